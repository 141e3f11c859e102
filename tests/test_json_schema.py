"""compiler/json_schema.py: JSON Schema → regex, exact or refusing.

The judge is ``jsonschema`` (Draft202012Validator with a FormatChecker) and, for the official JSON
Schema Test Suite (vendored in tests/data/json_schema_test_suite, MIT), the suite's own verdicts. The core
property checked everywhere: **never a larger language** -- every string a converted regex accepts
parses as JSON and is valid (strings are sampled *from the regex itself* and validated); plus the
documented smaller-language choices do not reject the natural serializations (compact, keys in schema
order).
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import random
import re
import time
import zlib
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from vllm_fst_backend.compiler.json_schema import escape_literal, json_schema_to_regex
from vllm_fst_backend.compiler.limits import InputLimits
from vllm_fst_backend.compiler.regex_parse import estimate_positions, parse_regex
from vllm_fst_backend.errors import (
    CompileBudgetError,
    EmptyLanguageError,
    FstBackendError,
    InputTooLargeError,
    InvalidOptionError,
    InvalidSchemaError,
    UnsupportedSchemaError,
)

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "tests" / "data" / "json_schema_test_suite" / "draft2020-12"
NAMED = (UnsupportedSchemaError, InvalidSchemaError, EmptyLanguageError, InputTooLargeError, CompileBudgetError)


def compact(v) -> str:
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False)


def validator(schema):
    # the draft's own checker: FormatChecker() would also check "time" with draft 3's meaning (no offset)
    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


def is_valid_text(schema, text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return validator(schema).is_valid(value)


# ------------------------------------------------------------------------------------------------
# Sampling strings from a regex (parse_regex tree): the "never larger" oracle
# ------------------------------------------------------------------------------------------------

_POOL = [chr(c) for c in range(0x20, 0x7F)] + list("\x00\x01\x1f\t\n\r\x7féßЖ中😀\u2028\u00a0٣")


def _sample(node, rnd: random.Random, out: list, budget: list) -> None:
    kind = node[0]
    if kind == "sym":
        chars, negated = node[1]
        if negated:
            pool = [c for c in _POOL if c not in chars]
            out.append(rnd.choice(pool))
        else:
            out.append(rnd.choice(sorted(chars)))
    elif kind == "cat":
        for c in node[1]:
            _sample(c, rnd, out, budget)
    elif kind == "alt":
        _sample(rnd.choice(node[1]), rnd, out, budget)
    elif kind == "rep":
        lo, hi = node[2], node[3]
        budget[0] -= 1
        cap = lo + (3 if budget[0] > 0 else 0)
        n = rnd.randint(lo, cap if hi is None else min(hi, cap))
        for _ in range(n):
            _sample(node[1], rnd, out, budget)


def sample(regex: str, n: int, seed: int = 0) -> list[str]:
    tree = parse_regex(regex, max_positions=10**6)
    rnd = random.Random(seed)
    res = []
    for _ in range(n):
        out: list[str] = []
        _sample(tree, rnd, out, [60])
        res.append("".join(out))
    return res


def mutate(text: str, rnd: random.Random) -> str:
    i = rnd.randrange(len(text) + 1)
    op = rnd.random()
    ch = rnd.choice('0123456789",:{}[]-.eE aztrufnl\\')
    if op < 0.35 and text:
        return text[:i] + text[i + 1:]
    if op < 0.7:
        return text[:i] + ch + text[i:]
    return text[:i] + ch + text[i + 1:]


def assert_never_larger(schema, n: int = 150, seed: int = 0, rx: str | None = None) -> str:
    """Every sampled string of the regex (and every mutation it still accepts) is valid."""
    rx = json_schema_to_regex(schema) if rx is None else rx
    parse_regex(rx, max_positions=10**6)
    c = re.compile(rx)
    rnd = random.Random(seed)
    for s in sample(rx, n, seed):
        assert c.fullmatch(s), (rx, s)
        assert is_valid_text(schema, s), f"regex accepts invalid {s!r} for {schema}"
        for _ in range(3):
            m = mutate(s, rnd)
            if c.fullmatch(m):
                assert is_valid_text(schema, m), f"regex accepts invalid mutation {m!r} for {schema}"
    return rx


def accepts(schema, value, **kw) -> bool:
    return re.fullmatch(json_schema_to_regex(schema, **kw), compact(value)) is not None


# ------------------------------------------------------------------------------------------------
# Property order, optional / required
# ------------------------------------------------------------------------------------------------

_VALUES = {"string": ["x", 3], "integer": [7, "7"], "boolean": [True, None]}


@pytest.mark.parametrize("required", [[], ["mid"], ["zeta", "beta"], ["alpha"], ["zeta", "alpha", "mid", "beta"]])
@pytest.mark.parametrize("extra,open_objects", [(False, False), (None, False), (True, False), (None, True)])
def test_property_order_and_optional_required_brute_force(required, extra, open_objects):
    types = {"zeta": "string", "alpha": "integer", "mid": "boolean", "beta": "string"}
    schema = {"type": "object", "properties": {k: {"type": t} for k, t in types.items()}, "required": required}
    if extra is not None:
        schema["additionalProperties"] = extra
    rx = re.compile(json_schema_to_regex(schema, open_objects=open_objects))
    closed = not (extra or (extra is None and open_objects))
    order = list(types)
    v = validator(schema)
    n_ok = 0
    for r in range(len(order) + 1):
        for keys in itertools.permutations(order, r):
            for choice in itertools.product(*[range(2) for _ in keys]):
                inst = {k: _VALUES[types[k]][c] for k, c in zip(keys, choice)}
                text = compact(inst)
                in_order = [k for k in order if k in keys] == list(keys)
                expected = v.is_valid(inst) and in_order
                assert bool(rx.fullmatch(text)) == expected, (schema, text)
                n_ok += expected
    assert n_ok > 0
    if not closed:  # extra keys after the declared ones (scalar values), never a declared name again
        base = {k: _VALUES[types[k]][0] for k in order}
        assert rx.fullmatch(compact({**base, "extra": 1, "more": "y"}))
        assert not rx.fullmatch(compact({**base, "zeta": "x"}).replace("}", ',"zeta":"y"}'))
        assert not rx.fullmatch(compact({"extra": 1, **base}))  # extras come last
    else:  # declared names only: silent about extra keys is closed unless open_objects (documented)
        assert not rx.fullmatch(compact({**{k: _VALUES[types[k]][0] for k in order}, "extra": 1}))


def test_nested_property_order_and_default_serialization():
    inner = {"type": "object", "properties": {"y": {"type": "integer"}, "b": {"type": "string"}},
             "required": ["y", "b"], "additionalProperties": False}
    schema = {"type": "object", "properties": {"z": inner, "a": {"type": "array", "items": inner}},
              "required": ["z", "a"], "additionalProperties": False}
    rx = json_schema_to_regex(schema)
    good = {"z": {"y": 1, "b": "q"}, "a": [{"y": 2, "b": "r"}, {"y": 3, "b": ""}]}
    assert re.fullmatch(rx, compact(good))
    assert re.fullmatch(rx, json.dumps(good))  # json.dumps' default ", " and ": " separators
    swapped = {"z": {"b": "q", "y": 1}, "a": []}
    assert not re.fullmatch(rx, compact(swapped))
    assert not re.fullmatch(rx, compact({"a": [], "z": {"y": 1, "b": "q"}}))
    assert_never_larger(schema)


def test_many_optional_properties_stay_small_and_flat():
    props = {f"p{i:02d}": {"type": "object", "properties": {f"q{j}": {"type": "integer"} for j in range(6)},
                           "additionalProperties": False} for i in range(24)}
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    rx = json_schema_to_regex(schema)
    parse_regex(rx, max_positions=10**6)  # group nesting within regex_parse.MAX_GROUP_DEPTH
    one = sum(len(json_schema_to_regex(p)) for p in props.values())
    assert len(rx) < 8 * one  # each optional member repeated a bounded number of times
    c = re.compile(rx)
    assert c.fullmatch("{}") and c.fullmatch('{"p23":{}}') and c.fullmatch('{"p00":{"q5":1},"p07":{}}')
    assert not c.fullmatch('{"p07":{},"p00":{}}')
    assert_never_larger(schema, n=60)


def test_required_names_not_in_properties_and_false_properties():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "gone": False}, "required": ["z"],
              "additionalProperties": {"type": "string"}}
    rx = assert_never_larger(schema)
    assert re.fullmatch(rx, '{"a":1,"z":"s"}') and re.fullmatch(rx, '{"z":"s","k":"v"}')
    assert not re.fullmatch(rx, '{"z":"s","gone":"v"}') and not re.fullmatch(rx, '{"a":1}')
    with pytest.raises(EmptyLanguageError):
        json_schema_to_regex({"type": "object", "required": ["z"], "additionalProperties": False})


def test_extra_keys_complement_of_declared_names():
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "nab": {"type": "integer"}},
              "additionalProperties": {"type": "boolean"}}
    c = re.compile(json_schema_to_regex(schema))
    for key, ok in [("x", True), ("", True), ("n", True), ("na", True), ("nam", True), ("nax", True),
                    ("name", False), ("nab", False), ("names", False), ("namx", False), ("zz", True)]:
        assert bool(c.fullmatch(compact({key: True}))) == ok, key
    assert not c.fullmatch(r'{"n\u0061me":true}')  # an escaped spelling of a declared name
    assert_never_larger(schema)


# ------------------------------------------------------------------------------------------------
# Integer and number bounds
# ------------------------------------------------------------------------------------------------


def _int_schema(lo, hi, lo_kw="minimum", hi_kw="maximum", **more):
    s = {"type": "integer", **more}
    if lo is not None:
        s[lo_kw] = lo
    if hi is not None:
        s[hi_kw] = hi
    return s


def _int_ok(v, s) -> bool:
    return (("minimum" not in s or v >= s["minimum"]) and ("maximum" not in s or v <= s["maximum"])
            and ("exclusiveMinimum" not in s or v > s["exclusiveMinimum"])
            and ("exclusiveMaximum" not in s or v < s["exclusiveMaximum"])
            and ("multipleOf" not in s or v % s["multipleOf"] == 0))


def test_integer_ranges_exhaustive_small():
    for lo in range(-25, 26, 3):
        for hi in [None, *range(lo, lo + 140, 9)]:
            for kws in (("minimum", "maximum"), ("exclusiveMinimum", "exclusiveMaximum")):
                s = _int_schema(lo, hi, *kws)
                try:
                    c = re.compile(json_schema_to_regex(s))
                except EmptyLanguageError:
                    assert not any(_int_ok(v, s) for v in range(lo - 2, lo + 3))
                    continue
                for v in range(lo - 30, (hi if hi is not None else lo) + 130):
                    assert bool(c.fullmatch(str(v))) == _int_ok(v, s), (s, v)
    for hi in range(-40, 41, 7):  # one-sided from above
        c = re.compile(json_schema_to_regex(_int_schema(None, hi)))
        for v in range(-300, 300):
            assert bool(c.fullmatch(str(v))) == (v <= hi)


@pytest.mark.parametrize("m", [2, 5, 10])
def test_integer_multiple_of_with_bounds(m):
    for lo, hi in [(-37, 52), (0, 1000), (7, None), (None, -3), (None, None)]:
        s = _int_schema(lo, hi, multipleOf=m)
        c = re.compile(json_schema_to_regex(s))
        for v in range(-1200, 1200):
            assert bool(c.fullmatch(str(v))) == _int_ok(v, s), (s, v)


def test_integer_ranges_random_large():
    rnd = random.Random(7)
    for _ in range(400):
        lo = rnd.randint(-10 ** rnd.randint(0, 22), 10 ** rnd.randint(0, 22))
        hi = lo + rnd.randint(0, 10 ** rnd.randint(0, 22))
        kind = rnd.random()
        lo_kw = rnd.choice(["minimum", "exclusiveMinimum"])
        hi_kw = rnd.choice(["maximum", "exclusiveMaximum"])
        s = _int_schema(None if kind < 0.15 else lo, None if 0.15 <= kind < 0.3 else hi, lo_kw, hi_kw)
        try:
            c = re.compile(json_schema_to_regex(s))
        except EmptyLanguageError:
            assert hi - lo <= 1
            continue
        for _ in range(40):
            base = rnd.choice([lo, hi, 0])
            v = base + rnd.randint(-(10 ** rnd.randint(0, 24)), 10 ** rnd.randint(0, 24))
            assert bool(c.fullmatch(str(v))) == _int_ok(v, s), (s, v)
        for v in (lo - 1, lo, lo + 1, hi - 1, hi, hi + 1):
            assert bool(c.fullmatch(str(v))) == _int_ok(v, s), (s, v)


@pytest.mark.parametrize("bounds,inside,outside", [
    ({"minimum": 1.5}, [2, 3, 100], [1, 0, -2]),
    ({"exclusiveMinimum": 2.0}, [3, 4], [2, 1]),
    ({"maximum": -0.5}, [-1, -7], [0, 1]),
    ({"exclusiveMaximum": 1.5, "minimum": -1e2}, [1, -100], [2, -101]),
    ({"minimum": 1e20}, [10**20, 10**21 + 3], [10**20 - 1]),
])
def test_integer_float_bounds(bounds, inside, outside):
    c = re.compile(json_schema_to_regex({"type": "integer", **bounds}))
    assert all(c.fullmatch(str(v)) for v in inside)
    assert not any(c.fullmatch(str(v)) for v in outside)


def _random_number_text(rnd: random.Random, center: int) -> str:
    k = rnd.random()
    if k < 0.3:
        return str(center + rnd.randint(-3, 3))
    ip = abs(center + rnd.randint(-2, 2))
    sign = "-" if rnd.random() < 0.4 else ""
    if k < 0.55:
        frac = "".join(rnd.choice("0123456789") for _ in range(rnd.randint(1, 12)))
    elif k < 0.8:
        frac = rnd.choice(["9" * rnd.randint(1, 25), "0" * rnd.randint(1, 25) + "1", "0" * rnd.randint(1, 30),
                           "5", "0" * rnd.randint(300, 340) + "1"])
    else:
        return sign + str(ip) + rnd.choice(["e1", "E-2", ".5e3", ""])
    return f"{sign}{ip}.{frac}"


def test_number_bounds_never_larger_even_with_float_rounding():
    """Numbers with integer-valued bounds: random texts near the bounds (including fractions that round
    to the bound as floats, and underflows) are never accepted when jsonschema rejects them."""
    rnd = random.Random(3)
    accepted = 0
    for _ in range(500):
        s = {"type": "number"}
        c0 = rnd.choice([0, 0, 1, -1, 5, -7, 10**6, -(10**6), 123456])
        for kw in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            if rnd.random() < 0.4:
                s[kw] = c0 + rnd.randint(-3, 3) if rnd.random() < 0.7 else float(c0 + rnd.randint(-3, 3))
        try:
            c = re.compile(json_schema_to_regex(s))
        except (EmptyLanguageError, UnsupportedSchemaError):  # e.g. an exclusive bound beyond 10**6
            continue
        v = validator(s)
        for _ in range(40):
            t = _random_number_text(rnd, c0)
            if c.fullmatch(t):
                assert v.is_valid(json.loads(t)), (s, t)
                accepted += 1
    assert accepted > 3000


@pytest.mark.parametrize("schema,good,bad", [
    ({"type": "number", "minimum": 0}, ["0", "0.5", "3", "12.25"], ["-1", "-0.5", "1e3"]),
    ({"type": "number", "exclusiveMinimum": 0}, ["0.5", "3", "0.000000001"], ["0", "0.0", "-2", "0.0000000000001"]),
    ({"type": "number", "maximum": 0}, ["0", "-0.5", "-3"], ["0.5", "1"]),
    ({"type": "number", "exclusiveMaximum": 0}, ["-0.5", "-3"], ["0", "-0", "-0.0", "0.5"]),
    ({"type": "number", "minimum": -2, "maximum": 2}, ["-2", "-1.5", "2", "1.999"], ["-2.5", "2.5", "3"]),
    ({"type": "number", "multipleOf": 5, "maximum": 20}, ["20", "-5", "0"], ["21", "2.5", "25"]),
])
def test_number_bounds_examples(schema, good, bad):
    c = re.compile(assert_never_larger(schema))
    assert all(c.fullmatch(t) for t in good), good
    assert not any(c.fullmatch(t) for t in bad)


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "number", "minimum": 0.5}, "minimum"),
    ({"type": "number", "exclusiveMinimum": 10**7}, "exclusiveMinimum"),
    ({"type": "number", "maximum": 2**60}, "maximum"),
    ({"type": "number", "multipleOf": 0.01}, "multipleOf"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "integer", "exclusiveMinimum": True, "minimum": 1}, "exclusiveMinimum"),
])
def test_number_keywords_refused(schema, keyword):
    with pytest.raises(UnsupportedSchemaError) as ei:
        json_schema_to_regex(schema)
    assert ei.value.keyword == keyword and keyword in str(ei.value)


# ------------------------------------------------------------------------------------------------
# Strings: length, pattern, format
# ------------------------------------------------------------------------------------------------


def test_string_length_counts_characters_and_escapes():
    c = re.compile(json_schema_to_regex({"type": "string", "minLength": 2, "maxLength": 3}))
    for s in ["ab", "abc", "a\n", "é中", '"\\', "\u0001x"]:
        assert c.fullmatch(compact(s)), s
    assert c.fullmatch(r'"\u00e9\/"')
    for s in ["a", "abcd", "😀"]:
        assert not c.fullmatch(compact(s)), s
    assert not c.fullmatch(r'"\ud83d\ude00"')  # surrogate escapes excluded (documented)
    assert c.fullmatch('"😀x"')
    assert_never_larger({"type": "string", "minLength": 2, "maxLength": 3})


@pytest.mark.parametrize("pattern,good,bad", [
    ("^[a-z]+-[0-9]{2}$", ["ab-12"], ["ab-1", "Ab-12", "xab-12 "]),
    ("^\\d{3}$", ["123"], ["12", "1234", "١٢٣"]),
    ("ab", ["ab", "xaby", "a\"ab"], ["a", "ba"]),
    ("^ab", ["ab", "abz"], ["zab"]),
    ("b$", ["b", "ab"], ["ba"]),
    ('^a"b\\\\c$', ['a"b\\c'], ["abc"]),
    ("^.{2}$", ["ab", "é中"], ["a", "abc"]),
    ("^[^a]$", ["b", "中"], ["a", "ab"]),
    ("^(foo|bar)?baz$", ["baz", "foobaz", "barbaz"], ["fbaz"]),
    ("^\\S+$", ["ab"], ["a b", ""]),
    ("^\\s?x$", ["x", " x", "\tx"], ["  x"]),
    ("^\\D$", ["a"], ["1", "٣"]),
])
def test_pattern_matches_the_json_escaped_text(pattern, good, bad):
    schema = {"type": "string", "pattern": pattern}
    c = re.compile(assert_never_larger(schema))
    for s in good:
        assert c.fullmatch(compact(s)), s
    for s in bad:
        assert not c.fullmatch(compact(s)), s


@pytest.mark.parametrize("pattern", ["\\w+\\W", "(?i)abc", "(?P<x>a)", "a{,3}", "[]a]", "\\bx", "(?=a)a",
                                     "(a)\\1", "\\p{L}", "\\cA", "[\\S]"])
def test_pattern_constructs_refused(pattern):
    with pytest.raises(UnsupportedSchemaError) as ei:
        json_schema_to_regex({"type": "string", "pattern": pattern})
    assert ei.value.keyword == "pattern"


def _random_strings(rnd: random.Random, alphabet: str, n: int, max_len: int) -> list[str]:
    return [rnd.choice(["", "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, max_len)))])
            if i % 50 == 0 else "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, max_len)))
            for i in range(n)]


@pytest.mark.parametrize("schema,alphabet,words", [
    ({"type": "string", "pattern": "^[a-z]{2,4}x$", "maxLength": 3}, "abx", []),
    ({"type": "string", "pattern": "a", "maxLength": 5}, "ab\"\n", ["a", "aaaaa", "bbbba"]),
    ({"type": "string", "pattern": "^[a-z]+[a-z0-9-]*$", "minLength": 2, "maxLength": 12,
      "not": {"enum": ["test", "source", "include"]}}, "tesourcinl0-", ["test", "source", "include", "tests", "te"]),
    ({"type": "string", "not": {"pattern": "^ | $"}, "maxLength": 4}, "a \t\"\n", [" a", "a ", "a", "", "a \n"]),
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}], "maxLength": 5}, "ab\\c", ["ab", "acb"]),
    ({"type": "string", "format": "date", "pattern": "^2024-"}, "20241-03", ["2024-02-29", "2023-02-28",
                                                                          "2024-13-01"]),
    ({"type": "string", "not": {"const": "x"}, "minLength": 1}, "xy", ["x", "xx", "y"]),
    ({"type": "string", "not": {"minLength": 2, "maxLength": 3}}, "ab", ["", "a", "ab", "abc", "abcd"]),
    ({"type": "string", "pattern": "^[^,]+$", "not": {"pattern": ",,|^-"}, "maxLength": 6}, "a,-\u00e9",
     ["a-", "-a", "é"]),
])
def test_combined_string_keywords_are_exact(schema, alphabet, words):
    """Patterns with lengths they do not imply, with a format or another pattern, and ``not`` of string
    keywords: the regex accepts a string (in ``json.dumps``' spelling) exactly when ``jsonschema`` does, and
    never an invalid text (sampled, mutated)."""
    rx = assert_never_larger(schema, n=200)
    c, v = re.compile(rx), validator(schema)
    rnd = random.Random(5)
    n_valid = 0
    for text in words + _random_strings(rnd, alphabet, 3000, 8):
        ok = v.is_valid(text)
        n_valid += ok
        hit = bool(c.fullmatch(json.dumps(text, ensure_ascii=False)))
        if any(ord(ch) < 0x20 or ch in '"\\' for ch in text):
            assert ok or not hit, (schema, text)  # (characters JSON escapes: outside negated classes, the pattern rule)
        else:
            assert hit == ok, (schema, text)
    assert n_valid > 0


def test_not_of_strings_keeps_the_other_types():
    for sub in ({"const": "x"}, {"enum": ["a", "b"]}, {"type": "string", "pattern": "^a"}):
        schema = {"not": sub}
        c = re.compile(assert_never_larger(schema))
        for value in (1, None, [], {}, True, "y", "ba"):
            assert bool(c.fullmatch(compact(value))) == validator(schema).is_valid(value), (sub, value)
    c = re.compile(json_schema_to_regex({"not": {"pattern": "^a"}}))  # (non-strings pass a pattern: not fails them)
    assert c.fullmatch('"b"') and not c.fullmatch('"ab"') and not c.fullmatch("1")
    with pytest.raises(UnsupportedSchemaError):  # (values of other types: not a string language)
        json_schema_to_regex({"not": {"enum": ["a", 1]}})
    # a negated pattern must hold every string it matches in ECMA-262's and Python's meanings: \s (ASCII here,
    # Unicode in Python: "\x1e" is a space there) and a format (its regex is a subset) are refused under not
    for sub in ({"pattern": "\\s$"}, {"pattern": "^\\d"}, {"format": "email"}):
        with pytest.raises(UnsupportedSchemaError) as ei:
            json_schema_to_regex({"type": "string", "not": sub})
        assert ei.value.keyword == "not"


def test_combined_string_keywords_over_the_budget_are_refused():
    # state elimination of a DFA with many lengths and branches: over MAX_COMBINED_POSITIONS
    with pytest.raises(UnsupportedSchemaError) as ei:
        json_schema_to_regex({"type": "string", "format": "email", "maxLength": 255})
    assert ei.value.keyword == "format" and "too large" in str(ei.value)


def test_format_date_exact_calendar():
    import datetime

    c = re.compile(json_schema_to_regex({"type": "string", "format": "date"}))
    for year in (1900, 1999, 2000, 2023, 2024, 2100, 2400, 4, 1):
        for month in range(0, 14):
            for day in range(0, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    datetime.date(year, month, day)
                    ok = True
                except ValueError:
                    ok = False
                assert bool(c.fullmatch(f'"{text}"')) == ok, text
    assert not c.fullmatch('"0000-01-01"') and not c.fullmatch('"2022-1-01"')


@pytest.mark.parametrize("fmt,good,bad", [
    ("time", ["08:30:06Z", "23:59:59.123+05:30", "00:00:00-23:59"], ["08:30:06", "24:00:00Z", "08:30:60Z",
                                                                     "8:30:06Z", "08:30:06+5:30"]),
    ("date-time", ["1963-06-19T08:30:06.283185Z", "2024-02-29T00:00:00+01:00"],
     ["1963-06-19T08:30:06", "2023-02-29T00:00:00Z", "1963-06-19 08:30:06Z"]),
    ("uuid", ["2EB8AA08-AA98-11ea-B4Aa-73B441D16380"], ["2eb8aa08-aa98-11ea-b4aa-73b441d1638",
                                                        "2eb8aa08aa9811eab4aa73b441d16380"]),
    ("ipv4", ["192.168.0.1", "0.0.0.0", "255.255.255.255"], ["256.0.0.1", "01.2.3.4", "1.2.3", "1.2.3.4.5"]),
    ("email", ["joe.bloggs@example.com", "a+b@x-y.co"], ["joe", "joe@", ".a@b.c", "a..b@c.d", "a@b", "a@-b.c"]),
])
def test_formats(fmt, good, bad):
    schema = {"type": "string", "format": fmt}
    c = re.compile(assert_never_larger(schema))
    for s in good:
        assert c.fullmatch(compact(s)), s
    for s in bad:
        assert not c.fullmatch(compact(s)), s


def test_format_ipv6_is_exactly_what_the_ipv6_check_accepts():
    """``format: ipv6`` emits every text form ``ipaddress.IPv6Address`` reads (``::`` anywhere once, IPv4
    tails) but a zone index, which ``jsonschema``'s check refuses: the regex and the checker agree on random
    strings built from groups, colons and dotted quads (about 4 % of them valid), and on the extremes."""
    schema = {"type": "string", "format": "ipv6"}
    c = re.compile(assert_never_larger(schema, n=300))
    checker = Draft202012Validator.FORMAT_CHECKER
    rnd = random.Random(7)
    parts = ["0", "1", "a", "F", "ff", "abc", "ffff", "1234", "12345", "g", "::", ":::", ".", "1.2.3.4",
             "255.255.255.255", "256.1.1.1", "01.2.3.4", "1.2.3", "%eth0", " "]
    valid = 0
    for _ in range(20_000):
        k = rnd.randint(1, 12)
        out = []
        for i in range(k):
            out.append(rnd.choice(parts[:10]) if rnd.random() < 0.8 else rnd.choice(parts))
            if i < k - 1 and rnd.random() < 0.85:
                out.append(rnd.choice([":", ":", ":", "::"]))
        text = "".join(out)
        ok = checker.conforms(text, "ipv6")
        valid += ok
        assert bool(c.fullmatch(compact(text))) == ok, text
    assert valid > 200
    for text in ["::", "::1", "1::", "fe80::1", "2001:db8::ff00:42:8329", "1:2:3:4:5:6:7:8", "::ffff:192.168.0.1",
                 "1:2:3:4:5:6:1.2.3.4", "1:2:3:4:5::1.2.3.4", "1:2:3:4:5:6:7::", "::2:3:4:5:6:7:8",
                 "FFFF:ffff:FfFf:0:0:0:255.255.255.255"]:
        assert c.fullmatch(compact(text)) and checker.conforms(text, "ipv6"), text
    for text in ["1:2:3:4:5:6:7", "1:2:3:4:5:6:7::8", "1:2:3:4:5:6:7:1.2.3.4", "1:2:3:4:5:6::1.2.3.4", ":1:2::",
                 "1::2::3", "12345::", "::01.2.3.4", "fe80::1%eth0", ""]:
        assert not c.fullmatch(compact(text)) and not checker.conforms(text, "ipv6"), text


# The ``hostname`` checkers jsonschema may use (the optional ``fqdn`` package, ``FQDN(x, min_labels=1)``),
# written out independently of the converter: fqdn 1.5 (labels of 1-63 letters, digits and inner hyphens,
# an optional final dot, at most 253 characters) and fqdn 1.0-1.4 (at least two labels of at most 62, the
# last one letters only)
_FQDN_15 = re.compile(r"((?!-)[-A-Za-z\d]{1,63}(?<!-)\.)*(?!-)[-A-Za-z\d]{1,63}(?<!-)\.?")
_FQDN_10 = re.compile(r"((?!-)[-A-Za-z\d]{1,62}(?<!-)\.)+[A-Za-z]{1,62}\.?")


def _hostname_ok(text: str) -> bool:
    return (len(text.removesuffix(".")) <= 253 and _FQDN_15.fullmatch(text) is not None
            and _FQDN_10.fullmatch(text) is not None)


def test_format_hostname_is_a_subset_of_every_checker():
    """``format: hostname`` emits only names both ``fqdn`` checkers accept (2-4 labels of at most 62
    characters, the last 2-62 letters): sampled outputs and random strings the regex accepts pass both;
    the JSON Schema Test Suite's invalid host names are refused, its valid multi-label ones accepted."""
    schema = {"type": "string", "format": "hostname"}
    rx = json_schema_to_regex(schema)
    c = re.compile(rx)
    for text in sample(rx, 300, seed=5):
        assert _hostname_ok(json.loads(text)), text
    rnd = random.Random(11)
    pieces = ["a", "Z", "0", "9", "-", "--", ".", "ab", "xn--p1ai", "com", "x" * 30, "y" * 62, "q" * 63, "_", "é"]
    accepted = 0
    for _ in range(20_000):
        text = "".join(rnd.choice(pieces) for _ in range(rnd.randint(1, 9)))
        if c.fullmatch(compact(text)):
            accepted += 1
            assert _hostname_ok(text), text
    assert accepted > 50  # (93 of these 20,000 strings)
    longest = ".".join(["a" * 62] * 3 + ["b" * 62])
    assert c.fullmatch(compact(longest)) and len(longest) == 251 and _hostname_ok(longest)
    for text in ["www.example.com", "a.b.co", "my-host.example.org", "A1.B2.Cc", "x--y.example.com"]:
        assert c.fullmatch(compact(text)), text
    for text in ["-a-host-name-that-starts-with--", "not_a_valid_host_name", "-hostname", "hostname-", "_hostname",
                 "hostname_", "host_name", "", ".", "a.-b.com", "a.b-.com", "a..com", "example.com.", "localhost",
                 "a.b.c.d.com", "a." + "q" * 63 + ".com", "example.c0m", "1.2.3.4"]:
        assert not c.fullmatch(compact(text)), text


def _duration_ok(s: str) -> bool:
    """RFC 3339 Appendix A's ``duration``, by recursive descent (independent of the converter's regex)."""
    def num(i):
        j = i
        while j < len(s) and s[j] in "0123456789":
            j += 1
        return j if j > i else None

    def elems(i, units):  # an element of unit units[0], optionally followed by one of units[1] (and so on)
        j = num(i)
        if j is None or j >= len(s) or s[j] != units[0]:
            return None
        got = elems(j + 1, units[1:]) if len(units) > 1 else None
        return got if got is not None else j + 1

    def chain(i, units):  # (dur-day / dur-month / dur-year) or (dur-hour / dur-minute / dur-second)
        for start in range(len(units)):
            j = elems(i, units[start:])
            if j is not None:
                return j
        return None

    def time(i):
        return chain(i + 1, "HMS") if i < len(s) and s[i] == "T" else None

    if not s.startswith("P"):
        return False
    week = num(1)
    if week is not None and week == len(s) - 1 and s[week] == "W":
        return True
    j = time(1)
    if j == len(s):
        return True
    j = chain(1, "YMD")
    if j is None:
        return False
    return j == len(s) or time(j) == len(s)


def _json_pointer_ok(s: str) -> bool:
    """RFC 6901 §3: empty, or ``/``-prefixed reference tokens whose ``~`` are ``~0`` / ``~1``."""
    return s == "" or (s.startswith("/") and re.fullmatch(r"(?:[^~]|~[01])*", s) is not None)


def _relative_json_pointer_ok(s: str) -> bool:
    """A non-negative integer without leading zeros, then ``#`` or a JSON pointer (no index manipulation)."""
    m = re.match(r"[0-9]+", s)
    if not m or (len(m.group()) > 1 and m.group()[0] == "0"):
        return False
    rest = s[m.end():]
    return rest == "#" or _json_pointer_ok(rest)


def _suite_format_cases(fmt: str) -> list[tuple[str, bool]]:
    path = Path(__file__).parent / "data" / "json_schema_test_suite" / "draft2020-12" / "optional" / "format"
    return [(t["data"], t["valid"]) for g in json.loads((path / f"{fmt}.json").read_text()) for t in g["tests"]
            if isinstance(t["data"], str)]


@pytest.mark.parametrize("fmt,oracle,lead,alphabet", [
    ("duration", _duration_ok, ["P", "P", "PT", ""],
     ["1Y", "2M", "3D", "4W", "5H", "6M", "7S", "T", "0", "12", "Y", "M", "S", "x"]),
    ("json-pointer", _json_pointer_ok, ["/", ""],
     ["/", "~", "~0", "~1", "~2", "a", "0", '"', "\\", "\n", "\x01", "é", "#", " "]),
    ("relative-json-pointer", _relative_json_pointer_ok, ["0", "1", "20", ""],
     ["0", "1", "#", "/", "/", "~0", "~", "a", "-", "+", '"']),
])
def test_formats_duration_and_json_pointers_are_exact(fmt, oracle, lead, alphabet):
    """``duration``, ``json-pointer`` and ``relative-json-pointer`` accept what their RFC grammars (written
    out independently above) accept, in ``json.dumps``'s spelling: the JSON Schema Test Suite's strings
    (as the suite judges them, and so does the oracle), 20,000 random strings, sampled outputs."""
    rx = json_schema_to_regex({"type": "string", "format": fmt})
    c = re.compile(rx)
    for text, valid in _suite_format_cases(fmt):
        assert oracle(text) == valid, text
        assert bool(c.fullmatch(compact(text))) == valid, text
    rnd = random.Random(7)
    accepted = 0
    for _ in range(20_000):
        text = rnd.choice(lead) + "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 6)))
        ok = oracle(text)
        assert bool(c.fullmatch(compact(text))) == ok, text
        accepted += ok
    assert accepted > 500, accepted
    for text in sample(rx, 300, seed=4):
        assert oracle(json.loads(text)), text
    assert not c.fullmatch(r'"/a\/b"') and not c.fullmatch(r'"/\u0041"')  # other spellings: left out


# RFC 3986 Appendix A, written out independently of the converter: URI = scheme ":" hier-part ["?" query]
# ["#" fragment] (IP literals left out: the converter never emits one)
_RFC_PCHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})"
_RFC3986_URI = re.compile(
    r"[A-Za-z][A-Za-z0-9+\-.]*:"
    rf"(?://(?:(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|%[0-9A-Fa-f]{{2}})*@)?(?:[A-Za-z0-9\-._~!$&'()*+,;=]|%[0-9A-Fa-f]{{2}})*"
    rf"(?::[0-9]*)?(?:/{_RFC_PCHAR}*)*|/(?:{_RFC_PCHAR}+(?:/{_RFC_PCHAR}*)*)?|{_RFC_PCHAR}+(?:/{_RFC_PCHAR}*)*|)"
    rf"(?:\?(?:{_RFC_PCHAR}|[/?])*)?(?:#(?:{_RFC_PCHAR}|[/?])*)?")


