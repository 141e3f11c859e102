#!/usr/bin/env python
"""Compile time and per-step mask-fill time: vllm-fst-backend vs xgrammar, llguidance, outlines-core.

For each regex (paper 001 App. C.4's five, paper 000 App. C's Pokédex template, and two free-text
constraints) and each backend, on the same tokenizer (default SmolLM2, 49,152 tokens):

* **cold compile**: median (and p90) of ``--repeats`` (>= 10) compilations with every compile cache off
  (fst: no CompiledCache, fresh automaton each time, no dead-end verdict of an earlier compile;
  xgrammar: ``cache_enabled=False``; llguidance and
  outlines-core have no cross-call cache). Per-tokenizer preparation (fst: ``prepare``; xgrammar:
  ``TokenizerInfo``; llguidance: ``LLTokenizer``; outlines: ``Vocabulary``) is done once, outside.
* **fill**: p50 / p99 in µs of one ``fill_bitmask`` call (one row of an ``int32`` bitmask of the
  backend's width), over random walks that pick uniformly among the allowed tokens (EOS with
  probability 0.3 when allowed), ``--walks`` walks of at most ``--steps`` steps, each with a new
  matcher; one bitmask tensor per backend serves every walk, as vLLM fills one tensor for all requests.
* **advance**: p50 in µs of accepting the picked token (fst ``accept_tokens``, xgrammar
  ``accept_token``, llguidance ``consume_token``, outlines ``advance``) on the same walks.

Writes a table and a PNG plot (``docs/bench_compile.png``) into ``docs/benchmarks.md`` (section
"Compile and fill"), with the exact command.

Usage: python scripts/bench_compile.py [--tokenizer models/SmolLM2-135M-Instruct] [--artifacts DIR]
       [--repeats 10] [--walks 5] [--steps 100] [--backends fst,fst-any,xgrammar,llguidance,outlines]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench_common import JSON_OBJECT_SCHEMA  # noqa: E402

COLORS = ["Red", "Orange", "Yellow", "Green", "Blue", "Indigo", "Violet"]
JSON_SCHEMA = JSON_OBJECT_SCHEMA

_TYPES = "Bug|Dark|Dragon|Electric|Fairy|Fighting|Fire|Flying|Ghost|Grass|Ground|Ice|Normal|Poison|Psychic|Rock|Steel|Stellar|Water"
_ABIL = "Overgrow|Blaze|Torrent|Shield Dust|Intimidate|Levitate|Pressure|Static"
POKEDEX = (
    r'\{\n  "alias": "[a-z]{1,5}",\n  "description": "[A-Z][a-z][0-9][\w\s,.!?]{1,3}",\n'
    rf'  "type": "({_TYPES})",\n  "height_m": [0-9]{{1,2}}\.[0-9]{{1}},\n  "weight_kg": [0-9]{{1,3}}\.[0-9]{{1}},\n'
    r'  "evolution_stage": "(Basic|Stage 1|Stage 2)",\n  "legendary": "(true|false)",\n'
    rf'  "abilities": \[\n    "({_ABIL})"(, "({_ABIL})"){{0,6}}\n  \]\n\}}'
)


def regexes() -> dict[str, str]:
    from outlines_core.json_schema import build_regex_from_schema

    return {
        "multiple choice": "|".join(COLORS),
        "ISO date-time": r"\d{4}-[01]\d-[0-3]\dT[0-2]\d:[0-5]\d:[0-5]\d([+][0-2]\d:[0-5]\d|Z)",
        "IPv4": r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
        "quoted text": r'" *(?:[^\s"\\]|\\["n\\])?(?: [^\s"\\]|\\["n\\])*"',
        "JSON object": build_regex_from_schema(json.dumps(JSON_SCHEMA)),
        "Pokédex": POKEDEX,
        "[A-Za-z ,]{5,60}\\.": r"[A-Za-z ,]{5,60}\.",
        "[^\\n]{1,200}": r"[^\n]{1,200}",
    }


CATEGORY = {
    "multiple choice": "simple", "ISO date-time": "simple", "IPv4": "simple", "quoted text": "free-text",
    "JSON object": "JSON", "Pokédex": "JSON", "[A-Za-z ,]{5,60}\\.": "free-text", "[^\\n]{1,200}": "free-text",
}
TARGET_MS = {"simple": 10, "JSON": 100, "free-text": 250}


# --- backends: compile(regex) -> object; walk(obj, rnd, steps) -> (fill times, advance times) in ns ---


class Fst:
    def __init__(self, artifacts, canonical: bool):
        from vllm_fst_backend.compiler import CompileOptions, prepare
        from vllm_fst_backend.compiler.service import settle_heap

        self.arts = artifacts
        self.opts = CompileOptions(canonical=canonical)
        prepare(artifacts, canonical=canonical)
        settle_heap()  # (as the compile process does once prepared: compiler/service.py)
        self.name = "fst canonical" if canonical else "fst"

    def cold(self):
        """Before each timed compile: no dead-end verdict of an earlier compile (compiler/verdict_cache.py)."""
        from vllm_fst_backend.compiler import forget_verdicts

        forget_verdicts(self.arts)

    def compile(self, regex):
        from vllm_fst_backend.compiler import compile_regex

        return compile_regex(regex, self.arts, self.opts)

    def walk(self, c, rnd, steps):
        from vllm_fst_backend.runtime import FstMatcher

        m = FstMatcher(c)
        bm = _bitmask(self, (1, c.num_words), lambda: torch.zeros((1, c.num_words), dtype=torch.int32))
        eos = np.asarray(m.eos_ids)
        return _timed_walk(lambda: m.fill_bitmask(bm, 0), lambda: _ids(bm[0]), lambda t: m.accept_tokens("b", [t]),
                           m.is_terminated, eos, rnd, steps)


class Xgr:
    name = "xgrammar"

    def __init__(self, hf_tok, V):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=V)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.V = V
        self.eos = np.asarray(self.info.stop_token_ids)

    def compile(self, regex):
        return self.compiler.compile_regex(regex)

    def walk(self, cg, rnd, steps):
        m = self.xgr.GrammarMatcher(cg)
        bm = _bitmask(self, (1, self.V), lambda: self.xgr.allocate_token_bitmask(1, self.V))
        return _timed_walk(lambda: m.fill_next_token_bitmask(bm, 0), lambda: _ids(bm[0])[: self.V], m.accept_token,
                           m.is_terminated, self.eos, rnd, steps)


class LLG:
    name = "llguidance"

    def __init__(self, hf_tok, V):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tok, V)
        self.V = V
        self.eos = np.asarray([self.tok.eos_token])

    def compile(self, regex):
        m = self.llg.LLMatcher(self.tok, self.llg.LLMatcher.grammar_from_regex(regex))
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def walk(self, m, rnd, steps):
        import llguidance.torch as lt

        bm = _bitmask(self, (1, self.V), lambda: lt.allocate_token_bitmask(1, self.V))
        return _timed_walk(lambda: lt.fill_next_token_bitmask(m, bm, 0), lambda: _ids(bm[0])[: self.V], m.consume_token,
                           m.is_stopped, self.eos, rnd, steps)


class Outlines:
    name = "outlines-core"

    def __init__(self, info):
        import outlines_core as oc

        self.oc = oc
        vocab: dict[bytes, list[int]] = {}
        eos = int(info.eos_ids[0])
        for i, b in enumerate(info.token_bytes):
            if b and i != eos:
                vocab.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(eos, vocab)
        self.V = info.vocab_size
        self.eos = np.asarray([eos])

    def compile(self, regex):
        return self.oc.Index(regex, self.vocab)

    def walk(self, index, rnd, steps):
        g = self.oc.Guide(index)
        bm = _bitmask(self, (1, self.V), lambda: torch.zeros((1, (self.V + 31) // 32), dtype=torch.int32))
        row = bm[0]

        def accept(tok):
            g.advance(tok)
            return True

        # the guide has no terminal state to enter: stop before EOS or once finished
        return _timed_walk(lambda: g.write_mask_into(row.data_ptr(), row.numel(), row.element_size()),
                           lambda: _ids(bm[0])[: self.V], accept, lambda: False, self.eos, rnd, steps,
                           stop_before=lambda tok: tok in self.eos or g.is_finished())


def _bitmask(backend, key, make):
    """The backend's bitmask tensor for ``key`` (allocated by ``make()`` on first use, then reused by
    every walk: vLLM allocates one bitmask per engine and fills it for every request)."""
    cache = backend.__dict__.setdefault("_bitmasks", {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _timed_walk(fill, allowed, accept, done, eos, rnd, steps, stop_before=None) -> tuple[list[int], list[int]]:
    """One random walk of at most ``steps`` steps: ``fill()`` (timed), pick a token among ``allowed()``
    (:func:`_pick`), stop if there is none or ``stop_before(token)``, else ``accept(token)`` (timed; stop
    when it returns False or ``done()``). Returns ``(fill ns, advance ns)`` lists."""
    out, adv = [], []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        fill()
        out.append(time.perf_counter_ns() - t0)
        tok = _pick(allowed(), eos, rnd)
        if tok is None or (stop_before is not None and stop_before(tok)):
            break
        t0 = time.perf_counter_ns()
        ok = accept(tok)
        adv.append(time.perf_counter_ns() - t0)
        if not ok or done():
            break
    return out, adv


def _ids(row) -> np.ndarray:
    r = row.numpy().astype("<i4").view(np.uint8)
    return np.flatnonzero(np.unpackbits(r, bitorder="little"))


def _pick(ids, eos, rnd):
    if not len(ids):
        return None
    is_eos = np.isin(ids, eos)
    if is_eos.any() and (is_eos.all() or rnd.random() < 0.3):
        return int(ids[is_eos][0])
    rest = ids[~is_eos]
    return int(rest[rnd.randrange(len(rest))])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--artifacts", default=None, help="artifacts dir (default tokenizer_artifacts/<name>, built if stale)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--backends", default="fst,fst-any,xgrammar,llguidance,outlines")
    ap.add_argument("--only", default=None, help="comma-separated regex names")
    ap.add_argument("--no-write", action="store_true", help="print only; do not touch docs/benchmarks.md")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from vllm_fst_backend.artifacts.build import build_artifacts, default_name
    from vllm_fst_backend.artifacts.tokenizer_info import load_tokenizer

    info = load_tokenizer(args.tokenizer)
    art_dir = args.artifacts or str(ROOT / "tokenizer_artifacts" / default_name(args.tokenizer))
    arts, _ = build_artifacts(args.tokenizer, art_dir, progress=False)
    V = info.vocab_size
    wanted = args.backends.split(",")
    backends = []
    for b in wanted:
        try:
            if b == "fst":
                backends.append(Fst(arts, True))
            elif b == "fst-any":
                backends.append(Fst(arts, False))
            elif b in ("xgrammar", "llguidance"):
                hf = AutoTokenizer.from_pretrained(args.tokenizer)
                backends.append(Xgr(hf, V) if b == "xgrammar" else LLG(hf, V))
            elif b == "outlines":
                backends.append(Outlines(info))
        except Exception as e:  # a missing optional package
            print(f"skipping {b}: {e}", file=sys.stderr)
    regs = regexes()
    if args.only:
        regs = {k: v for k, v in regs.items() if k in args.only.split(",")}
    results: dict = {}
    for rname, regex in regs.items():
        for be in backends:
            times, err = [], None
            obj = None
            for _ in range(args.repeats):
                getattr(be, "cold", lambda: None)()
                t0 = time.perf_counter()
                try:
                    obj = be.compile(regex)
                except Exception as e:
                    err = f"{type(e).__name__}: {str(e)[:60]}"
                    break
                times.append(time.perf_counter() - t0)
            fills: list[int] = []
            advs: list[int] = []
            if err is None:
                rnd = random.Random(0)
                for _ in range(args.walks):
                    f_ns, a_ns = be.walk(obj, rnd, args.steps)
                    fills += f_ns
                    advs += a_ns
            res = {"error": err}
            if times:
                res.update(compile_ms_p50=1e3 * statistics.median(times), compile_ms_p90=1e3 * float(np.percentile(times, 90)))
            if fills:
                f = np.asarray(fills) / 1e3
                res.update(fill_us_p50=float(np.percentile(f, 50)), fill_us_p99=float(np.percentile(f, 99)), steps=len(f))
            if advs:
                res.update(advance_us_p50=float(np.percentile(np.asarray(advs) / 1e3, 50)))
            results[(rname, be.name)] = res
            print(f"{rname:22s} {be.name:14s} " + (err or
                  f"compile p50 {res['compile_ms_p50']:8.2f} ms  fill p50 {res.get('fill_us_p50', float('nan')):7.2f} µs "
                  f"p99 {res.get('fill_us_p99', float('nan')):8.2f} µs  advance p50 "
                  f"{res.get('advance_us_p50', float('nan')):7.2f} µs"), flush=True)

    # --- table + plot ----------------------------------------------------------------------------------
    names = [b.name for b in backends]
    lines = ["| regex | target (fst canonical) | " + " | ".join(f"{n} compile ms / fill p50, p99 µs / advance p50 µs"
                                                                for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for rname in regs:
        cells = []
        for n in names:
            r = results.get((rname, n), {})
            if r.get("error"):
                cells.append(f"error ({r['error']})")
            else:
                cells.append(f"{r.get('compile_ms_p50', float('nan')):.1f} / {r.get('fill_us_p50', float('nan')):.1f}, "
                             f"{r.get('fill_us_p99', float('nan')):.1f} / {r.get('advance_us_p50', float('nan')):.1f}")
        cat = CATEGORY[rname]
        lines.append(f"| `{rname}` | {cat}: compile ≤ {TARGET_MS[cat]} ms, fill p50 ≤ 5 µs, advance p50 ≤ 10 µs | "
                     + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return 0
    png = ROOT / "docs" / "bench_compile.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(14, 5))
        x = np.arange(len(regs))
        w = 0.8 / max(1, len(names))
        for i, n in enumerate(names):
            comp = [results.get((r, n), {}).get("compile_ms_p50", np.nan) for r in regs]
            fill = [results.get((r, n), {}).get("fill_us_p50", np.nan) for r in regs]
            axes[0].bar(x + i * w, comp, w, label=n)
            axes[1].bar(x + i * w, fill, w, label=n)
        for ax, title in zip(axes, ["cold compile p50 (ms, log)", "fill p50 (µs, log)"]):
            ax.set_yscale("log")
            ax.set_title(title)
            ax.set_xticks(x + 0.4 - w / 2)
            ax.set_xticklabels(list(regs), rotation=30, ha="right", fontsize=8)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
    except Exception as e:
        print(f"plot skipped: {e}", file=sys.stderr)
    from scripts.bench_common import write_section

    import os
    cmd = "python scripts/bench_compile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    note = (f"Tokenizer `{args.tokenizer}` (V = {V}). {args.repeats} cold compiles per cell (median), fill over "
            f"{args.walks} random walks of ≤ {args.steps} steps (a new matcher each, one bitmask tensor per backend "
            f"for all walks, as vLLM's one per engine). Host: {os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.1f} at the end of the run (other jobs shared the machine). "
            "fst canonical = canonical tokenizations only (the default); fst = any tokenization. "
            "![compile and fill](bench_compile.png)")
    write_section("Compile and fill", cmd.strip(), table, note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
