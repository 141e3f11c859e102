"""Smoke tests of ``scripts/bench_e2e.py``.

``test_bench_e2e_smoke`` (issue 5): one backend, a tiny workload, a temporary benchmarks file. Starts one
vLLM CPU server (~2 min on 2 cores) through the script itself (the e2e server fixture of
``tests/test_vllm_e2e.py`` is module-scoped and serves fst with a proposer, so it is not reused; the script
can also target a running server with ``--server-url``). Runs by default like the other e2e tests;
``VLLM_FST_E2E=0`` opts out. A missing model or package is a failure, not a skip.

The ``test_serving_*`` tests (issue 12) check the pure parts of the serving workload without a server: the
constraint generator, the request body, the validity and canonicality checkers, the row summary, the
targets and the markdown section / plot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fst_testlib import fst_artifacts  # noqa: F401  (fixture)

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
TITLE = "## End-to-end on a vLLM CPU server"


@pytest.mark.e2e
@pytest.mark.slow
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
    # single-stream decode rate: the template's greedy stream and its repeats (default 3), not the MC answers
    assert rows["pokedex"]["stream_tok_s"] > 0 and rows["mc"]["stream_tok_s"] is None
    assert len(rows["pokedex"]["greedy_ids"]) == 4
    assert len({tuple(ids) for ids in rows["pokedex"]["greedy_ids"]}) == 1  # greedy: the same output each time
    assert rows["mc"]["prompt_mismatch"] == 0  # the offline reference scored the server's exact prompt
    assert 0.0 <= rows["mc"]["tv"] <= 1.0


# ---------------------------------------------------------------------------------------------------
# Serving workload: pure parts (no server)
# ---------------------------------------------------------------------------------------------------


def _bench():
    from scripts import bench_e2e

    return bench_e2e


def _depth(schema: dict) -> int:
    """Object nesting levels of a schema (an array of objects counts its items)."""
    if schema.get("type") == "object":
        return 1 + max((_depth(p) for p in schema["properties"].values()), default=0)
    if schema.get("type") == "array":
        return _depth(schema["items"])
    return 0


def test_serving_cases_distinct_valid_and_deterministic():
    import re

    import jsonschema

    b = _bench()
    cases = b.make_serving_cases(24 + 64)
    assert len(cases) == 88
    assert len({c.key() for c in cases}) == 88  # every request its own constraint, across both rows
    assert [c.key() for c in b.make_serving_cases(24)] == [c.key() for c in cases[:24]]  # fixed seed, prefix-stable
    assert [c.prompt for c in b.make_serving_cases(24)] == [c.prompt for c in cases[:24]]
    first = cases[:24]
    schemas = [c.spec for c in first if c.kind == "json"]
    regexes = [c.spec for c in first if c.kind == "regex"]
    assert len(schemas) == 16 and len(regexes) == 8
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == len(schemas)
    kinds_seen = set()
    for c in cases:
        assert c.prompt and c.name
        if c.kind == "json":
            jsonschema.Draft202012Validator.check_schema(c.spec)
            assert 3 <= len(c.spec["properties"]) <= 8
            assert _depth(c.spec) <= 2
            assert c.spec["additionalProperties"] is False and c.spec["required"]
            for p in c.spec["properties"].values():
                kinds_seen.add(p.get("type"))
                kinds_seen.update(k for k in ("enum", "minimum", "maximum", "format", "pattern", "maxItems") if k in p)
        else:
            assert c.kind == "regex"
            re.compile(c.spec)
            assert not re.search(r"\\[dswDSW]", c.spec)  # ASCII classes spelled out: every engine reads them alike
    # varied: every kind of property the generator knows shows up in one run
    assert {"string", "integer", "number", "boolean", "array", "object", "enum", "minimum", "maximum", "format", "pattern"} <= kinds_seen
    assert len({c.name for c in cases if c.kind == "regex"}) >= 6  # several regex families


def test_serving_plan_rounds_of_both_row_sizes():
    """``--serving-rounds`` / ``--serving-large-rounds``: round 1 of every size, then the later rounds
    interleaved, each run on new cases (no case twice but the repeated first row, last)."""
    b = _bench()
    plan = b.serving_plan(b.ServingConfig([(24, 8), (64, 32)], rounds=3, large_rounds=2, repeat=True))
    assert [(n, c, again, r) for _, n, c, again, r in plan] == [
        (24, 8, False, 1), (64, 32, False, 1), (24, 8, False, 2), (64, 32, False, 2), (24, 8, False, 3), (24, 8, True, 0)]
    new = [range(a, a + n) for a, n, _, again, _ in plan if not again]
    seen = [i for r in new for i in r]
    assert len(seen) == len(set(seen)) == 3 * 24 + 2 * 64 and min(seen) == 0
    assert plan[-1][:2] == (0, 24)
    # one round each (the default): the two sizes once, unnumbered, as before
    assert b.serving_plan(b.ServingConfig([(24, 8), (64, 32)])) == [(0, 24, 8, False, 0), (24, 64, 32, False, 0)]
    # --serving-interleave: the plan split by round (round 1 keeps the repeated run: same server), same cases
    cfg = b.ServingConfig([(24, 8), (64, 32)], rounds=3, large_rounds=2, repeat=True, interleave=True)
    assert b.serving_round_count(cfg) == 3
    by_round = [b.serving_plan(cfg, k) for k in (1, 2, 3)]
    assert sorted(x for r in by_round for x in r) == sorted(plan)
    assert by_round[0] == [plan[0], plan[1], plan[-1]] and by_round[2] == [plan[4]]
    assert b.serving_order(["fst", "xgrammar", "guidance"], 1) == ["fst", "xgrammar", "guidance"]
    assert b.serving_order(["fst", "xgrammar", "guidance"], 2) == ["guidance", "xgrammar", "fst"]


def test_serving_request_body():
    b = _bench()
    cases = b.make_serving_cases(3)
    js, rx = cases[0], cases[2]
    assert js.kind == "json" and rx.kind == "regex"
    body = b.serving_body(rx, "xgrammar")
    assert body["structured_outputs"] == {"regex": rx.spec}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["return_token_ids"] is True and body["max_tokens"] == 96 and body["temperature"] == 0.7
    assert "seed" not in body and "vllm_xargs" not in body  # a per-request seed kills the CPU engine
    body = b.serving_body(js, "fst-jump")
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": js.name, "schema": js.spec}}
    assert body["vllm_xargs"] == {"fst_jump": True}
    assert b.serving_body(js, "guidance", json_via="structured_outputs")["structured_outputs"] == {"json": js.spec}
    plain = b.serving_body(js, "unconstrained")
    assert "structured_outputs" not in plain and "response_format" not in plain


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "start": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"city": "Oslo", "unit": "celsius", "days": 3, "start": "2026-11-24", "tags": ["a"]}', True),
        ('{"city":"Oslo","unit":"fahrenheit"}', True),
        ('\n{ "unit": "celsius", "city": "Rome" } ', True),  # whitespace around JSON is fine
        ('{"city": "Oslo", "unit": "kelvin"}', False),  # not in the enum
        ('{"city": "Oslo", "unit": "celsius", "days": 15}', False),  # over the maximum
        ('{"city": "Oslo", "unit": "celsius", "days": 0}', False),  # under the minimum
        ('{"city": "Oslo", "unit": "celsius", "start": "2026-02-31"}', False),  # format: date is checked
        ('{"city": "Oslo", "unit": "celsius", "wind": 3}', False),  # additionalProperties: false
        ('{"unit": "celsius"}', False),  # a required property missing
        ('{"city": "Oslo, Norway!", "unit": "celsius"}', False),  # maxLength
        ('{"city": "Oslo", "unit": "celsius", "tags": ["a", "b", "c"]}', False),  # maxItems
        ('{"city": "Oslo", "unit": "cel', False),  # cut by max_tokens
        ("", False),
    ],
)
def test_serving_output_valid_json(text, ok):
    b = _bench()
    assert b.output_valid(b.ServingCase("get_weather", "json", SCHEMA, "p"), text) is ok


def test_serving_output_valid_regex():
    b = _bench()
    case = b.ServingCase("date", "regex", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", "p")
    assert b.output_valid(case, "2026-11-24")
    assert not b.output_valid(case, "2026-13-24")
    assert not b.output_valid(case, "2026-11-24 ")  # full match, not a prefix
    assert not b.output_valid(case, "On 2026-11-24")
    quoted = b.ServingCase("quoted", "regex", '"[^"\\\\]{1,20}"', "p")
    assert b.output_valid(quoted, '"The sea is wide."')
    assert not b.output_valid(quoted, '"a "quote" inside"')


def test_serving_output_canonical(smollm2_dir):
    from transformers import AutoTokenizer

    b = _bench()
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    eos = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    canon = tok.encode("Berlin", add_special_tokens=False)
    spelled = tok.convert_tokens_to_ids(["B", "e", "r", "l", "in"])  # the non-canonical spelling xgrammar produced
    assert canon != spelled and tok.decode(spelled) == "Berlin"
    assert b.output_canonical(canon, "Berlin", tok, eos) is True
    assert b.output_canonical(canon + [tok.convert_tokens_to_ids("<|im_end|>")], "Berlin", tok, eos) is True  # EOS removed
    assert b.output_canonical(spelled, "Berlin", tok, eos) is False
    assert b.output_canonical([], "Berlin", tok, eos) is None  # the server returned no ids


def test_e2e_sample_canonical_leaves_out_a_character_cut_by_max_tokens(smollm2_dir):
    """An output cut by max_tokens inside a multi-byte character (its text ends in U+FFFD) is judged on its
    complete characters; the same ids finished by the model, or spelled non-canonically, are not."""
    from transformers import AutoTokenizer

    b = _bench()
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    full = tok.encode("ok 😀", add_special_tokens=False)
    cut = full[:-1]
    assert tok.decode(cut).endswith("\ufffd") and len(full) >= 3
    assert b.sample_canonical(b.Sample(tok.decode(cut), cut, "length"), tok, set()) is True
    assert b.sample_canonical(b.Sample(tok.decode(cut), cut, "stop"), tok, set()) is False
    assert b.sample_canonical(b.Sample("ok 😀", full, "stop"), tok, set()) is True
    spelled = tok.convert_tokens_to_ids(["B", "e", "r", "l", "in"])
    assert b.sample_canonical(b.Sample("Berlin", spelled, "length"), tok, set()) is False


class _CharTokenizer:
    """Stand-in tokenizer for the row tests: one id per character."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        # ids past Unicode stand for a token holding part of a multi-byte character
        return "".join(chr(i) if i < 0x110000 else "\ufffd" for i in ids)


