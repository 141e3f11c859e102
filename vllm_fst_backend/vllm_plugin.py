"""Compatibility alias of :mod:`vllm_fst_backend.vllm` (the vLLM glue package).

Kept so that ``--speculative-config '{"method": "custom_class", "model":
"vllm_fst_backend.vllm_plugin.FstForcedTokenProposer", ...}'`` and the old entry point
``vllm_fst_backend.vllm_plugin:register`` keep working. No logic lives here.
"""

from vllm_fst_backend.vllm import (  # noqa: F401
    BACKEND_NAME,
    TESTED_VLLM_VERSION,
    VLLM_VERSION,
    VLLM_VERSION_OK,
    is_registered,
    register,
    unregister,
)
from vllm_fst_backend.vllm.backend import FstBackend, FstGrammar  # noqa: F401
from vllm_fst_backend.vllm.constraints import (  # noqa: F401
    InvalidConstraintError,
    choice_to_regex,
    constraint_to_regex,
    escape_literal,
    json_schema_to_regex,
    legacy_guided_to_structured_outputs,
)
from vllm_fst_backend.vllm.context import (  # noqa: F401
    TokenizerContext,
    load_or_build_artifacts,
    resolve_artifacts_dir,
    tokenizer_name,
)
from vllm_fst_backend.vllm.options import FstRequestOptions, parse_request_options  # noqa: F401
from vllm_fst_backend.vllm.proposer import FstForcedTokenProposer  # noqa: F401
from vllm_fst_backend.vllm.validation import validate_structured_outputs  # noqa: F401

__all__ = [
    "BACKEND_NAME",
    "FstBackend",
    "FstForcedTokenProposer",
    "FstGrammar",
    "FstRequestOptions",
    "InvalidConstraintError",
    "TokenizerContext",
    "choice_to_regex",
    "constraint_to_regex",
    "escape_literal",
    "json_schema_to_regex",
    "legacy_guided_to_structured_outputs",
    "load_or_build_artifacts",
    "parse_request_options",
    "register",
    "resolve_artifacts_dir",
    "tokenizer_name",
    "unregister",
    "validate_structured_outputs",
]
