"""Input size limits checked *before* any conversion or compile, in linear time (issue 14 item 1).

Why these exist: measured offline on public JSON schemas, outlines_core's schema conversion grew past
20 GB for one schema and returned a 93-million-character regex for another; a regex of that size then
kept the parser busy for minutes before the compile budget even started. Bounding the *inputs* first
makes every later stage's cost bounded too: a request over a limit is refused with
:class:`~vllm_fst_backend.errors.InputTooLargeError` (HTTP 400 in the server) naming the limit, the
environment variable that raises it, and the measured size.

Defaults (each overridable by the environment variable in brackets, read by
:meth:`InputLimits.from_env`):

* ``max_regex_chars`` = 100,000 characters [``VLLM_FST_MAX_REGEX_CHARS``]. Hand-written regexes are
  well under 1 KB; regexes converted from real tool-calling schemas are 1-30 KB. The compile budgets
  (``CompileBudgets.max_positions`` = 20,000 positions) refuse far smaller *expanded* regexes anyway;
  this limit only keeps the linear front end (parse, size estimate) in the millisecond range.
* ``max_schema_chars`` = 100,000 characters of JSON text [``VLLM_FST_MAX_SCHEMA_CHARS``]. Real
  tool-calling / response-format schemas are a few KB (OpenAI caps a tool's parameters schema at about
  the same order); 100 KB leaves a 10-30x margin.
* ``max_schema_depth`` = 32 levels of JSON containers [``VLLM_FST_MAX_SCHEMA_DEPTH``]. Real schemas
  nest 3-8 levels (object → properties → property → items → ...; each schema level is two JSON levels);
  32 also keeps every recursive consumer of the schema (conversion, ``jsonschema``) far from Python's
  recursion limit.
* ``max_choices`` = 1,000 choices [``VLLM_FST_MAX_CHOICES``] and ``max_choices_chars`` = 100,000
  characters in total [``VLLM_FST_MAX_CHOICES_CHARS``]: a choice list is a literal alternation, whose
  automaton grows with its total length.
* ``max_enum_values`` = 1,000 values in one ``enum`` of a schema [``VLLM_FST_MAX_ENUM_VALUES``]
  (same reason as choices; enforced by :func:`check_schema_obj`).

Every check is a single pass over the input (no recursion, no regex engine): well under a millisecond
per KB (measured with ``timeit`` on the development host, a 92 KB schema of 800 properties: about
28 µs per KB for :func:`check_schema_text`, 17 µs per KB for :func:`check_schema_obj`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Any, Iterable

from ..errors import InputTooLargeError, InvalidOptionError

__all__ = [
    "InputLimits",
    "DEFAULT_LIMITS",
    "ENV_VARS",
    "check_regex",
    "check_schema_text",
    "check_schema_obj",
    "check_choices",
    "nesting_depth_text",
]

#: Environment variable of each limit (field name → variable name).
ENV_VARS = {
    "max_regex_chars": "VLLM_FST_MAX_REGEX_CHARS",
    "max_schema_chars": "VLLM_FST_MAX_SCHEMA_CHARS",
    "max_schema_depth": "VLLM_FST_MAX_SCHEMA_DEPTH",
    "max_choices": "VLLM_FST_MAX_CHOICES",
    "max_choices_chars": "VLLM_FST_MAX_CHOICES_CHARS",
    "max_enum_values": "VLLM_FST_MAX_ENUM_VALUES",
}

_UNITS = {
    "max_regex_chars": "characters",
    "max_schema_chars": "characters",
    "max_schema_depth": "levels of nesting",
    "max_choices": "choices",
    "max_choices_chars": "characters",
    "max_enum_values": "enum values",
}


@dataclass(frozen=True)
class InputLimits:
    """Size limits of one request's inputs (module docstring: defaults, units and why).

    Attributes (all positive ints):
        max_regex_chars: length of a regex constraint, characters.
        max_schema_chars: length of a JSON schema's text (``json.dumps`` of a dict schema), characters.
        max_schema_depth: nesting depth of the schema's JSON containers (``{}`` / ``[]``), levels.
        max_choices: number of entries of a choice constraint.
        max_choices_chars: total length of all choices, characters.
        max_enum_values: number of values of any one ``enum`` in a schema.

    Raises:
        InvalidOptionError: a limit that is not a positive int (also from :meth:`from_env` for a bad
            environment value; the message names the variable).
    """

    max_regex_chars: int = 100_000
    max_schema_chars: int = 100_000
    max_schema_depth: int = 32
    max_choices: int = 1_000
    max_choices_chars: int = 100_000
    max_enum_values: int = 1_000

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidOptionError(f"input limit {f.name} must be a positive int, got {v!r}")

    @classmethod
    def from_env(cls, environ: dict | None = None) -> "InputLimits":
        """Defaults overridden by the environment variables of :data:`ENV_VARS` (unset or empty: default).

        Raises:
            InvalidOptionError: a variable that is not a positive integer (the message names it).
        """
        env = os.environ if environ is None else environ
        kw = {}
        for name, var in ENV_VARS.items():
            raw = env.get(var)
            if raw is None or str(raw).strip() == "":
                continue
            try:
                val = int(str(raw).strip().replace("_", ""))
            except ValueError:
                raise InvalidOptionError(f"{var} must be a positive integer, got {raw!r}") from None
            if val <= 0:
                raise InvalidOptionError(f"{var} must be a positive integer, got {raw!r}")
            kw[name] = val
        return cls(**kw)


DEFAULT_LIMITS = InputLimits()


def _too_large(what: str, name: str, limit: int, measured: int, at_least: bool = False) -> InputTooLargeError:
    var = ENV_VARS[name]
    unit = _UNITS[name]
    return InputTooLargeError(
        f"{what} is too large: {'at least ' if at_least else ''}{measured} {unit}, over the limit {name}={limit} "
        f"(raise it with the environment variable {var})",
        limit_name=name, env_var=var, limit=limit, measured=measured,
    )


def _limits(limits: InputLimits | None) -> InputLimits:
    return DEFAULT_LIMITS if limits is None else limits


def check_regex(regex: str, limits: InputLimits | None = None) -> None:
    """Refuse a regex longer than ``limits.max_regex_chars`` characters. O(1).

    Raises:
        InputTooLargeError: over the limit (``limit_name="max_regex_chars"``).
    """
    lim = _limits(limits)
    if isinstance(regex, str) and len(regex) > lim.max_regex_chars:
        raise _too_large("the regex", "max_regex_chars", lim.max_regex_chars, len(regex))


_JSON_STRING = re.compile(r'"(?:[^"\\]+|\\.)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def nesting_depth_text(text: str) -> int:
    """Maximum nesting depth of ``{}`` / ``[]`` in JSON ``text``, brackets inside strings ignored.
    Linear: two C-level regex passes (string literals, then everything but brackets, removed; the
    patterns cannot backtrack) and one pass over the remaining brackets. Malformed text gives some
    number (the JSON parser reports the syntax error later)."""
    br = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    depth = best = 0
    for c in br:
        if c == "{" or c == "[":
            depth += 1
            if depth > best:
                best = depth
        else:
            depth -= 1
    return best


def check_schema_text(text: str, limits: InputLimits | None = None) -> None:
    """Refuse a JSON schema text longer than ``max_schema_chars`` or nested deeper than
    ``max_schema_depth`` (brackets in strings not counted). Linear in ``len(text)``; the length is
    checked first, so an oversized text costs O(1).

    Raises:
        InputTooLargeError: over a limit (``limit_name`` ``"max_schema_chars"`` or ``"max_schema_depth"``).
    """
    lim = _limits(limits)
    if len(text) > lim.max_schema_chars:
        raise _too_large("the JSON schema", "max_schema_chars", lim.max_schema_chars, len(text))
    d = nesting_depth_text(text)
    if d > lim.max_schema_depth:
        raise _too_large("the JSON schema's nesting", "max_schema_depth", lim.max_schema_depth, d)


def check_schema_obj(schema: Any, limits: InputLimits | None = None) -> None:
    """Check a parsed schema (dict / list / scalars, as from ``json.loads``) against the schema
    limits: nesting depth of containers, number of ``enum`` values, and the total size (approximate
    JSON text length of keys and scalars). Iterative (explicit stack): no recursion limit, and it
    stops as soon as a limit is exceeded, so a huge object costs at most ~``max_schema_chars`` steps.

    Raises:
        InputTooLargeError: over a limit (``limit_name`` ``"max_schema_depth"``, ``"max_enum_values"`` or
            ``"max_schema_chars"``).
    """
    lim = _limits(limits)
    if isinstance(schema, str):
        check_schema_text(schema, lim)
        return
    size = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > lim.max_schema_depth:
                raise _too_large("the JSON schema's nesting", "max_schema_depth", lim.max_schema_depth, depth,
                                 at_least=True)
            enum = node.get("enum")
            if isinstance(enum, (list, tuple)) and len(enum) > lim.max_enum_values:
                raise _too_large("an enum of the JSON schema", "max_enum_values", lim.max_enum_values, len(enum))
            size += 2 + 2 * len(node)
            for k, v in node.items():
                size += len(k) + 3 if isinstance(k, str) else 8
                stack.append((v, depth + 1))
        elif isinstance(node, (list, tuple)):
            if depth > lim.max_schema_depth:
                raise _too_large("the JSON schema's nesting", "max_schema_depth", lim.max_schema_depth, depth,
                                 at_least=True)
            size += 2 + len(node)
            for v in node:
                stack.append((v, depth + 1))
        elif isinstance(node, str):
            size += len(node) + 2
        else:
            size += 5
        if size > lim.max_schema_chars:
            raise _too_large("the JSON schema", "max_schema_chars", lim.max_schema_chars, size, at_least=True)


def check_choices(choices: Iterable[Any], limits: InputLimits | None = None) -> None:
    """Refuse a choice list with more than ``max_choices`` entries or more than ``max_choices_chars``
    characters in total (``str()`` of each entry). Linear; stops at the first excess.

    Raises:
        InputTooLargeError: over a limit (``limit_name`` ``"max_choices"`` or ``"max_choices_chars"``).
    """
    lim = _limits(limits)
    try:
        n_all = len(choices)  # type: ignore[arg-type]
    except TypeError:
        n_all = None
    if n_all is not None and n_all > lim.max_choices:
        raise _too_large("the choice list", "max_choices", lim.max_choices, n_all)
    total = 0
    n = 0
    for c in choices:
        n += 1
        if n > lim.max_choices:
            raise _too_large("the choice list", "max_choices", lim.max_choices, n)
        total += len(c) if isinstance(c, str) else len(str(c))
        if total > lim.max_choices_chars:
            raise _too_large("the choice list", "max_choices_chars", lim.max_choices_chars, total)
