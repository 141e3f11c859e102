#!/usr/bin/env python
"""Compile of the serving workload's constraints, stage by stage: where fst's compile time goes.

The constraints are those of ``bench_e2e.py --workloads serving`` (``make_serving_cases``: tool-calling
JSON schemas and regexes, fixed seed), compiled for SmolLM2 in canonical mode two ways:

* **cold**: each constraint ``--repeats`` times from scratch (no automaton cache, no dead-end verdict of an
  earlier compile, ``compiler/verdict_cache.py``). For each constraint the median run's stage times
  (``CompiledAutomaton.stats``) are kept; the table gives the compile time p50 / p90 / max over the
  constraints and the sum of each stage over all of them (character DFA, byte DFA, token DFA (the trie
  walk and the group merge), canonical dead-end analysis, rows, explicit enumeration);
* **in serving order**: all constraints one after the other in one process, as a server's compile
  process meets them (each new; the verdicts of the constraints before it kept), ``--repeats`` passes
  each from an empty verdict cache; per constraint the median.

xgrammar's compile of the same constraints is given for context the same two ways (``compile_json_schema``
/ ``compile_regex``, one thread): cold (``cache_enabled=False``) and in serving order (one
``GrammarCompiler`` with its cache on, as vLLM runs it; xgrammar shares compiled sub-rules between grammars).

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


def tools_required_schema(tools: list[tuple[str, dict]]) -> dict:
    """The JSON schema vLLM constrains a ``tool_choice="required"`` answer with, for tools ``(name,
    parameters)``: an array (at least one item) of ``{"name": ..., "parameters": ...}`` objects, an anyOf
    over the tools (vLLM's ``tool_parsers.utils._get_json_schema_from_tools``, vLLM 0.32-0.33;
    ``tests/test_vllm_plugin_unit.py`` checks it is the same)."""
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
         "required": ["name", "parameters"]} for name, params in tools]}}


def tool_cases(counts: list[int], n_requests: int) -> list[tuple[str, str, object]]:
    """One ``tool_choice="required"`` constraint per count in ``counts``: the first N JSON schemas of the
    serving workload as the tools' parameters."""
    schemas = [(name, spec) for name, kind, spec in serving_constraints(max(n_requests, 4 * max(counts, default=0)))
               if kind == "json"]
    return [(f"tool_choice=required, {n} tools", "json", tools_required_schema(schemas[:n])) for n in counts]


def fst_regex(kind: str, spec) -> str:
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex

    return json_schema_to_regex(spec) if kind == "json" else spec


def measure_fst(cases, arts, repeats: int) -> list[dict]:
    """Per constraint: the stats of the median-time compile of ``repeats`` cold compiles."""
    from vllm_fst_backend.compiler import compile_regex, forget_verdicts, prepare
    from vllm_fst_backend.compiler.service import settle_heap
    from vllm_fst_backend.errors import CompileBudgetError

    prepare(arts)
    settle_heap()  # (as the compile process does once prepared: compiler/service.py)
    out = []
    for name, kind, spec in cases:
        rx = fst_regex(kind, spec)
        runs = []
        for _ in range(repeats):
            forget_verdicts(arts)
            t0 = time.perf_counter()
            try:
                a = compile_regex(rx, arts)
            except CompileBudgetError as e:  # (refused: a request the fallback backend answers)
                out.append({"name": name, "kind": kind, "ms": 1e3 * (time.perf_counter() - t0), "refused": str(e),
                            "regex_chars": len(rx), "byte_states": None, "mode": "refused",
                            **{k: 0.0 for k, _ in STAGES}})
                break
            runs.append((time.perf_counter() - t0, a.stats))
        if not runs:
            continue
        runs.sort(key=lambda r: r[0])
        dt, st = runs[len(runs) // 2]
        out.append({"name": name, "kind": kind, "ms": 1e3 * dt, "regex_chars": len(rx),
                    "byte_states": st.get("byte_states"), "mode": st.get("mode", "explicit"),
                    **{k: float(st.get(k, 0.0)) for k, _ in STAGES}})
    return out


def measure_fst_in_order(cases, arts, repeats: int) -> list[dict]:
    """Per constraint: median compile ms and dead-end ms over ``repeats`` passes over all constraints in
    order, each pass from an empty verdict cache (module docstring)."""
    from vllm_fst_backend.compiler import compile_regex, forget_verdicts

    from vllm_fst_backend.compiler.canonical_product import canonical_helper
    from vllm_fst_backend.compiler.token_trie import trie_for
    from vllm_fst_backend.compiler.verdict_cache import verdict_cache

    vc = verdict_cache(canonical_helper(arts, trie_for(arts)))
    rxs = [fst_regex(kind, spec) for _, kind, spec in cases]
    ms = [[] for _ in rxs]
    dead = [[] for _ in rxs]
    found = [[] for _ in rxs]
    for _ in range(repeats):
        forget_verdicts(arts)
        for i, rx in enumerate(rxs):
            h, m = vc.hits, vc.misses
            t0 = time.perf_counter()
            a = compile_regex(rx, arts)
            ms[i].append(1e3 * (time.perf_counter() - t0))
            dead[i].append(float(a.stats.get("ms_deadend", 0.0)))
            n = vc.hits - h + vc.misses - m
            found[i].append((vc.hits - h) / n if n else 1.0)
    return [{"ms": statistics.median(m), "ms_deadend": statistics.median(d), "found": statistics.median(f)}
            for m, d, f in zip(ms, dead, found)]


def measure_xgrammar(cases, tokenizer: str, V: int, repeats: int) -> tuple[list[float], list[float]] | None:
    """xgrammar compile ms per constraint: (cold, cache off: median of ``repeats``; in serving order, one
    compiler with its cache on: median of ``repeats`` passes, each with a new compiler), or None without
    xgrammar."""
    try:
        import xgrammar as xgr
        from transformers import AutoTokenizer
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tokenizer), vocab_size=V)

    def one(comp, kind, spec) -> float:
        t0 = time.perf_counter()
        if kind == "json":
            comp.compile_json_schema(json.dumps(spec), any_whitespace=False)
        else:
            comp.compile_regex(spec)
        return 1e3 * (time.perf_counter() - t0)

    cold_comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    cold = [statistics.median(one(cold_comp, kind, spec) for _ in range(repeats)) for _, kind, spec in cases]
    passes = []
    for _ in range(repeats):
        comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        passes.append([one(comp, kind, spec) for _, kind, spec in cases])
    return cold, [statistics.median(p[i] for p in passes) for i in range(len(cases))]


