"""Regex tree → deterministic automaton over *character classes* (code-point ranges).

Why not ``interegular.FSM``: its constructions (``crawl``) cannot be interrupted, so
``(a|b)*a(a|b){20}`` (2^20 DFA states) would hang the server. We take interegular's parse tree
(:mod:`.regex_parse`) and build the automaton ourselves with budgets checked *while* it grows:

1. **Alphabet partition.** Every leaf is a set of characters, possibly negated (interegular's
   "anything else" complement, e.g. ``.`` = everything but ``\\n``, ``[^"\\\\]``). The named characters
   split all of Unicode (U+0000–U+10FFFF without the surrogates U+D800–U+DFFF, which UTF-8 cannot
   encode) into classes of characters no leaf tells apart; the complement of all named characters is
   one class with correct membership for every negated leaf, including non-ASCII characters. Each
   class is a list of inclusive code-point ranges. An optional allowed set (script filters,
   ``script_ranges``) is intersected into every class.
2. **Position (Glushkov) automaton**, counted repetitions unrolled (``e{2,4}`` = ``e e (e (e)?)?``).
3. **Subset construction** with a state budget and a deadline, a state keyed by the positions it can
   read next and its finality (not by the positions last read, so the ends of alternatives that continue
   alike are one state), then **trimming** (states that cannot reach a final state are removed) and
   minimization (:func:`minimize`).

The result is a DFA over class ids: ``trans[s]`` maps class id → next state; state 0 is the start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import CompileBudgetError, EmptyLanguageError
from .regex_parse import optional_tail, separated_lists

MAX_CODEPOINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)


@dataclass
class CharDFA:
    """A trimmed DFA over character classes.

    Attributes:
        classes: list of K classes, each a sorted list of inclusive code-point ranges ``(lo, hi)``
            (surrogates never included; every class non-empty).
        trans: list of S dicts ``class id -> next state``; state 0 is the start.
        final: list of S bools.
    """

    classes: list
    trans: list
    final: list

    @property
    def num_states(self) -> int:
        return len(self.trans)

    def class_of(self, ch: str) -> int:
        """Class id of character ``ch`` (-1 if none). Linear scan: for tests."""
        cp = ord(ch)
        for i, rs in enumerate(self.classes):
            for lo, hi in rs:
                if lo <= cp <= hi:
                    return i
        return -1

    def accepts(self, text: str) -> bool:
        """Whether the DFA accepts ``text`` (for tests)."""
        s = 0
        for ch in text:
            c = self.class_of(ch)
            if c < 0 or c not in self.trans[s]:
                return False
            s = self.trans[s][c]
        return self.final[s]


# --- ranges helpers ---------------------------------------------------------------------------------


def _runs(cps: list[int]) -> list[tuple[int, int]]:
    """Sorted code points → maximal inclusive runs (surrogates removed)."""
    out: list[tuple[int, int]] = []
    for c in cps:
        if SURROGATES[0] <= c <= SURROGATES[1]:
            continue
        if out and out[-1][1] + 1 == c:
            out[-1] = (out[-1][0], c)
        else:
            out.append((c, c))
    return out


def _complement(cps: list[int]) -> list[tuple[int, int]]:
    """All scalar values except the sorted code points ``cps`` (and the surrogates)."""
    out: list[tuple[int, int]] = []
    lo = 0
    for c in sorted({x for x in cps if not SURROGATES[0] <= x <= SURROGATES[1]} | {SURROGATES[0]}):
        if c == SURROGATES[0]:
            if lo < c:
                out.append((lo, c - 1))
            lo = max(lo, SURROGATES[1] + 1)
            continue
        if c < lo:
            continue
        if lo < c:
            out.append((lo, c - 1))
        lo = c + 1
    if lo <= MAX_CODEPOINT:
        out.append((lo, MAX_CODEPOINT))
    return out


def intersect_ranges(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Intersection of two sorted disjoint inclusive range lists."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


# --- alphabet partition -------------------------------------------------------------------------------


def collect_leaves(node, leaves: dict) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        k = n[0]
        if k == "sym":
            if n[1] not in leaves:
                leaves[n[1]] = len(leaves)
        elif k in ("cat", "alt"):
            stack.extend(n[1])
        elif k == "rep":
            stack.append(n[1])


def partition(leaves: list, allowed: list[tuple[int, int]] | None, max_explicit_chars: int = 300_000):
    """Split Unicode into classes no leaf distinguishes.

    Args:
        leaves: list of CharSets ``(chars, negated)``.
        allowed: optional sorted disjoint ranges every class is intersected with (scripts filter).

    Returns:
        (classes, leaf_classes): ``classes`` = list of range lists (non-empty), ``leaf_classes[i]`` =
        frozenset of class ids of leaf i.
    """
    explicit: set[str] = set()
    for chars, _neg in leaves:
        explicit |= chars
        if len(explicit) > max_explicit_chars:
            raise CompileBudgetError(
                f"regex names more than {max_explicit_chars} distinct characters explicitly", None
            )
    neg_mask = 0
    for i, (_chars, neg) in enumerate(leaves):
        if neg:
            neg_mask |= 1 << i
    sig: dict[str, int] = {c: neg_mask for c in explicit}
    for i, (chars, neg) in enumerate(leaves):
        bit = 1 << i
        for c in chars:
            sig[c] ^= bit  # positive: set the bit; negated: clear it
    by_sig: dict[int, list[int]] = {}
    for c, s in sig.items():
        by_sig.setdefault(s, []).append(ord(c))
    else_sig = neg_mask
    classes: list[list[tuple[int, int]]] = []
    class_sigs: list[int] = []
    # the "anything else" class: complement of the explicit characters whose signature differs
    if else_sig:
        others = sorted(ord(c) for c, s in sig.items() if s != else_sig)
        rs = _complement(others)
        if allowed is not None:
            rs = intersect_ranges(rs, allowed)
        if rs:
            classes.append(rs)
            class_sigs.append(else_sig)
    for s, cps in sorted(by_sig.items(), key=lambda kv: min(kv[1])):
        if s == 0 or s == else_sig and else_sig:
            continue
        rs = _runs(sorted(cps))
        if allowed is not None:
            rs = intersect_ranges(rs, allowed)
        if rs:
            classes.append(rs)
            class_sigs.append(s)
    leaf_classes = []
    for i in range(len(leaves)):
        bit = 1 << i
        leaf_classes.append(frozenset(k for k, s in enumerate(class_sigs) if s & bit))
    return classes, leaf_classes


# --- position automaton ---------------------------------------------------------------------------------


class _Budget:
    def __init__(self, deadline: float, max_follow: int):
        self.deadline = deadline
        self.max_follow = max_follow
        self.follow_size = 0
        self.ticks = 0

    def tick(self, n: int = 1) -> None:
        self.ticks += n
        if self.ticks >= 256:
            self.ticks = 0
            if time.perf_counter() > self.deadline:
                raise CompileBudgetError("regex compilation exceeded the time budget", None)


class _Glushkov:
    def __init__(self, leaf_index: dict, leaf_classes: list, budget: _Budget):
        self.leaf_index = leaf_index
        self.leaf_classes = leaf_classes
        self.pos_classes: list[frozenset] = []
        self.follow: list[set] = []
        self.budget = budget

    def _link(self, lasts, firsts) -> None:
        if not firsts:
            return
        b = self.budget
        for p in lasts:
            f = self.follow[p]
            before = len(f)
            f |= firsts
            b.follow_size += len(f) - before
        if b.follow_size > b.max_follow:
            raise CompileBudgetError(
                f"regex automaton exceeds {b.max_follow} follow links (nested optional repetitions)", None
            )
        b.tick(len(lasts))

    def build(self, node):
        """Returns (first: frozenset, last: frozenset, nullable: bool)."""
        k = node[0]
        if k == "sym":
            p = len(self.pos_classes)
            self.pos_classes.append(self.leaf_classes[self.leaf_index[node[1]]])
            self.follow.append(set())
            self.budget.tick()
            return frozenset((p,)), frozenset((p,)), False
        if k == "eps":
            return frozenset(), frozenset(), True
        if k == "cat":
            kids = node[1]
            lists = separated_lists(kids) if self.share_separated_lists else {}
            acc = None
            i = 0
            while i < len(kids):
                if i in lists:
                    end, sep = lists[i]
                    part = self._separated_list(kids[i:end], sep)
                    i = end + 1
                else:
                    part = self.build(kids[i])
                    i += 1
                acc = part if acc is None else self._cat(acc, part)
            return acc
        if k == "alt":
            tail = optional_tail(node) if self.share_optional_tails else None
            if tail is not None:
                return self._optional_tail(*tail)
            first, last, nul = set(), set(), False
            for child in node[1]:
                f, l, n = self.build(child)
                first |= f
                last |= l
                nul = nul or n
            return frozenset(first), frozenset(last), nul
        if k == "rep":
            base, lo, hi = node[1], node[2], node[3]
            parts = [self.build(base) for _ in range(lo)]
            if hi is None:
                if parts:
                    f, l, n = parts[-1]
                    self._link(l, f)  # last copy loops: e{lo,} = e^(lo-1) e+
                else:
                    f, l, n = self.build(base)
                    self._link(l, f)
                    parts.append((f, l, True))
            elif hi > lo:
                opt = None
                for _ in range(hi - lo):  # innermost first: (e (e (e)?)?)?
                    c = self.build(base)
                    if opt is not None:
                        c = self._cat(c, opt)
                    opt = (c[0], c[1], True)
                parts.append(opt)
            if not parts:
                return frozenset(), frozenset(), True
            acc = parts[0]
            for p in parts[1:]:
                acc = self._cat(acc, p)
            return acc
        raise ValueError(k)

    # ``X (S X)*`` (a separated list: JSON arrays, ``tool_choice="required"``'s array of tool calls) is built
    # with one copy of X's positions: the last positions of X lead to S, the last of S back to X. The
    # language is the same; the subset construction then makes X's states once instead of twice (the two
    # copies are equivalent states that only minimization would merge, after the state budget counted
    # them).
    share_separated_lists = True

    def _separated_list(self, x_kids, sep_kids):
        """Glushkov triple of ``X (S X)*`` with one copy of X (see :attr:`share_separated_lists`)."""
        fx, lx, _ = self.build(("cat", tuple(x_kids)) if len(x_kids) > 1 else x_kids[0])
        fs, ls, _ = self.build(("cat", tuple(sep_kids)) if len(sep_kids) > 1 else sep_kids[0])
        self._link(lx, fs)
        self._link(ls, fx)
        return fx, lx, False

    # ``X (S M)? | M`` (:func:`.regex_parse.optional_tail`; the JSON-schema converter's "some of these
    # members, in order") is built with one copy of M's positions, entered from the start and from S's
    # last positions, left to whatever follows the alternation: the same language (the two copies had the
    # same inside and the same exits), and the subset construction makes M's states once.
    share_optional_tails = True

    def _optional_tail(self, x, sep, m):
        """Glushkov triple of ``X (S M)? | M`` with one copy of M (X, S, M not nullable)."""
        fx, lx, _ = self.build(("cat", x) if len(x) > 1 else x[0])
        fs, ls, _ = self.build(("cat", sep) if len(sep) > 1 else sep[0])
        fm, lm, _ = self.build(m)
        self._link(lx, fs)
        self._link(ls, fm)
        return fx | fm, lx | lm, False

    def _cat(self, a, b):
        fa, la, na = a
        fb, lb, nb = b
        self._link(la, fb)
        first = fa | fb if na else fa
        last = lb | la if nb else lb
        return first, last, na and nb


def build_char_dfa(
    tree,
    allowed: list[tuple[int, int]] | None = None,
    *,
    max_states: int = 4000,
    max_follow: int = 1_000_000,
    deadline: float | None = None,
    leaves: list | None = None,
) -> CharDFA:
    """Compile a regex tree (:func:`.regex_parse.parse_regex`) into a trimmed :class:`CharDFA`.

    Args:
        tree: the regex tree.
        allowed: optional code-point ranges every character must lie in (scripts filter).
        max_states: budget on DFA states (subset construction).
        max_follow: budget on the position automaton's follow links.
        deadline: ``time.perf_counter()`` value after which compilation stops.
        leaves: the CharSets to partition Unicode by, in order (a superset of the tree's own): DFAs of
            several trees built with one such list share their ``classes`` (:mod:`.regex_algebra`).

    Raises:
        CompileBudgetError: a budget was exceeded (``(a|b)*a(a|b){20}``, ``.{5000}``).
        EmptyLanguageError: the regex (under ``allowed``) matches nothing.
    """
    if deadline is None:
        deadline = time.perf_counter() + 5.0
    budget = _Budget(deadline, max_follow)
    leaf_index: dict = {}
    if leaves is not None:
        leaf_index = {leaf: i for i, leaf in enumerate(dict.fromkeys(leaves))}
    collect_leaves(tree, leaf_index)
    leaves = sorted(leaf_index, key=leaf_index.get)
    classes, leaf_classes = partition(leaves, allowed)
    g = _Glushkov(leaf_index, leaf_classes, budget)
    first, last, nullable = g.build(tree)
    pos_classes, follow = g.pos_classes, g.follow
    lastset = last

    # subset construction. A set D of positions (the positions last read) determines its future by two
    # things only: the positions that can be read next (the union of D's follow sets) and whether it is
    # final (D meets the last positions). So states are keyed by that pair, not by D: the sets reached by
    # different branches of an alternation that continue alike (``(a|bc)d``: after "a" and after "bc")
    # are one state from the start, where keyed by D they were equivalent states that only the
    # minimization merged (a JSON string character: 10 states per counted position instead of 7).
    by_set: dict = {}  # frozenset D -> state
    by_future: dict = {}  # (next positions, final) -> state
    cands: list[frozenset] = []
    final: list[bool] = []
    total_size = 0

    def state_of(D: frozenset, cand: frozenset | None = None, fin: bool = False) -> int:
        nonlocal total_size
        j = by_set.get(D)
        if j is not None:
            return j
        if cand is None:
            cand = frozenset().union(*[follow[p] for p in D])
            fin = not D.isdisjoint(lastset)
        key = (cand, fin)
        j = by_future.get(key)
        if j is None:
            j = by_future[key] = len(cands)
            cands.append(cand)
            final.append(fin)
            if len(cands) > max_states:
                raise CompileBudgetError(
                    f"regex automaton exceeds {max_states} states (e.g. a counted repetition after an "
                    f"unbounded one, or a very large bound)",
                    None,
                )
            total_size += len(D)
            if total_size > max_follow:
                raise CompileBudgetError(
                    f"regex automaton construction exceeds its budget ({max_follow} position-set entries)", None
                )
            budget.tick(len(cand) + 1)
        by_set[D] = j
        return j

    state_of(frozenset((-1,)), frozenset(first), bool(nullable))
    trans: list[dict] = []
    i = 0
    while i < len(cands):
        cand = cands[i]
        i += 1
        row = {}
        cls_sets = [pos_classes[q] for q in cand]
        if sum(map(len, cls_sets)) == len(frozenset().union(*cls_sets)):
            # no class is read by two candidate positions (the common case): each position's classes
            # lead to the set holding it alone
            for q, cs in zip(cand, cls_sets):
                if cs:
                    row.update(dict.fromkeys(cs, state_of(frozenset((q,)))))
        else:
            buckets: dict[int, list] = {}
            for q in cand:
                for c in pos_classes[q]:
                    buckets.setdefault(c, []).append(q)
            for c, qs in buckets.items():
                row[c] = state_of(frozenset(qs))
        trans.append(row)

    # trim: keep states that reach a final state
    n = len(cands)
    alive = coreachable(trans, final)
    if not alive[0]:
        raise EmptyLanguageError("the regex matches no string (under the character filters)", None)
    # every state is reachable from 0 (built from it): keep the alive ones, in order (minimize renumbers)
    if all(alive):
        out_trans, out_final = trans, final
    else:
        new = {}
        for s in range(n):
            if alive[s]:
                new[s] = len(new)
        out_trans = [{c: new[t] for c, t in trans[s].items() if alive[t]} for s in new]
        out_final = [final[s] for s in new]
    if time.perf_counter() > deadline:
        raise CompileBudgetError("regex compilation exceeded the time budget", None)
    out_trans, out_final = minimize(out_trans, out_final)
    return CharDFA(classes=classes, trans=out_trans, final=out_final)


def coreachable(trans: list[dict], final: list[bool]) -> list[bool]:
    """Per state of a DFA (``trans``: dicts ``class -> next state``): whether a final state is reachable."""
    rev: list[list[int]] = [[] for _ in range(len(trans))]
    for s, row in enumerate(trans):
        for t in set(row.values()):
            rev[t].append(s)
    alive = [bool(f) for f in final]
    stack = [s for s in range(len(trans)) if alive[s]]
    while stack:
        t = stack.pop()
        for s in rev[t]:
            if not alive[s]:
                alive[s] = True
                stack.append(s)
    return alive


def minimize(trans: list[dict], final: list[bool]) -> tuple[list[dict], list[bool]]:
    """The minimal DFA of a trimmed DFA over class ids (OpenFst's ``Minimize`` through pynini: labels
    are class id + 1), states renumbered in BFS order from the start (state 0).

    Why: subset construction does not merge equivalent states; regexes converted from JSON schemas
    repeat sub-expressions (strings, numbers, the extra-key part of open objects), and every surplus
    character state becomes several byte states and token states downstream, each paid for in the
    token-DFA walk and the dead-end analysis.

    The automaton goes to OpenFst and back in its binary ``VectorFst`` format (:func:`_vector_fst_bytes`,
    :func:`_read_vector_fst`), built and read with numpy: one Python call per arc (``add_arc``,
    ``arcs``) cost more than the minimization itself. :func:`minimize_reference` is the per-arc path
    (tests: same result).

    Args:
        trans: S dicts ``class id -> next state`` (state 0 the start; every state reachable and
            co-reachable).
        final: S bools.

    Returns:
        ``(trans, final)`` of the minimal DFA (same language).
    """
    import pynini

    if len(trans) <= 1:
        return trans, final
    f = pynini.Fst.read_from_string(_vector_fst_bytes(trans, final))
    f.arcsort("ilabel")  # OpenFst's Minimize merges nothing on a cyclic DFA whose arcs are not sorted
    f.minimize(allow_nondet=False)
    return _read_vector_fst(f.write_to_string())


_FST_MAGIC = 2125659606
_FST_INF_BITS = 0x7F800000  # float32 +inf: the tropical semiring's zero (not final)


def _fst_string(x: str) -> bytes:
    return len(x).to_bytes(4, "little") + x.encode()


def _vector_fst_bytes(trans: list[dict], final: list[bool]) -> bytes:
    """OpenFst's binary serialization of a ``VectorFst<StdArc>`` acceptor (label = class id + 1, weight
    One, start 0): header (magic, ``"vector"``, ``"standard"``, version 2, no symbol tables, properties
    expanded | mutable only, start, state and arc counts), then per state its final weight (``float32``),
    its arc count (``int64``) and its arcs (ilabel, olabel ``int32``, weight ``float32``, next state
    ``int32``)."""
    from itertools import chain

    S = len(trans)
    narcs = np.fromiter(map(len, trans), dtype=np.int64, count=S)
    E = int(narcs.sum())
    labels = np.fromiter(chain.from_iterable(trans), dtype=np.int32, count=E) + 1
    targets = np.fromiter(chain.from_iterable(r.values() for r in trans), dtype=np.int32, count=E)
    arc_start = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(narcs, out=arc_start[1:])
    word = 3 * np.arange(S, dtype=np.int64) + 4 * arc_start[:-1]  # each state's first int32 word
    body = np.zeros(3 * S + 4 * E, dtype=np.int32)
    body[word] = np.where(np.asarray(final, dtype=bool), 0, _FST_INF_BITS)
    body[word + 1] = narcs  # (int64, little-endian: the high word stays 0)
    first = np.repeat(word + 3, narcs) + 4 * (np.arange(E, dtype=np.int64) - np.repeat(arc_start[:-1], narcs))
    body[first] = labels
    body[first + 1] = labels
    body[first + 3] = targets
    head = (_FST_MAGIC.to_bytes(4, "little") + _fst_string("vector") + _fst_string("standard")
            + (2).to_bytes(4, "little") + (0).to_bytes(4, "little") + (3).to_bytes(8, "little")
            + (0).to_bytes(8, "little") + S.to_bytes(8, "little") + E.to_bytes(8, "little"))
    return head + body.tobytes()


def _read_vector_fst(data: bytes) -> tuple[list[dict], list[bool]]:
    """Inverse of :func:`_vector_fst_bytes` for an acceptor written by OpenFst (any start state, arcs in
    their stored order): ``(trans, final)`` renumbered in BFS order from the start, following arcs in
    that order.

    Raises:
        ValueError: not a ``VectorFst`` over the standard arc type, or symbol tables present.
    """
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        pos += n
        return data[pos - n : pos]

    def take_int(n: int) -> int:
        return int.from_bytes(take(n), "little", signed=True)

    if take_int(4) != _FST_MAGIC:
        raise ValueError("not an OpenFst binary FST")
    fst_type, arc_type = take(take_int(4)).decode(), take(take_int(4)).decode()
    take(4)  # version
    flags = take_int(4)
    if fst_type != "vector" or arc_type != "standard" or flags != 0:
        raise ValueError(f"unexpected FST {fst_type}/{arc_type} (flags {flags})")
    take(8)  # properties
    start, S = take_int(8), take_int(8)
    take(8)  # arc count
    from . import kernels

    words = np.frombuffer(data[pos:], dtype=np.int32).copy()  # (aligned, writable: the kernel's signature)
    ptr, label, target, final, n = kernels.vector_fst_arcs(words, start, S)
    p, lab, tgt = ptr.tolist(), label.tolist(), target.tolist()
    out_trans = [dict(zip(lab[p[i] : p[i + 1]], tgt[p[i] : p[i + 1]])) for i in range(int(n))]
    return out_trans, final.tolist()


def minimize_reference(trans: list[dict], final: list[bool]) -> tuple[list[dict], list[bool]]:
    """:func:`minimize` with the FST built and read one arc at a time through pynini's API (tests)."""
    import pynini

    n = len(trans)
    if n <= 1:
        return trans, final
    f = pynini.Fst()
    f.add_states(n)
    f.set_start(0)
    one = pynini.Weight.one(f.weight_type())
    for s, row in enumerate(trans):
        for c, t in row.items():
            f.add_arc(s, pynini.Arc(c + 1, c + 1, one, t))
        if final[s]:
            f.set_final(s)
    f.arcsort("ilabel")  # OpenFst's Minimize merges nothing on a cyclic DFA whose arcs are not sorted
    f.minimize(allow_nondet=False)
    start = f.start()
    new = {start: 0}
    order = [start]
    out_trans: list[dict] = []
    k = 0
    while k < len(order):
        s = order[k]
        k += 1
        row = {}
        for arc in f.arcs(s):
            t = arc.nextstate
            if t not in new:
                new[t] = len(order)
                order.append(t)
            row[arc.ilabel - 1] = new[t]
        out_trans.append(row)
    zero = pynini.Weight.zero(f.weight_type())
    out_final = [f.final(s) != zero for s in order]
    return out_trans, out_final
