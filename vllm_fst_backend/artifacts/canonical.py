"""The canonical-BPE filter: the implicit form of A_BPE (paper 004 §6.5), exact for pre-tokenized BPE.

Theory
------
For plain BPE, a token sequence is canonical iff every adjacent pair is (Berglund & van der Merwe 2023,
Cor. 2, restated as 004 Statement 1.1). So A_BPE needs, per token ``u``, only the set
``BANNED(u) = {v : BPE(bytes(u) + bytes(v)) != [u, v]}``; tokens with equal rows are one state
(a *class*) of the minimal A_BPE.

We compute BANNED from the merge table, never by tokenizing |V|^2 pairs. Let the merge tree of a token be
the tree BPE builds on its own symbols. Its *right spine* is the chain root → right child → ...; each node
``x`` on it has a formation rank ``f(x)`` (the merge that built it; -1 for a base symbol) and a death rank
``d_u(x)`` (the merge that absorbs it into its parent; +inf for the root). Symmetrically the *left spine*
of ``v``. While no merge crosses the u|v boundary, the two halves evolve exactly as alone, and the right
end of u's half is always a right-spine node (the left end of v's half a left-spine node). Hence a
boundary-crossing merge happens iff some merge ``(x, y) -> rank m`` has x alive in u and y alive in v:

    f(x) < m < d_u(x)     and     f(y) < m <= d_v(y)

(ties: equal ranks mean the same merged token; the leftmost occurrence merges first, so a tie with u's
absorbing merge is lost by the boundary and a tie with v's absorbing merge is won). This is the "merge
that would fire before either side is absorbed" rule; the oracle test checks it against the tokenizer.

Pre-tokenization (paper 000 §3.1)
---------------------------------
BPE runs inside the pre-tokenizer's chunks, so for the pair text ``u+v`` we first ask where the chunk
boundaries fall: a boundary strictly inside u or v → banned; a boundary exactly at the junction → allowed
(no merge can cross it); no boundary → the merge rule above. Chunk boundaries depend only on the classes
of characters the pre-tokenizer's regex distinguishes (Unicode category, whitespace, the letters of the
contractions, ...), so we map every token to a *representative string* (one representative character
per class, runs capped at 3) and run the tokenizer's own pre-tokenizer on representative pairs only.

Lookahead (the whitespace rule)
-------------------------------
The regex alternative ``\\s+(?!\\S)`` makes the chunking of a whitespace run depend on the character
*after* it: ``"\\n\\n"`` is one chunk at the end of a text but ``"\\n" "\\n"`` before a letter. So when v
ends with whitespace, the verdict for (u, v) depends on the first character of the next token. We keep it
exact with a refinement of the A_BPE state: state = (class of last token, S) where S is the set of
*lookahead classes* (classes of the next token's first character, plus END) under which (u, v) is
canonical. ``la_sets[k, j]`` stores S for class k followed by whitespace-final token j; for other tokens
S = ALL. EOS is allowed iff END ∈ S.

Invalid UTF-8 joins (byte-level tokens that split a character)
--------------------------------------------------------------
A pre-tokenizer never splits inside a character. So when the u|v junction falls inside a character,
the junction is not a chunk boundary and the verdict is the merge rule alone; a partial character is
represented by a letter of class Lo when computing chunk boundaries elsewhere in u+v. Joined bytes that
are invalid UTF-8 in any other way never reach the output (the UTF-8 filter removes them), and get the
same definition. Known limitation: the representative of a split character is a letter (class Lo), which is what most
split characters are for the byte-level vocabularies (rare CJK). For Tekken, whose regex makes symbols
(emoji, box drawing) *punctuation*, a token ending inside such a character followed by a token that
continues the same punctuation chunk gets the wrong left context, and the filter refuses that
(canonical) sequence: measured on real code with emoji escapes, tests/test_canonical.py. Token sequences
that the filter accepts are still canonical (the random walks).

Known limitation 2: the left context is ONE character (the previous token's last). Tekken's regex can
start a chunk earlier -- the punctuation run "','$" followed by combining marks (Mn counts as a letter
at a chunk start but as punctuation inside a run) -- so the pair after such a token can be judged as
if its chunk started at "$": measured 1 of 10,000 random walks (tests/test_canonical.py). A context of
the chunk's start (more characters) would make it exact.

SentencePiece byte-fallback tokens never merge (they stand for characters outside the
vocabulary), so they are never in conflict; which bytes may use them is decided by the detokenizer's
"canonical" byte policy.
"""

