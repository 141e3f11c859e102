"""Applying a packed token bitmask to CPU logits in place (every decoding step, in the model worker).

vLLM's CPU path (``vllm.v1.structured_output.utils.apply_grammar_bitmask``) converts the whole logits
tensor to float32, calls xgrammar's CPU kernel and converts back: for 32 requests of a 49,152-token
vocabulary in bfloat16 that is ~1.2 ms of conversions plus a kernel whose cost grows with the number of
*disallowed* tokens (~3 ns each: ~5 ms for 32 rows that allow nothing). Here the disallowed logits are
overwritten with -inf in their own dtype, one 32-bit mask word at a time: an all-ones word is skipped,
an all-zero word is one slice store, any other word is blended through a per-byte lane table (no branch
per token). Same result, bit for bit, as vLLM's path (``tests/test_logits_mask.py``); the figures are in
docs/benchmarks.md ("Bitmask application on CPU").
"""

from __future__ import annotations

import threading

import numba
import numpy as np

__all__ = ["apply_token_bitmask_inplace", "supported", "warm_up"]

# dtype -> (integer view dtype, the bit pattern of -inf in that view)
_NEG_INF_BITS = {
    "torch.bfloat16": (np.int16, -128),  # 0xFF80
    "torch.float16": (np.int16, -1024),  # 0xFC00
    "torch.float32": (np.int32, -8388608),  # 0xFF800000
}


def _lane_table(dtype) -> np.ndarray:
    """``dtype[256, 8]``: all bits set in lane ``i`` of row ``b`` iff bit ``i`` of byte ``b`` is set."""
    bits = (np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1
    return np.where(bits == 1, -1, 0).astype(dtype)


_TABLES = {np.int16: _lane_table(np.int16), np.int32: _lane_table(np.int32)}


@numba.njit(cache=True, nogil=True)
def _apply(lg, bm, rows, neg, tab):
    """Set ``lg[r, v] = neg`` where bit ``v`` of ``bm[r]`` is 0, for each ``r`` in ``rows`` (``lg``: the
    logits' integer view ``[B, V]``; ``bm``: ``int32[B', W]``, token ``v`` is bit ``v & 31`` of word
    ``v >> 5``; tokens past ``32 W`` untouched)."""
    V = lg.shape[1]
    W = min(bm.shape[1], (V + 31) >> 5)
    for i in range(rows.shape[0]):
        r = rows[i]
        for w in range(W):
            word = bm[r, w]
            if word == -1:
                continue
            base = w << 5
            end = min(base + 32, V)
            if word == 0:
                lg[r, base:end] = neg
            elif end - base == 32:
                for q in range(4):
                    lanes = tab[(word >> (8 * q)) & 0xFF]
                    o = base + 8 * q
                    for t in range(8):
                        m = lanes[t]
                        lg[r, o + t] = (lg[r, o + t] & m) | (neg & ~m)
            else:
                for v in range(base, end):
                    if ((word >> (v - base)) & 1) == 0:
                        lg[r, v] = neg


def supported(logits) -> bool:
    """Whether :func:`apply_token_bitmask_inplace` takes ``logits`` (a 2-D, contiguous CPU tensor of
    dtype bfloat16, float16 or float32)."""
    return (getattr(logits, "is_cpu", False) and logits.dim() == 2 and logits.is_contiguous()
            and str(logits.dtype) in _NEG_INF_BITS)


def apply_token_bitmask_inplace(logits, bitmask, rows=None) -> None:
    """Set the logits of disallowed tokens to -inf, in place (xgrammar's ``apply_token_bitmask_inplace``
    contract on CPU, without a float32 round trip).

    Args:
        logits: ``torch.Tensor[B, V]`` on CPU, contiguous, bfloat16 / float16 / float32.
        bitmask: ``int32[B, W]`` (torch tensor or numpy array): token ``v`` of row ``r`` is allowed iff bit
            ``v & 31`` of ``bitmask[r, v >> 5]`` is set; tokens ``v >= 32 W`` are left as they are.
        rows: the rows to mask (ints; row ``r`` of the logits takes row ``r`` of the bitmask), or None for
            every row.

    Raises:
        ValueError: ``logits`` is not :func:`supported`, or ``bitmask`` is not a 2-D int32 array with a
            row per logits row.
    """
    if not supported(logits):
        raise ValueError(f"logits must be a contiguous 2-D CPU tensor of bfloat16/float16/float32, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} {tuple(getattr(logits, 'shape', ()))}")
    bm = bitmask.numpy() if hasattr(bitmask, "numpy") else np.asarray(bitmask)
    if bm.dtype != np.int32 or bm.ndim != 2 or bm.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask must be int32[{logits.shape[0]}, W], got {bm.dtype}{list(bm.shape)}")
    view_dtype, neg = _NEG_INF_BITS[str(logits.dtype)]
    import torch

    lg = logits.view(torch.int16 if view_dtype is np.int16 else torch.int32).numpy()
    idx = np.arange(bm.shape[0], dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= bm.shape[0]):
        raise ValueError(f"rows must lie in [0, {bm.shape[0]})")
    _apply(lg, np.ascontiguousarray(bm), idx, view_dtype(neg), _TABLES[view_dtype])


_WARM = False
_WARM_LOCK = threading.Lock()


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel for both integer views; idempotent."""
    global _WARM
    with _WARM_LOCK:
        if _WARM:
            return
        bm = np.zeros((1, 1), np.int32)
        rows = np.zeros(1, np.int64)
        for view_dtype, tab in _TABLES.items():
            _apply(np.zeros((1, 32), view_dtype), bm, rows, view_dtype(0), tab)
        _WARM = True
