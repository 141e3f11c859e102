#!/usr/bin/env python
"""The rejection sampler's recovered tokens on CPU with jumps, per decoding step: vLLM's function against
the one a worker with fst's jump proposer runs (``vllm/patches.patch_cpu_recovered``).

vLLM's ``rejection_sampler.sample_recovered_tokens`` draws an exponential variate per vocabulary entry for
every request of a step that verifies drafts; fst's replacement draws them only for the requests whose
recovered tokens can be read (requests with drafts, less the unseeded ones whose drafts are all accepted
for sure: target probability 1, as forced tokens have, what the jump proposer drafts). Both are timed on the inputs of one
step of B requests (SmolLM2's 49,152 tokens): the drafts of each request are fst's forced-token chain at
that point of a random walk of its serving-workload constraint (``scripts/bench_e2e.make_serving_cases``;
at most 8 per request, the served ``num_speculative_tokens``), and each draft's target puts all its mass
on the draft token (a forced token under the grammar's bitmask). A row "wide targets" gives every draft a
target spread over 64 tokens instead (a proposer whose drafts are not forced: the noise is drawn as by
vLLM for the requests with drafts). Writes section "Recovered tokens with jumps on CPU" of
docs/benchmarks.md.

Usage: python scripts/bench_recovered_tokens.py [--batch 8,32] [--steps 40] [--repeats 3] [--no-write]
"""

from __future__ import annotations

import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = str(ROOT / "models" / "SmolLM2-135M-Instruct")
MAX_DRAFTS = 8


def draft_counts(cases, arts, steps: int, seed: int) -> list[list[int]]:
    """Per step, the number of drafts of each request: the length of its matcher's forced-token chain
    (at most :data:`MAX_DRAFTS`; 0 once finished) along the random walks of ``bench_mask_apply``
    (:func:`~scripts.bench_mask_apply._walk` of :func:`~scripts.bench_mask_apply.fst_matchers`)."""
    from scripts.bench_mask_apply import _walk, fst_matchers

    ms = fst_matchers(cases, arts)
    W = ms[0].compiled.num_words
    out: list[list[int]] = []

    def alloc():  # (a step starts: a finished request drafts nothing)
        out.append([0] * len(ms))
        return torch.full((len(ms), W), -1, dtype=torch.int32)

    def fill(bm, i):
        out[-1][i] = len(ms[i].forced_tokens(MAX_DRAFTS))
        ms[i].fill_bitmask(bm, i)

    _walk(len(ms), alloc, fill, lambda i: ms[i].is_terminated(), lambda i, t: ms[i].accept_tokens("r", [t]),
          set(ms[0].eos_ids), int(arts.vocab_size), steps, seed)
    return out


def step_inputs(counts: list[int], V: int, wide: bool, rng: np.random.Generator):
    """``(cu_num_draft_tokens, draft_token_ids, target_probs)`` of one step whose requests have ``counts``
    drafts: one-token targets on the draft tokens, or (``wide``) targets spread over 64 tokens."""
    n = sum(counts)
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    draft = torch.tensor(rng.integers(0, V, n), dtype=torch.int32)
    probs = torch.zeros((n, V), dtype=torch.float32)
    if wide:
        cols = torch.tensor(rng.integers(0, V, (n, 64)))
        probs.scatter_(1, cols, 1.0)
        probs /= probs.sum(-1, keepdim=True)
    else:
        probs[torch.arange(n), draft.long()] = 1.0
    return cu, draft, probs


def time_step(fn, counts, cu, draft, probs, repeats: int) -> float:
    meta = types.SimpleNamespace(generators={})
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(MAX_DRAFTS, counts, cu, draft, None, probs, meta, torch.device("cpu"))
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best


def main(argv=None) -> int:
    from scripts.bench_common import p50_mean_cell, step_bench_args

    args = step_bench_args(__doc__, argv, steps=40)

    import vllm.v1.sample.rejection_sampler as rs
    from vllm.utils import cpu_triton_utils

    from scripts.bench_compile_serving import serving_constraints
    from vllm_fst_backend.artifacts.build import build_artifacts, default_name
    from vllm_fst_backend.compiler import prepare
    from vllm_fst_backend.vllm import patches

    def cpu_kernel(out, cu, draft, draft_probs, target_probs, inv_q, *, max_spec_len):
        # what a CPU worker binds vLLM's Triton kernel to (vllm/platforms/cpu.py)
        cpu_triton_utils._sample_recovered_tokens_kernel_impl(out, cu, draft, draft_probs, target_probs, inv_q,
                                                              target_probs.shape[1], NO_DRAFT_PROBS=draft_probs is None)

    rs._sample_recovered_tokens = cpu_kernel
    vllm_fn = getattr(rs.sample_recovered_tokens, "__fst_original__", rs.sample_recovered_tokens)
    fst_fn = patches._recovered_tokens_for_draft_rows(rs)

    arts, _ = build_artifacts(MODEL, str(ROOT / "tokenizer_artifacts" / default_name(MODEL)), progress=False)
    prepare(arts, canonical=True)
    V = int(arts.vocab_size)
    rng = np.random.default_rng(args.seed)
    rows = ["| requests per step | targets | steps with drafts | drafts per such step (mean) | vLLM's function p50 / mean µs | fst's p50 / mean µs | vLLM's / fst's (p50) |",
            "|---|---|---|---|---|---|---|"]
    for B in [int(b) for b in args.batch.split(",")]:
        steps = [c for c in draft_counts(serving_constraints(B), arts, args.steps, args.seed) if sum(c)]
        for wide in (False, True):
            v, f = [], []
            for counts in steps:
                cu, draft, probs = step_inputs(counts, V, wide, rng)
                v.append(time_step(vllm_fn, counts, cu, draft, probs, args.repeats))
                f.append(time_step(fst_fn, counts, cu, draft, probs, args.repeats))
            row = (f"| {B} | {'wide (64 tokens)' if wide else 'one token (forced)'} | {len(steps)} of {args.steps} | "
                   f"{statistics.mean(sum(c) for c in steps):.1f} | {p50_mean_cell(v)} | {p50_mean_cell(f)} | "
                   f"{statistics.median(v) / statistics.median(f):.1f}× |")
            rows.append(row)
            print(row, flush=True)
    note = (f"Vocabulary: SmolLM2-135M-Instruct (V = {V}). Steps: B requests, each with its own serving-workload "
            f"constraint (the first B of `make_serving_cases`, fst canonical), one random walk of {args.steps} "
            f"steps per request; a step's drafts per request are the length of its forced-token chain (at most "
            f"{MAX_DRAFTS}); only steps with at least one draft are timed (vLLM calls the function only then). "
            f"Time per step: the best of {args.repeats} runs; p50 and mean over those steps. The kernel is vLLM's CPU "
            "one (`cpu_triton_utils._sample_recovered_tokens_kernel_impl`), no draft probabilities (as the jump "
            "proposer); unseeded requests. vLLM's function: noise for every request of the step; fst's "
            "(`vllm/patches._recovered_tokens_for_draft_rows`): for the requests whose recovered tokens can be "
            "read (not those whose drafts all have target probability 1: always accepted; the sampler's output "
            "tokens are the same, and the recovered tokens it reads keep their distribution: "
            "`tests/test_logits_mask.py`). The rows with wide targets cost what the previous version of the patch "
            "(noise for every request with drafts) cost for forced drafts too.")
    from scripts.bench_common import report_section

    report_section("Recovered tokens with jumps on CPU", "bench_recovered_tokens.py", argv, "\n".join(rows), note,
                   write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
