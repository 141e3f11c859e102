"""Per-step work of a CPU worker. Bitmask application on CPU logits (``runtime/logits_mask.py``) and its
vLLM touch point (``vllm/patches._patch_cpu_mask_apply``): the same logits, bit for bit, as vLLM's own CPU
path (float32 round trip around xgrammar's kernel), for real fst rows and random ones. The rejection
sampler's noise for requests with drafts only (``vllm/patches.patch_cpu_recovered``, jumps)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fst_testlib import fst_artifacts, grammar_bitmask_step  # noqa: F401  (fixture)
from vllm_fst_backend.runtime import logits_mask

xgr = pytest.importorskip("xgrammar")


def _vllm_cpu_path(logits, bitmask, rows=None):
    """What vLLM 0.32 / 0.33 do on CPU (``apply_grammar_bitmask``'s CPU branch)."""
    f = logits.to(torch.float32)
    xgr.apply_token_bitmask_inplace(f, torch.from_numpy(np.ascontiguousarray(bitmask)), indices=rows)
    logits.copy_(f.to(logits.dtype))


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _random_mask(rng, B, W):
    bm = rng.integers(-2**31, 2**31, size=(B, W), dtype=np.int64).astype(np.int32)
    kind = rng.integers(0, 4, size=(B, W))
    bm[kind == 0] = 0
    bm[kind == 1] = -1
    sparse = kind == 2  # sparser words
    bm[sparse] &= rng.integers(-2**31, 2**31, size=int(sparse.sum()), dtype=np.int64).astype(np.int32)
    return bm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("V", [49152, 1000, 33])
def test_same_logits_as_vllms_cpu_path(dtype, V):
    rng = np.random.default_rng(V)
    B, W = 6, (V + 31) // 32
    bm = _random_mask(rng, B, W)
    logits = torch.from_numpy(rng.standard_normal((B, V), dtype=np.float32) * 30).to(dtype)
    logits[0, :5] = float("inf")  # extreme values pass through untouched where allowed
    for rows in (None, [4, 1], []):
        want, got = logits.clone(), logits.clone()
        _vllm_cpu_path(want, bm, rows)
        logits_mask.apply_token_bitmask_inplace(got, bm, rows)
        assert torch.equal(_bits(got), _bits(want)), (dtype, V, rows)
        if rows == []:
            assert torch.equal(_bits(got), _bits(logits))
    # a bitmask wider than the logits (vLLM pads the vocabulary; the mask may cover more tokens)
    wide = np.concatenate([bm, np.zeros((B, 2), np.int32)], axis=1)
    want, got = logits.clone(), logits.clone()
    _vllm_cpu_path(want, wide)
    logits_mask.apply_token_bitmask_inplace(got, torch.from_numpy(wide))
    assert torch.equal(_bits(got), _bits(want))


def test_real_fst_rows_on_smollm2(fst_artifacts):
    """Rows of real SmolLM2 automata (a JSON string, free text, a template) along random walks."""
    from vllm_fst_backend.compiler import CompileOptions, compile_regex
    from vllm_fst_backend.runtime import FstMatcher

    arts = fst_artifacts("smollm2")
    rnd = random.Random(0)
    rows = []
    for rx in [r'\{"name": "[^"\\]{1,30}", "age": [0-9]{1,3}\}', r"[^\n]{1,80}", r"(yes|no|maybe)"]:
        c = compile_regex(rx, arts, CompileOptions(canonical=True))
        m = FstMatcher(c)
        bm = torch.zeros((1, c.num_words), dtype=torch.int32)
        for _ in range(40):
            m.fill_bitmask(bm, 0)
            rows.append(bm[0].numpy().copy())
            allowed = np.flatnonzero(np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little"))
            allowed = [t for t in allowed.tolist() if t not in m.eos_ids]
            if not allowed or not m.accept_tokens("r", [rnd.choice(allowed)]) or m.is_terminated():
                break
    masks = np.stack(rows)
    V = int(arts.vocab_size)
    logits = torch.from_numpy(np.random.default_rng(1).standard_normal((len(rows), V), dtype=np.float32)).to(torch.bfloat16)
    want, got = logits.clone(), logits.clone()
    _vllm_cpu_path(want, masks)
    logits_mask.apply_token_bitmask_inplace(got, masks)
    assert torch.equal(_bits(got), _bits(want))
    assert (torch.isinf(got) == ~torch.from_numpy(np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool))).all()


@pytest.mark.parametrize("bad", ["float64", "strided", "mask dtype", "mask rows", "row index"])
def test_unsupported_input_is_a_value_error(bad):
    logits = torch.zeros((2, 64), dtype=torch.bfloat16)
    bm = np.zeros((2, 2), np.int32)
    rows = None
    if bad == "float64":
        logits = logits.to(torch.float64)
    elif bad == "strided":
        logits = torch.zeros((2, 128), dtype=torch.bfloat16)[:, ::2]
    elif bad == "mask dtype":
        bm = bm.astype(np.int64)
    elif bad == "mask rows":
        bm = np.zeros((3, 2), np.int32)
    else:
        rows = [2]
    assert logits_mask.supported(logits) == (bad not in ("float64", "strided"))
    with pytest.raises(ValueError):
        logits_mask.apply_token_bitmask_inplace(logits, bm, rows)


@pytest.fixture
def cpu_mask_patch(monkeypatch):
    """``patches._patch_cpu_mask_apply`` installed on the installed vLLM (undone after the test)."""
    pytest.importorskip("vllm")
    from vllm_fst_backend.vllm import context, patches

    n = len(patches._PATCHES)
    monkeypatch.setattr("vllm.platforms.current_platform.is_cpu", lambda: True)
    patches._patch_cpu_mask_apply()
    yield patches, context
    while len(patches._PATCHES) > n:
        owner, attr, orig = patches._PATCHES.pop()
        setattr(owner, attr, orig)
    context.SERVED.pop("worker_backend", None)
    context.SERVED.pop("mask_applied", None)


def test_worker_serving_fst_with_any_drafter_gets_the_rejection_sampler_fixes(monkeypatch):
    """The CPU rejection-sampler fixes (``patches.patch_cpu_expand``, ``patch_cpu_recovered``) are installed
    by ``init_device`` in a worker serving fst with a speculative config of any method (vLLM's ngram too,
    where only fst's proposer installed them before), not in other workers."""
    pytest.importorskip("vllm")
    import types

    import vllm.v1.sample.rejection_sampler as rs
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from vllm_fst_backend.vllm import context, patches

    monkeypatch.setattr("vllm.platforms.current_platform.is_cpu", lambda: True)
    monkeypatch.setattr(WorkerWrapperBase, "init_device", lambda self, *a, **k: None)  # (vLLM's own: not here)
    n = len(patches._PATCHES)

    def worker(backend, spec):
        return types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            structured_outputs_config=types.SimpleNamespace(backend=backend), speculative_config=spec))

    def fixed():
        return [bool(getattr(getattr(rs, f), "__fst_wrapped__", False))
                for f in ("expand_batch_to_tokens", "sample_recovered_tokens")]

    try:
        patches._patch_cpu_mask_apply()
        assert fixed() == [False, False]
        for backend, spec in (("xgrammar", types.SimpleNamespace(method="ngram")), ("fst", None)):
            WorkerWrapperBase.init_device(worker(backend, spec))
            assert fixed() == [False, False], backend
        WorkerWrapperBase.init_device(worker("fst", types.SimpleNamespace(method="ngram")))
        assert fixed() == [True, True]
    finally:
        while len(patches._PATCHES) > n:
            owner, attr, orig = patches._PATCHES.pop()
            setattr(owner, attr, orig)
        context.SERVED.pop("worker_backend", None)


