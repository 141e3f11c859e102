"""Per-tokenizer context of a process: the tokenizer artifacts (located, loaded, built when missing),
the compile cache and the compile budgets."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from vllm_fst_backend.errors import ArtifactError, InvalidOptionError

from .metrics import logger, metric_inc
from .options import FstRequestOptions, env_flag

BUILD_COMMAND = "python scripts/build_tokenizer_artifacts.py --tokenizer {tokenizer} --out {out}"
REPO_ROOT = Path(__file__).resolve().parent.parent.parent

# ---- artifacts ---------------------------------------------------------------------------------

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
        auto_build = env_flag("VLLM_FST_AUTO_BUILD", True)
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



# ---- compile budgets, hooks, cache ------------------------------------------------------------

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
    if stage == "engine" and env_flag("VLLM_FST_VALIDATE_COMPILE", True):
        return budget * ENGINE_BUDGET_FACTOR
    return budget


def _default_prepare(artifacts: Any) -> None:
    from vllm_fst_backend.compiler import prepare

    prepare(artifacts)


def _default_matcher(compiled: Any):
    from vllm_fst_backend.runtime.matcher import FstMatcher

    return FstMatcher(compiled)


def _default_compile(regex: str, artifacts: Any, options: Any, budget_s: float) -> Any:
    from vllm_fst_backend.compiler import CompileBudgets, compile_regex

    return compile_regex(regex, artifacts, options, budgets=CompileBudgets(time_budget_s=budget_s))


# Hooks (tests replace them; production leaves them alone).
compile_function: Callable[[str, Any, Any, float], Any] = _default_compile
matcher_factory: Callable[[Any], Any] = _default_matcher
prepare_function: Callable[[Any], None] = _default_prepare


INLINE_LOAD_BYTES = 16 << 20  # stored automata up to this size are loaded on the caller's thread (cached_only)


@dataclasses.dataclass
class CompileResult:
    compiled: Any
    ms: float
    cache_hit: bool


def cache_bytes_from_env() -> int:
    """``$VLLM_FST_CACHE_BYTES``: bytes of compiled automata kept per tokenizer per process (default
    512 MiB, by ``CompiledAutomaton.nbytes``)."""
    raw = os.environ.get("VLLM_FST_CACHE_BYTES", "").strip()
    try:
        value = int(raw) if raw else 512 << 20
    except ValueError:
        value = -1
    if value <= 0:
        raise InvalidOptionError(f"VLLM_FST_CACHE_BYTES must be a positive number of bytes, got {raw!r}")
    return value


class TokenizerContext:
    """Artifacts of one tokenizer plus its cache of compiled automata (``compiler.CompiledCache``:
    LRU bounded in bytes, thread-safe, concurrent requests for one key compile once, failures not
    cached). One per tokenizer per process."""

    def __init__(self, artifacts: Any, tokenizer_path: str = "", cache_bytes: int | None = None):
        from vllm_fst_backend.compiler import CompiledCache

        self.artifacts = artifacts
        self.tokenizer_path = tokenizer_path
        self.cache = CompiledCache(cache_bytes if cache_bytes is not None else cache_bytes_from_env())
        self.disk = _disk_cache()
        self.eos_ids: tuple[int, ...] = tuple(int(x) for x in _artifact_attr(artifacts, "eos_ids", ()))
        self.vocab_size = int(_artifact_attr(artifacts, "vocab_size", 0) or 0)

    @property
    def nbytes(self) -> int:
        """Bytes of compiled automata held in this process's cache."""
        return self.cache.nbytes

    def prepare_in_background(self) -> threading.Thread:
        """Build the compiler's per-tokenizer structures (``compiler.prepare``) in a daemon thread, so
        that the first request does not wait for them. A failure is only logged: the first compile
        then builds them (and reports any error to its request)."""

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

    def _key(self, regex: str, options: FstRequestOptions) -> tuple:
        return self.cache.key(regex, options.compile_options(), self.artifacts)

    def _disk_key(self, regex: str, options: FstRequestOptions) -> str | None:
        if self.disk is None or not hasattr(self.artifacts, "fingerprint"):
            return None
        return self.disk.key(regex, options.compile_options(), self.artifacts)

    def peek(self, regex: str, options: FstRequestOptions, max_load_bytes: int | None = None) -> Any:
        """The compiled automaton if this process has it or another process of the host stored it
        (``compiler.persist.DiskCache``: the API server's compile process, the engine core), else None;
        never compiles. ``max_load_bytes``: a stored file larger than that is not loaded (None)."""
        key = self._key(regex, options)
        got = self.cache.get(key)
        if got is None:
            dkey = self._disk_key(regex, options)
            if dkey is not None:
                got = self.disk.load(dkey, self.artifacts, max_bytes=max_load_bytes)
                if got is not None:
                    self.cache.put(key, got)
                    metric_inc("disk_cache_loads")
        return got

    def compile(self, regex: str, options: FstRequestOptions, budget_s: float | None = None, *,
                cached_only: bool = False) -> CompileResult | None:
        """Compile (or take from this process's cache or the host's disk cache) ``regex`` under
        ``options`` within ``budget_s`` seconds (default: :func:`compile_budget_s` ``("validate")``); a
        fresh automaton is stored on disk for the host's other processes. ``cached_only``: None instead
        of compiling when neither cache has it, or when its file is over :data:`INLINE_LOAD_BYTES` (the
        caller then takes a thread that may block longer). Raises the compiler's errors (not cached)."""
        t0 = time.monotonic()
        hit = self.peek(regex, options, INLINE_LOAD_BYTES if cached_only else None)
        if hit is not None:
            return CompileResult(hit, (time.monotonic() - t0) * 1e3, True)
        if cached_only:
            return None
        budget = compile_budget_s("validate") if budget_s is None else budget_s
        t0 = time.monotonic()
        compiled = self.cache.get_or_compile(
            regex, self.artifacts, options.compile_options(),
            compile_fn=lambda r, a, o: compile_function(r, a, o, budget),
        )
        ms = (time.monotonic() - t0) * 1e3
        dkey = self._disk_key(regex, options)
        if dkey is not None and getattr(compiled, "nbytes", None) is not None:
            self.disk.store(dkey, compiled)
        metric_inc("compile_seconds", ms / 1e3)
        return CompileResult(compiled, ms, False)


