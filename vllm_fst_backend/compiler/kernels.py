"""Compiled (numba) hot loops of the compiler and of the factored canonical automaton.

Every kernel is ``@numba.njit(cache=True, nogil=True)``: compiled once per machine (the machine code is
cached next to this file, or in numba's user cache directory when that is read-only, so a server restart
does not JIT again) and run without the GIL, so a compile in one thread does not stall the others.
:func:`warm_up` compiles (or loads) all of them on tiny inputs; :func:`.token_trie.trie_for` calls it
once per process, inside :func:`.compile.prepare`, i.e. outside any compile budget.

Kernels cannot read the clock cheaply, so the long-running ones work in bounded chunks and return to
Python, which checks the deadline between chunks (:func:`walk_class_trie`: at most ``max_visits``
class-trie arcs per call).

Token DFA (:mod:`.token_dfa`, paper 001 Alg. 2 / 004 Eq. 3: byte DFA ∘ detokenizer, projected on tokens;
each kernel reproduces one numpy step of the reference path exactly, see the function docstrings):

* :func:`byte_classes` -- bytes with equal columns of the byte DFA;
* :func:`class_trie` -- the class trie (token-trie nodes merged by byte-class strings);
* :func:`walk_class_trie` -- the walk of the class trie from many byte states, in two passes: the
  states reached and, per group, hash sums of its (source, next state) pairs (merging groups with
  identical behaviour without storing the pairs); then, on the trie restricted to one class node per
  merged group (:func:`prune_trie`), the merged edges;
* :func:`chain_info`, :func:`prefix_paths`, :func:`chain_sums` -- pass 1 for the tokens that stay in one
  counter chain (bounded strings, free text), also after a short prefix (a string's escapes), per token
  length instead of per group;
* :func:`finish` -- trim (reachable and co-reachable) and BFS renumbering.

Factored canonical product (:mod:`.canonical_product`, 004 Eq. 5 / §6.5):

* :func:`signatures` -- the states' (edge groups, successor tags) signatures numbered;
* :func:`content_key` -- the edge part of a state's cross-compile dead-end verdict key (:mod:`.verdict_cache`);
* :func:`canon_row` -- the allowed-token row of a product state ``(s, 0, k, σ)``;
* :func:`canon_step` -- one decoding step: successor state and its row in one call.

Bit rows use vLLM's layout: ``int32[W]``, token ``v`` is bit ``v & 31`` of word ``v >> 5``; kernels
work on ``uint32`` views of them.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

__all__ = [
    "byte_classes", "byte_classes_exact", "first_keys", "char_arc_keys", "expand_gadgets", "vector_fst_arcs", "class_trie", "walk_class_trie", "prefix_paths", "pure_nodes", "chain_info", "chain_sums", "prune_trie", "unique_states", "finish",
    "canon_row", "canon_step", "sccs", "signatures", "content_key", "memo_put", "memo_run", "witness_verdict", "spec_table", "group_tokens", "group_rows", "group_classes", "group_hash_sums", "entering_classes", "witness_table", "witness_clear", "allows_some", "grouped_allows_some", "pairs_clear", "warm_up",
]

_jit = numba.njit(cache=True, nogil=True)


# --------------------------------------------------------------------------------------------------
# Token DFA
# --------------------------------------------------------------------------------------------------


@_jit
def _byte_class_ids(table, h, live, exact):
    """The classes of the live bytes (``live: bool[256]``) in order of their smallest byte: a byte joins the
    first class whose representative has its hash (``h: uint64[256]``), or, with ``exact``, its whole column
    of ``table``. ``(bcls int32[256], K, rep int32[K])`` as :func:`byte_classes`."""
    n = table.shape[0]
    bcls = np.full(256, -1, np.int32)
    rep = np.empty(256, np.int32)
    K = 0
    for b in range(256):
        if not live[b]:
            continue
        found = -1
        for k in range(K):
            c = rep[k]
            if exact:
                same = True
                for r in range(n):
                    if table[r, c] != table[r, b]:
                        same = False
                        break
            else:
                same = h[c] == h[b]
            if same:
                found = k
                break
        if found < 0:
            rep[K] = b
            found = K
            K += 1
        bcls[b] = found
    return bcls, K, rep[:K].copy()


@_jit
def byte_classes_exact(table):
    """:func:`byte_classes` by comparing every live byte's column in full with each class' representative
    (no hashing; O(256 · K · n), strided reads: its fallback on a hash collision)."""
    live = np.zeros(256, np.bool_)
    for r in range(table.shape[0]):
        for b in range(256):
            if table[r, b] >= 0:
                live[b] = True
    return _byte_class_ids(table, np.zeros(256, np.uint64), live, True)


@_jit
def byte_classes(table):
    """:func:`.token_dfa._byte_classes`: bytes whose columns of the byte DFA's ``table`` (``int32[n, 256]``)
    are equal form a class, bytes rejected in every state (a column of -1 only) are dead. Returns
    ``(bcls int32[256], K, rep int32[K])``: each byte's class (-1 dead), numbered in order of each class'
    smallest byte, which is ``rep[k]``. One pass over the table for a hash of each column, one more to
    check every byte's column against its class representative's; on a hash collision (a mismatch),
    every column compared in full with the representatives instead."""
    n = table.shape[0]
    h = np.zeros(256, np.uint64)
    top = np.full(256, -1, np.int32)
    for r in range(n):
        for b in range(256):  # (independent per byte: vectorized)
            v = table[r, b]
            h[b] = h[b] * np.uint64(0x100000001B3) + np.uint64(v + 2)
            top[b] = max(top[b], v)
    bcls, K, rep = _byte_class_ids(table, h, top >= 0, False)
    for r in range(n):  # verified in one pass over the rows
        for b in range(256):
            if bcls[b] >= 0 and table[r, b] != table[r, rep[bcls[b]]]:
                return byte_classes_exact(table)  # a hash collision
    return bcls, K, rep


@_jit
def char_arc_keys(ptr, labels, targets):
    """Per character state (:func:`.regex_to_bytes.byte_dfa_table`): its arcs sorted by class, each arc's
    target numbered by first appearance in that order (its *rank*: the state's gadget exit), the targets
    in rank order, and two hashes of the (class, rank) sequence (equal sequences give one gadget).

    Args:
        ptr: ``int64[S+1]``; labels, targets: ``int32[E]`` -- state s's arcs (class id, next state) are
            ``ptr[s]:ptr[s+1]``, in any order, classes distinct.

    Returns:
        ``(lab int32[E], rank int32[E], rt int32[E], nrank int64[S], h0 uint64[S], h1 uint64[S])``: per
        state, its arcs' classes ascending and their ranks, and in ``rt[ptr[s]:ptr[s] + nrank[s]]`` its
        distinct targets in rank order.
    """
    S = ptr.shape[0] - 1
    E = labels.shape[0]
    lab = labels.copy()
    tgt = targets.copy()
    rank = np.empty(E, np.int32)
    rt = np.empty(E, np.int32)
    nrank = np.zeros(S, np.int64)
    h0 = np.empty(S, np.uint64)
    h1 = np.empty(S, np.uint64)
    m0 = np.uint64(0x9E3779B97F4A7C15)
    m1 = np.uint64(0xBF58476D1CE4E5B9)
    for s in range(S):
        a = ptr[s]
        b = ptr[s + 1]
        for i in range(a + 1, b):  # insertion sort by class (a few arcs per state)
            x = lab[i]
            y = tgt[i]
            j = i - 1
            while j >= a and lab[j] > x:
                lab[j + 1] = lab[j]
                tgt[j + 1] = tgt[j]
                j -= 1
            lab[j + 1] = x
            tgt[j + 1] = y
        n = 0
        x0 = np.uint64(b - a) * m0
        x1 = np.uint64(b - a) ^ m1
        for i in range(a, b):
            t = tgt[i]
            r = -1
            for j in range(n):
                if rt[a + j] == t:
                    r = j
                    break
            if r < 0:
                r = n
                rt[a + n] = t
                n += 1
            rank[i] = r
            v = (np.uint64(lab[i]) << np.uint64(32)) | np.uint64(r)
            x0 = (x0 ^ (v + m1)) * m0
            x0 ^= x0 >> np.uint64(29)
            x1 = (x1 + v * m1) * (m0 | np.uint64(1))
            x1 ^= x1 >> np.uint64(31)
        nrank[s] = n
        h0[s] = x0
        h1[s] = x1
    return lab, rank, rt, nrank, h0, h1


@_jit
def expand_gadgets(table, g_rows, g_ptr, slot, base, ptr, rt):
    """The byte table of every character state's gadget (:func:`.regex_to_bytes.byte_dfa_table`), in
    place: character state s (byte state s) uses gadget ``slot[s]``, whose rows are
    ``g_rows[g_ptr[g]:g_ptr[g+1]]`` (``int32[ng, 256]``: ``>= 0`` internal state, -1 reject, ``-2 - e``
    exit e); its internal state j > 0 is byte state ``base[s] + j - 1``, its exit e the character state
    ``rt[ptr[s] + e]`` (:func:`char_arc_keys`)."""
    for s in range(slot.shape[0]):
        g = slot[s]
        lo = g_ptr[g]
        for j in range(g_ptr[g + 1] - lo):
            q = s if j == 0 else base[s] + j - 1
            for b in range(256):
                v = g_rows[lo + j, b]
                if v > 0:
                    table[q, b] = base[s] + v - 1
                elif v == 0:
                    table[q, b] = s
                elif v == -1:
                    table[q, b] = -1
                else:
                    table[q, b] = rt[ptr[s] - 2 - v]


@_jit
def vector_fst_arcs(words, start, S):
    """The states and arcs of an OpenFst ``VectorFst`` acceptor from the int32 words after its header
    (:func:`.char_dfa._read_vector_fst`: per state its final weight, its arc count as int64 and 4 words
    per arc: ilabel, olabel, weight, next state), renumbered in BFS order from ``start``, arcs in their
    stored order: ``(ptr int64[S+1], label int32[E] (ilabel - 1), target int32[E], final bool[S],
    n_reached)`` (``final``: weight != +inf)."""
    first = np.empty(S, np.int64)
    narcs = np.empty(S, np.int64)
    w = 0
    for s in range(S):
        first[s] = w + 3
        narcs[s] = words[w + 1]  # (the int64 count's high word is 0)
        w += 3 + 4 * narcs[s]
    new = np.full(S, -1, np.int64)
    order = np.empty(S, np.int64)
    new[start] = 0
    order[0] = start
    n = 1
    k = 0
    while k < n:
        s = order[k]
        k += 1
        for a in range(narcs[s]):
            t = words[first[s] + 4 * a + 3]
            if new[t] < 0:
                new[t] = n
                order[n] = t
                n += 1
    E = 0
    for x in range(n):
        E += narcs[order[x]]
    ptr = np.zeros(n + 1, np.int64)
    label = np.empty(E, np.int32)
    target = np.empty(E, np.int32)
    final = np.empty(n, np.bool_)
    e = 0
    for x in range(n):
        s = order[x]
        final[x] = words[first[s] - 3] != 0x7F800000
        for a in range(narcs[s]):
            label[e] = words[first[s] + 4 * a] - 1
            target[e] = new[words[first[s] + 4 * a + 3]]
            e += 1
        ptr[x + 1] = e
    return ptr, label, target, final, n


@_jit
def first_keys(k0, k1, k2):
    """Distinct keys ``(k0[i], k1[i], k2[i])`` (``uint64``, ``uint64``, ``int64``) numbered in order of first
    appearance: ``(inv int64[n], n_distinct)``. Open addressing, linear probing (:func:`.token_dfa._candidate_groups`)."""
    n = k0.shape[0]
    cap = 16
    while cap < 2 * n:
        cap *= 2
    slot = np.full(cap, -1, np.int64)
    inv = np.empty(n, np.int64)
    m = 0
    for i in range(n):
        h = (k0[i] * np.uint64(0x9E3779B97F4A7C15)) ^ k1[i] ^ (np.uint64(k2[i]) * np.uint64(0xBF58476D1CE4E5B9))
        j = np.int64((h ^ (h >> np.uint64(31))) & np.uint64(cap - 1))
        while True:
            r = slot[j]
            if r < 0:
                slot[j] = i
                inv[i] = m
                m += 1
                break
            if k0[r] == k0[i] and k1[r] == k1[i] and k2[r] == k2[i]:
                inv[i] = inv[r]
                break
            j = (j + 1) & (cap - 1)
    return inv, m


@_jit
def class_trie(node_parent, node_class, child_ptr, K):
    """Class trie of a token trie (``token_dfa._class_trie_numpy``): node ids assigned level by level,
    within a level in increasing ``(parent class node, byte class)`` order. Only live nodes are visited
    (children of live nodes through dead bytes are skipped with their subtrees): a counting sort per
    level by parent, then an insertion sort of each parent's (few) distinct child labels.

    Args:
        node_parent: ``int32[N]`` token-trie parents (-1 for the root).
        node_class: ``int32[N]`` byte class (``0..K-1``) of the arc into each node (-1 = dead byte).
        child_ptr: ``int64[N+1]`` token-trie children (contiguous per node).
        K: number of byte classes (> 0).

    Returns:
        ``(cid int32[N], parent int32[M], label int32[M])``: class node of each trie node (-1 = dead),
        and the parent (-1 for the root) and byte class (-1 for the root) of each class node.
    """
    N = node_parent.shape[0]
    cid = np.full(N, -1, np.int32)
    parent = np.empty(N, np.int32)
    label = np.empty(N, np.int32)
    if N == 0:
        return cid, parent[:0], label[:0]
    cid[0] = 0
    parent[0] = -1
    label[0] = -1
    next_id = 1
    prev_lo = 0  # class nodes of the previous level: prev_lo..next_id-1
    slot = np.full(K, -1, np.int64)
    labs = np.empty(K, np.int64)
    cnt = np.zeros(N + 1, np.int64)
    live = np.empty(N, np.int64)  # live trie nodes of the previous level
    cand = np.empty(N, np.int64)  # their live children
    bucket = np.empty(N, np.int64)
    live[0] = 0
    n_prev_live = 1
    while True:
        n_prev = next_id - prev_lo
        for u in range(n_prev + 1):
            cnt[u] = 0
        n_live = 0
        for x in range(n_prev_live):
            u = live[x]
            for i in range(child_ptr[u], child_ptr[u + 1]):
                if node_class[i] >= 0:
                    cand[n_live] = i
                    n_live += 1
                    cnt[cid[u] - prev_lo + 1] += 1
        if n_live == 0:
            break
        # counting sort of the live nodes of this level by their parent's class node
        for u in range(1, n_prev + 1):
            cnt[u] += cnt[u - 1]
        for x in range(n_live):
            i = cand[x]
            pc = cid[node_parent[i]] - prev_lo
            p = cnt[pc]
            cnt[pc] = p + 1
            bucket[p] = i
        # per parent class node: its distinct labels in increasing order get consecutive ids
        level_lo = next_id
        start = 0
        for u in range(n_prev):
            end = cnt[u]
            if end == start:
                continue
            n_l = 0
            for p in range(start, end):
                lab = node_class[bucket[p]]
                if slot[lab] < 0:
                    slot[lab] = 0
                    labs[n_l] = lab
                    n_l += 1
            for x in range(1, n_l):  # insertion sort (n_l <= K, usually 1)
                y = labs[x]
                z = x - 1
                while z >= 0 and labs[z] > y:
                    labs[z + 1] = labs[z]
                    z -= 1
                labs[z + 1] = y
            for j in range(n_l):
                slot[labs[j]] = next_id
                parent[next_id] = prev_lo + u
                label[next_id] = labs[j]
                next_id += 1
            for p in range(start, end):
                i = bucket[p]
                cid[i] = slot[node_class[i]]
            for j in range(n_l):
                slot[labs[j]] = -1
            start = end
        prev_lo = level_lo
        for x in range(n_live):
            live[x] = cand[x]
        n_prev_live = n_live
    return cid, parent[:next_id], label[:next_id]


@_jit
def walk_class_trie(kid_ptr, kids, byte_of_cnode, group_of_node, table, sources, start, max_visits, max_depth,
                    emit, h, sums, cnt, reached, per_source_max, o_s, o_g, o_q, n0):
    """Depth-first walk of the class trie from ``sources[start:]`` (byte states at a token boundary), both
    passes of ``token_dfa._FusedWalk``. Every node ``c`` reached from source index ``i`` (its byte string
    is defined from ``q = sources[i]``, leading to byte state ``q2``) with ``g = group_of_node[c] >= 0``:

    * pass 1 (``emit`` False) adds the pair ``(q, q2)`` to ``g``'s hash sums (those of
      ``token_dfa._merge_groups_numpy``, uint64 arithmetic wrapping modulo 2⁶⁴, order-free) and marks
      ``reached[q2]``; no edge is stored::

          sums[0, g] += h[0, q] * (h[1, q2] | 1) + h[2, q2];  sums[1, g] += h[3, q] * (h[4, q2] | 1) + h[5, q2]
          cnt[g] += 1

    * pass 2 (``emit`` True, on the trie pruned by :func:`prune_trie`) writes ``(i, g, q2)`` into the
      output buffers from ``n0`` on; no new source is started unless ``per_source_max`` slots are free.

    Args:
        kid_ptr: ``int64[M+1]``; the children of node c are ``kids[kid_ptr[c]:kid_ptr[c+1]]``, or the ids
            ``kid_ptr[c]:kid_ptr[c+1]`` themselves when ``kids`` is empty (the whole class trie: its
            ``child_ptr``).
        kids: ``int32[m]`` child ids (:func:`prune_trie`) or empty.
        byte_of_cnode: ``int32[M]`` the column of ``table`` read on the arc into each node.
        group_of_node: ``int32[M]`` the group of each node, -1 if none.
        table: ``int32[n, K]`` byte DFA by column (-1 = reject): the caller passes one column per byte
            class (``table[:, rep_byte]``) and the class labels as ``byte_of_cnode``.
        sources: ``int32[n_src]`` byte states.
        start: first source index to walk.
        max_visits: no new source is started once this many trie arcs were tried in this call (the
            first one always is).
        max_depth: depth of the class trie (the DFS stack size).
        emit: pass 2 (True) or pass 1 (False).
        h: ``uint64[6, n]`` per-byte-state hash values (``token_dfa._state_hashes``); pass 1 only.
        sums: ``uint64[2, G]``; cnt: ``int64[G]``; reached: ``bool[n]`` -- updated in place; pass 1 only.
        per_source_max, o_s, o_g, o_q, n0: pass 2 only: ``int32[cap]`` output buffers (source index,
            group, byte state) holding ``n0`` emissions already, ``cap >= n0 + per_source_max``.

    Returns:
        ``(next_start, n)``: the first source not walked (``len(sources)`` when done) and ``n0`` plus the
        number of (source, group) transitions found in this call.
    """
    n = sources.shape[0]
    cap = o_s.shape[0]
    by_id = kids.shape[0] == 0
    n_out = n0
    st_q = np.empty(max_depth + 2, np.int32)
    st_it = np.empty(max_depth + 2, np.int64)
    st_end = np.empty(max_depth + 2, np.int64)
    one = np.uint64(1)
    visits = 0
    i = start
    while i < n:
        if i > start and (visits >= max_visits or (emit and n_out + per_source_max > cap)):
            break
        q0 = sources[i]
        top = 0
        st_q[0] = q0
        st_it[0] = kid_ptr[0]
        st_end[0] = kid_ptr[1]
        while top >= 0:
            p = st_it[top]
            if p == st_end[top]:
                top -= 1
                continue
            st_it[top] = p + 1
            c = p if by_id else kids[p]
            visits += 1
            nq = table[st_q[top], byte_of_cnode[c]]
            if nq < 0:
                continue
            g = group_of_node[c]
            if g >= 0:
                if emit:
                    o_s[n_out] = i
                    o_g[n_out] = g
                    o_q[n_out] = nq
                else:
                    sums[0, g] += h[0, q0] * (h[1, nq] | one) + h[2, nq]
                    sums[1, g] += h[3, q0] * (h[4, nq] | one) + h[5, nq]
                    cnt[g] += 1
                    reached[nq] = True
                n_out += 1
            lo = kid_ptr[c]
            hi = kid_ptr[c + 1]
            if lo < hi:
                top += 1
                st_q[top] = nq
                st_it[top] = lo
                st_end[top] = hi
        i += 1
    return i, n_out


@_jit
def _heaviest_successor(tab, q, csize, acc):
    """``(r, b)``: the successor of byte state q that most bytes lead to (``csize[k]`` bytes per class k;
    the first class wins ties: deterministic) and that byte count; ``(-1, 0)`` without successor.
    ``acc`` (``int64[n]``, zero) is scratch, left zero."""
    K = tab.shape[1]
    for k in range(K):
        r = tab[q, k]
        if r >= 0:
            acc[r] += csize[k]
    best_r = -1
    best_b = 0
    for k in range(K):
        r = tab[q, k]
        if r >= 0 and acc[r] > best_b:
            best_b = acc[r]
            best_r = r
    for k in range(K):
        r = tab[q, k]
        if r >= 0:
            acc[r] = 0
    return best_r, best_b


@_jit
def chain_info(tab, sources, csize, min_bytes, max_depth):
    """Counter chains of the walk's sources (``token_dfa._FusedWalk``): for source ``q = sources[i]``, X
    is the set of byte classes leading to q's most common successor (by bytes: ``csize[k]`` = bytes in
    class k); q is a chain source when X holds at least ``min_bytes`` bytes and, from q, every class of
    X keeps leading to one same state: ``q = q_0 -X-> q_1 -X-> ... -X-> q_m`` with X rejected at ``q_m``
    (or ``m = max_depth``). Then every token spelled in X only, of length ``L <= m``, leads from q to
    ``q_L``, whatever its bytes (inside a bounded JSON string or free text, most tokens).

    Args:
        tab: ``int32[n, K]`` byte DFA by byte class (-1 reject); sources: ``int32[n_src]``;
        csize: ``int64[K]``; min_bytes, max_depth: ints.

    Returns:
        ``(xm bool[n_src, K], m int64[n_src], cq int32[n_src, max_depth + 1])``: the classes X (all False
        and ``m = -1`` for a source that is not a chain source), the chain length and the chain's states
        ``cq[i, :m + 1]``.
    """
    n = sources.shape[0]
    K = tab.shape[1]
    xm = np.zeros((n, K), np.bool_)
    m = np.full(n, -1, np.int64)
    cq = np.full((n, max_depth + 1), -1, np.int32)
    acc = np.zeros(tab.shape[0], np.int64)
    for i in range(n):
        q = sources[i]
        best_r, best_b = _heaviest_successor(tab, q, csize, acc)
        if best_r < 0 or best_b < min_bytes:
            continue
        for k in range(K):
            xm[i, k] = tab[q, k] == best_r
        cur = q
        cq[i, 0] = q
        j = 0
        ok = True
        while j < max_depth:
            first = -2
            for k in range(K):
                if xm[i, k]:
                    t = tab[cur, k]
                    if first == -2:
                        first = t
                    elif t != first:
                        ok = False
                        break
            if not ok or first < 0:
                break
            cur = first
            j += 1
            cq[i, j] = cur
        if ok:
            m[i] = j
        else:
            for k in range(K):
                xm[i, k] = False
            for x in range(max_depth + 1):
                cq[i, x] = -1
    return xm, m, cq


@_jit
def chain_sums(h, sources, m, cq, has_depth, U, reached):
    """Pass 1 of the walk for the X-only tokens of chain sources (:func:`chain_info`), per token length
    instead of per group: every X-only group of length L gets the pair ``(q, q_L)`` from each chain
    source q with ``m >= L``, so ``U[0, L]``, ``U[1, L]`` (``uint64``, wrapping) accumulate the pair hashes
    of :func:`walk_class_trie` and ``U[2, L]`` their number, for the lengths with ``has_depth[L]`` (some
    X-only group has that length); ``reached[q_L]`` is set for those."""
    one = np.uint64(1)
    for i in range(sources.shape[0]):
        q0 = sources[i]
        for L in range(1, m[i] + 1):
            if not has_depth[L]:
                continue
            q2 = cq[i, L]
            U[0, L] += h[0, q0] * (h[1, q2] | one) + h[2, q2]
            U[1, L] += h[3, q0] * (h[4, q2] | one) + h[5, q2]
            U[2, L] += one
            reached[q2] = True


@_jit
def prefix_paths(tab, sources, csize, max_d):
    """The prefix paths of the walk's sources that are not chain sources (:func:`chain_info`), for the
    prefixed chains of ``token_dfa._FusedWalk``: from ``q = sources[i]``, ``max_d`` steps each to the
    successor most bytes lead to (``csize[k]`` = bytes in class k; the first class wins ties), with the
    classes leading there. Inside a bounded JSON string: from the state after a backslash, the escape
    letters lead to the next character position (a chain source); after ``\\u0``, ``\\u00``,
    ``\\u000`` the hex digits lead there in 3, 2 or 1 steps.

    Args:
        tab: ``int32[n, K]`` byte DFA by byte class (-1 reject); sources: ``int32[n_src]``;
        csize: ``int64[K]``; max_d: int, the most steps.

    Returns:
        ``(rpath int32[n_src, max_d], ymask bool[n_src, max_d, K], first_ok bool[n_src, K])``: the states
        of the path (-1 past a state without successor), the classes leading to each, and the classes q
        accepts at all.
    """
    n = sources.shape[0]
    K = tab.shape[1]
    rpath = np.full((n, max_d), -1, np.int32)
    ymask = np.zeros((n, max_d, K), np.bool_)
    first_ok = np.zeros((n, K), np.bool_)
    acc = np.zeros(tab.shape[0], np.int64)
    for i in range(n):
        q = sources[i]
        for k in range(K):
            first_ok[i, k] = tab[q, k] >= 0
        cur = q
        for j in range(max_d):
            best_r = _heaviest_successor(tab, cur, csize, acc)[0]
            if best_r < 0:
                break
            for k in range(K):
                ymask[i, j, k] = tab[cur, k] == best_r
            rpath[i, j] = best_r
            cur = best_r
    return rpath, ymask, first_ok


@_jit
def pure_nodes(parent, label, depth, masks, first_ok):
    """The class-trie nodes whose byte string is spelled in the classes ``masks`` (``bool[D+1, K]``: a
    node at depth t >= 1 reads row ``min(t - 1, D)``; D = 0 for a counter chain, D = d for a chain after a
    prefix of d steps), and the *dead* nodes: those under a first byte whose class is not in ``first_ok``
    (``bool[K]``; no source of the variant reads them). ``parent``/``label``: ``int32[M]`` of the class
    trie, numbered level by level (parents precede children); ``depth``: ``int64[M]``, each node's depth.
    Returns ``(pure bool[M], dead bool[M])``; the root, the empty string, is pure."""
    M = parent.shape[0]
    D = masks.shape[0] - 1
    pure = np.zeros(M, np.bool_)
    dead = np.zeros(M, np.bool_)
    if M:
        pure[0] = True
    for c in range(1, M):
        p = parent[c]
        if dead[p]:
            dead[c] = True
            continue
        t = depth[c]
        if t == 1 and not first_ok[label[c]]:
            dead[c] = True
            continue
        pure[c] = pure[p] and masks[min(t - 1, D), label[c]]
    return pure, dead


@_jit
def prune_trie(parent, child_ptr, keep):
    """The class trie restricted to the nodes marked in ``keep`` (``bool[M]``, updated in place: every
    ancestor of a kept node is kept; node ids are numbered level by level, so parents precede children).
    Returns ``(kid_ptr int64[M+1], kids int32[m])``: the kept children of node c, in id order, are
    ``kids[kid_ptr[c]:kid_ptr[c+1]]``."""
    M = parent.shape[0]
    for c in range(M - 1, 0, -1):
        if keep[c]:
            keep[parent[c]] = True
    kid_ptr = np.zeros(M + 1, np.int64)
    m = 0
    for c in range(1, M):
        if keep[c]:
            kid_ptr[parent[c] + 1] += 1
            m += 1
    for c in range(M):
        kid_ptr[c + 1] += kid_ptr[c]
    fill = kid_ptr[:-1].copy()
    kids = np.empty(m, np.int32)
    for c in range(1, M):
        if keep[c]:
            p = parent[c]
            kids[fill[p]] = c
            fill[p] += 1
    return kid_ptr, kids


@_jit
def unique_states(q, n_states):
    """Sorted distinct values of ``q`` (``int32[e]`` or ``int64[e]``, values in ``0..n_states-1``) as
    ``int64[u]`` (``np.unique`` with a bitmap: O(e + n_states))."""
    seen = np.zeros(n_states, np.bool_)
    u = 0
    for i in range(q.shape[0]):
        if not seen[q[i]]:
            seen[q[i]] = True
            u += 1
    out = np.empty(u, np.int64)
    j = 0
    for v in range(n_states):
        if seen[v]:
            out[j] = v
            j += 1
    return out


@_jit
def finish(es, eg, en, acc_all, S_all):
    """Trim and renumber a token automaton (``token_dfa._finish_numpy``): keep the states co-reachable
    (reverse search from accepting states) and reachable from 0 (BFS over each state's edges in input
    order, numbering states by discovery), then sort the edges by (state, group), stably.

    Args:
        es, eg, en: ``int64[E]`` edges (source, group, next state) over states ``0..S_all-1``.
        acc_all: ``bool[S_all]`` accepting states.

    Returns:
        ``(ok, S, edge_ptr int64[S+1], edge_group int64[E'], edge_next int64[E'], old_of_new int64[S])``;
        ``ok`` is False (and the arrays empty) when state 0 is not co-reachable (an empty language).
    """
    E = es.shape[0]
    # edges per source, stable
    ptr = np.zeros(S_all + 1, np.int64)
    for i in range(E):
        ptr[es[i] + 1] += 1
    for s in range(1, S_all + 1):
        ptr[s] += ptr[s - 1]
    fill = ptr[:-1].copy()
    by_s = np.empty(E, np.int64)
    for i in range(E):
        p = fill[es[i]]
        fill[es[i]] = p + 1
        by_s[p] = i
    # predecessors
    rptr = np.zeros(S_all + 1, np.int64)
    for i in range(E):
        rptr[en[i] + 1] += 1
    for s in range(1, S_all + 1):
        rptr[s] += rptr[s - 1]
    rfill = rptr[:-1].copy()
    rsrc = np.empty(E, np.int64)
    for i in range(E):
        p = rfill[en[i]]
        rfill[en[i]] = p + 1
        rsrc[p] = es[i]
    alive = acc_all.copy()
    stack = np.empty(S_all + 1, np.int64)
    top = 0
    for s in range(S_all):
        if alive[s]:
            stack[top] = s
            top += 1
    while top > 0:
        top -= 1
        v = stack[top]
        for p in range(rptr[v], rptr[v + 1]):
            u = rsrc[p]
            if not alive[u]:
                alive[u] = True
                stack[top] = u
                top += 1
    e0 = np.zeros(0, np.int64)
    if S_all == 0 or not alive[0]:
        return False, 0, e0, e0, e0, e0
    new_id = np.full(S_all, -1, np.int64)
    queue = np.empty(S_all, np.int64)
    new_id[0] = 0
    queue[0] = 0
    n = 1
    head = 0
    while head < n:
        v = queue[head]
        head += 1
        for p in range(ptr[v], ptr[v + 1]):
            i = by_s[p]
            t = en[i]
            if alive[t] and new_id[t] < 0:
                new_id[t] = n
                queue[n] = t
                n += 1
    # kept edges in (old source, input) order, then stable sort by group, then by new source
    kept = np.empty(E, np.int64)
    m = 0
    G = 0
    for p in range(E):
        i = by_s[p]
        if alive[en[i]] and new_id[es[i]] >= 0:
            kept[m] = i
            m += 1
            if eg[i] + 1 > G:
                G = eg[i] + 1
    cg = np.zeros(G + 1, np.int64)
    for p in range(m):
        cg[eg[kept[p]] + 1] += 1
    for g in range(1, G + 1):
        cg[g] += cg[g - 1]
    by_g = np.empty(m, np.int64)
    for p in range(m):
        i = kept[p]
        q = cg[eg[i]]
        cg[eg[i]] = q + 1
        by_g[q] = i
    edge_ptr = np.zeros(n + 1, np.int64)
    for p in range(m):
        edge_ptr[new_id[es[kept[p]]] + 1] += 1
    for s in range(1, n + 1):
        edge_ptr[s] += edge_ptr[s - 1]
    fill2 = edge_ptr[:-1].copy()
    out_g = np.empty(m, np.int64)
    out_n = np.empty(m, np.int64)
    for p in range(m):
        i = by_g[p]
        s = new_id[es[i]]
        q = fill2[s]
        fill2[s] = q + 1
        out_g[q] = eg[i]
        out_n[q] = new_id[en[i]]
    old_of_new = np.empty(n, np.int64)
    for v in range(S_all):
        if new_id[v] >= 0:
            old_of_new[new_id[v]] = v
    return True, n, edge_ptr, out_g, out_n, old_of_new


# --------------------------------------------------------------------------------------------------
# Factored canonical product: one row
# --------------------------------------------------------------------------------------------------

# columns of the special-token tables (``FactoredCanonical._fast_specials``)
SP_TOK, SP_LF, SP_J, SP_KIND, SP_ARG, SP_ROW, SP_TGT = 0, 1, 2, 3, 4, 5, 6
KIND_NEVER, KIND_PLAIN, KIND_CTX, KIND_INNER = -1, 0, 1, 2
# statuses of canon_step besides a pending count >= 0
STEP_REJECT, STEP_NEED_SPEC, STEP_NEED_PY = -1, -2, -3


@_jit
def _row_into(out, s, k, sig, spec, lo, hi, tag_bits, inner_cache, pending, base, C, banned_ptr,
              banned_ids, n_seg, start_row, sigma_rows, sigma_full, sigma_la, la_sets_idx, class_group, ctx_classes,
              accepting, sigma_end, eos_ids):
    """Body of :func:`canon_row` / :func:`canon_step` (``out`` is the ``uint32`` view; the special tokens
    of s are rows ``lo:hi`` of ``spec``; ``base``: ``uint32[W]``, the regular tokens of s). Returns the
    number of pending pairs."""
    W = out.shape[0]
    # ~banned[k] (or the start row): the special tokens are checked against it, then it is narrowed
    if k == C:
        for w in range(W):
            out[w] = start_row[w]
    else:
        for w in range(W):
            out[w] = np.uint32(0xFFFFFFFF)
        for h in range(n_seg):
            a = banned_ptr[k * n_seg + h]
            b = banned_ptr[k * n_seg + h + 1]
            off = h * 65536
            for p in range(a, b):
                v = off + np.int64(banned_ids[p])
                out[v >> 5] &= ~(np.uint32(1) << np.uint32(v & 31))
    passed = np.empty(hi - lo, np.int64)
    n_ok = 0
    n_pend = 0
    grp = class_group[k]
    for i in range(lo, hi):
        kind = spec[i, 3]
        if kind < 0:
            continue
        v = spec[i, 0]
        if not sigma_la[sig, spec[i, 1]]:
            continue
        if ((out[v >> 5] >> np.uint32(v & 31)) & np.uint32(1)) == 0:
            continue
        j = spec[i, 2]
        nsig = la_sets_idx[k, j] if j >= 0 else 0
        if nsig < 0:
            continue
        if kind == 0:
            if (spec[i, 4] >> nsig) & 1:
                continue
        elif kind == 1:
            cv = ctx_classes[spec[i, 4], grp]
            if cv < 0:
                cv += C  # numpy's negative indexing, as the reference path
            if (tag_bits[spec[i, 5], cv] >> nsig) & 1:
                continue
        else:
            r = spec[i, 4]
            if (inner_cache[r, 0] >> nsig) & 1:
                if (inner_cache[r, 1] >> nsig) & 1:
                    continue
            else:
                pending[n_pend, 0] = i
                pending[n_pend, 1] = nsig
                n_pend += 1
                continue
        passed[n_ok] = v
        n_ok += 1
    if sigma_full[sig]:
        for w in range(W):
            out[w] &= base[w]
    else:
        for w in range(W):
            out[w] &= base[w] & sigma_rows[sig, w]
    for p in range(n_ok):
        v = passed[p]
        out[v >> 5] |= np.uint32(1) << np.uint32(v & 31)
    if accepting[s] and sigma_end[sig]:
        for e in range(eos_ids.shape[0]):
            v = eos_ids[e]
            out[v >> 5] |= np.uint32(1) << np.uint32(v & 31)
    return n_pend


@_jit
def canon_row(out_i32, s, k, sig, spec, key_lo, key_hi, key, tag_bits, inner_cache, pending, base_buf, base_slot, C,
              banned_ptr, banned_ids, n_seg, start_row, sigma_rows, sigma_full, sigma_la, la_sets_idx, class_group,
              ctx_classes, accepting, sigma_end, eos_ids):
    """Allowed-token row of the factored canonical state ``(s, 0, k, σ)`` (paper 004 Eq. 5 with the
    implicit A_BPE of §6.5; same bits as ``FactoredCanonical._compute_row_numpy``):
    ``base[s] & ~banned[k] (& lookahead row of σ) | the special tokens of s that pass | EOS``.
    The per-call arguments come first; the rest (from ``C`` on) are fixed per automaton.

    Args:
        out_i32: ``int32[W]`` output row (overwritten).
        s: regex state; k: class of the last token (``k == C``: START, ``start_row`` replaces
            ``~banned[k]``); sig: σ index.
        spec: ``int64[n, 7]`` special-token tables of all signatures built so far, one after the other;
            the table of s is rows ``key_lo[key]:key_hi[key]`` (``int64[R]`` each). Columns ``SP_*``: token, lookahead
            class of its first character, whitespace-final index (-1: none), kind ``KIND_*``, argument
            (plain: bit σ' set = the successor with lookahead set σ' is bad; ctx: row of
            ``ctx_classes``; inner: row of ``inner_cache``), row of ``tag_bits`` (ctx: the successor's
            bad table), target regex state.
        tag_bits: ``int64[n_rows, C]`` (bit σ' set = (class, σ') bad in that bad table).
        inner_cache: ``int64[n_inner, 2]``: per σ' bit, verdict known / bad (byte-fallback tokens that
            open a character; filled in by the caller).
        pending: ``int64[m, 2]`` with ``m >=`` the number of inner rows of the table; on return its
            first rows hold the (spec row, σ') pairs the caller must decide.
        base_buf: ``uint32[R, W]`` the base rows (regular tokens) built so far; base_slot: ``int64[R']``,
            the row of each table key (``>= 0`` wherever ``key_lo`` is: built together).
        banned_ptr, banned_ids: the canonical filter's CSR (``int64[C*n_seg+1]`` offsets, ``uint16`` ids
            in ``n_seg`` segments of 65,536 ids per class; row k is contiguous).
        start_row: ``uint32[W]``; sigma_rows: ``uint32[nσ, W]``; sigma_full: ``bool[nσ]`` (σ holds every
            lookahead class: no row AND).
        sigma_la: ``bool[nσ, L]``; la_sets_idx: ``int64[C+1, J]`` (-1 = empty set); class_group:
            ``int64[C+1]``; ctx_classes: ``int64[n_ctx, n_groups]``.
        accepting: ``bool[S]``; sigma_end: ``bool[nσ]``; eos_ids: ``int64[e]`` (EOS allowed iff
            ``accepting[s] and sigma_end[sig]``).

    Returns:
        The number of pending pairs: inner tokens whose verdict is not in ``inner_cache`` yet; the
        caller decides them and sets their bits.
    """
    return _row_into(out_i32.view(np.uint32), s, k, sig, spec, key_lo[key], key_hi[key], tag_bits,
                     inner_cache, pending, base_buf[base_slot[key]], C, banned_ptr, banned_ids, n_seg, start_row,
                     sigma_rows, sigma_full, sigma_la, la_sets_idx, class_group, ctx_classes, accepting,
                     sigma_end, eos_ids)


@_jit
def canon_step(out_i32, row_i32, state, token, spec, key_lo, key_hi, key_of_s, tag_bits, inner_cache, pending,
               base_buf, base_slot, C, banned_ptr, banned_ids, n_seg, start_row, sigma_rows, sigma_full, sigma_la,
               la_sets_idx, class_group, ctx_classes, accepting, sigma_end, eos_ids, token_group, edge_ptr,
               edge_group, edge_next, tok_info, acc, has_acc, n_sig, NK, n_acc):
    """One decoding step of the factored canonical automaton: the successor of packed ``state`` after
    the non-EOS ``token`` and, in the same call, the row of that successor (:func:`canon_row`). Same
    results as ``FactoredCanonical.next_state`` followed by ``compute_row``.

    Args:
        out_i32: ``int32[W]`` receives the successor's row (when the status is >= 0).
        row_i32: ``int32[W]`` row of ``state`` (``token`` must have its bit set).
        state: packed ``((s * n_acc + a) * NK + kk) * n_sig + σ`` (kk = 0 for START, k + 1 for class k).
        token: token id (``0 <= token < V``, not EOS).
        spec, key_lo, key_hi, tag_bits, inner_cache, pending, base_buf ... eos_ids: as :func:`canon_row`;
        key_of_s: ``int64[S]`` table of each regex state (``key_lo[key] < 0``: not built yet).
        token_group: ``int32[V]``; edge_ptr: ``int64[S+1]``; edge_group: ``int32[E]`` (sorted per state);
            edge_next: ``int32[E]`` -- the token DFA M.
        tok_info: ``int32[V, 4]`` per token: whitespace-final index, byte of a byte-fallback token,
            context index, class (-1: none).
        acc: ``int32[n_acc, 256]`` byte-fallback acceptor (used iff ``has_acc``).

    Returns:
        ``(next_state, status)``: status >= 0 = the row is in ``out_i32`` with that many pending pairs;
        ``STEP_REJECT`` (next_state -1): not allowed; ``STEP_NEED_SPEC``: the successor's table is not
        built; ``STEP_NEED_PY``: the successor is inside a byte-fallback character (row in Python).
    """
    x = state // n_sig  # (the current σ does not enter the successor)
    kk = x % NK
    x //= NK
    a = x % n_acc
    s = x // n_acc
    if ((row_i32[token >> 5] >> (token & 31)) & 1) == 0:
        return -1, STEP_REJECT
    g = token_group[token]
    if g < 0:
        return -1, STEP_REJECT
    lo = edge_ptr[s]
    hi = edge_ptr[s + 1]
    while lo < hi:  # first edge with group >= g
        mid = (lo + hi) >> 1
        if edge_group[mid] < g:
            lo = mid + 1
        else:
            hi = mid
    if lo >= edge_ptr[s + 1] or edge_group[lo] != g:
        return -1, STEP_REJECT
    t = np.int64(edge_next[lo])
    k = C if kk == 0 else kk - 1
    j = tok_info[token, 0]
    nsig = la_sets_idx[k, j] if j >= 0 else 0
    b = tok_info[token, 1]
    a2 = 0
    if b >= 0 and has_acc:
        m = acc[a, b]
        a2 = m if m >= 0 else 0
    cj = tok_info[token, 2]
    cls = np.int64(tok_info[token, 3]) if cj < 0 else ctx_classes[cj, class_group[k]]
    nxt = ((t * n_acc + a2) * NK + (0 if cls == C else cls + 1)) * n_sig + nsig
    if a2 != 0:
        return nxt, STEP_NEED_PY
    key = key_of_s[t]
    if key_lo[key] < 0:
        return nxt, STEP_NEED_SPEC
    k2 = C if cls == C or cls < 0 else cls  # (cls -1 packs as START, as in FactoredCanonical.pack)
    n_pend = _row_into(out_i32.view(np.uint32), t, k2, nsig, spec, key_lo[key], key_hi[key], tag_bits,
                       inner_cache, pending, base_buf[base_slot[key]], C, banned_ptr, banned_ids, n_seg, start_row,
                       sigma_rows, sigma_full, sigma_la, la_sets_idx, class_group, ctx_classes, accepting,
                       sigma_end, eos_ids)
    return nxt, n_pend


# --------------------------------------------------------------------------------------------------
# canonical product: one state's special tokens, dead-end analysis
# --------------------------------------------------------------------------------------------------


@_jit
def sccs(cuts, succ):
    """Tarjan's strongly connected components, iterative, of the graph whose node ``v`` has the
    successors ``succ[cuts[v]:cuts[v+1]]`` (``int64``; visited in that order, roots in id order).
    Returns ``(comp_ptr int64[n_comp+1], nodes int64[n])``: component c is ``nodes[comp_ptr[c]:
    comp_ptr[c+1]]`` (in stack-pop order), components sinks first (reverse topological order)."""
    n = cuts.shape[0] - 1
    index = np.full(n, -1, np.int64)
    low = np.zeros(n, np.int64)
    on = np.zeros(n, np.bool_)
    stack = np.empty(n, np.int64)
    sp = 0
    work_v = np.empty(n, np.int64)
    work_i = np.empty(n, np.int64)
    nodes = np.empty(n, np.int64)
    comp_ptr = np.zeros(n + 1, np.int64)
    n_out = 0
    n_comp = 0
    counter = 0
    for root in range(n):
        if index[root] >= 0:
            continue
        wp = -1
        w = root
        while True:
            if w >= 0:  # visit w: number it, push it on the component stack and the DFS stack
                index[w] = counter
                low[w] = counter
                counter += 1
                stack[sp] = w
                sp += 1
                on[w] = True
                wp += 1
                work_v[wp] = w
                work_i[wp] = cuts[w]
                w = -1
            if wp < 0:
                break
            v = work_v[wp]
            i = work_i[wp]
            if i < cuts[v + 1]:
                work_i[wp] = i + 1
                x = succ[i]
                if index[x] < 0:
                    w = x
                elif on[x] and index[x] < low[v]:
                    low[v] = index[x]
            else:
                wp -= 1
                if wp >= 0:
                    u = work_v[wp]
                    if low[v] < low[u]:
                        low[u] = low[v]
                if low[v] == index[v]:
                    while True:
                        sp -= 1
                        z = stack[sp]
                        on[z] = False
                        nodes[n_out] = z
                        n_out += 1
                        if z == v:
                            break
                    n_comp += 1
                    comp_ptr[n_comp] = n_out
    return comp_ptr[: n_comp + 1], nodes


@_jit
def spec_table(gs, ts, spec_group, st, tag, tag_row_arr, tag_bits, tclass, out):
    """The special-token table of one regex state (:meth:`.canonical_product.FactoredCanonical.
    _fast_specials`): for each special token whose group ``spec_group[r]`` is among the state's edge
    groups ``gs`` (sorted; targets ``ts``), a row of ``out`` (``int64[n_spec, 7]``): the static columns
    ``st[r]``, ``SP_TGT`` = the target, and for ``KIND_PLAIN`` tokens ``SP_ARG`` = ``tag_bits[row of the
    target's tag, class of the token]``, for ``KIND_CTX`` tokens ``SP_ROW`` = that row. Returns the
    number of rows written, or -1 when a target's tag has no ``tag_bits`` row yet (the caller adds it
    and calls again)."""
    m = 0
    E = gs.shape[0]
    for r in range(spec_group.shape[0]):
        g = spec_group[r]
        lo = np.searchsorted(gs, g)
        if lo >= E or gs[lo] != g:
            continue
        t = ts[lo]
        tr = tag_row_arr[tag[t]]
        if tr < 0 or tr >= tag_bits.shape[0]:  # (a row added after the caller's snapshot of tag_bits)
            return -1
        for c in range(7):
            out[m, c] = st[r, c]
        out[m, SP_TGT] = t
        kind = st[r, SP_KIND]
        if kind == KIND_PLAIN:
            k = tclass[st[r, SP_TOK]]
            out[m, SP_ARG] = tag_bits[tr, k if k > 0 else 0]
        elif kind == KIND_CTX:
            out[m, SP_ROW] = tr
        m += 1
    return m


@_jit
def _or_group_tokens(out_u32, g, tg, g_toks, g_ptr, regular, tclass, tab):
    """OR into ``out_u32`` (``uint32[W]``) the regular tokens of group g, less, when ``tg != 0``, those
    whose class is bad in bad table ``tg`` (``tab[tg, tclass[v]]``)."""
    for p in range(g_ptr[g], g_ptr[g + 1]):
        v = g_toks[p]
        if not regular[v]:
            continue
        if tg != 0:
            c = tclass[v]
            if c >= 0 and tab[tg, c]:
                continue
        out_u32[v >> 5] |= np.uint32(1) << np.uint32(v & 31)


@_jit
def pack_groups(groups, gtags, g_toks, g_ptr, regular, tclass, tab, rows_u32):
    """Row ``i`` of ``rows_u32`` (``uint32[n, W]``, zeroed by the caller) = the regular tokens
    (``regular[v]``) of group ``groups[i]`` as a bit row (group g's tokens ``g_toks[g_ptr[g]:g_ptr[g+1]]``),
    less, when ``gtags[i] != 0``, those whose class is bad in that successor's bad table
    (``tab[gtags[i], tclass[v]]``: :func:`regular_row`'s rule for an edge to a target with a bad table)."""
    for i in range(groups.shape[0]):
        _or_group_tokens(rows_u32[i], groups[i], gtags[i], g_toks, g_ptr, regular, tclass, tab)


@_jit
def regular_row(out_u32, gs, etags, edge_slot, grp_rows, g_toks, g_ptr, regular, tclass, tab):
    """The base row of one regex state (the regular tokens it allows whose successor is good with σ = ALL;
    ``_Analysis.regular_row_groups`` is the numpy reference): bit v of ``out_u32`` (``uint32[W]``,
    overwritten) is set iff v is in a group ``gs[e]`` (the state's edge groups) with ``regular[v]`` and,
    where the edge's target has a bad table (``etags[e] != 0``), its class is not bad there
    (``tab[etags[e], tclass[v]]``, ``bool[n_tags + 1, C]``: the σ = ALL rows per tag). Groups' tokens:
    ``g_toks[g_ptr[g]:g_ptr[g+1]]``. An edge with a packed row (``edge_slot[e] >= 0``: row of ``grp_rows``,
    ``uint32[n, W]``, from :func:`pack_groups` for that group and tag) is OR-ed in (W words); the others
    cost a pass over their group's tokens."""
    W = out_u32.shape[0]
    for w in range(W):
        out_u32[w] = 0
    for e in range(gs.shape[0]):
        r = edge_slot[e]
        if r >= 0:
            for w in range(W):
                out_u32[w] |= grp_rows[r, w]
        else:
            _or_group_tokens(out_u32, gs[e], etags[e], g_toks, g_ptr, regular, tclass, tab)


@_jit
def group_tokens(token_group, G):
    """Tokens by group (a counting sort): ``(g_toks int64[n], g_ptr int64[G+1])`` -- the tokens ``v``
    with ``token_group[v] >= 0``, by group, ascending ids within a group (= a stable argsort of
    ``token_group``); group g's tokens are ``g_toks[g_ptr[g]:g_ptr[g+1]]``. (Any int array of keys in
    ``0..G-1`` or -1: :func:`entering_classes` sorts edges by target with it.)"""
    g_ptr = np.zeros(G + 1, np.int64)
    for v in range(token_group.shape[0]):
        g = token_group[v]
        if g >= 0:
            g_ptr[g + 1] += 1
    for g in range(G):
        g_ptr[g + 1] += g_ptr[g]
    fill = g_ptr[:G].copy()
    g_toks = np.empty(g_ptr[G], np.int64)
    for v in range(token_group.shape[0]):
        g = token_group[v]
        if g >= 0:
            g_toks[fill[g]] = v
            fill[g] += 1
    return g_toks, g_ptr


@_jit
def group_rows(row_ptr, row_groups, g_toks, g_ptr, out_u32):
    """Bit rows of token sets given as group lists (non-canonical rows, :func:`.compiled.rows_for_groups`):
    row i of ``out_u32`` (``uint32[R, W]``, zeroed by the caller) gets the tokens of the groups
    ``row_groups[row_ptr[i]:row_ptr[i+1]]`` (group g's tokens ``g_toks[g_ptr[g]:g_ptr[g+1]]``, from
    :func:`group_tokens`). Work: one bit set per (row, token of its groups)."""
    for i in range(row_ptr.shape[0] - 1):
        for p in range(row_ptr[i], row_ptr[i + 1]):
            g = row_groups[p]
            for q in range(g_ptr[g], g_ptr[g + 1]):
                v = g_toks[q]
                out_u32[i, v >> 5] |= np.uint32(1) << np.uint32(v & 31)


@_jit
def group_classes(g_toks, g_ptr, tclass, ctx_j, ctx_cls_ptr, ctx_cls, C, need):
    """The classes of each group's tokens (:meth:`.canonical_product._Analysis._entering_table`), as a
    CSR ``(ptr int64[G+1], classes int64[n])``, each class once per group (in first-seen order): the
    class ``tclass[v]`` of each token and, for a context-dependent token (``ctx_j[v] >= 0``), every
    class it can reach (``ctx_cls[ctx_cls_ptr[j]:ctx_cls_ptr[j+1]]``, j = ``ctx_j[v]``); an empty list for
    a group with ``need[g]`` False (``bool[G]``: the caller never reads it). The output is sized once by a
    first pass (no growth). Entries are appended inline, here and in :func:`entering_classes`: a shared
    helper, even with ``inline="always"``, made the kernel several times slower."""
    G = g_ptr.shape[0] - 1
    bound = 0
    for g in range(G):
        if need[g]:
            bound += g_ptr[g + 1] - g_ptr[g]
            for x in range(g_ptr[g], g_ptr[g + 1]):
                j = ctx_j[g_toks[x]]
                if j >= 0:
                    bound += ctx_cls_ptr[j + 1] - ctx_cls_ptr[j]
    stamp = np.full(C, -1, np.int64)
    out = np.empty(bound, np.int64)
    ptr = np.zeros(G + 1, np.int64)
    m = 0
    for g in range(G):
        if not need[g]:
            ptr[g + 1] = m
            continue
        for x in range(g_ptr[g], g_ptr[g + 1]):
            v = g_toks[x]
            c = np.int64(tclass[v])
            if stamp[c] != g:
                stamp[c] = g
                out[m] = c
                m += 1
            j = ctx_j[v]
            if j >= 0:
                for y in range(ctx_cls_ptr[j], ctx_cls_ptr[j + 1]):
                    c = ctx_cls[y]
                    if stamp[c] != g:
                        stamp[c] = g
                        out[m] = c
                        m += 1
        ptr[g + 1] = m
    return ptr, out[:m].copy()


@_jit
def group_hash_sums(g_toks, g_ptr, tok_hash):
    """``uint64[2, G]``: per group (tokens ``g_toks[g_ptr[g]:g_ptr[g+1]]``) the sums of its tokens' two
    random values ``tok_hash[:, v]`` (``uint64[2, V]``), wrapping (:meth:`.verdict_cache.VerdictCache.
    group_hashes`; one pass, no gathered copy of the values)."""
    G = g_ptr.shape[0] - 1
    out = np.zeros((2, G), np.uint64)
    for g in range(G):
        a = np.uint64(0)
        b = np.uint64(0)
        for x in range(g_ptr[g], g_ptr[g + 1]):
            v = g_toks[x]
            a += tok_hash[0, v]
            b += tok_hash[1, v]
        out[0, g] = a
        out[1, g] = b
    return out


@_jit
def entering_classes(en, eg, gc_ptr, g_cls, S, C):
    """Per state, the union of the classes of the groups on its incoming edges (edge e: into state
    ``en[e]``, group ``eg[e]``; group g's classes ``g_cls[gc_ptr[g]:gc_ptr[g+1]]``), as a CSR ``(ptr
    int64[S+1], classes int64[n])`` sorted within each state (the ``np.unique`` of (state, class) pairs
    in :meth:`.canonical_product._Analysis._entering_table`). The output is sized once by a first pass."""
    order, eptr = group_tokens(en, S)  # the edges by target state
    bound = 0
    for e in range(eg.shape[0]):
        bound += gc_ptr[eg[e] + 1] - gc_ptr[eg[e]]
    stamp = np.full(C, -1, np.int64)
    out = np.empty(bound, np.int64)
    ptr = np.zeros(S + 1, np.int64)
    m = 0
    for s in range(S):
        start = m
        for x in range(eptr[s], eptr[s + 1]):
            g = eg[order[x]]
            for y in range(gc_ptr[g], gc_ptr[g + 1]):
                c = g_cls[y]
                if stamp[c] != s:
                    stamp[c] = s
                    out[m] = c
                    m += 1
        out[start:m].sort()
        ptr[s + 1] = m
    return ptr, out[:m].copy()


@_jit
def witness_table(ok, token_group, la_first, est_ban, out):
    """Dead-end analysis witnesses (:meth:`.canonical_product._Analysis._witness_table`): for each
    (group, lookahead class) the token ``v`` with ``ok[v]`` of lowest ``est_ban[v]`` (lowest id on ties),
    written into ``out`` (``int32[G, L]``, filled with -1 by the caller). One pass over the vocabulary."""
    for v in range(ok.shape[0]):
        if not ok[v]:
            continue
        g = token_group[v]
        c = la_first[v]
        cur = out[g, c]
        if cur < 0 or est_ban[v] < est_ban[cur]:
            out[g, c] = v


@_jit
def witness_clear(bt, wc, tt, tab, tclass, las, est_ban, max_w, idx, out):
    """Dead-end analysis, the witness step of :meth:`.canonical_product._Analysis.state_bad` for one
    lookahead set: the witnesses are the tokens ``wc[e, l]`` (``int32[E, L]``: the best token of edge e's
    group per lookahead class, -1 none) for ``l`` in ``las`` whose successor is good (``tt[e]`` = the tag
    of edge e's target, 0 = all good, else ``tab[tt[e], tclass[w]]`` says the token's class is bad
    there); of these, the ``max_w`` with the lowest ``est_ban`` (lowest id on ties) are tried in that
    order, and each keeps only the classes that ban it (``bt``: word-major banned bits ``int32[W, C]``) of
    the candidate class ids ``idx`` (``int64``, read only); ``est_ban[w] == 0`` says no class bans w (then
    none is kept). Returns ``n_left``: the classes left are ``out[:n_left]`` (``out``: ``int64``, at least
    ``len(idx)``; ``idx`` itself is allowed), in order."""
    E = wc.shape[0]
    n = 0
    cand = np.empty(E * las.shape[0], np.int64)  # (est_ban << 32 | w: sorts in the order they are tried)
    for e in range(E):
        t = tt[e]
        for li in range(las.shape[0]):
            w = wc[e, las[li]]
            if w < 0:
                continue
            if t != 0 and tab[t, tclass[w]]:
                continue
            if est_ban[w] == 0:  # a token no class bans: every class is cleared
                return 0
            cand[n] = (np.int64(est_ban[w]) << 32) | w
            n += 1
    m = idx.shape[0]
    if n == 0:
        for i in range(m):
            out[i] = idx[i]
        return m
    keys = cand[:n]
    keys.sort()
    r = 0
    prev = np.int64(-1)
    for x in range(n):
        if keys[x] == prev:  # (each witness once)
            continue
        prev = keys[x]
        if r == max_w or m == 0:
            break
        w = keys[x] & np.int64(0xFFFFFFFF)
        wd = w >> 5
        bit = w & 31
        j = 0
        for i in range(m):
            k = idx[i] if r == 0 else out[i]
            if (bt[wd, k] >> bit) & 1:
                out[j] = k
                j += 1
        m = j
        r += 1
    return m


@_jit
def allows_some(bt, few_ok, few_ptr, few_tok, heavy_pos, heavy_rows, row, words, k_arr, out):
    """Dead-end analysis (:meth:`.canonical_product.CanonHelper.allows_some`): set ``out[i]`` when class
    ``k_arr[i]`` bans not every token of the bit row ``row`` (``int32[W]``), i.e. some word ``w`` of
    ``words`` (the nonzero words of ``row``) has ``~bt[w, k_arr[i]] & row[w] != 0``. ``bt``: the
    word-major banned bits ``int32[W, C]``. A class that allows few tokens (``few_ok[k]``: they are
    ``few_tok[few_ptr[k]:few_ptr[k + 1]]``) is decided by reading ``row`` at those tokens. A class that
    bans many (``heavy_pos[k] >= 0``: its banned bits are the contiguous row ``heavy_rows[heavy_pos[k]]``,
    ``int32[n_heavy, W]``) is decided alone, along that row. For the others: words outer,
    still-undecided classes inner (compacted as they clear), so each pass reads one row of ``bt``;
    stops once every class is cleared."""
    n = k_arr.shape[0]
    rem = np.empty(n, np.int64)
    for i in range(n):
        rem[i] = i
    _clear_by_words(bt, few_ok, few_ptr, few_tok, heavy_pos, heavy_rows, row, words, k_arr, rem, n, out)


@_jit
def _clear_by_words(bt, few_ok, few_ptr, few_tok, heavy_pos, heavy_rows, row, words, k_arr, rem, nrem, out):
    """The loop of :func:`allows_some` over the classes ``k_arr[rem[:nrem]]`` (``rem`` is reordered).
    A class that bans every token of ``row`` reads all its words: for the heavy classes (those left
    after the witnesses, mostly) one contiguous row each instead of one cache line per word of ``bt``."""
    j = 0
    for r in range(nrem):  # the classes with their allowed tokens listed, and the heavy ones: decided here
        i = rem[r]
        k = k_arr[i]
        if few_ok[k]:
            for x in range(few_ptr[k], few_ptr[k + 1]):
                t = few_tok[x]
                if row[t >> 5] & (np.int32(1) << np.int32(t & 31)):
                    out[i] = True
                    break
        elif heavy_pos[k] >= 0:
            h = heavy_pos[k]
            for wi in range(words.shape[0]):
                w = words[wi]
                if (row[w] & ~heavy_rows[h, w]) != 0:
                    out[i] = True
                    break
        else:
            rem[j] = i
            j += 1
    nrem = j
    for wi in range(words.shape[0]):
        if nrem == 0:
            break
        w = words[wi]
        rw = row[w]
        if rw == 0:
            continue
        j = 0
        for r in range(nrem):
            i = rem[r]
            if ((~bt[w, k_arr[i]]) & rw) != 0:
                out[i] = True
            else:
                rem[j] = i
                j += 1
        nrem = j


@_jit
def _special_select(x, m, stamp_tgt, sp_tok_e, sp_group_e, lf_e, cls_e, opens_e, j_e, ctxj_e, sigma_la_row, tag,
                    tab, vt, vg, jw, dj, good_t, row_reg, row_all):
    """:func:`special_prep`'s test of the special token of est index ``x`` (its group is one of the
    state's): returns its position in ``vt`` (written there), -2 when it opens a byte-fallback character,
    -1 when not selected."""
    lf = lf_e[x]
    if cls_e[x] < 0 or lf < 0 or not sigma_la_row[lf]:
        return -1
    if opens_e[x]:
        return -2
    v = sp_tok_e[x]
    t = stamp_tgt[sp_group_e[x]]
    vt[m] = v
    vg[m] = t
    jw[m] = j_e[x]
    co = j_e[x] < 0 and ctxj_e[x] >= 0
    dj[m] = ctxj_e[x] if co else -1
    good = False
    if co:
        tg = tag[t]
        good = tg == 0 or not tab[tg, cls_e[x]]
        if good:
            row_reg[v >> 5] |= np.uint32(1) << np.uint32(v & 31)
    good_t[m] = good
    row_all[v >> 5] |= np.uint32(1) << np.uint32(v & 31)
    return m


@_jit
def _special_by_id(xs, ps, sp_tok_e, sp_group_e, stamp_tgt, id_tok, id_pos, inner_tok, inner_tgt):
    """:func:`special_prep`'s outputs by token id: for the special tokens of est indices ``xs`` (in
    increasing token id) and their results ``ps`` (:func:`_special_select`), the selected ones with their
    positions into ``id_tok`` / ``id_pos`` and those that open a byte-fallback character with their
    targets into ``inner_tok`` / ``inner_tgt``. Returns the number of the latter."""
    k = 0
    n_inner = 0
    for r in range(xs.shape[0]):
        x = xs[r]
        p = ps[r]
        if p >= 0:
            id_tok[k] = sp_tok_e[x]
            id_pos[k] = p
            k += 1
        elif p == -2:
            inner_tok[n_inner] = sp_tok_e[x]
            inner_tgt[n_inner] = stamp_tgt[sp_group_e[x]]
            n_inner += 1
    return n_inner


@_jit
def special_prep(gs, ts, stamp, stamp_tgt, call, tag, tab, sp_tok_e, sp_group_e, sp_id_to_e, grp_ptr, grp_x,
                 lf_e, cls_e, opens_e, j_e, ctxj_e, sigma_la_row, vt, vg, jw, dj, good_t, id_tok, id_pos,
                 inner_tok, inner_tgt, row_reg, row_all):
    """The per-state part of :meth:`.canonical_product._Analysis.specials_clear` in one pass (its numpy
    reference: the same arrays): the special tokens allowed at a regex state (edge groups ``gs``, targets
    ``ts``) that are valid, have a first lookahead class in σ (``sigma_la_row: bool[L]``) and do not open a
    byte-fallback character, in increasing (estimated ban count, id) order: ``sp_tok_e`` / ``sp_group_e``
    are the analysis' special tokens and their groups in that order, ``sp_id_to_e`` maps their id order
    to it, ``grp_ptr`` / ``grp_x`` list each group's tokens by est index (CSR, ascending); ``lf_e``,
    ``cls_e``, ``j_e``, ``ctxj_e`` are their first lookahead class, class, whitespace-final index and
    context index (``la_first``, ``tclass``, ``j_of``, ``ctx_j`` in est order: read in sequence, not at
    random over the vocabulary) and ``opens_e`` whether they open a byte-fallback character. ``stamp`` /
    ``stamp_tgt`` (``int64[G]``, kept by the caller between calls) mark the state's groups with the call
    number ``call`` (> every earlier one) and their targets. When the state's groups hold under a quarter
    of the special tokens (inside a multi-byte character, keys, punctuation), only theirs are visited
    (sorted, so the order is the same); else all are scanned.

    Writes (arrays of at least ``len(sp_tok_e)`` entries): ``vt, vg, jw`` (token, target, whitespace-final
    index), ``dj`` (the context index of a context-dependent token that is not whitespace-final, else -1),
    ``good_t`` (for those: the target's bad table, σ = ALL row ``tab[tag[target]]``, leaves the token's
    class good), ``id_tok, id_pos`` (the same
    tokens by id, and their positions in ``vt``), ``inner_tok, inner_tgt`` (the byte-fallback tokens that
    open a character, by id), and ``row_reg`` / ``row_all`` (``uint32[W]``, zeroed by the caller): the
    ``(dj >= 0) & good_t`` tokens and all of ``vt`` as bit rows.

    Returns:
        ``(n, n_inner)``: entries written to ``vt`` ... and to ``inner_tok``.
    """
    n_sp = sp_tok_e.shape[0]
    tot = 0
    for e in range(gs.shape[0]):
        stamp[gs[e]] = call
        stamp_tgt[gs[e]] = ts[e]
        tot += grp_ptr[gs[e] + 1] - grp_ptr[gs[e]]
    m = 0
    if 4 * tot < n_sp:
        xs = np.empty(tot, np.int64)
        k = 0
        for e in range(gs.shape[0]):
            for i in range(grp_ptr[gs[e]], grp_ptr[gs[e] + 1]):
                xs[k] = grp_x[i]
                k += 1
        xs.sort()
        pos = np.empty(tot, np.int64)
        for i in range(tot):
            p = _special_select(xs[i], m, stamp_tgt, sp_tok_e, sp_group_e, lf_e, cls_e, opens_e, j_e, ctxj_e,
                                sigma_la_row, tag, tab, vt, vg, jw, dj, good_t, row_reg, row_all)
            pos[i] = p
            if p >= 0:
                m += 1
        # the same tokens by id
        toks = np.empty(tot, np.int64)
        for i in range(tot):
            toks[i] = sp_tok_e[xs[i]]
        by_tok = np.argsort(toks)
        return m, _special_by_id(xs[by_tok], pos[by_tok], sp_tok_e, sp_group_e, stamp_tgt, id_tok, id_pos, inner_tok,
                                 inner_tgt)
    pos_of = np.full(n_sp, -1, np.int64)  # by est index: position in vt, or -2 (inner), -1 (not selected)
    for x in range(n_sp):
        if stamp[sp_group_e[x]] != call:
            continue
        p = _special_select(x, m, stamp_tgt, sp_tok_e, sp_group_e, lf_e, cls_e, opens_e, j_e, ctxj_e, sigma_la_row,
                            tag, tab, vt, vg, jw, dj, good_t, row_reg, row_all)
        pos_of[x] = p
        if p >= 0:
            m += 1
    return m, _special_by_id(sp_id_to_e, pos_of[sp_id_to_e], sp_tok_e, sp_group_e, stamp_tgt, id_tok, id_pos,
                             inner_tok, inner_tgt)


@_jit
def grouped_allows_some(bt, few_ok, few_ptr, few_tok, heavy_pos, heavy_rows, row, words, nd_ptr, nd_tok, groups, k_arr,
                        k_u, out):
    """Dead-end analysis, the regular-like special tokens (:meth:`.canonical_product._Analysis.
    specials_clear`): set ``out[i]`` when class ``k_arr[i]`` (context group ``g = groups[k_u[i]]``) bans
    not every token of ``row`` less the tokens ``nd_tok[nd_ptr[g]:nd_ptr[g + 1]]`` (those that do not
    act like regular tokens in group g). ``row``: ``int32[W]`` bit row of the candidate tokens (changed
    during the call and restored), ``words``: its nonzero words; ``bt``: word-major banned bits
    ``int32[W, C]``; ``few_ok, few_ptr, few_tok, heavy_pos, heavy_rows``: as in :func:`allows_some`. Per group: clear the
    group's exceptions in ``row``, then :func:`allows_some`'s loop
    over the group's classes not yet set, then restore ``row``."""
    U = groups.shape[0]
    n = k_arr.shape[0]
    cleared = np.empty(nd_tok.shape[0] + 1, np.int64)
    rem = np.empty(n, np.int64)
    # the classes bucketed by group (counting sort)
    start = np.zeros(U + 1, np.int64)
    for i in range(n):
        start[k_u[i] + 1] += 1
    for u in range(U):
        start[u + 1] += start[u]
    fill = start[:U].copy()
    by_u = np.empty(n, np.int64)
    for i in range(n):
        by_u[fill[k_u[i]]] = i
        fill[k_u[i]] += 1
    for u in range(U):
        g = groups[u]
        nrem = 0
        for x in range(start[u], start[u + 1]):
            i = by_u[x]
            if not out[i]:
                rem[nrem] = i
                nrem += 1
        if nrem == 0:
            continue
        nc = 0
        for x in range(nd_ptr[g], nd_ptr[g + 1]):
            t = nd_tok[x]
            bit = np.int32(1) << np.int32(t & 31)
            if row[t >> 5] & bit:
                row[t >> 5] &= ~bit
                cleared[nc] = t
                nc += 1
        _clear_by_words(bt, few_ok, few_ptr, few_tok, heavy_pos, heavy_rows, row, words, k_arr, rem, nrem, out)
        for x in range(nc):
            t = cleared[x]
            row[t >> 5] |= np.int32(1) << np.int32(t & 31)


@_jit
def _pair_good(bt, tclass, ctx_j, ctx_classes, la_sets_idx, tabs, tab_of, vt, jw, r, k, g, C):
    """Token ``vt[r]`` after class k (context group g): allowed and with a good successor (see
    :func:`pairs_clear`)."""
    v = vt[r]
    if (bt[v >> 5, k] >> (v & 31)) & 1:
        return False
    ns = 0
    if jw[r] >= 0:
        ns = la_sets_idx[k, jw[r]]
        if ns < 0:
            return False
    ti = tab_of[r]
    if ti >= 0:
        j2 = ctx_j[v]
        cv = np.int64(tclass[v]) if j2 < 0 else np.int64(ctx_classes[j2, g])
        if cv < 0:
            cv += C
        if tabs[ti, ns, cv]:
            return False
    return True


@_jit
def pairs_clear(bt, tclass, ctx_j, ctx_classes, class_group, la_sets_idx, tabs, tab_of, vt, jw, kk, dflt_j, nd_ptr,
                nd_tok, id_tok, id_r, out):
    """Dead-end analysis, the per-pair path of special tokens (:meth:`.canonical_product._Analysis.
    _pairs_clear`): for each class ``kk[i]`` with ``out[i]`` unset, set it when some token ``vt[r]`` is
    not banned after the class (``bt``: word-major banned bits ``int32[W, C]``) and its successor is
    good: lookahead-set index ``la_sets_idx[k, jw[r]]`` for whitespace-final tokens (``jw[r] >= 0``;
    -1 = empty set: never good) else 0 (ALL); class reached ``tclass[v]``, or
    ``ctx_classes[ctx_j[v], class_group[k]]`` for context-dependent tokens (negative indices wrap like
    numpy's); good unless ``tabs[tab_of[r], σ, class]`` (``tab_of[r] < 0``: the target's table is all
    good).

    Tokens with ``dflt_j[r] >= 0`` act like regular tokens in every context group except where they are
    an exception (``nd_tok[nd_ptr[g]:nd_ptr[g + 1]]``, token ids; :func:`grouped_allows_some` tests them
    elsewhere), so a class of group g tries the tokens with ``dflt_j[r] < 0`` and the exceptions of g
    present in ``vt`` (looked up by binary search in ``id_tok``: the tokens of ``vt`` sorted by id, with
    their positions ``id_r``; once per group), merged in the given order (likely witnesses first),
    stopping at the first good one."""
    C = bt.shape[1]
    n = vt.shape[0]
    base = np.empty(n, np.int64)
    nb = 0
    for r in range(n):
        if dflt_j[r] < 0:
            base[nb] = r
            nb += 1
    G = nd_ptr.shape[0] - 1
    ex_lo = np.full(G, -1, np.int64)
    ex_hi = np.full(G, -1, np.int64)
    ex = np.empty(0, np.int64)
    for i in range(kk.shape[0]):
        if out[i]:
            continue
        k = kk[i]
        g = class_group[k]
        if ex_lo[g] < 0:  # this group's exceptions present in vt, sorted by position r
            found = np.empty(nd_ptr[g + 1] - nd_ptr[g], np.int64)
            f = 0
            for x in range(nd_ptr[g], nd_ptr[g + 1]):
                t = nd_tok[x]
                lo = np.searchsorted(id_tok, t)
                if lo < n and id_tok[lo] == t and dflt_j[id_r[lo]] >= 0:
                    found[f] = id_r[lo]
                    f += 1
            found = np.sort(found[:f])
            ex_lo[g] = ex.shape[0]
            ex = np.concatenate((ex, found))
            ex_hi[g] = ex.shape[0]
        a = 0
        b = ex_lo[g]
        b_end = ex_hi[g]
        while a < nb or b < b_end:
            if b >= b_end or (a < nb and base[a] < ex[b]):
                r = base[a]
                a += 1
            else:
                r = ex[b]
                b += 1
            if _pair_good(bt, tclass, ctx_j, ctx_classes, la_sets_idx, tabs, tab_of, vt, jw, r, k, g, C):
                out[i] = True
                break


# --------------------------------------------------------------------------------------------------
# warm-up
# --------------------------------------------------------------------------------------------------

_WARM = False
_WARM_LOCK = threading.Lock()


@_jit
def signatures(edge_ptr, edge_group, edge_tag):
    """:func:`.canonical_product._signatures`: ``int32[S]``, each state's number among the distinct
    sequences (edge groups, successor tags) of its edges (``edge_ptr int64[S+1]``, ``edge_group int32[E]``,
    ``edge_tag int64[E]``), numbered in order of first appearance; ``None`` when two different sequences
    share their hashes (the caller then numbers them without hashing). Two hashes and the edge count per
    state, numbered by :func:`first_keys`, then every state compared edge by edge with the first of its
    number."""
    S = edge_ptr.shape[0] - 1
    h1 = np.empty(S, np.uint64)
    h2 = np.empty(S, np.uint64)
    cnt = np.empty(S, np.int64)
    for s in range(S):
        a, b = edge_ptr[s], edge_ptr[s + 1]
        x = np.uint64(0xCBF29CE484222325)
        y = np.uint64(0x84222325CBF29CE4)
        for e in range(a, b):
            x = (x ^ np.uint64(edge_group[e])) * np.uint64(0x100000001B3)
            x = (x ^ np.uint64(edge_tag[e])) * np.uint64(0x100000001B3)
            y = (y + np.uint64(edge_group[e]) * np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
            y = y ^ (np.uint64(edge_tag[e]) * np.uint64(0x94D049BB133111EB))
        h1[s], h2[s], cnt[s] = x, y, b - a
    inv, m = first_keys(h1, h2, cnt)
    first = np.full(m, -1, np.int64)
    out = np.empty(S, np.int32)
    for s in range(S):
        r = first[inv[s]]
        out[s] = inv[s]
        if r < 0:
            first[inv[s]] = s
            continue
        ra, a = edge_ptr[r], edge_ptr[s]
        for k in range(edge_ptr[s + 1] - a):
            if edge_group[ra + k] != edge_group[a + k] or edge_tag[ra + k] != edge_tag[a + k]:
                return None
    return out


@_jit
def content_key(s, edge_ptr, edge_group, edge_next, tag, gh, mul):
    """The edge part of a state's cross-compile verdict key (:mod:`.verdict_cache`): over the edges of
    regex state ``s`` (CSR ``edge_ptr``, ``edge_group``, ``edge_next``), the sums (wrapping ``uint64``) of
    ``gh[i, group] * mul[i, tag[next]]`` for i = 0, 1 (tag 0: multiplier 1). Returns the two sums."""
    h0 = np.uint64(0)
    h1 = np.uint64(0)
    for e in range(edge_ptr[s], edge_ptr[s + 1]):
        g = edge_group[e]
        t = tag[edge_next[e]]
        if t == 0:
            h0 += gh[0, g]
            h1 += gh[1, g]
        else:
            h0 += gh[0, g] * mul[0, t]
            h1 += gh[1, g] * mul[1, t]
    return h0, h1


@_jit
def _memo_slot(mkeys, mused, k0, k1, k2):
    """Open addressing (linear probing) in the table ``mkeys`` (``uint64[cap, 3]``, cap a power of two;
    ``mused``: ``bool[cap]``): the slot holding the key ``(k0, k1, k2)``, else ``-1 - `` the free slot
    where it would go (the table is never full: see :func:`memo_put`)."""
    mask = mkeys.shape[0] - 1
    h = (k0 * np.uint64(0x9E3779B97F4A7C15)) ^ k1 ^ (k2 * np.uint64(0xBF58476D1CE4E5B9))
    h = np.int64((h ^ (h >> np.uint64(29))) & np.uint64(mask))
    while mused[h]:
        if mkeys[h, 0] == k0 and mkeys[h, 1] == k1 and mkeys[h, 2] == k2:
            return h
        h = (h + 1) & mask
    return -1 - h


@_jit
def memo_put(mkeys, mvals, mused, k0, k1, k2, v):
    """Store ``v`` under the key ``(k0, k1, k2)`` (uint64) in the table of :func:`_memo_slot`
    (``mvals``: ``int64[cap]``). The caller sizes it to at least twice the keys it will hold."""
    h = _memo_slot(mkeys, mused, k0, k1, k2)
    if h < 0:
        h = -1 - h
        mused[h] = True
        mkeys[h, 0] = k0
        mkeys[h, 1] = k1
        mkeys[h, 2] = k2
    mvals[h] = v


@_jit
def witness_verdict(s, edge_ptr, edge_group, edge_next, tag, wv):
    """Whether the witness step of :meth:`.canonical_product._Analysis.state_bad` alone clears every class
    of state s under every lookahead set σ it can hold (then its verdict is None: all good), computed as
    there: per σ (skipped when s accepts and σ holds END, and σ != ALL unless a whitespace-final token
    enters s), :func:`witness_clear` with the witness table's rows of s's edge groups and the tags of
    their targets. False as soon as some class is left (or σ has no lookahead class: state_bad then
    checks rows). The classes of s: its entering classes (``ent_ptr``/``ent_cls`` CSR) or, for a state
    entered by every class (``ent_wide``), all classes of σ inside or outside a character
    (``wide_ptr[2σ + mid]`` CSR into ``wide_cls``), each among the classes of ``cls_base`` and
    ``sigma_cls``. ``wv``: ``(best int32[G, L], tab bool[T, C] (the tag table), tclass, las_ptr int64[nσ+1],
    las int64[n], est_ban int32[V], bt int32[W, C], max_w, accepting bool[S], ws_in bool[S], mid bool[S],
    sigma_end bool[nσ], sigma_cls bool[nσ, C], cls_base bool[2, C] (boundary, mid), ent_ptr int64[S+1],
    ent_cls int64[n], ent_wide bool[S], buf int64[C] (scratch), wide_ptr int64[2nσ+1], wide_cls int64[n])``."""
    best, tab, tclass, las_ptr, las, est_ban, bt, max_w = wv[0], wv[1], wv[2], wv[3], wv[4], wv[5], wv[6], wv[7]
    accepting, ws_in, mid, sigma_end, sigma_cls, cls_base = wv[8], wv[9], wv[10], wv[11], wv[12], wv[13]
    ent_ptr, ent_cls, ent_wide, buf, wide_ptr, wide_cls = wv[14], wv[15], wv[16], wv[17], wv[18], wv[19]
    nsig = las_ptr.shape[0] - 1
    a, b = edge_ptr[s], edge_ptr[s + 1]
    mrow = 1 if mid[s] else 0
    wc = best[edge_group[a:b]]
    tt = tag[edge_next[a:b]]
    for i in range(nsig):
        if accepting[s] and sigma_end[i]:
            continue
        if i != 0 and not ws_in[s]:
            continue
        if ent_wide[s]:
            idx = wide_cls[wide_ptr[2 * i + mrow] : wide_ptr[2 * i + mrow + 1]]
        else:
            m = 0
            for x in range(ent_ptr[s], ent_ptr[s + 1]):
                k = ent_cls[x]
                if cls_base[mrow, k] and sigma_cls[i, k]:
                    buf[m] = k
                    m += 1
            idx = buf[:m]
        if idx.shape[0] == 0:
            continue
        if las_ptr[i + 1] == las_ptr[i]:
            return False
        if witness_clear(bt, wc, tt, tab, tclass, las[las_ptr[i] : las_ptr[i + 1]], est_ban, max_w, idx, buf) > 0:
            return False
    return True


@_jit
def memo_run(states, start, edge_ptr, edge_group, edge_next, tag, gh, mul, static_id, mkeys, mvals, mused, miss_key,
             wv, n_free):
    """The dead-end analysis over a run of states (:meth:`.canonical_product._Analysis.run`: each one's
    successors decided before it) from ``states[start]`` on, while each state's content key (the static
    part's id ``static_id[s]`` and :func:`content_key`'s two sums, with the successors' current tags) is
    in the analysis' memo (:func:`memo_put`): its tag is the memo's (``tag[s]`` written); a state whose key
    is not there but whose witnesses clear every class (:func:`witness_verdict`, arrays ``wv``) gets tag
    0 (all good), which the memo keeps (``n_free[0]`` counts them). Returns the index of the first other
    state (``len(states)`` when none); its two sums are written to ``miss_key`` (``uint64[2]``)."""
    n = states.shape[0]
    for i in range(start, n):
        s = states[i]
        e0, e1 = content_key(s, edge_ptr, edge_group, edge_next, tag, gh, mul)
        k0 = np.uint64(static_id[s])
        h = _memo_slot(mkeys, mused, k0, e0, e1)
        if h < 0:
            if witness_verdict(s, edge_ptr, edge_group, edge_next, tag, wv):
                tag[s] = 0
                memo_put(mkeys, mvals, mused, k0, e0, e1, 0)
                n_free[0] += 1
                continue
            miss_key[0] = e0
            miss_key[1] = e1
            return i
        tag[s] = mvals[h]
    return n


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel on tiny inputs of the dtypes the callers use.
    Idempotent and thread-safe; ~0.1 s with a warm cache, a few seconds the very first time."""
    global _WARM
    with _WARM_LOCK:
        if _WARM:
            return
        i32 = np.zeros(2, np.int32)
        i64 = np.zeros(2, np.int64)
        class_trie(np.array([-1, 0], np.int32), np.array([0, 0], np.int32), np.array([1, 2, 2], np.int64), 1)
        table = np.full((1, 256), -1, np.int32)
        byte_classes(table)
        byte_classes_exact(table)
        first_keys(np.zeros(2, np.uint64), np.zeros(2, np.uint64), i64)
        vector_fst_arcs(np.array([0x7F800000, 0, 0], np.int32), 0, 1)
        char_arc_keys(np.array([0, 1], np.int64), i32[:1].copy(), i32[:1].copy())
        expand_gadgets(np.full((1, 256), -1, np.int32), np.full((1, 256), -1, np.int32), np.array([0, 1], np.int64),
                       i64[:1].copy(), i64[:1].copy(), np.array([0, 1], np.int64), i32[:1].copy())
        no_kids = np.zeros(0, np.int32)
        h, sums = np.zeros((6, 1), np.uint64), np.zeros((2, 1), np.uint64)
        walk_class_trie(np.array([1, 1], np.int64), no_kids, i32[:1], i32[:1], table, i32[:1], 0, 1, 1, False, h, sums,
                        i64[:1].copy(), np.zeros(1, np.bool_), 0, no_kids, no_kids, no_kids, 0)
        pure_nodes(np.array([-1], np.int32), np.array([-1], np.int32), np.zeros(1, np.int64), np.ones((1, 1), np.bool_),
                   np.ones(1, np.bool_))
        prefix_paths(table[:, :1].copy(), i32[:1], i64[:1], 1)
        kp, kids = prune_trie(np.array([-1], np.int32), np.array([1, 1], np.int64), np.ones(1, np.bool_))
        walk_class_trie(kp, kids, i32[:1], i32[:1], table, i32[:1], 0, 1, 1, True, h, sums, i64[:1].copy(),
                        np.zeros(1, np.bool_), 1, i32.copy(), i32.copy(), i32.copy(), 0)
        xm, m, cq = chain_info(table[:, :1].copy(), i32[:1], i64[:1], 1, 1)
        chain_sums(h, i32[:1], m, cq, np.zeros(2, np.bool_), np.zeros((3, 2), np.uint64), np.zeros(1, np.bool_))
        unique_states(i32, 1)
        unique_states(i64, 1)
        finish(i64, i64, i64, np.ones(1, bool), 1)
        few = (np.zeros(1, np.bool_), np.zeros(2, np.int64), i64[:0], np.full(1, -1, np.int32), np.zeros((1, 1), np.int32))
        for row in (i32[:1].copy(), _read_only(i32[:1].copy())):  # (memoized rows are read-only)
            allows_some(np.zeros((1, 1), np.int32), *few, row, i64[:1], i64[:1], np.zeros(1, np.bool_))
        group_tokens(i32, 1)
        group_tokens(i64, 1)
        for gi in (i32, i64):
            group_rows(np.array([0, 1], np.int64), gi[:1], np.zeros(1, np.int64), np.array([0, 1], np.int64),
                       np.zeros((1, 1), np.uint32))
        entering_classes(i64[:1], i64[:1], np.array([0, 1], np.int64), i64[:1], 1, 1)
        sccs(np.array([0, 1, 1], np.int64), np.array([1], np.int64))
        signatures(np.array([0, 1], np.int64), i32[:1], i64[:1])
        content_key(0, np.array([0, 1], np.int64), i32[:1], i32[:1], i64, np.zeros((2, 1), np.uint64),
                    np.ones((2, 1), np.uint64))
        mk, mv, mu = np.zeros((4, 3), np.uint64), np.zeros(4, np.int64), np.zeros(4, np.bool_)
        memo_put(mk, mv, mu, np.uint64(1), np.uint64(2), np.uint64(3), 1)
        b1, b11 = np.zeros(1, np.bool_), np.zeros((1, 1), np.bool_)
        wv = (np.full((1, 1), -1, np.int32), b11, i32[:1].copy(), np.zeros(2, np.int64), i64[:1].copy(), i32[:1].copy(),
              np.zeros((1, 1), np.int32), 12, b1, b1, b1, b1, b11, np.zeros((2, 1), np.bool_), np.zeros(2, np.int64),
              i64[:0], np.ones(1, np.bool_), i64.copy(), np.zeros(3, np.int64), i64[:0])
        memo_run(i64[:1], 0, np.array([0, 1], np.int64), i32[:1], i32[:1], i64, np.zeros((2, 1), np.uint64),
                 np.ones((2, 1), np.uint64), i64, mk, mv, mu, np.zeros(2, np.uint64), wv, np.zeros(1, np.int64))
        witness_clear(np.zeros((1, 1), np.int32), np.full((1, 1), -1, np.int32), i64[:1], np.zeros((1, 1), np.bool_),
                      i32, i64[:1], i32, 12, i64[:1].copy(), i64[:1].copy())
        group_classes(np.zeros(1, np.int64), np.array([0, 1], np.int64), i64, np.full(2, -1, np.int64), i64[:1],
                      i64[:0], 1, np.ones(1, np.bool_))
        group_hash_sums(np.zeros(1, np.int64), np.array([0, 1], np.int64), np.zeros((2, 1), np.uint64))
        group_hash_sums(np.zeros(1, np.int32), np.array([0, 1], np.int64), np.zeros((2, 1), np.uint64))
        witness_table(np.zeros(2, np.bool_), i32, i64, i32, np.full((1, 1), -1, np.int32))
        spec_table(i32[:1], i32[:1], i32[:1], np.zeros((1, 7), np.int64), i64[:1], i64[:1], np.zeros((1, 1), np.int64),
                   i32[:1], np.zeros((1, 7), np.int64))
        grouped_allows_some(np.zeros((1, 1), np.int32), *few, i32[:1].copy(), i64[:1], np.zeros(2, np.int64), i64[:1],
                            i64[:1], i64[:1], i64[:1], np.zeros(1, np.bool_))
        for tabs in (np.zeros((1, 1, 1), np.bool_), _read_only(np.zeros((1, 1, 1), np.bool_))):
            pairs_clear(np.zeros((1, 1), np.int32), i32[:1], i64[:1], np.zeros((1, 1), np.int64), i64[:1],
                        np.zeros((1, 1), np.int64), tabs, i64[:1], i64[:1], i64[:1], i64[:1],
                        i64[:1], np.zeros(2, np.int64), i64[:1], i64[:1], i64[:1], np.zeros(1, np.bool_))
        g1 = np.zeros(1, np.int64)
        pack_groups(g1, g1, g1, np.zeros(2, np.int64), np.zeros(1, np.bool_), i32[:1], np.zeros((1, 1), np.bool_),
                    np.zeros((1, 1), np.uint32))
        regular_row(np.zeros(1, np.uint32), i32[:1], i64[:1], np.full(1, -1, np.int64), np.zeros((1, 1), np.uint32),
                    g1, np.zeros(2, np.int64), np.zeros(1, np.bool_), i32[:1], np.zeros((1, 1), np.bool_))
        e1 = [np.zeros(1, np.int64) for _ in range(8)]
        special_prep(i32[:1], i32[:1], e1[0], e1[1], 1, i64[:1].copy(), np.zeros((1, 1), np.bool_), g1, g1, g1,
                     np.zeros(2, np.int64), g1, g1, i32[:1], np.zeros(1, np.bool_), g1, g1, np.zeros(1, np.bool_),
                     *e1[2:6], np.zeros(1, np.bool_), e1[6], e1[7], i64[:1].copy(), i64[:1].copy(),
                     np.zeros(1, np.uint32), np.zeros(1, np.uint32))
        u = np.zeros(1, np.uint32)
        u2 = np.zeros((1, 1), np.uint32)
        b1 = np.ones(1, np.bool_)
        # the canonical filter's CSR is a read-only memory map of the artifacts (in-memory test artifacts:
        # writable): numba types read-only arrays apart, so warm both flavours
        for writable in (True, False):
            bptr, bids, start = i64.copy(), np.zeros(1, np.uint16), u.copy()
            for x in (bptr, bids):
                x.setflags(write=writable)
            dyn = (np.zeros((0, 7), np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64))
            row_args = (np.zeros((1, 1), np.int64), np.zeros((1, 2), np.int64), np.zeros((1, 2), np.int64), u2,
                        np.zeros(1, np.int64), 1, bptr, bids, 1, start, u2, b1, np.ones((1, 1), np.bool_),
                        np.zeros((2, 1), np.int64), i64, np.zeros((1, 1), np.int64), b1, b1, i64[:1])
            canon_row(np.zeros(1, np.int32), 0, 0, 0, *dyn, 0, *row_args)
            for row_writable in (True, False):  # (the matcher's rows are read-only memo entries)
                row = np.zeros(1, np.int32)
                row.setflags(write=row_writable)
                canon_step(np.zeros(1, np.int32), row, 0, 0, *dyn, np.zeros(1, np.int64), *row_args,
                           np.zeros(1, np.int32), i64, i32[:0], i32[:0], np.zeros((1, 4), np.int32),
                           np.zeros((1, 256), np.int32), False, 1, 1, 1)
        _WARM = True
