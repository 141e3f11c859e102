"""Constraint (vLLM kind + spec) -> regex: ``choice``, ``regex``, ``json`` (JSON schema) and
``json_object``; the legacy ``guided_*`` request fields as ``StructuredOutputsParams``."""

from __future__ import annotations

import functools
import json
from typing import Any, Iterable

from vllm_fst_backend.errors import FstBackendError

SUPPORTED_TEXT = (
    "the 'fst' structured-output backend supports: regex, choice, json (JSON schema, also "
    "response_format json_schema) and json_object"
)
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class InvalidConstraintError(FstBackendError):
    """The request's constraint is malformed or of a kind the fst backend does not support."""


_REGEX_META = set(r"\.^$*+?{}[]|()")
_CONTROL_ESCAPES = {"\n": r"\n", "\t": r"\t"}  # other control characters: \xNN


def escape_literal(text: str) -> str:
    """Escape ``text`` so the regex matches it literally: a backslash before each regex
    metacharacter only (``re.escape`` also escapes space, ``-``, ``#``, ``&``, ``~``, which not every
    regex parser reads back as literals), control characters as ``\\n``-style or ``\\xNN`` escapes."""
    out = []
    for ch in text:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ch in _CONTROL_ESCAPES:
            out.append(_CONTROL_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def choice_to_regex(choices: Iterable[Any]) -> str:
    """``["a", "b"]`` -> ``(a|b)`` with each choice escaped.

    Raises:
        InvalidConstraintError: empty list.
    """
    items = [escape_literal(str(c)) for c in choices]
    if not items:
        raise InvalidConstraintError("choice must be a non-empty list")
    return "(" + "|".join(items) + ")"


@functools.lru_cache(maxsize=256)
def _schema_regex_cached(schema_text: str, whitespace_pattern: str | None) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    return build_regex_from_schema(schema_text, whitespace_pattern)


def json_schema_to_regex(schema: str | dict, whitespace_pattern: str | None = None) -> str:
    """JSON schema (text or dict) -> regex via ``outlines_core.json_schema.build_regex_from_schema``.

    Raises:
        InvalidConstraintError: not JSON, not an object, unenforced keywords, conversion failure.
    """
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidConstraintError(f"invalid JSON schema (not valid JSON: {e})") from None
    else:
        parsed = schema
    if not isinstance(parsed, (dict, bool)):
        raise InvalidConstraintError("invalid JSON schema: must be a JSON object")
    unenforced = sorted(_unenforced_keywords(parsed))
    if unenforced:
        raise InvalidConstraintError(
            f"JSON schema keywords {', '.join(unenforced)} cannot be enforced by the fst backend (its "
            "schema-to-regex conversion would silently ignore them); remove them or express the bound "
            "as a regex (structured_outputs.regex)"
        )
    text = json.dumps(parsed, sort_keys=True)
    try:
        return _schema_regex_cached(text, whitespace_pattern)
    except Exception as e:
        raise InvalidConstraintError(f"cannot turn the JSON schema into a regex: {e}") from None


# Keywords outlines_core's build_regex_from_schema accepts but does not enforce.
UNENFORCED_SCHEMA_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems"}
)
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SCHEMA_DATA = frozenset({"default", "const", "enum", "examples", "description", "title", "$comment"})


def _unenforced_keywords(schema: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(schema, list):
        for item in schema:
            found |= _unenforced_keywords(item)
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if key in _SCHEMA_DATA:
                continue
            if key in UNENFORCED_SCHEMA_KEYWORDS:
                found.add(key)
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                for sub in value.values():
                    found |= _unenforced_keywords(sub)
            elif isinstance(value, (dict, list)):
                found |= _unenforced_keywords(value)
    return found


def constraint_to_regex(kind: Any, spec: Any, whitespace_pattern: str | None = None) -> str:
    """Regex for a vLLM constraint: ``kind`` is a ``StructuredOutputOptions`` member (or its name),
    ``spec`` the grammar spec (CHOICE: a list or its JSON text; JSON: schema dict or text).

    Raises:
        InvalidConstraintError: grammar / structural_tag (unsupported), bad JSON schema, empty choice.
    """
    name = getattr(kind, "name", str(kind)).upper()
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
    if name == "JSON":
        return json_schema_to_regex(spec, whitespace_pattern)
    if name == "JSON_OBJECT":
        return json_schema_to_regex(JSON_OBJECT_SCHEMA, whitespace_pattern)
    if name in ("GRAMMAR", "STRUCTURAL_TAG"):
        what = "grammar" if name == "GRAMMAR" else "structural_tag"
        raise InvalidConstraintError(f"structured_outputs.{what} is not supported: {SUPPORTED_TEXT}")
    raise InvalidConstraintError(f"unsupported constraint kind {name}: {SUPPORTED_TEXT}")


def params_kind(so_params: Any) -> tuple[str, Any]:
    """(kind name, spec) of a ``StructuredOutputsParams`` (same precedence as vLLM's
    ``get_structured_output_key``).

    Raises:
        InvalidConstraintError: no constraint set.
    """
    if getattr(so_params, "json", None) is not None:
        return "JSON", so_params.json
    if getattr(so_params, "json_object", None):
        return "JSON_OBJECT", None
    if getattr(so_params, "regex", None) is not None:
        return "REGEX", so_params.regex
    if getattr(so_params, "choice", None) is not None:
        return "CHOICE", so_params.choice
    if getattr(so_params, "grammar", None) is not None:
        return "GRAMMAR", so_params.grammar
    if getattr(so_params, "structural_tag", None) is not None:
        return "STRUCTURAL_TAG", so_params.structural_tag
    raise InvalidConstraintError("no structured-output constraint given")


def params_to_regex(so_params: Any) -> tuple[str, str]:
    """(kind name, regex) for a ``StructuredOutputsParams``."""
    kind, spec = params_kind(so_params)
    return kind, constraint_to_regex(kind, spec, getattr(so_params, "whitespace_pattern", None))


def legacy_guided_to_structured_outputs(extra: dict[str, Any] | None):
    """``StructuredOutputsParams`` equivalent of the legacy ``guided_*`` fields in ``extra``, or None.

    Raises:
        VLLMValidationError: more than one kind given.
    """
    if not extra:
        return None
    kw: dict[str, Any] = {}
    for legacy, field in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if extra.get(legacy) is not None:
            kw[field] = extra[legacy]
    if not kw:
        return None
    if len(kw) > 1:
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(
            "You can only use one kind of guided decoding ('guided_json', 'guided_regex', "
            "'guided_choice' or 'guided_grammar')",
            parameter="guided_*",
        )
    if "json" in kw and not isinstance(kw["json"], (str, dict)):
        kw["json"] = json.dumps(kw["json"])
    if extra.get("guided_whitespace_pattern") is not None:
        kw["whitespace_pattern"] = extra["guided_whitespace_pattern"]
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**kw)
