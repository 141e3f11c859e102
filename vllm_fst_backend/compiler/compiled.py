"""The compiled constraint: a deterministic automaton over token ids with precomputed bitmask rows.

Two representations behind one interface (states are Python ints, start state 0):

* **explicit** (``mode == "explicit"``): every state is numbered ``0..S-1`` and all arrays are complete.
  Used for non-canonical constraints and for canonical products small enough to enumerate.
* **factored** (``mode == "factored"``, canonical constraints whose product with the canonical filter
  is too large to enumerate, e.g. free text ``[^\\n]{1,200}`` × ~10⁴ A_BPE classes): a state is the
  triple (token-DFA state ``s``, canonical class ``k``, lookahead set ``S``) packed into one int; its
  row is ``base_row[s] & ~banned[k] & la_row[S]`` minus the few tokens whose successor would be a
  dead end, computed on first use and memoized (see :mod:`.canonical_product`). The arrays below then
  describe the token DFA (the regex side); ``next_state``/``allowed_row``/``is_accepting``/
  ``forced`` are exact for product states.

Arrays (explicit mode; V = vocabulary size, W = ceil(V/32) int32 words, vLLM bit layout):

* ``allowed_rows``: ``int32[S, W]`` -- allowed tokens per state, EOS bits set exactly in accepting
  states. Stored deduplicated as ``rows[R, W]`` + ``row_index[S]``; ``allowed_rows`` materializes
  ``rows[row_index]`` on first access.
* transitions, CSR over *token groups* (tokens with identical behaviour from every state, computed per
  regex; when each group is one token this is exactly a token CSR): ``trans_ptr: int64[S+1]``,
  ``trans_group: int32[E]`` (sorted per state), ``trans_next: int32[E]``, ``token_group: int32[V]``
  (-1 = never allowed). ``next_state(s, t)`` = binary search of ``token_group[t]`` in
  ``trans_group[trans_ptr[s]:trans_ptr[s+1]]``. ``trans_token``/``trans_token_next`` (token-level
  CSR) are expanded on first access.
* ``accepting: bool[S]``; ``forced_token: int32[S]`` -- the only allowed token (EOS counts as a token)
  or -1.
"""

from __future__ import annotations

import threading
from functools import cached_property

import numpy as np

__all__ = ["CompiledAutomaton", "rows_for_groups"]


def rows_for_groups(state_groups: list, token_group: np.ndarray, V: int) -> np.ndarray:
    """Bit rows of token sets given as group lists (one :func:`.kernels.group_rows` call: a bit set per
    token of each row's groups).

    Args:
        state_groups: list of R int arrays of group ids (each id in ``0..max(token_group)``).
        token_group: ``int32[V]`` group of each token (-1 = none).
        V: vocabulary size.

    Returns:
        ``int32[R, W]`` rows (vLLM layout, W = ceil(V/32)).
    """
    from . import kernels

    R = len(state_groups)
    W = (V + 31) // 32
    out = np.zeros((R, W), dtype=np.uint32)
    if R == 0:
        return out.view(np.int32)
    G = int(token_group.max()) + 1 if len(token_group) else 0
    g_toks, g_ptr = kernels.group_tokens(np.ascontiguousarray(token_group, dtype=np.int32), G)
    row_ptr = np.zeros(R + 1, dtype=np.int64)
    row_ptr[1:] = np.cumsum([len(gs) for gs in state_groups])
    groups = np.concatenate([np.asarray(gs, dtype=np.int64) for gs in state_groups])
    kernels.group_rows(row_ptr, groups, g_toks, g_ptr, out)
    return out.view(np.int32)