@pytest.mark.parametrize("drafts", [{}, {"b": 2, "c": 1}])
def test_patched_apply_grammar_bitmask_equals_vllms(cpu_mask_patch, drafts, monkeypatch):
    """The wrapper (a worker serving fst) gives vLLM's logits, draft rows included; in a worker of another
    backend it leaves the work to vLLM's function."""
    import vllm.v1.structured_output.utils as so_utils

    patches, context = cpu_mask_patch
    wrapped = so_utils.apply_grammar_bitmask
    assert wrapped.__fst_wrapped__
    orig = wrapped.__fst_original__
    rng = np.random.default_rng(3)
    sched, grammar, batch, logits = grammar_bitmask_step(rng, 1000, ["a", "b", "c", "d", "e"], drafts)
    want = logits.clone()
    orig(sched, grammar, batch, want)

    calls = []
    real = logits_mask.apply_token_bitmask_inplace
    monkeypatch.setattr(logits_mask, "apply_token_bitmask_inplace", lambda *a: (calls.append(1), real(*a)))
    other = logits.clone()
    wrapped(sched, grammar, batch, other)  # no fst worker: vLLM's path
    assert not calls and torch.equal(_bits(other), _bits(want))

    context.SERVED["worker_backend"] = "fst"
    got = logits.clone()
    wrapped(sched, grammar, batch, got)
    assert calls and torch.equal(_bits(got), _bits(want))
    assert not torch.equal(_bits(got), _bits(logits))  # something was masked


