"""Bitmask rows in vLLM's layout, built with numpy only (no Python loop over the vocabulary).

A *row* for a vocabulary of ``V`` tokens is an ``int32`` array of ``W = ceil(V / 32)`` words; token ``i``
is bit ``i % 32`` of word ``i // 32`` (bit 31 is the sign bit). This is the layout of vLLM's
structured-output bitmask (``torch.int32`` of shape ``(batch, W')``, ``W' >= W``), so a row is copied
into the first ``W`` words of a bitmask row as is. Bits ``V .. 32*W-1`` are always 0.

Rows are built with ``np.packbits(..., bitorder="little")`` viewed as little-endian ``<i4``, which gives
exactly this layout on any host.
"""

from __future__ import annotations

import numpy as np

__all__ = ["n_words", "row_from_ids", "row_from_bool", "rows_from_bool", "ids_from_row", "row_test"]


def n_words(V: int) -> int:
    """Number of ``int32`` words ``W = ceil(V / 32)`` of a row for a vocabulary of ``V`` tokens."""
    if V < 0:
        raise ValueError(f"vocabulary size must be >= 0, got {V}")
    return (int(V) + 31) // 32


def _pack(mat: np.ndarray) -> np.ndarray:
    """``bool[..., V]`` → ``int32[..., W]`` (little bit order, ``<i4`` words)."""
    V = mat.shape[-1]
    W = n_words(V)
    pad = W * 32 - V
    if pad:
        mat = np.concatenate([mat, np.zeros(mat.shape[:-1] + (pad,), dtype=bool)], axis=-1)
    packed = np.packbits(mat, axis=-1, bitorder="little")  # uint8[..., 4W]
    return np.ascontiguousarray(packed).view("<i4").astype(np.int32, copy=False)


def row_from_bool(mask: np.ndarray) -> np.ndarray:
    """Pack ``mask: bool[V]`` (token ``i`` allowed ⇔ ``mask[i]``) into a row ``int32[W]``."""
    mask = np.asarray(mask, dtype=bool)
    if mask.ndim != 1:
        raise ValueError(f"row_from_bool expects a 1-D mask, got shape {mask.shape}")
    return _pack(mask)


def rows_from_bool(mat: np.ndarray) -> np.ndarray:
    """Pack ``mat: bool[n, V]`` into rows ``int32[n, W]`` (one row per line of ``mat``)."""
    mat = np.asarray(mat, dtype=bool)
    if mat.ndim != 2:
        raise ValueError(f"rows_from_bool expects a 2-D matrix, got shape {mat.shape}")
    return _pack(mat)


def row_from_ids(ids, V: int) -> np.ndarray:
    """Row ``int32[W]`` with exactly the bits of the token ids ``ids`` (any int iterable/array) set.

    Raises:
        IndexError: an id is outside ``0 .. V-1``.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= V):
        raise IndexError(f"token id out of range 0..{V - 1}: {ids[(ids < 0) | (ids >= V)][:5].tolist()}")
    mask = np.zeros(V, dtype=bool)
    mask[ids] = True
    return _pack(mask)


def bool_from_row(row: np.ndarray, V: int) -> np.ndarray:
    """Unpack a row ``int32[W']`` (``W' >= W``) into ``bool[V]``."""
    row = np.ascontiguousarray(np.asarray(row, dtype=np.int32)[: n_words(V)]).astype("<i4", copy=False)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:V].astype(bool)


def ids_from_row(row: np.ndarray, V: int) -> np.ndarray:
    """Sorted token ids ``int64[k]`` whose bits are set in ``row: int32[W']`` (bits ``>= V`` ignored)."""
    return np.flatnonzero(bool_from_row(row, V)).astype(np.int64)


def row_test(row: np.ndarray, i: int) -> bool:
    """Whether token ``i``'s bit is set in ``row: int32[W]``."""
    return bool((int(row[i >> 5]) >> (i & 31)) & 1)
