"""Shared pieces of the benchmark scripts: the paper-001 JSON-object schema and writing one section of
``docs/benchmarks.md``."""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path

BENCH_MD = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_section(title: str, command: str, body: str, note: str = "") -> None:
    """Replace (or append) the section ``## title`` of docs/benchmarks.md with the command and body."""
    text = BENCH_MD.read_text() if BENCH_MD.exists() else "# Benchmarks\n\nEvery figure below comes from the command printed above it.\n"
    stamp = _dt.date.today().isoformat()
    section = f"## {title}\n\nCommand: `{command}` ({stamp})\n\n{body}\n" + (f"\n{note}\n" if note else "")
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _m: section + "\n", text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    BENCH_MD.write_text(text)


def script_command(script: str, argv=None) -> str:
    """The command line a section records: ``python scripts/<script> <args>`` (``argv``: the arguments
    given to ``main``, else ``sys.argv[1:]``)."""
    import sys

    return ("python scripts/" + script + " " + " ".join(argv if argv is not None else sys.argv[1:])).strip()


def step_bench_args(doc: str, argv, steps: int):
    """The arguments of the per-step CPU benchmarks (bench_mask_apply, bench_recovered_tokens), parsed from
    ``argv``: ``--batch`` (requests per step, comma-separated), ``--steps`` (of each random walk, default
    ``steps``), ``--repeats`` (timings per step, the best counts), ``--seed``, ``--no-write``. ``doc``: the
    script's docstring (its first line is the description)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--batch", default="8,32", help="requests per step (comma-separated)")
    ap.add_argument("--steps", type=int, default=steps, help="steps of each random walk")
    ap.add_argument("--repeats", type=int, default=3, help="timings per step (the best counts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true", help="print only; do not touch docs/benchmarks.md")
    return ap.parse_args(argv)


def p50_mean_cell(times) -> str:
    """A table cell ``"<p50> / <mean>"`` of ``times`` (µs or ms, printed without decimals): the per-step
    CPU benchmarks' timing columns."""
    import statistics

    return f"{statistics.median(times):.0f} / {statistics.mean(times):.0f}"


def report_section(title: str, script: str, argv, body: str, note: str, write: bool) -> None:
    """Print ``note``; with ``write``, replace section ``title`` of docs/benchmarks.md with the script's
    command (:func:`script_command`), ``body`` and ``note``."""
    print(note)
    if write:
        write_section(title, script_command(script, argv), body, note)


# Paper 001 App. C.4.5: the JSON-object schema (an RPG character), used by bench_compile and bench_e2e.
JSON_OBJECT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "class": {"type": "string", "enum": ["Warrior", "Rogue", "Sorceror"]},
        "life": {"type": "integer"},
        "mana": {"type": "integer"},
        "equipment": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "durability": {"type": "integer"},
                    "quality": {"type": "string", "enum": ["Normal", "Magic", "Unique"]},
                },
            },
        },
    },
}