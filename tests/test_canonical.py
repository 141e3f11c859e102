"""The canonical-BPE filter against the tokenizer itself (the oracle), on the three real tokenizers.

Issue 2's proof:
* >= 100,000 random token pairs per tokenizer: the filter's verdict == ``encode(decode(u)+decode(v)) == [u, v]``;
* pairs whose join splits a UTF-8 character: checked on real texts that contain them, and every pair whose
  join completes the character (plus sampled triples) against the tokenizer;
* >= 1 MB of real multilingual text shipped in an installed package (pycountry's translations of ISO
  names into ~600 locales) plus real source code: every line's canonical tokenization is accepted;
* >= 10,000 random walks through the filter: decoded text re-encodes to the same ids (target 100 %).
"""

from __future__ import annotations

import gettext
import glob
import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest

TOKENIZERS = ["smollm2", "mistral_v1", "tekken"]
N_PAIRS = 100_000
N_WALKS = 10_000


def _site_packages() -> Path:
    spec = importlib.util.find_spec("pycountry")
    if spec is None:
        pytest.skip("pycountry (installed with vLLM) is missing")
    return Path(list(spec.submodule_search_locations)[0]).parent


@pytest.fixture(scope="session")
def real_lines() -> list[str]:
    """Real multilingual lines (pycountry's .mo translations) and real code lines (rich's sources)."""
    return load_real_lines()


def load_real_lines() -> list[str]:
    """See :func:`real_lines`."""
    sp = _site_packages()
    lines: list[str] = []
    for f in sorted(glob.glob(str(sp / "pycountry/locales/*/LC_MESSAGES/*.mo"))):
        with open(f, "rb") as fh:
            cat = gettext.GNUTranslations(fh)._catalog
        lines += [v for k, v in cat.items() if isinstance(k, str) and k and isinstance(v, str) and v and v != k]
    random.Random(0).shuffle(lines)
    code: list[str] = []
    for f in sorted(glob.glob(str(sp / "rich/*.py")))[:40]:
        code += Path(f).read_text(encoding="utf-8").split("\n")
    out, size = [], 0
    for line in lines:
        out.append(line)
        size += len(line.encode())
        if size > 1_100_000:
            break
    return out + [c for c in code if c]


@pytest.fixture(scope="session")
def code_blocks() -> list[str]:
    """Multi-line blocks of real code (newline runs, indentation, tabs)."""
    return load_code_blocks()


def load_code_blocks() -> list[str]:
    """See :func:`code_blocks`."""
    sp = _site_packages()
    blocks = []
    for f in sorted(glob.glob(str(sp / "rich/*.py")))[:20]:
        lines = Path(f).read_text(encoding="utf-8").split("\n")
        blocks += ["\n".join(lines[i : i + 15]) for i in range(0, len(lines), 15)]
    return blocks


@pytest.fixture(scope="session", params=TOKENIZERS)
def canon(request, built_artifacts, tokenizer_paths):
    """(TokenizerInfo, CanonicalFilter) of one real tokenizer, built once per test run."""
    from vllm_fst_backend.artifacts.store import load_artifacts
    from vllm_fst_backend.artifacts.tokenizer_info import load_tokenizer

    name = request.param
    arts = load_artifacts(built_artifacts(name, canonical=True))
    return load_tokenizer(tokenizer_paths[name]), arts.canonical


def _prefix(info) -> str:
    return " " if info.prepend_space else ""


def test_random_pairs_match_oracle(canon):
    info, cf = canon
    ids = [i for i in info.normal_ids]
    rng = random.Random(1)
    n = n_canonical = 0
    disagreements = []
    while n < N_PAIRS:
        u, v = rng.choice(ids), rng.choice(ids)
        try:
            text = (info.token_bytes[u] + info.token_bytes[v]).decode("utf-8")
        except UnicodeDecodeError:
            continue  # invalid joins: see test_split_character_pairs_in_real_text
        if info.prepend_space and not text.startswith(" "):
            continue  # SentencePiece text always starts with the dummy-prefix space
        n += 1
        oracle = info.encode(text) == [u, v]
        n_canonical += oracle
        if cf.accepts([u, v]) != oracle:
            disagreements.append((info.token_bytes[u], info.token_bytes[v], oracle))
    assert not disagreements, disagreements[:10]
    assert 0 < n_canonical < n  # both verdicts occur


