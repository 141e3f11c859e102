"""On-disk tokenizer artifacts: one directory per tokenizer, written once, memory-mapped at serve time.

Layout of ``tokenizer_artifacts/NAME/`` (see also ``tokenizer_artifacts/README.md``):

==============================  ==========================================================================
file                            content
==============================  ==========================================================================
``manifest.json``               format version, tokenizer fingerprint + path + kind, vocab size,
                                ``prepend_space``, build options, per-file sha256 + size, build seconds
                                per step, summary; which file holds which FST / array. Written LAST.
``token_data.npy``              ``uint8[N]``: the surface bytes of all tokens, concatenated
``token_offsets.npy``           ``int64[V+1]``: token ``i`` is ``token_data[off[i]:off[i+1]]``
``alphabet_row.npy``            ``int32[W]`` row (vLLM layout): tokens inside the constraint alphabet
                                (bit 0 ⇔ special/control token, ``token_bytes[i] is None``)
``eos_ids.npy``                 ``int32[k]``
``byte_fallback.npy``           ``int32[256]``: byte → SentencePiece ``<0xNN>`` token id, -1 if none
``canon_<name>.npy``            the arrays of :meth:`CanonicalFilter.arrays` (``canon_token_class.npy``,
                                ``canon_banned_rows.npy``, ...), memory-mapped on load
``detokenizer.fst``             the byte → token transducer (:mod:`.detokenizer`); for tokenizers with
                                byte fallback one ``detokenizer_<policy>.fst`` per distinct byte policy
``utf8.fst``                    UTF-8 validity acceptor (:func:`unicode_filters.utf8_fst`)
``script_<name>.fst``           one per name of :data:`unicode_filters.SCRIPT_NAMES`
==============================  ==========================================================================

Writing is crash-safe: the old manifest is removed first, every file is written to a temporary name and
renamed into place, and the new manifest is renamed into place last; a directory without a valid manifest
is never loaded. Loading checks the format version, every file's sha256 (about 0.1 s for 60 MB) and,
when the tokenizer path is given, its fingerprint; every failure is an :class:`ArtifactError` naming the
file and giving the rebuild command.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import ArtifactError, InvalidOptionError, OutputDirError
from .bitrows import bool_from_row, row_from_bool

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BUILD_SCRIPT = "scripts/build_tokenizer_artifacts.py"


def rebuild_command(tokenizer_path: str | os.PathLike | None, directory: str | os.PathLike) -> str:
    """The exact shell command that (re)builds the artifacts of ``tokenizer_path`` into ``directory``."""
    tok = str(tokenizer_path) if tokenizer_path is not None else "<PATH>"
    return f"python {BUILD_SCRIPT} --tokenizer {tok} --out {directory}"


def tokenizer_fingerprint(tokenizer_path: str | os.PathLike) -> str:
    """sha256 (hex) of the tokenizer file at ``tokenizer_path`` (a file or a model directory), equal to
    :attr:`TokenizerInfo.fingerprint`. Raises FileNotFoundError."""
    from .tokenizer_info import resolve_tokenizer_file

    return _sha256_file(resolve_tokenizer_file(tokenizer_path))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()


def _normalize(obj):
    """JSON round trip (tuples → lists, keys → str) so options compare equal to what the manifest holds."""
    return json.loads(json.dumps(obj, sort_keys=True))


def _read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_artifacts(
    directory: str | os.PathLike,
    info,
    *,
    detokenizers: dict,
    utf8=None,
    scripts: dict | None = None,
    canonical=None,
    options: dict | None = None,
    build_seconds: dict | None = None,
    summary: dict | None = None,
) -> dict:
    """Write the artifacts of the tokenizer ``info`` (a :class:`TokenizerInfo`) into ``directory``.

    Args:
        directory: created if missing.
        info: the tokenizer (token bytes, EOS, byte fallback, fingerprint, path, kind).
        detokenizers: ``byte_policy -> pynini.Fst``; policies whose FSTs serialize identically share one
            file (``detokenizer.fst`` when all are identical, else ``detokenizer_<policy>.fst``).
        utf8: the UTF-8 acceptor, or None to leave it out.
        scripts: ``script name -> pynini.Fst`` (``script_<name>.fst``), or None.
        canonical: a :class:`CanonicalFilter` (arrays stored as ``canon_<name>.npy``), or None.
        options: the build options (compared by :func:`is_up_to_date`).
        build_seconds: seconds per build step (recorded only).
        summary: figures for humans (recorded only).

    Returns:
        The manifest (dict) as written.

    Raises:
        OutputDirError: ``directory`` cannot be created or written.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        old = _read_manifest(directory)
        (directory / MANIFEST).unlink(missing_ok=True)
    except OSError as e:
        raise OutputDirError(f"cannot write artifacts into {directory}: {e}") from None

    V = info.vocab_size
    files: dict[str, dict] = {}

    def put(name: str, data: bytes) -> str:
        try:
            _write_atomic(directory / name, data)
        except OSError as e:
            raise OutputDirError(f"cannot write {directory / name}: {e}") from None
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        return name

    # token bytes
    lens = np.fromiter((len(b) if b is not None else 0 for b in info.token_bytes), dtype=np.int64, count=V)
    offsets = np.zeros(V + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    data = np.frombuffer(b"".join(b for b in info.token_bytes if b), dtype=np.uint8)
    alphabet = np.fromiter((b is not None for b in info.token_bytes), dtype=bool, count=V)
    byte_fallback = np.full(256, -1, dtype=np.int32)
    for b, tid in info.byte_fallback.items():
        byte_fallback[b] = tid
    put("token_data.npy", _npy_bytes(data))
    put("token_offsets.npy", _npy_bytes(offsets))
    put("alphabet_row.npy", _npy_bytes(row_from_bool(alphabet)))
    put("eos_ids.npy", _npy_bytes(np.asarray(info.eos_ids, dtype=np.int32)))
    put("byte_fallback.npy", _npy_bytes(byte_fallback))

    # detokenizers, deduplicated by content
    by_id: dict[int, bytes] = {}
    for f in detokenizers.values():
        if id(f) not in by_id:
            by_id[id(f)] = f.write_to_string()
    blobs = {p: by_id[id(f)] for p, f in detokenizers.items()}
    unique = list(dict.fromkeys(blobs.values()))
    det_files: dict[str, str] = {}
    for p, blob in blobs.items():
        first = next(q for q, b in blobs.items() if b == blob)  # policies sharing content share the file
        name = "detokenizer.fst" if len(unique) == 1 else f"detokenizer_{first}.fst"
        if name not in files:
            put(name, blob)
        det_files[p] = name

    utf8_file = put("utf8.fst", utf8.write_to_string()) if utf8 is not None else None
    script_files = {n: put(f"script_{n}.fst", f.write_to_string()) for n, f in (scripts or {}).items()}

    canon_files = None
    canon_stats = None
    if canonical is not None:
        canon_files = {}
        for k, a in canonical.arrays().items():
            canon_files[k] = put(k if k.startswith("canon_") else f"canon_{k}.npy", _npy_bytes(a))
        canon_stats = _normalize(getattr(canonical, "stats", {}) or {})

    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": info.fingerprint,
        "tokenizer_path": str(Path(info.path).resolve()),
        "kind": info.kind,
        "vocab_size": V,
        "prepend_space": bool(info.prepend_space),
        "options": _normalize(options or {}),
        "detokenizers": det_files,
        "utf8": utf8_file,
        "scripts": script_files,
        "canonical": canon_files,
        "canonical_stats": canon_stats,
        "files": files,
        "build_seconds": _normalize(build_seconds or {}),
        "summary": _normalize(summary or {}),
    }
    # remove files of the previous build that this one does not have (and stray temp files)
    keep = set(files) | {MANIFEST}
    stale = set((old or {}).get("files", {})) - keep
    stale |= {p.name for p in directory.glob(".*.tmp-*")}
    for name in stale:
        try:
            (directory / name).unlink(missing_ok=True)
        except OSError:
            pass
    try:
        _write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8"))
    except OSError as e:
        raise OutputDirError(f"cannot write {directory / MANIFEST}: {e}") from None
    return manifest


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