def _result(text, ttft, latency, ok=True, ids=None, finish="stop", error=None):
    return {"ok": ok, "error": error, "text": text, "token_ids": [ord(c) for c in text] if ids is None else ids,
            "finish": finish, "ttft": ttft, "latency": latency, "completion_tokens": len(text)}  # fmt: skip


def _rows(b):
    cases = [
        b.ServingCase("get_weather", "json", SCHEMA, "p"),
        b.ServingCase("get_weather2", "json", dict(SCHEMA, required=["city"]), "p"),
        b.ServingCase("date", "regex", "[0-9]{4}", "p"),
        b.ServingCase("id", "regex", "[A-Z]{3}", "p"),
    ]
    good = [_result('{"city": "Oslo", "unit": "celsius"}', 0.1, 1.0), _result('{"city": "Rome"}', 0.2, 1.2),
            _result("2026", 0.3, 0.5), _result("ABC", 0.4, 0.6)]  # fmt: skip
    x_res = [_result('{"city": "Oslo", "unit": "celsius"}', 0.2, 1.0, ids=[1, 2]),  # not canonical
             _result('{"city": "Ro', 0.2, 1.2, finish="length"),  # cut: invalid
             _result("2026", 0.3, 0.5), _result("", 0, 0, ok=False, error="HTTP 400: bad regex")]  # fmt: skip
    tok = _CharTokenizer()
    health = {"times": [0.002, 0.004, 0.030], "errors": []}
    rows = [
        b.summarize_serving("fst", cases, good, 2.0, health, 2, tok, set()),
        b.summarize_serving("xgrammar", cases, x_res, 2.0, {"times": [0.001], "errors": []}, 2, tok, set()),
    ]
    return cases, rows


