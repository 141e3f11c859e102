"""vLLM integration of the fst structured-output backend: the only package that imports vLLM.

``register()`` is the ``vllm.general_plugins`` entry point (``pyproject.toml``): it installs the
patches of :mod:`.patches` in every vLLM process. Modules: :mod:`.backend` (the vLLM contract),
:mod:`.options` (``fst_*`` request options), :mod:`.constraints` (constraint -> regex),
:mod:`.context` (artifacts, compile cache, budgets), :mod:`.validation` (API-server checks),
:mod:`.fallback` (requests fst cannot express), :mod:`.proposer` (forced-token jumps),
:mod:`.metrics`. Every touch point in vLLM and why: ``docs/vllm-integration.md``.
"""

from __future__ import annotations

import threading

TESTED_VLLM_VERSION = "0.32"
BACKEND_NAME = "fst"

try:  # the package stays importable (and its pure helpers testable) without vLLM
    import vllm as _vllm

    VLLM_VERSION: str | None = str(getattr(_vllm, "__version__", "unknown"))
except Exception:  # pragma: no cover - vLLM missing
    VLLM_VERSION = None

VLLM_VERSION_OK = VLLM_VERSION is not None and VLLM_VERSION.startswith(TESTED_VLLM_VERSION + ".")

_REGISTER_LOCK = threading.RLock()
_REGISTERED = False


def register() -> None:
    """vLLM general-plugin entry point: make ``fst`` a structured-output backend. Idempotent; does
    nothing (but log an error) unless the installed vLLM is a tested version."""
    global _REGISTERED
    from . import metrics, patches

    if not VLLM_VERSION_OK:
        metrics.logger.error(
            "vllm-fst-backend was tested with vLLM %s.x only, but vLLM %s is installed: the 'fst' "
            "structured-output backend is NOT registered",
            TESTED_VLLM_VERSION,
            VLLM_VERSION,
        )
        return
    with _REGISTER_LOCK:
        if _REGISTERED:
            return
        patches.install()
        _REGISTERED = True
        metrics.logger.debug("fst: structured-output backend 'fst' registered (vLLM %s)", VLLM_VERSION)


def unregister() -> None:
    """Undo :func:`register` (tests)."""
    global _REGISTERED
    from . import patches

    with _REGISTER_LOCK:
        patches.uninstall()
        _REGISTERED = False


def is_registered() -> bool:
    """Whether :func:`register` installed the patches in this process."""
    return _REGISTERED


__all__ = ["BACKEND_NAME", "TESTED_VLLM_VERSION", "VLLM_VERSION", "VLLM_VERSION_OK", "register", "unregister",
           "is_registered"]