def _disk_cache() -> Any:
    """The host-shared disk cache (``compiler.persist``), or None when disabled or misconfigured."""
    from vllm_fst_backend.compiler.persist import disk_cache_from_env

    try:
        return disk_cache_from_env()
    except InvalidOptionError as e:
        logger.error("fst: disk cache disabled: %s", e)
        return None


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


# Facts about the served configuration learnt in this process (``InputProcessor.__init__`` wrap in
# the API server): ``backend``, ``speculative_model``.
SERVED: dict[str, Any] = {}


def is_jump_proposer(model: Any) -> bool:
    """Whether a ``speculative_config.model`` (a class path) is fst's forced-token proposer
    (``vllm_fst_backend.vllm_plugin.FstForcedTokenProposer``)."""
    return model is not None and str(model).endswith("FstForcedTokenProposer")


# ---- the compile check of the API server (out of its event loop and GIL) ----------------------------


class InProcessChecker:
    """The compile check in this process (conversion + compile into its :class:`TokenizerContext`);
    used when the isolated compile process is disabled (``VLLM_FST_CHECK_PROCESS=0``)."""

    def __init__(self, model_config: Any):
        self.model_config = model_config

    def check(self, kind: str, spec: Any, *, whitespace_pattern: str | None = None,
              options: FstRequestOptions | None = None, budget_s: float | None = None) -> str:
        """The constraint's regex, once it compiled (budget ``budget_s``, default the validation
        budget). Raises the conversion's / compiler's errors."""
        from vllm_fst_backend.compiler.constraints import constraint_to_regex

        ctx = get_tokenizer_context(self.model_config)
        regex = constraint_to_regex(kind, spec, whitespace_pattern, disk=ctx.disk)
        res = ctx.compile(regex, options or FstRequestOptions(), budget_s)
        if not res.cache_hit:
            logger.info("fst: validated %s constraint: compiled in %.1f ms", kind.lower(), res.ms)
        return regex

    async def acheck(self, kind: str, spec: Any, **kw: Any) -> str:
        """:meth:`check` in a worker thread (off the event loop, but not off the GIL)."""
        return await run_off_loop(self.check, kind, spec, **kw)


_CHECK_POOL: Any = None
_CHECK_POOL_LOCK = threading.Lock()
CHECK_THREADS = 64  # threads that wait for compile checks (each blocks in select while its compile runs)


