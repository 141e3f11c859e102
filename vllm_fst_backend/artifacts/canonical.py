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

Left context (the chunk-prefix automaton)
-----------------------------------------
A pair's chunk boundaries can also depend on text *before* u, when u continues a chunk that started
earlier: Tekken's punctuation run ``','$`` followed by combining marks stays one run (marks are
punctuation inside ``[^\\s\\p{L}\\p{N}]+``), but ``$`` followed by the same marks starts the letter
alternative (``[^\\r\\n\\p{L}\\p{N}]?`` then marks). So the A_BPE state also carries a *context
state*: the class of the text of the current chunk before the next token. Two chunk prefixes are the
same state when the pre-tokenizer draws the same boundaries after them for every probe continuation
(the 1-3 character heads of all representatives, the lookahead characters, the end of text): a
Myhill-Nerode quotient with bounded probes, found breadth first, each state represented by the
shortest prefix found. A token read in a state either starts a new chunk (the context does not reach
it: its context-free verdicts hold) or continues the chunk: then its verdicts are computed with the
state's prefix in front, and the state after it is the prefix extended by the token. The probes
over-distinguish, so two reductions follow (both exact): fixes of (state, token) pairs no text
reaches are dropped (:func:`_reachable_fixes`: after a chunk ``'`` the token ``ta`` is already banned
by the previous token's row, contraction ``'t``), then the automaton is minimized (Moore partition
refinement, :func:`_minimize_context`). Classes carry the state reached (``class_group``); tokens
whose class depends on the state are listed in ``ctx_token_index``/``ctx_classes``; each costs the
compiler a per-state check, so fewer is faster. The build summary gives the figures
(``n_context_prefixes`` found, ``n_context_groups`` after minimization, ``n_context_tokens``).

Split characters (byte-level tokens that split a UTF-8 character)
-----------------------------------------------------------------
A pre-tokenizer never splits inside a character. So at a junction inside a character neither side is
a chunk boundary: the boundary before the character belongs to the left token, the one after it to
the right token (``category`` in :func:`build_canonical_filter`). Which boundaries fall there depends on
the character, which neither token holds alone. Three mechanisms keep it exact:

* *Pairs*: representatives carry the bytes of the incomplete character a token ends with and the
  continuation bytes a token starts with; where the two complete a character c, the junction is
  judged with c itself (``exact_cells``: ``D9`` + ``A8`` is U+0668, a digit, although most characters
  after ``D9`` are Arabic letters).
* *Lead states*: a token ending in the first bytes P of a character whose completions are of more
  than one class (:meth:`_TailChars.mixed`; Tekken spells U+FE0F, the emoji variation selector and a
  mark, ``EF`` ``B8`` ``8F``, one byte per token, while most characters after ``EF`` are symbols) leads
  to the context state (y, P), y the chunk prefix before the character. A continuation token read
  there is read in the ordinary state of y followed by the character it completes (``dispatch``), or,
  when it leaves the character incomplete, by the stand-in of the longer prefix (``EF B8``: a mark,
  as U+FE0F is).
* *Stand-ins*: everywhere else an incomplete character gets a stand-in (:class:`_TailChars`: a
  character of the class with the most weight among the completions of its first bytes, weighted by
  the vocabulary -- a symbol for ``F0 9F``, emoji, which Tekken's regex treats as punctuation; a
  letter for ``E0 A4``), and the context state carries how many bytes the pending character still
  misses, so a token of continuation bytes only either completes it or leaves it pending. Where all
  completions share a class the stand-in is exact.

A token of continuation bytes only that may complete a whitespace character (``A0`` after ``C2``:
U+00A0) is whitespace-final for the lookahead rule above; its lookahead sets decide per class. Joined
bytes that are invalid UTF-8 in any other way never reach the output (the UTF-8 filter removes them)
and get the same definition. ``tests/test_canonical.py`` checks every character-splitting pair and a
sample of triples through split characters against the tokenizer (zero disagreements).

