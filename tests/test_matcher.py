"""FstMatcher: vLLM 0.32's StructuredOutputGrammar contract on real tokenizers (SmolLM2, Mistral v1).

* accept_tokens (atomic; EOS terminates only in accepting states; tokens after termination ignored),
  validate_tokens (longest valid prefix, no state change), rollback (EOS included), reset,
  num_processed_tokens;
* fill_bitmask: one row copy, bitmask wider than W (extra words zeroed), equal to the allowed set;
* forced_tokens: the forced chain on a multiple-choice regex (000 §3.3.1), not changing the state;
* hypothesis: random regexes and strings -- the matcher accepts exactly the canonical tokenization of
  matching strings and rejects non-matching ones at EOS.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from fst_testlib import (  # noqa: F401  (fixtures)
    FST_SETTINGS,
    TOKENIZERS,
    decode_text,
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

from vllm_fst_backend.compiler import CompileOptions, compile_regex
from vllm_fst_backend.runtime import FstMatcher


def _allowed_from_bitmask(bm: torch.Tensor, V: int) -> np.ndarray:
    row = bm.numpy().astype("<i4").view(np.uint8)
    return np.flatnonzero(np.unpackbits(row, bitorder="little")[:V])


@pytest.fixture(scope="module")
def days(fst_artifacts):
    return {
        name: compile_regex(r"(Monday|Tuesday|Wednesday|Thursday)", fst_artifacts(name), CompileOptions())
        for name in TOKENIZERS
    }


@pytest.mark.parametrize("name", TOKENIZERS)
def test_accept_validate_rollback(fst_artifacts, fst_infos, days, name):
    info = fst_infos(name)
    c = days[name]
    eos = int(c.eos_ids[0])
    ids = oracle_ids(info, "Tuesday")
    m = FstMatcher(c, eos_ids=c.eos_ids)
    assert m.num_processed_tokens == 0 and not m.is_terminated()
    # validate does not move
    assert m.validate_tokens(ids + [eos]) == ids + [eos]
    assert m.validate_tokens(ids[:1] + [12345678 % c.vocab_size] + ids[1:]) == ids[:1] or len(ids) == 1
    assert m.state == 0 and m.num_processed_tokens == 0
    # an invalid token: False, state unchanged (atomic)
    assert m.accept_tokens("r", ids[:1])
    s1 = m.state
    bad = [t for t in range(c.vocab_size) if t not in set(m.allowed_token_ids().tolist())][:1]
    assert not m.accept_tokens("r", ids[1:2] + bad)
    assert m.state == s1 and m.num_processed_tokens == 1
    # EOS before acceptance is invalid
    if len(ids) > 1:
        assert not m.accept_tokens("r", [eos])
    assert m.accept_tokens("r", ids[1:] + [eos])
    assert m.is_terminated() and m.num_processed_tokens == len(ids) + 1
    assert m.accept_tokens("r", [5, 6])  # ignored after termination
    assert m.validate_tokens([5]) == []
    # rollback restores termination and state
    m.rollback(1)
    assert not m.is_terminated() and m.num_processed_tokens == len(ids)
    assert m.validate_tokens([eos]) == [eos]
    m.rollback(len(ids))
    assert m.state == 0 and m.num_processed_tokens == 0
    with pytest.raises(ValueError):
        m.rollback(1)
    m.accept_tokens("r", ids)
    m.reset()
    assert m.state == 0 and m.num_processed_tokens == 0 and not m.is_terminated()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_forced_tokens(fst_infos, days, name):
    """Multiple choice: after the first token of a choice the rest is forced (000 §3.3.1)."""
    info = fst_infos(name)
    c = days[name]
    eos = int(c.eos_ids[0])
    for word in ("Monday", "Tuesday", "Wednesday", "Thursday"):
        ids = oracle_ids(info, word)
        m = FstMatcher(c)
        # find the shortest prefix after which everything is forced
        for k in range(len(ids) + 1):
            chain = m.forced_tokens(100)
            if chain == ids[k:] + [eos]:
                break
            assert m.accept_tokens("r", [ids[k]])
        else:
            pytest.fail(f"{word}: no forced chain")
        st = m.state
        assert m.forced_tokens(2) == (ids[k:] + [eos])[:2]
        assert m.state == st  # unchanged
        assert m.accept_tokens("r", chain) and m.is_terminated()
        assert m.forced_tokens(5) == []


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("regex", [r"(Monday|Tuesday)", r"[^\n]{1,40}", r"\d{1,3}(\.\d{1,3}){3}"])
def test_fill_bitmask(fst_artifacts, name, regex):
    arts = fst_artifacts(name)
    c = compile_regex(regex, arts, CompileOptions())
    V, W = c.vocab_size, c.num_words
    m = FstMatcher(c)
    rnd = random.Random(0)
    for wide in (W, W + 3):
        bm = torch.full((4, wide), -1, dtype=torch.int32)
        m.reset()
        for _ in range(6):
            m.fill_bitmask(bm, 2)
            allowed = m.allowed_token_ids()
            assert np.array_equal(_allowed_from_bitmask(bm[2, :W], V), allowed)
            assert (bm[2, W:] == 0).all()
            assert (bm[1] == -1).all() and (bm[3] == -1).all()  # other rows untouched
            non_eos = [t for t in allowed.tolist() if t not in m.eos_ids]
            if not non_eos:
                break
            assert m.accept_tokens("r", [rnd.choice(non_eos)])


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("canonical", [True, False], ids=["canonical", "any"])
@FST_SETTINGS
@given(regex=regex_strategy(), seed=st.integers(0, 2**16), junk=st.text(min_size=1, max_size=4))
def test_matcher_on_random_strings(fst_artifacts, fst_infos, name, canonical, regex, seed, junk):
    """Matching strings: their canonical ids are accepted and EOS terminates; a non-matching string's
    ids are never accepted through EOS."""
    arts, info = fst_artifacts(name), fst_infos(name)
    c = compile_regex(regex, arts, CompileOptions(canonical=canonical))
    eos = int(c.eos_ids[0])
    for text in matching_texts(regex, 3, seed):
        ids = oracle_ids(info, text)
        m = FstMatcher(c)
        assert m.validate_tokens(ids + [eos]) == ids + [eos], (regex, text)
        assert m.accept_tokens("r", ids) and m.accept_tokens("r", [eos]) and m.is_terminated()
    for text in [junk] + [t + junk for t in matching_texts(regex, 2, seed + 1)]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            continue
        if fullmatch(regex, text):
            continue
        ids = oracle_ids(info, text)
        try:
            same = decode_text(info, ids) == text
        except (UnicodeDecodeError, AssertionError):
            same = False
        if not same:  # the tokenizer drops/normalizes something: these are not this text's ids
            continue
        m = FstMatcher(c)
        assert len(m.validate_tokens(ids + [eos])) <= len(ids), (regex, text)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_walk_decodes_and_rolls_back(fst_artifacts, fst_infos, name):
    """Random walks with interleaved rollbacks reach the same states as straight walks."""
    arts, info = fst_artifacts(name), fst_infos(name)
    c = compile_regex(r"[a-z ]{1,30}\.", arts, CompileOptions())
    rnd = random.Random(3)
    for _ in range(10):
        ids, done = random_walk(c, rnd, max_steps=60)
        m = FstMatcher(c)
        states = [m.state]
        for t in ids:
            assert m.accept_tokens("r", [t])
            states.append(m.state)
        for k in range(len(ids), 0, -1):
            m.rollback(1)
            assert m.state == states[k - 1]
        if done:
            assert fullmatch(r"[a-z ]{1,30}\.", decode_text(info, ids))


# --- factored canonical automata: the compiled step (kernels.canon_row / canon_step) == numpy reference -----

FACTORED_REGEXES = [r"[^\n]{1,60}", r'"[^"\\]{0,40}"', r"[^a\n]{1,3}中文 .{0,10}", r"[一-龥ぁ-ん가-힣 ]{1,10}"]


def _walk_states(c, rnd, n_walks=6, max_steps=40):
    """States of random walks over the allowed tokens (byte-fallback tokens preferred when allowed, so
    that SentencePiece walks enter characters spelled in bytes)."""
    fc = c.factored
    eos = set(c.eos_ids.tolist())
    out = []
    for _ in range(n_walks):
        st = 0
        for _ in range(max_steps):
            out.append(st)
            ids = [t for t in c.allowed_tokens(st).tolist() if t not in eos]
            if not ids:
                break
            bf = [t for t in ids if fc.H.tok_bf_byte[t] >= 0]
            st = c.next_state(st, rnd.choice(bf) if bf and rnd.random() < 0.5 else rnd.choice(ids))
    return out


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("regex", FACTORED_REGEXES)
def test_factored_kernel_equals_reference(fst_artifacts, name, regex):
    """Factored canonical automata: the kernel rows equal the numpy rows (``_compute_row_numpy``), the
    scalar successor equals the numpy one (``_next_state_reference``), and ``advance`` (one kernel call:
    successor + its row) equals ``next_state`` + ``row``, for allowed, disallowed, EOS and out-of-range
    tokens, along random walks (context-dependent tokens; SentencePiece byte-fallback characters)."""
    c = compile_regex(regex, fst_artifacts(name), CompileOptions())
    assert c.mode == "factored"
    fc = c.factored
    rnd = random.Random(5)
    V = c.vocab_size
    for x in _walk_states(c, rnd):
        u = fc.unpack(x)
        assert np.array_equal(fc.compute_row(*u), fc._compute_row_numpy(*u)), (regex, u)
        row = fc.row(x)
        ids = c.allowed_tokens(x).tolist()
        probes = rnd.sample(ids, min(6, len(ids))) + [rnd.randrange(V), int(c.eos_ids[0]), -1, V]
        for t in probes:
            ref = fc._next_state_reference(x, t)
            assert fc.next_state(x, t) == ref, (regex, u, t)
            nxt, nrow = fc.advance(x, row, t)
            if ref < 0 or t in set(c.eos_ids.tolist()):
                assert nxt == -1 and nrow is None, (regex, u, t)
            else:
                assert nxt == ref, (regex, u, t)
                assert np.array_equal(nrow, fc._compute_row_numpy(*fc.unpack(ref))), (regex, u, t)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_accept_tokens_fast_path_equals_generic(fst_artifacts, name):
    """FstMatcher on a factored automaton (advance per token) accepts exactly what the generic path
    (``compiled.next_state`` / ``is_accepting``, as for explicit automata) accepts, with the same states,
    rows, atomicity on an invalid token, EOS handling and rollback."""
    c = compile_regex(r"[^\n]{1,40}\.?", fst_artifacts(name), CompileOptions())
    assert c.mode == "factored"
    rnd = random.Random(11)
    eos = int(c.eos_ids[0])

    def generic(state, toks):
        """(accepted?, states after each token, terminated) with the generic semantics."""
        states, term = [], False
        for t in toks:
            if t in set(c.eos_ids.tolist()):
                if not c.is_accepting(state):
                    return False, [], False
                states.append(state)
                term = True
                break
            state = c.next_state(state, t)
            if state < 0:
                return False, [], False
            states.append(state)
        return True, states, term

    for _ in range(8):
        m = FstMatcher(c)
        for _ in range(12):
            if m.is_terminated():
                break
            ids = [t for t in m.allowed_token_ids().tolist() if t != eos]
            chunk = [rnd.choice(ids)] if ids else []
            if rnd.random() < 0.4 and chunk:  # a multi-token call, maybe with an invalid token inside
                nxt = c.next_state(m.state, chunk[0])
                more = [t for t in c.allowed_tokens(nxt).tolist() if t != eos]
                if more:
                    chunk.append(rnd.choice(more) if rnd.random() < 0.7 else rnd.randrange(c.vocab_size))
            elif rnd.random() < 0.2:  # one token of any id: the one-step path, valid or not
                chunk = [rnd.randrange(c.vocab_size)]
            if rnd.random() < 0.2:
                chunk.append(eos)
            before = (m.state, m.num_processed_tokens)
            ok, states, term = generic(m.state, chunk)
            assert m.accept_tokens("r", chunk) == ok, chunk
            if not ok:
                assert (m.state, m.num_processed_tokens) == before
                continue
            if states:
                assert m.state == states[-1]
            assert m.is_terminated() == term
            assert np.array_equal(m._row, c.allowed_row(m.state))
            if states and rnd.random() < 0.3:
                m.rollback(1)
                assert m.state == (states[-2] if len(states) > 1 else before[0])
                assert np.array_equal(m._row, c.allowed_row(m.state))


@pytest.mark.parametrize("name", TOKENIZERS)
def test_forced_tokens_factored_equals_generic(fst_artifacts, name):
    """``forced_tokens`` on a factored automaton (forced token read from the row, next row from the
    compiled step) returns the chain of the generic path (``compiled.forced`` / ``next_state``), without
    changing the state: a JSON template whose keys and punctuation are forced, at every state of random
    walks, for chain lengths 1, 3 and 50."""
    regex = r'\{"name": "[a-z]{1,12}", "kind": "(alpha|beta)", "count": [0-9]{1,3}\}'
    c = compile_regex(regex, fst_artifacts(name), CompileOptions())
    assert c.mode == "factored"
    eos = set(c.eos_ids.tolist())

    def generic(state, max_n):
        out = []
        while len(out) < max_n:
            t = c.forced(state)
            if t < 0:
                break
            out.append(t)
            if t in eos:
                break
            state = c.next_state(state, t)
        return out

    rnd = random.Random(3)
    long_chains = 0
    for _ in range(6):
        m = FstMatcher(c)
        while not m.is_terminated():
            st = m.state
            for n in (1, 3, 50):
                assert m.forced_tokens(n) == generic(st, n), (st, n)
            assert m.state == st
            chain = m.forced_tokens(50)
            long_chains += len(chain) >= 3
            ids = m.allowed_token_ids().tolist()
            assert m.accept_tokens("r", [rnd.choice(ids)])
    assert long_chains > 0  # the template has multi-token forced stretches