@pytest.mark.parametrize("fmt", ["uri", "uri-reference", "iri", "iri-reference"])
def test_format_uri_is_an_rfc3986_subset(fmt):
    rx = json_schema_to_regex({"type": "string", "format": fmt})
    c = re.compile(rx)
    for text in sample(rx, 300, seed=3):
        assert _RFC3986_URI.fullmatch(json.loads(text)), text
    for good in ["http://example.com", "https://a.b:8080/x/y?q=1&r=%20#frag", "ftp://h/", "file:///etc/x",
                 "s3+x-y.z://bucket/key;v=1"]:
        assert c.fullmatch(json.dumps(good)) and _RFC3986_URI.fullmatch(good), good
    for bad in ["//foo.bar/?baz=qux#quux", "http:// x.com", ":// should fail", "bar,baz:foo", "http://é.com",
                "http://a.com/%zz", "1http://a", "http://a.com/<x>", 'http://a"b']:
        assert not c.fullmatch(json.dumps(bad, ensure_ascii=False)), bad


def test_pattern_of_one_class_with_length_bounds():
    # one repeated class anchored at both ends: the bounds go into the repetition (exact)
    schema = {"type": "string", "pattern": "^[^,\"]+$", "maxLength": 5}
    c = re.compile(assert_never_larger(schema))
    for text, ok in [("abc", True), ("abcde", True), ("abcdef", False), ("", False), ("a,b", False)]:
        assert bool(c.fullmatch(compact(text))) == ok, text
    c = re.compile(assert_never_larger({"type": "string", "pattern": "^[a-z]{2,8}$", "minLength": 3,
                                        "maxLength": 20}))
    assert c.fullmatch('"abc"') and not c.fullmatch('"ab"') and not c.fullmatch('"abcdefghi"')
    with pytest.raises(EmptyLanguageError):
        json_schema_to_regex({"type": "string", "pattern": "^[a-z]{2,3}$", "minLength": 5})
    # other patterns: combined with the bounds (regex_algebra)
    c = re.compile(assert_never_larger({"type": "string", "pattern": "^a[a-z]+$", "maxLength": 5}))
    for text, ok in [("ab", True), ("abcde", True), ("abcdef", False), ("a", False), ("ba", False)]:
        assert bool(c.fullmatch(compact(text))) == ok, text


