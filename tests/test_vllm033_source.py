"""The vLLM glue against vLLM 0.33.0's sources (no CPU build of 0.33 exists, so no server runs here).

Data: ``tests/data/vllm033/`` (regenerate with its ``extract.py`` from the 0.33.0 wheel; vLLM is
Apache-2.0, see the ``LICENSE`` there): a few whole modules, verbatim, and ``excerpts.json`` (verbatim
sources of the functions the plugin wraps or relies on, and the top-level names of every vLLM module
the plugin imports).

* Source checks (standard library only): every vLLM import of the plugin exists in 0.33, the wrapped
  functions keep the signatures our wrappers call, the 0.33 behaviours the port relies on are there,
  and the touch points the port did *not* change are AST-identical to the installed 0.32.
* Behaviour checks: 0.33's ``StructuredOutputManager`` (and its request/utils modules, and
  ``create_error_response``), imported from the vendored files against the installed vLLM 0.32 (their
  imports all exist there), run with the plugin's patches and fake compiler stages: ``backend_name``,
  the one-backend-per-engine check with fallback requests, the fixed ``K + 1``-row bitmask blocks down
  to 0.33's ``apply_grammar_bitmask``, and the reasoning-end mask.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import json
import re
import sys
import types
from pathlib import Path

import pytest

import vllm_fst_backend.vllm as fstv

DATA = Path(__file__).resolve().parent / "data" / "vllm033"
REPO = Path(__file__).resolve().parent.parent
EXCERPTS = json.loads((DATA / "excerpts.json").read_text(encoding="utf-8"))

needs_vllm = pytest.mark.skipif(not fstv.VLLM_VERSION_OK, reason="needs an installed vLLM 0.32.x or 0.33.x")


def _load_extract():
    spec = importlib.util.spec_from_file_location("_vllm033_extract", DATA / "extract.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EXTRACT = _load_extract()


def excerpt(path: str, qualname: str) -> str:
    for e in EXCERPTS["excerpts"]:
        if e["path"] == path and e["qualname"] == qualname:
            return e["source"]
    raise KeyError(f"{path}::{qualname} not in excerpts.json (add it to extract.py and regenerate)")


def vendored(path: str) -> str:
    return (DATA / path).read_text(encoding="utf-8")


def def_node(source: str, qualname: str | None = None) -> ast.AST:
    """The def/class of an excerpt (its only top-level statement) or ``qualname`` in a whole file."""
    tree = ast.parse(source)
    if qualname is None:
        assert len(tree.body) == 1
        return tree.body[0]
    return dict(EXTRACT._qualname_nodes(tree))[qualname]


def params(node: ast.AST) -> list[str]:
    """``name`` / ``name=default`` of each parameter, ``*args`` / ``**kw`` included."""
    a = node.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    out = [p.arg + ("" if d is None else "=" + ast.unparse(d)) for p, d in zip(pos, defaults)]
    if a.vararg:
        out.append("*" + a.vararg.arg)
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append(p.arg + ("" if d is None else "=" + ast.unparse(d)))
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return out


# ------------------------------------------------------------------------------------------------
# Source checks
# ------------------------------------------------------------------------------------------------


def test_vendored_files_are_the_033_release():
    assert EXCERPTS["vllm_version"] == "0.33.0"
    for path in EXTRACT.WHOLE_FILES:
        assert hashlib.sha256(vendored(path).encode()).hexdigest() == EXCERPTS["file_sha256"][path], path
    assert "Apache License" in (DATA / "LICENSE").read_text()


def test_033_is_a_supported_version_and_the_gpu_extra_allows_it():
    assert fstv.vllm_series("0.33.0") == "0.33" and fstv.vllm_series("0.33.1.dev4+gabc") == "0.33"
    assert fstv.vllm_series("0.32.0+cpu") == "0.32" and fstv.vllm_series("unknown") is None
    assert {"0.32", "0.33"} <= set(fstv.SUPPORTED_VLLM_VERSIONS)
    assert fstv.vllm_series("0.34.0") not in fstv.SUPPORTED_VLLM_VERSIONS
    assert fstv.vllm_series("0.31.2") not in fstv.SUPPORTED_VLLM_VERSIONS
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (gpu,) = extras["gpu"]
    assert re.fullmatch(r"vllm\s*>=\s*0\.32\.0\s*,\s*<\s*0\.34", gpu), gpu
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover
        return
    spec = Requirement(gpu).specifier
    assert "0.33.0" in spec and "0.32.0" in spec and "0.33.9" in spec and "0.34.0" not in spec


def test_every_vllm_import_of_the_plugin_exists_in_033():
    recorded = EXCERPTS["modules"]
    for module, names in EXTRACT.plugin_vllm_imports().items():
        assert module in recorded, f"{module}: new vLLM import; rerun tests/data/vllm033/extract.py"
        entry = recorded[module]
        assert entry["path"] is not None, f"{module} does not exist in vLLM 0.33"
        known = set(entry["names"]) | set(entry["lazy"]) | set(entry.get("submodules", ()))
        missing = [n for n in names if n not in known]
        assert not missing, f"{module}: {missing} not defined in vLLM 0.33"
    assert "__version__" in recorded["vllm"]["names"]  # the version check reads vllm.__version__


def test_wrapped_functions_keep_the_signatures_our_wrappers_call():
    cases = {
        ("vllm/sampling_params.py", "SamplingParams._validate_structured_outputs"):
            ["self", "model_config", "structured_outputs_config", "tokenizer"],
        ("vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest.extract_structured_outputs"):
            ["self"],
        ("vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest.extract_structured_outputs"):
            ["self"],
        ("vllm/entrypoints/openai/chat_completion/serving.py", "OpenAIServingChat.create_chat_completion"):
            ["self", "request", "raw_request=None"],
        ("vllm/entrypoints/openai/completion/serving.py", "OpenAIServingCompletion.create_completion"):
            ["self", "request", "raw_request=None"],
        ("vllm/entrypoints/generate/beam_search/offline.py",
         "BeamSearchOfflineMixin._init_beam_search_structured_output"): ["self", "structured_outputs", "tokenizer"],
        ("vllm/v1/sample/rejection_sampler.py", "expand_batch_to_tokens"):
            ["x", "cu_num_tokens", "num_tokens", "replace_from=0", "replace_to=0"],
        ("vllm/v1/core/sched/scheduler.py", "Scheduler._handle_blocked_waiting_request"): ["self", "request"],
        ("vllm/v1/core/sched/scheduler.py", "Scheduler._reserve_prefill_lookahead"):
            ["self", "request", "num_computed_tokens", "num_new_tokens"],
    }
    for (path, qualname), expected in cases.items():
        assert params(def_node(excerpt(path, qualname))) == expected, qualname
    for qualname in ("OpenAIServingChat.create_chat_completion", "OpenAIServingCompletion.create_completion"):
        path = next(e["path"] for e in EXCERPTS["excerpts"] if e["qualname"] == qualname)
        assert isinstance(def_node(excerpt(path, qualname)), ast.AsyncFunctionDef)  # our wrapper is async
    init = def_node(excerpt("vllm/v1/engine/input_processor.py", "InputProcessor.__init__"))
    assert params(init)[:2] == ["self", "vllm_config"]
    assert "self.model_config = model_config" in excerpt("vllm/entrypoints/serve/engine/serving.py",
                                                          "BaseServing.__init__")  # the precheck reads it
    mgr = vendored("vllm/v1/structured_output/__init__.py")
    assert params(def_node(mgr, "StructuredOutputManager.__init__")) == ["self", "vllm_config"]
    assert params(def_node(mgr, "StructuredOutputManager.grammar_init")) == ["self", "request"]
    assert params(def_node(mgr, "StructuredOutputManager._create_grammar")) == ["self", "request"]
    err = def_node(vendored("vllm/entrypoints/serve/exception_handling/error_response.py"), "create_error_response")
    assert params(err)[0] == "message"
    # The config Literal patch: the module alias and the dataclass field are still what we extend.
    so_cfg = vendored("vllm/config/structured_outputs.py")
    assert re.search(r"^StructuredOutputsBackend = Literal\[", so_cfg, re.M)
    assert "backend: StructuredOutputsBackend = " in so_cfg
    # The beam-search wrap stops on the same name field.
    assert "structured_outputs._backend" in excerpt("vllm/entrypoints/generate/beam_search/offline.py",
                                                    "BeamSearchOfflineMixin._init_beam_search_structured_output")


def test_033_manager_is_the_one_backend_per_engine_version():
    """What the port relies on in 0.33's manager (it fails if a later vendored copy drops them)."""
    mgr = vendored("vllm/v1/structured_output/__init__.py")
    init = ast.unparse(def_node(mgr, "StructuredOutputManager.__init__"))
    assert "self.backend_name: str | None = None" in init
    gi = ast.unparse(def_node(mgr, "StructuredOutputManager.grammar_init"))
    assert "request_backend = structured_outputs._backend" in gi
    assert "self.backend_name is not None and request_backend != self.backend_name" in gi
    assert "only supports one backend per engine" in gi and "VLLMValidationError" in gi
    assert "self.backend_name = request_backend" in gi  # only where vLLM itself creates the backend
    create = ast.unparse(def_node(mgr, "StructuredOutputManager._create_grammar"))
    assert "self.backend.compile_grammar(request_type, grammar_spec, stop_token_ids=stop_token_ids)" in create
    bm = ast.unparse(def_node(mgr, "StructuredOutputManager.grammar_bitmask"))
    assert "mask_stride" in bm and "allocate_token_bitmask(max_batch_size * (1 + max_num_spec_tokens))" in bm
    masked = ast.unparse(def_node(mgr, "StructuredOutputManager._masked_reasoning_ends"))
    assert "grammar.validate_tokens([token_id])" in masked
    utils = ast.unparse(def_node(vendored("vllm/v1/structured_output/utils.py"), "apply_grammar_bitmask"))
    assert "mask_stride = grammar_bitmask.shape[0] // len(" in utils


