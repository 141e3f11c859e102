"""Helpers shared by test_compiler.py and test_matcher.py: artifacts fixtures, a random-regex
generator, random walks and checks on compiled automata.

Hypothesis: few examples by default (``FST_SETTINGS``, applied per test); ``HYPOTHESIS_PROFILE=thorough``
runs 300 per test.
"""

from __future__ import annotations

import os
import random
import re
import unicodedata

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Applied per test (not as a global profile, so other test modules keep their own settings).
if os.environ.get("HYPOTHESIS_PROFILE") == "thorough":
    FST_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
else:
    FST_SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

TOKENIZERS = ["smollm2", "mistral_v1"]


# --- fixtures (session-scoped, built once per test run through conftest.built_artifacts) -----------------


@pytest.fixture(scope="session")
def fst_artifacts(built_artifacts):
    """``fst_artifacts(name) -> TokenizerArtifacts`` with the canonical filter, loaded once per name."""
    from vllm_fst_backend.artifacts.store import load_artifacts

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_artifacts(built_artifacts(name, canonical=True))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def fst_infos(request):
    """``fst_infos(name) -> TokenizerInfo`` (the oracle)."""
    fixture = {"smollm2": "smollm2_info", "mistral_v1": "mistral_v1_info", "tekken": "tekken_info"}

    def get(name: str):
        return request.getfixturevalue(fixture[name])

    return get


# --- random regexes ------------------------------------------------------------------------------------

LITERALS = list("abcxZ01 ,.-é中ж€😀")
CLASSES = [r"[a-c]", r"[0-9]", r"[^a\n]", r"[a-zé]", r"\d", r"[xyz中]", r"[ ,.]", r"[^0-9a-z ]", r"."]


def _rep(t):
    body, a, b = t
    lo, hi = min(a, b), max(a, b)
    return f"(?:{body}){{{lo},{hi}}}"


def regex_strategy(max_leaves: int = 7):
    """Random regexes: literals (incl. non-ASCII), classes (incl. negated = 'anything else'),
    alternation, bounded repetition, optional."""
    atom = st.one_of(st.sampled_from(LITERALS).map(re.escape), st.sampled_from(CLASSES))

    def extend(children):
        return st.one_of(
            st.lists(children, min_size=2, max_size=3).map("".join),
            st.lists(children, min_size=2, max_size=3).map(lambda xs: "(?:" + "|".join(xs) + ")"),
            st.tuples(children, st.integers(0, 3), st.integers(0, 3)).map(_rep),
            children.map(lambda x: f"(?:{x})?"),
        )

    return st.recursive(atom, extend, max_leaves=max_leaves)


def fullmatch(regex: str, text: str) -> bool:
    """Python's verdict with the backend's conventions (``\\d \\w \\s`` are ASCII)."""
    return re.fullmatch(regex, text, flags=re.ASCII) is not None


