#!/usr/bin/env python
"""Bitmask application on CPU logits, per decoding step: vLLM's path against fst's.

vLLM's CPU path (``apply_grammar_bitmask``) converts the logits to float32, runs xgrammar's CPU kernel
and converts back; a worker serving fst applies the same masks in the logits' own dtype
(``vllm_fst_backend/runtime/logits_mask.py``, installed by ``vllm/patches._patch_cpu_mask_apply``).
Both are timed on the masks of one engine step of B requests (bfloat16 logits of SmolLM2's 49,152
tokens, as the served model has), each request with its own constraint of the serving workload
(``scripts/bench_e2e.make_serving_cases``: JSON schemas and regexes), along random walks:

* fst: the masks fst's matchers fill (canonical mode), applied by vLLM's path and by fst's;
* xgrammar: the masks xgrammar's matchers fill for the same constraints (JSON schemas through
  ``compile_json_schema``), applied by vLLM's path (what an xgrammar server pays).

Reports, per batch size, the p50 and mean time per step and the share of mask words that allow every
token (skipped), none, or some. Writes section "Bitmask application on CPU" of docs/benchmarks.md.

Usage: python scripts/bench_mask_apply.py [--batch 8,32] [--steps 60] [--repeats 3] [--no-write]
"""

from __future__ import annotations

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

MODEL = str(ROOT / "models" / "SmolLM2-135M-Instruct")


def _walk(n: int, alloc, fill, done, accept, stop: set, V: int, steps: int, seed: int) -> list[np.ndarray]:
    """``int32[n, W]`` per step of ``n`` matchers along random walks: ``alloc()`` a bitmask with every bit
    set, ``fill(bm, i)`` row ``i`` unless ``done(i)`` (a finished request keeps its all-ones row, as vLLM
    leaves it), then ``accept(i, token)`` of a token picked among the allowed ones as bench_compile's walks
    pick them (``_pick``: a ``stop`` token with probability 0.3 when one is allowed)."""
    from scripts.bench_compile import _ids, _pick

    eos = np.asarray(sorted(stop))
    rnd = random.Random(seed)
    out = []
    for _ in range(steps):
        bm = alloc()
        for i in range(n):
            if not done(i):
                fill(bm, i)
        out.append(bm.numpy().copy())
        for i in range(n):
            if done(i):
                continue
            tok = _pick(_ids(bm[i])[:V], eos, rnd)
            if tok is not None:
                accept(i, tok)
    return out


def fst_matchers(cases, arts) -> list:
    """One fst matcher (canonical mode) per serving case ``(name, kind, spec)``."""
    from scripts.bench_compile_serving import fst_regex
    from vllm_fst_backend.compiler import CompileOptions, compile_regex
    from vllm_fst_backend.runtime import FstMatcher

    return [FstMatcher(compile_regex(fst_regex(kind, spec), arts, CompileOptions(canonical=True)))
            for _, kind, spec in cases]


def fst_masks(cases, arts, steps: int, seed: int) -> list[np.ndarray]:
    """:func:`_walk` of fst's matchers (:func:`fst_matchers`)."""
    ms = fst_matchers(cases, arts)
    W = ms[0].compiled.num_words
    return _walk(len(ms), lambda: torch.full((len(ms), W), -1, dtype=torch.int32), lambda bm, i: ms[i].fill_bitmask(bm, i),
                 lambda i: ms[i].is_terminated(), lambda i, t: ms[i].accept_tokens("r", [t]), set(ms[0].eos_ids),
                 int(arts.vocab_size), steps, seed)


def xgrammar_masks(cases, V: int, steps: int, seed: int) -> list[np.ndarray]:
    """The same for xgrammar's matchers (JSON schemas compiled as JSON schemas, regexes as regexes)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(MODEL), vocab_size=V)
    comp = xgr.GrammarCompiler(info, max_threads=1)
    ms = [xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(spec)) if kind == "json" else comp.compile_regex(spec))
          for _, kind, spec in cases]
    return _walk(len(ms), lambda: xgr.allocate_token_bitmask(len(ms), V), lambda bm, i: ms[i].fill_next_token_bitmask(bm, i),
                 lambda i: ms[i].is_terminated(), lambda i, t: ms[i].accept_token(t), set(info.stop_token_ids),
                 V, steps, seed)


def vllm_path(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """vLLM 0.32 / 0.33's CPU branch of ``apply_grammar_bitmask`` (every row structured)."""
    import xgrammar as xgr

    f = logits.to(torch.float32)
    xgr.apply_token_bitmask_inplace(f, torch.from_numpy(bitmask))
    logits.copy_(f.to(logits.dtype))