def test_serving_summary_row():
    b = _bench()
    cases, (f, x) = _rows(b)
    assert f["requests"] == 4 and f["ok"] == 4 and f["failed"] == 0 and f["concurrency"] == 2
    assert f["valid"] == 1.0 and f["canonical"] == 1.0 and f["canonical_n"] == 4
    assert f["ttft_p50_ms"] == pytest.approx(250.0) and f["ttft_p90_ms"] == pytest.approx(370.0)  # linear interpolation
    assert f["lat_p50_ms"] == pytest.approx(800.0)
    # time per output token: (latency - TTFT) / (tokens - 1) per request (26.5, 66.7, 66.7, 100 ms), p50
    assert f["tpot_p50_ms"] == pytest.approx(200 / 3)
    assert b._tpot_p50({k: v for k, v in f.items() if k != "tpot_p50_ms"}) == pytest.approx(200 / 3)  # (older JSON)
    assert f["health_max_ms"] == pytest.approx(30.0) and f["health_polls"] == 3
    # TTFT medians of the burst (the first `concurrency` = 2 requests sent) and of the later ones
    assert (f["ttft_burst_ms"], f["ttft_later_ms"]) == (pytest.approx(150.0), pytest.approx(350.0))
    old = {k: v for k, v in f.items() if k not in ("ttft_burst_ms", "ttft_later_ms")}  # (older JSON)
    assert b._ttft_phases(old) == (pytest.approx(150.0), pytest.approx(350.0))
    assert x["ttft_later_ms"] == pytest.approx(300.0)  # (the failed request has no TTFT)
    tokens = sum(len(r) for r in ('{"city": "Oslo", "unit": "celsius"}', '{"city": "Rome"}', "2026", "ABC"))
    assert f["completion_tokens"] == tokens and f["tok_s"] == pytest.approx(tokens / 2.0)
    assert f["chars_s"] == pytest.approx(tokens / 2.0)  # one character per token here
    assert x["chars_s"] == pytest.approx(len('{"city": "Oslo", "unit": "celsius"}{"city": "Ro2026') / 2.0)
    assert f["json_requests"] == 2 and f["regex_requests"] == 2
    assert x["ok"] == 3 and x["failed"] == 1 and x["errors"] == ["HTTP 400: bad regex"]
    assert x["valid"] == pytest.approx(2 / 3) and x["canonical"] == pytest.approx(2 / 3) and x["capped"] == 1
    assert len(x["bad_examples"]) == 2
    assert x["bad_examples"][0]["canonical"] is False and x["bad_examples"][0]["token_ids"] == [1, 2]  # listed first
    # an output cut by max_tokens inside a character is judged on its complete characters
    cut = _result("Ro\ufffd", 0.1, 1.0, ids=[ord("R"), ord("o"), 0x110000], finish="length")
    assert b.summarize_serving("fst", cases[:1], [cut], 1.0, {"times": [], "errors": []}, 1, _CharTokenizer(),
                               set())["canonical"] == 1.0
    assert b.summarize_serving("fst", cases[:1], [dict(cut, finish="stop")], 1.0, {"times": [], "errors": []}, 1,
                               _CharTokenizer(), set())["canonical"] == 0.0
    # per-request records: the constraint, the TTFT in ms (None for a failed request)
    assert [(p["name"], p["ttft_ms"]) for p in f["per_request"]] == [
        (c.name, pytest.approx(t)) for c, t in zip(cases, (100.0, 200.0, 300.0, 400.0))]
    assert x["per_request"][3]["ok"] is False and x["per_request"][3]["ttft_ms"] is None
    # the steady-state split: requests after the first `concurrency` (2), JSON / regex TTFT p50
    f2 = dict(f, per_request=[dict(p, kind="json") if i == 3 else p for i, p in enumerate(f["per_request"])])
    assert b.serving_steady_split([f, x, dict(f, repeat=True)]) == ["fst @ 4 × 2: – / 350", "xgrammar @ 4 × 2: – / 300"]
    assert b.serving_steady_split([f2]) == ["fst @ 4 × 2: 400 / 300"]


