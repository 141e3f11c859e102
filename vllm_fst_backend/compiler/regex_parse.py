"""Regex text → a small syntax tree over character sets, with typed errors carrying positions.

Syntax is interegular's (Python ``re`` subset): literals, ``.``, classes ``[...]`` / ``[^...]``, escapes
``\\d \\w \\s \\D \\W \\S \\n \\t \\xNN \\0oo``, groups ``(...)``, ``(?:...)``, ``(?P<name>...)``,
alternation, ``* + ? {n} {n,} {,m} {n,m}`` (lazy ``?`` suffix accepted, same language), inline flags
``(?i) (?s)`` and ``(?i:...)``. The whole output must match (as ``re.fullmatch``). On top of
interegular we accept ``\\uXXXX`` / ``\\UXXXXXXXX`` escapes and a leading ``^`` / trailing ``$``
(no-ops under full match). ``\\d \\w \\s`` are ASCII (as ``re.ASCII``); ``.`` excludes ``\\n`` unless
``(?s)``.

Errors (all subclasses of :class:`~vllm_fst_backend.errors.RegexError`, ``position`` = 0-based offset
into the *original* regex):

* :class:`RegexSyntaxError` -- does not parse (unbalanced parentheses, bad range ``[z-a]``, ``{3,2}``);
* :class:`UnsupportedRegexError` -- backreferences, lookarounds, anchors inside the pattern, ``\\b``,
  conditionals, unsupported flags, Unicode properties ``\\p{..}``;
* :class:`CompileBudgetError` -- the expanded size (character positions after unrolling counted
  repetitions) exceeds the budget; estimated from the tree *before* anything is expanded.

Tree nodes (tuples, immutable):

* ``("sym", CharSet)`` -- one character of a set; ``CharSet = (chars: frozenset[str], negated: bool)``;
* ``("cat", (node, ...))``, ``("alt", (node, ...))``;
* ``("rep", node, min, max_or_None)``; ``("eps",)``.
"""

from __future__ import annotations

import functools
import re as _re
import threading
import time
from collections import OrderedDict

from ..errors import CompileBudgetError, RegexError, RegexSyntaxError, UnsupportedRegexError
from .limits import InputLimits, check_regex

__all__ = ["parse_regex", "estimate_positions", "escape_literal", "CharSet", "MAX_GROUP_DEPTH", "cat_node", "alt_node",
           "rep_node", "literal_node", "fragment_tree", "remember_tree", "known_tree"]

CharSet = tuple  # (frozenset[str], bool)

_EPS = ("eps",)

_INLINE_FLAGS = _re.compile(r"\(\?([a-zA-Z]*)(?:-([a-zA-Z]*))?[:)]")

#: Deepest group nesting accepted. interegular's parser recurses about 10 Python frames per level
#: (measured: 99 levels exhaust the default recursion limit of 1000); real regexes, including those
#: converted from JSON schemas within ``InputLimits.max_schema_depth``, nest well under 50.
MAX_GROUP_DEPTH = 50


_REGEX_META = frozenset("\\.^$*+?{}[]|()")
_CONTROL_ESCAPES = {"\n": r"\n", "\t": r"\t", "\r": r"\r"}


