"""Per-request compile options, and the boolean environment flags of the whole package."""

from __future__ import annotations

import hashlib
import numbers
import os
from dataclasses import dataclass, field

from ..errors import InvalidOptionError

__all__ = ["CompileOptions", "env_flag", "normalize_token_ids", "TRUE_WORDS", "FALSE_WORDS"]

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def env_flag(name: str, default: bool, strict: bool = False) -> bool:
    """Boolean environment variable ``name``: unset or empty -> ``default``; one of :data:`FALSE_WORDS`
    (any case, spaces stripped) -> False; anything else -> True, or with ``strict`` only one of
    :data:`TRUE_WORDS`.

    Raises:
        InvalidOptionError: ``strict`` and a value of neither word list (a server misconfiguration).
    """
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return default
    if v in FALSE_WORDS:
        return False
    if strict and v not in TRUE_WORDS:
        raise InvalidOptionError(f"{name} must be 0 or 1, got {v!r}")
    return True


def normalize_token_ids(ids, name: str) -> tuple[int, ...]:
    """``ids`` (an iterable of token ids) as a sorted tuple of distinct ints.

    Raises:
        InvalidOptionError: ``ids`` is not an iterable, is empty, or holds a bool, a non-integer or a
            negative id (the message names ``name``). Ids past the vocabulary are left to the compiler
            (it knows the vocabulary size: :func:`.compile.allowed_token_mask` ignores them).
    """
    if isinstance(ids, (str, bytes)):
        raise InvalidOptionError(f"{name} must be a list of token ids, got {ids!r}")
    try:
        items = list(ids)
    except TypeError:
        raise InvalidOptionError(f"{name} must be a list of token ids, got {ids!r}") from None
    if not items:
        raise InvalidOptionError(f"{name} must not be empty")
    out = set()
    for i in items:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
            raise InvalidOptionError(f"{name} must hold non-negative integer token ids, got {i!r}")
        out.add(int(i))
    return tuple(sorted(out))


@dataclass(frozen=True)
class CompileOptions:
    """Options of :func:`compile_regex` (hashable: part of the cache key).

    Attributes:
        canonical: only canonical tokenizations (paper 000 §3.3, 004 §6.5): every accepted token
            sequence is exactly what the tokenizer produces for its text. Default True.
        scripts: ``None`` (no filter) or a tuple of script names of
            ``unicode_filters.SCRIPT_NAMES`` (e.g. ``("latin",)``, ``("han", "hiragana_katakana")``):
            every character must belong to one of them (000 §4.2). Normalized to a sorted tuple of
            lower-case names.
        allow_ascii_byte_tokens: SentencePiece only, non-canonical mode: also allow byte-fallback
            tokens for ASCII bytes that have a piece (byte policy ``"all"`` instead of
            ``"no_ascii_with_piece"``, 000 §4.3). Ignored in canonical mode (policy ``"canonical"``).
        allowed_tokens: ``None`` (every token) or the token ids the output may use (vLLM's
            ``allowed_token_ids``; any iterable of ints, normalized to a sorted tuple of distinct ids):
            the automaton is built from these tokens only (the token DFA's composition drops the others,
            so the dead-end analysis sees only paths through them), plus the end-of-sequence ids, of which
            at least one must be among them for an output to end. Compared and shown by
            ``allowed_digest`` (sha256 of the ids, 16 hex digits), not by the ids themselves.

    Raises:
        InvalidOptionError: a non-bool flag, an unknown script name, an empty script tuple, an
            ``allowed_tokens`` that is empty or holds a negative or non-integer id.
    """

    canonical: bool = True
    scripts: tuple[str, ...] | None = None
    allow_ascii_byte_tokens: bool = False
    allowed_tokens: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    allowed_digest: str | None = field(default=None, init=False)

    def __post_init__(self):
        if not isinstance(self.canonical, bool):
            raise InvalidOptionError(f"canonical must be a bool, got {self.canonical!r}")
        if not isinstance(self.allow_ascii_byte_tokens, bool):
            raise InvalidOptionError(f"allow_ascii_byte_tokens must be a bool, got {self.allow_ascii_byte_tokens!r}")
        if self.scripts is not None:
            names = (self.scripts,) if isinstance(self.scripts, str) else self.scripts
            try:
                names = tuple(names)
            except TypeError:
                raise InvalidOptionError(f"scripts must be a tuple of script names, got {self.scripts!r}") from None
            from ..artifacts.unicode_filters import SCRIPT_NAMES

            norm = []
            for n in names:
                key = n.strip().lower() if isinstance(n, str) else n
                if key not in SCRIPT_NAMES:
                    raise InvalidOptionError(
                        f"unknown script {n!r}; valid script names: {', '.join(SCRIPT_NAMES)}"
                    )
                norm.append(key)
            if not norm:
                raise InvalidOptionError(f"scripts must name at least one script of {', '.join(SCRIPT_NAMES)}")
            object.__setattr__(self, "scripts", tuple(sorted(set(norm))))
        if self.allowed_tokens is not None:
            ids = normalize_token_ids(self.allowed_tokens, "allowed_tokens")
            object.__setattr__(self, "allowed_tokens", ids)
            digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]
            object.__setattr__(self, "allowed_digest", digest)

    @property
    def byte_policy(self) -> str:
        """The detokenizer byte policy these options select (000 §4.3)."""
        if self.canonical:
            return "canonical"
        return "all" if self.allow_ascii_byte_tokens else "no_ascii_with_piece"
