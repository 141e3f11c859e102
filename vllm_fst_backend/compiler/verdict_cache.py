"""Dead-end verdicts shared between the compiles of one process (one cache per tokenizer helper).

The dead-end analysis (:class:`.canonical_product._Analysis`, paper 004 §6.5 with 000 §3.3) decides per
regex state ``s`` a *bad table* (``bool[nσ, C]``: the (lookahead set, class) pairs with which ``s`` cannot
reach acceptance canonically) from what ``s`` reads only: whether it accepts, whether it lies inside a
UTF-8 character, whether a whitespace-final token enters it, the classes that enter it, and for each
successor the tokens that lead there and the successor's own bad table. A compile already shares
verdicts between its states with equal such *content*. Regexes converted from different JSON schemas
share most of it too (the inside of a bounded string, a number, the text between two keys), but their
token DFAs number groups, states and tables differently, so this cache keys a verdict by content:

* the tokens on the edges as a sum of per-token random 64-bit values (two of them: 128 bits), each
  edge's sum multiplied by an odd number derived from the successor's bad table (the BLAKE2b digest of
  its packed bits, :func:`table_digest`; 1 for "all good") — equal for any grouping of the same tokens onto successors with equal tables;
* the entering classes as a sum of per-class random values;
* the three flags.

A verdict is exact whatever grouping or witness order computed it, so a hit returns the very table
the analysis would compute (tests compare a compile on a warm cache with one on a cold cache). Two
different contents sharing a key needs a 128-bit collision of random sums.

Bounded: at most :data:`MAX_BYTES` of distinct tables and :data:`MAX_ENTRIES` verdicts, and at most an
eighth of the compile memory budget (``$VLLM_FST_COMPILE_MEMORY_MB``, which counts the cache: a process
that compiles many schemas must not push a small one over it); over either the cache starts empty again. Thread-safe (compiles may run in threads of one engine process); a table it
returns is read-only and shared.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np

__all__ = ["VerdictCache", "verdict_cache", "table_digest", "MAX_BYTES", "MAX_ENTRIES"]

MAX_BYTES = 64 << 20  # distinct bad tables kept (SmolLM2: 43 KB each, Tekken: 180 KB)
MAX_ENTRIES = 200_000  # verdicts kept (~150 bytes each)
_SEED = 0x0F57_C0DE
_MISSING = object()
_LOCK = threading.Lock()


class VerdictCache:
    """Content-keyed memo of dead-end verdicts (module docstring).

    Args:
        n_tokens: vocabulary size V (token ids ``0..V-1``).
        n_classes: canonical classes C.
        max_bytes: bytes of distinct tables kept at most.
        max_entries: verdicts kept at most.

    Attributes:
        tok_hash: ``uint64[2, V]`` random value per token; cls_hash: ``uint64[2, C]`` per class.
        hits, misses: lookups answered / not answered (since the start).
    """

    def __init__(self, n_tokens: int, n_classes: int, max_bytes: int = MAX_BYTES, max_entries: int = MAX_ENTRIES):
        rng = np.random.default_rng(_SEED)
        top = np.iinfo(np.uint64).max
        self.tok_hash = rng.integers(0, top, size=(2, int(n_tokens)), dtype=np.uint64, endpoint=True)
        self.cls_hash = rng.integers(0, top, size=(2, max(int(n_classes), 1)), dtype=np.uint64, endpoint=True)
        self.max_bytes = int(max_bytes)
        self.max_entries = int(max_entries)
        self._gen = ({}, {}, [0], {})  # key -> digest (None: all good); digest -> table; [bytes]; id -> digest
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    # --- content hashes ------------------------------------------------------------------------------

    def digest_of(self, table: np.ndarray) -> bytes:
        """:func:`table_digest`, looked up for the tables this cache shares (kept alive by it while listed)."""
        d = self._gen[3].get(id(table))
        return d if d is not None else table_digest(table)

    @staticmethod
    def multipliers(digest: bytes) -> tuple[int, int]:
        """The two odd 64-bit multipliers of a successor whose bad table has ``digest``."""
        return int.from_bytes(digest[:8], "little") | 1, int.from_bytes(digest[8:16], "little") | 1

    def group_hashes(self, g_toks: np.ndarray, g_ptr: np.ndarray) -> np.ndarray:
        """``uint64[2, G]``: per token group (tokens ``g_toks[g_ptr[g]:g_ptr[g+1]]``) the sums of its
        tokens' values (wrapping)."""
        if len(g_ptr) <= 1:
            return np.zeros((2, 0), dtype=np.uint64)
        from . import kernels

        return kernels.group_hash_sums(g_toks, np.asarray(g_ptr, dtype=np.int64), self.tok_hash)

    # --- lookups -------------------------------------------------------------------------------------

    def get(self, key) -> tuple[bool, np.ndarray | None]:
        """``(found, table)`` for ``key`` (table None: all good)."""
        verdicts, tables = self._gen[0], self._gen[1]
        d = verdicts.get(key, _MISSING)
        if d is _MISSING:
            self.misses += 1
            return False, None
        if d is None:
            self.hits += 1
            return True, None
        t = tables.get(d)
        if t is None:  # (a reset between the two reads)
            self.misses += 1
            return False, None
        self.hits += 1
        return True, t

    def put(self, key, table: np.ndarray | None) -> np.ndarray | None:
        """Store the verdict of ``key``; returns the table to use from now on (the shared read-only copy
        when one with the same content is stored already)."""
        with self._lock:
            verdicts, tables, size, ids = self._gen
            d = None
            if table is not None:
                d = self.digest_of(table)
                shared = tables.get(d)
                if shared is None:
                    if size[0] + table.nbytes > self.max_bytes or len(verdicts) >= self.max_entries:
                        self._gen = verdicts, tables, size, ids = ({}, {}, [0], {})
                    shared = np.array(table, copy=True)
                    shared.setflags(write=False)
                    tables[d] = shared
                    ids[id(shared)] = d
                    size[0] += shared.nbytes
                table = shared
            elif len(verdicts) >= self.max_entries:
                self._gen = verdicts, tables, size, ids = ({}, {}, [0], {})
            verdicts[key] = d
        return table

    def clear(self) -> None:
        """Forget every verdict (the next compiles compute theirs)."""
        with self._lock:
            self._gen = ({}, {}, [0], {})

    def nbytes(self) -> int:
        """Bytes of the tables kept now (the keys add ~150 bytes per verdict)."""
        return self._gen[2][0]

    def __len__(self) -> int:
        return len(self._gen[0])


