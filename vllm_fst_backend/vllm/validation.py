"""API-server checks of a request for the fst backend (``SamplingParams._validate_structured_outputs``
wrap): errors as ``VLLMValidationError`` (HTTP 400) or a 500 that keeps its message."""

from __future__ import annotations

from typing import Any

from vllm_fst_backend.errors import ArtifactError, FstBackendError, InvalidOptionError

from . import BACKEND_NAME
from . import context as _context
from .constraints import InvalidConstraintError, params_to_regex
from .metrics import logger, metric_inc
from .options import env_flag, parse_request_options


class GenericChecksDone(Exception):
    """Raised by :class:`_FstName` at vLLM's backend dispatch: the generic checks have all run."""


class _FstName(str):
    """Equal to ``"fst"``; ``startswith`` (first used by vLLM's dispatch) stops the original validator."""

    def startswith(self, *a, **k):  # type: ignore[override]
        raise GenericChecksDone()


class ConfigProxy:
    def __init__(self, cfg: Any):
        self._cfg = cfg

    @property
    def backend(self) -> str:
        return _FstName(BACKEND_NAME)

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
        raise validation_error(f"fst: {e}", parameter="vllm_xargs") from None
    so = getattr(params, "structured_outputs", None)
    if so is None:
        if options.jump or any(k.startswith("fst_") for k in (params.extra_args or {})):
            logger.debug("fst options given without a structured-output constraint: ignored")
        return
    try:
        kind, regex = params_to_regex(so)
    except InvalidConstraintError as e:
        raise validation_error(f"fst: {e}", parameter="structured_outputs") from None
    if options.jump:
        _warn_jump_without_proposer(model_config)
    if not env_flag("VLLM_FST_VALIDATE_COMPILE", True):
        return
    try:
        budget_s = _context.compile_budget_s("validate")
    except InvalidOptionError as e:  # the server's configuration, not the request
        raise server_error(f"fst backend misconfigured: {e}") from None
    try:
        ctx = _context.get_tokenizer_context(model_config)
        res = ctx.compile(regex, options, budget_s)
    except (ArtifactError, ImportError) as e:  # server-side problem: a 500 with the message, not a 400
        logger.error("fst: cannot compile request constraints: %s", e)
        raise server_error(f"fst backend unavailable: {e}") from None
    except FstBackendError as e:
        raise validation_error(f"fst: cannot compile the {kind.lower()} constraint: {e}", "structured_outputs") from None
    metric_inc("validated")
    if not res.cache_hit:
        logger.info("fst: validated %s constraint: compiled in %.1f ms", kind.lower(), res.ms)


_SPEC_WARNED = False


def _warn_jump_without_proposer(model_config: Any) -> None:
    global _SPEC_WARNED
    if _SPEC_WARNED:
        return
    spec = _context.SERVED.get("speculative_model")
    if spec is None or not str(spec).endswith("FstForcedTokenProposer"):
        _SPEC_WARNED = True
        logger.warning(
            "fst: a request asked for fst_jump but the server was not started with the forced-token "
            "proposer (--speculative-config '{\"method\": \"custom_class\", \"model\": "
            "\"vllm_fst_backend.vllm_plugin.FstForcedTokenProposer\", \"num_speculative_tokens\": N}'); "
            "decoding is correct but without jumps"
        )