def test_serving_report_and_section(tmp_path):
    b = _bench()
    _, rows = _rows(b)
    big = [dict(r, requests=64, concurrency=32) for r in rows]
    table = b.render_serving_table(rows + big)
    lines = table.splitlines()
    assert lines[0].startswith("| backend | requests × concurrency |") and len(lines) == 2 + 4
    assert "| fst | 4 × 2 | 4 / 0 | 250 / 370 |" in table
    assert "| xgrammar | 64 × 32 | 3 / 1 |" in table
    tgt = b.serving_targets(rows + big)
    text = "\n".join(tgt)
    # fst TTFT p50 250 vs xgrammar 200 ms: NOT met; p90 370 vs 280: 1.32× met; tokens/s and /health (30 ms) met
    assert "fst @ 4 × 2: TTFT p50 ≤ 1.0× xgrammar: 1.25×" in text and "NOT met" in tgt[0]
    assert tgt[1].endswith("— met.") and "1.32×" in tgt[1]
    assert any("tokens/s ≥ 1.0× xgrammar" in t and t.endswith("— met.") for t in tgt)
    assert any("; characters/s " in t and "tokens/s ≥" in t for t in tgt)
    assert any("worst /health ≤ 50 ms: 30.0 ms (xgrammar 1.0 ms) — met." in t for t in tgt)
    assert any("100 % valid and canonical: valid 100.0 %, canonical 100.0 % (4 of 4 outputs with ids), 0 failed — met." in t for t in tgt)
    assert sum("fst @ 64 × 32" in t for t in tgt) == 8  # (5 targets; time per output token, burst / later TTFT, batch wall: context)
    assert any("(context, not a target) batch wall time, the same requests to their end: 2.00 vs 2.00 s (1.00×" in t for t in tgt)
    assert any("(context, not a target) time per output token p50: 66.7 vs 66.7 ms (1.00× xgrammar's)." in t for t in tgt)

    out_md = tmp_path / "benchmarks.md"
    out_md.write_text("# Benchmarks\n\n## Some other section\n\nkept\n\n## Serving workload\n\nold numbers\n\n## Later section\n\nalso kept\n")
    meta = {"command": "python scripts/bench_e2e.py --workloads serving", "host": "x86_64, 2 CPUs", "workloads": ["serving"],
            "serving": {"sizes": [[4, 2], [64, 32]], "max_tokens": 96, "temperature": 0.7, "json_via": "response_format"}}  # fmt: skip
    data = {"meta": meta, "rows": rows + big, "fidelity": {}, "startup_s": {}, "server_fail": {"outlines": "exited with 1"},
            "engine_loads": {"fst": {"n": 3, "p50": 1.25, "p90": 2.0, "max": 3.0}, "fst-jump": None}}
    for _ in range(2):  # a re-run replaces the section in place
        got = b.write_report(out_md, data)
        md = out_md.read_text()
        assert md.count("## Serving workload") == 1 and "old numbers" not in md
        assert "## Some other section\n\nkept" in md and "## Later section\n\nalso kept" in md
        assert md.index("## Some other section") < md.index("## Serving workload") < md.index("## Later section")
        assert "## End-to-end on a vLLM CPU server" not in md  # a serving-only run leaves the e2e section alone
    assert got == tgt
    section = md[md.index("## Serving workload") : md.index("## Later section")]
    assert "Command: `python scripts/bench_e2e.py --workloads serving` (" in section  # command + date
    assert "Host: x86_64, 2 CPUs" in section and "Targets:" in section and "NOT met" in section
    assert "xgrammar @ 4 × 2: 1 failed requests, first error: `HTTP 400: bad regex`" in section
    assert "outlines: server did not start" in section
    assert "ms p50 / p90 / max: fst 1.2 / 2.0 / 3.0 (n = 3)." in section and "batch wall s" in section
    assert "![serving workload](bench_serving.png)" in section
    assert (tmp_path / "bench_serving.png").stat().st_size > 1000


