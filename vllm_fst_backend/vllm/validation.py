"""API-server checks of a request for the fst backend.

* :func:`validate_structured_outputs` -- the ``SamplingParams._validate_structured_outputs`` wrap (sync,
  often on the API server's event loop): cheap checks only (``fst_*`` options, input size limits,
  constraint kind), routes the request to fst or to the fallback (``fallback.py``).
* :func:`plan_precheck` / :func:`run_precheck` -- awaited by the chat/completion handlers
  (``patches._patch_serving_precheck``; beside the request's prefill for a new constraint, ``pending.py``):
  the compile check (JSON schema conversion + compile) in the isolated compile process, so that a bad
  constraint or an empty language is an HTTP 400 with the reason, and an unsupported schema or a
  constraint over fst's budget is routed to the fallback (a 400 with ``VLLM_FST_FALLBACK=none``). Its
  verdicts are remembered (:data:`PRECHECKS`) for the sync hook.

Errors: ``VLLMValidationError`` (HTTP 400) or :func:`server_error` (a 500 that keeps its message).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import threading
import time
from collections import OrderedDict
from typing import Any

from vllm_fst_backend.errors import (
    ArtifactError,
    CompileBudgetError,
    CompileServiceError,
    FstBackendError,
    InputTooLargeError,
    InvalidOptionError,
    UnsupportedSchemaError,
)

from . import BACKEND_NAME
from . import context as _context
from . import fallback, pending
from .constraints import InvalidConstraintError, check_input_limits, params_kind, whitespace_of
from .metrics import logger, metric_inc
from .options import env_flag, fst_keys, parse_request_options


class GenericChecksDone(Exception):
    """Raised by :class:`_FstName` at vLLM's backend dispatch: the generic checks have all run."""


class _FstName(str):
    """Equal to ``"fst"``; ``startswith`` (first used by vLLM's dispatch) stops the original validator."""

    def startswith(self, *a, **k):  # type: ignore[override]
        raise GenericChecksDone()


class ConfigProxy:
    """The served ``StructuredOutputsConfig`` with another ``backend``: ``"fst"`` (the original
    validator runs vLLM's generic checks and stops at its backend dispatch) or a built-in backend's
    name (the original validator runs that backend's validation, for fallback requests)."""

    def __init__(self, cfg: Any, backend: str = BACKEND_NAME):
        self._cfg = cfg
        self._backend = _FstName(BACKEND_NAME) if backend == BACKEND_NAME else backend

    @property
    def backend(self) -> str:
        return self._backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def server_error(message: str) -> Exception:
    """A 500 error whose message reaches the client. A plain ``VLLMServerError`` raised in the request
    path is re-raised by ``AsyncLLM.generate`` as ``EngineGenerateError()`` -- a 500 with an *empty*
    message (measured); ``GracefulHTTPError`` passes through unchanged and ``create_error_response``
    answers with its ``http_status`` and ``str(exc)``. Still a ``VLLMServerError`` (not a 400)."""
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError, VLLMServerError

    cls = type("FstServerError", (GracefulHTTPError, VLLMServerError), {})
    return cls(message, HTTPStatus.INTERNAL_SERVER_ERROR)


def validation_error(message: str, parameter: str | None = None) -> Exception:
    """``VLLMValidationError`` (HTTP 400 naming ``parameter``)."""
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message, parameter=parameter)


# ---- verdicts of the async precheck, read by the sync hook ---------------------------------------