def _stats(ms) -> str:
    ms = np.asarray(ms, dtype=float)
    return f"{np.percentile(ms, 50):.1f} / {np.percentile(ms, 90):.1f} / {ms.max():.1f}, {ms.sum():.0f}"


def table(rows: list[dict], ordered: list[dict], xgr: tuple | None) -> str:
    lines = ["| constraints | compile | fst p50 / p90 / max ms, sum | " + " | ".join(f"{label} (sum ms)" for _, label in STAGES)
             + " | xgrammar p50 / p90 / max ms, sum |",
             "|---|---|---|" + "---|" * len(STAGES) + "---|"]
    sums = [sum(r[k] for r in rows) for k, _ in STAGES]
    head = f"{len(rows)} ({sum(r['kind'] == 'json' for r in rows)} JSON schemas)"
    lines.append(f"| {head} | cold | {_stats([r['ms'] for r in rows])} | " + " | ".join(f"{s:.0f}" for s in sums)
                 + f" | {'n/a' if xgr is None else _stats(xgr[0])} |")
    dead = sum(r["ms_deadend"] for r in ordered)
    lines.append(f"| {head} | in serving order | {_stats([r['ms'] for r in ordered])} | "
                 + " | ".join(f"{dead:.0f}" if k == "ms_deadend" else "" for k, _ in STAGES)
                 + f" | {'n/a' if xgr is None else _stats(xgr[1])} |")
    return "\n".join(lines)


def tool_rows(rows: list[dict], xgr_cold: list[float] | None) -> str:
    """Table lines of the ``tool_choice="required"`` constraints (cold compiles)."""
    out = []
    for i, r in enumerate(rows):
        fst = f"refused ({r['refused']}) after {r['ms']:.0f} ms" if r.get("refused") else f"{r['ms']:.1f}"
        out.append(f"| {r['name']} | cold | {fst} | " + " | ".join(f"{r[k]:.0f}" for k, _ in STAGES)
                   + f" | {'n/a' if xgr_cold is None else f'{xgr_cold[i]:.1f}'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--artifacts", default=None, help="artifacts dir (default tokenizer_artifacts/<name>, built if stale)")
    ap.add_argument("--requests", type=int, default=24, help="number of serving constraints (a prefix of the list)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tools", default="2,4,6",
                    help="tool counts of the tool_choice=required rows (comma-separated; empty: none)")
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
    ordered = measure_fst_in_order(cases, arts, args.repeats)
    xgr = None if args.no_xgrammar else measure_xgrammar(cases, args.tokenizer, int(arts.vocab_size), args.repeats)
    body = table(rows, ordered, xgr)
    counts = [int(x) for x in args.tools.split(",") if x.strip()]
    if counts:
        tcases = tool_cases(counts, args.requests)
        trows = measure_fst(tcases, arts, args.repeats)
        txgr = None if args.no_xgrammar else measure_xgrammar(tcases, args.tokenizer, int(arts.vocab_size), args.repeats)
        body += "\n" + tool_rows(trows, None if txgr is None else txgr[0])
    print(body)
    if args.no_write:
        return 0
    from scripts.bench_common import write_section

    cmd = "python scripts/bench_compile_serving.py " + " ".join(argv if argv is not None else sys.argv[1:])
    slow = sorted(rows, key=lambda r: -r["ms"])[:3]
    note = (f"Tokenizer `{args.tokenizer}`, canonical mode (the default): the first {args.requests} "
            f"constraints of the serving workload (seed of `make_serving_cases`). Cold: each the median of {args.repeats} "
            "compiles in one process with no automaton cache and no dead-end verdict of an earlier compile "
            "(per-tokenizer preparation done once, outside); the stage sums add up to the compile sum less parsing "
            "and bookkeeping. In serving order: the constraints one after the other in one process, each new, "
            "the dead-end verdicts of those before it kept (compiler/verdict_cache.py), median of "
            f"{args.repeats} passes each from an empty cache; only the dead-end sum is split out; share of a JSON "
            "schema's verdicts found in the cache (made for the constraints before it), median over the schemas after "
            f"the first 8: {100 * float(np.median([o['found'] for c, o in zip(cases[8:], ordered[8:]) if c[1] == 'json'] or [0])):.0f} %. "
            "xgrammar (one "
            "thread): cold = `cache_enabled=False`; in serving order = one `GrammarCompiler` with its cache on. "
            "Slowest (cold): "
            + ", ".join(f"`{r['name']}` {r['ms']:.0f} ms ({r['byte_states']} byte states)" for r in slow)
            + ". Rows `tool_choice=required, N tools`: the schema vLLM constrains such an answer with "
            "(an array of anyOf over N `{name, parameters}` objects, `tools_required_schema`), the first N JSON "
            "schemas of the serving workload as the tools' parameters; cold compiles as above (xgrammar: cold)"
            + f". Host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end of the run.")
    write_section("Compile stages of the serving constraints", cmd.strip(), body, note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
