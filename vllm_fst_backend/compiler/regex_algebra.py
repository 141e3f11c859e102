"""Boolean operations on regex trees: intersection, complement and length bounds, back to a regex tree.

Regular languages are closed under intersection and complement, but a regex has no operator for
either. The JSON-schema converter needs them for string values whose keywords combine (``pattern`` with
``minLength`` / ``maxLength`` or ``format``, ``not`` of a pattern or of string values): here the trees
(:mod:`.regex_parse`, over decoded characters) become minimal DFAs over one shared partition of Unicode
(:func:`.char_dfa.build_char_dfa`), are combined by the product construction (intersection), completion
and final-state swap (complement) and a counter (length), and the result is turned back into a tree by
state elimination (Brzozowski and McCluskey 1963; Hopcroft, Motwani and Ullman, *Introduction to Automata
Theory*, §3.2.2), states with the fewest in × out paths first. State elimination can give regexes
exponentially larger than the DFA: the tree's size is bounded (``max_positions``), past it
:class:`~vllm_fst_backend.errors.CompileBudgetError`.
"""

from __future__ import annotations

import time

from ..errors import CompileBudgetError, EmptyLanguageError
from .char_dfa import build_char_dfa, collect_leaves, coreachable, minimize
from .regex_parse import alt_node, cat_node, rep_node

__all__ = ["combine", "ANY_CHAR"]

#: A tree of any one character.
ANY_CHAR = ("sym", (frozenset(), True))
_EPS = ("eps",)
_MAX_CP = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
#: A class is written as the set of its characters, or as the negated set of the others, whichever is
#: smaller; past this many characters either way the combination is refused.
MAX_SET_CHARS = 200_000


def _trim(trans: list[dict], final: list[bool]) -> tuple[list[dict], list[bool]] | None:
    """The states reachable from 0 that reach a final state, renumbered (0 first); None when 0 does not."""
    alive = coreachable(trans, final)
    if not alive[0]:
        return None
    new: dict[int, int] = {0: 0}
    order = [0]
    for s in order:  # (BFS over alive states from 0)
        for t in trans[s].values():
            if alive[t] and t not in new:
                new[t] = len(order)
                order.append(t)
    return ([{c: new[t] for c, t in trans[s].items() if alive[t]} for s in order], [final[s] for s in order])


def _product(a: tuple, b: tuple, deadline: float, max_states: int) -> tuple[list[dict], list[bool]]:
    """Intersection of two complete-or-partial DFAs ``(trans, final)`` over the same classes."""
    (ta, fa), (tb, fb) = a, b
    index = {(0, 0): 0}
    pairs = [(0, 0)]
    trans: list[dict] = []
    for p, q in pairs:
        row = {}
        rb = tb[q]
        for c, p2 in ta[p].items():
            q2 = rb.get(c)
            if q2 is None:
                continue
            j = index.get((p2, q2))
            if j is None:
                j = index[(p2, q2)] = len(pairs)
                pairs.append((p2, q2))
                if len(pairs) > max_states:
                    raise CompileBudgetError(f"combined string constraints exceed {max_states} states", None)
            row[c] = j
        trans.append(row)
        if len(trans) % 256 == 0 and time.perf_counter() > deadline:
            raise CompileBudgetError("combining string constraints exceeded the time budget", None)
    return trans, [fa[p] and fb[q] for p, q in pairs]


def _complement(d: tuple, n_classes: int) -> tuple[list[dict], list[bool]]:
    """Complement over all ``n_classes`` classes: completed with a sink, final states swapped."""
    trans, final = d
    sink = len(trans)
    out = [{c: row.get(c, sink) for c in range(n_classes)} for row in trans]
    out.append({c: sink for c in range(n_classes)})
    return out, [not f for f in final] + [True]


def _lengths(lo: int, hi: int | None, n_classes: int) -> tuple[list[dict], list[bool]]:
    """Strings of ``lo`` to ``hi`` characters (None: no upper bound)."""
    top = hi if hi is not None else lo
    trans = [{c: min(i + 1, top) for c in range(n_classes)} for i in range(top)]
    last = {c: top for c in range(n_classes)} if hi is None else {}
    trans.append(last)
    return trans, [lo <= i for i in range(top + 1)]


