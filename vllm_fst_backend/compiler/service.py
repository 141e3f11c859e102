"""The isolated compile process: constraint → regex → compiled automaton, bounded in time and memory,
outside the process that asks for it.

Why: an API server must not compile on its event loop (nothing else is answered meanwhile) nor in a
thread of its own (the compile holds the GIL for most of its time), and no single request may exhaust
the server's memory. :class:`CompileService` keeps ``workers`` child processes
(``python -m vllm_fst_backend.compiler.service``; no vLLM import, no ``multiprocessing`` main-module
re-import) that load the tokenizer artifacts and the compiler's per-tokenizer tables once, then serve
requests one at a time each:

* the parent waits on the child's pipe with ``select`` (no GIL held), at most the time budget plus a
  margin (``deadline_margin_s``); a child still busy then is killed and the request fails with
  :class:`~vllm_fst_backend.errors.CompileBudgetError` naming the budget (the compiler checks its own
  deadline in every long loop, so this only catches stages that cannot be interrupted);
* the child's private resident memory (resident less file-backed and shared pages, so the mapped
  per-tokenizer tables of :mod:`.table_store` do not count) is sampled every 20 ms; over its private
  size at start-up plus
  ``memory_budget_bytes`` it is killed and the request fails with
  :class:`~vllm_fst_backend.errors.CompileMemoryError` naming the budget and ``VLLM_FST_COMPILE_MEMORY_MB``;
* a killed or crashed child is replaced by a fresh one (the next request waits for its start-up);
* the automaton is written to the host-shared :class:`~.persist.DiskCache`, where the engine core and
  the workers load it instead of compiling again;
* scheduling: waiting requests get a free process shortest-estimated-first (:func:`cost_hint`: text
  length plus bounded repetitions); constraints estimated heavy may hold at most ``workers - 1``
  processes at once, so a short constraint never waits behind long compiles only; and one process more
  than ``workers`` (``quick_workers``) serves only *quick* constraints (a regex or choice list with a
  cost of at most :data:`QUICK_COST`, compiled in a few ms): under load a JSON schema compiles for
  hundreds of ms, and a date regex behind it waited that long for a process;
* at most ``parallel`` constraints that are not quick *run* at once (default: half the CPUs this
  process may use, at least 1), except that a compile running longer than ``stall_s`` no longer counts,
  so one long compile never holds the others back. On a host whose CPUs also run the model, compiles
  running side by side only share the same free CPU: each takes as long as all of them together,
  where one after the other (shortest first) most finish sooner. A burst of 8 new schemas at 2 CPUs
  showed it (docs/benchmarks.md, serving);
* a free process is taken most-recently-used first: a compile reuses the dead-end verdicts of the
  compiles before it in the same process (:mod:`.verdict_cache`), so the work goes where they are;
* the processes run at a lower CPU priority than their parent (``nice`` +10,
  ``$VLLM_FST_COMPILE_NICE``): on a host whose CPUs the model, the engine core and the API server also
  need, a burst of compiles took CPU from the API server's event loop (``/health`` answers) and from the
  engine core's steps; at a lower priority they take what those leave (docs/benchmarks.md, "Serving
  workload", the compile processes' priority).

Wire format (both directions): 8-byte little-endian length + pickle. Request: dict with ``kind``,
``spec``, ``whitespace_pattern``, ``options`` (:class:`~.options.CompileOptions`), ``budget_s``.
Reply: ``("ok", regex, compile_ms, cache_hit)`` or ``("err", class name, message, attributes)``.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

from .. import errors as _errors
from ..errors import CompileBudgetError, CompileMemoryError, CompileServiceError

__all__ = ["CompileService", "memory_budget_from_env", "nice_from_env", "CheckResult", "cost_hint", "default_parallel",
           "LIGHT_COST", "QUICK_COST", "STALL_S", "DEFAULT_NICE", "settle_heap"]

_LEN = struct.Struct("<Q")
_POLL_S = 0.02
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_QUANT = re.compile(r"\{(\d{1,9})(?:,(\d{0,9}))?\}")
_JSON_BOUND = re.compile(r'"(?:maxLength|maxItems|maxProperties|maxContains)"\s*:\s*(\d{1,9})')
LIGHT_COST = 800  # cost_hint at or below which a constraint is "light" (compiles in ~<100 ms at SmolLM2)
QUICK_COST = 450  # a regex or choice list at or below: "quick" (compiles in ~2-4 ms at SmolLM2, isolated)
STALL_S = 0.25  # a compile running longer no longer holds back the next one (CompileService, parallel)
DEFAULT_NICE = 10  # the compile processes' nice increment over their parent's (module docstring)


def default_parallel() -> int:
    """Compiles (not quick) to run at once by default: half the CPUs this process may use, at least 1
    (the other half runs the model, the engine core and the API server)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 2
    return max(1, n // 2)


def cost_hint(kind: str, spec: Any) -> int:
    """A cheap estimate of a constraint's compile cost (no parsing; O(len(text))): the length of its
    text (regex, choice list or schema as JSON) plus 20 per unit of bounded repetition (regex
    ``{m,n}``: n; schema ``maxLength``/``maxItems``/...: the bound; each capped at 10,000). Bounded
    repetitions unroll into one automaton state per unit, which dominates compile time (a schema with
    four ``maxLength`` strings: 2,766 states). Only orders the waiting requests; never rejects."""
    try:
        text = spec if isinstance(spec, str) else json.dumps(spec, default=str)
    except (TypeError, ValueError):
        text = str(spec)
    if kind == "REGEX":
        bound = sum(min(int(hi or lo), 10_000) for lo, hi in _QUANT.findall(text))
    else:
        bound = sum(min(int(x), 10_000) for x in _JSON_BOUND.findall(text))
    return len(text) + 20 * bound


def memory_budget_from_env() -> int:
    """``$VLLM_FST_COMPILE_MEMORY_MB`` in bytes (default 768 MB per constraint).

    Raises:
        InvalidOptionError: not a positive number.
    """
    raw = os.environ.get("VLLM_FST_COMPILE_MEMORY_MB", "").strip()
    try:
        mb = float(raw) if raw else 768.0
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise _errors.InvalidOptionError(f"VLLM_FST_COMPILE_MEMORY_MB must be a positive number, got {raw!r}")
    return int(mb * (1 << 20))


def nice_from_env() -> int:
    """``$VLLM_FST_COMPILE_NICE``: how much lower than their parent's the compile processes' CPU priority
    is (a ``nice`` increment, 0-19; default :data:`DEFAULT_NICE`; 0 keeps the parent's priority).

    Raises:
        InvalidOptionError: not an integer from 0 to 19.
    """
    raw = os.environ.get("VLLM_FST_COMPILE_NICE", "").strip()
    try:
        n = int(raw) if raw else DEFAULT_NICE
    except ValueError:
        n = -1
    if not 0 <= n <= 19:
        raise _errors.InvalidOptionError(f"VLLM_FST_COMPILE_NICE must be an integer from 0 to 19, got {raw!r}")
    return n


def _private_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` that are not file-backed or shared (``/proc/<pid>/statm``: resident -
    shared): what a compile allocates. Pages of mapped files (the shared tables, the artifacts) can be
    dropped by the kernel and are held once per host, so they do not count. 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            f = fh.read().split()
        return max(int(f[1]) - int(f[2]), 0) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _send(fh, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=5)
    fh.write(_LEN.pack(len(data)))
    fh.write(data)
    fh.flush()


def _recv_exact(fh, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = fh.read(n - len(buf))
        if not chunk:
            raise EOFError("compile process closed its pipe")
        buf += chunk
    return buf


def _recv(fh) -> Any:
    (n,) = _LEN.unpack(_recv_exact(fh, _LEN.size))
    return pickle.loads(_recv_exact(fh, n))


def _error_reply(e: BaseException) -> tuple:
    attrs = {k: v for k, v in vars(e).items() if isinstance(v, (str, int, float, bool, type(None)))}
    return ("err", type(e).__name__, str(e), attrs)


def _rebuild_error(name: str, message: str, attrs: dict) -> BaseException:
    cls = getattr(_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, _errors.FstBackendError)):
        return CompileServiceError(f"compile process failed: {name}: {message}")
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    for k, v in attrs.items():
        setattr(e, k, v)
    return e


class CheckResult:
    """Outcome of one check: ``regex`` (str), ``ms`` (compile wall time in the child, ms; 0 when the
    automaton was already stored), ``cache_hit`` (bool), ``wait_ms`` (time in the parent incl. queueing)."""

    __slots__ = ("regex", "ms", "cache_hit", "wait_ms")

    def __init__(self, regex: str, ms: float, cache_hit: bool, wait_ms: float):
        self.regex, self.ms, self.cache_hit, self.wait_ms = regex, ms, cache_hit, wait_ms


class _Worker:
    def __init__(self, cmd: list[str], env: dict, start_timeout_s: float):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, env=env)
        self.start_timeout_s = start_timeout_s
        self.baseline = 0
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        msg = self._wait(time.monotonic() + self.start_timeout_s, None, "start")
        if not (isinstance(msg, tuple) and msg and msg[0] == "ready"):
            self.kill()
            raise CompileServiceError(f"compile process did not start: {msg!r}")
        self.baseline = _private_bytes(self.proc.pid)
        self.ready = True

    def _wait(self, deadline: float, mem_limit: int | None, what: str) -> Any:
        out = self.proc.stdout
        fd = out.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise TimeoutError(what)
            r, _, _ = select.select([fd], [], [], min(_POLL_S, left))
            if r:
                try:
                    return _recv(out)
                except (EOFError, OSError, pickle.UnpicklingError) as e:
                    rc = self.proc.poll()
                    self.kill()
                    raise CompileServiceError(f"compile process died during {what} (exit {rc}): {e}") from None
            if mem_limit is not None and _private_bytes(self.proc.pid) > mem_limit:
                self.kill()
                raise MemoryError(what)
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.kill()
                raise CompileServiceError(f"compile process exited during {what} (exit {rc})")

    def request(self, req: dict, timeout_s: float, memory_budget: int) -> Any:
        try:
            _send(self.proc.stdin, req)
        except (BrokenPipeError, OSError) as e:
            self.kill()
            raise CompileServiceError(f"compile process unavailable: {e}") from None
        return self._wait(time.monotonic() + timeout_s, self.baseline + memory_budget, "compile")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except Exception:  # pragma: no cover
            pass
        for fh in (self.proc.stdin, self.proc.stdout):
            try:
                fh.close()
            except Exception:
                pass


class CompileService:
    """A pool of isolated compile processes for one tokenizer (module docstring). Thread-safe:
    :meth:`check` blocks the calling thread (not the GIL) until a process is free and has answered.

    Args:
        artifacts_dir: the tokenizer artifacts (must exist: the caller builds missing ones first).
        tokenizer_path: the tokenizer (fingerprint check), or None.
        workers: number of child processes (``$VLLM_FST_CHECK_WORKERS``, default 3).
        memory_budget_bytes: per-constraint memory budget (default :func:`memory_budget_from_env`).
        deadline_margin_s: extra wait past a request's time budget before its process is killed.
        start_timeout_s: time allowed for a child to load artifacts and prepare (Tekken: ~15 s).
        light_cost: :func:`cost_hint` at or below which a constraint is light; heavier ones hold at most
            ``workers - 1`` processes at once (module docstring, scheduling).
        quick_workers: processes beyond ``workers`` that only quick constraints may take (regex or
            choice, cost at most ``quick_cost``); quick ones may take any free process.
        parallel: constraints that are not quick compiling at once, not counting those running longer
            than ``stall_s`` seconds (module docstring, scheduling); default :func:`default_parallel`.
        nice: the children's ``nice`` increment over this process's priority (0-19); default
            :func:`nice_from_env`.

    Raises:
        InvalidOptionError: ``$VLLM_FST_COMPILE_MEMORY_MB`` or ``$VLLM_FST_COMPILE_NICE`` malformed, or
            ``nice`` outside 0-19.
    """

    def __init__(self, artifacts_dir: str | os.PathLike, tokenizer_path: str | None = None, *, workers: int = 3,
                 memory_budget_bytes: int | None = None, deadline_margin_s: float = 2.0,
                 start_timeout_s: float = 120.0, light_cost: int = LIGHT_COST, quick_workers: int = 1,
                 quick_cost: int = QUICK_COST, parallel: int | None = None, stall_s: float = STALL_S,
                 nice: int | None = None):
        self.artifacts_dir = str(artifacts_dir)
        self.tokenizer_path = tokenizer_path
        self.n_general = max(1, int(workers))  # processes the constraints that are not quick may hold
        self.n_workers = self.n_general + max(0, int(quick_workers))
        self.quick_cost = int(quick_cost)
        self.memory_budget = memory_budget_bytes if memory_budget_bytes is not None else memory_budget_from_env()
        self.deadline_margin_s = deadline_margin_s
        self.start_timeout_s = start_timeout_s
        self.light_cost = int(light_cost)
        self.heavy_cap = max(1, self.n_general - 1)  # processes heavy constraints may hold at once
        self.parallel = max(1, min(self.n_general, int(parallel if parallel is not None else default_parallel())))
        self.stall_s = float(stall_s)
        self.nice = nice_from_env() if nice is None else int(nice)
        if not 0 <= self.nice <= 19:
            raise _errors.InvalidOptionError(f"nice must be from 0 to 19, got {nice!r}")
        self._running: dict[int, float] = {}  # ticket -> start (monotonic s) of each compile not quick
        self._idle: deque[_Worker] = deque()
        self._n_live = 0
        self._n_heavy = 0
        self._waiting: list[tuple[int, int, bool]] = []  # (cost, ticket, quick) of the requests waiting
        self._tickets = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self.restarts = 0

    def _spawn(self) -> _Worker:
        cmd = [sys.executable, "-m", "vllm_fst_backend.compiler.service", "--artifacts", self.artifacts_dir]
        if self.tokenizer_path:
            cmd += ["--tokenizer", str(self.tokenizer_path)]
        if self.nice:
            cmd += ["--nice", str(self.nice)]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        return _Worker(cmd, env, self.start_timeout_s)

    def start(self) -> None:
        """Start the child processes now (they load and prepare in the background)."""
        with self._cond:
            while self._n_live < self.n_workers and not self._closed:
                self._idle.append(self._spawn())
                self._n_live += 1

    def _heavy(self, cost: int) -> bool:
        return cost > self.light_cost

    def quick(self, kind: str, cost: int) -> bool:
        """Whether a constraint of ``kind`` and :func:`cost_hint` ``cost`` is quick (module docstring)."""
        return kind in ("REGEX", "CHOICE") and cost <= self.quick_cost

    @property
    def _n_slow(self) -> int:
        """Processes held by constraints that are not quick (each is in ``_running``)."""
        return len(self._running)

    def _young(self, now: float) -> list[float]:
        """Start times of the compiles (not quick) running for less than ``stall_s``."""
        return [t for t in self._running.values() if now - t < self.stall_s]

    def _eligible(self, cost: int, quick: bool, now: float) -> bool:
        if quick:
            return True
        return (self._n_slow < self.n_general and (not self._heavy(cost) or self._n_heavy < self.heavy_cap)
                and len(self._young(now)) < self.parallel)

    def _age_wait(self, now: float) -> float | None:
        """Seconds until the next running compile stops counting against ``parallel`` (None: none will)."""
        young = self._young(now)
        return max(min(young) + self.stall_s - now, 1e-3) if young else None

    def _my_turn(self, entry: tuple[int, int, bool]) -> bool:
        """Whether ``entry`` is the first waiting request (in (cost, arrival) order) that may take a
        process now. Caller holds the lock."""
        if not (self._idle or self._n_live < self.n_workers):
            return False
        now = time.monotonic()
        for e in sorted(self._waiting):
            if self._eligible(e[0], e[2], now):
                return e == entry
        return False

    def _acquire(self, cost: int = 0, quick: bool = False) -> _Worker:
        heavy = self._heavy(cost) and not quick
        with self._cond:
            if self._closed:
                raise CompileServiceError("compile service is closed")
            entry = (int(cost), next(self._tickets), bool(quick))
            self._waiting.append(entry)
            try:
                while not self._my_turn(entry):
                    self._cond.wait(self._age_wait(time.monotonic()))
                    if self._closed:
                        raise CompileServiceError("compile service is closed")
            finally:
                self._waiting.remove(entry)
                self._cond.notify_all()
            self._n_heavy += heavy
            if not quick:
                self._running[entry[1]] = time.monotonic()
            if self._idle:
                w = self._idle.pop()  # the process used last: its caches are warm (verdict_cache)
                w.ticket = entry[1]
                return w
            self._n_live += 1
        try:
            w = self._spawn()
        except Exception as e:
            with self._cond:
                self._n_live -= 1
                self._n_heavy -= heavy
                self._running.pop(entry[1], None)
                self._cond.notify_all()
            raise CompileServiceError(f"cannot start the compile process: {e}") from None
        w.ticket = entry[1]
        return w

    def _release(self, w: _Worker | None, cost: int = 0, quick: bool = False, ticket: int | None = None) -> None:
        with self._cond:
            self._n_heavy -= self._heavy(cost) and not quick
            self._running.pop(ticket if ticket is not None else getattr(w, "ticket", None), None)
            if w is not None and w.alive() and not self._closed:
                self._idle.append(w)
            else:
                self._n_live -= 1
                if w is not None:
                    w.kill()
            self._cond.notify_all()

    def check(self, kind: str, spec: Any, *, whitespace_pattern: str | None = None, options: Any = None,
              budget_s: float = 4.0) -> CheckResult:
        """Convert and compile a constraint in a child process (storing the automaton in the disk cache).

        Args:
            kind: ``"REGEX"``, ``"CHOICE"``, ``"JSON"``, ``"JSON_OBJECT"``.
            spec: the constraint's spec (regex text, choice list, schema dict/text).
            options: :class:`~.options.CompileOptions` (default: canonical).
            budget_s: compile time budget in seconds (the child's deadline; the process is killed
                ``deadline_margin_s`` later).

        Returns:
            :class:`CheckResult`.

        Raises:
            Every named error of the conversion and the compiler (rebuilt from the child's reply),
            CompileBudgetError (killed past the budget), CompileMemoryError (over the memory budget),
            CompileServiceError (the process could not start or crashed).
        """
        from .options import CompileOptions

        t0 = time.monotonic()
        cost = cost_hint(kind, spec)
        quick = self.quick(kind, cost)
        w = self._acquire(cost, quick)
        ticket = w.ticket
        req = dict(kind=kind, spec=spec, whitespace_pattern=whitespace_pattern,
                   options=options if options is not None else CompileOptions(), budget_s=float(budget_s))
        try:
            try:
                w.wait_ready()
                reply = w.request(req, budget_s + self.deadline_margin_s, self.memory_budget)
            except TimeoutError as e:
                self.restarts += 1
                if str(e) == "start":
                    raise CompileServiceError(
                        f"compile process did not start within {self.start_timeout_s:.0f} s") from None
                raise CompileBudgetError(
                    f"compiling the constraint exceeded the time budget of {budget_s:g} s "
                    "(VLLM_FST_COMPILE_BUDGET_S); the compile process was stopped", None) from None
            except MemoryError:
                self.restarts += 1
                raise CompileMemoryError(
                    f"compiling the constraint exceeded the memory budget of {self.memory_budget >> 20} MB "
                    "(VLLM_FST_COMPILE_MEMORY_MB); the compile process was stopped", None) from None
        except BaseException:
            self._release(None if not w.alive() else w, cost, quick, ticket)
            raise
        # a child that kept memory from this request beyond the budget is replaced
        if _private_bytes(w.proc.pid) > w.baseline + self.memory_budget:
            w.kill()
        self._release(w, cost, quick, ticket)
        if reply[0] == "ok":
            _, regex, ms, hit = reply
            return CheckResult(regex, ms, hit, (time.monotonic() - t0) * 1e3)
        _, name, message, attrs = reply
        raise _rebuild_error(name, message, attrs)

    def close(self) -> None:
        """Stop every child process."""
        with self._cond:
            self._closed = True
            idle, self._idle = list(self._idle), deque()
            self._n_live -= len(idle)
            self._cond.notify_all()
        for w in idle:
            w.kill()


# ---- the child process --------------------------------------------------------------------------


REFREEZE_EVERY = 256  # replies between two full collections of the frozen heap (settle_heap)


def settle_heap(unfreeze: bool = False) -> None:
    """Collect garbage, then freeze (``gc.freeze``) every object that survives, so that no later
    collection traverses them; ``unfreeze``: first thaw the frozen ones, so that reference cycles among
    them are collected too. The compile process calls it while no request waits (after start-up and
    between requests; every :data:`REFREEZE_EVERY` replies with ``unfreeze``).

    Why: the process keeps ~10^5 Python objects for its whole life (artifacts, the compiler's tables,
    the dead-end verdicts of the compiles before), and CPython's oldest-generation collection traverses
    all of them: ~50 ms at SmolLM2, triggered at some allocation inside a compile. Frozen objects are
    skipped, so a collection inside a compile traverses only that compile's own objects (docs/compiler.md,
    "Garbage collection in the compile process"). Objects freed by reference counting are freed as
    before."""
    import gc

    if unfreeze:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


def _settle_when_idle(stdin, served: int) -> None:
    """:func:`settle_heap` unless a request is already waiting on ``stdin`` (then at a later reply)."""
    try:
        if select.select([stdin], [], [], 0)[0]:
            return
    except (OSError, ValueError):
        return
    settle_heap(unfreeze=served % REFREEZE_EVERY == 0)


def _serve(artifacts_dir: str, tokenizer_path: str | None, nice: int = 0) -> int:
    if nice:
        os.nice(nice)  # an increment: always allowed
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the pipe
    from ..artifacts.store import load_artifacts
    from .compile import CompileBudgets, compile_regex, prepare
    from .constraints import constraint_to_regex
    from .persist import disk_cache_from_env

    try:
        artifacts = load_artifacts(artifacts_dir, tokenizer_path=tokenizer_path)
        prepare(artifacts, canonical=getattr(artifacts, "canonical", None) is not None)
        disk = disk_cache_from_env()
    except Exception as e:
        _send(stdout, ("failed", f"{type(e).__name__}: {e}"))
        return 1
    settle_heap()
    _send(stdout, ("ready",))
    served = 0
    while True:
        try:
            req = _recv(stdin)
        except EOFError:
            return 0
        try:
            t0 = time.perf_counter()
            deadline = t0 + req["budget_s"]
            regex = constraint_to_regex(req["kind"], req["spec"], req["whitespace_pattern"], deadline=deadline, disk=disk)
            options = req["options"]
            key = disk.key(regex, options, artifacts) if disk is not None else None
            hit = bool(disk is not None and disk._path(key).is_file())
            if not hit:
                left = max(deadline - time.perf_counter(), 1e-3)
                compiled = compile_regex(regex, artifacts, options, budgets=CompileBudgets(time_budget_s=left))
                if disk is not None:
                    disk.store(key, compiled, evict=False)  # (evicted after the reply)
            reply = ("ok", regex, 0.0 if hit else (time.perf_counter() - t0) * 1e3, hit)
        except Exception as e:  # every error goes back to the caller, named
            reply = _error_reply(e)
        _send(stdout, reply)
        if disk is not None:
            disk.maybe_evict()
        served += 1
        _settle_when_idle(stdin, served)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="fst isolated compile process (started by CompileService)")
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by this much")
    a = ap.parse_args(argv)
    return _serve(a.artifacts, a.tokenizer, a.nice)


if __name__ == "__main__":
    sys.exit(main())
