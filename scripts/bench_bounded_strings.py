#!/usr/bin/env python
"""Bounded JSON strings (``maxLength`` N), which the compiler unrolls: compile time, stages and memory per
tokenizer with the served default budgets, and what the token DFA's prefixed chains save.

For each tokenizer (``--artifacts name=DIR``) and each constraint (a string of ``maxLength`` N for N in
``--lengths``, and an object of 20 required strings of ``maxLength`` 64) it prints, and writes into
``docs/benchmarks.md`` (section "Bounded strings") unless ``--no-write``:

* the canonical compile with the default budgets (``CompileBudgets()``; median of ``--repeats`` cold
  compiles, no dead-end verdict of an earlier compile), or the budget that refuses it;
* its byte states and its stages (character DFA, byte DFA, token DFA, dead-end analysis), ms;
* the token stage with the prefixed chains of the walk turned off (``_FusedWalk.use_prefixes = False``),
  median of as many compiles, alternating with the default in the same process;
* the compile's private memory: the process's unique set size after the row's compiles over its size
  before the first row (psutil), MB.

Usage: python scripts/bench_bounded_strings.py [--artifacts name=DIR ...] [--lengths 100 500 1000 1400 2000]
       [--repeats 3] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STAGES = ("ms_char", "ms_byte", "ms_token", "ms_deadend")


def constraints(lengths: list[int]) -> list[tuple[str, dict]]:
    """``(name, JSON schema)``: a string of each ``maxLength``, then an object of 20 such strings."""
    out = [(f"string, maxLength {n:,}", {"type": "string", "maxLength": n}) for n in lengths]
    out.append(("object of 20 strings, maxLength 64", {
        "type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 64} for i in range(20)},
        "required": [f"k{i}" for i in range(20)]}))
    return out


def measure(arts, regex: str, repeats: int) -> dict:
    """Median stats of ``repeats`` cold compiles with and without the prefixed chains (alternating), or
    ``{"refused": reason}``."""
    from vllm_fst_backend.compiler import compile_regex, forget_verdicts
    from vllm_fst_backend.compiler import token_dfa
    from vllm_fst_backend.errors import CompileBudgetError

    runs: dict = {True: [], False: []}
    t0 = time.perf_counter()
    try:
        for _ in range(repeats):
            for prefixes in (True, False):
                token_dfa._FusedWalk.use_prefixes = prefixes
                forget_verdicts(arts)
                t = time.perf_counter()
                a = compile_regex(regex, arts)
                runs[prefixes].append((1e3 * (time.perf_counter() - t), a.stats))
    except CompileBudgetError as e:
        return {"refused": str(e), "ms": 1e3 * (time.perf_counter() - t0)}
    finally:
        token_dfa._FusedWalk.use_prefixes = True
    on = sorted(runs[True], key=lambda r: r[0])[len(runs[True]) // 2]
    return {"ms": on[0], "byte_states": on[1]["byte_states"], **{k: on[1].get(k, 0.0) for k in STAGES},
            "token_off": statistics.median(r[1]["ms_token"] for r in runs[False])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifacts", nargs="+", default=[f"smollm2={ROOT / 'tokenizer_artifacts' / 'SmolLM2-135M-Instruct'}"],
                    help="name=DIR of built artifacts (canonical)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 500, 1000, 1400, 2000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    import psutil

    from vllm_fst_backend.artifacts.store import load_artifacts
    from vllm_fst_backend.compiler import prepare
    from vllm_fst_backend.compiler.compile import DEFAULT_BUDGETS
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex
    from vllm_fst_backend.compiler.service import settle_heap

    proc = psutil.Process()
    rows = ["| tokenizer | constraint | byte states | compile ms (default budgets) | character / byte / token / "
            "dead-end ms | token ms without prefixed chains | private memory MB |", "|---|---|---|---|---|---|---|"]
    for spec in args.artifacts:
        name, _, path = spec.partition("=")
        arts = load_artifacts(path)
        prepare(arts)
        settle_heap()  # (as the compile process does once prepared: compiler/service.py)
        base = proc.memory_full_info().uss
        for label, sch in constraints(args.lengths):
            r = measure(arts, json_schema_to_regex(sch), args.repeats)
            mem = (proc.memory_full_info().uss - base) / 2**20
            if "refused" in r:
                row = f"| {name} | {label} | – | refused after {r['ms']:.0f} ms: {r['refused']} | – | – | {mem:.0f} |"
            else:
                row = (f"| {name} | {label} | {r['byte_states']:,} | {r['ms']:.0f} | "
                       + " / ".join(f"{r[k]:.0f}" for k in STAGES) + f" | {r['token_off']:.0f} | {mem:.0f} |")
            rows.append(row)
            print(row, flush=True)
    note = (f"Canonical mode, default budgets ({DEFAULT_BUDGETS.max_positions:,} positions, "
            f"{DEFAULT_BUDGETS.max_char_states:,} character-DFA states, {DEFAULT_BUDGETS.time_budget_s:g} s). "
            f"Median of {args.repeats} cold compiles per cell, in one process per tokenizer after its "
            "preparation; the token stage without prefixed chains from as many compiles alternating with "
            "them. Private memory: the unique set size after the row's compiles over the size before the "
            "first row (what the compile process's memory budget measures; memory freed by earlier rows is "
            "partly returned, so rows are not cumulative).")
    from scripts.bench_common import report_section

    report_section("Bounded strings", "bench_bounded_strings.py", argv, "\n".join(rows), note, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
