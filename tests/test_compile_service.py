"""The host-shared disk cache of compiled automata (``compiler/persist.py``) and the isolated compile
process (``compiler/service.py``), on the real SmolLM2 tokenizer with canonical artifacts.

* A stored automaton loaded in another process state gives the same rows, successors and accepting
  states along random walks as the one compiled (explicit and factored modes).
* The key separates regexes, options and tokenizers; the directory stays within its byte budget.
* The compile process returns the compiler's named errors with their attributes, enforces the memory
  budget and the time budget by stopping the process, and keeps serving afterwards.
"""

from __future__ import annotations

import json
import numpy as np
import pytest

from vllm_fst_backend.compiler import CompileBudgets, CompileOptions, compile_regex
from vllm_fst_backend.compiler import persist
from vllm_fst_backend.errors import (
    CompileBudgetError,
    CompileMemoryError,
    InputTooLargeError,
    RegexSyntaxError,
    UnsupportedSchemaError,
)

REGEXES = [
    r"(yes|no|maybe)",  # explicit
    r"\d{4}-\d{2}-\d{2}",  # explicit
    r'\{"name": "[A-Za-z ]{1,20}", "age": [0-9]{1,3}\}',
    r'"[^"\\]{0,40}"',  # factored
    r"[^\n]{1,200}",  # factored
]


@pytest.fixture(scope="module")
def smol(built_artifacts, smollm2_dir):
    from vllm_fst_backend.artifacts.store import load_artifacts

    d = built_artifacts("smollm2", canonical=True)
    return d, load_artifacts(d, tokenizer_path=smollm2_dir), smollm2_dir


def _row(c, state):
    return c.factored.row(state) if c.mode == "factored" else c.allowed_row(state)


def _walk_signature(c, rng, steps=40):
    """Rows, accepting flags and successors along a random walk (tokens chosen from each row)."""
    out = []
    state = 0
    for _ in range(steps):
        row = np.asarray(_row(c, state))
        out.append(row.tobytes())
        out.append(bool(c.is_accepting(state)))
        bits = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        bits = np.array([b for b in bits.tolist() if not c.is_eos(b)])
        if not len(bits):
            break
        tok = int(rng.choice(bits))
        nxt = c.next_state(state, tok)
        out.append((tok, nxt))
        state = nxt
    return out


