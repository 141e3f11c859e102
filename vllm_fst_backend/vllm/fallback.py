"""Requests fst cannot express -- ``grammar`` (EBNF/Lark), ``structural_tag``, JSON schemas the converter
refuses with ``UnsupportedSchemaError``, constraints whose compile goes over a budget -- served by a backend built into vLLM, owned by ``FstBackend``
(vLLM 0.33 allows one backend per engine, so the fallback lives inside fst's own backend).

``$VLLM_FST_FALLBACK``: ``auto`` (default: vLLM's own choice between xgrammar and guidance, made by
vLLM's validation in the API server), ``xgrammar``, ``guidance``, or ``none`` (such requests are an
HTTP 400, as before). Routing: the API server's validation sets ``structured_outputs._backend`` to the
built-in backend's name (vLLM's own validation of that backend sets it); the engine's ``FstBackend``
hands every request whose ``_backend`` is not ``fst`` to :class:`FallbackBackends` (vLLM 0.33: the engine's
``grammar_init`` wrap first moves the built-in name to ``_fst_fallback`` and sets ``_backend`` to ``fst``,
``backend.adopt_fallback_route``, since 0.33 allows one backend per engine).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterable

from vllm_fst_backend.errors import CompileBudgetError, InvalidOptionError, UnsupportedSchemaError

from .metrics import logger, metric_inc

FALLBACK_ENV = "VLLM_FST_FALLBACK"
FALLBACK_SETTINGS = ("auto", "xgrammar", "guidance", "none")
DEFAULT_FALLBACK = "auto"
# Constraint kinds fst never expresses (not regular languages in general).
FALLBACK_KINDS = frozenset({"GRAMMAR", "STRUCTURAL_TAG"})
# vLLM 0.32's / 0.33's built-in backends (lm-format-enforcer: deprecated in 0.33), by the name vLLM's validation writes into ``_backend``.
BUILTIN_BACKENDS = ("xgrammar", "guidance", "outlines", "lm-format-enforcer")


def fallback_setting() -> str:
    """``$VLLM_FST_FALLBACK`` (lower-cased; default ``auto``).

    Raises:
        InvalidOptionError: not one of :data:`FALLBACK_SETTINGS` (a server misconfiguration).
    """
    raw = os.environ.get(FALLBACK_ENV, "").strip().lower() or DEFAULT_FALLBACK
    if raw not in FALLBACK_SETTINGS:
        raise InvalidOptionError(f"{FALLBACK_ENV} must be one of {', '.join(FALLBACK_SETTINGS)}, got {raw!r}")
    return raw


def needs_fallback(kind: str, error: BaseException | None = None) -> bool:
    """Whether a constraint of ``kind`` (``StructuredOutputOptions`` name) goes to the fallback:
    ``grammar`` / ``structural_tag`` always; a JSON schema whose conversion raised
    ``UnsupportedSchemaError``; any constraint whose compile went over a budget (``CompileBudgetError``:
    time, memory, states, positions -- a request another backend may still answer). Input-size errors
    (``InputTooLargeError``) and bad constraints never do (they are a 400)."""
    return kind.upper() in FALLBACK_KINDS or isinstance(error, (UnsupportedSchemaError, CompileBudgetError))


def fallback_reason(kind: str, error: BaseException | None = None) -> str:
    """Human-readable reason (log lines, 400 messages with ``none``)."""
    if kind.upper() in FALLBACK_KINDS:
        return f"structured_outputs.{kind.lower()} is not expressible by fst"
    if isinstance(error, CompileBudgetError):
        return f"the {kind.lower()} constraint is over fst's compile budget: {error}"
    return f"JSON schema not expressible by fst: {error}"


def count_fallback(kind: str, backend: str, where: str) -> None:
    """Log and count a request routed to the fallback (``vllm_fst_fallback_requests_total{kind=...}``)."""
    metric_inc("fallback", 1.0, kind=kind.lower())
    logger.info("fst: %s request served by the fallback backend %s (%s)", kind.lower(), backend, where)


class _TailClearedGrammar:
    """A fallback grammar whose ``fill_bitmask`` also clears the words past the tokenizer's vocabulary
    (the bitmask is allocated by ``FstBackend`` for the model's padded vocabulary; llguidance only
    writes the words of its own vocabulary, so a row could keep bits of an earlier request)."""

    def __init__(self, inner: Any, token_words: int):
        self._inner = inner
        self._token_words = token_words

    def fill_bitmask(self, bitmask: Any, idx: int) -> None:
        self._inner.fill_bitmask(bitmask, idx)
        if bitmask.shape[1] > self._token_words:
            bitmask[idx, self._token_words :] = 0

    def __getattr__(self, name: str) -> Any:  # accept_tokens, validate_tokens, rollback, ...
        return getattr(self._inner, name)


class FallbackBackends:
    """vLLM's built-in backends, created lazily by name (thread-safe) and owned by ``FstBackend``.

    Args:
        vllm_config, tokenizer, vocab_size: as given to ``FstBackend`` by vLLM (``vocab_size``: the
            model's, possibly padded, vocabulary).
        token_words: int32 words of the tokenizer's vocabulary (``ceil(V / 32)``) or None.
    """

    def __init__(self, vllm_config: Any, tokenizer: Any, vocab_size: int, token_words: int | None = None):
        self.vllm_config = vllm_config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.token_words = token_words
        self._backends: dict[str, Any] = {}
        self._lock = threading.Lock()

    def default_name(self) -> str:
        """Built-in backend for a request that reached the engine without the API server's routing
        (e.g. a JSON schema refused only by the engine's conversion).

        Raises:
            InvalidOptionError: ``VLLM_FST_FALLBACK=none`` (or invalid).
        """
        setting = fallback_setting()
        if setting == "none":
            raise InvalidOptionError(f"no fallback backend ({FALLBACK_ENV}=none)")
        return "xgrammar" if setting == "auto" else setting

    def get(self, name: str) -> Any:
        """The built-in backend ``name`` (one of :data:`BUILTIN_BACKENDS`), created on first use.

        Raises:
            InvalidOptionError: unknown name.
        """
        with self._lock:
            be = self._backends.get(name)
            if be is None:
                be = self._backends[name] = self._create(name)
                logger.info("fst: fallback backend %s created", name)
            return be

    def _create(self, name: str) -> Any:
        kw = dict(tokenizer=self.tokenizer, vocab_size=self.vocab_size)
        if name == "xgrammar":
            from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

            return XgrammarBackend(self.vllm_config, **kw)
        if name == "guidance":
            from vllm.v1.structured_output.backend_guidance import GuidanceBackend

            return GuidanceBackend(self.vllm_config, **kw)
        if name == "outlines":
            from vllm.v1.structured_output.backend_outlines import OutlinesBackend

            return OutlinesBackend(self.vllm_config, **kw)
        if name == "lm-format-enforcer":
            from vllm.v1.structured_output.backend_lm_format_enforcer import LMFormatEnforcerBackend

            return LMFormatEnforcerBackend(self.vllm_config, **kw)
        raise InvalidOptionError(f"unknown fallback backend {name!r}; known: {', '.join(BUILTIN_BACKENDS)}")

    def compile(self, name: str, request_type: Any, grammar_spec: str,
                stop_token_ids: Iterable[int] | None = None) -> Any:
        """Compile with the built-in backend ``name`` (its ``compile_grammar``); its errors propagate."""
        grammar = self.get(name).compile_grammar(request_type, grammar_spec, stop_token_ids=stop_token_ids)
        if self.token_words is not None and name == "guidance":
            return _TailClearedGrammar(grammar, self.token_words)
        return grammar

    def destroy(self) -> None:
        with self._lock:
            for be in self._backends.values():
                try:
                    be.destroy()
                except Exception:  # pragma: no cover
                    pass
            self._backends.clear()
