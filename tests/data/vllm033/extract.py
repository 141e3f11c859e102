"""Regenerate the vLLM 0.33.0 source excerpts used by ``tests/test_vllm033_source.py``.

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm033
    python tests/data/vllm033/extract.py /tmp/vllm033/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl

Writes, next to this script:

* ``vllm/...``: a few whole modules of the wheel, verbatim (the test imports the structured-output
  manager and friends from them, against the installed vLLM);
* ``excerpts.json``: verbatim sources of the functions/classes the plugin wraps or relies on in the
  large modules, lines matching a few patterns, the top-level names of every vLLM module the plugin
  imports, and the SHA-256 of the wheel and of each source file read;
* ``LICENSE``: vLLM's license (Apache-2.0), from the wheel.

Only the Python standard library is used; nothing is imported from the wheel.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
import textwrap
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = HERE.parents[2] / "vllm_fst_backend"

WHOLE_FILES = [
    "vllm/v1/structured_output/__init__.py",
    "vllm/v1/structured_output/request.py",
    "vllm/v1/structured_output/utils.py",
    "vllm/v1/structured_output/backend_types.py",
    "vllm/config/structured_outputs.py",
    "vllm/entrypoints/serve/exception_handling/error_response.py",
    "vllm/v1/spec_decode/custom_class_proposer.py",
]

# (file, qualified name): a module-level def/class/assignment, or Class.member.
EXCERPTS = [
    ("vllm/sampling_params.py", "StructuredOutputsParams"),
    ("vllm/sampling_params.py", "SamplingParams._validate_structured_outputs"),
    ("vllm/v1/engine/input_processor.py", "InputProcessor.__init__"),
    ("vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest.extract_structured_outputs"),
    ("vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest.extract_structured_outputs"),
    ("vllm/entrypoints/openai/chat_completion/serving.py", "OpenAIServingChat.create_chat_completion"),
    ("vllm/entrypoints/openai/completion/serving.py", "OpenAIServingCompletion.create_completion"),
    ("vllm/entrypoints/serve/engine/serving.py", "BaseServing.__init__"),
    ("vllm/entrypoints/generate/beam_search/offline.py",
     "BeamSearchOfflineMixin._init_beam_search_structured_output"),
    ("vllm/v1/sample/rejection_sampler.py", "expand_batch_to_tokens"),
    ("vllm/v1/sample/rejection_sampler.py", "apply_sampling_constraints"),
    ("vllm/v1/sample/rejection_sampler.py", "sample_recovered_tokens"),
    ("vllm/v1/sample/rejection_sampler.py", "rejection_sample"),
    ("vllm/v1/sample/rejection_sampler.py", "_sample_recovered_tokens"),
    ("vllm/utils/cpu_triton_utils.py", "_expand_kernel_impl"),
    ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner.propose_draft_token_ids"),
    ("vllm/v1/worker/cpu_model_runner.py", "CPUModelRunner.load_model"),
    ("vllm/v1/worker/gpu_input_batch.py", "CachedRequestState"),
    ("vllm/v1/worker/gpu_input_batch.py", "InputBatch.req_ids"),
    ("vllm/config/speculative.py", "SpeculativeMethod"),
    ("vllm/config/vllm.py", "VllmConfig._get_v2_model_runner_unsupported_features"),
    ("vllm/v1/core/sched/scheduler.py", "Scheduler._handle_blocked_waiting_request"),
    ("vllm/v1/core/sched/scheduler.py", "Scheduler._reserve_prefill_lookahead"),
    ("vllm/v1/core/sched/scheduler.py", "Scheduler.get_grammar_bitmask"),
    ("vllm/v1/core/sched/scheduler.py", "Scheduler.update_from_output"),
    ("vllm/v1/core/sched/scheduler.py", "Scheduler.update_draft_token_ids"),
    ("vllm/v1/engine/core.py", "EngineCore.step"),
    ("vllm/v1/engine/core.py", "EngineCore.post_step"),
    ("vllm/v1/engine/core.py", "EngineCoreProc._process_engine_step"),
    ("vllm/v1/engine/core.py", "EngineCore.preprocess_add_request"),
    ("vllm/v1/engine/core.py", "EngineCoreProc._handle_request_validation_error"),
    ("vllm/outputs.py", "RequestError"),
    ("vllm/exceptions.py", "VLLMValidationError"),
    ("vllm/exceptions.py", "GracefulHTTPError"),
    ("vllm/plugins/__init__.py", "load_general_plugins"),
    ("vllm/v1/worker/worker_base.py", "WorkerWrapperBase.init_worker"),
    ("vllm/v1/worker/worker_base.py", "WorkerWrapperBase.init_device"),
    ("vllm/distributed/device_communicators/shm_broadcast.py", "SpinCondition.__init__"),
    ("vllm/distributed/device_communicators/shm_broadcast.py", "SpinCondition.wait"),
    ("vllm/v1/executor/multiproc_executor.py", "MultiprocExecutor.collective_rpc"),
]

# (file, regex): every matching line, verbatim (for code inside very long functions).
LINE_PATTERNS = [
    ("vllm/v1/worker/gpu_model_runner.py", r"custom_class|create_custom_proposer|drafter\.load_model"),
    ("vllm/v1/engine/core.py", r"except VLLMValidationError|_handle_request_validation_error\("),
    ("vllm/v1/engine/async_llm.py", r"except \(VLLMClientError"),
    ("vllm/v1/core/sched/scheduler.py",
     r"self\.(vllm_config|scheduler_config|parallel_config|connector) = |num_output_tokens\.append\("),
    ("vllm/v1/worker/gpu_model_runner.py",
     r"num_output_tokens = req_data\.num_output_tokens\[i\]|elif num_output_tokens < len\(req_state\.output_token_ids\)"
     r"|del req_state\.output_token_ids\[num_output_tokens:\]"),
    ("vllm/platforms/cpu.py", r"async_scheduling = False"),
    ("vllm/v1/worker/gpu_model_runner.py", r"apply_grammar_bitmask"),
    ("vllm/v1/executor/multiproc_executor.py", r"self\.response_mqs( = |\.append\()"),
    ("vllm/v1/engine/core.py", r"self\.model_executor = executor_class|self\.structured_output_manager = "),
    ("vllm/distributed/device_communicators/shm_broadcast.py", r"self\._spin_condition = SpinCondition\("),
]


def _qualname_nodes(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        yield f"{node.name}.{sub.name}", sub
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    yield t.id, node


def _source_of(text: str, node: ast.AST) -> str:
    lines = text.splitlines(keepends=True)
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return textwrap.dedent("".join(lines[first - 1 : node.end_lineno]))


def _top_level_names(tree: ast.Module) -> tuple[list[str], list[str]]:
    """Names bound at module level (also inside top-level if/try blocks) and the string constants of a
    module-level ``__getattr__`` (lazy attributes such as ``vllm.platforms.current_platform``)."""
    names: set[str] = set()
    lazy: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if node.name == "__getattr__":
                    lazy.update(c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str))
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names.add((a.asname or a.name).split(".")[0])
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return sorted(names), sorted(lazy)


def plugin_vllm_imports(package: Path = PACKAGE) -> dict[str, list[str]]:
    """``{module: [names]}`` of every vLLM import in the plugin package (``from vllm.x import y``,
    ``import vllm.x``, and ``("vllm.x", "Name")`` string pairs as in ``patches._patch_protocol``)."""
    out: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "vllm" or node.module.startswith("vllm.")
            ):
                out.setdefault(node.module, set()).update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "vllm" or a.name.startswith("vllm."):
                        out.setdefault(a.name, set())
            elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
            ):
                mod, name = node.elts[0].value, node.elts[1].value
                if mod.startswith("vllm.") and name.isidentifier():
                    out.setdefault(mod, set()).add(name)
    return {k: sorted(v) for k, v in sorted(out.items())}


def module_file(names: set[str], module: str) -> str | None:
    base = module.replace(".", "/")
    for cand in (base + ".py", base + "/__init__.py"):
        if cand in names:
            return cand
    return None


def main(wheel: str) -> None:
    wheel_sha = hashlib.sha256(Path(wheel).read_bytes()).hexdigest()
    zf = zipfile.ZipFile(wheel)
    names = set(zf.namelist())
    version = re.search(r"__version__ = version = '([^']+)'", zf.read("vllm/_version.py").decode()).group(1)
    texts: dict[str, str] = {}

    def text(path: str) -> str:
        if path not in texts:
            texts[path] = zf.read(path).decode("utf-8")
        return texts[path]

    for path in WHOLE_FILES:
        out = HERE / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text(path), encoding="utf-8")
    (HERE / "LICENSE").write_bytes(zf.read(f"vllm-{version}.dist-info/licenses/LICENSE"))

    excerpts = []
    for path, qualname in EXCERPTS:
        found = dict(_qualname_nodes(ast.parse(text(path))))
        if qualname not in found:
            raise SystemExit(f"{path}: {qualname} not found")
        excerpts.append({"path": path, "qualname": qualname, "source": _source_of(text(path), found[qualname])})

    lines = []
    for path, pattern in LINE_PATTERNS:
        rx = re.compile(pattern)
        lines.append({"path": path, "pattern": pattern,
                      "lines": [ln.strip() for ln in text(path).splitlines() if rx.search(ln)]})

    modules = {}
    for module, imported in plugin_vllm_imports().items():
        path = module_file(names, module)
        entry: dict = {"path": path, "imported": imported}
        if path is not None:
            entry["names"], entry["lazy"] = _top_level_names(ast.parse(text(path)))
            prefix = path[: -len("__init__.py")] if path.endswith("__init__.py") else None
            if prefix:  # a package: its submodules are importable names too
                entry["submodules"] = sorted({n[len(prefix):].split("/")[0].removesuffix(".py")
                                              for n in names if n.startswith(prefix) and n.endswith(".py")} - {"__init__"})
        modules[module] = entry

    data = {
        "vllm_version": version,
        "wheel": Path(wheel).name,
        "wheel_sha256": wheel_sha,
        "excerpts": excerpts,
        "lines": lines,
        "modules": modules,
        "file_sha256": {p: hashlib.sha256(t.encode("utf-8")).hexdigest() for p, t in sorted(texts.items())},
    }
    (HERE / "excerpts.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"vLLM {version}: {len(WHOLE_FILES)} files, {len(excerpts)} excerpts, {len(modules)} modules")


if __name__ == "__main__":
    main(sys.argv[1])
