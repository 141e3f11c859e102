"""Byte-level Unicode acceptors: UTF-8 validity, code-point classes and script filters.

Every FST built here is a **deterministic, minimal, epsilon-free acceptor over byte labels**
(byte ``b`` is label ``b + 1``, label 0 = epsilon; see ``docs/architecture.md``), without symbol
tables, arc-sorted on input labels (so composition with it needs no further sorting), with weights
all ``One`` of the standard (tropical) arc type. All are tokenizer-agnostic; the artifact build writes
them with ``Fst.write`` and reads them back with ``pynini.Fst.read``.

Contents (design paper 000, §4.1–4.3):

* :func:`codepoint_ranges_to_utf8_fst` — ONE character out of a set of code-point ranges, as
  shortest-form UTF-8. Used by the regex compiler for character classes (including interegular's
  "anything else" complement class) and by everything below.
* :func:`utf8_fst` — the UTF-8 validity DFA (Höhrmann 2010; paper §4.1 "canonical Unicode"):
  the closure of all valid characters.
* :func:`script_ranges`, :func:`script_fst`, :func:`scripts_fst` — mono-/multi-lingual script
  filters (paper §4.2).
* :func:`accepts` — does an FST accept a byte string (test and debugging helper).

Script filter definition (exact)
--------------------------------
Script membership comes from the Unicode Character Database bundled with the ``regex`` module
(``\\p{Script=..}`` = ``sc``, ``\\p{Script_Extensions=..}`` = ``scx``), never from hand-written tables.
For a script name other than ``"ascii"``, the allowed characters are the union of

1. **script characters**: ``\\p{scx=X}`` for the script(s) X of the name (``latin``: Latin,
   ``cyrillic``: Cyrillic, ``greek``: Greek, ``han``: Han, ``hiragana_katakana``: Hiragana ∪ Katakana,
   ``hangul``: Hangul, ``arabic``: Arabic, ``devanagari``: Devanagari). ``scx`` contains ``sc`` and,
   in addition, the Common/Inherited characters Unicode attributes to that script, e.g. the
   prolonged sound mark U+30FC and the voiced sound marks U+3099–U+309C for Hiragana/Katakana,
   the ideographic comma/full stop U+3001–U+3002 and CJK brackets for Han/Hiragana/Katakana/Hangul,
   the Arabic comma U+060C and tatweel U+0640 for Arabic, the dandas U+0964–U+0965 for Devanagari;
2. **the common set** (shared by every script):

   * decimal digits and punctuation that belong to no particular script:
     ``[\\p{Nd}\\p{P}] && \\p{scx=Common}`` (ASCII and full-width digits, the mathematical and
     segmented digits; ASCII, general and full-width punctuation; *not* script-specific punctuation
     such as U+060C or U+3002, which goes with its scripts by rule 1);
   * whitespace: ``\\p{White_Space} && \\p{sc=Common}`` (U+0009–U+000D, U+0020, U+0085, U+00A0,
     U+2000–U+200A, U+2028, U+2029, U+202F, U+205F, U+3000; only U+1680 OGHAM SPACE MARK is left out);
   * ASCII symbols and punctuation: U+0020–U+007E minus letters and digits (``$+<=>^`|~`` and the rest);
3. **inherited marks**: ``\\p{sc=Inherited}`` (combining marks U+0300–U+036F etc., variation
   selectors, ZWNJ/ZWJ U+200C–U+200D), so decomposed text and conjuncts pass.

``"ascii"`` is exactly printable ASCII plus ASCII whitespace, U+0009–U+000D and U+0020–U+007E: the
common set's non-ASCII members (full-width digits, curly quotes, NBSP, ...) are *not* added, so an
``ascii`` filter never lets a non-ASCII byte through. Its ASCII part (digits, punctuation, symbols,
whitespace) is already included.

Everything else (unassigned code points, emoji and other ``\\p{S}`` symbols outside ASCII, control
characters other than whitespace, private use) is rejected by every script filter. A script filter
is the closure (Kleene star) of "one allowed character", so the empty string is accepted.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Sequence

import numpy as np
import pynini
import regex

from vllm_fst_backend.errors import InvalidOptionError

__all__ = [
    "MAX_CODEPOINT",
    "SCRIPT_NAMES",
    "accepts",
    "codepoint_ranges_to_utf8_fst",
    "normalize_ranges",
    "script_fst",
    "script_ranges",
    "scripts_fst",
    "utf8_fst",
]

MAX_CODEPOINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)

SCRIPT_NAMES: tuple[str, ...] = (
    "ascii",
    "latin",
    "cyrillic",
    "greek",
    "han",
    "hiragana_katakana",
    "hangul",
    "arabic",
    "devanagari",
)

# Unicode script property values (regex's long names) of each script filter but "ascii".
_SCRIPT_PROPERTIES: dict[str, tuple[str, ...]] = {
    "latin": ("Latin",),
    "cyrillic": ("Cyrillic",),
    "greek": ("Greek",),
    "han": ("Han",),
    "hiragana_katakana": ("Hiragana", "Katakana"),
    "hangul": ("Hangul",),
    "arabic": ("Arabic",),
    "devanagari": ("Devanagari",),
}

_ASCII_RANGES: tuple[tuple[int, int], ...] = ((0x09, 0x0D), (0x20, 0x7E))

# Regex classes (regex's V1 syntax: nested sets, && and --) of the common set and the inherited marks.
_COMMON_CLASS = (
    r"[[[\p{Nd}\p{P}]&&\p{scx=Common}]"
    r"[\p{White_Space}&&\p{sc=Common}]"
    r"[\x20-\x7E--[A-Za-z0-9]]]"
)
_INHERITED_CLASS = r"\p{sc=Inherited}"


# --------------------------------------------------------------------------------------------------
# Code-point ranges -> one-character UTF-8 DFA
# --------------------------------------------------------------------------------------------------


def normalize_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort and merge inclusive code-point ranges, and drop the surrogates U+D800–U+DFFF.

    Args:
        ranges: pairs ``(lo, hi)`` of code points, inclusive, ``0 <= lo <= hi <= 0x10FFFF``, in any
            order, possibly overlapping or adjacent.

    Returns:
        Sorted, disjoint, non-adjacent inclusive ranges with no surrogate code point (surrogates
        have no UTF-8 encoding, so they are ignored rather than rejected: interegular's complement
        class, for one, contains them).

    Raises:
        ValueError: a range with ``lo > hi`` or a bound outside ``0..0x10FFFF``.
    """
    merged: list[list[int]] = []
    for lo, hi in sorted((int(lo), int(hi)) for lo, hi in ranges):
        if lo > hi or lo < 0 or hi > MAX_CODEPOINT:
            raise ValueError(f"bad code-point range ({lo:#x}, {hi:#x}): need 0 <= lo <= hi <= {MAX_CODEPOINT:#x}")
        if merged and lo <= merged[-1][1] + 1:
            if hi > merged[-1][1]:
                merged[-1][1] = hi
        else:
            merged.append([lo, hi])
    out: list[tuple[int, int]] = []
    s_lo, s_hi = _SURROGATES
    for lo, hi in merged:
        if hi < s_lo or lo > s_hi:
            out.append((lo, hi))
            continue
        if lo < s_lo:
            out.append((lo, s_lo - 1))
        if hi > s_hi:
            out.append((s_hi + 1, hi))
    return out


