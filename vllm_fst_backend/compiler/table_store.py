"""Per-tokenizer compiler tables on disk, memory-mapped and shared by the processes of one host.

The canonical product needs per-tokenizer tables derived from the canonical filter
(:class:`~.canonical_product.CanonHelper`: the word-major banned matrix ``int32[W, C]`` and a few
V-sized arrays). Building them costs 0.4 s for SmolLM2 and ~8 s for Tekken (whose banned matrix is
739 MB), and a server builds them in every process that compiles or advances a canonical automaton:
each compile process of the API server, the engine core, each worker with jumps. Here the first
process builds them and writes them as ``.npy`` files; every other process maps the files
(copy-on-write ``mmap``: the pages are shared through the page cache, a process that wrote into an
array would get a private copy of that page only), so preparation costs a few milliseconds and the
host holds the tables once.

Layout: ``<root>/<name>/`` with ``meta.json`` (scalars and the list of arrays with dtype and shape)
and one ``<attr>.npy`` per array; ``name`` = ``<kind>-<tokenizer fingerprint[:16]>-<key[:24]>`` where the
key hashes the format version, the compiler's and artifacts' sources and the artifacts manifest's file
checksums, so a changed compiler or tokenizer never maps old tables. A directory is written under a
temporary name and renamed into place (atomic); while one process builds, the others wait on a lock
file (``fcntl.flock``, at most ``wait_s``) and then map its result. Writing a new version removes the
older versions of the same tokenizer. Only directories owned by the current user and not writable
by others are read. The root is ``$VLLM_FST_SHARED_TABLES_DIR``, else ``<disk cache dir>/tables``
(:func:`.persist.default_cache_dir`, memory-backed ``/dev/shm`` when writable); ``$VLLM_FST_SHARED_TABLES=0``
turns the store off. A root without room for the tables (free space < 1.25 x their size + 64 MB)
is skipped: the process keeps its own in-memory tables, as without the store.

Never raises on I/O problems: a store that cannot be read or written costs the in-process build.

Cost: a mapped table uses 4 KB pages (``/dev/shm`` gets no transparent huge pages unless the host
enables them for shmem), while numpy's own large allocations get huge pages, and each page faults on
its first touch. Random reads through a mapping are therefore slower: with every table mapped the per-token
advance was markedly slower (profiled by hand, not benchmarked), so the canonical helper keeps only its
banned matrix mapped and copies the rest (:attr:`.canonical_product.CanonHelper.SHARED_ARRAYS`); the
dead-end analysis, which reads that matrix at scattered places, is somewhat slower on Tekken with the
mapped copy, against the matrix's memory (739 MB) and build time saved per process.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .options import env_flag

__all__ = ["shared_tables_root", "load_or_build", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_META = "meta.json"


def shared_tables_root() -> Path | None:
    """The store's root directory (module docstring), or None when ``$VLLM_FST_SHARED_TABLES`` is
    ``0``/``false``/``no``/``off``."""
    if not env_flag("VLLM_FST_SHARED_TABLES", True):
        return None
    env = os.environ.get("VLLM_FST_SHARED_TABLES_DIR", "").strip()
    if env:
        return Path(env).expanduser()
    from .persist import default_cache_dir

    return default_cache_dir() / "tables"


def _name(kind: str, artifacts: Any) -> tuple[str, str]:
    """``(prefix, name)``: the prefix is shared by every version of the tables of one tokenizer."""
    from .persist import _source_hash

    fp = str(getattr(artifacts, "fingerprint", ""))
    files = (getattr(artifacts, "manifest", None) or {}).get("files", {})
    h = hashlib.sha256()
    for part in (str(FORMAT_VERSION), kind, _source_hash(), fp, json.dumps(files, sort_keys=True, default=str)):
        h.update(part.encode())
        h.update(b"\0")
    prefix = f"{kind}-{fp[:16]}-"
    return prefix, prefix + h.hexdigest()[:24]


def _dir_ok(d: Path) -> bool:
    try:
        st = d.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not (st.st_mode & 0o022)


def _load(d: Path) -> tuple[dict, dict] | None:
    """``(scalars, arrays)`` of a complete store directory (arrays mapped copy-on-write), or None."""
    if not (_dir_ok(d.parent) and _dir_ok(d)):
        return None
    try:
        meta = json.loads((d / _META).read_text())
        if meta.get("format") != FORMAT_VERSION:
            return None
        arrays = {}
        for attr, (dtype, shape) in meta["arrays"].items():
            a = np.load(d / f"{attr}.npy", mmap_mode="c", allow_pickle=False)
            if a.dtype.str != dtype or list(a.shape) != list(shape):
                return None
            arrays[attr] = a.view(np.ndarray)  # plain ndarray over the mapping (numba types it as usual)
        return meta["scalars"], arrays
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(root: Path, prefix: str, name: str, scalars: dict, arrays: dict) -> bool:
    need = sum(int(a.nbytes) for a in arrays.values())
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _dir_ok(root) or shutil.disk_usage(root).free < 1.25 * need + (64 << 20):
            return False
        tmp = root / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        try:
            for attr, a in arrays.items():
                np.save(tmp / f"{attr}.npy", np.ascontiguousarray(a), allow_pickle=False)
            meta = {"format": FORMAT_VERSION, "scalars": scalars,
                    "arrays": {k: [a.dtype.str, list(a.shape)] for k, a in arrays.items()}}
            (tmp / _META).write_text(json.dumps(meta))
            shutil.rmtree(root / name, ignore_errors=True)  # an invalid copy (the caller holds the lock)
            os.rename(tmp, root / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        return False
    # older versions of this tokenizer's tables (processes that still map them keep their pages)
    for old in root.glob(prefix + "*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    for old in root.glob(".tmp-*"):
        try:
            if time.time() - old.stat().st_mtime > 600:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    return True


def load_or_build(kind: str, artifacts: Any, build: Callable[[], tuple[dict, dict]],
                  root: Path | None = None, wait_s: float = 300.0) -> tuple[tuple[dict, dict], str]:
    """The tables ``kind`` of ``artifacts``: mapped from the store, or built (``build()``) and stored.

    Args:
        kind: table family (a file-name-safe word, e.g. ``"canon"``).
        artifacts: the tokenizer artifacts (``fingerprint``, ``manifest``).
        build: returns ``(scalars, arrays)``: JSON-serializable scalars (dict) and numpy arrays (dict of
            attribute name → ndarray); called at most once, only when the store has no valid copy.
        root: the store's root (default :func:`shared_tables_root`; None there = no store).
        wait_s: longest wait (s) for another process that is building the same tables; after it this
            process builds its own.

    Returns:
        ``((scalars, arrays), how)`` with ``how`` one of ``"mapped"`` (read from the store),
        ``"stored"`` (built here, written, and mapped back: the host shares this copy) or ``"built"``
        (built here, not stored: store off, no room, or an I/O error).
    """
    root = shared_tables_root() if root is None else root
    if root is None:
        return build(), "built"
    prefix, name = _name(kind, artifacts)
    d = root / name
    got = _load(d)
    if got is not None:
        return got, "mapped"
    lock_fh = None
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_fh = open(root / f".{prefix}lock", "a+")
        t_end = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > t_end:
                    lock_fh.close()
                    lock_fh = None
                    break
                time.sleep(0.05)
    except OSError:
        if lock_fh is not None:
            lock_fh.close()
        lock_fh = None
    try:
        got = _load(d)  # built by the process we waited for
        if got is not None:
            return got, "mapped"
        scalars, arrays = build()
        if _write(root, prefix, name, scalars, arrays):
            got = _load(d)
            if got is not None:
                return got, "stored"
        return (scalars, arrays), "built"
    finally:
        if lock_fh is not None:
            try:
                fcntl.flock(lock_fh, fcntl.LOCK_UN)
            finally:
                lock_fh.close()
