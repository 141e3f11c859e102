"""Tests of the artifact stage's storage side: bit rows, the detokenizing FST, the on-disk store and the CLI.

Fast: artifacts are built once per session without the canonical filter (``built_artifacts`` in
conftest); the canonical arrays' round trip uses a small hand-made CanonicalFilter.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pynini
import pytest

from vllm_fst_backend.artifacts import bitrows
from vllm_fst_backend.artifacts.build import build_artifacts, check_output_dir, default_name, default_options, main
from vllm_fst_backend.artifacts.detokenizer import BYTE_POLICIES, build_detokenizer
from vllm_fst_backend.artifacts.store import (
    MANIFEST,
    is_up_to_date,
    load_artifacts,
    save_artifacts,
)
from vllm_fst_backend.errors import ArtifactError, InvalidOptionError, OutputDirError, UnsupportedTokenizerError

# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def byte_acceptor(data: bytes) -> pynini.Fst:
    """Linear acceptor of ``data`` with byte labels b+1."""
    f = pynini.Fst()
    one = pynini.Weight.one("tropical")
    s = f.add_state()
    f.set_start(s)
    for b in data:
        t = f.add_state()
        f.add_arc(s, pynini.Arc(b + 1, b + 1, one, t))
        s = t
    f.set_final(s)
    return f


def token_lattice(detok: pynini.Fst, data: bytes) -> set[tuple[int, ...]]:
    """All token sequences (ids) whose surface bytes T_V maps from ``data``: paths of
    project(acceptor(data) @ detok, output) after ε-removal (an acyclic FST)."""
    lat = pynini.compose(byte_acceptor(data), detok)
    lat.project("output").rmepsilon().connect()
    zero = pynini.Weight.zero("tropical")
    out: set[tuple[int, ...]] = set()
    if lat.start() < 0:
        return out
    stack = [(lat.start(), ())]
    while stack:
        s, seq = stack.pop()
        if lat.final(s) != zero:
            out.add(seq)
        for a in lat.arcs(s):
            stack.append((a.nextstate, seq + (a.ilabel - 1,)))
        assert len(out) < 200_000
    return out


@pytest.fixture(scope="module")
def detoks(smollm2_info, mistral_v1_info):
    return {
        ("smollm2", "canonical"): build_detokenizer(smollm2_info, "canonical"),
        **{("mistral_v1", p): build_detokenizer(mistral_v1_info, p) for p in BYTE_POLICIES},
    }


# --------------------------------------------------------------------------------------------------
# bit rows
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("V", [1, 31, 32, 33, 64, 100, 49152])
def test_bitrows_round_trip(V):
    rng = np.random.default_rng(V)
    mask = rng.random(V) < 0.3
    mask[V - 1] = True
    row = bitrows.row_from_bool(mask)
    assert row.dtype == np.int32 and row.shape == (bitrows.n_words(V),)
    ids = np.flatnonzero(mask)
    np.testing.assert_array_equal(bitrows.row_from_ids(ids, V), row)
    np.testing.assert_array_equal(bitrows.ids_from_row(row, V), ids)
    for i in [0, V - 1, V // 2]:
        assert bitrows.row_test(row, i) == bool(mask[i])
    # the vLLM layout: token i is bit i % 32 of word i // 32
    i = int(ids[-1])
    assert (int(row[i // 32]) >> (i % 32)) & 1 == 1
    mat = np.stack([mask, ~mask, np.zeros(V, bool)])
    rows = bitrows.rows_from_bool(mat)
    assert rows.shape == (3, bitrows.n_words(V)) and rows.dtype == np.int32
    np.testing.assert_array_equal(rows[0], row)
    assert not rows[2].any()


def test_bitrows_sign_bit_and_range():
    row = bitrows.row_from_ids([31], 32)
    assert row.tolist() == [-(2**31)]
    assert bitrows.row_test(row, 31)
    with pytest.raises(IndexError):
        bitrows.row_from_ids([32], 32)


# --------------------------------------------------------------------------------------------------
# detokenizer
# --------------------------------------------------------------------------------------------------

TEXTS = ["Hello world", " x = 1;\n", "naïve café", "日本", "\t{\"a\": 2}", " 🦜!"]


@pytest.mark.parametrize("name", ["smollm2", "mistral_v1"])
@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_lattice_contains_own_encoding(detoks, smollm2_info, mistral_v1_info, name, text):
    info = {"smollm2": smollm2_info, "mistral_v1": mistral_v1_info}[name]
    data = text.encode("utf-8")
    lattice = token_lattice(detoks[(name, "canonical")], data)
    assert tuple(info.encode(text)) in lattice
    for seq in lattice:  # only segmentations of exactly these bytes, no special tokens
        assert info.decode_bytes(seq) == data
        assert all(info.token_bytes[t] is not None for t in seq)


def test_detokenizer_shape(detoks):
    f = detoks[("smollm2", "canonical")]
    assert f.start() == 0 and f.final(0) == pynini.Weight.one("tropical")
    assert f.properties(pynini.I_LABEL_SORTED, True) == pynini.I_LABEL_SORTED
    assert f.num_input_epsilons(0) == 0
    # final state = start state only
    zero = pynini.Weight.zero("tropical")
    assert [s for s in f.states() if f.final(s) != zero] == [0]


def test_detokenizer_lattice_is_exact_on_small_vocab(smollm2_info):
    """All segmentations, no more: compare with a brute-force segmentation over the vocabulary."""
    info = smollm2_info
    data = b"the cat"
    by_bytes = {}
    for i, b in enumerate(info.token_bytes):
        if b:
            by_bytes.setdefault(b, []).append(i)

    def segs(k):
        if k == len(data):
            return [()]
        out = []
        for j in range(k + 1, len(data) + 1):
            for t in by_bytes.get(data[k:j], []):
                out += [(t,) + rest for rest in segs(j)]
        return out

    assert token_lattice(build_detokenizer(info, "all"), data) == set(segs(0))


def test_sentencepiece_byte_policies(detoks, mistral_v1_info):
    bf = mistral_v1_info.byte_fallback
    byte_ids = set(bf.values())
    a_piece = next(i for i, b in enumerate(mistral_v1_info.token_bytes) if b == b"a" and i not in byte_ids)
    for policy in ("canonical", "no_ascii_with_piece"):
        f = detoks[("mistral_v1", policy)]
        assert (bf[0x0A],) in token_lattice(f, b"\n")  # "\n" has no piece: <0x0A>
        lat_a = token_lattice(f, b"a")
        assert (bf[0x61],) not in lat_a and (a_piece,) in lat_a  # "a" is a piece: never <0x61>
    assert (bf[0x61],) in token_lattice(detoks[("mistral_v1", "all")], b"a")

    # a character outside the vocabulary: its UTF-8 bytes as byte tokens, under every policy
    parrot = "🦜".encode()
    seq = tuple(bf[b] for b in parrot)
    assert tuple(mistral_v1_info.encode("🦜")) == seq
    for policy in BYTE_POLICIES:
        assert seq in token_lattice(detoks[("mistral_v1", policy)], parrot)
    # a character that is a single piece: byte tokens only without the canonical policy
    e_acute = "é".encode()
    assert any(b == e_acute for i, b in enumerate(mistral_v1_info.token_bytes) if i not in byte_ids)
    seq = tuple(bf[b] for b in e_acute)
    assert seq not in token_lattice(detoks[("mistral_v1", "canonical")], e_acute)
    assert seq in token_lattice(detoks[("mistral_v1", "no_ascii_with_piece")], e_acute)
    # a lone continuation byte is never a whole character
    assert token_lattice(detoks[("mistral_v1", "canonical")], b"\x80") == set()


# --------------------------------------------------------------------------------------------------
# store
# --------------------------------------------------------------------------------------------------


def _copy(src, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name", ["smollm2", "mistral_v1"])
def test_store_round_trip(built_artifacts, tokenizer_paths, smollm2_info, mistral_v1_info, name):
    info = {"smollm2": smollm2_info, "mistral_v1": mistral_v1_info}[name]
    d = built_artifacts(name)
    arts = load_artifacts(d, tokenizer_path=tokenizer_paths[name])
    assert arts.kind == info.kind and arts.vocab_size == info.vocab_size
    assert arts.fingerprint == info.fingerprint and arts.prepend_space == info.prepend_space
    assert arts.token_bytes == info.token_bytes
    assert arts.eos_ids.dtype == np.int32 and tuple(arts.eos_ids.tolist()) == tuple(info.eos_ids)
    bf = np.full(256, -1, np.int32)
    for b, t in info.byte_fallback.items():
        bf[b] = t
    np.testing.assert_array_equal(arts.byte_fallback, bf)
    alpha = np.array([b is not None for b in info.token_bytes])
    np.testing.assert_array_equal(arts.alphabet_row, bitrows.row_from_bool(alpha))
    for p in BYTE_POLICIES:
        assert arts.detokenizer(p).write_to_string() == build_detokenizer(info, p).write_to_string()
    assert arts.detokenizer("all") is arts.detokenizer("all")  # cached
    files = set(arts.manifest["files"])
    if info.byte_fallback:
        assert len({arts.manifest["detokenizers"][p] for p in BYTE_POLICIES}) == 3
    else:
        assert {arts.manifest["detokenizers"][p] for p in BYTE_POLICIES} == {"detokenizer.fst"}
        assert not any(f.startswith("detokenizer_") for f in files)
    from vllm_fst_backend.artifacts import unicode_filters as uf

    assert uf.accepts(arts.utf8_fst(), "ü".encode()) and not uf.accepts(arts.utf8_fst(), b"\xff")
    for s in uf.SCRIPT_NAMES:
        assert arts.script_fst(s).num_states() > 0
    with pytest.raises(InvalidOptionError):
        arts.script_fst("klingon")
    with pytest.raises(InvalidOptionError):
        arts.detokenizer("some")
    with pytest.raises(ArtifactError, match="canonical"):
        arts.canonical  # built with canonical=False
    assert arts.nbytes_on_disk == sum(p.stat().st_size for p in d.iterdir())


def test_store_canonical_arrays_round_trip(tmp_path, mistral_v1_info):
    from vllm_fst_backend.artifacts.canonical import CanonicalFilter

    V = mistral_v1_info.vocab_size
    W = bitrows.n_words(V)
    rng = np.random.default_rng(0)
    arrays = {
        "token_class": rng.integers(-1, 5, V).astype(np.int32),
        "banned_ptr": np.array([0, 3, 3, 7, 9, 12], dtype=np.int64),
        "banned_ids": rng.integers(0, V, 12).astype(np.uint16),
        "start_row": rng.integers(-(2**31), 2**31 - 1, W).astype(np.int32),
        "la_first": rng.integers(-1, 3, V).astype(np.int16),
        "la_rows": rng.integers(-(2**31), 2**31 - 1, (3, W)).astype(np.int32),
        "la_token_index": rng.integers(-1, 4, V).astype(np.int32),
        "la_set_values": np.array([0, 5, 15], dtype=np.uint64),
        "la_set_index": rng.integers(0, 3, (6, 4)).astype(np.uint8),
        "class_group": rng.integers(0, 2, 6).astype(np.int16),
        "ctx_token_index": np.full(V, -1, dtype=np.int32),
        "ctx_classes": np.zeros((0, 2), dtype=np.int32),
    }
    cf = CanonicalFilter.from_arrays(arrays, V, stats={"banned_pairs": 123})
    tiny = pynini.accep("a")
    save_artifacts(tmp_path, mistral_v1_info, detokenizers={p: tiny for p in BYTE_POLICIES}, canonical=cf,
                   options={"x": 1})
    arts = load_artifacts(tmp_path)
    c = arts.canonical
    for k, a in arrays.items():
        got = getattr(c, k)
        assert isinstance(got, np.memmap) and got.dtype == a.dtype
        np.testing.assert_array_equal(got, a)
    assert c.vocab_size == V and c.stats["banned_pairs"] == 123
    # the dense rows expand the CSR sets: bit v of row k set <=> v in banned_ids[ptr[k]:ptr[k+1]]
    rows = c.banned_rows
    assert rows.shape == (5, W) and rows.dtype == np.int32
    for k in range(5):
        ids = set(arrays["banned_ids"][arrays["banned_ptr"][k] : arrays["banned_ptr"][k + 1]].tolist())
        assert set(bitrows.ids_from_row(rows[k], V).tolist()) == ids
    assert arts.manifest["detokenizers"] == {p: "detokenizer.fst" for p in BYTE_POLICIES}


@pytest.mark.parametrize("victim", ["token_offsets.npy", "detokenizer_canonical.fst", "script_latin.fst"])
def test_store_flipped_byte_is_detected(built_artifacts, tokenizer_paths, tmp_path, victim):
    d = _copy(built_artifacts("mistral_v1"), tmp_path)
    path = d / victim
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError) as ei:
        load_artifacts(d, tokenizer_path=tokenizer_paths["mistral_v1"])
    msg = str(ei.value)
    assert victim in msg
    assert f"python scripts/build_tokenizer_artifacts.py --tokenizer {tokenizer_paths['mistral_v1']} --out {d}" in msg


def test_store_missing_and_bad_manifest(built_artifacts, tmp_path):
    d = _copy(built_artifacts("mistral_v1"), tmp_path)
    (d / "eos_ids.npy").unlink()
    with pytest.raises(ArtifactError, match="eos_ids.npy.*missing"):
        load_artifacts(d)
    # without verify, the missing file is reported on first use
    arts = load_artifacts(d, verify=False)
    with pytest.raises(ArtifactError, match="eos_ids.npy"):
        arts.eos_ids
    man = json.loads((d / MANIFEST).read_text())
    man["format_version"] = 999
    (d / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(ArtifactError, match="format version.*scripts/build_tokenizer_artifacts.py --tokenizer"):
        load_artifacts(d)
    (d / MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match="manifest.json"):
        load_artifacts(d)
    (d / MANIFEST).unlink()
    with pytest.raises(ArtifactError, match=r"manifest.json: file is missing.*--tokenizer <PATH>"):
        load_artifacts(d)
    with pytest.raises(ArtifactError, match="does not exist"):
        load_artifacts(tmp_path / "nowhere")


def test_store_other_tokenizer_fingerprint(built_artifacts, tokenizer_paths):
    d = built_artifacts("smollm2")
    with pytest.raises(ArtifactError, match="another tokenizer") as ei:
        load_artifacts(d, tokenizer_path=tokenizer_paths["mistral_v1"])
    assert f"--tokenizer {tokenizer_paths['mistral_v1']} --out {d}" in str(ei.value)
    assert not is_up_to_date(d, tokenizer_paths["mistral_v1"], default_options(canonical=False))
    assert is_up_to_date(d, tokenizer_paths["smollm2"], default_options(canonical=False))
    assert not is_up_to_date(d, tokenizer_paths["smollm2"], default_options(canonical=True))


# --------------------------------------------------------------------------------------------------
# build / CLI
# --------------------------------------------------------------------------------------------------


def test_unwritable_out_dir_fails_before_work(tmp_path, mistral_v1_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = blocker / "sub" / "dir"

    def boom(*a, **k):  # the tokenizer must not even be read
        raise AssertionError("work started before the output directory was checked")

    monkeypatch.setattr("vllm_fst_backend.artifacts.tokenizer_info.load_tokenizer", boom)
    with pytest.raises(OutputDirError, match="a_file"):
        build_artifacts(mistral_v1_path, out, progress=False)
    with pytest.raises(OutputDirError):
        check_output_dir(blocker)  # an existing regular file is not a directory
    rc = main(["--tokenizer", str(mistral_v1_path), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and "Traceback" not in err and str(out) in err


def test_cli_second_run_is_up_to_date(built_artifacts, tokenizer_paths, capsys):
    d = built_artifacts("mistral_v1")  # the first run
    mtime = (d / MANIFEST).stat().st_mtime_ns
    rc = main(["--tokenizer", str(tokenizer_paths["mistral_v1"]), "--out", str(d), "--no-canonical", "--quiet"])
    assert rc == 0
    assert "up to date" in capsys.readouterr().out
    assert (d / MANIFEST).stat().st_mtime_ns == mtime


def test_cli_force_rebuild_and_summary(tmp_path, mistral_v1_path, built_artifacts, capsys):
    d = _copy(built_artifacts("mistral_v1"), tmp_path)
    (d / "stale_from_old_build.fst").write_bytes(b"junk")  # not in the manifest: left alone
    rc = main(["--tokenizer", str(mistral_v1_path), "--out", str(d), "--no-canonical", "--quiet", "--force"])
    out = capsys.readouterr().out
    assert rc == 0 and "tokens: 32000" in out and "detokenizer_canonical.fst" in out and "peak RSS" in out
    load_artifacts(d, tokenizer_path=mistral_v1_path)
    assert not list(d.glob(".*tmp*")) and not list(d.glob(".write-probe*"))


def _tiny_hf_tokenizer(path, kind: str):
    from tokenizers import Tokenizer
    from tokenizers.models import Unigram, WordPiece

    if kind == "wordpiece":
        tok = Tokenizer(WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    else:
        tok = Tokenizer(Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -2.0)], unk_id=0))
    tok.save(str(path))
    return path


@pytest.mark.parametrize("kind", ["wordpiece", "unigram"])
def test_unsupported_tokenizer_clean_error(tmp_path, kind, capsys):
    path = _tiny_hf_tokenizer(tmp_path / f"{kind}.json", kind)
    with pytest.raises(UnsupportedTokenizerError):
        build_artifacts(path, tmp_path / "out_api", progress=False)
    rc = main(["--tokenizer", str(path), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "not BPE" in err and "supported" in err and "Traceback" not in err
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_cli_missing_tokenizer(tmp_path, capsys):
    rc = main(["--tokenizer", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 2 and "not found" in capsys.readouterr().err


def test_default_name(smollm2_dir, mistral_v1_path, tekken_path):
    assert default_name(smollm2_dir) == "SmolLM2-135M-Instruct"
    assert default_name(smollm2_dir / "tokenizer.json") == "SmolLM2-135M-Instruct"
    assert default_name(mistral_v1_path) == "tokenizer_model_v1"
    assert default_name(tekken_path) == "tekken_240911"
