"""Compiled automata on disk, shared by the processes of one host: compile once per constraint per host.

In a vLLM server one constraint is needed by several processes: the API server's compile check (an
isolated compile process, :mod:`.service`), the engine core (``StructuredOutputManager`` compiles the
grammar) and, with forced-token jumps, every worker (the proposer keeps its own matcher). Compiling
in each costs the same 0.1-3 s every time; loading a stored automaton costs about a millisecond. The
first process that compiles a constraint writes it here; the others load it.

Format: one file per constraint, ``<key>.pkl``, a pickle (protocol 5) of the
:class:`~.compiled.CompiledAutomaton` with the per-tokenizer canonical helper left out (it is rebuilt
once per process from the artifacts, :func:`.canonical_product.canonical_helper`) and locks recreated.
The key is the SHA-256 of (format version, the compiler's source code, the tokenizer fingerprint,
regex, :class:`~.options.CompileOptions`): a changed compiler or tokenizer never loads an old file.
Files are written atomically (temporary file + rename). The regex a JSON schema converts to is stored
beside them, ``<key>.rx`` (key: the compiler's source code, the spec's text, the whitespace pattern, the
input limits): the engine core and the workers take it instead of converting again
(:func:`.constraints.constraint_to_regex` with ``disk``). The directory is created with mode 0700 and
only files in a directory owned by the current user are loaded (pickle trusts its input).

Bounded in bytes: ``max_bytes`` (``$VLLM_FST_DISK_CACHE_BYTES``, default 1 GiB); a scan of the directory
deletes the least recently used files down to it (by modification time; a load touches its file when it
is older than ``DiskCache.TOUCH_AFTER_S``). A process scans once it has written ``max_bytes /
DiskCache.EVICT_SHARE`` since its last scan (the compile process after its reply), so the directory may
exceed the budget by that share per writing process.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import InvalidOptionError
from .options import env_flag

__all__ = ["DiskCache", "default_cache_dir", "disk_cache_from_env", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))
_SOURCE_HASH: str | None = None


def _source_hash() -> str:
    """SHA-256 of the compiler's and artifacts' Python sources (computed once per process)."""
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        h = hashlib.sha256()
        pkg = Path(__file__).resolve().parent.parent
        for sub in ("compiler", "artifacts"):
            for p in sorted((pkg / sub).glob("*.py")):
                h.update(p.name.encode())
                h.update(p.read_bytes())
        _SOURCE_HASH = h.hexdigest()
    return _SOURCE_HASH


def _stem(*parts: str, tail: str = "") -> str:
    """A file stem: SHA-256 of (format version, the compiler's source code, ``parts`` each ended by a NUL,
    ``tail``), 40 hex digits."""
    h = hashlib.sha256()
    for part in (str(FORMAT_VERSION), _source_hash(), *parts):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    h.update(tail.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:40]


def default_cache_dir() -> Path:
    """``$VLLM_FST_DISK_CACHE_DIR``, else ``/dev/shm/vllm_fst_cache-<uid>`` (memory-backed, shared by the
    host's processes) when ``/dev/shm`` is writable, else ``<tmp>/vllm_fst_cache-<uid>``."""
    env = os.environ.get("VLLM_FST_DISK_CACHE_DIR", "").strip()
    if env:
        return Path(env).expanduser()
    name = f"vllm_fst_cache-{os.getuid()}"
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / name
    return Path(tempfile.gettempdir()) / name


class _Pickler(pickle.Pickler):
    def __init__(self, f, helper_type):
        super().__init__(f, protocol=5)
        self._helper_type = helper_type

    def persistent_id(self, obj):
        if self._helper_type is not None and isinstance(obj, self._helper_type):
            return "canon_helper"
        if isinstance(obj, _LOCK_TYPES):
            return "rlock" if isinstance(obj, _LOCK_TYPES[1]) else "lock"
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, artifacts):
        super().__init__(f)
        self._artifacts = artifacts

    def persistent_load(self, pid):
        if pid == "lock":
            return threading.Lock()
        if pid == "rlock":
            return threading.RLock()
        if pid == "canon_helper":
            from .canonical_product import canonical_helper
            from .token_trie import trie_for

            return canonical_helper(self._artifacts, trie_for(self._artifacts))
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def dumps(compiled: Any) -> bytes:
    """Serialize a :class:`~.compiled.CompiledAutomaton` (without the per-tokenizer helper)."""
    from .canonical_product import CanonHelper

    buf = io.BytesIO()
    _Pickler(buf, CanonHelper).dump(compiled)
    return buf.getvalue()