@pytest.mark.parametrize("pat", [r"^a|b$", r"^(\d{4}(-\d{2})?$)|(^[a-z]+$)", r"^(?:x$)|^y|z", r"^(ab|cd)$|^e$",
                                 r"^([^,]|$)", r"(^a|b$)", r"^(?:x|(ab|y$))"])
def test_pattern_alternatives_with_their_own_anchors(pat):
    # ECMA-262 / Python: each top-level alternative is anchored by its own ^ / $ (a search, not a full match);
    # a group of alternatives that is a whole alternative is distributed (^(a|$) is ^a|^$)
    c = re.compile(assert_never_larger({"type": "string", "pattern": pat}))
    probes = ["a", "axx", "xxb", "b", "ba", "xa", "2020", "2020-01", "x2020", "abc", "ab1", "x", "xq", "qy", "y1",
              "qqz", "z1", "ab", "cd", "e", "abe", "ee", "", ",", ",a", "a,", "aby", "yy", "xy"]
    for text in probes:
        assert bool(c.fullmatch(compact(text))) == bool(re.search(pat, text)), (pat, text)


def test_pattern_identity_escapes():
    # \# \: \@ ... are the characters themselves (ECMA-262 identity escapes; Python reads them alike)
    c = re.compile(json_schema_to_regex({"type": "string", "pattern": r"^a\#b\:c\@d\"e$"}))
    assert c.fullmatch(compact('a#b:c@d"e')) and not c.fullmatch(compact("a#b:c@de"))
    assert re.fullmatch(r"a\#b\:c\@d\"e", 'a#b:c@d"e')


@pytest.mark.parametrize("fmt", ["uri-template", "idn-hostname", "regex", "idn-email", "color", "host-name"])
def test_other_formats_refused(fmt):
    with pytest.raises(UnsupportedSchemaError) as ei:
        json_schema_to_regex({"type": "string", "format": fmt})
    assert ei.value.keyword == "format" and fmt in str(ei.value)
    assert json_schema_to_regex({"type": "integer", "format": fmt})  # format only constrains strings


@pytest.mark.parametrize("fmt", ["password", "int32", "byte", "binary", "url"])
def test_formats_no_draft_defines_are_annotations(fmt):
    # jsonschema's checkers (every draft's) know none of these: any string is valid, so any string is emitted
    schema = {"type": "string", "format": fmt}
    assert json_schema_to_regex(schema) == json_schema_to_regex({"type": "string"})
    checker = Draft202012Validator.FORMAT_CHECKER
    assert fmt not in checker.checkers and Draft202012Validator(schema, format_checker=checker).is_valid("?? x")


# ------------------------------------------------------------------------------------------------
# enum / const, arrays, combinators, $ref
# ------------------------------------------------------------------------------------------------


