"""A request prefills while the API server compiles its constraint (``vllm_fst_backend/vllm/pending.py``):
the markers, the engine's watcher, and the API server's held first output. The scheduler and
``grammar_init`` touch points are tested in ``test_vllm_plugin_unit.py``, the whole path on the real
server in ``test_vllm_e2e.py``."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import Future

import pytest

from vllm_fst_backend.vllm import pending

KEY = bytes(range(32))


def _wait(fut: Future, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not fut.done():
        assert time.monotonic() < deadline, "the watcher never resolved the future"
        time.sleep(0.005)
    return fut


def test_markers_begin_and_end(tmp_path):
    m = pending.PendingMarkers(pending.pending_dir(tmp_path))
    token = m.begin(KEY)
    assert token and token.startswith(KEY.hex()[:32]) and m.token_for(KEY) == token
    assert pending.marker_state(m.directory, token, 60) == "pending"
    assert oct(m.directory.stat().st_mode & 0o777) == "0o700"
    m.end(KEY, token, refused=False)
    assert m.token_for(KEY) is None and not (m.directory / token).exists()
    assert pending.marker_state(m.directory, token, 60) == "done"
    t2 = m.begin(KEY)
    m.end(KEY, t2, refused=True)
    assert pending.marker_state(m.directory, t2, 60) == "refused"
    t3 = m.begin(KEY)
    old = time.time() - 100
    os.utime(m.directory / t3, (old, old))
    assert pending.marker_state(m.directory, t3, 60) == "done"  # its API server is taken to be gone
    assert pending.wait_for_marker(m.directory, t3, 60) == "done"


def test_markers_off_when_the_directory_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("x")
    assert pending.PendingMarkers(tmp_path / "file" / "pending").begin(KEY) is None


def test_request_token_is_validated():
    class SP:
        extra_args = {pending.PENDING_ARG: "ab12-cd"}

    assert pending.request_token(SP) == "ab12-cd"
    for bad in ("../../etc/passwd", "", "a" * 200, 5, None):
        SP.extra_args = {pending.PENDING_ARG: bad}
        assert pending.request_token(SP) is None
    SP.extra_args = None
    assert pending.request_token(SP) is None


def test_watcher_resolves_from_the_cache_once_the_marker_goes(tmp_path):
    m = pending.PendingMarkers(pending.pending_dir(tmp_path))
    token = m.begin(KEY)
    cache: dict[str, str] = {}
    compiles = []
    w = pending.PendingWatcher(poll_s=0.001)
    fut = w.watch(m.directory, token, 60, load=lambda: cache.get("g"), compile_async=lambda: compiles.append(1))
    time.sleep(0.05)
    assert pending.is_pending(fut) and len(w) == 1
    cache["g"] = "grammar"  # the API server's compile stored the automaton, then removed its marker
    m.end(KEY, token, refused=False)
    assert _wait(fut).result() == "grammar" and not compiles
    assert not pending.is_pending(fut)
    deadline = time.monotonic() + 2
    while len(w) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(w) == 0


def test_watcher_compiles_on_a_miss_and_fails_refused_or_finished_requests(tmp_path):
    m = pending.PendingMarkers(pending.pending_dir(tmp_path))
    w = pending.PendingWatcher(poll_s=0.001)
    # marker gone but nothing stored (e.g. too large to load inline): vLLM's pool compiles it
    t1 = m.begin(KEY)
    pool_result: Future = Future()
    f1 = w.watch(m.directory, t1, 60, load=lambda: None, compile_async=lambda: pool_result)
    m.end(KEY, t1, refused=False)
    time.sleep(0.05)
    assert not f1.done()
    pool_result.set_result("compiled in the pool")
    assert _wait(f1).result() == "compiled in the pool"
    # refused by the API server's check: the request fails instead of being compiled
    t2 = m.begin(KEY)
    f2 = w.watch(m.directory, t2, 60, load=lambda: pytest.fail("loaded"), compile_async=lambda: pytest.fail("compiled"))
    m.end(KEY, t2, refused=True)
    with pytest.raises(pending.CompileRefused):
        _wait(f2).result()
    # the request ended first (aborted): dropped, never cancelled (vLLM re-raises CancelledError)
    t3 = m.begin(KEY)
    f3 = w.watch(m.directory, t3, 60, load=lambda: pytest.fail("loaded"), compile_async=lambda: pytest.fail("compiled"),
                 finished=lambda: True)
    assert isinstance(_wait(f3).exception(), pending.CompileRefused) and not f3.cancelled()
    # an error in load() reaches the request, and the watcher goes on
    t4 = m.begin(KEY)
    f4 = w.watch(m.directory, t4, 60, load=lambda: 1 / 0, compile_async=lambda: pytest.fail("compiled"))
    m.end(KEY, t4, refused=False)
    assert isinstance(_wait(f4).exception(), ZeroDivisionError)
    t5 = m.begin(KEY)
    f5 = w.watch(m.directory, t5, 60, load=lambda: "ok", compile_async=lambda: pytest.fail("compiled"))
    m.end(KEY, t5, refused=False)
    assert _wait(f5).result() == "ok"


def test_held_first_output_then_the_rest_or_cancelled():
    closed = []

    async def stream():
        try:
            for i in range(3):
                await asyncio.sleep(0)
                yield f"chunk{i}"
        finally:
            closed.append(True)

    async def handler_stream():
        return stream()

    async def handler_full():
        await asyncio.sleep(0)
        return {"full": 1}

    async def main():
        run = asyncio.ensure_future(pending.first_output(handler_stream()))
        out = pending.joined(await run)
        got = [x async for x in out]
        assert got == ["chunk0", "chunk1", "chunk2"] and closed == [True]
        assert pending.joined(await pending.first_output(handler_full())) == {"full": 1}
        # refused: the task is cancelled while the engine runs the request, and the stream is closed
        started = asyncio.Event()

        async def slow_stream():
            try:
                started.set()
                await asyncio.sleep(30)
                yield "never"
            finally:
                closed.append("slow")

        async def handler_slow():
            return slow_stream()

        run = asyncio.ensure_future(pending.first_output(handler_slow()))
        await started.wait()
        await pending.cancel_output(run)
        assert closed[-1] == "slow" and run.cancelled()
        # a task that finished before the verdict: its stream is closed all the same
        closed.clear()
        run = asyncio.ensure_future(pending.first_output(handler_stream()))
        await asyncio.sleep(0.01)
        assert run.done()
        await pending.cancel_output(run)
        assert closed == [True]

    asyncio.run(main())


def test_only_constraints_that_take_a_while_overlap_their_compile():
    """A quick constraint (short regex or choice list: a few ms of compile) is compiled before its request
    enters the engine; overlapping it would only cost the request a step. JSON schemas and long regexes
    overlap."""
    assert not pending.worth_overlapping("REGEX", r"\d{4}-\d{2}-\d{2}")
    assert not pending.worth_overlapping("CHOICE", ["yes", "no"])
    assert pending.worth_overlapping("JSON", {"type": "object", "properties": {"a": {"type": "string"}}})
    assert pending.worth_overlapping("JSON_OBJECT", None)
    assert pending.worth_overlapping("REGEX", "[a-z]{1,400}")  # 20 per unit of bounded repetition
