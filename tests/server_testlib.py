"""A real vLLM CPU server with ``--structured-outputs-config.backend fst`` for the end-to-end test
modules (``test_vllm_e2e.py``, ``test_vllm_tools_e2e.py``, ``test_stress_e2e.py``): the command line, the environment and the
readiness wait in one place (the start itself is ``scripts/vllm_server.running_server``)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import types
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 900
PROPOSER_CLASS = "vllm_fst_backend.vllm_plugin.FstForcedTokenProposer"
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")  # SmolLM2's end-of-turn and end-of-text tokens


def load_tokenizer():
    """SmolLM2's own tokenizer (the oracle for canonicality)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


def eos_ids_of(tokenizer) -> set[int]:
    """The token ids of :data:`EOS_TOKENS`."""
    ids = {tokenizer.convert_tokens_to_ids(t) for t in EOS_TOKENS}
    assert None not in ids and len(ids) == len(EOS_TOKENS), ids
    return ids


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def eos_ids(tok) -> set[int]:
    return eos_ids_of(tok)


def e2e_opted_out() -> bool:
    """``VLLM_FST_E2E=0`` opts out of the end-to-end modules."""
    return os.environ.get("VLLM_FST_E2E", "1").strip().lower() in ("0", "false", "no", "off")


def stack_problems() -> list[str]:
    """What is missing for the end-to-end tests (empty when everything is there)."""
    import importlib
    from importlib.metadata import entry_points

    problems = []
    try:
        importlib.import_module("vllm")
    except Exception as e:
        problems.append(f"vLLM is not importable ({e}); run: bash scripts/install.sh")
    try:
        comp = importlib.import_module("vllm_fst_backend.compiler")
        if not hasattr(comp, "compile_regex"):
            problems.append("vllm_fst_backend.compiler.compile_regex is missing")
    except Exception as e:
        problems.append(f"vllm_fst_backend.compiler is not importable ({e})")
    try:
        importlib.import_module("vllm_fst_backend.runtime.matcher")
    except Exception as e:
        problems.append(f"vllm_fst_backend.runtime.matcher is not importable ({e})")
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "fst"]
    if not eps:
        problems.append("the 'fst' vLLM plugin entry point is not installed; run: pip install -e .[cpu,model,test]")
    elif eps[0].value != "vllm_fst_backend.vllm:register":
        problems.append(f"the 'fst' entry point points elsewhere: {eps[0].value}")
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        if not (MODEL / f).is_file():
            problems.append(f"{MODEL / f} is missing; run: python scripts/prepare_smollm2.py")
    return problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def fst_server(artifacts: Path, tmp: Path, *, jump_tokens: int = 0, env: dict | None = None,
               args: tuple[str, ...] = ()):
    """Start the server on the canonical ``artifacts`` (``VLLM_FST_AUTO_BUILD=0``: it never builds its
    own), yield ``SimpleNamespace(base, log, proc, artifacts, model, disk_cache)``; stop it on exit.

    Args:
        jump_tokens: > 0 starts the forced-token proposer with that many speculative tokens.
        env: extra environment variables of the server (e.g. ``VLLM_FST_FALLBACK``).
        args: extra command-line arguments of ``vllm serve`` (e.g. a tool-call parser).

    ``--enforce-eager``: ready in ~35 s instead of ~100-190 s (torch.compile); structured outputs are not
    affected. ``PROMETHEUS_MULTIPROC_DIR`` is fresh, so ``/metrics`` shows the engine's and workers'
    counters too; the host disk cache of compiled automata is a fresh directory as well.
    """
    problems = stack_problems()
    assert not problems, "end-to-end stack incomplete:\n" + "\n".join(problems)
    assert (artifacts / "manifest.json").is_file(), f"no artifacts were built in {artifacts}"
    from scripts.vllm_server import ServerStartError, running_server

    port = free_port()
    log_path = tmp / "server.log"
    prom_dir = tmp / "prometheus"
    prom_dir.mkdir()
    disk = tmp / "disk_cache"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(MODEL), "--max-model-len", "2048", "--port", str(port),
        "--structured-outputs-config.backend", "fst", "--enforce-eager",
    ]  # fmt: skip
    if jump_tokens:
        spec = {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": jump_tokens}
        cmd += ["--speculative-config", json.dumps(spec)]
    cmd += list(args)
    full_env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="2",
        HF_HUB_OFFLINE="1",
        VLLM_FST_ARTIFACTS_DIR=str(artifacts),
        VLLM_FST_AUTO_BUILD="0",
        PROMETHEUS_MULTIPROC_DIR=str(prom_dir),
        VLLM_FST_DISK_CACHE_DIR=str(disk),
        **(env or {}),
    )
    try:
        with running_server(cmd, port, full_env, log_path, START_TIMEOUT_S, cwd=REPO_ROOT, poll_s=2.0) as (
            base, ready_s, proc,
        ):
            print(f"\nvLLM server ready in {ready_s:.0f} s (port {port}, log {log_path})")
            yield types.SimpleNamespace(base=base, log=log_path, proc=proc, artifacts=artifacts, model=str(MODEL),
                                        disk_cache=disk)
    except ServerStartError as e:
        pytest.fail(str(e))