def test_enum_const_filtered_by_the_other_keywords():
    schema = {"type": "string", "enum": ["a", "bb", 3, None, "ccc"], "maxLength": 2}
    c = re.compile(assert_never_larger(schema))
    assert c.fullmatch('"a"') and c.fullmatch('"bb"')
    assert not c.fullmatch("3") and not c.fullmatch("null") and not c.fullmatch('"ccc"')
    rx = json_schema_to_regex({"enum": [{"k": [1, "x\n"]}, "a|b", 1.5, True]})
    for v in [{"k": [1, "x\n"]}, "a|b", 1.5, True]:
        assert re.fullmatch(rx, compact(v))
    assert not re.fullmatch(rx, '"a"')
    assert json_schema_to_regex({"const": "x", "not": {"const": "y"}}) == '"x"'  # exact via jsonschema
    with pytest.raises(EmptyLanguageError):
        json_schema_to_regex({"const": "x", "type": "integer"})


def test_arrays():
    s = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": {"type": "boolean"},
         "minItems": 1, "maxItems": 4}
    c = re.compile(assert_never_larger(s))
    for v, ok in [([1], True), ([1, "a"], True), ([1, "a", True, False], True), ([], False),
                  ([1, "a", True, False, True], False), (["a"], False), ([1, "a", 3], False)]:
        assert bool(c.fullmatch(compact(v))) == ok, v
    c = re.compile(assert_never_larger({"type": "array", "prefixItems": [{"const": 1}], "items": False}))
    assert c.fullmatch("[]") and c.fullmatch("[1]") and not c.fullmatch("[1,1]")
    c = re.compile(assert_never_larger({"type": "array", "items": {"const": "z"}, "uniqueItems": True}))
    assert c.fullmatch('["z"]') and not c.fullmatch('["z","z"]')
    assert json_schema_to_regex({"type": "array", "uniqueItems": True, "maxItems": 1})
    for bad in ({"type": "array", "uniqueItems": True}, {"type": "array", "contains": {"const": 1}, "maxContains": 1},
                {"type": "array", "items": [{"type": "integer"}]}):
        with pytest.raises(UnsupportedSchemaError):
            json_schema_to_regex(bad)


def test_any_value_bounded_depth():
    c = re.compile(assert_never_larger({}))
    for v in [None, 1, -2.5e3, "s", [], {}, [1, {"a": "b"}], {"a": [1, 2], "b": {"c": None}}]:
        assert c.fullmatch(compact(v)), v
    assert not c.fullmatch(compact([[[1]]]))  # deeper than ANY_VALUE_DEPTH (documented)
    assert c.fullmatch(compact([[[]], [{}]])) and c.fullmatch("[[{ }]]")  # empty containers: at any depth
    obj = re.compile(assert_never_larger({"type": "object"}))
    assert obj.fullmatch(compact({"a": [1, "x"], "b": {"c": "d"}})) and not obj.fullmatch("[]")
    assert not obj.fullmatch(compact({"a": [1, {"x": 1}]})) and obj.fullmatch(compact({"a": [1, {}, []]}))
    # values of extra keys next to declared properties: scalars and empty containers
    ext = re.compile(assert_never_larger({"type": "object", "properties": {"a": {"type": "integer"}},
                                          "additionalProperties": True}))
    assert ext.fullmatch(compact({"a": 1, "zz": {}})) and not ext.fullmatch(compact({"a": 1, "zz": {"q": 1}}))
    assert obj.fullmatch(json.dumps({"a": [1, 2], "b": {"c": "d"}}))


def test_any_of_one_of_all_of():
    s = {"anyOf": [{"type": "integer", "minimum": 5}, {"type": "string", "maxLength": 1}, {"type": "null"}]}
    c = re.compile(assert_never_larger(s))
    assert c.fullmatch("7") and c.fullmatch('"a"') and c.fullmatch("null") and not c.fullmatch("4")
    # siblings of anyOf are distributed into each alternative
    s = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False,
         "anyOf": [{"required": ["a"]}, {"maxProperties": 0}]}
    c = re.compile(assert_never_larger(s))
    assert c.fullmatch('{"a":1}') and c.fullmatch("{}")
    # oneOf: disjoint by type, by const discriminator, by numeric range
    for s in ({"oneOf": [{"type": "string"}, {"type": "integer"}]},
              {"oneOf": [{"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                          "required": ["kind"]},
                         {"type": "object", "properties": {"kind": {"enum": ["dog", "wolf"]}}, "required": ["kind"]}]},
              {"oneOf": [{"type": "integer", "maximum": 0}, {"type": "integer", "exclusiveMinimum": 0}]}):
        assert_never_larger(s)
    one_sided = {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                           {"type": "object", "properties": {"k": {"const": "b"}}}]}
    c = re.compile(assert_never_larger(one_sided))
    assert c.fullmatch('{"k":"a"}') and c.fullmatch("{}") and c.fullmatch('{"k":"b"}')
    for overlapping in ({"oneOf": [{"type": "integer"}, {"type": "number"}]},
                        {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}},
                                   {"type": "object", "properties": {"k": {"const": "b"}}}]},  # {} is in both
                        {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 0}]}):
        with pytest.raises(UnsupportedSchemaError) as ei:
            json_schema_to_regex(overlapping)
        assert ei.value.keyword == "oneOf"
    # allOf: merged when the keywords do not interact
    s = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                   {"properties": {"b": {"type": "string"}}, "required": ["b"]}, {"title": "x"}]}
    c = re.compile(assert_never_larger(s))
    assert c.fullmatch('{"a":1,"b":"x"}') and not c.fullmatch('{"a":1}')
    with pytest.raises(UnsupportedSchemaError) as ei:
        json_schema_to_regex({"allOf": [{"properties": {"a": {}}}, {"additionalProperties": False}]})
    assert ei.value.keyword == "allOf"
    # not / if of string keywords: string languages (regex_algebra), the other types as they fare
    for s in ({"not": {"type": "string", "maxLength": 3}}, {"if": {"const": "a"}, "then": {"minLength": 2}}):
        c = re.compile(assert_never_larger(s))
        for v in ("", "a", "ab", "abcd", 1, None, []):
            assert bool(c.fullmatch(compact(v))) == validator(s).is_valid(v), (s, v)


_PROBES = [0, 7, -3, 2.0, 1.5, -0.25, 10.05, True, False, None, "", "a", "7", [], [1, "x"], {}, {"a": None}]


@pytest.mark.parametrize("schema", [
    {"not": {"type": "integer"}}, {"not": {"type": ["integer", "boolean"]}}, {"not": {"type": "number"}},
    {"type": "number", "not": {"type": "integer"}}, {"type": ["string", "null"], "not": {"type": "null"}},
    {"type": "object", "properties": {"v": {"not": {"type": ["object", "array", "string"]}}}, "required": ["v"]},
    {"not": {"type": ["null", "boolean", "object", "array", "string", "integer"]}},
    {"not": {"minimum": 5}}, {"type": "integer", "minimum": 0, "not": {"exclusiveMinimum": 3}},
    {"not": {"maxLength": 1}}, {"type": ["array", "string"], "not": {"minItems": 1}},
    # with keywords converted as unions of merges: the not still applies in each
    {"type": ["number", "string"], "not": {"type": "integer"}, "if": {"type": "string"}, "then": {"maxLength": 1}},
    {"type": ["number", "object"], "not": {"type": "integer"}, "dependentRequired": {"a": ["b"]}},
])
def test_not_of_types_alone(schema):
    """``not`` of types alone removes them (``integer`` from the numbers leaves the non-integer ones, written
    without an exponent): sampled outputs valid; every probe value accepted iff ``jsonschema`` says valid,
    but for numbers valued as integers and written with a fraction (``2.0``), which fst writes as integers."""
    c = re.compile(assert_never_larger(schema))
    inside = "properties" in schema
    for v in _PROBES:
        text = compact({"v": v} if inside else v)
        valid = is_valid_text(schema, text)
        if valid and isinstance(v, float) and v.is_integer():
            continue  # (number-spelling: the integer 2 is written "2")
        assert bool(c.fullmatch(text)) == valid, (schema, v)


@pytest.mark.parametrize("schema", [
    # "cannot have result and error at the same time" (a JSON-RPC schema of the JSONSchemaBench sample)
    {"type": "object", "properties": {"id": {}, "result": {}, "error": {"type": "string"}}, "required": ["id"],
     "not": {"description": "not both", "required": ["result", "error"]}},
    {"not": {"required": ["id"]}}, {"type": "object", "additionalProperties": True, "not": {"required": ["id", "error"]}},
])
def test_not_of_required_names(schema):
    """``not: {"required": [...]}``: objects that miss one of the names (non-objects always satisfy
    ``required``, so never its negation); probe values accepted iff ``jsonschema`` says valid."""
    c = re.compile(assert_never_larger(schema))
    for v in ({"id": 1}, {"id": 1, "result": 2}, {"id": 1, "error": "e"}, {"id": 1, "result": 2, "error": "e"},
              {"result": 2}, {}, 1, "x", None, [1]):
        text = compact(v)
        assert bool(c.fullmatch(text)) == is_valid_text(schema, text), (schema, v)


def test_not_of_types_edge_cases():
    with pytest.raises(EmptyLanguageError):
        json_schema_to_regex({"type": "integer", "not": {"type": "number"}})
    with pytest.raises(UnsupportedSchemaError) as ei:  # non-integer numbers with bounds: not written
        json_schema_to_regex({"type": "number", "minimum": 1, "not": {"type": "integer"}})
    assert ei.value.keyword == "not"
    # a key no draft defines is dropped before the conversion: the internal marker cannot come from a schema
    assert accepts({"type": "number", "\x00not-integer": True}, 2)


def test_refs_pointers_memo_and_recursion():
    schema = {"$defs": {"a/b": {"type": "integer"}, "c~d": {"type": "string"}, "pct %": {"type": "null"},
                        "a%20b": {"type": "integer", "minimum": 3}},
              "definitions": {"old": {"type": "boolean"}},
              "type": "array", "prefixItems": [{"$ref": "#/$defs/a~1b"}, {"$ref": "#/$defs/c~0d"},
                                               {"$ref": "#/$defs/pct%20%25"}, {"$ref": "#/definitions/old"},
                                               {"$ref": "#/prefixItems/0"}, {"$ref": "#/$defs/a%2520b"}],
              "items": False}
    c = re.compile(assert_never_larger(schema))
    assert c.fullmatch('[1,"s",null,true,2,3]') and not c.fullmatch('[1,"s",null,true,2,2]')
    rec = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
           "$ref": "#/$defs/node"}
    with pytest.raises(UnsupportedSchemaError) as ei:
        json_schema_to_regex(rec)
    assert ei.value.keyword == "$ref" and ei.value.regular is False
    with pytest.raises(UnsupportedSchemaError) as ei:
        json_schema_to_regex({"type": "object", "properties": {"self": {"$ref": "#"}}})
    assert ei.value.regular is False
    for ref in ("http://localhost:1234/draft2020-12/integer.json", "other.json#/x"):
        with pytest.raises(UnsupportedSchemaError) as ei:
            json_schema_to_regex({"type": "object", "properties": {"a": {"$ref": ref}}})
        assert ei.value.keyword == "$ref" and ei.value.regular is True and ei.value.pointer == "/properties/a"
        assert "not in the document" in str(ei.value)
    for ref in ("#/$defs/missing", "#anchor"):
        with pytest.raises(InvalidSchemaError) as ei:
            json_schema_to_regex({"$ref": ref})
        assert ref[1:] in str(ei.value) and ei.value.keyword == "$ref"


@pytest.mark.parametrize("schema,good,bad", [
    # an embedded resource referenced by its relative URI; its own "#/..." pointers are its own
    ({"$id": "http://example.com/root.json", "type": "object", "required": ["a", "c"], "additionalProperties": False,
      "$defs": {"A": {"$id": "foo.json", "$defs": {"B": {"type": "integer", "minimum": 3}}, "$ref": "#/$defs/B"},
                "C": {"$anchor": "cc", "type": "string", "maxLength": 3}},
      "properties": {"a": {"$ref": "foo.json"}, "c": {"$ref": "#cc"}}},
     [{"a": 3, "c": "xyz"}, {"a": 40, "c": ""}], [{"a": 2, "c": "x"}, {"a": 3, "c": "long"}, {"a": "3", "c": "x"}]),
    # no base URI at the root: relative identifiers, a pointer into an embedded resource, "#" inside it
    ({"$defs": {"R": {"$id": "r.json", "type": "object", "properties": {"x": {"type": "integer", "maximum": 5}},
                      "$defs": {"X": {"$ref": "#/properties/x"}}}},
      "type": "array", "prefixItems": [{"$ref": "r.json#/$defs/X"}, {"$ref": "r.json"}], "items": False},
     [[5, {"x": 1}], [0, {}]], [[6, {}], [1, {"x": 9}], ["a", {}]]),
    # the same name under two resources: each reference reaches its own
    ({"$defs": {"P": {"$id": "p.json", "$defs": {"v": {"type": "string"}}, "$ref": "#/$defs/v"},
                "Q": {"$id": "q.json", "$defs": {"v": {"type": "boolean"}}, "$ref": "#/$defs/v"}},
      "type": "array", "prefixItems": [{"$ref": "p.json"}, {"$ref": "q.json"}], "items": False},
     [["s", True], []], [[True, "s"], ["s", "t"]]),
    # an identifier below the root that nothing references (real-world schemas): no effect
    ({"type": "object", "properties": {"n": {"$id": "nullable-array", "type": ["array", "null"], "maxItems": 1}},
      "required": ["n"], "additionalProperties": False},
     [{"n": None}, {"n": [1]}], [{"n": [1, 2]}, {"n": 1}]),
])
def test_refs_through_identifiers_and_anchors(schema, good, bad):
    """``$ref`` resolved with the base URI of its location (``referencing``, as ``jsonschema`` does): the
    converted regex agrees with ``jsonschema`` on each value and never accepts an invalid text."""
    v = validator(schema)
    assert all(v.is_valid(x) for x in good) and not any(v.is_valid(x) for x in bad)
    c = re.compile(assert_never_larger(schema))
    for x in good:
        assert c.fullmatch(compact(x)), x
    for x in bad:
        assert not c.fullmatch(compact(x)), x


