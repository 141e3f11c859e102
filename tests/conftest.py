"""Shared pytest fixtures: the three real tokenizers (offline) and quick artifact builds.

Fixtures (all session-scoped):

* ``repo_root`` -- the checkout's root directory.
* ``smollm2_dir`` -- ``models/SmolLM2-135M-Instruct`` (runs ``scripts/prepare_smollm2.py``'s ``prepare()``
  when the checkpoint is missing; skips if that is impossible).
* ``mistral_v1_path`` / ``tekken_path`` -- the SentencePiece v1 model and the Tekken JSON shipped in
  ``mistral_common``.
* ``tokenizer_paths`` -- ``{"smollm2": ..., "mistral_v1": ..., "tekken": ...}`` (SmolLM2 prepared lazily).
* ``smollm2_info`` / ``mistral_v1_info`` / ``tekken_info`` -- :class:`TokenizerInfo` of each.
* ``built_artifacts`` -- ``built_artifacts(name, canonical=False) -> Path``: artifacts of tokenizer
  ``name`` built once per session into a tmp dir (``canonical=False`` skips the slow canonical step).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))



def _mistral_data_dir() -> Path:
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mistral_common is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    out = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
    if not (out / "tokenizer.json").is_file():
        spec = importlib.util.spec_from_file_location("prepare_smollm2", REPO_ROOT / "scripts" / "prepare_smollm2.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        try:
            mod.prepare(out)
        except FileNotFoundError as e:
            pytest.skip(f"SmolLM2 checkpoint unavailable: {e}")
    return out


@pytest.fixture(scope="session")
def mistral_v1_path() -> Path:
    p = _mistral_data_dir() / "tokenizer.model.v1"
    if not p.is_file():
        pytest.skip(f"{p} missing")
    return p


@pytest.fixture(scope="session")
def tekken_path() -> Path:
    p = _mistral_data_dir() / "tekken_240911.json"
    if not p.is_file():
        pytest.skip(f"{p} missing")
    return p


@pytest.fixture(scope="session")
def tokenizer_paths(request) -> dict:
    """Name → path of the three real tokenizers (resolving the fixtures on first use)."""

    class _Lazy(dict):
        def __missing__(self, key):
            fixture = {"smollm2": "smollm2_dir", "mistral_v1": "mistral_v1_path", "tekken": "tekken_path"}[key]
            value = request.getfixturevalue(fixture)
            self[key] = value
            return value

    return _Lazy()


@pytest.fixture(scope="session")
def smollm2_info(smollm2_dir):
    from vllm_fst_backend.artifacts.tokenizer_info import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def mistral_v1_info(mistral_v1_path):
    from vllm_fst_backend.artifacts.tokenizer_info import load_tokenizer

    return load_tokenizer(mistral_v1_path)


@pytest.fixture(scope="session")
def tekken_info(tekken_path):
    from vllm_fst_backend.artifacts.tokenizer_info import load_tokenizer

    return load_tokenizer(tekken_path)


@pytest.fixture(scope="session")
def built_artifacts(tmp_path_factory, tokenizer_paths):
    """``built_artifacts(name, canonical=False) -> Path`` of a directory built once per session."""
    from vllm_fst_backend.artifacts.build import build_artifacts

    cache: dict = {}

    def get(name: str, canonical: bool = False) -> Path:
        key = (name, canonical)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"artifacts_{name}_{'canon' if canonical else 'quick'}")
            build_artifacts(tokenizer_paths[name], out, progress=False, canonical=canonical)
            cache[key] = out
        return cache[key]

    return get
