"""The regex compiler on the real SmolLM2 (byte-level BPE) and Mistral v1 (SentencePiece) tokenizers.

Properties on random regexes (literals incl. non-ASCII, classes incl. negated ones, alternation,
bounded repetition, optional) -- hypothesis, few examples by default (``HYPOTHESIS_PROFILE=thorough``
for more):

1. every token sequence accepted to completion (random walks over allowed tokens) decodes to a string
   that ``re.fullmatch``-es;
2. canonical mode: that sequence is exactly the tokenizer's encoding of the string;
3. strings that match: their canonical tokenization is accepted (both modes);
4. no dead ends (on the arrays for explicit automata, by exploration for factored ones);
5. scripts filter: outputs stay in the allowed scripts.

Unit tests: typed errors with positions, budgets (< 5 s each), empty languages, the numpy trie walk vs
the pynini composition path (001 Alg. 2), options validation, the cache.
"""

from __future__ import annotations

import random
import sys
import threading
import time

import numpy as np
import pytest
from fst_testlib import (  # noqa: F401  (fixtures)
    FST_SETTINGS,
    TOKENIZERS,
    check_coaccessible,
    check_no_dead_ends_explicit,
    decode_text,
    explore,
    fst_artifacts,
    fst_infos,
    fullmatch,
    matching_texts,
    oracle_ids,
    random_walk,
    regex_strategy,
)
from hypothesis import given
from hypothesis import strategies as st

from vllm_fst_backend.compiler import CompiledCache, CompileOptions, compile_regex
from vllm_fst_backend.errors import (
    CompileBudgetError,
    EmptyLanguageError,
    InvalidOptionError,
    RegexSyntaxError,
    UnsupportedRegexError,
)
from vllm_fst_backend.runtime import FstMatcher


def _accepts(c, ids) -> bool:
    m = FstMatcher(c)
    return m.accept_tokens("t", list(ids)) and m.accept_tokens("t", [int(c.eos_ids[0])]) and m.is_terminated()


# --- properties 1-4 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("canonical", [True, False], ids=["canonical", "any"])
@FST_SETTINGS
@given(regex=regex_strategy(), seed=st.integers(0, 2**16))
def test_random_regexes(fst_artifacts, fst_infos, name, canonical, regex, seed):
    arts, info = fst_artifacts(name), fst_infos(name)
    c = compile_regex(regex, arts, CompileOptions(canonical=canonical))
    rnd = random.Random(seed)
    # (1) + (2): random walks
    for _ in range(6):
        ids, done = random_walk(c, rnd)
        if not done:
            continue
        text = decode_text(info, ids)
        assert fullmatch(regex, text), (regex, text)
        if canonical:
            assert ids == oracle_ids(info, text), (regex, text, ids)
    # (3): matching strings' canonical tokenizations are accepted
    for text in matching_texts(regex, 4, seed):
        assert _accepts(c, oracle_ids(info, text)), (regex, text)
    # (4): no dead ends
    if c.mode == "explicit":
        check_no_dead_ends_explicit(c)
    else:
        seen, edges, complete = explore(c, max_states=300, max_tokens=3000)
        if complete:
            check_coaccessible(c, seen, edges)


def _check_canonical_walks(c, info, regex: str, seed: int, max_steps: int) -> None:
    """25 random walks (EOS with probability 0.5): at least one ends, and every one that ends decodes to
    a match of ``regex`` whose canonical tokenization (the tokenizer, the oracle) is the walk."""
    rnd = random.Random(seed)
    n_done = 0
    for _ in range(25):
        ids, done = random_walk(c, rnd, max_steps=max_steps, p_eos=0.5)
        if done:
            n_done += 1
            text = decode_text(info, ids)
            assert fullmatch(regex, text), (regex, text)
            assert ids == oracle_ids(info, text), (regex, text, ids)
    assert n_done > 0


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize(
    "regex",
    [
        r"(Yes|No|Maybe)",
        r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z",
        r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
        r"[A-Za-z ,]{5,60}\.",
        r'"([^"\\]|\\.){0,20}"',
        r"[^\n]{1,200}",
        r" ?[a-z]{1,8}( [a-z]{1,8}){0,3}\n",
        r"(  |\t)?x",
        r"[^a\n]€",  # regression: byte-level tokens ending inside a character (dead end after ' \xe2', '\x82')
        r"[^a\n]{1,3}中文",
    ],
)
def test_fixed_regexes_walks(fst_artifacts, fst_infos, name, regex):
    """Properties 1, 2, 4 on the benchmark-like regexes (canonical)."""
    arts, info = fst_artifacts(name), fst_infos(name)
    c = compile_regex(regex, arts, CompileOptions())
    _check_canonical_walks(c, info, regex, seed=1, max_steps=250)
    for text in matching_texts(regex, 10, 3):
        assert _accepts(c, oracle_ids(info, text)), (regex, text)
    if c.mode == "explicit":
        check_no_dead_ends_explicit(c)


@pytest.mark.parametrize("regex", [r'"[^"\\]{0,40}"', r"[^\n]{1,30}\n", r"[A-Za-z ,]{5,40}\."])
def test_tekken_context_dependent_tokens(fst_artifacts, fst_infos, regex):
    """Tekken's filter has ~14k context-dependent tokens (their class depends on the chunk before them;
    canonical.py "Left context"), which the dead-end analysis and the rows check in batches
    (``specials_clear``, ``_specials_ok``). Walks end canonical; matching texts (random and real
    multilingual lines) are accepted exactly when the canonical filter accepts their tokenization.
    The budget is raised: speed is the benchmarks' business (bench_compile_tokenizers.py)."""
    from test_canonical import load_real_lines

    from vllm_fst_backend.compiler import CompileBudgets

    arts, info = fst_artifacts("tekken"), fst_infos("tekken")
    c = compile_regex(regex, arts, CompileOptions(), budgets=CompileBudgets(time_budget_s=120))
    _check_canonical_walks(c, info, regex, seed=3, max_steps=120)
    texts = matching_texts(regex, 10, 3)
    if "^\\n" in regex:
        texts += [x + "\n" for x in load_real_lines() if 0 < len(x) <= 30 and "\n" not in x][:300]
    n_accepted = 0
    for text in texts:
        assert fullmatch(regex, text), text
        ids = oracle_ids(info, text)
        ok = _accepts(c, ids)
        assert ok == arts.canonical.accepts(ids), (regex, text, ids)
        n_accepted += ok
    assert n_accepted >= 0.9 * len(texts)


def test_explicit_product_arrays(fst_artifacts):
    """Small canonical products are explicit: complete arrays, dead-end free, forced tokens."""
    c = compile_regex(r"(Monday|Tuesday|Wednesday)", fst_artifacts("smollm2"), CompileOptions())
    assert c.mode == "explicit"
    check_no_dead_ends_explicit(c)
    assert c.allowed_rows.dtype == np.int32
    assert c.trans_ptr.dtype == np.int64 and c.trans_next.dtype == np.int32
    assert (c.forced_token >= 0).sum() >= 2


def test_explicit_attempt_skipped_where_a_state_allows_too_many_tokens(fst_artifacts, monkeypatch):
    """Free text (a regex state allowing thousands of tokens) stays factored without the explicit
    enumeration being tried: its rows could not fit the 1,024 tokens of an explicit row; small choices
    and dates still become explicit. The bound is the most tokens a token-DFA state allows (SmolLM2's
    counts, checked against a per-state count)."""
    from vllm_fst_backend.compiler import canonical_product as cp

    arts = fst_artifacts("smollm2")
    tried = []
    real = cp._try_explicit
    monkeypatch.setattr(cp, "_try_explicit", lambda *a, **k: tried.append(1) or real(*a, **k))
    seen = []
    real_max = cp._max_state_tokens

    def spy_max(M, g_size):
        n = real_max(M, g_size)
        want = max(int(np.isin(M.token_group, M.edge_group[M.edge_ptr[s]:M.edge_ptr[s + 1]]).sum())
                   for s in range(M.num_states))
        assert n == want
        seen.append(n)
        return n

    monkeypatch.setattr(cp, "_max_state_tokens", spy_max)
    for regex, mode, attempt in ((r'"[^"\\]{0,20}"', "factored", False), (r"[a-z ]{1,30}", "factored", False),
                                 (r"(Monday|Tuesday|Wednesday)", "explicit", True), (r"\d{4}-\d{2}-\d{2}", "explicit", True)):
        tried.clear()
        c = compile_regex(regex, arts, CompileOptions())
        assert c.mode == mode and bool(tried) == attempt, (regex, c.mode, tried, seen[-1])
        assert (seen[-1] > cp.EXPLICIT_MAX_REGEX_TOKENS) == (not attempt)


# --- property 5: scripts ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("scripts", [("latin",), ("han",), ("cyrillic", "greek"), ("ascii",)])
def test_scripts_filter(fst_artifacts, fst_infos, name, scripts):
    from vllm_fst_backend.artifacts.unicode_filters import script_ranges

    arts, info = fst_artifacts(name), fst_infos(name)
    allowed = [r for s in scripts for r in script_ranges(s)]

    def ok(ch):
        return any(lo <= ord(ch) <= hi for lo, hi in allowed)

    for canonical in (True, False):
        c = compile_regex(r"[^\n]{1,12}", arts, CompileOptions(canonical=canonical, scripts=scripts))
        rnd = random.Random(7)
        for _ in range(20):
            ids, done = random_walk(c, rnd, max_steps=40)
            if done:
                text = decode_text(info, ids)
                assert all(ok(ch) for ch in text), (scripts, text)
                assert fullmatch(r"[^\n]{1,12}", text)
                if canonical:
                    assert ids == oracle_ids(info, text)


def test_scripts_empty_language(fst_artifacts):
    with pytest.raises(EmptyLanguageError):
        compile_regex("中文", fst_artifacts("smollm2"), CompileOptions(scripts=("latin",)))


# --- allowed token ids (vLLM's allowed_token_ids) ---------------------------------------------------------