# ------------------------------------------------------------------------------------------------
# Errors, keywords, whitespace, escape_literal
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "integer", "minimum": "abc"}, "minimum"),
    ({"type": "object", "required": 5}, "required"),
    ({"type": "strin"}, "type"),
    ({"type": "string", "maxLength": -1}, "maxLength"),
    ({"type": "object", "properties": {"a": 3}}, "properties"),
    ({"anyOf": []}, "anyOf"),
])
def test_invalid_schemas(schema, keyword):
    with pytest.raises(InvalidSchemaError) as ei:
        json_schema_to_regex(schema)
    assert ei.value.keyword == keyword and keyword in str(ei.value) and isinstance(ei.value, FstBackendError)
    with pytest.raises(InvalidSchemaError):
        json_schema_to_regex([1, 2])


def test_unknown_keywords_ignored_older_drafts_refused_with_pointer():
    # keywords no draft defines (vendor extensions, OpenAPI's, typos) have no effect on validity
    plain = {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "integer"}}, "required": ["a"]}
    noisy = {"type": "object", "@context": "x", "x-order": 1, "categories": ["c"],
             "properties": {"a": {"type": "string", "nullable": True, "example": "e", "_uniqueItems": True},
                            "n": {"type": "integer", "format": "int32", "jsonrpc": {"type": "string"}}},
             "required": ["a"]}
    assert json_schema_to_regex(noisy) == json_schema_to_regex(plain)
    # the same for jsonschema: an instance the unknown keywords would seem to forbid is valid
    c = re.compile(json_schema_to_regex(noisy))
    assert c.fullmatch('{"a":"x","n":2}') and Draft202012Validator(noisy).is_valid({"a": "x", "n": 2})
    # draft 4-6 ``id``: the root's base URI and plain-name anchors are read as such; a resource of its own is not
    assert json_schema_to_regex({"id": "http://example.com/s.json", "type": "object", "properties": {
        "a": {"id": "#a", "type": "integer"}}}) == json_schema_to_regex(
        {"type": "object", "properties": {"a": {"type": "integer"}}})
    # (and a resource of its own that nothing references: no effect)
    assert json_schema_to_regex({"type": "object", "properties": {"a": {"id": "http://x/a.json", "type": "integer"}}}) \
        == json_schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}}})
    # formats no draft defines are annotations; an older draft's format name is refused, not ignored
    assert json_schema_to_regex({"type": "string", "format": "byte"}) == json_schema_to_regex({"type": "string"})
    for fmt in ("host-name", "uri-template"):
        with pytest.raises(UnsupportedSchemaError) as ei:
            json_schema_to_regex({"type": "string", "format": fmt})
        assert ei.value.keyword == "format"
    # ``dependencies`` is read as 2020-12's dependentRequired / dependentSchemas (here: one that always holds)
    closed = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
    assert json_schema_to_regex(dict(closed, dependencies={"a": ["b"], "zz": {"type": "string"}})) == \
        json_schema_to_regex(closed)
    c = re.compile(json_schema_to_regex({"type": "object", "dependencies": {"x": ["y"]}}))  # (an entry that applies)
    assert c.fullmatch('{"x":1,"y":2}') and c.fullmatch('{"y":2}') and not c.fullmatch('{"x":1}')
    with pytest.raises(UnsupportedSchemaError) as ei:
        json_schema_to_regex({"type": "object", "dependencies": {k: ["y"] for k in "abcd"}})
    assert ei.value.keyword == "dependentRequired" and "more than 3" in str(ei.value)
    for kw in ("additionalItems", "propertyNames", "$dynamicRef", "divisibleBy"):
        value = {"$dynamicRef": "#x", "propertyNames": {"maxLength": 3}, "divisibleBy": 2}.get(
            kw, {"x": {"type": "string"}})
        sch = {"type": "object", kw: value}
        if kw == "propertyNames":  # (extra keys next to declared names: keys other than the names AND S)
            sch.update(properties={"a": {}}, additionalProperties=True)
        with pytest.raises(UnsupportedSchemaError) as ei:
            json_schema_to_regex(sch)
        assert ei.value.keyword == kw
    annotated = {"title": "t", "description": "d", "default": 1, "examples": [1], "$comment": "c", "deprecated": True,
                 "readOnly": True, "writeOnly": False, "$schema": "https://json-schema.org/draft/2020-12/schema",
                 "type": "integer"}
    assert json_schema_to_regex(annotated) == json_schema_to_regex({"type": "integer"})
    # propertyNames / min/maxProperties / dependentRequired accepted when they always hold
    assert json_schema_to_regex({"type": "object", "properties": {"ab": {}}, "additionalProperties": False,
                                 "propertyNames": {"maxLength": 2}, "maxProperties": 1,
                                 "dependentRequired": {"zz": ["q"]}})
    c = re.compile(json_schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}},
                                         "additionalProperties": False, "minProperties": 1}))
    assert c.fullmatch('{"a":1}') and not c.fullmatch("{}")


@pytest.mark.parametrize("schema", [
    {"propertyNames": {"maxLength": 3}}, {"propertyNames": {"pattern": "^a+$"}}, {"propertyNames": False},
    {"propertyNames": {"const": "foo"}}, {"propertyNames": {"enum": ["foo", "bar", 1]}},
    {"type": "object", "propertyNames": {"pattern": "^[a-z]{1,4}$"}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "propertyNames": {"type": "string", "format": "date"}, "additionalProperties": {"type": "boolean"}},
    {"type": "object", "propertyNames": {"type": "integer"}},
    {"type": "object", "propertyNames": {"$ref": "#/$defs/k"}, "$defs": {"k": {"minLength": 2, "maxLength": 2}}},
])
def test_property_names_are_the_keys_of_objects_without_declared_names(schema):
    """``propertyNames`` S of an object that declares no names: its keys are the strings S admits (the JSON
    Schema Test Suite's propertyNames.json, and maps with typed values): sampled outputs valid, and probe
    objects accepted iff ``jsonschema`` says valid."""
    c = re.compile(assert_never_larger(schema))
    keys = ["", "a", "aa", "aaA", "f", "foo", "bar", "baz", "foobar", "1", "2024-02-29", "2023-02-29", "ab", "a b"]
    for k in keys:
        for v in (1, True, "x", None):
            obj = {k: v}
            assert bool(c.fullmatch(compact(obj))) == is_valid_text(schema, compact(obj)), (schema, obj)
    assert c.fullmatch("{}") and (not c.fullmatch('{"foo":1,"bar":2}')) == (not is_valid_text(schema, '{"foo":1,"bar":2}'))


@pytest.mark.parametrize("schema", [
    {"contains": {"minimum": 5}}, {"contains": {"const": 5}}, {"contains": True}, {"contains": False},
    {"contains": {"type": "null"}}, {"contains": {"const": 1}, "minContains": 2}, {"contains": {"const": 1}, "minContains": 0},
    {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 3}, "minContains": 2, "minItems": 1},
    {"$defs": {"n": {"type": "integer", "minimum": 3}}, "type": "array", "items": {"type": "integer"},
     "contains": {"$ref": "#/$defs/n"}},
    {"type": "array", "contains": {"enum": [1, "a", None]}, "items": {"type": "integer"}},
    {"type": "array", "items": {"type": "string", "maxLength": 2}, "contains": {"enum": ["ab", "abc", "a"]}, "minContains": 2},
])
def test_contains_at_least_min_contains_elements(schema):
    """``contains`` C with ``minContains`` m (default 1) and no ``maxContains``: arrays of ``items`` elements
    of which at least m satisfy C too (the JSON Schema Test Suite's contains.json and minContains.json
    cases without maxContains, and typed arrays): sampled outputs valid, probe arrays accepted iff
    ``jsonschema`` says valid."""
    c = re.compile(assert_never_larger(schema))
    probes = [[], [1], [5], [2, 5], [6, 2], [1, 1], [1, 2, 1], ["a", None], [None], [3], [3, 6], [1, "x", 1, 1],
              ["a", "ab", "b"], ["a", "ab", "ac"], ["ab", "b", "a", "a"], ["abc", "a", "a", "a"], "x", 7, {}]
    for p in probes:
        text = compact(p)
        assert bool(c.fullmatch(text)) == is_valid_text(schema, text), (schema, p)


@pytest.mark.parametrize("schema", [
    {"type": "array", "contains": {"const": "a"}, "minContains": 0, "maxContains": 1},
    {"type": "array", "contains": {"minimum": 5}, "maxContains": 1, "items": {"type": "integer"}},
    {"type": "array", "contains": {"type": "string", "pattern": "^a"}, "minContains": 1, "maxContains": 2},
    {"contains": {"type": "string"}, "minContains": 3, "maxContains": 2},
])
def test_max_contains_counts_the_elements_that_satisfy_contains(schema):
    """maxContains: the elements that fail ``contains`` are written by its negation, so the count is exact."""
    c = re.compile(assert_never_larger(schema))
    v = validator(schema)
    rnd = random.Random(8)
    pool = [0, 1, 5, 7, -2, 1.5, "a", "ab", "b", None, True, []]
    for i in range(3000):
        x = [rnd.choice(pool) for _ in range(rnd.randint(0, 5))] if i % 3 else rnd.choice(pool)
        assert bool(c.fullmatch(compact(x))) == v.is_valid(x), (schema, x)


def test_contains_refusals():
    for schema, kw in [({"contains": {"const": 1}, "maxContains": 2}, "contains"),
                       ({"type": "array", "prefixItems": [{}], "contains": {}}, "contains"),
                       ({"type": "array", "contains": {"const": 1}, "maxItems": 3}, "contains"),
                       ({"type": "array", "contains": {"const": 1}, "minItems": 2}, "contains"),
                       ({"items": {"multipleOf": 2}, "contains": {"multipleOf": 3}}, "contains")]:
        with pytest.raises(UnsupportedSchemaError) as ei:
            json_schema_to_regex(schema)
        assert ei.value.keyword == kw, schema


@pytest.mark.parametrize("schema", [
    {"dependentRequired": {"bar": ["foo"]}}, {"dependentRequired": {"quux": ["foo", "bar"]}},
    {"dependentSchemas": {"bar": {"properties": {"foo": {"type": "integer"}, "bar": {"type": "integer"}}}}},
    {"dependentSchemas": {"foo": True, "bar": False}},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
     "required": ["a"], "dependentRequired": {"b": ["c"]}, "additionalProperties": False},
    {"type": "object", "properties": {"card": {"type": "string", "maxLength": 4}, "zip": {"type": "integer"},
                                      "name": {"type": "string"}},
     "dependentSchemas": {"card": {"required": ["zip"], "properties": {"zip": {"minimum": 10}}}},
     "dependentRequired": {"name": ["card"]}},
    {"type": "object", "required": ["a"], "dependentRequired": {"a": ["b"]}},  # (a required name: always present)
    {"type": "object", "properties": {"a": False}, "additionalProperties": False, "dependentRequired": {"a": ["b"]}},
    # a chain (a name another entry adds is not "never present": found by the random test below)
    {"type": "object", "properties": {"d": {}}, "required": ["d"], "dependentRequired": {"d": ["b"]},
     "dependentSchemas": {"b": {"required": ["e"]}}},
])
def test_dependencies_as_a_union_over_present_names(schema):
    """``dependentRequired`` / ``dependentSchemas`` entries that do not always hold: the union over which of
    their names are present (each with its entry's schema merged in, the others absent). Sampled outputs
    valid; probe objects (keys in the order fst writes them: declared names, then the entries' names as
    required ones, then their schema's) accepted iff ``jsonschema`` says valid."""
    c = re.compile(assert_never_larger(schema))
    probes = [{}, {"bar": 1}, {"foo": 1}, {"bar": 2, "foo": 1}, {"quux": 1, "foo": 1, "bar": 1}, {"bar": 2, "foo": "x"},
              {"foo": 1, "bar": 2}, {"a": 1}, {"a": 1, "b": "x"}, {"a": 1, "b": "x", "c": True}, {"a": 1, "c": False},
              {"card": "1234"}, {"card": "1234", "zip": 12}, {"card": "1234", "zip": 5}, {"zip": 5}, {"name": "n"},
              {"card": "1", "zip": 10, "name": "n"}, {"a": 1, "b": 2}, {"d": 0, "b": None}, {"d": 0, "b": None, "e": 1},
              {"d": 0}, 1, "x", [None]]
    from scripts.bench_json_schema_suite import order_instance  # (fst's key order, as the suite benchmark)

    closed = "properties" in schema or "required" in schema  # (closed: a schema that declares names, docstring)
    declared = {*schema.get("properties", {}), *schema.get("required", []),
                *(n for deps in schema.get("dependentRequired", {}).values() for n in deps),
                *(n for s in schema.get("dependentSchemas", {}).values() if isinstance(s, dict)
                  for n in s.get("required", []))}
    for p in probes:
        if closed and isinstance(p, dict) and not p.keys() <= declared:
            continue
        text = compact(order_instance(p, schema))
        assert bool(c.fullmatch(text)) == is_valid_text(schema, text), (schema, p)


