"""The character DFA is minimal (``char_dfa.minimize``, OpenFst through pynini) and keeps its language.

Oracle for minimality: Moore's partition refinement written out in plain Python on the result (no two
states equivalent). Oracle for the language: Python's ``re.fullmatch`` on strings sampled from the
regex and on mutations of them. Corpus: regexes converted from JSON schemas (they repeat
sub-expressions, where subset construction leaves equivalent states) and hand-written ones.
"""

from __future__ import annotations

import random
import re

import pytest

from scripts.bench_compile_serving import tools_required_schema
from vllm_fst_backend.compiler import char_dfa
from vllm_fst_backend.compiler.char_dfa import minimize
from vllm_fst_backend.compiler.constraints import json_schema_to_regex
from vllm_fst_backend.compiler.regex_to_bytes import regex_to_char_dfa

SCHEMAS = [
    {"type": "object"},
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                      "tags": {"type": "array", "items": {"type": "string"}}}},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 150}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
]
# tool_choice="required" as vLLM writes it (an array of tool calls, each an anyOf of {name, parameters}
# objects; tools_required_schema is checked equal to vLLM's own in tests/test_vllm_plugin_unit.py)
TOOLS_REQUIRED = tools_required_schema([
    ("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                      "unit": {"enum": ["C", "F"]}}, "required": ["city"]}),
    ("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}),
])
SCHEMAS.append(TOOLS_REQUIRED)
SCHEMAS.append({"type": "array", "items": {"type": "object", "properties": {"x": {"type": "string", "maxLength": 4}},
                                           "required": ["x"]}})
REGEXES = [json_schema_to_regex(s) for s in SCHEMAS] + [r"(ab|c)(,(ab|c))*;(x(y|z)[0-9])( x(y|z)[0-9])*",
                                                          r"a(;b?a)*", r"(a|)(,(a|))*", r"(ab)*(,(ab)*)*",
    r"(ab|cd)*(ab|ef)", r"[a-z]+( [a-z]+){0,5}", r"(x|y){2,6}z", r"\d{4}-\d{2}-\d{2}", r"(foo|bar|baz)+",
]


def _moore_classes(trans: list[dict], final: list[bool]) -> int:
    """Number of Myhill-Nerode classes of a DFA given as class-id dicts (plain Moore refinement)."""
    block = [1 if f else 0 for f in final]
    n_blocks = len(set(block))
    while True:
        sigs = {}
        new = []
        for s, row in enumerate(trans):
            sig = (block[s], tuple(sorted((c, block[t]) for c, t in row.items())))
            new.append(sigs.setdefault(sig, len(sigs)))
        if len(sigs) == n_blocks:
            return n_blocks
        block, n_blocks = new, len(sigs)


def _samples(regex: str, dfa, n: int, rnd: random.Random) -> list[str]:
    """Random walks of the DFA (one character per class, ending where a walk may stop) and mutations."""
    out = []
    for _ in range(n):
        s, text = 0, []
        for _ in range(rnd.randint(0, 60)):
            if dfa.final[s] and rnd.random() < 0.15:
                break
            row = dfa.trans[s]
            if not row:
                break
            c = rnd.choice(sorted(row))
            lo, hi = rnd.choice(dfa.classes[c])
            text.append(chr(rnd.randint(lo, min(hi, lo + 300))))
            s = row[c]
        t = "".join(text)
        out.append(t)
        if t:
            i = rnd.randrange(len(t))
            out.append(t[:i] + t[i + 1:])
            out.append(t[:i] + rnd.choice('a1" {}[],:') + t[i:])
    return out


@pytest.mark.parametrize("regex", REGEXES, ids=[f"rx{i}" for i in range(len(REGEXES))])
def test_char_dfa_is_minimal_and_keeps_the_language(regex):
    dfa = regex_to_char_dfa(regex, max_states=100_000)
    assert _moore_classes(dfa.trans, dfa.final) == dfa.num_states  # no two states equivalent
    rnd = random.Random(7)
    for text in _samples(regex, dfa, 150, rnd):
        assert dfa.accepts(text) == (re.fullmatch(regex, text) is not None), (regex, text)


def test_minimize_merges_equivalent_states():
    # (a|b)c written with two copies of the "c" state; the minimal DFA has 3 states
    trans = [{0: 1, 1: 2}, {2: 3}, {2: 4}, {}, {}]
    final = [False, False, False, True, True]
    t2, f2 = minimize(trans, final)
    assert len(t2) == 3 and f2 == [False, False, True]
    assert t2[0] == {0: 1, 1: 1} and t2[1] == {2: 2}


def test_json_schema_regexes_lose_states():
    """The JSON-object regex of ``response_format: json_object`` has equivalent states before
    minimization (measured 487 -> 278 at the time of writing); assert a real reduction, computed with
    the plain-Python oracle on the unminimized subset construction."""
    import vllm_fst_backend.compiler.char_dfa as cd

    rx = json_schema_to_regex({"type": "object"})
    orig = cd.minimize
    try:
        cd.minimize = lambda trans, final: (trans, final)
        raw = regex_to_char_dfa(rx, max_states=100_000)
    finally:
        cd.minimize = orig
    small = regex_to_char_dfa(rx, max_states=100_000)
    assert small.num_states == _moore_classes(raw.trans, raw.final) < raw.num_states


def _raw_char_dfa(regex: str):
    """The subset construction's DFA before minimization (trimmed)."""
    import vllm_fst_backend.compiler.char_dfa as cd

    orig = cd.minimize
    try:
        cd.minimize = lambda trans, final: (trans, final)
        return regex_to_char_dfa(regex, max_states=100_000)
    finally:
        cd.minimize = orig


@pytest.mark.parametrize("regex", [r"(a|bc|def)g", r"x(1|22|333)*y",
                                   json_schema_to_regex({"type": "string", "maxLength": 6})])
def test_subset_states_keyed_by_their_future(regex):
    """The subset construction keys a state by the positions it can read next and its finality, not by
    the positions last read: the branches of an alternation that continue alike end in one state. On
    these regexes every equivalent state came from such branch ends (a JSON string character's plain,
    short-escape and \\u-escape ends), so the construction's DFA is already minimal; keyed by the last
    positions it had more states (``(a|bc|def)g``: 7 instead of 5)."""
    raw = _raw_char_dfa(regex)
    assert raw.num_states == _moore_classes(raw.trans, raw.final) == regex_to_char_dfa(regex).num_states


@pytest.mark.parametrize("regex", REGEXES, ids=[f"rx{i}" for i in range(len(REGEXES))])
def test_minimize_through_binary_fst_equals_per_arc_path(regex, monkeypatch):
    """``minimize`` hands the automaton to OpenFst and back in its binary format (numpy); the result is
    exactly that of building and reading it arc by arc through pynini's API (``minimize_reference``):
    same transitions, same finality, same BFS numbering."""
    seen = []
    monkeypatch.setattr(char_dfa, "minimize", lambda t, f: seen.append((t, f)) or minimize(t, f))
    regex_to_char_dfa(regex, max_states=100_000)
    (trans, final), = seen
    got = minimize(trans, final)
    assert got == char_dfa.minimize_reference(trans, final)


SEPARATED = [json_schema_to_regex(TOOLS_REQUIRED), json_schema_to_regex(SCHEMAS[-1]),
             r"(ab|c)(,(ab|c))*;(x(y|z)[0-9])( x(y|z)[0-9])*"]


OPTIONAL_TAILS = [
    json_schema_to_regex({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 6} for i in range(9)}}),
    json_schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "object", "properties": {
        "c": {"type": "string"}, "d": {"enum": [1, 2]}}}, "e": {"type": "boolean"}}, "required": ["e"]}),
    r"(ab(, ?cd)?|cd)x(y(;z+)?|z+)",
]
SHARED = [("share_separated_lists", rx) for rx in SEPARATED] + [("share_optional_tails", rx) for rx in OPTIONAL_TAILS]


