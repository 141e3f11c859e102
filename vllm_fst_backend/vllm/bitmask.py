"""Single bits of vLLM's token bitmask (``torch.int32``, shape ``(B, W')``, token ``t`` at bit ``t % 32``
of word ``t // 32``, the layout of xgrammar's ``allocate_token_bitmask``)."""

from __future__ import annotations

from typing import Any

__all__ = ["set_bit", "has_bit"]


def set_bit(bitmask: Any, row: int, token: int) -> None:
    """Allow ``token`` in row ``row`` (no-op for a token past the row's words)."""
    w, b = divmod(int(token), 32)
    if w >= bitmask.shape[1]:
        return
    v = (int(bitmask[row, w]) & 0xFFFFFFFF) | (1 << b)
    bitmask[row, w] = v - (1 << 32) if v >= (1 << 31) else v


def has_bit(bitmask: Any, row: int, token: int) -> bool:
    """Whether ``token`` is allowed in row ``row`` (False past the row's words)."""
    w, b = divmod(int(token), 32)
    if w >= bitmask.shape[1]:
        return False
    return bool((int(bitmask[row, w]) >> b) & 1)