def escape_literal(text: str) -> str:
    """Escape ``text`` so that a regex of this dialect matches it literally: a backslash before each
    regex metacharacter only (``re.escape`` also escapes space, ``-``, ``#``, ``&``, ``~``, which not
    every regex parser reads back as literals), control characters as ``\\n``-style or ``\\xNN``
    escapes. Linear in ``len(text)``."""
    out = []
    for ch in text:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ch in _CONTROL_ESCAPES:
            out.append(_CONTROL_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _find_unsupported(regex: str, max_depth: int | None = None) -> tuple[str, int] | None:
    """Scan ``regex`` (escapes and classes respected) for constructs no finite automaton of ours
    expresses; returns (description, position) of the first one, or None. One linear pass (every
    step advances ``i``; no slice of the rest of the text).

    Raises:
        CompileBudgetError: groups nested deeper than ``max_depth`` (when given); ``position`` is the
            offset in ``regex`` of the first parenthesis over the limit.
    """
    i, n = 0, len(regex)
    in_class = False
    depth = 0
    while i < n:
        c = regex[i]
        if c == "\\":
            if i + 1 >= n:
                return None  # dangling backslash: a syntax error, reported by the parser
            d = regex[i + 1]
            if not in_class:
                if d in "123456789":
                    return ("backreference", i)
                if d in "bBAZzG":
                    return (f"anchor/word boundary \\{d}", i)
                if d == "g":
                    return ("backreference \\g<...>", i)
            if d in "pPN":
                return (f"Unicode property/name escape \\{d}", i)
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            i += 1
            continue
        if c == "[":
            in_class = True
            i += 1
            if i < n and regex[i] == "^":
                i += 1
            if i < n and regex[i] == "]":
                i += 1  # a leading ']' is a literal in Python
            continue
        if c == "(":
            depth += 1
            if max_depth is not None and depth > max_depth:
                raise CompileBudgetError(
                    f"regex nests groups more than {max_depth} deep; flatten the pattern", i
                )
        elif c == ")" and depth:
            depth -= 1
        if c == "(" and regex.startswith("(?", i):
            rest = regex[i + 2 : i + 4]
            if rest.startswith("="):
                return ("lookahead (?=...)", i)
            if rest.startswith("!"):
                return ("negative lookahead (?!...)", i)
            if rest.startswith("<=") or rest.startswith("<!"):
                return ("lookbehind", i)
            if rest.startswith("P="):
                return ("named backreference (?P=...)", i)
            if rest.startswith("("):
                return ("conditional (?(...)...)", i)
            if rest.startswith(">"):
                return ("atomic group (?>...)", i)
            m = _INLINE_FLAGS.match(regex, i)  # anchored at i: no copy of regex[i:] (was quadratic)
            if m:
                for k, f in enumerate((m.group(1) or "") + (m.group(2) or "")):
                    if f not in "is":
                        return (f"inline flag {f!r}", i + 2 + k)
        if c == "^":
            return ("anchor '^' inside the pattern", i)
        if c == "$":
            return ("anchor '$' inside the pattern", i)
        i += 1
    return None


def _preprocess(regex: str) -> tuple[str, list[int]]:
    """Strip a leading ``^`` / trailing ``$``; rewrite ``\\uXXXX`` and ``\\UXXXXXXXX`` into literal
    characters. Returns (new text, map from new offsets (len+1 entries) to original offsets)."""
    out: list[str] = []
    pos: list[int] = []
    start, end = 0, len(regex)
    if regex.startswith("^"):
        start = 1
    if end > start and regex.endswith("$"):
        # a '$' preceded by an even number of backslashes is an anchor
        k = end - 2
        bs = 0
        while k >= start and regex[k] == "\\":
            bs += 1
            k -= 1
        if bs % 2 == 0:
            end -= 1
    i = start
    in_class = False
    while i < end:
        c = regex[i]
        if c == "\\" and i + 1 < end:
            d = regex[i + 1]
            width = 4 if d == "u" else 8 if d == "U" else 0
            if width:
                hexd = regex[i + 2 : i + 2 + width]
                if len(hexd) != width or not all(h in "0123456789abcdefABCDEF" for h in hexd):
                    raise RegexSyntaxError(f"bad escape \\{d}: expected {width} hex digits", i)
                cp = int(hexd, 16)
                if cp > 0x10FFFF:
                    raise RegexSyntaxError(f"bad escape \\{d}{hexd}: code point above U+10FFFF", i)
                ch = chr(cp)
                special = "\\]-^[" if in_class else "\\.^$*+?{}[]|()"
                # re-escape specials; write other characters literally
                text = ("\\" + ch) if ch in special else (f"\\x{cp:02x}" if cp < 0x20 or cp == 0x7F else ch)
                for t in text:
                    out.append(t)
                    pos.append(i)
                i += 2 + width
                continue
            out.append(c)
            pos.append(i)
            out.append(d)
            pos.append(i + 1)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            pos.append(i)
            i += 1
            for lit in ("^", "]"):
                if i < end and regex[i] == lit:
                    out.append(lit)
                    pos.append(i)
                    i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        pos.append(i)
        i += 1
    pos.append(end)
    return "".join(out), pos


def _fold_case(chars: frozenset) -> frozenset:
    more = set(chars)
    for c in chars:
        for d in (c.lower(), c.upper(), c.swapcase()):
            if len(d) == 1:
                more.add(d)
    return frozenset(more)


def cat_node(parts) -> tuple:
    """The tree of the concatenation of the trees ``parts`` as the parser makes it: ``("eps",)`` parts
    dropped, a single part itself."""
    parts = [q for q in parts if q != _EPS]
    if not parts:
        return _EPS
    return parts[0] if len(parts) == 1 else ("cat", tuple(parts))


def alt_node(options) -> tuple:
    """The tree of the alternation of the trees ``options`` (in order) as the parser makes it."""
    options = tuple(options)
    return options[0] if len(options) == 1 else ("alt", options)


def rep_node(base: tuple, lo: int, hi: int | None) -> tuple:
    """The tree of ``base{lo,hi}`` (``hi`` None: unbounded) as the parser makes it:
    ``(x{0,k}){m,n}`` is ``x{0,k*n}`` (every copy may be empty; avoids quadratic follow sets)."""
    if base[0] == "rep" and base[2] == 0:
        k = base[3]
        return ("rep", base[1], 0, None if (k is None or hi is None) else k * hi)
    return ("rep", base, lo, hi)


def literal_node(text: str) -> tuple:
    """The tree of :func:`escape_literal` (``text``): one single-character set per character."""
    return cat_node([("sym", (frozenset(c), False)) for c in text])


def _convert(p, flags_i: bool, flags_s: bool, regex: str):
    """interegular pattern objects → our tuples (applying the i/s flags)."""
    import interegular.patterns as ip

    if isinstance(p, ip.Pattern):
        fl_i, fl_s = flags_i, flags_s
        if p.added_flags & ip.REFlags.I:
            fl_i = True
        if p.removed_flags & ip.REFlags.I:
            fl_i = False
        if p.added_flags & ip.REFlags.S:
            fl_s = True
        if p.removed_flags & ip.REFlags.S:
            fl_s = False
        return alt_node([_convert(o, fl_i, fl_s, regex) for o in p.options])
    if isinstance(p, ip._Concatenation):
        parts = []
        for q in p.parts:
            if isinstance(q, ip._NonCapturing):
                found = _find_unsupported(regex)
                raise UnsupportedRegexError("lookarounds are not supported", found[1] if found else None)
            parts.append(_convert(q, flags_i, flags_s, regex))
        return cat_node(parts)
    if isinstance(p, ip._Repeated):
        base = _convert(p.base, flags_i, flags_s, regex)
        if p.max is not None and p.min > p.max:
            m = _re.search(r"\{\s*%d\s*,\s*%d\s*\}" % (p.min, p.max), regex)
            raise RegexSyntaxError(
                f"min repeat {p.min} greater than max repeat {p.max}", m.start() if m else None
            )
        return rep_node(base, int(p.min), None if p.max is None else int(p.max))
    if isinstance(p, ip._CharGroup):
        chars = frozenset(p.chars)
        if flags_i:
            chars = _fold_case(chars)
        return ("sym", (chars, bool(p.negated)))
    if p is ip._DOT:
        return ("sym", (frozenset() if flags_s else frozenset("\n"), True))
    if p is ip._EMPTY:
        return _EPS
    raise UnsupportedRegexError(f"unsupported regex construct {type(p).__name__}", None)


def _check_deadline(deadline: float | None, stage: str) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise CompileBudgetError(f"regex compilation exceeded the time budget ({stage})", None)


def parse_regex(regex: str, max_positions: int = 20000, *, deadline: float | None = None,
                limits: InputLimits | None = None):
    """Parse ``regex`` into a tree (module docstring) and check its expanded size.

    Bounded work (issue 14): the length is checked first (O(1), :func:`.limits.check_regex`); every
    scan of the text is one linear pass; group nesting is capped at :data:`MAX_GROUP_DEPTH` before the
    (recursive) parser runs; ``deadline`` is checked between the stages (interegular's parser itself
    cannot be interrupted: its cost is bounded by the length limit, about 15 µs per character of a
    long literal alternation on the development host). A regex whose tree the JSON-schema converter
    recorded (:func:`remember_tree`) is not parsed again; its size is checked the same way.

    Args:
        regex: the constraint; the whole output must match it.
        max_positions: budget on character positions after unrolling counted repetitions
            (``.{5000}`` has 5000).
        deadline: ``time.perf_counter()`` value after which parsing stops (None: no deadline).
        limits: :class:`~.limits.InputLimits` (None: :meth:`InputLimits.from_env`).

    Returns:
        The tree root (a tuple node).

    Raises:
        InputTooLargeError: longer than ``limits.max_regex_chars``.
        RegexSyntaxError, UnsupportedRegexError (with ``position``), CompileBudgetError (expanded size,
        nesting depth, deadline).
        InvalidOptionError: a malformed ``VLLM_FST_MAX_*`` environment variable (``limits`` None).
    """
    if not isinstance(regex, str):
        raise RegexSyntaxError(f"regex must be a str, got {type(regex).__name__}", None)
    check_regex(regex, InputLimits.from_env() if limits is None else limits)
    node = known_tree(regex)
    if node is None:
        node = _parse_text(regex, deadline)
    _check_deadline(deadline, "parse")
    n = estimate_positions(node)
    if n > max_positions:
        raise CompileBudgetError(
            f"regex expands to about {n} character positions after unrolling repetitions "
            f"(budget {max_positions}); use a smaller bound or an unbounded repetition",
            None,
        )
    return node


def _parse_text(regex: str, deadline: float | None):
    """:func:`parse_regex`'s parse of the text by interegular (no size checks)."""
    import interegular.patterns as ip
    from interegular.utils.simple_parser import NoMatch

    text, pos_map = _preprocess(regex)
    try:
        found = _find_unsupported(text, MAX_GROUP_DEPTH)
    except CompileBudgetError as e:
        raise CompileBudgetError(str(e).split(" (at position")[0], pos_map[e.position]) from None
    _check_deadline(deadline, "scan")
    if found is not None:
        raise UnsupportedRegexError(f"unsupported regex construct: {found[0]}", pos_map[found[1]])
    parser = ip._ParsePattern(text)
    try:
        tree = parser.parse()
    except NoMatch as e:
        idx = min(e.index, len(text))
        raise RegexSyntaxError("regex does not parse", pos_map[idx]) from None
    except ip.InvalidSyntax as e:
        # interegular turns its NoMatch (which knows the furthest position it expected something at)
        # into a bare InvalidSyntax; recover that position from the parser's bookkeeping
        exp = getattr(parser, "_expected", None)
        idx = max(exp) if (exp and not str(e)) else parser.index
        idx = min(idx, len(text))
        raise RegexSyntaxError(f"regex does not parse: {e}" if str(e) else "regex does not parse", pos_map[idx]) from None
    except ip.Unsupported as e:
        idx = max(0, min(parser.index - 1, len(text)))
        raise UnsupportedRegexError(f"unsupported regex construct: {e}", pos_map[idx]) from None
    except RecursionError:  # MAX_GROUP_DEPTH keeps clear of this unless the caller's stack is deep
        raise CompileBudgetError("regex nests too deeply for the parser; flatten the pattern", None) from None
    except (ValueError, OverflowError) as e:  # e.g. chr() out of range in a class
        idx = min(parser.index, len(text))
        raise RegexSyntaxError(f"regex does not parse: {e}", pos_map[idx]) from None
    flag_i = bool(parser.flags and parser.flags & ip.REFlags.I)
    flag_s = bool(parser.flags and parser.flags & ip.REFlags.S)
    try:
        node = _convert(tree, flag_i, flag_s, text)
    except UnsupportedRegexError as e:
        if e.position is not None and e.position < len(pos_map):
            raise UnsupportedRegexError(str(e).split(" (at position")[0], pos_map[e.position]) from None
        raise
    except RegexSyntaxError as e:
        if e.position is not None and e.position < len(pos_map):
            raise RegexSyntaxError(str(e).split(" (at position")[0], pos_map[e.position]) from None
        raise
    return node


# --- trees known without parsing: regexes the JSON-schema converter composed -------------------------
# The converter (:mod:`.json_schema`) builds its regex from fragments and knows the tree of each
# (:func:`fragment_tree` for a fixed or user-given piece, the node constructors above for its own
# operators), so it records the whole regex's tree here and the compile that follows in the same process
# does not parse the text again: interegular's parser costs ~2.5 µs per character (44 ms of a real-world
# schema's 11,000-character regex, a quarter of its compile). tests/test_json_schema.py checks the trees
# against the parser's on the JSON Schema Test Suite.

KNOWN_TREES_MAX = 4  # regexes whose tree is kept (the most recent conversions: each is compiled right after)
_KNOWN: "OrderedDict[str, tuple]" = OrderedDict()
_KNOWN_LOCK = threading.Lock()


def remember_tree(regex: str, tree: tuple) -> None:
    """Record ``tree`` as the parse of ``regex`` (it must equal what the parser makes of it) for
    :func:`parse_regex`; the :data:`KNOWN_TREES_MAX` most recent are kept."""
    with _KNOWN_LOCK:
        _KNOWN[regex] = tree
        _KNOWN.move_to_end(regex)
        while len(_KNOWN) > KNOWN_TREES_MAX:
            _KNOWN.popitem(last=False)


def known_tree(regex: str) -> tuple | None:
    """The tree recorded for ``regex`` by :func:`remember_tree`, or None."""
    with _KNOWN_LOCK:
        return _KNOWN.get(regex)


@functools.lru_cache(maxsize=1024)
def fragment_tree(text: str) -> tuple | None:
    """The tree of a regex fragment that is concatenated, alternated or repeated into a larger regex
    as a unit, or None when its parse alone may differ from its part in the whole (anchors, inline
    flags) or it does not parse (the whole regex is then parsed and reports the error). Memoized: the
    converter's fixed pieces (a JSON string character, a number, formats) are parsed once per process."""
    if not text or text.startswith("^") or text.endswith("$") or "(?" in text:
        return None
    try:
        return _parse_text(text, None)
    except (RegexError, CompileBudgetError, RecursionError):
        return None


def nullable(node) -> bool:
    """Whether the regex tree ``node`` matches the empty string."""
    k = node[0]
    if k == "sym":
        return False
    if k == "eps":
        return True
    if k == "cat":
        return all(nullable(c) for c in node[1])
    if k == "alt":
        return any(nullable(c) for c in node[1])
    return node[2] == 0 or nullable(node[1])  # rep


def separated_lists(kids) -> dict:
    """The separated lists ``X (S X)*`` among the children ``kids`` of a concatenation node: ``{i: (j,
    S)}`` for each run ``kids[i:j]`` = X followed by ``kids[j]`` = ``(S X)*``, where S (a tuple of
    nodes) is the leading part of the repeated concatenation and neither S nor X matches the empty
    string; leftmost first, the longest X, not overlapping. JSON arrays (``\\[X(,X)*\\]``) and
    ``tool_choice="required"``'s array of tool calls have this form; the character DFA builds X once
    for them (:mod:`.char_dfa`), and :func:`estimate_positions` counts it once."""
    out: dict = {}
    done = 0
    for j, kid in enumerate(kids):
        if kid[0] != "rep" or kid[2] != 0 or kid[3] is not None or kid[1][0] != "cat":
            continue
        body = kid[1][1]
        m, most = 0, min(j - done, len(body) - 1)  # the common suffix of body and kids[:j] (S not empty)
        while m < most and body[-1 - m] == kids[j - 1 - m]:
            m += 1
        if m:
            sep = tuple(body[: len(body) - m])
            if not nullable(("cat", sep)) and not nullable(("cat", tuple(kids[j - m : j]))):
                out[j - m] = (j, sep)
                done = j + 1
    return out


def optional_tail(node) -> tuple | None:
    """``(X, S, M)`` when the alternation ``node`` is ``X (S M)? | M`` (two options, the second M again at
    the end of the optional part; X, S, M not nullable), else None. X and S are tuples of nodes (the items
    of a concatenation), M a node. The language is X | X S M | M: a position automaton may build M once,
    entered from the start and from S's last positions (:mod:`.char_dfa`), and :func:`estimate_positions`
    counts it once. The JSON-schema converter writes "some of these members, in order, comma-separated"
    (an object's leading optional properties) as a chain of such alternations, so the members' positions
    are not copied once per place they may start the object."""
    if node[0] != "alt" or len(node[1]) != 2:
        return None
    first, m = node[1]
    if first[0] != "cat" or len(first[1]) < 2:
        return None
    opt = first[1][-1]
    if opt[0] != "rep" or opt[2] != 0 or opt[3] != 1 or opt[1][0] != "cat":
        return None
    body = opt[1][1]
    if m[0] == "cat" and len(body) > len(m[1]) and body[len(body) - len(m[1]):] == m[1]:
        sep = body[: len(body) - len(m[1])]
    elif len(body) > 1 and body[-1] == m:
        sep = body[:-1]
    else:
        return None
    x = first[1][:-1]
    if nullable(m) or nullable(("cat", sep)) or nullable(("cat", x)):
        return None
    return x, sep, m


def estimate_positions(node) -> int:
    """Number of character positions of ``node`` after unrolling counted repetitions (an upper bound
    on the position automaton's size). Computed on the tree without expanding anything; saturates at
    ``10**12``."""
    cap = 10**12
    kind = node[0]
    if kind == "sym":
        return 1
    if kind == "eps":
        return 0
    if kind == "cat":
        kids = node[1]
        lists = separated_lists(kids)
        total, i = 0, 0
        while i < len(kids):
            if i in lists:  # X (S X)*: X's positions once, then S's
                j, sep = lists[i]
                total += sum(estimate_positions(c) for c in kids[i:j]) + sum(estimate_positions(c) for c in sep)
                i = j + 1
            else:
                total += estimate_positions(kids[i])
                i += 1
        return min(cap, total)
    if kind == "alt":
        tail = optional_tail(node)
        if tail is not None:  # X (S M)? | M: M's positions once
            x, sep, m = tail
            return min(cap, estimate_positions(("cat", x)) + estimate_positions(("cat", sep)) + estimate_positions(m))
        return min(cap, sum(estimate_positions(c) for c in node[1]))
    if kind == "rep":
        inner = estimate_positions(node[1])
        lo, hi = node[2], node[3]
        times = (lo + 1) if hi is None else max(hi, 1)
        return min(cap, inner * max(times, 1))
    raise ValueError(kind)