@pytest.mark.parametrize("canonical", [True, False])
def test_round_trip_same_automaton(smol, canonical):
    _, art, _ = smol
    opts = CompileOptions(canonical=canonical)
    modes = set()
    for rx in REGEXES:
        c = compile_regex(rx, art, opts, budgets=CompileBudgets(time_budget_s=60))
        data = persist.dumps(c)
        c2 = persist.loads(data, art)
        assert c2 is not c and c2.mode == c.mode
        modes.add(c.mode)
        if c.mode == "factored":  # the dead-end tables come back from their packed, deduplicated form
            an, an2 = c.factored.an, c2.factored.an
            assert np.array_equal(an.tag, an2.tag)
            for b, b2 in zip(an.bad, an2.bad):
                assert (b is None and b2 is None) or np.array_equal(b, b2)
            assert np.array_equal(an._tag_table(), an2._tag_table())
            for st in range(0, an.M.num_states, max(1, an.M.num_states // 16)):  # rows from the rebuilt tables
                assert np.array_equal(an.regular_row_packed(st), an2.regular_row_packed(st)), (rx, st)
            assert len(data) < 8 << 20, len(data)  # no memo tables or row memo; special-token tables only small ones
        for seed in range(3):
            assert _walk_signature(c, np.random.default_rng(seed)) == _walk_signature(c2, np.random.default_rng(seed)), rx
    if canonical:
        assert modes == {"explicit", "factored"}  # both representations went through the store



def test_disk_cache_scans_for_eviction_once_it_wrote_a_share_of_its_budget(tmp_path, monkeypatch):
    """A scan of the directory (it stats every stored file) runs once this process has written
    max_bytes / EVICT_SHARE bytes since its last one, not at every store: in a long-running server a scan
    per store put 12 ms (3,000 files) on every compile's path. The compile process stores without the
    scan and calls maybe_evict after its reply. A scan evicts the least recently written files down to
    the budget."""
    import os
    import time as _time

    monkeypatch.setattr(persist, "dumps", lambda compiled: b"x" * compiled)  # an "automaton" of n bytes
    cache = persist.DiskCache(tmp_path / "c", max_bytes=persist.DiskCache.EVICT_SHARE * 1000)
    for i in range(9):  # 900 bytes written: not due
        assert cache.store(f"k{i}", 100) == 100
    assert cache.scans == 0
    assert cache.store("k9", 100, evict=False) == 100 and cache.scans == 0  # due, but asked not to scan
    assert cache.maybe_evict() and cache.scans == 1 and not cache.maybe_evict()
    cache.store_regex("r0", "y" * 1000)  # the schemas' regexes count too
    assert cache.maybe_evict() and cache.scans == 2
    # over the budget: the oldest files go at the next scan
    big = cache.max_bytes // 4
    for i in range(6):
        cache.store(f"b{i}", big, evict=False)
        path = tmp_path / "c" / f"b{i}.pkl"
        os.utime(path, (_time.time() - 100 + i, _time.time() - 100 + i))
    assert cache.nbytes() > cache.max_bytes
    assert cache.maybe_evict()
    assert cache.nbytes() <= cache.max_bytes
    assert not (tmp_path / "c" / "b0.pkl").exists() and (tmp_path / "c" / "b5.pkl").exists()

def test_disk_cache_keys_and_budget(smol, tmp_path):
    _, art, _ = smol
    compiled = [compile_regex(rx, art, CompileOptions(), budgets=CompileBudgets(time_budget_s=60)) for rx in REGEXES]
    sizes = [len(persist.dumps(c)) for c in compiled]
    assert all(s > 0 for s in sizes)
    # a budget that holds the largest file but not all of them
    cache = persist.DiskCache(tmp_path / "c", max_bytes=max(max(sizes), sum(sizes) // 2))
    k1 = cache.key("(a|b)", CompileOptions(), art)
    assert k1 != cache.key("(a|c)", CompileOptions(), art)
    assert k1 != cache.key("(a|b)", CompileOptions(canonical=False), art)
    assert cache.load(k1, art) is None
    for rx, c, size in zip(REGEXES, compiled, sizes):
        assert cache.store(cache.key(rx, CompileOptions(), art), c) == size
        assert cache.nbytes() <= cache.max_bytes
    assert sum(sizes) > cache.max_bytes  # the budget forced evictions
    assert len(list((tmp_path / "c").glob("*.pkl"))) < len(REGEXES)
    assert cache.load(cache.key(REGEXES[-1], CompileOptions(), art), art) is not None  # newest kept
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700
    # max_bytes: a larger file is not loaded; a load touches (LRU) only a file older than TOUCH_AFTER_S
    key = cache.key(REGEXES[-1], CompileOptions(), art)
    path = tmp_path / "c" / f"{key}.pkl"
    size = path.stat().st_size
    assert cache.load(key, art, max_bytes=size - 1) is None and cache.load(key, art, max_bytes=size) is not None
    import os
    import time as _time

    old = _time.time() - 2 * cache.TOUCH_AFTER_S
    os.utime(path, (old, old))
    assert cache.load(key, art) is not None and path.stat().st_mtime > _time.time() - 30  # touched
    recent = _time.time() - 5
    os.utime(path, (recent, recent))
    assert cache.load(key, art) is not None and abs(path.stat().st_mtime - recent) < 1e-3  # left alone


@pytest.fixture(scope="module")
def service(smol, tmp_path_factory):
    from vllm_fst_backend.compiler.service import CompileService

    d, _, tok = smol
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_FST_DISK_CACHE_DIR", str(tmp_path_factory.mktemp("disk")))
    svc = CompileService(d, str(tok), workers=1)
    svc.start()
    yield svc
    svc.close()
    mp.undo()


def test_service_compiles_into_the_disk_cache(service, smol):
    _, art, _ = smol
    r = service.check("JSON", {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
                               "required": ["b", "a"], "additionalProperties": False}, budget_s=30)
    assert r.regex.index('"b"') < r.regex.index('"a"')  # schema order
    assert not r.cache_hit and r.ms > 0
    again = service.check("JSON", {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
                                   "required": ["b", "a"], "additionalProperties": False}, budget_s=30)
    assert again.cache_hit and again.regex == r.regex
    disk = persist.disk_cache_from_env()
    c = disk.load(disk.key(r.regex, CompileOptions(), art), art)
    assert c is not None and _row(c, 0).any()


def test_schema_regex_converted_once_per_host(service, monkeypatch):
    """The compile process stores a JSON schema's regex on the host; another process (the engine core,
    a worker) takes it from there with the schema as vLLM keys it (``json.dumps`` of the dict) instead of
    converting again. The key holds the whitespace pattern and the limits; errors are not stored."""
    from vllm_fst_backend.compiler import constraints
    from vllm_fst_backend.compiler.limits import InputLimits

    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                               "n": {"type": "integer", "minimum": 1, "maximum": 12}},
              "required": ["when", "n"], "additionalProperties": False}
    r = service.check("JSON", schema, budget_s=30)
    disk = persist.disk_cache_from_env()
    assert list(disk.directory.glob("*.rx"))

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(constraints, "json_schema_to_regex", no_conversion)
    assert constraints.constraint_to_regex("JSON", json.dumps(schema), disk=disk) == r.regex
    # anything else the conversion reads is part of the key: converted (here: refused by the stub)
    with pytest.raises(AssertionError, match="converted again"):
        constraints.constraint_to_regex("JSON", json.dumps(schema), "[ ]?", disk=disk)
    with pytest.raises(AssertionError, match="converted again"):
        constraints.constraint_to_regex("JSON", json.dumps(schema), limits=InputLimits(max_regex_chars=10**6),
                                        disk=disk)
    with pytest.raises(AssertionError, match="converted again"):
        constraints.constraint_to_regex("JSON", json.dumps({**schema, "required": ["n"]}), disk=disk)
    monkeypatch.undo()
    # a refused schema leaves nothing behind: the next process raises the same error
    n = len(list(disk.directory.glob("*.rx")))
    with pytest.raises(UnsupportedSchemaError):
        constraints.constraint_to_regex("JSON", {"type": "object", "properties": {"a": {"$ref": "#"}}}, disk=disk)
    assert len(list(disk.directory.glob("*.rx"))) == n


def test_service_returns_named_errors(service):
    with pytest.raises(RegexSyntaxError) as e:
        service.check("REGEX", "(ab", budget_s=10)
    assert e.value.position == 3
    with pytest.raises(InputTooLargeError) as e2:
        service.check("REGEX", "a" * 200_001, budget_s=10)
    assert e2.value.limit_name == "max_regex_chars" and e2.value.measured == 200_001
    with pytest.raises(UnsupportedSchemaError) as e3:
        service.check("JSON", {"type": "string", "not": {"pattern": "^\\d"}}, budget_s=10)  # (\d: ECMA vs Python)
    assert e3.value.keyword == "not"
    with pytest.raises(CompileBudgetError, match="states"):
        service.check("REGEX", r"(a|b)*a(a|b){20}", budget_s=10)
    assert service.check("CHOICE", ["x", "y"], budget_s=10).regex == "(x|y)"


def _priorities(svc) -> list[int]:
    import os

    with svc._cond:
        pids = [w.proc.pid for w in svc._idle]
    return [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids]


def test_compile_processes_run_at_a_lower_cpu_priority(service, smol, monkeypatch):
    """The children take the CPU the model, the engine core and the API server leave (``nice`` +10 by
    default, ``$VLLM_FST_COMPILE_NICE``; 0 keeps the parent's priority); a malformed setting is a named
    error at start-up."""
    import os

    from vllm_fst_backend.compiler.service import CompileService, nice_from_env
    from vllm_fst_backend.errors import InvalidOptionError

    assert service.check("REGEX", "(on|off)", budget_s=30).regex == "(on|off)"
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    prios = _priorities(service)
    assert len(prios) == 2 and prios == [min(mine + 10, 19)] * 2
    monkeypatch.setenv("VLLM_FST_COMPILE_NICE", "0")
    assert nice_from_env() == 0
    d, _, tok = smol
    svc = CompileService(d, str(tok), workers=1, quick_workers=0)
    try:
        assert svc.check("REGEX", "(up|down)", budget_s=30).regex == "(up|down)"
        assert _priorities(svc) == [mine]
    finally:
        svc.close()
    for bad in ("20", "-1", "low"):
        monkeypatch.setenv("VLLM_FST_COMPILE_NICE", bad)
        with pytest.raises(InvalidOptionError, match="VLLM_FST_COMPILE_NICE"):
            CompileService(d, str(tok), workers=1)
    with pytest.raises(InvalidOptionError, match="nice"):
        CompileService(d, str(tok), workers=1, nice=25)


def test_service_memory_and_time_budgets_stop_the_process(smol):
    from vllm_fst_backend.compiler.service import CompileService

    d, _, tok = smol
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_FST_DISK_CACHE", "0")
    try:
        svc = CompileService(d, str(tok), workers=1, memory_budget_bytes=4 << 20)
        with pytest.raises(CompileMemoryError, match="memory budget of 4 MB"):  # ~65 MB private at its peak
            svc.check("REGEX", r"[^\n]{1,1000}", budget_s=30)
        svc.memory_budget = 2 << 30
        assert svc.check("REGEX", "(yes|no)", budget_s=30).regex == "(yes|no)"  # a fresh process serves
        svc.deadline_margin_s = -29.99  # wait 10 ms past nothing: the process is stopped mid-compile
        with pytest.raises(CompileBudgetError, match="time budget of 30 s.*stopped"):
            svc.check("REGEX", r"[^\n]{1,1000}", budget_s=30)  # (~0.2 s: 8,000 byte states)
        svc.deadline_margin_s = 2.0
        assert svc.check("REGEX", "(a|b)", budget_s=30).regex == "(a|b)"
        assert svc.restarts == 2
        svc.close()
    finally:
        mp.undo()


def test_cost_hint_counts_bounded_repetitions():
    from vllm_fst_backend.compiler.service import LIGHT_COST, cost_hint

    assert cost_hint("REGEX", "(yes|no)") == len("(yes|no)")
    assert cost_hint("REGEX", r'"[^"]{0,48}"') == len(r'"[^"]{0,48}"') + 20 * 48
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 40}}}
    assert cost_hint("JSON", schema) == len(json.dumps(schema)) + 20 * 40
    assert cost_hint("CHOICE", ["x", "y"]) <= LIGHT_COST < cost_hint("REGEX", r"[a-z]{1,100}")