def table_digest(table: np.ndarray) -> bytes:
    """16-byte BLAKE2b digest of a bad table (``bool[nσ, C]``): of its shape and its bits packed (an eighth
    of its bytes: 180 KB at Tekken)."""
    bits = np.packbits(np.ascontiguousarray(table, dtype=bool))
    return hashlib.blake2b(np.asarray(table.shape, dtype=np.int64).tobytes() + bits.tobytes(), digest_size=16).digest()


def _budget_share() -> int:
    """Bytes of tables the process's caches may keep: :data:`MAX_BYTES`, at most an eighth of the compile
    memory budget (:func:`.service.memory_budget_from_env`; its default when the variable is malformed)."""
    from .service import memory_budget_from_env

    try:
        budget = memory_budget_from_env()
    except Exception:  # (malformed: the request path reports it; here the default applies)
        budget = 768 << 20
    return max(1 << 20, min(MAX_BYTES, budget // 8))


def verdict_cache(helper) -> VerdictCache:
    """The process's :class:`VerdictCache` of a canonical helper (``V`` tokens, ``C`` classes), made on
    first use and kept on the helper."""
    vc = getattr(helper, "_fst_verdicts", None)
    if vc is None:
        with _LOCK:
            vc = getattr(helper, "_fst_verdicts", None)
            if vc is None:
                cap = _budget_share()
                vc = VerdictCache(helper.V, helper.C, max_bytes=cap, max_entries=min(MAX_ENTRIES, cap // 320))
                helper._fst_verdicts = vc
    return vc