def fst_path(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    from vllm_fst_backend.runtime import logits_mask

    logits_mask.apply_token_bitmask_inplace(logits, bitmask)


def time_per_step(fn, masks, V: int, repeats: int) -> list[float]:
    """µs per step: ``fn`` on a fresh copy of bfloat16 logits ``[B, V]`` per mask (best of ``repeats``)."""
    base = torch.from_numpy(np.random.default_rng(0).standard_normal((masks[0].shape[0], V), dtype=np.float32)).to(torch.bfloat16)
    out = []
    for m in masks:
        best = float("inf")
        for _ in range(repeats):
            lg = base.clone()
            t0 = time.perf_counter()
            fn(lg, m)
            best = min(best, time.perf_counter() - t0)
        out.append(best * 1e6)
    return out


def word_shares(masks) -> tuple[float, float, float]:
    allw = np.concatenate([m.reshape(-1) for m in masks])
    ones, zeros = float((allw == -1).mean()), float((allw == 0).mean())
    return ones, zeros, 1.0 - ones - zeros


def main(argv=None) -> int:
    from scripts.bench_common import p50_mean_cell, step_bench_args

    args = step_bench_args(__doc__, argv, steps=60)

    from scripts.bench_compile_serving import serving_constraints
    from vllm_fst_backend.artifacts.build import build_artifacts, default_name
    from vllm_fst_backend.compiler import prepare
    from vllm_fst_backend.runtime import logits_mask

    arts, _ = build_artifacts(MODEL, str(ROOT / "tokenizer_artifacts" / default_name(MODEL)), progress=False)
    prepare(arts, canonical=True)
    logits_mask.warm_up()
    V = int(arts.vocab_size)
    rows = ["| requests per step | masks | words all allowed / none / some | vLLM's path p50 / mean µs | fst's path p50 / mean µs | vLLM's / fst's (p50) |",
            "|---|---|---|---|---|---|"]
    for B in [int(b) for b in args.batch.split(",")]:
        cases = serving_constraints(B)
        for name, masks in (("fst", fst_masks(cases, arts, args.steps, args.seed)),
                            ("xgrammar", xgrammar_masks(cases, V, args.steps, args.seed))):
            ones, zeros, some = word_shares(masks)
            v = time_per_step(vllm_path, masks, V, args.repeats)
            f = time_per_step(fst_path, masks, V, args.repeats) if name == "fst" else None
            fst_cell = p50_mean_cell(f) if f else "– (not used)"
            ratio = f"{statistics.median(v) / statistics.median(f):.1f}×" if f else "–"
            row = f"| {B} | {name} | {ones:.0%} / {zeros:.0%} / {some:.0%} | {p50_mean_cell(v)} | {fst_cell} | {ratio} |"
            rows.append(row)
            print(row, flush=True)
    note = (f"Tokenizer and logits: SmolLM2-135M-Instruct (V = {V}), bfloat16 logits `[B, V]` (the dtype the CPU "
            f"server computes in). Masks: B requests, each with its own serving-workload constraint (the first "
            f"B of `make_serving_cases`), one random walk of {args.steps} steps per request (EOS taken with "
            f"probability 0.3 when allowed; a finished request keeps an all-ones row), fst canonical and "
            f"xgrammar 0.2.8 matchers on the same constraints. Time per step: the best of {args.repeats} runs on a "
            "fresh copy of the logits; p50 and mean over the steps. vLLM's path: the float32 round trip around "
            "`xgrammar.apply_token_bitmask_inplace` (vLLM 0.32 / 0.33, CPU); fst's path: "
            "`runtime/logits_mask.apply_token_bitmask_inplace`, what a worker serving fst runs instead "
            "(same logits bit for bit: `tests/test_logits_mask.py`). A decode step of the served 135M model "
            "takes ~20 ms with 1-7 requests and ~65-80 ms with 24-32 on this host (the serving hand notes).")
    from scripts.bench_common import report_section

    report_section("Bitmask application on CPU", "bench_mask_apply.py", argv, "\n".join(rows), note, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