def test_033_engine_side_compile_errors_are_400s():
    sched = excerpt("vllm/v1/core/sched/scheduler.py", "Scheduler._handle_blocked_waiting_request")
    assert 'code="validation_error"' in sched and "Invalid structured outputs" in sched
    req_err = excerpt("vllm/outputs.py", "RequestError")
    assert 'if self.code == "validation_error":' in req_err and "return VLLMValidationError(self.message)" in req_err
    core = next(x for x in EXCERPTS["lines"] if x["path"] == "vllm/v1/engine/core.py")["lines"]
    assert "except VLLMValidationError as e:" in core  # grammar_init's refusal: a 400, not a crash
    assert "self.structured_output_manager.grammar_init(req)" in excerpt(
        "vllm/v1/engine/core.py", "EngineCore.preprocess_add_request")
    # GracefulHTTPError (our FstServerError) still passes AsyncLLM.generate unchanged.
    lines = next(x for x in EXCERPTS["lines"] if x["path"] == "vllm/v1/engine/async_llm.py")["lines"]
    assert any("GracefulHTTPError" in ln for ln in lines)


def test_033_custom_class_proposer_path():
    ccp = vendored("vllm/v1/spec_decode/custom_class_proposer.py")
    assert "instance = user_class(vllm_config)" in ccp  # FstForcedTokenProposer(vllm_config)
    lines = next(x for x in EXCERPTS["lines"] if x["path"] == "vllm/v1/worker/gpu_model_runner.py")["lines"]
    assert "self.drafter = create_custom_proposer(  # type: ignore[assignment]" in lines
    # The only call of propose() for custom_class, and that our proposer accepts it.
    prop = def_node(excerpt("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner.propose_draft_token_ids"))
    calls = [c for c in ast.walk(prop) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
             and c.func.attr == "propose" and "self.drafter" in ast.unparse(c.func)
             and "cast(Any" in ast.unparse(c.func)]
    assert len(calls) == 1
    call = calls[0]
    assert [ast.unparse(a) for a in call.args] == [
        "sampled_token_ids", "self.input_batch.num_tokens_no_spec", "self.input_batch.token_ids_cpu"]
    assert [k.arg for k in call.keywords] == ["slot_mappings"]
    from vllm_fst_backend.vllm.proposer import FstForcedTokenProposer

    inspect.signature(FstForcedTokenProposer.propose).bind(object(), [[1]], None, None, slot_mappings=None)
    # The proposer reaches requests through the runner it is bound to (our wrap of this method).
    state = excerpt("vllm/v1/worker/gpu_input_batch.py", "CachedRequestState")
    assert "sampling_params: SamplingParams | None" in state and "output_token_ids: list[int]" in state
    assert "def req_ids(self) -> list[str]:" in excerpt("vllm/v1/worker/gpu_input_batch.py", "InputBatch.req_ids")
    assert "self.drafter.load_model(self.model)" in excerpt("vllm/v1/worker/cpu_model_runner.py",
                                                            "CPUModelRunner.load_model")
    # custom_class keeps the V1 model runner (the one with propose_draft_token_ids) in 0.33.
    v2 = def_node(excerpt("vllm/config/vllm.py", "VllmConfig._get_v2_model_runner_unsupported_features"))
    assert any(isinstance(t, ast.Tuple) and "custom_class" in [getattr(e, "value", None) for e in t.elts]
               for t in ast.walk(v2))