def matching_texts(regex: str, n: int, seed: int) -> list[str]:
    """Up to ``n`` distinct strings matching ``regex`` (sampled by a tiny generator over the regex's
    own structure via hypothesis' ``from_regex`` examples would be slow; we use rejection-free sampling
    with ``exrex``-like expansion through Python's sre parser)."""
    import re._parser as sre_parse  # Python 3.11

    rnd = random.Random(seed)
    parsed = sre_parse.parse(regex, flags=re.ASCII)

    def any_char(excluded) -> str:
        while True:
            c = rnd.choice(
                [chr(rnd.randint(0x20, 0x7E)), chr(rnd.randint(0xA0, 0x2FF)), chr(rnd.randint(0x4E00, 0x4FFF)),
                 chr(rnd.randint(0x1F600, 0x1F64F)), chr(rnd.randint(0x400, 0x4FF))]
            )
            if not excluded(c):
                return c

    def gen(items) -> str:
        out = []
        for op, av in items:
            name = str(op)
            if name == "LITERAL":
                out.append(chr(av))
            elif name == "NOT_LITERAL":
                out.append(any_char(lambda c: ord(c) == av))
            elif name == "ANY":
                out.append(any_char(lambda c: c == "\n"))
            elif name == "IN":
                out.append(_in(av))
            elif name == "BRANCH":
                out.append(gen(rnd.choice(av[1])))
            elif name == "SUBPATTERN":
                out.append(gen(av[-1]))
            elif name in ("MAX_REPEAT", "MIN_REPEAT"):
                lo, hi, body = av
                hi = min(hi, lo + 3)
                out.append("".join(gen(body) for _ in range(rnd.randint(lo, hi))))
            else:
                raise ValueError(name)
        return "".join(out)

    def _in(av) -> str:
        negate = any(str(o) == "NEGATE" for o, _ in av)

        def member(c: str) -> bool:
            cp = ord(c)
            for o, a in av:
                o = str(o)
                if o == "LITERAL" and cp == a:
                    return True
                if o == "RANGE" and a[0] <= cp <= a[1]:
                    return True
                if o == "CATEGORY":
                    cat = str(a)
                    if cat == "CATEGORY_DIGIT" and c in "0123456789":
                        return True
                    if cat == "CATEGORY_SPACE" and c in " \t\n\r\f\v":
                        return True
                    if cat == "CATEGORY_WORD" and (c.isascii() and (c.isalnum() or c == "_")):
                        return True
            return False

        if negate:
            return any_char(member)
        pool = []
        for o, a in av:
            o = str(o)
            if o == "LITERAL":
                pool.append(chr(a))
            elif o == "RANGE":
                pool.append(chr(rnd.randint(a[0], a[1])))
            elif o == "CATEGORY":
                pool.append(rnd.choice({"CATEGORY_DIGIT": "0123456789", "CATEGORY_SPACE": " \t\n",
                                        "CATEGORY_WORD": "azAZ09_"}[str(a)]))
        return rnd.choice(pool)

    out: list[str] = []
    for _ in range(n * 4):
        t = gen(parsed)
        if fullmatch(regex, t) and unicodedata.normalize("NFC", t) == t and t not in out:
            out.append(t)
            if len(out) >= n:
                break
    return out


# --- walks and checks ----------------------------------------------------------------------------------


def random_walk(compiled, rnd: random.Random, max_steps: int = 80, p_eos: float = 0.3):
    """Random walk choosing allowed tokens (EOS with probability ``p_eos`` when allowed). Returns
    (token ids without EOS, terminated). Asserts every visited state has an allowed token."""
    from vllm_fst_backend.runtime import FstMatcher

    m = FstMatcher(compiled)
    eos = np.asarray(sorted(set(m.eos_ids)), dtype=np.int64)
    out: list[int] = []
    for _ in range(max_steps):
        allowed = m.allowed_token_ids()
        assert len(allowed) > 0, f"dead end after {out}"
        is_eos = np.isin(allowed, eos)
        non_eos = allowed[~is_eos]
        if is_eos.any() and (not len(non_eos) or rnd.random() < p_eos):
            t = int(allowed[is_eos][0])
            assert m.accept_tokens("walk", [t])
            assert m.is_terminated()
            return out, True
        t = int(non_eos[rnd.randrange(len(non_eos))])
        assert m.accept_tokens("walk", [t])
        out.append(t)
    return out, False


def decode_text(info, ids) -> str:
    """Surface text of ``ids`` without the SentencePiece dummy-prefix space."""
    text = info.decode_bytes(ids).decode("utf-8")
    if info.prepend_space:
        assert text.startswith(" "), repr(text)
        text = text[1:]
    return text


def oracle_ids(info, text: str) -> list[int]:
    """The tokenizer's canonical ids of user text ``text`` (SentencePiece: with the dummy prefix)."""
    return info.encode(" " + text if info.prepend_space else text)