def _ranges_node(ranges: list[tuple[int, int]]) -> tuple:
    """A ``sym`` tree of the characters of ``ranges`` (sorted, disjoint), positive or negated, whichever
    names fewer characters."""
    size = sum(hi - lo + 1 for lo, hi in ranges)
    comp, prev = [], 0
    for lo, hi in ranges:
        if lo > prev:
            comp.append((prev, lo - 1))
        prev = hi + 1
    if prev <= _MAX_CP:
        comp.append((prev, _MAX_CP))
    comp = [(lo, hi) for lo, hi in comp if not (lo >= _SURROGATES[0] and hi <= _SURROGATES[1])]
    comp_size = sum(hi - lo + 1 for lo, hi in comp) - sum(
        max(0, min(hi, _SURROGATES[1]) - max(lo, _SURROGATES[0]) + 1) for lo, hi in comp)
    if min(size, comp_size) > MAX_SET_CHARS:
        raise CompileBudgetError(f"a character class of the combined string constraints names more than "
                                 f"{MAX_SET_CHARS} characters either way", None)
    if size <= comp_size:
        return ("sym", (frozenset(chr(c) for lo, hi in ranges for c in range(lo, hi + 1)), False))
    return ("sym", (frozenset(chr(c) for lo, hi in comp for c in range(lo, hi + 1)
                              if not _SURROGATES[0] <= c <= _SURROGATES[1]), True))


def _label(classes: list, ids) -> tuple:
    """The tree of one character of the union of the classes ``ids``."""
    rs = sorted(r for c in ids for r in classes[c])
    merged: list[list[int]] = []
    for lo, hi in rs:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return _ranges_node([(lo, hi) for lo, hi in merged])


def _to_tree(trans: list[dict], final: list[bool], classes: list, max_positions: int, deadline: float) -> tuple:
    """State elimination (module docstring) of a trimmed DFA; start state 0. Each edge's size (positions, as
    :func:`.regex_parse.estimate_positions` counts them, from its parts' sizes) is kept beside it for the
    budget."""
    n = len(trans)
    S, E = n, n + 1  # new start and end
    out: dict[int, dict[int, tuple]] = {s: {} for s in range(n + 2)}
    size: dict[tuple, int] = {}
    inn: dict[int, set] = {s: set() for s in range(n + 2)}
    labels: dict[tuple, tuple] = {}  # (one tree per distinct set of classes: a class may name many characters)

    def add(p: int, q: int, t: tuple, n_pos: int) -> None:
        old = out[p].get(q)
        out[p][q] = t if old is None else _alt(old, t)
        size[p, q] = n_pos + size.get((p, q), 0)
        if size[p, q] > max_positions:
            raise CompileBudgetError(f"the combined string constraints' regex exceeds {max_positions} positions",
                                     None)
        inn[q].add(p)

    for s, row in enumerate(trans):
        by_target: dict[int, list] = {}
        for c, t in row.items():
            by_target.setdefault(t, []).append(c)
        for t, cs in by_target.items():
            key = tuple(sorted(cs))
            label = labels.get(key)
            if label is None:
                label = labels[key] = _label(classes, key)
            add(s, t, label, 1)
        if final[s]:
            add(s, E, _EPS, 0)
    add(S, 0, _EPS, 0)
    alive = set(range(n))
    while alive:
        # fewest new paths first; among equals the state numbered last (a chain is eliminated from its
        # end, which nests its optional tails instead of repeating them)
        k = min(alive, key=lambda s: ((len(inn[s]) - (s in inn[s])) * (len(out[s]) - (s in out[s])), -s))
        alive.discard(k)
        loop = out[k].pop(k, None)
        loop_size = size.pop((k, k), 0)
        inn[k].discard(k)
        star = rep_node(loop, 0, None) if loop is not None else None
        preds = [p for p in inn[k] if p != k]
        succs = [(q, t, size.pop((k, q))) for q, t in out[k].items()]
        for p in preds:
            head, head_size = out[p].pop(k), size.pop((p, k))
            for q, tail, tail_size in succs:
                add(p, q, _cat([head, star, tail] if star is not None else [head, tail]),
                    head_size + loop_size + tail_size)
        for q, _, _ in succs:
            inn[q].discard(k)
        out[k] = {}
        inn[k] = set()
        if time.perf_counter() > deadline:
            raise CompileBudgetError("combining string constraints exceeded the time budget", None)
    return out[S].get(E, None)