@pytest.mark.parametrize("schema", [
    {"if": {"const": 0}}, {"if": {"exclusiveMaximum": 0}, "then": {"minimum": -10}},
    {"if": {"exclusiveMaximum": 0}, "else": {"multipleOf": 2}},
    {"if": {"exclusiveMaximum": 0}, "then": {"minimum": -10}, "else": {"multipleOf": 2}},
    {"if": True, "then": {"const": "then"}, "else": {"const": "else"}},
    {"if": False, "then": {"const": "then"}, "else": {"const": "else"}},
    {"then": {"const": "yes"}, "else": {"const": "other"}, "if": {"maxLength": 4}},
    {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 10}, "else": {"minimum": 0}},
    {"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": ["null", "array"], "maxItems": 1}},
    {"type": "array", "if": {"minItems": 2}, "then": {"items": {"type": "integer"}}, "else": {"items": {"type": "string"}}},
])
def test_if_then_else_as_a_union(schema):
    """``if`` I ``then`` T ``else`` E: (I and T) or (not I and E), with not I written for a boolean, ``type``
    alone or one bound alone (the JSON Schema Test Suite's if-then-else.json schemas, and typed ones):
    sampled outputs valid, probe values accepted iff ``jsonschema`` says valid."""
    c = re.compile(assert_never_larger(schema))
    probes = [0, -1, -10, -11, 1, 2, 3, -2, 6, 11, 12, 0.5, -0.5, "then", "else", "abcd", "abcde", "yes", "other",
              "a", "ab", True, None, [], [1], [1, 2], ["a"], ["a", "b"], [None], {}]
    for p in probes:
        text = compact(p)
        assert bool(c.fullmatch(text)) == is_valid_text(schema, text), (schema, p)


def test_if_then_else_discriminated_by_a_property():
    """The common ``if`` of an object: one property's value (``const``) decides which names are required;
    not I is "the property present with another value of its ``enum``, or absent when required"."""
    from scripts.bench_json_schema_suite import order_instance

    schema = {"type": "object", "properties": {"kind": {"enum": ["car", "bike"]}, "wheels": {"type": "integer"},
                                               "gears": {"type": "integer"}},
              "required": ["kind"], "additionalProperties": False,
              "if": {"properties": {"kind": {"const": "car"}}, "required": ["kind"]},
              "then": {"required": ["wheels"]}, "else": {"required": ["gears"]}}
    c = re.compile(assert_never_larger(schema))
    for v in ({"kind": "car", "wheels": 4}, {"kind": "car", "gears": 3}, {"kind": "bike", "gears": 3},
              {"kind": "bike", "wheels": 2}, {"kind": "bike", "wheels": 2, "gears": 1}, {"kind": "car"}, {}):
        text = compact(order_instance(v, schema))
        assert bool(c.fullmatch(text)) == is_valid_text(schema, text), v
    # without an enum for the property, "another value" is the strings other than "car" (regex_algebra)
    schema = {**schema, "properties": {**schema["properties"], "kind": {"type": "string", "maxLength": 5}}}
    c = re.compile(assert_never_larger(schema))
    for v in ({"kind": "car", "wheels": 4}, {"kind": "car", "gears": 3}, {"kind": "van", "gears": 3},
              {"kind": "cars", "wheels": 2}, {"kind": "ca", "gears": 1}):
        text = compact(order_instance(v, schema))
        assert bool(c.fullmatch(text)) == is_valid_text(schema, text), v


@pytest.mark.parametrize("schema", [
    {"type": "string", "oneOf": [{"minLength": 2}, {"maxLength": 4}]}, {"oneOf": [True, False, False]},
    {"oneOf": [{"properties": {"bar": {"type": "integer"}}, "required": ["bar"]},
               {"properties": {"foo": {"type": "string"}}, "required": ["foo"]}]},
    {"oneOf": [{"type": "number"}, {}]}, {"oneOf": [{"type": ["string", "null"]}, {"maxLength": 1}, {"minimum": 1}]},
])
def test_one_of_with_overlapping_alternatives_by_negation(schema):
    """A ``oneOf`` whose alternatives may overlap: the union of "this one and not the others" where each
    negation can be written (the JSON Schema Test Suite's oneOf.json cases of that kind): probe values
    accepted iff ``jsonschema`` says valid."""
    from scripts.bench_json_schema_suite import order_instance

    c = re.compile(assert_never_larger(schema))
    for p in (0, 1, 2, 1.5, "", "a", "ab", "abcd", "abcde", None, True, [], {}, {"bar": 2}, {"foo": "x"},
              {"bar": 2, "foo": "x"}, {"bar": "x"}, {"foo": 2}):
        text = compact(order_instance(p, schema))
        assert bool(c.fullmatch(text)) == is_valid_text(schema, text), (schema, p)
    for empty in ({"oneOf": [True, True]}, {"oneOf": [False, False]}):
        with pytest.raises(EmptyLanguageError):
            json_schema_to_regex(empty)
    with pytest.raises(UnsupportedSchemaError) as ei:  # not integer next to a bound: not written
        json_schema_to_regex({"oneOf": [{"type": "integer"}, {"minimum": 2}]})
    assert ei.value.keyword == "oneOf"


def test_if_refused_where_its_negation_cannot_be_written():
    for cond in ({"const": 0}, {"type": "integer"}, {"minimum": 1, "maximum": 3}, {"required": list("abcde")},
                 {"properties": {"a": {}, "b": {}}}):
        with pytest.raises(UnsupportedSchemaError) as ei:
            json_schema_to_regex({"if": cond, "then": {"type": "number"}})
        assert ei.value.keyword == "if", cond


def _random_value(rnd: random.Random, depth: int = 0):
    k = rnd.random()
    if depth < 2 and k < 0.3:
        return {rnd.choice("abcdef"): _random_value(rnd, depth + 1) for _ in range(rnd.randint(0, 4))}
    if depth < 2 and k < 0.45:
        return [_random_value(rnd, depth + 1) for _ in range(rnd.randint(0, 4))]
    return rnd.choice([0, 1, 2, 5, -3, 1.5, 12, "", "a", "ab", "abc", "2024-01-01", True, False, None])


def _random_condition(rnd: random.Random):
    return rnd.choice([True, False, {"type": "string"}, {"type": ["null", "array"]}, {"minimum": 2},
                       {"exclusiveMaximum": 1}, {"maxLength": 1}, {"minItems": 2}, {"const": 1},
                       {"required": ["a"]}, {"properties": {"a": {"const": 1}}},
                       {"properties": {"b": {"enum": ["a", None]}}, "required": ["b"]}, {"pattern": "^a"},
                       {"enum": ["a", "abc"]}])


def _random_new_keyword_schema(rnd: random.Random, depth: int = 0):
    """Random schemas over the keywords converted as unions of merges (if/then/else, dependencies,
    contains, not, propertyNames), nested in objects and arrays."""
    leaf = rnd.choice([{}, {"type": "integer"}, {"type": "string", "maxLength": 2}, {"enum": [1, "a", None]},
                       {"type": ["number", "string"]}, {"minimum": 1}, {"type": "string", "pattern": "^a", "maxLength": 2},
                       {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"enum": ["a", "b", None]}},
                        "additionalProperties": rnd.choice([False, True])}])
    if depth > 1:
        return leaf
    k = rnd.random()
    sub = lambda: _random_new_keyword_schema(rnd, depth + 1)  # noqa: E731
    if k < 0.2:
        s = {"if": _random_condition(rnd)}
        if rnd.random() < 0.4:  # (an object discriminated by a property)
            s.update(type="object", properties={"a": {"enum": [1, 2]}, "b": {"enum": ["a", "b", None]}, "c": sub()})
        for b in ("then", "else"):
            if rnd.random() < 0.7:
                s[b] = rnd.choice([sub(), {"type": "integer"}, {"maxLength": 1}, {"minimum": 5}])
        return s
    if k < 0.45:
        names = rnd.sample("abcd", rnd.randint(1, 3))
        s = {"type": "object", "properties": {n: sub() for n in names}}
        if rnd.random() < 0.5:
            s["required"] = rnd.sample(names, rnd.randint(0, len(names)))
        if rnd.random() < 0.4:
            s["additionalProperties"] = rnd.choice([False, True, {"type": "integer"}])
        for _ in range(rnd.randint(1, 2)):
            t = rnd.choice("abcde")
            if rnd.random() < 0.5:
                s.setdefault("dependentRequired", {})[t] = rnd.sample("abcde", rnd.randint(0, 2))
            else:
                s.setdefault("dependentSchemas", {})[t] = rnd.choice(
                    [{"required": [rnd.choice("abcde")]}, {"properties": {rnd.choice("abcde"): {"type": "integer"}}},
                     {"minProperties": 1}, True])
        return s
    if k < 0.52:
        return {"oneOf": [rnd.choice([_random_condition(rnd), sub()]) for _ in range(rnd.randint(2, 3))]}
    if k < 0.6:
        return {"type": "object", "propertyNames": rnd.choice([{"maxLength": 1}, {"enum": ["a", "b"]}, {"pattern": "^[a-c]$"}]),
                "additionalProperties": sub()}
    if k < 0.8:
        s = {"type": "array", "contains": sub()}
        if rnd.random() < 0.5:
            s["items"] = rnd.choice([{"type": ["integer", "string"]}, {}, sub()])
        if rnd.random() < 0.4:
            s["minContains"] = rnd.randint(0, 2)
        if rnd.random() < 0.3:
            s["maxContains"] = rnd.randint(1, 3)
        return s
    return {**leaf, "not": rnd.choice([{"type": "integer"}, {"type": "string"}, {"minimum": 2}, {"maxLength": 1},
                                        {"type": ["null", "boolean"]}, {"required": ["a", "b"]}, {"required": ["b"]},
                                        {"properties": {"a": {"const": 1}}}, {"pattern": "^a"}, {"enum": ["a", "ab"]},
                                        {"const": "abc"}, {"type": "string", "maxLength": 1, "pattern": "b"}])}


@pytest.mark.parametrize("schema", [
    # a tagged union whose alternatives leave out "type": "object" (real-world schemas): a string, a number,
    # ... is valid against both alternatives, so no such value is valid against the oneOf
    {"oneOf": [{"properties": {"t": {"const": "a"}, "n": {"type": "integer"}}, "required": ["t", "n"],
                "additionalProperties": False},
               {"properties": {"t": {"const": "b"}}, "required": ["t"], "additionalProperties": False}]},
    {"oneOf": [{"minimum": 5}, {"maximum": 3}]},
    {"oneOf": [{"type": "string"}, {"maxLength": 3}]},
    {"oneOf": [True, {"type": "string"}]},
    # strings told apart by their patterns / lengths (the intersection of the two languages is empty)
    {"type": "string", "oneOf": [{"pattern": "^[0-9]+$"}, {"pattern": "^[a-z]+$"}, {"minLength": 9}]},
    {"type": "string", "oneOf": [{"pattern": "^ab"}, {"pattern": "b$", "maxLength": 2}]},
    {"type": ["object", "string"], "oneOf": [{"required": ["a"]}, {"required": ["b"]}, {"type": "string"}]},
])
def test_one_of_split_by_type(schema):
    c = re.compile(assert_never_larger(schema))
    v = validator(schema)
    rnd = random.Random(11)
    values = [{"t": "a", "n": 1}, {"t": "b"}, {"t": "a"}, {"t": "c"}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {},
              "", "abcd", "ab", "12", "abcdefghijk", "123456789", "b", "xb", "abb", 0, 4, 5, 2.5, None, True, [],
              [1]] + [_random_value(rnd) for _ in range(300)]
    agree = 0
    for x in values:
        hit = bool(c.fullmatch(compact(x)))
        assert not hit or v.is_valid(x), (schema, x)
        agree += hit == v.is_valid(x)
    assert agree >= 0.9 * len(values)


def test_new_keywords_never_accept_an_invalid_instance():
    """Soundness of the keywords converted as unions of merges, on random schemas and random instances (keys
    in fst's order): every instance the regex accepts is valid (``jsonschema``); and the converter refuses
    by name what it cannot write."""
    from scripts.bench_json_schema_suite import order_instance

    rnd = random.Random(2025)
    converted = accepted = 0
    for _ in range(300):
        schema = _random_new_keyword_schema(rnd)
        try:
            rx = json_schema_to_regex(schema)
        except NAMED:
            continue
        converted += 1
        c = re.compile(rx)
        for _ in range(120):
            v = _random_value(rnd)
            text = compact(order_instance(v, schema))
            if c.fullmatch(text):
                accepted += 1
                assert is_valid_text(schema, text), (schema, text)
        for text in sample(rx, 20, seed=rnd.randint(0, 10**6)):
            assert is_valid_text(schema, text), (schema, text)
    assert converted > 150 and accepted > 2000, (converted, accepted)


def test_boolean_schemas():
    assert re.fullmatch(json_schema_to_regex(True), "[1]")
    with pytest.raises(EmptyLanguageError):
        json_schema_to_regex(False)
    rx = json_schema_to_regex({"type": "object", "properties": {"a": False, "b": True}, "additionalProperties": False})
    assert re.fullmatch(rx, '{"b":[]}') and not re.fullmatch(rx, '{"a":1}')


def test_whitespace_pattern():
    s = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}, "required": ["a"],
         "additionalProperties": False}
    assert re.fullmatch(json_schema_to_regex(s), '{ "a": [1, 2] }')
    assert not re.fullmatch(json_schema_to_regex(s), '{  "a":[1]}')  # default [ ]? is bounded
    rx = json_schema_to_regex(s, "[ \\n]{0,2}")
    assert re.fullmatch(rx, '{\n "a": [\n1,\n 2\n] }') and parse_regex(rx)
    assert re.fullmatch(json_schema_to_regex(s, ""), '{"a":[1]}')
    assert not re.fullmatch(json_schema_to_regex(s, ""), '{"a": [1]}')
    for bad in ("\\s*", "x?", "[^a]"):
        with pytest.raises(InvalidOptionError):
            json_schema_to_regex(s, bad)


