#!/usr/bin/env python
"""Canonical compile time of a few regexes per tokenizer (the three real ones), fst backend only.

    python scripts/bench_compile_tokenizers.py [--artifacts name=DIR ...] [--repeats N] [--no-write]

``scripts/bench_compile.py`` compares backends on SmolLM2; this one compares tokenizers, because the
canonical product's cost depends on the tokenizer's canonical filter (classes, context-dependent
tokens). Each tokenizer's artifacts are loaded once (``--artifacts name=DIR``, else
``tokenizer_artifacts/<name>``, built if missing). The per-tokenizer preparation (``compiler.prepare``:
token trie and the canonical helper's tables) is reported apart, twice, with an empty host-shared table
store (``compiler/table_store.py``, a fresh temporary root): in this process, which builds the tables
and stores them, and in a second process started afterwards, which takes them from the store (what every other
process of a server pays). Every compile runs with a 600 s budget so that slow cases are
measured rather than refused; the served default budget is 4 s (``CompileBudgets``). The last column
is the decode-step cost of a state seen for the first time (:func:`first_row_ms`). Prints a table
and writes it to docs/benchmarks.md, section "Canonical compile per tokenizer".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REGEXES = {
    "letters": r"[A-Za-z ,]{5,40}\.",
    "choice": r"(yes|no|maybe)",
    "date": r"\d{4}-\d{2}-\d{2}",
    "quoted text": r'"[^"\\]{0,40}"',
    "words": r"[a-z]+( [a-z]+){0,8}",
}


ROW_REGEX = "quoted text"


def first_row_ms(compiled, walks: int = 30, steps: int = 45, seed: int = 0) -> tuple[float, float]:
    """(p50, p99) in ms of computing an allowed-token row the first time a state is visited, over
    random walks (uniform among allowed non-EOS tokens). Factored automata compute rows on first use
    (then memoize them), so this is the decode-step cost a new state adds; explicit ones copy a stored
    row. States already seen are not timed again."""
    import numpy as np

    from vllm_fst_backend.compiler.canonical_product import ids_of_row

    rng = np.random.default_rng(seed)
    seen: set[int] = set()
    times: list[float] = []
    for _ in range(walks):
        st = 0
        for _ in range(steps):
            t = time.perf_counter()
            row = compiled.allowed_row(st)
            if st not in seen:
                times.append((time.perf_counter() - t) * 1000)
                seen.add(st)
            ids = ids_of_row(row)
            ids = ids[~np.isin(ids, compiled.eos_ids)]
            if not len(ids):
                break
            st = compiled.next_state(st, int(rng.choice(ids)))
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


def prepare_in_new_process(art_dir: Path, tok: str) -> float:
    """Seconds of ``compiler.prepare`` in a fresh Python process (imports and artifact loading excluded)."""
    import subprocess

    code = ("import sys, time; sys.path.insert(0, %r)\n"
            "from vllm_fst_backend.artifacts.store import load_artifacts\n"
            "from vllm_fst_backend.compiler import prepare\n"
            "a = load_artifacts(%r, tokenizer_path=%r)\n"
            "t = time.perf_counter(); prepare(a); print(time.perf_counter() - t)\n") % (str(ROOT), str(art_dir), str(tok))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ.copy())
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from scripts.bench_artifacts import tokenizers
    from scripts.bench_common import write_section
    from vllm_fst_backend.artifacts.build import build_artifacts
    from vllm_fst_backend.artifacts.store import load_artifacts
    import tempfile

    from vllm_fst_backend.compiler.compile import CompileBudgets, CompileOptions, compile_regex, forget_verdicts, prepare
    from vllm_fst_backend.compiler.service import settle_heap

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifacts", nargs="*", default=[], help="name=DIR (names: smollm2, mistral_v1, tekken)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    dirs = dict(a.split("=", 1) for a in args.artifacts)
    budgets = CompileBudgets(time_budget_s=600.0)
    rows = []
    for name, path in tokenizers().items():
        d = Path(dirs.get(name) or ROOT / "tokenizer_artifacts" / name)
        if not (d / "manifest.json").is_file():
            build_artifacts(path, d, progress=True)
        arts = load_artifacts(d, tokenizer_path=path)
        from vllm_fst_backend.compiler.persist import default_cache_dir

        # (next to the served default, memory-backed /dev/shm where writable)
        with tempfile.TemporaryDirectory(prefix="fst_tables_", dir=default_cache_dir().parent) as store:
            os.environ["VLLM_FST_SHARED_TABLES_DIR"] = store  # empty: this process builds and stores
            t = time.perf_counter()
            prepare(arts)
            first = (time.perf_counter() - t, prepare_in_new_process(d, path))
            settle_heap()  # (as the compile process does once prepared: compiler/service.py)
            print(name, f"preparation {first[0]:.2f} s (builds), another process {first[1]:.2f} s (takes them from the store)", flush=True)
            compile_regex("a", arts, CompileOptions(canonical=True), budgets=budgets)
        cells = {}
        for label, rx in REGEXES.items():
            ms = []
            for _ in range(args.repeats):
                forget_verdicts(arts)  # cold: no dead-end verdict of an earlier compile
                t = time.perf_counter()
                compile_regex(rx, arts, CompileOptions(canonical=True), budgets=budgets)
                ms.append((time.perf_counter() - t) * 1000)
            cells[label] = statistics.median(ms)
            print(name, label, f"{cells[label]:.0f} ms", flush=True)
        row_ms = first_row_ms(compile_regex(REGEXES[ROW_REGEX], arts, CompileOptions(canonical=True), budgets=budgets))
        print(name, "first-use row", f"p50 {row_ms[0]:.2f} ms p99 {row_ms[1]:.2f} ms", flush=True)
        rows.append((name, first, cells, row_ms))
    lines = ["| tokenizer | preparation s: first process (builds) / another process (takes them from the store) | "
             + " | ".join(f"{k} ms" for k in REGEXES)
             + f" | {ROW_REGEX} first-use row p50 / p99 ms |",
             "|" + "---|" * (3 + len(REGEXES))]
    for name, first, cells, row_ms in rows:
        lines.append(f"| {name} | {first[0]:.1f} / {first[1]:.2f} | " + " | ".join(f"{cells[k]:.0f}" for k in REGEXES)
                     + f" | {row_ms[0]:.2f} / {row_ms[1]:.2f} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        cmd = "python scripts/bench_compile_tokenizers.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section("Canonical compile per tokenizer", cmd.strip(), table,
                      note="Regexes: " + "; ".join(f"{k} = `{v}`" for k, v in REGEXES.items()) + ". "
                      f"Median of {args.repeats} compiles per cell (each one cold: no automaton cache, no dead-end verdict of an earlier compile), fst "
                      f"canonical mode, budget raised to 600 s; the served default is 4 s, so a cell above "
                      f"4000 ms is a request refused with HTTP 400. Preparation = `compiler.prepare` (token trie and "
                      f"the canonical helper's tables) with an empty host-shared table store, in this process (builds "
                      f"and stores the tables) and in a second process started afterwards (maps the banned matrix from the store and copies the smaller tables). Host: {os.cpu_count()} CPUs, load average "
                      f"{os.getloadavg()[0]:.1f} at the end.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
