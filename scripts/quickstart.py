#!/usr/bin/env python
"""The embedded default, end to end: serve SmolLM2-135M-Instruct on vLLM CPU with
``--structured-outputs-config.backend fst`` and answer a ``guided_regex`` request and a choice request.

    python scripts/quickstart.py [--port 8000] [--log /tmp/vllm_fst_quickstart.log]

Expects what ``scripts/quickstart.sh`` prepares (the install, the model in
``models/SmolLM2-135M-Instruct`` and its artifacts in ``tokenizer_artifacts/SmolLM2-135M-Instruct``).
The server starts through ``scripts/vllm_server.py`` (the launcher the benchmarks and end-to-end tests
use) and stops when the answers are printed. Exit status 1 with the server log's tail when it cannot
start (:class:`ServerStartError`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "models/SmolLM2-135M-Instruct"
ARTIFACTS = "tokenizer_artifacts/SmolLM2-135M-Instruct"


def chat(base: str, question: str, **constraint) -> tuple[str, list[int] | None]:
    """One greedy chat completion (at most 40 tokens) with the constraint fields in the body:
    (answer text, its token ids)."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": question}],
            "temperature": 0, "max_tokens": 40, "return_token_ids": True, **constraint}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    out = json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]
    return out["message"]["content"], out.get("token_ids")


def main(argv=None) -> int:
    from scripts.vllm_server import ServerStartError, running_server

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    ap.add_argument("--log", default=os.environ.get("LOG", "/tmp/vllm_fst_quickstart.log"))
    args = ap.parse_args(argv)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL,
           "--served-model-name", "smollm2", "--max-model-len", "2048", "--port", str(args.port),
           "--structured-outputs-config.backend", "fst"]
    env = dict(os.environ, VLLM_FST_ARTIFACTS_DIR=ARTIFACTS)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    print(f"starting vLLM (CPU) with backend fst; log: {args.log} (takes ~100 s)", flush=True)
    try:
        with running_server(cmd, args.port, env, Path(args.log), timeout=900, cwd=ROOT) as (base, ready_s, _):
            print(f"server ready in {ready_s:.0f} s", flush=True)
            text, ids = chat(base, "What is the capital of France?", guided_regex="(Paris|London|Berlin)")
            print(f"guided_regex (Paris|London|Berlin) -> {text!r}  token ids {ids}")
            text, ids = chat(base, "Is the sky blue? Answer yes or no.", structured_outputs={"choice": ["yes", "no"]})
            print(f"choice [yes, no]                   -> {text!r}  token ids {ids}")
    except ServerStartError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
