"""The official JSON Schema Test Suite (draft 2020-12, vendored in tests/data/json_schema_test_suite) through
fst: the converter (``constraints.json_schema_to_regex``) on every schema, and the whole pipeline, token by
token on the real SmolLM2 tokenizer in canonical mode, on a deterministic sample of schemas.

The judge is the suite's own verdict per instance. Each instance is serialized compactly with its object
keys in the order fst emits (``scripts/bench_json_schema_suite.py``: ``order_instance``) and tokenized
canonically (the tokenizer's own ``encode``, no special tokens); the token-level check feeds those ids one
at a time to a fresh ``FstMatcher``, then EOS (accepted iff all are accepted).

Asserted:

* every schema converts to a regex or is refused with a named error (``UnsupportedSchemaError``,
  ``InvalidSchemaError``, ``EmptyLanguageError``, ``InputTooLargeError``, ``CompileBudgetError``); an
  "empty language" schema has no valid instance in the suite;
* **no invalid instance is accepted**, by the regex (Python ``re.fullmatch``, every converted schema) and
  token by token (the sample);
* every valid instance of a converted schema is accepted, except where the converter documents a smaller
  language (``compiler/json_schema.py``, "Smaller language"). Those are excluded by the rules of
  ``smaller_language_rule`` (in the benchmark script, shared with the report), each a property of the schema
  and the instance, never a list of cases: ``format-annotation`` (core ``format.json`` string instances:
  the suite treats ``format`` as an annotation, fst asserts it), ``custom-metaschema`` (a root ``$schema``
  other than draft 2020-12's: fst ignores ``$schema``), ``format-subset`` (lower-case ``t`` / ``z``, leap
  seconds, > 9 fraction digits in date-time / time; quoted local parts, address literals, dotless domains
  in email; single-label or long-label hostnames, or ones whose top-level label is not letters),
  ``pattern-classes`` (``\\d \\w \\s \\D \\S . [^`` in a pattern vs. a character outside
  printable ASCII or one JSON escapes), ``number-spelling`` (an integral value written ``1.0`` / with an
  exponent / ``-0`` under integer type, bounds or multipleOf), ``enum-spelling`` (a value equal to an
  enum / const value but spelled differently), ``any-value-depth`` (a container deeper than
  ``ANY_VALUE_DEPTH`` where the schema leaves the shape free), ``extra-key`` (an undeclared key of an object
  with declared names and free extra keys: container value, escaped key, or a 3-character prefix shared
  with a declared name), ``surrogate-escape``;
* the regex (``re.fullmatch``) and the token-level matcher agree on every sampled instance.

Sample (token level): per suite file, the converted schemas in file order at positions 0, 3, 6, ... (at
least 60 schemas from at least 25 files); compiled with a 60 s budget (correctness, not speed: the served
4 s budget is measured by the benchmark).
"""

from __future__ import annotations

import re
import time

import pytest

from scripts.bench_json_schema_suite import load_suite, prepare_cases, smaller_language_rule
from vllm_fst_backend.compiler.constraints import json_schema_to_regex
from vllm_fst_backend.errors import (
    CompileBudgetError,
    EmptyLanguageError,
    InputTooLargeError,
    InvalidSchemaError,
    UnsupportedSchemaError,
)

NAMED = (UnsupportedSchemaError, InvalidSchemaError, EmptyLanguageError, InputTooLargeError, CompileBudgetError)
SAMPLE_STEP = 3
MIN_SAMPLE = 60


@pytest.fixture(scope="module")
def suite(smollm2_dir):
    cases = load_suite()
    prepare_cases(cases, smollm2_dir)
    return cases


@pytest.fixture(scope="module")
def converted(suite):
    """cid -> regex for every converted schema; cid -> exception for the refused ones."""
    regexes, refused = {}, {}
    for c in suite:
        try:
            regexes[c.cid] = json_schema_to_regex(c.schema)
        except NAMED as e:
            refused[c.cid] = e
    return regexes, refused


def _describe(case, inst, extra: str = "") -> str:
    return f"{case.cid} ({case.description}): {inst.description}: {inst.text}{extra}"