Remaining limits, documented not handled: (1) a character split over three or more tokens whose
bytes after the second token still leave mixed classes is judged from there on by the stand-in of
those bytes, and the boundary *before* a character that only a later token completes is judged with
the stand-in of the bytes the left token holds. Measured by ``scripts/bench_split_chars.py``
(docs/benchmarks.md, "Split characters") on sampled four-token sequences u v w x through such
characters (v leaves the character open, w completes it): SmolLM2 4 of 357,888 disagree with the
tokenizer (e.g. `` E2`` ``81`` ``9F``, U+205F, whitespace, before a letter), Tekken 9,295 of 1,092,303
(e.g. ``E2`` ``9D`` ``B8..``: U+2778, a digit among dingbat symbols). An experiment not kept (ad hoc, on
this session's branch before the compiler's batched check of regular-like tokens) followed each such
character byte by byte, lead states chained through the longer prefixes: nearly all of these went,
the rest of kind 1b, but Tekken's filter grew to ~1,000 context states and ~480 MB of arrays and its
free-text compile became ~3x slower, so it is not done. (1b) Character classes come
from Python's Unicode tables (``unicodedata``, Unicode 14 on Python 3.11), the pre-tokenizer's from
its regex engine: code points assigned after Unicode 14 (CJK extension H, U+31350..) are unassigned
to the first and letters to the second, so split across tokens they are judged as symbols. (2) The
pre-tokenizer's *lookahead* is tracked only for whitespace runs (above); Tekken's letter alternatives
can also move a boundary back over an uppercase run (``中AB`` + ``c`` is one chunk, ``中AB`` + ``!`` is
``中`` ``AB``), which no bounded context sees.

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
CANONICAL_VERSION = 5
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

    * ``class_group``: int16[C + 1] -- the left-context state (module docstring, "Left context") each
      class leads to (entry C = start state, state 0); ``ctx_token_index``: int32[V] (-1 or j) and
      ``ctx_classes``: int32[J2, G] -- the class token j reaches when read in context state g
      (column 0 = ``token_class``).

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


_COARSE_ATOMS = (r"\p{L}", r"\p{Lu}", r"\p{Ll}", r"\p{Lt}", r"\p{Lm}", r"\p{Lo}", r"\p{M}", r"\p{N}", r"\s")


def _coarse_signature(c: str) -> tuple:
    """What the pre-tokenizer regexes we support can tell about ``c``: the Unicode classes their
    patterns name (GPT-2/Llama-3/Tekken: L and its subclasses, M, N, \\s) and the literal characters."""
    import regex

    global _COARSE_RE
    try:
        atoms = _COARSE_RE
    except NameError:
        atoms = _COARSE_RE = [regex.compile(a) for a in _COARSE_ATOMS]
    return tuple(bool(a.match(c)) for a in atoms) + ((c if c in _SPECIAL_CHARS else None),)


def _utf8_length(lead: int) -> int:
    """Bytes of the UTF-8 character whose first byte is ``lead`` (1 for ASCII and stray bytes)."""
    return 2 if 0xC0 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if lead >= 0xF0 else 1