from __future__ import annotations

import hashlib
import time
import unicodedata
from dataclasses import dataclass, field

import numpy as np

from .tokenizer_info import SP_SPACE, TokenizerInfo

INF = np.iinfo(np.int64).max
# Bumped whenever the filter's arrays or their meaning change (the build compares it: see build.py).
CANONICAL_VERSION = 3
BANNED, SPLIT, JOIN = 0, 1, 2
_RUN_CAP = 3
_PARTIAL_REP = "\u4e2d"  # 中, class Lo: stands for a character split across tokens
_SPECIAL_CHARS = set(" \t\n\r\x0b\x0c'/\u2019")  # kept literally: regex alternatives name them
_CONTRACTION_LETTERS = set("stmdlrevSTMDLREV")  # literal only right after an apostrophe ('s, 'll, ...)


@dataclass
class CanonicalFilter:
    """The implicit canonical automaton A_BPE with the lookahead refinement (module docstring).

    Arrays (V = vocabulary size, W = ceil(V/32), C = number of classes, L = lookahead classes,
    J = whitespace-final tokens):

    * ``token_class``: int32[V] -- class (A_BPE state) reached by each token; -1 = never canonical.
    * ``banned_ptr``: int64[C*H + 1] and ``banned_ids``: uint16[N] -- the banned sets in CSR form, as
      stored on disk (memory-mappable, 2 bytes a banned pair instead of V/8 bytes a row). With
      H = ceil(V / 65536), segment ``k*H + h`` holds the ids ``v`` of row k with ``v >> 16 == h`` as
      ``v & 0xFFFF``.
    * ``banned_rows`` (property): int32[C, W] -- the same sets in vLLM's bit layout, expanded once on
      first use; bit v of row k set ⇔ v may not follow class k.
    * ``start_row``: int32[W] -- bit v set ⇔ v may be the first token.
    * ``la_first``: int16[V] -- lookahead class (0..L-1) of each token's first character (-1: none).
    * ``la_rows``: int32[L, W] -- tokens whose first character is in lookahead class c.
    * ``la_token_index``: int32[V] -- j for whitespace-final tokens, else -1.
    * ``la_set_values``: uint64[D] and ``la_set_index``: uint8[C + 1, J] (uint16 if D > 256) -- the few
      distinct lookahead sets and, per (class, whitespace-final token), which one applies; stored so.
    * ``la_sets`` (property): uint64[C + 1, J] -- row k (row C = start state): bit c set ⇔ after class k
      and token j the next token may start with lookahead class c; bit L set ⇔ the text may end (END).

    * ``class_group``: int16[C + 1] -- left-context group of each class (of its tokens' last character;
      entry C = start state, group 0); ``ctx_token_index``: int32[V] (-1 or j) and ``ctx_classes``:
      int32[J2, G] -- the class token j reaches after a class of group g (column 0 = ``token_class``).

    The canonical state is (k, S) with S a uint64 set over lookahead classes + END; the class reached by
    token v from class k is ``ctx_classes[ctx_token_index[v], class_group[k]]`` for context-dependent
    tokens and ``token_class[v]`` otherwise; see :meth:`allowed_row`, :meth:`next_class`, :meth:`step`.
    """

    vocab_size: int
    token_class: np.ndarray
    banned_ptr: np.ndarray
    banned_ids: np.ndarray
    start_row: np.ndarray
    la_first: np.ndarray
    la_rows: np.ndarray
    la_token_index: np.ndarray
    la_set_values: np.ndarray
    la_set_index: np.ndarray
    class_group: np.ndarray
    ctx_token_index: np.ndarray
    ctx_classes: np.ndarray
    stats: dict = field(default_factory=dict)

    ARRAY_NAMES = ("token_class", "banned_ptr", "banned_ids", "start_row", "la_first", "la_rows", "la_token_index", "la_set_values", "la_set_index",
                   "class_group", "ctx_token_index", "ctx_classes")
    _dense: np.ndarray | None = field(default=None, repr=False)

    @property
    def n_classes(self) -> int:
        """C, the number of A_BPE classes (excluding the start state)."""
        return (int(self.banned_ptr.shape[0]) - 1) // _segments(self.vocab_size)

    @property
    def la_sets(self) -> np.ndarray:
        """uint64[C + 1, J]: the lookahead set per (class, whitespace-final token); see the class doc."""
        return np.asarray(self.la_set_values)[np.asarray(self.la_set_index)]

    @property
    def banned_rows(self) -> np.ndarray:
        """int32[C, W]: the banned sets in vLLM's bit layout (expanded from the CSR form on first use,
        ~0.1 s and C*W*4 bytes of memory)."""
        if self._dense is None:
            self._dense = csr_to_rows(self.banned_ptr, self.banned_ids, self.vocab_size)
        return self._dense

    @property
    def n_lookahead(self) -> int:
        """L, the number of lookahead classes (END is bit L)."""
        return int(self.la_rows.shape[0])

    @property
    def start_class(self) -> int:
        """The class index standing for 'no token yet' (== C)."""
        return self.n_classes

    @property
    def all_set(self) -> int:
        """S = every lookahead class and END."""
        return (1 << (self.n_lookahead + 1)) - 1

    @property
    def end_bit(self) -> int:
        """The bit of END in a lookahead set S."""
        return 1 << self.n_lookahead

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays to store on disk (names of :data:`ARRAY_NAMES`)."""
        return {n: getattr(self, n) for n in self.ARRAY_NAMES}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], vocab_size: int, stats: dict | None = None) -> "CanonicalFilter":
        """Rebuild from :meth:`arrays` (e.g. memory-mapped ``.npy`` files)."""
        return cls(vocab_size=vocab_size, stats=dict(stats or {}), **{n: arrays[n] for n in cls.ARRAY_NAMES})

    def summary(self) -> dict:
        """Figures for the build summary: classes, banned pairs, lookahead sizes, bytes."""
        s = dict(self.stats)
        s.update(
            n_classes=self.n_classes,
            banned_pairs_class_level=int(self.banned_ids.size),
            n_lookahead_classes=self.n_lookahead,
            n_lookahead_tokens=int(self.la_set_index.shape[1]),
            nbytes=int(sum(a.nbytes for a in self.arrays().values())),
        )
        return s

    # --- the automaton ----------------------------------------------------------------------------

    def allowed_row(self, k: int, S: int) -> np.ndarray:
        """int32[W]: tokens allowed after class ``k`` (``start_class`` for none) with lookahead set S.
        EOS is not part of the row: it is allowed iff ``S & end_bit``."""
        base = self.start_row if k == self.start_class else ~self.banned_rows[k]
        if S & (self.all_set ^ self.end_bit) != (self.all_set ^ self.end_bit):
            la = np.zeros_like(base)
            for c in range(self.n_lookahead):
                if S >> c & 1:
                    la |= self.la_rows[c]
            base = base & la
        return base

    def is_allowed(self, k: int, S: int, v: int) -> bool:
        """Whether token ``v`` may follow state (k, S)."""
        if self.token_class[v] < 0:
            return False
        row = self.start_row if k == self.start_class else self.banned_rows[k]
        bit = (int(row[v >> 5]) >> (v & 31)) & 1
        if (k == self.start_class) != bool(bit):
            return False
        c = int(self.la_first[v])
        return c >= 0 and bool(S >> c & 1)

    def next_class(self, k, v):
        """Class reached by token(s) ``v`` (int or int array) from class(es) ``k`` (broadcast), using the
        left-context table for context-dependent tokens (Tekken's punctuation runs). Vectorized."""
        k = np.asarray(k)
        v = np.asarray(v)
        out = np.asarray(self.token_class)[v]
        j = np.asarray(self.ctx_token_index)[v]
        if np.any(j >= 0):
            g = np.asarray(self.class_group)[k]
            g = np.broadcast_to(g, np.broadcast(j, g).shape)
            out = np.where(j >= 0, np.asarray(self.ctx_classes)[np.maximum(j, 0), g], out)
        return out

    def step(self, k: int, v: int) -> tuple[int, int]:
        """The state (k', S') after reading token ``v`` from class ``k`` (no check; see is_allowed)."""
        j = int(self.la_token_index[v])
        S = int(self.la_set_values[self.la_set_index[k, j]]) if j >= 0 else self.all_set
        return int(self.next_class(k, v)), S

    def accepts(self, ids) -> bool:
        """Whether the whole sequence ``ids`` is canonical according to the filter (ending at END)."""
        k, S = self.start_class, self.all_set
        for v in ids:
            if not self.is_allowed(k, S, v):
                return False
            k, S = self.step(k, v)
        return bool(S & self.end_bit)


def _segments(V: int) -> int:
    """H = ceil(V / 65536): uint16 segments per row of the stored banned sets."""
    return max(1, (V + 0xFFFF) >> 16)


def rows_to_csr(rows: list[np.ndarray], V: int) -> tuple[np.ndarray, np.ndarray]:
    """Packed bit rows (uint8, little bit order) → (``ptr`` int64[C*H+1], ``ids`` uint16[N]) as described
    in :class:`CanonicalFilter` (segment k*H + h: ids with ``v >> 16 == h``, stored as ``v & 0xFFFF``)."""
    H = _segments(V)
    parts = []
    for r in rows:
        ids = np.flatnonzero(np.unpackbits(r, bitorder="little")[:V])
        cuts = np.searchsorted(ids, np.arange(1, H) << 16)
        parts += [p.astype(np.uint16) for p in np.split(ids & 0xFFFF, cuts)]
    ptr = np.zeros(len(parts) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([p.size for p in parts])
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
    return ptr, ids


def csr_to_rows(ptr: np.ndarray, ids: np.ndarray, V: int, chunk: int = 512) -> np.ndarray:
    """Expand the stored sets (:func:`rows_to_csr`) into int32[C, ceil(V/32)] bit rows in vLLM's layout
    (bit i of word i // 32). Vectorized over chunks of ``chunk`` rows."""
    H = _segments(V)
    C = (int(ptr.shape[0]) - 1) // H
    W = (V + 31) // 32
    out = np.zeros((C, W * 4), dtype=np.uint8)
    for a in range(0, C, chunk):
        b = min(C, a + chunk)
        lo, hi = int(ptr[a * H]), int(ptr[b * H])
        dense = np.zeros((b - a, W * 32), dtype=bool)
        seg = np.repeat(np.arange((b - a) * H), np.diff(np.asarray(ptr[a * H : b * H + 1])))
        full = np.asarray(ids[lo:hi], dtype=np.int64) + ((seg % H) << 16)
        dense[seg // H, full] = True
        out[a:b] = np.packbits(dense, axis=1, bitorder="little")
    return out.view("<i4")


# --------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------


def _bpe_tree(symbols: list[int], merges: dict) -> tuple[list[int], list[tuple]]:
    """Run BPE on ``symbols`` (token ids of base symbols), lowest rank first, ties leftmost.

    Returns (final token ids, nodes) where nodes[i] = (token_id, formation_rank, left, right) and the
    final list refers to node indices' token ids. Quadratic in the length; tokens are short.
    """
    nodes = [(s, -1, -1, -1) for s in symbols]
    seq = list(range(len(symbols)))
    while len(seq) > 1:
        best, best_i = None, -1
        for i in range(len(seq) - 1):
            m = merges.get((nodes[seq[i]][0], nodes[seq[i + 1]][0]))
            if m is not None and (best is None or m[0] < best[0]):
                best, best_i = m, i
        if best is None:
            break
        nodes.append((best[1], best[0], seq[best_i], seq[best_i + 1]))
        seq[best_i : best_i + 2] = [len(nodes) - 1]
    return [nodes[i][0] for i in seq], nodes, seq


def _spines(nodes, root: int):
    """Right and left spines of the tree at ``root``: lists of (token_id, formation, death)."""
    out = []
    for side in (3, 2):  # right child index 3, left child index 2
        spine, n, death = [], root, INF
        while n >= 0:
            tok, f, left, right = nodes[n]
            spine.append((tok, f, death))
            death = f
            n = right if side == 3 else left
        out.append(spine)
    return out[0], out[1]


def _char_signature(c: str, ws_re, literal: bool) -> tuple:
    cat = unicodedata.category(c)
    return (cat, c.isspace(), bool(ws_re.match(c)), c if literal else None)


class _RepMapper:
    """Maps text to representative strings: one character per pre-tokenizer-relevant class, runs capped."""

    def __init__(self, kind: str, contractions: bool = False):
        import regex

        self.kind = kind
        # Whether the pre-tokenizer has contraction alternatives ('s, 'll, ...): then a token's first two
        # letters may complete an apostrophe at the end of the previous token, so they stay literal too.
        self.contractions = contractions
        self._ws = regex.compile(r"\s")
        self._rep_of_sig: dict[tuple, str] = {}
        self._cache: dict[str, str] = {}

    def char(self, c: str, after_apostrophe: bool = False) -> str:
        """Representative of ``c``; contraction letters stay literal only right after an apostrophe."""
        if self.kind == "sentencepiece_bpe":
            return SP_SPACE if c in (" ", SP_SPACE) else "a"
        literal = c in _SPECIAL_CHARS or (after_apostrophe and c in _CONTRACTION_LETTERS)
        key = (c, literal)
        r = self._cache.get(key)
        if r is None:
            sig = _char_signature(c, self._ws, literal)
            r = self._rep_of_sig.setdefault(sig, c)
            self._cache[key] = r
        return r

    def text(self, s: str) -> str:
        """Representative string of ``s``: per-class characters, runs capped at ``_RUN_CAP``."""
        out: list[str] = []
        run = 0
        since_apostrophe = 0 if self.contractions else 99
        for c in s:
            since_apostrophe = 0 if c in "'\u2019" else since_apostrophe + 1
            r = self.char(c, since_apostrophe <= 2)
            if out and out[-1] == r:
                run += 1
                if run >= _RUN_CAP:
                    continue
            else:
                run = 0
            out.append(r)
        return "".join(out)


def _surface_text(b: bytes, kind: str) -> tuple[str, bool, bool]:
    """Decode token bytes; partial characters at either end become a Lo letter.
    Returns (text, starts_partial, ends_partial)."""
    try:
        s = b.decode("utf-8")
        return s, False, False
    except UnicodeDecodeError:
        pass
    # strip leading continuation bytes and a trailing incomplete sequence
    i = 0
    while i < len(b) and i < 3 and (b[i] & 0xC0) == 0x80:
        i += 1
    j = len(b)
    k = j - 1
    while k >= i and k > j - 4 and (b[k] & 0xC0) == 0x80:
        k -= 1
    if k >= i and b[k] >= 0xC0:
        need = 2 if b[k] < 0xE0 else 3 if b[k] < 0xF0 else 4
        if j - k < need:
            j = k
    mid = b[i:j].decode("utf-8", errors="replace")
    return (_PARTIAL_REP if i else "") + mid + (_PARTIAL_REP if j < len(b) else ""), i > 0, j < len(b)


def build_canonical_filter(info: TokenizerInfo, progress: bool = True) -> CanonicalFilter:
    """Build the canonical filter of ``info`` from its merge table and pre-tokenizer (module docstring).

    Cost: O(V * |spine|) tree work, O(R^2) pre-tokenizer calls over R distinct representative strings,
    and O(V * V / 8) bytes of row work in numpy. Raises nothing on supported tokenizers.
    """
    from tqdm import tqdm

    t0 = time.time()
    V = info.vocab_size
    W = (V + 31) // 32
    kind = info.kind
    byte_ids = set(info.byte_fallback.values())
    contractions = len(info.chunk_spans("'s")) != len(info.chunk_spans("'x")) or len(
        info.chunk_spans("'ll")
    ) != len(info.chunk_spans("'xx"))
    mapper = _RepMapper(kind, contractions)
    steps = tqdm(total=6, desc="canonical filter", disable=not progress, unit="step")

    # 1. standalone canonicality, merge trees and spines ------------------------------------------
    ok = np.zeros(V, dtype=bool)
    rspine: list[list] = [[] for _ in range(V)]
    lspine: list[list] = [[] for _ in range(V)]
    reps: list[str | None] = [None] * V
    first_rep: list[str | None] = [None] * V
    ws_final = np.zeros(V, dtype=bool)
    for t in range(V):
        b = info.token_bytes[t]
        if b is None or not b:
            continue
        if t in byte_ids:
            # An ASCII byte token is never canonical when the character has a piece of its own
            # (000 §4.3); which multi-byte sequences may use byte tokens is the detokenizer's
            # "canonical" byte policy (characters outside the vocabulary only).
            if b[0] < 0x80 and chr(b[0]).replace(" ", SP_SPACE) in info.symbol_id:
                continue
            ok[t] = True
            rspine[t] = lspine[t] = [(t, -1, INF)]
            reps[t] = _PARTIAL_REP
            first_rep[t] = _PARTIAL_REP
            continue
        try:
            syms = info.symbols_of(t)
        except (KeyError, UnicodeDecodeError):
            continue
        final, nodes, seq = _bpe_tree(syms, info.merges)
        if final != [t]:
            continue
        text, _, ends_partial = _surface_text(b, kind)
        if not ends_partial and len(info.chunk_spans(text)) != 1:
            continue
        ok[t] = True
        rspine[t], lspine[t] = _spines(nodes, seq[0])
        reps[t] = mapper.text(text)
        first_rep[t] = mapper.char(text[0])
        ws_final[t] = (not ends_partial) and text[-1].isspace()
    steps.update()

    # 2. pre-tokenizer categories over representative strings ------------------------------------
    rep_ids: dict[str, int] = {}
    tok_rep = np.full(V, -1, dtype=np.int32)
    for t in np.flatnonzero(ok):
        tok_rep[t] = rep_ids.setdefault(reps[t], len(rep_ids))
    rep_list = list(rep_ids)
    R = len(rep_list)
    la_chars = sorted({first_rep[t] for t in np.flatnonzero(ok)})
    L = len(la_chars)
    if L > 63:
        raise RuntimeError(f"{L} lookahead classes do not fit a uint64 set")
    la_index = {c: i for i, c in enumerate(la_chars)}
    la_first = np.full(V, -1, dtype=np.int16)
    for t in np.flatnonzero(ok):
        la_first[t] = la_index[first_rep[t]]
    ws_rep = sorted({int(tok_rep[t]) for t in np.flatnonzero(ws_final & ok)})
    ws_rep_pos = {r: i for i, r in enumerate(ws_rep)}

    def category(a: str, b: str, look: str = "", pre: str = "") -> int:
        """Chunk category of the junction of ``a``|``b`` in ``pre + a + b + look``."""
        spans = info.chunk_spans(pre + a + b + look)
        p = len(pre)
        la, lb = p + len(a), p + len(a) + len(b)
        junction = False
        for s, e in spans:
            for x in (s, e):
                if p < x < la or la < x < lb:
                    return BANNED
                if x == la:
                    junction = True
        return SPLIT if junction else JOIN

    cat = np.empty((R + 1, R), dtype=np.uint8)  # row R: start of text
    for i, a in enumerate(tqdm(rep_list, desc="pre-tokenizer pairs", disable=not progress, leave=False)):
        for j, bb in enumerate(rep_list):
            cat[i, j] = category(a, bb)
    for j, bb in enumerate(rep_list):
        cat[R, j] = category("", bb)
    # lookahead verdicts for whitespace-final v: [R+1, n_ws_rep, L+1] (last = END)
    cat_la = np.empty((R + 1, len(ws_rep), L + 1), dtype=np.uint8)
    for i in range(R + 1):
        a = rep_list[i] if i < R else ""
        for jj, j in enumerate(ws_rep):
            bb = rep_list[j]
            for c, ch in enumerate(la_chars):
                cat_la[i, jj, c] = category(a, bb, ch)
            cat_la[i, jj, L] = cat[i, j]

    # Left context: when u's whole text continues the chunk of the previous token's last character c
    # (e.g. Tekken's greedy punctuation run "&" + "_" before "bar"), the u|v junction is judged with c
    # in front. ctx_fix[(c, r)] = (cat row, cat_la row) for representative r, only where it differs.
    last_rep: list[str | None] = [None] * V
    for t in np.flatnonzero(ok):
        last_rep[t] = reps[t][-1]
    ctx_chars = sorted({last_rep[t] for t in np.flatnonzero(ok)})
    ctx_fix: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
    # Screening probes: the distinct 2-character heads of all representatives (what follows the
    # junction decides how the chunk that started before u ends); full rows only where a probe differs.
    probes = sorted({r[:2] for r in rep_list} | set(la_chars))
    for c in tqdm(ctx_chars, desc="left-context pairs", disable=not progress, leave=False):
        for i, a in enumerate(rep_list):
            if info.chunk_spans(c + a) != [(0, len(c) + len(a))]:
                continue  # u does not continue c's chunk: the pairwise verdicts hold
            if all(category(a, b, pre=c) == category(a, b) for b in probes):
                continue
            row = np.array([category(a, bb, pre=c) for bb in rep_list], dtype=np.uint8)
            row_la = np.empty((len(ws_rep), L + 1), dtype=np.uint8)
            for jj, j in enumerate(ws_rep):
                for cc, ch in enumerate(la_chars):
                    row_la[jj, cc] = category(a, rep_list[j], ch, pre=c)
                row_la[jj, L] = row[j]
            if not (np.array_equal(row, cat[i]) and np.array_equal(row_la, cat_la[i])):
                ctx_fix[(c, i)] = (row, row_la)
    # context groups: characters with the same fixes behave alike; group 0 = no fix (and START)
    sig_of_char = {c: tuple(sorted((i, hashlib.blake2b(f[0].tobytes() + f[1].tobytes(), digest_size=8).digest())
                                   for (cc, i), f in ctx_fix.items() if cc == c)) for c in ctx_chars}
    group_ids: dict[tuple, int] = {(): 0}
    char_group = {c: group_ids.setdefault(sig, len(group_ids)) for c, sig in sig_of_char.items()}
    G = len(group_ids)
    group_char = {g: c for c, g in char_group.items()}  # a representative character per group
    steps.update()

    # 3. left-spine index: for each token y, entries (v, death, formation) sorted by death desc ------
    ys, vs, ds, fs = [], [], [], []
    for v in np.flatnonzero(ok):
        for y, f, d in lspine[v]:
            ys.append(y), vs.append(v), ds.append(d), fs.append(f)
    ys = np.asarray(ys, dtype=np.int64)
    vs = np.asarray(vs, dtype=np.int32)
    ds = np.asarray(ds, dtype=np.int64)
    fs = np.asarray(fs, dtype=np.int64)
    order = np.lexsort((-ds, ys))
    ys, vs, ds, fs = ys[order], vs[order], ds[order], fs[order]
    lptr = np.searchsorted(ys, np.arange(V + 1))
    neg_ds = -ds  # ascending within each y block
    # merges by left token, sorted by rank
    ml = np.array([(a, b, r) for (a, b), (r, _) in info.merges.items()], dtype=np.int64).reshape(-1, 3)
    ml = ml[np.lexsort((ml[:, 2], ml[:, 0]))]
    mptr = np.searchsorted(ml[:, 0], np.arange(V + 1))
    steps.update()

    item_cache: dict[tuple[int, int, int], np.ndarray] = {}

    def item_conflicts(x: int, fx: int, dx: int) -> np.ndarray:
        """Token ids v in conflict with a right-spine node x alive in (fx, dx)."""
        key = (x, fx, dx)
        got = item_cache.get(key)
        if got is not None:
            return got
        lo, hi = mptr[x], mptr[x + 1]
        block = ml[lo:hi]
        block = block[(block[:, 2] > fx) & (block[:, 2] < dx)]
        parts = []
        for y, m in zip(block[:, 1].tolist(), block[:, 2].tolist()):
            a, b = lptr[y], lptr[y + 1]
            if a == b:
                continue
            # entries with death >= m are a prefix of the block (sorted by death desc)
            cut = a + int(np.searchsorted(neg_ds[a:b], -m, side="right"))
            if cut > a:
                sel = vs[a:cut][fs[a:cut] < m]
                if sel.size:
                    parts.append(sel)
        res = np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)
        item_cache[key] = res
        return res

    # 4. rows per token, deduplicated into classes ------------------------------------------------
    not_ok = ~ok
    ws_tokens = np.flatnonzero(ws_final & ok)
    J = len(ws_tokens)
    la_token_index = np.full(V, -1, dtype=np.int32)
    la_token_index[ws_tokens] = np.arange(J, dtype=np.int32)
    ws_tok_rep_pos = np.array([ws_rep_pos[int(tok_rep[t])] for t in ws_tokens], dtype=np.int64)
    tok_rep_safe = np.where(tok_rep >= 0, tok_rep, 0)
    c_range = np.arange(L + 1, dtype=np.uint64)
    class_of_sig: dict[bytes, int] = {}
    rows: list[np.ndarray] = []
    sets: list[np.ndarray] = []
    token_class = np.full(V, -1, dtype=np.int32)
    class_group: list[int] = []
    ctx_variants: list[tuple[int, int, int]] = []
    conflict = np.zeros(V, dtype=bool)

    def la_vector(ru: int, conflict_vec: np.ndarray, cat_la_row: np.ndarray | None = None) -> np.ndarray:
        cats = (cat_la[ru] if cat_la_row is None else cat_la_row)[ws_tok_rep_pos]  # [J, L+1]
        okc = (cats == SPLIT) | ((cats == JOIN) & ~conflict_vec[ws_tokens][:, None])
        return (okc.astype(np.uint64) << c_range).sum(axis=1, dtype=np.uint64) if J else np.zeros(0, np.uint64)

    for u in tqdm(np.flatnonzero(ok), desc="canonical rows", disable=not progress, leave=False):
        conflict[:] = False
        for x, fx, dx in rspine[u]:
            hit = item_conflicts(x, fx, dx)
            if hit.size:
                conflict[hit] = True
        ru = int(tok_rep[u])
        own_group = char_group[last_rep[u]]
        variants = [(0, cat[ru], None)] + [
            (g, *ctx_fix[(group_char[g], ru)]) for g in range(1, G) if (group_char[g], ru) in ctx_fix
        ]
        for g, cat_row, cat_la_row in variants:
            cats = cat_row[tok_rep_safe]
            banned = (cats == BANNED) | ((cats == JOIN) & conflict) | not_ok
            lav = la_vector(ru, conflict, cat_la_row)
            if J:
                banned[ws_tokens] = lav == 0
            packed = np.packbits(banned, bitorder="little")
            sig = hashlib.blake2b(packed.tobytes() + lav.tobytes() + bytes([own_group % 256, own_group // 256]),
                                  digest_size=16).digest()
            k = class_of_sig.get(sig)
            if k is None:
                k = class_of_sig[sig] = len(rows)
                rows.append(packed)
                sets.append(lav)
                class_group.append(own_group)
            if g == 0:
                token_class[u] = k
            else:
                ctx_variants.append((u, g, k))
    steps.update()

    # start state
    conflict[:] = False
    cats = cat[R][tok_rep_safe]
    start_allowed = (cats != BANNED) & ok
    start_lav = la_vector(R, conflict)
    if J:
        start_allowed[ws_tokens] &= start_lav != 0

    C = len(rows)
    pad = W * 4
    banned_ptr, banned_ids = rows_to_csr(rows, V)
    del rows
    start_row = np.zeros(pad, dtype=np.uint8)
    sp = np.packbits(start_allowed, bitorder="little")
    start_row[: sp.size] = sp
    start_row = start_row.view("<i4")
    la_rows = np.zeros((L, pad), dtype=np.uint8)
    for c in range(L):
        r = np.packbits(la_first == c, bitorder="little")
        la_rows[c, : r.size] = r
    la_rows = la_rows.view("<i4")
    la_sets = np.zeros((C + 1, J), dtype=np.uint64)
    for k, s in enumerate(sets):
        la_sets[k] = s
    la_sets[C] = start_lav
    ctx_token_index = np.full(V, -1, dtype=np.int32)
    ctx_tokens = sorted({u for u, _, _ in ctx_variants})
    ctx_token_index[ctx_tokens] = np.arange(len(ctx_tokens), dtype=np.int32)
    ctx_classes = np.repeat(token_class[ctx_tokens][:, None], G, axis=1).astype(np.int32)
    for u, g, k in ctx_variants:
        ctx_classes[ctx_token_index[u], g] = k
    class_group_arr = np.array(class_group + [0], dtype=np.int16)  # last entry: the start state
    la_set_values, inverse = np.unique(la_sets, return_inverse=True)
    la_set_index = inverse.reshape(la_sets.shape).astype(np.uint8 if la_set_values.size <= 256 else np.uint16)
    del la_sets
    steps.update()
    steps.close()
    stats = dict(
        n_tokens=int(V),
        n_canonical_tokens=int(ok.sum()),
        n_rep_strings=R,
        build_seconds=round(time.time() - t0, 2),
        n_context_groups=G,
        n_context_tokens=len(ctx_tokens),
        n_spine_items=len(item_cache),
        spine_item_entries=int(sum(a.size for a in item_cache.values())),
    )
    return CanonicalFilter(
        vocab_size=V, token_class=token_class, banned_ptr=banned_ptr, banned_ids=banned_ids,
        start_row=np.ascontiguousarray(start_row), la_first=la_first, la_rows=np.ascontiguousarray(la_rows),
        la_token_index=la_token_index, la_set_values=la_set_values, la_set_index=la_set_index,
        class_group=class_group_arr, ctx_token_index=ctx_token_index, ctx_classes=ctx_classes, stats=stats,
    )
