"""Byte DFA ∘ detokenizer → token DFA, by a vectorized walk of the token trie (fast path).

Paper 001 Alg. 2 composes the regex automaton with the detokenizing FST and projects onto tokens;
004 Eq. 3 is the same construction. Since each token spells exactly one byte string and the byte
automaton is deterministic, the result is already deterministic: from a *boundary* byte state ``q``,
token ``v`` leads to ``δ*(q, bytes(v))`` (if defined). We compute all of these at once:

1. **Byte classes.** Bytes whose columns of the transition table are equal are interchangeable; bytes
   rejected everywhere are dead.
2. **Class trie.** Mapping every trie node's byte to its class merges trie nodes whose spellings have
   the same class string; tokens with the same class string behave identically from *every* state and
   form one *group* (the terminal-mask idea of 001 §2.5.1, computed instead of hand-written: for
   ``[^\\n]{1,200}`` all newline-free ASCII tokens of length 5 are one group). Dead bytes prune whole
   subtrees. Cost O(trie nodes), vectorized per level.
3. **Walk.** Over the class trie from every boundary state; every class node carrying a group emits an
   edge ``(source, group, state)``. Boundary states are discovered in rounds (token boundaries may fall
   inside a character for byte-level BPE). Reference path (numpy): level by level with a frontier of
   ``(source state, class node, byte state)`` triples, all edges kept.
4. **Group merge.** Groups with the same (source, next state) pairs from every state merge (inside a
   JSON string, all words of one length). The numba path (:class:`_FusedWalk`) never holds the
   unmerged edges (~10⁴-10⁵ per string position): pass 1 walks depth first and keeps, per group, two
   hash sums of its pairs; pass 2 walks the class trie pruned to one node per merged group.
   **Counter chains**: from a state inside a bounded string or free text, every token spelled in the
   chain's byte classes X leads to the state its length away, so pass 1 adds those pairs per token
   length and walks only the part of the class trie where a token leaves X (the result is the same
   automaton).

Byte-fallback tokens under the ``"canonical"`` byte policy are added separately: from a boundary state
they must spell one whole character of :func:`.token_trie.canonical_byte_ranges` (extra *inner*
states while inside that character).

The result (:class:`TokenDFA`) labels edges with groups; ``token_group`` maps tokens to groups.
:func:`token_dfa_to_fst` expands it to a pynini acceptor over token labels for the equivalence tests
against the pynini path (:func:`reference_token_fst`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import CompileBudgetError, EmptyLanguageError
from .regex_to_bytes import ByteDFA, _gadget
from .token_trie import TokenTrie, canonical_byte_ranges, policy_token_mask

__all__ = ["TokenDFA", "build_token_dfa", "token_dfa_to_fst", "reference_token_fst"]


@dataclass
class TokenDFA:
    """Deterministic token automaton with group-labelled edges (start state 0, trimmed: every state is
    reachable and can reach an accepting state).

    Attributes:
        num_states: S.
        accepting: ``bool[S]``.
        edge_ptr: ``int64[S+1]``; edges of state s are ``edge_ptr[s]:edge_ptr[s+1]``.
        edge_group: ``int32[E]`` sorted within each state.
        edge_next: ``int32[E]``.
        token_group: ``int32[V]`` -- group of each token, -1 for tokens never allowed.
        num_groups: G.
        byte_state: ``int32[S]`` -- the byte-DFA state of each token state (debugging).
    """

    num_states: int
    accepting: np.ndarray
    edge_ptr: np.ndarray
    edge_group: np.ndarray
    edge_next: np.ndarray
    token_group: np.ndarray
    num_groups: int
    byte_state: np.ndarray

    def tokens_per_state(self, group_size: np.ndarray) -> np.ndarray:
        """``int64[S]``: the tokens each state allows (the sizes ``group_size`` (``int[G]``) of its edge
        groups summed; EOS not counted)."""
        cs = np.concatenate([[0], np.cumsum(group_size[self.edge_group], dtype=np.int64)])
        return cs[self.edge_ptr[1:]] - cs[self.edge_ptr[:-1]]

    def group_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """CSR of tokens per group: ``(ptr int64[G+1], tokens int32[n])``, tokens sorted."""
        tg = self.token_group
        toks = np.flatnonzero(tg >= 0).astype(np.int32)
        order = np.argsort(tg[toks], kind="stable")
        toks = toks[order]
        ptr = np.zeros(self.num_groups + 1, dtype=np.int64)
        np.cumsum(np.bincount(tg[toks], minlength=self.num_groups), out=ptr[1:])
        return ptr, toks

    def next_state(self, s: int, token: int) -> int:
        """Next state after ``token`` from ``s`` (-1 if not allowed)."""
        g = int(self.token_group[token])
        if g < 0:
            return -1
        a, b = int(self.edge_ptr[s]), int(self.edge_ptr[s + 1])
        i = a + int(np.searchsorted(self.edge_group[a:b], g))
        if i < b and self.edge_group[i] == g:
            return int(self.edge_next[i])
        return -1


def _unique_bool_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(x, axis=0, return_inverse=True)`` for a 2-D ``bool`` array (same rows, same order,
    ``inverse`` as ``int64[n]``), through the rows packed into bytes: numpy's ``axis=0`` path took ~10 ms
    for a few thousand rows of a JSON schema's walk, this one a fraction of a ms. Packed big-endian,
    byte order equals the rows' lexicographic order (False < True)."""
    if not x.size:
        keys, inv = np.unique(x, axis=0, return_inverse=True)
        return keys, inv.reshape(-1).astype(np.int64)
    packed = np.ascontiguousarray(np.packbits(x, axis=1))
    rows = packed.view(np.dtype((np.void, packed.shape[1]))).reshape(-1)
    _, first, inv = np.unique(rows, return_index=True, return_inverse=True)
    return x[first], inv.reshape(-1).astype(np.int64)


