#!/usr/bin/env python
"""Benchmark the once-per-tokenizer artifact build (issue 2's speed and size targets).

    python scripts/bench_artifacts.py [--only smollm2,mistral_v1,tekken] [--no-write]

Builds each real tokenizer's artifacts from scratch (``--force``) in a fresh child process, measures
wall seconds and peak RSS (``resource.getrusage`` of the child), the bytes on disk and the canonical
filter's figures, prints a table and writes it to ``docs/benchmarks.md`` (section "Artifact build")
together with this command. Targets (2-core machine): SmolLM2 ≤ 3 min and ≤ 64 MB; Mistral v1 ≤ 2 min;
Tekken ≤ 15 min and ≤ 512 MB.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from scripts.bench_common import write_section  # noqa: E402


def tokenizers() -> dict[str, Path]:
    data = Path(list(importlib.util.find_spec("mistral_common").submodule_search_locations)[0]) / "data"
    return {
        "smollm2": ROOT / "models" / "SmolLM2-135M-Instruct",
        "mistral_v1": data / "tokenizer.model.v1",
        "tekken": data / "tekken_240911.json",
    }


TARGETS = {"smollm2": (180, 64), "mistral_v1": (120, None), "tekken": (900, 512)}


def run_one(name: str, path: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"bench_{name}_"))
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_tokenizer_artifacts.py"), "--tokenizer", str(path),
         "--out", str(out), "--force", "--quiet"],
        capture_output=True, text=True,
    )
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"build of {name} failed:\n{proc.stderr[-2000:]}")
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    manifest = json.loads((out / "manifest.json").read_text())
    files = manifest["files"]
    size = sum(f["size"] for f in files.values())
    canon = sum(f["size"] for n, f in files.items() if n.startswith("canon_"))
    summary = manifest.get("summary", {})
    canon_sum = summary.get("canonical") or {}
    return dict(name=name, vocab=manifest["vocab_size"], seconds=wall, peak_mb=peak_mb, mb=size / 1e6,
                canon_mb=canon / 1e6, classes=summary.get("n_classes"),
                banned=summary.get("banned_pairs"), ctx=canon_sum.get("n_context_groups"),
                ctx_found=canon_sum.get("n_context_prefixes"), ctx_tokens=canon_sum.get("n_context_tokens"), out=str(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="smollm2,mistral_v1,tekken")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    toks = tokenizers()
    rows = []
    for name in args.only.split(","):
        r = run_one(name, toks[name])
        rows.append(r)
        print(json.dumps(r), flush=True)
    lines = [
        "| tokenizer | V | build s (target) | on disk MB (target) | canonical arrays MB | classes | banned pairs (class level) "
        "| context states (found → minimal) | context-dependent tokens | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ts, tm = TARGETS[r["name"]]
        lines.append(
            f"| {r['name']} | {r['vocab']} | {r['seconds']:.0f} (≤ {ts}) | {r['mb']:.1f}"
            f"{f' (≤ {tm})' if tm else ''} | {r['canon_mb']:.1f} | {r['classes']} | {r['banned']} "
            f"| {r['ctx_found']} → {r['ctx']} | {r['ctx_tokens']} | {r['peak_mb']:.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        cmd = "python scripts/bench_artifacts.py" + (f" --only {args.only}" if args.only != "smollm2,mistral_v1,tekken" else "")
        write_section("Artifact build", cmd, table, note=f"machine: {platform.machine()}, "
                      f"{__import__('os').cpu_count()} cores. Peak RSS is getrusage(RUSAGE_CHILDREN), the largest child "
                      "so far (a later row is bounded below by the rows before it).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
