"""Named errors of the whole pipeline.

Every error the backend raises on bad input derives from :class:`FstBackendError`, so the vLLM
integration can turn all of them into HTTP 400 responses and the CLI into a clean message.
"""

from __future__ import annotations


class FstBackendError(Exception):
    """Base class of every error raised by vllm-fst-backend on bad input or bad artifacts."""


# --- artifacts (once per tokenizer) -------------------------------------------------------------


class UnsupportedTokenizerError(FstBackendError):
    """The tokenizer is not one of the supported kinds (byte-level BPE, SentencePiece BPE, tiktoken BPE)."""


class ArtifactError(FstBackendError):
    """Tokenizer artifacts are missing, corrupt, or were built for another tokenizer.

    The message always names the offending file and the exact command that rebuilds the artifacts.
    """


class OutputDirError(FstBackendError):
    """The artifact output directory cannot be created or written."""


# --- compiler (once per request) ----------------------------------------------------------------


class RegexError(FstBackendError):
    """Base class of errors about a request's regex. ``position`` is a 0-based character offset or None."""

    def __init__(self, message: str, position: int | None = None):
        super().__init__(message if position is None else f"{message} (at position {position})")
        self.position = position


class RegexSyntaxError(RegexError):
    """The regex does not parse."""


class UnsupportedRegexError(RegexError):
    """The regex uses a construct a finite automaton cannot express (backreference, lookaround, ...)."""


class CompileBudgetError(RegexError):
    """Compiling the regex exceeded the state or time budget (e.g. ``.{5000}`` or ``(a|b)*a(a|b){20}``)."""


class EmptyLanguageError(RegexError):
    """No token sequence satisfies the constraint (unsatisfiable regex, or empty under the filters)."""


class InvalidOptionError(FstBackendError):
    """A per-request option (``fst_canonical``, ``fst_scripts``, ...) has an unknown name or a bad value."""


class InvalidConstraintError(FstBackendError):
    """The request's constraint is malformed (not a string regex, an empty choice list, a schema that
    is not JSON) or of a kind the fst backend does not express (``grammar``, ``structural_tag``)."""


class CompileMemoryError(CompileBudgetError):
    """Compiling the constraint would exceed its memory budget (bytes of automaton arrays; see
    ``CompileBudgets.max_bytes`` / ``VLLM_FST_COMPILE_MEMORY_MB``). The message names the budget."""


class CompileServiceError(FstBackendError):
    """The isolated compile process (``compiler/service.py``) is unavailable: it could not start, or
    it died for a reason other than a budget (a server-side problem, HTTP 500 with the message)."""


# --- request inputs (checked before any conversion or compile) ----------------------------------


class InputTooLargeError(FstBackendError):
    """A request input exceeds a size limit checked in linear time before any work is done (regex
    length, schema text length or nesting depth, number of choices, ...).

    Attributes: ``limit_name`` (e.g. ``"max_regex_chars"``), ``env_var`` (the environment variable that
    sets it), ``limit`` and ``measured`` (same unit, named in the message).
    """

    def __init__(self, message: str, *, limit_name: str = "", env_var: str = "", limit: int | float = 0,
                 measured: int | float = 0):
        super().__init__(message)
        self.limit_name = limit_name
        self.env_var = env_var
        self.limit = limit
        self.measured = measured


class UnsupportedSchemaError(FstBackendError):
    """A JSON schema uses a keyword (or a combination) that fst cannot enforce *exactly* as a regular
    language. Never silently weakened: the message names the keyword and its JSON pointer.

    Attributes: ``keyword`` (e.g. ``"oneOf"``), ``pointer`` (e.g. ``"/properties/a"``), ``regular``
    (False when the schema is not a regular language at all, e.g. unbounded recursion: a fallback
    backend may serve it).
    """

    def __init__(self, message: str, *, keyword: str = "", pointer: str = "", regular: bool = True):
        super().__init__(message)
        self.keyword = keyword
        self.pointer = pointer
        self.regular = regular


class InvalidSchemaError(FstBackendError):
    """A JSON schema is malformed: not an object or boolean, a keyword whose value has the wrong type or
    range (``"minimum": "abc"``, ``"required": 5``, ``"type": "strin"``), or a ``$ref`` that does not
    resolve. The message says what is wrong and where.

    Attributes: ``keyword`` (e.g. ``"minimum"``) and ``pointer`` (JSON pointer of the schema holding it,
    e.g. ``"/properties/a"``; ``""`` for the root).
    """

    def __init__(self, message: str, *, keyword: str = "", pointer: str = ""):
        super().__init__(message)
        self.keyword = keyword
        self.pointer = pointer
