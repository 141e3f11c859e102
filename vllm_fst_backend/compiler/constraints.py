"""Constraint (kind + spec) → regex, before the regex is compiled: ``regex``, ``choice``, ``json``
(JSON schema, :mod:`.json_schema`) and ``json_object``. Input sizes are checked first, in linear time
(:mod:`.limits`); the conversion itself is bounded by the same limits and a deadline.

Kinds are the names of vLLM's ``StructuredOutputOptions`` (``"REGEX"``, ``"CHOICE"``, ``"JSON"``,
``"JSON_OBJECT"``, ``"GRAMMAR"``, ``"STRUCTURAL_TAG"``); this module does not import vLLM.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Iterable

from ..errors import InvalidConstraintError, InvalidSchemaError, UnsupportedSchemaError
from .limits import InputLimits, check_choices, check_regex, check_schema_obj, check_schema_text
from .options import env_flag
from .regex_parse import escape_literal

__all__ = [
    "SUPPORTED_TEXT",
    "JSON_OBJECT_SCHEMA",
    "FST_KINDS",
    "choice_to_regex",
    "check_input_limits",
    "json_schema_to_regex",
    "constraint_to_regex",
]

SUPPORTED_TEXT = (
    "the 'fst' structured-output backend supports: regex, choice, json (JSON schema, also "
    "response_format json_schema) and json_object"
)
JSON_OBJECT_SCHEMA = '{"type": "object"}'
#: Kinds fst expresses itself (the others go to the fallback backend, ``vllm/fallback.py``).
FST_KINDS = frozenset({"REGEX", "CHOICE", "JSON", "JSON_OBJECT"})


def _kind_name(kind: Any) -> str:
    return getattr(kind, "name", str(kind)).upper()


def choice_to_regex(choices: Iterable[Any]) -> str:
    """``["a", "b"]`` → ``(a|b)``, each choice escaped (:func:`.regex_parse.escape_literal`).

    Raises:
        InvalidConstraintError: empty list.
    """
    items = [escape_literal(str(c)) for c in choices]
    if not items:
        raise InvalidConstraintError("choice must be a non-empty list")
    return "(" + "|".join(items) + ")"


def check_input_limits(kind: Any, spec: Any, limits: InputLimits | None = None) -> None:
    """Linear-time size checks of a constraint (:mod:`.limits`) before any conversion or compile.
    ``GRAMMAR`` / ``STRUCTURAL_TAG`` are not fst's (the fallback backend and vLLM check them).

    Raises:
        InputTooLargeError: over a limit (the message names it, its variable and the size).
        InvalidOptionError: a malformed ``VLLM_FST_MAX_*`` variable (``limits`` None).
    """
    limits = limits if limits is not None else InputLimits.from_env()
    name = _kind_name(kind)
    if name == "REGEX" and isinstance(spec, str):
        check_regex(spec, limits)
    elif name == "JSON" and spec is not None:
        if isinstance(spec, str):
            check_schema_text(spec, limits)
        else:
            check_schema_obj(spec, limits)
    elif name == "CHOICE":
        if isinstance(spec, str):
            check_schema_text(spec, limits)  # the JSON text of the list: length first
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError:
                return
        if isinstance(spec, (list, tuple)):
            check_choices(spec, limits)


class _RegexLRU:
    """Schema text → regex, at most ``max_entries`` (each bounded by ``max_regex_chars``)."""

    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            v = self._data.get(key)
            if v is not None:
                self._data.move_to_end(key)
            return v

    def put(self, key, value) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)


_SCHEMA_REGEXES = _RegexLRU()


def _check_metaschema(schema: Any) -> None:
    """Validate the schema itself against the draft 2020-12 metaschema (``jsonschema``), so that a
    malformed keyword is refused even where the converter would not read it (``"minimum": "abc"`` on an
    object).

    A ``pattern`` (or ``patternProperties`` key) that the metaschema's ``regex`` format check (Python's
    ``re``) cannot compile may still be a valid ECMA-262 regex (``\\p{Letter}``, ``\\cC``): fst cannot
    read it, so it is unsupported (the fallback backend may serve the request), not invalid.

    Raises:
        InvalidSchemaError: the schema is not a valid JSON Schema (message: what and where).
        UnsupportedSchemaError: a pattern in a syntax fst does not read (``keyword``: the keyword).
    """
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        path = [str(p) for p in e.path]
        where = "/" + "/".join(path) if path else "the schema root"
        if e.validator == "format" and e.validator_value == "regex":
            raise UnsupportedSchemaError(
                f"unsupported JSON schema: the pattern {e.instance!r} is not in the regex syntax fst reads "
                f"(Python re; ECMA-262 features such as \\p{{...}} or \\cX are not supported; at {where})",
                keyword=path[-1] if path else "pattern", pointer="/" + "/".join(path[:-1]) if len(path) > 1 else "",
            ) from None
        raise InvalidSchemaError(f"invalid JSON schema: {e.message} (at {where})") from None
    except RecursionError:
        raise InvalidSchemaError("invalid JSON schema: nested too deeply to check") from None


OPEN_OBJECTS_ENV = "VLLM_FST_JSON_OPEN_OBJECTS"


def open_objects_from_env() -> bool:
    """``$VLLM_FST_JSON_OPEN_OBJECTS`` (``1`` / ``true``: objects that are silent about extra keys take them,
    as JSON Schema allows; default ``0``: declared names only, :func:`.json_schema.json_schema_to_regex`).

    Raises:
        InvalidOptionError: a value other than 0/1/true/false/yes/no/on/off (a server misconfiguration).
    """
    return env_flag(OPEN_OBJECTS_ENV, False, strict=True)


def json_schema_to_regex(schema: str | dict | bool, whitespace_pattern: str | None = None, *,
                         limits: InputLimits | None = None, deadline: float | None = None) -> str:
    """JSON schema (text or parsed) → regex, keys in the schema's order, every keyword enforced
    exactly or refused (:func:`.json_schema.json_schema_to_regex`). Cached per process by the schema
    text (64 entries).

    Raises:
        InvalidConstraintError: not JSON, not an object or boolean.
        InvalidSchemaError: a malformed schema.
        UnsupportedSchemaError: a keyword fst cannot enforce exactly (``regular=False``: not a regular
            language at all); the fallback backend may serve it.
        InputTooLargeError / CompileBudgetError: the input limits, the regex size, the deadline.
    """
    from .json_schema import json_schema_to_regex as convert

    limits = limits if limits is not None else InputLimits.from_env()
    if isinstance(schema, str):
        check_schema_text(schema, limits)
        text = schema
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidConstraintError(f"invalid JSON schema (not valid JSON: {e})") from None
    else:
        parsed = schema
        text = json.dumps(schema, ensure_ascii=False)
    if not isinstance(parsed, (dict, bool)):
        raise InvalidConstraintError("invalid JSON schema: must be a JSON object or a boolean")
    open_objects = open_objects_from_env()
    key = (text, whitespace_pattern, limits, open_objects)
    got = _SCHEMA_REGEXES.get(key)
    if got is None:
        _check_metaschema(parsed)
        got = convert(parsed, whitespace_pattern, limits=limits, deadline=deadline, open_objects=open_objects)
        _SCHEMA_REGEXES.put(key, got)
    return got


def constraint_to_regex(kind: Any, spec: Any, whitespace_pattern: str | None = None, *,
                        limits: InputLimits | None = None, deadline: float | None = None, disk: Any = None) -> str:
    """Regex of a constraint: ``kind`` is a ``StructuredOutputOptions`` member or its name, ``spec`` the
    grammar spec (REGEX: the regex; CHOICE: a list or its JSON text; JSON: schema dict or text;
    JSON_OBJECT: ignored). Sizes are checked first (:func:`check_input_limits`).

    ``disk`` (a :class:`.persist.DiskCache`, optional): a JSON schema's regex is taken from the host's
    disk cache when another process converted the same schema text (the API server's compile process
    stores it before it compiles), and stored there after a conversion. The key holds everything the
    conversion reads (:func:`_regex_key`); only successful conversions are stored, so errors are raised
    as without it. Saves the engine core and the workers ~2.5 ms per new schema (most of it the
    metaschema check).

    Raises:
        InvalidConstraintError: grammar / structural_tag, a non-string regex, an empty or malformed choice
            list, a schema that is not JSON.
        InputTooLargeError, InvalidSchemaError, UnsupportedSchemaError, CompileBudgetError: see
            :func:`json_schema_to_regex`.
    """
    limits = limits if limits is not None else InputLimits.from_env()
    name = _kind_name(kind)
    if name not in FST_KINDS:
        what = name.lower()
        raise InvalidConstraintError(f"structured_outputs.{what} is not supported: {SUPPORTED_TEXT}")
    check_input_limits(name, spec, limits)
    if name == "REGEX":
        if not isinstance(spec, str):
            raise InvalidConstraintError("regex must be a string")
        return spec
    if name == "CHOICE":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError:
                raise InvalidConstraintError("choice must be a list of strings") from None
        if not isinstance(spec, (list, tuple)):
            raise InvalidConstraintError("choice must be a list of strings")
        return choice_to_regex(spec)
    schema = spec if name == "JSON" else JSON_OBJECT_SCHEMA
    rkey = _regex_key(disk, name, schema, whitespace_pattern, limits) if disk is not None else None
    if rkey is not None:
        got = disk.load_regex(rkey)
        if got is not None:
            return got
    regex = json_schema_to_regex(schema, whitespace_pattern, limits=limits, deadline=deadline)
    if rkey is not None:
        disk.store_regex(rkey, regex)
    return regex


def _regex_key(disk: Any, name: str, schema: Any, whitespace_pattern: str | None, limits: InputLimits) -> str | None:
    """The disk cache's key of a schema's regex: the schema's text as vLLM keys it (a dict: ``json.dumps``),
    the whitespace pattern, the limits and the open-objects setting; None if the schema has no text."""
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
    except (TypeError, ValueError):
        return None
    return disk.regex_key(name, text, repr(whitespace_pattern), repr(limits), repr(open_objects_from_env()))
