"""Compile checks in flight on the host, so that a request prefills while its constraint compiles.

The API server's compile check (``validation.run_precheck``) of a new constraint used to finish before its
request entered the engine. Now the request enters at once and the check runs beside it:

* API server (:class:`PendingMarkers`): the check creates a marker file ``<disk cache dir>/pending/<token>``
  and the sync hook writes ``<token>`` into the request's ``extra_args`` (:data:`PENDING_ARG`). When the
  compile ends the marker is removed (the automaton is then on the host's disk cache) or renamed to
  ``<token>.refused`` (the request is cancelled there and answered with HTTP 400 or sent to the fallback).
* Engine core (:class:`PendingWatcher`): a request carrying a live marker gets a :class:`PendingGrammar`
  future instead of a compile of its own; one thread polls the markers and resolves each future from the
  disk cache once its marker is gone. The scheduler lets such a request prefill meanwhile
  (``patches._patch_scheduler``: its whole prompt, its first token sampled in the step its grammar comes
  in; or all of its prompt but the last token), so the compile overlaps the prefill.
* Jump proposer (:func:`wait_for_marker`): waits for the marker before it looks the automaton up.

Source of the idea: vLLM keeps a request in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` until its grammar is
compiled; the prompt's tokens do not depend on the grammar, only the sampled one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from .metrics import logger
from .options import env_flag

PENDING_ARG = "_fst_pending"  # the extra_args key (not an fst_* option: the option parser ignores it)
REFUSED_SUFFIX = ".refused"
POLL_S = 0.004  # marker poll period of the engine's watcher thread (s)
REFUSED_KEEP_S = 120.0  # a refused marker is deleted by the API server after this many seconds
SLACK_S = 8.0  # past its compile budget plus this, a marker no longer holds its request back


class CompileRefused(Exception):
    """The API server's compile check refused the constraint of a request that had already entered the
    engine (HTTP 400 or the fallback there); the engine ends the request, which the API server aborts."""


def pending_dir(cache_dir: str | os.PathLike) -> Path:
    """Where the markers of one disk cache live."""
    return Path(cache_dir) / "pending"


def _valid_token(token: Any) -> bool:
    return isinstance(token, str) and 0 < len(token) <= 80 and all(c.isalnum() or c == "-" for c in token)


class PendingMarkers:
    """API-server side: one marker file per compile check in flight (thread-safe).

    Args:
        directory: the marker directory (:func:`pending_dir`), created with mode 0700.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._by_key: dict[bytes, str] = {}
        self._lock = threading.Lock()
        self._last_sweep = 0.0

    def begin(self, key: bytes) -> str | None:
        """Create the marker of a check of the constraint ``key`` (32 bytes); its token, or None when the
        directory cannot be written (the request then waits for its check, as before)."""
        token = key.hex()[:32] + "-" + secrets.token_hex(4)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.directory / token, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.close(fd)
        except OSError as e:
            logger.warning("fst: cannot write the pending-compile marker in %s (%s)", self.directory, e)
            return None
        with self._lock:
            self._by_key[key] = token
        self._sweep()
        return token

    def token_for(self, key: bytes) -> str | None:
        """The token of the newest check of ``key`` still in flight, else None."""
        with self._lock:
            return self._by_key.get(key)

    def end(self, key: bytes, token: str, refused: bool) -> None:
        """The check of ``token`` ended: remove its marker (the automaton is stored) or, with ``refused``,
        rename it to ``<token>.refused`` (the engine then ends the request instead of compiling it)."""
        with self._lock:
            if self._by_key.get(key) == token:
                del self._by_key[key]
        path = self.directory / token
        try:
            if refused:
                os.replace(path, self.directory / (token + REFUSED_SUFFIX))
            else:
                os.unlink(path)
        except OSError:
            pass

    def _sweep(self) -> None:
        now = time.time()
        if now - self._last_sweep < REFUSED_KEEP_S / 4:
            return
        self._last_sweep = now
        try:
            for p in self.directory.glob("*" + REFUSED_SUFFIX):
                try:
                    if now - p.stat().st_mtime > REFUSED_KEEP_S:
                        p.unlink()
                except OSError:
                    pass
        except OSError:
            pass


def marker_state(directory: str | os.PathLike, token: str, deadline_s: float) -> str:
    """``"pending"`` (the check runs), ``"refused"`` or ``"done"`` (marker gone, or older than
    ``deadline_s`` seconds: its API server is taken to be gone)."""
    path = Path(directory) / token
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "refused" if os.path.exists(str(path) + REFUSED_SUFFIX) else "done"
    except OSError:
        return "done"
    return "pending" if time.time() - st.st_mtime <= deadline_s else "done"


