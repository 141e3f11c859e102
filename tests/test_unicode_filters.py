"""Tests of ``vllm_fst_backend.artifacts.unicode_filters`` (paper 000 §4.1–4.2).

Oracles are independent of the module: Python's strict UTF-8 codec for validity, and a per-character
predicate written here with ``regex`` properties for the script filters. Real multilingual text is
taken from files of installed packages (pygments' Gherkin keywords, hypothesis' test strings, rich's
demo, numpy / matplotlib / setuptools / transformers docstrings and tests), never typed in here.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import random
import struct
import timeit
from pathlib import Path

import pynini
import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_fst_backend.artifacts import unicode_filters as uf
from vllm_fst_backend.errors import FstBackendError, InvalidOptionError

NON_ASCII_SCRIPTS = tuple(n for n in uf.SCRIPT_NAMES if n != "ascii")
SCRIPT_CODES = {
    "latin": ("Latn",),
    "cyrillic": ("Cyrl",),
    "greek": ("Grek",),
    "han": ("Hani",),
    "hiragana_katakana": ("Hira", "Kana"),
    "hangul": ("Hang",),
    "arabic": ("Arab",),
    "devanagari": ("Deva",),
}
# Code points where UTF-8 changes shape, for biased sampling.
BOUNDARIES = [0, 0x7F, 0x80, 0x7FF, 0x800, 0xFFF, 0x1000, 0xCFFF, 0xD000, 0xD7FF, 0xD800, 0xDFFF, 0xE000,
              0xFFFF, 0x10000, 0x3FFFF, 0x40000, 0xFFFFF, 0x100000, 0x10FFFF]


# --- independent oracles ------------------------------------------------------------------------


@functools.cache
def _prop(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


def allowed(name: str, ch: str) -> bool:
    """The script-filter definition, written per character (module docstring, independently)."""
    if name == "ascii":
        return ch in "\t\n\v\f\r" or " " <= ch <= "~"
    if any(_prop(rf"\p{{scx={c}}}").match(ch) for c in SCRIPT_CODES[name]):
        return True
    if _prop(r"\p{sc=Zinh}").match(ch):
        return True
    if " " <= ch <= "~" and not ch.isalnum():
        return True
    if _prop(r"\p{scx=Zyyy}").match(ch) and (_prop(r"\p{Nd}").match(ch) or _prop(r"\p{P}").match(ch)):
        return True
    return bool(_prop(r"\p{White_Space}").match(ch) and _prop(r"\p{sc=Zyyy}").match(ch))


def n_valid_utf8_strings(n_by_len: dict[int, int], length: int) -> int:
    """Number of byte strings of ``length`` bytes that concatenate chars (n_by_len[k] chars of k bytes)."""
    f = [1] + [0] * length
    for m in range(1, length + 1):
        f[m] = sum(n_by_len.get(k, 0) * f[m - k] for k in range(1, 5) if k <= m)
    return f[length]


def chars_by_utf8_len(ranges) -> dict[int, int]:
    out = {1: 0, 2: 0, 3: 0, 4: 0}
    for lo, hi in ranges:
        for k, (a, b) in enumerate(((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, 0x10FFFF)), 1):
            lo2, hi2 = max(lo, a), min(hi, b)
            if lo2 <= hi2:
                out[k] += hi2 - lo2 + 1 - max(0, min(hi2, 0xDFFF) - max(lo2, 0xD800) + 1)
    return out


# --- FST helpers ----------------------------------------------------------------------------------


def n_arcs(fst: pynini.Fst) -> int:
    return sum(fst.num_arcs(s) for s in fst.states())


def count_strings(fst: pynini.Fst, length: int) -> int:
    """Number of accepted strings of exactly ``length`` labels (a DFA: one path per string)."""
    zero = pynini.Weight.zero(fst.weight_type())
    arcs = [(s, a.nextstate) for s in fst.states() for a in fst.arcs(s)]
    cur = {fst.start(): 1}
    for _ in range(length):
        nxt: dict[int, int] = {}
        for s, d in arcs:
            if s in cur:
                nxt[d] = nxt.get(d, 0) + cur[s]
        cur = nxt
    return sum(c for s, c in cur.items() if fst.final(s) != zero)


def random_strings(fst: pynini.Fst, npath: int, seed: int, mean_len: int = 20) -> list[bytes]:
    """Distinct random accepted byte strings; the final weight is raised so paths stay ~mean_len arcs."""
    g = fst.copy()
    zero = pynini.Weight.zero(g.weight_type())
    for s in g.states():
        if g.final(s) != zero:  # stop with probability ~ 1 / mean_len among num_arcs choices
            g.set_final(s, -math.log(max(g.num_arcs(s), 1) / (mean_len - 1)))
    paths = pynini.randgen(g, npath=npath, seed=seed, select="log_prob").paths()
    out = []
    while not paths.done():
        out.append(bytes(label - 1 for label in paths.ilabels()))
        paths.next()
    return out


def recomputed_properties(fst: pynini.Fst, mask):
    """Properties computed from scratch (the header's stored bits replaced by kExpanded|kMutable)."""
    data = bytearray(fst.write_to_string())
    pos = 4 + 4 + len(b"vector") + 4 + len(fst.arc_type()) + 4 + 4
    data[pos : pos + 8] = struct.pack("<Q", 3)
    return pynini.Fst.read_from_string(bytes(data)).properties(mask, True)


DFA_MASK = (pynini.ACCEPTOR | pynini.I_DETERMINISTIC | pynini.NO_EPSILONS | pynini.I_LABEL_SORTED
            | pynini.O_LABEL_SORTED | pynini.UNWEIGHTED | pynini.ACCESSIBLE | pynini.COACCESSIBLE)


def check_well_formed(fst: pynini.Fst) -> None:
    assert fst.verify()
    assert fst.input_symbols() is None and fst.output_symbols() is None
    assert fst.properties(DFA_MASK, True) == DFA_MASK
    assert recomputed_properties(fst, DFA_MASK) == DFA_MASK  # declared header bits are true
    g = fst.copy()
    g.minimize()
    assert g.num_states() == fst.num_states()


# --- real text from installed packages ----------------------------------------------------------

SOURCES = [
    ("pygments", "lexers/testing.py"),  # Gherkin keywords in ~70 languages
    ("hypothesis", "internal/conjecture/providers.py"),  # multilingual test strings
    ("rich", "__main__.py"),  # Chinese / Japanese / Korean demo sentences
    ("numpy", "_core/strings.py"),  # Greek, Chinese docstring examples
    ("matplotlib", "tests/test_category.py"),  # Russian
    ("setuptools", "tests/config/test_apply_pyprojecttoml.py"),  # Ukrainian
    ("charset_normalizer", "__init__.py"),  # Bulgarian (with two Latin look-alikes)
    ("transformers", "models/aya_vision/modeling_aya_vision.py"),  # Hindi
]


def _package_file(package: str, relpath: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relpath
    return path if path.is_file() else None


@functools.cache
def real_segments() -> tuple[str, ...]:
    """Non-ASCII pieces of the string literals of SOURCES (split at ``\\n`` escapes and ``|()^``)."""
    literal = regex.compile(r'"((?:[^"\\\n]|\\.)*)"' + r"|'((?:[^'\\\n]|\\.)*)'")
    seen: dict[str, None] = {}
    for package, relpath in SOURCES:
        path = _package_file(package, relpath)
        if path is None:
            continue
        for m in literal.finditer(path.read_text(encoding="utf-8")):
            body = m.group(1) if m.group(1) is not None else m.group(2)
            for piece in regex.split(r"\\n|\\s\*|[|()^]", body):
                piece = regex.sub(r"^:[a-z_]+:\s*", "", piece).strip()  # rich's ":flag_for_china:"
                if piece and not piece.isascii() and "\\" not in piece:
                    seen[piece] = None
    return tuple(seen)


def letter_scripts(text: str) -> set[str]:
    """Our script names the letters of text belong to ('?' for a letter of none of them).

    A letter counts for its Script (sc) if that is one of ours, else for the one script of ours in its
    Script_Extensions (U+30FC KATAKANA-HIRAGANA PROLONGED SOUND MARK is sc=Common); letters shared
    by several of our scripts are ignored.
    """
    out = set()
    for ch in regex.findall(r"\p{L}", text):
        names = [n for n, codes in SCRIPT_CODES.items() if any(_prop(rf"\p{{sc={c}}}").match(ch) for c in codes)]
        if not names:
            names = [n for n, codes in SCRIPT_CODES.items() if any(_prop(rf"\p{{scx={c}}}").match(ch) for c in codes)]
        if len(names) <= 1:
            out.add(names[0] if names else "?")
    return out


# --- codepoint_ranges_to_utf8_fst ----------------------------------------------------------------


def test_all_of_unicode_is_small_and_exact():
    fst = uf.codepoint_ranges_to_utf8_fst([(0, 0x10FFFF)])
    check_well_formed(fst)
    assert fst.num_states() == 9 and n_arcs(fst) == 499
    counts = [count_strings(fst, k) for k in range(6)]
    assert counts == [0, 128, 1920, 61440, 1048576, 0]
    for cp in BOUNDARIES:
        data = chr(cp).encode("utf-8", "surrogatepass")
        assert uf.accepts(fst, data) == (not 0xD800 <= cp <= 0xDFFF), hex(cp)


def test_empty_and_degenerate_inputs():
    empty = uf.codepoint_ranges_to_utf8_fst([])
    assert empty.num_states() == 1 and not uf.accepts(empty, b"") and not uf.accepts(empty, b"a")
    only_surrogates = uf.codepoint_ranges_to_utf8_fst([(0xD800, 0xDFFF)])
    assert only_surrogates.num_states() == 1
    nul = uf.codepoint_ranges_to_utf8_fst([(0, 0)])
    assert uf.accepts(nul, b"\x00") and not uf.accepts(nul, b"") and not uf.accepts(nul, b"\x00\x00")
    for bad in ([(5, 4)], [(-1, 3)], [(0, 0x110000)]):
        with pytest.raises(ValueError):
            uf.codepoint_ranges_to_utf8_fst(bad)
    assert uf.normalize_ranges([(10, 20), (0, 5), (6, 9), (0xD000, 0xE000)]) == [(0, 20), (0xD000, 0xD7FF), (0xDFFF + 1, 0xE000)]


codepoints = st.one_of(st.sampled_from(BOUNDARIES), st.integers(0, 0x10FFFF), st.integers(0, 0x3000))


@st.composite
def range_lists(draw):
    pairs = draw(st.lists(st.tuples(codepoints, codepoints), max_size=8))
    return [(min(a, b), max(a, b)) for a, b in pairs]


@settings(max_examples=150, deadline=None)
@given(ranges=range_lists(), probes=st.lists(codepoints, max_size=30))
def test_ranges_acceptance_iff_membership(ranges, probes):
    fst = uf.codepoint_ranges_to_utf8_fst(ranges)
    edges = [c for lo, hi in ranges for c in (lo - 1, lo, hi, hi + 1) if 0 <= c <= 0x10FFFF]
    for cp in probes + edges:
        member = any(lo <= cp <= hi for lo, hi in ranges) and not 0xD800 <= cp <= 0xDFFF
        assert uf.accepts(fst, chr(cp).encode("utf-8", "surrogatepass")) == member, hex(cp)
    # Exact: the DFA has exactly one string per member code point (1-4 bytes, nothing longer).
    by_len = chars_by_utf8_len(uf.normalize_ranges(ranges))
    for k in range(1, 6):
        assert count_strings(fst, k) == by_len.get(k, 0)
    if fst.num_states() > 1:
        assert fst.properties(pynini.I_DETERMINISTIC | pynini.ACYCLIC, True) == pynini.I_DETERMINISTIC | pynini.ACYCLIC
        g = fst.copy()
        g.minimize()
        assert g.num_states() == fst.num_states()


def test_character_class_samples_decode_to_members():
    everything = "".join(map(chr, range(0x110000)))
    ranges = [(m.start(), m.end() - 1) for m in regex.finditer(r"[^\w]+", everything)]  # interegular-like complement
    fst = uf.codepoint_ranges_to_utf8_fst(ranges)
    check_well_formed(fst)
    samples = random_strings(fst, 3000, seed=3)  # distinct paths; many start with the same ASCII byte
    assert len(samples) >= 500
    for data in samples:
        text = data.decode("utf-8")
        assert len(text) == 1 and not regex.match(r"\w", text)


def test_speed_of_a_large_class():
    everything = "".join(map(chr, range(0x110000)))
    ranges = [(m.start(), m.end() - 1) for m in regex.finditer(r"\w+", everything)]
    assert len(ranges) > 700
    seconds = min(timeit.repeat(lambda: uf.codepoint_ranges_to_utf8_fst(ranges), number=3, repeat=3)) / 3
    assert seconds < 0.05  # ~3-5 ms on an idle core; loose bound for a loaded 2-core CI machine


# --- utf8_fst ------------------------------------------------------------------------------------

INVALID_UTF8 = [
    b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xe0\x9f\xbf", b"\xf0\x80\x80\x80", b"\xf0\x8f\xbf\xbf",  # overlong
    b"\xed\xa0\x80", b"\xed\xbf\xbf", b"a\xed\xb2\x80b",  # surrogates
    b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xfe", b"\xff",  # > U+10FFFF, F5+
    b"\xc3", b"\xe4\xb8", b"\xf0\x9f\x98", b"abc\xc3", b"\xe4\xb8a",  # truncated
    b"\x80", b"a\xbfb", b"\xc3\xa9\xa9",  # lone continuation bytes
]


def test_utf8_fst_shape_and_exact_counts():
    fst = uf.utf8_fst()
    check_well_formed(fst)
    assert fst.num_states() <= 8 and n_arcs(fst) <= 500
    assert fst.final(fst.start()) != pynini.Weight.zero(fst.weight_type())
    by_len = {1: 128, 2: 1920, 3: 61440, 4: 1048576}
    for length in range(9):
        assert count_strings(fst, length) == n_valid_utf8_strings(by_len, length)


def test_utf8_fst_rejects_invalid_and_accepts_random_paths():
    fst = uf.utf8_fst()
    for data in INVALID_UTF8:
        with pytest.raises(UnicodeDecodeError):
            data.decode("utf-8")
        assert not uf.accepts(fst, data), data
    samples = random_strings(fst, 2500, seed=1)
    assert len(samples) >= 2000
    for data in samples:
        data.decode("utf-8")  # raises if invalid


_utf8 = functools.cache(uf.utf8_fst)


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(st.binary(max_size=10), st.text(max_size=10).map(lambda t: t.encode())))
def test_utf8_fst_agrees_with_python_decoder(data):
    try:
        data.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        valid = False
    assert uf.accepts(_utf8(), data) == valid


def test_utf8_fst_accepts_real_multilingual_text():
    fst = uf.utf8_fst()
    segments = real_segments()
    assert len(segments) >= 100
    for text in segments:
        assert uf.accepts(fst, text.encode()), text
    raw = _package_file("pygments", "lexers/testing.py").read_bytes()  # a whole non-ASCII file
    assert not raw.isascii() and uf.accepts(fst, raw)
    assert not uf.accepts(fst, raw + b"\xe4")


# --- script filters ------------------------------------------------------------------------------


def test_script_names_and_errors():
    assert uf.SCRIPT_NAMES == ("ascii", "latin", "cyrillic", "greek", "han", "hiragana_katakana", "hangul",
                               "arabic", "devanagari")
    for call in (lambda: uf.script_fst("klingon"), lambda: uf.script_ranges("klingon"),
                 lambda: uf.scripts_fst(["latin", "klingon"]), lambda: uf.scripts_fst([])):
        with pytest.raises(InvalidOptionError) as info:
            call()
        assert isinstance(info.value, FstBackendError) and "hiragana_katakana" in str(info.value)
    assert pynini.equal(uf.scripts_fst("Latin"), uf.script_fst("latin"))  # bare str, case-insensitive
    assert pynini.equal(uf.scripts_fst(["greek", "latin", "greek"]), uf.scripts_fst(["latin", "greek"]))
    ranges = uf.script_ranges("greek")
    ranges.clear()  # a fresh list: the cache is not touched
    assert uf.script_ranges("greek")


@pytest.mark.parametrize("name", uf.SCRIPT_NAMES)
def test_script_ranges_match_definition(name):
    ranges = uf.script_ranges(name)
    assert ranges == uf.normalize_ranges(ranges)
    own = uf.script_ranges(name, include_common=False)
    assert set(uf.normalize_ranges(own + ranges)) == set(ranges)  # script chars ⊆ allowed chars
    rng = random.Random(name)
    probes = {c for lo, hi in ranges for c in (lo - 1, lo, hi, hi + 1)}
    probes |= {rng.randrange(0x110000) for _ in range(5000)} | {rng.randrange(0x3400) for _ in range(5000)}
    for cp in sorted(probes):
        if 0 <= cp <= 0x10FFFF and not 0xD800 <= cp <= 0xDFFF:
            assert any(lo <= cp <= hi for lo, hi in ranges) == allowed(name, chr(cp)), (name, hex(cp))


@pytest.mark.parametrize("name", uf.SCRIPT_NAMES)
def test_script_fst_is_closure_of_allowed_chars(name):
    fst = uf.script_fst(name)
    check_well_formed(fst)
    assert fst.num_states() < 200
    by_len = chars_by_utf8_len(uf.script_ranges(name))
    for length in range(7):
        assert count_strings(fst, length) == n_valid_utf8_strings(by_len, length)
    samples = random_strings(fst, 2500, seed=7)
    assert len(samples) >= 2000
    for data in samples:
        text = data.decode("utf-8")
        bad = [ch for ch in text if not allowed(name, ch)]
        assert not bad, (name, bad)


REJECTED = {
    "ascii": ["é", "\u00a0", "“", "１"],
    "latin": ["Ж", "α", "中", "€", "😍", "\u3002", "\u0964"],
    "cyrillic": ["a", "Z", "α", "中", "\u1680"],
    "greek": ["a", "Ж", "ب"],
    "han": ["a", "ア", "한", "Ж"],
    "hiragana_katakana": ["中", "a", "한"],
    "hangul": ["中", "ア", "a"],
    "arabic": ["a", "क", "Ж"],
    "devanagari": ["a", "ب", "中"],
}
ACCEPTED = {
    "ascii": ["\t\n", "a-Z 0~9"],
    "latin": ["Ça va, 123!", "e\u0301", "ＡＢ１"],
    "cyrillic": ["й, ё.", "и\u0306", "１２"],
    "greek": ["ά (1)"],
    "han": ["中\u3001\u3002", "「中」"],
    "hiragana_katakana": ["ア\u30fcあ\u3002", "\u3099"],
    "hangul": ["한\u3002", "\u1100"],
    "arabic": ["ب\u060c \u0660", "ب\u200cب"],
    "devanagari": ["क\u094d\u200dष\u0964", "\u0966"],
}


@pytest.mark.parametrize("name", uf.SCRIPT_NAMES)
def test_script_probes(name):
    fst = uf.script_fst(name)
    assert uf.accepts(fst, b"")
    for text in REJECTED[name]:
        assert not uf.accepts(fst, text.encode()), (name, text)
    for text in ACCEPTED[name]:
        assert all(allowed(name, ch) for ch in text), text
        assert uf.accepts(fst, text.encode()), (name, text)


MIN_REAL = {"latin": 20, "cyrillic": 10, "greek": 2, "han": 10, "hiragana_katakana": 5, "hangul": 5,
            "arabic": 5, "devanagari": 1}


@pytest.mark.parametrize("name", NON_ASCII_SCRIPTS)
def test_script_fst_on_real_text(name):
    fst = uf.script_fst(name)
    own = [t for t in real_segments() if letter_scripts(t) == {name}]
    accepted = 0
    for text in own:
        expected = all(allowed(name, ch) for ch in text)
        assert uf.accepts(fst, text.encode()) == expected, (name, text)
        accepted += expected
    assert accepted >= MIN_REAL[name], (name, accepted, own)
    others = [t for t in real_segments() if letter_scripts(t) - {name}]
    assert others and not any(uf.accepts(fst, t.encode()) for t in others)


def test_ascii_on_real_text():
    import json

    fst = uf.script_fst("ascii")
    assert json.__doc__.isascii() and uf.accepts(fst, json.__doc__.encode())
    assert not any(uf.accepts(fst, t.encode()) for t in real_segments())


def test_scripts_fst_union_on_mixed_real_text():
    japanese = [t for t in real_segments() if letter_scripts(t) == {"han", "hiragana_katakana"}]
    assert japanese
    both = uf.scripts_fst(["han", "hiragana_katakana"])
    for text in japanese:
        assert uf.accepts(both, text.encode()), text
        assert not uf.accepts(uf.script_fst("han"), text.encode())
        assert not uf.accepts(uf.script_fst("hiragana_katakana"), text.encode())
    mixed = [t for t in real_segments() if len(letter_scripts(t)) > 1 and "?" not in letter_scripts(t)]
    assert len(mixed) >= 3  # e.g. Hindi + Arabic, Bulgarian with Latin look-alikes, Japanese
    for text in mixed:
        names = sorted(letter_scripts(text))
        fst = uf.scripts_fst(names)
        expected = all(any(allowed(n, ch) for n in names) for ch in text)
        assert uf.accepts(fst, text.encode()) == expected, (names, text)
        for n in names:
            assert not uf.accepts(uf.script_fst(n), text.encode())
    every = uf.scripts_fst(NON_ASCII_SCRIPTS)
    for text in real_segments():
        expected = all(any(allowed(n, ch) for n in NON_ASCII_SCRIPTS) for ch in text)
        assert uf.accepts(every, text.encode()) == expected, text


# --- accepts() and serialization -----------------------------------------------------------------


def test_accepts_on_nondeterministic_and_transducer_fsts():
    a = uf.codepoint_ranges_to_utf8_fst([(ord("a"), ord("c"))])
    nondet = pynini.union(a, uf.codepoint_ranges_to_utf8_fst([(ord("b"), ord("é"))])).closure()  # epsilons, nondeterministic
    assert nondet.properties(pynini.I_DETERMINISTIC, True) != pynini.I_DETERMINISTIC
    for data, want in [(b"", True), (b"abc", True), ("é".encode(), True), (b"d", True), (b"\xc3", False)]:
        assert uf.accepts(nondet, data) == want, data
    unsorted = pynini.Fst()  # deterministic, arcs not sorted: the linear-scan path
    unsorted.add_states(2)
    for label in (3, 2):
        unsorted.add_arc(0, pynini.Arc(label, label, pynini.Weight.one("tropical"), 1))
    unsorted.set_start(0)
    unsorted.set_final(1)
    assert unsorted.properties(pynini.I_LABEL_SORTED, True) != pynini.I_LABEL_SORTED
    assert uf.accepts(unsorted, b"\x01") and uf.accepts(unsorted, b"\x02") and not uf.accepts(unsorted, b"\x00")
    no_start = pynini.Fst()
    assert not uf.accepts(no_start, b"")


def test_write_read_roundtrip(tmp_path):
    for name in ("utf8", "latin"):
        fst = uf.utf8_fst() if name == "utf8" else uf.script_fst(name)
        path = tmp_path / f"{name}.fst"
        fst.write(str(path))
        back = pynini.Fst.read(str(path))
        assert pynini.equal(fst, back) and back.input_symbols() is None
        assert back.properties(pynini.I_LABEL_SORTED, False) == pynini.I_LABEL_SORTED
