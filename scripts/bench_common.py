"""Shared helper of the benchmark scripts: write one section of ``docs/benchmarks.md``."""

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