class PrecheckResults:
    """Bounded LRU of precheck verdicts: key = SHA-256 of (kind, spec text, whitespace pattern,
    options) (32 bytes), value = ``None`` (fst serves it) or the ``UnsupportedSchemaError`` /
    ``CompileBudgetError`` that routes it to the fallback (a budget verdict is re-checked by the next
    precheck of the same constraint). At most ``max_entries`` entries (thread-safe)."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._data: OrderedDict[bytes, BaseException | None] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(kind: str, spec: Any, whitespace_pattern: str | None, options: Any) -> bytes:
        text = spec if isinstance(spec, str) else json.dumps(spec, ensure_ascii=False)
        h = hashlib.sha256()
        for part in (kind, text or "", whitespace_pattern or "", repr(options.cache_key)):
            h.update(part.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        return h.digest()

    def put(self, key: bytes, verdict: BaseException | None) -> None:
        with self._lock:
            self._data[key] = verdict
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def get(self, key: bytes) -> tuple[bool, BaseException | None]:
        """(found, verdict)."""
        with self._lock:
            if key not in self._data:
                return False, None
            self._data.move_to_end(key)
            return True, self._data[key]


PRECHECKS = PrecheckResults()


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# ---- the sync hook ----------------------------------------------------------------------------------


def validate_structured_outputs(params: Any, orig: Any, model_config: Any, so_config: Any, tokenizer: Any) -> None:
    """The wrapped ``SamplingParams._validate_structured_outputs`` for the served backend ``fst``:
    options, input limits and the route (fst or the fallback, whose own vLLM validation then runs);
    the compile check only when not on an event loop (offline ``LLM``) and not prechecked.

    Raises:
        VLLMValidationError: HTTP 400 with the fst message.
    """
    try:
        options = parse_request_options(getattr(params, "extra_args", None), getattr(params, "allowed_token_ids", None))
    except InvalidOptionError as e:
        raise validation_error(f"fst: {e}", parameter="vllm_xargs") from None
    so = params.structured_outputs
    if so is None:
        return
    try:
        kind, spec = params_kind(so)
        check_input_limits(kind, spec)
    except (InvalidConstraintError, InputTooLargeError) as e:
        raise validation_error(f"fst: {e}", parameter="structured_outputs") from None
    ws = whitespace_of(so)
    key = PrecheckResults.key(kind, spec, ws, options)
    found, verdict = PRECHECKS.get(key)
    if fallback.needs_fallback(kind, verdict):
        return _validate_fallback(params, orig, model_config, so_config, tokenizer, kind, verdict)
    try:
        orig(params, model_config, ConfigProxy(so_config), tokenizer)  # vLLM's generic checks
    except GenericChecksDone:
        pass
    so._backend = BACKEND_NAME
    _mark_pending(params, key)
    if options.jump:
        _warn_jump_without_proposer()
    if found or _on_event_loop() or not env_flag("VLLM_FST_VALIDATE_COMPILE", True):
        return  # prechecked, or the engine compiles (no compile on an event loop)
    verdict = check_in_process(kind, spec, ws, options, model_config)
    if verdict is not None:  # offline LLM: an unsupported schema routes here
        so._backend = None
        _validate_fallback(params, orig, model_config, so_config, tokenizer, kind, verdict)


def _mark_pending(params: Any, key: bytes) -> None:
    """Tell the engine that this API server is still compiling the request's constraint: the token of
    its marker (``pending.py``) goes into ``extra_args``, so that the engine waits for the automaton
    (and prefills meanwhile) instead of compiling it too."""
    markers = pending.markers() if pending.overlap_enabled() else None
    token = markers.token_for(key) if markers is not None else None
    if token is not None:
        extra = params.extra_args if isinstance(params.extra_args, dict) else {}
        params.extra_args = {**extra, pending.PENDING_ARG: token}


def _validate_fallback(params, orig, model_config, so_config, tokenizer, kind, error) -> None:
    setting = _fallback_setting()
    reason = fallback.fallback_reason(kind, error)
    if setting == "none":
        raise validation_error(f"fst: {reason} ({fallback.FALLBACK_ENV}=none): {_supported_text()}",
                               parameter="structured_outputs")
    keys = fst_keys(getattr(params, "extra_args", None))
    if keys:
        raise validation_error(
            f"fst: {', '.join(keys)} cannot apply: this request is served by the fallback backend ({reason})",
            parameter="vllm_xargs",
        )
    orig(params, model_config, ConfigProxy(so_config, setting), tokenizer)  # vLLM's own validation
    fallback.count_fallback(kind, params.structured_outputs._backend or setting, reason)


def _fallback_setting() -> str:
    try:
        return fallback.fallback_setting()
    except InvalidOptionError as e:  # the server's configuration, not the request
        raise server_error(f"fst backend misconfigured: {e}") from None


def _supported_text() -> str:
    from .constraints import SUPPORTED_TEXT

    return SUPPORTED_TEXT


def _compile_budget() -> float:
    try:
        return _context.compile_budget_s("validate")
    except InvalidOptionError as e:  # the server's configuration, not the request
        raise server_error(f"fst backend misconfigured: {e}") from None


def _raise_compile_error(kind: str, e: BaseException) -> None:
    if isinstance(e, (ArtifactError, CompileServiceError, ImportError)):  # server-side: a 500 with the message
        logger.error("fst: cannot check request constraints: %s", e)
        raise server_error(f"fst backend unavailable: {e}") from None
    raise validation_error(f"fst: cannot compile the {kind.lower()} constraint: {e}", "structured_outputs") from None


def check_in_process(kind: str, spec: Any, ws: str | None, options: Any, model_config: Any):
    """The compile check in this process (no event loop here: offline ``LLM``). Returns None (fst
    serves it) or the ``UnsupportedSchemaError`` that sends it to the fallback.

    Raises:
        VLLMValidationError: bad constraint, over a budget, empty language (HTTP 400).
    """
    budget_s = _compile_budget()
    try:
        _context.InProcessChecker(model_config).check(kind, spec, whitespace_pattern=ws, options=options,
                                                      budget_s=budget_s)
    except (UnsupportedSchemaError, CompileBudgetError) as e:
        return e
    except (FstBackendError, ImportError) as e:
        _raise_compile_error(kind, e)
    metric_inc("validated")
    return None


_SPEC_WARNED = False


def _warn_jump_without_proposer() -> None:
    global _SPEC_WARNED
    if _SPEC_WARNED:
        return
    spec = _context.SERVED.get("speculative_model")
    if not _context.is_jump_proposer(spec):
        _SPEC_WARNED = True
        logger.warning(
            "fst: a request asked for fst_jump but the server was not started with the forced-token "
            "proposer (--speculative-config '{\"method\": \"custom_class\", \"model\": "
            "\"vllm_fst_backend.vllm_plugin.FstForcedTokenProposer\", \"num_speculative_tokens\": N}'); "
            "decoding is correct but without jumps"
        )


# ---- the async precheck (chat / completion handlers) ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrecheckPlan:
    """What :func:`run_precheck` compiles for one request: the constraint and its :data:`PRECHECKS` key."""

    key: bytes
    kind: str
    spec: Any
    whitespace_pattern: str | None
    options: Any


def plan_precheck(request: Any) -> PrecheckPlan | None:
    """The compile check an OpenAI ``request`` (``ChatCompletionRequest`` / ``CompletionRequest``) needs
    before its constraint is served, or None: no constraint, the check is off
    (``VLLM_FST_VALIDATE_COMPILE=0``), a verdict is known (:data:`PRECHECKS`; a budget verdict is checked
    again: it depends on the load), or the sync hook answers the request by itself (bad options, over an
    input limit, grammar / structural_tag). Cheap: option parsing and a hash of the constraint."""
    so = request.extract_structured_outputs()
    if so is None or not env_flag("VLLM_FST_VALIDATE_COMPILE", True):
        return None
    try:
        options = parse_request_options(getattr(request, "vllm_xargs", None), getattr(request, "allowed_token_ids", None))
        kind, spec = params_kind(so)
        check_input_limits(kind, spec)
    except (FstBackendError, TypeError):
        return None  # the sync hook answers these (400) with vLLM's generic checks first
    if kind in fallback.FALLBACK_KINDS:
        return None
    ws = whitespace_of(so)
    key = PrecheckResults.key(kind, spec, ws, options)
    found, verdict = PRECHECKS.get(key)
    if found and not isinstance(verdict, CompileBudgetError):
        return None
    return PrecheckPlan(key, kind, spec, ws, options)


async def run_precheck(plan: PrecheckPlan, model_config: Any) -> bool:
    """JSON schema conversion + compile of ``plan`` in the isolated compile process (awaited off the event
    loop, :func:`context.get_checker`); the verdict goes to :data:`PRECHECKS`. Returns True when fst
    serves the constraint, False when it goes to the fallback (unsupported schema, over the budget).

    Raises:
        VLLMValidationError: bad constraint, empty language (HTTP 400).
        FstServerError: artifacts missing or the checker unavailable (HTTP 500 with the message).
    """
    budget_s = _compile_budget()
    t0 = time.monotonic()
    try:
        checker = await _context.run_off_loop(_context.get_checker, model_config)  # may start processes
        await checker.acheck(plan.kind, plan.spec, whitespace_pattern=plan.whitespace_pattern,
                             options=plan.options, budget_s=budget_s)
    except (UnsupportedSchemaError, CompileBudgetError) as e:
        PRECHECKS.put(plan.key, e)  # the sync hook routes it to the fallback (or answers 400 with "none")
        return False
    except (FstBackendError, ImportError) as e:
        _raise_compile_error(plan.kind, e)
    finally:
        metric_inc("precheck_seconds", time.monotonic() - t0)
    metric_inc("validated")
    PRECHECKS.put(plan.key, None)
    return True


def reset_route(request: Any) -> None:
    """Undo what a first pass through vLLM's validation wrote into an OpenAI request's
    ``structured_outputs`` (the backend it chose), so that the request can be submitted again and routed
    anew (to the fallback, after an overlapped check refused it for fst)."""
    so = getattr(request, "structured_outputs", None)
    if so is not None and hasattr(so, "_backend"):
        so._backend = None
        if hasattr(so, "_backend_was_auto"):
            so._backend_was_auto = False