def _run(x: tuple) -> tuple:
    """``x`` as ``(base, lo, hi)``: a repetition's parts, else ``(x, 1, 1)``."""
    return (x[1], x[2], x[3]) if x[0] == "rep" else (x, 1, 1)


def _cat(parts) -> tuple:
    """Concatenation, nested ones flattened, with runs of one base merged (``Y Y{0,k}`` is ``Y{1,k+1}``):
    the chains that length bounds make stay flat instead of nesting one group per character."""
    flat: list = []
    for p in parts:
        for q in (p[1] if p[0] == "cat" else (p,)):
            if q == _EPS:
                continue
            if flat:
                (b1, l1, h1), (b2, l2, h2) = _run(flat[-1]), _run(q)
                if b1 == b2:
                    flat[-1] = _rep(b1, l1 + l2, None if h1 is None or h2 is None else h1 + h2)
                    continue
            flat.append(q)
    return cat_node(flat)


def _rep(base: tuple, lo: int, hi: int | None) -> tuple:
    return base if lo == hi == 1 else rep_node(base, lo, hi)


def _alt(a: tuple, b: tuple) -> tuple:
    """``a|b`` with ``eps|x`` as ``x?`` (``Y{1,k}`` then ``Y{0,k}``)."""
    if a == b:
        return a
    if a == _EPS:
        a, b = b, a
    if b == _EPS:
        base, lo, hi = _run(a)
        if a[0] == "rep" and lo <= 1:
            return _rep(base, 0, hi)
        return rep_node(a, 0, 1)
    kids = (a[1] if a[0] == "alt" else (a,)) + (b[1] if b[0] == "alt" else (b,))
    return alt_node(tuple(dict.fromkeys(kids)))


def combine(positive: list, negative: list = (), lo: int = 0, hi: int | None = None, *,
            max_states: int = 5_000, max_positions: int = 20_000, deadline: float | None = None) -> tuple | None:
    """The tree of the strings every tree of ``positive`` matches, no tree of ``negative`` matches, of
    ``lo`` to ``hi`` characters (None: no upper bound); None when there is no such string.

    Args:
        positive, negative: regex trees over characters (full-match semantics); ``positive`` empty: any
            string.
        max_states: budget on each DFA and product (states).
        max_positions: budget on the result tree (:func:`.regex_parse.estimate_positions`).
        deadline: ``time.perf_counter()`` value after which the work stops (None: 5 s from now).

    Raises:
        CompileBudgetError: a budget or the deadline was exceeded.
    """
    if deadline is None:
        deadline = time.perf_counter() + 5.0
    trees = list(positive) + list(negative)
    leaf_index: dict = {ANY_CHAR[1]: 0}
    for t in trees:
        collect_leaves(t, leaf_index)
    leaves = sorted(leaf_index, key=leaf_index.get)
    dfas = []
    classes = None
    for t in trees:
        try:
            d = build_char_dfa(t, max_states=max_states, deadline=deadline, leaves=leaves)
            dfas.append((d.trans, d.final))
            classes = d.classes
        except EmptyLanguageError:  # (no string of it)
            dfas.append(([{}], [False]))
    if classes is None:  # (no tree at all: any string)
        classes = build_char_dfa(ANY_CHAR, leaves=leaves).classes
    k = len(classes)
    acc = _lengths(lo, hi, k)
    for d in dfas[: len(positive)]:
        acc = _product(acc, d, deadline, max_states)
    for d in dfas[len(positive):]:
        acc = _product(acc, _complement(d, k), deadline, max_states)
    trimmed = _trim(*acc)
    if trimmed is None:
        return None
    trans, final = minimize(*trimmed)
    tree = _to_tree(trans, final, classes, max_positions, deadline)
    return tree