def test_adjacent_pairs_of_real_text_match_oracle(canon, real_lines):
    """Hard pairs: tokens that really occur next to each other, re-paired with their neighbours' neighbours."""
    info, cf = canon
    seen = 0
    disagreements = []
    for line in real_lines[::7]:
        ids = info.encode(_prefix(info) + line)
        for a, b in zip(ids, ids[2:] + ids[1:2]):
            if info.token_bytes[a] is None or info.token_bytes[b] is None:
                continue
            for u, v in ((a, b), (b, a)):
                try:
                    text = (info.token_bytes[u] + info.token_bytes[v]).decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if info.prepend_space and not text.startswith(" "):
                    continue
                seen += 1
                if cf.accepts([u, v]) != (info.encode(text) == [u, v]):
                    disagreements.append((info.token_bytes[u], info.token_bytes[v]))
        if seen > 60_000:
            break
    assert seen > 10_000
    assert not disagreements, disagreements[:10]


def _first_rejection(cf, ids) -> int | None:
    """Index of the first token the filter refuses (len(ids) if END is refused), or None if accepted."""
    k, S = cf.start_class, cf.all_set
    for i, v in enumerate(ids):
        if not cf.is_allowed(k, S, v):
            return i
        k, S = cf.step(k, v)
    return None if S & cf.end_bit else len(ids)


def test_real_text_is_accepted(canon, real_lines, code_blocks):
    """Every line's canonical tokenization is accepted: multilingual lines, code lines and multi-line
    code blocks (emoji escapes, box drawing, newline runs, indentation), including Tekken's U+FE0F spelled
    ``EF`` ``B8`` ``8F`` one byte per token (a lead state: canonical.py, "Split characters")."""
    info, cf = canon
    size = 0
    rejected = []
    for line in real_lines + code_blocks:
        size += len(line.encode())
        ids = info.encode(_prefix(info) + line)
        i = _first_rejection(cf, ids)
        if i is not None:
            rejected.append((line, [info.token_bytes[t] for t in ids[max(0, i - 2) : i + 1]]))
    assert size >= 1_000_000
    assert not rejected, (len(rejected), rejected[:10])


def test_split_character_pairs_in_real_text(canon, real_lines):
    """Definition for joins that split a UTF-8 character (module docstring of canonical.py): the
    junction is never a chunk boundary, so only the merge rule applies. Checked on real texts whose
    canonical tokenization contains such pairs: every one of those sequences is accepted."""
    info, cf = canon
    n_split = 0
    for line in real_lines:
        ids = info.encode(_prefix(info) + line)
        for u in ids[:-1]:
            b = info.token_bytes[u]
            if b is not None:
                try:
                    b.decode("utf-8")
                except UnicodeDecodeError:
                    n_split += 1
                    break
        else:
            continue
        assert _first_rejection(cf, ids) is None, line
    if info.kind == "sentencepiece_bpe":
        assert n_split > 0  # byte-fallback characters occur in the corpus
    else:
        assert n_split > 100


def _split_joins(info) -> list[tuple[int, int]]:
    """Every pair (u, v) of tokens where u ends inside a character, v starts with continuation bytes and
    the joined bytes are valid UTF-8 (byte-level tokenizers; none for SentencePiece)."""
    from vllm_fst_backend.artifacts.canonical import incomplete_tail

    tails, heads = [], []
    for t in info.normal_ids:
        b = info.token_bytes[t]
        if b and incomplete_tail(b) < len(b):
            tails.append(t)
        if b and b[0] & 0xC0 == 0x80:
            heads.append(t)
    out = []
    for u in tails:
        for v in heads:
            try:
                (info.token_bytes[u] + info.token_bytes[v]).decode("utf-8")
            except UnicodeDecodeError:
                continue
            out.append((u, v))
    return out


def test_pairs_splitting_a_character_match_oracle(canon):
    """All pairs whose junction falls inside a character the two tokens complete (``D9`` + ``A8`` ...:
    U+0668, a digit, after the letter-like stand-in of ``D9``), exhaustively: the filter's verdict equals
    the tokenizer's. Random pairs almost never meet these (tens of thousands among |V|^2)."""
    info, cf = canon
    pairs = _split_joins(info)
    if info.kind == "sentencepiece_bpe":
        assert not pairs  # pieces are whole characters; byte-fallback tokens are outside the alphabet
        return
    assert len(pairs) > 10_000
    disagreements = []
    for u, v in pairs:
        text = (info.token_bytes[u] + info.token_bytes[v]).decode("utf-8")
        oracle = info.encode(text) == [u, v]
        if cf.accepts([u, v]) != oracle:
            disagreements.append((info.token_bytes[u], info.token_bytes[v], oracle))
    assert not disagreements, (len(disagreements), disagreements[:10])


