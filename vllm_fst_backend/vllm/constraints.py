"""vLLM request → constraint: the kind and spec of a ``StructuredOutputsParams`` and the legacy
``guided_*`` request fields. The conversion to a regex is the compiler's
(``compiler/constraints.py``, re-exported here)."""

from __future__ import annotations

import json
from typing import Any

from vllm_fst_backend.compiler.constraints import (  # noqa: F401  (re-exported)
    JSON_OBJECT_SCHEMA,
    SUPPORTED_TEXT,
    check_input_limits,
    choice_to_regex,
    constraint_to_regex,
    json_schema_to_regex,
)
from vllm_fst_backend.compiler.regex_parse import escape_literal  # noqa: F401
from vllm_fst_backend.errors import InvalidConstraintError  # noqa: F401


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


def whitespace_of(so_params: Any) -> str | None:
    """The whitespace a request's JSON may have between tokens: its ``whitespace_pattern``; else none
    (``""``: compact JSON) when it sets ``disable_any_whitespace`` (a ``StructuredOutputsParams`` field that
    vLLM's own backends leave to the server's configuration, which vLLM refuses for fst); else None (the
    converter's default, ``[ ]?``)."""
    ws = getattr(so_params, "whitespace_pattern", None)
    if ws is None and getattr(so_params, "disable_any_whitespace", False) is True:
        return ""
    return ws


def params_to_regex(so_params: Any, disk: Any = None) -> tuple[str, str]:
    """(kind name, regex) for a ``StructuredOutputsParams``; ``disk``: the host's disk cache, where a
    schema's regex converted by another process is taken from (:func:`constraint_to_regex`)."""
    kind, spec = params_kind(so_params)
    return kind, constraint_to_regex(kind, spec, whitespace_of(so_params), disk=disk)


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