def _recovered_inputs(num_draft, V=6, seed=0):
    """Inputs of ``rejection_sampler.sample_recovered_tokens`` for requests with ``num_draft`` drafts each:
    every draft proposes token 0; the target puts 0.5 on token 0 and the rest on tokens 1..V-1 as 1:2:..."""
    n = sum(num_draft)
    cu = torch.tensor(np.cumsum(num_draft), dtype=torch.int32)
    draft = torch.zeros(n, dtype=torch.int32)
    tail = torch.arange(1, V, dtype=torch.float32)
    probs = torch.cat([torch.tensor([0.5]), 0.5 * tail / tail.sum()]).repeat(n, 1)
    return cu, draft, probs


def _recovered_functions(monkeypatch):
    """``(ours, vLLM's)`` ``sample_recovered_tokens`` with vLLM's CPU kernel bound (as a CPU worker binds the
    Triton kernel: ``vllm/platforms/cpu.py``)."""
    pytest.importorskip("vllm")
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.utils import cpu_triton_utils

    from vllm_fst_backend.vllm import patches

    def cpu_kernel(out, cu, draft, draft_probs, target_probs, inv_q, *, max_spec_len):
        cpu_triton_utils._sample_recovered_tokens_kernel_impl(out, cu, draft, draft_probs, target_probs, inv_q,
                                                              target_probs.shape[1], NO_DRAFT_PROBS=draft_probs is None)

    monkeypatch.setattr(rs, "_sample_recovered_tokens", cpu_kernel)
    return (patches._recovered_tokens_for_draft_rows(rs),
            getattr(rs.sample_recovered_tokens, "__fst_original__", rs.sample_recovered_tokens))