def _accepted_sequences(c, max_len: int) -> set:
    """Every accepted token sequence (EOS left out) of ``c``, whose language is finite, up to ``max_len``."""
    out, stack = set(), [(0, ())]
    while stack:
        s, path = stack.pop()
        for t in c.allowed_tokens(s).tolist():
            if c.is_eos(t):
                out.add(path)
            elif len(path) < max_len:
                stack.append((c.next_state(s, t), path + (t,)))
    return out


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("canonical", [True, False], ids=["canonical", "any"])
def test_allowed_tokens_restrict_the_language_exactly(fst_artifacts, fst_infos, name, canonical):
    """An automaton built from a token subset accepts exactly the full automaton's sequences that use only
    those tokens (so no state is left without a token the subset allows, and none is lost), canonical
    ones the tokenizer's own; a subset that spells no output is an empty language."""
    arts, info = fst_artifacts(name), fst_infos(name)
    regex = r"(ab|ba|c){1,3}( x| 龘| ǅ)?"  # (龘, ǅ: byte-fallback tokens in Mistral v1)
    full = compile_regex(regex, arts, CompileOptions(canonical=canonical))
    seqs = _accepted_sequences(full, 12)
    toks = sorted({t for q in seqs for t in q})
    rnd = random.Random(3)
    n_empty = 0
    for size in (1, 2, len(toks) // 3, len(toks) // 2, 2 * len(toks) // 3, len(toks) - 1):
        subset = set(rnd.sample(toks, max(1, size)))
        allowed = sorted(subset | set(arts.eos_ids))
        want = {q for q in seqs if set(q) <= subset}
        opts = CompileOptions(canonical=canonical, allowed_tokens=allowed)
        if not want:
            n_empty += 1
            with pytest.raises(EmptyLanguageError, match="allowed token ids"):
                compile_regex(regex, arts, opts)
            continue
        c = compile_regex(regex, arts, opts)
        assert _accepted_sequences(c, 12) == want, (size, sorted(subset))
        seen, edges, complete = explore(c)
        assert complete
        check_coaccessible(c, seen, edges)
        if canonical:
            for q in want:
                assert list(q) == oracle_ids(info, decode_text(info, q))
    assert n_empty < 6


def test_allowed_tokens_need_an_end_token_and_ignore_ids_past_the_vocabulary(fst_artifacts, fst_infos):
    arts, info = fst_artifacts("smollm2"), fst_infos("smollm2")
    yes = oracle_ids(info, "yes")
    with pytest.raises(EmptyLanguageError, match="end-of-sequence"):
        compile_regex("(yes|no)", arts, CompileOptions(allowed_tokens=yes))
    V = int(arts.vocab_size)
    c = compile_regex("(yes|no)", arts, CompileOptions(allowed_tokens=yes + list(arts.eos_ids) + [V, V + 7]))
    assert _accepted_sequences(c, 4) == {tuple(yes)}
    with pytest.raises(InvalidOptionError):
        CompileOptions(allowed_tokens=[])
    with pytest.raises(InvalidOptionError):
        CompileOptions(allowed_tokens=[1, -2])
    assert CompileOptions(allowed_tokens=[5, 1, 5]) == CompileOptions(allowed_tokens=(1, 5))
    assert CompileOptions(allowed_tokens=[1, 5]) != CompileOptions(allowed_tokens=[1, 6])
    assert CompileOptions(allowed_tokens=[1, 5]) != CompileOptions()


# --- fast path == pynini path ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize(
    "regex", [r"(Yes|No|Maybe)", r"\d{2}-\d", r"[a-zé]{1,2}", r"é|€|中文", r'"([^"\\]|\\.)?"', r"[α-ω]{1,2}x?", r"a?\n?"]
)
def test_trie_walk_equals_pynini(fst_artifacts, fst_infos, name, regex):
    """The numpy trie walk gives the same token language as pynini's composition with the detokenizer
    (001 Alg. 2: project(A ∘ T_V), rmepsilon, determinize, minimize), for every byte policy, and the
    byte DFA equals the pynini byte acceptor (∩ UTF-8 filter)."""
    import pynini

    from vllm_fst_backend.compiler.regex_to_bytes import byte_dfa_fst, byte_dfa_table, regex_to_char_dfa
    from vllm_fst_backend.compiler.token_dfa import build_token_dfa, reference_token_fst, token_dfa_to_fst
    from vllm_fst_backend.compiler.token_trie import trie_for

    arts = fst_artifacts(name)
    cdfa = regex_to_char_dfa(regex, prepend_space=arts.prepend_space)
    bdfa = byte_dfa_table(cdfa)
    ref_bytes = byte_dfa_fst(cdfa)
    mine_bytes = pynini.Fst()
    mine_bytes.add_states(bdfa.num_states)
    mine_bytes.set_start(0)
    one = pynini.Weight.one("tropical")
    for q in range(bdfa.num_states):
        if bdfa.final[q]:
            mine_bytes.set_final(q)
        for b in np.flatnonzero(bdfa.table[q] >= 0).tolist():
            mine_bytes.add_arc(q, pynini.Arc(b + 1, b + 1, one, int(bdfa.table[q, b])))
    assert pynini.equivalent(pynini.determinize(mine_bytes).minimize(), ref_bytes)
    policies = ["all", "no_ascii_with_piece", "canonical"] if arts.byte_policies and len(set(arts.manifest["detokenizers"].values())) > 1 else ["all"]
    for policy in policies:
        td = build_token_dfa(bdfa, trie_for(arts), policy)
        mine = pynini.determinize(token_dfa_to_fst(td)).minimize()
        ref = reference_token_fst(ref_bytes, arts.detokenizer(policy))
        assert pynini.equivalent(mine, ref), (regex, policy)


@pytest.mark.parametrize("regex", [r"[a-c]{1,3}", r"(ab|a)(c|bc)?"])
def test_canonical_byte_policy_matches_pynini(fst_artifacts, regex):
    """SentencePiece canonical mode (byte tokens only for whole characters without a piece, enforced by
    the product's acceptor component) == pynini with the canonical detokenizer, restricted to canonical
    sequences: every accepted sequence up to length 4 is in the pynini language."""
    import pynini

    from vllm_fst_backend.compiler.regex_to_bytes import byte_dfa_fst, regex_to_char_dfa
    from vllm_fst_backend.compiler.token_dfa import reference_token_fst

    arts = fst_artifacts("mistral_v1")
    c = compile_regex(regex, arts, CompileOptions())
    ref = reference_token_fst(byte_dfa_fst(regex_to_char_dfa(regex, prepend_space=True)), arts.detokenizer("canonical"))
    seen, edges, complete = explore(c, max_states=500)
    assert complete
    # enumerate accepted sequences and check each against the reference
    stack = [(0, [])]
    n = 0
    while stack:
        s, path = stack.pop()
        if c.is_accepting(s):
            chain = pynini.accep("".join(f"[{t + 1}]" for t in path))
            assert pynini.compose(chain, ref).num_states() > 0, path
            n += 1
        if len(path) < 4:
            for t in c.allowed_tokens(s).tolist():
                if not c.is_eos(t):
                    stack.append((c.next_state(s, t), path + [t]))
    assert n > 0


# --- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "regex, exc, pos",
    [
        ("(ab", RegexSyntaxError, 3),
        ("a)", RegexSyntaxError, 1),
        ("[z-a]", RegexSyntaxError, None),
        ("a{3,2}", RegexSyntaxError, 1),
        ("(a)\\1", UnsupportedRegexError, 3),
        ("ab(?=c)", UnsupportedRegexError, 2),
        ("x(?<!y)z", UnsupportedRegexError, 1),
        ("\\bfoo", UnsupportedRegexError, 0),
        ("a^b", UnsupportedRegexError, 1),
        ("a$b", UnsupportedRegexError, 1),
        ("(?P<n>a)(?P=n)", UnsupportedRegexError, 8),
        ("\\p{L}", UnsupportedRegexError, 0),
        ("(?x)a", UnsupportedRegexError, 2),
    ],
)
def test_bad_regex_errors(fst_artifacts, regex, exc, pos):
    with pytest.raises(exc) as ei:
        compile_regex(regex, fst_artifacts("smollm2"), CompileOptions())
    if pos is not None:
        assert ei.value.position == pos, (regex, ei.value)
    else:
        assert ei.value.position is not None


def test_anchors_and_escapes_accepted(fst_artifacts):
    arts = fst_artifacts("smollm2")
    for r in ["^abc$", r"\u00e9t\u00e9", r"caf\U000000e9", "a\\$"]:
        compile_regex(r, arts, CompileOptions())


@pytest.mark.parametrize(
    "regex",
    [
        r"(a|b)*a(a|b){20}",
        r".{5000}",
        r"((a{1,50}){1,50}){1,50}",
        r"(.{0,100}){100}",
        r"(x?){3000}",
        r"[^\n]{1,100}[^\n]{1,100}[^\n]{1,100}[^\n]{1,100}",
    ],
)
def test_pathological_regexes_fail_fast(fst_artifacts, regex):
    arts = fst_artifacts("smollm2")
    t0 = time.perf_counter()
    try:
        compile_regex(regex, arts, CompileOptions())
    except CompileBudgetError:
        pass
    assert time.perf_counter() - t0 < 5.0, regex


def test_pathological_raise_budget(fst_artifacts):
    arts = fst_artifacts("smollm2")
    for r in [r"(a|b)*a(a|b){20}", r".{50000}", r"((a{1,50}){1,50}){1,50}"]:
        with pytest.raises(CompileBudgetError):
            compile_regex(r, arts, CompileOptions())


@pytest.mark.parametrize("regex", ["[^\\s\\S]", "a[^\\s\\S]b", "(?:[^\\s\\S])+"])
def test_empty_language(fst_artifacts, regex):
    with pytest.raises(EmptyLanguageError):
        compile_regex(regex, fst_artifacts("smollm2"), CompileOptions())


def test_options_validation():
    with pytest.raises(InvalidOptionError):
        CompileOptions(scripts=("klingon",))
    with pytest.raises(InvalidOptionError):
        CompileOptions(scripts=())
    with pytest.raises(InvalidOptionError):
        CompileOptions(canonical="yes")
    o = CompileOptions(scripts=("Latin", "han", "latin"))
    assert o.scripts == ("han", "latin")
    assert hash(o) == hash(CompileOptions(scripts=("han", "latin")))
    assert CompileOptions(canonical=False).byte_policy == "no_ascii_with_piece"
    assert CompileOptions(canonical=False, allow_ascii_byte_tokens=True).byte_policy == "all"
    assert CompileOptions().byte_policy == "canonical"


def test_ascii_byte_tokens_option(fst_artifacts):
    """Mistral: 'A' has a piece, so its byte token <0x41> is allowed only with allow_ascii_byte_tokens."""
    arts = fst_artifacts("mistral_v1")
    bf = int(arts.byte_fallback[ord("A")])
    strict = compile_regex("A", arts, CompileOptions(canonical=False))
    loose = compile_regex("A", arts, CompileOptions(canonical=False, allow_ascii_byte_tokens=True))

    def used(c):
        seen, _, complete = explore(c)
        assert complete
        return any(bf in c.allowed_tokens(s).tolist() for s in seen)

    assert not used(strict)
    assert used(loose)
    assert not used(compile_regex("A", arts, CompileOptions(canonical=True, allow_ascii_byte_tokens=True)))


# --- cache -------------------------------------------------------------------------------------------------