class _TailChars:
    """Stand-in characters for UTF-8 characters split after their first 1-3 bytes (``lead``).

    The stand-in is the first completion of the class (:func:`_coarse_signature`) with the largest
    weight among the assigned characters that start with ``lead`` (among all valid ones where none is
    assigned: ``EE``, private use, gets a private-use character). Weights come from the vocabulary,
    the tokenizer's own evidence of what is common: a completion weighs the number of tokens that
    contain it; when none does, each next byte ``x`` weighs the number of tokens containing the bytes
    ``lead + x``, shared among the classes of its completions; without any evidence every code point
    weighs 1. So ``F0`` and ``F0 9F`` get a symbol (emoji, punctuation to Tekken's regex, although most
    code points after ``F0`` are CJK letters), ``E0 A4`` a letter. Exact whenever all completions share
    a class (:meth:`mixed` says where not: there the build tracks the bytes themselves, module
    docstring, "Split characters"). Cached per ``lead``."""

    def __init__(self, token_bytes):
        self._freq: dict[str, int] = {}
        self._grams: dict[bytes, int] = {}
        for b in token_bytes:
            if not b:
                continue
            for c in set(b.decode("utf-8", errors="ignore")):
                self._freq[c] = self._freq.get(c, 0) + 1
            for q in {b[i : i + n] for n in (2, 3) for i in range(len(b) - n + 1) if b[i] >= 0xC0}:
                self._grams[q] = self._grams.get(q, 0) + 1
        self._classes_cache: dict[bytes, tuple] = {}
        self._cache: dict[bytes, str] = {}

    def _classes(self, lead: bytes, every: bool = False) -> tuple[dict, dict, dict]:
        """(code points per class, vocabulary weight per class, first completion per class) over the
        assigned completions of ``lead``, or with ``every`` over all of them (private-use and
        unassigned code points too: valid UTF-8 a model may write)."""
        got = self._classes_cache.get((lead, every))
        if got is not None:
            return got
        rest = _utf8_length(lead[0]) - len(lead)
        by_count: dict[tuple, int] = {}
        by_freq: dict[tuple, int] = {}
        first: dict[tuple, str] = {}
        for k in range(64 ** max(rest, 0)):
            tail = bytes(0x80 | ((k >> (6 * i)) & 0x3F) for i in reversed(range(rest)))
            try:
                c = (lead + tail).decode("utf-8")
            except UnicodeDecodeError:
                continue
            if unicodedata.category(c) in (("Cs",) if every else ("Cs", "Cn", "Co")):
                continue
            g = _coarse_signature(c)
            by_count[g] = by_count.get(g, 0) + 1
            by_freq[g] = by_freq.get(g, 0) + self._freq.get(c, 0)
            first.setdefault(g, c)
        got = self._classes_cache[(lead, every)] = (by_count, by_freq, first)
        return got

    def mixed(self, lead: bytes) -> bool:
        """Whether the completions of ``lead`` (a valid UTF-8 prefix) fall into more than one class
        (:func:`_coarse_signature`): only then can a stand-in misjudge one of them."""
        return 0xC2 <= lead[0] <= 0xF4 and len(self._classes(lead, every=True)[0]) > 1

    def __call__(self, lead: bytes) -> str:
        got = self._cache.get(lead)
        if got is not None:
            return got
        by_count, by_freq, first = self._classes(lead)
        weight = by_freq if any(by_freq.values()) else {}
        if not weight and _utf8_length(lead[0]) - len(lead) >= 2:
            for x in range(0x80, 0xC0):
                n = self._grams.get(lead + bytes([x]), 0)
                sub = self._classes(lead + bytes([x]))[0] if n else {}
                total = sum(sub.values())
                for g, m in sub.items():
                    weight[g] = weight.get(g, 0) + n * m / total
        weight = weight or by_count
        if not weight:  # no assigned completion (private use, U+E000..): judge by what there is
            weight, _, first = self._classes(lead, every=True)
        out = first[max(weight, key=weight.get)] if weight else _PARTIAL_REP
        self._cache[lead] = out
        return out


def _whitespace_tails() -> set[bytes]:
    """The proper suffixes (continuation bytes only) of the UTF-8 encodings of whitespace characters
    (``str.isspace``): a token made of one of them may complete a whitespace character."""
    out = set()
    for cp in range(0x80, 0x3001):
        if chr(cp).isspace():
            enc = chr(cp).encode("utf-8")
            out |= {enc[k:] for k in range(1, len(enc))}
    return out


def incomplete_tail(b: bytes, start: int = 0) -> int:
    """Index (>= ``start``) of the lead byte of a UTF-8 character that ``b`` leaves incomplete at its
    end, or ``len(b)`` when ``b`` ends at a character boundary (as far as its last 4 bytes tell)."""
    k = len(b) - 1
    while k >= start and k > len(b) - 4 and (b[k] & 0xC0) == 0x80:
        k -= 1
    if k >= start and b[k] >= 0xC0 and len(b) - k < _utf8_length(b[k]):
        return k
    return len(b)


def _surface_text(b: bytes, tail_char) -> tuple[str, int, int]:
    """Decode token bytes; partial characters at either end get a stand-in character.

    Returns ``(text, lead, rem)``: ``lead`` = leading continuation bytes (0-3; they continue the
    previous token's character, stand-in :data:`_PARTIAL_REP`; the joins use the previous token's
    stand-in instead), ``rem`` = bytes still missing from a trailing partial character (0-3; its
    stand-in is ``tail_char(lead bytes)``, see :class:`_TailChars`)."""
    try:
        s = b.decode("utf-8")
        return s, 0, 0
    except UnicodeDecodeError:
        pass
    # strip leading continuation bytes and a trailing incomplete sequence
    i = 0
    while i < len(b) and i < 3 and (b[i] & 0xC0) == 0x80:
        i += 1
    j = incomplete_tail(b, i)
    rem = _utf8_length(b[j]) - (len(b) - j) if j < len(b) else 0
    mid = b[i:j].decode("utf-8", errors="replace")
    tail = tail_char(b[j:]) if rem else ""
    return (_PARTIAL_REP if i else "") + mid + tail, i, rem