def test_engine_load_stats_from_a_server_log(tmp_path):
    b = _bench()
    log = tmp_path / "server_fst.log"
    log.write_text(
        "(EngineCore pid=1) INFO [backend.py:219] fst: request r1: json constraint (401 regex chars, 591 states, "
        "canonical=True) compiled in 2.5 ms (cache hit)\n"
        "(EngineCore pid=1) INFO [backend.py:219] fst: request r2: regex constraint (8 regex chars, 3 states, "
        "canonical=True) compiled in 40.0 ms\n"  # a compile, not a load: not counted
        "(EngineCore pid=1) INFO [backend.py:219] fst: request r3: regex constraint (8 regex chars, 3 states, "
        "canonical=True) compiled in 0.5 ms (cache hit)\n")
    got = b.engine_load_stats([log])
    assert got["n"] == 2 and got["max"] == 2.5 and got["p50"] == 1.5
    other = tmp_path / "server_fst_round2.log"  # (--serving-interleave: one log per round, pooled)
    other.write_text("(EngineCore pid=2) INFO [backend.py:219] fst: request r9: regex constraint (8 regex chars, "
                     "3 states, canonical=True) compiled in 9.0 ms (cache hit)\n")
    assert b.engine_load_stats([log, other])["n"] == 3 and b.engine_load_stats([log, other])["max"] == 9.0
    assert b.engine_load_stats([tmp_path / "missing.log"]) is None