def test_cache_lru_bytes_and_threads(fst_artifacts):
    arts = fst_artifacts("smollm2")
    cache = CompiledCache(max_bytes=10**9)
    opts = CompileOptions(canonical=False)
    a = cache.get_or_compile("(a|b)", arts, opts)
    assert cache.get_or_compile("(a|b)", arts, opts) is a
    assert cache.hits == 1 and cache.misses == 1
    assert cache.nbytes == a.nbytes
    # byte bound evicts least recently used
    small = CompiledCache(max_bytes=int(a.nbytes * 2.5))
    x = small.get_or_compile("x", arts, opts)
    small.get_or_compile("y", arts, opts)
    small.get_or_compile("x", arts, opts)  # x recently used
    small.get_or_compile("z", arts, opts)  # evicts y
    assert small.get(small.key("x", opts, arts)) is x
    assert small.get(small.key("y", opts, arts)) is None
    assert small.nbytes <= small.max_bytes
    # concurrent misses on one key compile once
    c3 = CompiledCache()
    results = []
    ts = [threading.Thread(target=lambda: results.append(c3.get_or_compile("[a-z]{1,5}", arts, opts))) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(results) == 6 and all(r is results[0] for r in results)
    assert c3.misses == 1
    # errors are raised, not cached
    with pytest.raises(RegexSyntaxError):
        c3.get_or_compile("(", arts, opts)
    assert len(c3) == 1


def test_compile_times_reasonable(fst_artifacts):
    """A smoke check (the real figures come from scripts/bench_compile.py): simple regexes compile fast."""
    arts = fst_artifacts("smollm2")
    compile_regex("(Yes|No)", arts, CompileOptions())  # warm the per-tokenizer caches
    t0 = time.perf_counter()
    compile_regex("(Yes|No|Maybe)", arts, CompileOptions())
    assert time.perf_counter() - t0 < 0.5


# --- token DFA: numba kernels == numpy reference (identical arrays) -----------------------------------------

_JSON_STR = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"'
_JSON_LIKE = (
    r'\{[ ]?"name"[ ]?:[ ]?' + _JSON_STR + r'[ ]?,[ ]?"class"[ ]?:[ ]?("Warrior"|"Rogue"|"Sorceror")[ ]?,'
    r'[ ]?"life"[ ]?:[ ]?(-)?(0|[1-9][0-9]*)[ ]?,[ ]?"tags"[ ]?:[ ]?\[[ ]?(' + _JSON_STR + r'(,[ ]?' + _JSON_STR
    + r'){0,4})?[ ]?\][ ]?\}'
)
_POKEDEX_LIKE = (
    r'\{\n  "alias": "[a-z]{1,5}",\n  "description": "[A-Z][a-z][0-9][\w\s,.!?]{1,3}",\n'
    r'  "type": "(Bug|Dark|Dragon|Electric|Fairy|Fire|Water)",\n  "height_m": [0-9]{1,2}\.[0-9]{1},\n'
    r'  "abilities": \[\n    "(Overgrow|Blaze|Torrent|Shield Dust)"(, "(Overgrow|Blaze|Torrent)"){0,3}\n  \]\n\}'
)
KERNEL_REGEXES = [
    # the pynini-checked and walk-checked regexes above
    r"(Yes|No|Maybe)", r"\d{2}-\d", r"[a-zé]{1,2}", r"é|€|中文", r'"([^"\\]|\\.)?"', r"[α-ω]{1,2}x?", r"a?\n?",
    r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z", r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
    r"[A-Za-z ,]{5,60}\.", r'"([^"\\]|\\.){0,20}"', r" ?[a-z]{1,8}( [a-z]{1,8}){0,3}\n", r"(  |\t)?x",
    r"[^a\n]€", r"[^a\n]{1,3}中文", r"(a|)",
    # JSON-schema-like, free text, multilingual classes
    _JSON_LIKE, _POKEDEX_LIKE, r"[^\n]{1,200}", r'"[^"\\]{0,40}"', r"[^\n]{1,30}\n",
    r"[α-ωА-Яа-яё ]{1,12}", r"[一-龥ぁ-んァ-ン]{1,8}", r"[가-힣 ]{1,10}", r"[^\x00-\x7f]{1,6}",
    r"[\u0600-\u06ff ]{1,5}",
]


def _token_dfa_diff(a, b) -> str | None:
    """Name of the first TokenDFA field where ``a`` and ``b`` differ (values or dtypes), None if identical."""
    for f in ("num_states", "num_groups"):
        if getattr(a, f) != getattr(b, f):
            return f
    for f in ("accepting", "edge_ptr", "edge_group", "edge_next", "token_group", "byte_state"):
        x, y = getattr(a, f), getattr(b, f)
        if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
            return f
    return None


def _both_backends(bdfa, trie, policy, **kw):
    """(result or exception type) of build_token_dfa with each backend."""
    from vllm_fst_backend.compiler.token_dfa import build_token_dfa

    out = []
    for backend in ("numpy", "numba"):
        try:
            out.append(build_token_dfa(bdfa, trie, policy, backend=backend, **kw))
        except (CompileBudgetError, EmptyLanguageError) as e:
            out.append(type(e))
    return out


def _quick_arts(built_artifacts, name):
    from vllm_fst_backend.artifacts.store import load_artifacts

    return load_artifacts(built_artifacts(name))


def _policies(arts):
    return ["all", "no_ascii_with_piece", "canonical"] if (np.asarray(arts.byte_fallback) >= 0).any() else ["all"]


_TOOL_SCHEMA = {  # a tool-calling schema: bounded strings between many key literals (fine byte classes)
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 48}, "unit": {"enum": ["celsius", "fahrenheit"]},
                   "note": {"type": "string", "maxLength": 64}, "days": {"type": "integer"}},
    "required": ["city", "unit"],
}


@pytest.mark.parametrize("name", ["smollm2", "mistral_v1", "tekken"])
def test_token_dfa_numba_equals_numpy(built_artifacts, name, monkeypatch):
    """The numba trie walk (kernels.py) gives exactly the numpy path's TokenDFA (same arrays: states,
    accepting, edge CSR, token groups, byte states) on a corpus of regexes, for every byte policy of
    the tokenizer (SentencePiece: byte fallback and the canonical byte policy): with the counter-chain
    shortcut of pass 1 as configured (it must serve the tool schema), and forced on every chain source and
    every prefixed chain source (a string's escapes, hex digits and UTF-8 continuations; served there)."""
    from vllm_fst_backend.compiler import token_dfa
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex
    from vllm_fst_backend.compiler.regex_to_bytes import byte_dfa_table, regex_to_char_dfa
    from vllm_fst_backend.compiler.token_trie import trie_for

    arts = _quick_arts(built_artifacts, name)
    trie = trie_for(arts)
    used = []
    real = token_dfa._FusedWalk._variant

    def spy(self, masks, first_ok):
        v = real(self, masks, first_ok)
        used.append((v is not None, masks.shape[0] - 1))
        return v

    monkeypatch.setattr(token_dfa._FusedWalk, "_variant", spy)
    tool = json_schema_to_regex(_TOOL_SCHEMA)
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(token_dfa._FusedWalk, "_CHAIN_MIN_VISITS", 0)
            monkeypatch.setattr(token_dfa._FusedWalk, "_CHAIN_MAX_SHARE", 1.0)
            monkeypatch.setattr(token_dfa._FusedWalk, "_PREFIX_MIN_SOURCES", 1)
        for regex in ([tool] + KERNEL_REGEXES) if forced else [tool, _JSON_LIKE, _POKEDEX_LIKE]:
            used.clear()
            bdfa = byte_dfa_table(regex_to_char_dfa(regex, prepend_space=bool(arts.prepend_space)))
            for policy in _policies(arts):
                ref, fast = _both_backends(bdfa, trie, policy, deadline=time.perf_counter() + 120)
                assert not isinstance(ref, type), (regex, policy, ref)
                assert _token_dfa_diff(ref, fast) is None, (regex, policy, forced, _token_dfa_diff(ref, fast))
            if regex is tool:
                assert any(ok for ok, _ in used), (name, forced)  # the shortcut served the schema's strings
                if forced:  # and the prefixed chains their escapes
                    assert any(ok and d >= 1 for ok, d in used), (name, used)


@pytest.mark.parametrize("name", TOKENIZERS)
@FST_SETTINGS
@given(regex=regex_strategy())
def test_token_dfa_backends_agree_on_random_regexes(built_artifacts, name, regex):
    """Property: both backends give identical TokenDFAs (or the same error) on random regexes, also when
    the numba walk is cut into many tiny chunks (deadline checks between chunks, output buffers grown)."""
    from vllm_fst_backend.compiler import token_dfa
    from vllm_fst_backend.compiler.regex_to_bytes import byte_dfa_table, regex_to_char_dfa
    from vllm_fst_backend.compiler.token_trie import trie_for

    arts = _quick_arts(built_artifacts, name)
    trie = trie_for(arts)
    bdfa = byte_dfa_table(regex_to_char_dfa(regex, prepend_space=bool(arts.prepend_space)))
    saved = token_dfa._WALK_CHUNK_VISITS
    for chunk in (saved, 7):
        token_dfa._WALK_CHUNK_VISITS = chunk
        try:
            for policy in _policies(arts):
                ref, fast = _both_backends(bdfa, trie, policy, deadline=time.perf_counter() + 120)
                if isinstance(ref, type):
                    assert fast is ref, (regex, policy)
                else:
                    assert _token_dfa_diff(ref, fast) is None, (regex, policy, chunk, _token_dfa_diff(ref, fast))
        finally:
            token_dfa._WALK_CHUNK_VISITS = saved


def test_byte_classes_kernels_equal_numpy():
    """The byte classes of a byte DFA table (bytes with equal columns; dead bytes -1; numbered by smallest
    byte): the hashing kernel, its exact fallback (taken on a hash collision) and the numpy path agree, on
    random tables with few distinct values (many equal columns) and on real ones."""
    from vllm_fst_backend.compiler import kernels
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex
    from vllm_fst_backend.compiler.regex_to_bytes import byte_dfa_table, regex_to_char_dfa
    from vllm_fst_backend.compiler.token_dfa import _byte_classes

    rng = np.random.default_rng(3)
    tables = [byte_dfa_table(regex_to_char_dfa(rx)).table for rx in
              (json_schema_to_regex(_TOOL_SCHEMA), _JSON_LIKE, _POKEDEX_LIKE, r"[^\n]{1,20}", "a")]
    for _ in range(200):
        t = rng.integers(-1, 3, size=(int(rng.integers(1, 6)), 256)).astype(np.int32)
        t[:, rng.integers(0, 256, 60)] = -1
        tables.append(t)
    for t in tables:
        want = _byte_classes(t, fast=False)
        for got in (_byte_classes(t, fast=True), kernels.byte_classes_exact(t)):
            assert np.array_equal(got[0], want[0]) and int(got[1]) == want[1] and np.array_equal(got[2], want[2])
        assert want[1] == len(np.unique(t[:, want[0] >= 0], axis=1).T) and (want[0] < 0).sum() == (t < 0).all(0).sum()


