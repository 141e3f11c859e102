"""JSON Schema (draft 2020-12) → regex, exact or refusing.

:func:`json_schema_to_regex` turns a schema into a regex (the dialect of :mod:`.regex_parse`; also valid
Python ``re`` syntax, whole-output match) whose language is a subset of the schema's valid instances, as
``jsonschema``'s ``Draft202012Validator`` (with its ``FORMAT_CHECKER``) judges them. The rule: **never a
larger language**. Where the regex accepts fewer instances than the schema, it is one of the choices
listed under "Smaller language" below; everything else is enforced exactly or refused with a named error.

Output shape. Object keys appear in the schema's ``properties`` order (dict order of the parsed JSON, at
every level), then required names that ``properties`` does not declare (in ``required`` order), then
extra keys (with ``allOf`` / ``$ref`` merges: the schema's own properties, then each merged schema's new
ones, in order; the names of ``dependentRequired`` / ``dependentSchemas`` entries present come as required
names after the schema's own, in entry order, then their entries' names). Optional properties may be absent; commas are always right. The whitespace regex
(``whitespace_pattern``, default :data:`DEFAULT_WHITESPACE` = ``[ ]?``; it may only match JSON
whitespace) goes after ``{``, ``[``, ``,`` and ``:`` and before ``}`` / ``]``; so both the compact
serialization (``json.dumps(obj, separators=(",", ":"), ensure_ascii=False)``) and ``json.dumps``'
default one match.

Enforced exactly:

* ``type`` (string or list), ``enum`` and ``const`` (any JSON values, each serialized compactly; the
  values are filtered by validating each against the whole schema with ``jsonschema``, so every other
  keyword next to ``enum`` / ``const`` is exact, whatever it is);
* strings: ``minLength`` / ``maxLength`` (code points, an escape counts one); ``pattern`` (translated to
  match the JSON-escaped text, see below; a search: a side without an anchor takes any text, and each
  top-level alternative has its own ``^`` / ``$``, also inside a group that is the whole alternative, a group of
  several alternatives there distributed over them: ``^([^,]|$)`` is ``^[^,]|^$``);
  keywords that combine -- a ``pattern`` with lengths it does not imply, with a ``format`` or with another
  ``pattern`` (``allOf``), a ``not`` of string keywords (patterns, lengths, string ``enum`` / ``const``) --
  as one language over decoded characters (:mod:`.regex_algebra`: DFA intersection and complement, back
  to a regex by state elimination; a negated pattern holds every string it matches in ECMA-262's meaning
  and in Python's), written in the pattern rule's single spelling (below);
  ``format`` ``date`` (month lengths, Feb 29 only in leap years, years 0001-9999), ``time`` and ``date-time`` (RFC 3339 with a required offset; enforced even
  where ``jsonschema`` lacks its optional RFC 3339 checker), ``uuid``, ``ipv4`` (octets 0-255, no leading
  zeros), ``ipv6`` (every form ``ipaddress`` reads, ``::`` and IPv4 tails included, no zone index),
  ``hostname`` (2-4 labels of at most 62 characters, the last 2-62 letters: a subset every version of
  the ``fqdn`` checker accepts), ``duration`` (RFC 3339 Appendix A), ``json-pointer`` (RFC 6901),
  ``relative-json-pointer`` (without index manipulation),
  ``email`` (a dot-atom subset of what ``jsonschema`` accepts), ``uri`` / ``uri-reference`` /
  ``iri`` / ``iri-reference`` (an RFC 3986 subset, below); ``pattern`` or ``format``
  with a length bound that every match satisfies, or a pattern that is one repeated character class
  anchored at both ends (``^[^,]+$``: the bounds go into its repetition), as they are; with other length
  bounds: combined (above);
* integers: ``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` (any numbers;
  float bounds rounded inwards) as an exact digit-range regex; ``multipleOf`` 1, 2, 5 or 10;
* numbers: the same four bounds when they are integer-valued (inclusive: ``|bound| <= 2**53``;
  exclusive: ``|bound| <= 10**6``, see below); ``multipleOf`` 1, 2, 5, 10 (integers only, see below);
* objects: ``properties``, ``required``, ``additionalProperties`` (``false``, a schema, or ``true``:
  extra keys with any value; absent: see "Smaller language"), ``unevaluatedProperties`` (as ``additionalProperties`` when that is
  absent, a no-op when it is present; next to ``anyOf`` it sees one alternative's properties at a time,
  a smaller language), ``maxProperties: 0``, ``minProperties: 1``;
  ``propertyNames`` (its strings are the keys of an object that declares no names; elsewhere: when every
  possible key satisfies it), ``dependentRequired`` / ``dependentSchemas`` (and the older drafts'
  ``dependencies``, read as these two; up to :attr:`_Converter.MAX_DEPENDENCIES` entries that do not always
  hold, whose schemas merge with the object's: the union over which of their names are present), other
  ``minProperties`` / ``maxProperties`` and ``patternProperties: {}`` only when they always hold; ``patternProperties`` with one pattern when no
  declared name matches it and no other key is allowed (``additionalProperties: false``, or silent: see
  "Smaller language"): its keys (a search, as ``pattern``) with values of its schema;
* arrays: ``items`` (schema or ``false``), ``prefixItems``, ``minItems``, ``maxItems``,
  ``unevaluatedItems`` (as ``items`` when that is absent); ``uniqueItems`` when ``maxItems <= 1`` or the
  items are a single ``const``; ``contains`` with ``minContains`` (at least that many elements satisfy
  both ``items`` and ``contains``; with ``maxContains``, at most that many, where ``contains`` can be negated)
  when there is no ``prefixItems``, ``unevaluatedItems``,
  ``maxItems``, ``uniqueItems`` or ``minItems`` above ``minContains``;
* ``anyOf`` (union; sibling keywords, ``oneOf`` included, are distributed into each alternative);
  ``oneOf`` when the alternatives are provably pairwise disjoint (different types, disjoint ``const`` /
  ``enum`` values, disjoint numeric ranges, objects that require a property with disjoint values), or
  else (up to :attr:`_Converter.MAX_NEGATED_ONE_OF` alternatives) as the union of "this alternative and
  not the others" where each can be negated (as ``if``'s condition, below);
  ``allOf`` and ``$ref`` with siblings by merging schemas whose keywords do not interact: ``type``
  intersected, ``required`` united, bounds tightened, ``enum`` intersected, ``properties`` united (a
  name in both: ``allOf`` of its two schemas) while neither side has ``additionalProperties`` /
  ``patternProperties``, equal values kept; keywords that read each other (``properties`` /
  ``patternProperties`` / ``additionalProperties``, ``prefixItems`` / ``items``, ``contains`` /
  ``minContains`` / ``maxContains``, ``if`` / ``then`` / ``else``) are never split between two schemas,
  and an ``unevaluated*`` keyword never sees what its siblings evaluate; ``not: false``;
* ``$ref`` to ``#``, ``#/$defs/...``, ``#/definitions/...`` or any JSON pointer into the document
  (``~0``, ``~1``, percent-decoding); the regex of each target is built once; a ``$ref`` through an
  identifier the document holds (an embedded resource's ``$id`` / drafts 4-6's ``id``, relative to the
  base URI of its location, an ``$anchor``) is first rewritten to the pointer of its target
  (:mod:`.json_refs`, resolved by the ``referencing`` library as ``jsonschema`` resolves it);
* boolean schemas: ``true`` = any value (bounded depth), ``false`` = no value.

Ignored (annotations, no effect on validity): ``title``, ``description``, ``default``, ``examples``,
``$comment``, ``$schema`` (every draft is read as 2020-12: keywords whose meaning changed are refused),
``deprecated``, ``readOnly``, ``writeOnly``, ``contentMediaType``, ``contentEncoding``, ``contentSchema``,
``$anchor`` / ``$dynamicAnchor`` (references to ``$anchor`` are resolved, above), ``$vocabulary``, ``$defs`` /
``definitions`` (read through ``$ref``), ``$id`` (identifiers: above), ``discriminator`` (an OpenAPI hint next to
``oneOf``, which is enforced), ``then`` / ``else`` without ``if``, ``minContains`` / ``maxContains``
without ``contains``; every keyword no draft defines (vendor extensions and typos: ``nullable``,
``example``, ``x-...``, ``@context``; draft 2020-12 collects unknown keywords as annotations and
``jsonschema`` ignores them); ``format`` values no draft defines (OpenAPI's ``int32``, ``byte``,
``password``, ...: annotations to every validator); drafts 4-6's ``id`` at the root or as a plain-name
anchor (``"#name"``).

Refused with :class:`~vllm_fst_backend.errors.UnsupportedSchemaError` (``keyword``, ``pointer``): a ``not``
whose negation cannot be written (:meth:`_Converter.negation` writes it for a boolean, types alone --
``not: {"type": "integer"}`` leaves the non-integer numbers, with a fraction and no exponent, not next to
numeric bounds --, one bound alone: its other side, ``required`` names, one property's schema, string
keywords: the strings they do not match), an ``if``
whose negation cannot be written (``if`` I ``then`` T ``else`` E is the union of I and T with not I and E;
not I as for ``not``, without the non-integer numbers), other ``contains``, other ``patternProperties``, ``$dynamicRef``,
``$recursiveRef``, a ``$ref`` to a URI the document does not hold (remote, a meta-schema: never fetched),
other ``multipleOf``,
non-integer number bounds, other ``format`` values a draft defines (``idn-hostname``, ``uri-template``,
draft 3's ``host-name``, ...), ``pattern`` constructs whose ECMA-262
and Python meanings differ or that our parser lacks (``\\W``, ``(?...)`` other than ``(?:``, ``{,n}``,
``[]``, lookaround, backreferences, ``\\b``, ``\\p{..}``, ``\\D`` / ``\\S`` inside a class), combined string
keywords whose regex exceeds :attr:`_Converter.MAX_COMBINED_POSITIONS` (``format: email`` with ``maxLength``
255), a ``not`` of a ``format`` or of a pattern with ``\\d`` / ``\\w`` / ``\\s``, ``uniqueItems`` beyond the cases above, the object keywords above when they do not
always hold, ``oneOf`` not provably disjoint, ``allOf`` / sibling merges that interact, keywords of older
drafts (``additionalItems``, ``items`` as an array, boolean ``exclusiveMinimum``, ...). A recursive ``$ref`` (a target reachable from itself)
is refused with ``regular=False``: the language is not regular, a fallback backend may serve it.

Other errors: :class:`~vllm_fst_backend.errors.InvalidSchemaError` (malformed schema: wrong value types,
unknown type names, unresolvable ``$ref``); :class:`~vllm_fst_backend.errors.EmptyLanguageError` (the
schema admits no value: ``false``, contradictory keywords); :class:`~vllm_fst_backend.errors.InputTooLargeError`
(the schema is over the input limits, or the regex being built exceeds ``max_regex_chars``: checked at
every step, so an explosive schema fails fast); :class:`~vllm_fst_backend.errors.CompileBudgetError`
(past the ``deadline``, more than :data:`MAX_STEPS` conversion steps, or a regex nesting groups deeper
than the parser accepts).

Smaller language (documented choices; valid instances outside the regex are never generated):

* extra keys only where the schema names them: an object that declares names (``properties`` /
  ``required`` / ``patternProperties``) but has no ``additionalProperties`` / ``unevaluatedProperties``
  takes its declared names (and pattern keys) only (``open_objects=False``, the default; xgrammar and outlines do the same in vLLM);
  ``additionalProperties: true`` or a schema opens it, and so does ``open_objects=True`` everywhere;
* whitespace only where :data:`DEFAULT_WHITESPACE` (or the given pattern) allows it, none inside
  ``enum`` / ``const`` values (they are matched in their compact serialization, keys in the order given);
* arbitrary values (``{}``, ``true``, ``{"type": "object"}`` without properties, arrays without
  ``items``) nest at most :data:`ANY_VALUE_DEPTH` non-empty containers counted from the root of the output
  (deeper ones: scalars, ``[]`` or ``{}``); values of extra keys (``additionalProperties`` absent /
  ``true`` / ``{}``) of an object that declares properties are scalars, ``[]`` or ``{}``
  (:data:`EXTRA_VALUE_DEPTH`); extra keys come after declared ones;
* strings: no ``\\uD800``-``\\uDFFF`` escapes (a surrogate pair counts 1 character to JSON Schema but
  is 2 escapes); extra keys of an object that declares properties use unescaped characters only (so
  that no escaped spelling of a declared name slips in as an "extra" key), and those longer than
  :data:`EXTRA_KEY_PREFIX` characters do not start with a declared name's first EXTRA_KEY_PREFIX ones;
* ``pattern``: characters that JSON must escape are matched in one spelling only (``json.dumps``'s:
  ``\\"``, ``\\\\``, ``\\n``, ``\\u0001``, ...), ``/`` only unescaped; ``.`` and negated classes also
  exclude ``"``, ``\\``, control characters and U+2028 / U+2029 (so they can be emitted raw), and
  ``\\d`` / ``\\w`` / ``\\s`` are ASCII while ``\\D`` / ``\\S`` exclude all Unicode digits / spaces (the
  intersection of the ECMA-262 and Python meanings); ``$`` does not match before a final newline;
* formats: ``T`` and ``Z`` upper case, seconds ``00``-``59`` (no leap second), fractions of 1-9 digits;
  ``email`` is ``dot-atom@domain`` with at least one dot in the domain (no quoted local parts, no
  address literals); ``uuid`` is the 8-4-4-4-12 hex form; ``uri`` and its relatives are
  ``scheme://host[:port]path[?query][#fragment]`` in RFC 3986's ASCII characters with percent escapes
  (no user info, IP literal, URI without ``//``, relative reference or non-ASCII IRI); ``hostname`` has
  2-4 labels, each of at most 62 characters, the last one 2-62 letters (no single-label name, no digit or
  hyphen in the top-level label, no trailing dot); ``json-pointer`` characters other than control
  characters, ``"`` and ``\\`` unescaped (those in ``json.dumps``'s spelling), ``relative-json-pointer``
  without an index manipulation (``0+1/a``);
* integers: no exponent and no fraction (``1.0`` and ``1e2`` are integers to JSON Schema), and
  ``enum`` / ``const`` numbers only in their own spelling (``1`` for 1, not ``1.0``); numbers with a
  bound or ``multipleOf``: no exponent, ``-0`` excluded; with ``multipleOf``: integers only; with an
  exclusive bound, the fraction of a number within 1 of that bound has at most 9 digits and does not
  end in ``0`` (so that rounding to a float can never reach the excluded bound).

Larger than the instances in one way: keys admitted by ``patternProperties`` or ``additionalProperties``
may repeat (a declared property appears once); the uniqueness of names drawn from an unbounded set is
not a regular property (docs/compiler.md, "Known limits"). Parsers keep one of the values.
"""

from __future__ import annotations

import json
import math
import re
import time
import unicodedata
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterable
from urllib.parse import unquote

from ..errors import (
    CompileBudgetError,
    EmptyLanguageError,
    FstBackendError,
    InputTooLargeError,
    InvalidOptionError,
    InvalidSchemaError,
    RegexError,
    UnsupportedSchemaError,
)
from .json_refs import localize_refs
from .regex_algebra import ANY_CHAR
from .regex_algebra import combine as combine_languages
from .limits import ENV_VARS, InputLimits, check_schema_obj
from .regex_parse import (  # escape_literal: re-exported (one shared copy)
    alt_node,
    cat_node,
    escape_literal,
    estimate_positions,
    fragment_tree,
    literal_node,
    parse_regex,
    remember_tree,
    rep_node,
)

try:  # the parser's nesting limit (regex_parse.MAX_GROUP_DEPTH); 50 where an older parser lacks the name
    from .regex_parse import MAX_GROUP_DEPTH
except ImportError:  # pragma: no cover
    MAX_GROUP_DEPTH = 50

__all__ = [
    "json_schema_to_regex",
    "escape_literal",
    "DEFAULT_WHITESPACE",
    "ANY_VALUE_DEPTH",
    "EXTRA_VALUE_DEPTH",
    "EXTRA_KEY_PREFIX",
    "MAX_STEPS",
]

#: Whitespace between JSON tokens when the request gives none (what vLLM's outlines integration uses).
#: Bounded on purpose: unbounded whitespace lets small models loop.
DEFAULT_WHITESPACE = "[ ]?"

#: Arbitrary JSON values (``{}``, ``true``, ``{"type": "object"}`` without properties, ``{"type": "array"}``
#: without items) nest at most this many containers counted from the root of the output: at the root,
#: ``{"a": [1], "b": {"c": null}}`` is accepted, ``{"a": [[1]]}`` is not. Deeper arbitrary values get the
#: rest (at least scalars). Why 2: on SmolLM2 (canonical, 2 CPU cores), ``{"type": "object"}`` compiles
#: in ~1.3 s with 2 levels and ~1.9 s with 3, and ``{}`` in ~3 s with 2 levels but over the token-state
#: budget with 3 (the automaton remembers every open container). Empty containers (``[]``, ``{}``) are
#: allowed at any depth.
ANY_VALUE_DEPTH = 2

#: Containers allowed inside the value of an *extra* key (``additionalProperties`` absent, ``true`` or
#: ``{}``) of an object that declares properties: 0 = scalars only (null, booleans, numbers, strings) and
#: empty containers. Each
#: open object costs a few tenths of a second of compile time even so.
EXTRA_VALUE_DEPTH = 0

#: Longest backtracking search of a ``patternProperties`` pattern in one declared name (seconds).
PATTERN_SEARCH_S = 0.5

#: Extra keys are compared with the declared names on at most this many leading characters: an extra key
#: longer than that which starts with a declared name's first EXTRA_KEY_PREFIX characters is not generated
#: at all (smaller language; keeps the key regex small).
EXTRA_KEY_PREFIX = 3

