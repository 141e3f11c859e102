"""The character-to-subword ("detokenizing") transducer T_V over bytes.

Paper 001 §2.3 Alg. 1 and paper 004 §5 / App. B Alg. 6: a trie transducer whose input side spells the
surface bytes of a token and whose output side is that token, closed under concatenation (the final
state is the start state), so that for a byte-level acceptor ``A`` (regex DFA, UTF-8/script filter),
``project(A @ T_V, "output")`` accepts exactly the token sequences whose concatenated bytes are in
``L(A)`` (004 Eq. 3; with ε-removal the result is already deterministic, 004 Lemma 1).

Labels (docs/architecture.md): input byte ``b`` is label ``b + 1``, output token ``t`` is label ``t + 1``,
0 is ε.

Structure (our choice, documented in docs/architecture.md)
---------------------------------------------------------
A **trie on the input bytes with the token emitted on the LAST arc** (as 001 Alg. 1 after merging common
prefixes, and 004 Alg. 6):

* one state per distinct *proper* prefix of a token spelling (the root, state 0, is the empty prefix);
* for ``k < n - 1`` the arc ``prefix[:k] --b_k : ε--> prefix[:k+1]`` is shared by every token with that
  prefix;
* the last byte of token ``t`` is the arc ``prefix[:n-1] --b_{n-1} : t+1--> root``.

A state may therefore have two arcs with the same input label (continue in the trie, or close token
``t``): the FST is non-deterministic on the input side, which composition handles; it has no input-ε
arcs, so ``A @ T_V`` needs no ε-filter work on the ``A`` side. Size: ``#proper prefixes + #tokens`` arcs
(≈ 2V), versus ``Σ|t|`` (≈ 6–7 V) for one separate path per token with the output on the first arc
(which cannot share the first arc between tokens, since each carries a different output). Composition
is also cheaper with the shared trie: each byte prefix is explored once per state of ``A`` rather than
once per token. The price is that a token is known only when its last byte is read; after projecting
and removing ε this makes no difference to the token automaton.

Byte-fallback tokens (SentencePiece ``<0xNN>``, ``info.byte_fallback``) follow ``byte_policy``
(paper 000 §4.3, ambiguity between characters and bytes):

* ``"all"``: every byte token is a 1-byte loop at the root;
* ``"no_ascii_with_piece"``: ASCII byte tokens only for bytes ``b`` with no piece spelling ``bytes([b])``
  (e.g. ``<0x0A>`` for ``"\\n"`` in Mistral v1); every non-ASCII byte token;
* ``"canonical"``: byte tokens only in sequences spelling ONE whole UTF-8 character that is not a
  single-character piece, as SentencePiece's byte fallback emits them. Built from the code-point ranges
  with ``unicode_filters.codepoint_ranges_to_utf8_fst`` and relabelled to output the byte token ids.

For byte-level kinds (no byte fallback) all policies give the same FST.
"""

from __future__ import annotations

import time

import pynini

BYTE_POLICIES = ("all", "no_ascii_with_piece", "canonical")
DEFAULT_BYTE_POLICY = "canonical"

MAX_CODEPOINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
SP_SPACE_CODEPOINT = 0x2581  # "▁": SentencePiece reads a literal ▁ as a space, so it is never spelt by bytes


def _check_policy(byte_policy: str) -> None:
    if byte_policy not in BYTE_POLICIES:
        raise ValueError(f"unknown byte_policy {byte_policy!r}; expected one of {BYTE_POLICIES}")


def policies_differ(info) -> bool:
    """True when the byte policies give different FSTs, i.e. the tokenizer has byte-fallback tokens."""
    return bool(info.byte_fallback)


def _byte_token_ids(info) -> set[int]:
    return set(info.byte_fallback.values())


def build_detokenizer(info, byte_policy: str = DEFAULT_BYTE_POLICY) -> pynini.Fst:
    """Build the byte → token transducer T_V for ``info`` (a :class:`TokenizerInfo`).

    Args:
        info: the tokenizer; tokens with ``token_bytes`` ``None`` (special/control) or empty are excluded.
        byte_policy: one of :data:`BYTE_POLICIES` (see the module docstring); only matters when
            ``info.byte_fallback`` is non-empty.

    Returns:
        A ``pynini.Fst`` (tropical weights, all weights One) with start state 0 = the only final state,
        input labels ``byte + 1`` (1..256), output labels ``token + 1`` or 0, arc-sorted on ilabel.
        Shape: a trie with the token on the last arc (module docstring; 001 Alg. 1, 004 Alg. 6).

    Raises:
        ValueError: unknown ``byte_policy``.
    """
    _check_policy(byte_policy)
    byte_ids = _byte_token_ids(info)
    one = pynini.Weight.one("tropical")
    fst = pynini.Fst()
    root = fst.add_state()
    fst.set_start(root)
    fst.set_final(root)
    Arc = pynini.Arc
    add_arc = fst.add_arc
    add_state = fst.add_state
    node: dict[bytes, int] = {b"": root}

    for tid, tb in enumerate(info.token_bytes):
        if not tb or tid in byte_ids:
            continue
        # walk / extend the trie over the proper prefix tb[:-1]
        n = len(tb)
        k = n - 1
        while k > 0 and tb[:k] not in node:  # longest existing proper prefix
            k -= 1
        cur = node[tb[:k]]
        for j in range(k, n - 1):
            nxt = add_state()
            add_arc(cur, Arc(tb[j] + 1, 0, one, nxt))
            node[tb[: j + 1]] = nxt
            cur = nxt
        add_arc(cur, Arc(tb[-1] + 1, tid + 1, one, root))

    if info.byte_fallback:
        if byte_policy == "all":
            for b, tid in info.byte_fallback.items():
                add_arc(root, Arc(b + 1, tid + 1, one, root))
        elif byte_policy == "no_ascii_with_piece":
            single = _single_byte_pieces(info)
            for b, tid in info.byte_fallback.items():
                if b >= 0x80 or b not in single:
                    add_arc(root, Arc(b + 1, tid + 1, one, root))
        else:
            _attach_byte_acceptor(fst, root, _canonical_byte_acceptor(info), info.byte_fallback)

    fst.arcsort("ilabel")
    return fst


