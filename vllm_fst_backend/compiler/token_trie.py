"""The token trie in numpy form: the detokenizer T_V (paper 001 Alg. 1) as arrays, built once per
tokenizer and reused by every compile.

Nodes are the distinct byte prefixes of token spellings, numbered level by level (depth, then parent,
then byte), so that the children of a node are contiguous and a level is a contiguous range. Node 0 is
the empty prefix. Each token ends at exactly one node (tokens with the same bytes share it).

Byte-fallback tokens (SentencePiece ``<0xNN>``) are 1-byte strings in the trie; which of them a compile
may use is the byte policy (:func:`policy_token_mask`); under the ``"canonical"`` policy they are not
trie tokens at all but go through :func:`canonical_byte_ranges` (one whole character out of the
characters that have no single-character piece), as the detokenizer FST does.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np



@dataclass
class TokenTrie:
    """Arrays of the token trie (module docstring).

    Attributes:
        vocab_size: V.
        node_parent: ``int32[N]`` (-1 for the root).
        node_byte: ``uint8[N]`` -- the byte on the arc into the node (0 for the root).
        level_ptr: ``int64[D+2]`` -- nodes of depth d are ``level_ptr[d]:level_ptr[d+1]``.
        child_ptr: ``int64[N+1]`` -- children of node n are ``child_ptr[n]:child_ptr[n+1]``.
        tok_node: ``int32[V]`` -- end node of each token, -1 for tokens without bytes (special).
        byte_fallback: ``int32[256]`` -- byte → ``<0xNN>`` token id, -1 if none.
        single_byte_piece: ``bool[256]`` -- a normal (non-byte-fallback) token spells exactly this byte.
        token_bytes: the list of token spellings (``None`` for special tokens).
        first_byte_nodes: ``int64[256]`` -- the number of trie nodes under each first byte (what a walk
            from a state accepting only that first byte can visit at most; the token DFA's prefixed chains
            weigh their cost with it).
    """

    vocab_size: int
    node_parent: np.ndarray
    node_byte: np.ndarray
    level_ptr: np.ndarray
    child_ptr: np.ndarray
    tok_node: np.ndarray
    byte_fallback: np.ndarray
    single_byte_piece: np.ndarray
    token_bytes: list
    first_byte_nodes: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.node_parent.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.level_ptr.shape[0] - 2)


def build_token_trie(token_bytes: list, byte_fallback) -> TokenTrie:
    """Build the trie of ``token_bytes`` (list of V ``bytes | None``); ``byte_fallback``: ``int32[256]``
    array or ``{byte: id}`` dict. Cost: ~0.3 s for 50k tokens (Python set of prefixes)."""
    V = len(token_bytes)
    bf = np.full(256, -1, dtype=np.int32)
    if isinstance(byte_fallback, dict):
        for b, t in byte_fallback.items():
            bf[b] = t
    elif byte_fallback is not None:
        bf[:] = np.asarray(byte_fallback, dtype=np.int32)
    prefixes = {b""}
    for tb in token_bytes:
        if tb:
            for k in range(1, len(tb) + 1):
                prefixes.add(tb[:k])
    ordered = sorted(prefixes, key=lambda p: (len(p), p))
    # sort by (depth, parent id, byte): parents precede children and are themselves in that order,
    # so sorting by (len, bytes) gives exactly (depth, parent order, byte) as bytes compare lexicographically
    index = {p: i for i, p in enumerate(ordered)}
    N = len(ordered)
    parent = np.full(N, -1, dtype=np.int32)
    byte = np.zeros(N, dtype=np.uint8)
    depth = np.zeros(N, dtype=np.int64)
    for i, p in enumerate(ordered):
        if p:
            parent[i] = index[p[:-1]]
            byte[i] = p[-1]
            depth[i] = len(p)
    D = int(depth.max()) if N else 0
    level_ptr = np.searchsorted(depth, np.arange(D + 2)).astype(np.int64)
    # children contiguous: nodes sorted by (depth, parent-order, byte) → children of n are contiguous
    counts = np.bincount(parent[1:], minlength=N) if N > 1 else np.zeros(N, dtype=np.int64)
    # children of n are contiguous (the sort groups level d+1 by parent prefix, in parent order)
    child_ptr = np.concatenate([[1], 1 + np.cumsum(counts)]).astype(np.int64)
    tok_node = np.full(V, -1, dtype=np.int32)
    for t, tb in enumerate(token_bytes):
        if tb:
            tok_node[t] = index[tb]
    single = np.zeros(256, dtype=bool)
    bf_ids = set(int(x) for x in bf if x >= 0)
    for t, tb in enumerate(token_bytes):
        if tb is not None and len(tb) == 1 and t not in bf_ids:
            single[tb[0]] = True
    anc = np.arange(len(parent), dtype=np.int64)  # each node's depth-1 ancestor (level order: its parent's)
    for d in range(2, len(level_ptr) - 1):
        anc[level_ptr[d] : level_ptr[d + 1]] = anc[parent[level_ptr[d] : level_ptr[d + 1]]]
    first_nodes = np.bincount(byte[anc[1:]], minlength=256).astype(np.int64)
    return TokenTrie(
        vocab_size=V, node_parent=parent, node_byte=byte, level_ptr=level_ptr, child_ptr=child_ptr,
        tok_node=tok_node, byte_fallback=bf, single_byte_piece=single, token_bytes=token_bytes,
        first_byte_nodes=first_nodes,
    )


_TRIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TRIES_BY_FP: dict = {}
_LOCK = threading.Lock()


def trie_for(artifacts) -> TokenTrie:
    """The (cached) :class:`TokenTrie` of a :class:`TokenizerArtifacts` (or anything with
    ``token_bytes``, ``byte_fallback`` and ``fingerprint``). Thread-safe; built once per tokenizer.

    The first call in a process also compiles (or loads from numba's on-disk cache) the kernels of
    :mod:`.kernels` (:func:`.kernels.warm_up`), so that no compile budget ever pays the JIT."""
    from .kernels import warm_up

    warm_up()
    with _LOCK:
        try:
            got = _TRIES.get(artifacts)
        except TypeError:
            got = None
        if got is None:
            fp = getattr(artifacts, "fingerprint", None)
            got = _TRIES_BY_FP.get(fp) if fp is not None else None
        if got is None:
            got = build_token_trie(list(artifacts.token_bytes), artifacts.byte_fallback)
            if fp is not None:
                _TRIES_BY_FP[fp] = got
        try:
            _TRIES[artifacts] = got
        except TypeError:
            pass
        return got


def policy_token_mask(trie: TokenTrie, byte_policy: str) -> np.ndarray:
    """``bool[V]``: tokens that are *trie tokens* under ``byte_policy`` (paper 000 §4.3).

    * every normal token with a spelling;
    * byte-fallback tokens: all (``"all"``), those of non-ASCII bytes or bytes without a single-byte
      piece (``"no_ascii_with_piece"``), none (``"canonical"``: they go through
      :func:`canonical_byte_ranges` instead).
    """
    mask = trie.tok_node >= 0
    bf = trie.byte_fallback
    has = bf >= 0
    ids = bf[has]
    if byte_policy == "all":
        pass
    elif byte_policy == "no_ascii_with_piece":
        bytes_ = np.flatnonzero(has)
        drop = ids[(bytes_ < 0x80) & trie.single_byte_piece[bytes_]]
        mask[drop] = False
    elif byte_policy == "canonical":
        mask[ids] = False
    else:
        raise ValueError(f"unknown byte policy {byte_policy!r}")
    return mask


def canonical_byte_ranges(trie: TokenTrie) -> list[tuple[int, int]]:
    """Code points that SentencePiece spells with byte-fallback tokens (see
    ``detokenizer.canonical_byte_codepoints``). Empty when there is no byte fallback."""
    if not (trie.byte_fallback >= 0).any():
        return []
    from ..artifacts.detokenizer import byte_fallback_codepoints

    return byte_fallback_codepoints(trie.token_bytes, set(int(x) for x in trie.byte_fallback if x >= 0))