def test_033_rejection_sampler_cpu_workaround_still_applies():
    """``patch_cpu_expand`` replaces the module global ``expand_batch_to_tokens``; 0.33 still calls it by
    that name for temperature / top-p, and the CPU kernel it calls still hands the C++ op a copy."""
    constraints = def_node(excerpt("vllm/v1/sample/rejection_sampler.py", "apply_sampling_constraints"))
    callees = [ast.unparse(c.func) for c in ast.walk(constraints) if isinstance(c, ast.Call)]
    assert callees.count("expand_batch_to_tokens") >= 2
    assert "_ensure_int64(output)" in excerpt("vllm/utils/cpu_triton_utils.py", "_expand_kernel_impl")
    # patch_cpu_recovered replaces the module global sample_recovered_tokens (unchanged in 0.33, listed
    # below), which 0.33's rejection_sample still calls by that name
    sample = def_node(excerpt("vllm/v1/sample/rejection_sampler.py", "rejection_sample"))
    assert [ast.unparse(c.func) for c in ast.walk(sample) if isinstance(c, ast.Call)].count("sample_recovered_tokens") == 1


# Touch points the 0.33 port leaves as they are because 0.33 did not change them.
UNCHANGED_IN_033 = [
    ("vllm/sampling_params.py", "StructuredOutputsParams"),
    ("vllm/sampling_params.py", "SamplingParams._validate_structured_outputs"),
    ("vllm/v1/engine/input_processor.py", "InputProcessor.__init__"),
    ("vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest.extract_structured_outputs"),
    ("vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest.extract_structured_outputs"),
    ("vllm/entrypoints/openai/chat_completion/serving.py", "OpenAIServingChat.create_chat_completion"),
    ("vllm/entrypoints/openai/completion/serving.py", "OpenAIServingCompletion.create_completion"),
    ("vllm/entrypoints/serve/engine/serving.py", "BaseServing.__init__"),
    ("vllm/entrypoints/generate/beam_search/offline.py", "BeamSearchOfflineMixin._init_beam_search_structured_output"),
    ("vllm/v1/sample/rejection_sampler.py", "expand_batch_to_tokens"),
    ("vllm/v1/sample/rejection_sampler.py", "apply_sampling_constraints"),
    ("vllm/v1/sample/rejection_sampler.py", "sample_recovered_tokens"),
    ("vllm/v1/sample/rejection_sampler.py", "_sample_recovered_tokens"),
    ("vllm/utils/cpu_triton_utils.py", "_expand_kernel_impl"),
    ("vllm/v1/worker/cpu_model_runner.py", "CPUModelRunner.load_model"),
    ("vllm/v1/worker/gpu_input_batch.py", "CachedRequestState"),
    ("vllm/v1/worker/gpu_input_batch.py", "InputBatch.req_ids"),
    ("vllm/exceptions.py", "VLLMValidationError"),
    ("vllm/exceptions.py", "GracefulHTTPError"),
    ("vllm/plugins/__init__.py", "load_general_plugins"),
    ("vllm/v1/structured_output/backend_types.py", None),  # whole file
    ("vllm/v1/spec_decode/custom_class_proposer.py", None),
]


