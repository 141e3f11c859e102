"""Per-request matcher: vLLM 0.32's ``StructuredOutputGrammar`` contract over a compiled automaton.

No vLLM import here (the plugin wraps this class). Semantics follow vLLM's xgrammar/outlines backends:

* ``accept_tokens(request_id, tokens) -> bool``: advances over ``tokens``; an EOS token in an accepting
  state terminates (tokens after it are ignored). An invalid token (or EOS in a non-accepting state)
  returns False and leaves the state unchanged (the whole call is atomic). After termination every call
  returns True and changes nothing (as vLLM's backends: tokens after termination are ignored).
* ``validate_tokens(tokens) -> list[int]``: the longest valid prefix (EOS included when accepted), no
  state change.
* ``rollback(n)``: undoes the last ``n`` accepted tokens (EOS included), restoring termination.
* ``fill_bitmask(bitmask, idx)``: copies the current state's precomputed row into ``bitmask[idx]``
  (``torch.int32``, shape ``(B, W')``, ``W' >= W``; words ``W..W'-1`` are zeroed). One row copy, no
  loop over the vocabulary. A terminated matcher fills EOS only (vLLM does not apply the mask then).
* ``forced_tokens(max_n) -> list[int]``: the chain of forced tokens from the current state (paper 000
  §3.3.1, coalescence), O(length), without changing the state; stops after an EOS.
* ``num_processed_tokens``: accepted tokens (EOS included) since the last reset.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FstMatcher"]

# (tensor, numpy view or None) of the last bitmask a matcher of this process filled (fill_bitmask)
_LAST_VIEW: list = [None]


class FstMatcher:
    """Matcher over a :class:`~vllm_fst_backend.compiler.CompiledAutomaton` (module docstring).

    Args:
        compiled: the compiled automaton (shared, read-only; many matchers may use one).
        eos_ids: EOS token ids (default: ``compiled.eos_ids``).

    Not thread-safe (one matcher per request, as in vLLM).
    """

    __slots__ = ("compiled", "eos_ids", "_eos", "_state", "_terminated", "_history", "num_processed_tokens",
                 "_row", "_row_t", "_W", "_eos_row", "_eos_row_t", "_np_cache", "_fc")

    def __init__(self, compiled, eos_ids=None):
        self.compiled = compiled
        eos = compiled.eos_ids if eos_ids is None else eos_ids
        self.eos_ids = tuple(int(e) for e in np.asarray(eos).reshape(-1))
        self._eos = frozenset(self.eos_ids)
        self._W = compiled.num_words
        eos_row = np.zeros(self._W, dtype=np.int32)
        for e in self.eos_ids:
            eos_row[e >> 5] |= np.int32(np.uint32(1 << (e & 31)).view(np.int32))
        import torch

        self._eos_row = eos_row
        self._eos_row_t = torch.from_numpy(eos_row)
        self._np_cache = None
        # factored canonical automata: one compiled step per token (successor + its row), accept_tokens
        self._fc = getattr(compiled, "factored", None)
        self.reset()

    # --- state --------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Back to the start state; clears history, termination and the token counter."""
        self._state = 0
        self._terminated = False
        self._history: list = []
        self.num_processed_tokens = 0
        self._set_row()

    def _set_row(self) -> None:
        row = self.compiled.allowed_row(self._state)
        self._row = row
        self._row_t = None  # torch view made on demand (non-CPU bitmasks only)

    @property
    def state(self) -> int:
        """The current automaton state (an int; see CompiledAutomaton)."""
        return self._state

    def is_terminated(self) -> bool:
        """True once an EOS token was accepted in an accepting state."""
        return self._terminated

    def _step(self, state: int, token: int) -> int:
        """Next state, -2 for an accepted EOS, -1 if invalid."""
        if token in self._eos:
            return -2 if self.compiled.is_accepting(state) else -1
        return self.compiled.next_state(state, token)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over ``tokens`` (atomic); True iff all were accepted (module docstring).

        Factored canonical automata (:class:`~vllm_fst_backend.compiler.canonical_product.FactoredCanonical`)
        take :meth:`_accept_factored`: one compiled call per token checks it against the current row
        (already computed for ``fill_bitmask``), computes the successor and its row
        (``FactoredCanonical.advance``; memoized per automaton)."""
        if self._terminated:
            return True
        if self._fc is not None:
            return self._accept_factored(self._fc, tokens)
        state = self._state
        new_states = []
        terminated = False
        for t in tokens:
            nxt = self._step(state, int(t))
            if nxt == -1:
                return False
            if nxt == -2:
                terminated = True
                new_states.append(state)
                break
            new_states.append(nxt)
            state = nxt
        self._commit(new_states, state, terminated)
        return True

    def _accept_factored(self, fc, tokens) -> bool:
        """:meth:`accept_tokens` on a factored automaton (same semantics and results as the generic path:
        ``tests/test_matcher.py``)."""
        state = self._state
        row = self._row
        eos = self._eos
        new_states = []
        terminated = False
        for t in tokens:
            t = int(t)
            if t in eos:
                if not fc.is_accepting(state):
                    return False
                terminated = True
                new_states.append(state)
                break
            nxt, row = fc.advance(state, row, t)
            if nxt < 0:
                return False
            new_states.append(nxt)
            state = nxt
        self._commit(new_states, state, terminated, row)
        return True

    def _commit(self, new_states: list, state: int, terminated: bool, row=None) -> None:
        """Record an accepted run of tokens: history (one entry per token), the new state and its row
        (``row``: already computed by the factored path; else :meth:`_set_row`)."""
        if not new_states:
            return
        hist = self._history
        prev = self._state
        for s in new_states:
            hist.append(prev)
            prev = s
        self.num_processed_tokens += len(new_states)
        if state != self._state:
            self._state = state
            if row is None:
                self._set_row()
            else:
                self._row = row
                self._row_t = None
        self._terminated = terminated

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """Longest prefix of ``tokens`` that would be accepted (EOS included if accepted); no state change."""
        if self._terminated:
            return []
        state = self._state
        out = []
        for t in tokens:
            nxt = self._step(state, int(t))
            if nxt == -1:
                break
            out.append(int(t))
            if nxt == -2:
                break
            state = nxt
        return out

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (EOS included).

        Raises:
            ValueError: more tokens than were accepted since the last reset.
        """
        if num_tokens <= 0:
            return
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {len(self._history)} accepted")
        state = self._history[-num_tokens]
        del self._history[-num_tokens:]
        self.num_processed_tokens -= num_tokens
        self._terminated = False
        if state != self._state:
            self._state = state
            self._set_row()

    # --- masks --------------------------------------------------------------------------------------------

    def fill_bitmask(self, bitmask, idx: int) -> None:
        """Copy the allowed-token row of the current state into ``bitmask[idx]``.

        Args:
            bitmask: ``torch.int32`` tensor of shape ``(B, W')`` with ``W' >= W`` (vLLM's layout).
            idx: the batch row to fill.
        """
        W = self._W
        cache = self._np_cache
        if cache is None or cache[0] is not bitmask:
            cache = _LAST_VIEW[0]  # vLLM fills one bitmask tensor for every request: a new matcher reuses
            if cache is None or cache[0] is not bitmask:  # the view the last one made
                try:  # a CPU tensor (vLLM's bitmask): write through a cached numpy view (~1 µs)
                    arr = bitmask.numpy()
                except (RuntimeError, TypeError):
                    arr = None
                cache = _LAST_VIEW[0] = (bitmask, arr)
            self._np_cache = cache
        arr = cache[1]
        if arr is not None:
            arr[idx, :W] = self._eos_row if self._terminated else self._row
            if arr.shape[1] > W:
                arr[idx, W:] = 0
            return
        import torch

        if self._row_t is None:
            self._row_t = torch.from_numpy(np.array(self._row, dtype=np.int32))
        src = self._eos_row_t if self._terminated else self._row_t
        dst = bitmask[idx]
        if dst.shape[0] == W:
            dst.copy_(src)
        else:
            dst[:W].copy_(src)
            dst[W:].zero_()

    def allowed_token_ids(self) -> np.ndarray:
        """Sorted token ids allowed now (EOS included when accepting). For tests/debugging."""
        return self.compiled.allowed_tokens(self._state)

    def forced_tokens(self, max_n: int) -> list[int]:
        """The chain of forced tokens from the current state (at most ``max_n``; stops after EOS).
        Does not change the state. O(length). On a factored automaton each forced token is read from
        the current row and the next row comes from the compiled step (``FactoredCanonical.advance``,
        memoized)."""
        out: list[int] = []
        if self._terminated:
            return out
        c, fc = self.compiled, self._fc
        s, row = self._state, self._row
        while len(out) < max_n:
            t = fc.forced_in_row(row) if fc is not None else c.forced(s)
            if t < 0:
                break
            out.append(t)
            if t in self._eos or len(out) == max_n:
                break
            if fc is not None:
                s, row = fc.advance(s, row, t)
            else:
                s = c.next_state(s, t)
            if s < 0:  # cannot happen for a well-formed automaton
                break
        return out
