"""``compile_regex``: regex + tokenizer artifacts + options → :class:`CompiledAutomaton`.

Pipeline (paper 001 Alg. 2; 000 §3.1–3.3; 004 Eq. 3 and 5):

1. :mod:`.regex_parse` -- parse (typed errors with positions, size estimate before expansion);
2. :mod:`.char_dfa` -- DFA over character classes (scripts filter intersected into the classes;
   SentencePiece: the language becomes ``" " + L``, the dummy prefix, 000 §3.1);
3. :mod:`.regex_to_bytes` -- byte DFA (UTF-8 paths; the UTF-8 filter holds by construction);
4. :mod:`.token_dfa` -- ∘ detokenizer (byte policy), projected to tokens: a deterministic token DFA
   with group-labelled edges, trimmed;
5. non-canonical: :mod:`.explicit`; canonical: :mod:`.canonical_product` (∩ A_BPE, 004 Eq. 5, §6.5),
   dead-end free.

Budgets: ``max_positions`` (unrolled regex size, checked on the tree before expansion),
``max_char_states``, ``max_token_states``, and a wall-clock ``time_budget_s``; exceeding any raises
:class:`CompileBudgetError` (pathological regexes fail in well under 5 s).
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import EmptyLanguageError, InvalidOptionError
from .compiled import CompiledAutomaton
from .options import CompileOptions
from .regex_to_bytes import byte_dfa_table, regex_to_char_dfa
from .token_dfa import build_token_dfa
from .token_trie import trie_for

__all__ = ["compile_regex", "prepare", "CompileBudgets", "DEFAULT_BUDGETS"]


class CompileBudgets:
    """Limits of one compilation (see the module docstring). Plain attributes; override per call.

    The state and position budgets catch explosive regexes early (``(a|b)*a(a|b){20}``: the 10,000-state
    budget in ~50 ms); the time budget and the compile process's memory budget bound the rest. They admit a
    JSON string of ``maxLength`` up to ~1,400 (about 7 character states and 10 positions per unit; SmolLM2
    ~0.26 s, Tekken ~0.5 s on 2 CPU cores; docs/benchmarks.md, "Bounded strings").
    """

    def __init__(self, max_positions: int = 20_000, max_char_states: int = 10_000, max_byte_states: int = 100_000,
                 max_token_states: int = 50_000, max_product_states: int = 256, time_budget_s: float = 4.0):
        self.max_positions = max_positions
        self.max_char_states = max_char_states
        self.max_byte_states = max_byte_states
        self.max_token_states = max_token_states
        self.max_product_states = max_product_states
        self.time_budget_s = time_budget_s


DEFAULT_BUDGETS = CompileBudgets()


def _allowed_ranges(scripts):
    if not scripts:
        return None
    from ..artifacts.unicode_filters import normalize_ranges, script_ranges

    rs = []
    for name in scripts:
        rs.extend(script_ranges(name))
    return normalize_ranges(rs)


def allowed_token_mask(options: CompileOptions, artifacts) -> np.ndarray | None:
    """``bool[V]`` of ``options.allowed_tokens`` (None when every token is allowed). Ids at or past the
    tokenizer's vocabulary size V are left out: no automaton row holds them (a model's embedding may
    have more rows than the tokenizer has tokens, and vLLM checks ids against the model's size).

    Raises:
        EmptyLanguageError: no end-of-sequence id is allowed (no output could end; the automaton's
            accepting states end with one).
    """
    ids = options.allowed_tokens
    if ids is None:
        return None
    V = int(artifacts.vocab_size)
    mask = np.zeros(V, dtype=bool)
    arr = np.asarray(ids, dtype=np.int64)
    mask[arr[arr < V]] = True
    eos = [int(e) for e in artifacts.eos_ids]
    if eos and not mask[eos].any():
        raise EmptyLanguageError(
            f"the allowed token ids hold no end-of-sequence token ({', '.join(map(str, eos))}): "
            "no output of the constraint could end", None)
    return mask


def prepare(artifacts, canonical: bool = True) -> None:
    """Build the per-tokenizer structures the compiler needs (token trie; for canonical mode the
    dense banned rows and witness statistics of the canonical filter), once per tokenizer and process.
    Called by :func:`compile_regex` before its time budget starts; call it at startup to keep the first
    request fast. The helper's tables come from the host-shared table store when another process built
    them (:mod:`.table_store`: ~20 ms; building costs 0.4 s for SmolLM2, ~8 s for Tekken); the trie
    costs 0.25-0.8 s per process. Also imports what the first compile would (interegular's parser,
    pynini for the character DFA's minimization: ~50 ms)."""
    import interegular.patterns  # noqa: F401
    import pynini  # noqa: F401

    trie = trie_for(artifacts)
    if canonical:
        from .canonical_product import canonical_helper

        canonical_helper(artifacts, trie)


def forget_verdicts(artifacts) -> None:
    """Empty this process's dead-end verdict cache for ``artifacts`` (:mod:`.verdict_cache`), so that the
    next compile computes every verdict itself: a *cold* compile, as benchmarks measure it. No-op when
    no canonical compile ran yet."""
    helper = getattr(artifacts, "_fst_canon_helper", None)
    vc = getattr(helper, "_fst_verdicts", None)
    if vc is not None:
        vc.clear()


def compile_regex(regex: str, artifacts, options: CompileOptions | None = None, *,
                  budgets: CompileBudgets | None = None) -> CompiledAutomaton:
    """Compile ``regex`` for the tokenizer of ``artifacts``.

    Args:
        regex: interegular/Python ``re`` syntax (see :mod:`.regex_parse`); the whole output must match.
        artifacts: a :class:`~vllm_fst_backend.artifacts.store.TokenizerArtifacts` (or an object with
            ``vocab_size, eos_ids, token_bytes, byte_fallback, prepend_space, fingerprint`` and, for
            canonical mode, ``canonical``).
        options: :class:`CompileOptions` (default: canonical, no scripts filter).
        budgets: :class:`CompileBudgets` (default :data:`DEFAULT_BUDGETS`).

    Returns:
        The :class:`CompiledAutomaton` (start state 0).

    Raises:
        RegexSyntaxError, UnsupportedRegexError: bad regex (``.position`` = offset in ``regex``).
        CompileBudgetError: state/size/time budget exceeded.
        EmptyLanguageError: no token sequence satisfies the constraint.
        InvalidOptionError: ``options`` is not a CompileOptions.
        ArtifactError: canonical mode on artifacts built without the canonical filter.
    """
    if options is None:
        options = CompileOptions()
    if not isinstance(options, CompileOptions):
        raise InvalidOptionError(f"options must be a CompileOptions, got {type(options).__name__}")
    b = budgets or DEFAULT_BUDGETS
    prepare(artifacts, canonical=options.canonical)  # per-tokenizer work, once, outside the budget
    t0 = time.perf_counter()
    deadline = t0 + b.time_budget_s
    stats: dict = {}
    cdfa = regex_to_char_dfa(
        regex, prepend_space=bool(artifacts.prepend_space), allowed_ranges=_allowed_ranges(options.scripts),
        max_positions=b.max_positions, max_states=b.max_char_states, deadline=deadline,
    )
    t1 = time.perf_counter()
    bdfa = byte_dfa_table(cdfa, max_states=b.max_byte_states, deadline=deadline)
    t2 = time.perf_counter()
    trie = trie_for(artifacts)
    t3 = time.perf_counter()
    # canonical mode: byte tokens as plain 1-byte tokens here; the canonical byte policy (whole characters
    # without a piece) is enforced by the canonical product (an acceptor component), see canonical_product
    policy = "no_ascii_with_piece" if options.canonical else options.byte_policy
    mask = allowed_token_mask(options, artifacts)
    try:
        tdfa = build_token_dfa(bdfa, trie, policy, deadline=deadline, max_states=b.max_token_states, token_mask=mask)
        t4 = time.perf_counter()
        stats.update(char_states=cdfa.num_states, byte_states=bdfa.num_states, token_states=tdfa.num_states,
                     ms_char=1e3 * (t1 - t0), ms_byte=1e3 * (t2 - t1), ms_trie=1e3 * (t3 - t2),
                     ms_token=1e3 * (t4 - t3))
        eos = artifacts.eos_ids
        V = int(artifacts.vocab_size)
        if options.canonical:
            from .canonical_product import canonical_automaton

            out = canonical_automaton(tdfa, artifacts, trie, eos, V, deadline=deadline,
                                      n_char_states=cdfa.num_states, max_product_states=b.max_product_states,
                                      stats=stats)
        else:
            from .explicit import explicit_from_token_dfa

            out = explicit_from_token_dfa(tdfa, eos, V, stats=stats)
    except EmptyLanguageError as e:
        if mask is None:
            raise
        raise EmptyLanguageError(f"{e}, using only the {len(options.allowed_tokens)} allowed token ids", None) from None
    out.stats["ms_total"] = 1e3 * (time.perf_counter() - t0)
    return out