def check_no_dead_ends_explicit(c) -> None:
    """On the arrays of an explicit automaton: every state has an allowed token, and an accepting state
    is reachable from every state."""
    S = c.num_states
    rows = c.allowed_rows
    assert rows.shape == (S, c.num_words)
    assert (rows != 0).any(axis=1).all(), "a state with no allowed token"
    eos_w = {int(e) >> 5: 0 for e in c.eos_ids}
    for e in c.eos_ids:
        eos_w[int(e) >> 5] |= 1 << (int(e) & 31)
    for s in range(S):  # EOS bits exactly in accepting states
        has = all((int(np.uint32(rows[s, w].view(np.uint32))) & m) == m for w, m in eos_w.items())
        assert has == bool(c.accepting[s])
    # reverse reachability from accepting states over the CSR
    src = np.repeat(np.arange(S), np.diff(c.trans_ptr))
    good = c.accepting.copy()
    changed = True
    while changed:
        new = good.copy()
        new[src[good[c.trans_next]]] = True
        changed = bool((new != good).any())
        good = new
    assert good.all(), f"states without a path to acceptance: {np.flatnonzero(~good)[:10]}"
    # forced tokens agree with the rows
    counts = np.array([len(c.allowed_tokens(s)) for s in range(S)])
    for s in range(S):
        if counts[s] == 1:
            assert c.forced_token[s] == c.allowed_tokens(s)[0]
        else:
            assert c.forced_token[s] == -1


def explore(c, max_states: int = 3000, max_tokens: int = 20000):
    """BFS over reachable states through the public API (works for factored automata). Returns
    (states, edges dict state -> list of successors, complete); gives up (complete=False) after
    ``max_states`` states or ``max_tokens`` transitions."""
    from collections import deque

    seen = {0}
    q = deque([0])
    edges: dict = {}
    n_tok = 0
    while q:
        s = q.popleft()
        toks = c.allowed_tokens(s)
        assert len(toks) > 0, f"state {s} has no allowed token"
        n_tok += len(toks)
        if n_tok > max_tokens:
            return seen, edges, False
        succ = []
        for t in toks.tolist():
            if c.is_eos(t):
                assert c.is_accepting(s)
                continue
            n = c.next_state(s, t)
            assert n >= 0
            succ.append(n)
            if n not in seen:
                if len(seen) >= max_states:
                    return seen, edges, False
                seen.add(n)
                q.append(n)
        edges[s] = succ
    return seen, edges, True


def check_coaccessible(c, seen, edges) -> None:
    """On a completely explored automaton: an accepting state is reachable from every state."""
    good = {s for s in seen if c.is_accepting(s)}
    changed = True
    while changed:
        changed = False
        for s, succ in edges.items():
            if s not in good and any(n in good for n in succ):
                good.add(s)
                changed = True
    assert good == set(seen), f"{len(set(seen) - good)} states cannot reach acceptance"


# --- vLLM's apply_grammar_bitmask inputs (tests/test_logits_mask.py, tests/test_vllm033_source.py) -------------


def grammar_bitmask_step(rng: np.random.Generator, V: int, batch: list, drafts: dict, stride: int | None = None):
    """``(scheduler_output, grammar_output, input_batch, logits bfloat16[n, V])`` of one step as vLLM's
    ``apply_grammar_bitmask`` reads them: ``batch`` the runner's request ids in batch order, ``drafts``
    the draft-token count per request (one logits row per request plus one per draft); every other
    request has a grammar, listed in reversed order (vLLM's bitmask order need not be the batch's), its
    bitmask rows random words of the three kinds (all allowed, none, mixed); ``stride`` the bitmask rows
    per request (vLLM 0.33's ``mask_stride``) or None for 0.32's packed rows (``1 +`` drafts each)."""
    import types

    import torch

    W = (V + 31) // 32
    structured = list(reversed(batch[::2]))
    n_mask = len(structured) * stride if stride else sum(1 + drafts.get(r, 0) for r in structured)
    bm = rng.integers(-2**31, 2**31, size=(n_mask, W), dtype=np.int64).astype(np.int32)
    kind = rng.integers(0, 3, size=(n_mask, W))
    bm[kind == 0] = 0
    bm[kind == 1] = -1
    sched = types.SimpleNamespace(scheduled_spec_decode_tokens={r: [7] * k for r, k in drafts.items() if k})
    grammar = types.SimpleNamespace(structured_output_request_ids=structured, grammar_bitmask=bm)
    n_logits = sum(1 + drafts.get(r, 0) for r in batch)
    logits = torch.from_numpy(rng.standard_normal((n_logits, V), dtype=np.float32)).to(torch.bfloat16)
    return sched, grammar, types.SimpleNamespace(req_ids=list(batch)), logits
