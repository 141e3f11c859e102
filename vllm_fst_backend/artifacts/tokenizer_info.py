"""Read a tokenizer into one uniform description: surface bytes, merges, pre-tokenizer, oracle.

Three kinds are supported (paper 004 §3.3 and §6.3; paper 000 §3.1 for the preprocessing):

* ``byte_level_bpe`` -- a Hugging Face ``tokenizer.json`` with a BPE model and the GPT-2 byte-level
  character map (SmolLM2). Merges are the explicit merge list; the pre-tokenizer is the
  ``ByteLevel``/``Split`` regex, run through the ``tokenizers`` library itself.
* ``sentencepiece_bpe`` -- a SentencePiece ``ModelProto`` of type BPE with byte fallback (Mistral v1,
  Llama-2). Any adjacent pair whose concatenation is a normal piece may merge; higher score first.
  Spaces are written ``▁`` and a ``▁`` is prepended to the text (the dummy prefix). Words are split
  before each ``▁`` that starts a whitespace run (``SplitIntoWords`` of sentencepiece).
* ``tekken`` -- mistral_common's tiktoken-style JSON: byte-level BPE where any adjacent pair whose
  concatenation is a token may merge, lower rank first; the pre-tokenizer is the JSON's regex.

WordPiece, Unigram and anything else raise :class:`UnsupportedTokenizerError` naming the supported kinds.

All merge tables use the same form: ``merges[(left_id, right_id)] = (rank, merged_id)``, lower rank merges
first, ties broken leftmost (true of all three implementations).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

from ..errors import UnsupportedTokenizerError

SUPPORTED_KINDS = ("byte_level_bpe", "sentencepiece_bpe", "tekken")
_SUPPORTED_TEXT = (
    "supported tokenizers: byte-level BPE (Hugging Face tokenizer.json with a ByteLevel pre-tokenizer, "
    "e.g. SmolLM2, GPT-2, Llama-3), SentencePiece BPE (.model, e.g. Llama-2, Mistral v1), "
    "tiktoken-style Tekken JSON (mistral_common)"
)
SP_SPACE = "\u2581"  # ▁


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable-character map (byte-level BPE; 256 entries)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@dataclass
class TokenizerInfo:
    """Uniform description of a BPE tokenizer.

    Attributes:
        kind: one of :data:`SUPPORTED_KINDS`.
        path: the tokenizer file that was read (``tokenizer.json``, ``.model`` or Tekken ``.json``).
        vocab_size: V, number of token ids (ids are ``0..V-1``, including special tokens).
        token_bytes: list of V entries: the token's surface bytes exactly as the decoder spells them
            (byte-level map undone, ``▁`` → space, ``<0xNN>`` → that byte), or ``None`` for special and
            control tokens, which are outside the constraint alphabet.
        eos_ids: end-of-sequence token ids (allowed exactly in accepting states).
        special_ids: ids of added/special/control tokens (``token_bytes`` is ``None`` for them).
        byte_fallback: byte value → token id for SentencePiece ``<0xNN>`` tokens (empty otherwise).
        prepend_space: True for SentencePiece (the dummy prefix ``▁`` before the text).
        fingerprint: sha256 over the tokenizer file's bytes (hex).
        merges: ``(left_id, right_id) -> (rank, merged_id)``.
        base_symbols: the unit BPE starts from for this kind: ``"byte"`` or ``"char"`` (SentencePiece).
        symbol_id: base unit (a byte value as int for byte-level kinds, a one-character str for
            SentencePiece, in normalized form with ``▁``) → token id.
    """

    kind: str
    path: Path
    vocab_size: int
    token_bytes: list[bytes | None]
    eos_ids: tuple[int, ...]
    special_ids: frozenset[int]
    merges: dict[tuple[int, int], tuple[int, int]]
    symbol_id: dict
    base_symbols: str
    fingerprint: str
    prepend_space: bool = False
    byte_fallback: dict[int, int] = field(default_factory=dict)
    _encode: Callable[[str], list[int]] | None = None
    _chunk: Callable[[str], list[tuple[int, int]]] | None = None

    # --- the oracle -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """The tokenizer's own encoding of ``text`` (no BOS/EOS). For SentencePiece, ``text`` is the
        surface text *including* the leading space that stands for the dummy prefix, so
        ``encode(decode(ids)) == ids`` for canonical ids; the dummy prefix is not added again."""
        return self._encode(text)

    def decode_bytes(self, ids) -> bytes:
        """Concatenated surface bytes of ``ids`` (special tokens contribute nothing)."""
        tb = self.token_bytes
        return b"".join(tb[i] or b"" for i in ids)

    def chunk_spans(self, text: str) -> list[tuple[int, int]]:
        """Pre-tokenizer chunks of the surface ``text`` as ``(start, end)`` character offsets.
        BPE merges never cross a chunk boundary."""
        return self._chunk(text)

    @cached_property
    def normal_ids(self) -> list[int]:
        """Ids of tokens inside the constraint alphabet (not special, not byte-fallback)."""
        bf = set(self.byte_fallback.values())
        return [i for i, b in enumerate(self.token_bytes) if b is not None and i not in bf]

    def symbols_of(self, token_id: int) -> list[int]:
        """Token ids of the base symbols (bytes, or SentencePiece characters) spelling ``token_id``.
        Raises KeyError if a base symbol is not in the vocabulary."""
        b = self.token_bytes[token_id]
        if self.base_symbols == "byte":
            return [self.symbol_id[x] for x in b]
        return [self.symbol_id[c] for c in b.decode("utf-8").replace(" ", SP_SPACE)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    h.update(path.read_bytes())
    return h.hexdigest()


def resolve_tokenizer_file(path: str | Path) -> Path:
    """Find the tokenizer file for ``path`` (a file, or a model directory holding ``tokenizer.json``,
    ``tekken.json`` or ``tokenizer.model``). Raises FileNotFoundError."""
    p = Path(path)
    if p.is_dir():
        for name in ("tokenizer.json", "tekken.json", "tokenizer.model"):
            if (p / name).is_file():
                return p / name
        raise FileNotFoundError(f"no tokenizer.json, tekken.json or tokenizer.model in {p}")
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {p}")
    return p


def load_tokenizer(path: str | Path) -> TokenizerInfo:
    """Read the tokenizer at ``path`` (file or model directory).

    Raises:
        FileNotFoundError: nothing readable at ``path``.
        UnsupportedTokenizerError: a WordPiece/Unigram/other tokenizer, or an unknown file format.
    """
    p = resolve_tokenizer_file(path)
    raw = p.read_bytes()
    if p.suffix == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UnsupportedTokenizerError(f"{p} is not valid JSON ({e}); {_SUPPORTED_TEXT}") from None
        if isinstance(data, dict) and "model" in data:
            return _load_hf(p, data)
        if isinstance(data, dict) and "vocab" in data and "config" in data:
            return _load_tekken(p, data)
        raise UnsupportedTokenizerError(f"{p}: unknown JSON tokenizer format; {_SUPPORTED_TEXT}")
    return _load_sentencepiece(p, raw)


# --- Hugging Face byte-level BPE ------------------------------------------------------------------


def _load_hf(p: Path, data: dict) -> TokenizerInfo:
    from tokenizers import Tokenizer

    model = data["model"]
    mtype = model.get("type")
    if mtype != "BPE":
        raise UnsupportedTokenizerError(f"{p}: tokenizer model type {mtype!r} is not BPE; {_SUPPORTED_TEXT}")
    pre = json.dumps(data.get("pre_tokenizer"))
    if "ByteLevel" not in pre and "ByteLevel" not in json.dumps(data.get("decoder")):
        raise UnsupportedTokenizerError(
            f"{p}: a BPE tokenizer.json without the byte-level map is not supported; {_SUPPORTED_TEXT}"
        )
    if data.get("normalizer") not in (None, {"type": "NFC"}):
        raise UnsupportedTokenizerError(f"{p}: tokenizer normalizer {data['normalizer']!r} is not supported")
    tok = Tokenizer.from_str(p.read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(model["vocab"])
    added = {a["content"]: a["id"] for a in data.get("added_tokens", [])}
    V = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1, max(added.values(), default=-1) + 1)
    b2u = gpt2_bytes_to_unicode()
    u2b = {c: b for b, c in b2u.items()}
    token_bytes: list[bytes | None] = [None] * V
    for s, i in vocab.items():
        if s in added:
            continue
        try:
            token_bytes[i] = bytes(u2b[c] for c in s)
        except KeyError:
            raise UnsupportedTokenizerError(f"{p}: token {s!r} is not in the byte-level alphabet") from None
    special = frozenset(added.values())
    for i in special:
        token_bytes[i] = None
    merges: dict[tuple[int, int], tuple[int, int]] = {}
    for rank, m in enumerate(model.get("merges", [])):
        a, b = (m.split(" ", 1) if isinstance(m, str) else m)
        key = (vocab[a], vocab[b])
        if key not in merges:
            merges[key] = (rank, vocab[a + b])
    eos = _hf_eos_ids(p, added)
    symbol_id = {b: vocab[b2u[b]] for b in range(256) if b2u[b] in vocab}

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    pretok = tok.pre_tokenizer

    def chunk(text: str) -> list[tuple[int, int]]:
        if pretok is None:
            return [(0, len(text))] if text else []
        return [span for _, span in pretok.pre_tokenize_str(text)]

    return TokenizerInfo(
        kind="byte_level_bpe", path=p, vocab_size=V, token_bytes=token_bytes, eos_ids=eos,
        special_ids=special, merges=merges, symbol_id=symbol_id, base_symbols="byte",
        fingerprint=_sha256(p), _encode=encode, _chunk=chunk,
    )


def _hf_eos_ids(p: Path, added: dict[str, int]) -> tuple[int, ...]:
    """EOS ids from ``tokenizer_config.json`` / ``generation_config.json`` beside ``tokenizer.json``;
    falls back to the usual names among the added tokens."""
    ids: set[int] = set()
    cfg = p.parent / "tokenizer_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text()).get("eos_token")
        t = t.get("content") if isinstance(t, dict) else t
        if t in added:
            ids.add(added[t])
    gen = p.parent / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([e] if isinstance(e, int) else (e or []))
    if not ids:
        for name in ("<|endoftext|>", "<|im_end|>", "</s>", "<|eot_id|>", "<|end_of_text|>"):
            if name in added:
                ids.add(added[name])
    return tuple(sorted(ids))


# --- SentencePiece BPE ----------------------------------------------------------------------------


def _load_sentencepiece(p: Path, raw: bytes) -> TokenizerInfo:
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    try:
        m.ParseFromString(raw)
    except Exception:
        raise UnsupportedTokenizerError(f"{p}: not a SentencePiece model; {_SUPPORTED_TEXT}") from None
    if not m.pieces:
        raise UnsupportedTokenizerError(f"{p}: not a SentencePiece model; {_SUPPORTED_TEXT}")
    if m.trainer_spec.model_type != pb.TrainerSpec.BPE:
        name = pb.TrainerSpec.ModelType.Name(m.trainer_spec.model_type)
        raise UnsupportedTokenizerError(f"{p}: SentencePiece model type {name} is not BPE; {_SUPPORTED_TEXT}")
    ns = m.normalizer_spec
    if ns.precompiled_charsmap or ns.remove_extra_whitespaces or m.trainer_spec.treat_whitespace_as_suffix:
        raise UnsupportedTokenizerError(
            f"{p}: SentencePiece normalization (charsmap / remove_extra_whitespaces / whitespace suffix) "
            "is not supported"
        )
    prepend = bool(ns.add_dummy_prefix)
    allow_ws_only = bool(m.trainer_spec.allow_whitespace_only_pieces)
    NORMAL, USER, BYTE = 1, 4, 6  # ModelProto.SentencePiece.Type; the rest are special/control
    V = len(m.pieces)
    token_bytes: list[bytes | None] = [None] * V
    piece_id: dict[str, int] = {}
    byte_fallback: dict[int, int] = {}
    special = set()
    for i, pc in enumerate(m.pieces):
        if pc.type in (NORMAL, USER):
            token_bytes[i] = pc.piece.replace(SP_SPACE, " ").encode("utf-8")
            piece_id[pc.piece] = i
        elif pc.type == BYTE:
            b = int(pc.piece[3:5], 16)
            token_bytes[i] = bytes([b])
            byte_fallback[b] = i
        else:
            special.add(i)
    # Rank: higher score merges first; ties by id (see module docstring for why this is exact here).
    order = sorted((i for i, pc in enumerate(m.pieces) if pc.type == NORMAL), key=lambda i: (-m.pieces[i].score, i))
    rank_of = {i: r for r, i in enumerate(order)}
    merges: dict[tuple[int, int], tuple[int, int]] = {}
    for i in order:
        s = m.pieces[i].piece
        for k in range(1, len(s)):
            a, b = piece_id.get(s[:k]), piece_id.get(s[k:])
            if a is not None and b is not None:
                merges[(a, b)] = (rank_of[i], i)
    symbol_id = {s: i for s, i in piece_id.items() if len(s) == 1}
    eos = tuple(i for i, pc in enumerate(m.pieces) if pc.piece == "</s>") or (m.trainer_spec.eos_id,)

    m2 = pb.ModelProto()
    m2.CopyFrom(m)
    m2.normalizer_spec.add_dummy_prefix = False
    sp = spm.SentencePieceProcessor(model_proto=m2.SerializeToString())

    def encode(text: str) -> list[int]:
        return list(sp.encode(text))

    def chunk(text: str) -> list[tuple[int, int]]:
        """sentencepiece's SplitIntoWords (treat_whitespace_as_suffix=false) on the normalized text."""
        spans: list[tuple[int, int]] = []
        in_ws = False
        start = 0
        for k, c in enumerate(text):
            is_ws = c == " " or c == SP_SPACE
            if k == 0 or (is_ws and (not in_ws or not allow_ws_only)):
                if k > 0:
                    spans.append((start, k))
                start = k
                in_ws = True
            if in_ws and not is_ws:
                in_ws = False
        if text:
            spans.append((start, len(text)))
        return spans

    return TokenizerInfo(
        kind="sentencepiece_bpe", path=p, vocab_size=V, token_bytes=token_bytes, eos_ids=eos,
        special_ids=frozenset(special), merges=merges, symbol_id=symbol_id, base_symbols="char",
        fingerprint=_sha256(p), prepend_space=prepend, byte_fallback=byte_fallback,
        _encode=encode, _chunk=chunk,
    )