def test_serving_repeated_rows_are_shown_but_not_targeted(tmp_path):
    b = _bench()
    _, rows = _rows(b)
    again = [dict(r, repeat=True, ttft_p50_ms=1.0) for r in rows]  # the same size, constraints seen before
    table = b.render_serving_table(rows + again)
    assert "| fst | 4 × 2, repeated |" in table and "| fst | 4 × 2 |" in table
    tgt = b.serving_targets(rows + again)
    assert tgt == b.serving_targets(rows)  # targets: rows with new constraints only
    assert b._size_key(again[0]) != b._size_key(rows[0])
    assert b.make_serving_plot(rows + again, tmp_path / "p.png").stat().st_size > 1000


def test_serving_rounds_are_shown_and_targeted_by_their_medians():
    """``--serving-rounds``: each round of the first row size is a row of its own in the table; the targets
    take each backend's medians over the rounds (TTFT, tokens/s), its worst /health and its pooled outputs."""
    b = _bench()
    _, (f, x) = _rows(b)
    f2 = dict(f, round=2, ttft_p50_ms=150.0, health_max_ms=60.0, valid=0.5)
    x2 = dict(x, round=2)
    rows = [dict(f, round=1), dict(x, round=1), f2, x2]
    table = b.render_serving_table(rows)
    assert "| fst | 4 × 2, round 1 |" in table and "| fst | 4 × 2, round 2 |" in table
    tgt = b.serving_targets(rows)
    # fst TTFT p50: median(250, 150) = 200 vs xgrammar median(200, 200): 1.00x, met
    assert tgt[0].startswith("- fst @ 4 × 2 (median of 2 rounds): TTFT p50 ≤ 1.0× xgrammar: 1.00×") and tgt[0].endswith("— met.")
    assert any("worst /health ≤ 50 ms: 60.0 ms" in t and t.endswith("NOT met.") for t in tgt)
    assert any("valid 75.0 %" in t for t in tgt)  # (4 outputs at 100 % and 4 at 50 %)
    merged = b._merge_rounds([dict(f, round=1), f2])
    assert merged["ok"] == 8 and merged["rounds"] == 2 and merged["ttft_p50_ms"] == pytest.approx(200.0)
    # burst / later TTFT: medians over the rounds (150 and 350 ms in round 1, 50 and 250 in round 2)
    f3 = dict(f2, ttft_burst_ms=50.0, ttft_later_ms=250.0)
    assert b._ttft_phases(b._merge_rounds([dict(f, round=1), f3])) == (pytest.approx(100.0), pytest.approx(300.0))
    phase = [t for t in tgt if "TTFT median of the burst" in t]
    assert phase == ["- fst @ 4 × 2 (median of 2 rounds): (context, not a target) TTFT median of the burst (the first 2 "
                     "requests, sent at once) / of the later requests (each sent as one ends): 150 / 350 vs 200 / 300 ms "
                     "(0.75× / 1.17× xgrammar's)."]