class CompiledAutomaton:
    """A compiled regex constraint (module docstring). Immutable after construction except for the
    factored mode's row memo (thread-safe).

    Attributes:
        mode: ``"explicit"`` or ``"factored"``.
        vocab_size: V; ``num_words``: W.
        eos_ids: ``int32[k]`` end-of-sequence token ids (allowed exactly in accepting states).
        num_states: S (explicit mode; the token DFA's states in factored mode).
        rows: ``int32[R, W]`` unique rows; ``row_index``: ``int32[S]`` (factored mode: no rows, and the
            signature of each token-DFA state; rows come from ``factored``).
        trans_ptr, trans_group, trans_next, token_group: group CSR (module docstring).
        accepting: ``bool[S]``; forced_token: ``int32[S]``.
        stats: dict of build figures (states, groups, seconds per stage).
    """

    def __init__(
        self, *, vocab_size: int, eos_ids, rows: np.ndarray, row_index: np.ndarray, trans_ptr: np.ndarray,
        trans_group: np.ndarray, trans_next: np.ndarray, token_group: np.ndarray, accepting: np.ndarray,
        forced_token: np.ndarray, factored=None, stats: dict | None = None,
    ):
        self.vocab_size = int(vocab_size)
        self.num_words = (self.vocab_size + 31) // 32
        self.eos_ids = np.asarray(eos_ids, dtype=np.int32)
        self.rows = np.ascontiguousarray(rows, dtype=np.int32)
        self.row_index = np.asarray(row_index, dtype=np.int32)
        self.trans_ptr = np.asarray(trans_ptr, dtype=np.int64)
        self.trans_group = np.asarray(trans_group, dtype=np.int32)
        self.trans_next = np.asarray(trans_next, dtype=np.int32)
        self.token_group = np.asarray(token_group, dtype=np.int32)
        self.accepting = np.asarray(accepting, dtype=bool)
        self.forced_token = np.asarray(forced_token, dtype=np.int32)
        self.factored = factored
        self.mode = "factored" if factored is not None else "explicit"
        self.stats = dict(stats or {})
        self._eos_set = frozenset(int(e) for e in self.eos_ids)
        self._lock = threading.Lock()
        self._tg_list = None

    # --- sizes ------------------------------------------------------------------------------------------

    @property
    def num_states(self) -> int:
        """Number of explicit states S (factored mode: states of the token DFA)."""
        return int(self.row_index.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (and the factored mode's precomputed rows), for the cache budget."""
        n = sum(
            a.nbytes for a in (self.rows, self.row_index, self.trans_ptr, self.trans_group, self.trans_next,
                               self.token_group, self.accepting, self.forced_token, self.eos_ids)
        )
        if self.factored is not None:
            n += self.factored.nbytes
        return int(n)

    @cached_property
    def allowed_rows(self) -> np.ndarray:
        """``int32[S, W]``: allowed-token rows of the explicit states (materialized on first access)."""
        return self.rows[self.row_index]

    @cached_property
    def rows_torch(self):
        """A ``torch.int32`` view of :attr:`rows` (shares memory) for :meth:`FstMatcher.fill_bitmask`."""
        import torch

        return torch.from_numpy(self.rows)

    @cached_property
    def _token_csr(self):
        ptr_g = np.zeros(int(self.token_group.max()) + 2 if len(self.token_group) else 1, dtype=np.int64)
        tg = self.token_group
        toks = np.flatnonzero(tg >= 0).astype(np.int32)
        order = np.argsort(tg[toks], kind="stable")
        toks = toks[order]
        G = len(ptr_g) - 1
        np.cumsum(np.bincount(tg[toks], minlength=G), out=ptr_g[1:])
        sizes = ptr_g[1:] - ptr_g[:-1]
        per_state_tok, per_state_next, ptr = [], [], np.zeros(self.num_states + 1, dtype=np.int64)
        for s in range(self.num_states):
            a, b = self.trans_ptr[s], self.trans_ptr[s + 1]
            gs = self.trans_group[a:b]
            nx = self.trans_next[a:b]
            t = np.concatenate([toks[ptr_g[g] : ptr_g[g + 1]] for g in gs.tolist()]) if len(gs) else np.zeros(0, np.int32)
            n = np.repeat(nx, sizes[gs]) if len(gs) else np.zeros(0, np.int32)
            o = np.argsort(t, kind="stable")
            per_state_tok.append(t[o])
            per_state_next.append(n[o])
            ptr[s + 1] = ptr[s] + len(t)
        return (
            ptr,
            np.concatenate(per_state_tok).astype(np.int32) if per_state_tok else np.zeros(0, np.int32),
            np.concatenate(per_state_next).astype(np.int32) if per_state_next else np.zeros(0, np.int32),
        )

    @property
    def trans_token_ptr(self) -> np.ndarray:
        """``int64[S+1]``: token-level CSR pointers (expanded on first access; can be large)."""
        return self._token_csr[0]

    @property
    def trans_token(self) -> np.ndarray:
        """``int32[E_tok]``: token-level CSR labels, sorted per state (expanded on first access)."""
        return self._token_csr[1]

    @property
    def trans_token_next(self) -> np.ndarray:
        """``int32[E_tok]``: token-level CSR targets (expanded on first access)."""
        return self._token_csr[2]

    # --- the automaton ----------------------------------------------------------------------------------

    def _explicit_next(self, s: int, token: int) -> int:
        if not 0 <= token < self.vocab_size:
            return -1
        g = int(self.token_group[token])
        if g < 0:
            return -1
        a, b = int(self.trans_ptr[s]), int(self.trans_ptr[s + 1])
        if a == b:
            return -1
        tg = self.trans_group
        i = a + int(np.searchsorted(tg[a:b], g))
        if i < b and int(tg[i]) == g:
            return int(self.trans_next[i])
        return -1

    def next_state(self, state: int, token: int) -> int:
        """State after ``token`` (a token id, not EOS) from ``state``; -1 if not allowed.
        O(log E_state) in explicit mode (binary search)."""
        if self.factored is not None:
            return self.factored.next_state(state, token)
        return self._explicit_next(state, token)

    def is_accepting(self, state: int) -> bool:
        """Whether ``state`` is accepting (EOS allowed)."""
        if self.factored is not None:
            return self.factored.is_accepting(state)
        return bool(self.accepting[state])

    def is_eos(self, token: int) -> bool:
        """Whether ``token`` is an EOS id."""
        return token in self._eos_set

    def allowed_row(self, state: int) -> np.ndarray:
        """``int32[W]``: the allowed tokens of ``state`` (EOS bits included when accepting)."""
        if self.factored is not None:
            return self.factored.row(state)
        return self.rows[self.row_index[state]]

    def forced(self, state: int) -> int:
        """The only allowed token of ``state`` (EOS counts), or -1."""
        if self.factored is not None:
            return self.factored.forced(state)
        return int(self.forced_token[state])

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Sorted token ids allowed in ``state`` (EOS included when accepting). For tests/debugging."""
        from .canonical_product import ids_of_row

        ids = ids_of_row(np.asarray(self.allowed_row(state)))
        return ids[ids < self.vocab_size]

    def __repr__(self) -> str:
        return (
            f"CompiledAutomaton(mode={self.mode!r}, states={self.num_states}, rows={self.rows.shape[0]}, "
            f"groups={int(self.token_group.max()) + 1 if len(self.token_group) else 0}, nbytes={self.nbytes})"
        )
