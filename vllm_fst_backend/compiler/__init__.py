"""Stage 2: regex + options → :class:`CompiledAutomaton` (once per request, cached).

See :mod:`.compile` for the pipeline and ``docs/architecture.md`` for the contracts.
"""

from .cache import CompiledCache
from .compile import CompileBudgets, compile_regex, forget_verdicts, prepare
from .compiled import CompiledAutomaton
from .options import CompileOptions

__all__ = ["compile_regex", "CompileOptions", "CompiledAutomaton", "CompiledCache", "CompileBudgets", "prepare",
           "forget_verdicts"]