def _blocks(ivs: Sequence[tuple[int, int]], shift: int) -> list[tuple[int, int, tuple[tuple[int, int], ...]]]:
    """Split sorted disjoint intervals into aligned blocks of ``2**shift`` values.

    Returns ``(c_lo, c_hi, sub)``: blocks ``c_lo..c_hi`` (block ``c`` holds values
    ``c << shift .. ((c + 1) << shift) - 1``) all contain exactly the intervals ``sub``, given
    relative to the block start. Runs of completely covered blocks come as one entry.
    """
    size = 1 << shift
    mask = size - 1
    full = ((0, mask),)
    out: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
    cur_c = -1
    cur: list[tuple[int, int]] = []
    for lo, hi in ivs:
        c_lo, c_hi = lo >> shift, hi >> shift
        if c_lo != cur_c:
            if cur:
                out.append((cur_c, cur_c, tuple(cur)))
            cur_c, cur = c_lo, []
        if c_lo == c_hi:
            cur.append((lo & mask, hi & mask))
            continue
        cur.append((lo & mask, mask))
        out.append((c_lo, c_lo, tuple(cur)))
        if c_hi - c_lo > 1:
            out.append((c_lo + 1, c_hi - 1, full))
        cur_c, cur = c_hi, [(0, hi & mask)]
    if cur:
        out.append((cur_c, cur_c, tuple(cur)))
    return out