def _installed_032_root() -> Path:
    if fstv.VLLM_SERIES != "0.32":
        pytest.skip("compares with an installed vLLM 0.32")
    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parent.parent


def test_unchanged_touch_points_are_identical_to_installed_032():
    root = _installed_032_root()
    for path, qualname in UNCHANGED_IN_033:
        old_text = (root / path).read_text(encoding="utf-8")
        if qualname is None:
            assert ast.dump(ast.parse(old_text)) == ast.dump(ast.parse(vendored(path))), path
            continue
        old = dict(EXTRACT._qualname_nodes(ast.parse(old_text)))[qualname]
        old_src = EXTRACT._source_of(old_text, old)
        assert ast.dump(ast.parse(old_src)) == ast.dump(ast.parse(excerpt(path, qualname))), qualname
    # and the manager did change (this test would not notice a wrong vendored copy otherwise)
    old_mgr = (root / "vllm/v1/structured_output/__init__.py").read_text()
    assert "backend_name" not in old_mgr and "backend_name" in vendored("vllm/v1/structured_output/__init__.py")


# ------------------------------------------------------------------------------------------------
# Behaviour: 0.33's manager with the plugin's patches (fake compiler stages)
# ------------------------------------------------------------------------------------------------

V = 40  # fake vocabulary: token t < 26 spells chr(ord('a') + t); 39 = EOS
EOS = 39
VOCAB = 64  # the model's (padded) vocabulary: 2 int32 words


class FakeCompiled:
    """``[a-z]+`` literals -> a chain of tokens then EOS; anything else -> any letter, any length."""

    def __init__(self, regex: str):
        self.chain = [ord(c) - ord("a") for c in regex] if re.fullmatch(r"[a-z]+", regex) else None

    def allowed(self, state: int) -> set[int]:
        if self.chain is None:
            return set(range(26)) | {EOS}
        return {self.chain[state]} if state < len(self.chain) else {EOS}

    def next_state(self, state: int, token: int) -> int:
        if token not in self.allowed(state):
            return -1
        return -2 if token == EOS else (state + 1 if self.chain is not None else state)