def test_bench_compile_serving_stages(fst_artifacts):
    """scripts/bench_compile_serving.py compiles the first serving constraints for real (canonical, SmolLM2)
    and reports every stage: the stage sums are positive where the stage ran and add up to at most the
    compile sum."""
    from scripts import bench_compile_serving as b

    cases = b.serving_constraints(3)
    assert [c[1] for c in cases] == ["json", "json", "regex"]
    rows = b.measure_fst(cases, fst_artifacts("smollm2"), repeats=1)
    assert len(rows) == 3
    for r in rows:
        stages = sum(r[k] for k, _ in b.STAGES)
        assert r["ms_char"] > 0 and r["ms_token"] > 0 and r["ms_deadend"] > 0, r
        assert 0 < stages <= r["ms"], r
        assert r["byte_states"] > 1
    ordered = b.measure_fst_in_order(cases, fst_artifacts("smollm2"), repeats=1)
    assert len(ordered) == 3 and all(o["ms"] > 0 and 0.0 <= o["found"] <= 1.0 for o in ordered)
    assert ordered[0]["ms_deadend"] > 0
    lines = b.table(rows, ordered, None).splitlines()
    assert lines[2].startswith("| 3 (2 JSON schemas) | cold |") and "n/a" in lines[2]
    assert lines[3].startswith("| 3 (2 JSON schemas) | in serving order |")


def test_fst_sequential_is_fst_without_the_overlap_and_serving_only():
    b = _bench()
    cmd = b.server_command("fst-sequential", 8790, 8, [])
    assert cmd[cmd.index("--structured-outputs-config.backend") + 1] == "fst" and "--speculative-config" not in cmd
    assert b.parse_args(["--workloads", "serving", "--backends", "fst,fst-sequential,fst-early-prefill,fst-overlap-all"]
                        ).backends == ["fst", "fst-sequential", "fst-early-prefill", "fst-overlap-all"]
    for extra in ("fst-sequential", "fst-early-prefill", "fst-overlap-all"):
        with pytest.raises(SystemExit):
            b.parse_args(["--workloads", "mc", "--backends", extra])


def test_jump_targets_name_the_batch_ceiling_the_single_stream_rate_and_greedy_identity():
    b = _bench()

    def row(backend, wl, tok_s, stream, ids):
        return {"backend": backend, "workload": wl, "tok_s": tok_s, "stream_tok_s": stream, "greedy_ids": ids,
                "canonical": 1.0 if backend.startswith("fst") else 0.5}

    rows = [row("fst", "pokedex", 500.0, 60.0, [[1, 2], [1, 4]]), row("fst-jump", "pokedex", 510.0, 150.0, [[1, 2], [1, 3]]),
            row("xgrammar", "pokedex", 500.0, 75.0, None), row("unconstrained", "pokedex", 520.0, None, None)]
    text = "\n".join(b.targets_text(rows, {}))
    assert ("n = 50 per request: 1.02× (510.0 vs 500.0; the model's own rate, unconstrained, is 1.04× xgrammar's; "
            "fst without jumps 1.00×) (NOT met)") in text
    assert "single stream (greedy, n = 1): 2.00× (150.0 vs 75.0; fst without jumps 0.80×) (met)" in text
    assert "near-tie): pokedex 1 of 2 (fst: 2 distinct in 2) (NOT met)" in text
    rows[1]["greedy_ids"] = [[1, 4], [1, 2]]
    assert "near-tie): pokedex 2 of 2 (fst: 2 distinct in 2) (met)" in "\n".join(b.targets_text(rows, {}))
    rows += [row("fst", "mc", 1.0, None, [[5], [6]]), row("fst-jump", "mc", 1.0, None, [[6], [5]])]  # per question
    assert "near-tie): mc 0 of 2, pokedex 2 of 2 (fst: 2 distinct in 2) (NOT met)" in "\n".join(b.targets_text(rows, {}))


