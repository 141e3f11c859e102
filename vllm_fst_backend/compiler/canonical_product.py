"""Canonical product: token DFA ∩ A_BPE (paper 004 Eq. 5 with the implicit A_BPE of §6.5; 000 §3.3),
dead-end free.

The canonical filter (``artifacts/canonical.py``) is a DFA over tokens whose state is
(class ``k`` of the last token, lookahead set ``S``); from (k, S) token v is allowed iff
``v ∉ banned[k]`` (``start_row`` for the start) and ``la_first[v] ∈ S``; the next state is
``(token_class[v], la_sets[k, j(v)])`` for whitespace-final v (index j) and ``(token_class[v], ALL)``
otherwise; EOS is allowed iff END ∈ S. For SentencePiece the byte-fallback rule of the canonical byte
policy (byte tokens only spell whole characters that are not single-character pieces, 000 §4.3) is a
third component ``a``: the state of that character acceptor (0 = not inside a byte-fallback character).
The regex side is the token DFA ``M`` (built with byte policy ``no_ascii_with_piece``, so byte tokens
are 1-byte tokens there; the acceptor restricts them).

A product state is ``(s, a, k, S)``. With ~10⁴ classes, wide regexes (free text) have ~10⁴ reachable
product states per regex state, so the product is not enumerated; instead:

1. **Dead-end analysis** (exact least fixpoint, per regex state, sinks first, iterating inside cycles):
   ``bad[s]`` = the (lookahead set, class) pairs with which (s, 0, k, S) cannot reach acceptance
   (``None`` when there are none, the common case). Per state and lookahead set, all classes are
   tested at once: a few *witness* tokens (allowed at s, successor good, rarely banned) clear most
   classes with one column read of ``banned_rows`` each (only the classes that can occur there: those
   entering s, and for σ != ALL those of the whitespace-final tokens that leave σ,
   :meth:`CanonHelper._sigma_classes`); the remaining classes are checked exactly with
   row operations (``rows AND ~banned AND lookahead rows``), then against the *special* tokens (below)
   in batches of a [tokens × classes] matrix (:meth:`_Analysis.specials_clear`: Tekken has ~14k
   context-dependent tokens; one by one they cost 25 s per free-text compile). States with equal
   (edges, successor verdicts) share the result.
2. **Rows.** ``row(s, 0, k, S) = base[s] & ~banned[k] & la_row[S]`` plus the *special* tokens whose
   successor depends on k (whitespace-final tokens: lookahead; context-dependent tokens: their class,
   ``ctx_classes``; byte-fallback tokens that start a multi-byte character), checked vectorized, plus
   EOS bits when s is accepting and END ∈ S. ``base[s]`` holds the other allowed tokens whose
   successor is good; it is computed per distinct regex state signature.
3. **Representation.** If the token DFA and the reachable product are small (multiple choice, dates,
   IPv4, ...), the product is enumerated into an explicit :class:`CompiledAutomaton` (token-level CSR,
   all arrays complete).
   Otherwise the automaton is *factored*: states are packed ints, rows are computed on first use and
   memoized (:class:`FactoredCanonical`). Both are dead-end free: every allowed token leads to a state
   from which an accepting state is reachable.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import OrderedDict

import numpy as np

from ..errors import CompileBudgetError, EmptyLanguageError
from .compiled import CompiledAutomaton
from .explicit import set_eos_bits
from .token_dfa import TokenDFA
from .verdict_cache import table_digest

__all__ = ["CanonHelper", "canonical_helper", "canonical_automaton", "FactoredCanonical"]

_NO_PENDING = np.zeros((0, 2), dtype=np.int64)
_KERNELS = None


def _kernels():
    """The :mod:`.kernels` module (numba), imported on first use."""
    global _KERNELS
    if _KERNELS is None:
        from . import kernels

        _KERNELS = kernels
    return _KERNELS


def _bool_of_row(row: np.ndarray, V: int) -> np.ndarray:
    return np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")[:V].astype(bool)


def ids_of_row(row: np.ndarray) -> np.ndarray:
    """Sorted token ids (int64) of the set bits of ``row: int32[W]``; cost ~ number of non-zero words."""
    words = np.flatnonzero(row)
    if not len(words):
        return np.zeros(0, dtype=np.int64)
    bits = np.unpackbits(np.ascontiguousarray(row[words]).view(np.uint8), bitorder="little").reshape(len(words), 32)
    return (words[:, None].astype(np.int64) * 32 + np.arange(32, dtype=np.int64)[None, :])[bits.astype(bool)]


def _pack(mask: np.ndarray, W: int) -> np.ndarray:
    out = np.zeros(W * 4, dtype=np.uint8)
    p = np.packbits(mask, bitorder="little")
    out[: len(p)] = p
    return out.view("<i4").astype(np.int32, copy=False)


def _pack_ids(ids: np.ndarray, W: int) -> np.ndarray:
    """``int32[W]``: the token ids ``ids`` as a bit row (vLLM's layout)."""
    r = np.zeros(W, dtype=np.int64)
    np.bitwise_or.at(r, ids >> 5, np.left_shift(1, ids & 31))
    return r.astype(np.uint32).view(np.int32)


# --------------------------------------------------------------------------------------------------
# Per-tokenizer helper (cached on the artifacts object)
# --------------------------------------------------------------------------------------------------


class CanonHelper:
    """Arrays of the canonical filter in the form the product needs, plus the byte-fallback acceptor.
    Built once per tokenizer (:func:`canonical_helper`); read-only afterwards.

    Attributes (V tokens, W words, C classes, L lookahead classes, nσ distinct lookahead sets):
        tclass: ``int32[V]``; banned: ``int32[C, W]``; start_row: ``int32[W]``;
        la_first: ``int64[V]``; j_of: ``int64[V]`` (whitespace-final index or -1);
        sigmas: list of the nσ distinct non-empty lookahead sets (ints), ``ALL`` first;
        nd_ptr: ``int64[n_groups+1]``, nd_tok: ``int64[n]`` -- per context group, the context-dependent
        tokens that do not reach their own class there (a CSR; elsewhere they act like regular tokens);
        ctx_cls_ptr: ``int64[n_ctx+1]``, ctx_cls: ``int64[m]`` -- the distinct classes of each row of
        ``ctx_classes`` (a CSR; a negative entry c read as c + C);
        la_sets_idx: ``int64[C+1, J]`` -- index into ``sigmas`` of ``la_sets`` (-1 = empty set);
        sigma_rows: ``int32[nσ, W]`` -- tokens whose first character's lookahead class is in the set;
        sigma_la: ``bool[nσ, L]``; sigma_end: ``bool[nσ]``; sigma_cls: ``bool[nσ, C]`` -- the classes that
        occur together with each lookahead set (:meth:`_sigma_classes`);
        est_ban: ``int32[V]`` -- 0 for a token no class bans (exact), else 1 + the number of classes
        banning it among a sample (ranks witnesses);
        heavy_pos: ``int32[C]``, heavy_rows: ``int32[n, W]`` -- the classes that ban the most tokens and
        their banned bits class-major (:func:`_heavy_classes`);
        few_ok: ``bool[C]``, few_ptr: ``int64[C+1]``, few_tok: ``int64[n]`` -- the classes that allow at most
        :data:`FEW_ALLOWED` tokens, and those tokens (a CSR; :func:`_few_allowed`);
        acc: ``int32[n_acc, 256]`` byte-fallback character acceptor (``None`` without byte fallback);
        bf_tok: ``int32[256]``; tok_bf_byte: ``int32[V]`` (-1 for non-byte tokens).
    """

    def __init__(self, cf, trie):
        from ..artifacts.canonical import incomplete_tail
        from .regex_to_bytes import _gadget
        from .token_trie import canonical_byte_ranges

        self.V = int(cf.vocab_size)
        self.W = (self.V + 31) // 32
        self.C = int(cf.n_classes)
        self.START = self.C
        self.tclass = np.asarray(cf.token_class, dtype=np.int32)
        self.bt = _banned_transposed(cf, self.V, self.W, self.C)  # int32[W, C]: word-major banned bits
        ban_counts = _class_ban_counts(self.bt)  # int64[C]
        self.few_ok, self.few_ptr, self.few_tok = _few_allowed(self.bt, self.V, ban_counts)
        self._attach_filter(cf)
        self.start_row = np.asarray(cf.start_row, dtype=np.int32)
        self.la_first = np.asarray(cf.la_first).astype(np.int64)
        self.L = int(cf.n_lookahead)
        self.END = 1 << self.L
        self.ALL = (1 << (self.L + 1)) - 1
        self.j_of = np.asarray(cf.la_token_index).astype(np.int64)
        # context-dependent classes (Tekken punctuation runs): class reached = ctx_classes[j2, group(k)]
        ctx = getattr(cf, "ctx_token_index", None)
        self.ctx_j = np.asarray(ctx).astype(np.int64) if ctx is not None else np.full(self.V, -1, np.int64)
        self.class_group = np.asarray(cf.class_group).astype(np.int64) if ctx is not None else np.zeros(self.C + 1, np.int64)
        self.ctx_classes = np.asarray(cf.ctx_classes).astype(np.int64) if ctx is not None else np.zeros((0, 1), np.int64)
        # the context-dependent tokens that do not reach their own class (tclass) in a context group, per
        # group, as a CSR of token ids (elsewhere they act like regular tokens; ~1.5 % of Tekken's pairs)
        has = np.flatnonzero(self.ctx_j >= 0)
        n_grp = max(int(self.class_group.max()) + 1 if len(self.class_group) else 1, self.ctx_classes.shape[1])
        gi, vi = np.nonzero((self.ctx_classes[self.ctx_j[has]] != self.tclass[has].astype(np.int64)[:, None]).T)
        self.nd_ptr = np.zeros(n_grp + 1, dtype=np.int64)
        np.cumsum(np.bincount(gi, minlength=n_grp), out=self.nd_ptr[1:])
        self.nd_tok = has[vi].astype(np.int64)
        # the distinct classes each context-dependent token can reach (ctx_classes rows deduplicated, as a
        # CSR; a negative entry read as numpy indexes it), for the entering classes of the analysis
        wrapped = np.sort(np.where(self.ctx_classes < 0, self.ctx_classes + self.C, self.ctx_classes), axis=1)
        first = np.ones(wrapped.shape, dtype=bool)
        first[:, 1:] = wrapped[:, 1:] != wrapped[:, :-1]
        self.ctx_cls_ptr = np.zeros(wrapped.shape[0] + 1, dtype=np.int64)
        np.cumsum(first.sum(axis=1), out=self.ctx_cls_ptr[1:])
        self.ctx_cls = wrapped[first].astype(np.int64)
        la_sets = np.asarray(cf.la_sets).astype(np.uint64)
        vals = sorted(set(int(x) for x in np.unique(la_sets)) - {0, self.ALL})
        self.sigmas = [self.ALL] + vals
        sig_arr = np.asarray(self.sigmas, dtype=np.uint64)
        order = np.argsort(sig_arr)
        pos = np.searchsorted(sig_arr[order], la_sets)
        pos = np.minimum(pos, len(sig_arr) - 1)
        hit = sig_arr[order][pos] == la_sets
        self.la_sets_idx = np.where(hit, order[pos], -1).astype(np.int64)
        la_rows = np.asarray(cf.la_rows, dtype=np.int32)
        self.sigma_la = np.array([[(s >> c) & 1 == 1 for c in range(self.L)] for s in self.sigmas], dtype=bool)
        self.sigma_end = np.array([bool(s & self.END) for s in self.sigmas], dtype=bool)
        self.sigma_rows = np.zeros((len(self.sigmas), self.W), dtype=np.int32)
        for i in range(len(self.sigmas)):
            for c in np.flatnonzero(self.sigma_la[i]).tolist():
                self.sigma_rows[i] |= la_rows[c]
        self.sigma_cls = self._sigma_classes()
        lf = self.la_first
        self.sigma_tok = np.stack([(lf >= 0) & self.sigma_la[i][np.maximum(lf, 0)] for i in range(len(self.sigmas))])
        self.sigma_full = np.array([bool(self.sigma_la[i].all()) for i in range(len(self.sigmas))], dtype=bool)
        # ban counts: 0 exactly for the tokens no class bans (a witness that clears every class at once,
        # :func:`.kernels.witness_clear`), else 1 + the count among a sample of classes (ranks witnesses)
        n_sample = min(self.C, 384)
        idx = np.linspace(0, self.C - 1, n_sample).astype(np.int64) if self.C else np.zeros(0, np.int64)
        est = np.zeros(self.W * 32, dtype=np.int32)
        for a in range(0, len(idx), 64):
            rows = np.ascontiguousarray(self.bt[:, idx[a : a + 64]].T).view(np.uint8)
            est += np.unpackbits(rows, axis=1, bitorder="little").sum(axis=0, dtype=np.int32)
        self.est_ban = np.where(_banned_by_some(self.bt, self.V), est[: self.V] + 1, 0).astype(np.int32)
        self.heavy_pos, self.heavy_rows = _heavy_classes(self.bt, self.V, ban_counts)
        # byte fallback acceptor (SentencePiece canonical byte policy)
        self.bf_tok = np.asarray(trie.byte_fallback, dtype=np.int32)
        self.tok_bf_byte = np.full(self.V, -1, dtype=np.int32)
        has = self.bf_tok >= 0
        self.tok_bf_byte[self.bf_tok[has]] = np.flatnonzero(has).astype(np.int32)
        self.acc = None
        if has.any():
            ranges = canonical_byte_ranges(trie)
            if ranges:
                self.acc = _gadget((tuple(ranges),))
        self.n_acc = 1 if self.acc is None else int(self.acc.shape[0])
        # which classes can be the last token's class at a character boundary / inside a character
        # (a token ending inside a UTF-8 character leads to a regex state inside a character)
        ends_mid = np.zeros(self.V, dtype=bool)
        ends_cb = np.ones(self.V, dtype=bool)
        for t, b in enumerate(trie.token_bytes):
            if not b:
                continue
            if all((x & 0xC0) == 0x80 for x in b):  # only continuation bytes: may complete a character or not
                ends_mid[t] = True
            elif incomplete_tail(b) < len(b):
                ends_mid[t] = True
                ends_cb[t] = False
        ends_mid |= self.tok_bf_byte >= 0
        valid = self.tclass >= 0
        self.cls_boundary = np.zeros(self.C, dtype=bool)
        self.cls_mid = np.zeros(self.C, dtype=bool)
        self.cls_boundary[self.tclass[valid & ends_cb]] = True
        self.cls_mid[self.tclass[valid & ends_mid]] = True
        for j2 in range(self.ctx_classes.shape[0]):  # context-dependent tokens may reach other classes
            row = self.ctx_classes[j2]
            self.cls_boundary[row[row >= 0]] = True
            self.cls_mid[row[row >= 0]] = True

    def _sigma_classes(self) -> np.ndarray:
        """``bool[nσ, C]``: the classes a product state can hold together with lookahead set σ. Row 0
        (``ALL``) is every class. A set σ != ALL is only entered by a whitespace-final token v, from some
        previous class k, with σ = ``la_sets[k, j(v)]`` and the class v reaches (``tclass[v]``; for a
        context-dependent v any of its ``ctx_classes``): row i holds the classes of the whitespace-final
        tokens v for which some k gives σ_i. Pairs outside it never occur, so the dead-end analysis need
        not decide them (most of its row scans were such pairs: a whitespace class with the lookahead
        set of another whitespace token)."""
        nsig = len(self.sigmas)
        out = np.zeros((nsig, self.C), dtype=bool)
        out[0] = True
        J = self.la_sets_idx.shape[1]
        present = np.zeros((J, nsig), dtype=bool)  # present[j, i]: some previous class gives σ_i to index j
        for i in range(1, nsig):
            present[:, i] = (self.la_sets_idx == i).any(axis=0)
        ws = np.flatnonzero((self.j_of >= 0) & (self.tclass >= 0))
        for v in ws.tolist():
            sig = np.flatnonzero(present[self.j_of[v]])
            if not len(sig):
                continue
            if self.ctx_j[v] >= 0:
                cs = self.ctx_classes[self.ctx_j[v]]
                cs = cs[cs >= 0]
            else:
                cs = self.tclass[v : v + 1]
            out[np.ix_(sig, cs)] = True
        return out

    def acts_regular(self, toks: np.ndarray, dj: np.ndarray, g: int) -> np.ndarray:
        """``bool[len(toks)]``: token ``toks[i]`` (context-dependent index ``dj[i]``, -1 for a token
        not considered) reaches its own class in context group g (the reference of ``nd_ptr/nd_tok``)."""
        out = np.zeros(len(toks), dtype=bool)
        c = np.flatnonzero(dj >= 0)
        out[c] = self.ctx_classes[dj[c], g] == self.tclass[toks[c]]
        return out

    def _attach_filter(self, cf) -> None:
        """Views of the filter's own arrays (not stored by :mod:`.table_store`): the CSR of the banned
        sets (row k is contiguous: FactoredCanonical's row kernel reads it)."""
        ptr = getattr(cf, "banned_ptr", None)
        self.banned_ptr = np.asarray(ptr, dtype=np.int64) if ptr is not None else np.zeros(0, np.int64)
        self.banned_ids = np.asarray(cf.banned_ids) if ptr is not None else np.zeros(0, np.uint16)
        # the row kernel reads these memory maps at random on every first visit of a state: fault their
        # pages in now (one byte read per page), not one by one during decoding
        for a in (self.banned_ptr, self.banned_ids):
            if a.size and a.flags.c_contiguous:
                int(a.reshape(-1).view(np.uint8)[::4096].sum())

    def table_state(self) -> tuple[dict, dict]:
        """``(scalars, arrays)``: the helper's own tables for :mod:`.table_store` (JSON-serializable
        scalars; numpy arrays), without the filter's arrays and without private per-process caches."""
        scalars, arrays = {}, {}
        for k, v in self.__dict__.items():
            if k.startswith("_") or k in ("banned_ptr", "banned_ids"):
                continue
            if isinstance(v, np.ndarray):
                arrays[k] = v
            else:
                scalars[k] = v
        return scalars, arrays

    # arrays that stay memory-mapped when the tables come from the host's store: the banned matrix, read
    # by the dead-end analysis only (739 MB for Tekken). The others are copied into the process's own
    # memory: the decode-step kernels read them at random, and through a mapping of 4 KB pages (numpy's
    # own large arrays get transparent huge pages) the per-token advance was markedly slower.
    SHARED_ARRAYS = ("bt",)

    @classmethod
    def from_tables(cls, cf, scalars: dict, arrays: dict, copy: bool = True) -> "CanonHelper":
        """Inverse of :meth:`table_state` for the filter ``cf``: arrays named in :attr:`SHARED_ARRAYS`
        are used as given (e.g. copy-on-write memory maps: nothing writes into a helper after
        construction), the others copied unless ``copy`` is False (arrays built in this process)."""
        h = cls.__new__(cls)
        h.__dict__.update(scalars)
        h.__dict__.update({k: (np.array(a) if copy and k not in cls.SHARED_ARRAYS else a) for k, a in arrays.items()})
        h._attach_filter(cf)
        return h

    def next_cls(self, k, v: int):
        """Class reached by token ``v`` from class(es) ``k`` (int or int array; START = C)."""
        j = int(self.ctx_j[v])
        if j < 0:
            return int(self.tclass[v]) if np.isscalar(k) else np.full(len(k), int(self.tclass[v]), np.int64)
        row = self.ctx_classes[j]
        return int(row[self.class_group[k]]) if np.isscalar(k) else row[self.class_group[np.asarray(k)]]

    def next_cls_matrix(self, k_arr: np.ndarray, toks: np.ndarray) -> np.ndarray:
        """``int64[len(toks), len(k_arr)]``: class reached by each token of ``toks`` from each class of
        ``k_arr`` (START = C allowed); one gather from ``ctx_classes`` for the context-dependent ones."""
        k_arr = np.asarray(k_arr, dtype=np.int64)
        toks = np.asarray(toks, dtype=np.int64)
        out = np.repeat(self.tclass[toks].astype(np.int64)[:, None], len(k_arr), axis=1)
        j = self.ctx_j[toks]
        ctx = np.flatnonzero(j >= 0)
        if len(ctx):
            out[ctx] = self.ctx_classes[j[ctx]][:, self.class_group[k_arr]]
        return out

    def banned_matrix(self, k_arr: np.ndarray, toks: np.ndarray) -> np.ndarray:
        """``bool[len(toks), len(k_arr)]``: whether class ``k_arr[c]`` bans token ``toks[r]`` (classes only,
        not START). One gather of the word-major copy ``bt``."""
        toks = np.asarray(toks, dtype=np.int64)
        words = self.bt[np.ix_(toks >> 5, np.asarray(k_arr, dtype=np.int64))]
        return ((words >> (toks & 31)[:, None].astype(np.int32)) & 1).astype(bool)

    def bans(self, w: int, k_arr: np.ndarray) -> np.ndarray:
        """``bool[len(k_arr)]``: whether class ``k_arr[i]`` (not START) bans token ``w`` (a gather from one
        contiguous row of the word-major copy ``bt``)."""
        return ((self.bt[w >> 5, k_arr] >> (w & 31)) & 1).astype(bool)

    def allows_some(self, row: np.ndarray, k_arr: np.ndarray) -> np.ndarray:
        """``bool[len(k_arr)]``: whether class ``k_arr[i]`` (not START) bans not every token of the bit
        row ``row`` (``int32[W]``). Gathers only ``row``'s nonzero words, 512 classes at a time."""
        words = np.flatnonzero(row)
        out = np.zeros(len(k_arr), dtype=bool)
        if len(words) and len(k_arr):
            _kernels().allows_some(self.bt, self.few_ok, self.few_ptr, self.few_tok, self.heavy_pos, self.heavy_rows,
                                   np.ascontiguousarray(row, dtype=np.int32), words.astype(np.int64),
                                   np.ascontiguousarray(k_arr, dtype=np.int64), out)
        return out

    def allows_some_numpy(self, row: np.ndarray, k_arr: np.ndarray) -> np.ndarray:
        """Reference (numpy) :meth:`allows_some`, for tests."""
        words = np.flatnonzero(row)
        out = np.zeros(len(k_arr), dtype=bool)
        for a0 in range(0, len(k_arr), 512):
            part = np.asarray(k_arr[a0 : a0 + 512], dtype=np.int64)
            out[a0 : a0 + 512] = ((~self.bt[np.ix_(words, part)].T) & row[words]).any(axis=1)
        return out

    def not_banned_row(self, k: int) -> np.ndarray:
        """``int32[W]``: tokens allowed after class ``k`` (``start_row`` for START)."""
        if k == self.START:
            return self.start_row
        return ~self.bt[:, k]

    def banned_bit(self, k: int, v: int) -> bool:
        """Whether ``v`` may not follow class ``k``."""
        if k == self.START:
            return not ((int(self.start_row[v >> 5]) >> (v & 31)) & 1)
        return bool((int(self.bt[v >> 5, k]) >> (v & 31)) & 1)

    @property
    def nbytes(self) -> int:
        return int(self.bt.nbytes + self.est_ban.nbytes + self.la_sets_idx.nbytes + self.sigma_rows.nbytes)


FEW_ALLOWED = 64  # a class allowing at most this many tokens has them listed (CanonHelper.few_tok)


def _banned_by_some(bt: np.ndarray, V: int) -> np.ndarray:
    """``bool[V]``: the tokens that some class bans (any bit of the token's column in the word-major
    banned bits ``bt: int32[W, C]``), OR-ed over blocks of classes (no copy of ``bt``)."""
    acc = np.zeros(bt.shape[0], dtype=np.int32)
    for a in range(0, bt.shape[1], 4096):
        acc |= np.bitwise_or.reduce(bt[:, a : a + 4096], axis=1)
    return np.unpackbits(acc.view(np.uint8), bitorder="little")[:V].astype(bool)


#: classes banning more than V / HEAVY_SHARE tokens get a contiguous copy of their banned bits
#: (:func:`_heavy_classes`), at most HEAVY_MAX of them (SmolLM2: 256 of 14,329 classes, 1.5 MB; Tekken:
#: 108 of 45,105, 1.8 MB)
HEAVY_SHARE = 8
HEAVY_MAX = 256


def _class_ban_counts(bt: np.ndarray) -> np.ndarray:
    """``int64[C]``: the set bits of each class's column of ``bt`` (``int32[W, C]``, word-major banned
    bits; the padding bits past the last token included): one popcount pass over it (Tekken ~0.15 s,
    once per tokenizer)."""
    cnt = np.zeros(bt.shape[1], dtype=np.int64)
    for a in range(0, bt.shape[0], 256):
        cnt += np.bitwise_count(bt[a : a + 256].view(np.uint32)).sum(axis=0, dtype=np.int64)
    return cnt


def _heavy_classes(bt: np.ndarray, V: int, cnt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(heavy_pos int32[C], heavy_rows int32[n, W])``: the classes of ``bt`` (word-major banned bits,
    ``int32[W, C]``; ``cnt``: their ban counts, :func:`_class_ban_counts`) that ban the most tokens, more
    than ``V / HEAVY_SHARE`` (at most :data:`HEAVY_MAX`), and their banned bits class-major (``heavy_pos[k]``: k's row, -1 for the others). After the
    witnesses, the classes left for a row check are mostly these (the classes that ban every witness),
    and a class that bans the whole row is decided only after reading all its words: along one row
    here instead of one cache line of ``bt`` per word (``kernels.allows_some``; Tekken's
    ``[a-z]{2,10}...`` e-mail regex: 34 such classes over ~3,900 words, ~1 ms per check before)."""
    C = bt.shape[1]
    order = np.argsort(-cnt, kind="stable")[:HEAVY_MAX]
    heavy = np.sort(order[cnt[order] > V // HEAVY_SHARE])
    pos = np.full(C, -1, dtype=np.int32)
    pos[heavy] = np.arange(len(heavy), dtype=np.int32)
    rows = np.ascontiguousarray(bt[:, heavy].T, dtype=np.int32) if len(heavy) else np.zeros((1, bt.shape[0]), np.int32)
    return pos, rows


def _never_banned_row(H) -> np.ndarray:
    """``int32[W]``: the tokens no class bans (``est_ban == 0``), packed; made once per helper."""
    row = getattr(H, "_fst_never_row", None)
    if row is None:
        row = H._fst_never_row = _pack(H.est_ban == 0, H.W)
        row.setflags(write=False)
    return row


def _few_allowed(bt: np.ndarray, V: int, banned: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(few_ok bool[C], few_ptr int64[C+1], few_tok int64[n])``: the classes after which at most
    :data:`FEW_ALLOWED` tokens are allowed and, as a CSR, those tokens (sorted ids). Such classes are
    bad almost everywhere (Tekken: 10 classes, 148 tokens in all), and proving a class bad against a row
    otherwise reads every nonzero word of the row (``kernels.allows_some``). From ``bt`` (``int32[W, C]``,
    word-major banned bits) and its columns' set bits ``banned`` (:func:`_class_ban_counts`)."""
    W, C = bt.shape
    allowed = W * 32 - banned
    pad = W * 32 - V  # bits past the last token (not tokens, whatever their value)
    if pad:
        allowed -= np.bitwise_count((~bt[W - 1]).view(np.uint32) >> np.uint32(32 - pad)).astype(np.int64)
    ok = allowed <= FEW_ALLOWED
    ptr = np.zeros(C + 1, dtype=np.int64)
    toks = []
    for k in np.flatnonzero(ok).tolist():
        bits = np.unpackbits((~bt[:, k]).view(np.uint8), bitorder="little")[:V]
        toks.append(np.flatnonzero(bits))
        ptr[k + 1] = len(toks[-1])
    np.cumsum(ptr, out=ptr)
    tok = np.concatenate(toks).astype(np.int64) if toks else np.zeros(0, np.int64)
    return ok, ptr, tok


def _banned_transposed(cf, V: int, W: int, C: int) -> np.ndarray:
    """``int32[W, C]``: ``bt[w, k]`` = word w of class k's banned row, built from the stored CSR in chunks
    (never materializing the row-major dense matrix): columns of ``banned_rows`` (all classes banning one
    token) become contiguous reads."""
    bt = np.empty((W, C), dtype=np.int32)
    ptr = getattr(cf, "banned_ptr", None)
    if ptr is None:  # older in-memory filters: transpose the dense rows
        bt[:] = np.asarray(cf.banned_rows).T
        return bt
    from ..artifacts.canonical import csr_to_rows

    ptr = np.asarray(ptr)
    H = (int(ptr.shape[0]) - 1) // max(C, 1) if C else 1
    ids = cf.banned_ids
    for a in range(0, C, 1024):
        b = min(C, a + 1024)
        rows = csr_to_rows(ptr[a * H : b * H + 1], ids, V)
        bt[:, a:b] = rows[:, :W].T
    return bt


_HELPER_LOCK = threading.Lock()


def canonical_helper(artifacts, trie) -> CanonHelper:
    """The cached :class:`CanonHelper` of ``artifacts``: on first use in a process mapped from the host's
    table store (:mod:`.table_store`, a few ms) or built there (0.4 s for SmolLM2, ~8 s for Tekken) and
    stored for the host's other processes. Artifacts without a manifest and fingerprint (in-memory test
    objects) are always built in-process."""
    with _HELPER_LOCK:
        h = getattr(artifacts, "_fst_canon_helper", None)
        if h is None:
            cf = artifacts.canonical
            if isinstance(getattr(artifacts, "manifest", None), dict) and getattr(artifacts, "fingerprint", None):
                from .table_store import load_or_build

                (scalars, arrays), how = load_or_build("canon", artifacts, lambda: CanonHelper(cf, trie).table_state())
                h = CanonHelper.from_tables(cf, scalars, arrays, copy=how != "built")
            else:
                h = CanonHelper(cf, trie)
            try:
                setattr(artifacts, "_fst_canon_helper", h)
            except AttributeError:
                pass
        return h


# --------------------------------------------------------------------------------------------------
# Dead-end analysis
# --------------------------------------------------------------------------------------------------


def _postorder(comp: list[int], members: set, ptr: np.ndarray, nxt: np.ndarray) -> list[int]:
    """The states of an SCC in DFS postorder over its own edges, from the state Tarjan's search entered
    it by (``comp[-1]``): a state comes after every successor the search reached from it, so only the
    edges back to a state still on the search's path (one per cycle) point to a state evaluated later."""
    seen = {comp[-1]}
    out: list[int] = []
    stack = [(comp[-1], iter(sorted(set(nxt[int(ptr[comp[-1]]) : int(ptr[comp[-1] + 1])].tolist()))))]
    while stack:
        s, it = stack[-1]
        for t in it:
            if t in members and t not in seen:
                seen.add(t)
                stack.append((t, iter(sorted(set(nxt[int(ptr[t]) : int(ptr[t + 1])].tolist())))))
                break
        else:
            stack.pop()
            out.append(s)
    out.extend(s for s in comp if s not in seen)  # (none: an SCC is strongly connected)
    return out


def _scc_csr(n: int, ptr: np.ndarray, nxt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tarjan's SCCs of the token DFA's state graph (:func:`.kernels.sccs`; successors deduplicated and
    in ascending order), sinks first (reverse topological order), as a CSR: ``(comp_ptr int64[n_comps +
    1], nodes int64[n])``."""
    src = np.repeat(np.arange(n, dtype=np.int64), np.diff(ptr))
    pairs = np.unique(src * n + nxt.astype(np.int64))
    cuts = np.searchsorted(pairs // n, np.arange(n + 1)).astype(np.int64)
    return _kernels().sccs(cuts, pairs % n)


class _Analysis:
    """Dead-end analysis state for one compile (module docstring, step 1).

    ``use_kernels`` (default True): the hot loops run as numba kernels (:meth:`CanonHelper.allows_some`,
    :meth:`_pairs_clear`) or vectorized (:meth:`byte_moves`, :meth:`opening_byte_ok`: one
    :meth:`inner_good` per distinct (class reached, σ)); False selects the reference path (same
    results; tests compare them)."""

    use_kernels = True

    def __init__(self, M: TokenDFA, H: CanonHelper, deadline: float, n_char_states: int):
        self.M = M
        # regex states inside a UTF-8 character (only tokens ending inside a character lead there)
        self.mid = np.asarray(M.byte_state) >= n_char_states
        # states entered by a group holding a whitespace-final token (only those see σ != ALL)
        ws_groups = np.zeros(max(M.num_groups, 1), dtype=bool)
        tgw = M.token_group[(H.j_of >= 0) & (M.token_group >= 0)]
        ws_groups[tgw] = True
        self.ws_in = np.zeros(M.num_states, dtype=bool)
        if len(M.edge_group):
            self.ws_in[M.edge_next[ws_groups[M.edge_group]]] = True
        self.H = H
        self.deadline = deadline
        self.nsig = len(H.sigmas)
        self._las = [np.flatnonzero(H.sigma_la[i]) for i in range(self.nsig)]  # lookahead classes per σ
        tg = M.token_group
        self.G = M.num_groups
        self._token_arrays()
        self._group_arrays()
        self.best = self._witness_table()
        # special tokens: list with their group
        self.spec_toks = np.flatnonzero(self.special & (tg >= 0)).astype(np.int64)
        self.spec_group = tg[self.spec_toks]
        self._sp_e = None  # (special_prep's arrays: built on first use, _special_order)
        self._stacks: dict = {}  # _pairs_clear: distinct successor tags (bytes) -> their tables stacked
        self._sp_calls = 0
        # per-state results
        S = M.num_states
        self.bad: list = [None] * S  # None (all good) or bool[nsig, C]
        self.tag = np.zeros(S, dtype=np.int64)  # 0 = all good; else unique id of the bad table
        self._tags: dict = {}
        self._tag_full: dict = {}  # tag -> the bad table (bool[nsig, C]) with that tag
        self._tab = np.zeros((64, H.C), dtype=bool)
        self._row_cache: dict = {}
        self._btok: dict = {}
        self._grows: dict = {}
        self._gmat = None  # int32[G, W] group rows (regular tokens), filled on first use
        self._gbuilt = None
        self._tok_cache: dict = {}
        self._cache: dict = {}
        self._inner_memo: dict = {}
        self._bstatic: dict = {}
        self._cls_ids: dict = {}  # mid (bool) -> per σ, the ids of H.cls_mid / H.cls_boundary in sigma_cls[σ]
        self._xk = None  # (verdict cache, group hashes, per-state entering-class sums, tag multipliers)
        self._xstatic = None  # (uint64[S, 3] per state: the part of its content key made once, _xkey_init)
        self._wv = None  # (the arrays of kernels.witness_verdict, _witness_args)
        self._memo_tab = None  # (the run's memo of content keys, _run_singles)
        self._n_free = np.zeros(1, np.int64)  # (states kernels.memo_run found all good by their witnesses)
        self._tag_of_obj: dict = {}  # id(table) -> tag (_set)
        self._pinned: list = []  # (those tables, kept alive)
        # entering classes (see entering_classes); not with a byte-fallback acceptor (inner goodness
        # reads other classes)
        self._ent_ptr = self._ent_cls = self._ent_wide = None
        if H.acc is None:
            self._ent_ptr, self._ent_cls, self._ent_wide = self._entering_table()

    def _token_arrays(self) -> None:
        """The per-token arrays (V-sized, not pickled): the byte-fallback acceptor's move from state 0
        (``bf_start``), the token categories ``special`` / ``regular`` and ``tclass_safe`` depend on the
        tokenizer only, so they are built once per process and helper and shared (never written); the
        tokens of each group (``g_toks``, ``g_ptr``, ``g_size``) on first use (:meth:`__getattr__`)."""
        H = self.H
        cats = getattr(H, "_fst_tok_cats", None)
        if cats is None:
            valid = H.tclass >= 0
            is_bf = H.tok_bf_byte >= 0
            bf_start = np.full(H.V, -3, dtype=np.int64)  # acceptor move from state 0 (-1 reject, <=-2 exit)
            if H.acc is not None:
                bf_start[is_bf] = H.acc[0, H.tok_bf_byte[is_bf]]
            bf_inner = is_bf & (bf_start >= 0)
            bf_reject = is_bf & (bf_start == -1)
            special = valid & ((H.j_of >= 0) | bf_inner | (H.ctx_j >= 0))
            regular = valid & ~special & ~bf_reject
            cats = H._fst_tok_cats = (bf_start, special, regular, np.maximum(H.tclass, 0))  # (class, -1 -> 0)
        self.bf_start, self.special, self.regular, self.tclass_safe = cats
        self._pgrp = PackedGroupRows(H.W)  # (regular_row; not pickled)

    def _group_arrays(self) -> None:
        """The tokens of each group: ``g_toks`` (token ids grouped), ``g_ptr`` (``int64[G+1]`` offsets),
        ``g_size``."""
        g_toks, g_ptr = _kernels().group_tokens(np.ascontiguousarray(self.M.token_group, dtype=np.int32), self.G)
        self.g_toks, self.g_ptr, self.g_size = g_toks, g_ptr, np.diff(g_ptr)

    def _expand_tags(self) -> None:
        """``_tag_full`` (tag -> ``bool[nσ, C]``) and ``bad`` (per state) from the stored flat indices."""
        full = {}
        for tag, (shape, idx) in self.__dict__.pop("_tag_compact").items():
            tab = np.zeros(shape, dtype=bool)
            tab.flat[idx] = True
            full[tag] = tab
        self._tag_full = full
        self.bad = [None if t == 0 else full[t] for t in self.tag.tolist()]

    def __getattr__(self, name: str):
        """A loaded analysis builds some members on first use, not in :meth:`__setstate__` (loading is on
        the engine's request path; a decode that stays in the stored rows never needs them): the group
        arrays (:meth:`_group_arrays`) and the bad tables (:meth:`_expand_tags`)."""
        if name in ("g_toks", "g_ptr", "g_size") and "M" in self.__dict__:
            self._group_arrays()
        elif name in ("bad", "_tag_full") and "_tag_compact" in self.__dict__:
            self._expand_tags()
        else:
            raise AttributeError(name)
        return self.__dict__[name]

    def _witness_table(self) -> np.ndarray:
        """``int32[G, L]``: the best witness per (group, lookahead class): the regular token of the group
        with that first lookahead class and the lowest estimated ban count (-1: none)."""
        H, tg = self.H, self.M.token_group
        best = np.full((self.G, max(H.L, 1)), -1, dtype=np.int32)
        ok = self.regular & (tg >= 0) & (H.la_first >= 0)
        _kernels().witness_table(ok, np.ascontiguousarray(tg, dtype=np.int32), H.la_first,
                                 np.ascontiguousarray(H.est_ban, dtype=np.int32), best)
        return best

    # memo tables of the analysis itself (rebuilt on demand): not part of the pickled state
    _MEMOS = ("_cache", "_row_cache", "_btok", "_grows", "_tok_cache", "_inner_memo", "_bstatic", "_cls_ids", "_stacks")

    def __getstate__(self) -> dict:
        """Pickled state (``compiler/persist.py``): without the analysis' memo tables, and the bad tables
        once per distinct table as the flat indices of their bad entries (few: most classes are good);
        ``bad`` is rebuilt from them on load, ``_tab`` and ``_tags`` when first needed (the engine loading
        an automaton never needs them)."""
        state = self.__dict__.copy()
        for name in self._MEMOS:
            state[name] = {}
        state["_gmat"] = state["_gbuilt"] = state["_sp_e"] = None
        state["_tag_compact"] = {tag: (tab.shape, np.flatnonzero(tab).astype(np.int32))
                                 for tag, tab in self._tag_full.items()}
        state["_tab"] = state["_tags"] = None
        # the entering classes serve the analysis only (a loaded one decides every class)
        state["_ent_ptr"] = state["_ent_cls"] = state["_ent_wide"] = None
        # (V- and G-sized, rebuilt on load; the witness table only when a loaded analysis analyses again)
        state["best"] = None
        state["_xk"] = state["_xstatic"] = state["_static_id"] = state["_wv"] = None  # (the process's verdict cache; rebuilt
        state["_memo_tab"] = None  # to analyse again, with the run's memo of keys)
        state["_tag_of_obj"], state["_pinned"] = {}, []
        for name in ("bad", "_tag_full", "g_toks", "g_ptr", "g_size", "bf_start", "special", "regular",
                     "tclass_safe", "_pgrp"):
            state.pop(name, None)  # (bad, _tag_full and the group arrays: rebuilt on first use)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._token_arrays()

    def _tag_index(self) -> None:
        """Rebuild ``_tags`` (table digest -> tag, needed only to analyse again) and ``_tab`` (σ=ALL rows per
        tag) from ``_tag_full`` (after loading: they are not pickled)."""
        self._tags = {table_digest(tab): tag for tag, tab in self._tag_full.items()}
        if self._tab is None:
            self._tab_index()

    def _tab_index(self) -> None:
        """Rebuild ``_tab`` alone (what a loaded automaton's base rows read): for a loaded analysis whose bad
        tables are not expanded yet, straight from their stored bad entries (the σ = ALL row's are the
        flat indices below C), without expanding every table (the engine loads an automaton per request
        and builds a first row at once: the expansion was most of that row's cost)."""
        compact = self.__dict__.get("_tag_compact")
        if compact is None:
            self._tab = np.zeros((max(self._tag_full, default=0) + 64, self.H.C), dtype=bool)
            for tag, tab in self._tag_full.items():
                self._tab[tag] = tab[0]
            return
        self._tab = np.zeros((max(compact, default=0) + 64, self.H.C), dtype=bool)
        for tag, (shape, idx) in compact.items():
            self._tab[tag, idx[: np.searchsorted(idx, shape[1])]] = True

    def _n_tags(self) -> int:
        """The number of distinct bad tables (tags ``1..n``), without expanding a loaded analysis' tables."""
        compact = self.__dict__.get("_tag_compact")
        return len(compact) if compact is not None else len(self._tag_full)

    def tag_sigma_bits(self, tag: int) -> np.ndarray:
        """``int64[C]``: for the bad table with this tag, bit σ set per class when (class, σ) is bad (from
        the stored bad entries when the analysis was loaded and its tables are not expanded)."""
        compact = self.__dict__.get("_tag_compact")
        if compact is None:
            b = self._tag_full[tag]
            return (b.astype(np.int64) << np.arange(b.shape[0], dtype=np.int64)[:, None]).sum(axis=0)
        (_, C), idx = compact[tag]
        out = np.zeros(C, dtype=np.int64)
        np.bitwise_or.at(out, idx % C, np.int64(1) << (idx // C).astype(np.int64))
        return out

    # --- helpers ---------------------------------------------------------------------------------------

    def succ_good(self, t: int, cls: int, sig: int) -> bool:
        """Whether (t, 0, cls, sigmas[sig]) is good (sig -1 = empty set: never)."""
        if sig < 0:
            return False
        b = self.bad[t]
        return b is None or not b[sig, cls]

    def succ_good_many(self, tgts: np.ndarray, cv: np.ndarray, nsig: np.ndarray) -> np.ndarray:
        """Vectorized :meth:`succ_good`: ``tgts: int64[n]`` target regex state per row of ``cv``/``nsig``
        (``int64[n]`` or ``int64[n, m]``, class reached and lookahead-set index). Returns bool of
        ``cv``'s shape; one gather per distinct target state whose table is not all good."""
        good = nsig >= 0
        if not len(tgts):
            return good
        # tag 0 <=> bad table None (all good): only rows whose target has a table need a gather, one per
        # distinct tag (equal tags = equal tables)
        tags = self.tag[tgts]
        nz = np.flatnonzero(tags)
        if not len(nz):
            return good
        tz = tags[nz]
        if (tz == tz[0]).all():
            rows = nz
            good[rows] &= ~self._tag_full[int(tz[0])][np.maximum(nsig[rows], 0), cv[rows]]
            return good
        order = np.argsort(tz, kind="stable")
        ts = tz[order]
        cuts = np.concatenate([[0], np.flatnonzero(ts[1:] != ts[:-1]) + 1, [len(ts)]])
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            rows = nz[order[a:b]]
            good[rows] &= ~self._tag_full[int(ts[a])][np.maximum(nsig[rows], 0), cv[rows]]
        return good

    # special tokens checked per batch in specials_clear: the [tokens x classes] work arrays stay
    # below this many entries
    _BATCH_CELLS = 1 << 22

    def specials_clear(self, k_arr: np.ndarray, sig: int, s: int) -> np.ndarray:
        """``bool[len(k_arr)]``: for each class of ``k_arr``, whether some special token allowed at regex
        state s (:meth:`specials_of`) is allowed after (class, σ) and leads to a good state. Per context
        group of the classes: context-dependent tokens that reach their default class there are tested
        like regular tokens (a packed row per group); the others go through :meth:`_pairs_clear`,
        vectorized over tokens × classes in batches (Tekken has ~14k context-dependent tokens);
        byte-fallback tokens that open a character (SentencePiece, ≤ 256) go through
        :meth:`opening_byte_ok` one by one. The tokens of s are prepared in one kernel call
        (:func:`.kernels.special_prep`; numpy with ``use_kernels`` off)."""
        H = self.H
        out = np.zeros(len(k_arr), dtype=bool)
        if not len(k_arr) or not len(self.spec_toks):
            return out
        if self.use_kernels:
            vt, vg, jw, dj, good_t, by_id, row_reg, row_all, inner_tok, inner_tgt = self._special_prep(s, sig)
        else:
            toks, tgts = self.specials_of(s)
            lf = H.la_first[toks]
            sel = (H.tclass[toks] >= 0) & (lf >= 0) & H.sigma_la[sig][np.maximum(lf, 0)]
            inner = sel & (H.tok_bf_byte[toks] >= 0) & (self.bf_start[toks] >= 0)
            inner_tok, inner_tgt = toks[inner], tgts[inner]
            sel &= ~inner
            vt, vg = toks[sel], tgts[sel]
            vt_order = np.argsort(H.est_ban[vt], kind="stable")  # likely witnesses first
            # (toks come sorted by id: keep that order's positions for _pairs_clear's lookups)
            by_id = (vt, np.empty(len(vt), dtype=np.int64))
            by_id[1][vt_order] = np.arange(len(vt), dtype=np.int64)
            vt, vg = vt[vt_order], vg[vt_order]
            jw = H.j_of[vt]
            # A context-dependent token that is not whitespace-final and reaches its default class in
            # the context group of class k acts after k like a regular token: successor (target,
            # default class, ALL). So per group: one successor check per such token and one packed
            # row test per class; the per-pair path below only gets the other tokens (for group 0,
            # the chunk start, that leaves the whitespace-final ones).
            ctx_only = (jw < 0) & (H.ctx_j[vt] >= 0)
            good_t = np.zeros(len(vt), dtype=bool)
            if ctx_only.any():
                c = np.flatnonzero(ctx_only)
                good_t[c] = self.succ_good_many(vg[c], H.tclass[vt[c]].astype(np.int64), np.zeros(len(c), np.int64))
            dj = np.where(ctx_only, H.ctx_j[vt], -1)  # (-1: not a candidate for the regular-like test)
            row_reg = row_all = None
        if len(vt):
            # group the classes by context group (np.unique without the sort: groups are small ints)
            cg = H.class_group[k_arr]
            groups = cg[:1] if (cg == cg[0]).all() else np.flatnonzero(np.bincount(cg))
            k_u = np.searchsorted(groups, cg).astype(np.int64)  # each class's group, as an index of groups
            if self.use_kernels:  # every group in one call
                _kernels().grouped_allows_some(H.bt, H.few_ok, H.few_ptr, H.few_tok, H.heavy_pos, H.heavy_rows, row_reg,
                                               np.flatnonzero(row_reg),
                                               H.nd_ptr, H.nd_tok, groups,
                                               np.ascontiguousarray(k_arr, dtype=np.int64), k_u, out)
            else:
                for u in range(len(groups)):
                    w = vt[H.acts_regular(vt, dj, int(groups[u])) & good_t]
                    if len(w):
                        in_g = np.flatnonzero(k_u == u)
                        out[in_g[self._allows_some(_pack_ids(w, H.W), k_arr[in_g])]] = True
            rem = np.flatnonzero(~out)
            if len(rem) and len(vt) > self._PAIRS_PREFILTER_TOKENS:
                # a class banning every one of these tokens is not cleared by any: one word-major scan
                # of the banned bits (the classes left here are mostly such, and the per-pair path
                # would read one banned bit per (class, token), at random)
                rem = rem[self._allows_some(row_all if row_all is not None else _pack_ids(vt, H.W), k_arr[rem])]
            if len(rem):
                sub = out[rem]
                self._pairs_clear(k_arr[rem], k_u[rem], groups, sig, vt, vg, jw, dj, sub, by_id)
                out[rem] = sub
        for v, t in zip(inner_tok.tolist(), inner_tgt.tolist()):
            idx = np.flatnonzero(~out)
            if not len(idx):
                break
            out[idx[self.opening_byte_ok(k_arr[idx], v, t)]] = True
        return out

    def _special_prep(self, s: int, sig: int):
        """:meth:`specials_clear`'s tokens of state s under σ (:func:`.kernels.special_prep`): ``(vt, vg,
        jw, dj, good_t, (id_tok, id_pos), row_reg, row_all, inner_tok, inner_tgt)``; the rows are
        ``int32[W]``."""
        H = self.H
        gs, ts = self._edges(s)
        n = len(self.spec_toks)
        vt, vg, jw, dj = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        good_t = np.empty(n, bool)
        id_tok, id_pos = np.empty(n, np.int64), np.empty(n, np.int64)
        inner_tok, inner_tgt = np.empty(n, np.int64), np.empty(n, np.int64)
        row_reg, row_all = np.zeros(H.W, np.int32), np.zeros(H.W, np.int32)
        if self._sp_e is None:
            self._sp_e = self._special_order()
        self._sp_calls += 1
        tok_e, grp_e, id_to_e, stamp, stamp_tgt, grp_ptr, grp_x, lf_e, cls_e, opens_e, j_e, ctxj_e = self._sp_e
        m, n_in = _kernels().special_prep(gs, ts, stamp, stamp_tgt, self._sp_calls, self.tag, self._tag_table(), tok_e,
                                          grp_e, id_to_e, grp_ptr, grp_x, lf_e, cls_e, opens_e, j_e, ctxj_e,
                                          H.sigma_la[sig], vt, vg, jw, dj, good_t, id_tok, id_pos,
                                          inner_tok, inner_tgt, row_reg.view(np.uint32), row_all.view(np.uint32))
        return (vt[:m], vg[:m], jw[:m], dj[:m], good_t[:m], (id_tok[:m], id_pos[:m]), row_reg, row_all,
                inner_tok[:n_in], inner_tgt[:n_in])

    def _special_order(self) -> tuple:
        """:func:`.kernels.special_prep`'s per-analysis arrays: the special tokens and their groups in
        increasing (estimated ban count, id) order (likely witnesses first), the map from their id order
        to it, the group marks (``int64[G]`` stamps and targets), each group's tokens (CSR ``int64[G+1]``
        offsets into ``int64`` est indices, ascending), and the tokens' static attributes in that order
        (first lookahead class, class, opens a byte-fallback character, whitespace-final index, context
        index)."""
        H = self.H
        # the order of all the tokenizer's special tokens by (estimated ban count, id), once per helper;
        # this analysis' ones (those of its groups) keep it
        order = getattr(H, "_fst_special_order", None)
        if order is None:
            every = np.flatnonzero(self.special).astype(np.int64)
            order = H._fst_special_order = every[np.argsort(H.est_ban[every], kind="stable")]
        tok_e = order[self.M.token_group[order] >= 0]
        pos = np.searchsorted(self.spec_toks, tok_e)  # (spec_toks: sorted ids) its index in spec_toks
        est = pos.astype(np.int64)
        G = max(self.G, 1)
        grp_e = self.spec_group[est].astype(np.int64)
        # each group's tokens, ascending est index (a stable radix sort where the group ids fit 16 bits)
        narrow = grp_e.astype(np.uint16) if G <= 1 << 16 else grp_e
        grp_x = np.argsort(narrow, kind="stable").astype(np.int64)
        grp_ptr = np.zeros(G + 1, np.int64)
        np.cumsum(np.bincount(grp_e, minlength=G), out=grp_ptr[1:])
        id_to_e = np.empty(len(est), np.int64)  # the inverse permutation of est
        id_to_e[est] = np.arange(len(est), dtype=np.int64)
        return (tok_e, grp_e, id_to_e, np.zeros(G, np.int64), np.zeros(G, np.int64),
                grp_ptr, grp_x, np.ascontiguousarray(H.la_first[tok_e]), np.ascontiguousarray(H.tclass[tok_e]),
                (H.tok_bf_byte[tok_e] >= 0) & (self.bf_start[tok_e] >= 0), np.ascontiguousarray(H.j_of[tok_e]),
                np.ascontiguousarray(H.ctx_j[tok_e]))

    _MAX_WITNESSES = 12
    _PAIRS_PREFILTER_TOKENS = 256  # special tokens at a state above which specials_clear pre-filters classes

    def _witness_keep(self, idx: np.ndarray, wc: np.ndarray, tt: np.ndarray, tab: np.ndarray,
                      las: np.ndarray) -> np.ndarray:
        """The classes of ``idx`` (sorted ``int64`` ids; not changed) that no witness proves
        good: a witness is a token ``wc[e, l]`` (the best of edge e's group with lookahead class ``l`` in
        ``las``; ``wc: int32[E, L]``, -1 none) whose successor is good for its class (``tt[e]``: the
        target's tag, ``tab``: the tag table), one of the :attr:`_MAX_WITNESSES` of lowest estimated ban
        count; a class not banning one is good. Returns the classes left, in order (a new array)."""
        H = self.H
        if self.use_kernels:
            out = np.empty(len(idx), dtype=np.int64)
            n_left = _kernels().witness_clear(H.bt, wc, tt, tab, self.tclass_safe, las, H.est_ban,
                                              self._MAX_WITNESSES, idx, out)
            return out[:n_left]
        w64 = wc.astype(np.int64)
        okw = (w64 >= 0) & ~tab[tt[:, None], self.tclass_safe[np.maximum(w64, 0)]]
        w = np.unique(w64[:, las][okw[:, las]])
        for x in w[np.argsort(H.est_ban[w], kind="stable")[: self._MAX_WITNESSES]].tolist():
            idx = idx[H.bans(x, idx)]
        return idx

    def _allows_some(self, row: np.ndarray, k_arr: np.ndarray) -> np.ndarray:
        H = self.H
        return H.allows_some(row, k_arr) if self.use_kernels else H.allows_some_numpy(row, k_arr)

    def _pairs_clear(self, k_arr: np.ndarray, k_u: np.ndarray, groups: np.ndarray, sig: int, vt: np.ndarray,
                     vg: np.ndarray, jw: np.ndarray, dj: np.ndarray, out: np.ndarray, by_id=None) -> None:
        """The per-pair path of :meth:`specials_clear` for the classes of ``k_arr`` not yet cleared in
        ``out`` (set in place; class i in context group ``groups[k_u[i]]``): tokens ``vt`` (→ regex states
        ``vg``, lookahead-token indices ``jw``) × classes, except the tokens that act like regular ones in
        the class's group (``dj``: their ``ctx_j``, else -1; :meth:`CanonHelper.acts_regular`). Numba kernel
        :func:`.kernels.pairs_clear` (per class, tokens in order until a good one), with the bad tables
        of the tokens' targets stacked per distinct tag. ``by_id``: ``(tokens of vt sorted by id, their
        positions in vt)`` when the caller has them (else computed here)."""
        H = self.H
        if not self.use_kernels:
            for u in range(len(groups)):
                sel = ~H.acts_regular(vt, dj, int(groups[u]))
                self._pairs_clear_numpy(k_arr, np.flatnonzero(k_u == u), sig, vt[sel], vg[sel], jw[sel], out)
            return
        if not len(vt) or not len(k_arr):
            return
        live = np.flatnonzero(~out)
        if not len(live):
            return
        if by_id is None:
            o = np.argsort(vt, kind="stable")
            by_id = (vt[o], o.astype(np.int64))
        tags = self.tag[vg]
        tab_of = np.full(len(vt), -1, dtype=np.int64)
        nz = np.flatnonzero(tags)
        if len(nz):
            tz = tags[nz]
            if (tz == tz[0]).all():
                tabs = self._tag_full[int(tz[0])][None]
                tab_of[nz] = 0
            else:  # (np.unique without the sort: tags are small ints)
                present = np.zeros(int(tz.max()) + 1, dtype=bool)
                present[tz] = True
                tu = np.flatnonzero(present)
                remap = np.cumsum(present) - 1
                key = tu.tobytes()
                tabs = self._stacks.get(key)
                if tabs is None:  # (states of one compile often have the same successor tags)
                    if len(self._stacks) >= 64:
                        self._stacks.clear()
                    tabs = self._stacks[key] = np.stack([self._tag_full[t] for t in tu.tolist()])
                tab_of[nz] = remap[tz]
        else:
            tabs = np.zeros((1, 1, 1), dtype=bool)
        sub = np.zeros(len(live), dtype=bool)
        _kernels().pairs_clear(H.bt, H.tclass, H.ctx_j, H.ctx_classes, H.class_group, H.la_sets_idx, tabs, tab_of,
                               np.ascontiguousarray(vt, dtype=np.int64), np.ascontiguousarray(jw, dtype=np.int64),
                               np.ascontiguousarray(k_arr[live], dtype=np.int64),
                               dj, H.nd_ptr, H.nd_tok, np.ascontiguousarray(by_id[0], dtype=np.int64), by_id[1], sub)
        out[live[sub]] = True

    def _pairs_clear_numpy(self, k_arr: np.ndarray, idx: np.ndarray, sig: int, vt: np.ndarray, vg: np.ndarray,
                           jw: np.ndarray, out: np.ndarray) -> None:
        """Reference (numpy) :meth:`_pairs_clear`: tokens × classes in batches of at most
        ``_BATCH_CELLS`` entries."""
        H = self.H
        a = 0
        while a < len(vt):
            live = idx[~out[idx]]
            if not len(live):
                return
            kk = k_arr[live]
            b = min(len(vt), a + max(16, self._BATCH_CELLS // len(kk)))
            t_b, g_b, j_b = vt[a:b], vg[a:b], jw[a:b]
            ok = ~H.banned_matrix(kk, t_b)
            cv = H.next_cls_matrix(kk, t_b)
            nsig = np.zeros_like(cv)
            ws = np.flatnonzero(j_b >= 0)
            if len(ws):
                nsig[ws] = H.la_sets_idx[np.ix_(kk, j_b[ws])].T
            ok &= self.succ_good_many(g_b, cv, nsig)
            out[live[ok.any(axis=0)]] = True
            a = b

    def byte_moves(self, s: int, k: int, sig: int, a: int):
        """Yield ``(v, good)`` for each byte-fallback token v allowed in product state (s, a, k, σ) with
        a > 0 (inside a byte-fallback character; lazily, so callers may stop at the first good one):
        not banned after class k, first character in σ, a regex move; ``good`` = its successor is good
        (the character continues: :meth:`inner_good`; it ends: :meth:`succ_good`). The filters are
        vectorized over the acceptor's bytes (:meth:`_byte_static`); tokens in byte order."""
        H, M = self.H, self.M
        vs, lf, jv, a2s, gv = self._byte_static(a)
        if not len(vs):
            return
        ok = H.sigma_la[sig, lf]
        if k == H.START:
            ok &= ((H.start_row[vs >> 5] >> (vs & 31)) & 1) == 1
        else:
            ok &= ((H.bt[vs >> 5, k] >> (vs & 31)) & 1) == 0
        # regex move (TokenDFA.next_state, vectorized)
        e0, e1 = int(M.edge_ptr[s]), int(M.edge_ptr[s + 1])
        eg = M.edge_group[e0:e1]
        pos = np.searchsorted(eg, gv)
        inb = (pos < len(eg)) & (gv >= 0)
        hit = np.zeros(len(vs), dtype=bool)
        hit[inb] = eg[pos[inb]] == gv[inb]
        ok &= hit
        for i in np.flatnonzero(ok).tolist():
            v = int(vs[i])
            t = int(M.edge_next[e0 + int(pos[i])])
            cv = H.next_cls(k, v)
            nsig = int(H.la_sets_idx[k, jv[i]]) if jv[i] >= 0 else 0
            a2 = int(a2s[i])
            yield v, (self.inner_good(t, cv, nsig, a2) if a2 >= 0 else self.succ_good(t, cv, nsig))

    def _inner_any(self, s: int, k: int, sig: int, a: int) -> bool:
        """``any(good for _, good in byte_moves(s, k, sig, a))``, vectorized: the moves that end the
        character are checked at once (:meth:`succ_good_many`), then the others recursively."""
        H, M = self.H, self.M
        vs, lf, jv, a2s, gv = self._byte_static(a)
        if not len(vs):
            return False
        ok = H.sigma_la[sig, lf]
        if k == H.START:
            ok &= ((H.start_row[vs >> 5] >> (vs & 31)) & 1) == 1
        else:
            ok &= ((H.bt[vs >> 5, k] >> (vs & 31)) & 1) == 0
        e0, e1 = int(M.edge_ptr[s]), int(M.edge_ptr[s + 1])
        eg = M.edge_group[e0:e1]
        pos = np.searchsorted(eg, gv)
        inb = (pos < len(eg)) & (gv >= 0)
        hit = np.zeros(len(vs), dtype=bool)
        hit[inb] = eg[pos[inb]] == gv[inb]
        idx = np.flatnonzero(ok & hit)
        if not len(idx):
            return False
        v = vs[idx]
        t = np.asarray(M.edge_next[e0 + pos[idx]], dtype=np.int64)
        cv = H.tclass[v].astype(np.int64)
        cj = H.ctx_j[v]
        c = cj >= 0
        if c.any():
            cv[c] = H.ctx_classes[cj[c], H.class_group[k]]
        jj = jv[idx]
        ns = np.zeros(len(idx), dtype=np.int64)
        w = jj >= 0
        if w.any():
            ns[w] = H.la_sets_idx[k, jj[w]]
        a2 = a2s[idx]
        leaf = a2 < 0
        if leaf.any() and self.succ_good_many(t[leaf], cv[leaf], ns[leaf]).any():
            return True
        for i in np.flatnonzero(~leaf).tolist():
            if self.inner_good(int(t[i]), int(cv[i]), int(ns[i]), int(a2[i])):
                return True
        return False

    def _byte_static(self, a: int):
        """Per acceptor state ``a``: the byte-fallback tokens with a move (byte order), valid and with a
        first lookahead class: arrays (token, lookahead class, whitespace-final index, next acceptor
        state, token group). Memoized."""
        got = self._bstatic.get(a)
        if got is None:
            H = self.H
            arow = H.acc[a]
            bs = np.flatnonzero((arow != -1) & (H.bf_tok >= 0))
            vs = H.bf_tok[bs].astype(np.int64)
            lf = H.la_first[vs]
            keep = (H.tclass[vs] >= 0) & (lf >= 0)
            bs, vs, lf = bs[keep], vs[keep], lf[keep]
            got = self._bstatic[a] = (vs, lf, H.j_of[vs], arow[bs].astype(np.int64),
                                      np.asarray(self.M.token_group)[vs].astype(np.int64))
        return got

    def byte_moves_reference(self, s: int, k: int, sig: int, a: int):
        """Reference (scalar) :meth:`byte_moves`, for tests."""
        H = self.H
        arow = H.acc[a]
        for b in np.flatnonzero((arow != -1) & (H.bf_tok >= 0)).tolist():
            v = int(H.bf_tok[b])
            lf = int(H.la_first[v])
            if int(H.tclass[v]) < 0 or lf < 0 or not H.sigma_la[sig, lf] or H.banned_bit(k, v):
                continue
            cv = H.next_cls(k, v)
            t = self.M.next_state(s, v)
            if t < 0:
                continue
            nsig = int(H.la_sets_idx[k, H.j_of[v]]) if H.j_of[v] >= 0 else 0
            a2 = int(arow[b])
            yield v, (self.inner_good(t, cv, nsig, a2) if a2 >= 0 else self.succ_good(t, cv, nsig))

    def inner_good(self, s: int, k: int, sig: int, a: int) -> bool:
        """Whether (s, a, k, sigmas[sig]) with a > 0 (inside a byte-fallback character) is good:
        some byte tokens complete the character (<= 3 more bytes) into a good state."""
        key = (s, k, sig, a)
        got = self._inner_memo.get(key)
        if got is not None:
            return got
        if self.use_kernels:
            res = self._inner_any(s, k, sig, a)
        else:
            res = any(ok for _, ok in self.byte_moves_reference(s, k, sig, a))
        if len(self._inner_memo) > 200_000:
            self._inner_memo.clear()
        self._inner_memo[key] = res
        return res

    def _edges(self, s: int):
        a, b = int(self.M.edge_ptr[s]), int(self.M.edge_ptr[s + 1])
        return self.M.edge_group[a:b], self.M.edge_next[a:b]

    def regular_tokens(self, s: int) -> np.ndarray | None:
        """Sorted ids of :meth:`regular_row` (the reference path's small states) when at most 256 tokens are
        allowed at s (by group sizes), else None. Memoized."""
        gs, ts = self._edges(s)
        if int(self.g_size[gs].sum()) > 256:
            return None
        key = (gs.tobytes(), self.tag[ts].tobytes())
        got = self._tok_cache.get(key)
        if got is None:
            parts = []
            for g, t in zip(gs.tolist(), ts.tolist()):
                tk = self.g_toks[self.g_ptr[g] : self.g_ptr[g + 1]]
                tk = tk[self.regular[tk]]
                tg = int(self.tag[t])
                if tg:
                    tk = tk[~self._tag_table()[tg, self.tclass_safe[tk]]]
                parts.append(tk)
            got = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
            self._tok_cache[key] = got
        return got

    def _pack_group(self, g: int) -> np.ndarray:
        """``int32[W]``: the regular tokens of group ``g``."""
        tk = self.g_toks[self.g_ptr[g] : self.g_ptr[g + 1]]
        return _pack_ids(tk[self.regular[tk]], self.H.W)

    def _group_row(self, g: int) -> np.ndarray:
        """:meth:`_pack_group`, memoized per group (the path without a group-row matrix)."""
        r = self._grows.get(g)
        if r is None:
            r = self._grows[g] = self._pack_group(g)
        return r

    _GROUP_MATRIX_WORDS = 1 << 23  # group rows kept as one int32[G, W] matrix up to 32 MB

    def _or_group_rows(self, gs: np.ndarray) -> np.ndarray:
        """``int32[W]``: union of the regular-token rows of the groups ``gs``. With a group-row matrix
        (``G * W`` within :attr:`_GROUP_MATRIX_WORDS`; rows filled on first use) one gather and one OR
        reduction; otherwise group by group."""
        W = self.H.W
        if self.G * W > self._GROUP_MATRIX_WORDS:
            row = np.zeros(W, dtype=np.int32)
            for g in gs.tolist():
                row |= self._group_row(g)
            return row
        if self._gmat is None:
            self._gmat = np.zeros((self.G, W), dtype=np.int32)
            self._gbuilt = np.zeros(self.G, dtype=bool)
        missing = gs[~self._gbuilt[gs]]
        for g in missing.tolist():
            self._gmat[g] = self._pack_group(g)
        self._gbuilt[missing] = True
        return np.bitwise_or.reduce(self._gmat[gs], axis=0)

    def regular_row(self, s: int) -> np.ndarray:
        """A new ``int32[W]`` row: the regular tokens allowed at s whose successor (target, class of the
        token, ALL) is good -- the base row of s (:func:`.kernels.regular_row`; big groups through packed
        rows, :class:`PackedGroupRows`)."""
        gs, ts = self._edges(s)
        tags = self.tag[ts]
        tab = self._tag_table()
        slot, rows = self._pgrp.slots(self, gs, tags, tab)
        out = np.empty(self.H.W, dtype=np.int32)
        _kernels().regular_row(out.view(np.uint32), gs, tags, slot, rows, self.g_toks, self.g_ptr, self.regular,
                               self.H.tclass, tab)
        return out

    def regular_row_packed(self, s: int) -> np.ndarray:
        """:meth:`regular_row` (the reference path: :meth:`regular_row_groups`), memoized per (edge groups,
        successor tags) (read-only: shared)."""
        gs, ts = self._edges(s)
        key = (gs.tobytes(), self.tag[ts].tobytes())
        row = self._row_cache.get(key)
        if row is None:
            row = self.regular_row(s) if self.use_kernels else self.regular_row_groups(s)
            row.setflags(write=False)
            if len(self._row_cache) > 4096:
                self._row_cache.clear()
            self._row_cache[key] = row
        return row

    def regular_row_groups(self, s: int) -> np.ndarray:
        """:meth:`regular_row` built from per-group rows of regular tokens, minus (per successor tag) the
        tokens whose class is bad there: ``OR_g row[g] & ~bad[tag_g]`` computed as one OR per distinct tag
        (``(a & ~b) | (c & ~b) = (a | c) & ~b``); the tests' reference."""
        gs, ts = self._edges(s)
        toks = self.regular_tokens(s)
        row = np.zeros(self.H.W, dtype=np.int32)
        if toks is not None:
            if len(toks):
                row = _pack_ids(toks, self.H.W)
        elif len(gs):
            tags = self.tag[ts]
            untagged = tags == 0
            if untagged.any():
                row |= self._or_group_rows(gs[untagged])
            if not untagged.all():
                for tg in np.unique(tags[~untagged]).tolist():
                    row |= self._or_group_rows(gs[tags == tg]) & ~self._bad_tok_row(tg)
        return row

    def _bad_tok_row(self, tag: int) -> np.ndarray:
        """``int32[W]``: tokens whose class is bad (σ = ALL) in a state with this tag."""
        r = self._btok.get(tag)
        if r is None:
            tab = self._tag_table()
            r = self._btok[tag] = _pack(tab[tag][self.tclass_safe] & (self.H.tclass >= 0), self.H.W)
        return r

    def _tag_table(self) -> np.ndarray:
        """``bool[n_tags + 1, C]``: row ``tag`` = the σ=ALL row of the bad table with that tag (row 0:
        all good). Grown by doubling as tags appear."""
        if self._tab is None:
            self._tab_index()
        return self._tab[: self._n_tags() + 1]

    def specials_of(self, s: int):
        """Special tokens allowed at s: arrays (token, target)."""
        gs, ts = self._edges(s)
        if not len(self.spec_toks) or not len(gs):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        pos = np.searchsorted(gs, self.spec_group)
        pos = np.minimum(pos, len(gs) - 1)
        hit = gs[pos] == self.spec_group
        return self.spec_toks[hit], ts[pos[hit]].astype(np.int64)

    def opening_byte_ok(self, k_arr: np.ndarray, v: int, t: int) -> np.ndarray:
        """For classes ``k_arr``: is byte-fallback token v, which opens a multi-byte character (→ regex
        state t), allowed after the class with some completion of the character leading to a good state
        (:meth:`inner_good`)? The caller has checked v's validity and lookahead class."""
        H = self.H
        allowed = ~H.bans(v, k_arr)
        cv_arr = H.next_cls(k_arr, v)  # class reached, per previous class
        j = int(H.j_of[v])
        a2 = int(self.bf_start[v])
        out = np.zeros(len(k_arr), dtype=bool)
        if not self.use_kernels:  # reference: one inner_good call per class
            for i in np.flatnonzero(allowed).tolist():
                nsig = int(H.la_sets_idx[int(k_arr[i]), j]) if j >= 0 else 0
                out[i] = self.inner_good(t, int(cv_arr[i]), nsig, a2)
            return out
        idx = np.flatnonzero(allowed)
        if not len(idx):
            return out
        # the verdict depends on the class only through (class reached, lookahead-set index): one
        # inner_good call per distinct pair
        cvs = np.asarray(cv_arr, dtype=np.int64)[idx]
        ns = H.la_sets_idx[np.asarray(k_arr, dtype=np.int64)[idx], j] if j >= 0 else np.zeros(len(idx), np.int64)
        key = cvs * (self.nsig + 2) + (ns + 1)
        uk, inv = np.unique(key, return_inverse=True)
        first = np.zeros(len(uk), dtype=np.int64)
        first[np.asarray(inv).reshape(-1)[::-1]] = np.arange(len(idx) - 1, -1, -1)
        verdict = np.array([self.inner_good(t, int(cvs[f]), int(ns[f]), a2) for f in first.tolist()], dtype=bool)
        out[idx] = verdict[np.asarray(inv).reshape(-1)]
        return out

    # --- one state -------------------------------------------------------------------------------------

    _ENTERING_MAX_TOKENS = 4096  # states entered by more tokens are analysed for every class
    _ENTERING_MAX_PAIRS = 1 << 22  # (state, class) pairs computed per compile at most

    def _entering_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR ``(ptr int64[S+1], classes int64[n])`` of :meth:`entering_classes` for every state, and
        ``wide: bool[S]`` -- the states entered by more than ``_ENTERING_MAX_TOKENS`` tokens, and the widest
        others beyond ``_ENTERING_MAX_PAIRS`` (state, class) pairs in all (all classes, empty in the CSR).
        Vectorized: the classes of each group once, then their union over the edges into each state."""
        M, H = self.M, self.H
        S, C = M.num_states, H.C
        # the classes of each group's tokens (context-dependent tokens: every class they can reach;
        # negative ones index like numpy's), as a CSR over groups
        # (only those of groups on an edge into a state entered by few tokens: the others are never read)
        en = M.edge_next.astype(np.int64)
        n_in = np.bincount(en, weights=self.g_size[M.edge_group], minlength=S)
        wide = n_in > self._ENTERING_MAX_TOKENS
        need = np.zeros(max(self.G, 1), dtype=bool)
        need[M.edge_group[~wide[en]]] = True
        gc_ptr, g_cls = _kernels().group_classes(self.g_toks, self.g_ptr, self.tclass_safe.astype(np.int64), H.ctx_j,
                                                 H.ctx_cls_ptr, H.ctx_cls, C, need)
        # per state: the union over the edges into it
        n_cls = gc_ptr[M.edge_group + 1] - gc_ptr[M.edge_group]  # (edge, class) pairs of each edge
        pairs = np.bincount(en, weights=n_cls, minlength=S) * ~wide
        if pairs.sum() > self._ENTERING_MAX_PAIRS:  # bounded work: the narrowest states first
            order = np.argsort(pairs, kind="stable")
            over = np.cumsum(pairs[order]) > self._ENTERING_MAX_PAIRS
            wide[order[over]] = True
        sel = np.flatnonzero(~wide[en])
        ptr, cls = _kernels().entering_classes(en[sel], M.edge_group[sel].astype(np.int64), gc_ptr, g_cls, S, C)
        return ptr, cls, wide

    def entering_classes(self, s: int) -> np.ndarray | None:
        """Sorted ``int64`` ids of the classes with which a token can enter regex state ``s`` (the class
        of each token on an edge into s; for context-dependent tokens every class they can reach), or
        None (all classes) when more than ``_ENTERING_MAX_TOKENS`` tokens enter s or the tokenizer has
        byte fallback. The bad table of s is only ever read at these classes (successor checks read the
        class the token reaches), so :meth:`state_bad` decides only them and leaves the others good."""
        if self._ent_ptr is None or self._ent_wide[s]:
            return None
        return self._ent_cls[int(self._ent_ptr[s]) : int(self._ent_ptr[s + 1])]

    def _xkey_init(self) -> tuple:
        """:attr:`_xk` for :meth:`_content_key`: the process's :class:`.verdict_cache.VerdictCache`, the
        group hashes (``uint64[2, G]``), the entering-class sums per state (``uint64[2, S]``; wide states:
        ``wide``) and the multiplier of every tag so far (``uint64[2, n]``, tag 0: 1)."""
        from .verdict_cache import verdict_cache

        vc = verdict_cache(self.H)
        gh = vc.group_hashes(self.g_toks, self.g_ptr)
        S = self.M.num_states
        ent_sum = np.zeros((2, S), dtype=np.uint64)
        wide = np.ones(S, dtype=bool)
        if self._ent_ptr is not None:
            wide = self._ent_wide.copy()
            ptr = self._ent_ptr
            nz = np.flatnonzero((np.diff(ptr) > 0) & ~wide)
            if len(nz) and len(self._ent_cls):
                ent_sum[:, nz] = np.add.reduceat(vc.cls_hash[:, self._ent_cls], ptr[:-1][nz], axis=1)
        if self._tags is None:
            self._tag_index()
        mul = np.ones((2, max(self._tag_full, default=0) + 64), dtype=np.uint64)
        for d, tag in self._tags.items():  # (table digest -> tag)
            mul[:, tag] = vc.multipliers(d)
        self._xk = (vc, gh, ent_sum, wide, mul)
        # the part of each state's key that does not depend on its successors' tables, made once: its
        # flags (accepting, inside a character, entered by a whitespace-final token, wide) and its entering
        # classes' sums (0 when wide); as a tuple for the cross-compile key and as an id per distinct value
        # for the analysis' own memo (_run_singles), both from these rows
        flags = (self.M.accepting.astype(np.uint64) | (self.mid.astype(np.uint64) << np.uint64(1))
                 | (self.ws_in.astype(np.uint64) << np.uint64(2)) | (wide.astype(np.uint64) << np.uint64(3)))
        parts = np.ascontiguousarray(np.stack([flags, np.where(wide, 0, ent_sum[0]), np.where(wide, 0, ent_sum[1])],
                                              axis=1))
        self._xstatic = parts  # (a key's tuple is made when a state needs one: _key)
        rows = parts.view(np.dtype((np.void, parts.shape[1] * 8))).reshape(-1)  # (rows as one value each)
        self._static_id = np.unique(rows, return_inverse=True)[1].reshape(-1).astype(np.int64)
        return self._xk

    def _content_key(self, s: int) -> tuple:
        """The cross-compile key of :meth:`state_bad` for s (:mod:`.verdict_cache`): the flags and the
        entering classes' sums (made once per analysis), the edges' token sums weighted by their successors'
        table multipliers."""
        xk = self._xk if self._xk is not None else self._xkey_init()
        M = self.M
        return self._key(s, *_kernels().content_key(s, M.edge_ptr, M.edge_group, M.edge_next, self.tag, xk[1], xk[4]))

    def _key(self, s: int, e0, e1) -> tuple:
        """:meth:`_content_key` of s from its edges' two sums (``kernels.content_key``)."""
        return (tuple(self._xstatic[s].tolist()), int(e0), int(e1))

    def state_bad(self, s: int, only: np.ndarray | None = None, key: tuple | None = None):
        """The bad table of s given the current tables of its successors (None = all good); decided for
        the classes of :meth:`entering_classes` (the others are left good). Memoized by content across
        the compiles of the process (:mod:`.verdict_cache`); with byte fallback (inner goodness depends
        on the targets' own edges) and on the reference path (``use_kernels`` off: it must compute what
        the tests compare) by the edges themselves, per compile.

        ``only`` (``bool[nsig, C]``, optional): a table known to contain the answer (s's table from an
        earlier evaluation in the same fixpoint iteration: successor tables only lose bad entries and
        the evaluation is monotone in them, so the new table is a subset of the old one); only its
        entries are decided, which gives the same table as deciding all of them. ``key``: s's
        :meth:`_content_key` when the caller made it already."""
        M, H = self.M, self.H
        shared = H.acc is None and self.use_kernels
        if shared:
            if key is None:
                key = self._content_key(s)
            found, got = self._xk[0].get(key)
            if found:
                return got
        gs, ts = self._edges(s)
        acc = bool(M.accepting[s])
        ent = self.entering_classes(s)
        if not shared:
            key = (acc, bool(self.mid[s]), bool(self.ws_in[s]), gs.tobytes(), self.tag[ts].tobytes(),
                   ts.tobytes() if H.acc is not None else b"", None if ent is None else ent.tobytes())
            got = self._cache.get(key, False)
            if got is not False:
                return got
        # the candidate classes, as sorted ids: those that can be the last token's class here
        mid = bool(self.mid[s])
        base = H.cls_mid if mid else H.cls_boundary
        if ent is None:  # every class
            per_sig = self._class_ids(mid)
        else:
            idx0 = ent[base[ent]]
            per_sig = None
        # witness candidates: the best token of each (edge group, lookahead class) whose successor
        # (target state, its class, ALL) is good
        if self.best is None:
            self.best = self._witness_table()
        wc = self.best[gs]  # int32[E, L]
        tt = self.tag[ts]
        tab = self._tag_table()
        full_row = None
        res = None
        for i in range(self.nsig):
            if acc and H.sigma_end[i]:
                continue
            if i != 0 and not self.ws_in[s]:
                continue  # no whitespace-final token enters s: σ != ALL never occurs here
            # a product state (t, k, σ) with σ != ALL is only ever entered by a whitespace-final token,
            # so k is the class of one: other classes are irrelevant there (left good)
            # (σ_i, k) pairs that occur; idx may be memoized (_cls_ids): every step below reads idx and
            # makes new arrays, none writes into it
            if per_sig is not None:
                idx = per_sig[i]
            else:
                idx = idx0 if i == 0 else idx0[H.sigma_cls[i][idx0]]
            if only is not None:
                idx = idx[only[i, idx]]
            if not len(idx):
                continue
            las = self._las[i]
            if len(las):
                # a few witnesses (good successor, rarely banned): each keeps the classes banning it
                idx = self._witness_keep(idx, wc, tt, tab, las)
            if len(idx):
                if full_row is None:
                    full_row = self.regular_row_packed(s)
                Y = full_row if H.sigma_full[i] else full_row & H.sigma_rows[i]
                n_bits = int(np.bitwise_count(Y.view(np.uint32)).sum())
                if n_bits and (Y & _never_banned_row(H)).any():  # a token no class bans: every class is good
                    idx = idx[:0]
                elif n_bits:
                    if n_bits <= 16 or len(idx) > 2048:
                        words = np.flatnonzero(Y)
                        # one banned column per token (few tokens, or too many classes for row checks)
                        w = words[:8]
                        bits = np.unpackbits(Y[w].view(np.uint8), bitorder="little").reshape(len(w), 32)
                        ys = (w[:, None] * 32 + np.arange(32)[None, :])[bits.astype(bool)]
                        if len(ys) > 32:
                            ys = ys[np.argpartition(H.est_ban[ys], 31)[:32]]
                        for y in ys.tolist():
                            idx = idx[H.bans(y, idx)]
                            if not len(idx):
                                break
                    if len(idx) and n_bits > 16:
                        idx = idx[~self._allows_some(Y, idx)]
                if len(idx):
                    idx = idx[~self.specials_clear(idx, i, s)]
            if len(idx):
                if res is None:
                    res = np.zeros((self.nsig, H.C), dtype=bool)
                res[i, idx] = True
            if time.perf_counter() > self.deadline:
                raise CompileBudgetError("canonical product exceeded the time budget", None)
        if shared:
            return self._xk[0].put(key, res)
        self._cache[key] = res
        return res

    def _set(self, s: int, table) -> bool:
        """Store a new table; returns True if it changed. Tags are content-based (equal tables share a
        tag), so states with equal successor verdicts share cached results."""
        old = self.bad[s]
        if table is old:  # (None twice, or the same shared table of the verdict cache)
            return False
        if table is not None and old is not None and np.array_equal(table, old):
            return False
        if self._tags is None:
            self._tag_index()
        self.bad[s] = table
        if table is None:
            self.tag[s] = 0
        else:
            # a table object met before (shared tables of the verdict cache, all-bad in a cycle, a memoized
            # verdict): its tag by identity (pinned while the analysis lives, so an id is never reused;
            # tables are never changed once made), a new one by content
            tag = self._tag_of_obj.get(id(table))
            if tag is not None:
                self.tag[s] = tag
                return True
            # (a table the verdict cache shares: its digest is known there)
            key = self._xk[0].digest_of(table) if self._xk is not None else table_digest(table)
            tag = self._tags.get(key)
            if tag is None:
                tag = self._tags[key] = len(self._tags) + 1
                if tag >= self._tab.shape[0]:
                    grown = np.zeros((2 * self._tab.shape[0], self.H.C), dtype=bool)
                    grown[: self._tab.shape[0]] = self._tab
                    self._tab = grown
                self._tab[tag] = table[0]
                self._tag_full[tag] = table
                if self._xk is not None:  # the new tag's multipliers for content keys
                    vc, mul = self._xk[0], self._xk[4]
                    if tag >= mul.shape[1]:
                        grown = np.ones((2, max(2 * mul.shape[1], tag + 1)), dtype=np.uint64)
                        grown[:, : mul.shape[1]] = mul
                        self._xk = (*self._xk[:4], grown)
                        mul = grown
                    mul[:, tag] = vc.multipliers(key)
            self._tag_of_obj[id(table)] = tag
            self._pinned.append(table)
            self.tag[s] = tag
        return True

    def run(self, n_char_states: int) -> None:
        """Compute ``bad`` for every regex state (least fixpoint, SCCs sinks first).

        With a byte-fallback acceptor (SentencePiece), tokens never end inside a character when a = 0,
        so regex states inside a character (byte state >= ``n_char_states``) are all-bad at a = 0
        (they are reached only with a > 0, see :meth:`inner_good`)."""
        M = self.M
        comp_ptr, nodes = _scc_csr(M.num_states, M.edge_ptr, M.edge_next)
        all_bad = np.ones((self.nsig, self.H.C), dtype=bool)
        if self.H.acc is not None:
            for s in np.flatnonzero(M.byte_state >= n_char_states).tolist():
                self._set(s, all_bad)
            skip = M.byte_state >= n_char_states
        else:
            skip = np.zeros(M.num_states, dtype=bool)
        src = np.repeat(np.arange(M.num_states), np.diff(M.edge_ptr))
        self_loop = np.zeros(M.num_states, dtype=bool)
        self_loop[src[M.edge_next == src]] = True
        skip_l, loop_l = skip.tolist(), self_loop.tolist()
        shared = self.H.acc is None and self.use_kernels
        # the components in order; a run of single-state components without a self-loop (each one's
        # successors decided before it) goes to _run_singles in one piece
        sizes = np.diff(comp_ptr)
        single = (sizes == 1) & ~self_loop[nodes[comp_ptr[:-1]]] & ~skip[nodes[comp_ptr[:-1]]]
        if not shared:
            single[:] = False
        c, n_comps = 0, len(sizes)
        while c < n_comps:
            if single[c]:
                e = c + 1
                while e < n_comps and single[e]:
                    e += 1
                self._run_singles(nodes[comp_ptr[c] : comp_ptr[e]])
                c = e
                continue
            comp = [s for s in nodes[comp_ptr[c] : comp_ptr[c + 1]].tolist() if not skip_l[s]]
            c += 1
            if not comp:
                continue
            if len(comp) == 1 and not loop_l[comp[0]]:
                self._set(comp[0], self.state_bad(comp[0]))
                continue
            # chaotic iteration with a worklist (monotone: tables only lose bad entries), starting from
            # all-bad = the least fixpoint's bottom; a change re-queues the predecessors inside the SCC
            members = set(comp)
            for s in comp:
                self._set(s, all_bad)
            preds: dict = {s: [] for s in comp}
            for s in comp:
                a, b = int(M.edge_ptr[s]), int(M.edge_ptr[s + 1])
                for t in set(M.edge_next[a:b].tolist()):
                    if t in members:
                        preds[t].append(s)
            from collections import deque

            # evaluation order: DFS postorder inside the SCC, so a state's first evaluation sees the tables
            # of the successors the search reached from it (only the edges closing a cycle point to a state
            # evaluated later); a re-evaluation decides only the entries still bad (state_bad's ``only``)
            queue = deque(_postorder(comp, members, M.edge_ptr, M.edge_next))
            queued = set(comp)
            steps = 0
            while queue:
                s = queue.popleft()
                queued.discard(s)
                cur = self.bad[s]
                if cur is None:  # all good already: it cannot change (tables only lose bad entries)
                    continue
                if self._set(s, self.state_bad(s, None if cur is all_bad else cur)):
                    self._inner_memo.clear()
                    for p in preds[s]:
                        if p not in queued:
                            queued.add(p)
                            queue.append(p)
                steps += 1
                if steps > 1_000_000:
                    raise CompileBudgetError("canonical dead-end analysis did not converge", None)
            self._inner_memo.clear()
        self._tag_of_obj, self._pinned = {}, []  # (the tables set during the run; bad[] keeps the final ones)
        self._wv = None  # (its scratch and class lists serve the run only; not kept with the automaton)

    def _witness_args(self) -> tuple:
        """The arrays of :func:`.kernels.witness_verdict` (the tag table as it is now: it grows)."""
        wv = self._wv
        if wv is None:
            H, S = self.H, self.M.num_states
            las_ptr = np.zeros(self.nsig + 1, np.int64)
            np.cumsum([len(x) for x in self._las], out=las_ptr[1:])
            las = np.concatenate(self._las).astype(np.int64) if self.nsig else np.zeros(0, np.int64)
            ent_ptr, ent_cls, ent_wide = self._ent_ptr, self._ent_cls, self._ent_wide
            if ent_ptr is None:
                ent_ptr, ent_cls, ent_wide = np.zeros(S + 1, np.int64), np.zeros(0, np.int64), np.ones(S, bool)
            if self.best is None:
                self.best = self._witness_table()
            wv = self._wv = [self.best, None, np.ascontiguousarray(self.tclass_safe), las_ptr, las,
                             np.ascontiguousarray(H.est_ban, dtype=np.int32), H.bt, self._MAX_WITNESSES,
                             np.ascontiguousarray(self.M.accepting, dtype=bool), self.ws_in, self.mid, H.sigma_end,
                             np.ascontiguousarray(H.sigma_cls), np.stack([H.cls_boundary, H.cls_mid]),
                             np.ascontiguousarray(ent_ptr, dtype=np.int64), np.ascontiguousarray(ent_cls, dtype=np.int64),
                             np.ascontiguousarray(ent_wide, dtype=bool), np.empty(H.C, np.int64),
                             *self._wide_classes()]
        wv[1] = self._tag_table()
        return tuple(wv)

    def _class_ids(self, mid: bool) -> list:
        """Per σ, the sorted ids (``int64``) of the classes :meth:`state_bad` decides at a state entered by
        every class: those of ``H.cls_mid`` (inside a character) or ``H.cls_boundary`` in ``sigma_cls[σ]``.
        Memoized (Tekken: ~45k classes, two gathers each)."""
        per_sig = self._cls_ids.get(mid)
        if per_sig is None:
            H = self.H
            all_ids = np.flatnonzero(H.cls_mid if mid else H.cls_boundary)
            per_sig = self._cls_ids[mid] = [all_ids] + [all_ids[H.sigma_cls[i][all_ids]] for i in range(1, self.nsig)]
        return per_sig

    def _wide_classes(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_class_ids` as one CSR ``(ptr int64[2nσ+1], classes int64[n])``: row ``2σ + mid``."""
        rows = [self._class_ids(mid)[i] for i in range(self.nsig) for mid in (False, True)]
        ptr = np.zeros(len(rows) + 1, np.int64)
        np.cumsum([len(r) for r in rows], out=ptr[1:])
        return ptr, np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)

    def _run_singles(self, states: np.ndarray) -> None:
        """:meth:`run` for consecutive single-state components (``states``: ``int64``) in order (each one's successors decided
        before it), with the verdict cache's keys (:meth:`_content_key`). A state whose key an earlier
        state of this analysis had takes that state's tag in a compiled loop (:func:`.kernels.memo_run`,
        the analysis' own memo of key → tag: the same verdict, by the key's definition), with no Python
        call per state; inside a bounded string or free text most states repeat their successor's content
        (``[^\n]{1,200}``: 1,601 states, a handful of distinct keys; ~5 µs of Python calls each before).
        The others go through :meth:`state_bad` (and the cross-compile cache) and enter the memo."""
        K = _kernels()
        M = self.M
        xk = self._xk if self._xk is not None else self._xkey_init()
        memo = self._memo_tab
        if memo is None:
            cap = 1 << max(4, int(2 * M.num_states).bit_length())  # (at least twice the keys it can hold)
            memo = self._memo_tab = (np.zeros((cap, 3), np.uint64), np.zeros(cap, np.int64), np.zeros(cap, bool),
                                     np.zeros(2, np.uint64))  # (+ the sums of the key a run stopped at)
        miss = memo[3]
        arr = states
        tag, tag_full, bad = self.tag, self._tag_full, self.bad
        i, n = 0, len(arr)
        while i < n:
            j = K.memo_run(arr, i, M.edge_ptr, M.edge_group, M.edge_next, tag, xk[1], self._xk[4], self._static_id,
                           *memo, self._witness_args(), self._n_free)
            if j > i:
                for s in arr[i:j].tolist():
                    t = int(tag[s])
                    bad[s] = None if t == 0 else tag_full[t]
                xk[0].hits += j - i
            if j == n:
                break
            s = int(arr[j])
            key = self._key(s, miss[0], miss[1])
            self._set(s, self.state_bad(s, key=key))
            K.memo_put(*memo[:3], np.uint64(self._static_id[s]), miss[0], miss[1], int(tag[s]))
            i = j + 1


# --------------------------------------------------------------------------------------------------
# Rows and the factored automaton
# --------------------------------------------------------------------------------------------------


class FactoredCanonical:
    """The canonical product in factored form (module docstring, step 3).

    A state is the int ``((s * n_acc + a) * (C + 1) + kk) * nσ + σ`` (s: regex state, a: byte-fallback
    acceptor state, kk = 0 for START and k + 1 for class k, σ: index into ``sigmas``, ALL = 0), so the
    start state (0, 0, START, ALL) is 0.

    Rows are computed on first use (``base[s] & ~banned[k] & la_row[σ]`` + special tokens + EOS)
    and memoized in an LRU of ``memo_rows`` entries (thread-safe). The base row of a regex state (its
    regular tokens whose successor is good, :meth:`_regular_row`) is built at compile for automata with at
    most :attr:`EAGER_BASE_SIGNATURES` signatures (:meth:`build_tables`, with the special-token tables when
    there are at most :attr:`EAGER_TABLE_KEYS` of them), else on the first visit of its signature, like
    the state's special-token table. The computation is compiled
    (:mod:`.kernels`, numba, GIL released): :meth:`compute_row` reads the banned set of k from the
    filter's CSR (contiguous) and checks the special tokens of s from a per-signature table;
    :meth:`advance` (the matcher's decoding step) computes the successor of a token and its row in one
    call. :meth:`_compute_row_numpy` and :meth:`_next_state_reference` are the numpy formulations the
    tests compare them with; the numpy path also serves states inside a byte-fallback character
    (``a > 0``) and filters without the CSR.
    """

    def __init__(self, M: TokenDFA, H: CanonHelper, an: _Analysis, eos_ids, base_index: np.ndarray,
                 memo_rows: int = 1024):
        """Args: the token DFA ``M``, the helper ``H``, the finished dead-end analysis ``an``, the EOS ids
        and ``base_index`` (``int32[S]``, the signature of each regex state: :func:`_signatures`)."""
        self.M = M
        self.H = H
        self.an = an
        self.eos_ids = np.asarray(eos_ids, dtype=np.int64)
        self.base_index = np.ascontiguousarray(base_index, dtype=np.int32)
        self.nsig = len(H.sigmas)
        self.NK = H.C + 1
        self.n_acc = H.n_acc
        self._eos_set = frozenset(int(e) for e in self.eos_ids.tolist())
        self._memo: OrderedDict = OrderedDict()
        self._memo_max = memo_rows
        self._lock = threading.Lock()
        self._spec: dict = {}
        self._tagmask: dict = {}
        eos_row = np.zeros((1, H.W), dtype=np.int32)
        if len(self.eos_ids):
            set_eos_bits(eos_row, np.array([0]), eos_ids)
        self._eos_row = eos_row[0]
        # compiled fast path (kernels.canon_row / canon_step); filters without the CSR use the numpy path
        self._fast_ok = len(H.banned_ptr) > 0 and H.C > 0
        self._kstatic = None  # fixed arguments of canon_row (_fast_init), built on first use
        self._kstep = None  # (canon_step, its fixed arguments) (_step_init)
        self._W = int(H.W)
        self._no_acc = H.acc is None
        self._has_inner = False
        # special-token tables: without a byte-fallback acceptor a table depends only on the (groups,
        # successor tags) signature of a regex state, which base_index numbers (_signatures): free text
        # shares one table across positions; with one, the targets matter (inner_good): one per state
        self._key_of_s = (np.ascontiguousarray(base_index, dtype=np.int64) if self._no_acc
                          else np.arange(M.num_states, dtype=np.int64))
        self._spec_static = None  # per special token of the analysis: the state-independent columns
        self._edges_py = None  # Python lists of M's CSR for next_state (built on first use)
        self._eager_base = None  # (rows int32[n, W], row per signature int64[n_sig]): build_tables, build_start_table
        self._eager_tables = None  # the special-token tables built at compile and their tag rows (the same)
        self.reset_caches()

    def reset_caches(self) -> None:
        """Empty the tables filled on demand: the row memo, the base rows, the special-token tables and the
        tag rows they read (``_fspec``, ``_tag_bits``). Called at construction, after the explicit
        enumeration gave up (it filled them for states a decode may never visit) and on unpickling (they
        are not stored)."""
        H = self.H
        self._memo = OrderedDict()
        self._spec = {}
        self._tagmask = {}
        self._has_inner = False
        self._tag_bits = np.zeros((1, max(H.C, 1)), dtype=np.int64)  # a view of _tag_buf (rows appended)
        self._tag_buf = self._tag_bits
        self._spec_buf = np.zeros((0, 7), np.int64)  # spec rows of every built table (the snapshot: a view)
        self._base_buf = np.zeros((0, H.W), np.int32)  # base rows built so far (the snapshot: a view)
        self._grp = PackedGroupRows(H.W)  # packed rows of big groups (_regular_row)
        n_sig = (int(self.base_index.max()) + 1) if len(self.base_index) else 1
        self._base_of_sig = np.full(n_sig, -1, dtype=np.int64)  # row of _base_buf per signature
        if self._eager_base is not None:  # the rows built at compile (build_tables; stored with the automaton)
            self._base_buf, self._base_of_sig = self._eager_base[0], self._eager_base[1].copy()
        n_keys = (int(self._key_of_s.max()) + 1) if len(self._key_of_s) else 1
        self._tag_row_arr = np.full(int(self.an.tag.max(initial=0)) + 1, -1, dtype=np.int64)
        self._tag_row_arr[0] = 0
        # snapshot, replaced as a whole under the lock: (spec int64[n, 7], key_lo int64[R], key_hi int64[R]
        # (key_lo -1: table not built), inner_cache int64[n_inner, 2], tag_bits int64[n_rows, C],
        # base rows uint32[n_base, W], base_slot int64[R] (the base row of each key, built with its table))
        self._fspec = (np.zeros((0, 7), np.int64), np.full(n_keys, -1, np.int64), np.full(n_keys, -1, np.int64),
                       np.zeros((1, 2), np.int64), self._tag_bits, self._base_buf.view(np.uint32),
                       np.full(n_keys, -1, np.int64))
        if self._eager_tables is not None:  # every special-token table, built at compile (build_tables):
            # copies, as decodes append and write
            spec, lo, hi, icache, tag_bits, slot, tag_row_arr, has_inner = self._eager_tables
            self._spec_buf, self._tag_bits, self._tag_row_arr = spec.copy(), tag_bits.copy(), tag_row_arr.copy()
            self._tag_buf, self._has_inner = self._tag_bits, has_inner
            self._fspec = (self._spec_buf, lo.copy(), hi.copy(), icache.copy(), self._tag_bits,
                           self._base_buf.view(np.uint32), slot.copy())

    _CACHES = ("_memo", "_spec", "_tagmask", "_has_inner", "_tag_bits", "_tag_buf", "_spec_buf", "_tag_row_arr",
               "_fspec", "_base_buf", "_base_of_sig", "_grp")

    def __getstate__(self) -> dict:
        """Pickled state (``compiler/persist.py``) without the kernels' argument tuples, the Python lists
        of :meth:`successor` (they hold views of per-tokenizer arrays: the filter's CSR, lookahead tables)
        and the tables filled on demand (:meth:`reset_caches`); all are rebuilt on first use after
        loading."""
        state = self.__dict__.copy()
        state["_kstatic"] = state["_kstep"] = state["_edges_py"] = None
        for name in self._CACHES:
            del state[name]
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self.reset_caches()

    @property
    def nbytes(self) -> int:
        spec = self._fspec
        return int(self._base_buf.nbytes + self._grp.nbytes + self.base_index.nbytes
                   + self.H.W * 4 * len(self._memo) + self._tag_bits.nbytes + spec[0].nbytes + spec[1].nbytes
                   + spec[2].nbytes + spec[3].nbytes + spec[6].nbytes)

    def pack(self, s: int, a: int, k: int, sig: int) -> int:
        """Packed state of (s, a, k, σ); k = C means START."""
        kk = 0 if k == self.H.START else k + 1
        return ((s * self.n_acc + a) * self.NK + kk) * self.nsig + sig

    def unpack(self, x: int):
        """(s, a, k, σ) of a packed state (k = C for START)."""
        x, sig = divmod(x, self.nsig)
        x, kk = divmod(x, self.NK)
        s, a = divmod(x, self.n_acc)
        return s, a, (self.H.START if kk == 0 else kk - 1), sig

    # --- rows ------------------------------------------------------------------------------------------

    def _specials(self, s: int):
        """(tokens, targets, badmask) of the special tokens of regex state s; ``badmask[i]`` has bit σ
        set when (target, class of the token, σ) is bad (context-dependent tokens: -1, checked per call)."""
        got = self._spec.get(s)
        if got is None:
            toks, tgts = self.an.specials_of(s)
            H, an = self.H, self.an
            badmask = np.zeros(len(toks), dtype=np.int64)
            cv = np.maximum(H.tclass[toks], 0)
            tags = an.tag[tgts]
            for tg in np.unique(tags[tags != 0]).tolist():
                sel = tags == tg
                badmask[sel] = self._tag_sigma_mask(tg)[cv[sel]]
            badmask[H.ctx_j[toks] >= 0] = -1  # class depends on k: checked per call
            badmask[(H.tok_bf_byte[toks] >= 0) & (an.bf_start[toks] >= 0)] = -1  # inner: inner_good per call
            got = self._spec[s] = (toks, tgts, badmask)
        return got

    def compute_row(self, s: int, a: int, k: int, sig: int) -> np.ndarray:
        """``int32[W]`` row of product state (s, a, k, σ) (module docstring, step 2).

        States with ``a == 0`` go through the compiled kernel :func:`.kernels.canon_row` (one pass over
        the banned set of k in the filter's CSR, the base row and the special tokens of s; a few µs on a
        49k vocabulary); inside a byte-fallback character (``a > 0``, SentencePiece) the few byte tokens
        are checked in Python, as are filters without the CSR. Same bits as :meth:`_compute_row_numpy`
        (``tests/test_matcher.py``)."""
        if a != 0 or not self._fast_ok:
            return self._compute_row_numpy(s, a, k, sig)
        static = self._kstatic if self._kstatic is not None else self._fast_init()
        key = int(self._key_of_s[s])
        snap = self._fspec  # one consistent snapshot
        if snap[1][key] < 0:
            self._fast_specials(s)
            snap = self._fspec
        spec, key_lo, key_hi, icache, tag_bits, base_buf, base_slot = snap
        out = np.empty(self.H.W, dtype=np.int32)
        pending = np.empty((256, 2), dtype=np.int64) if self._has_inner else _NO_PENDING
        n_pend = _kernels().canon_row(out, s, k, sig, spec, key_lo, key_hi, key, tag_bits, icache, pending, base_buf,
                                      base_slot, *static)
        if n_pend:
            self._decide_inner(out, spec, icache, pending[:n_pend], k)
        return out

    def advance(self, state: int, row: np.ndarray, token: int):
        """One decoding step: ``(next_state, next_row)`` for ``token`` from ``state`` whose row is ``row``
        (``int32[W]``), or ``(-1, None)`` if ``token`` is not allowed (or EOS). The successor and its
        row come from one kernel call (:func:`.kernels.canon_step`); the row is memoized like
        :meth:`row`'s. Same results as :meth:`next_state` + :meth:`row`."""
        if not 0 <= token < self.H.V or token in self._eos_set:
            return -1, None
        if not self._fast_ok:
            nxt = self.next_state(state, token)
            return (nxt, self.row(nxt)) if nxt >= 0 else (-1, None)
        step = self._kstep if self._kstep is not None else self._step_init()
        spec, key_lo, key_hi, icache, tag_bits, base_buf, base_slot = self._fspec
        out = np.empty(self._W, dtype=np.int32)
        pending = np.empty((256, 2), dtype=np.int64) if self._has_inner else _NO_PENDING
        nxt, st = step[0](out, row, state, token, spec, key_lo, key_hi, self._key_of_s, tag_bits, icache, pending,
                          base_buf, base_slot, *step[1])
        if st < 0:
            if st == -1:  # kernels.STEP_REJECT
                return -1, None
            return nxt, self.row(nxt)  # STEP_NEED_SPEC (built on the way) or STEP_NEED_PY (a > 0)
        if st:
            self._decide_inner(out, spec, icache, pending[:st], self.unpack(nxt)[2])
        out.setflags(write=False)
        memo = self._memo
        with self._lock:
            r = memo.get(nxt)
            if r is not None:
                return nxt, r
            memo[nxt] = out
            if len(memo) > self._memo_max:
                memo.popitem(last=False)
        return nxt, out

    def _fast_init(self) -> tuple:
        """The fixed arguments of :func:`.kernels.canon_row` (views, no copies of big arrays)."""
        H = self.H
        n_seg = (len(H.banned_ptr) - 1) // H.C if H.C and len(H.banned_ptr) else 1
        ctx = H.ctx_classes.reshape(H.ctx_classes.shape[0], -1) if H.ctx_classes.size else np.zeros((1, 1), np.int64)
        static = (
            int(H.C), np.ascontiguousarray(H.banned_ptr, dtype=np.int64), np.ascontiguousarray(H.banned_ids),
            max(int(n_seg), 1), np.ascontiguousarray(H.start_row, dtype=np.int32).view(np.uint32),
            np.ascontiguousarray(H.sigma_rows, dtype=np.int32).view(np.uint32),
            np.ascontiguousarray(H.sigma_full, dtype=bool), np.ascontiguousarray(H.sigma_la, dtype=bool),
            np.ascontiguousarray(H.la_sets_idx, dtype=np.int64), np.ascontiguousarray(H.class_group, dtype=np.int64),
            np.ascontiguousarray(ctx, dtype=np.int64), np.ascontiguousarray(self.M.accepting, dtype=bool),
            np.ascontiguousarray(H.sigma_end, dtype=bool), np.ascontiguousarray(self.eos_ids, dtype=np.int64),
        )
        self._kstatic = static
        return static

    def _step_init(self) -> tuple:
        """``(kernels.canon_step, its fixed arguments)``: those of :func:`.kernels.canon_row`, M's group
        CSR and the per-token ``int32[V, 4]`` table (cached on the helper, once per tokenizer)."""
        H, M = self.H, self.M
        static = self._kstatic if self._kstatic is not None else self._fast_init()
        info = getattr(H, "_fst_tok_info", None)
        if info is None:
            info = np.ascontiguousarray(np.stack([H.j_of, H.tok_bf_byte, H.ctx_j, H.tclass], axis=1).astype(np.int32))
            H._fst_tok_info = info
        acc = np.ascontiguousarray(H.acc, dtype=np.int32) if H.acc is not None else np.zeros((1, 256), np.int32)
        args = static + (
            np.ascontiguousarray(M.token_group, dtype=np.int32), np.ascontiguousarray(M.edge_ptr, dtype=np.int64),
            np.ascontiguousarray(M.edge_group, dtype=np.int32), np.ascontiguousarray(M.edge_next, dtype=np.int32),
            info, acc, H.acc is not None, int(self.nsig), int(self.NK), int(self.n_acc),
        )
        step = (_kernels().canon_step, args)
        self._kstep = step
        return step

    def _fast_specials(self, s: int) -> None:
        """Build (if missing) the special-token table of regex state s -- the kernels' ``spec`` rows,
        columns ``kernels.SP_*`` -- and its base row (:meth:`_regular_row`, once per signature),
        and publish both in a new ``_fspec`` snapshot under key ``_key_of_s[s]``. The special tokens are
        those of :meth:`_Analysis.specials_of`; plain ones carry
        :meth:`_specials`' badmask (bit σ = successor bad, read from ``tag_bits``), context-dependent ones
        the ``ctx_classes`` row and the ``tag_bits`` row of their target's bad table, byte-fallback tokens
        that open a character a row of ``inner_cache`` (decided on first use, :meth:`_decide_inner`)."""
        kernels = _kernels()
        H, an = self.H, self.an
        key = int(self._key_of_s[s])
        if self._fspec[1][key] >= 0:
            return
        st = self._spec_static if self._spec_static is not None else self._spec_static_init()
        gs, ts = an._edges(s)
        # fast path: one kernel call (every target's tag already has its tag_bits row), else numpy
        buf = np.empty((len(st), 7), dtype=np.int64)
        n = kernels.spec_table(gs, ts, an.spec_group, st, an.tag, self._tag_row_arr, self._tag_bits, H.tclass, buf)
        if n >= 0:
            spec = buf[:n]
        else:
            spec = self._spec_rows_numpy(s, st)
        base = self._regular_row(s) if self._base_of_sig[int(self.base_index[s])] < 0 else None
        self._publish_specials(key, spec, s, base)

    def _regular_row(self, s: int, have_lock: bool = False) -> np.ndarray:
        """``int32[W]``: the base row of regex state s (:meth:`_Analysis.regular_row`'s bits; free-text
        states allow tens of thousands of tokens, so big groups are OR-ed in as packed rows, built once per
        group, successor tag and automaton: :class:`PackedGroupRows`). ``have_lock``: the caller holds
        ``_lock``."""
        an = self.an
        gs, ts = an._edges(s)
        tags = an.tag[ts]
        # the analysis made this row already (same edge groups, same successor tags): the same bits
        got = an._row_cache.get((gs.tobytes(), tags.tobytes()))
        if got is not None:
            return np.array(got)
        tab = an._tag_table()
        if have_lock:
            slot, rows = self._grp.slots(an, gs, tags, tab)
        else:
            with self._lock:
                slot, rows = self._grp.slots(an, gs, tags, tab)
        out = np.empty(self._W, dtype=np.int32)
        _kernels().regular_row(out.view(np.uint32), gs, tags, slot, rows, an.g_toks, an.g_ptr, an.regular,
                               self.H.tclass, tab)
        return out

    # automata with at most this many signatures get every base row at compile (build_tables): a few
    # ms, and a decode of bounded free text, which reaches a new signature every few steps, never waits
    # for one; larger ones (JSON schemas with bounded strings) build them on first visit
    EAGER_BASE_SIGNATURES = 128
    # automata with at most this many special-token tables (keys) also get every table at compile: ~10 µs
    # each, where a first visit in a decode paid tens of µs of Python around it; unless the tables grow
    # past EAGER_TABLE_BYTES (Tekken: ~8,000 special tokens per table), which would be stored with the
    # automaton and loaded by the engine for every request
    EAGER_TABLE_KEYS = 128
    EAGER_TABLE_BYTES = 4 << 20

    def build_tables(self) -> None:
        """Build now, and keep with the automaton (pickled, restored by :meth:`reset_caches`), the base row
        of every signature and, with at most :attr:`EAGER_TABLE_KEYS` keys whose tables (with the
        ``tag_bits`` rows they read) stay within :attr:`EAGER_TABLE_BYTES`, every special-token table: a
        decode then computes each row in one kernel call."""
        n_keys = int(self._key_of_s.max(initial=-1)) + 1
        if n_keys <= self.EAGER_TABLE_KEYS:
            for s in np.unique(self._key_of_s, return_index=True)[1].tolist():
                self._fast_specials(int(s))
                if self._tables_too_large():
                    self.reset_caches()  # too large to store: built on first visit instead
                    break
        first = np.unique(self.base_index, return_index=True)[1]
        with self._lock:
            todo = [(sig, int(s)) for sig, s in enumerate(first.tolist()) if self._base_of_sig[sig] < 0]
            if todo:
                rows = np.stack([self._regular_row(s, have_lock=True) for _, s in todo])
                n0 = len(self._fspec[5])
                self._base_buf = _append_rows(self._base_buf, n0, rows)
                self._base_of_sig[[sig for sig, _ in todo]] = n0 + np.arange(len(todo))
                snap = self._fspec
                self._fspec = snap[:5] + (self._base_buf[: n0 + len(todo)].view(np.uint32), snap[6])
        self._keep_built()

    def build_start_table(self) -> None:
        """For automata :meth:`build_tables` leaves to first visits: build now, and keep with the automaton,
        the start state's special-token table and base row only. Every request's first row reads them: in a
        server the engine would build them on the request's first step, on the engine core's own critical
        path, where the compile process builds them off it. Not kept when over :attr:`EAGER_TABLE_BYTES`."""
        self._fast_specials(0)
        if self._tables_too_large():
            self.reset_caches()
            return
        self._keep_built()

    def _tables_too_large(self) -> bool:
        """Whether the special-token tables built so far, with the ``tag_bits`` rows they read, exceed
        :attr:`EAGER_TABLE_BYTES` (then they are not stored with the automaton)."""
        return self._fspec[0].nbytes + self._tag_bits.nbytes > self.EAGER_TABLE_BYTES

    def _keep_built(self) -> None:
        """Keep the base rows and special-token tables built so far with the automaton (``_eager_base``,
        ``_eager_tables``: pickled, restored by :meth:`reset_caches`; the others are built on first visit)."""
        with self._lock:
            n = len(self._fspec[5])
            self._eager_base = (np.array(self._base_buf[:n]), self._base_of_sig.copy()) if n else None
            spec, lo, hi, icache, tag_bits, _, slot = self._fspec
            built = bool((lo >= 0).any())
            self._eager_tables = ((np.array(spec), lo.copy(), hi.copy(), icache.copy(), np.array(tag_bits),
                                   slot.copy(), self._tag_row_arr.copy(), self._has_inner) if built else None)

    def _base_row(self, s: int) -> np.ndarray:
        """``int32[W]``: the base row of regex state s, built with its key's table when missing."""
        key = int(self._key_of_s[s])
        if self._fspec[1][key] < 0:
            self._fast_specials(s)
        snap = self._fspec
        return snap[5][snap[6][key]].view(np.int32)

    def _spec_rows_numpy(self, s: int, st: np.ndarray) -> np.ndarray:
        """The rows of :meth:`_fast_specials` with numpy, adding the ``tag_bits`` rows of new tags."""
        kernels = _kernels()
        H, an = self.H, self.an
        gs, ts = an._edges(s)
        if len(gs) and len(an.spec_toks):
            pos = np.minimum(np.searchsorted(gs, an.spec_group), len(gs) - 1)
            idx = np.flatnonzero(gs[pos] == an.spec_group)
        else:
            pos = idx = np.zeros(0, dtype=np.int64)
        spec = st[idx]  # (a copy)
        tgts = ts[pos[idx]].astype(np.int64)
        spec[:, kernels.SP_TGT] = tgts
        trow = self._tag_rows(an.tag[tgts])
        tag_bits = self._tag_bits
        kind = spec[:, kernels.SP_KIND]
        plain = kind == kernels.KIND_PLAIN
        spec[plain, kernels.SP_ARG] = tag_bits[trow[plain], np.maximum(H.tclass[spec[plain, kernels.SP_TOK]], 0)]
        ctx = kind == kernels.KIND_CTX
        spec[ctx, kernels.SP_ROW] = trow[ctx]
        return spec

    def _publish_specials(self, key: int, spec: np.ndarray, s: int, base: np.ndarray | None) -> None:
        """Append the special-token table ``spec`` of key ``key`` (that of regex state s) and, unless the
        signature of s has one already, its base row ``base`` (None: computed here); publish a new
        ``_fspec`` snapshot (byte-fallback tokens opening a character get their ``inner_cache`` rows
        here)."""
        kernels = _kernels()
        inner = np.flatnonzero(spec[:, kernels.SP_KIND] == kernels.KIND_INNER)
        with self._lock:
            spec_all, key_lo, key_hi, icache, _, base_all, base_slot = self._fspec
            if key_lo[key] >= 0:  # another thread built it meanwhile
                return
            sig = int(self.base_index[s])
            slot = int(self._base_of_sig[sig])
            if slot < 0:
                if base is None:  # (the caller saw a row: caches reset meanwhile)
                    base = self._regular_row(s, have_lock=True)
                slot = len(base_all)
                self._base_buf = _append_rows(self._base_buf, slot, base[None, :])
                base_all = self._base_buf[: slot + 1].view(np.uint32)
                self._base_of_sig[sig] = slot
            base_slot = base_slot.copy()
            base_slot[key] = slot
            if len(inner):
                spec[inner, kernels.SP_ARG] = len(icache) + np.arange(len(inner), dtype=np.int64)
                icache = np.concatenate([icache, np.zeros((len(inner), 2), dtype=np.int64)])
                self._has_inner = True
            key_lo, key_hi = key_lo.copy(), key_hi.copy()
            n0 = len(spec_all)
            key_lo[key], key_hi[key] = n0, n0 + len(spec)
            if len(spec):
                self._spec_buf = _append_rows(self._spec_buf, n0, spec)
                spec_all = self._spec_buf[: n0 + len(spec)]
            self._fspec = (spec_all, key_lo, key_hi, icache, self._tag_bits, base_all, base_slot)

    def _spec_static_init(self) -> np.ndarray:
        """``int64[n_spec, 7]``: the state-independent columns of the special tokens of the analysis
        (``an.spec_toks``): token, lookahead class of the first character, whitespace-final index, kind
        (:meth:`_compute_row_numpy`'s cases: never valid; plain; context-dependent class; byte-fallback
        token opening a character, which takes precedence), and the ``ctx_classes`` row of ctx tokens."""
        kernels = _kernels()
        H, an = self.H, self.an
        toks = an.spec_toks
        n = len(toks)
        st = np.zeros((n, 7), dtype=np.int64)
        lf = H.la_first[toks]
        never = (H.tclass[toks] < 0) | (lf < 0)
        inner = (H.tok_bf_byte[toks] >= 0) & (an.bf_start[toks] >= 0)
        ctx = (H.ctx_j[toks] >= 0) & ~inner
        kind = np.full(n, kernels.KIND_PLAIN, dtype=np.int64)
        kind[ctx] = kernels.KIND_CTX
        kind[inner] = kernels.KIND_INNER
        kind[never] = kernels.KIND_NEVER
        st[:, kernels.SP_TOK] = toks
        st[:, kernels.SP_LF] = np.maximum(lf, 0)
        st[:, kernels.SP_J] = H.j_of[toks]
        st[:, kernels.SP_KIND] = kind
        st[ctx, kernels.SP_ARG] = H.ctx_j[toks[ctx]]
        self._spec_static = st
        return st

    def _tag_rows(self, tags: np.ndarray) -> np.ndarray:
        """``int64[n]``: rows of ``_tag_bits`` for the bad-table tags ``tags`` (of some regex states); new
        tags get a row (:meth:`_tag_sigma_mask`: bit σ set per class when (class, σ) is bad). The caller
        publishes the grown table with its next ``_fspec`` snapshot."""
        tra = self._tag_row_arr
        missing = tags[tra[tags] < 0]
        if len(missing):
            with self._lock:
                new = [tg for tg in np.unique(missing).tolist() if tra[tg] < 0]
                if new:
                    rows = [self._tag_sigma_mask(tg) for tg in new]
                    n0 = len(self._tag_bits)
                    self._tag_buf = _append_rows(self._tag_buf, n0, np.stack(rows))
                    self._tag_bits = self._tag_buf[: n0 + len(rows)]
                    tra[new] = n0 + np.arange(len(new))  # (after the table holds the rows)
        return tra[tags]

    def _decide_inner(self, out: np.ndarray, spec: np.ndarray, icache: np.ndarray, pend: np.ndarray, k: int) -> None:
        """The kernel's pending byte-fallback tokens (open a multi-byte character): decide them with
        :meth:`_Analysis.inner_good`, set their bits in ``out``, remember the verdict per (token, σ) in
        ``icache`` when it does not depend on k (the token's class is not context-dependent)."""
        H, an = self.H, self.an
        for i, nsig in pend.tolist():
            v = int(spec[i, 0])
            good = an.inner_good(int(spec[i, 6]), H.next_cls(k, v), nsig, int(an.bf_start[v]))
            if good:
                out[v >> 5] |= np.int32(np.uint32(1 << (v & 31)).view(np.int32))
            if H.ctx_j[v] < 0:
                r = int(spec[i, 4])
                with self._lock:
                    if not good:
                        icache[r, 1] |= 1 << nsig
                    icache[r, 0] |= 1 << nsig

    def _compute_row_numpy(self, s: int, a: int, k: int, sig: int) -> np.ndarray:
        """Reference path of :meth:`compute_row` (numpy; also the ``a > 0`` case)."""
        H, an = self.H, self.an
        if a == 0:
            row = self._base_row(s) & H.not_banned_row(k)
            if not H.sigma_full[sig]:
                row &= H.sigma_rows[sig]
            toks, tgts, badmask = self._specials(s)
            if len(toks):
                sel = self._specials_ok(k, sig, toks, tgts, badmask)
                if sel.any():
                    row = row | _pack_ids(toks[sel], H.W)
            if bool(self.M.accepting[s]) and H.sigma_end[sig] and len(self.eos_ids):
                row |= self._eos_row
            return row
        # inside a byte-fallback character: byte tokens only
        row = np.zeros(H.W, dtype=np.int32)
        for v, ok in an.byte_moves(s, k, sig, a):
            if ok:
                row[v >> 5] |= np.int32(np.uint32(1 << (v & 31)).view(np.int32))
        return row

    def _tag_sigma_mask(self, tag: int) -> np.ndarray:
        """``int64[C]``: for the bad table with this tag, bit σ set per class when (class, σ) is bad
        (:meth:`_Analysis.tag_sigma_bits`). Cached per tag."""
        got = self._tagmask.get(tag)
        if got is None:
            got = self._tagmask[tag] = self.an.tag_sigma_bits(tag)
        return got

    def _specials_ok(self, k: int, sig: int, toks: np.ndarray, tgts: np.ndarray, badmask: np.ndarray) -> np.ndarray:
        """Vectorized over special tokens ``toks`` (→ regex states ``tgts``) of a plain state: allowed
        after (k, σ) and leading to a good state."""
        H, an = self.H, self.an
        ok = H.tclass[toks] >= 0
        lf = H.la_first[toks]
        ok &= (lf >= 0) & H.sigma_la[sig][np.maximum(lf, 0)]
        if k == H.START:
            ok &= ((H.start_row[toks >> 5].astype(np.int64) >> (toks & 31)) & 1).astype(bool)
        else:
            ok &= ~((H.bt[toks >> 5, k].astype(np.int64) >> (toks & 31)) & 1).astype(bool)
        j = H.j_of[toks]
        nsig = np.where(j >= 0, H.la_sets_idx[k, np.maximum(j, 0)], 0)
        ok &= nsig >= 0
        if not ok.any():
            return ok
        # successor goodness from the precomputed σ bitmasks
        plain = badmask >= 0
        ok &= ~(plain & (((np.maximum(badmask, 0) >> np.maximum(nsig, 0)) & 1) == 1))
        inner = (H.tok_bf_byte[toks] >= 0) & (an.bf_start[toks] >= 0)
        ctx = np.flatnonzero(ok & ~inner & ~plain)
        if len(ctx):
            cv = H.next_cls_matrix(np.array([k]), toks[ctx])[:, 0]
            ok[ctx] = an.succ_good_many(tgts[ctx], cv, nsig[ctx])
        for i in np.flatnonzero(ok & inner).tolist():
            v = int(toks[i])
            ok[i] = an.inner_good(int(tgts[i]), H.next_cls(k, v), int(nsig[i]), int(an.bf_start[v]))
        return ok

    def next_states(self, state: int, toks: np.ndarray) -> np.ndarray:
        """Vectorized :meth:`next_state` for tokens known to be allowed (non-EOS) in ``state``."""
        H, M = self.H, self.M
        s, a, k, sig = self.unpack(state)
        g = M.token_group[toks]
        lo, hi = int(M.edge_ptr[s]), int(M.edge_ptr[s + 1])
        pos = lo + np.searchsorted(M.edge_group[lo:hi], g)
        t = M.edge_next[np.minimum(pos, len(M.edge_next) - 1)].astype(np.int64)
        j = H.j_of[toks]
        nsig = np.where(j >= 0, H.la_sets_idx[k, np.maximum(j, 0)], 0)
        cv = H.next_cls_matrix(np.array([k]), toks)[:, 0]
        a2 = np.zeros(len(toks), dtype=np.int64)
        if H.acc is not None:
            b = H.tok_bf_byte[toks]
            isb = b >= 0
            if isb.any():
                m = H.acc[a, b[isb]]
                a2[isb] = np.where(m >= 0, m, 0)
        return ((t * self.n_acc + a2) * self.NK + (cv + 1)) * self.nsig + nsig

    def _special_ok_start(self, v: int, t: int, sig: int) -> bool:
        H, an = self.H, self.an
        lf = int(H.la_first[v])
        if int(H.tclass[v]) < 0 or lf < 0 or not H.sigma_la[sig, lf]:
            return False
        cv = H.next_cls(H.START, v)
        j = int(H.j_of[v])
        nsig = int(H.la_sets_idx[H.START, j]) if j >= 0 else 0
        a2 = int(an.bf_start[v]) if H.tok_bf_byte[v] >= 0 else -3
        if a2 >= 0:
            return an.inner_good(t, cv, nsig, a2)
        return an.succ_good(t, cv, nsig)

    def row(self, state: int) -> np.ndarray:
        """Memoized row of a packed state."""
        with self._lock:
            r = self._memo.get(state)
            if r is not None:
                self._memo.move_to_end(state)
                return r
        r = self.compute_row(*self.unpack(state))
        r.setflags(write=False)
        with self._lock:
            self._memo[state] = r
            if len(self._memo) > self._memo_max:
                self._memo.popitem(last=False)
        return r

    # --- automaton -------------------------------------------------------------------------------------

    def is_accepting(self, state: int) -> bool:
        s, a, k, sig = self.unpack(state)
        return a == 0 and bool(self.M.accepting[s]) and bool(self.H.sigma_end[sig])

    def next_state(self, state: int, token: int) -> int:
        """Packed successor of ``state`` after ``token`` (-1 if not allowed or EOS): the (memoized) row of
        ``state`` decides, then :meth:`successor`. Same result as :meth:`_next_state_reference`."""
        if not 0 <= token < self.H.V:
            return -1
        row = self.row(state)
        if not (int(row[token >> 5]) >> (token & 31)) & 1:
            return -1
        if token in self._eos_set:
            return -1
        return self.successor(state, token)

    def successor(self, state: int, token: int) -> int:
        """Packed successor of ``state`` after ``token``, for a non-EOS ``token`` known to be allowed in
        ``state`` (its row bit is set; not checked here): the regex transition (binary search in M's
        group CSR), the lookahead set after a whitespace-final token, the byte-fallback acceptor move
        and the class reached (context-dependent tokens: by the context group of the previous class).
        Scalar Python on cached lists, no numpy call besides scalar reads (~1–2 µs). -1 if M has no
        transition (cannot happen for an allowed token)."""
        ep = self._edges_py if self._edges_py is not None else self._init_edges_py()
        tg, eptr, egrp, enxt, info, la, ctxc, cgrp, acc, nsig_n, NK, n_acc, START = ep
        x, sig = divmod(state, nsig_n)
        x, kk = divmod(x, NK)
        s, a = divmod(x, n_acc)
        g = int(tg[token])
        if g < 0:
            return -1
        lo, hi = eptr[s], eptr[s + 1]
        i = bisect_left(egrp, g, lo, hi)
        if i >= hi or egrp[i] != g:
            return -1
        j, b, cj, cls = info[token]
        k = START if kk == 0 else kk - 1
        nsig = int(la[k, j]) if j >= 0 else 0
        a2 = 0
        if b >= 0 and acc is not None:
            m = int(acc[a, b])
            a2 = m if m >= 0 else 0
        if cj >= 0:
            cls = int(ctxc[cj, cgrp[k]])
        return ((enxt[i] * n_acc + a2) * NK + (0 if cls == START else cls + 1)) * nsig_n + nsig

    def _init_edges_py(self):
        """Python lists for :meth:`successor`: M's CSR (O(E), built on the first call), and per token
        ``(whitespace-final index, byte-fallback byte, context index, class)`` (cached per tokenizer on
        the helper: ~10 ms for 50k tokens, once)."""
        H, M = self.H, self.M
        info = getattr(H, "_fst_token_info", None)
        if info is None:
            info = list(zip(H.j_of.tolist(), H.tok_bf_byte.tolist(), H.ctx_j.tolist(), H.tclass.tolist()))
            H._fst_token_info = info
        ep = (M.token_group, M.edge_ptr.tolist(), M.edge_group.tolist(), M.edge_next.tolist(), info,
              H.la_sets_idx, H.ctx_classes, H.class_group.tolist(), H.acc, self.nsig, self.NK, self.n_acc, H.START)
        self._edges_py = ep
        return ep

    def _next_state_reference(self, state: int, token: int) -> int:
        """The numpy formulation of :meth:`next_state` (tests)."""
        H = self.H
        if not 0 <= token < H.V:
            return -1
        row = self.row(state)
        if not (int(row[token >> 5]) >> (token & 31)) & 1:
            return -1
        if token in self._eos_set:
            return -1
        s, a, k, sig = self.unpack(state)
        t = self.M.next_state(s, token)
        if t < 0:
            return -1
        j = int(H.j_of[token])
        nsig = int(H.la_sets_idx[k, j]) if j >= 0 else 0
        b = int(H.tok_bf_byte[token])
        a2 = 0
        if b >= 0 and H.acc is not None:
            m = int(H.acc[a, b])
            a2 = m if m >= 0 else 0
        return self.pack(t, a2, H.next_cls(k, token), nsig)

    def forced(self, state: int) -> int:
        """The only allowed token of ``state`` (EOS counts), or -1."""
        return self.forced_in_row(self.row(state))

    @staticmethod
    def forced_in_row(row: np.ndarray) -> int:
        """The only token of the ``int32[W]`` row ``row``, or -1 (one nonzero word holding one bit)."""
        if np.count_nonzero(row) != 1:
            return -1
        w = int(np.argmax(row != 0))
        v = int(np.uint32(row[w].view(np.uint32)))
        if v & (v - 1):
            return -1
        return w * 32 + v.bit_length() - 1


class PackedGroupRows:
    """Bit rows of the big token groups, per (group, successor tag), for :func:`.kernels.regular_row`: the
    part of a base row an edge of a big group contributes (its regular tokens, less those whose class is
    bad in the target's bad table) depends on the group and the target's tag only, and bounded free text
    meets the same few large groups (its tokens by length) and tags at state after state (Tekken's
    ``"[^"\\]{0,40}"``: 416 edges of big groups, 26 distinct pairs). Each pair is packed once
    (:func:`.kernels.pack_groups`, one pass over its tokens); an edge then costs an OR of W words.

    Snapshot semantics: :meth:`slots` publishes ``(slot dict, rows)`` as a whole and never writes rows
    published before, so a kernel may read returned rows while another thread adds pairs (callers that
    share an instance between threads call :meth:`slots` under their lock)."""

    BIG = 512  # groups of more tokens get packed rows

    def __init__(self, W: int):
        self._buf = np.zeros((0, W), dtype=np.uint32)
        self._snap: tuple[dict, np.ndarray] = ({}, self._buf)

    @property
    def nbytes(self) -> int:
        return int(self._buf.nbytes)

    def slots(self, an, gs: np.ndarray, tags: np.ndarray, tab: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(edge_slot int64[E], rows uint32[n, W])`` for the edges ``gs`` (groups, ``int32[E]``) to
        targets with ``tags`` (``int64[E]``) of analysis ``an`` (``g_size``, ``g_toks``, ``g_ptr``,
        ``regular``; ``tab`` its σ = ALL rows per tag): the row of each big group's edge, -1 elsewhere;
        packs the pairs not seen before."""
        slot, rows = self._snap
        out = np.full(len(gs), -1, dtype=np.int64)
        big = np.flatnonzero(an.g_size[gs] > self.BIG)
        if not len(big):
            return out, rows
        keys = list(zip(gs[big].tolist(), tags[big].tolist()))
        need = sorted({k for k in keys if k not in slot})
        if need:
            new = np.zeros((len(need), self._buf.shape[1]), dtype=np.uint32)
            arr = np.array(need, dtype=np.int64).reshape(-1, 2)
            _kernels().pack_groups(arr[:, 0].copy(), arr[:, 1].copy(), an.g_toks, an.g_ptr, an.regular,
                                   an.H.tclass, tab, new)
            n0 = len(rows)
            self._buf = _append_rows(self._buf, n0, new)
            slot = dict(slot)
            slot.update({k: n0 + i for i, k in enumerate(need)})
            rows = self._buf[: n0 + len(need)]
            self._snap = (slot, rows)
        out[big] = [slot[k] for k in keys]
        return out, rows


def _append_rows(buf: np.ndarray, n: int, rows: np.ndarray) -> np.ndarray:
    """Write ``rows`` after the first ``n`` rows of ``buf`` (2-D), in place when the capacity allows, else
    into a buffer of twice the size (amortized O(1) per row). Rows below ``n`` are never written, so
    views of them published earlier (snapshots read by other threads' kernels) stay valid."""
    need = n + len(rows)
    if need > buf.shape[0]:
        grown = np.empty((max(2 * buf.shape[0], need, 16), buf.shape[1]), dtype=buf.dtype)
        grown[:n] = buf[:n]
        buf = grown
    buf[n:need] = rows
    return buf


def _signatures(an: _Analysis) -> np.ndarray:
    """``int32[S]``: the signature of each regex state, numbered from 0 in order of first appearance:
    states with equal (edge groups, successor tags) have equal base rows and special-token tables
    (:func:`.kernels.signatures`; with ``use_kernels`` off or on a hash collision, :func:`_signatures_reference`)."""
    M = an.M
    if not an.use_kernels:
        return _signatures_reference(an)
    out = _kernels().signatures(np.ascontiguousarray(M.edge_ptr, dtype=np.int64),
                                np.ascontiguousarray(M.edge_group, dtype=np.int32),
                                np.ascontiguousarray(an.tag[M.edge_next], dtype=np.int64))
    return _signatures_reference(an) if out is None else out  # (None: a hash collision)


def _signatures_reference(an: _Analysis) -> np.ndarray:
    """:func:`_signatures` in Python: a dict keyed by each state's edge groups and successor tags."""
    M = an.M
    S = M.num_states
    keys: dict = {}
    index = np.empty(S, dtype=np.int32)
    ptr = M.edge_ptr.tolist()
    eg = np.ascontiguousarray(M.edge_group, dtype=np.int32).tobytes()
    et = np.ascontiguousarray(an.tag[M.edge_next], dtype=np.int64).tobytes()
    for s in range(S):  # (bytes slices: no numpy call per state)
        a, b = ptr[s], ptr[s + 1]
        index[s] = keys.setdefault((eg[4 * a : 4 * b], et[8 * a : 8 * b]), len(keys))
    return index


EXPLICIT_MAX_REGEX_TOKENS = 4096  # (:func:`canonical_automaton`: no explicit attempt above it)


def _max_state_tokens(M: TokenDFA, gsize: np.ndarray) -> int:
    """The most tokens any state of ``M`` allows (:meth:`.token_dfa.TokenDFA.tokens_per_state` with the
    group sizes ``gsize``, ``int64[G]``)."""
    return int(M.tokens_per_state(gsize).max(initial=0))


def _try_explicit(fc: FactoredCanonical, V: int, eos_ids, max_states: int, max_edges: int, deadline: float, stats):
    """Enumerate the reachable product; None if larger than the budgets."""
    start = 0
    index = {start: 0}
    order = [start]
    rows = []
    ptrs = [0]
    toks_all, nxt_all = [], []
    n_edges = 0
    eos = set(int(e) for e in np.asarray(eos_ids).tolist())
    i = 0
    while i < len(order):
        st = order[i]
        i += 1
        row = fc.row(st)
        ids = ids_of_row(row)
        if eos and fc.is_accepting(st):
            ids = ids[~np.isin(ids, list(eos))]
        n_edges += len(ids)
        if n_edges > max_edges or len(ids) > 1024:
            return None
        packed = fc.next_states(st, ids.astype(np.int64))
        uniq, inv = np.unique(packed, return_inverse=True)
        ids_u = np.empty(len(uniq), dtype=np.int64)
        for j, ns in enumerate(uniq.tolist()):
            q = index.get(ns)
            if q is None:
                q = index[ns] = len(order)
                order.append(ns)
                if len(order) > max_states:
                    return None
            ids_u[j] = q
        nx = ids_u[inv.reshape(-1)]
        rows.append(row)
        toks_all.append(ids.astype(np.int32))
        nxt_all.append(nx.astype(np.int32))
        ptrs.append(ptrs[-1] + len(ids))
        if time.perf_counter() > deadline:
            return None
    S = len(order)
    seen: dict = {}
    row_index = np.empty(S, dtype=np.int32)
    uniq_rows = []
    for i2, r in enumerate(rows):
        key = r.tobytes()
        j2 = seen.get(key)
        if j2 is None:
            j2 = seen[key] = len(uniq_rows)
            uniq_rows.append(r)
        row_index[i2] = j2
    uniq = np.stack(uniq_rows)
    accepting = np.array([fc.is_accepting(st) for st in order], dtype=bool)
    forced = np.array([fc.forced(st) for st in order], dtype=np.int32)
    stats = dict(stats)
    stats.update(product_states=S, product_edges=int(ptrs[-1]), mode="explicit")
    return CompiledAutomaton(
        vocab_size=V, eos_ids=eos_ids, rows=uniq, row_index=row_index.reshape(-1), trans_ptr=np.asarray(ptrs),
        trans_group=np.concatenate(toks_all) if toks_all else np.zeros(0, np.int32),
        trans_next=np.concatenate(nxt_all) if nxt_all else np.zeros(0, np.int32),
        token_group=np.arange(V, dtype=np.int32), accepting=accepting, forced_token=forced, stats=stats,
    )


def canonical_automaton(M: TokenDFA, artifacts, trie, eos_ids, V: int, *, deadline: float, n_char_states: int,
                        max_product_states: int = 256, max_explicit_edges: int = 30_000,
                        stats: dict | None = None) -> CompiledAutomaton:
    """Intersect the token DFA ``M`` (byte policy ``no_ascii_with_piece``) with the canonical filter of
    ``artifacts`` (module docstring).

    Returns:
        An explicit :class:`CompiledAutomaton` when the reachable product has at most
        ``max_product_states`` states and ``max_explicit_edges`` token transitions, else a factored one.

    Raises:
        EmptyLanguageError: no canonical token sequence satisfies the constraint.
        CompileBudgetError: past ``deadline``.
    """
    t0 = time.perf_counter()
    H = canonical_helper(artifacts, trie)
    an = _Analysis(M, H, deadline, n_char_states)
    an.run(n_char_states)
    t1 = time.perf_counter()
    base_index = _signatures(an)
    fc = FactoredCanonical(M, H, an, eos_ids, base_index)
    start_row = fc.row(0)
    if not start_row.any():
        raise EmptyLanguageError("no canonical token sequence satisfies the constraint", None)
    t2 = time.perf_counter()
    st = dict(stats or {})
    st.update(ms_deadend=1e3 * (t1 - t0), ms_rows=1e3 * (t2 - t1), canon_classes=H.C,
              bad_states=int(sum(b is not None for b in an.bad)))
    # not tried when the regex side alone has more states than the product may have: the product holds
    # at least one state per regex state a canonical path reaches (nearly all), so the enumeration would
    # fail after paying for up to max_product_states rows; such an automaton stays factored
    # nor when a regex state allows more than EXPLICIT_MAX_REGEX_TOKENS tokens (free text, a JSON string):
    # its product states allow far more than the 1,024 tokens an explicit row may hold unless a class bans
    # nearly all of them, so the attempt computed a few rows and failed (Tekken: 1-6 ms per compile)
    exp = None
    if M.num_states <= max_product_states and _max_state_tokens(M, an.g_size) <= EXPLICIT_MAX_REGEX_TOKENS:
        exp = _try_explicit(fc, V, eos_ids, max_product_states, max_explicit_edges, deadline, st)
    if exp is not None:
        exp.stats["ms_explicit"] = 1e3 * (time.perf_counter() - t2)
        return exp
    st["ms_explicit"] = 1e3 * (time.perf_counter() - t2)  # the attempt that found the product too large
    fc.reset_caches()  # (the attempt's rows and special tables: rebuilt on demand where a decode goes)
    t3 = time.perf_counter()
    if int(base_index.max(initial=-1)) + 1 <= fc.EAGER_BASE_SIGNATURES:
        fc.build_tables()
    else:
        fc.build_start_table()
    st["ms_rows"] += 1e3 * (time.perf_counter() - t3)
    st["mode"] = "factored"
    S = M.num_states
    return CompiledAutomaton(
        vocab_size=V, eos_ids=eos_ids, rows=np.zeros((0, H.W), np.int32), row_index=base_index, trans_ptr=M.edge_ptr,
        trans_group=M.edge_group, trans_next=M.edge_next, token_group=M.token_group,
        accepting=M.accepting, forced_token=np.full(S, -1, dtype=np.int32), factored=fc, stats=st,
    )