class _FakeWorker:
    def alive(self):
        return True

    def kill(self):
        pass


def _pool(workers, parallel=None, stall_s=60.0):
    from vllm_fst_backend.compiler.service import CompileService

    svc = CompileService("unused", None, workers=workers, light_cost=100,
                         parallel=workers if parallel is None else parallel, stall_s=stall_s)
    svc._spawn = _FakeWorker  # scheduling only: no child processes
    return svc


def _acquire_in_thread(svc, cost, got):
    import threading

    def run():
        w = svc._acquire(cost)
        got.append((cost, w))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_for(cond, timeout=10.0):
    import time as _t

    end = _t.monotonic() + timeout
    while not cond():
        assert _t.monotonic() < end, "timed out"
        _t.sleep(0.005)


def test_service_schedules_light_constraints_past_heavy_ones():
    svc = _pool(workers=2)  # heavy constraints may hold one process at a time
    heavy1 = svc._acquire(5000)
    got: list = []
    _acquire_in_thread(svc, 6000, got)  # second heavy one: waits though a process is free
    _wait_for(lambda: len(svc._waiting) == 1)
    assert got == []
    _acquire_in_thread(svc, 10, got)  # a light one takes the free process at once
    _wait_for(lambda: len(got) == 1)
    assert got[0][0] == 10
    svc._release(heavy1, 5000)  # the heavy one goes next
    _wait_for(lambda: len(got) == 2)
    assert got[1][0] == 6000 and svc._n_heavy == 1


