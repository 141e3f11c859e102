"""Regex → byte-level DFA (paper 001 Alg. 2 ``BUILDREGEXFSA``, over UTF-8 bytes).

Pipeline: :func:`.regex_parse.parse_regex` (interegular syntax; typed errors with positions) →
:func:`.char_dfa.build_char_dfa` (DFA over character classes; budgets) → here: every character
transition is spelt as UTF-8 byte paths.

Two equivalent outputs:

* :func:`byte_dfa_table` -- the fast path: a dense ``int32[n, 256]`` transition table (``-1`` = reject).
  For each character state, its outgoing classes grouped by target form a *gadget*: the minimal
  deterministic byte automaton that reads one UTF-8 character and exits by the group it belongs to
  (RE2 / ``utf8-ranges`` splitting, states hash-consed on their residual byte-range suffixes). Gadgets
  are cached per partition, so ``.{0,300}`` builds one gadget and copies it 300 times with numpy.
  Only shortest-form UTF-8 without surrogates is produced, so the UTF-8 filter (000 §4.1) holds by
  construction; script filters are applied on the classes (``script_ranges``) before this step.
* :func:`byte_dfa_fst` -- the reference path: a ``pynini`` acceptor built with
  :func:`unicode_filters.codepoint_ranges_to_utf8_fst` per transition, intersected with
  :func:`unicode_filters.utf8_fst` and, optionally, :func:`unicode_filters.scripts_fst`, determinized
  and minimized. Tests check both paths accept the same language.

SentencePiece preprocessing (paper 000 §3.1): with ``prepend_space`` the language becomes
``" " + L`` (the leading space is the dummy prefix ``▁``), so users write plain text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import CompileBudgetError
from .char_dfa import CharDFA, build_char_dfa
from .regex_parse import parse_regex

__all__ = ["ByteDFA", "regex_to_char_dfa", "byte_dfa_table", "byte_dfa_table_reference", "byte_dfa_fst", "utf8_sequences"]


@dataclass
class ByteDFA:
    """Deterministic automaton over bytes.

    Attributes:
        table: ``int32[n, 256]``; ``table[q, b]`` = next state or -1. State 0 is the start.
        final: ``bool[n]``.
        char_entry: ``int32[n_char]`` -- byte state of each character-DFA state (character boundary).
    """

    table: np.ndarray
    final: np.ndarray
    char_entry: np.ndarray

    @property
    def num_states(self) -> int:
        return int(self.table.shape[0])

    def accepts(self, data: bytes) -> bool:
        """Whether ``data`` is accepted (for tests)."""
        q = 0
        for b in data:
            q = int(self.table[q, b])
            if q < 0:
                return False
        return bool(self.final[q])

    def run(self, q: int, data: bytes) -> int:
        """State after reading ``data`` from ``q`` (-1 if rejected)."""
        for b in data:
            if q < 0:
                return -1
            q = int(self.table[q, b])
        return q


def regex_to_char_dfa(
    regex: str,
    *,
    prepend_space: bool = False,
    allowed_ranges=None,
    max_positions: int = 20000,
    max_states: int = 4000,
    deadline: float | None = None,
) -> CharDFA:
    """Parse and compile ``regex`` to a character-class DFA (with the SentencePiece leading space when
    ``prepend_space``; restricted to ``allowed_ranges`` when given).

    Raises: RegexSyntaxError, UnsupportedRegexError, CompileBudgetError, EmptyLanguageError.
    """
    tree = parse_regex(regex, max_positions=max_positions)
    if prepend_space:
        tree = ("cat", (("sym", (frozenset(" "), False)), tree))
    return build_char_dfa(tree, allowed_ranges, max_states=max_states, deadline=deadline)


# --- UTF-8 range splitting ---------------------------------------------------------------------------


def utf8_sequences(lo: int, hi: int):
    """Split the scalar range ``[lo, hi]`` (no surrogates inside) into UTF-8 byte-range sequences
    ``((b0_lo, b0_hi), (b1_lo, b1_hi), ...)`` whose cross products are exactly its encodings
    (Russ Cox's UTF-8 range splitting, as in RE2)."""
    out = []
    stack = [(lo, hi)]
    while stack:
        lo, hi = stack.pop()
        if lo > hi:
            continue
        done = False
        for bound in (0x7F, 0x7FF, 0xFFFF):
            if lo <= bound < hi:
                stack.append((bound + 1, hi))
                stack.append((lo, bound))
                done = True
                break
        if done:
            continue
        n = 1 if hi <= 0x7F else 2 if hi <= 0x7FF else 3 if hi <= 0xFFFF else 4
        for i in range(1, n):
            m = (1 << (6 * i)) - 1
            if lo & ~m != hi & ~m:
                if lo & m:
                    stack.append(((lo | m) + 1, hi))
                    stack.append((lo, lo | m))
                    done = True
                    break
                if hi & m != m:
                    stack.append((hi & ~m, hi))
                    stack.append((lo, (hi & ~m) - 1))
                    done = True
                    break
        if done:
            continue
        a = chr(lo).encode("utf-8")
        b = chr(hi).encode("utf-8")
        out.append(tuple(zip(a, b)))
    return out


_GADGETS: dict = {}


def _gadget(groups: tuple) -> np.ndarray:
    """Byte automaton reading ONE character and exiting by its group.

    Args:
        groups: tuple of range lists (one per exit).

    Returns:
        ``int32[g, 256]``: ``>= 0`` internal state, ``-1`` reject, ``-2 - e`` exit ``e``.
        State 0 is the entry. Minimal: states are hash-consed on their residual suffix sets.
    """
    got = _GADGETS.get(groups)
    if got is not None:
        return got
    items = []
    for e, ranges in enumerate(groups):
        for lo, hi in ranges:
            for seq in utf8_sequences(lo, hi):
                items.append((seq, e))
    start = frozenset(items)
    index = {start: 0}
    order = [start]
    rows = []
    k = 0
    while k < len(order):
        R = order[k]
        k += 1
        row = np.full(256, -1, dtype=np.int32)
        cuts = {0, 256}
        for seq, _e in R:
            cuts.add(seq[0][0])
            cuts.add(seq[0][1] + 1)
        cuts = sorted(cuts)
        for a, b in zip(cuts[:-1], cuts[1:]):
            sub = [(seq[1:], e) for seq, e in R if seq[0][0] <= a and b - 1 <= seq[0][1]]
            if not sub:
                continue
            ends = [e for s, e in sub if not s]
            if ends:
                row[a:b] = -2 - ends[0]
                continue
            nxt = frozenset(sub)
            j = index.get(nxt)
            if j is None:
                j = index[nxt] = len(order)
                order.append(nxt)
            row[a:b] = j
        rows.append(row)
    g = np.stack(rows)
    if len(_GADGETS) > 4096:
        _GADGETS.clear()
    _GADGETS[groups] = g
    return g


def _gadget_of(cdfa: CharDFA, classes, ranks, n_exits: int) -> np.ndarray:
    """The gadget of a character state whose arcs, by class (``classes``, ascending), exit by ``ranks``
    (their targets numbered by first appearance): exit i reads the code points of the classes ranked i."""
    return _gadget(tuple(tuple(sorted(r for c, j in zip(classes, ranks) if j == i for r in cdfa.classes[c]))
                         for i in range(n_exits)))


def byte_dfa_table(cdfa: CharDFA, *, max_states: int = 200_000, deadline: float | None = None) -> ByteDFA:
    """Expand the character DFA into a dense byte-level DFA (module docstring, fast path).

    Each character state's arcs, by class, with their targets numbered by first appearance (the state's
    gadget exits) are keyed in one kernel call (:func:`.kernels.char_arc_keys`); states with one key share
    a gadget, built once per key; every row is then written in one kernel call
    (:func:`.kernels.expand_gadgets`). The result is
    :func:`byte_dfa_table_reference`'s, array for array (taken instead when two keys' hashes collide).

    Returns:
        :class:`ByteDFA` with ``table: int32[n, 256]`` (start 0, character states first: byte state
        ``char_entry[c]`` is character state ``c``), ``final: bool[n]``.

    Raises:
        CompileBudgetError: more than ``max_states`` byte states, or past ``deadline``.
    """
    from itertools import chain

    from . import kernels

    trans = cdfa.trans
    nc = cdfa.num_states
    narcs = np.fromiter(map(len, trans), dtype=np.int64, count=nc)
    ptr = np.zeros(nc + 1, dtype=np.int64)
    np.cumsum(narcs, out=ptr[1:])
    E = int(ptr[-1])
    labels = np.fromiter(chain.from_iterable(trans), dtype=np.int32, count=E)
    targets = np.fromiter(chain.from_iterable(r.values() for r in trans), dtype=np.int32, count=E)
    lab, rank, rt, nrank, h0, h1 = kernels.char_arc_keys(ptr, labels, targets)
    inv, n_keys = kernels.first_keys(h0, h1, narcs)
    first = np.unique(inv, return_index=True)[1]  # (the first state of each key; keys numbered so)
    owner = np.repeat(np.arange(nc), narcs)
    same = ptr[first[inv[owner]]] + (np.arange(E) - ptr[owner])  # each arc's place in its key's first state
    if not (np.array_equal(lab, lab[same]) and np.array_equal(rank, rank[same])):  # (a hash collision)
        return byte_dfa_table_reference(cdfa, max_states=max_states, deadline=deadline)
    gadgets, slot_of_key, slot_of = [], np.empty(n_keys, dtype=np.int64), {}
    for u, s in enumerate(first.tolist()):
        g = _gadget_of(cdfa, lab[ptr[s] : ptr[s + 1]].tolist(), rank[ptr[s] : ptr[s + 1]].tolist(), int(nrank[s]))
        k = slot_of.get(id(g))
        if k is None:
            k = slot_of[id(g)] = len(gadgets)
            gadgets.append(g)
        slot_of_key[u] = k
    slot = slot_of_key[inv]
    sizes = np.fromiter((g.shape[0] - 1 for g in gadgets), dtype=np.int64, count=len(gadgets))
    total = nc + int(sizes[slot].sum())
    if total > max_states:
        raise CompileBudgetError(f"byte automaton exceeds {max_states} states", None)
    if deadline is not None and time.perf_counter() > deadline:
        raise CompileBudgetError("regex compilation exceeded the time budget", None)
    # inner byte states numbered per gadget in order of first use, its states ascending, ng - 1 each
    # (byte_dfa_table_reference's numbering); then every row in one kernel call
    order = np.argsort(slot, kind="stable")
    grow = sizes[slot[order]]
    base = np.empty(nc, dtype=np.int64)
    base[order] = nc + np.cumsum(grow) - grow
    g_ptr = np.zeros(len(gadgets) + 1, dtype=np.int64)
    np.cumsum(sizes + 1, out=g_ptr[1:])
    table = np.empty((total, 256), dtype=np.int32)
    kernels.expand_gadgets(table, np.ascontiguousarray(np.concatenate(gadgets), dtype=np.int32), g_ptr, slot, base,
                           ptr, rt)
    final = np.zeros(total, dtype=bool)
    final[:nc] = np.asarray(cdfa.final, dtype=bool)
    return ByteDFA(table=table, final=final, char_entry=np.arange(nc, dtype=np.int32))


def byte_dfa_table_reference(cdfa: CharDFA, *, max_states: int = 200_000, deadline: float | None = None) -> ByteDFA:
    """:func:`byte_dfa_table` one character state at a time in Python (the tests compare them; taken on a
    hash collision of the states' keys): the same arguments, result and errors."""
    nc = cdfa.num_states
    plans = []  # per char state: (gadget, exit targets)
    key_cache: dict = {}
    total = nc
    for s in range(nc):
        # the state's classes in order and, per class, its target's rank by first appearance (= the
        # targets ordered by their smallest class): the partition of the classes by target
        items = sorted(cdfa.trans[s].items())
        rank: dict[int, int] = {}
        key = (tuple([c for c, _ in items]), tuple([rank.setdefault(t, len(rank)) for _, t in items]))
        g = key_cache.get(key)
        if g is None:
            g = key_cache[key] = _gadget_of(cdfa, key[0], key[1], len(rank))
        plans.append((g, np.fromiter(rank, dtype=np.int32, count=len(rank))))
        total += g.shape[0] - 1
        if total > max_states:
            raise CompileBudgetError(f"byte automaton exceeds {max_states} states", None)
        if deadline is not None and (s & 63) == 63 and time.perf_counter() > deadline:
            raise CompileBudgetError("regex compilation exceeded the time budget", None)
    table = np.full((total, 256), -1, dtype=np.int32)
    # vectorized per gadget: all character states sharing a gadget are expanded at once
    by_gadget: dict = {}
    for st, (g, targets) in enumerate(plans):
        by_gadget.setdefault(id(g), (g, [], []))
        by_gadget[id(g)][1].append(st)
        by_gadget[id(g)][2].append(targets)
    nxt = nc
    for g, sts, tlist in by_gadget.values():
        n = len(sts)
        ng = g.shape[0]
        n_exit = max((len(t) for t in tlist), default=0)
        # one lookup row per character state: its gadget's states (ids), its exit targets, then -1; the
        # gadget's table, mapped into that row (internal j -> j, exit e -> ng + e, reject -> the last),
        # expands all of them in one gather
        lut = np.full((n, ng + n_exit + 1), -1, dtype=np.int32)
        lut[:, 0] = sts
        if ng > 1:
            lut[:, 1:ng] = nxt + np.arange(n * (ng - 1), dtype=np.int32).reshape(n, ng - 1)
        nxt += n * (ng - 1)
        for i, t in enumerate(tlist):
            lut[i, ng : ng + len(t)] = t
        col = np.where(g >= 0, g, np.where(g <= -2, ng - 2 - g, ng + n_exit))  # [ng, 256]
        table[lut[:, :ng].reshape(-1)] = lut[:, col].reshape(n * ng, 256)
    final = np.zeros(total, dtype=bool)
    final[:nc] = np.asarray(cdfa.final, dtype=bool)
    return ByteDFA(table=table, final=final, char_entry=np.arange(nc, dtype=np.int32))


def byte_dfa_fst(cdfa: CharDFA, scripts=None):
    """Reference path: the same language as :func:`byte_dfa_table` as a ``pynini`` acceptor (labels
    ``byte + 1``), built from :func:`unicode_filters.codepoint_ranges_to_utf8_fst` per transition,
    intersected with the UTF-8 filter (always) and ``scripts_fst(scripts)`` (when given), then
    determinized and minimized. Slow (Python loops over arcs); for tests and small regexes."""
    import pynini

    from ..artifacts.unicode_filters import codepoint_ranges_to_utf8_fst, scripts_fst, utf8_fst

    one = pynini.Weight.one("tropical")
    f = pynini.Fst()
    nc = cdfa.num_states
    f.add_states(nc)
    f.set_start(0)
    for s in range(nc):
        if cdfa.final[s]:
            f.set_final(s)
    cache: dict = {}
    for s in range(nc):
        by_target: dict[int, list[int]] = {}
        for c, t in cdfa.trans[s].items():
            by_target.setdefault(t, []).append(c)
        for t, cls_ids in by_target.items():
            key = tuple(sorted(cls_ids))
            piece = cache.get(key)
            if piece is None:
                rs = [r for c in key for r in cdfa.classes[c]]
                piece = cache[key] = codepoint_ranges_to_utf8_fst(rs)
            # splice piece between s and t
            m = {}
            for q in piece.states():
                m[q] = s if q == piece.start() else f.add_state()
            for q in piece.states():
                for a in piece.arcs(q):
                    dst = a.nextstate
                    is_final = piece.final(dst) != pynini.Weight.zero("tropical")
                    tgt = t if is_final and piece.num_arcs(dst) == 0 else m[dst]
                    f.add_arc(m[q], pynini.Arc(a.ilabel, a.ilabel, one, tgt))
    f = pynini.determinize(f).minimize()
    f = pynini.intersect(f, utf8_fst())
    if scripts:
        f = pynini.intersect(f, scripts_fst(tuple(scripts)))
    f = pynini.determinize(f.rmepsilon()).minimize()
    f.arcsort("ilabel")
    return f