class TokenizerArtifacts:
    """A loaded artifacts directory (see the module docstring). Arrays are memory-mapped read-only,
    FSTs and the canonical filter are read lazily on first use and cached (thread-safe).

    Attributes / properties:
        directory (Path), manifest (dict), kind (str), vocab_size (int V), fingerprint (str, sha256 hex),
        prepend_space (bool), eos_ids (int32[k]), byte_fallback (int32[256], -1 = none),
        alphabet_row (int32[W]), token_bytes (list[bytes | None] of length V), nbytes_on_disk (int).
    """

    def __init__(self, directory: Path, manifest: dict, tokenizer_path: str | os.PathLike | None = None):
        self.directory = Path(directory)
        self.manifest = manifest
        self._tokenizer_path = tokenizer_path if tokenizer_path is not None else manifest.get("tokenizer_path")
        self._lock = threading.Lock()
        self._fsts: dict[str, object] = {}

    # --- errors --------------------------------------------------------------------------------------

    def _error(self, name: str, problem: str) -> ArtifactError:
        return ArtifactError(
            f"tokenizer artifacts {self.directory / name}: {problem}; rebuild them with: "
            f"{rebuild_command(self._tokenizer_path, self.directory)}"
        )

    # --- metadata ------------------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """Tokenizer kind (``byte_level_bpe``, ``sentencepiece_bpe``, ``tekken``)."""
        return self.manifest["kind"]

    @property
    def vocab_size(self) -> int:
        """V, number of token ids."""
        return int(self.manifest["vocab_size"])

    @property
    def fingerprint(self) -> str:
        """sha256 (hex) of the tokenizer file the artifacts were built from."""
        return self.manifest["fingerprint"]

    @property
    def prepend_space(self) -> bool:
        """True for SentencePiece's dummy prefix (a space before the text)."""
        return bool(self.manifest["prepend_space"])

    @property
    def nbytes_on_disk(self) -> int:
        """Total size in bytes of all files of the directory listed in the manifest, manifest included."""
        size = sum(int(f["size"]) for f in self.manifest["files"].values())
        try:
            size += (self.directory / MANIFEST).stat().st_size
        except OSError:
            pass
        return size

    # --- arrays --------------------------------------------------------------------------------------

    def _npy(self, name: str) -> np.ndarray:
        if name not in self.manifest["files"]:
            raise self._error(name, "not listed in the manifest")
        try:
            return np.load(self.directory / name, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise self._error(name, "file is missing") from None
        except (OSError, ValueError) as e:
            raise self._error(name, f"cannot be read ({e})") from None

    @cached_property
    def eos_ids(self) -> np.ndarray:
        """``int32[k]``: end-of-sequence token ids."""
        return np.asarray(self._npy("eos_ids.npy"), dtype=np.int32)

    @cached_property
    def byte_fallback(self) -> np.ndarray:
        """``int32[256]``: byte → SentencePiece ``<0xNN>`` token id; -1 where there is none."""
        return self._npy("byte_fallback.npy")

    @cached_property
    def alphabet_row(self) -> np.ndarray:
        """``int32[W]`` (vLLM layout): bit ``i`` set ⇔ token ``i`` is inside the constraint alphabet."""
        return self._npy("alphabet_row.npy")

    @cached_property
    def token_bytes(self) -> list[bytes | None]:
        """Surface bytes of every token (``list`` of length V); ``None`` for special/control tokens."""
        data = self._npy("token_data.npy").tobytes()
        off = self._npy("token_offsets.npy").tolist()
        alpha = bool_from_row(self.alphabet_row, self.vocab_size).tolist()
        return [data[off[i] : off[i + 1]] if alpha[i] else None for i in range(self.vocab_size)]

    # --- FSTs ----------------------------------------------------------------------------------------

    def _fst(self, name: str):
        with self._lock:
            f = self._fsts.get(name)
            if f is None:
                import pynini

                path = self.directory / name
                if not path.is_file():
                    raise self._error(name, "file is missing")
                try:
                    f = pynini.Fst.read(str(path))
                except Exception as e:  # pynini raises FstIOError / FstOpError on a bad file
                    raise self._error(name, f"cannot be read as an FST ({e})") from None
                self._fsts[name] = f
            return f

    @property
    def byte_policies(self) -> tuple[str, ...]:
        """The byte policies a detokenizer was built for."""
        return tuple(self.manifest["detokenizers"])

    def detokenizer(self, byte_policy: str = "canonical"):
        """The byte → token transducer for ``byte_policy`` (``pynini.Fst``, see :mod:`.detokenizer`).
        Cached; callers must not mutate it (copy first).

        Raises:
            InvalidOptionError: unknown byte policy.
            ArtifactError: the file is missing/unreadable or the policy was not built.
        """
        from .detokenizer import BYTE_POLICIES

        if byte_policy not in BYTE_POLICIES:
            raise InvalidOptionError(f"unknown byte policy {byte_policy!r}; expected one of {BYTE_POLICIES}")
        name = self.manifest["detokenizers"].get(byte_policy)
        if name is None:
            raise self._error(MANIFEST, f"no detokenizer for byte policy {byte_policy!r}")
        return self._fst(name)

    def utf8_fst(self):
        """The UTF-8 validity acceptor over byte labels (``pynini.Fst``; cached, do not mutate).
        Raises ArtifactError when it was not built."""
        name = self.manifest.get("utf8")
        if not name:
            raise self._error("utf8.fst", "was not built (unicode_filters was unavailable at build time)")
        return self._fst(name)

    def script_fst(self, name: str):
        """The script filter ``name`` (one of ``unicode_filters.SCRIPT_NAMES``; cached, do not mutate).

        Raises:
            InvalidOptionError: unknown script name.
            ArtifactError: the file is missing/unreadable or was not built.
        """
        fname = self.manifest.get("scripts", {}).get(name)
        if fname is None:
            try:
                from .unicode_filters import SCRIPT_NAMES
            except ImportError:  # pragma: no cover - unicode_filters is part of the package
                SCRIPT_NAMES = ()
            if name not in SCRIPT_NAMES:
                raise InvalidOptionError(f"unknown script {name!r}; expected one of {tuple(SCRIPT_NAMES)}")
            raise self._error(f"script_{name}.fst", "was not built")
        return self._fst(fname)

    # --- canonical filter ------------------------------------------------------------------------------

    @cached_property
    def canonical(self):
        """The :class:`CanonicalFilter` over the memory-mapped ``canon_*.npy`` arrays.
        Raises ArtifactError when the artifacts were built without it."""
        files = self.manifest.get("canonical")
        if not files:
            raise self._error(MANIFEST, "built without the canonical filter")
        from .canonical import CanonicalFilter

        arrays = {k: self._npy(f) for k, f in files.items()}
        try:
            return CanonicalFilter.from_arrays(arrays, self.vocab_size, stats=self.manifest.get("canonical_stats"))
        except (KeyError, TypeError, ValueError) as e:
            raise self._error(MANIFEST, f"canonical arrays do not match this version ({e})") from None

    def __repr__(self) -> str:
        return f"TokenizerArtifacts({str(self.directory)!r}, kind={self.kind!r}, vocab_size={self.vocab_size})"


def load_artifacts(
    directory: str | os.PathLike, tokenizer_path: str | os.PathLike | None = None, verify: bool = True
) -> TokenizerArtifacts:
    """Open the artifacts directory ``directory``.

    Args:
        directory: a directory written by :func:`save_artifacts`.
        tokenizer_path: when given, the tokenizer file (or model directory) the artifacts must have been
            built from: its sha256 must equal the manifest's fingerprint.
        verify: check every file's size and sha256 against the manifest (≈0.1 s per 60 MB).

    Returns:
        A :class:`TokenizerArtifacts`.

    Raises:
        ArtifactError: missing/corrupt manifest, another format version, another tokenizer, or a file
            missing or not matching its checksum. The message names the file and gives the command
            ``python scripts/build_tokenizer_artifacts.py --tokenizer PATH --out DIR``.
    """
    directory = Path(directory)
    man_path = directory / MANIFEST
    cmd_tok = tokenizer_path

    def err(name: str, problem: str, tok=None) -> ArtifactError:
        return ArtifactError(
            f"tokenizer artifacts {directory / name}: {problem}; rebuild them with: "
            f"{rebuild_command(tok if tok is not None else cmd_tok, directory)}"
        )

    if not man_path.is_file():
        problem = "directory does not exist" if not directory.exists() else "file is missing"
        raise err(MANIFEST, problem)
    try:
        manifest = json.loads(man_path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise err(MANIFEST, f"cannot be read ({e})") from None
    if cmd_tok is None:
        cmd_tok = manifest.get("tokenizer_path")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise err(MANIFEST, f"format version {manifest.get('format_version')!r} != {FORMAT_VERSION} expected")
    for key in ("fingerprint", "kind", "vocab_size", "files", "detokenizers"):
        if key not in manifest:
            raise err(MANIFEST, f"has no {key!r} entry")
    if tokenizer_path is not None:
        try:
            fp = tokenizer_fingerprint(tokenizer_path)
        except FileNotFoundError as e:
            raise ArtifactError(f"tokenizer {tokenizer_path}: {e}") from None
        if fp != manifest["fingerprint"]:
            raise err(
                MANIFEST,
                f"built for another tokenizer (fingerprint {manifest['fingerprint'][:12]}… of "
                f"{manifest.get('tokenizer_path')}, but {tokenizer_path} has {fp[:12]}…)",
            )
    if verify:
        for name, meta in manifest["files"].items():
            path = directory / name
            try:
                size = path.stat().st_size
            except OSError:
                raise err(name, "file is missing") from None
            if size != meta.get("size"):
                raise err(name, f"size {size} != {meta.get('size')} recorded in the manifest (corrupt or truncated)")
            try:
                digest = _sha256_file(path)
            except OSError as e:
                raise err(name, f"cannot be read ({e})") from None
            if digest != meta.get("sha256"):
                raise err(name, "sha256 does not match the manifest (corrupt file)")
    return TokenizerArtifacts(directory, manifest, tokenizer_path=cmd_tok)


def is_up_to_date(directory: str | os.PathLike, tokenizer_path: str | os.PathLike, options: dict) -> bool:
    """True when ``directory`` holds a manifest of this format version, for the tokenizer at
    ``tokenizer_path`` (same sha256), built with ``options``, and every listed file exists with its
    recorded size (checksums are not recomputed: :func:`load_artifacts` does that)."""
    directory = Path(directory)
    manifest = _read_manifest(directory)
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        return False
    try:
        if manifest.get("fingerprint") != tokenizer_fingerprint(tokenizer_path):
            return False
    except FileNotFoundError:
        return False
    if manifest.get("options") != _normalize(options):
        return False
    for name, meta in manifest.get("files", {}).items():
        try:
            if (directory / name).stat().st_size != meta.get("size"):
                return False
        except OSError:
            return False
    return True


__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "TokenizerArtifacts",
    "is_up_to_date",
    "load_artifacts",
    "rebuild_command",
    "save_artifacts",
    "tokenizer_fingerprint",
]
