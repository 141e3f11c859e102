"""Input limits (compiler/limits.py, issue 14 item 1): each limit refuses just over its value with an
InputTooLargeError naming the limit, the environment variable and the measured size, and accepts
just under it; the environment overrides; the checks are iterative (no RecursionError)."""

from __future__ import annotations

import json

import pytest

from vllm_fst_backend.compiler.limits import (
    DEFAULT_LIMITS,
    ENV_VARS,
    InputLimits,
    check_choices,
    check_regex,
    check_schema_obj,
    check_schema_text,
    nesting_depth_text,
)
from vllm_fst_backend.errors import FstBackendError, InputTooLargeError, InvalidOptionError


def _raises(fn, name: str, measured=None) -> InputTooLargeError:
    with pytest.raises(InputTooLargeError) as ei:
        fn()
    e = ei.value
    assert isinstance(e, FstBackendError)
    assert e.limit_name == name and e.env_var == ENV_VARS[name]
    assert name in str(e) and ENV_VARS[name] in str(e) and str(e.measured) in str(e)
    if measured is not None:
        assert e.measured == measured
    return e


def test_regex_length():
    lim = InputLimits(max_regex_chars=10)
    check_regex("a" * 10, lim)
    _raises(lambda: check_regex("a" * 11, lim), "max_regex_chars", 11)
    _raises(lambda: check_regex("[a-z]" * 1_000_000), "max_regex_chars", 5_000_000)


def _schema(n_props: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x [y] {z}"}
                                             for i in range(n_props)}, "required": ["p0"]}


def test_schema_text_length_and_depth():
    text = json.dumps(_schema(3))
    check_schema_text(text, InputLimits(max_schema_chars=len(text), max_schema_depth=3))
    _raises(lambda: check_schema_text(text, InputLimits(max_schema_chars=len(text) - 1)), "max_schema_chars",
            len(text))
    # brackets inside strings (with escaped quotes) do not count
    assert nesting_depth_text(text) == 3
    assert nesting_depth_text('{"a": "[[[{{{\\"[[", "b": [[1]]}') == 3
    _raises(lambda: check_schema_text(text, InputLimits(max_schema_depth=2)), "max_schema_depth", 3)
    deep = "[" * 200_000 + "]" * 200_000  # json.loads would hit the recursion limit on this
    _raises(lambda: check_schema_text(deep, InputLimits(max_schema_chars=10**6)), "max_schema_depth", 200_000)


def test_schema_obj_depth_enum_size():
    check_schema_obj(_schema(3))
    nested: dict = {}
    cur = nested
    for _ in range(100_000):  # far beyond Python's recursion limit
        cur["not"] = {}
        cur = cur["not"]
    e = _raises(lambda: check_schema_obj(nested), "max_schema_depth")
    assert e.measured == DEFAULT_LIMITS.max_schema_depth + 1
    en = {"enum": list(range(DEFAULT_LIMITS.max_enum_values + 1))}
    _raises(lambda: check_schema_obj(en), "max_enum_values", DEFAULT_LIMITS.max_enum_values + 1)
    check_schema_obj({"enum": list(range(DEFAULT_LIMITS.max_enum_values))})
    big = _schema(20_000)
    e = _raises(lambda: check_schema_obj(big), "max_schema_chars")
    assert e.measured > DEFAULT_LIMITS.max_schema_chars
    # a schema given as text goes through the text check
    _raises(lambda: check_schema_obj(json.dumps(big)), "max_schema_chars", len(json.dumps(big)))


def test_choices():
    lim = InputLimits(max_choices=3, max_choices_chars=10)
    check_choices(["ab", "cd", "ef"], lim)
    _raises(lambda: check_choices(["a", "b", "c", "d"], lim), "max_choices", 4)
    _raises(lambda: check_choices(iter(["a", "b", "c", "d"]), lim), "max_choices", 4)
    _raises(lambda: check_choices(["abcdef", "ghijk"], lim), "max_choices_chars", 11)
    check_choices([12345, 67890], lim)  # non-strings are measured as str()
    _raises(lambda: check_choices([123456, 67890], lim), "max_choices_chars", 11)


def test_from_env_and_validation():
    env = {v: "7" for v in ENV_VARS.values()}
    lim = InputLimits.from_env(env)
    assert all(getattr(lim, k) == 7 for k in ENV_VARS)
    assert InputLimits.from_env({}) == DEFAULT_LIMITS
    assert InputLimits.from_env({"VLLM_FST_MAX_REGEX_CHARS": ""}) == DEFAULT_LIMITS
    for bad in ("0", "-3", "abc", "1.5"):
        with pytest.raises(InvalidOptionError, match="VLLM_FST_MAX_CHOICES"):
            InputLimits.from_env({"VLLM_FST_MAX_CHOICES": bad})
    with pytest.raises(InvalidOptionError):
        InputLimits(max_regex_chars=0)
    with pytest.raises(InvalidOptionError):
        InputLimits(max_schema_depth=True)