def test_suite_is_vendored(suite):
    files = {c.file for c in suite}
    assert len(suite) >= 300 and len(files) >= 40, (len(suite), len(files))
    assert all(c.instances for c in suite)


def test_every_schema_converts_or_refuses_by_name(suite, converted):
    regexes, refused = converted
    assert len(regexes) + len(refused) == len(suite)  # anything else raised out of the fixture
    for c in suite:
        e = refused.get(c.cid)
        if isinstance(e, EmptyLanguageError):
            valid = [i for i in c.instances if i.valid]
            assert not valid, f"{c.cid}: refused as empty but the suite has valid instances: {valid[0].text}"
        if isinstance(e, UnsupportedSchemaError):
            assert e.keyword, f"{c.cid}: UnsupportedSchemaError without a keyword: {e}"
    assert len(regexes) >= 150, len(regexes)  # the converter covers a good part of the suite


def test_regex_level_never_larger_and_complete(suite, converted):
    regexes, _ = converted
    bad, missed = [], []
    for c in suite:
        regex = regexes.get(c.cid)
        if regex is None:
            continue
        pattern = re.compile(regex)
        for inst in c.instances:
            ok = pattern.fullmatch(inst.text) is not None
            if ok and not inst.valid:
                bad.append(_describe(c, inst))
            elif not ok and inst.valid and smaller_language_rule(c, inst) is None:
                missed.append(_describe(c, inst))
    assert not bad, "invalid instances matched by the converted regex:\n" + "\n".join(bad)
    assert not missed, "valid instances rejected outside the documented smaller language:\n" + "\n".join(missed)


def _sample(suite, regexes) -> list:
    by_file: dict[str, list] = {}
    for c in suite:
        if c.cid in regexes:
            by_file.setdefault(c.file, []).append(c)
    return [c for cases in by_file.values() for c in cases[::SAMPLE_STEP]]


@pytest.mark.slow
def test_token_level_sample(suite, converted, built_artifacts, smollm2_dir):
    from vllm_fst_backend.artifacts.store import load_artifacts
    from vllm_fst_backend.compiler import CompileBudgets, CompileOptions, compile_regex, prepare
    from vllm_fst_backend.runtime import FstMatcher

    regexes, _ = converted
    sample = _sample(suite, regexes)
    assert len(sample) >= MIN_SAMPLE and len({c.file for c in sample}) >= 25, (len(sample), len({c.file for c in sample}))
    arts = load_artifacts(built_artifacts("smollm2", canonical=True), tokenizer_path=smollm2_dir)
    prepare(arts, canonical=True)
    opts, budgets = CompileOptions(canonical=True), CompileBudgets(time_budget_s=60.0)
    bad, missed, disagree = [], [], []
    n_inst = 0
    t0 = time.perf_counter()
    for c in sample:
        regex = regexes[c.cid]
        compiled = compile_regex(regex, arts, opts, budgets=budgets)
        pattern = re.compile(regex)
        for inst in c.instances:
            n_inst += 1
            m = FstMatcher(compiled)
            ok = all(m.accept_tokens("t", [t]) for t in inst.ids)
            ok = ok and m.accept_tokens("t", [m.eos_ids[0]]) and m.is_terminated()
            if ok != (pattern.fullmatch(inst.text) is not None):
                disagree.append(_describe(c, inst, f" (matcher {ok}, regex {not ok})"))
            if ok and not inst.valid:
                bad.append(_describe(c, inst, f" ids {inst.ids}"))
            elif not ok and inst.valid and smaller_language_rule(c, inst) is None:
                missed.append(_describe(c, inst, f" ids {inst.ids}"))
    print(f"{len(sample)} schemas, {n_inst} instances, {time.perf_counter() - t0:.1f} s")
    assert not bad, "invalid instances accepted token by token:\n" + "\n".join(bad)
    assert not disagree, "regex and token-level matcher disagree:\n" + "\n".join(disagree)
    assert not missed, "valid instances rejected outside the documented smaller language:\n" + "\n".join(missed)
