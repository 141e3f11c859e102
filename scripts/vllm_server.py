"""Start a vLLM OpenAI server as a subprocess and wait until it answers ``/health``.

Shared by ``scripts/bench_e2e.py`` and the end-to-end tests (``tests/test_vllm_e2e.py``): one place
for the start, the readiness wait and the clean-up of the server's process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["ServerStartError", "running_server", "log_tail"]


class ServerStartError(RuntimeError):
    """The server exited, or did not answer ``/health`` within the timeout; the message holds the
    last lines of its log."""


def log_tail(path: Path, n: int = 3000) -> str:
    """The last ``n`` characters of the file at ``path`` ("" if unreadable)."""
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, env: dict, log_path: Path, timeout: float, cwd: Path | None = None,
                   name: str = "vLLM", poll_s: float = 1.0):
    """Run ``cmd`` (a ``vllm.entrypoints.openai.api_server`` command line listening on ``port``) in its
    own process group with stdout/stderr in ``log_path``; yield ``(base_url, seconds_to_ready, proc)``
    once ``GET /health`` answers 200. On exit the whole group gets SIGTERM, then SIGKILL after 30 s.

    Raises:
        ServerStartError: the process exited before it was ready, or ``timeout`` seconds passed.
    """
    import requests

    log = open(log_path, "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise ServerStartError(f"{name} server exited with {proc.returncode}:\n{log_tail(log_path)}")
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() - t0 > timeout:
                raise ServerStartError(f"{name} server not ready after {timeout:.0f} s:\n{log_tail(log_path)}")
            time.sleep(poll_s)
        yield base, time.monotonic() - t0, proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # the group this function created
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