class FakeMatcher:
    def __init__(self, compiled: FakeCompiled):
        self.c, self.history = compiled, [0]

    def accept_tokens(self, request_id, tokens):
        for t in tokens:
            n = self.c.next_state(self.history[-1], t) if self.history[-1] != -2 else -1
            if n == -1:
                return False
            self.history.append(n)
        return True

    def validate_tokens(self, tokens):
        s, ok = self.history[-1], []
        for t in tokens:
            n = self.c.next_state(s, t) if s != -2 else -1
            if n == -1:
                break
            ok.append(t)
            s = n
        return ok

    def rollback(self, n):
        del self.history[len(self.history) - n :]

    def fill_bitmask(self, bitmask, idx):
        import torch

        words = [0, 0]
        for t in self.c.allowed(self.history[-1]):
            words[t // 32] |= 1 << (t % 32)
        bitmask[idx, :2] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def is_terminated(self):
        return self.history[-1] == -2

    def reset(self):
        self.history = [0]

    def forced_tokens(self, max_n):
        return []


class FakeArtifacts:
    vocab_size = V
    eos_ids = (EOS,)
    fingerprint = "fake-tokenizer"


def bits(row) -> set[int]:
    return {32 * w + b for w, v in enumerate(list(row)) for b in range(32) if (int(v) & 0xFFFFFFFF) >> b & 1}


@pytest.fixture
def fake_stages(monkeypatch):
    from vllm_fst_backend.vllm import context

    monkeypatch.setenv("VLLM_FST_DISK_CACHE", "0")
    ctx = context.TokenizerContext(FakeArtifacts(), tokenizer_path="fake-tokenizer")
    monkeypatch.setattr(context, "compile_function", lambda regex, artifacts, options, budget_s: FakeCompiled(regex))
    monkeypatch.setattr(context, "matcher_factory", FakeMatcher)
    monkeypatch.setattr(context, "prepare_function", lambda artifacts: None)
    monkeypatch.setattr(context, "get_tokenizer_context", lambda model_config: ctx)
    return ctx


def _load_vendored(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, DATA / path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _undo_patches(owners) -> None:
    from vllm_fst_backend.vllm import patches

    keep = []
    for owner, attr, orig in reversed(patches._PATCHES):
        if any(owner is o for o in owners):
            setattr(owner, attr, orig)
        else:
            keep.append((owner, attr, orig))
    patches._PATCHES[:] = list(reversed(keep))


@pytest.fixture(scope="module")
def v033():
    """0.33's structured-output modules, the manager patched by ``patches._patch_manager``."""
    if not fstv.VLLM_VERSION_OK:
        pytest.skip("needs an installed vLLM 0.32.x or 0.33.x")
    from vllm_fst_backend.vllm import patches

    ns = types.SimpleNamespace(
        request=_load_vendored("_vllm033_so_request", "vllm/v1/structured_output/request.py"),
        manager=_load_vendored("_vllm033_so_manager", "vllm/v1/structured_output/__init__.py"),
        utils=_load_vendored("_vllm033_so_utils", "vllm/v1/structured_output/utils.py"),
    )
    ns.manager.cached_tokenizer_from_config = lambda model_config: None  # no tokenizer in these tests
    cls = ns.manager.StructuredOutputManager
    ns.orig_grammar_init = cls.grammar_init
    patches._patch_manager(cls)
    assert cls.grammar_init.__fst_wrapped__ and cls._create_grammar.__fst_wrapped__
    yield ns
    _undo_patches([cls])
    for name in ("_vllm033_so_request", "_vllm033_so_manager", "_vllm033_so_utils"):
        sys.modules.pop(name, None)


def _config(k=0, max_num_seqs=2, backend="fst"):
    return types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(distributed_executor_backend="external_launcher"),  # sync compile
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=types.SimpleNamespace(skip_tokenizer_init=False, get_vocab_size=lambda: VOCAB,
                                           is_diffusion=False, tokenizer="fake"),
        structured_outputs_config=types.SimpleNamespace(backend=backend, reasoning_parser="",
                                                        reasoning_parser_plugin="", enable_in_reasoning=False),
        speculative_config=types.SimpleNamespace(num_speculative_tokens=k, model=None) if k else None,
        num_speculative_tokens=k,
    )


def _request(v033, request_id="r1", backend="fst", extra_args=None, **so):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    sp = SamplingParams(structured_outputs=StructuredOutputsParams(**so), extra_args=extra_args)
    sp.structured_outputs._backend = backend  # as the API server's validation leaves it
    sp._all_stop_token_ids = {EOS}
    return types.SimpleNamespace(
        request_id=request_id,
        sampling_params=sp,
        structured_output_request=v033.request.StructuredOutputRequest.from_sampling_params(sp),
        use_structured_output=True,
        prompt_token_ids=[1, 2],
        all_token_ids=[1, 2],
    )


@pytest.fixture
def manager(v033, fake_stages):
    made = []

    def make(**kw):
        mgr = v033.manager.StructuredOutputManager(_config(**kw))
        made.append(mgr)
        return mgr

    yield make
    for mgr in made:
        mgr.clear_backend()


def test_033_manager_creates_fst_backend_with_backend_name(manager, v033):
    from vllm_fst_backend.vllm.backend import FstBackend, FstGrammar

    mgr = manager()
    assert isinstance(mgr.backend, FstBackend) and mgr.backend_name == "fst"
    req = _request(v033, regex="ab")
    mgr.grammar_init(req)
    assert isinstance(req.structured_output_request.grammar, FstGrammar)
    # not the fst backend: the patch leaves vLLM's own creation alone
    other = v033.manager.StructuredOutputManager(_config(backend="xgrammar"))
    assert other.backend is None and other.backend_name is None
    other.clear_backend()


def test_033_lazy_creation_also_sets_backend_name(manager, v033, monkeypatch):
    from vllm_fst_backend.vllm.backend import FstBackend
    from vllm_fst_backend.vllm.fallback import FallbackBackends

    mgr = manager()
    mgr.backend, mgr.backend_name = None, None  # as if the eager creation had not happened
    mgr.grammar_init(_request(v033, regex="ab"))
    assert isinstance(mgr.backend, FstBackend) and mgr.backend_name == "fst"
    # a fallback request first: still fst's engine (not vLLM's xgrammar latched for good)
    monkeypatch.setattr(FallbackBackends, "compile", lambda self, name, *a, **k: types.SimpleNamespace(name=name))
    mgr.backend, mgr.backend_name = None, None
    req = _request(v033, backend="xgrammar", grammar='root ::= "a"')
    mgr.grammar_init(req)
    assert isinstance(mgr.backend, FstBackend) and mgr.backend_name == "fst"
    assert req.structured_output_request.grammar.name == "xgrammar"


def test_033_unpatched_grammar_init_refuses_a_fallback_request(manager, v033):
    """The check the port works around is real: vLLM 0.33's own grammar_init, engine on fst."""
    from vllm.exceptions import VLLMValidationError

    mgr = manager()
    req = _request(v033, backend="xgrammar", grammar='root ::= "a"')
    with pytest.raises(VLLMValidationError, match="only supports one backend per engine"):
        v033.orig_grammar_init(mgr, req)


def test_033_fallback_requests_are_adopted_and_served_by_the_fallback(manager, v033, monkeypatch):
    from vllm_fst_backend.vllm import backend as vbackend
    from vllm_fst_backend.vllm.fallback import FallbackBackends

    calls = []

    def fake_compile(self, name, request_type, grammar_spec, stop_token_ids=None):
        calls.append((name, request_type.name, grammar_spec))
        return types.SimpleNamespace(name=name)

    monkeypatch.setattr(FallbackBackends, "compile", fake_compile)
    mgr = manager()
    req = _request(v033, backend="xgrammar", grammar='root ::= "a"')
    mgr.grammar_init(req)  # no "one backend per engine" refusal
    so = req.sampling_params.structured_outputs
    assert so._backend == "fst" and getattr(so, vbackend.FALLBACK_ROUTE_ATTR) == "xgrammar"
    assert calls == [("xgrammar", "GRAMMAR", 'root ::= "a"')]
    assert req.structured_output_request.grammar.name == "xgrammar"
    # a JSON schema the API server routed to guidance (auto) keeps its route; re-adoption is idempotent
    req2 = _request(v033, request_id="r2", backend="guidance", json={"type": "object"})
    mgr.grammar_init(req2)
    assert calls[-1][0] == "guidance" and vbackend.routed_backend(req2.sampling_params.structured_outputs) == "guidance"
    assert vbackend.adopt_fallback_route(req2.sampling_params.structured_outputs) == "guidance"
    # fst requests stay fst's
    req3 = _request(v033, request_id="r3", regex="ab")
    mgr.grammar_init(req3)
    assert len(calls) == 2 and isinstance(req3.structured_output_request.grammar, vbackend.FstGrammar)
    assert vbackend.routed_backend(req3.sampling_params.structured_outputs) is None


def _grammar_output(v033, mgr, requests, spec_tokens):
    ids = list(requests)
    arr = mgr.grammar_bitmask(requests, ids, spec_tokens).copy()  # a view of the reused buffer
    return arr, types.SimpleNamespace(grammar_bitmask=arr, structured_output_request_ids=ids)


def test_033_bitmask_blocks_of_k_plus_1_rows_down_to_the_logits(manager, v033):
    """K = 2, two fst requests: r1 with two drafts, r2 with none. 0.33 gives each a block of 3 rows
    (r2's rows 4, 5 unused); ``apply_grammar_bitmask`` maps them onto the logits of a batch in another
    order."""
    import numpy as np
    import torch

    mgr = manager(k=2, max_num_seqs=2)
    r1 = _request(v033, "r1", regex="abcd")
    r2 = _request(v033, "r2", regex="dc")
    for r in (r1, r2):
        mgr.grammar_init(r)
    spec = {"r1": [0, 1]}  # "a", "b" drafted
    arr, out = _grammar_output(v033, mgr, {"r1": r1, "r2": r2}, spec)
    assert arr.shape == (6, 2) and arr.dtype == np.int32  # 2 requests x (K + 1) rows, the whole buffer
    assert [bits(arr[i]) for i in range(4)] == [{0}, {1}, {2}, {3}]
    g1 = r1.structured_output_request.grammar
    assert g1.matcher.history == [0]  # drafts rolled back after the fill
    # one request of the two: the buffer is cut at 1 x (K + 1) rows
    arr1, _ = _grammar_output(v033, mgr, {"r2": r2}, {})
    assert arr1.shape == (3, 2) and bits(arr1[0]) == {3}

    pytest.importorskip("xgrammar")
    logits = torch.zeros((4, VOCAB), dtype=torch.float32)  # batch order: r2 (1 row), r1 (1 + 2 drafts)
    v033.utils.apply_grammar_bitmask(
        types.SimpleNamespace(scheduled_spec_decode_tokens=spec), out,
        types.SimpleNamespace(req_ids=["r2", "r1"]), logits,
    )
    allowed = [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]
    assert allowed == [{3}, {0}, {1}, {2}]


def test_033_reasoning_end_tokens_are_masked_via_validate_tokens(manager, v033):
    """While a request reasons, 0.33 masks the implicit reasoning-end tokens the grammar cannot start
    with, asking the (fresh) grammar ``validate_tokens([tok])``; the grammar must not advance."""

    class FakeReasoner(v033.manager.ParserEngineReasoningAdapter):
        implicit_reasoning_end_token_ids = {0, 5}  # "a" may start "ab", "f" may not
        reasoning_end_token_ids = ()

        def __init__(self, tokenizer=None, **kwargs):
            pass

        def is_reasoning_end(self, input_ids):
            return False

        def is_reasoning_end_streaming(self, input_ids, delta_ids):
            return False

    mgr = manager()
    mgr.reasoner_cls = FakeReasoner
    req = _request(v033, regex="ab")
    mgr.grammar_init(req)
    arr, _ = _grammar_output(v033, mgr, {"r1": req}, {})
    assert bits(arr[0]) == set(range(VOCAB)) - {5}
    assert req.structured_output_request.masked_reasoning_end_ids == (5,)
    assert req.structured_output_request.grammar.matcher.history == [0]


@needs_vllm
def test_033_config_literal_patch():
    from pydantic import TypeAdapter, ValidationError

    from vllm_fst_backend.vllm import patches

    so_mod = _load_vendored("_vllm033_config_so", "vllm/config/structured_outputs.py")
    cls = so_mod.StructuredOutputsConfig
    try:
        with pytest.raises(ValidationError):
            cls(backend="fst")
        patches._patch_config_literal(so_mod)
        assert cls(backend="fst").backend == "fst"
        assert TypeAdapter(cls).validate_json('{"backend": "fst"}').backend == "fst"
        assert "fst" in so_mod.StructuredOutputsBackend.__args__
        with pytest.raises(ValidationError):
            cls(backend="fsx")
    finally:
        _undo_patches([so_mod, cls, cls.__dataclass_fields__["backend"]])
        sys.modules.pop("_vllm033_config_so", None)


@needs_vllm
def test_033_error_response_keeps_fst_statuses_and_messages():
    """0.33's ``create_error_response`` (the precheck's 400s, the FstServerError 500 with its text)."""
    from vllm_fst_backend.vllm import validation

    mod = _load_vendored("vllm.entrypoints.serve.exception_handling._error_response_033",
                         "vllm/entrypoints/serve/exception_handling/error_response.py")
    try:
        err = mod.create_error_response(validation.validation_error("fst: bad regex", "structured_outputs"))
        assert err.error.code == 400 and "bad regex" in err.error.message
        err = mod.create_error_response(validation.server_error("fst backend unavailable: no artifacts"))
        assert err.error.code == 500 and "no artifacts" in err.error.message
    finally:
        sys.modules.pop("vllm.entrypoints.serve.exception_handling._error_response_033", None)


@needs_vllm
def test_033_scheduler_ends_a_failed_pending_grammar_with_a_request_error():
    """0.33 keeps ``grammar_compile_error_reqs`` as request id -> ``RequestError`` (0.32: a set); the
    prefill-while-compiling patch writes either. Its waiting branch still holds a request whose grammar
    is None (an unresolved future), so without the patch a pending grammar simply waits."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output.request import StructuredOutputRequest

    from vllm_fst_backend.vllm import pending

    blocked = excerpt("vllm/v1/core/sched/scheduler.py", "Scheduler._handle_blocked_waiting_request")
    assert "if not struct_output_req or struct_output_req.grammar is None:" in blocked
    assert "self.grammar_compile_error_reqs[request.request_id] = RequestError(" in blocked
    fstv.register()
    so = object.__new__(StructuredOutputRequest)
    fut = pending.PendingGrammar()
    so._grammar = fut
    fut.set_exception(pending.CompileRefused("refused"))
    req = types.SimpleNamespace(request_id="r", structured_output_request=so, num_tokens=50,
                                num_computed_tokens=0, status=None)
    sched = types.SimpleNamespace(num_prefill_lookahead=0, block_size=16, connector=None,
                                  need_mamba_block_aligned_split=False, grammar_compile_error_reqs={})
    assert Scheduler._reserve_prefill_lookahead(sched, req, 10, 5) == 0
    err = sched.grammar_compile_error_reqs["r"]
    assert err.code == "validation_error" and "refused" in err.message


def _lines(path: str, needle: str) -> list[str]:
    return next(x for x in EXCERPTS["lines"] if x["path"] == path and needle in x["pattern"])["lines"]


def test_033_keeps_what_the_first_sample_in_the_step_relies_on():
    """The first sample in the step (``patches._patch_scheduler``) on 0.33: the synchronous engine step
    still asks for the bitmask after handing the step to the model and before waiting for it; the
    bitmask leaves out prefill chunks (how a late request is left out); ``update_from_output`` gives a
    request with no sampled token no output and no grammar advance, and asserts that such a request has
    no prompt logprobs (why requests asking for them keep the old way); the scheduler sends each running
    request's ``num_output_tokens`` and the worker truncates its copy to it (how a dropped token leaves
    the worker); the config fields the gate reads exist; CPU forces synchronous scheduling; the drafts of
    a step reach the scheduler after its output, and a prefill chunk's are dropped."""
    step = excerpt("vllm/v1/engine/core.py", "EngineCore.step")
    dispatch = step.index("self.model_executor.execute_model(scheduler_output, non_block=True)")
    ask = step.index("self.scheduler.get_grammar_bitmask(scheduler_output)")
    assert dispatch < ask < step.index("future.result()") < step.index("self.scheduler.update_from_output(")
    bitmask = excerpt("vllm/v1/core/sched/scheduler.py", "Scheduler.get_grammar_bitmask")
    assert params(def_node(bitmask)) == ["self", "scheduler_output"]
    assert "and (req.use_structured_output and not req.is_prefill_chunk)" in bitmask
    update = excerpt("vllm/v1/core/sched/scheduler.py", "Scheduler.update_from_output")
    assert params(def_node(update)) == ["self", "scheduler_output", "model_runner_output"]
    for needle in ("sampled_token_ids[req_index] if sampled_token_ids else []",
                   "req_index = model_runner_output.req_id_to_index[req_id]",
                   "if new_token_ids and not self.structured_output_manager.accept_tokens(",
                   "new_token_ids or pooler_output is not None or stopped",
                   "assert not prompt_logprobs_tensors"):
        assert needle in update, needle
    sched = _lines("vllm/v1/core/sched/scheduler.py", "num_output_tokens")
    for needle in ("self.vllm_config = vllm_config", "self.scheduler_config = vllm_config.scheduler_config",
                   "self.parallel_config = vllm_config.parallel_config", "self.connector = None",
                   "num_output_tokens.append("):
        assert needle in sched, needle
    worker = _lines("vllm/v1/worker/gpu_model_runner.py", "num_output_tokens")
    assert worker == ["num_output_tokens = req_data.num_output_tokens[i]",
                      "elif num_output_tokens < len(req_state.output_token_ids):",
                      "del req_state.output_token_ids[num_output_tokens:]"]
    assert _lines("vllm/platforms/cpu.py", "async_scheduling") == ["scheduler_config.async_scheduling = False"]
    # with the forced-token proposer: the step's drafts come after update_from_output (post_step), and a
    # prefill chunk's are ignored (how the drafts of a dropped sample are)
    engine = excerpt("vllm/v1/engine/core.py", "EngineCoreProc._process_engine_step")
    assert engine.index("self.step_fn()") < engine.index("self.post_step(model_executed)")
    post = excerpt("vllm/v1/engine/core.py", "EngineCore.post_step")
    assert "self.scheduler.update_draft_token_ids(draft_token_ids)" in post and "not self.async_scheduling" in post
    drafts = excerpt("vllm/v1/core/sched/scheduler.py", "Scheduler.update_draft_token_ids")
    assert params(def_node(drafts)) == ["self", "draft_token_ids"]
    assert "if request.is_prefill_chunk:" in drafts and "request.spec_token_ids = []" in drafts


