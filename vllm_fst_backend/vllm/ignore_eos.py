"""Requests with ``ignore_eos``: the constraint's mask stays on after its end.

vLLM's ``StructuredOutputManager._fill_bitmasks`` fills a full row (no constraint) for a grammar whose
``is_terminated()`` is true, and a request with ``ignore_eos`` goes on after EOS: its text went on
unconstrained after the constraint's end, with every backend (docs/vllm-integration.md, touch point 4).
:class:`EosAfterEndGrammar` wraps the grammar of such a request (fst's or the fallback backend's).
"""

from __future__ import annotations

from typing import Any, Iterable

from .bitmask import set_bit

__all__ = ["EosAfterEndGrammar"]


class EosAfterEndGrammar:
    """A ``StructuredOutputGrammar`` that, once its inner grammar has accepted EOS, allows the stop tokens
    only instead of terminating: ``is_terminated()`` is always False, so vLLM keeps applying the mask; the
    output is the constraint's match followed by stop tokens up to ``max_tokens``.

    Args:
        inner: the request's grammar (vLLM's contract: ``accept_tokens``, ``validate_tokens``,
            ``rollback``, ``fill_bitmask``, ``is_terminated``, ``reset``); after it terminates its
            tokens are not given to it (they are counted here, so ``rollback`` crosses the end).
        stop_ids: token ids allowed after the end: the tokenizer's EOS ids and the request's stop tokens
            (``sampling_params.all_stop_token_ids``, which leaves EOS out under ``ignore_eos``).

    Other attributes are the inner grammar's.
    """

    def __init__(self, inner: Any, stop_ids: Iterable[int]):
        self._inner = inner
        self._stops = frozenset(int(t) for t in stop_ids)
        self._after = 0  # tokens accepted after the inner grammar's end (all stop tokens)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Like the inner grammar's, one token at a time up to its end; past it stop tokens only (False on
        any other token; the tokens before it stay accepted)."""
        for i, t in enumerate(tokens):
            if self._inner.is_terminated():
                rest = tokens[i:]
                if not self._stops.issuperset(int(x) for x in rest):
                    return False
                self._after += len(rest)
                return True
            if not self._inner.accept_tokens(request_id, [t]):
                return False
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest valid prefix of ``tokens``: the inner grammar's, then (once it ends: it accepted a
        stop token, which ends every backend's grammar) stop tokens."""
        ended = self._inner.is_terminated()
        n = 0 if ended else len(self._inner.validate_tokens(tokens))
        if ended or (n and int(tokens[n - 1]) in self._stops):
            while n < len(tokens) and int(tokens[n]) in self._stops:
                n += 1
        return list(tokens[:n])

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens: the stop tokens past the end first."""
        after = min(max(num_tokens, 0), self._after)
        self._after -= after
        if num_tokens - after > 0:
            self._inner.rollback(num_tokens - after)

    def fill_bitmask(self, bitmask: Any, idx: int) -> None:
        """The inner grammar's row; past its end the stop tokens' bits only (``bitmask``: ``torch.int32``
        ``(B, W')``)."""
        if not self._inner.is_terminated():
            self._inner.fill_bitmask(bitmask, idx)
            return
        bitmask[idx].zero_()
        for t in self._stops:
            set_bit(bitmask, idx, t)

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        self._inner.reset()
        self._after = 0

    def __getattr__(self, name: str) -> Any:  # num_forced, matcher, ...
        return getattr(self._inner, name)