#: Leading optional properties of one object (those before the first required one) are written as a
#: chain ``((b1(, b2)?|b2)(, b3)?|b3)...`` of about this many blocks of consecutive members, each block one
#: member or a chain of its own blocks (recursively): a chain adds a group nesting level per part after
#: the first and writes those parts twice, so n small members nest about 3 log4(n) groups deep and are
#: written about sqrt(n) times; the character DFA builds each member's positions once
#: (:func:`.regex_parse.optional_tail`). A member longer than :data:`BIG_MEMBER_CHARS` (a nested object,
#: say) starts a block (at most 2 copies), and is written once when it is at least as long as its
#: siblings together (they get a few copies more), so a chain of nested all-optional objects grows
#: linearly, not exponentially.
OPTIONAL_BLOCKS = 4
BIG_MEMBER_CHARS = 200

#: Conversion steps (schema nodes visited, merges, disjointness checks) before CompileBudgetError.
MAX_STEPS = 200_000

_MAX_SAFE_INT = 2**53  # inclusive number bounds: exactly representable as floats
_MAX_EXCLUSIVE_BOUND = 10**6  # exclusive number bounds: 9 fraction digits stay clear of float rounding

# --------------------------------------------------------------------------------------------------
# Keywords
# --------------------------------------------------------------------------------------------------

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "deprecated", "readOnly",
    "writeOnly", "contentMediaType", "contentEncoding", "contentSchema", "$anchor", "$dynamicAnchor",
    "$vocabulary", "$defs", "definitions",
    "discriminator",  # OpenAPI / pydantic hint next to oneOf/anyOf: no validation meaning of its own
})
_NUMERIC_KW = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_STRING_KW = frozenset({"minLength", "maxLength", "pattern", "format"})
#: internal key of a flattened schema: a tuple of ``(schema, pointer)`` string schemas (``pattern``, ``format``,
#: lengths, string ``enum`` / ``const``) that a string value must fail (``not``); kept through flattening
#: (a known keyword); a user's document cannot hold a tuple, so a key of that name there is refused
_NOT_STRING = "\x00not-strings"
#: keywords of a schema whose ``not`` is written as a string language (:meth:`_Converter.string_negation`)
_STRING_NEGATABLE = frozenset({"type", "pattern", "format", "minLength", "maxLength", "enum", "const"})
_ARRAY_KW = frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains",
                       "minContains", "maxContains", "unevaluatedItems"})
_OBJECT_KW = frozenset({"properties", "required", "additionalProperties", "unevaluatedProperties",
                        "patternProperties", "propertyNames", "minProperties", "maxProperties",
                        "dependentRequired", "dependentSchemas"})
_GENERIC_KW = frozenset({"type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf", "not", "if", "then",
                         "else", "$id"})
_KNOWN = _ANNOTATIONS | _NUMERIC_KW | _STRING_KW | _ARRAY_KW | _OBJECT_KW | _GENERIC_KW | {_NOT_STRING}
#: Keywords of older drafts whose meaning differs in 2020-12 (refused; ``id`` and ``dependencies`` are read
#: as their 2020-12 equivalents where that is exact: :meth:`_Converter.check_keywords`, :func:`_own_keywords`).
_OLDER_DRAFTS = frozenset({"dependencies", "additionalItems", "$recursiveRef", "$recursiveAnchor", "id",
                           "divisibleBy", "disallow", "extends", "optional"})
_REFUSED_UNKNOWN = frozenset({"$dynamicRef"})


def _embeds_resource(v: Any) -> bool:
    """Whether an ``id`` value (drafts 4-6) starts a schema resource of its own: a URI other than a plain
    fragment (``"#name"`` is an anchor there, and a non-string is no ``id`` at all)."""
    return isinstance(v, str) and not v.startswith("#")


def _is_annotation(k: str) -> bool:
    """Whether keyword ``k`` has no effect on validity: the annotations, and every keyword no draft defines
    (vendor extensions such as ``x-order``, ``example``, ``nullable``, ``@context``): draft 2020-12 (Core
    §4.3.1) has unknown keywords collected as annotations, and ``Draft202012Validator`` ignores them."""
    return k in _ANNOTATIONS or not (k in _KNOWN or k in _OLDER_DRAFTS or k in _REFUSED_UNKNOWN)

#: Keywords that read each other: never split between two merged schemas.
_ADJACENT = (
    frozenset({"properties", "patternProperties", "additionalProperties"}),
    frozenset({"prefixItems", "items"}),
    frozenset({"contains", "minContains", "maxContains"}),
    frozenset({"if", "then", "else"}),
)
_APPLICATORS = frozenset({"allOf", "anyOf", "oneOf", "$ref", "not", "if", "then", "else", "dependentSchemas"})
#: What an unevaluated* keyword reads: these keywords (and in-place applicators that may hold them) must
#: come from the same schema (or below it), never from a sibling that a merge would put next to it.
_EVALUATES = {
    "unevaluatedProperties": frozenset({"properties", "patternProperties", "additionalProperties",
                                        "unevaluatedProperties"}) | _APPLICATORS,
    "unevaluatedItems": frozenset({"prefixItems", "items", "contains", "unevaluatedItems"}) | _APPLICATORS,
}

_TYPE_NAMES = ("null", "boolean", "object", "array", "string", "number", "integer")
#: keywords by which an object schema declares names (and is closed unless it says otherwise: docstring)
_OBJECT_NAMING = frozenset({"properties", "required", "patternProperties", "additionalProperties",
                            "unevaluatedProperties"})
_TYPE_ORDER = ("object", "array", "string", "number", "integer", "boolean", "null")

# --------------------------------------------------------------------------------------------------
# Regex text helpers
# --------------------------------------------------------------------------------------------------

def _class_char(cp: int) -> str:
    ch = chr(cp)
    if ch in "\\]^-[":
        return "\\" + ch
    if cp < 0x20 or cp == 0x7F:
        return f"\\x{cp:02x}"
    return ch


def _class_text(cps: Iterable[int], negated: bool = False) -> str:
    """``[...]`` (or ``[^...]``) of the code points ``cps``, runs of three or more written as ranges."""
    cps = sorted(set(cps))
    out = []
    i = 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(_class_char(cps[i]) + "-" + _class_char(cps[j]))
        else:
            out.extend(_class_char(c) for c in cps[i : j + 1])
        i = j + 1
    return "[" + ("^" if negated else "") + "".join(out) + "]"


def _where(ptr: str) -> str:
    return f"at #{ptr}" if ptr else "at the schema root"


def _ptr_join(ptr: str, *tokens: Any) -> str:
    return ptr + "".join("/" + str(t).replace("~", "~0").replace("/", "~1") for t in tokens)


# --------------------------------------------------------------------------------------------------
# Regex algebra (sizes checked at every step)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _R:
    """A regex fragment: ``atom`` when a quantifier may follow it without parentheses; ``branches`` the
    alternatives when it is exactly ``(b1|b2|...)`` (so that unions splice them instead of nesting);
    ``tree`` the :mod:`.regex_parse` tree of ``text`` (None: not known, the text is parsed) and
    ``btrees`` those of the branches."""

    text: str
    atom: bool
    branches: tuple[str, ...] | None = None
    tree: tuple | None = None
    btrees: tuple | None = None


_EPS = _R("", True, None, cat_node(()))  # the empty string
_EPS_TREE = ("eps",)
_PARSE = object()  # (make: the tree of a fixed or given text, from the fragment parser)