@pytest.mark.parametrize("drafts", [{}, {"b": 2, "c": 1}])
def test_033_cpu_mask_apply_keeps_vllms_row_layout(v033, drafts):
    """``patches._sorted_bitmask`` runs 0.33's own ``apply_grammar_bitmask`` (its bitmask has
    ``mask_stride`` rows per request, 1 + the most drafts any request may have): fst's CPU apply on what
    it records gives 0.33's logits, draft rows included."""
    import numpy as np
    import torch

    from fst_testlib import grammar_bitmask_step
    from vllm_fst_backend.runtime import logits_mask
    from vllm_fst_backend.vllm import patches

    rng = np.random.default_rng(5)
    sched, grammar, batch, logits = grammar_bitmask_step(rng, 700, ["a", "b", "c", "d", "e"], drafts, stride=3)
    want = logits.clone()
    v033.utils.apply_grammar_bitmask(sched, grammar, batch, want)
    bitmask, rows = patches._sorted_bitmask(v033.utils.apply_grammar_bitmask, sched, grammar, batch, logits.shape[0])
    got = logits.clone()
    logits_mask.apply_token_bitmask_inplace(got, bitmask, rows)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(got.view(torch.int16), logits.view(torch.int16))
    assert v033.utils.xgr is not None and not isinstance(v033.utils.xgr, patches._BitmaskRecorder)  # put back