def wait_for_marker(directory: str | os.PathLike, token: str, deadline_s: float, poll_s: float = 0.01) -> str:
    """Block (sleeping) until the marker of ``token`` is no longer pending; its final state."""
    while True:
        state = marker_state(directory, token, deadline_s)
        if state != "pending":
            return state
        time.sleep(poll_s)


class PendingGrammar(Future):
    """The grammar of a request whose constraint the API server is still compiling (a
    ``concurrent.futures.Future`` as vLLM's ``StructuredOutputRequest`` holds for compiles in its pool).
    ``waited_a_step``: the scheduler has held its request back once (it starts an early prefill only
    from its second step on)."""

    waited_a_step = False


class PendingWatcher:
    """Engine-core side: resolves :class:`PendingGrammar` futures when their markers go (one daemon
    thread, started on first use, asleep while nothing is pending).

    Per watched request, once its marker is gone: ``load()`` (the automaton from the disk cache, ~1 ms)
    gives the grammar; if it gives None, ``compile_async()`` (a ``Future``: vLLM's grammar pool) does. A
    refused marker resolves the future with :class:`CompileRefused`; a request that ``finished()`` first
    is dropped (its future fails with :class:`CompileRefused`; never cancelled: vLLM's
    ``StructuredOutputRequest`` re-raises a cancelled future's ``CancelledError``).
    """

    def __init__(self, poll_s: float = POLL_S):
        self.poll_s = poll_s
        self._items: list[tuple[PendingGrammar, Path, str, float, Callable, Callable, Callable]] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, directory: str | os.PathLike, token: str, deadline_s: float, *,
              load: Callable[[], Any], compile_async: Callable[[], Future],
              finished: Callable[[], bool] = lambda: False) -> PendingGrammar:
        fut = PendingGrammar()
        with self._cv:
            self._items.append((fut, Path(directory), token, deadline_s, load, compile_async, finished))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fst-pending", daemon=True)
                self._thread.start()
            self._cv.notify()
        return fut

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items:
                    self._cv.wait()
                items = list(self._items)
            done = []
            for item in items:
                fut, directory, token, deadline_s, load, compile_async, finished = item
                try:
                    if finished():
                        fut.set_exception(CompileRefused("fst: the request ended before its constraint compiled"))
                        done.append(item)
                        continue
                    state = marker_state(directory, token, deadline_s)
                    if state == "pending":
                        continue
                    done.append(item)
                    if state == "refused":
                        fut.set_exception(CompileRefused("fst: the API server's compile check refused this constraint"))
                        continue
                    grammar = load()
                    if grammar is not None:
                        fut.set_result(grammar)
                    else:
                        _chain(compile_async(), fut)
                except Exception as e:  # never let the watcher die: the request gets the error
                    if item not in done:
                        done.append(item)
                    if not fut.done():
                        fut.set_exception(e)
            if done:
                with self._cv:
                    self._items = [it for it in self._items if all(it is not d for d in done)]
            time.sleep(self.poll_s)


def _chain(src: Future, dst: Future) -> None:
    def copy(f: Future) -> None:
        if dst.done():
            return
        try:
            dst.set_result(f.result())
        except BaseException as e:  # noqa: BLE001 - any error is the request's
            dst.set_exception(e)

    src.add_done_callback(copy)


def marker_deadline_s() -> float:
    """Seconds after which a marker no longer holds its request back: the API server's compile budget,
    the compile process's kill margin and :data:`SLACK_S`."""
    from .context import compile_budget_s

    try:
        budget = compile_budget_s("validate")
    except Exception:
        budget = 4.0
    return budget + 2.0 + SLACK_S


# ---- the API server's side of a request that overlaps its check (asyncio) -------------------------------

_NO_OUTPUT = object()


async def first_output(awaitable: Any) -> tuple[Any, Any]:
    """Await a handler's result; for a streamed one (an async generator) also its first item, which
    starts the request in the engine. Returns (result, first item or a sentinel)."""
    result = await awaitable
    if hasattr(result, "__anext__"):
        try:
            return result, await result.__anext__()
        except StopAsyncIteration:
            return result, _NO_OUTPUT
    return result, _NO_OUTPUT


async def cancel_output(run: "asyncio.Future") -> None:
    """Cancel a :func:`first_output` task (vLLM aborts its request in the engine) and close its stream."""
    if not run.done():
        run.cancel()
    try:
        result, _ = await run
    except (asyncio.CancelledError, Exception):
        return
    if hasattr(result, "aclose"):
        try:
            await result.aclose()
        except Exception:
            pass