def test_recovered_tokens_drawn_for_draft_rows_only_keep_their_distribution(monkeypatch):
    """``patches.patch_cpu_recovered``: noise only for the requests with drafts; the recovered tokens
    (drafts rejected: target less draft, renormalized) keep their distribution, seeded requests keep
    their generator's draws. The kernel is vLLM's CPU one (a CPU worker rebinds the Triton kernel to it)."""
    import types

    ours, orig = _recovered_functions(monkeypatch)
    num_draft = [0, 2, 0, 1, 0, 0]
    cu, draft, probs = _recovered_inputs(num_draft)
    meta = types.SimpleNamespace(generators={})
    counts = np.zeros(6)
    torch.manual_seed(0)
    for _ in range(3000):
        out = ours(2, num_draft, cu, draft, None, probs, meta, torch.device("cpu"))
        counts += np.bincount(out.numpy(), minlength=6)
    assert counts[0] == 0  # the draft token itself is never the recovered one
    freq = counts[1:] / counts.sum()
    want = np.arange(1, 6) / 15
    assert np.abs(freq - want).max() < 0.02, (freq, want)
    # a seeded request (its own generator) gets the same recovered tokens as with vLLM's function
    for seed in range(5):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        m1 = types.SimpleNamespace(generators={1: g1})
        m2 = types.SimpleNamespace(generators={1: g2})
        want_ids = orig(2, num_draft, cu, draft, None, probs, m1, torch.device("cpu"))
        got_ids = ours(2, num_draft, cu, draft, None, probs, m2, torch.device("cpu"))
        assert torch.equal(want_ids[:2], got_ids[:2]), seed  # request 1's two drafts
    assert ours(2, [0, 0], torch.tensor([0, 0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32), None,
                torch.zeros((0, 6)), meta, torch.device("cpu")).numel() == 0


def test_recovered_tokens_of_drafts_accepted_for_sure_need_no_noise(monkeypatch):
    """Drafts whose target probability is exactly 1 (forced tokens: what the jump proposer drafts) are
    accepted whatever the uniform draw, so their requests' noise is never read: the patched function
    draws none from the global generator and the rejection sampler (vLLM's CPU kernel) outputs the
    same tokens as with vLLM's function, also when float rounding leaves other targets tiny but not
    zero; a seeded request's generator advances as in vLLM; a request with a rejected draft or a draft
    of a wider target still draws (in the same batch)."""
    import types

    from vllm.utils import cpu_triton_utils

    from vllm_fst_backend.vllm import patches

    ours, orig = _recovered_functions(monkeypatch)
    V, K = 1000, 3
    num_draft = [0, 3, 1, 0, 2]
    B, n = len(num_draft), sum(num_draft)
    cu = torch.tensor(np.cumsum(num_draft), dtype=torch.int32)
    draft = torch.tensor([7, 8, 9, 10, 11, 12], dtype=torch.int32)
    forced = torch.zeros((n, V))
    forced[torch.arange(n), draft.long()] = 1.0  # each draft the only allowed token
    forced[1, 40:50] = 1e-9  # rounding left: the draft's probability is still exactly 1
    assert float(forced[1, 8]) == 1.0
    proposed = torch.zeros((n, V))
    proposed[torch.arange(n), draft.long()] = 1.0  # a proposer's own distribution: its draft token

    def sample(fn, draft_probs, target, meta, uniform):
        """Output tokens ``int64[B, K + 1]`` of vLLM's CPU rejection sampler with ``fn``'s recovered tokens."""
        recovered = fn(K, num_draft, cu, draft, draft_probs, target, meta, torch.device("cpu"))
        out = torch.full((B, K + 1), -1, dtype=torch.int64)
        cpu_triton_utils._rejection_random_sample_kernel_impl(
            out, cu, draft, draft_probs, target, torch.full((B,), 99, dtype=torch.int64), recovered, uniform,
            torch.zeros(B, dtype=torch.bool), K, V, NO_DRAFT_PROBS=draft_probs is None)
        return out

    meta = types.SimpleNamespace(generators={})
    g = torch.Generator().manual_seed(0)
    for draft_probs in (None, proposed):
        assert patches._rows_needing_noise(num_draft, draft, draft_probs, forced, {}) == []
        for _ in range(20):
            uniform = torch.rand(n, dtype=torch.float64, generator=g)
            want = sample(orig, draft_probs, forced, meta, uniform)
            before = torch.get_rng_state()
            got = sample(ours, draft_probs, forced, meta, uniform)
            assert torch.equal(torch.get_rng_state(), before)  # no noise drawn
            assert torch.equal(got, want)
            assert got[1].tolist() == [7, 8, 9, 99]  # every draft accepted, then the bonus token
    # a seeded request: its generator advances as with vLLM's function
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    orig(K, num_draft, cu, draft, None, forced, types.SimpleNamespace(generators={4: g1}), torch.device("cpu"))
    ours(K, num_draft, cu, draft, None, forced, types.SimpleNamespace(generators={4: g2}), torch.device("cpu"))
    assert torch.equal(g1.get_state(), g2.get_state())
    # request 2's draft is not the allowed token (rejected: its recovered token is read), request 4's
    # second draft has a wider target: those two draw, request 1 still does not
    mixed = forced.clone()
    mixed[3] = 0.0
    mixed[3, 500] = 1.0
    mixed[5] = 0.0
    mixed[5, 12] = 0.5
    mixed[5, 20:30] = 0.05
    assert patches._rows_needing_noise(num_draft, draft, None, mixed, {}) == [2, 4]
    counts = np.zeros(V)
    torch.manual_seed(0)
    for _ in range(2000):
        out = ours(K, num_draft, cu, draft, None, mixed, meta, torch.device("cpu"))
        assert int(out[3]) == 500  # the only token left once the draft is excluded
        counts[int(out[5])] += 1
    assert counts[20:30].sum() == 2000  # never the draft token itself
    assert counts[20:30].min() > 120  # ten equally likely tokens, 200 draws each expected
    # the kept buffer of ones the noise rows are written into is all ones again between calls
    assert patches._ONES and all(bool((b == 1).all()) for b in patches._ONES.values())
