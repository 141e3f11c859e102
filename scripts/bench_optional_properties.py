#!/usr/bin/env python
"""Objects whose properties are all optional (none required, so each may start the object): what the
shared optional tails of the character DFA save (docs/compiler.md, front end, "Optional tails").

For objects of N optional strings (``maxLength`` 30) it prints, and writes into ``docs/benchmarks.md``
(section "Leading optional properties") unless ``--no-write``:

* the converted regex's length (characters) and its character positions (``regex_parse.estimate_positions``,
  the quantity the position budget bounds);
* the character DFA with each member's positions built once (``_Glushkov.share_optional_tails``, the
  default) and with a copy per place it is written: states before minimization and build time (best of
  ``--repeats``; the minimal DFA is the same);
* the whole canonical compile at SmolLM2 with the served default budgets (best of ``--repeats``, no
  dead-end verdict of an earlier compile), or the budget that refuses it.

Usage: python scripts/bench_optional_properties.py [--members 6 12 24] [--repeats 3] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def schema(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 30} for i in range(n)}}


def char_dfa(regex: str, share: bool, repeats: int) -> tuple[int, float]:
    """(states before minimization, best build ms) of the character DFA of ``regex``."""
    import vllm_fst_backend.compiler.char_dfa as cd
    from vllm_fst_backend.compiler.regex_parse import parse_regex

    tree = parse_regex(regex, 10**7)
    saved_share, real_minimize = cd._Glushkov.share_optional_tails, cd.minimize
    seen: list[int] = []
    cd._Glushkov.share_optional_tails = share
    cd.minimize = lambda t, f: seen.append(len(t)) or real_minimize(t, f)
    try:
        best = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            cd.build_char_dfa(tree, max_states=10**5, max_follow=10**8)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
    finally:
        cd._Glushkov.share_optional_tails, cd.minimize = saved_share, real_minimize
    return seen[-1], 1e3 * best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, nargs="+", default=[6, 12, 24])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--artifacts", default=str(ROOT / "tokenizer_artifacts" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    from vllm_fst_backend.artifacts.store import load_artifacts
    from vllm_fst_backend.compiler import compile_regex, forget_verdicts, prepare
    from vllm_fst_backend.compiler.compile import DEFAULT_BUDGETS
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex
    from vllm_fst_backend.compiler.regex_parse import estimate_positions, parse_regex
    from vllm_fst_backend.compiler.service import settle_heap
    from vllm_fst_backend.errors import CompileBudgetError

    arts = load_artifacts(args.artifacts)
    prepare(arts)
    settle_heap()
    rows = ["| optional strings | regex chars | positions | character DFA, members built once: states / ms | "
            "character DFA, a copy per place: states / ms | canonical compile, default budgets |",
            "|---|---|---|---|---|---|"]
    for n in args.members:
        regex = json_schema_to_regex(schema(n))
        positions = estimate_positions(parse_regex(regex, 10**7))
        shared = char_dfa(regex, True, args.repeats)
        copied = char_dfa(regex, False, args.repeats)
        best, refused = None, None
        for _ in range(args.repeats):
            regex = json_schema_to_regex(schema(n))  # (records its tree for the compile, as a server does)
            forget_verdicts(arts)
            t0 = time.perf_counter()
            try:
                compile_regex(regex, arts)
            except CompileBudgetError as e:
                refused = str(e)
                break
            dt = 1e3 * (time.perf_counter() - t0)
            best = dt if best is None else min(best, dt)
        compiled = f"refused: {refused}" if refused else f"{best:.0f} ms"
        rows.append(f"| {n} | {len(regex)} | {positions} | {shared[0]} / {shared[1]:.0f} | {copied[0]} / {copied[1]:.0f} "
                    f"| {compiled} |")
        print(rows[-1], flush=True)
    note = ("Objects of N optional strings (`maxLength` 30, none required), converted by `json_schema_to_regex`, "
            f"SmolLM2 canonical mode; best of {args.repeats} per cell. Character DFA: `build_char_dfa` on the "
            "converted tree, states before minimization (the minimal DFA is the same either way) and build time, "
            "with the members' positions built once (the default) and with a copy per place each is written "
            "(`_Glushkov.share_optional_tails = False`). Positions: `estimate_positions`, bounded by the "
            f"{DEFAULT_BUDGETS.max_positions:,}-position budget (counting each member once); the character DFA by "
            f"the {DEFAULT_BUDGETS.max_char_states:,}-state budget (states before minimization).")
    if not args.no_write:
        from scripts.bench_common import write_section

        cmd = "python scripts/bench_optional_properties.py" + (
            "" if args.members == [6, 12, 24] else " --members " + " ".join(map(str, args.members))) + (
            "" if args.repeats == 3 else f" --repeats {args.repeats}")
        write_section("Leading optional properties", cmd, "\n".join(rows), note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
