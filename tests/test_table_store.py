"""The host-shared store of per-tokenizer compiler tables (``compiler/table_store.py``), on the real
SmolLM2 tokenizer with canonical artifacts.

* The first process builds and stores the tables, later ones map them (copy-on-write memory maps);
  the mapped tables equal the built ones array for array; the helper keeps only its banned matrix
  mapped; automata compiled with them have the same rows and successors along random walks as with
  tables built in-process.
* Invalid stores (a truncated array, a wrong shape) are rebuilt, older versions of a tokenizer's tables
  are removed, a root without room is not written, and of two processes starting together exactly one
  builds.
* The compile process's memory budget counts private memory only, not mapped tables.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from vllm_fst_backend.compiler import CompileBudgets, compile_regex, table_store
from vllm_fst_backend.compiler.canonical_product import CanonHelper, canonical_helper
from vllm_fst_backend.compiler.token_trie import trie_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smol(built_artifacts, smollm2_dir):
    return built_artifacts("smollm2", canonical=True), smollm2_dir


def _fresh(smol):
    from vllm_fst_backend.artifacts.store import load_artifacts

    d, tok = smol
    return load_artifacts(d, tokenizer_path=tok)


def _build(art):
    return lambda: CanonHelper(art.canonical, trie_for(art)).table_state()


def test_store_then_map_same_tables(smol, tmp_path):
    art = _fresh(smol)
    (sc1, ar1), how1 = table_store.load_or_build("canon", art, _build(art), root=tmp_path)
    (sc2, ar2), how2 = table_store.load_or_build("canon", art, lambda: pytest.fail("rebuilt"), root=tmp_path)
    assert (how1, how2) == ("stored", "mapped")
    ref_sc, ref_ar = CanonHelper(art.canonical, trie_for(art)).table_state()
    assert sc2 == json.loads(json.dumps(ref_sc)) and set(ar2) == set(ref_ar)
    assert "bt" in ar2 and ar2["bt"].shape == (ref_sc["W"], ref_sc["C"])
    for k, a in ref_ar.items():
        assert ar2[k].dtype == a.dtype and np.array_equal(ar2[k], a), k
        assert ar2[k].flags.writeable  # copy-on-write: numba types it like an in-memory array
    # mapped, not read into private memory: the array's memory is a file mapping
    base = ar2["bt"]
    while getattr(base, "base", None) is not None and not isinstance(base, __import__("mmap").mmap):
        base = base.base
    assert isinstance(base, __import__("mmap").mmap)


def _walk(c, seed, steps=40):
    rng = np.random.default_rng(seed)
    out, state = [], 0
    for _ in range(steps):
        row = np.asarray(c.factored.row(state) if c.mode == "factored" else c.allowed_row(state))
        out.append(row.tobytes())
        bits = [b for b in np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist()
                if not c.is_eos(b)]
        if not bits:
            break
        tok = int(rng.choice(bits))
        state = c.next_state(state, tok)
        out.append((tok, state))
    return out


@pytest.mark.parametrize("regex", [r'"[^"\\]{0,40}"', r'\{"name": "[A-Za-z ]{1,20}", "age": [0-9]{1,3}\}',
                                   r"(yes|no|maybe)"])
def test_compile_with_mapped_tables_equals_built(smol, tmp_path, monkeypatch, regex):
    monkeypatch.setenv("VLLM_FST_SHARED_TABLES_DIR", str(tmp_path))
    a_store, a_map = _fresh(smol), _fresh(smol)
    canonical_helper(a_store, trie_for(a_store))  # builds and stores
    h_map = canonical_helper(a_map, trie_for(a_map))  # maps
    assert isinstance(h_map.bt.base, np.memmap)  # mapped from the store, not built
    # the tables the decode-step kernels read at random are the process's own copies (not mapped)
    for name in ("la_sets_idx", "tclass", "sigma_rows", "ctx_classes"):
        arr = getattr(h_map, name)
        assert not isinstance(arr.base, np.memmap) and not isinstance(arr, np.memmap), name
    monkeypatch.setenv("VLLM_FST_SHARED_TABLES", "0")
    a_built = _fresh(smol)
    canonical_helper(a_built, trie_for(a_built))
    b = CompileBudgets(time_budget_s=60)
    c_map, c_built = compile_regex(regex, a_map, budgets=b), compile_regex(regex, a_built, budgets=b)
    assert c_map.mode == c_built.mode
    for seed in range(3):
        assert _walk(c_map, seed) == _walk(c_built, seed)


def test_invalid_store_is_rebuilt_and_old_versions_removed(smol, tmp_path):
    art = _fresh(smol)
    calls = []

    def build():
        calls.append(1)
        return _build(art)()

    prefix, name = table_store._name("canon", art)
    old = tmp_path / (prefix + "0" * 24)
    old.mkdir(mode=0o700)
    (old / "meta.json").write_text("{}")
    table_store.load_or_build("canon", art, build, root=tmp_path)
    assert not old.exists() and (tmp_path / name).is_dir()
    # a truncated array, then a shape that does not match the metadata: both rebuilt
    bt = tmp_path / name / "bt.npy"
    bt.write_bytes(bt.read_bytes()[:1000])
    (_, ar), how = table_store.load_or_build("canon", art, build, root=tmp_path)
    assert how == "stored" and len(calls) == 2 and ar["bt"].size > 1000
    meta = json.loads((tmp_path / name / "meta.json").read_text())
    meta["arrays"]["tclass"][1] = [1]
    (tmp_path / name / "meta.json").write_text(json.dumps(meta))
    _, how = table_store.load_or_build("canon", art, build, root=tmp_path)
    assert how == "stored" and len(calls) == 3


def test_no_room_and_store_off(smol, tmp_path, monkeypatch):
    art = _fresh(smol)

    class Usage:
        free = 10 << 20

    monkeypatch.setattr(table_store.shutil, "disk_usage", lambda p: Usage())
    _, how = table_store.load_or_build("canon", art, _build(art), root=tmp_path)
    assert how == "built" and not any(p.name.startswith("canon") for p in tmp_path.iterdir())
    monkeypatch.setenv("VLLM_FST_SHARED_TABLES", "off")
    assert table_store.shared_tables_root() is None


def test_two_processes_build_once(tmp_path):
    """Two processes asking at once: one builds (under the lock), the other waits and maps its copy."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import numpy as np
        from pathlib import Path
        from vllm_fst_backend.compiler import table_store

        class Art:
            fingerprint = "f" * 64
            manifest = {{"files": {{"x.npy": "abc"}}}}

        def build():
            time.sleep(1.0)
            return {{"n": 3}}, {{"a": np.arange(1 << 20, dtype=np.int32)}}

        (sc, ar), how = table_store.load_or_build("test", Art(), build, root=Path({str(tmp_path)!r}))
        assert sc == {{"n": 3}} and int(ar["a"][-1]) == (1 << 20) - 1
        print(how)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["mapped", "stored"]


def test_private_memory_excludes_mapped_tables(tmp_path):
    """The compile process's budget reads private memory: mapping and reading 256 MB of a file does
    not raise it, allocating 256 MB does."""
    from vllm_fst_backend.compiler.service import _private_bytes

    f = tmp_path / "big.npy"
    np.save(f, np.ones(64 << 20, dtype=np.int32))
    script = textwrap.dedent(f"""
        import sys, numpy as np
        a = np.load({str(f)!r}, mmap_mode="c")
        int(a.sum())  # touch every page
        sys.stdout.write("mapped\\n"); sys.stdout.flush(); sys.stdin.readline()
        b = np.ones(64 << 20, dtype=np.int32)
        sys.stdout.write("allocated\\n"); sys.stdout.flush(); sys.stdin.readline()
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "mapped"
        after_map = _private_bytes(p.pid)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "allocated"
        after_alloc = _private_bytes(p.pid)
        p.stdin.write("\n")
        p.stdin.flush()
    finally:
        p.communicate(timeout=30)
    assert after_map < 200 << 20
    assert after_alloc - after_map > 200 << 20