def joined(outcome: tuple[Any, Any]) -> Any:
    """The handler's result again from a :func:`first_output` outcome: a stream starts with the held item."""
    result, first = outcome
    if first is _NO_OUTPUT:
        return result
    return _prepend(first, result)


async def _prepend(first: Any, stream: Any):
    try:
        yield first
        async for item in stream:
            yield item
    finally:
        await stream.aclose()


def is_pending(grammar_slot: Any) -> bool:
    """Whether a ``StructuredOutputRequest._grammar`` value is a :class:`PendingGrammar` not resolved yet."""
    return type(grammar_slot) is PendingGrammar and not grammar_slot.done()


def request_marker(sampling_params: Any) -> tuple[Path, str] | None:
    """(marker directory, token) of a request whose API server wrote a marker token into its
    ``extra_args``, when this host's disk cache is on; else None."""
    token = request_token(sampling_params)
    directory = cache_marker_dir() if token is not None else None
    return (directory, token) if directory is not None else None


def request_token(sampling_params: Any) -> str | None:
    """The marker token an API server wrote into ``sampling_params.extra_args``, if valid."""
    extra = getattr(sampling_params, "extra_args", None)
    token = extra.get(PENDING_ARG) if isinstance(extra, dict) else None
    return token if _valid_token(token) else None


WATCHER = PendingWatcher()
_MARKERS: PendingMarkers | None = None
_MARKERS_LOCK = threading.Lock()


def overlap_enabled() -> bool:
    """``$VLLM_FST_OVERLAP_COMPILE`` (default on): a request with a new constraint enters the engine while
    the API server compiles it; off: it waits for the compile check first."""
    return env_flag("VLLM_FST_OVERLAP_COMPILE", True)


def first_sample_enabled() -> bool:
    """``$VLLM_FST_FIRST_SAMPLE`` (default on): a pending request is prefilled whole, and its first token
    is sampled in that step when its grammar arrives while the model computes the step (else that sample
    is dropped and the last prompt token computed again); off: its last prompt token waits for the
    grammar (docs/architecture.md, "Overlap of compile and prefill")."""
    return env_flag("VLLM_FST_FIRST_SAMPLE", True)