@FST_SETTINGS
@given(regex=regex_strategy())
def test_byte_dfa_table_equals_reference_on_random_regexes(regex):
    """Property: the byte table built through the kernels (``kernels.char_arc_keys``: one gadget per key of
    class sequence and exit ranks; ``kernels.expand_gadgets``: every row in one call) is the per-state
    Python path's, array for array, with and without the SentencePiece space."""
    from vllm_fst_backend.compiler.regex_to_bytes import byte_dfa_table, byte_dfa_table_reference, regex_to_char_dfa

    for ps in (False, True):
        try:
            cdfa = regex_to_char_dfa(regex, prepend_space=ps)
        except (CompileBudgetError, EmptyLanguageError):
            return
        a, b = byte_dfa_table(cdfa), byte_dfa_table_reference(cdfa)
        assert np.array_equal(a.table, b.table) and np.array_equal(a.final, b.final), regex
        assert np.array_equal(a.char_entry, b.char_entry)


def test_byte_dfa_table_equals_reference_on_the_corpus(monkeypatch):
    """The kernels' byte table equals the Python path's on JSON schemas (bounded strings: UTF-8 and escape
    gadgets per position), the compile and kernel corpora and multilingual classes; and when the states'
    key hashes collide (all keys made equal here) it takes the Python path and still gives that table."""
    from vllm_fst_backend.compiler import kernels
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex
    from vllm_fst_backend.compiler.regex_to_bytes import byte_dfa_table, byte_dfa_table_reference, regex_to_char_dfa

    corpus = [json_schema_to_regex(_TOOL_SCHEMA), _JSON_LIKE, _POKEDEX_LIKE] + KERNEL_REGEXES
    cdfas = [regex_to_char_dfa(rx, prepend_space=ps) for rx in corpus for ps in (False, True)]
    for cdfa in cdfas:
        want = byte_dfa_table_reference(cdfa)
        got = byte_dfa_table(cdfa)
        assert np.array_equal(got.table, want.table) and np.array_equal(got.final, want.final)
    real = kernels.first_keys
    monkeypatch.setattr(kernels, "first_keys", lambda k0, k1, k2: (np.zeros(len(k0), np.int64), 1) if len(k0) else real(k0, k1, k2))
    for cdfa in cdfas[:6]:
        assert np.array_equal(byte_dfa_table(cdfa).table, byte_dfa_table_reference(cdfa).table)


def test_candidate_groups_kernel_equals_numpy():
    """Merge candidates of the token DFA's groups (equal pair-set hash triples) numbered in order of first
    appearance: the hash-table kernel (``kernels.first_keys``) and the numpy path agree, with many and with
    no repeated keys, and keys differing in one component only stay apart."""
    from vllm_fst_backend.compiler.token_dfa import _candidate_groups

    rng = np.random.default_rng(5)
    for n, distinct in ((0, 1), (1, 1), (50, 3), (2000, 40), (2000, 5000)):
        pick = rng.integers(0, distinct, n)
        base = rng.integers(0, 2**63, size=(3, distinct), dtype=np.uint64)
        s1, s2, cnt = base[0][pick], base[1][pick], (base[2][pick] % 7).astype(np.int64)
        if n > 2:
            s2[0], s1[1], cnt[2] = s2[0] ^ np.uint64(1), s1[1] ^ np.uint64(1), cnt[2] + 1  # one component off
        present = np.sort(rng.choice(3 * n + 1, size=n, replace=False)).astype(np.int64)
        fast = _candidate_groups(s1, s2, cnt, present, 3 * n + 1, True)
        ref = _candidate_groups(s1, s2, cnt, present, 3 * n + 1, False)
        assert np.array_equal(fast[0], ref[0]) and np.array_equal(fast[1], ref[1]) and fast[2] == ref[2]
        keys = list(zip(s1.tolist(), s2.tolist(), cnt.tolist()))
        assert fast[2] == len(set(keys))
        order = list(dict.fromkeys(keys))  # (first appearance)
        assert fast[0].tolist() == [order.index(k) for k in keys]


def test_explicit_rows_are_the_tokens_of_each_states_groups(fst_artifacts):
    """Non-canonical (explicit) automata at SmolLM2: each state's bitmask row (``rows_for_groups``, one
    kernel call) holds exactly the tokens of its transition groups, plus EOS iff the state accepts; its
    forced token is the only allowed one where there is one."""
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex

    arts = fst_artifacts("smollm2")
    eos = set(np.asarray(arts.eos_ids).tolist())
    for rx in (_POKEDEX_LIKE, json_schema_to_regex(_TOOL_SCHEMA), r"[^\n]{1,40}", "Red|Green|Blue"):
        c = compile_regex(rx, arts, CompileOptions(canonical=False))
        assert c.mode == "explicit"
        tg = c.token_group
        for s in range(c.num_states):
            groups = c.trans_group[c.trans_ptr[s] : c.trans_ptr[s + 1]]
            want = set(np.flatnonzero(np.isin(tg, groups) & (tg >= 0)).tolist()) | (eos if c.accepting[s] else set())
            got = set(c.allowed_tokens(s).tolist())
            assert got == want, (rx, s, len(got ^ want))
            assert (int(c.forced_token[s]) >= 0) == (len(want) == 1)
            if len(want) == 1:
                assert want == {int(c.forced_token[s])}


def test_token_dfa_numba_budgets_and_empty(built_artifacts):
    """Both backends raise the same typed errors: past deadline, too many states or transitions, and an
    empty token language (a vocabulary that cannot spell the regex)."""
    from vllm_fst_backend.compiler import token_dfa
    from vllm_fst_backend.compiler.regex_to_bytes import byte_dfa_table, regex_to_char_dfa
    from vllm_fst_backend.compiler.token_trie import build_token_trie, trie_for

    trie = trie_for(_quick_arts(built_artifacts, "smollm2"))
    bdfa = byte_dfa_table(regex_to_char_dfa(_JSON_LIKE))
    for kw in ({"deadline": time.perf_counter() - 1.0}, {"max_states": 5}, {"max_edges": 100}):
        for backend in ("numpy", "numba"):
            with pytest.raises(CompileBudgetError):
                token_dfa.build_token_dfa(bdfa, trie, "all", backend=backend, **kw)
    tiny = build_token_trie([b"a", b"ab", None, b"b"], None)
    for backend in ("numpy", "numba"):
        with pytest.raises(EmptyLanguageError):
            token_dfa.build_token_dfa(byte_dfa_table(regex_to_char_dfa("c")), tiny, "all", backend=backend)
        td = token_dfa.build_token_dfa(byte_dfa_table(regex_to_char_dfa("(ab)+")), tiny, "all", backend=backend)
        assert td.num_states >= 2
    with pytest.raises(ValueError):
        token_dfa.build_token_dfa(bdfa, trie, "all", backend="cuda")


# --- canonical dead-end analysis: numba / vectorized path == reference path (identical tables) --------------