def test_escape_literal_round_trip():
    for text in ["a.b", "x|y", "(1+1)*2", "new\nline", "a b-c#d", "[]{}^$\\", "\x00\x7f", '"q"', "中😀"]:
        rx = escape_literal(text)
        assert re.fullmatch(rx, text) and parse_regex(rx)


# ------------------------------------------------------------------------------------------------
# A corpus of realistic schemas: parses, never larger, natural instances accepted
# ------------------------------------------------------------------------------------------------

CORPUS = {
    "tool_call": ({
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["location"],
    }, [{"location": "Paris"}, {"location": "Oslo", "unit": "celsius", "days": 3}]),
    "pydantic": ({
        "$defs": {"Color": {"enum": ["red", "green"], "title": "Color", "type": "string"},
                  "Item": {"properties": {"name": {"title": "Name", "type": "string"},
                                          "price": {"exclusiveMinimum": 0, "title": "Price", "type": "number"}},
                           "required": ["name", "price"], "title": "Item", "type": "object"}},
        "properties": {"id": {"format": "uuid", "type": "string"},
                       "color": {"$ref": "#/$defs/Color", "default": "red"},
                       "items": {"items": {"$ref": "#/$defs/Item"}, "maxItems": 5, "type": "array"},
                       "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                       "when": {"format": "date-time", "type": "string"}},
        "required": ["id", "items"], "title": "Order", "type": "object", "additionalProperties": False,
    }, [{"id": "2eb8aa08-aa98-11ea-b4aa-73b441d16380", "items": []},
        {"id": "2eb8aa08-aa98-11ea-b4aa-73b441d16380", "color": "green",
         "items": [{"name": "pen", "price": 1.5}, {"name": "ink", "price": 2}], "note": None,
         "when": "2024-02-29T12:00:00Z"}]),
    "discriminated": ({
        "oneOf": [{"type": "object", "properties": {"type": {"const": "circle"}, "r": {"type": "number", "minimum": 0}},
                   "required": ["type", "r"], "additionalProperties": False},
                  {"type": "object", "properties": {"type": {"const": "rect"}, "w": {"type": "number"},
                                                    "h": {"type": "number"}},
                   "required": ["type", "w", "h"], "additionalProperties": False}],
        "discriminator": {"propertyName": "type"},
    }, [{"type": "circle", "r": 2}, {"type": "rect", "w": 1, "h": 2.5}]),
    "nested_optional": ({
        "type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 20},
            "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string",
                        "pattern": "^[0-9]{5}$"}}, "additionalProperties": False},
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": False},
            "score": {"type": ["number", "null"], "maximum": 100}},
        "additionalProperties": False,
    }, [{}, {"name": "x", "address": {"zip": "12345"}, "tags": ["a", "b"], "score": None},
        {"address": {"street": "Main"}, "score": 99.5}]),
    "json_object": ({"type": "object"}, [{}, {"a": 1, "b": [True, None], "c": {"d": "e"}}]),
    "string_formats": ({"type": "array", "items": {"anyOf": [{"type": "string", "format": "date"},
                                                            {"type": "string", "format": "ipv4"},
                                                            {"type": "string", "format": "email"}]}},
                       [["2020-01-31", "10.0.0.1", "a@b.io"]]),
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_never_larger_and_natural_instances_accepted(name):
    schema, instances = CORPUS[name]
    rx = assert_never_larger(schema, n=200, seed=zlib.crc32(name.encode()))
    c = re.compile(rx)
    v = validator(schema)
    for inst in instances:
        assert v.is_valid(inst), inst
        assert c.fullmatch(compact(inst)), (name, inst)
        assert c.fullmatch(json.dumps(inst, ensure_ascii=False)), (name, inst)


def _random_schema(rnd: random.Random, depth: int, defs: dict):
    """A random schema over the supported keywords (and a few that get refused)."""
    k = rnd.random()
    if depth > 3 or k < 0.25:
        t = rnd.choice(["integer", "number", "string", "boolean", "null"])
        s: dict = {"type": t}
        if t == "integer":
            if rnd.random() < 0.5:
                s["minimum"] = rnd.randint(-20, 20)
            if rnd.random() < 0.4:
                s["exclusiveMaximum"] = rnd.randint(-20, 40)
            if rnd.random() < 0.2:
                s["multipleOf"] = rnd.choice([2, 5, 10])
        elif t == "number":
            if rnd.random() < 0.5:
                s[rnd.choice(["minimum", "exclusiveMinimum"])] = rnd.randint(-5, 5)
            if rnd.random() < 0.5:
                s[rnd.choice(["maximum", "exclusiveMaximum"])] = rnd.randint(-5, 10)
        elif t == "string":
            r = rnd.random()
            if r < 0.3:
                s.update(maxLength=rnd.randint(0, 4), minLength=rnd.randint(0, 2))
            elif r < 0.5:
                s["pattern"] = rnd.choice(["^a+$", "b", "^[^x]{1,2}$", "^.$", "\\d", "^\\S+$", "^(ab|c)*$", 'q"\\\\'])
            elif r < 0.6:
                s["format"] = rnd.choice(["date", "ipv4", "uuid", "time", "date-time", "email"])
            elif r < 0.7:
                s = {"enum": rnd.sample(["a", "b", 1, None, True, [1], {"x": 1}, "c\n"], rnd.randint(1, 4))}
        if rnd.random() < 0.1:
            s = {"const": rnd.choice(["z", 2, None, {"k": [1]}])}
        return s
    if k < 0.55:
        names = ["zeta", "a", "mid", "b2", "ab", "x", "name"]
        props = {rnd.choice(names) + str(i): _random_schema(rnd, depth + 1, defs) for i in range(rnd.randint(0, 4))}
        s = {"type": "object", "properties": props}
        if props and rnd.random() < 0.6:
            s["required"] = rnd.sample(list(props), rnd.randint(0, len(props)))
        r = rnd.random()
        if r < 0.35:
            s["additionalProperties"] = False
        elif r < 0.5:
            s["additionalProperties"] = _random_schema(rnd, depth + 1, defs)
        elif r < 0.6:
            s = {"allOf": [s], "unevaluatedProperties": False}
        if rnd.random() < 0.1:
            s["minProperties"] = 1
        if rnd.random() < 0.2:
            s.pop("type", None)
        return s
    if k < 0.7:
        s = {"type": "array"}
        if rnd.random() < 0.3:
            s["prefixItems"] = [_random_schema(rnd, depth + 1, defs) for _ in range(rnd.randint(1, 2))]
        if rnd.random() < 0.7:
            s["items"] = _random_schema(rnd, depth + 1, defs) if rnd.random() < 0.9 else False
        if rnd.random() < 0.4:
            s["minItems"] = rnd.randint(0, 2)
        if rnd.random() < 0.4:
            s["maxItems"] = rnd.randint(0, 3)
        return s
    if k < 0.8:
        alternatives = [_random_schema(rnd, depth + 1, defs) for _ in range(rnd.randint(1, 3))]
        return {rnd.choice(["anyOf", "oneOf"]): alternatives}
    if k < 0.87:
        return {"allOf": [_random_schema(rnd, depth + 1, defs) for _ in range(rnd.randint(1, 2))]}
    if k < 0.95:
        name = f"d{len(defs)}"
        defs[name] = {}
        defs[name] = _random_schema(rnd, depth + 1, defs)
        ref = {"$ref": f"#/$defs/{name}"}
        return ref if rnd.random() < 0.7 else {**ref, "required": ["a0"], "type": "object"}
    return rnd.choice([{}, True, {"type": ["string", "null"]}, {"not": False}, {"not": {"type": "integer"}},
                       {"type": ["number", "string"], "not": {"type": ["string", "integer"]}},
                       {"if": {"minimum": 3}, "then": {"maximum": 5}, "else": {"type": "integer"}},
                       {"if": {"maxLength": 2}, "then": {"pattern": "^a"}},
                       {"contains": {"type": "string"}, "minContains": 2}])


def test_random_schemas_never_larger():
    """Random schemas over the supported keywords: converted or refused by name, and every sampled
    string of the regex (and every accepted mutation of one) valid."""
    converted = 0
    for seed in range(200):
        rnd = random.Random(seed)
        defs: dict = {}
        schema = _random_schema(rnd, 0, defs)
        if defs and isinstance(schema, dict):
            schema = {**schema, "$defs": defs}
        try:
            rx = json_schema_to_regex(schema)
        except NAMED:
            continue
        converted += 1
        assert_never_larger(schema, n=20, seed=seed, rx=rx)
    assert converted > 140


# ------------------------------------------------------------------------------------------------
# The official JSON Schema Test Suite (draft 2020-12)
# ------------------------------------------------------------------------------------------------

#: Floors measured on this converter (see the final report); raise them when support grows.
SUITE_MIN_CONVERTED = 282
SUITE_MIN_VALID_ACCEPTED = 745


def _serializations(value) -> list[str]:
    def reorder(v, how):
        if isinstance(v, dict):
            keys = sorted(v) if how == "sorted" else list(v)[::-1] if how == "reversed" else list(v)
            return {k: reorder(v[k], how) for k in keys}
        if isinstance(v, list):
            return [reorder(x, how) for x in v]
        return v

    return list(dict.fromkeys(compact(reorder(value, h)) for h in ("given", "sorted", "reversed")))


def test_json_schema_test_suite():
    files = sorted(glob.glob(str(SUITE / "*.json")) + glob.glob(str(SUITE / "optional" / "**" / "*.json"),
                                                                  recursive=True))
    assert len(files) >= 80
    converted = refused = valid = valid_accepted = invalid = 0
    wrong = []
    for f in files:
        for case in json.load(open(f, encoding="utf-8")):
            try:
                rx = json_schema_to_regex(case["schema"])
            except NAMED:
                refused += 1
                continue
            converted += 1
            parse_regex(rx, max_positions=10**6)
            c = re.compile(rx)
            for t in case["tests"]:
                hits = [c.fullmatch(s) is not None for s in _serializations(t["data"])]
                if t["valid"]:
                    valid += 1
                    valid_accepted += any(hits)
                else:
                    invalid += 1
                    if any(hits):
                        wrong.append((os.path.basename(f), case["description"], t["description"]))
    print(f"suite: {converted} schemas converted, {refused} refused; valid instances accepted "
          f"{valid_accepted}/{valid}; invalid instances {invalid}, wrongly accepted {len(wrong)}")
    assert wrong == []
    assert converted >= SUITE_MIN_CONVERTED and valid_accepted >= SUITE_MIN_VALID_ACCEPTED


def test_composed_trees_equal_the_parse_of_the_regex(monkeypatch):
    """The converter records the tree of each regex it returns (composed from its fragments' trees, not
    parsed: compiler/regex_parse.remember_tree). For every schema of the JSON Schema Test Suite and the
    random schemas above that converts, that tree is the one interegular's parse of the regex gives,
    and parse_regex returns it without parsing (the parser is not called)."""
    from vllm_fst_backend.compiler import regex_parse as rp

    files = sorted(glob.glob(str(SUITE / "*.json")) + glob.glob(str(SUITE / "optional" / "**" / "*.json"),
                                                                  recursive=True))
    schemas = [case["schema"] for f in files for case in json.load(open(f, encoding="utf-8"))]
    for seed in range(60):
        rnd = random.Random(seed)
        defs: dict = {}
        schema = _random_schema(rnd, 0, defs)
        schemas.append({**schema, "$defs": defs} if defs and isinstance(schema, dict) else schema)
    checked = 0
    for schema in schemas:
        try:
            rx = json_schema_to_regex(schema)
        except NAMED:
            continue
        tree = rp.known_tree(rx)
        assert tree is not None, rx[:200]
        assert tree == rp._parse_text(rx, None), rx[:200]
        checked += 1
    assert checked > 250
    # parse_regex takes the recorded tree (no parse) and still applies its size budget
    rx = json_schema_to_regex({"type": "object", "properties": {"a": {"type": "string", "maxLength": 30}}})
    monkeypatch.setattr(rp, "_parse_text", lambda *a: pytest.fail("parsed a recorded regex"))
    assert parse_regex(rx) == rp.known_tree(rx)
    with pytest.raises(CompileBudgetError, match="character positions"):
        parse_regex(rx, max_positions=10)


def test_fragment_trees_are_not_used_where_a_fragment_parses_differently_alone():
    """A fragment with an anchor or an inline flag, or one that does not parse, has no tree of its own
    (its parse alone may differ from its part in the whole regex): a regex made with it is parsed."""
    from vllm_fst_backend.compiler.regex_parse import fragment_tree

    assert fragment_tree("(?i)ab") is None and fragment_tree("^a") is None and fragment_tree("a$") is None
    assert fragment_tree("(a") is None and fragment_tree("a(?=b)") is None
    assert fragment_tree("[a-c]x") == ("cat", (("sym", (frozenset("abc"), False)), ("sym", (frozenset("x"), False))))


def test_remote_refs_of_the_suite_are_refused():
    data = json.load(open(SUITE / "refRemote.json", encoding="utf-8"))
    n = 0
    for case in data:
        if "localhost:1234" in json.dumps(case["schema"]):
            with pytest.raises(UnsupportedSchemaError):
                json_schema_to_regex(case["schema"])
            n += 1
    assert n >= 5


# ------------------------------------------------------------------------------------------------
# Limits and budgets
# ------------------------------------------------------------------------------------------------


def test_regex_size_limit_raises_fast():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{1,3}[0-9]+$"}
                                            for i in range(900)}, "required": ["p0"]}
    t = time.perf_counter()
    with pytest.raises(InputTooLargeError) as ei:
        json_schema_to_regex(big, limits=InputLimits(max_regex_chars=20_000))
    assert time.perf_counter() - t < 1.0
    e = ei.value
    assert e.limit_name == "max_regex_chars" and e.env_var == "VLLM_FST_MAX_REGEX_CHARS" and e.limit == 20_000
    assert e.measured > 20_000 and "max_regex_chars" in str(e)