def _byte_classes(table: np.ndarray, fast: bool = True) -> tuple[np.ndarray, int, np.ndarray]:
    """Partition bytes by equal columns of ``table`` (``int32[n, 256]``). Returns (bcls int32[256] with
    -1 = dead byte, K, rep_byte int32[K] = smallest byte of each class), classes numbered in order of
    their smallest byte. ``fast``: two kernel passes (:func:`.kernels.byte_classes`, ~0.25 ms for 2,766
    states); else numpy: columns hashed (two random projections), verified exactly; O(n * 256)."""
    if fast:
        from . import kernels

        bcls, K, rep = kernels.byte_classes(np.ascontiguousarray(table, dtype=np.int32))
        return bcls, int(K), rep
    n = table.shape[0]
    rng = np.random.default_rng(12345)
    t64 = table.astype(np.int64)
    r = rng.integers(1, 2**61, size=(2, n), dtype=np.int64)
    # (einsum, not matmul: integer matmul and BLAS are slow or thread-contended here)
    with np.errstate(over="ignore"):
        h = np.stack([np.einsum("i,ij->j", r[0], t64), np.einsum("i,ij->j", r[1], t64)], axis=1)
    dead = (table < 0).all(axis=0)
    _, first, inv = np.unique(h, axis=0, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    if not np.array_equal(table, table[:, first[inv]]):  # a hash collision: exact fallback
        _, first, inv = np.unique(np.ascontiguousarray(table.T), axis=0, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
    live_b = np.flatnonzero(~dead)
    live_classes = inv[live_b][np.sort(np.unique(inv[live_b], return_index=True)[1])]  # by smallest byte
    remap = np.full(len(first), -1, dtype=np.int32)
    remap[live_classes] = np.arange(len(live_classes), dtype=np.int32)
    bcls = remap[inv].astype(np.int32)
    bcls[dead] = -1
    K = len(live_classes)
    rep = np.zeros(K, dtype=np.int32)
    live_b = np.flatnonzero(bcls >= 0)
    rep[bcls[live_b[::-1]]] = live_b[::-1]  # last write wins: the smallest byte
    return bcls, K, rep


@dataclass
class _ClassTrie:
    parent: np.ndarray  # int32[M]
    label: np.ndarray  # int32[M] byte class of the arc into the node
    child_ptr: np.ndarray  # int64[M+1]
    node_cid: np.ndarray  # int32[N] trie node -> class node (-1 dead)


def _class_trie_numpy(trie: TokenTrie, bcls: np.ndarray, K: int, deadline: float) -> _ClassTrie:
    """Reference path of :func:`.kernels.class_trie` (numpy, level by level)."""
    N = trie.num_nodes
    cid = np.full(N, -1, dtype=np.int32)
    cid[0] = 0
    parents = [np.array([-1], dtype=np.int64)]
    labels = [np.array([-1], dtype=np.int64)]
    next_id = 1
    lp = trie.level_ptr
    nb = bcls[trie.node_byte.astype(np.int64)]
    for d in range(1, len(lp) - 1):
        a, b = int(lp[d]), int(lp[d + 1])
        pc = cid[trie.node_parent[a:b]]
        lab = nb[a:b]
        ok = (pc >= 0) & (lab >= 0)
        if not ok.any():
            break
        key = pc[ok].astype(np.int64) * K + lab[ok]
        uk, inv = np.unique(key, return_inverse=True)
        sub = cid[a:b]
        sub[ok] = next_id + inv.reshape(-1)
        parents.append(uk // K)
        labels.append(uk % K)
        next_id += len(uk)
        if time.perf_counter() > deadline:
            raise CompileBudgetError("regex compilation exceeded the time budget", None)
    parent = np.concatenate(parents).astype(np.int32)
    label = np.concatenate(labels).astype(np.int32)
    M = len(parent)
    counts = np.bincount(parent[1:], minlength=M) if M > 1 else np.zeros(M, dtype=np.int64)
    child_ptr = np.concatenate([[1], 1 + np.cumsum(counts)]).astype(np.int64)
    return _ClassTrie(parent=parent, label=label, child_ptr=child_ptr, node_cid=cid)


def _walk_numpy(
    ct: _ClassTrie, group_of_cnode: np.ndarray, rep_byte: np.ndarray, table: np.ndarray,
    sources: np.ndarray, deadline: float, max_edges: int,
):
    """Edges (src index, group, byte state) of all tokens from all ``sources`` (byte states), level by
    level (reference path of :class:`_FusedWalk`)."""
    src = np.arange(len(sources), dtype=np.int32)
    node = np.zeros(len(sources), dtype=np.int32)
    q = sources.astype(np.int32)
    out_s, out_g, out_q = [], [], []
    n_out = 0
    cptr = ct.child_ptr
    if len(rep_byte) == 0:  # no byte is ever accepted (the language is {ε})
        e = np.zeros(0, dtype=np.int32)
        return e, e, e
    byte_of_cnode = rep_byte[np.maximum(ct.label, 0)]
    while len(src):
        lo = cptr[node]
        cnt = (cptr[node + 1] - lo).astype(np.int64)
        has = cnt > 0
        if not has.all():
            src, node, q, lo, cnt = src[has], node[has], q[has], lo[has], cnt[has]
        if not len(src):
            break
        total = int(cnt.sum())
        rep = np.repeat(np.arange(len(src)), cnt)
        starts = np.cumsum(cnt) - cnt
        child = (lo[rep] + (np.arange(total) - starts[rep])).astype(np.int32)
        nq = table[q[rep], byte_of_cnode[child]]
        ok = nq >= 0
        src, node, q = src[rep][ok], child[ok], nq[ok]
        g = group_of_cnode[node]
        hit = g >= 0
        if hit.any():
            out_s.append(src[hit])
            out_g.append(g[hit])
            out_q.append(q[hit])
            n_out += int(hit.sum())
            if n_out > max_edges:
                raise CompileBudgetError(
                    f"token automaton exceeds {max_edges} group transitions", None
                )
        if time.perf_counter() > deadline:
            raise CompileBudgetError("regex compilation exceeded the time budget", None)
    if not out_s:
        e = np.zeros(0, dtype=np.int32)
        return e, e, e
    return np.concatenate(out_s), np.concatenate(out_g), np.concatenate(out_q)


def build_token_dfa(
    bdfa: ByteDFA,
    trie: TokenTrie,
    byte_policy: str,
    *,
    deadline: float | None = None,
    max_states: int = 50_000,
    max_edges: int = 20_000_000,
    backend: str = "numba",
    token_mask: np.ndarray | None = None,
) -> TokenDFA:
    """Compose the byte DFA with the detokenizer of ``trie`` under ``byte_policy`` (module docstring;
    paper 001 Alg. 2, 004 Eq. 3).

    Args:
        bdfa: the byte-level regex DFA (:func:`.regex_to_bytes.byte_dfa_table`; ``table: int32[n, 256]``).
        trie: the tokenizer's :class:`TokenTrie`.
        byte_policy: ``"all"``, ``"no_ascii_with_piece"`` or ``"canonical"`` (000 §4.3).
        deadline: ``time.perf_counter()`` value after which :class:`CompileBudgetError` is raised
            (default: now + 5 s). The numba passes check it between chunks of ~1 M trie arcs (a few ms).
        max_states: token-DFA state budget (before trimming).
        max_edges: budget of (state, group) transitions found per discovery round, and of the merged
            transitions in all (numba path: the tokens a counter chain's shortcut covers count once per
            (source, token length), not once per group: they are never enumerated).
        backend: ``"numba"`` (compiled kernels of :mod:`.kernels`, the default) or ``"numpy"`` (the
            vectorized reference path). Both give identical arrays (``tests/test_compiler.py``) unless two
            groups' hash sums collide (:class:`_FusedWalk`).
        token_mask: ``bool[V]`` or None: the tokens the automaton may use (a request's
            ``allowed_token_ids``); the others are left out of the composition like the tokens the byte
            policy excludes (under the ``"canonical"`` policy a byte-fallback token left out rejects its
            byte inside a character), so trimming and the empty-language check see only these.

    Returns:
        The trimmed :class:`TokenDFA`.

    Raises:
        EmptyLanguageError: no token sequence spells a string of the language.
        CompileBudgetError: budgets (states, edges, deadline) exceeded.
        ValueError: unknown ``byte_policy`` or ``backend``.
    """
    if deadline is None:
        deadline = time.perf_counter() + 5.0
    if backend not in ("numba", "numpy"):
        raise ValueError(f"unknown backend {backend!r}")
    fast = backend == "numba"
    table = bdfa.table
    V = trie.vocab_size
    bcls, K, rep_byte = _byte_classes(table, fast)
    ct = _class_trie_numba(trie, bcls, K, deadline) if fast else _class_trie_numpy(trie, bcls, K, deadline)
    M = len(ct.parent)
    # groups = class nodes where at least one enabled token ends
    mask = policy_token_mask(trie, byte_policy)
    if token_mask is not None:
        mask &= np.asarray(token_mask, dtype=bool)
    tok_cid = np.full(V, -1, dtype=np.int32)
    has_node = mask & (trie.tok_node >= 0)
    tok_cid[has_node] = ct.node_cid[trie.tok_node[has_node]]
    tok_cid[tok_cid == 0] = -1  # empty spelling: never
    if fast:  # (sorted distinct class nodes, as np.unique; a bitmap instead of a hash table)
        from . import kernels

        gnodes = kernels.unique_states(tok_cid[tok_cid >= 0], max(M, 1)).astype(tok_cid.dtype)
    else:
        gnodes = np.unique(tok_cid[tok_cid >= 0])
    group_of_cnode = np.full(M, -1, dtype=np.int32)
    group_of_cnode[gnodes] = np.arange(len(gnodes), dtype=np.int32)
    token_group = np.where(tok_cid >= 0, group_of_cnode[np.maximum(tok_cid, 0)], -1).astype(np.int32)
    G = len(gnodes)

    # byte-fallback tokens under the canonical policy: one whole character out of `ranges`
    bf_acc = None
    bf_tok = None
    if byte_policy == "canonical" and (trie.byte_fallback >= 0).any():
        ranges = canonical_byte_ranges(trie)
        if ranges:
            bf_acc = _gadget((tuple(ranges),))  # int32[a, 256]: >=0 inner, -2 exit, -1 reject
            bf_tok = trie.byte_fallback
            has_bf = bf_tok >= 0
            if token_mask is not None:  # a byte whose token is left out: no character spelled with it
                bf_acc = bf_acc.copy()
                bf_acc[:, has_bf & ~np.asarray(token_mask, dtype=bool)[np.maximum(bf_tok, 0)]] = -1
            token_group[bf_tok[has_bf]] = G + np.flatnonzero(has_bf).astype(np.int32)
            G += 256

    # discover token states in rounds. Plain token states are byte states at a token boundary
    # (array lookup); inner states (inside a byte-fallback character) are (byte state, acceptor state).
    nb = table.shape[0]
    plain_id = np.full(nb, -1, dtype=np.int64)
    inner_id: dict = {}
    keys_q: list = []  # byte state of each token state
    keys_a: list = []  # acceptor state (-1 = plain)
    n_states = 0

    def new_plain(qs: np.ndarray) -> None:
        nonlocal n_states
        if fast:
            from . import kernels

            qs = kernels.unique_states(np.ascontiguousarray(qs), nb)
        else:
            qs = np.unique(qs)
        qs = qs[plain_id[qs] < 0]
        if len(qs):
            plain_id[qs] = np.arange(n_states, n_states + len(qs))
            keys_q.extend(qs.tolist())
            keys_a.extend([-1] * len(qs))
            n_states += len(qs)
            if n_states > max_states:
                raise CompileBudgetError(f"token automaton exceeds {max_states} states", None)

    def inner(q: int, a: int) -> int:
        nonlocal n_states
        j = inner_id.get((q, a))
        if j is None:
            j = inner_id[(q, a)] = n_states
            keys_q.append(q)
            keys_a.append(a)
            n_states += 1
        return j

    csize = np.bincount(bcls[bcls >= 0], minlength=K).astype(np.int64)
    # the class-trie nodes under each first byte class, estimated from the token trie's (scaled by the class
    # trie's size): what a prefixed chain can save per source (_FusedWalk._prefixed)
    live = bcls >= 0
    first_reach = (np.bincount(bcls[live], weights=trie.first_byte_nodes[live], minlength=K)
                   * (M / max(trie.num_nodes, 1))).astype(np.int64)
    fw = _FusedWalk(ct, group_of_cnode, rep_byte, table, G, deadline, max_edges, csize, first_reach) if fast else None
    new_plain(np.array([0], dtype=np.int64))
    # walk from every character boundary at once (usually all reachable; unreachable ones are dropped)
    new_plain(bdfa.char_entry.astype(np.int64))
    done_upto = 0
    E_s, E_g, E_n = [], [], []
    while done_upto < n_states:
        lo, hi = done_upto, n_states
        done_upto = hi
        ka = np.asarray(keys_a[lo:hi], dtype=np.int64)
        kq = np.asarray(keys_q[lo:hi], dtype=np.int64)
        plain_sel = np.flatnonzero(ka < 0)
        if len(plain_sel):
            srcs = kq[plain_sel]
            if fw is not None:  # pass 1: states reached and group hash sums, no edges stored
                new_plain(fw.hash_round(srcs))
            else:
                s_i, g, nq = _walk_numpy(ct, group_of_cnode, rep_byte, table, srcs, deadline, max_edges)
                if len(s_i):
                    new_plain(nq.astype(np.int64))
                    E_s.append(lo + plain_sel[s_i])
                    E_g.append(g.astype(np.int64))
                    E_n.append(plain_id[nq])
        if bf_acc is not None:
            # byte-fallback tokens, vectorized over the batch: (state i, byte b) pairs
            rows = bf_acc[np.maximum(ka, 0)]  # [n, 256]
            T = table[kq]  # [n, 256]
            ok = (rows != -1) & (bf_tok >= 0)[None, :] & (T >= 0)
            ii, bb = np.nonzero(ok)
            if len(ii):
                q2 = T[ii, bb].astype(np.int64)
                r2 = rows[ii, bb].astype(np.int64)
                ex = r2 <= -2
                dst = np.empty(len(ii), dtype=np.int64)
                if ex.any():
                    new_plain(q2[ex])
                    dst[ex] = plain_id[q2[ex]]
                nin = np.flatnonzero(~ex)
                if len(nin):
                    for k, (x, y) in enumerate(zip(q2[nin].tolist(), r2[nin].tolist())):
                        dst[nin[k]] = inner(x, y)
                E_s.append(lo + ii.astype(np.int64))
                E_g.append(token_group[bf_tok[bb]].astype(np.int64))
                E_n.append(dst)
    es = np.concatenate(E_s) if E_s else np.zeros(0, dtype=np.int64)
    eg = np.concatenate(E_g) if E_g else np.zeros(0, dtype=np.int64)
    en = np.concatenate(E_n) if E_n else np.zeros(0, dtype=np.int64)
    kq_all = np.asarray(keys_q, dtype=np.int64)
    ka_all = np.asarray(keys_a, dtype=np.int64)
    acc_all = (ka_all < 0) & bdfa.final[kq_all]
    # hash key of each token state: its byte state (plain states) or nb + its id (inner states)
    skey = np.where(ka_all < 0, kq_all, nb + np.arange(n_states, dtype=np.int64))
    if fw is not None:  # merge from the pass-1 sums, then pass 2 emits the merged edges
        es, eg, en, token_group, G = fw.merge_and_emit(plain_id, kq_all, ka_all, skey, es, eg, en, token_group, G)
    else:
        es, eg, en, token_group, G = _merge_groups_numpy(es, eg, en, token_group, G, n_states, skey)
    # (state, group) order: the BFS numbering of the trim follows it
    order = _edge_order(es, eg, n_states, G) if fast else np.lexsort((eg, es))
    es, eg, en = es[order], eg[order], en[order]
    if fast:
        return _finish_numba(n_states, es, eg, en, acc_all, token_group, G, kq_all.astype(np.int32))
    return _finish_numpy(n_states, es, eg, en, acc_all, token_group, G, kq_all.astype(np.int32))


# --- numba path (kernels.py): same results as the numpy functions below, array for array -------------

_WALK_CHUNK_VISITS = 1 << 20  # trie arcs per kernel call between deadline checks (~2-5 ms)


def _class_trie_numba(trie: TokenTrie, bcls: np.ndarray, K: int, deadline: float) -> _ClassTrie:
    """:func:`_class_trie_numpy` in one kernel call (O(live trie nodes): ~2 ms for 10^5, less when the
    regex kills most bytes)."""
    from . import kernels

    nb = bcls[trie.node_byte.astype(np.int64)].astype(np.int32)
    cid, parent, label = kernels.class_trie(
        np.ascontiguousarray(trie.node_parent, dtype=np.int32), nb,
        np.ascontiguousarray(trie.child_ptr, dtype=np.int64), max(int(K), 1),
    )
    if time.perf_counter() > deadline:
        raise CompileBudgetError("regex compilation exceeded the time budget", None)
    M = len(parent)
    counts = np.bincount(parent[1:], minlength=M) if M > 1 else np.zeros(M, dtype=np.int64)
    child_ptr = np.concatenate([[1], 1 + np.cumsum(counts)]).astype(np.int64)
    return _ClassTrie(parent=parent, label=label, child_ptr=child_ptr, node_cid=cid)


_HASH_SALTS = (0x5851F42D4C957F2D, 0x14057B7EF767814F, 0x2545F4914F6CDD1D, 0x9E3779B97F4A7C15,
               0xD1B54A32D192ED03, 0x8CB92BA72F3D8DD7)


def _state_hashes(keys: np.ndarray) -> list:
    """Six ``uint64[n]`` pseudo-random values per state key (``int64[n]``, >= 0): splitmix64 of
    ``key + salt`` (a pure function of the key, so the numba pass and the numpy path agree without
    sharing random vectors)."""
    k = np.asarray(keys, dtype=np.int64).astype(np.uint64)
    out = []
    for salt in _HASH_SALTS:
        z = (k + np.uint64(salt)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out.append(z ^ (z >> np.uint64(31)))
    return out


def _pair_hashes(h: list, es: np.ndarray, en: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(h1, h2)`` (``uint64[E]``) of the edges ``es -> en`` (state indices into the arrays of
    :func:`_state_hashes`): the terms of the group hash sums (:func:`.kernels.walk_class_trie`)."""
    one = np.uint64(1)
    h1 = h[0][es] * (h[1][en] | one) + h[2][en]
    h2 = h[3][es] * (h[4][en] | one) + h[5][en]
    return h1, h2


class _FusedWalk:
    """The numba path of the walk and the group merge, in two passes that never hold the unmerged edges
    (inside a bounded JSON string every position state has ~10⁴-10⁵ unmerged edges, which the merge
    collapses to a few hundred; see :func:`_merge_groups_numpy` for the merge itself).

    * Pass 1 (:meth:`hash_round`, once per discovery round, :func:`.kernels.walk_class_trie`): the states
      reached and, per group, hash sums of its (source, next state) pairs.
    * :meth:`merge_and_emit`: groups with equal sums (and pair counts) are merged; pass 2
      (:func:`.kernels.walk_class_trie`) walks the class trie pruned to one class node per merged group
      (:func:`.kernels.prune_trie`) from every source and emits the merged edges.

    The merge is decided on two 64-bit hash sums without the numpy path's exact check (that check needs
    every unmerged edge): two groups with different pair sets are merged only if both sums collide
    (probability below 2⁻¹⁰⁰ per pair of groups; ``tests/test_compiler.py`` compares
    the automata with the numpy path's verified merge).
    """

    # counter chains (:meth:`_chain_round`): sources whose chain classes hold at least this many bytes,
    # when their full walks would visit at least _CHAIN_MIN_VISITS class-trie nodes in all (pruning costs
    # about one pass over the class trie) and the pruned trie keeps at most _CHAIN_MAX_SHARE of it
    use_chains = True
    _CHAIN_MIN_BYTES = 16
    _CHAIN_MIN_VISITS = 1 << 20
    _CHAIN_MAX_SHARE = 0.5
    # prefixed chains (:meth:`_prefixed`): paths of at most _PREFIX_MAX_STEPS steps before the chain, variants
    # of at least _PREFIX_MIN_SOURCES sources (a source's full walk costs a few µs, a variant's pruning a
    # fraction of a ms)
    use_prefixes = True
    _PREFIX_MAX_STEPS = 4
    _PREFIX_MIN_SOURCES = 48
    _PREFIX_MIN_CHAIN_BYTES = 80

    def __init__(self, ct: _ClassTrie, group_of_cnode: np.ndarray, rep_byte: np.ndarray, table: np.ndarray,
                 G: int, deadline: float, max_edges: int, csize: np.ndarray | None = None,
                 first_reach: np.ndarray | None = None):
        self.ct = ct
        self.csize = csize
        self._variants: dict = {}
        self._levels = None
        self.first_reach = first_reach
        self.gc = np.ascontiguousarray(group_of_cnode, dtype=np.int32)
        # the kernels read the byte DFA by byte class: table[:, rep_byte] (n x K, a fraction of n x 256,
        # so the walk's random reads stay in cache) indexed by each class node's label
        self.byte_of_cnode = np.maximum(ct.label, 0).astype(np.int32) if len(rep_byte) else None
        self.tab = np.ascontiguousarray(table[:, rep_byte], dtype=np.int32)
        self.nb = table.shape[0]
        self.deadline = deadline
        self.max_edges = max_edges
        self.depth = self._depth_levels()  # (the DFS stack size of the walk kernel)
        self.h = np.stack(_state_hashes(np.arange(self.nb, dtype=np.int64)))  # uint64[6, nb]
        self.sums = np.zeros((2, max(G, 1)), dtype=np.uint64)
        self.cnt = np.zeros(max(G, 1), dtype=np.int64)
        self._no_out = np.zeros(0, dtype=np.int32)
        self.reached = np.zeros(self.nb, dtype=bool)

    def _check_deadline(self) -> None:
        if time.perf_counter() > self.deadline:
            raise CompileBudgetError("regex compilation exceeded the time budget", None)

    def hash_round(self, sources: np.ndarray) -> np.ndarray:
        """Pass 1 from the byte states ``sources``; returns every byte state reached so far (``int64``,
        sorted). Raises :class:`CompileBudgetError` past the deadline or when this round finds more than
        ``max_edges`` transitions."""
        from . import kernels

        if self.byte_of_cnode is None or not len(sources):  # no byte is ever accepted (the language is {ε})
            return np.zeros(0, dtype=np.int64)
        src = np.ascontiguousarray(sources, dtype=np.int32)
        n_emit = 0
        if self.use_chains and self.csize is not None:
            src, n_emit = self._chain_round(src)
        i = 0
        while i < len(src):
            no = self._no_out  # (no kids: the whole class trie; no output buffers in pass 1)
            i, n = kernels.walk_class_trie(self.ct.child_ptr, no, self.byte_of_cnode, self.gc, self.tab, src, i,
                                           _WALK_CHUNK_VISITS, self.depth, False, self.h, self.sums, self.cnt,
                                           self.reached, 0, no, no, no, 0)
            n_emit += n
            self._check_budget(n_emit)
        return np.flatnonzero(self.reached).astype(np.int64)

    def _chain_round(self, src: np.ndarray) -> tuple[np.ndarray, int]:
        """Pass 1 for the chain sources among ``src`` (:func:`.kernels.chain_info`: inside a bounded JSON
        string or free text, the states from which every token spelled in the chain's classes X leads
        to the state its length away) and for the prefixed chain sources (:meth:`_prefixed`: a string's
        escape states, a few steps before such a chain). For those, the tokens spelled in the chain's
        classes only are not walked: their pairs ``(q, q_L)`` go into the hash sums once per length L
        (:func:`.kernels.chain_sums`; sums are order-free, so the automaton is the same), and the class
        trie is walked only where a token leaves the classes (inside a JSON string, a small part of it).
        Returns the sources still to walk in full (neither kind, or the classes prune too little) and
        the pairs counted."""
        from . import kernels

        M = len(self.ct.parent)
        if len(src) * M < self._CHAIN_MIN_VISITS:
            return src, 0
        xm, m, cq = kernels.chain_info(self.tab, src, self.csize, self._CHAIN_MIN_BYTES, self.depth)
        todo = []  # (variant, source indices, m, cq)
        covered = np.zeros(len(src), dtype=bool)
        chain = np.flatnonzero(m >= 0)
        if len(chain):
            keys, inv = _unique_bool_rows(xm[chain])
            for v in range(len(keys)):
                sel = chain[inv == v]
                var = self._variant(keys[v][None, :], None) if len(sel) * M >= self._CHAIN_MIN_VISITS else None
                if var is not None:
                    todo.append((var, sel, m[sel], cq[sel]))
                    covered[sel] = True
        if self.use_prefixes:  # (also chain sources whose classes prune too little: a string's hex digits)
            for masks, first_ok, sel, ms, cqs in self._prefixed(src, ~covered):
                var = self._variant(masks, first_ok)
                if var is not None:
                    todo.append((var, sel, ms, cqs))
                    covered[sel] = True
        n_emit = 0
        no = self._no_out
        for var, sel, ms, cqs in todo:
            kid_ptr, kids, gc_mixed, pg_groups, pg_depth, n_pg = var
            s_v = np.ascontiguousarray(src[sel])
            i = 0
            while i < len(s_v):  # the tokens leaving the classes, on the pruned trie (pure nodes emit nothing)
                i, n = kernels.walk_class_trie(kid_ptr, kids, self.byte_of_cnode, gc_mixed, self.tab, s_v, i,
                                               _WALK_CHUNK_VISITS, self.depth, False, self.h, self.sums, self.cnt,
                                               self.reached, 0, no, no, no, 0)
                n_emit += n
                self._check_budget(n_emit)
            U = np.zeros((3, len(n_pg)), dtype=np.uint64)
            kernels.chain_sums(self.h, s_v, np.ascontiguousarray(ms), np.ascontiguousarray(cqs), n_pg > 0,
                               U, self.reached)
            self.sums[0, pg_groups] += U[0, pg_depth]
            self.sums[1, pg_groups] += U[1, pg_depth]
            self.cnt[pg_groups] += U[2, pg_depth].astype(np.int64)
            # (counted once per (source, token length): the pairs the shortcut adds per length, and the most
            # merged transitions they can become, since groups with equal pair sets merge; counted per group,
            # a string of maxLength 255 had passed 20 M "transitions" that were never enumerated)
            n_emit += int(U[2].astype(np.int64)[n_pg > 0].sum())
            self._check_budget(n_emit)
        return np.ascontiguousarray(src[~covered]), n_emit

    def _prefixed(self, src: np.ndarray, candidates: np.ndarray) -> list:
        """The prefixed chain sources among ``src[candidates]`` (``bool[n]``: the sources no counter chain
        serves), grouped by variant: a source q is one when its prefix path (:func:`.kernels.prefix_paths`,
        at most ``_PREFIX_MAX_STEPS`` steps, each to the successor most bytes lead to) reaches, after d
        steps through the classes Y_1..Y_d, a chain source c0 whose classes X hold at least
        ``_PREFIX_MIN_CHAIN_BYTES`` bytes (a string's characters, not its hex digits). Every token spelled
        in Y_1..Y_d and then in X leads from q to the state its length away (the path's states, then
        c0's chain). Inside a bounded JSON string: the state after a backslash (d = 1: the escape letters
        lead to the next character position), those inside ``\\uXXXX`` (d = 1 to 3) and inside a UTF-8
        character (the last continuation byte), whose full walks were most of the walk (their tokens
        start with a letter or digit). Returns ``[(masks bool[d+1, K], first_ok bool[K], source indices,
        m, cq)]``: only variants of at least ``_PREFIX_MIN_SOURCES`` sources (the pruning costs about one
        pass over the class trie)."""
        from . import kernels

        nonchain = np.flatnonzero(candidates)
        if len(nonchain) < self._PREFIX_MIN_SOURCES:
            return []
        D = self._PREFIX_MAX_STEPS
        rpath, ymask, first_ok = kernels.prefix_paths(self.tab, np.ascontiguousarray(src[nonchain]), self.csize, D)
        reach = self.first_reach
        if reach is None:
            return []
        # (a variant needs sources with one set of first classes whose walks could visit _CHAIN_MIN_VISITS
        # nodes in all; none has: not worth the rest)
        fk, finv = _unique_bool_rows(first_ok)
        if int((np.bincount(finv, minlength=len(fk)) * (fk @ reach)).max()) < self._CHAIN_MIN_VISITS:
            return []
        cand = np.unique(rpath[rpath >= 0]).astype(np.int32)
        if not len(cand):
            return []
        cxm, cm, ccq = kernels.chain_info(self.tab, cand, self.csize, self._PREFIX_MIN_CHAIN_BYTES, self.depth)
        pos = np.minimum(np.searchsorted(cand, np.maximum(rpath, 0)), len(cand) - 1)
        ok = (rpath >= 0) & (cand[pos] == rpath) & (cm[pos] >= 0)
        has = ok.any(axis=1)
        if has.sum() < self._PREFIX_MIN_SOURCES:
            return []
        rows = np.flatnonzero(has)
        d = ok[rows].argmax(axis=1) + 1  # the first step that reaches a chain source
        c0 = pos[rows, d - 1]
        K = self.tab.shape[1]
        key = np.zeros((len(rows), D + 1 + K + D * K + K), dtype=bool)
        key[np.arange(len(rows)), d] = True
        key[:, D + 1 : D + 1 + K] = first_ok[rows]
        y = ymask[rows].copy()
        y[np.arange(D)[None, :] >= d[:, None]] = False  # (steps past c0 do not count)
        key[:, D + 1 + K : D + 1 + K + D * K] = y.reshape(len(rows), D * K)
        key[:, D + 1 + K + D * K :] = cxm[c0]
        keys, inv = _unique_bool_rows(key)
        out = []
        W = self.depth + 1
        for v in range(len(keys)):
            sub = np.flatnonzero(inv == v)
            # (worth it when the sources' full walks could visit _CHAIN_MIN_VISITS nodes, as for the plain
            # chains: a source reads only the subtrees of the first classes it accepts)
            if len(sub) < self._PREFIX_MIN_SOURCES or \
                    len(sub) * int(reach[first_ok[rows[sub[0]]]].sum()) < self._CHAIN_MIN_VISITS:
                continue
            r0, dv = rows[sub], int(d[sub[0]])
            masks = np.concatenate([ymask[r0[0], :dv], cxm[c0[sub[0]]][None, :]])
            cqp = np.full((len(sub), W), -1, dtype=np.int32)
            cqp[:, 0] = src[nonchain[r0]]
            cqp[:, 1 : dv + 1] = rpath[r0, :dv]
            cqp[:, dv + 1 :] = ccq[c0[sub], 1 : W - dv]
            mp = np.minimum(dv + cm[c0[sub]], self.depth).astype(np.int64)
            out.append((masks, first_ok[r0[0]], nonchain[r0], mp, cqp))
        return out

    def _depth_levels(self) -> int:
        """The class trie's depth (= the longest token, in bytes); fills ``_levels`` (the node id range
        of each level) and ``_node_depth`` (``int64[M]``) on first use."""
        if self._levels is None:
            cp = self.ct.child_ptr
            levels, lo, hi = [], 0, 1
            while hi > lo:
                levels.append((lo, hi))
                lo, hi = int(cp[lo]), int(cp[hi])
            self._levels = levels
            self._node_depth = np.zeros(len(self.ct.parent), dtype=np.int64)
            for d, (lo, hi) in enumerate(levels):
                self._node_depth[lo:hi] = d
        return len(self._levels) - 1

    def _variant(self, masks: np.ndarray, first_ok: np.ndarray | None):
        """For the classes ``masks`` (``bool[D+1, K]``: a counter chain's X as one row, D = 0; a prefixed
        chain's Y_1..Y_d and X) and the first classes its sources accept (``first_ok``, ``bool[K]``; None:
        any), memoized: ``(kid_ptr, kids, gc_mixed, pg_groups, pg_depth, n_pg)`` -- the class trie pruned to
        the nodes on a path to a token leaving the classes (less the subtrees under a first class the
        sources reject), the groups with the pure nodes' groups removed, the pure groups and their
        lengths, the number of pure groups per length (:func:`.kernels.pure_nodes`); None when the pruned
        trie keeps more than ``_CHAIN_MAX_SHARE``."""
        from . import kernels

        K = masks.shape[1]
        fo = np.ones(K, dtype=bool) if first_ok is None else np.ascontiguousarray(first_ok, dtype=bool)
        key = (masks.shape, masks.tobytes(), fo.tobytes())
        if key in self._variants:
            return self._variants[key]
        ct = self.ct
        M = len(ct.parent)
        pure, dead = kernels.pure_nodes(ct.parent, ct.label, self._node_depth, np.ascontiguousarray(masks, dtype=bool),
                                        fo)
        keep = ~pure & ~dead
        res = None
        if keep.sum() <= self._CHAIN_MAX_SHARE * M:
            kid_ptr, kids = kernels.prune_trie(ct.parent, ct.child_ptr, keep)  # (+ the ancestors of kept nodes)
            gc_mixed = np.where(pure, -1, self.gc).astype(np.int32)
            pg = np.flatnonzero(pure & (self.gc >= 0))
            pg_depth = self._node_depth[pg]
            n_pg = np.bincount(pg_depth, minlength=len(self._levels)).astype(np.int64)
            res = (kid_ptr, kids, gc_mixed, self.gc[pg].astype(np.int64), pg_depth, n_pg)
        self._variants[key] = res
        return res

    def _check_budget(self, n_emit: int) -> None:
        if n_emit > self.max_edges:
            raise CompileBudgetError(f"token automaton exceeds {self.max_edges} group transitions", None)
        self._check_deadline()

    def merge_and_emit(self, plain_id, kq_all, ka_all, skey, bf_s, bf_g, bf_n, token_group, G):
        """Merge the groups and emit the merged edges (pass 2). ``bf_s, bf_g, bf_n``: the byte-fallback
        edges of the canonical byte policy (token-state ids, ``int64``), merged and deduplicated here.
        Returns ``(es, eg, en, token_group, G)`` like :func:`_merge_groups_numpy` (edges in any order)."""
        from . import kernels

        s1, s2, cnt = self.sums[0, :G].copy(), self.sums[1, :G].copy(), self.cnt[:G].copy()
        if len(bf_s):
            h1, h2 = _pair_hashes(_state_hashes(skey), bf_s, bf_n)
            np.add.at(s1, bf_g, h1)
            np.add.at(s2, bf_g, h2)
            cnt += np.bincount(bf_g, minlength=G)
        newg = np.arange(G, dtype=np.int64)
        present = np.flatnonzero(cnt)
        if len(present) and G > 1:
            inv, cand, n_new = _candidate_groups(s1[present], s2[present], cnt[present], present, G, True)
            if n_new < len(present):
                newg = cand
                tg = np.where(token_group >= 0, newg[np.maximum(token_group, 0)], -1)
                token_group = np.where(tg >= 0, tg, -1).astype(np.int32)
                G = n_new
        # one class node per merged group (the lowest trie group: the shallowest node)
        ct = self.ct
        trie_groups = np.flatnonzero(self.gc >= 0)  # class nodes carrying a group, group ids ascending
        g_of_node = self.gc[trie_groups].astype(np.int64)
        live = cnt[g_of_node] > 0
        nodes, g_of_node = trie_groups[live], g_of_node[live]
        e_of_node = newg[g_of_node]
        first = np.unique(e_of_node, return_index=True)[1] if len(e_of_node) else np.zeros(0, np.int64)
        emit_group = np.full(len(ct.parent), -1, dtype=np.int32)
        emit_group[nodes[first]] = e_of_node[first]
        has_rep = np.zeros(max(G, 1), dtype=bool)
        has_rep[e_of_node[first]] = True
        out_s, out_g, out_n = [], [], []
        plain_states = np.flatnonzero(ka_all < 0)
        if len(first) and len(plain_states):
            kid_ptr, kids = kernels.prune_trie(ct.parent, ct.child_ptr, emit_group >= 0)
            src = np.ascontiguousarray(kq_all[plain_states], dtype=np.int32)
            per_source = len(first)
            cap = max(1 << 16, 2 * per_source)
            bufs = [np.empty(cap, dtype=np.int32) for _ in range(3)]
            n_out = 0
            i = 0
            while i < len(src):
                if n_out + per_source > len(bufs[0]):
                    grown = [np.empty(max(2 * len(bufs[0]), n_out + 2 * per_source), dtype=np.int32) for _ in range(3)]
                    for b_old, b_new in zip(bufs, grown):
                        b_new[:n_out] = b_old[:n_out]
                    bufs = grown
                i, n_out = kernels.walk_class_trie(kid_ptr, kids, self.byte_of_cnode, emit_group, self.tab, src, i,
                                                   _WALK_CHUNK_VISITS, self.depth, True, self.h, self.sums, self.cnt,
                                                   self.reached, per_source, *bufs, n_out)
                self._check_budget(n_out)
            si, g, q = (b[:n_out] for b in bufs)
            out_s.append(plain_states[si])
            out_g.append(g.astype(np.int64))
            out_n.append(plain_id[q])
        if len(bf_s):  # byte-fallback edges of merged groups without a class node, deduplicated
            e = newg[bf_g]
            keep = ~has_rep[e]
            key = e[keep] * np.int64(len(ka_all)) + bf_s[keep]
            _, idx = np.unique(key, return_index=True)
            out_s.append(bf_s[keep][idx])
            out_g.append(e[keep][idx])
            out_n.append(bf_n[keep][idx])
        if not out_s:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z, token_group, G
        return np.concatenate(out_s), np.concatenate(out_g), np.concatenate(out_n), token_group, G


def _candidate_groups(s1, s2, cnt, groups_present, G, fast: bool = True):
    """Candidate merged groups from the per-group pair-set hashes ``(s1, s2, cnt)`` (``uint64[n]``,
    ``uint64[n]``, ``int64[n]``, for the groups ``groups_present``): ``(inv int64[n] new id per present
    group, newg int64[G] new id per old group or -1, n_new)``, new ids in order of first appearance.
    Equal hashes are only candidates: the callers verify them. ``fast``: one pass through a hash table
    (:func:`.kernels.first_keys`); else numpy (``np.unique`` of the triples)."""
    n = len(s1)
    if fast:
        from . import kernels

        inv, n_new = kernels.first_keys(np.ascontiguousarray(s1, dtype=np.uint64), np.ascontiguousarray(s2, dtype=np.uint64),
                                        np.ascontiguousarray(cnt, dtype=np.int64))
        n_new = int(n_new)
    elif n:
        keys = np.empty(n, dtype=[("a", "<u8"), ("b", "<u8"), ("c", "<i8")])
        keys["a"], keys["b"], keys["c"] = s1, s2, cnt
        _, first, inv0 = np.unique(keys, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first), dtype=np.int64)
        inv, n_new = rank[inv0.reshape(-1)], len(first)
    else:
        inv, n_new = np.zeros(0, dtype=np.int64), 0
    newg = np.full(G, -1, dtype=np.int64)
    newg[groups_present] = inv
    return inv, newg, n_new


def _edge_order(es: np.ndarray, eg: np.ndarray, S: int, G: int) -> np.ndarray:
    """``int64[E]``: ``np.lexsort((eg, es))`` as two stable counting sorts (:func:`.kernels.group_tokens`:
    by group, then by state), O(E + S + G). ``es``: ``int[E]`` in ``0..S-1``, ``eg``: in ``0..G-1``."""
    from . import kernels

    by_group, _ = kernels.group_tokens(np.ascontiguousarray(eg), int(G))
    by_state, _ = kernels.group_tokens(np.ascontiguousarray(es[by_group]), int(S))
    return by_group[by_state]


def _finish_numba(S_all, es, eg, en, acc_all, token_group, G, byte_state) -> TokenDFA:
    """:func:`_finish_numpy` in one kernel call (:func:`.kernels.finish`)."""
    from . import kernels

    ok, S, edge_ptr, eg2, en2, old_of_new = kernels.finish(
        np.ascontiguousarray(es, dtype=np.int64), np.ascontiguousarray(eg, dtype=np.int64),
        np.ascontiguousarray(en, dtype=np.int64), np.ascontiguousarray(acc_all, dtype=bool), int(S_all),
    )
    if not ok:
        raise EmptyLanguageError(
            "no token sequence satisfies the constraint (empty under the vocabulary and filters)", None
        )
    return TokenDFA(
        num_states=int(S), accepting=acc_all[old_of_new], edge_ptr=edge_ptr, edge_group=eg2.astype(np.int32),
        edge_next=en2.astype(np.int32), token_group=token_group, num_groups=G,
        byte_state=byte_state[old_of_new],
    )


def _merge_groups_numpy(es, eg, en, token_group, G, n_states, skey):
    """Merge groups that behave identically from every state (same set of (state, next state) pairs):
    class strings that differ only in bytes no state along their paths tells apart (e.g. two words
    inside a JSON string). Candidate merges come from two hash sums of the pair sets (states hashed by
    their key ``skey: int64[n_states]``, :func:`_state_hashes`) and are verified exactly here.
    Returns (es, eg, en, token_group, G) with edges deduplicated."""
    if len(eg) == 0 or G <= 1:
        return es, eg, en, token_group, G
    h1, h2 = _pair_hashes(_state_hashes(skey), es, en)
    order = np.argsort(eg, kind="stable")
    g_sorted = eg[order]
    starts = np.flatnonzero(np.concatenate([[True], g_sorted[1:] != g_sorted[:-1]]))
    groups_present = g_sorted[starts]
    s1 = np.add.reduceat(h1[order], starts)
    s2 = np.add.reduceat(h2[order], starts)
    cnt = np.diff(np.concatenate([starts, [len(order)]]))
    inv, newg, n_new = _candidate_groups(s1, s2, cnt, groups_present, G, False)
    if n_new == len(groups_present):
        return es, eg, en, token_group, G
    # verify: within each merged group every member has exactly the same pair set
    members = np.bincount(inv, minlength=n_new)
    ng = newg[eg]
    S = np.int64(n_states)
    trip = (ng * S + es) * S + en
    uk, tcount = np.unique(trip, return_counts=True)
    u_en = uk % S
    u_es = (uk // S) % S
    u_g = uk // (S * S)
    if not np.array_equal(tcount, members[u_g]):  # a hash collision: keep the fine groups
        return es, eg, en, token_group, G
    tg = np.where(token_group >= 0, newg[np.maximum(token_group, 0)], -1)
    tg = np.where(tg >= 0, tg, -1).astype(np.int32)
    return u_es, u_g, u_en, tg, n_new


def _finish_numpy(S_all, es, eg, en, acc_all, token_group, G, byte_state) -> TokenDFA:
    """Restrict to states reachable from 0 that reach an accepting state; renumber in BFS order;
    sort edges by (state, group)."""
    # reachability from 0
    order = np.argsort(es, kind="stable")
    es, eg, en = es[order], eg[order], en[order]
    ptr = np.zeros(S_all + 1, dtype=np.int64)
    np.cumsum(np.bincount(es, minlength=S_all), out=ptr[1:])
    # co-accessibility (reverse BFS from accepting), vectorized by frontier
    alive = acc_all.copy()
    rorder = np.argsort(en, kind="stable")
    r_src = es[rorder]
    r_ptr = np.zeros(S_all + 1, dtype=np.int64)
    np.cumsum(np.bincount(en, minlength=S_all), out=r_ptr[1:])
    frontier = np.flatnonzero(alive)
    while len(frontier):
        lo, hi = r_ptr[frontier], r_ptr[frontier + 1]
        cnt = hi - lo
        if cnt.sum() == 0:
            break
        rep = np.repeat(np.arange(len(frontier)), cnt)
        idx = lo[rep] + (np.arange(int(cnt.sum())) - (np.cumsum(cnt) - cnt)[rep])
        pred = np.unique(r_src[idx])
        pred = pred[~alive[pred]]
        alive[pred] = True
        frontier = pred
    if not alive[0]:
        raise EmptyLanguageError(
            "no token sequence satisfies the constraint (empty under the vocabulary and filters)", None
        )
    keep = alive[en] & alive[es]
    es, eg, en = es[keep], eg[keep], en[keep]
    ptr = np.zeros(S_all + 1, dtype=np.int64)
    np.cumsum(np.bincount(es, minlength=S_all), out=ptr[1:])
    # forward BFS from 0 (vectorized), BFS numbering
    new_id = np.full(S_all, -1, dtype=np.int64)
    new_id[0] = 0
    n = 1
    frontier = np.array([0], dtype=np.int64)
    while len(frontier):
        lo, hi = ptr[frontier], ptr[frontier + 1]
        cnt = hi - lo
        tot = int(cnt.sum())
        if tot == 0:
            break
        rep = np.repeat(np.arange(len(frontier)), cnt)
        idx = lo[rep] + (np.arange(tot) - (np.cumsum(cnt) - cnt)[rep])
        succ = en[idx]
        _, first_pos = np.unique(succ, return_index=True)
        cand = succ[np.sort(first_pos)]
        cand = cand[new_id[cand] < 0]
        new_id[cand] = np.arange(n, n + len(cand))
        n += len(cand)
        frontier = cand
    keep = new_id[es] >= 0
    es, eg, en = new_id[es[keep]], eg[keep], new_id[en[keep]]
    order = np.lexsort((eg, es))
    es, eg, en = es[order], eg[order], en[order]
    S = n
    edge_ptr = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(np.bincount(es, minlength=S), out=edge_ptr[1:])
    old_of_new = np.empty(S, dtype=np.int64)
    sel = np.flatnonzero(new_id >= 0)
    old_of_new[new_id[sel]] = sel
    return TokenDFA(
        num_states=S, accepting=acc_all[old_of_new], edge_ptr=edge_ptr, edge_group=eg.astype(np.int32),
        edge_next=en.astype(np.int32), token_group=token_group, num_groups=G,
        byte_state=byte_state[old_of_new],
    )


# --- pynini views (tests / reference path) ----------------------------------------------------------


def token_dfa_to_fst(tdfa: TokenDFA):
    """Expand a :class:`TokenDFA` into a pynini acceptor over token labels (``token + 1``). Slow:
    one arc per (state, token); for tests on small automata."""
    import pynini

    one = pynini.Weight.one("tropical")
    ptr, toks = tdfa.group_tokens()
    f = pynini.Fst()
    f.add_states(tdfa.num_states)
    f.set_start(0)
    for s in range(tdfa.num_states):
        if tdfa.accepting[s]:
            f.set_final(s)
        for e in range(int(tdfa.edge_ptr[s]), int(tdfa.edge_ptr[s + 1])):
            g = int(tdfa.edge_group[e])
            nxt = int(tdfa.edge_next[e])
            for t in toks[ptr[g] : ptr[g + 1]].tolist():
                f.add_arc(s, pynini.Arc(t + 1, t + 1, one, nxt))
    f.arcsort("ilabel")
    return f


def reference_token_fst(byte_fst, detokenizer):
    """The pynini path of 001 Alg. 2: ``byte_fst ∘ detokenizer``, projected on the output (tokens),
    ε-removed, determinized and minimized. ``byte_fst``: acceptor over byte labels."""
    import pynini

    a = byte_fst.copy()
    a.arcsort("olabel")
    c = pynini.compose(a, detokenizer)
    c.project("output")
    c.rmepsilon()
    c = pynini.determinize(c).minimize()
    c.arcsort("ilabel")
    return c