# --- Tekken (tiktoken-style) ----------------------------------------------------------------------


def _load_tekken(p: Path, data: dict) -> TokenizerInfo:
    import regex

    cfg = data["config"]
    n_special = int(cfg.get("default_num_special_tokens", 1000))
    V = int(cfg.get("default_vocab_size", len(data["vocab"]) + n_special))
    n_ranks = V - n_special
    ranks = data["vocab"][:n_ranks]
    token_bytes: list[bytes | None] = [None] * V
    id_of: dict[bytes, int] = {}
    for r, entry in enumerate(ranks):
        b = base64.b64decode(entry["token_bytes"])
        token_bytes[r + n_special] = b
        id_of[b] = r + n_special
    merges: dict[tuple[int, int], tuple[int, int]] = {}
    for b, i in id_of.items():
        r = i - n_special
        for k in range(1, len(b)):
            a, c = id_of.get(b[:k]), id_of.get(b[k:])
            if a is not None and c is not None:
                merges[(a, c)] = (r, i)
    symbol_id = {x: id_of[bytes([x])] for x in range(256) if bytes([x]) in id_of}
    specials = data.get("special_tokens") or []
    eos = tuple(s["rank"] for s in specials if s.get("token_str") == "</s>") or (2,)
    pattern = regex.compile(cfg["pattern"])

    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    tk = Tekkenizer.from_file(str(p))

    def encode(text: str) -> list[int]:
        return list(tk.encode(text, bos=False, eos=False))

    def chunk(text: str) -> list[tuple[int, int]]:
        return [m.span() for m in pattern.finditer(text)]

    return TokenizerInfo(
        kind="tekken", path=p, vocab_size=V, token_bytes=token_bytes, eos_ids=eos,
        special_ids=frozenset(range(n_special)), merges=merges, symbol_id=symbol_id, base_symbols="byte",
        fingerprint=_sha256(p), _encode=encode, _chunk=chunk,
    )