def group_rss_bytes(pid: int) -> int:
    """Resident memory of the process ``pid`` and all its descendants (API server, engine core,
    compile processes), in bytes."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


# ---- checks of a server's outputs and metrics (shared by the e2e modules) --------------------------------


def outputs_of(r, eos_ids) -> list[tuple[str, list[int]]]:
    """(text, token ids without the final EOS) of every choice; each choice must have stopped."""
    assert r.status_code == 200, r.text
    outs = []
    for c in r.json()["choices"]:
        text = c["message"]["content"] if "message" in c else c["text"]
        ids = c["token_ids"]
        assert ids is not None, f"no token_ids in the response (return_token_ids): {c}"
        assert c["finish_reason"] == "stop", f"did not stop ({c['finish_reason']}): {text!r} {ids}"
        outs.append((text, without_eos(ids, eos_ids)))
    return outs


def without_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    """``ids`` less a final EOS; no EOS may remain inside."""
    if ids and ids[-1] in eos_ids:
        ids = ids[:-1]
    assert not set(ids) & eos_ids, f"EOS inside the output: {ids}"
    return ids


def assert_canonical(tok, text: str, ids: list[int]) -> None:
    assert tok.decode(ids) == text, (text, ids)
    canon = tok.encode(text, add_special_tokens=False)
    assert ids == canon, (
        f"non-canonical tokenization of {text!r}: got {[tok.decode([i]) for i in ids]} {ids}, "
        f"canonical {[tok.decode([i]) for i in canon]} {canon}"
    )


def metrics(server) -> dict[str, float]:
    import requests

    out: dict[str, float] = {}
    for line in requests.get(server.base + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            base = name.split("{", 1)[0]
            out[base] = out.get(base, 0.0) + float(value)
    return out


def metrics_after(server, before: dict[str, float], finished: int) -> dict[str, float]:
    """Metrics once ``finished`` more requests are recorded (the API server records a step's stats
    after handing its outputs to the waiting requests, so a reply can come first)."""
    key = "vllm:request_success_total"
    deadline = time.monotonic() + 10
    while True:
        m = metrics(server)
        if m.get(key, 0.0) - before.get(key, 0.0) >= finished or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def metric_delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


LONG_PREFACE = "You answer with one JSON object and nothing else. " * 30  # ~330 prompt tokens to prefill


def heavy_schemas(field: str, n: int, text_len: int = 180) -> list[dict]:
    """``n`` distinct JSON schemas whose bounded strings unroll into automaton states (tens of ms of compile
    each): ``{field}_{i}`` (a string), ``remark`` (a longer string), ``rank`` (a bounded integer)."""
    return [{"type": "object", "properties": {f"{field}_{i}": {"type": "string", "maxLength": 20 + i},
                                              "remark": {"type": "string", "maxLength": text_len + i},
                                              "rank": {"type": "integer", "minimum": 1, "maximum": 9 + i}},
             "required": [f"{field}_{i}", "rank"], "additionalProperties": False} for i in range(n)]


def new_schema_burst(server, tag: str, n: int = 6, xargs: dict | None = None) -> tuple[float, float, dict]:
    """``n`` concurrent requests, each with a new heavy JSON schema (bounded strings: tens of ms of compile
    each, queued in the compile processes) and a long distinct prompt (~330 tokens to prefill), one of them
    through the completions endpoint with n = 2; ``xargs`` go to every request (``vllm_xargs``). Asserts
    that every output is canonical and valid against its schema. Returns the deltas of
    ``vllm_fst_first_samples_in_step_total`` and ``vllm_fst_late_first_samples_total`` and the metrics after
    (``tag`` makes the schemas new to a server that ran this before). Asserts that at least one request
    was prefilled while its constraint still compiled (~330 prompt tokens): how many more are depends on
    the timing of the burst (the API server overlaps only the checks that start soon,
    ``vllm/pending.CheckQueue``; a check that ends before its request is scheduled leaves nothing pending)."""
    import jsonschema
    import requests
    from concurrent.futures import ThreadPoolExecutor
    tok = load_tokenizer()
    eos_ids = eos_ids_of(tok)
    warm = requests.post(server.base + "/v1/chat/completions", timeout=120, json={
        "model": server.model, "max_tokens": 4, "messages": [{"role": "user", "content": "yes or no?"}],
        "structured_outputs": {"regex": "(yes|no)"}})
    assert warm.status_code == 200, warm.text  # the request path warmed up
    before = metrics(server)
    schemas = heavy_schemas(f"{tag}_item", n)
    preface = LONG_PREFACE
    extra = {"vllm_xargs": xargs} if xargs else {}

    def one(i: int):
        prompt = f"Request {i} of {n}. " + preface + f"Give {tag}_item_{i} and rank."
        if i == n - 1:  # the completions endpoint, two samples (two engine requests on one constraint)
            body = {"model": server.model, "max_tokens": 256, "temperature": 1.0, "return_token_ids": True, "n": 2,
                    "prompt": prompt + "\n", "structured_outputs": {"json": schemas[i]}, **extra}
            return requests.post(server.base + "/v1/completions", json=body, timeout=120)
        body = {"model": server.model, "max_tokens": 256, "temperature": 0.0 if i % 2 else 1.0, "return_token_ids": True,
                "messages": [{"role": "user", "content": prompt}], **extra,
                "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}}}
        return requests.post(server.base + "/v1/chat/completions", json=body, timeout=120)

    with ThreadPoolExecutor(n) as ex:
        results = list(ex.map(one, range(n)))
    for i, res in enumerate(results):
        outs = outputs_of(res, eos_ids)
        assert len(outs) == (2 if i == n - 1 else 1)
        for text, ids in outs:
            assert_canonical(tok, text, ids)
            jsonschema.validate(json.loads(text), schemas[i])
    after = metrics_after(server, before, n + 1)
    in_step = metric_delta(after, before, "vllm_fst_first_samples_in_step_total")
    late = metric_delta(after, before, "vllm_fst_late_first_samples_total")
    pending = metric_delta(after, before, "vllm_fst_pending_prefill_tokens_total")
    print(f"\nfirst samples ({tag}): {in_step:.0f} in their step, {late:.0f} dropped (grammar late), {pending:.0f} pending prefill tokens")
    assert pending > 300
    return in_step, late, {"before": before, "after": after}