async def run_off_loop(fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` awaited from the event loop in fst's own thread pool (:data:`CHECK_THREADS`
    threads, created on first use). Not ``asyncio.to_thread``: the loop's default pool has
    ``min(32, CPUs + 4)`` threads (6 on 2 CPUs), and a thread waiting for a compile holds one for the
    whole compile, so a burst of new constraints would queue behind each other before reaching the
    compile processes, and would starve everything else the server runs in that pool."""
    import asyncio
    import functools
    from concurrent.futures import ThreadPoolExecutor

    global _CHECK_POOL
    with _CHECK_POOL_LOCK:
        if _CHECK_POOL is None:
            _CHECK_POOL = ThreadPoolExecutor(max_workers=CHECK_THREADS, thread_name_prefix="fst-check")
    return await asyncio.get_running_loop().run_in_executor(_CHECK_POOL, functools.partial(fn, *args, **kw))


#: Constraint kinds compiled at start-up by :class:`ServiceChecker` (their spec is fixed).
WARM_KINDS = ("JSON_OBJECT",)


class ServiceChecker:
    """The compile check in the isolated compile processes (``compiler.service.CompileService``): the
    API server's event loop only awaits a thread that waits on a pipe; the automaton lands in the
    host's disk cache, where the engine core loads it."""

    def __init__(self, model_config: Any):
        from vllm_fst_backend.compiler.service import CompileService

        tok = local_tokenizer_path(model_config)
        directory = resolve_artifacts_dir(tok)
        load_or_build_artifacts(tok, directory)  # builds missing artifacts once (file lock)
        workers = _positive_int_env("VLLM_FST_CHECK_WORKERS", 3)
        self.service = CompileService(directory, tok, workers=workers)
        self.service.start()
        threading.Thread(target=self._warm, name="fst-warm", daemon=True).start()

    def _warm(self) -> None:
        """Compile the constraints every server sees (``response_format: json_object``) once at start-up,
        so that their first request is a disk-cache hit (a no-op when an earlier start stored them)."""
        for kind in WARM_KINDS:
            try:
                self.check(kind, None)
            except Exception as e:  # logged only: the request itself reports any error
                logger.info("fst: warm-up compile of %s failed: %s", kind.lower(), e)

    def check(self, kind: str, spec: Any, *, whitespace_pattern: str | None = None,
              options: FstRequestOptions | None = None, budget_s: float | None = None) -> str:
        """The constraint's regex, once it compiled in a compile process. Raises the named errors of
        the conversion and the compiler, ``CompileMemoryError``, ``CompileServiceError``."""
        res = self.service.check(kind, spec, whitespace_pattern=whitespace_pattern,
                                 options=(options or FstRequestOptions()).compile_options(),
                                 budget_s=compile_budget_s("validate") if budget_s is None else budget_s)
        if not res.cache_hit:
            metric_inc("compile_seconds", res.ms / 1e3)
            logger.info("fst: validated %s constraint: compiled in %.1f ms (compile process; %.1f ms with the wait)",
                        kind.lower(), res.ms, res.wait_ms)
        return res.regex

    async def acheck(self, kind: str, spec: Any, **kw: Any) -> str:
        """:meth:`check` awaited from the event loop (a thread blocked in ``select``, GIL released)."""
        return await run_off_loop(self.check, kind, spec, **kw)


def _positive_int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        value = 0
    if value <= 0:
        raise InvalidOptionError(f"{name} must be a positive integer, got {raw!r}")
    return value


_CHECKERS: dict[str, Any] = {}
_CHECKERS_LOCK = threading.Lock()


def get_checker(model_config: Any) -> Any:
    """The compile checker of the served tokenizer in this process (created once):
    :class:`ServiceChecker` unless ``VLLM_FST_CHECK_PROCESS=0`` (then :class:`InProcessChecker`). An
    object with ``check(kind, spec, *, whitespace_pattern, options, budget_s) -> regex`` and
    ``async acheck(...)``.

    Raises:
        ArtifactError: artifacts missing and not buildable; InvalidOptionError: a bad variable.
    """
    tok = local_tokenizer_path(model_config)
    with _CHECKERS_LOCK:
        checker = _CHECKERS.get(tok)
        if checker is None:
            cls = ServiceChecker if env_flag("VLLM_FST_CHECK_PROCESS", True) else InProcessChecker
            checker = _CHECKERS[tok] = cls(model_config)
        return checker


def start_checker_in_background(model_config: Any) -> threading.Thread:
    """Create the checker now (API server start-up: the compile processes load the artifacts while the
    engine warms up), in a daemon thread; a failure is logged and retried by the first request."""

    def run() -> None:
        try:
            get_checker(model_config)
        except Exception as e:
            logger.warning("fst: compile checker not started: %s", e)

    th = threading.Thread(target=run, name="fst-checker-start", daemon=True)
    th.start()
    return th
