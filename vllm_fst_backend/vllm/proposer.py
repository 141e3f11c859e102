"""Forced-token jump proposer (``--speculative-config`` ``custom_class``): drafts the forced-token
chain of each ``fst_jump`` request, in the worker process."""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from vllm_fst_backend.errors import InvalidOptionError

from . import BACKEND_NAME
from . import context as _context
from . import pending
from .constraints import params_to_regex
from .metrics import logger, metric_inc
from .options import FstRequestOptions, parse_request_options


_JUMP_DEBUG = os.environ.get("VLLM_FST_JUMP_DEBUG", "") == "1"


@dataclasses.dataclass
class _JumpState:
    matcher: Any = None
    future: Future | None = None
    consumed: int = 0
    first: int | None = None  # the first output token the matcher took
    disabled: bool = False


class FstForcedTokenProposer:
    """Speculative proposer (``--speculative-config '{"method": "custom_class", "model":
    "vllm_fst_backend.vllm_plugin.FstForcedTokenProposer", "num_speculative_tokens": N}'``) that drafts
    the forced-token chain of each request whose ``fst_jump`` option is on, and nothing otherwise.

    Runs in the worker process, where vLLM's grammar objects are *not* (they are in the engine core);
    so it keeps its own matcher per request, compiled in a background thread from the request's
    ``SamplingParams`` (read from the model runner's ``requests``) and advanced with the request's
    ``output_token_ids``. Until the compile finishes, and for requests without ``fst_jump`` or
    ``structured_outputs``, it proposes ``[]``. The scheduler validates every draft with the real
    grammar, so a wrong draft can only be rejected, never emitted.
    Not used when a reasoning parser is configured without ``enable_in_reasoning`` (the grammar starts
    at an offset this class cannot see).
    """

    def __init__(self, vllm_config: Any):
        self.vllm_config = vllm_config
        spec = getattr(vllm_config, "speculative_config", None)
        self.k = int(getattr(spec, "num_speculative_tokens", 0) or 0)
        so_cfg = getattr(vllm_config, "structured_outputs_config", None)
        self.enabled = True
        if so_cfg is not None and getattr(so_cfg, "backend", BACKEND_NAME) != BACKEND_NAME:
            logger.warning("fst: FstForcedTokenProposer needs --structured-outputs-config.backend fst; it will propose nothing")
            self.enabled = False
        if so_cfg is not None and getattr(so_cfg, "reasoning_parser", "") and not getattr(so_cfg, "enable_in_reasoning", False):
            logger.warning("fst: forced-token jumps are disabled with a reasoning parser")
            self.enabled = False
        self._runner_ref: Callable[[], Any] | None = None
        self._states: dict[str, _JumpState] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fst-jump-compile")
        self._context: _context.TokenizerContext | None = None
        self._context_error: Exception | None = None
        self.num_proposed = 0
        self._eos: frozenset[int] = frozenset()
        from . import patches

        patches.install_runner_binding()
        patches.patch_cpu_expand()
        patches.patch_cpu_recovered()
        if self.enabled and self.k > 0:
            # Warm up in the background (artifacts + the compiler's per-tokenizer helpers, ~1-2 s on
            # first use) so that the first fst_jump request does not finish before its automaton.
            self._executor.submit(self._warm_up)
        logger.info("fst: forced-token proposer ready (up to %d draft tokens per step)", self.k)

    # vLLM hooks -----------------------------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:  # called by the (CPU) model runner
        return None

    def bind_runner(self, runner: Any) -> None:
        if self._runner_ref is None or self._runner_ref() is not runner:
            self._runner_ref = weakref.ref(runner)

    def propose(self, sampled_token_ids: list[list[int]], *args: Any, **kwargs: Any) -> list[list[int]]:
        n = len(sampled_token_ids)
        empty: list[list[int]] = [[] for _ in range(n)]
        runner = self._runner_ref() if self._runner_ref is not None else None
        if not self.enabled or self.k <= 0 or runner is None:
            return empty
        try:
            req_ids = list(runner.input_batch.req_ids)
            requests = runner.requests
        except AttributeError:
            return empty
        out = empty
        _dbg = _JUMP_DEBUG
        if _dbg:
            _t0 = time.perf_counter()
        for row in range(min(n, len(req_ids))):
            if not sampled_token_ids[row]:
                continue
            req_id = req_ids[row]
            req_state = requests.get(req_id) if req_id is not None else None
            if req_state is None:
                continue
            try:
                out[row] = self._propose_one(req_id, req_state)
            except Exception:
                logger.exception("fst: forced-token proposer failed for request %s; disabling it there", req_id)
                self._states[req_id] = _JumpState(disabled=True)
        if len(self._states) > 2 * max(1, len(requests)):
            for rid in [r for r in self._states if r not in requests]:
                del self._states[rid]
        if _dbg:
            logger.info(
                "fst-jump-debug propose %.3f ms rows=%d sampled=%s drafts=%s ready=%s",
                (time.perf_counter() - _t0) * 1e3, n, [len(x) for x in sampled_token_ids], [len(x) for x in out],
                [(r[-6:] if r else r, (self._states.get(r).matcher is not None) if self._states.get(r) else None) for r in req_ids],
            )
        return out

    # internals ------------------------------------------------------------------------------------
    def _warm_up(self) -> None:
        ctx = self._ctx()
        if ctx is None:
            return
        t0 = time.monotonic()
        try:
            ctx.compile("a", FstRequestOptions())
        except Exception as e:  # only a warm-up
            logger.debug("fst: proposer warm-up compile failed: %s", e)
        logger.info("fst: forced-token proposer warmed up in %.0f ms", (time.monotonic() - t0) * 1e3)

    def _ctx(self) -> _context.TokenizerContext | None:
        if self._context is None and self._context_error is None:
            try:
                self._context = _context.get_tokenizer_context(self.vllm_config.model_config)
            except Exception as e:
                self._context_error = e
                logger.warning("fst: forced-token proposer cannot load the artifacts (%s); no jumps", e)
        return self._context

    def _start(self, req_state: Any) -> _JumpState:
        sp = getattr(req_state, "sampling_params", None)
        so = getattr(sp, "structured_outputs", None) if sp is not None else None
        if so is None:
            return _JumpState(disabled=True)
        try:
            options = parse_request_options(getattr(sp, "extra_args", None), getattr(sp, "allowed_token_ids", None))
        except InvalidOptionError:
            return _JumpState(disabled=True)
        if not options.jump:
            return _JumpState(disabled=True)
        if self._context_error is not None:
            return _JumpState(disabled=True)
        ctx = self._context
        if ctx is not None:  # cache hit (e.g. the n>1 siblings of a request, a repeated schema): no wait
            try:
                _, regex = params_to_regex(so, disk=ctx.disk)
                compiled = ctx.peek(regex, options)
            except Exception:
                compiled = None
            if compiled is not None:
                return _JumpState(matcher=_context.matcher_factory(compiled))

        def build():  # in the background thread: artifacts loading and compiling never block a step
            ctx = self._ctx()
            if ctx is None:
                raise RuntimeError(f"no tokenizer artifacts ({self._context_error})")
            _, regex = params_to_regex(so, disk=ctx.disk)
            marker = pending.request_marker(sp)
            if marker is not None:  # the API server still compiles it: take its automaton, not a compile
                if pending.wait_for_marker(*marker, pending.marker_deadline_s()) == "refused":
                    raise pending.CompileRefused("fst: the API server's compile check refused this constraint")
            return _context.matcher_factory(ctx.compile(regex, options).compiled)

        return _JumpState(future=self._executor.submit(build))

    def _propose_one(self, req_id: str, req_state: Any) -> list[int]:
        st = self._states.get(req_id)
        if st is None:
            st = self._states[req_id] = self._start(req_state)
        if st.disabled:
            return []
        if st.matcher is None:
            assert st.future is not None
            if not st.future.done():
                return []
            try:
                st.matcher = st.future.result()
            except Exception as e:
                logger.warning("fst: jump compile failed for request %s: %s", req_id, e)
                st.disabled = True
                return []
            st.future = None
        outs = req_state.output_token_ids
        if st.consumed and (len(outs) < st.consumed or outs[0] != st.first):
            # the scheduler dropped the first sample (its grammar came after the step: the first sample in
            # the step, patches.py) and the worker took it back; the next step sampled another
            st.matcher.reset()
            st.consumed, st.first = 0, None
        new = list(outs[st.consumed :])
        if any(t < 0 for t in new):  # async-scheduling placeholders: not supported
            st.disabled = True
            return []
        if new:
            if not st.matcher.accept_tokens(req_id, new):
                st.disabled = True
                return []
            if not st.consumed:
                st.first = new[0]
            st.consumed = len(outs)
        if st.matcher.is_terminated():
            return []
        chain = st.matcher.forced_tokens(self.k)
        if not chain:
            return []
        eos = self._eos
        if not eos and self._context is not None:
            eos = self._eos = frozenset(self._context.eos_ids)
        for i, t in enumerate(chain):
            if t in eos:
                chain = chain[:i]
                break
        if chain:
            self.num_proposed += len(chain)
            metric_inc("jump_drafts", len(chain))
        return chain