@pytest.mark.parametrize("switch,regex", SHARED, ids=[f"{sw.split('_')[1]}{i}" for i, (sw, _) in enumerate(SHARED)])
def test_shared_positions_keep_the_minimal_dfa(switch, regex, monkeypatch):
    """``X (S X)*`` is built with one copy of X (``_Glushkov.share_separated_lists``) and ``X (S M)? | M``
    with one copy of M (``_Glushkov.share_optional_tails``; the converter's leading optional properties
    are chains of it): the subset construction makes fewer states, and the minimal DFA is the same,
    transition for transition, as with two copies."""
    import vllm_fst_backend.compiler.char_dfa as cd

    raw = {}
    for share in (None, True, False):  # (None: the default, which shares)
        if share is not None:
            monkeypatch.setattr(cd._Glushkov, switch, share)
        seen = []
        monkeypatch.setattr(cd, "minimize", lambda t, f: seen.append(len(t)) or minimize(t, f))
        dfa = regex_to_char_dfa(regex, max_states=100_000, max_positions=10**6)
        raw[share] = (seen[0], dfa.trans, dfa.final, dfa.classes)
    assert raw[None] == raw[True]
    assert raw[True][0] < raw[False][0]
    assert raw[True][1:] == raw[False][1:]


def test_optional_tails_are_found_where_exact():
    """:func:`regex_parse.optional_tail` finds ``X (S M)? | M`` with X, S, M not nullable (M once as a node
    or as the items of a concatenation); :func:`regex_parse.estimate_positions` counts M once there."""
    from vllm_fst_backend.compiler.regex_parse import estimate_positions, optional_tail, parse_regex

    def sym(c):
        return ("sym", (frozenset(c), False))

    assert optional_tail(parse_regex(r"(ab(,cd)?|cd)")) == ((sym("a"), sym("b")), (sym(","),),
                                                            ("cat", (sym("c"), sym("d"))))
    assert optional_tail(parse_regex(r"(ab(;c+)?|c+)")) == ((sym("a"), sym("b")), (sym(";"),), ("rep", sym("c"), 1, None))
    for rx in (r"(ab(,cd)?|ce)", r"(ab(,cd)?|cd|e)", r"(a?(,c)?|c)", r"(ab(c)?|c)", r"(ab(,?c)?|c)",
               r"(ab(,c){0,2}|c)", r"(ab(,c?)?|c?)", r"(cd|ab(,cd)?)"):
        assert optional_tail(parse_regex(rx)) is None, rx
    assert estimate_positions(parse_regex(r"(ab(,cd)?|cd)")) == 2 + 1 + 2
    assert estimate_positions(parse_regex(r"(ab(,cd)?|ce)")) == 2 + 3 + 2


def test_separated_lists_are_found_where_exact():
    """:func:`regex_parse.separated_lists` finds ``X (S X)*`` with S and X not nullable (the longest X);
    :func:`regex_parse.estimate_positions` counts X once there."""
    from vllm_fst_backend.compiler.regex_parse import estimate_positions, parse_regex, separated_lists

    def found(rx):
        node = parse_regex(rx)
        return separated_lists(node[1]) if node[0] == "cat" else {}

    assert found(r"\[(ab|c)(,(ab|c))*\]") == {1: (2, (("sym", (frozenset(","), False)),))}
    assert list(found(r"\[ab(,ab)*\]")) == [1]  # X = "ab": two children of the outer concatenation
    assert found(r"a(a)*") == {}  # S empty: a plain a+, not rewritten
    assert found(r"\[a?(,a?)*\]") == {}  # X nullable
    assert found(r"\[a(b?a)*\]") == {}  # S nullable
    assert found(r"\[a(,a){0,3}\]") == {}  # a bounded count keeps its copies
    assert estimate_positions(parse_regex(r"\[abc(,abc)*\]")) == 2 + 3 + 1
    assert estimate_positions(parse_regex(r"\[abc(,abd)*\]")) == 2 + 3 + 4