def test_service_keeps_a_process_for_quick_constraints():
    """One process beyond ``workers`` serves quick constraints (a short regex or choice) only: with the
    general process busy, another schema waits while a quick regex starts at once; a quick one may also
    take the general process."""
    svc = _pool(workers=1)
    assert svc.n_workers == 2 and svc.quick("REGEX", 300) and svc.quick("CHOICE", 40)
    assert not svc.quick("JSON", 50) and not svc.quick("REGEX", 1000)
    slow = svc._acquire(90)
    got: list = []
    _acquire_in_thread(svc, 80, got)  # a second schema: waits for the general process
    _wait_for(lambda: len(svc._waiting) == 1)
    w = svc._acquire(30, quick=True)  # the quick lane, at once
    assert got == [] and svc._n_slow == 1
    svc._release(w, 30, quick=True)
    svc._release(slow, 90)
    _wait_for(lambda: len(got) == 1)
    q1 = svc._acquire(20, quick=True)  # both processes busy now: one with the schema, one with q1
    got2: list = []

    def run():
        got2.append(svc._acquire(25, quick=True))

    import threading

    t = threading.Thread(target=run, daemon=True)
    t.start()
    _wait_for(lambda: len(svc._waiting) == 1)
    svc._release(got[0][1], 80)  # the general process is free: the waiting quick one takes it
    _wait_for(lambda: len(got2) == 1)
    svc._release(q1, 20, quick=True)
    svc._release(got2[0], 25, quick=True)
    assert svc._n_slow == 0 and svc._n_heavy == 0