def _single_byte_pieces(info) -> set[int]:
    """Bytes ``b`` such that a normal (non-byte-fallback, non-special) token spells ``bytes([b])``."""
    byte_ids = _byte_token_ids(info)
    return {tb[0] for i, tb in enumerate(info.token_bytes) if tb is not None and len(tb) == 1 and i not in byte_ids}


def canonical_byte_codepoints(info) -> list[tuple[int, int]]:
    """Code points that SentencePiece's byte fallback spells with ``<0xNN>`` tokens, as sorted disjoint
    inclusive ranges ``[(lo, hi), ...]``: every scalar value (surrogates excluded) that is not a
    single-character normal piece, minus U+2581 ``▁`` (read as a space by SentencePiece, so never
    spelt by bytes). Empty when the tokenizer has no byte fallback."""
    if not info.byte_fallback:
        return []
    return byte_fallback_codepoints(info.token_bytes, _byte_token_ids(info))


def byte_fallback_codepoints(token_bytes, byte_ids) -> list[tuple[int, int]]:
    """The ranges of :func:`canonical_byte_codepoints` from ``token_bytes`` (list of bytes or None) and
    the set ``byte_ids`` of byte-fallback token ids (shared with the compiler's token trie)."""
    excluded = {SP_SPACE_CODEPOINT, *range(SURROGATES[0], SURROGATES[1] + 1)}
    for i, tb in enumerate(token_bytes):
        if tb is None or i in byte_ids or len(tb) > 4:
            continue
        try:
            s = tb.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if len(s) == 1:
            excluded.add(ord(s))
    ranges: list[tuple[int, int]] = []
    lo = 0
    for x in sorted(excluded):
        if x > lo:
            ranges.append((lo, x - 1))
        lo = max(lo, x + 1)
    if lo <= MAX_CODEPOINT:
        ranges.append((lo, MAX_CODEPOINT))
    return ranges


def _canonical_byte_acceptor(info) -> pynini.Fst:
    """Minimal DFA over byte labels accepting the UTF-8 encodings of :func:`canonical_byte_codepoints`."""
    ranges = canonical_byte_codepoints(info)
    from .unicode_filters import codepoint_ranges_to_utf8_fst

    acc = codepoint_ranges_to_utf8_fst(ranges)
    acc = pynini.determinize(acc.copy().rmepsilon()).minimize()
    return acc


def _attach_byte_acceptor(fst: pynini.Fst, root: int, acc: pynini.Fst, byte_fallback: dict[int, int]) -> None:
    """Copy the byte acceptor ``acc`` into ``fst`` between ``root`` and ``root``: its start state becomes
    ``root``'s arcs, arcs into its (leaf) final states go back to ``root``, and every arc outputs the
    byte token of its input byte. ε-arcs connect start/final states that are not a pure source/sink."""
    one = pynini.Weight.one("tropical")
    zero = pynini.Weight.zero("tropical")
    start = acc.start()
    if start < 0:
        return
    has_in = set()
    for s in acc.states():
        for a in acc.arcs(s):
            has_in.add(a.nextstate)
    final = {s for s in acc.states() if acc.final(s) != zero}
    leaf_final = {s for s in final if acc.num_arcs(s) == 0}
    start_is_root = start not in has_in and start not in final
    mapping: dict[int, int] = {}
    for s in acc.states():
        if s == start and start_is_root:
            mapping[s] = root
        elif s in leaf_final:
            mapping[s] = root
        else:
            mapping[s] = fst.add_state()
    if not start_is_root:
        fst.add_arc(root, pynini.Arc(0, 0, one, mapping[start]))
    for s in final - leaf_final:
        fst.add_arc(mapping[s], pynini.Arc(0, 0, one, root))
    for s in acc.states():
        for a in acc.arcs(s):
            b = a.ilabel - 1
            tid = byte_fallback.get(b)
            if tid is None:  # a byte with no <0xNN> token: the character cannot be spelt by bytes
                continue
            fst.add_arc(mapping[s], pynini.Arc(a.ilabel, tid + 1, one, mapping[a.nextstate]))


def measure(info, byte_policy: str = DEFAULT_BYTE_POLICY) -> dict:
    """Build the detokenizer and report ``{"states", "arcs", "bytes" (serialized size), "seconds"}``."""
    t0 = time.perf_counter()
    fst = build_detokenizer(info, byte_policy)
    dt = time.perf_counter() - t0
    return {
        "states": fst.num_states(),
        "arcs": sum(fst.num_arcs(s) for s in fst.states()),
        "bytes": len(fst.write_to_string()),
        "seconds": round(dt, 3),
    }
