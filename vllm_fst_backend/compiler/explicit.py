"""Token DFA → explicit :class:`CompiledAutomaton` (non-canonical mode): rows, forced tokens."""

from __future__ import annotations

import numpy as np

from .compiled import CompiledAutomaton, rows_for_groups
from .token_dfa import TokenDFA

__all__ = ["explicit_from_token_dfa", "set_eos_bits"]


def set_eos_bits(rows: np.ndarray, which: np.ndarray, eos_ids) -> None:
    """Set the EOS bits in ``rows[which]`` (in place)."""
    for e in np.asarray(eos_ids, dtype=np.int64).tolist():
        rows[which, e >> 5] |= np.int32(np.uint32(1 << (e & 31)).view(np.int32))


def explicit_from_token_dfa(tdfa: TokenDFA, eos_ids, vocab_size: int, stats: dict | None = None) -> CompiledAutomaton:
    """Rows (deduplicated by (group set, accepting)), forced tokens and the group CSR of ``tdfa``.

    Returns:
        An explicit-mode :class:`CompiledAutomaton` with the same states as ``tdfa``.
    """
    S = tdfa.num_states
    ptr, grp, nxt = tdfa.edge_ptr, tdfa.edge_group, tdfa.edge_next
    keys: dict = {}
    row_index = np.empty(S, dtype=np.int32)
    uniq_groups = []
    uniq_acc = []
    for s in range(S):
        gs = grp[ptr[s] : ptr[s + 1]]
        key = (gs.tobytes(), bool(tdfa.accepting[s]))
        r = keys.get(key)
        if r is None:
            r = keys[key] = len(uniq_groups)
            uniq_groups.append(gs)
            uniq_acc.append(key[1])
        row_index[s] = r
    rows = rows_for_groups(uniq_groups, tdfa.token_group, vocab_size)
    acc_rows = np.flatnonzero(np.asarray(uniq_acc, dtype=bool))
    if len(acc_rows):
        set_eos_bits(rows, acc_rows, eos_ids)
    # forced tokens: exactly one allowed token (EOS counts)
    tg = tdfa.token_group
    G = tdfa.num_groups
    gsize = np.bincount(tg[tg >= 0], minlength=G)
    n_eos = len(np.asarray(eos_ids))
    counts = tdfa.tokens_per_state(gsize) + np.where(tdfa.accepting, n_eos, 0)
    forced = np.full(S, -1, dtype=np.int32)
    one = np.flatnonzero(counts == 1)
    if len(one):
        first_tok = np.full(G, -1, dtype=np.int64)
        toks = np.flatnonzero(tg >= 0)
        first_tok[tg[toks][::-1]] = toks[::-1]
        eos0 = int(np.asarray(eos_ids)[0]) if n_eos else -1
        for s in one.tolist():
            if ptr[s + 1] > ptr[s]:
                forced[s] = first_tok[grp[ptr[s]]]
            else:
                forced[s] = eos0
    st = dict(stats or {})
    st.update(states=S, unique_rows=len(uniq_groups), groups=G, group_edges=int(len(grp)))
    return CompiledAutomaton(
        vocab_size=vocab_size, eos_ids=eos_ids, rows=rows, row_index=row_index, trans_ptr=ptr,
        trans_group=grp, trans_next=nxt, token_group=tg, accepting=tdfa.accepting, forced_token=forced,
        stats=st,
    )
