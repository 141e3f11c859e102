"""Per-request options: the ``fst_*`` keys of ``SamplingParams.extra_args`` (``vllm_xargs`` in the
request body) and vLLM's ``allowed_token_ids`` (a compile input for fst). The boolean environment flags
(``env_flag``) live in :mod:`vllm_fst_backend.compiler.options` and are re-exported here."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from vllm_fst_backend.compiler.options import FALSE_WORDS, TRUE_WORDS, env_flag  # noqa: F401 (re-exported)
from vllm_fst_backend.compiler.options import normalize_token_ids
from vllm_fst_backend.errors import InvalidOptionError

OPTION_NAMES = ("fst_canonical", "fst_scripts", "fst_jump", "fst_allow_ascii_bytes")
_SCRIPT_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class FstRequestOptions:
    """Per-request options, parsed from ``SamplingParams.extra_args`` and ``allowed_token_ids``
    (``allowed_tokens``: a sorted tuple of distinct token ids, or None)."""

    canonical: bool = True
    scripts: tuple[str, ...] | None = None
    jump: bool = False
    allow_ascii_bytes: bool = False
    allowed_tokens: tuple[int, ...] | None = dataclasses.field(default=None, repr=False)

    def compile_options(self):
        """The compiler's ``CompileOptions`` (``jump`` is a runtime option, not a compile option)."""
        from vllm_fst_backend.compiler import CompileOptions

        return CompileOptions(
            canonical=self.canonical, scripts=self.scripts, allow_ascii_byte_tokens=self.allow_ascii_bytes,
            allowed_tokens=self.allowed_tokens,
        )

    @property
    def cache_key(self) -> tuple:
        return (self.canonical, self.scripts, self.allow_ascii_bytes, self.compile_options().allowed_digest)

    def text(self) -> str:
        """Short log form, e.g. ``canonical=True scripts=latin jump=True``."""
        parts = [f"canonical={self.canonical}"]
        if self.scripts:
            parts.append("scripts=" + ",".join(self.scripts))
        if self.allow_ascii_bytes:
            parts.append("allow_ascii_bytes=True")
        if self.allowed_tokens is not None:
            parts.append(f"allowed_tokens={len(self.allowed_tokens)}")
        if self.jump:
            parts.append("jump=True")
        return " ".join(parts)


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise InvalidOptionError(f"{name} must be a boolean (true/false), got {value!r}")


def _known_script_names() -> tuple[str, ...] | None:
    try:
        from vllm_fst_backend.artifacts.unicode_filters import SCRIPT_NAMES
    except Exception:  # artifacts stage not importable: syntactic check only
        return None
    return tuple(SCRIPT_NAMES)


def _parse_scripts(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        items = [s for s in (p.strip() for p in value.split(",")) if s]
    elif isinstance(value, (list, tuple)):
        if not all(isinstance(s, str) for s in value):
            raise InvalidOptionError(f"fst_scripts must be a list of script names, got {value!r}")
        items = [s.strip() for s in value if s.strip()]
    else:
        raise InvalidOptionError(f"fst_scripts must be a list or a comma-separated string, got {value!r}")
    if not items:
        return None
    names = []
    known = _known_script_names()
    for s in items:
        key = s.lower()
        if not _SCRIPT_RE.match(key) or (known is not None and key not in known):
            valid = f"; valid script names: {', '.join(known)}" if known else ""
            raise InvalidOptionError(f"fst_scripts: unknown script {s!r}{valid}")
        if key not in names:
            names.append(key)
    return tuple(sorted(names))


def fst_keys(extra_args: Any) -> list[str]:
    """The ``fst_*`` keys present in ``extra_args`` (sorted; [] when none or not a dict)."""
    if not isinstance(extra_args, dict):
        return []
    return sorted(k for k in extra_args if isinstance(k, str) and k.startswith("fst_"))


def parse_request_options(extra_args: dict[str, Any] | None, allowed_token_ids: Any = None) -> FstRequestOptions:
    """Parse the ``fst_*`` keys of ``extra_args`` (other keys are ignored: other extensions use them) and
    the request's ``allowed_token_ids`` (None: every token), which the constraint's automaton is built
    from (``CompileOptions.allowed_tokens``), so that the two never leave a step without a token.

    Raises:
        InvalidOptionError: an unknown ``fst_*`` key or a bad value (the message names both); an
            ``allowed_token_ids`` that is empty or holds a non-integer or negative id.
    """
    allowed = None
    if allowed_token_ids is not None:
        allowed = normalize_token_ids(allowed_token_ids, "allowed_token_ids")
    if not extra_args:
        return FstRequestOptions(allowed_tokens=allowed)
    if not isinstance(extra_args, dict):
        raise InvalidOptionError(f"extra_args must be an object, got {type(extra_args).__name__}")
    unknown = [k for k in fst_keys(extra_args) if k not in OPTION_NAMES]
    if unknown:
        raise InvalidOptionError(
            f"unknown fst option(s) {', '.join(unknown)}; valid options: {', '.join(OPTION_NAMES)}"
        )
    kw: dict[str, Any] = {}
    if "fst_canonical" in extra_args:
        kw["canonical"] = _parse_bool("fst_canonical", extra_args["fst_canonical"])
    if "fst_jump" in extra_args:
        kw["jump"] = _parse_bool("fst_jump", extra_args["fst_jump"])
    if "fst_allow_ascii_bytes" in extra_args:
        kw["allow_ascii_bytes"] = _parse_bool("fst_allow_ascii_bytes", extra_args["fst_allow_ascii_bytes"])
    if "fst_scripts" in extra_args:
        kw["scripts"] = _parse_scripts(extra_args["fst_scripts"])
    return FstRequestOptions(allowed_tokens=allowed, **kw)
