"""Smoke test of ``scripts/bench_e2e.py`` (issue 5): one backend, a tiny workload, a temporary benchmarks file.

Starts one vLLM CPU server (~2 min on 2 cores) through the script itself (the e2e server fixture of
``tests/test_vllm_e2e.py`` is module-scoped and serves fst with a proposer, so it is not reused; the script
can also target a running server with ``--server-url``). Runs by default like the other e2e tests;
``VLLM_FST_E2E=0`` opts out. A missing model or package is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
TITLE = "## End-to-end on a vLLM CPU server"


def test_bench_e2e_smoke(tmp_path):
    if os.environ.get("VLLM_FST_E2E", "1").strip().lower() in ("0", "false", "no", "off"):
        pytest.skip("VLLM_FST_E2E=0: end-to-end server tests opted out")
    import matplotlib  # noqa: F401  (the plots) -- installed by scripts/install.sh
    import pycountry  # noqa: F401  (the multiple-choice data set)
    import vllm  # noqa: F401

    assert (MODEL / "model.safetensors").is_file(), f"{MODEL} missing: run scripts/prepare_smollm2.py"
    out_md = tmp_path / "benchmarks.md"
    out_md.write_text("# Benchmarks\n\n## Some other section\n\nkept\n")
    raw = tmp_path / "rows.json"
    cmd = [
        sys.executable, "scripts/bench_e2e.py", "--backends", "xgrammar", "--workloads", "mc,pokedex",
        "--questions", "2", "--samples", "2", "--template-samples", "2",
        "--out-md", str(out_md), "--json-out", str(raw), "--log-dir", str(tmp_path / "logs"), "--no-progress",
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    text = out_md.read_text()
    assert "## Some other section\n\nkept" in text  # other sections untouched
    assert TITLE in text
    section = text[text.index(TITLE) :]
    assert "python scripts/bench_e2e.py --backends xgrammar" in section  # the exact command
    table_rows = [ln for ln in section.splitlines() if ln.startswith("| xgrammar |")]
    assert [ln.split("|")[2].strip() for ln in table_rows] == ["mc", "pokedex"]
    for png in ("bench_e2e_fidelity.png", "bench_e2e_throughput.png"):
        assert (tmp_path / png).stat().st_size > 1000
        assert f"]({png})" in section

    rows = {row["workload"]: row for row in json.loads(raw.read_text())["rows"]}
    assert rows["mc"]["failed"] == 0 and rows["pokedex"]["failed"] == 0, rows
    assert rows["mc"]["satisfied"] == 1.0  # every sampled answer is one of the options
    assert rows["pokedex"]["satisfied"] == 1.0  # every sample matches the template regex
    assert rows["mc"]["tok_s"] > 0 and rows["pokedex"]["ttft_ms"] > 0
    assert rows["mc"]["prompt_mismatch"] == 0  # the offline reference scored the server's exact prompt
    assert 0.0 <= rows["mc"]["tv"] <= 1.0