def test_triples_through_a_split_character_match_oracle(canon):
    """Triples u v w where v completes the character u leaves open (the lead state after a lone lead
    byte, a whitespace character completed by continuation bytes before a lookahead, ...) and w is
    another token: the filter's verdict equals the tokenizer's. All pairs with a lone lead byte, a
    sample of the others; w from a fixed sample of tokens and the tokens of ``\\``, ``.``, `` ``,
    ``a``, ``A``, ``1``, newline."""
    info, cf = canon
    rng = random.Random(5)
    pairs = _split_joins(info)
    if info.kind == "sentencepiece_bpe":
        assert not pairs  # see test_pairs_splitting_a_character_match_oracle
        return
    lone = [p for p in pairs if info.token_bytes[p[0]][-1] >= 0xC0]
    rest = [p for p in pairs if info.token_bytes[p[0]][-1] < 0xC0]
    chosen = lone + rng.sample(rest, min(len(rest), 6000))
    ws = rng.sample(info.normal_ids, 12) + [ids[-1] for ids in map(info.encode, ["\\", ".", " ", "a", "A", "1", "\n"]) if ids]
    n = 0
    disagreements = []
    for u, v in chosen:
        for w in ws:
            try:
                text = (info.token_bytes[u] + info.token_bytes[v] + info.token_bytes[w]).decode("utf-8")
            except (TypeError, UnicodeDecodeError):
                continue
            n += 1
            oracle = info.encode(text) == [u, v, w]
            if cf.accepts([u, v, w]) != oracle:
                disagreements.append((info.token_bytes[u], info.token_bytes[v], info.token_bytes[w], oracle))
    assert n > 50_000
    assert not disagreements, (len(disagreements), disagreements[:10])


def _allowed_ids(cf, k, S, V, normal: np.ndarray) -> np.ndarray:
    row = cf.allowed_row(k, S)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:V].astype(bool)
    return np.flatnonzero(bits & normal)


def test_random_walks_roundtrip(canon):
    """Random walks choosing only allowed next tokens re-encode to themselves.

    SentencePiece byte-fallback tokens are left out of the walks: which byte sequences may use them
    (whole characters outside the vocabulary) is decided by the detokenizer's "canonical" byte policy,
    not by the pair filter (tests/test_artifacts_store.py and the compiler tests cover it)."""
    info, cf = canon
    V = info.vocab_size
    normal = np.zeros(V, dtype=bool)
    normal[info.normal_ids] = True
    normal &= np.asarray(cf.token_class) >= 0
    rng = np.random.default_rng(3)
    walks = roundtrip = 0
    failures = []
    while walks < N_WALKS:
        length = int(rng.integers(2, 41))
        k, S = cf.start_class, cf.all_set
        ids: list[int] = []
        for _ in range(length + 8):
            allowed = _allowed_ids(cf, k, S, V, normal)
            assert allowed.size, "dead end in the canonical filter"
            v = int(rng.choice(allowed))
            ids.append(v)
            k, S = cf.step(k, v)
            if len(ids) >= length and S & cf.end_bit:
                try:
                    info.decode_bytes(ids).decode("utf-8")
                    break
                except UnicodeDecodeError:
                    pass
        else:
            continue
        text = info.decode_bytes(ids).decode("utf-8")
        if info.prepend_space and not text.startswith(" "):
            continue
        walks += 1
        enc = info.encode(text)
        if enc == ids:
            roundtrip += 1
        else:
            failures.append(([info.token_bytes[i] for i in ids], [info.token_bytes[i] for i in enc]))
    assert not failures, (roundtrip / walks, len(failures), failures[:5])
    assert roundtrip == walks


@pytest.mark.parametrize("V", [32000, 49152, 131072])
def test_stored_form_round_trips(V):
    """The on-disk CSR form (uint16 segments per 65,536 ids) expands back to the same vLLM bit rows."""
    from vllm_fst_backend.artifacts.canonical import csr_to_rows, rows_to_csr

    rng = np.random.default_rng(V)
    dense = rng.random((7, V)) < 0.03
    dense[3] = False  # an empty row
    dense[5, -1] = dense[5, 0] = True  # both ends of the vocabulary
    rows = [np.packbits(r, bitorder="little") for r in dense]
    ptr, ids = rows_to_csr(rows, V)
    assert ids.dtype == np.uint16 and ids.size == dense.sum()
    back = csr_to_rows(ptr, ids, V)
    want = np.zeros((7, (V + 31) // 32 * 4), dtype=np.uint8)
    want[:, : rows[0].size] = np.stack(rows)
    np.testing.assert_array_equal(back, want.view("<i4"))