class _CharDfa:
    """Minimal DFA for one UTF-8 character, built by hash-consing residual code-point sets.

    A state reached after the lead byte and ``k`` continuation bytes of an ``n``-byte encoding must
    still read ``r = n - 1 - k`` continuation bytes; its residual language is determined by ``r`` and
    the set of allowed 6·r-bit offsets (a tuple of relative intervals). Equal keys ⇒ equal residual
    languages and vice versa (the encoding is a bijection), so hash-consing on the key yields the
    minimal DFA directly, without a determinize/minimize pass. State 0 is the start, state 1 the
    single final state (no outgoing arcs).
    """

    def __init__(self, ranges: Sequence[tuple[int, int]]):
        self.arcs: list[list[tuple[int, int, int]]] = [[], []]  # per state: (byte_lo, byte_hi, next)
        self._memo: dict[tuple[int, tuple[tuple[int, int], ...]], int] = {}
        start = self.arcs[0]
        # 1-byte: U+0000..U+007F.
        for lo, hi in _clip(ranges, 0x00, 0x7F):
            start.append((lo, hi, 1))
        # n-byte: lead byte = base + (cp >> shift); the lower `shift` bits are continuation payload.
        for lo_cp, hi_cp, base, shift in ((0x80, 0x7FF, 0xC0, 6), (0x800, 0xFFFF, 0xE0, 12), (0x10000, MAX_CODEPOINT, 0xF0, 18)):
            part = _clip(ranges, lo_cp, hi_cp)
            if part:
                for c_lo, c_hi, sub in _blocks(part, shift):
                    start.append((base + c_lo, base + c_hi, self._node(shift // 6, sub)))

    def _node(self, r: int, ivs: tuple[tuple[int, int], ...]) -> int:
        key = (r, ivs)
        state = self._memo.get(key)
        if state is not None:
            return state
        if r == 1:  # last continuation byte: one arc run per interval, to the final state
            arcs = [(0x80 + lo, 0x80 + hi, 1) for lo, hi in ivs]
        else:
            arcs = [(0x80 + c_lo, 0x80 + c_hi, self._node(r - 1, sub)) for c_lo, c_hi, sub in _blocks(ivs, 6 * (r - 1))]
        state = len(self.arcs)
        self.arcs.append(arcs)
        self._memo[key] = state
        return state

    def to_fst(self, star: bool) -> pynini.Fst:
        """Emit the pynini acceptor; ``star=True`` merges the final state into the start (closure)."""
        if star:  # state 1 (final) becomes 0 (start); states 2.. move down by one
            n = len(self.arcs) - 1
            flat = [x for s, arcs in enumerate(self.arcs) for lo, hi, d in arcs for x in (s - (s > 0), lo, hi, d - (d > 0))]
        else:
            n = len(self.arcs)
            flat = [x for s, arcs in enumerate(self.arcs) for lo, hi, d in arcs for x in (s, lo, hi, d)]
        return _fst_from_byte_runs(n, 0, 0 if star else 1, np.array(flat, dtype=np.int64).reshape(-1, 4))


_FST_MAGIC = 2125659606  # OpenFst binary header magic number
_TROPICAL_ZERO_BITS = 0x7F800000  # TropicalWeight::Zero() = +inf as float32 bits
_VECTOR_FST_VERSION = 2
# Properties true of every acceptor built here by construction (written into the binary header so
# that OpenFst does not recompute them): the DFA is epsilon-free, unweighted, deterministic,
# emitted in ascending label order, and every state is reachable and co-reachable.
_DFA_PROPERTIES = (
    pynini.EXPANDED
    | pynini.MUTABLE
    | pynini.ACCEPTOR
    | pynini.I_DETERMINISTIC
    | pynini.O_DETERMINISTIC
    | pynini.NO_EPSILONS
    | pynini.NO_I_EPSILONS
    | pynini.NO_O_EPSILONS
    | pynini.I_LABEL_SORTED
    | pynini.O_LABEL_SORTED
    | pynini.UNWEIGHTED
    | pynini.ACCESSIBLE
    | pynini.COACCESSIBLE
).value


def _fst_from_byte_runs(num_states: int, start: int, final: int, runs: np.ndarray) -> pynini.Fst:
    """Build an unweighted byte acceptor from arc runs, rows ``(src, byte_lo, byte_hi, dst)``.

    ``runs`` (``int64[R, 4]``) must be grouped by ascending ``src`` and, within a state, by ascending
    bytes; each row stands for one arc per byte ``byte_lo..byte_hi`` with label ``byte + 1``. The FST
    is assembled with numpy as OpenFst's binary ``vector``/``standard`` file (header, then per state:
    final weight f32, arc count i64, arcs as ilabel i32, olabel i32, weight f32, nextstate i32) and
    loaded with ``Fst.read_from_string``: several times faster than ``add_arc`` per arc from Python,
    which matters for character classes with ~10^4 arcs. The header declares ``_DFA_PROPERTIES``
    (the caller guarantees them: deterministic, sorted, all states accessible and co-accessible);
    the remaining properties are computed on demand by OpenFst.
    """
    counts_r = runs[:, 2] - runs[:, 1] + 1
    total = int(counts_r.sum())
    first_r = np.cumsum(counts_r) - counts_r
    src = np.repeat(runs[:, 0], counts_r)
    labels = np.repeat(runs[:, 1] + 1 - first_r, counts_r) + np.arange(total)
    narcs = np.bincount(src, minlength=num_states)
    header = struct.pack("<i", _FST_MAGIC)
    for name in (b"vector", b"standard"):
        header += struct.pack("<i", len(name)) + name
    header += struct.pack("<iiQqqq", _VECTOR_FST_VERSION, 0, _DFA_PROPERTIES, start, num_states, total)
    # Body in 32-bit words: per state a 3-word record (final f32, narcs i64) then 4 words per arc
    # (ilabel, olabel, weight f32 = 0.0 = One, nextstate). Arcs are grouped by state, so arc i sits
    # at word 3 * (src_i + 1) + 4 * i, and the record of state s at 3 * s + 4 * (arcs before s).
    body = np.zeros(3 * num_states + 4 * total, dtype="<i4")
    rec = 3 * np.arange(num_states) + 4 * (np.cumsum(narcs) - narcs)
    body[rec] = _TROPICAL_ZERO_BITS
    body[rec[final]] = 0  # TropicalWeight::One() = 0.0f
    body[rec + 1] = narcs  # low word of the int64 arc count (high word stays 0)
    arc = 3 * (src + 1) + 4 * np.arange(total)
    body[arc] = labels
    body[arc + 1] = labels
    body[arc + 3] = np.repeat(runs[:, 3], counts_r)
    return pynini.Fst.read_from_string(header + body.tobytes())


def _clip(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(a, lo), min(b, hi)) for a, b in ranges if a <= hi and b >= lo]


def codepoint_ranges_to_utf8_fst(ranges: Iterable[tuple[int, int]]) -> pynini.Fst:
    """Acceptor of exactly ONE character whose code point lies in ``ranges``, as UTF-8 bytes.

    Only shortest-form UTF-8 is accepted (no overlong forms, no surrogates U+D800–U+DFFF, nothing
    above U+10FFFF). Construction follows RE2 / Rust ``utf8-ranges``: each range is cut along the
    UTF-8 length boundaries (U+007F, U+07FF, U+FFFF) and then along 6-bit continuation-byte blocks,
    so every state has at most one arc per byte; states with equal residual code-point sets are
    shared while building (hash-consing), which gives the **minimal deterministic** acceptor
    without a separate determinize/minimize pass (tests check ``minimize`` finds nothing to merge).
    Size: all of Unicode = 9 states / 499 arcs; one arc per (state, byte), ≤ 256 per state.
    Cost: linear in ranges plus arcs (arcs are written in bulk via numpy, see
    ``_fst_from_byte_runs``): ~3 ms for ``\\w`` (817 ranges, 329 states, 13,800 arcs), ~6 ms for
    1,000 random ranges spread over all planes (501 states, 17,400 arcs), on one idle core.

    Args:
        ranges: inclusive ``(lo, hi)`` code-point pairs in any order; overlaps and surrogates are
            allowed (surrogates are ignored). An empty set gives an acceptor of the empty language
            (one non-final state).

    Returns:
        Deterministic minimal acyclic acceptor over byte labels (``b + 1``), start state 0, one final
        state, arc-sorted on input labels, no symbol tables. Its strings are 1–4 bytes long.

    Raises:
        ValueError: a range with ``lo > hi`` or a bound outside ``0..0x10FFFF``.

    Source: paper 000 §4.1 (UTF-8 canonicality); RE2 ``UTF-8 range compilation``.
    """
    norm = normalize_ranges(ranges)
    if not norm:  # empty language: one non-final start state
        fst = pynini.Fst()
        fst.set_start(fst.add_state())
        return fst
    return _CharDfa(norm).to_fst(star=False)


def _closure_fst(ranges: Sequence[tuple[int, int]]) -> pynini.Fst:
    """Minimal DFA of ``(one character of ranges)*`` (ranges already normalized)."""
    fst = _CharDfa(ranges).to_fst(star=True)
    # Merging the final state into the start keeps determinism; minimize for safety (tiny, cached).
    fst.minimize()
    fst.arcsort("ilabel")
    return fst


@functools.lru_cache(maxsize=1)
def _utf8_fst_cached() -> pynini.Fst:
    return _closure_fst([(0, _SURROGATES[0] - 1), (_SURROGATES[1] + 1, MAX_CODEPOINT)])


def utf8_fst() -> pynini.Fst:
    """The UTF-8 validity DFA: all byte strings that are valid, shortest-form UTF-8.

    The closure of :func:`codepoint_ranges_to_utf8_fst` over all scalar values (U+0000–U+D7FF,
    U+E000–U+10FFFF): rejects overlong forms (``C0 80``, ``E0 80 80``), surrogates (``ED A0 80``),
    bytes ``F5``–``FF``, code points above U+10FFFF (``F4 90 ..``), lone continuation bytes and
    truncated sequences (the latter end in a non-final state). Accepts the empty string.

    Returns:
        A fresh copy (callers may mutate it) of the minimal deterministic acceptor over byte labels
        (``b + 1``): 8 states (start = the only final state), 499 arcs, arc-sorted on input labels.

    Source: paper 000 §4.1; Höhrmann (2010), "Flexible and economical UTF-8 decoder".
    """
    return _utf8_fst_cached().copy()


# --------------------------------------------------------------------------------------------------
# Script filters
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _unicode_tables() -> dict[str, tuple[tuple[int, int], ...]]:
    """Scan all code points once per class with regex; returns ranges for each script and ``"common"``/``"inherited"``.

    The scan runs ``finditer(CLASS+)`` over one string holding every code point in order (index ==
    code point), so each match span is one maximal range: ~5 ms per class, no per-code-point calls.
    """
    everything = "".join(map(chr, range(MAX_CODEPOINT + 1)))

    def scan(pattern: str) -> tuple[tuple[int, int], ...]:
        return tuple((m.start(), m.end() - 1) for m in regex.finditer(f"(?V1)(?:{pattern})+", everything))

    tables = {"common": scan(_COMMON_CLASS), "inherited": scan(_INHERITED_CLASS)}
    for name, props in _SCRIPT_PROPERTIES.items():
        tables[name] = scan("[" + "".join(rf"\p{{scx={p}}}" for p in props) + "]")
    return tables


def _check_name(name: str) -> str:
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in SCRIPT_NAMES:
        raise InvalidOptionError(f"unknown script {name!r}; valid script names: {', '.join(SCRIPT_NAMES)}")
    return key


def script_ranges(name: str, *, include_common: bool = True) -> list[tuple[int, int]]:
    """Code-point ranges of the characters the script filter ``name`` allows.

    Args:
        name: one of :data:`SCRIPT_NAMES` (case-insensitive).
        include_common: ``True`` (default): the full allowed set, script ∪ common set ∪ inherited
            marks, exactly the characters of :func:`script_fst` (see the module docstring).
            ``False``: the script's own characters only (``\\p{scx=..}``; for ``"ascii"`` no difference).

    Returns:
        Sorted, disjoint, non-adjacent inclusive ``(lo, hi)`` code-point pairs (a fresh list).

    Raises:
        InvalidOptionError: unknown script name (the message lists the valid names).

    Source: paper 000 §4.2; Unicode Script / Script_Extensions from the ``regex`` module's database.
    """
    key = _check_name(name)
    if key == "ascii":
        return list(_ASCII_RANGES)
    tables = _unicode_tables()
    if not include_common:
        return list(tables[key])
    return normalize_ranges(tables[key] + tables["common"] + tables["inherited"])


@functools.lru_cache(maxsize=64)
def _scripts_fst_cached(keys: tuple[str, ...]) -> pynini.Fst:
    ranges: list[tuple[int, int]] = []
    for key in keys:
        ranges.extend(script_ranges(key))
    return _closure_fst(normalize_ranges(ranges))


def scripts_fst(names: Sequence[str] | str) -> pynini.Fst:
    """Filter for text written in any mix of the named scripts: ``(one allowed character)*``.

    The allowed characters are the union of :func:`script_ranges` over ``names`` (each script plus
    the common set and inherited marks; see the module docstring). Use it for a request that allows
    several scripts (e.g. ``("han", "hiragana_katakana")`` for Japanese).

    Args:
        names: script names from :data:`SCRIPT_NAMES` (case-insensitive; order and duplicates do not
            matter); a bare string is taken as one name.

    Returns:
        A fresh copy of the minimal deterministic acceptor over byte labels (``b + 1``), start state
        = the only final state (the empty string is accepted), arc-sorted on input labels. Results
        are cached per set of names, so repeated calls cost one copy.

    Raises:
        InvalidOptionError: an unknown script name (the message lists the valid names) or no name.

    Source: paper 000 §4.2 (mono- vs multi-linguality filtering).
    """
    if isinstance(names, str):
        names = (names,)
    keys = tuple(sorted({_check_name(n) for n in names}))
    if not keys:
        raise InvalidOptionError(f"no script names given; valid script names: {', '.join(SCRIPT_NAMES)}")
    return _scripts_fst_cached(keys).copy()


def script_fst(name: str) -> pynini.Fst:
    """Filter for text in one script: ``(script char | common char | inherited mark)*`` as UTF-8.

    Same as ``scripts_fst([name])``; see :func:`scripts_fst` for the returned FST and the module
    docstring for the exact character sets.

    Raises:
        InvalidOptionError: unknown script name (the message lists the valid names).

    Source: paper 000 §4.2.
    """
    return scripts_fst((name,))


# --------------------------------------------------------------------------------------------------
# Acceptance check
# --------------------------------------------------------------------------------------------------


def accepts(fst: pynini.Fst, data: bytes) -> bool:
    """Whether ``fst`` has a successful path whose input labels spell ``data`` (label = byte + 1).

    Works for any FST (transducers are checked on their input side): deterministic epsilon-free
    input sides are walked directly (binary search over arcs when arc-sorted on input labels);
    anything else is checked by composing a linear acceptor of ``data`` with ``fst``.

    Args:
        fst: an FST over byte labels; not modified.
        data: the bytes to check (``b""`` checks whether the start state is final).

    Returns:
        ``True`` iff some path from the start state reading exactly ``data`` (with any number of
        epsilons) ends in a final state with a non-``Zero`` weight.
    """
    start = fst.start()
    if start < 0:
        return False
    zero = pynini.Weight.zero(fst.weight_type())
    want = pynini.I_DETERMINISTIC | pynini.NO_I_EPSILONS
    if fst.properties(want, True) == want:
        sorted_ = fst.properties(pynini.I_LABEL_SORTED, True) == pynini.I_LABEL_SORTED
        state = start
        for byte in data:
            state = _next_state(fst, state, byte + 1, sorted_)
            if state < 0:
                return False
        return fst.final(state) != zero
    chain = pynini.Fst(fst.arc_type())
    chain.add_states(len(data) + 1)
    one = pynini.Weight.one(chain.weight_type())
    for i, byte in enumerate(data):
        chain.add_arc(i, pynini.Arc(byte + 1, byte + 1, one, i + 1))
    chain.set_start(0)
    chain.set_final(len(data))
    return pynini.compose(chain, fst, connect=True).num_states() > 0


def _next_state(fst: pynini.Fst, state: int, label: int, sorted_: bool) -> int:
    if not sorted_:
        for arc in fst.arcs(state):
            if arc.ilabel == label:
                return arc.nextstate
        return -1
    it = fst.arcs(state)
    lo, hi = 0, fst.num_arcs(state)
    while lo < hi:
        mid = (lo + hi) // 2
        it.seek(mid)
        arc = it.value()
        if arc.ilabel < label:
            lo = mid + 1
        elif arc.ilabel > label:
            hi = mid
        else:
            return arc.nextstate
    return -1