class _Rx:
    """Builds regex fragments; ``None`` is the empty language. Every result longer than
    ``max_chars`` raises InputTooLargeError at once, so nothing huge is ever built."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars

    def make(self, text: str, atom: bool, branches: tuple[str, ...] | None = None, tree=_PARSE,
             btrees: tuple | None = None) -> _R:
        """A fragment of ``text``; its tree is ``tree``, or the parse of ``text`` alone (memoized,
        :func:`.regex_parse.fragment_tree`) when not given."""
        if len(text) > self.max_chars:
            var = ENV_VARS["max_regex_chars"]
            raise InputTooLargeError(
                f"the regex converted from the JSON schema is too large: at least {len(text)} characters, "
                f"over the limit max_regex_chars={self.max_chars} (raise it with the environment variable "
                f"{var})",
                limit_name="max_regex_chars", env_var=var, limit=self.max_chars, measured=len(text),
            )
        if tree is _PARSE:  # (a text with branches is exactly "(b1|b2|...)")
            if branches is not None:
                btrees = tuple(fragment_tree(b) for b in branches)
                tree = alt_node(btrees) if all(t is not None for t in btrees) else fragment_tree(text)
            else:
                tree = fragment_tree(text)
        return _R(text, atom, branches, tree, btrees)

    def lit(self, text: str) -> _R:
        if not text:
            return _EPS
        return self.make(escape_literal(text), len(text) == 1, tree=literal_node(text))

    @staticmethod
    def group(r: _R) -> str:
        return r.text if r.atom else "(" + r.text + ")"

    def cat(self, *parts: _R | None) -> _R | None:
        if any(p is None for p in parts):
            return None
        parts = [p for p in parts if p is not _EPS and p.text]
        if not parts:
            return _EPS
        if len(parts) == 1:
            return parts[0]
        tree = None
        if all(p.tree is not None for p in parts):  # (a bare concatenation's items join the others)
            items: list = []
            for p in parts:
                if not p.atom and p.tree[0] == "cat":
                    items.extend(p.tree[1])
                else:
                    items.append(p.tree)
            tree = cat_node(items)
        return self.make("".join(p.text for p in parts), False, tree=tree)

    def alt(self, parts: Iterable[_R | None]) -> _R | None:
        """Union; alternatives of alternations are spliced in, duplicates dropped, ``(...)?`` when one
        part is the empty string."""
        seen: dict[str, _R] = {}
        has_eps = False
        for p in parts:
            if p is None:
                continue
            if not p.text:
                has_eps = True
                continue
            if p.branches is None:
                seen.setdefault(p.text, p)
                continue
            bts = p.btrees or (None,) * len(p.branches)
            for b, bt in zip(p.branches, bts):
                if b not in seen:
                    seen[b] = _R(b, False, None, bt)
        if not seen:
            return _EPS if has_eps else None
        if len(seen) == 1:
            (r,) = seen.values()
        else:
            trees = tuple(v.tree for v in seen.values())
            known = all(t is not None for t in trees)
            r = self.make("(" + "|".join(seen) + ")", True, tuple(seen), tree=alt_node(trees) if known else None,
                          btrees=trees)
        return self.opt(r) if has_eps else r

    def opt(self, r: _R | None) -> _R:
        if r is None or not r.text:
            return _EPS
        return self.make(self.group(r) + "?", False, tree=None if r.tree is None else rep_node(r.tree, 0, 1))

    def rep(self, r: _R | None, lo: int, hi: int | None) -> _R | None:
        if hi is not None and hi < lo:
            return None
        if r is None:
            return _EPS if lo == 0 else None
        if not r.text or hi == 0:
            return _EPS
        if lo == 1 and hi == 1:
            return r
        if (lo, hi) == (0, 1):
            return self.opt(r)
        q = {(0, None): "*", (1, None): "+"}.get((lo, hi))
        if q is None:
            q = "{%d}" % lo if lo == hi else "{%d,}" % lo if hi is None else "{%d,%d}" % (lo, hi)
        return self.make(self.group(r) + q, False, tree=None if r.tree is None else rep_node(r.tree, lo, hi))


# --------------------------------------------------------------------------------------------------
# Fixed pieces of JSON
# --------------------------------------------------------------------------------------------------

_HEX = "[0-9a-fA-F]"
#: \\u escapes of non-surrogates (U+D800-U+DFFF excluded: a pair counts 1 character, 2 escapes); the last
#: two hex digits are written once after the alternation, so that both branches end in the same positions
_U_ESCAPE = rf"u([0-9a-cA-CefEF]{_HEX}|[dD][0-7]){_HEX}{{2}}"
_STRING_CHAR = r'([^"\\\x00-\x1f]|\\(["\\/bfnrt]|' + _U_ESCAPE + "))"
#: every character JSON escapes (:data:`_RAW_CHAR_CPS`) in ``json.dumps``' spelling, one alternative
_RAW_SPELLINGS = r'\\(["\\bfnrt]|u00(0[0-7bef]|1[0-9a-f]))'
_RAW_CHAR_CPS = frozenset(range(0x20)) | {ord('"'), ord("\\")}  # what a raw class must exclude
_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_INTEGER = r"-?(0|[1-9][0-9]*)"
#: numbers that are not integers (``not: {"type": "integer"}``): a fraction with a non-zero digit, no exponent
_FRACTIONAL = r"-?(0|[1-9][0-9]*)\.[0-9]*[1-9][0-9]*"
#: internal key of a flattened schema (never a user's: flatten drops keywords no draft defines): its numbers
#: are the non-integer ones
_NOT_INTEGER = "\x00not-integer"

_YEAR = r"([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    rf"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
# RFC 3986 URI with an authority (``scheme://host[:port]path[?query][#fragment]``): a reg-name host, no user
# info, no IP literal; pchar = unreserved / pct-encoded / sub-delims / ":" / "@" (RFC 3986 §3.3)
_PCHAR = r"([A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"
_URI = (rf"[A-Za-z][A-Za-z0-9+.-]*://[A-Za-z0-9._~!$&'()*+,;=-]*(:[0-9]*)?(/{_PCHAR}*)*(\?({_PCHAR}|[/?])*)?"
        rf"(#({_PCHAR}|[/?])*)?")
_H16 = _HEX + "{1,4}"
_IPV4 = rf"{_OCTET}(\.{_OCTET}){{3}}"


def _ipv6_regex() -> str:
    """The text forms of an IPv6 address (RFC 4291 §2.2) exactly as Python's ``ipaddress.IPv6Address``
    reads them, less a zone index (``%eth0``, which ``jsonschema``'s ``ipv6`` check refuses): 8 groups of 1-4
    hex digits; 6 groups and a dotted IPv4 address (no leading zeros, as ``IPv4Address`` reads it); or
    ``::`` for at least one group, with L groups before it and R after it, L + R ≤ 7, or L + R ≤ 5 before
    an IPv4 tail (which counts two groups). One alternative per L: ~150 character states, ~10 ms to
    compile canonically at SmolLM2."""
    alts = [rf"({_H16}:){{7}}{_H16}", rf"({_H16}:){{6}}{_IPV4}"]
    for left in range(8):
        lhs = "" if left == 0 else _H16 + (rf"(:{_H16}){{{left - 1}}}" if left > 1 else "")
        right = 7 - left  # at most this many groups after "::"
        alts.append(lhs + "::" + (rf"({_H16}(:{_H16}){{0,{right - 1}}})?" if right else ""))
        if left <= 5:
            alts.append(lhs + "::" + rf"({_H16}:){{0,{5 - left}}}" + _IPV4)
    return "(" + "|".join(alts) + ")"


#: ``hostname``: what every checker of the format accepts, whichever version of the optional ``fqdn`` package
#: ``jsonschema`` finds (1.5: dot-separated labels of 1-63 letters, digits or inner hyphens, at most 253
#: characters; 1.0-1.4: at least two labels of at most 62, the last one letters only) and RFC 1123: 2-4
#: labels of at most 62 characters, the last one 2-62 letters (at most 251 characters in all)
_HOST_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,60}[A-Za-z0-9])?"
_HOSTNAME = rf"({_HOST_LABEL}\.){{1,3}}[A-Za-z]{{2,62}}"
#: ``json-pointer`` (RFC 6901 §3) in the JSON-escaped text: reference tokens of characters other than ``/``
#: and ``~``, with ``~0`` / ``~1``; ``"``, ``\\`` and control characters in ``json.dumps``'s spelling (``\\u00XX``
#: and the short escapes but ``\\/``, which is a ``/``); other ``\\u`` escapes are left out
_JP_CHAR = r'([^/~"\\\x00-\x1f]|~[01]|\\(["\\bfnrt]|u00[01][0-9a-fA-F]))'
_JSON_POINTER = rf"(/{_JP_CHAR}*)*"
#: ``duration`` (RFC 3339 Appendix A, ISO 8601): ``P`` and the date elements Y, M, D in that order (each
#: larger one followed by the next), then ``T`` and H, M, S likewise; or weeks alone
_DUR_TIME = r"T([0-9]+H([0-9]+M([0-9]+S)?)?|[0-9]+M([0-9]+S)?|[0-9]+S)"
_DURATION = rf"P(([0-9]+D|[0-9]+M([0-9]+D)?|[0-9]+Y([0-9]+M([0-9]+D)?)?)({_DUR_TIME})?|{_DUR_TIME}|[0-9]+W)"
_FORMATS = {
    "uri": _URI,
    "uri-reference": _URI,  # (a URI is a URI reference)
    "iri": _URI,  # (an ASCII URI is an IRI)
    "iri-reference": _URI,
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "T" + _TIME,
    "uuid": rf"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
    "ipv4": _IPV4,
    "ipv6": _ipv6_regex(),
    "hostname": _HOSTNAME,
    "email": rf"{_ATEXT}+(\.{_ATEXT}+)*@{_LABEL}(\.{_LABEL})+",
    "json-pointer": _JSON_POINTER,
    # (draft-bhutton-relative-json-pointer-00 without its index manipulation, ``0+1/a``)
    "relative-json-pointer": rf"(0|[1-9][0-9]*)(#|{_JSON_POINTER})",
    "duration": _DURATION,
}

_FORMAT_LENGTHS: dict[str, tuple[int, int | None]] = {}  # (min, max) length of each format, on first use
#: Formats draft 2020-12 defines (Validation §7.3) and the older drafts' names for formats (draft 3:
#: ``host-name``, ``ip-address``, ``color``, ...): the ones fst lacks are refused. Any other ``format`` value
#: (OpenAPI's ``int32``, ``byte``, ``password``, ...) is an annotation to every validator and is ignored.
_DEFINED_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex",
    "host-name", "ip-address", "color", "utc-millisec", "style", "phone",
})


def _own_keywords(schema: dict) -> dict:
    """The keywords of ``schema`` that the conversion reads (after :meth:`_Converter.check_keywords`):
    without annotations, unknown keywords (:func:`_is_annotation`), ``id`` (a base URI or a plain-name
    anchor there) and a ``format`` no draft defines; an older draft's ``dependencies`` becomes
    ``dependentRequired`` (its array values) and ``dependentSchemas`` (its schema values), as 2020-12 split it."""
    own = {k: v for k, v in schema.items() if not _is_annotation(k) and k != "id"}
    if isinstance(own.get("format"), str) and own["format"] not in _DEFINED_FORMATS:
        del own["format"]
    deps = own.pop("dependencies", None)
    if isinstance(deps, dict):
        for name, dep in deps.items():
            own.setdefault("dependentRequired" if isinstance(dep, list) else "dependentSchemas", {})[name] = dep
    return own

# --------------------------------------------------------------------------------------------------
# Integer and number ranges
# --------------------------------------------------------------------------------------------------

_ALL_DIGITS = frozenset("0123456789")
_LAST_DIGITS = {1: _ALL_DIGITS, 2: frozenset("02468"), 5: frozenset("05"), 10: frozenset("0")}


def _digit_class(lo: int, hi: int, allowed: frozenset = _ALL_DIGITS) -> str | None:
    ds = [d for d in range(lo, hi + 1) if str(d) in allowed]
    if not ds:
        return None
    if len(ds) == 1:
        return str(ds[0])
    if ds == list(range(ds[0], ds[-1] + 1)):
        return f"[{ds[0]}-{ds[-1]}]" if len(ds) > 2 else f"[{ds[0]}{ds[1]}]"
    return "[" + "".join(map(str, ds)) + "]"


def _free_digits(k: int, last: frozenset) -> str | None:
    """``k`` free digit positions whose last one is in ``last``."""
    if k == 0:
        return ""
    if last == _ALL_DIGITS:
        return "[0-9]" + _quant(k, k)
    tail = _digit_class(0, 9, last)
    if tail is None:
        return None
    if k == 1:
        return tail
    lead = "[0-9]" if k == 2 else "[0-9]{%d}" % (k - 1)
    return lead + tail


def _same_length_blocks(lo: int, hi: int, last: frozenset) -> list[str]:
    """Flat alternatives ``prefix[a-b][0-9]{k}`` covering the integers lo..hi (same digit count, no
    leading zero), restricted to last digits in ``last``. At most ~20 blocks per digit."""
    n = len(str(lo))
    out = []
    x = lo
    while x <= hi:
        k = 0
        while k + 1 < n and x % 10 ** (k + 1) == 0 and x + 10 ** (k + 1) - 1 <= hi:
            k += 1
        step = 10**k
        d = (x // step) % 10
        c = min(10 - d, (hi - x + 1) // step)
        s = str(x)
        prefix = s[: n - k - 1]
        if k == 0:
            cls = _digit_class(d, d + c - 1, last)
            text = None if cls is None else prefix + cls
        else:
            free = _free_digits(k, last)
            text = None if free is None else prefix + _digit_class(d, d + c - 1) + free
        if text is not None:
            out.append(text)
        x += c * step
    return out


def _quant(lo: int, hi: int | None) -> str:
    """Quantifier text for {lo,hi} (hi None: unbounded); "" for exactly one."""
    if hi is None:
        return "*" if lo == 0 else "+" if lo == 1 else "{%d,}" % lo
    if lo == hi:
        return "" if lo == 1 else "{%d}" % lo
    return "?" if (lo, hi) == (0, 1) else "{%d,%d}" % (lo, hi)


def _more_digits(k_min: int, last: frozenset, k_max: int | None = None) -> str | None:
    """Between ``k_min`` (>= 1) and ``k_max`` (None: unbounded) digits, the last one in ``last``."""
    if last == _ALL_DIGITS:
        return "[0-9]" + _quant(k_min, k_max)
    tail = _digit_class(0, 9, last)
    if tail is None:
        return None
    hi = None if k_max is None else k_max - 1
    return ("" if hi == 0 else "[0-9]" + _quant(k_min - 1, hi)) + tail


def _natural_range(lo: int, hi: int | None, last: frozenset = _ALL_DIGITS) -> list[str]:
    """Flat alternatives matching the canonical decimal naturals in [lo, hi] (hi None: unbounded) whose
    last digit is in ``last``: per digit count, the aligned blocks of :func:`_same_length_blocks`; runs of
    digit counts that are entirely inside the range as one ``[1-9][0-9]{a,b}``."""
    out: list[str] = []
    if hi is not None and hi < lo:
        return out
    n_hi = None if hi is None else len(str(hi))
    d = len(str(lo))
    while n_hi is None or d <= n_hi:
        first = 0 if d == 1 else 10 ** (d - 1)
        a = max(lo, first)
        if hi is not None and d == n_hi:  # last digit count: up to hi
            more = _more_digits(d - 1, last, d - 1) if d > 1 and a == first and hi == 10**d - 1 else None
            if more is not None:
                out.append("[1-9]" + more)
            elif not (d > 1 and a == first and hi == 10**d - 1):
                out.extend(_same_length_blocks(a, hi, last))
            break
        if d > 1 and a == first:  # every number of d digits or more, up to the last full digit count
            top = None if hi is None else (n_hi if hi == 10**n_hi - 1 else n_hi - 1)
            more = _more_digits(d - 1, last, None if top is None else top - 1)
            if more is not None:
                out.append("[1-9]" + more)
            if top is None or top == n_hi:
                break
            d = n_hi
            continue
        out.extend(_same_length_blocks(a, 10**d - 1, last))
        d += 1
    return [t for t in out if t]


# --------------------------------------------------------------------------------------------------
# Pattern (ECMA-262) translation
# --------------------------------------------------------------------------------------------------

_SIMPLE_ESCAPES = set("dswDStnrfv0xu") | set("\\.*+?()[]{}|^$/-")
#: ``\#``, ``\:``, ...: the character itself in ECMA-262 (an identity escape) and in Python
_IDENTITY_ESCAPES = set("#&~'\",:!@%=<>;` ")
_UNICODE_SETS: dict[str, frozenset] = {}


def _unicode_set(kind: str) -> frozenset:
    """Code points of Python's Unicode ``\\d`` (kind "d") or ``\\s`` plus ECMA-262's white space (kind
    "s"); computed once per process (~0.1 s)."""
    if kind not in _UNICODE_SETS:
        if kind == "d":
            cps = {cp for cp in range(0x110000) if unicodedata.category(chr(cp)) == "Nd"}
        else:
            cps = {cp for cp in range(0x3100) if chr(cp).isspace()} | {0xFEFF, 0x3000}
            cps |= {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F, 0x205F}
            cps |= set(range(0x2000, 0x200B))
        _UNICODE_SETS[kind] = frozenset(cps)
    return _UNICODE_SETS[kind]


def _len_bounds(node) -> tuple[int, int | None]:
    """(min, max) length in characters of the strings of a :func:`parse_regex` tree (max None: unbounded)."""
    kind = node[0]
    if kind == "sym":
        return 1, 1
    if kind == "eps":
        return 0, 0
    if kind == "cat":
        lo, hi = 0, 0
        for c in node[1]:
            a, b = _len_bounds(c)
            lo += a
            hi = None if hi is None or b is None else hi + b
        return lo, hi
    if kind == "alt":
        bs = [_len_bounds(c) for c in node[1]]
        return min(b[0] for b in bs), (None if any(b[1] is None for b in bs) else max(b[1] for b in bs))
    a, b = _len_bounds(node[1])
    n_lo, n_hi = node[2], node[3]
    if n_hi == 0 or b == 0:
        return a * n_lo, 0
    return a * n_lo, (None if n_hi is None or b is None else b * n_hi)


# --------------------------------------------------------------------------------------------------
# JSON values
# --------------------------------------------------------------------------------------------------


def _json_equal(a: Any, b: Any) -> bool:
    """JSON Schema equality: numbers by value (1 == 1.0), booleans distinct from numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _compact(value: Any) -> str | None:
    """Compact JSON text of ``value`` (keys as given), or None for NaN / infinities (not JSON)."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------------
# The converter
# --------------------------------------------------------------------------------------------------


class _Converter:
    """One conversion: the document, the whitespace fragment, limits, deadline, memo tables."""

    def __init__(self, root: Any, ws: _R, max_chars: int, deadline: float | None, open_objects: bool = False):
        self.root = root
        self.open_objects = open_objects
        self.rx = _Rx(max_chars)
        self.ws = ws
        self.deadline = deadline
        self.steps = 0
        self.stack: list[str] = []  # ref targets being expanded on the current path
        self.ref_memo: dict[tuple[str, int], _R | None] = {}
        self.flat_memo: dict[str, tuple[Any, tuple[str, ...]]] = {}
        self.targets: dict[str, Any] = {}  # resolved ref pointer -> schema
        self.any_memo: dict[int, _R] = {}
        self._validator = None
        self.sep = self.rx.cat(self.rx.lit(","), ws)
        self.colon = self.rx.cat(self.rx.lit(":"), ws)
        self.string_char = self.rx.make(_STRING_CHAR, True)
        self.string = self.rx.make('"' + _STRING_CHAR + '*"', False)

    # ---- bookkeeping -------------------------------------------------------------------------

    def tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise CompileBudgetError(
                f"JSON schema conversion exceeded its work budget of {MAX_STEPS} steps; simplify the schema",
                None)
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise CompileBudgetError("JSON schema conversion exceeded the compile time budget "
                                     "(VLLM_FST_COMPILE_BUDGET_S)", None)

    @contextmanager
    def expanding(self, refs: Iterable[str]):
        refs = list(refs)
        self.stack.extend(refs)
        try:
            yield
        finally:
            del self.stack[len(self.stack) - len(refs):]

    @staticmethod
    def refuse(keyword: str, ptr: str, why: str, regular: bool = True) -> UnsupportedSchemaError:
        return UnsupportedSchemaError(f"JSON schema keyword '{keyword}' {_where(ptr)}: {why}",
                                      keyword=keyword, pointer=ptr, regular=regular)

    @staticmethod
    def invalid(keyword: str, ptr: str, why: str) -> InvalidSchemaError:
        return InvalidSchemaError(f"invalid JSON schema: '{keyword}' {_where(ptr)} {why}",
                                  keyword=keyword, pointer=ptr)

    # ---- keyword value checks ----------------------------------------------------------------

    def check_keywords(self, d: dict, ptr: str) -> None:
        for k in d:
            if not isinstance(k, str):
                raise self.invalid(str(k), ptr, "is not a string keyword")
            if k == _NOT_STRING and not isinstance(d[k], tuple):
                raise self.invalid(repr(k), ptr, "is not a keyword")
            if k in _KNOWN or _is_annotation(k):
                continue
            if k == "id" and (ptr == "" or not _embeds_resource(d[k])):
                continue  # draft 4-6's $id: the root's base URI, or a plain-name anchor ("#name")
            if k == "dependencies" and isinstance(d[k], dict) and not (d.keys() & {"dependentRequired",
                                                                                   "dependentSchemas"}):
                continue  # read as dependentRequired / dependentSchemas (_own_keywords)
            if k == "id":
                raise self.refuse(k, ptr, "embedded schema resources (id below the root) are not supported")
            if k in _OLDER_DRAFTS:
                raise self.refuse(k, ptr, "is a keyword of an older JSON Schema draft; use its draft 2020-12 "
                                          "equivalent")
            raise self.refuse(k, ptr, "dynamic references are not supported", regular=False)  # $dynamicRef
        if "$id" in d and ptr != "":
            raise self.refuse("$id", ptr, "embedded schema resources ($id below the root) are not supported")
        if "type" in d:
            self.types_of_keyword(d["type"], ptr)

    def types_of_keyword(self, t: Any, ptr: str) -> set[str]:
        if isinstance(t, str):
            names = [t]
        elif isinstance(t, list) and t:
            names = t
        else:
            raise self.invalid("type", ptr, f"must be a type name or a non-empty list of them, got {t!r}")
        out = set()
        for n in names:
            if n not in _TYPE_NAMES:
                raise self.invalid("type", ptr, f"names an unknown type {n!r} (known: {', '.join(_TYPE_NAMES)})")
            out.add(n)
        if len(out) != len(names):
            raise self.invalid("type", ptr, "lists a type twice")
        return out

    def nonneg_int(self, d: dict, key: str, ptr: str, default: int | None = None) -> int | None:
        if key not in d:
            return default
        v = d[key]
        if not _is_number(v) or v < 0 or (isinstance(v, float) and not v.is_integer()):
            raise self.invalid(key, ptr, f"must be a non-negative integer, got {v!r}")
        return int(v)

    def number(self, d: dict, key: str, ptr: str):
        v = d.get(key)
        if v is None and key not in d:
            return None
        if isinstance(v, bool) and key.startswith("exclusive"):
            raise self.refuse(key, ptr, "the draft-4 boolean form is not supported (use a number)")
        if not _is_number(v) or (isinstance(v, float) and not math.isfinite(v)):
            raise self.invalid(key, ptr, f"must be a finite number, got {v!r}")
        return v

    def schema_value(self, v: Any, key: str, ptr: str) -> Any:
        if not isinstance(v, (dict, bool)):
            raise self.invalid(key, ptr, f"must be a schema (object or boolean), got {type(v).__name__}")
        return v

    def schema_list(self, d: dict, key: str, ptr: str) -> list:
        v = d[key]
        if not isinstance(v, list) or not v:
            raise self.invalid(key, ptr, "must be a non-empty array of schemas")
        for s in v:
            self.schema_value(s, key, ptr)
        return v

    def schema_map(self, d: dict, key: str, ptr: str) -> dict:
        v = d.get(key, {})
        if not isinstance(v, dict):
            raise self.invalid(key, ptr, f"must be an object of schemas, got {type(v).__name__}")
        for s in v.values():
            self.schema_value(s, key, ptr)
        return v

    def string_list(self, d: dict, key: str, ptr: str) -> list[str]:
        v = d.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.invalid(key, ptr, f"must be an array of strings, got {v!r}")
        if len(set(v)) != len(v):
            raise self.invalid(key, ptr, "lists a name twice")
        return v

    # ---- $ref --------------------------------------------------------------------------------

    def resolve(self, ref: Any, ptr: str) -> tuple[str, Any]:
        """(canonical pointer, target) of a local ``$ref``."""
        if not isinstance(ref, str):
            raise self.invalid("$ref", ptr, f"must be a string, got {type(ref).__name__}")
        if not ref.startswith("#"):
            raise self.refuse("$ref", ptr, f"only references within the document ('#...') are supported, "
                                           f"not {ref!r}")
        frag = unquote(ref[1:])
        if frag and not frag.startswith("/"):
            raise self.refuse("$ref", ptr, f"references to anchors ({ref!r}) are not supported")
        node = self.root
        tokens = frag.split("/")[1:] if frag else []
        for raw in tokens:
            tok = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and tok in node:
                if node is not self.root and ("$id" in node or _embeds_resource(node.get("id"))):
                    raise self.refuse("$ref", ptr, f"{ref!r} points into an embedded resource ($id)")
                node = node[tok]
            elif isinstance(node, list) and re.fullmatch(r"0|[1-9][0-9]*", tok) and int(tok) < len(node):
                node = node[int(tok)]
            else:
                raise self.invalid("$ref", ptr, f"does not resolve: {ref!r} (no {tok!r})")
        if not isinstance(node, (dict, bool)):
            raise self.invalid("$ref", ptr, f"{ref!r} points to a {type(node).__name__}, not a schema")
        target = _ptr_join("", *[t.replace("~1", "/").replace("~0", "~") for t in tokens])
        self.targets[target] = node
        return target, node

    def recursion(self, target: str, ptr: str) -> UnsupportedSchemaError:
        return self.refuse("$ref", ptr, f"recursive reference to #{target}: a recursive schema is not a regular "
                                        f"language", regular=False)

    # ---- flattening (inline $ref and allOf, merge) -------------------------------------------

    def flatten(self, schema: Any, ptr: str) -> tuple[Any, tuple[str, ...]]:
        """``schema`` with its top-level ``$ref`` and ``allOf`` merged in and annotations dropped: a dict
        without those keywords, or a boolean. Also returns the ref targets inlined (to keep on the
        recursion stack while converting the result)."""
        self.tick()
        if isinstance(schema, bool):
            return schema, ()
        if not isinstance(schema, dict):
            raise InvalidSchemaError(f"invalid JSON schema {_where(ptr)}: a schema must be an object or a "
                                     f"boolean, got {type(schema).__name__}", pointer=ptr)
        self.check_keywords(schema, ptr)
        own = {k: v for k, v in _own_keywords(schema).items() if k not in ("$ref", "allOf", "$id")}
        children: list[tuple[Any, str]] = []
        refs: list[str] = []
        if "$ref" in schema:
            target_ptr, _ = self.resolve(schema["$ref"], ptr)
            flat, inner = self.flatten_ref(target_ptr, ptr)
            children.append((flat, _ptr_join(ptr, "$ref")))
            refs.extend((target_ptr, *inner))
        if "allOf" in schema:
            for i, sub in enumerate(self.schema_list(schema, "allOf", ptr)):
                sub_ptr = _ptr_join(ptr, "allOf", i)
                with self.expanding(refs):
                    flat, inner = self.flatten(sub, sub_ptr)
                children.append((flat, sub_ptr))
                refs.extend(inner)
        if not children:
            return own, ()
        return self.merge_children(own, children, ptr), tuple(refs)

    def flatten_ref(self, target_ptr: str, ptr: str) -> tuple[Any, tuple[str, ...]]:
        if target_ptr in self.stack:
            raise self.recursion(target_ptr, ptr)
        if target_ptr not in self.flat_memo:
            with self.expanding([target_ptr]):
                self.flat_memo[target_ptr] = self.flatten(self.targets[target_ptr], target_ptr)
        flat, inner = self.flat_memo[target_ptr]
        for r in inner:
            if r in self.stack:
                raise self.recursion(r, ptr)
        return flat, inner

    def merge_children(self, parent: dict, children: list[tuple[Any, str]], ptr: str) -> Any:
        """Conjunction of ``parent`` (a flattened dict) and flattened ``children`` (its in-place
        applicators), or refuse when it cannot be written as one schema exactly."""
        if any(c is False for c, _ in children):
            return False
        dicts = [(c, p) for c, p in children if isinstance(c, dict)]
        for i, (c, cptr) in enumerate(dicts):
            for kw, evaluators in _EVALUATES.items():
                if kw not in c:
                    continue
                outside = set(parent) | {k for j, (o, _) in enumerate(dicts) if j != i for k in o}
                if outside & evaluators:
                    raise self.refuse(kw, cptr, "inside an allOf/anyOf/oneOf/$ref alternative whose siblings "
                                                "evaluate properties/items is not supported")
        out: Any = dict(parent)
        for c, cptr in dicts:
            out = self.merge(out, c, cptr)
            if out is False:
                return False
        return out

    def merge(self, a: dict, b: dict, ptr: str) -> Any:
        """``a`` ∧ ``b`` as one dict (False when contradictory); refuses interacting keywords."""
        self.tick()
        for group in _ADJACENT:
            if _constraining(group, a) and _constraining(group, b) and any(
                    not _json_equal(a.get(k, _MISSING), b.get(k, _MISSING)) for k in group):
                if group & (a.keys() | b.keys()) == {"properties"}:
                    continue  # properties alone on both sides: merged name by name (combine)
                if "properties" in group and (_names_within(a, b) or _names_within(b, a)):
                    continue  # one side's properties alone, names the other declares: the same "additional" keys
                kws = "/".join(sorted(group & (a.keys() | b.keys())))
                raise self.refuse("allOf", ptr, f"cannot merge schemas that both use {kws} (they interact)")
        out = dict(a)
        for k, v in b.items():
            if k not in out:
                out[k] = v
                continue
            if _json_equal(out[k], v):
                continue
            combined = self.combine(k, out[k], v, ptr)
            if combined is _CONTRADICTION:
                return False
            out[k] = combined
        return out

    def combine(self, k: str, x: Any, y: Any, ptr: str) -> Any:
        if k == "type":
            tx, ty = self.norm_types(x, ptr), self.norm_types(y, ptr)
            both = [t for t in _TYPE_NAMES if t in _type_meet(tx, ty)]
            return both if both else _CONTRADICTION
        if k == "required":
            return list(dict.fromkeys(self.string_list({k: x}, k, ptr) + self.string_list({k: y}, k, ptr)))
        if k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            vx, vy = self.number({k: x}, k, ptr), self.number({k: y}, k, ptr)
            return max(vx, vy) if "inimum" in k else min(vx, vy)
        if k in ("minLength", "minItems", "minProperties", "minContains"):
            return max(self.nonneg_int({k: x}, k, ptr), self.nonneg_int({k: y}, k, ptr))
        if k in ("maxLength", "maxItems", "maxProperties", "maxContains"):
            return min(self.nonneg_int({k: x}, k, ptr), self.nonneg_int({k: y}, k, ptr))
        if k == "enum":
            if not isinstance(x, list) or not isinstance(y, list):
                raise self.invalid("enum", ptr, "must be an array")
            return [v for v in x if any(_json_equal(v, w) for w in y)]
        if k == "const":
            return _CONTRADICTION
        if k == "properties":  # both sides' subschemas apply to a common name
            px, py = self.schema_map({k: x}, k, ptr), self.schema_map({k: y}, k, ptr)
            out = dict(px)
            for name, sub in py.items():
                out[name] = sub if name not in out or _json_equal(out[name], sub) else {"allOf": [out[name], sub]}
            return out
        if k == "pattern":  # both apply: the string keywords' intersection (type_string)
            return tuple(dict.fromkeys(_patterns({k: x}) + _patterns({k: y})))
        if k == _NOT_STRING:
            return tuple(x) + tuple(y)
        if k == "uniqueItems":
            return bool(x) or bool(y)
        raise self.refuse("allOf", ptr, f"cannot merge two different '{k}' values into one schema")

    def norm_types(self, t: Any, ptr: str) -> set[str]:
        return self.types_of_keyword(t, ptr)

    # ---- conversion entry points ---------------------------------------------------------------

    def any_depth(self, nest: int) -> int:
        return max(ANY_VALUE_DEPTH - nest, 0)

    def node(self, schema: Any, ptr: str, nest: int) -> _R | None:
        """Regex of a schema found in the document at ``ptr``; ``nest`` = containers around the value."""
        self.tick()
        if isinstance(schema, dict) and "$ref" in schema and _own_keywords(schema).keys() == {"$ref"}:
            target_ptr, _ = self.resolve(schema["$ref"], ptr)
            return self.ref(target_ptr, ptr, nest)
        flat, refs = self.flatten(schema, ptr)
        with self.expanding(refs):
            return self.flat(flat, ptr, nest, schema)

    def node_and(self, parts: list[tuple[Any, str]], ptr: str, nest: int, keep_open: bool = False) -> _R | None:
        """Regex of the conjunction of schemas found at their pointers (each flattened there, then merged as
        an ``allOf`` is: refused as ``allOf`` when keywords interact); ``enum`` values are checked against
        all of them. ``keep_open``: an object that says nothing about other keys takes any (declared names
        would close it: module docstring, "Smaller language")."""
        flats, refs = [], []
        for schema, at in parts:
            f, r = self.flatten(schema, at)
            flats.append((f, at))
            refs.extend(r)
        merged = self.merge_children({}, flats, ptr)
        if keep_open and isinstance(merged, dict) and not merged.keys() & {"additionalProperties",
                                                                          "unevaluatedProperties"}:
            merged["additionalProperties"] = True
        with self.expanding(refs):
            return self.flat(merged, ptr, nest, {"allOf": [schema for schema, _ in parts]})

    def ref(self, target_ptr: str, ptr: str, nest: int) -> _R | None:
        if target_ptr in self.stack:
            raise self.recursion(target_ptr, ptr)
        key = (target_ptr, self.any_depth(nest))
        if key not in self.ref_memo:
            with self.expanding([target_ptr]):
                self.ref_memo[key] = self.node(self.targets[target_ptr], target_ptr, nest)
        return self.ref_memo[key]

    def flat(self, d: Any, ptr: str, nest: int, origin: Any) -> _R | None:
        """Regex of a flattened schema; ``origin`` is an equivalent-or-stronger document schema that
        ``enum`` candidates are validated against."""
        self.tick()
        if d is False:
            return None
        if d is True:
            return self.any_value(nest)
        self.check_keywords(d, ptr)
        if "enum" in d or "const" in d:
            return self.enum(d, ptr, origin)
        if "anyOf" in d or "oneOf" in d:
            return self.combinator(d, ptr, nest, origin)
        # (``if`` and the dependencies first: they merge their parts with the rest of ``d``, ``not`` included,
        # and convert each merge here again; ``not`` may leave a mark that only ``typed`` reads)
        if "if" in d:
            return self.if_then_else(d, ptr, nest)
        if "dependentRequired" in d or "dependentSchemas" in d:
            return self.dependencies(d, ptr, nest)
        if "not" in d:
            d = self.not_keyword(d, ptr)
            if d is False:
                return None
            if d.keys() & {"anyOf", "oneOf", "if", "dependentRequired", "dependentSchemas", "not"}:
                return self.flat(d, ptr, nest, origin)  # (a negation written as a union, or merged in)
        return self.typed(d, ptr, nest)

    #: most ``dependentRequired`` / ``dependentSchemas`` entries that do not always hold in one object (the
    #: object is written once per subset of their names: 2**n times)
    MAX_DEPENDENCIES = 3

    def dependencies(self, d: dict, ptr: str, nest: int) -> _R | None:
        """``dependentRequired`` {t: names} and ``dependentSchemas`` {t: S}: the union, over the subsets P of
        the entries' names t, of the schema with the names of P required and their S (``{"required":
        names}``) merged in, and the others declared ``false`` (absent; with ``additionalProperties: true``
        where the schema declared no names and said nothing about other keys, which would have closed it).
        Entries that always hold (S true, names all required, t never present) are dropped; at most
        :data:`MAX_DEPENDENCIES` others, whose S must merge with the schema."""
        rest = {k: v for k, v in d.items() if k not in ("dependentRequired", "dependentSchemas")}
        props = self.schema_map(d, "properties", ptr)
        req_list = self.string_list(d, "required", ptr)
        required = set(req_list)
        declares = bool(props or required or d.get("patternProperties"))
        extra_kw = next((k for k in ("additionalProperties", "unevaluatedProperties") if k in d), None)
        closed = ((extra_kw is not None and self.schema_value(d[extra_kw], extra_kw, ptr) is False)
                  or (extra_kw is None and declares and not self.open_objects)) and not d.get("patternProperties")
        entries: list[tuple[str, Any, str]] = []  # (name, schema, pointer)
        # names an entry may add to the object (conservatively: any string in the entries' values)
        named = json.dumps([list(v.values()) for v in (d.get("dependentRequired"), d.get("dependentSchemas"))
                            if isinstance(v, dict)], ensure_ascii=False)
        for kw in ("dependentRequired", "dependentSchemas"):
            deps = d.get(kw, {})
            if not isinstance(deps, dict):
                raise self.invalid(kw, ptr, "must be an object")
            for name, dep in deps.items():
                dptr = _ptr_join(ptr, kw, name)
                if kw == "dependentRequired":
                    if not isinstance(dep, list) or not all(isinstance(x, str) for x in dep):
                        raise self.invalid(kw, ptr, "values must be arrays of strings")
                    if set(dep) <= required:
                        continue
                    dep = {"required": dep}
                else:
                    flat, _ = self.flatten(self.schema_value(dep, kw, ptr), dptr)
                    if flat is True or flat == {}:
                        continue
                if closed and name not in required and json.dumps(name, ensure_ascii=False) not in named and (
                        name not in props or self.flatten(props[name], _ptr_join(ptr, "properties", name))[0] is False):
                    continue  # the name is never present
                entries.append((name, dep, dptr))
        if not entries:
            return self.flat(rest, ptr, nest, rest)
        if len(entries) > self.MAX_DEPENDENCIES:
            raise self.refuse(next(k for k in ("dependentSchemas", "dependentRequired") if k in d), ptr,
                              f"more than {self.MAX_DEPENDENCIES} dependentRequired / dependentSchemas entries that "
                              f"do not always hold are not supported")
        names = list(dict.fromkeys(n for n, _, _ in entries))
        keep_open = not declares and extra_kw is None and not self.open_objects
        alts = []
        for bits in range(1 << len(names)):
            self.tick()
            on = [n for i, n in enumerate(names) if bits >> i & 1]
            base = dict(rest)
            off = {n: False for n in names if n not in on}
            if props or off:
                base["properties"] = {**props, **off}
            if required or on:
                base["required"] = list(dict.fromkeys([*req_list, *on]))
            parts = [(base, ptr)] + [(dep, dptr) for n, dep, dptr in entries if n in on]
            alts.append(self.node_and(parts, ptr, nest, keep_open))
        return self.rx.alt(alts)

    def if_then_else(self, d: dict, ptr: str, nest: int) -> _R | None:
        """``if`` I ``then`` T ``else`` E: the union of (the rest, I, T) and (the rest, not I, E), each merged
        as an ``allOf`` (a missing T or E: true); not I as :meth:`negation` writes it."""
        rest = {k: v for k, v in d.items() if k not in ("if", "then", "else")}
        if d.keys() & {"unevaluatedProperties", "unevaluatedItems"}:
            raise self.refuse("if", ptr, "if next to unevaluatedProperties / unevaluatedItems (which see its "
                                         "annotations) is not supported")
        if "then" not in d and "else" not in d:
            return self.flat(rest, ptr, nest, rest)  # (``if`` alone: no effect)
        i_ptr = _ptr_join(ptr, "if")
        cond = self.schema_value(d["if"], "if", ptr)
        flat_if, _ = self.flatten(cond, i_ptr)
        neg = self.negation(flat_if, "if", ptr)
        alts = []
        for branch, c in (("then", cond), ("else", neg)):
            if c is False:
                continue
            parts = [(rest, ptr), (c, i_ptr)]
            if branch in d:
                parts.append((self.schema_value(d[branch], branch, ptr), _ptr_join(ptr, branch)))
            alts.append(self.node_and(parts, ptr, nest))
        return self.rx.alt(alts)

    #: what ``not {kw: v}`` leaves: (the type kw constrains, the other side's keyword, its value less v)
    _NEGATED_BOUNDS = {"minimum": ("number", "exclusiveMaximum", 0), "exclusiveMinimum": ("number", "maximum", 0),
                       "maximum": ("number", "exclusiveMinimum", 0), "exclusiveMaximum": ("number", "minimum", 0),
                       "minLength": ("string", "maxLength", -1), "maxLength": ("string", "minLength", 1),
                       "minItems": ("array", "maxItems", -1), "maxItems": ("array", "minItems", 1)}

    def negation(self, sub: Any, kw: str, ptr: str, fractions: bool = False) -> Any:
        """A schema for the values that fail the flattened schema ``sub``, where one can be written: for a
        boolean, for ``type`` alone (``integer`` removed from the numbers only with ``fractions``: the result
        then carries :data:`_NOT_INTEGER`, which only ``typed`` reads, so the caller must not flatten it
        again), for one bound alone
        (``{"minimum": 5}`` fails on the numbers below 5: ``{"type": "number", "exclusiveMaximum": 5}``;
        ``minLength`` / ``maxLength`` / ``minItems`` / ``maxItems`` likewise), for one ``required`` name (the
        objects without it; several names: a union over which one is missing, up to
        :attr:`MAX_NEGATED_ONE_OF`) and for ``properties`` of one name, with or without ``required`` (the objects
        where it fails its schema, or is absent when required: the discriminator of ``if`` /
        ``then``; a ``not`` of that property's schema is left to the conversion of the merged branch, which
        is exact where the property lists its values with ``enum``, and for string properties through
        :data:`_NOT_STRING`), and for string keywords (:meth:`string_negation`). Refuses (``kw``) the others."""
        if sub is False:
            return True
        if sub is True or sub == {}:
            return False
        if isinstance(sub, dict) and len(sub) == 1:
            (k, v), = sub.items()
            if k == "type":
                removed = self.norm_types(v, ptr)
                if "number" in removed:
                    removed = removed | {"integer"}
                elif "integer" in removed and not fractions:
                    raise self.refuse(kw, ptr, f"{kw}: the numbers that are not integers cannot be written here")
                left = [t for t in _TYPE_NAMES if t not in removed]
                if not left:
                    return False
                return {"type": left, _NOT_INTEGER: True} if "integer" in removed and "number" in left else {"type": left}
            if k == "required":  # the objects without one of the names
                names = list(dict.fromkeys(self.string_list(sub, "required", ptr)))
                if not names:
                    return False
                if len(names) == 1:
                    return {"type": "object", "properties": {names[0]: False}}
                if len(names) <= self.MAX_NEGATED_ONE_OF:
                    return {"type": "object", "anyOf": [{"properties": {n: False}} for n in names]}
            if k in self._NEGATED_BOUNDS:
                typ, other, delta = self._NEGATED_BOUNDS[k]
                v = self.number(sub, k, ptr) if typ == "number" else self.nonneg_int(sub, k, ptr)
                if typ != "number" and v + delta < 0:
                    return False  # (minLength 0: every string passes)
                return {"type": typ, other: v + delta}
        if isinstance(sub, dict) and "properties" in sub and sub.keys() <= {"properties", "required"}:
            props = self.schema_map(sub, "properties", ptr)
            req = set(self.string_list(sub, "required", ptr)) if "required" in sub else set()
            if len(props) == 1 and req <= props.keys():
                # one property P: the objects where it is present and fails P's schema (kept as a "not" there:
                # exact where that property's own schema lists its values, refused elsewhere), or absent
                # when it is required
                (name, s), = props.items()
                fails = {"type": "object", "required": [name], "properties": {name: {"not": s}}}
                return {"anyOf": [{"type": "object", "properties": {name: False}}, fails]} if req else fails
        if isinstance(sub, dict) and sub.keys() <= _STRING_NEGATABLE and sub.keys() - {"type"}:
            neg = self.string_negation(sub, ptr)
            if neg is not None:
                return neg
        raise self.refuse(kw, ptr, f"{kw}: only a boolean, 'type' alone, one bound alone, one 'required' name, "
                                   f"string keywords (pattern, format, lengths, string enum / const) "
                                   f"or one property's schema can be negated here")

    def string_negation(self, sub: dict, ptr: str) -> dict | None:
        """The values failing ``sub``, a schema of string keywords (:data:`_STRING_NEGATABLE`), or None when
        ``sub`` is not one (a ``type`` other than ``"string"``, non-string ``enum`` / ``const`` values): the
        strings it does not match (:data:`_NOT_STRING`, written by :meth:`combined_string`; it constrains
        strings only), and the values of the other types where ``sub`` rejects them (a ``type`` or ``enum`` /
        ``const``; ``pattern``, ``format`` and the lengths hold for every non-string)."""
        if "type" in sub and self.norm_types(sub["type"], ptr) != {"string"}:
            return None
        values = [sub["const"]] if "const" in sub else sub.get("enum")
        if values is not None and (not isinstance(values, list) or not all(isinstance(v, str) for v in values)):
            return None
        # (no anyOf: the internal key stays at the top of the dicts it is merged into, where enum reads it)
        if "type" in sub or values is not None:
            return {"type": list(_TYPE_NAMES), _NOT_STRING: ((sub, ptr),)}
        return {"type": "string", _NOT_STRING: ((sub, ptr),)}

    def not_keyword(self, d: dict, ptr: str) -> Any:
        """``d`` without its ``not``: ``not: false`` drops out, ``not: true`` / ``{}`` admits nothing, and the
        forms :meth:`negation` writes are merged in (types alone: ``integer`` removed from the numbers leaves
        the non-integer ones, :data:`_FRACTIONAL`, not next to numeric bounds; one bound alone, ``required``,
        one property); any other ``not`` is refused."""
        not_ptr = _ptr_join(ptr, "not")
        sub, _ = self.flatten(self.schema_value(d["not"], "not", ptr), not_ptr)
        rest = {k: v for k, v in d.items() if k != "not"}
        if sub is False:
            return rest
        neg = self.negation(sub, "not", not_ptr, fractions=True)
        out = False if neg is False else self.merge(rest, neg, ptr)
        if out is False:
            return False
        if out.pop(_NOT_INTEGER, False):
            types = [t for t in self.norm_types(out["type"], ptr) if t != "integer"]  # (no integer at all)
            if not types:
                return False
            out["type"] = [t for t in _TYPE_NAMES if t in types]
            if "number" in types:
                if rest.keys() & _NUMERIC_KW:
                    raise self.refuse("not", ptr, "'not: {type: integer}' on numbers with bounds or multipleOf "
                                                  "is not supported")
                out[_NOT_INTEGER] = True
        if (not self.open_objects and neg.keys() - {"type", _NOT_INTEGER} and not rest.keys() & _OBJECT_NAMING
                and not out.keys() & {"additionalProperties", "unevaluatedProperties"}):
            out["additionalProperties"] = True  # (names "absent" here would close an open object: docstring)
        return out

    # ---- enum / const --------------------------------------------------------------------------

    def validator(self):
        if self._validator is None:
            try:
                from jsonschema import Draft202012Validator
            except ImportError:  # pragma: no cover - jsonschema ships with vLLM
                raise UnsupportedSchemaError("enum/const next to other keywords needs the jsonschema package",
                                             keyword="enum") from None
            # the draft's own format checker (FormatChecker() also holds draft 3's "time", without offset);
            # its pattern keywords search with a time bound (jsonschema's own use Python's re, which a pattern
            # with nested repetitions keeps busy for hours on a 40-character value)
            cls = _bounded_pattern_validator(Draft202012Validator, self.search_bounded)
            self._validator = cls(self.root, format_checker=Draft202012Validator.FORMAT_CHECKER)
        return self._validator

    def enum(self, d: dict, ptr: str, origin: Any) -> _R | None:
        """The ``const`` / ``enum`` values (compact JSON) that are valid against ``origin``."""
        if "const" in d:
            values, kw = [d["const"]], "const"
        else:
            values, kw = d["enum"], "enum"
            if not isinstance(values, list):
                raise self.invalid("enum", ptr, f"must be an array, got {type(values).__name__}")
        validator = None
        if not (isinstance(origin, dict) and _own_keywords(origin).keys() <= {"enum", "const"}):
            validator = self.validator().evolve(schema=origin)
        # the internal negations of ``d`` (a merge's result; ``origin`` may not hold them)
        not_strings = [self.validator().evolve(schema=sub) for sub, _ in d.get(_NOT_STRING, ())]
        alts = []
        for v in values:
            self.tick()
            text = _compact(v)
            if text is None or (validator is not None and not self.valid(validator, v, kw, ptr)):
                continue
            if isinstance(v, str) and any(self.valid(n, v, kw, ptr) for n in not_strings):
                continue
            if d.get(_NOT_INTEGER) and _is_number(v) and float(v).is_integer():
                continue
            alts.append(self.rx.lit(text))
        return self.rx.alt(alts)

    def valid(self, validator, value: Any, kw: str, ptr: str) -> bool:
        try:
            return bool(validator.is_valid(value))
        except RecursionError:
            raise self.refuse(kw, ptr, "checking the values against the schema recursed too deeply",
                              regular=False) from None
        except Exception as e:  # noqa: BLE001 - jsonschema / referencing errors of many kinds
            raise self.refuse(kw, ptr, f"cannot check the values against the rest of the schema: {e}") from None

    # ---- anyOf / oneOf -------------------------------------------------------------------------

    def combinator(self, d: dict, ptr: str, nest: int, origin: Any) -> _R | None:
        kw = "anyOf" if "anyOf" in d else "oneOf"  # with both: anyOf first, oneOf inside each alternative
        rest = {k: v for k, v in d.items() if k != kw}
        for uk in ("unevaluatedProperties", "unevaluatedItems"):
            if rest.get(uk, True) is not True:
                # it sees what *every* matching alternative evaluated: distributing it into each
                # alternative would refuse valid instances that two alternatives match together
                raise self.refuse(uk, ptr, f"{uk} next to {kw} is not supported")
        results, merged = [], []
        for i, sub in enumerate(self.schema_list(d, kw, ptr)):
            sub_ptr = _ptr_join(ptr, kw, i)
            flat, refs = self.flatten(sub, sub_ptr)
            with self.expanding(refs):
                m = self.merge_children(rest, [(flat, sub_ptr)], sub_ptr) if rest else flat
                # enum candidates are checked against the alternative itself (m is rest ∧ alternative,
                # exactly or smaller), so an empty result means an empty alternative
                r = self.flat(m, sub_ptr, nest, m if isinstance(m, dict) else origin)
            results.append(r)
            merged.append(m)  # all of them: a regex may be empty where the alternative is not
        if kw == "oneOf" and not all(self.disjoint(merged[i], merged[j], 0)
                                     for i in range(len(merged)) for j in range(i + 1, len(merged))):
            alone = self.one_of_by_types(merged)
            if alone is None:
                return self.one_of_by_negation(d, rest, ptr, nest)
            results = []
            for i, (m, names) in enumerate(zip(merged, alone)):
                if m is False or not names:
                    continue
                sub_ptr = _ptr_join(ptr, kw, i)
                m = {"type": names} if m is True else self.merge(m, {"type": names}, sub_ptr)
                if m is not False:
                    results.append(self.flat(m, sub_ptr, nest, m))
        return self.rx.alt(results)

    def one_of_by_types(self, merged: list) -> list | None:
        """For a ``oneOf`` whose flattened alternatives ``merged`` may overlap: per alternative, the type names
        of the values that it alone can hold, or None when that cannot be told. Type by type (the atoms
        null, boolean, object, array, string, integer, non-integer number): a type that two alternatives
        admit without a keyword for it (``{"properties": ...}`` says nothing about strings: a string is
        valid against both) holds no valid value; one such alternative holds it alone where no other
        alternative admits the type; else the alternatives that constrain the type must be disjoint on it
        (:meth:`disjoint_for_type`: numeric ranges, an object's required property)."""
        keep: list[set] = [set() for _ in merged]
        for t in _ATOMS:
            free, bound = [], []
            for i, m in enumerate(merged):
                if m is True:
                    free.append(i)
                elif m is not False and t in self.type_atoms(m):
                    (bound if _constrains_type(m, t) else free).append(i)
            if len(free) >= 2:
                continue  # every value of the type is valid against two alternatives
            if free:
                if bound:
                    return None
                keep[free[0]].add(t)
                continue
            if any(not self.disjoint_for_type(t, merged[a], merged[b], 0)
                   for x, a in enumerate(bound) for b in bound[x + 1:]):
                return None
            for i in bound:
                keep[i].add(t)
        out = []
        for k in keep:
            names = [n for n in ("null", "boolean", "object", "array", "string") if n in k]
            if {"integer", "fraction"} <= k:
                names.append("number")
            elif "integer" in k:
                names.append("integer")
            elif "fraction" in k:
                return None  # (the non-integer numbers alone: not written here)
            out.append(names)
        return out

    #: most alternatives of a ``oneOf`` written as "this one and not the others" (:meth:`one_of_by_negation`)
    MAX_NEGATED_ONE_OF = 4

    def one_of_by_negation(self, d: dict, rest: dict, ptr: str, nest: int) -> _R | None:
        """A ``oneOf`` whose alternatives may overlap: the union over i of (the rest, alternative i, and not
        each other alternative), not written by :meth:`negation`; refused as ``oneOf`` where one cannot be
        written, or the parts do not merge."""
        why = ("alternatives are not provably disjoint (e.g. different types, const values or numeric ranges) "
               "and not all of them can be negated; use anyOf if overlap is acceptable")
        subs = [(sub, _ptr_join(ptr, "oneOf", i)) for i, sub in enumerate(self.schema_list(d, "oneOf", ptr))]
        if len(subs) > self.MAX_NEGATED_ONE_OF:
            raise self.refuse("oneOf", ptr, why)
        try:
            negs = [self.negation(self.flatten(sub, at)[0], "oneOf", at) for sub, at in subs]
        except UnsupportedSchemaError:
            raise self.refuse("oneOf", ptr, why) from None
        alts = []
        for i, (sub, at) in enumerate(subs):
            others = [(negs[j], subs[j][1]) for j in range(len(subs)) if j != i]
            if any(n is False for n, _ in others):
                continue  # another alternative always holds: this one never holds alone
            try:
                alts.append(self.node_and([(rest, ptr), (sub, at), *others], at, nest))
            except UnsupportedSchemaError as e:
                if e.keyword not in ("allOf", "not"):
                    raise
                raise self.refuse("oneOf", ptr, f"{why} ({e})") from None
        return self.rx.alt(alts)

    def disjoint(self, a: Any, b: Any, depth: int) -> bool:
        """True only when no instance is valid against both flattened schemas ``a`` and ``b``."""
        self.tick()
        if a is False or b is False:
            return True
        if a is True or b is True or depth > 8:
            return False
        for x, y in ((a, b), (b, a)):
            vals = _finite_values(x)
            if vals is not None:
                try:
                    vx = self.validator().evolve(schema=x)
                    vy = self.validator().evolve(schema=y)
                    return not any(vx.is_valid(v) and vy.is_valid(v) for v in vals)
                except Exception:  # noqa: BLE001
                    return False
        common = self.type_atoms(a) & self.type_atoms(b)
        return all(self.disjoint_for_type(t, a, b, depth) for t in common)

    def type_atoms(self, d: dict) -> set[str]:
        if "anyOf" in d or "oneOf" in d:
            subs = d.get("anyOf") or d.get("oneOf")
            out: set[str] = set()
            for s in subs if isinstance(subs, list) else []:
                try:
                    flat, _ = self.flatten(s, "")
                except (UnsupportedSchemaError, InvalidSchemaError):
                    return set(_ATOMS)
                out |= set(_ATOMS) if flat is True else set() if flat is False else self.type_atoms(flat)
            if "type" in d:
                out &= _atoms(self.norm_types(d["type"], ""))
            return out
        if "type" not in d:
            return set(_ATOMS)
        return _atoms(self.norm_types(d["type"], ""))

    def disjoint_for_type(self, t: str, a: dict, b: dict, depth: int) -> bool:
        if t in ("integer", "fraction"):
            return _ranges_disjoint(_numeric_range(a), _numeric_range(b))
        if t == "string":
            return self.strings_disjoint(a, b)
        if t != "object":
            return False
        for x, y in ((a, b), (b, a)):
            for name in x.get("required", []) if isinstance(x.get("required"), list) else []:
                sx, sy = _property_schema(x, name), _property_schema(y, name)
                try:
                    fx, _ = self.flatten(sx, "")
                    fy, _ = self.flatten(sy, "")
                except (UnsupportedSchemaError, InvalidSchemaError):
                    continue
                if self.disjoint(fx, fy, depth + 1):  # x requires the property, y cannot give it x's values
                    return True
        return False

    # ---- types -----------------------------------------------------------------------------------

    def typed(self, d: dict, ptr: str, nest: int) -> _R | None:
        types = self.norm_types(d["type"], ptr) if "type" in d else set(_TYPE_NAMES)
        if "number" in types:
            types.discard("integer")
        if not (d.keys() - {"type"}) and types >= {"null", "boolean", "object", "array", "string", "number"}:
            return self.any_value(nest)
        parts = []
        for t in _TYPE_ORDER:
            if t in types:
                parts.append(getattr(self, "type_" + t)(d, ptr, nest))
        return self.rx.alt(parts)

    def type_null(self, d: dict, ptr: str, nest: int) -> _R:
        return self.rx.lit("null")

    def type_boolean(self, d: dict, ptr: str, nest: int) -> _R:
        return self.rx.make("(true|false)", True)

    # ---- numbers -------------------------------------------------------------------------------

    def type_integer(self, d: dict, ptr: str, nest: int) -> _R | None:
        last = self.multiple_of(d, ptr)
        lo, hi = self.integer_bounds(d, ptr)
        if lo is None and hi is None and last == _ALL_DIGITS:
            return self.rx.make(_INTEGER, False)
        return self.int_range(lo, hi, last)

    def integer_bounds(self, d: dict, ptr: str) -> tuple[int | None, int | None]:
        lo = hi = None
        for kw in ("minimum", "exclusiveMinimum"):
            v = self.number(d, kw, ptr)
            if v is not None:
                f = Fraction(v)
                b = math.ceil(f) if kw == "minimum" else math.floor(f) + 1
                lo = b if lo is None else max(lo, b)
        for kw in ("maximum", "exclusiveMaximum"):
            v = self.number(d, kw, ptr)
            if v is not None:
                f = Fraction(v)
                b = math.floor(f) if kw == "maximum" else math.ceil(f) - 1
                hi = b if hi is None else min(hi, b)
        return lo, hi

    def multiple_of(self, d: dict, ptr: str) -> frozenset:
        """Allowed last digits for ``multipleOf`` (all digits when absent)."""
        if "multipleOf" not in d:
            return _ALL_DIGITS
        m = d["multipleOf"]
        if not _is_number(m) or not math.isfinite(m) or m <= 0:
            raise self.invalid("multipleOf", ptr, f"must be a number > 0, got {m!r}")
        if (isinstance(m, int) or m.is_integer()) and int(m) in _LAST_DIGITS:
            return _LAST_DIGITS[int(m)]
        raise self.refuse("multipleOf", ptr, f"multipleOf {m!r} is not supported (only 1, 2, 5 and 10)")

    def int_range(self, lo: int | None, hi: int | None, last: frozenset = _ALL_DIGITS) -> _R | None:
        """Canonical decimal integers in [lo, hi] (None: unbounded) with last digit in ``last``; one flat
        alternation (no nested groups, whatever the number of digits)."""
        if lo is not None and hi is not None and lo > hi:
            return None
        texts = []
        if lo is None or lo < 0:  # negative numbers: "-" + magnitude in [m_lo, m_hi]
            m_lo = 1 if hi is None or hi >= 0 else -hi
            texts += ["-" + t for t in _natural_range(m_lo, None if lo is None else -lo, last)]
        if hi is None or hi >= 0:
            texts += _natural_range(max(lo or 0, 0), hi, last)
        return self.alts(texts)

    def alts(self, texts: list[str]) -> _R | None:
        self.tick()
        if not texts:
            return None
        if len(texts) == 1:
            return self.rx.make(texts[0], bool(re.fullmatch(r"\[[^\]]*\]|[0-9]", texts[0])))
        return self.rx.make("(" + "|".join(texts) + ")", True, tuple(texts))

    def type_number(self, d: dict, ptr: str, nest: int) -> _R | None:
        if d.get(_NOT_INTEGER):
            return self.rx.make(_FRACTIONAL, False)
        if "multipleOf" in d:
            return self.type_integer(d, ptr, nest)
        if not (d.keys() & _NUMERIC_KW):
            return self.rx.make(_NUMBER, False)
        (lo, lo_x), (hi, hi_x) = self.number_bounds(d, ptr)
        ints = self.int_range(None if lo is None else lo + lo_x, None if hi is None else hi - hi_x)
        # non-integer numbers: the cell (c, c+1) of the integer part; cells c in [lo, hi - 1]
        c_lo, c_hi = lo, None if hi is None else hi - 1
        if c_lo is not None and c_hi is not None and c_lo > c_hi:
            return ints
        frac_any = self.rx.make(r"\.[0-9]+", False)
        frac_edge = self.rx.make(r"\.[0-9]{0,8}[1-9]", False)
        spans = []  # (first cell, last cell, fraction)
        inner_lo = c_lo if c_lo is None or not lo_x else c_lo + 1
        inner_hi = c_hi if c_hi is None or not hi_x else c_hi - 1
        if lo_x:
            spans.append((c_lo, c_lo, frac_edge))
        if hi_x and not (lo_x and c_hi == c_lo):
            spans.append((c_hi, c_hi, frac_edge))
        if inner_lo is None or inner_hi is None or inner_lo <= inner_hi:
            spans.append((inner_lo, inner_hi, frac_any))
        parts = [ints]
        for a, b, frac in spans:
            cells = self.cells(a, b, frac)
            if frac is frac_any and ints is not None and cells and cells[0] == ints:
                parts[0] = self.rx.cat(ints, self.rx.opt(frac))  # same integer parts: one branch
            else:
                parts.extend(self.rx.cat(c, frac) for c in cells)
        return self.rx.alt(parts)

    def cells(self, a: int | None, b: int | None, frac: _R) -> list[_R | None]:
        """Numbers with a fraction whose value lies in the cells (c, c+1), c in [a, b] (None: unbounded)."""
        texts = []
        if b is None or b >= 0:  # positive cells: integer part c
            texts += _natural_range(max(a, 0) if a is not None else 0, b)
        if a is None or a <= -1:  # negative cells: "-" integer part -c-1
            m_lo = 0 if b is None or b >= -1 else -b - 1
            texts += ["-" + t for t in _natural_range(m_lo, None if a is None else -a - 1)]
        return [self.alts(texts)] if texts else []

    def number_bounds(self, d: dict, ptr: str):
        """((lo, lo_exclusive), (hi, hi_exclusive)) as integers; refuses non-integer or too large bounds."""
        def bound(incl_kw: str, excl_kw: str, tighter):
            best = None
            for kw, excl in ((incl_kw, False), (excl_kw, True)):
                v = self.number(d, kw, ptr)
                if v is None:
                    continue
                if isinstance(v, float) and not v.is_integer():
                    raise self.refuse(kw, ptr, f"a non-integer bound ({v!r}) on a number is not supported")
                v = int(v)
                limit = _MAX_EXCLUSIVE_BOUND if excl else _MAX_SAFE_INT
                if abs(v) > limit:
                    raise self.refuse(kw, ptr, f"a number bound beyond ±{limit} is not supported")
                if best is None or tighter((v, excl), best):
                    best = (v, excl)
            return best or (None, False)

        lo = bound("minimum", "exclusiveMinimum", lambda n, o: n[0] > o[0] or (n[0] == o[0] and n[1]))
        hi = bound("maximum", "exclusiveMaximum", lambda n, o: n[0] < o[0] or (n[0] == o[0] and n[1]))
        return lo, hi

    # ---- strings -------------------------------------------------------------------------------

    def type_string(self, d: dict, ptr: str, nest: int) -> _R | None:
        lo = self.nonneg_int(d, "minLength", ptr, 0)
        hi = self.nonneg_int(d, "maxLength", ptr)
        if hi is not None and hi < lo:
            return None
        if d.get(_NOT_STRING) or isinstance(d.get("pattern"), tuple) or ("format" in d and "pattern" in d):
            return self.combined_string(d, ptr, lo, hi)
        if "format" in d or "pattern" in d:
            kw = "format" if "format" in d else "pattern"
            content, (c_lo, c_hi) = self.format(d, ptr) if kw == "format" else self.pattern(d, ptr, lo, hi)
            if content is None:
                return None
            if c_lo < lo or (hi is not None and (c_hi is None or c_hi > hi)):
                return self.combined_string(d, ptr, lo, hi)  # (the lengths do not follow from the pattern)
            return self.rx.cat(self.rx.lit('"'), content, self.rx.lit('"'))
        if lo == 0 and hi is None:
            return self.string
        return self.rx.cat(self.rx.lit('"'), self.rx.rep(self.string_char, lo, hi), self.rx.lit('"'))

    #: budget of a combined string constraint's regex (:func:`.regex_algebra.combine`, positions)
    MAX_COMBINED_POSITIONS = 3_000

    def combined_string(self, d: dict, ptr: str, lo: int, hi: int | None) -> _R | None:
        """A string whose keywords combine (``pattern`` with lengths it does not imply, with ``format`` or with
        another ``pattern``; a ``not`` of string keywords): the strings of ``lo`` to ``hi`` characters that
        every pattern and format matches and no :data:`_NOT_STRING` schema does, as one regex over decoded
        characters (:func:`.regex_algebra.combine`: DFA intersection and complement, back by state
        elimination), then in its JSON-escaped spelling (:meth:`emit_pattern`: one spelling per character, and
        negated classes without the characters JSON escapes: the pattern rule). Refused past
        :attr:`MAX_COMBINED_POSITIONS` positions (before and after the spelling)."""
        kw = "pattern" if "pattern" in d else "format" if "format" in d else "not"
        pos = self.string_trees(d, ptr)
        neg = []
        for sub, sub_ptr in d.get(_NOT_STRING, ()):
            t = self.string_language(sub, sub_ptr)
            if t is not None:  # (a schema no string matches: every string fails it)
                neg.append(t)
        tree = self.combine_strings(kw, ptr, pos, neg, lo, hi)
        if tree is None:
            return None
        try:
            content = self.emit_pattern(tree)
            n_pos = estimate_positions(content.tree) if content.tree is not None else 0
        except InputTooLargeError as e:
            n_pos, content = None, e
        if n_pos is None or n_pos > self.MAX_COMBINED_POSITIONS:
            raise self.refuse(kw, ptr, f"{kw} combined with the other string keywords is too large to convert "
                                       f"({content if n_pos is None else f'{n_pos} positions'})")
        return self.rx.cat(self.rx.lit('"'), content, self.rx.lit('"'))

    def string_language(self, sub: dict, ptr: str) -> tuple | None:
        """Tree (decoded characters) of the strings a schema of string keywords matches (a superset where
        the meanings of a pattern differ: :meth:`string_trees`, ``negated``); None: none."""
        trees = self.string_trees(sub, ptr, negated=True)
        values = [sub["const"]] if "const" in sub else sub.get("enum")
        if values is not None:
            if not values:
                return None
            trees.append(_strings_tree(values))
        lo = self.nonneg_int(sub, "minLength", ptr, 0)
        hi = self.nonneg_int(sub, "maxLength", ptr)
        if hi is not None and hi < lo:
            return None
        return self.combine_strings("not", ptr, trees, [], lo, hi)

    def combine_strings(self, kw: str, ptr: str, pos: list, neg: list, lo: int, hi: int | None) -> tuple | None:
        """:func:`.regex_algebra.combine` within the converter's budgets; past the size budget refused (``kw``),
        past the deadline :class:`CompileBudgetError`."""
        deadline = self.deadline if self.deadline is not None else time.perf_counter() + 5.0
        try:
            return combine_languages(pos, neg, lo, hi, max_positions=self.MAX_COMBINED_POSITIONS, deadline=deadline)
        except CompileBudgetError as e:
            if self.deadline is not None and time.perf_counter() > self.deadline:
                raise
            raise self.refuse(kw, ptr, f"{kw} combined with the other string keywords is too large to convert "
                                       f"({e})") from None

    def strings_disjoint(self, a: dict, b: dict) -> bool:
        """True only when no string is valid against both flattened schemas: the intersection of supersets of
        their string languages is empty (:func:`.regex_algebra.combine`; patterns widened as under ``not``,
        lengths and string ``enum`` / ``const`` values exact; a pattern that cannot be widened, a
        ``format`` and the other keywords read as any string)."""
        trees, lo, hi = [], 0, None
        try:
            for d in (a, b):
                lo = max(lo, self.nonneg_int(d, "minLength", "", 0))
                h = self.nonneg_int(d, "maxLength", "")
                hi = h if hi is None else hi if h is None else min(hi, h)
                for pat in _patterns(d):
                    try:
                        trees.extend(self.string_trees({"pattern": pat}, "", negated=True))
                    except UnsupportedSchemaError:
                        pass  # (any string)
                values = [d["const"]] if "const" in d else d.get("enum")
                if isinstance(values, list):
                    strings = [v for v in values if isinstance(v, str)]
                    if not strings:
                        return True
                    trees.append(_strings_tree(strings))
            if hi is not None and hi < lo:
                return True
            return self.combine_strings("oneOf", "", trees, [], lo, hi) is None
        except (FstBackendError, ValueError):
            return False

    def string_trees(self, d: dict, ptr: str, negated: bool = False) -> list:
        """Trees (decoded characters, full match) of the ``pattern`` values (a search: any text on a side
        without an anchor) and the ``format`` of ``d``. ``negated`` (the schema of a ``not``): the trees must
        hold every string the keyword matches, in ECMA-262's meaning and in Python's (``jsonschema``'s): a
        ``$`` also before a final newline (Python), and the constructs whose meanings differ, or that the
        translation narrows (``\\d \\w \\s`` and their negations, ``format``: a subset), are refused."""
        out = []
        for pat in _patterns(d):
            if not isinstance(pat, str):
                raise self.invalid("pattern", ptr, f"must be a string, got {pat!r}")
            if negated and re.search(r"(?<!\\)(\\\\)*\\[dswDSW]", pat):
                raise self.refuse("not", ptr, f"not of a pattern with \\d, \\w or \\s ({pat!r}): their ECMA-262 and "
                                              f"Python meanings differ")
            parts = []
            for text, left, right in _anchored_alternatives(self.prescan_pattern(pat, ptr)):
                t = self.parse_pattern(text, pat, ptr)
                anywhere = rep_node(ANY_CHAR, 0, None)
                end = _EPS_TREE if not negated else rep_node(literal_node("\n"), 0, 1)
                parts.append(cat_node([anywhere if not left else _EPS_TREE, t, anywhere if not right else end]))
            out.append(alt_node(parts))
        if "format" in d and negated:
            raise self.refuse("not", ptr, "not of a format is not supported (its regex is a subset of the format)")
        if "format" in d:
            self.format(d, ptr)  # (its checks)
            tree = parse_regex(_FORMATS[d["format"]], max_positions=10**6)
            if _matches_raw_chars(tree):
                raise self.refuse("format", ptr, f"format {d['format']!r} together with other string keywords is not "
                                                 f"supported")
            out.append(tree)
        return out

    def format(self, d: dict, ptr: str) -> tuple[_R, tuple[int, int | None]]:
        fmt = d["format"]
        if not isinstance(fmt, str):
            raise self.invalid("format", ptr, f"must be a string, got {fmt!r}")
        if fmt not in _FORMATS:
            raise self.refuse("format", ptr, f"format {fmt!r} is not supported (supported: "
                                             f"{', '.join(sorted(_FORMATS))})")
        text = _FORMATS[fmt]
        if fmt not in _FORMAT_LENGTHS:
            _FORMAT_LENGTHS[fmt] = _len_bounds(parse_regex(text))
        return self.rx.make(text, False), _FORMAT_LENGTHS[fmt]

    def pattern(self, d: dict, ptr: str, len_lo: int = 0, len_hi: int | None = None
                ) -> tuple[_R | None, tuple[int, int | None]]:
        """(regex of the JSON-escaped string content, (min, max) length of its matches); the string's own
        ``minLength`` / ``maxLength`` (``len_lo`` / ``len_hi``) are applied where the pattern is one repeated
        character class, anchored at both ends (content None: no string satisfies both)."""
        pat = d["pattern"]
        if not isinstance(pat, str):
            raise self.invalid("pattern", ptr, f"must be a string, got {pat!r}")
        body = self.prescan_pattern(pat, ptr)
        # ECMA-262: each top-level alternative has its own anchors (``^a$|^b$``, ``^(a$)|(^b)``)
        alts = _anchored_alternatives(body)
        if len(alts) > 1:
            parts, los, his = [], [], []
            for text, left, right in alts:
                content, (lo, hi) = self.pattern_part(text, left, right, pat, ptr)
                parts.append(content)
                los.append(lo)
                his.append(hi)
            return self.rx.alt(parts), (min(los), None if None in his else max(his))
        text, left, right = alts[0]
        tree = self.parse_pattern(text, pat, ptr)
        if left and right and tree[0] == "rep" and tree[1][0] == "sym":
            # one repeated character class (``^[^,]+$``): the length bounds go into its repetition
            _, sym, m, n = tree
            lo = max(m, len_lo)
            his = [b for b in (n, len_hi) if b is not None]
            hi = min(his) if his else None
            if hi is not None and lo > hi:
                return None, (0, 0)
            return self.rx.rep(self.emit_pattern(sym), lo, hi), (lo, hi)
        return self.pattern_part(text, left, right, pat, ptr, tree)

    def parse_pattern(self, text: str, pat: str, ptr: str):
        try:
            return parse_regex(text, deadline=self.deadline, limits=InputLimits(max_regex_chars=self.rx.max_chars))
        except (RegexError, InputTooLargeError) as e:
            if isinstance(e, CompileBudgetError) or isinstance(e, InputTooLargeError):
                raise
            raise self.refuse("pattern", ptr, f"cannot translate {pat!r}: {e}") from None

    def pattern_part(self, text: str, left: bool, right: bool, pat: str, ptr: str, tree=None
                     ) -> tuple[_R, tuple[int, int | None]]:
        """One alternative of a pattern without its edge anchors: any text before it unless ``left``, after
        it unless ``right``."""
        tree = self.parse_pattern(text, pat, ptr) if tree is None else tree
        content = self.emit_pattern(tree)
        lo, hi = _len_bounds(tree)
        anywhere = self.rx.rep(self.string_char, 0, None)
        if not left:
            content, hi = self.rx.cat(anywhere, content), None
        if not right:
            content, hi = self.rx.cat(content, anywhere), None
        return content, (lo, hi)

    def prescan_pattern(self, pat: str, ptr: str) -> str:
        """Refuse constructs whose ECMA-262 and Python meanings differ; rewrite ``\\D`` / ``\\S``."""
        out = []
        i, n, in_class = 0, len(pat), False
        while i < n:
            c = pat[i]
            if c == "\\" and i + 1 < n:
                e = pat[i + 1]
                if e in _IDENTITY_ESCAPES:
                    out.append(e)  # (none of them is special to our parser, in a class or outside one)
                    i += 2
                    continue
                if e not in _SIMPLE_ESCAPES:
                    raise self.refuse("pattern", ptr, f"escape \\{e} in {pat!r} is not supported")
                if e == "W" or (in_class and e in "DS"):
                    raise self.refuse("pattern", ptr, f"\\{e} in {pat!r} means different things in ECMA-262 "
                                                      f"and Python")
                if e in "DS":
                    excluded = _unicode_set(e.lower()) | _RAW_CHAR_CPS | {0x2028, 0x2029}
                    out.append(_class_text(excluded, negated=True))
                else:
                    out.append(pat[i : i + 2])
                i += 2
                continue
            if in_class:
                in_class = c != "]"
            elif c == "[":
                if pat.startswith("[]", i) or pat.startswith("[^]", i):
                    raise self.refuse("pattern", ptr, f"empty or negated-empty class in {pat!r}")
                in_class = True
                if pat.startswith("[^", i):
                    out.append("[^")
                    i += 2
                    continue
            elif c == "(" and pat.startswith("(?", i) and not pat.startswith("(?:", i):
                raise self.refuse("pattern", ptr, f"group syntax '(?' in {pat!r} is not supported "
                                                  f"(only '(?:')")
            elif c == "{" and pat.startswith("{,", i):
                raise self.refuse("pattern", ptr, f"'{{,n}}' in {pat!r} means different things in ECMA-262 "
                                                  f"and Python")
            out.append(c)
            i += 1
        return "".join(out)

    def emit_pattern(self, node) -> _R | None:
        """Regex over the JSON-escaped text for a :func:`parse_regex` tree over decoded characters."""
        self.tick()
        kind = node[0]
        if kind == "sym":
            chars, negated = node[1]
            if negated:
                excluded = {ord(c) for c in chars} | _RAW_CHAR_CPS | {0x2028, 0x2029}
                return self.rx.make(_class_text(excluded, negated=True), True)
            raw = [ord(c) for c in chars if ord(c) not in _RAW_CHAR_CPS and not 0xD800 <= ord(c) <= 0xDFFF]
            parts = [self.rx.make(_class_text(raw), True) if len(raw) > 1 else
                     self.rx.lit(chr(raw[0])) if raw else None]
            escaped = [c for c in sorted(chars) if ord(c) in _RAW_CHAR_CPS]
            if len(escaped) == len(_RAW_CHAR_CPS):
                parts.append(self.rx.make(_RAW_SPELLINGS, True))
            else:
                parts += [self.rx.lit(json.dumps(c)[1:-1]) for c in escaped]
            return self.rx.alt(parts)
        if kind == "eps":
            return _EPS
        if kind == "cat":
            return self.rx.cat(*[self.emit_pattern(c) for c in node[1]])
        if kind == "alt":
            return self.rx.alt([self.emit_pattern(c) for c in node[1]])
        return self.rx.rep(self.emit_pattern(node[1]), node[2], node[3])

    # ---- arrays --------------------------------------------------------------------------------

    def type_array(self, d: dict, ptr: str, nest: int) -> _R | None:
        if "items" in d and isinstance(d["items"], list):
            raise self.refuse("items", ptr, "items as an array is draft 2019-09 and older; use prefixItems")
        if "contains" in d and ("maxContains" in d or self.nonneg_int(d, "minContains", ptr, 1) > 0):
            return self.contains(d, ptr, nest)  # (else at least 0: no constraint)
        prefix = self.schema_list(d, "prefixItems", ptr) if "prefixItems" in d else []
        items_kw = "items" if "items" in d else "unevaluatedItems" if "unevaluatedItems" in d else None
        lo = self.nonneg_int(d, "minItems", ptr, 0)
        hi = self.nonneg_int(d, "maxItems", ptr)
        elems: list[_R] = []
        for i, sub in enumerate(prefix):
            e = self.node(sub, _ptr_join(ptr, "prefixItems", i), nest + 1)
            if e is None:
                hi = i if hi is None else min(hi, i)
                break
            elems.append(e)
        rest_schema = True if items_kw is None else self.schema_value(d[items_kw], items_kw, ptr)
        rest = self.node(rest_schema, _ptr_join(ptr, items_kw or "items"), nest + 1)
        if rest is None:
            hi = len(elems) if hi is None else min(hi, len(elems))
        hi = self.unique_items(d, ptr, hi, elems, rest_schema)
        if hi is not None and lo > hi:
            return None
        return self.array(elems, rest, lo, hi)

    def contains(self, d: dict, ptr: str, nest: int) -> _R | None:
        """Arrays of ``items`` elements (any values without it) of which at least ``minContains`` (default 1)
        also satisfy ``contains`` C: ``E* B (E* B){m-1} E*`` with separators, B the elements of both
        schemas (their ``allOf``); with ``maxContains`` M: E the elements that fail C (C negated by
        :meth:`negation`, refused where it cannot be), ``(E,)* B ((,E)* ,B){m-1,M-1} (,E)*`` (each element is
        B or E, never both: the count of B is exact). Refused with ``prefixItems``, ``unevaluatedItems``,
        ``maxItems``, ``uniqueItems`` or ``minItems`` above m."""
        m = self.nonneg_int(d, "minContains", ptr, 1)
        for kw in ("prefixItems", "unevaluatedItems", "maxItems"):
            if kw in d:
                raise self.refuse("contains", ptr, f"contains together with {kw} is not supported")
        if d.get("uniqueItems") is True:
            raise self.refuse("contains", ptr, "contains together with uniqueItems is not supported")
        if self.nonneg_int(d, "minItems", ptr, 0) > m:
            raise self.refuse("contains", ptr, "contains together with a minItems above minContains is not "
                                               "supported")
        if "maxContains" in d:
            return self.contains_at_most(d, ptr, nest, m, self.nonneg_int(d, "maxContains", ptr))
        items = self.schema_value(d["items"], "items", ptr) if "items" in d else True
        c_ptr, i_ptr = _ptr_join(ptr, "contains"), _ptr_join(ptr, "items")
        rest = self.node(items, i_ptr, nest + 1)
        try:
            both = self.node_and([(items, i_ptr), (self.schema_value(d["contains"], "contains", ptr), c_ptr)],
                                 c_ptr, nest + 1)
        except UnsupportedSchemaError as e:
            if e.keyword != "allOf":
                raise
            raise self.refuse("contains", ptr, f"cannot merge contains with items: {e}") from None
        if rest is None or both is None:
            return None
        rx = self.rx
        others = rx.rep(rx.cat(self.sep, rest), 0, None)
        body = rx.cat(rx.rep(rx.cat(rest, self.sep), 0, None), both)
        for _ in range(m - 1):
            self.tick()
            body = rx.cat(body, others, self.sep, both)
        return rx.cat(rx.lit("["), self.ws, body, others, self.ws, rx.lit("]"))

    def contains_at_most(self, d: dict, ptr: str, nest: int, m: int, big_m: int) -> _R | None:
        """:meth:`contains` with ``maxContains`` ``big_m`` (its refusals checked there): between ``m`` and
        ``big_m`` elements satisfy C."""
        if m > big_m:
            return None
        items = self.schema_value(d["items"], "items", ptr) if "items" in d else True
        c_ptr, i_ptr = _ptr_join(ptr, "contains"), _ptr_join(ptr, "items")
        contains = self.schema_value(d["contains"], "contains", ptr)
        try:
            neg = self.negation(self.flatten(contains, c_ptr)[0], "contains", c_ptr)
        except UnsupportedSchemaError as e:
            raise self.refuse("contains", ptr, f"contains with maxContains needs the elements that fail contains, "
                                               f"which cannot be written here ({e})") from None
        try:
            both = self.node_and([(items, i_ptr), (contains, c_ptr)], c_ptr, nest + 1)
            fail = None if neg is False else self.node_and([(items, i_ptr), (neg, c_ptr)], c_ptr, nest + 1)
        except UnsupportedSchemaError as e:
            if e.keyword != "allOf":
                raise
            raise self.refuse("contains", ptr, f"cannot merge contains with items: {e}") from None
        rx = self.rx
        parts = []
        if m == 0 and fail is not None:  # (no element satisfies C: any array of the others, or none)
            parts.append(rx.rep(rx.cat(fail, rx.rep(rx.cat(self.sep, fail), 0, None)), 0, 1))
        elif m == 0:
            parts.append(_EPS)
        if both is not None and big_m >= 1:
            lead = rx.rep(rx.cat(fail, self.sep), 0, None) if fail is not None else _EPS
            gap = rx.rep(rx.cat(self.sep, fail), 0, None) if fail is not None else _EPS
            more = rx.rep(rx.cat(gap, self.sep, both), max(m, 1) - 1, big_m - 1)
            parts.append(rx.cat(lead, both, more, gap))
        body = rx.alt(parts)
        if body is None:
            return None
        return rx.cat(rx.lit("["), self.ws, body, self.ws, rx.lit("]"))

    def unique_items(self, d: dict, ptr: str, hi: int | None, elems: list, rest_schema: Any) -> int | None:
        if "uniqueItems" not in d:
            return hi
        u = d["uniqueItems"]
        if not isinstance(u, bool):
            raise self.invalid("uniqueItems", ptr, f"must be a boolean, got {u!r}")
        if not u or (hi is not None and hi <= 1):
            return hi
        if not elems and isinstance(rest_schema, dict) and _single_value(rest_schema):
            return 1 if hi is None else min(hi, 1)
        raise self.refuse("uniqueItems", ptr, "uniqueItems is only supported with maxItems <= 1 or items that "
                                              "allow a single value")

    def array(self, elems: list[_R], rest: _R | None, lo: int, hi: int | None) -> _R:
        """``[ e0, e1, ..., rest, rest, ... ]`` with between lo and hi elements."""
        rx = self.rx
        open_, close = rx.cat(rx.lit("["), self.ws), rx.cat(self.ws, rx.lit("]"))
        if hi == 0:
            return rx.cat(rx.lit("["), self.ws, rx.lit("]"))
        k = len(elems)

        def tail(i: int) -> _R | None:  # elements i.. given element i-1 is present
            self.tick()
            if hi is not None and i >= hi:
                return _EPS
            if i >= k:
                n_lo = max(lo - i, 0)
                n_hi = None if hi is None else hi - i
                return rx.rep(rx.cat(self.sep, rest), n_lo, n_hi)
            part = rx.cat(self.sep, elems[i], tail(i + 1))
            return part if i < lo else rx.opt(part)

        first = elems[0] if k else rest
        body = rx.cat(first, tail(1))
        if body is None:
            return rx.cat(rx.lit("["), self.ws, rx.lit("]")) if lo == 0 else None
        if lo == 0:
            return rx.cat(open_, rx.opt(rx.cat(body, self.ws)), rx.lit("]"))
        return rx.cat(open_, body, close)

    # ---- objects -------------------------------------------------------------------------------

    def type_object(self, d: dict, ptr: str, nest: int) -> _R | None:
        props = self.schema_map(d, "properties", ptr)
        required = self.string_list(d, "required", ptr)
        extra_kw = ("additionalProperties" if "additionalProperties" in d else
                    "unevaluatedProperties" if "unevaluatedProperties" in d else None)
        extra_schema = True if extra_kw is None else self.schema_value(d[extra_kw], extra_kw, ptr)
        extra_ptr = _ptr_join(ptr, extra_kw or "additionalProperties")
        pattern_extra = self.pattern_properties(d, ptr, nest, list(props) + list(required), extra_kw, extra_schema)
        req = set(required)
        items: list[tuple[_R, bool]] = []
        present: list[str] = []
        for name, sub in props.items():
            v = self.node(sub, _ptr_join(ptr, "properties", name), nest + 1)
            if v is None:
                if name in req:
                    return None
                continue
            items.append((self.key_value(self.key(name), v), name in req))
            present.append(name)
        for name in required:
            if name not in props:
                v = self.node(extra_schema, extra_ptr, nest + 1)
                if v is None:
                    return None
                items.append((self.key_value(self.key(name), v), True))
                present.append(name)
        names = list(props) + [n for n in required if n not in props]
        keys_named = False  # (propertyNames built into the extra keys)
        if pattern_extra is not False:  # patternProperties: its keys are the extra keys
            extra = pattern_extra
        else:
            if extra_kw is None and names and not self.open_objects:
                extra_value = None  # silent about extra keys: the declared names only (module docstring)
            else:
                extra_value = self.extra_value(extra_schema, extra_ptr, nest, bool(names))
            extra = None
            if extra_value is not None:
                keys_named = not names and "propertyNames" in d
                key = self.property_names_key(d, ptr, nest) if keys_named else self.extra_key(names)
                extra = None if key is None else self.key_value(key, extra_value)
        count = self.object_side_keywords(d, ptr, present, req, names, extra is not None, keys_named)
        if count == "empty":  # maxProperties: 0
            return None if req & set(present) else self.wrap_object(None, True)
        body, may_be_empty = self.object_body(items, extra)
        if count == "nonempty":  # minProperties: 1
            return None if body is None else self.wrap_object(body, False)
        return self.wrap_object(body, may_be_empty)

    def pattern_properties(self, d: dict, ptr: str, nest: int, names: list[str], extra_kw: str | None,
                           extra_schema: Any) -> _R | None | bool:
        """The extra member (key regex, value regex) of ``patternProperties`` with one pattern P: keys
        matching P (a search, as ``pattern``) with values of its schema; None when no such member can exist;
        False without ``patternProperties``. Exact when no declared name matches P and the other keys are
        not allowed (``additionalProperties: false``, or silent in the default closed mode)."""
        pp = self.schema_map(d, "patternProperties", ptr)
        if not pp:
            return False
        pp_ptr = _ptr_join(ptr, "patternProperties")
        if len(pp) > 1:
            raise self.refuse("patternProperties", ptr, "patternProperties with more than one pattern is not "
                                                        "supported")
        (pat, sub), = pp.items()
        if (extra_kw is not None and extra_schema is not False) or (extra_kw is None and self.open_objects):
            raise self.refuse("patternProperties", ptr, "patternProperties next to keys it does not match "
                                                        "(additionalProperties other than false) is not supported")
        key_content, _ = self.pattern({"pattern": pat}, pp_ptr)
        clash = [n for n in names if self.searches(pat, n, ptr)]
        if clash:
            raise self.refuse("patternProperties", ptr, f"declared property {clash[0]!r} also matches pattern "
                                                        f"{pat!r}: not supported")
        value = self.node(sub, _ptr_join(pp_ptr, pat), nest + 1)
        if key_content is None or value is None:
            return None
        return self.key_value(self.rx.cat(self.rx.lit('"'), key_content, self.rx.lit('"')), value)

    def search_bounded(self, pat: str, text: str) -> bool:
        """Whether ``pat`` matches somewhere in ``text``, by a backtracking matcher (the ``regex`` package, a
        dependency) bounded in time: the deadline, at most :data:`PATTERN_SEARCH_S`.

        Raises:
            TimeoutError: the match ran out of time (a pattern with nested repetitions).
            regex.error: ``pat`` does not compile.
        """
        left = PATTERN_SEARCH_S if self.deadline is None else min(PATTERN_SEARCH_S, self.deadline - time.perf_counter())
        return pattern_search(pat, text, left)

    def searches(self, pat: str, text: str, ptr: str) -> bool:
        """:meth:`search_bounded` for ``patternProperties`` (a pattern :meth:`prescan_pattern` accepted).

        Raises:
            UnsupportedSchemaError: the match runs out of time, or the pattern does not compile.
        """
        try:
            return self.search_bounded(pat, text)
        except TimeoutError:
            raise self.refuse("patternProperties", ptr, f"matching pattern {pat!r} against {text!r} took too "
                                                        "long") from None
        except Exception as e:  # noqa: BLE001 - regex.error
            raise self.refuse("patternProperties", ptr, f"cannot read pattern {pat!r}: {e}") from None

    def property_names_key(self, d: dict, ptr: str, nest: int) -> _R | None:
        """Keys of an object that declares no names, under ``propertyNames`` S: the strings S admits (S and
        ``type: string``, the values of an ``enum`` checked against both), None when S admits none."""
        pn_ptr = _ptr_join(ptr, "propertyNames")
        pn = self.schema_value(d["propertyNames"], "propertyNames", ptr)
        return self.node_and([(pn, pn_ptr), ({"type": "string"}, pn_ptr)], pn_ptr, nest + 1)

    def extra_value(self, schema: Any, ptr: str, nest: int, declares: bool) -> _R | None:
        """Values of extra keys: an explicit schema's regex; arbitrary values of depth
        :data:`EXTRA_VALUE_DEPTH` when the object declares names, else of the depth left at ``nest + 1``."""
        flat, _ = self.flatten(schema, ptr)
        if declares and (flat is True or flat == {}):
            return self.any_of_depth(EXTRA_VALUE_DEPTH)
        return self.node(schema, ptr, nest + 1)

    def key(self, name: str) -> _R:
        return self.rx.lit(json.dumps(name, ensure_ascii=False))

    def key_value(self, key: _R, value: _R) -> _R:
        return self.rx.cat(key, self.colon, value)

    def extra_key(self, names: list[str]) -> _R:
        """Any key when no name is declared; else unescaped keys other than the declared names."""
        if not names:
            return self.string
        raw_names = [n for n in names if json.dumps(n, ensure_ascii=False) == f'"{n}"']
        return self.rx.cat(self.rx.lit('"'), self.complement(raw_names), self.rx.lit('"'))

    def complement(self, names: list[str]) -> _R:
        """Strings of unescaped characters other than ``names``, of which those longer than
        :data:`EXTRA_KEY_PREFIX` that start like a name are left out. Flat: (a prefix of the names' trie, then
        a character leaving it) then any characters, or a prefix that is not a whole name; one shared
        "any characters" tail (each copy of a free-text loop costs compile time)."""
        trie: dict = {}
        for n in names:
            node = trie
            for ch in n[:EXTRA_KEY_PREFIX]:
                node = node.setdefault(ch, {})
            if len(n) <= EXTRA_KEY_PREFIX:
                node[None] = True
        rx = self.rx
        leave: list[_R | None] = []
        stop: list[_R | None] = []
        stack = [("", trie)]
        while stack:
            self.tick()
            prefix, node = stack.pop()
            children = sorted(c for c in node if c is not None)
            if None not in node:
                stop.append(rx.lit(prefix))
            if len(prefix) < EXTRA_KEY_PREFIX:
                other = _class_text(_RAW_CHAR_CPS | {ord(c) for c in children}, negated=True)
                leave.append(rx.cat(rx.lit(prefix), rx.make(other, True)))
                stack.extend((prefix + c, node[c]) for c in reversed(children))
        anything = rx.rep(rx.make(_class_text(_RAW_CHAR_CPS, negated=True), True), 0, None)
        return rx.alt([rx.cat(rx.alt(leave), anything), *stop])

    def object_side_keywords(self, d: dict, ptr: str, present: list[str], req: set[str], names: list[str],
                             extras: bool, keys_named: bool = False) -> str:
        """Refuse the object keywords we do not build into the regex, unless they always hold. Returns
        "empty" for ``maxProperties: 0``, "nonempty" for ``minProperties: 1`` that required properties
        do not imply (both enforced by the caller), else "". ``keys_named``: ``propertyNames`` is built into
        the extra keys (:meth:`property_names_key`)."""
        if "propertyNames" in d and not keys_named:
            pn = self.schema_value(d["propertyNames"], "propertyNames", ptr)
            flat, _ = self.flatten(pn, _ptr_join(ptr, "propertyNames"))
            ok = flat is True or flat == {}
            if not ok and not extras:
                v = self.validator().evolve(schema=pn)
                ok = all(self.valid(v, n, "propertyNames", ptr) for n in present)
            if not ok:
                raise self.refuse("propertyNames", ptr, "propertyNames is not supported (unless every possible "
                                                        "key satisfies it)")
        n_min = len([n for n in present if n in req])
        n_max = None if extras else len(present)
        min_p = self.nonneg_int(d, "minProperties", ptr, 0)
        max_p = self.nonneg_int(d, "maxProperties", ptr)
        count = ""
        if max_p == 0:
            count = "empty"
        elif max_p is not None and (n_max is None or n_max > max_p):
            raise self.refuse("maxProperties", ptr, "maxProperties is not supported (unless it is 0, or the "
                                                    "object is closed and declares at most that many properties)")
        if min_p > n_min:
            if min_p > 1 or count:
                raise self.refuse("minProperties", ptr, "minProperties above 1 and above the number of required "
                                                        "properties is not supported")
            count = "nonempty"

        def possible(name: str) -> bool:
            return name in present or (extras and name not in names)

        for kw in ("dependentRequired", "dependentSchemas"):
            deps = d.get(kw, {})
            if not isinstance(deps, dict):
                raise self.invalid(kw, ptr, "must be an object")
            for name, dep in deps.items():
                if not possible(name):
                    continue
                if kw == "dependentRequired":
                    if not isinstance(dep, list) or not all(isinstance(x, str) for x in dep):
                        raise self.invalid(kw, ptr, "values must be arrays of strings")
                    if all(x in req for x in dep):
                        continue
                else:
                    flat, _ = self.flatten(self.schema_value(dep, kw, ptr), _ptr_join(ptr, kw, name))
                    if flat is True or flat == {}:
                        continue
                raise self.refuse(kw, ptr, f"{kw} for {name!r} is not supported (unless it always holds)")
        return count

    def object_body(self, items: list[tuple[_R, bool]], extra: _R | None) -> tuple[_R | None, bool]:
        """Members in order (optional ones may be absent) then extras; (body, body may be empty)."""
        rx, sep = self.rx, self.sep
        n_lead = next((i for i, (_, r) in enumerate(items) if r), len(items))
        # "at least one member so far" (None: not possible yet), first over the leading optional members
        some = self.some_of([m for m, _ in items[:n_lead]])
        all_optional = True
        for member, required in items[n_lead:]:
            self.tick()
            if required and all_optional:
                some = member if some is None else rx.cat(rx.opt(rx.cat(some, sep)), member)
                all_optional = False
            elif required:
                some = rx.cat(some, sep, member)
            else:
                some = rx.cat(some, rx.opt(rx.cat(sep, member)))
        all_optional = all_optional and n_lead == len(items)
        if extra is None:
            return some, all_optional
        more = rx.rep(rx.cat(sep, extra), 0, None)
        if some is None:
            return rx.cat(extra, more), True
        if all_optional:
            return rx.cat(rx.alt([some, extra]), more), True
        return rx.cat(some, more), False

    def some_of(self, members: list[_R]) -> _R | None:
        """Non-empty comma-separated subsequences of optional ``members`` (in order). A member that is big
        and at least as long as all the others together is written once: (some of those before ",")? BIG
        (", " later one)? ... | some of the others. Otherwise a chain (:meth:`chain`) of blocks
        (:meth:`optional_blocks`), each one member or the same construction of its members."""
        self.tick()
        rx, sep = self.rx, self.sep
        if not members:
            return None
        p = max(range(len(members)), key=lambda i: len(members[i].text))
        size_p = len(members[p].text)
        if size_p > BIG_MEMBER_CHARS and 2 * size_p >= sum(len(m.text) for m in members):
            before = self.some_of(members[:p])
            with_p = rx.cat(rx.opt(None if before is None else rx.cat(before, sep)), members[p],
                            *[rx.opt(rx.cat(sep, m)) for m in members[p + 1 :]])
            return rx.alt([with_p, self.some_of(members[:p] + members[p + 1 :])])
        blocks = self.optional_blocks(members)
        return self.chain([blk[0] if len(blk) == 1 else self.some_of(blk) for blk in blocks])

    @staticmethod
    def optional_blocks(members: list[_R]) -> list[list[_R]]:
        """Consecutive blocks of at most ceil(n / OPTIONAL_BLOCKS) members; a big member starts a block
        (so that it is written at most twice)."""
        size = max(1, -(-len(members) // OPTIONAL_BLOCKS))
        blocks: list[list[_R]] = []
        for m in members:
            if not blocks or len(blocks[-1]) >= size or len(m.text) > BIG_MEMBER_CHARS:
                blocks.append([])
            blocks[-1].append(m)
        return blocks

    def chain(self, parts: list[_R]) -> _R:
        """``S_1 = P_1``, ``S_k = (S_{k-1}(, P_k)?|P_k)``: the non-empty comma-separated subsequences of the
        (non-empty) languages ``parts`` in order. Each part is written twice, but the character DFA builds
        its positions once (:func:`.regex_parse.optional_tail`), and so does the position budget count
        them. The alternation is made here, not by :meth:`_Rx.alt`, which would splice in a part's own
        branches and hide the shape."""
        rx, sep = self.rx, self.sep
        s = parts[0]
        for part in parts[1:]:
            self.tick()
            a = rx.cat(s, rx.opt(rx.cat(sep, part)))
            tree = None if a.tree is None or part.tree is None else alt_node((a.tree, part.tree))
            s = rx.make("(" + a.text + "|" + part.text + ")", True, (a.text, part.text), tree=tree,
                        btrees=(a.tree, part.tree))
        return s

    def wrap_object(self, body: _R | None, may_be_empty: bool) -> _R | None:
        rx = self.rx
        if body is None:
            return rx.cat(rx.lit("{"), self.ws, rx.lit("}")) if may_be_empty else None
        if may_be_empty:
            return rx.cat(rx.lit("{"), self.ws, rx.opt(rx.cat(body, self.ws)), rx.lit("}"))
        return rx.cat(rx.lit("{"), self.ws, body, self.ws, rx.lit("}"))

    # ---- arbitrary values ----------------------------------------------------------------------

    def any_value(self, nest: int) -> _R:
        return self.any_of_depth(self.any_depth(nest))

    def any_of_depth(self, depth: int) -> _R:
        """null, booleans, numbers, strings, ``[]`` and ``{}``, and (depth > 0) arrays / objects of depth - 1
        values."""
        if depth not in self.any_memo:
            self.tick()
            rx = self.rx
            parts = [rx.make("(null|true|false)", True), rx.make(_NUMBER, False), self.string]
            if depth == 0:  # empty containers cost a state or two, and real-world instances nest them deep
                parts += [self.array([], None, 0, 0), self.wrap_object(None, True)]
            else:
                v = self.any_of_depth(depth - 1)
                parts.append(self.array([], v, 0, None))
                member = self.key_value(self.string, v)
                parts.append(self.wrap_object(rx.cat(member, rx.rep(rx.cat(self.sep, member), 0, None)), True))
            self.any_memo[depth] = rx.alt(parts)
        return self.any_memo[depth]


# --------------------------------------------------------------------------------------------------
# Helpers of the disjointness check
# --------------------------------------------------------------------------------------------------

_MISSING = object()
_CONTRADICTION = object()
_ATOMS = ("null", "boolean", "object", "array", "string", "integer", "fraction")


#: the keywords that constrain values of one type atom only (the others may constrain any type)
_TYPE_KEYWORDS = {"null": frozenset(), "boolean": frozenset(), "object": _OBJECT_KW, "array": _ARRAY_KW,
                  "string": _STRING_KW | {_NOT_STRING}, "integer": _NUMERIC_KW | {_NOT_INTEGER},
                  "fraction": _NUMERIC_KW | {_NOT_INTEGER}}
_ALL_TYPE_KEYWORDS = frozenset().union(*_TYPE_KEYWORDS.values())


def _constrains_type(d: dict, atom: str) -> bool:
    """Whether the flattened schema ``d`` may reject some value of type ``atom`` that its ``type`` admits:
    a keyword of that type, or any keyword that is not specific to one type (``enum``, ``anyOf``, ``not``,
    ...)."""
    keys = set(d) - {"type"}
    return bool(keys - _ALL_TYPE_KEYWORDS) or bool(keys & _TYPE_KEYWORDS[atom])


def _atoms(types: set[str]) -> set[str]:
    out = set(types) - {"number"}
    if "number" in types:
        out |= {"integer", "fraction"}
    return out


def _constraining(group: frozenset, d: dict) -> set:
    """The keywords of ``group`` in ``d`` that constrain anything (``additionalProperties: true`` / ``{}``
    does not: merged with the other side's keywords it changes nothing)."""
    return {k for k in group & d.keys()
            if not (k in ("additionalProperties", "unevaluatedProperties") and d[k] in (True, {}))}


def _names_within(x: dict, y: dict) -> bool:
    """Whether ``x`` has ``properties`` alone of its object keywords (no ``additionalProperties`` /
    ``patternProperties``) and ``y`` declares every one of those names: merged, the keys that ``y``'s
    ``additionalProperties`` / ``patternProperties`` see do not change."""
    px, py = x.get("properties"), y.get("properties")
    return (isinstance(px, dict) and isinstance(py, dict) and not x.keys() & {"additionalProperties", "patternProperties"}
            and px.keys() <= py.keys())


def _type_meet(a: set[str], b: set[str]) -> set[str]:
    out = a & b
    if "number" in a and "integer" in b or "integer" in a and "number" in b:
        out.add("integer")
    return out


def _finite_values(d: dict) -> list | None:
    if "const" in d:
        return [d["const"]]
    if isinstance(d.get("enum"), list):
        return d["enum"]
    return None


def _single_value(d: dict) -> bool:
    vals = _finite_values(d)
    return vals is not None and len(vals) == 1


def _numeric_range(d: dict) -> tuple:
    """(lo, lo_exclusive, hi, hi_exclusive) from the numeric bounds of ``d`` (None: unbounded)."""
    lo, lo_x, hi, hi_x = None, False, None, False
    for kw, excl in (("minimum", False), ("exclusiveMinimum", True)):
        v = d.get(kw)
        if _is_number(v) and (lo is None or v > lo or (v == lo and excl)):
            lo, lo_x = v, excl
    for kw, excl in (("maximum", False), ("exclusiveMaximum", True)):
        v = d.get(kw)
        if _is_number(v) and (hi is None or v < hi or (v == hi and excl)):
            hi, hi_x = v, excl
    return lo, lo_x, hi, hi_x


def _ranges_disjoint(a: tuple, b: tuple) -> bool:
    def before(x, y) -> bool:  # every value of x is below every value of y
        hi, hi_x = x[2], x[3]
        lo, lo_x = y[0], y[1]
        if hi is None or lo is None:
            return False
        return hi < lo or (hi == lo and (hi_x or lo_x))

    return before(a, b) or before(b, a)


def _property_schema(d: dict, name: str) -> Any:
    props = d.get("properties")
    if isinstance(props, dict) and name in props:
        return props[name]
    if isinstance(d.get("patternProperties"), dict) and d["patternProperties"]:
        return True
    return d.get("additionalProperties", True)


# --------------------------------------------------------------------------------------------------
# Whitespace and the public function
# --------------------------------------------------------------------------------------------------

_JSON_WS = frozenset(" \t\n\r")


def _check_ws_tree(node) -> bool:
    kind = node[0]
    if kind == "sym":
        chars, negated = node[1]
        return not negated and chars <= _JSON_WS
    if kind == "eps":
        return True
    if kind in ("cat", "alt"):
        return all(_check_ws_tree(c) for c in node[1])
    return _check_ws_tree(node[1])


def _whitespace(pattern: str | None, rx: _Rx, limits: InputLimits) -> _R:
    """The whitespace fragment; refuses a pattern that can match anything but JSON whitespace."""
    text = DEFAULT_WHITESPACE if pattern is None else pattern
    if not isinstance(text, str):
        raise InvalidOptionError(f"whitespace_pattern must be a string, got {type(text).__name__}")
    if text == "":
        return _EPS
    if not _check_ws_tree(parse_regex(text, limits=limits)):
        raise InvalidOptionError(f"whitespace_pattern {text!r} may match characters other than JSON whitespace "
                                 f"(space, \\t, \\n, \\r)")
    if text == DEFAULT_WHITESPACE:
        return rx.make(text, False)
    return rx.make("(" + text + ")", True)


def json_schema_to_regex(schema: dict | bool, whitespace_pattern: str | None = None, *,
                         limits: InputLimits | None = None, deadline: float | None = None,
                         open_objects: bool = False) -> str:
    """Regex (the :mod:`.regex_parse` dialect, also Python ``re``; whole-output match) of the JSON texts
    valid against ``schema`` (draft 2020-12), within the documented smaller-language choices (module
    docstring). Every string the regex accepts parses as JSON and is valid against the schema.

    Args:
        schema: the parsed schema (``json.loads`` result): a dict or a boolean.
        whitespace_pattern: regex of the whitespace allowed between JSON tokens (None:
            :data:`DEFAULT_WHITESPACE`; ``""``: none). It may only match JSON whitespace.
        limits: :class:`~.limits.InputLimits` (None: :meth:`InputLimits.from_env`); the schema is checked
            against them first, and the regex may not grow past ``max_regex_chars``.
        deadline: ``time.perf_counter()`` value after which conversion stops (None: none).
        open_objects: an object that declares names (``properties`` / ``required``; with
            ``patternProperties``: refused instead) and says nothing about other keys (no
            ``additionalProperties`` / ``unevaluatedProperties``) also takes extra keys, as
            JSON Schema allows; False (default): the declared names only, as xgrammar's and outlines'
            conversions in vLLM (a smaller language; such an object's automaton is about half as large).

    Returns:
        The regex.

    Raises:
        InputTooLargeError: the schema is over the input limits (before any work), or the regex being
            built exceeds ``max_regex_chars`` (raised as soon as it does).
        UnsupportedSchemaError: a keyword or combination that is not enforced exactly (``keyword``,
            ``pointer``; ``regular=False`` for recursive references and dynamic references).
        InvalidSchemaError: a malformed schema (wrong value types, unknown type, unresolvable ``$ref``).
        EmptyLanguageError: no JSON value satisfies the schema.
        CompileBudgetError: past ``deadline``, or over :data:`MAX_STEPS` conversion steps.
        InvalidOptionError: a ``whitespace_pattern`` that may match more than JSON whitespace, or a bad
            ``VLLM_FST_MAX_*`` environment variable (``limits`` None).
        RegexSyntaxError, UnsupportedRegexError: ``whitespace_pattern`` does not parse.
    """
    lim = InputLimits.from_env() if limits is None else limits
    check_schema_obj(schema, lim)
    if not isinstance(schema, (dict, bool)):
        raise InvalidSchemaError(f"invalid JSON schema: must be an object or a boolean, got "
                                 f"{type(schema).__name__}")
    schema = localize_refs(schema)  # ($ref through $id / $anchor: as JSON pointers from the root)
    rx = _Rx(lim.max_regex_chars)
    conv = _Converter(schema, _whitespace(whitespace_pattern, rx, lim), lim.max_regex_chars, deadline,
                      open_objects)
    conv.tick()
    try:
        result = conv.node(schema, "", 0)
    except RecursionError:
        raise UnsupportedSchemaError("the JSON schema chains references or subschemas too deeply to convert",
                                     keyword="$ref") from None
    if result is None:
        raise EmptyLanguageError("the JSON schema admits no value (false, or contradictory keywords)", None)
    depth = _group_depth(result.text)
    if depth > MAX_GROUP_DEPTH:
        raise CompileBudgetError(f"the JSON schema nests too deeply: its regex nests groups {depth} deep, over the "
                                 f"regex parser's limit of {MAX_GROUP_DEPTH}", None)
    if result.tree is not None:  # (the compile that follows need not parse the regex again)
        remember_tree(result.text, result.tree)
    return result.text


def pattern_search(pat: str, text: str, timeout_s: float) -> bool:
    """Whether the pattern ``pat`` matches somewhere in ``text``, by a backtracking matcher (the ``regex``
    package, a dependency) stopped after ``timeout_s`` seconds (at least 1 ms): Python's ``re`` cannot be
    stopped, and a pattern with nested repetitions keeps it busy for hours on a 40-character text.

    Raises:
        TimeoutError: the match ran out of time.
        regex.error: ``pat`` does not compile.
    """
    import regex as regex_module

    return regex_module.search(pat, text, timeout=max(timeout_s, 1e-3)) is not None


def _bounded_pattern_validator(base: Any, search: Any) -> Any:
    """``base`` (a jsonschema validator class) with ``pattern``, ``patternProperties`` and
    ``additionalProperties`` reading patterns through ``search(pattern, text) -> bool`` (time-bounded; it
    raises ``TimeoutError``) instead of ``re.search``; ``base`` itself where jsonschema cannot be extended."""
    try:
        from jsonschema import ValidationError, validators
    except ImportError:  # pragma: no cover - jsonschema ships with vLLM
        return base

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not search(patrn, instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator, pp, instance, schema):
        if validator.is_type(instance, "object"):
            for pat, sub in pp.items():
                for k, v in instance.items():
                    if search(pat, k):
                        yield from validator.descend(v, sub, path=k, schema_path=pat)

    def additional_properties(validator, ap, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        props, pats = schema.get("properties", {}), list(schema.get("patternProperties", {}))
        extras = [k for k in instance if k not in props and not any(search(p, k) for p in pats)]
        if validator.is_type(ap, "object"):
            for k in extras:
                yield from validator.descend(instance[k], ap, path=k)
        elif not ap and extras:
            yield ValidationError(f"Additional properties are not allowed ({', '.join(map(repr, extras))})")

    try:
        return validators.extend(base, {"pattern": pattern, "patternProperties": pattern_properties,
                                        "additionalProperties": additional_properties})
    except Exception:  # noqa: BLE001 - another jsonschema API: its own keywords
        return base


def _outside_classes(text: str):
    """``(index, character, group depth)`` of the characters of a pattern outside escapes and character
    classes; the depth counts the groups open around the character (a group's own parentheses are at the
    depth outside it)."""
    depth, in_class, i = 0, False, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        else:
            depth -= c == ")"
            yield i, c, depth
            depth += c == "("
        i += 1


def _patterns(d: dict) -> tuple:
    """The ``pattern`` values of a flattened schema (a merge of two holds a tuple of them)."""
    pats = d.get("pattern")
    return pats if isinstance(pats, tuple) else () if pats is None else (pats,)


def _strings_tree(values: list) -> tuple:
    """Tree (decoded characters) of one of the strings ``values`` (not empty)."""
    return alt_node([literal_node(v) for v in dict.fromkeys(values)])


def _matches_raw_chars(tree) -> bool:
    """Whether a tree (over characters) can match a character JSON escapes (:data:`_RAW_CHAR_CPS`)."""
    stack = [tree]
    while stack:
        n = stack.pop()
        if n[0] == "sym":
            chars, negated = n[1]
            cps = {ord(c) for c in chars}
            if (not negated and cps & _RAW_CHAR_CPS) or (negated and not _RAW_CHAR_CPS <= cps):
                return True
        elif n[0] in ("cat", "alt"):
            stack.extend(n[1])
        elif n[0] == "rep":
            stack.append(n[1])
    return False


def _split_alternatives(text: str) -> list[str]:
    """The top-level alternatives of a pattern (``|`` outside groups and classes; escapes skipped)."""
    cuts = [i for i, c, d in _outside_classes(text) if c == "|" and d == 0]
    return [text[a + 1 : b] for a, b in zip([-1, *cuts], [*cuts, len(text)])]


def _whole_group(text: str) -> str | None:
    """The inside of ``text`` when it is one group (``(...)`` / ``(?:...)``)."""
    if not (text.startswith("(") and text.endswith(")")):
        return None
    close = next((i for i, c, d in _outside_classes(text) if c == ")" and d == 0), None)
    if close != len(text) - 1:
        return None
    return text[3:-1] if text.startswith("(?:") else text[1:-1]


def _whole_group_inner(text: str) -> str | None:
    """The inside of ``text`` when it is one group (``(...)`` / ``(?:...)``) with a single alternative."""
    inner = _whole_group(text)
    return inner if inner is not None and len(_split_alternatives(inner)) == 1 else None


def _anchored_alternatives(text: str) -> list[tuple[str, bool, bool]]:
    """The top-level alternatives of a pattern, each as ``(text, left anchored, right anchored)``
    (:func:`_edge_anchors`); an alternative that is one group of several alternatives between its anchors is
    distributed over them (``^([^,]|$)`` is ``^[^,]|^$``, ``^(a|b)$`` is ``^a$|^b$``: the same strings match)."""
    out = []
    for alt in _split_alternatives(text):
        body, left, right = _strip_anchors(alt)
        inner = _whole_group(body)
        if inner is not None and len(_split_alternatives(inner)) > 1:
            out += [(t, left or l2, right or r2) for t, l2, r2 in _anchored_alternatives(inner)]
        else:
            out.append(_edge_anchors(alt))
    return out


def _strip_anchors(text: str) -> tuple[str, bool, bool]:
    """(``text`` without the ``^`` at its start and the unescaped ``$`` at its end, left anchored, right
    anchored)."""
    left = right = False
    if text.startswith("^"):
        text, left = text[1:], True
    if re.search(r"(?<!\\)(\\\\)*\$$", text):
        text, right = text[:-1], True
    return text, left, right


def _edge_anchors(text: str) -> tuple[str, bool, bool]:
    """(``text`` without the ``^`` at its start and the unescaped ``$`` at its end, also inside a group that
    is the whole of it, left anchored, right anchored)."""
    text, left, right = _strip_anchors(text)
    inner = _whole_group_inner(text)
    if inner is not None:
        t2, l2, r2 = _edge_anchors(inner)
        if l2 or r2:
            text, left, right = "(?:" + t2 + ")", left or l2, right or r2
    return text, left, right


def _group_depth(regex: str) -> int:
    """Deepest group nesting of ``regex`` (escapes and classes skipped; our classes escape every ``]``
    inside them)."""
    return max((d + 1 for _, c, d in _outside_classes(regex) if c == "("), default=0)