def test_033_cpu_mask_apply_touch_points():
    """What ``patches._patch_cpu_mask_apply`` relies on in 0.33: the worker loads the plugins before it
    imports the worker class (so ``gpu_model_runner``'s ``from ... import apply_grammar_bitmask`` binds
    the wrapper), ``init_device`` has the worker's config, and the model runner calls the function."""
    init = excerpt("vllm/v1/worker/worker_base.py", "WorkerWrapperBase.init_worker")
    assert "load_general_plugins()" in init and "resolve_obj_by_qualname(" in init
    assert init.index("load_general_plugins()") < init.index("resolve_obj_by_qualname(")
    assert "self.vllm_config = vllm_config" in init
    assert "self.vllm_config" in excerpt("vllm/v1/worker/worker_base.py", "WorkerWrapperBase.init_device")
    assert _lines("vllm/v1/worker/gpu_model_runner.py", "apply_grammar_bitmask") == [
        "from vllm.v1.structured_output.utils import apply_grammar_bitmask", "apply_grammar_bitmask("]


def test_033_keeps_what_the_engine_core_sleeping_wait_relies_on():
    """``patches._patch_engine_waits`` on 0.33: the engine core builds its executor before the
    structured-output manager (whose start-up installs the patch); ``MultiprocExecutor.collective_rpc``
    (wrapped) reads the executor's ``response_mqs``, which hold the reply queues; each queue's reader has
    a ``SpinCondition`` whose ``wait`` busy-loops only within ``busy_loop_s`` of the last read and
    otherwise polls its notification socket (sleeps): the same ``wait`` as 0.32's (the installed source)."""
    import textwrap

    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    core = _lines("vllm/v1/engine/core.py", "model_executor")
    assert core.index("self.model_executor = executor_class(vllm_config)") < core.index(
        "self.structured_output_manager = StructuredOutputManager(vllm_config)")
    assert "self.response_mqs.append(local_message_queue)" in _lines("vllm/v1/executor/multiproc_executor.py",
                                                                      "response_mqs")
    assert "self._spin_condition = SpinCondition(" in _lines(
        "vllm/distributed/device_communicators/shm_broadcast.py", "_spin_condition")
    rpc = excerpt("vllm/v1/executor/multiproc_executor.py", "MultiprocExecutor.collective_rpc")
    assert "self.response_mqs" in rpc
    installed = getattr(MultiprocExecutor.collective_rpc, "__fst_original__", MultiprocExecutor.collective_rpc)
    assert params(def_node(rpc))[:2] == params(def_node(textwrap.dedent(inspect.getsource(installed))))[:2] == [
        "self", "method"]
    init = excerpt("vllm/distributed/device_communicators/shm_broadcast.py", "SpinCondition.__init__")
    assert "self.is_reader = is_reader" in init and "self.busy_loop_s = busy_loop_s" in init
    wait = excerpt("vllm/distributed/device_communicators/shm_broadcast.py", "SpinCondition.wait")
    assert ast.dump(def_node(wait)) == ast.dump(def_node(textwrap.dedent(inspect.getsource(
        shm_broadcast.SpinCondition.wait))))  # the same code as the installed 0.32's
    assert "self.last_read + self.busy_loop_s" in wait and "self.poller.poll(" in wait