def _reachable_fixes(ctx_fix: dict, succ0: list[int], pending: list[int], lead: list[bool], cat: np.ndarray,
                     cat_la: np.ndarray, ws_rep: list[int]) -> dict:
    """Drop the fixes of (state, representative) pairs that no text reaches.

    A pair (g, i) is reached when some reached pair (g', a) leads to g and does not ban i after a
    (verdict not BANNED; for whitespace-final i, under some lookahead), and i is valid UTF-8 there
    (it starts with continuation bytes exactly when g has a character pending). Most fixes found by
    the probes are not: after a chunk ``'``, a token ``ta`` would be cut by the contraction ``'t``,
    which the previous token's row already bans. Least fixpoint from the start of text (row R of
    ``cat``); arguments as in :func:`build_canonical_filter` (``cat: uint8[R+1, R]``,
    ``cat_la: uint8[R+1, n_ws, L+1]``)."""
    R = cat.shape[1]
    n_states = len(pending)
    lead = np.asarray(lead, dtype=bool)
    valid = np.array([lead if p else ~lead for p in pending])  # [G, R]
    ws = np.asarray(ws_rep, dtype=np.int64)

    def ok_row(row: np.ndarray, row_la: np.ndarray) -> np.ndarray:
        ok = row != BANNED
        if len(ws):
            ok[ws] |= (row_la != BANNED).any(axis=1)
        return ok

    default_ok = np.stack([ok_row(cat[a], cat_la[a]) for a in range(R)])  # [R, R]
    fixes_at: list[dict] = [{} for _ in range(n_states)]
    for (g, i), f in ctx_fix.items():
        fixes_at[g][i] = f
    reached = np.zeros((n_states, R), dtype=bool)
    reached[0] = ok_row(cat[R], cat_la[R]) & valid[0]
    work = [0]
    while work:
        g = work.pop()
        for a in np.flatnonzero(reached[g]).tolist():
            f = fixes_at[g].get(a)
            t = succ0[a] if f is None else f[2]
            ok = default_ok[a] if f is None or f[0] is None else ok_row(f[0], f[1])
            new = ok & valid[t] & ~reached[t]
            if new.any():
                reached[t] |= new
                if t not in work:
                    work.append(t)
    return {(g, i): f for (g, i), f in ctx_fix.items() if reached[g, i]}


