"""The vLLM contract: ``FstBackend`` (``StructuredOutputBackend``) and ``FstGrammar``
(``StructuredOutputGrammar``, over a ``runtime.matcher.FstMatcher``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from vllm_fst_backend.errors import ArtifactError, CompileBudgetError, InvalidOptionError, UnsupportedSchemaError

from . import BACKEND_NAME, VLLM_VERSION_OK
from . import context as _context
from .bitmask import set_bit, has_bit
from .constraints import constraint_to_regex, whitespace_of
from .fallback import FallbackBackends, needs_fallback
from .ignore_eos import EosAfterEndGrammar
from .metrics import logger, metric_inc
from .options import FstRequestOptions, parse_request_options

if VLLM_VERSION_OK:
    from vllm.v1.structured_output.backend_types import StructuredOutputBackend as _BackendBase
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar as _GrammarBase
else:  # pragma: no cover - wrong/missing vLLM: classes still defined, register() refuses
    _BackendBase = object
    _GrammarBase = object


# Where the engine keeps the built-in backend a request was routed to once vLLM 0.33's one-backend check
# has made its ``_backend`` "fst" (see :func:`adopt_fallback_route`).
FALLBACK_ROUTE_ATTR = "_fst_fallback"


def routed_backend(params: Any) -> str | None:
    """The built-in backend that serves a request (``StructuredOutputsParams``), or None for fst: the
    API server's route (vLLM's own validation of that backend wrote its name into ``_backend``), kept
    under :data:`FALLBACK_ROUTE_ATTR` once the engine adopted the request (vLLM 0.33)."""
    name = getattr(params, FALLBACK_ROUTE_ATTR, None) or getattr(params, "_backend", None)
    return None if name in (None, BACKEND_NAME) else name


def adopt_fallback_route(params: Any) -> str | None:
    """vLLM 0.33 (``StructuredOutputManager.grammar_init``: "only supports one backend per engine")
    refuses a request whose ``_backend`` differs from the engine's ``backend_name`` ("fst"). A request
    the API server routed to the fallback carries the built-in backend's name there; it is served by
    ``FstBackend`` all the same (its :class:`FallbackBackends`), so the engine moves that name to
    :data:`FALLBACK_ROUTE_ATTR` and sets ``_backend = "fst"``. Engine-side only (the params object is the
    engine's own copy); idempotent. Returns the fallback's name, or None for an fst request."""
    name = routed_backend(params)
    if name is not None:
        setattr(params, FALLBACK_ROUTE_ATTR, name)
        params._backend = BACKEND_NAME
    return name


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
        if self.extra_stop_ids and self.eos_ids and has_bit(bitmask, batch_index, self.eos_ids[0]):
            for t in self.extra_stop_ids:
                set_bit(bitmask, batch_index, t)

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
        metric_inc("tokens", n)
        metric_inc("forced_tokens", f)
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
        self.context = _context.get_tokenizer_context(model_config)
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
        self.fallback = FallbackBackends(self.vllm_config, self.tokenizer, self.vocab_size, self.token_words)
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
        cached_only: bool = False,
    ) -> FstGrammar | None:
        """The grammar of one constraint (regex, choice, JSON schema, ``json_object``), compiled within the
        engine's budget or loaded from a cache; ``cached_only``: None when no cache holds it yet.

        Raises:
            The compiler's errors (``InvalidConstraintError``, ``UnsupportedSchemaError``,
            ``CompileBudgetError``, ``EmptyLanguageError``, ...).
        """
        options = options or FstRequestOptions()
        kind = getattr(request_type, "name", str(request_type))
        regex = constraint_to_regex(request_type, grammar_spec, whitespace_pattern, disk=self.context.disk)
        res = self.context.compile(regex, options, _context.compile_budget_s("engine"), cached_only=cached_only)
        if res is None:
            return None
        metric_inc("requests")
        if res.cache_hit:
            metric_inc("cache_hits")
        logger.info(
            "fst: request %s: %s constraint (%d regex chars, %s states, %s) compiled in %.1f ms%s",
            request_id,
            kind.lower(),
            len(regex),
            getattr(res.compiled, "num_states", "?"),
            options.text(),
            res.ms,
            " (cache hit)" if res.cache_hit else "",
        )
        return FstGrammar(
            _context.matcher_factory(res.compiled),
            request_id=request_id,
            eos_ids=self.context.eos_ids,
            stop_token_ids=stop_token_ids,
            token_words=self.token_words,
            compile_ms=res.ms,
            kind=kind,
            options=options,
        )

    def cached_vllm_grammar(self, request: Any) -> FstGrammar | None:
        """fst's grammar for a ``vllm.v1.request.Request`` when its automaton is already compiled (this
        process's cache or the host's disk cache, where the API server's compile check left it: a load of
        about a millisecond), else None, also for requests of the fallback and for any error (the caller
        then takes :meth:`compile_vllm_request` in vLLM's grammar thread pool, which reports it)."""
        so = getattr(request.sampling_params, "structured_outputs", None)
        if request.structured_output_request is None or getattr(so, "_backend", None) != BACKEND_NAME:
            return None
        try:
            return self.compile_vllm_request(request, cached_only=True)
        except Exception:
            return None

    def compile_vllm_request(self, request: Any, cached_only: bool = False) -> Any:
        """Grammar for a ``vllm.v1.request.Request``: fst's (options from ``sampling_params.extra_args``),
        or the fallback backend's when the API server routed it there (:func:`routed_backend`: a built-in
        backend's name in ``_backend``, or under :data:`FALLBACK_ROUTE_ATTR` on vLLM 0.33) or when fst
        cannot express it (grammar, structural_tag, an unsupported schema that reached the engine
        unchecked). ``cached_only``: fst's grammar only if no compile is needed, else None. A request with
        ``ignore_eos`` gets it wrapped in an :class:`~.ignore_eos.EosAfterEndGrammar` (stop tokens only
        after the constraint's end, where vLLM would leave the rest of the output unconstrained)."""
        grammar = self._vllm_grammar(request, cached_only)
        sp = request.sampling_params
        if grammar is not None and getattr(sp, "ignore_eos", False):
            stops = set(self.context.eos_ids) | set(getattr(sp, "all_stop_token_ids", None) or ())
            return EosAfterEndGrammar(grammar, stops)
        return grammar

    def _vllm_grammar(self, request: Any, cached_only: bool) -> Any:
        """:meth:`compile_vllm_request` without the ``ignore_eos`` wrapper."""
        sp = request.sampling_params
        so_req = request.structured_output_request
        request_type, spec = so_req.structured_output_key
        stop_ids = getattr(sp, "all_stop_token_ids", None)
        routed = routed_backend(so_req.params)
        kind = getattr(request_type, "name", str(request_type))
        if routed is not None or needs_fallback(kind):
            if cached_only:
                return None
            name = routed if routed is not None else self.fallback.default_name()
            return self.fallback.compile(name, request_type, spec, stop_token_ids=stop_ids)
        try:
            return self.compile_request(
                request_type,
                spec,
                options=parse_request_options(getattr(sp, "extra_args", None), getattr(sp, "allowed_token_ids", None)),
                whitespace_pattern=whitespace_of(so_req.params),
                stop_token_ids=stop_ids,
                request_id=request.request_id,
                cached_only=cached_only,
            )
        except (UnsupportedSchemaError, CompileBudgetError) as e:  # reached the engine unchecked
            if cached_only:
                return None
            try:
                name = self.fallback.default_name()
            except InvalidOptionError:  # VLLM_FST_FALLBACK=none: the request fails with fst's error
                raise e from None
            logger.info("fst: request %s: %s; served by the fallback backend %s", request.request_id, e, name)
            metric_inc("fallback", 1.0, kind=kind.lower())
            return self.fallback.compile(name, request_type, spec, stop_token_ids=stop_ids)

    def allocate_token_bitmask(self, max_num_seqs: int):
        """One row per (request, draft position + bonus): vLLM passes ``max_num_seqs * (1 + K)``; each
        row is one int32 bit per token of the model's vocabulary. The rows' order is the manager's:
        0.32 packs ``1 + len(drafts)`` rows per request, 0.33 gives each request a fixed block of
        ``K + 1`` rows (``mask_stride``); a grammar only ever fills the row it is given."""
        import torch

        return torch.full((max_num_seqs, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def destroy(self):
        self.fallback.destroy()