class StepClock:
    """How long the engine core may wait for pending grammars inside a step without delaying it: the
    scheduler asks for the step's bitmask right after it has handed the step to the model, so a wait
    shorter than the model's forward pass costs nothing. The wait is ``share`` × an estimate of the
    step's time from the steps timed before (their scheduled tokens and the time from that call to their
    output), within ``[floor_s, cap_s]``; ``default_s`` before any step was timed. The estimate for a step
    of N tokens is the larger of
      - the shortest of the last ``n`` steps that computed at least N/2 tokens (a step with a whole prompt
        to prefill may wait longer than a decode step), and
      - for the size classes wholly below N (``n.bit_length()``: [2^(k-1), 2^k) tokens), the fastest of the
        last ``per_class`` steps of each, the largest of those: a step computing more tokens does not take
        less time. This one remembers the size of earlier bursts: the first prefill of a burst after a
        quiet spell (recent steps all single-token decodes) still waits about as long as the last
        burst's steps took, where the recent steps alone gave a few ms and the grammars compiled meanwhile
        came one step late (docs/architecture.md, "First sample in the step").
    Steps that computed no token are not recorded (no forward pass)."""

    def __init__(self, n: int = 32, share: float = 0.9, floor_s: float = 0.001, cap_s: float = 1.0,
                 default_s: float = 0.02, per_class: int = 8):
        self.steps: deque = deque(maxlen=n)  # (scheduled tokens, seconds)
        self.by_class: dict[int, deque] = {}  # n.bit_length() -> the last per_class steps' seconds
        self.per_class = per_class
        self.share, self.floor_s, self.cap_s, self.default_s = share, floor_s, cap_s, default_s
        self._started: tuple[int, float] | None = None

    def start(self, num_tokens: int) -> None:
        """The bitmask of a step computing ``num_tokens`` tokens is asked for (the model runs from now on)."""
        self._started = (int(num_tokens), time.perf_counter())

    def stop(self) -> None:
        """The step's output arrived: record it."""
        if self._started is not None:
            n, t0 = self._started
            self.record(n, time.perf_counter() - t0)
            self._started = None

    def record(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` tokens took ``seconds`` (nothing for 0 tokens)."""
        if num_tokens <= 0:
            return
        self.steps.append((num_tokens, seconds))
        self.by_class.setdefault(num_tokens.bit_length(), deque(maxlen=self.per_class)).append(seconds)

    def wait_s(self, num_tokens: int) -> float:
        """Seconds a grammar may be waited for in a step computing ``num_tokens`` tokens (class docstring)."""
        if not self.steps:
            return self.default_s
        alike = [s for n, s in self.steps if 2 * n >= num_tokens]
        k = max(int(num_tokens), 1).bit_length()
        below = [min(ts) for c, ts in self.by_class.items() if c < k and ts]
        est = max(min(alike) if alike else 0.0, max(below) if below else 0.0)
        return min(max(self.share * est, self.floor_s), self.cap_s)


def await_grammars(futures: list[Future], timeout_s: float) -> list[bool]:
    """Wait until every future in ``futures`` (:class:`PendingGrammar`) is done, at most ``timeout_s``
    seconds in all (the GIL is released meanwhile: the watcher thread resolves them). Returns, per future,
    whether it holds a grammar now (done and not a :class:`CompileRefused` or other exception result)."""
    deadline = time.perf_counter() + max(timeout_s, 0.0)
    for f in futures:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        try:
            f.result(timeout=left)
        except Exception:  # noqa: BLE001 - a timeout or a failed future: judged below
            pass
    out = []
    for f in futures:
        ok = False
        if f.done() and not f.cancelled() and f.exception() is None:
            ok = not isinstance(f.result(), BaseException)
        out.append(ok)
    return out


class CheckQueue:
    """The compile checks of this API server that are not quick (:func:`worth_overlapping`) and have not
    ended, counted on its event loop (the handlers that start and end them run there: no lock), so that a
    request of a burst can see that its compile will wait behind others before any of them has reached
    a compile process."""

    def __init__(self) -> None:
        self.in_flight = 0

    @contextlib.contextmanager
    def held(self):
        """Count one check while the ``with`` block runs."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def starts_soon(self) -> bool:
        """Whether a new check would start at once or right after the compiles running now: fewer checks
        in flight than twice the compiles the compile processes run at once
        (:func:`compiler.service.default_parallel`)."""
        from vllm_fst_backend.compiler.service import default_parallel

        return self.in_flight < 2 * default_parallel()


CHECKS = CheckQueue()


def overlap_queued() -> bool:
    """``$VLLM_FST_OVERLAP_QUEUED`` (default off): also a request whose compile waits behind others
    enters the engine at once (:func:`overlap_now`)."""
    return env_flag("VLLM_FST_OVERLAP_QUEUED", False)


def overlap_now() -> bool:
    """Whether a request whose constraint is worth overlapping (:func:`worth_overlapping`) enters the engine
    now, while its compile check runs: overlap on (:func:`overlap_enabled`) and its compile starting at
    once or right after those running (:meth:`CheckQueue.starts_soon`), unless :func:`overlap_queued`.
    A request whose compile waits behind others (a burst of new constraints) enters the engine once it
    has compiled: entered at once, it would be prefilled, in arrival order, while the grammars come in
    shortest-first order, and a request prefilled before its grammar came loses its first sample and
    takes one more step (on 2 CPUs, up to a 1.4 s step of 2,048 prompt tokens); those prefills also take
    CPU from the compiles. Measured on the serving workload (docs/architecture.md, "Overlap of compile
    and prefill")."""
    return overlap_enabled() and (overlap_queued() or CHECKS.starts_soon())


def worth_overlapping(kind: str, spec: Any) -> bool:
    """Whether a constraint's request should enter the engine before its compile ends: not for a quick
    one (a short regex or choice list, ``compiler.service`` "quick": a few ms of compile), which is
    compiled before the engine's next step could start its prefill; overlapping it would only risk the
    request one more step (its prompt's last token, computed again or for the first time once the grammar
    is there)."""
    from vllm_fst_backend.compiler.service import QUICK_COST, cost_hint

    return not (kind in ("REGEX", "CHOICE") and cost_hint(kind, spec) <= QUICK_COST)


def markers() -> PendingMarkers | None:
    """This API server's markers under the host's disk cache directory, or None when the disk cache is
    off (then nothing is overlapped: the engine could not load the automaton the check compiles)."""
    global _MARKERS
    if _MARKERS is None:
        with _MARKERS_LOCK:
            if _MARKERS is None:
                directory = cache_marker_dir()
                _MARKERS = PendingMarkers(directory) if directory is not None else False  # type: ignore[assignment]
    return _MARKERS or None


def cache_marker_dir() -> Path | None:
    """:func:`pending_dir` of the served disk cache, or None when it is disabled or misconfigured."""
    from vllm_fst_backend.compiler.persist import disk_cache_from_env
    from vllm_fst_backend.errors import InvalidOptionError

    try:
        disk = disk_cache_from_env()
    except InvalidOptionError:
        return None
    return pending_dir(disk.directory) if disk is not None else None
