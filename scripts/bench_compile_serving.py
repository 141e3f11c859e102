#!/usr/bin/env python
"""Cold compile of the serving workload's constraints, stage by stage: where fst's compile time goes.

The constraints are those of ``bench_e2e.py --workloads serving`` (``make_serving_cases``: tool-calling
JSON schemas and regexes, fixed seed), each compiled ``--repeats`` times from scratch (no cache) for
SmolLM2 in canonical mode, as the compile process of a server does it. For each constraint the median
run's stage times (``CompiledAutomaton.stats``) are kept; the table gives the compile time p50 / p90 / max
over the constraints and the sum of each stage over all of them (character DFA, byte DFA, token DFA
(the trie walk and the group merge), canonical dead-end analysis, rows, explicit enumeration), plus
xgrammar's cold compile of the same constraints for context (``compile_json_schema`` /
``compile_regex``, cache off, one thread).

Writes the table into ``docs/benchmarks.md`` (section "Compile stages of the serving constraints") unless
``--no-write``.

Usage: python scripts/bench_compile_serving.py [--requests 24] [--repeats 3] [--no-xgrammar] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STAGES = [("ms_char", "character DFA"), ("ms_byte", "byte DFA"), ("ms_token", "token DFA"),
          ("ms_deadend", "dead-end analysis"), ("ms_rows", "rows"), ("ms_explicit", "explicit enumeration")]


def serving_constraints(n: int) -> list[tuple[str, str, object]]:
    """``(name, kind, spec)`` of the first ``n`` serving cases (kind ``json``: a schema; ``regex``)."""
    from scripts.bench_e2e import make_serving_cases

    return [(c.name, c.kind, c.spec) for c in make_serving_cases(n)]


def fst_regex(kind: str, spec) -> str:
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex

    return json_schema_to_regex(spec) if kind == "json" else spec


def measure_fst(cases, arts, repeats: int) -> list[dict]:
    """Per constraint: the stats of the median-time compile of ``repeats`` cold compiles."""
    from vllm_fst_backend.compiler import compile_regex, prepare

    prepare(arts)
    out = []
    for name, kind, spec in cases:
        rx = fst_regex(kind, spec)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a = compile_regex(rx, arts)
            runs.append((time.perf_counter() - t0, a.stats))
        runs.sort(key=lambda r: r[0])
        dt, st = runs[len(runs) // 2]
        out.append({"name": name, "kind": kind, "ms": 1e3 * dt, "regex_chars": len(rx),
                    "byte_states": st.get("byte_states"), "mode": st.get("mode", "explicit"),
                    **{k: float(st.get(k, 0.0)) for k, _ in STAGES}})
    return out


def measure_xgrammar(cases, tokenizer: str, V: int, repeats: int) -> list[float] | None:
    """xgrammar cold compile ms (median of ``repeats``) per constraint, or None without xgrammar."""
    try:
        import xgrammar as xgr
        from transformers import AutoTokenizer
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tokenizer), vocab_size=V)
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out = []
    for _, kind, spec in cases:
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if kind == "json":
                comp.compile_json_schema(json.dumps(spec), any_whitespace=False)
            else:
                comp.compile_regex(spec)
            ts.append(time.perf_counter() - t0)
        out.append(1e3 * statistics.median(ts))
    return out


def table(rows: list[dict], xgr_ms: list[float] | None) -> str:
    ms = np.array([r["ms"] for r in rows])
    lines = ["| constraints | compile p50 / p90 / max ms | sum ms | " + " | ".join(f"{label} (sum ms)" for _, label in STAGES)
             + " | xgrammar compile p50 / p90 / max ms, sum |",
             "|---|---|---|" + "---|" * len(STAGES) + "---|"]
    sums = [sum(r[k] for r in rows) for k, _ in STAGES]
    x = ("n/a" if xgr_ms is None else
         f"{np.percentile(xgr_ms, 50):.1f} / {np.percentile(xgr_ms, 90):.1f} / {max(xgr_ms):.1f}, {sum(xgr_ms):.0f}")
    lines.append(f"| {len(rows)} ({sum(r['kind'] == 'json' for r in rows)} JSON schemas) | {np.percentile(ms, 50):.1f} / "
                 f"{np.percentile(ms, 90):.1f} / {ms.max():.1f} | {ms.sum():.0f} | " + " | ".join(f"{s:.0f}" for s in sums)
                 + f" | {x} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--artifacts", default=None, help="artifacts dir (default tokenizer_artifacts/<name>, built if stale)")
    ap.add_argument("--requests", type=int, default=24, help="number of serving constraints (a prefix of the list)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-xgrammar", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print only; do not touch docs/benchmarks.md")
    args = ap.parse_args(argv)

    from vllm_fst_backend.artifacts.build import build_artifacts, default_name

    art_dir = args.artifacts or str(ROOT / "tokenizer_artifacts" / default_name(args.tokenizer))
    arts, _ = build_artifacts(args.tokenizer, art_dir, progress=False)
    cases = serving_constraints(args.requests)
    rows = measure_fst(cases, arts, args.repeats)
    for r in sorted(rows, key=lambda r: -r["ms"]):
        print(f"{r['name']:28s} {r['kind']:5s} {r['ms']:8.1f} ms  byte states {r['byte_states']}  {r['mode']:9s} "
              + "  ".join(f"{k[3:]} {r[k]:.1f}" for k, _ in STAGES), flush=True)
    xgr_ms = None if args.no_xgrammar else measure_xgrammar(cases, args.tokenizer, int(arts.vocab_size), args.repeats)
    body = table(rows, xgr_ms)
    print(body)
    if args.no_write:
        return 0
    from scripts.bench_common import write_section

    cmd = "python scripts/bench_compile_serving.py " + " ".join(argv if argv is not None else sys.argv[1:])
    slow = sorted(rows, key=lambda r: -r["ms"])[:3]
    note = (f"Tokenizer `{args.tokenizer}`, canonical mode (the default), no compile cache: the first {args.requests} "
            f"constraints of the serving workload (seed of `make_serving_cases`), each the median of {args.repeats} "
            "cold compiles in one process (per-tokenizer preparation done once, outside). The stage sums add up to "
            "the compile sum less parsing and bookkeeping. Slowest: "
            + ", ".join(f"`{r['name']}` {r['ms']:.0f} ms ({r['byte_states']} byte states)" for r in slow)
            + f". Host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end of the run.")
    write_section("Compile stages of the serving constraints", cmd.strip(), body, note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