def test_health_poller_separate_process():
    """The /health poller of the serving workload times a real HTTP server from its own process, and counts
    a non-200 answer as an error with its time."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from scripts import bench_e2e as b

    status = {"code": 200}

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            if status["code"] != 200:
                time.sleep(0.05)
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        poller = b.HealthPoller(f"http://127.0.0.1:{srv.server_address[1]}", period=0.01)
        time.sleep(0.3)
        status["code"] = 503
        time.sleep(0.2)
        out = poller.stop()
    finally:
        srv.shutdown()
    assert len(out["times"]) >= 10 and all(0 < t < 5 for t in out["times"])
    assert out["errors"] and all(e == "HTTP 503" for e in out["errors"]) and max(out["times"]) >= 0.05


@pytest.mark.e2e
def test_bench_mask_apply_masks_and_timings(fst_artifacts):
    """scripts/bench_mask_apply.py: one step's masks of real fst and xgrammar matchers on the serving
    constraints (a row per request, mask words of every kind), both paths timed on them."""
    import numpy as np

    from scripts import bench_mask_apply as b
    from scripts.bench_compile_serving import serving_constraints

    arts = fst_artifacts("smollm2")
    V = int(arts.vocab_size)
    cases = serving_constraints(3)
    masks = b.fst_masks(cases, arts, steps=4, seed=0)
    xmasks = b.xgrammar_masks(cases, V, steps=2, seed=0)
    assert len(masks) == 4 and len(xmasks) == 2
    assert all(m.shape == (3, (V + 31) // 32) and m.dtype == np.int32 for m in masks + xmasks)
    for ms in (masks, xmasks):
        ones, zeros, some = b.word_shares(ms)
        assert zeros > 0 and some > 0 and abs(ones + zeros + some - 1) < 1e-9
    v = b.time_per_step(b.vllm_path, masks, V, 1)
    f = b.time_per_step(b.fst_path, masks, V, 1)
    assert len(v) == len(f) == 4 and min(v) > 0 and min(f) > 0


@pytest.mark.e2e
def test_bench_recovered_tokens_drafts_and_inputs(fst_artifacts):
    """scripts/bench_recovered_tokens.py: per step, the drafts of each request are its matcher's forced
    chain (some steps have drafts, at most 8 each); the step's inputs give one-token targets on the
    drafts, or targets over 64 tokens."""
    import numpy as np
    import torch

    from scripts import bench_recovered_tokens as b
    from scripts.bench_compile_serving import serving_constraints

    arts = fst_artifacts("smollm2")
    counts = b.draft_counts(serving_constraints(3), arts, steps=6, seed=0)
    assert len(counts) == 6 and all(len(c) == 3 for c in counts)
    assert any(sum(c) for c in counts) and max(max(c) for c in counts) <= b.MAX_DRAFTS
    step = next(c for c in counts if sum(c))
    V = int(arts.vocab_size)
    cu, draft, probs = b.step_inputs(step, V, wide=False, rng=np.random.default_rng(0))
    assert int(cu[-1]) == sum(step) == len(draft) and probs.shape == (sum(step), V)
    assert torch.equal(probs.argmax(-1), draft.long()) and torch.equal(torch.count_nonzero(probs, dim=-1),
                                                                       torch.ones(len(draft), dtype=torch.int64))
    _, _, wide = b.step_inputs(step, V, wide=True, rng=np.random.default_rng(0))
    assert (torch.count_nonzero(wide, dim=-1) > 1).all() and torch.allclose(wide.sum(-1), torch.ones(len(draft)))
