"""Logging and Prometheus counters of the fst backend (``vllm_fst_*``, created lazily in the process
that counts; best effort: a metrics failure never fails a request)."""

from __future__ import annotations

import logging
import threading
from typing import Any

try:
    from vllm.logger import init_logger

    logger = init_logger("vllm.fst_backend")
except Exception:  # pragma: no cover - vLLM missing
    logger = logging.getLogger("vllm.fst_backend")

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
    "disk_cache_loads": ("vllm_fst_disk_cache_loads_total", "Compiled automata loaded from the host's disk cache instead of compiled"),
    "fallback": ("vllm_fst_fallback_requests_total", "Requests routed to the fallback backend, by constraint kind"),
    "pending_prefill_tokens": ("vllm_fst_pending_prefill_tokens_total", "Prompt tokens prefilled while the API server still compiled the request's constraint"),
    "first_samples_in_step": ("vllm_fst_first_samples_in_step_total", "Requests prefilled whole while their constraint compiled whose grammar came in time for the step's sample"),
    "late_first_samples": ("vllm_fst_late_first_samples_total", "Samples dropped because the request's grammar had not come by the end of the step's forward pass (its last prompt token runs again)"),
    "precheck_seconds": ("vllm_fst_precheck_seconds_total", "Seconds API-server requests waited for the isolated check"),
}
_METRIC_LABELS = {"fallback": ("kind",)}


class _NullCounter:
    def inc(self, amount: float = 1.0) -> None:
        pass

    def labels(self, **labels: str) -> "_NullCounter":
        return self


def metric_inc(key: str, amount: float = 1.0, **labels: str) -> None:
    """Add ``amount`` to the counter ``key`` of :data:`_METRIC_DEFS` (created on first use; ``labels``
    for the counters of :data:`_METRIC_LABELS`)."""
    try:
        c = _METRICS.get(key)
        if c is None:
            with _METRICS_LOCK:
                c = _METRICS.get(key)
                if c is None:
                    from prometheus_client import Counter

                    name, doc = _METRIC_DEFS[key]
                    c = Counter(name.removesuffix("_total"), doc, labelnames=_METRIC_LABELS.get(key, ()))
                    _METRICS[key] = c
        (c.labels(**labels) if labels else c).inc(amount)
    except Exception:  # metrics are best effort
        _METRICS.setdefault(key, _NullCounter())
