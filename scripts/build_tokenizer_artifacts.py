#!/usr/bin/env python
"""Build the FST backend's artifacts for one tokenizer.

Usage::

    python scripts/build_tokenizer_artifacts.py --tokenizer PATH [--out tokenizer_artifacts/NAME] [--force]

A thin wrapper around :func:`vllm_fst_backend.artifacts.build.main` (see that module for the steps,
the default NAME and the exit codes).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from vllm_fst_backend.artifacts.build import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