def test_service_serves_waiting_requests_shortest_first():
    svc = _pool(workers=1)
    first = svc._acquire(50)
    got: list = []
    for cost in (90, 70, 20):
        _acquire_in_thread(svc, cost, got)
        _wait_for(lambda c=cost: any(e[0] == c for e in svc._waiting))
    svc._release(first, 50)
    for n in (1, 2, 3):
        _wait_for(lambda n=n: len(got) == n)
        svc._release(got[-1][1], got[-1][0])
    assert [c for c, _ in got] == [20, 70, 90]


def test_service_runs_one_compile_at_a_time_until_it_stalls():
    """With ``parallel=1`` a second schema waits for the first though a process is free (compiles side by
    side only share the free CPU), and starts beside it once the first has run ``stall_s``; quick ones
    never wait for that. The default takes half the CPUs this process may use."""
    import os
    import time as _t

    from vllm_fst_backend.compiler.service import default_parallel

    assert default_parallel() == max(1, len(os.sched_getaffinity(0)) // 2)
    svc = _pool(workers=3, parallel=1, stall_s=0.3)
    assert svc.parallel == 1
    first = svc._acquire(50)
    t0 = _t.monotonic()
    got: list = []
    _acquire_in_thread(svc, 60, got)
    _wait_for(lambda: len(svc._waiting) == 1)
    q = svc._acquire(10, quick=True)  # the quick lane is not held back
    svc._release(q, 10, quick=True)
    assert got == []
    _wait_for(lambda: len(got) == 1)  # the first one stalled: the second starts beside it
    assert _t.monotonic() - t0 >= 0.29 and svc._n_slow == 2
    _acquire_in_thread(svc, 70, got)  # the second one is young: a third waits ...
    _wait_for(lambda: len(svc._waiting) == 1)
    assert len(got) == 1
    svc._release(got[0][1], 60)  # ... until it finishes (the stalled first one does not count)
    _wait_for(lambda: len(got) == 2)
    svc._release(got[1][1], 70)
    svc._release(first, 50)
    assert svc._n_slow == 0 and svc._running == {}


def test_compile_process_settles_its_heap_only_while_idle():
    """The compile process freezes the objects that survive a request (``settle_heap``) only while no
    request waits on its pipe, so that the collector's traversal of its long-lived heap never runs inside
    a compile; a thaw every ``REFREEZE_EVERY`` replies lets reference cycles among frozen objects go."""
    import gc
    import os
    import weakref

    from vllm_fst_backend.compiler import service

    class Node:
        pass

    r, w = os.pipe()
    try:
        with os.fdopen(r, "rb", buffering=0) as rf:
            gc.unfreeze()
            os.write(w, b"x")  # a request waits: nothing is frozen
            service._settle_when_idle(rf, 1)
            assert gc.get_freeze_count() == 0
            rf.read(1)
            service._settle_when_idle(rf, 1)  # idle: the survivors are frozen
            assert gc.get_freeze_count() > 0
            a, b = Node(), Node()
            a.other, b.other = b, a  # a cycle, frozen while alive
            gone = weakref.ref(a)
            service.settle_heap()
            del a, b
            gc.collect()
            assert gone() is not None  # frozen: no collection sees it
            service._settle_when_idle(rf, service.REFREEZE_EVERY)  # the periodic thaw collects it
            assert gone() is None
    finally:
        os.close(w)
        gc.unfreeze()