def _token_dfa_of(arts, regex: str, monkeypatch):
    """Compile ``regex`` (canonical); returns its token DFA, the canonical helper and the number of
    character states (what the dead-end analysis takes)."""
    import vllm_fst_backend.compiler.canonical_product as cp
    from vllm_fst_backend.compiler import CompileBudgets

    got = {}
    real = cp.canonical_automaton

    def spy(M, artifacts, trie, eos_ids, V, *, deadline, n_char_states, **kw):
        got["args"] = (M, cp.canonical_helper(artifacts, trie), n_char_states)
        return real(M, artifacts, trie, eos_ids, V, deadline=deadline, n_char_states=n_char_states, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(cp, "canonical_automaton", spy)
        compile_regex(regex, arts, CompileOptions(), budgets=CompileBudgets(time_budget_s=120))
    return got["args"]


def _analysis_pair(arts, regex: str, monkeypatch):
    """Compile ``regex`` (canonical) and rerun its dead-end analysis twice on the same token DFA: the fast
    path (numba kernels, vectorized byte-fallback moves) and the reference path (``use_kernels=False``)."""
    import vllm_fst_backend.compiler.canonical_product as cp

    M, H, n = _token_dfa_of(arts, regex, monkeypatch)
    out = []
    for use in (True, False):
        an = cp._Analysis(M, H, time.perf_counter() + 300, n)
        an.use_kernels = use
        an.run(n)
        an.n_char_states = n
        out.append(an)
    return cp, out[0], out[1]


def _schema_regex(props: dict, required: list) -> str:
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex

    return json_schema_to_regex({"type": "object", "properties": props, "required": required,
                                 "additionalProperties": False})


@pytest.mark.parametrize("name", ["smollm2", "tekken"])
def test_deadend_verdicts_shared_between_compiles_are_exact(fst_artifacts, monkeypatch, name):
    """Dead-end verdicts are shared between compiles by content (``compiler/verdict_cache.py``): a
    schema analysed after two others (warm cache: most verdicts looked up, made by other token DFAs
    with other groups and tags) gets exactly the bad tables of the same analysis on an empty cache,
    state by state, and the automaton built on the warm cache has the same rows on random walks."""
    import vllm_fst_backend.compiler.canonical_product as cp
    from vllm_fst_backend.compiler.verdict_cache import VerdictCache

    arts = fst_artifacts(name)
    if name == "tekken":
        warm = [r'\{"a": "[a-z ]{0,8}", "n": [0-9]{1,3}\}', r'\{"b": "[a-z ]{0,6}"\}']
        target = r'\{"c": "[a-z ]{0,7}"(, "d": [0-9]{1,2})?\}'
    else:
        s32 = {"type": "string", "maxLength": 32}
        warm = [_schema_regex({"title": s32, "n": {"type": "integer"}}, ["title", "n"]),
                _schema_regex({"topic": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"}}, ["topic"])]
        target = _schema_regex({"name": {"type": "string", "maxLength": 20}, "price": {"type": "number"},
                                "tags": {"type": "array", "items": s32, "maxItems": 2}}, ["name", "price"])
    M, H, n = _token_dfa_of(arts, target, monkeypatch)
    vc = VerdictCache(H.V, H.C)  # warmed by the other schemas only
    monkeypatch.setattr(H, "_fst_verdicts", vc, raising=False)
    for rx in warm:
        compile_regex(rx, arts, CompileOptions())
    m0 = vc.misses
    warm_an = cp._Analysis(M, H, time.perf_counter() + 300, n)
    warm_an.run(n)
    warm_computed = vc.misses - m0
    monkeypatch.setattr(H, "_fst_verdicts", VerdictCache(H.V, H.C), raising=False)
    cold = cp._Analysis(M, H, time.perf_counter() + 300, n)
    cold.run(n)
    cold_computed = H._fst_verdicts.misses
    # (the warm run looked up verdicts another schema's compile made)
    assert cold_computed > 10 and warm_computed < 0.8 * cold_computed, (warm_computed, cold_computed)
    for s in range(M.num_states):
        a, b = warm_an.bad[s], cold.bad[s]
        assert (a is None) == (b is None), (name, s)
        if a is not None:
            assert np.array_equal(a, b), (name, s)
    compiled = compile_regex(target, arts, CompileOptions())  # fresh cache: computed, not looked up
    monkeypatch.undo()
    again = compile_regex(target, arts, CompileOptions())
    rng = random.Random(7)
    for _ in range(5):
        ma, mb = FstMatcher(compiled), FstMatcher(again)
        for _ in range(40):
            ra, rb = ma.compiled.allowed_row(ma.state), mb.compiled.allowed_row(mb.state)
            assert np.array_equal(ra, rb)
            ids = np.flatnonzero(np.unpackbits(ra.view(np.uint8), bitorder="little"))
            if not len(ids):
                break
            t = int(ids[rng.randrange(len(ids))])
            if t in ma.eos_ids:
                break
            assert ma.accept_tokens("a", [t]) and mb.accept_tokens("b", [t])


def test_verdict_cache_is_bounded(monkeypatch):
    """Over its byte or entry budget the verdict cache starts empty again; tables it returns are shared,
    read-only, and equal ones are stored once. Its budget is at most an eighth of the compile memory
    budget, which counts it."""
    from types import SimpleNamespace

    from vllm_fst_backend.compiler.verdict_cache import MAX_BYTES, VerdictCache, verdict_cache

    monkeypatch.setenv("VLLM_FST_COMPILE_MEMORY_MB", "128")
    assert verdict_cache(SimpleNamespace(V=10, C=4)).max_bytes == 16 << 20
    monkeypatch.delenv("VLLM_FST_COMPILE_MEMORY_MB")
    assert verdict_cache(SimpleNamespace(V=10, C=4)).max_bytes == MAX_BYTES

    vc = VerdictCache(10, 4, max_bytes=3 * 8, max_entries=5)
    t = np.zeros((2, 4), dtype=bool)
    t[1, 2] = True
    got = vc.put(("k", 1), t)
    assert not got.flags.writeable and np.array_equal(got, t) and got is not t
    assert vc.put(("k", 2), t.copy()) is got and vc.nbytes() == 8
    assert vc.get(("k", 1)) == (True, got) and vc.get(("k", 9)) == (False, None)
    vc.put(("none", 1), None)
    assert vc.get(("none", 1)) == (True, None)
    for i in range(3):  # distinct tables: the third exceeds 24 bytes -> a fresh cache
        u = np.zeros((2, 4), dtype=bool)
        u[0, i] = True
        vc.put(("u", i), u)
    assert vc.nbytes() == 8 and len(vc) == 1 and vc.get(("k", 1)) == (False, None)
    for i in range(6):
        vc.put(("n", i), None)
    assert len(vc) <= 5


@pytest.mark.parametrize("name, regex, max_pairs", [
    ("smollm2", _JSON_LIKE, None), ("smollm2", _POKEDEX_LIKE, None), ("smollm2", _POKEDEX_LIKE, 3000),
    ("smollm2", r'"[^"\\]{0,20}", "[a-z]{1,6}"', None), ("smollm2", r"(yes|no|maybe)[.!]?", None),
    ("tekken", r'\{"a": "[a-z ]{0,6}"(, "b": [0-9]{1,2})?\}', None),
])
def test_deadend_entering_classes_exact(fst_artifacts, monkeypatch, name, regex, max_pairs):
    """The analysis decides each state only for the classes a token can enter it with
    (``_Analysis.entering_classes``): its bad tables equal the analysis over every class on those classes
    (the only ones any reader uses), for every regex state; and the factored automata built from both
    give the same rows and successors on random walks. With a small pair budget (``max_pairs``) the
    widest of the other states fall back to every class, and the result is the same."""
    import vllm_fst_backend.compiler.canonical_product as cp

    arts = fst_artifacts(name)
    if max_pairs is not None:
        monkeypatch.setattr(cp._Analysis, "_ENTERING_MAX_PAIRS", max_pairs)
    _, fast, _ = _analysis_pair(arts, regex, monkeypatch)
    if max_pairs is not None:  # the budget made some states wide that the token bound alone would not
        M = fast.M
        n_in = np.bincount(M.edge_next, weights=fast.g_size[M.edge_group], minlength=M.num_states)
        capped = [s for s in range(M.num_states)
                  if fast.entering_classes(s) is None and n_in[s] <= fast._ENTERING_MAX_TOKENS]
        assert capped, regex
    monkeypatch.setattr(cp._Analysis, "_ENTERING_MAX_TOKENS", -1)  # every state "wide": all classes
    full = cp._Analysis(fast.M, fast.H, time.perf_counter() + 300, fast.n_char_states)
    full.run(fast.n_char_states)
    monkeypatch.undo()
    restricted = 0
    for s in range(fast.M.num_states):
        ent = fast.entering_classes(s)
        assert full.entering_classes(s) is None
        a = fast.bad[s] if fast.bad[s] is not None else np.zeros((fast.nsig, fast.H.C), dtype=bool)
        b = full.bad[s] if full.bad[s] is not None else np.zeros((full.nsig, full.H.C), dtype=bool)
        if ent is None:
            assert np.array_equal(a, b), (regex, s)
        else:
            restricted += 1
            assert np.array_equal(a[:, ent], b[:, ent]), (regex, s)
            rest = np.ones(fast.H.C, dtype=bool)
            rest[ent] = False
            assert not a[:, rest].any(), (regex, s)  # the classes it is never entered with are left good
    assert restricted > 0, regex
    eos = np.asarray(arts.eos_ids)
    autos = []
    for an in (fast, full):
        autos.append(cp.FactoredCanonical(an.M, an.H, an, eos, cp._signatures(an)))
        _check_base_rows(an, autos[-1])
    rng = np.random.default_rng(1)
    for _ in range(4):
        x = 0
        for _step in range(40):
            r1, r2 = autos[0].row(x), autos[1].row(x)
            assert np.array_equal(r1, r2), (regex, x)
            ids = cp.ids_of_row(r1)
            ids = ids[~np.isin(ids, eos)]
            if not len(ids):
                break
            v = int(rng.choice(ids))
            y1, y2 = autos[0].next_state(x, v), autos[1].next_state(x, v)
            assert y1 == y2 >= 0, (regex, x, v)
            x = y1


@pytest.mark.parametrize("name", ["smollm2", "tekken"])
def test_packed_group_rows_exact_with_bad_tables(fst_artifacts, monkeypatch, name):
    """Base rows built from packed rows of big groups per (group, successor tag)
    (``canonical_product.PackedGroupRows``), in the analysis and in the factored automaton, are the
    reference rows (group rows less the classes bad at each target) at every state of bounded quoted text,
    where big groups lead to targets with bad tables (checked: such edges occur)."""
    import vllm_fst_backend.compiler.canonical_product as cp

    M, H, n = _token_dfa_of(fst_artifacts(name), r'"[^"\\]{0,24}"', monkeypatch)
    an = cp._Analysis(M, H, time.perf_counter() + 300, n)
    an.run(n)
    assert _check_base_rows(an) > 0


def _check_setup_kernels(an):
    """The analysis' set-up kernels against numpy: tokens by group (a stable argsort), the witness
    table (a lexsort: lowest estimated ban count, lowest id on ties), the classes of each group (a
    unique over (group, class) pairs) and the (σ, class) pairs that occur (a loop over tokens)."""
    from vllm_fst_backend.compiler import kernels

    H, M = an.H, an.M
    tg = M.token_group
    toks = np.flatnonzero(tg >= 0)
    assert np.array_equal(an.g_toks, toks[np.argsort(tg[toks], kind="stable")])
    assert np.array_equal(an.g_ptr[1:], np.cumsum(np.bincount(tg[toks], minlength=an.G)))
    reg = np.flatnonzero(an.regular & (tg >= 0) & (H.la_first >= 0))
    ref = np.full((an.G, max(H.L, 1)), -1, dtype=np.int32)
    o = np.lexsort((H.est_ban[reg], H.la_first[reg], tg[reg]))
    r = reg[o]
    key = tg[r].astype(np.int64) * max(H.L, 1) + H.la_first[r]
    sel = r[np.concatenate([[True], key[1:] != key[:-1]])]
    ref[tg[sel], H.la_first[sel]] = sel
    assert np.array_equal(an._witness_table(), ref)
    assert (ref >= 0).any()
    ptr, cls = kernels.group_classes(an.g_toks, an.g_ptr, an.tclass_safe.astype(np.int64), H.ctx_j, H.ctx_cls_ptr,
                                     H.ctx_cls, H.C, np.ones(an.G, dtype=bool))
    # a group left out by ``need`` gets an empty list, the others the same ones
    need = np.arange(an.G) % 2 == 0
    p2, c2 = kernels.group_classes(an.g_toks, an.g_ptr, an.tclass_safe.astype(np.int64), H.ctx_j, H.ctx_cls_ptr,
                                   H.ctx_cls, H.C, need)
    for g in range(an.G):
        assert np.array_equal(c2[p2[g] : p2[g + 1]], cls[ptr[g] : ptr[g + 1]] if need[g] else cls[:0]), g
    # the verdict cache's group hashes (kernels.group_hash_sums): the wrapping sums of the tokens' values
    from vllm_fst_backend.compiler.verdict_cache import verdict_cache

    vc = verdict_cache(H)
    gh = vc.group_hashes(an.g_toks, an.g_ptr)
    with np.errstate(over="ignore"):
        want_h = np.stack([[vc.tok_hash[i, an.g_toks[an.g_ptr[g] : an.g_ptr[g + 1]]].sum(dtype=np.uint64)
                            for g in range(an.G)] for i in (0, 1)])
    assert gh.dtype == np.uint64 and np.array_equal(gh, want_h)
    for g in range(0, an.G, max(1, an.G // 50)):
        tk = an.g_toks[an.g_ptr[g] : an.g_ptr[g + 1]]
        want = [an.tclass_safe[tk].astype(np.int64)]
        for j in H.ctx_j[tk][H.ctx_j[tk] >= 0].tolist():
            row = H.ctx_classes[j].astype(np.int64)
            want.append(np.where(row < 0, row + H.C, row))
        got = cls[ptr[g] : ptr[g + 1]]
        assert len(got) == len(set(got.tolist())) and np.array_equal(np.sort(got), np.unique(np.concatenate(want)))
    if an._ent_ptr is not None:  # entering classes: per narrow state, the union over its incoming edges
        for s in range(M.num_states):
            if an._ent_wide[s]:
                continue
            into = np.flatnonzero(M.edge_next == s)
            want = [cls[ptr[g] : ptr[g + 1]] for g in M.edge_group[into].tolist()]
            want = np.unique(np.concatenate(want)) if want else np.zeros(0, np.int64)
            assert np.array_equal(an.entering_classes(s), want), s
    occurs = np.zeros_like(H.sigma_cls)
    occurs[0] = True
    for v in np.flatnonzero((H.j_of >= 0) & (H.tclass >= 0)).tolist():
        cs = H.next_cls_matrix(np.arange(H.C + 1), np.array([v]))[0]  # the class v reaches from each k
        i = H.la_sets_idx[:, H.j_of[v]]  # the lookahead set it leaves from each k
        occurs[i[i > 0], cs[i > 0]] = True
    assert not (occurs & ~H.sigma_cls).any()  # every (σ, class) pair that occurs is kept
    _check_base_rows(an)


def _check_base_rows(an, fc=None):
    """The factored automaton's base rows, built token by token on first visit (``kernels.regular_row``),
    are the analysis' regular rows (group rows less the classes bad at each target), state by state."""
    import vllm_fst_backend.compiler.canonical_product as cp

    M = an.M
    if fc is None:
        fc = cp.FactoredCanonical(M, an.H, an, np.asarray([], np.int64), cp._signatures(an))
    n_tagged = n_packed_tagged = 0
    for s in range(M.num_states):
        ref = an.regular_row_groups(s)
        assert np.array_equal(fc._base_row(s), ref), s
        assert np.array_equal(an.regular_row(s), ref), s  # (the analysis' own packed rows)
        gs, ts = an._edges(s)
        n_tagged += bool(an.tag[ts].any())
        n_packed_tagged += bool(((an.g_size[gs] > cp.PackedGroupRows.BIG) & (an.tag[ts] != 0)).any())
    assert n_tagged > 0  # some state has a successor with bad classes (the filter is exercised)
    return n_packed_tagged


def _check_special_prep(an, s: int, sig: int, toks: np.ndarray, tgts: np.ndarray) -> bool:
    """``kernels.special_prep`` (through ``_special_prep``: a state's special tokens visited through its
    groups' lists when they are few, else by a scan of all) against the numpy selection of
    ``specials_clear``'s reference path: the same tokens in the same order, targets, flags and rows.
    Returns whether the kernel took the path through the groups' lists."""
    H = an.H
    vt, vg, jw, dj, good_t, (id_tok, id_pos), row_reg, row_all, inner_tok, inner_tgt = an._special_prep(s, sig)
    lf = H.la_first[toks]
    sel = (H.tclass[toks] >= 0) & (lf >= 0) & H.sigma_la[sig][np.maximum(lf, 0)]
    inner = sel & (H.tok_bf_byte[toks] >= 0) & (an.bf_start[toks] >= 0)
    assert np.array_equal(inner_tok, toks[inner]) and np.array_equal(inner_tgt, tgts[inner])
    sel &= ~inner
    r_vt, r_vg = toks[sel], tgts[sel]
    order = np.argsort(H.est_ban[r_vt], kind="stable")
    assert np.array_equal(vt, r_vt[order]) and np.array_equal(vg, r_vg[order])
    assert np.array_equal(id_tok, r_vt) and np.array_equal(vt[id_pos], r_vt)
    assert np.array_equal(jw, H.j_of[vt])
    ctx_only = (jw < 0) & (H.ctx_j[vt] >= 0)
    assert np.array_equal(dj, np.where(ctx_only, H.ctx_j[vt], -1))
    want_good = np.zeros(len(vt), dtype=bool)
    c = np.flatnonzero(ctx_only)
    want_good[c] = an.succ_good_many(vg[c], H.tclass[vt[c]].astype(np.int64), np.zeros(len(c), np.int64))
    assert np.array_equal(good_t, want_good)
    cp = sys.modules[type(an).__module__]
    assert np.array_equal(row_all, cp._pack_ids(vt, H.W)) and np.array_equal(row_reg, cp._pack_ids(vt[good_t], H.W))
    gs, _ = an._edges(s)
    grp_ptr = an._sp_e[5]
    return 4 * int((grp_ptr[gs + 1] - grp_ptr[gs]).sum()) < len(an.spec_toks)  # (the kernel's path)


_MEMBER = r'"[a-z]{1,8}"[ ]?:[ ]?("[^"\\]{0,12}"|\d{1,3})'
_SMALL_OBJECT = r"\{[ ]?(" + _MEMBER + r"([ ]?,[ ]?" + _MEMBER + r"){0,2})?[ ]?\}"


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize(
    "regex", [_SMALL_OBJECT, r'"[^"\\]{0,20}"', r"[^a\n]{1,3}中文", r"[A-Za-z ,]{5,40}\."]
)
def test_deadend_analysis_matches_reference(fst_artifacts, monkeypatch, name, regex):
    """The dead-end analysis' fast path (kernels ``allows_some`` / ``pairs_clear``, vectorized
    ``byte_moves`` / ``inner_good`` / ``opening_byte_ok``) gives exactly the reference verdicts: equal bad
    tables and tags for every regex state, equal state signatures (``kernels.signatures``), and equal
    byte-fallback moves (SentencePiece)."""
    arts = fst_artifacts(name)
    cp, fast, ref = _analysis_pair(arts, regex, monkeypatch)
    assert len(fast.bad) == len(ref.bad)
    for s, (a, b) in enumerate(zip(fast.bad, ref.bad)):
        assert (a is None) == (b is None), (regex, s)
        if a is not None:
            assert np.array_equal(a, b), (regex, s)
    assert np.array_equal(fast.tag, ref.tag)
    # the states' signatures (kernels.signatures against the dict of the reference path)
    sig_fast, sig_ref = cp._signatures(fast), cp._signatures(ref)
    assert np.array_equal(sig_fast, sig_ref) and sig_fast.dtype == sig_ref.dtype
    H = fast.H
    _check_setup_kernels(fast)
    # the kernels against their numpy references on the analysis' own rows and random class sets
    rng = np.random.default_rng(0)
    paths = set()
    for s in range(0, fast.M.num_states, max(1, fast.M.num_states // 8)):
        row = fast.regular_row_packed(s)
        k_arr = np.sort(rng.choice(H.C, size=min(H.C, 300), replace=False)).astype(np.int64)
        assert np.array_equal(H.allows_some(row, k_arr), H.allows_some_numpy(row, k_arr))
        toks, tgts = fast.specials_of(s)
        for sig in range(fast.nsig):
            paths.add(_check_special_prep(fast, s, sig, toks, tgts))
            o1 = np.zeros(len(k_arr), dtype=bool)
            o2 = np.zeros(len(k_arr), dtype=bool)
            lf = H.la_first[toks]
            sel = (H.tclass[toks] >= 0) & (lf >= 0) & H.sigma_la[sig][np.maximum(lf, 0)]
            vt, vg = toks[sel], tgts[sel]
            idx = np.arange(len(k_arr))
            jw = H.j_of[vt]
            fast._pairs_clear_numpy(k_arr, idx, sig, vt, vg, jw, o2)
            cg = H.class_group[k_arr]
            groups = np.unique(cg)
            k_u = np.searchsorted(groups, cg).astype(np.int64)
            # every token, then without the ones acting like regular tokens in each class's group
            dj_all = np.full(len(vt), -1, dtype=np.int64)
            fast._pairs_clear(k_arr, k_u, groups, sig, vt, vg, jw, dj_all, o1)
            assert np.array_equal(o1, o2), (regex, s, sig)
            dj = np.where((jw < 0) & (H.ctx_j[vt] >= 0), H.ctx_j[vt], -1)
            outs = []
            for use in (True, False):
                fast.use_kernels = use
                o = np.zeros(len(k_arr), dtype=bool)
                fast._pairs_clear(k_arr, k_u, groups, sig, vt, vg, jw, dj, o)
                outs.append(o)
            fast.use_kernels = True
            assert np.array_equal(outs[0], outs[1]), (regex, s, sig)
            assert not (outs[0] & ~o2).any()  # (a subset of the tokens clears a subset of the classes)
            # the regular-like tokens: the kernel against packed rows per group (allows_some_numpy)
            from vllm_fst_backend.compiler import kernels

            good = rng.random(len(vt)) < 0.7
            o3 = np.zeros(len(k_arr), dtype=bool)
            row = cp._pack_ids(vt[(dj >= 0) & good], H.W)
            row0 = row.copy()
            kernels.grouped_allows_some(H.bt, H.few_ok, H.few_ptr, H.few_tok, H.heavy_pos, H.heavy_rows, row,
                                        np.flatnonzero(row), H.nd_ptr, H.nd_tok, groups.astype(np.int64),
                                        k_arr, k_u, o3)
            assert np.array_equal(row, row0)  # (restored)
            o4 = np.zeros(len(k_arr), dtype=bool)
            for u, g in enumerate(groups.tolist()):
                w = vt[good & H.acts_regular(vt, dj, g)]
                in_g = np.flatnonzero(k_u == u)
                if len(w):
                    o4[in_g] = H.allows_some_numpy(cp._pack_ids(w, H.W), k_arr[in_g])
            assert np.array_equal(o3, o4), (regex, s, sig)
        if H.acc is not None:
            for a in range(1, H.acc.shape[0]):
                for k in k_arr[:2].tolist():
                    m1 = list(fast.byte_moves(s, k, 0, a))
                    m2 = list(fast.byte_moves_reference(s, k, 0, a))
                    assert m1 == m2, (regex, s, k, a)
                    assert fast._inner_any(s, k, 0, a) == any(ok for _, ok in m2)
    # (both of special_prep's paths were compared; a whole-vocabulary scan may not occur on the last regex)
    assert paths == {True, False} or (True in paths and regex.endswith("中文"))


@pytest.mark.parametrize("name", ["smollm2", "tekken"])
def test_witness_verdicts_of_the_compiled_run_are_exact(fst_artifacts, monkeypatch, name):
    """``kernels.witness_verdict`` (``memo_run``'s verdict for a state whose witnesses alone clear every
    class, without calling ``state_bad``) only ever says "all good" where the analysis' verdict is all
    good, on the fast and on the reference path (which never takes it), for every state; and it serves
    the run (a quarter of a JSON schema's states at least)."""
    from vllm_fst_backend.compiler import kernels

    arts = fst_artifacts(name)
    schema_rx = _schema_regex({"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["C", "F"]},
                               "days": {"type": "integer", "minimum": 1, "maximum": 14}}, ["city"])
    for regex in (schema_rx, _SMALL_OBJECT):
        cp, fast, ref = _analysis_pair(arts, regex, monkeypatch)
        assert fast._n_free[0] > 0, regex
        M = fast.M
        n_true = 0
        for s in range(M.num_states):
            if kernels.witness_verdict(s, M.edge_ptr, M.edge_group, M.edge_next, fast.tag, fast._witness_args()):
                n_true += 1
                assert fast.bad[s] is None and ref.bad[s] is None, (regex, s)
                assert fast.state_bad(s) is None, (regex, s)
        assert n_true > (M.num_states // 4 if regex is schema_rx else 10), (regex, n_true, M.num_states)


_ARRAY_OF_OBJECTS = r"\[" + _SMALL_OBJECT + r"([ ]?,[ ]?" + _SMALL_OBJECT + r")*\]"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_deadend_fixpoint_does_not_depend_on_evaluation_order(fst_artifacts, monkeypatch, name):
    """:meth:`_Analysis.run`'s worklist (inside an SCC: DFS postorder, a re-evaluation deciding
    only the entries still bad) reaches the least fixpoint of plain Kleene iteration: from all-bad, every
    state evaluated in full on the reference path, round after round, until no table changes. The regex
    is an array of objects (what ``tool_choice="required"`` makes), whose token DFA is one large SCC."""
    import vllm_fst_backend.compiler.canonical_product as cp

    arts = fst_artifacts(name)
    M, H, n = _token_dfa_of(arts, _ARRAY_OF_OBJECTS, monkeypatch)
    comps = _scc_lists(cp, M.num_states, M.edge_ptr, M.edge_next)
    assert max(len(c) for c in comps) > M.num_states // 2
    fast = cp._Analysis(M, H, time.perf_counter() + 300, n)
    fast.run(n)
    ref = cp._Analysis(M, H, time.perf_counter() + 600, n)
    ref.use_kernels = False
    all_bad = np.ones((ref.nsig, H.C), dtype=bool)
    skip = (M.byte_state >= n) if H.acc is not None else np.zeros(M.num_states, dtype=bool)
    for s in range(M.num_states):
        ref._set(s, all_bad)
    rounds, changed = 0, True
    while changed:
        changed, rounds = False, rounds + 1
        for s in np.flatnonzero(~skip).tolist():
            changed |= ref._set(s, ref.state_bad(s))
            ref._inner_memo.clear()
    assert rounds > 2  # (the fixpoint took more than one pass: the order matters to the worklist)
    n_bad = 0
    for s in range(M.num_states):
        a, b = fast.bad[s], ref.bad[s]
        assert (a is None) == (b is None), s
        if a is not None:
            assert np.array_equal(a, b), s
            n_bad += int(a.sum())
    assert n_bad > 0  # (some entries are bad: the filter is exercised)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_tool_choice_required_schema_walks_valid_and_canonical(fst_artifacts, fst_infos, name):
    """``tool_choice="required"`` (vLLM's array of anyOf over ``{name, parameters}`` objects, the form the
    character DFA builds with one copy of the repeated item): random walks end in JSON instances of the
    schema (jsonschema) whose canonical tokenization (the tokenizer) is the walk."""
    import json

    import jsonschema

    from scripts.bench_compile_serving import tools_required_schema
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex

    schema = tools_required_schema([
        ("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                          "unit": {"enum": ["C", "F"]}}, "required": ["city"]}),
        ("add", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["a"]}),
    ])
    regex = json_schema_to_regex(schema)
    arts, info = fst_artifacts(name), fst_infos(name)
    c = compile_regex(regex, arts, CompileOptions())
    rnd = random.Random(11)
    lengths = []
    for _ in range(30):
        ids, done = random_walk(c, rnd, max_steps=200, p_eos=1.0)
        if done:
            text = decode_text(info, ids)
            jsonschema.validate(json.loads(text), schema)
            assert ids == oracle_ids(info, text), (text, ids)
            lengths.append(len(json.loads(text)))
    assert len(lengths) >= 10 and max(lengths) >= 2  # (walks end, some with more than one tool call)


def _row_kernels_match_reference(H, rows, k_arr) -> None:
    """``allows_some`` and ``grouped_allows_some`` (one context group, no exceptions) give the numpy
    reference's answer for every row of ``rows`` and the classes ``k_arr``."""
    from vllm_fst_backend.compiler import kernels

    for row in rows:
        want = H.allows_some_numpy(row, k_arr)
        assert np.array_equal(H.allows_some(row, k_arr), want)
        got = np.zeros(len(k_arr), dtype=bool)
        kernels.grouped_allows_some(H.bt, H.few_ok, H.few_ptr, H.few_tok, H.heavy_pos, H.heavy_rows, row.copy(),
                                    np.flatnonzero(row), np.zeros(2, np.int64), np.zeros(0, np.int64),
                                    np.zeros(1, np.int64), k_arr, np.zeros(len(k_arr), np.int64), got)
        assert np.array_equal(got, want)


@pytest.mark.parametrize("name", ["smollm2", "tekken"])
def test_few_allowed_classes_listed_and_decided_exactly(fst_artifacts, name):
    """``CanonHelper.few_ok / few_ptr / few_tok`` list exactly the classes allowing at most
    ``FEW_ALLOWED`` tokens and those tokens (reference: the banned bits unpacked); the kernels that
    decide such a class from its list (``allows_some``, ``grouped_allows_some``) agree with the numpy
    reference on rows holding none, one, or all of its allowed tokens."""
    import vllm_fst_backend.compiler.canonical_product as cp
    from vllm_fst_backend.compiler.token_trie import trie_for

    arts = fst_artifacts(name)
    H = cp.canonical_helper(arts, trie_for(arts))
    n_allowed = np.zeros(H.C, dtype=np.int64)
    for a in range(0, H.C, 512):  # (unpacked 512 classes at a time: Tekken's whole matrix is 5.9 G bits)
        bits = np.unpackbits((~H.bt[:, a : a + 512]).T.copy().view(np.uint8), axis=1, bitorder="little")
        n_allowed[a : a + 512] = bits[:, : H.V].sum(axis=1)
    ref_ok = n_allowed <= cp.FEW_ALLOWED
    assert np.array_equal(H.few_ok, ref_ok)
    allowed = {k: np.flatnonzero(np.unpackbits((~H.bt[:, k]).view(np.uint8), bitorder="little")[: H.V])
               for k in np.flatnonzero(ref_ok).tolist()}
    for k in np.flatnonzero(ref_ok).tolist():
        assert np.array_equal(H.few_tok[H.few_ptr[k] : H.few_ptr[k + 1]], allowed[k])
    if name == "tekken":
        assert H.few_ok.sum() > 0  # (Tekken has such classes: the path is exercised)
    rng = np.random.default_rng(3)
    few = np.flatnonzero(H.few_ok)
    k_arr = np.sort(np.concatenate([few, rng.choice(H.C, size=50, replace=False)])).astype(np.int64)
    rows = [rng.integers(-(2**31), 2**31, size=H.W, dtype=np.int64).astype(np.int32) & rng.integers(0, 2, H.W).astype(np.int32)]
    for k in few.tolist():
        for toks in (allowed[k][:1], allowed[k]):
            if len(toks):
                rows.append(cp._pack_ids(toks, H.W))
    rows.append(cp._pack_ids(np.array([0, H.V - 1]), H.W))
    _row_kernels_match_reference(H, rows, k_arr)


@pytest.mark.parametrize("name", ["smollm2", "tekken"])
def test_heavy_classes_copied_and_decided_exactly(fst_artifacts, name):
    """``CanonHelper.heavy_pos / heavy_rows``: the classes banning the most tokens (more than V /
    HEAVY_SHARE, at most HEAVY_MAX) with their banned bits copied class-major; the kernels that decide a
    heavy class along its copy (``allows_some``, ``grouped_allows_some``) agree with the numpy reference on
    rows that such a class bans entirely (its own banned set), or all but one token of, and random rows."""
    import vllm_fst_backend.compiler.canonical_product as cp
    from vllm_fst_backend.compiler.token_trie import trie_for

    arts = fst_artifacts(name)
    H = cp.canonical_helper(arts, trie_for(arts))
    heavy = np.flatnonzero(H.heavy_pos >= 0)
    assert 0 < len(heavy) <= cp.HEAVY_MAX
    cnt = np.zeros(H.C, dtype=np.int64)
    for a in range(0, H.W, 256):
        cnt += np.bitwise_count(H.bt[a : a + 256].view(np.uint32)).sum(axis=0, dtype=np.int64)
    assert (cnt[heavy] > H.V // cp.HEAVY_SHARE).all()
    others = np.setdiff1d(np.arange(H.C), heavy)
    assert len(heavy) == cp.HEAVY_MAX or (cnt[others] <= H.V // cp.HEAVY_SHARE).all()
    assert cnt[heavy].min() >= cnt[others].max()
    for k in heavy.tolist():
        assert np.array_equal(H.heavy_rows[H.heavy_pos[k]], H.bt[:, k])
    rng = np.random.default_rng(5)
    k_arr = np.sort(np.concatenate([heavy, rng.choice(others, size=50, replace=False)])).astype(np.int64)
    rows = [rng.integers(-(2**31), 2**31, size=H.W, dtype=np.int64).astype(np.int32) & rng.integers(0, 2, H.W).astype(np.int32)]
    for k in heavy[:: max(1, len(heavy) // 4)].tolist():
        banned = H.bt[:, k].copy()
        rows.append(banned)  # class k bans every token of it
        allowed = np.flatnonzero(np.unpackbits((~banned).view(np.uint8), bitorder="little")[: H.V])
        extra = banned.copy()
        extra[allowed[-1] >> 5] |= np.int32(1) << np.int32(allowed[-1] & 31)
        rows.append(extra)  # all but one
    _row_kernels_match_reference(H, rows, k_arr)
    assert not H.allows_some(rows[1], np.array([heavy[0]], np.int64))[0]
    assert H.allows_some(rows[2], np.array([heavy[0]], np.int64))[0]


def _scc_lists(cp, n, ptr, nxt) -> list[list[int]]:
    """``cp._scc_csr``'s components as lists of states, sinks first."""
    comp_ptr, nodes = cp._scc_csr(n, ptr, nxt)
    nodes = nodes.tolist()
    return [nodes[a:b] for a, b in zip(comp_ptr[:-1].tolist(), comp_ptr[1:].tolist())]


def test_sccs_are_components_in_reverse_topological_order():
    """``canonical_product._scc_csr`` (the numba Tarjan) on random graphs against reachability: the
    components partition the nodes, two nodes share one iff each reaches the other, and every edge
    leads to the same component or to an earlier one (sinks first, the order the dead-end analysis
    needs)."""
    import vllm_fst_backend.compiler.canonical_product as cp

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        deg = rng.integers(0, 4, size=n)
        ptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
        nxt = rng.integers(0, n, size=int(ptr[-1])).astype(np.int32)
        comps = _scc_lists(cp, n, ptr, nxt)
        assert sorted(x for c in comps for x in c) == list(range(n))
        comp_of = np.empty(n, dtype=np.int64)
        for i, c in enumerate(comps):
            comp_of[c] = i
        reach = np.eye(n, dtype=bool)
        src = np.repeat(np.arange(n), deg)
        reach[src, nxt] = True
        for _k in range(n):  # transitive closure
            reach = reach | (reach.astype(np.int64) @ reach.astype(np.int64) > 0)
        assert np.array_equal(comp_of[:, None] == comp_of[None, :], reach & reach.T)
        assert (comp_of[nxt] <= comp_of[src]).all()


def test_eager_tables_over_their_byte_bound_are_left_to_first_use(fst_artifacts, monkeypatch):
    """Special-token tables that would outgrow ``EAGER_TABLE_BYTES`` (Tekken: ~8,000 special tokens per
    table) are not built at compile, the base rows still are; the rows are the same either way."""
    import vllm_fst_backend.compiler.canonical_product as cp

    arts = fst_artifacts("smollm2")
    regex = r"[A-Za-z ,]{5,40}\."
    full = compile_regex(regex, arts, CompileOptions()).factored
    monkeypatch.setattr(cp.FactoredCanonical, "EAGER_TABLE_BYTES", 1)
    capped = compile_regex(regex, arts, CompileOptions()).factored
    assert full._eager_tables is not None and capped._eager_tables is None and capped._eager_base is not None
    assert (capped._fspec[1] < 0).all() and (capped._base_of_sig >= 0).all()
    rng = np.random.default_rng(4)
    eos = set(np.asarray(arts.eos_ids).tolist())
    x, r = 0, capped.row(0)
    for _step in range(40):
        assert np.array_equal(r, full.row(x)), x
        ids = [t for t in cp.ids_of_row(r).tolist() if t not in eos]
        if not ids:
            break
        x, r = capped.advance(x, r, int(rng.choice(ids)))


@pytest.mark.parametrize("name", TOKENIZERS)
def test_loaded_schema_automaton_builds_its_tables_on_first_use_with_the_same_rows(fst_artifacts, name):
    """A stored JSON-schema automaton (factored, bounded strings: bad tables, more than 128 signatures)
    loads without rebuilding its group arrays and bad tables (built on first use, ``_Analysis.__getattr__``);
    along random walks its rows equal the compiled automaton's, and once built its bad tables equal the
    compiled ones."""
    from vllm_fst_backend.compiler import persist
    from vllm_fst_backend.compiler.json_schema import json_schema_to_regex

    arts = fst_artifacts(name)
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                               "maxItems": 3},
        "kind": {"enum": ["a b", "c"]}, "n": {"type": "integer", "minimum": -5, "maximum": 300}},
        "required": ["name", "kind"], "additionalProperties": False}
    c = compile_regex(json_schema_to_regex(schema), arts, CompileOptions())
    fc = c.factored
    assert fc is not None and any(t is not None for t in fc.an.bad)
    # too many signatures for build_tables: only the start state's table and base row are built at compile
    # and kept (build_start_table); the others on first visit
    key0 = int(fc._key_of_s[0])
    assert fc._eager_tables is not None and np.flatnonzero(fc._eager_tables[1] >= 0).tolist() == [key0]
    assert (fc._eager_base[1] >= 0).sum() == 1 and fc._eager_base[1][fc.base_index[0]] >= 0
    loaded = persist.loads(persist.dumps(c), arts)
    assert np.flatnonzero(loaded.factored._fspec[1] >= 0).tolist() == [key0]
    an = loaded.factored.an
    assert "_tag_compact" in an.__dict__ and "bad" not in an.__dict__ and "g_toks" not in an.__dict__
    rng = np.random.default_rng(5)
    eos = set(np.asarray(arts.eos_ids).tolist())
    for _ in range(4):
        m, ref = FstMatcher(loaded), FstMatcher(c)
        for _step in range(60):
            ids = m.allowed_token_ids()
            assert np.array_equal(ids, ref.allowed_token_ids())
            ids = [t for t in ids.tolist() if t not in eos]
            if not ids:
                break
            t = int(rng.choice(ids))
            assert m.accept_tokens("r", [t]) and ref.accept_tokens("r", [t])
    # the rows read the bad tables' σ = ALL rows and σ bits straight from the stored entries: the walks
    # did not expand them (but for byte-fallback characters, whose verdicts read the tables); the same
    # values as from the expanded tables
    if an.H.acc is None:
        assert "_tag_compact" in an.__dict__ and "bad" not in an.__dict__
    reloaded = persist.loads(persist.dumps(c), arts).factored.an
    tab_compact = reloaded._tag_table().copy()
    bits_compact = {tag: reloaded.tag_sigma_bits(tag) for tag in reloaded._tag_compact}
    assert "_tag_compact" in reloaded.__dict__ and "bad" not in reloaded.__dict__
    assert tab_compact.shape[0] == len(fc.an._tag_full) + 1 and tab_compact[1:].any()
    # (σ != ALL bits: set exactly where the compiled tables have bad entries)
    assert any((b >> 1).any() for b in bits_compact.values()) == any(t[1:].any() for t in fc.an._tag_full.values())
    assert len(an.bad) == len(fc.an.bad) and all(
        (a is None and b is None) or np.array_equal(a, b) for a, b in zip(an.bad, fc.an.bad))
    assert an._tag_full.keys() == fc.an._tag_full.keys()
    assert np.array_equal(an.g_toks, fc.an.g_toks) and np.array_equal(an.g_ptr, fc.an.g_ptr)
    an._tab = None
    assert np.array_equal(an._tag_table(), tab_compact) and np.array_equal(fc.an._tag_table(), tab_compact)
    for tag, bits in bits_compact.items():
        assert np.array_equal(an.tag_sigma_bits(tag), bits) and np.array_equal(fc.an.tag_sigma_bits(tag), bits)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_eager_base_rows_equal_lazy_and_survive_pickling(fst_artifacts, monkeypatch, name):
    """Factored automata with few signatures build every base row and special-token table at compile
    (``build_tables``) and keep them when stored (``compiler/persist.py``); the rows equal the ones
    built on first visit (the path of larger automata, forced here with a threshold of 0) and the
    reference group-row path, and the loaded automaton builds no base row or table at any visit."""
    import vllm_fst_backend.compiler.canonical_product as cp
    from vllm_fst_backend.compiler import persist

    arts = fst_artifacts(name)
    regex = r"[A-Za-z ,]{5,40}\."
    eager = compile_regex(regex, arts, CompileOptions())
    fe = eager.factored
    assert fe is not None and fe._eager_base is not None and fe._eager_tables is not None
    n_sig = int(fe.base_index.max()) + 1
    assert (fe._base_of_sig >= 0).all() and len(fe._fspec[5]) == n_sig and (fe._fspec[1] >= 0).all()
    monkeypatch.setattr(cp.FactoredCanonical, "EAGER_BASE_SIGNATURES", 0)
    lazy = compile_regex(regex, arts, CompileOptions())
    fl = lazy.factored
    # (past the threshold: the start state's table and base row only, build_start_table)
    key0, sig0 = int(fl._key_of_s[0]), int(fl.base_index[0])
    assert np.flatnonzero(fl._base_of_sig >= 0).tolist() == [sig0] and np.flatnonzero(fl._fspec[1] >= 0).tolist() == [key0]
    loaded = persist.loads(persist.dumps(eager), arts).factored
    assert (loaded._base_of_sig >= 0).all() and (loaded._fspec[1] >= 0).all()
    built = []
    monkeypatch.setattr(cp.FactoredCanonical, "_regular_row", lambda self, s, have_lock=False: built.append(s))
    monkeypatch.setattr(cp.FactoredCanonical, "_fast_specials", lambda self, s: built.append(s))
    for s in range(fe.M.num_states):
        ref = fe.an.regular_row_groups(s)
        assert np.array_equal(loaded._base_row(s), ref), s
        assert np.array_equal(fe._base_row(s), ref), s
    rng = np.random.default_rng(2)
    eos = np.asarray(arts.eos_ids)
    walked = []  # (state, row) along random walks of the loaded automaton (compiled steps)
    for _ in range(3):
        x, r = 0, loaded.row(0)
        for _step in range(30):
            walked.append((x, r))
            ids = cp.ids_of_row(r)
            ids = ids[~np.isin(ids, eos)]
            if not len(ids):
                break
            x, r = loaded.advance(x, r, int(rng.choice(ids)))
    assert not built  # every base row and table came from the stored ones
    monkeypatch.undo()
    for s in range(fl.M.num_states):
        assert np.array_equal(fl._base_row(s), fe.an.regular_row_groups(s)), s
    for x, r in walked:  # the product rows: the same in all three
        assert np.array_equal(r, fl.row(x)) and np.array_equal(r, fe.row(x)), x


_KERNEL_SIGNATURES_SCRIPT = r"""
import json, sys
import numba
import numpy as np
from vllm_fst_backend.compiler import compile_regex, kernels as K, prepare
from vllm_fst_backend.artifacts.store import load_artifacts
from vllm_fst_backend.runtime import FstMatcher
from scripts.bench_compile_serving import fst_regex, serving_constraints

K.warm_up()
disp = {n: getattr(K, n) for n in dir(K) if isinstance(getattr(K, n), numba.core.registry.CPUDispatcher)}
before = {n: set(d.signatures) for n, d in disp.items()}
rng = np.random.default_rng(0)
rxs = [fst_regex(kind, spec) for _, kind, spec in serving_constraints(4)]
rxs += [r'[^"]{0,40}', r'(\w+ ){1,5}\.', r'"[^"\\]*"', '(Yes|No|Maybe)']
for path in sys.argv[1:]:
    arts = load_artifacts(path)
    prepare(arts)
    for rx in rxs:
        m = FstMatcher(compile_regex(rx, arts))
        for _ in range(12):
            if m.is_terminated():
                break
            assert m.accept_tokens("r", [int(rng.choice(m.allowed_token_ids()))])
print(json.dumps({n: [str(s) for s in d.signatures if s not in before[n]] for n, d in disp.items()}))
"""


def test_warm_up_compiles_every_kernel_signature_a_compile_uses(built_artifacts):
    """:func:`.kernels.warm_up` (run before any compile budget starts) compiles every numba signature that
    compiling and matching real constraints then uses, on the three tokenizers (byte fallback, ~14.6k
    special tokens): a signature it misses is JIT-compiled inside the first compile's time budget, seconds
    on a fresh install (a fresh process: this one has compiled everything already)."""
    import json
    import subprocess
    from pathlib import Path

    paths = [str(built_artifacts(n, canonical=True)) for n in ("smollm2", "mistral_v1", "tekken")]
    root = Path(__file__).resolve().parents[1]
    got = subprocess.run([sys.executable, "-c", _KERNEL_SIGNATURES_SCRIPT, *paths], cwd=root, capture_output=True,
                         text=True, timeout=900)
    assert got.returncode == 0, got.stderr[-3000:]
    new = json.loads(got.stdout.strip().splitlines()[-1])
    assert any(k == "canon_step" for k in new)  # (the script saw the kernels)
    assert {k: v for k, v in new.items() if v} == {}