def loads(data: bytes, artifacts: Any) -> Any:
    """Inverse of :func:`dumps`; the canonical helper is that of ``artifacts`` (built once per process)."""
    return _Unpickler(io.BytesIO(data), artifacts).load()


def _read_fd(fd: int, size: int) -> bytes:
    """The ``size`` bytes of the file behind ``fd`` (one read on a local file; files are written once and
    renamed into place, so the size does not change under an open descriptor)."""
    parts, got = [], 0
    while got < size:
        chunk = os.read(fd, size - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class DiskCache:
    """Host-shared store of compiled automata (module docstring).

    Args:
        directory: where the files live (created with mode 0700).
        max_bytes: total size budget in bytes.

    Methods never raise on I/O problems (a cache that cannot be read or written is a miss, logged by
    the caller through the ``errors`` counter).
    """

    # a process scans the directory for eviction once it has written max_bytes / EVICT_SHARE since its last
    # scan: a scan stats every stored file (1.2 ms for 300 files, 12 ms for 3,000 on /dev/shm), which a
    # scan per store put on every compile's path in a long-running server; the budget may then be exceeded
    # by at most that share per writing process
    EVICT_SHARE = 64

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 1 << 30):
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)
        self.errors = 0
        self.scans = 0  # eviction scans of this process
        self._unscanned = 0  # bytes this process wrote since its last scan

    def key(self, regex: str, options: Any, artifacts: Any) -> str:
        """File stem for ``(regex, options)`` under the tokenizer of ``artifacts``."""
        return _stem(str(artifacts.fingerprint), repr(options), tail=regex)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.pkl"

    # --- the regexes of constraints (JSON schemas): converted once per host --------------------------

    def regex_key(self, *parts: str) -> str:
        """File stem of a constraint's regex: ``parts`` name the conversion's inputs (kind, spec text,
        whitespace pattern, limits, ...); the compiler's source code is part of the key."""
        return _stem("regex", *parts)

    def load_regex(self, rkey: str) -> str | None:
        """The regex stored under ``rkey`` (:meth:`store_regex`), else None."""
        if not self._dir_ok():
            return None
        try:
            with open(self.directory / f"{rkey}.rx", "rb") as fh:
                return fh.read().decode("utf-8", "surrogatepass")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError):
            self.errors += 1
            return None

    def store_regex(self, rkey: str, regex: str) -> None:
        """Store the regex a constraint converted to under ``rkey`` (atomically; counted in the byte
        budget like the automata)."""
        data = regex.encode("utf-8", "surrogatepass")
        if self._write(self.directory / f"{rkey}.rx", data):
            self._unscanned += len(data)

    def _write(self, path: Path, data: bytes) -> bool:
        """Write ``data`` to ``path`` in the directory atomically (temporary file + rename); False when the
        directory is not ours or on an OS error (counted in ``errors``)."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self._dir_ok():
                return False
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=path.suffix)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except OSError:
            self.errors += 1
            return False
        return True

    def _files(self, prefix: str = "") -> list[Path]:
        """The stored files (automata ``.pkl``, regexes ``.rx``) whose names start with ``prefix``."""
        return [p for ext in (".pkl", ".rx") for p in self.directory.glob(f"{prefix}*{ext}")]

    def _dir_ok(self) -> bool:
        try:
            st = self.directory.stat()
        except FileNotFoundError:
            return False
        return st.st_uid == os.getuid() and not (st.st_mode & 0o022)

    # a load touches its file (LRU by modification time) only when it is older than this: the engine loads
    # an automaton right after the API server's compile check wrote it, and every syscall on that path
    # lets a busy thread take the GIL
    TOUCH_AFTER_S = 60.0

    def load(self, key: str, artifacts: Any, max_bytes: int | None = None) -> Any:
        """The stored automaton of ``key`` or None (also when its file is over ``max_bytes`` bytes)."""
        if not self._dir_ok():
            return None
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError:
            self.errors += 1
            return None
        try:
            st = os.fstat(fd)
            if max_bytes is not None and st.st_size > max_bytes:
                return None
            data = _read_fd(fd, st.st_size)
            if time.time() - st.st_mtime > self.TOUCH_AFTER_S and os.utime in os.supports_fd:
                os.utime(fd)
        except OSError:
            self.errors += 1
            return None
        finally:
            os.close(fd)
        try:
            return loads(data, artifacts)
        except Exception:
            self.errors += 1
            return None

    def store(self, key: str, compiled: Any, evict: bool = True) -> int:
        """Write ``compiled`` under ``key`` (atomically); returns the bytes written (0 on failure or
        when the file alone exceeds the budget). ``evict``: then :meth:`maybe_evict` (the compile process
        passes False and calls it after its reply)."""
        try:
            data = dumps(compiled)
        except Exception:
            self.errors += 1
            return 0
        if len(data) > self.max_bytes or not self._write(self._path(key), data):
            return 0
        self._unscanned += len(data)
        if evict:
            self.maybe_evict()
        return len(data)

    def maybe_evict(self) -> bool:
        """Evict the least recently used files down to the budget if this process has written
        ``max_bytes / EVICT_SHARE`` bytes since its last scan (:attr:`EVICT_SHARE`); True if it scanned."""
        if self._unscanned * self.EVICT_SHARE < self.max_bytes:
            return False
        self._unscanned = 0
        self.scans += 1
        self._evict()
        return True

    def _evict(self) -> None:
        try:
            entries = []
            for p in self._files():
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, p))
            total = sum(e[1] for e in entries)
            if total <= self.max_bytes:
                return
            for _, size, p in sorted(entries, key=lambda e: e[0]):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
                total -= size
                if total <= self.max_bytes:
                    break
            # leftovers of writers that died between mkstemp and rename
            for p in self._files(".tmp-"):
                try:
                    if time.time() - p.stat().st_mtime > 600:
                        p.unlink()
                except FileNotFoundError:
                    pass
        except OSError:
            self.errors += 1

    def nbytes(self) -> int:
        """Bytes currently stored."""
        try:
            return sum(p.stat().st_size for p in self._files())
        except OSError:
            return 0


def disk_cache_from_env() -> DiskCache | None:
    """The served :class:`DiskCache` (``$VLLM_FST_DISK_CACHE``: ``1`` (default) or ``0`` to disable;
    ``$VLLM_FST_DISK_CACHE_DIR``; ``$VLLM_FST_DISK_CACHE_BYTES``, default 1 GiB), or None when disabled.

    Raises:
        InvalidOptionError: a malformed variable.
    """
    if not env_flag("VLLM_FST_DISK_CACHE", True):
        return None
    raw = os.environ.get("VLLM_FST_DISK_CACHE_BYTES", "").strip()
    try:
        max_bytes = int(raw) if raw else 1 << 30
    except ValueError:
        max_bytes = -1
    if max_bytes <= 0:
        raise InvalidOptionError(f"VLLM_FST_DISK_CACHE_BYTES must be a positive number of bytes, got {raw!r}")
    return DiskCache(default_cache_dir(), max_bytes)