def _minimize_context(ctx_fix: dict, succ0: list[int], n_states: int) -> tuple[dict, list[int], int]:
    """Minimize the chunk-prefix automaton (Moore partition refinement, as in DFA minimization).

    ``ctx_fix[(g, i)] = (row, row_la, succ)`` is where representative ``i`` read in state ``g`` differs
    from reading it at a chunk start (verdict rows ``uint8[R]``/``uint8[J, L+1]`` or ``None`` for the
    chunk-start ones; successor state); elsewhere the successor is ``succ0[i]``. Two states are
    equivalent when every representative gets the same verdicts in both and leads to equivalent states:
    the probes that found the states over-distinguish them, and every state that survives costs the
    compiler (its tokens become context-dependent). Returns ``(ctx_fix, succ0, n_blocks)`` over block
    ids, state 0 (chunk start) staying 0, with the fixes that no longer change anything dropped."""
    verdict: list[dict] = [{} for _ in range(n_states)]
    succ_of: list[dict] = [{} for _ in range(n_states)]
    for (g, i), (row, row_la, succ) in ctx_fix.items():
        if row is not None:
            verdict[g][i] = row.tobytes() + row_la.tobytes()
        succ_of[g][i] = succ
    fixed = sorted({i for _, i in ctx_fix})  # other representatives lead to succ0[i] from every state
    ids: dict = {}
    block = [ids.setdefault(tuple(sorted(verdict[g].items())), len(ids)) for g in range(n_states)]
    while True:
        ids = {}
        new = [
            ids.setdefault((block[g], tuple(block[succ_of[g].get(i, succ0[i])] for i in fixed)), len(ids))
            for g in range(n_states)
        ]
        done = len(ids) == len(set(block))
        block = new
        if done:
            break
    # renumber so that the start state is block 0 (ids are assigned in state order: block[0] == 0)
    first_of: dict[int, int] = {}
    for g in range(n_states):
        first_of.setdefault(block[g], g)
    succ0 = [block[s] for s in succ0]
    out: dict = {}
    for (g, i), (row, row_la, succ) in ctx_fix.items():
        if first_of[block[g]] != g:
            continue
        b = block[succ]
        if row is not None or b != succ0[i]:
            out[(block[g], i)] = (row, row_la, b)
    return out, succ0, len(first_of)


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
    tail_char = _TailChars(info.token_bytes)
    ws_tails = _whitespace_tails()
    steps = tqdm(total=6, desc="canonical filter", disable=not progress, unit="step")

    # 1. standalone canonicality, merge trees and spines ------------------------------------------
    ok = np.zeros(V, dtype=bool)
    rspine: list[list] = [[] for _ in range(V)]
    lspine: list[list] = [[] for _ in range(V)]
    # (representative text, lead, rem, head, tail): see _surface_text; head = the leading continuation
    # bytes, tail = the bytes of an incomplete character at the end (module docstring, "Split characters")
    reps: list[tuple | None] = [None] * V
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
            reps[t] = (_PARTIAL_REP, 0, 0, b"", b"")
            first_rep[t] = _PARTIAL_REP
            continue
        try:
            syms = info.symbols_of(t)
        except (KeyError, UnicodeDecodeError):
            continue
        final, nodes, seq = _bpe_tree(syms, info.merges)
        if final != [t]:
            continue
        text, lead, rem = _surface_text(b, tail_char)
        if not rem and len(info.chunk_spans(text)) != 1:
            continue
        ok[t] = True
        rspine[t], lspine[t] = _spines(nodes, seq[0])
        reps[t] = (mapper.text(text), lead, rem, b[:lead], b[incomplete_tail(b, lead):] if rem else b"")
        first_rep[t] = mapper.char(text[0])
        # whitespace-final: ends with whitespace, or is continuation bytes only that may complete a
        # whitespace character (``A0`` after ``C2``: U+00A0); which one the lookahead sets decide
        ws_final[t] = (not rem) and (b[:lead] in ws_tails if lead == len(b) else text[-1].isspace())
    steps.update()

    # 2. pre-tokenizer categories over representative strings ------------------------------------
    # A representative's first three fields (text, lead, rem) decide its chunk categories; the last two
    # (literal head and tail bytes) matter only where two tokens complete a split character (exact
    # cells, lead states). Categories are computed once per *base* (the first three fields) and
    # expanded to all representatives sharing it.
    rep_ids: dict[tuple, int] = {}
    tok_rep = np.full(V, -1, dtype=np.int32)
    for t in np.flatnonzero(ok):
        tok_rep[t] = rep_ids.setdefault(reps[t], len(rep_ids))
    rep_list = list(rep_ids)
    R = len(rep_list)
    base_ids: dict[tuple, int] = {}
    base_of = np.array([base_ids.setdefault(r[:3], len(base_ids)) for r in rep_list], dtype=np.int64)
    base_list = list(base_ids)
    Rb = len(base_list)
    members: list[list[int]] = [[] for _ in range(Rb)]
    for i in range(R):
        members[int(base_of[i])].append(i)
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
    ws_base = sorted({int(base_of[j]) for j in ws_rep})
    ws_base_pos = {r: i for i, r in enumerate(ws_base)}
    ws_expand = np.array([ws_base_pos[int(base_of[j])] for j in ws_rep], dtype=np.int64)  # full ws -> base ws
    row_expand = np.append(base_of, Rb)  # full row index (R = start of text) -> base row index
    EMPTY = ("", 0, 0)
    NO_CTX = ("", 0, b"")

    def pending_after(a: tuple, r: int) -> int:
        """Bytes still missing from the current character after token ``a`` read with ``r`` missing."""
        if r and a[1] and len(a[0]) == 1 and not a[2]:  # continuation bytes only
            return max(r - a[1], 0)
        return a[2]

    def category(a: tuple, b: tuple, look: str = "", pre: tuple = NO_CTX) -> int:
        """Chunk category of the junction of tokens ``a``|``b`` (representatives as in ``reps``) after
        the context ``pre`` = (chunk-prefix text, bytes its last character still misses, ...) and
        before the text ``look``. A character split across a junction is one character (the left
        token's stand-in): no chunk boundary can fall inside it, so the boundary before it belongs to
        the left token and the one after it to the right token."""
        pt, pend = pre[0], pre[1]
        at, bt = a[0], b[0]
        mid_a = bool(pend and a[1])  # a starts inside the last character of the context
        if mid_a:
            at = at[1:]
        mid_b = bool(pending_after(a, pend) and b[1])  # the junction falls inside a character
        if mid_b:
            bt = bt[1:]
        p = len(pt) - (1 if mid_a else 0)
        la = len(pt) + len(at)
        lb = la + len(bt)
        junction = False
        for s0, e0 in info.chunk_spans(pt + at + bt + look):
            for x in (s0, e0):
                if p < x < la or la < x < lb or (mid_b and x == la < lb):
                    return BANNED
                if x == la and not mid_b:
                    junction = True
        return SPLIT if junction else JOIN

    def la_row(a: tuple, pre: tuple = NO_CTX) -> np.ndarray:
        """uint8[n_ws_base, L+1]: verdicts of ``a`` before each whitespace-final base under each
        lookahead class (last column: END, filled by the caller)."""
        out = np.empty((len(ws_base), L + 1), dtype=np.uint8)
        for jj, j in enumerate(ws_base):
            bb = base_list[j]
            for c, ch in enumerate(la_chars):
                out[jj, c] = category(a, bb, ch, pre=pre)
        return out

    cat_b = np.empty((Rb + 1, Rb), dtype=np.uint8)  # row Rb: start of text
    for i, a in enumerate(tqdm(base_list, desc="pre-tokenizer pairs", disable=not progress, leave=False)):
        for j, bb in enumerate(base_list):
            cat_b[i, j] = category(a, bb)
    for j, bb in enumerate(base_list):
        cat_b[Rb, j] = category(EMPTY, bb)
    # lookahead verdicts for whitespace-final v: [Rb+1, n_ws_base, L+1] (last = END)
    cat_la_b = np.empty((Rb + 1, len(ws_base), L + 1), dtype=np.uint8)
    for i in range(Rb + 1):
        cat_la_b[i] = la_row(base_list[i] if i < Rb else EMPTY)
        cat_la_b[i, :, L] = cat_b[i, ws_base]
    cat = cat_b[row_expand][:, base_of]  # [R+1, R]
    cat_la = cat_la_b[row_expand][:, ws_expand]  # [R+1, n_ws_rep, L+1]

    # Junctions inside a character are judged with the exact character wherever the tokens' bytes
    # complete it (the stand-in only stands for characters still incomplete).
    reps_by_head: dict[tuple[int, bytes], list[int]] = {}
    for j, r in enumerate(rep_list):
        if r[1]:
            reps_by_head.setdefault((r[1], r[3]), []).append(j)

    def completions(part: bytes) -> dict[str, list[int]]:
        """The continuation representatives j that complete the character begun by the bytes
        ``part``, grouped by the (representative of the) character they complete it to."""
        need = _utf8_length(part[0]) - len(part)
        by_char: dict[str, list[int]] = {}
        for (n, head), js in reps_by_head.items():
            if n == need:
                try:
                    c = (part + head).decode("utf-8")
                except UnicodeDecodeError:
                    continue
                by_char.setdefault(mapper.char(c), []).extend(js)
        return by_char

    # exact[i]: for a representative i ending inside a character, (i with the completed character for
    # its stand-in, [j, ...]) per character its continuations complete it to
    exact: dict[int, list[tuple[tuple, list[int]]]] = {}
    for i, r in enumerate(rep_list):
        if r[4]:
            got = completions(r[4])
            if got:
                exact[i] = [((r[0][:-1] + c, r[1], r[2]), js) for c, js in got.items()]

    def exact_cells(cells: list, row: np.ndarray, row_la: np.ndarray, pre: tuple = NO_CTX) -> tuple[np.ndarray, np.ndarray]:
        """Copies of a representative's verdict rows (``uint8[R]``, ``uint8[n_ws_rep, L+1]``) in context
        ``pre`` with the cells of the continuations j that complete the split character judged exactly:
        ``cells`` = ``exact[i]``, (representative with the completed character, [j, ...])."""
        row, row_la = row.copy(), row_la.copy()
        for a, js in cells:
            got: dict[int, int] = {}
            for j in js:
                jb = int(base_of[j])
                v = got.get(jb)
                if v is None:
                    v = got[jb] = category(a, base_list[jb], pre=pre)
                row[j] = v
                jj = ws_rep_pos.get(j)
                if jj is not None:
                    for cc, ch in enumerate(la_chars):
                        row_la[jj, cc] = category(a, base_list[jb], ch, pre=pre)
                    row_la[jj, L] = v
        return row, row_la

    for i, cells in exact.items():
        cat[i], cat_la[i] = exact_cells(cells, cat[i], cat_la[i])

    # Left context: the chunk-prefix automaton (module docstring, "Left context"). A state stands for
    # the text of the current pre-token chunk before the next token, up to what the pre-tokenizer can
    # still tell about the future: prefixes with the same verdicts on every probe continuation are one
    # state, represented by the shortest such prefix found (breadth first). State 0 = start of text.
    # A *lead state* (y, need, P) stands for the chunk prefix y followed by the first bytes P of a
    # character whose ``need`` continuation bytes are still to come, where P's completions are of
    # more than one class (module docstring, "Split characters"): it has no verdicts of its own; a
    # token of continuation bytes read there is read in the ordinary state of y followed by the
    # character those bytes complete (or by the stand-in of the longer prefix they leave).
    probes = sorted({r[0][:2] for r in base_list} | {r[0][:3] for r in base_list} | set(la_chars) | {""})
    # screening continuations for a token's verdicts (full rows only where one differs)
    probe_reps = sorted({(r[0][:2], r[1], 0) for r in base_list} | {(c, 0, 0) for c in la_chars})

    def future(y: str) -> tuple:
        n = len(y)
        return tuple(tuple(s0 - n for s0, _ in info.chunk_spans(y + q) if s0 >= n) for q in probes)

    # (chunk prefix, bytes missing from its last character, first bytes P of a lead state or b"")
    states: list[tuple[str, int, bytes]] = [NO_CTX]
    state_of_future: dict[tuple, int] = {(0, future("")): 0}
    state_of_text: dict[tuple, int] = {("", 0): 0}
    lead_states: dict[tuple[str, bytes], int] = {}

    def state_of(y: str, pend: int) -> int:
        g = state_of_text.get((y, pend))
        if g is None:
            key = (pend, future(y))
            g = state_of_future.get(key)
            if g is None:
                g = state_of_future[key] = len(states)
                states.append((y, pend, b""))
            state_of_text[(y, pend)] = g
        return g

    def lead_state(y: str, part: bytes) -> int:
        """The lead state of chunk prefix ``y`` (up to its state) followed by the incomplete
        character ``part`` (1-3 bytes)."""
        y0 = states[state_of(y, 0)][0]
        g = lead_states.get((y0, part))
        if g is None:
            g = lead_states[(y0, part)] = len(states)
            states.append((y0, _utf8_length(part[0]) - len(part), part))
        return g

    def advance(g: int, a: tuple) -> int:
        """The state after token representative ``a`` read in (ordinary) state ``g``."""
        y, pend, _ = states[g]
        at = a[0][1:] if (pend and a[1]) else a[0]
        if not at:  # continuation bytes only: the character completes or stays pending
            return state_of(y, pending_after(a, pend)) if pend else g
        for c in at[:-1]:
            y = states[state_of(y + c, 0)][0]
        if a[4] and tail_char.mixed(a[4]):
            return lead_state(y, a[4])
        return state_of(y + at[-1], a[2])

    def dispatch(g: int, a: tuple) -> int:
        """The ordinary state in which continuation token ``a`` read in lead state ``g`` is judged:
        the prefix followed by the exact character ``a`` completes, else by the stand-in of the
        character's bytes with ``a``'s (a longer prefix), else (invalid UTF-8) by the stand-in of the
        character's bytes so far."""
        y, need, part = states[g]
        head = a[3]
        if a[1] == need:
            try:
                return state_of(y + mapper.char((part + head).decode("utf-8")), need)
            except UnicodeDecodeError:
                pass
        prefix = part + head if a[1] < need else part
        return state_of(y + mapper.char(tail_char(prefix)), need)

    succ0 = [advance(0, a) for a in rep_list]
    # ctx_fix[(g, i)] = (cat row, cat_la row or None, successor) where representative i read in state g
    # differs from reading it at a chunk start (row R of the tables; state 0) in verdicts or successor.
    ctx_fix: dict[tuple[int, int], tuple] = {}
    via: dict[tuple[int, int], int] = {}  # (lead state, representative) -> ordinary state it is read in
    screen_default: list[list[int] | None] = [None] * Rb

    def screen(ib: int) -> list[int]:
        """Categories of base ``ib`` at a chunk start before the screening continuations."""
        if screen_default[ib] is None:
            screen_default[ib] = [category(base_list[ib], q) for q in probe_reps]
        return screen_default[ib]

    g = 1
    pbar = tqdm(desc="left-context states", disable=not progress, leave=False)
    while g < len(states):  # states are discovered while the loop runs
        pre = states[g]
        pt, pend, part = pre
        if part:
            for i, a in enumerate(rep_list):
                if a[1]:  # other tokens start a new character inside this one: invalid UTF-8
                    via[(g, i)] = dispatch(g, a)
            g += 1
            pbar.update()
            continue
        for ib, a in enumerate(base_list):
            mid_a = bool(pend and a[1])
            if pend and not mid_a:
                continue  # a new character inside a pending one: invalid UTF-8, never output
            if not mid_a:
                spans = info.chunk_spans(pt + a[0])
                if any(s0 == len(pt) for s0, _ in spans):
                    continue  # a starts a chunk: the context does not reach it
            row = row_la = None
            if mid_a or not all(category(a, q, pre=pre) == d for q, d in zip(probe_reps, screen(ib))):
                row_b = np.array([category(a, bb, pre=pre) for bb in base_list], dtype=np.uint8)
                row_la_b = la_row(a, pre)
                row_la_b[:, L] = row_b[ws_base]
                if mid_a or not (np.array_equal(row_b, cat_b[ib]) and np.array_equal(row_la_b, cat_la_b[ib])):
                    row, row_la = row_b[base_of], row_la_b[ws_expand]
            for i in members[ib]:
                succ = advance(g, rep_list[i])
                row_i, row_la_i = (row, row_la) if row is None or i not in exact else exact_cells(exact[i], row, row_la, pre)
                if row_i is not None or succ != succ0[i]:
                    ctx_fix[(g, i)] = (row_i, row_la_i, succ)
        g += 1
        pbar.update()
        pbar.set_postfix(states=len(states), fixes=len(ctx_fix))
    pbar.close()
    for (g, i), h in via.items():  # a lead state reads a token as the ordinary state it dispatches to
        f = ctx_fix.get((h, i))
        if f is not None:
            ctx_fix[(g, i)] = f
    n_fixes_found = len(ctx_fix)
    ctx_fix = _reachable_fixes(ctx_fix, succ0, [s[1] for s in states], [r[1] > 0 for r in rep_list], cat, cat_la, ws_rep)
    n_fixes_kept = len(ctx_fix)
    ctx_fix, succ0, G = _minimize_context(ctx_fix, succ0, len(states))
    fixes_of_rep: dict[int, list] = {}
    for (g, i), f in ctx_fix.items():
        fixes_of_rep.setdefault(i, []).append((g, *f))
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
        base = cat[ru]
        variants = [(0, base, None, succ0[ru])] + [
            (g, base if row is None else row, row_la, succ) for g, row, row_la, succ in fixes_of_rep.get(ru, ())
        ]
        done: dict[int, tuple[np.ndarray, np.ndarray, bytes]] = {}  # per distinct verdict row
        for g, cat_row, cat_la_row, succ in variants:
            key = id(cat_row) if cat_la_row is None else id(cat_la_row)
            got = done.get(key)
            if got is None:
                cats = cat_row[tok_rep_safe]
                banned = (cats == BANNED) | ((cats == JOIN) & conflict) | not_ok
                lav = la_vector(ru, conflict, cat_la_row)
                if J:
                    banned[ws_tokens] = lav == 0
                packed = np.packbits(banned, bitorder="little")
                got = done[key] = (packed, lav, hashlib.blake2b(packed.tobytes() + lav.tobytes(), digest_size=16).digest())
            packed, lav, h = got
            sig = h + int(succ).to_bytes(4, "little")
            k = class_of_sig.get(sig)
            if k is None:
                k = class_of_sig[sig] = len(rows)
                rows.append(packed)
                sets.append(lav)
                class_group.append(succ)
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
        n_context_prefixes=len(states),
        n_context_fixes=len(ctx_fix),
        n_context_fixes_unreachable=n_fixes_found - n_fixes_kept,
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