def _fan_out(levels: int, combinator: str) -> dict:
    defs = {f"L{levels}": {"type": "integer"}}
    for i in range(levels - 1, -1, -1):
        nxt = {"$ref": f"#/$defs/L{i + 1}"}
        defs[f"L{i}"] = {combinator: [nxt, {"type": "array", "items": nxt}]}
    return {"$defs": defs, "$ref": "#/$defs/L0"}


@pytest.mark.parametrize("combinator", ["anyOf", "oneOf"])
def test_explosive_fan_out_is_refused_quickly(combinator):
    t = time.perf_counter()
    with pytest.raises(NAMED):
        json_schema_to_regex(_fan_out(12, combinator))
    assert time.perf_counter() - t < 2.0
    # the same shape, twice the same ref: deduplicated, linear
    defs = {"L10": {"type": "integer"}}
    for i in range(9, -1, -1):
        defs[f"L{i}"] = {"anyOf": [{"$ref": f"#/$defs/L{i + 1}"}, {"$ref": f"#/$defs/L{i + 1}"}]}
    assert json_schema_to_regex({"$defs": defs, "$ref": "#/$defs/L0"}) == json_schema_to_regex({"type": "integer"})


def test_deadline_in_the_past_raises_compile_budget_error():
    with pytest.raises(CompileBudgetError) as ei:
        json_schema_to_regex({"type": "object"}, deadline=time.perf_counter() - 1)
    assert "time budget" in str(ei.value)


def test_schema_input_limits_checked_first():
    deep: dict = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InputTooLargeError) as ei:
        json_schema_to_regex(deep)
    assert ei.value.limit_name == "max_schema_depth"
    with pytest.raises(InputTooLargeError):
        json_schema_to_regex({"enum": list(range(5))}, limits=InputLimits(max_enum_values=3))


# ------------------------------------------------------------------------------------------------
# Real compiles (SmolLM2, canonical) stay within the compile budget
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_converted_regexes_compile_within_budget(built_artifacts):
    art_dir = built_artifacts("smollm2", canonical=True)  # built once per test run (conftest)
    from vllm_fst_backend.artifacts.store import load_artifacts
    from vllm_fst_backend.compiler import CompileOptions, compile_regex, prepare

    art = load_artifacts(str(art_dir))
    prepare(art, canonical=True)
    for name in ("tool_call", "pydantic", "discriminated", "json_object"):
        rx = json_schema_to_regex(CORPUS[name][0])
        assert estimate_positions(parse_regex(rx)) < 8000
        compiled = compile_regex(rx, art, CompileOptions(canonical=True))  # default budgets (4 s)
        assert compiled.accepting.any()


def test_many_leading_optional_properties_compile_and_match_token_by_token(built_artifacts, smollm2_info):
    """An object of 12 optional bounded strings (none required, so each may start the object) was refused
    by the position budget: its regex wrote each member ~3 times (10,217 positions, budget 8,000). The
    converter's chain of optional tails is built with each member's positions once
    (regex_parse.optional_tail). Compiled with the default budgets (canonical), its matcher accepts the
    canonical SmolLM2 ids of random instances (any subset of the members, in order) and of the regex's
    own samples, and rejects out-of-order members, a doubled comma and a string one character too long."""
    from vllm_fst_backend.artifacts.store import load_artifacts
    from vllm_fst_backend.compiler import CompileOptions, compile_regex, prepare
    from vllm_fst_backend.runtime import FstMatcher

    art = load_artifacts(str(built_artifacts("smollm2", canonical=True)))
    prepare(art, canonical=True)
    names = [f"field_{i}" for i in range(12)]
    schema = {"type": "object", "properties": {k: {"type": "string", "maxLength": 30} for k in names}}
    rx = json_schema_to_regex(schema)
    assert estimate_positions(parse_regex(rx)) < 8000
    compiled = compile_regex(rx, art, CompileOptions(canonical=True))  # default budgets

    def accepted(text: str) -> bool:
        m = FstMatcher(compiled)
        return all(m.accept_tokens("t", [t]) for t in smollm2_info.encode(text)) and \
            m.accept_tokens("t", [m.eos_ids[0]]) and m.is_terminated()

    rnd = random.Random(7)
    words = ["Berlin", "a b", "x" * 30, "", "caf\u00e9", "quote \" here", "日本", "42"]
    v = validator(schema)
    for _ in range(25):
        keys = [k for k in names if rnd.random() < 0.4]
        inst = {k: rnd.choice(words) for k in keys}
        assert v.is_valid(inst)
        assert accepted(compact(inst)), compact(inst)
    assert accepted("{}") and accepted('{"field_11":"z"}') and accepted('{"field_0":"z"}')
    assert not accepted('{"field_3":"a","field_1":"b"}')
    assert not accepted('{"field_1":"a",,"field_3":"b"}')
    assert not accepted('{"field_1":"' + "x" * 31 + '"}')


def test_long_bounded_strings_compile_with_the_default_budgets(built_artifacts, smollm2_info):
    """Strings of ``maxLength`` 1,000 (10,002 positions, ~7,000 character states, ~14,000 byte states) were
    refused: by the position budget (8,000), and past it by the token DFA's count of group transitions,
    which counted each pair the counter-chain shortcut adds once per group (over 20 M, never enumerated).
    With the default budgets it compiles (canonical, SmolLM2); its matcher accepts the canonical ids of a
    1,000-character string (escapes, non-ASCII) and of an object of two such strings, and rejects 1,001."""
    from vllm_fst_backend.artifacts.store import load_artifacts
    from vllm_fst_backend.compiler import CompileOptions, compile_regex, prepare
    from vllm_fst_backend.runtime import FstMatcher

    art = load_artifacts(str(built_artifacts("smollm2", canonical=True)))
    prepare(art, canonical=True)
    string = {"type": "string", "maxLength": 1000}
    obj = {"type": "object", "properties": {"a": string, "b": {"type": "string", "maxLength": 255}},
           "required": ["a", "b"], "additionalProperties": False}
    rnd = random.Random(11)
    pieces = ["word ", "caf\u00e9 ", "\"q\" ", "\\", "日本 ", "tab\t", "x"]
    text = ""
    while len(text) < 1000:
        text += rnd.choice(pieces)
    text = text[:1000]
    for schema, good, bad in ((string, [text, "", text[:1]], [text + "y"]),
                              (obj, [{"a": text, "b": text[:255]}, {"a": "", "b": ""}],
                               [{"a": text, "b": text[:256]}, {"a": text + "z", "b": ""}])):
        compiled = compile_regex(json_schema_to_regex(schema), art, CompileOptions(canonical=True))

        def accepted(inst) -> bool:
            m = FstMatcher(compiled)
            return all(m.accept_tokens("t", [t]) for t in smollm2_info.encode(compact(inst))) and \
                m.accept_tokens("t", [m.eos_ids[0]]) and m.is_terminated()

        v = validator(schema)
        for inst in good:
            assert v.is_valid(inst) and accepted(inst), compact(inst)[:80]
        for inst in bad:
            assert not v.is_valid(inst) and not accepted(inst), compact(inst)[:80]


@pytest.mark.parametrize("schema,keyword,pointer", [
    ({"type": "string", "pattern": "^\\p{Letter}+$"}, "pattern", ""),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^\\cC$"}}}, "pattern", "/properties/a"),
    ({"type": "object", "patternProperties": {"^\\p{digit}+$": {}}}, "patternProperties", ""),
])
def test_ecma_only_patterns_are_unsupported_not_invalid(schema, keyword, pointer):
    """A pattern Python's ``re`` cannot compile (the metaschema's ``regex`` format check) may be valid
    ECMA-262 (``\\p{Letter}``, ``\\cC``; the suite's optional/ecmascript-regex.json): the server-side
    conversion refuses it as unsupported (the fallback backend may serve it), naming the keyword and
    where, not as a malformed schema (HTTP 400); a malformed keyword stays invalid."""
    from vllm_fst_backend.compiler.constraints import json_schema_to_regex as server_convert

    with pytest.raises(UnsupportedSchemaError) as ei:
        server_convert(schema)
    assert ei.value.keyword == keyword and ei.value.pointer == pointer and "regex syntax" in str(ei.value)
    with pytest.raises(InvalidSchemaError):
        server_convert({"type": "string", "pattern": "^\\p{Letter}+$", "minLength": "x"})


def test_open_objects_environment(monkeypatch):
    from vllm_fst_backend.compiler import constraints

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = compact({"a": 1, "b": 2})
    monkeypatch.delenv(constraints.OPEN_OBJECTS_ENV, raising=False)
    assert not re.fullmatch(constraints.json_schema_to_regex(schema), text)
    assert Draft202012Validator(schema).is_valid({"a": 1, "b": 2})  # (valid: the default is a smaller language)
    monkeypatch.setenv(constraints.OPEN_OBJECTS_ENV, "1")
    assert re.fullmatch(constraints.json_schema_to_regex(schema), text)  # (not the memo of the closed regex)
    monkeypatch.setenv(constraints.OPEN_OBJECTS_ENV, "maybe")
    with pytest.raises(InvalidOptionError, match="VLLM_FST_JSON_OPEN_OBJECTS"):
        constraints.json_schema_to_regex(schema)


def test_pattern_properties_one_pattern():
    # a map: keys matching the pattern (a search, as ``pattern``), values of its schema, no other keys
    schema = {"type": "object", "patternProperties": {"^[a-z]+$": {"type": "integer"}}, "additionalProperties": False}
    c = re.compile(assert_never_larger(schema))
    for v, ok in [({}, True), ({"a": 1}, True), ({"ab": 1, "cd": 2}, True), ({"A": 1}, False), ({"a": "x"}, False)]:
        assert bool(c.fullmatch(compact(v))) == ok, v
    # next to declared properties (silent about other keys: closed by default, as declared names)
    schema = {"type": "object", "properties": {"X1": {"type": "string"}}, "required": ["X1"],
              "patternProperties": {"^[a-z]+$": {"type": "integer"}}}
    c = re.compile(assert_never_larger(schema))
    assert c.fullmatch(compact({"X1": "q", "ab": 1})) and not c.fullmatch(compact({"X1": "q", "AB": 1}))
    for bad, why in [
        (dict(schema, additionalProperties=True), "does not match"),
        ({"type": "object", "patternProperties": {"^a": {}, "^b": {}}}, "more than one"),
        ({"type": "object", "properties": {"ab": {}}, "patternProperties": {"^a": {"type": "integer"}}}, "'ab'"),
    ]:
        with pytest.raises(UnsupportedSchemaError, match=why) as ei:
            json_schema_to_regex(bad)
        assert ei.value.keyword == "patternProperties"
    with pytest.raises(UnsupportedSchemaError):  # open objects: the keys it does not match would need a complement
        json_schema_to_regex(schema, open_objects=True)


def test_pattern_properties_search_is_bounded():
    # a declared name against a pattern a backtracking matcher takes exponential time on: refused within
    # PATTERN_SEARCH_S, never a hang
    schema = {"type": "object", "properties": {"a" * 40 + "b": {}}, "patternProperties": {"(a|aa)+$": {}},
              "additionalProperties": False}
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedSchemaError, match="took too long"):
        json_schema_to_regex(schema)
    assert time.perf_counter() - t0 < 10


def test_enum_check_of_patterns_is_bounded():
    # enum values are filtered by jsonschema; its pattern keywords go through a time-bounded search here
    # (Python's re takes ~4 s on 36 a's of this pattern and doubles per character)
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedSchemaError, match="timed out"):
        json_schema_to_regex({"type": "string", "pattern": "(a|aa)+$", "enum": ["a" * 60 + "b", "aab"]})
    assert time.perf_counter() - t0 < 10
    # and still exact where the search is quick
    assert json_schema_to_regex({"type": "string", "pattern": "^a+$", "enum": ["aaa", "b"]}) == '"aaa"'
    obj = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False,
           "enum": [{"x1": 1}, {"y": 2}, {"x2": "s"}]}
    assert re.fullmatch(json_schema_to_regex(obj), '{"x1":1}') and json_schema_to_regex(obj) == r'\{"x1":1\}'


def test_env_flag_one_parser_for_every_boolean_variable(monkeypatch):
    """``compiler.options.env_flag``: unset or empty -> the default; 0/false/no/off (any case, spaces)
    -> False; anything else -> True, or with ``strict`` only 1/true/yes/on (else InvalidOptionError naming
    the variable). The disk cache, the table store, the open-objects switch and the vLLM flags read it."""
    from vllm_fst_backend.compiler import persist, table_store
    from vllm_fst_backend.compiler.options import env_flag

    name = "VLLM_FST_TEST_FLAG"
    monkeypatch.delenv(name, raising=False)
    assert env_flag(name, True) is True and env_flag(name, False) is False
    for raw, want in [("", True), ("  ", True), ("0", False), (" Off ", False), ("NO", False), ("1", True),
                      ("yes", True), ("maybe", True)]:
        monkeypatch.setenv(name, raw)
        assert env_flag(name, True) is want, raw
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(InvalidOptionError, match=name):
        env_flag(name, False, strict=True)
    monkeypatch.setenv(name, " TRUE ")
    assert env_flag(name, False, strict=True) is True
    monkeypatch.setenv("VLLM_FST_DISK_CACHE", "False")
    assert persist.disk_cache_from_env() is None
    monkeypatch.setenv("VLLM_FST_SHARED_TABLES", "no")
    assert table_store.shared_tables_root() is None
