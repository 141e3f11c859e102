"""Build the on-disk artifacts of one tokenizer (once per tokenizer; see :mod:`.store` for the layout).

Command line (``scripts/build_tokenizer_artifacts.py`` and the ``vllm-fst-build-artifacts`` entry point)::

    python scripts/build_tokenizer_artifacts.py --tokenizer PATH [--out tokenizer_artifacts/NAME] [--force]

``PATH`` is a tokenizer file (``tokenizer.json``, SentencePiece ``.model``, Tekken ``.json``) or a model
directory holding one. ``NAME`` defaults to the model directory's name, or the file name without its
``.json``/``.model`` suffix (dots → ``_``), under ``./tokenizer_artifacts``. Steps: check the output
directory is writable (before any work) → read the tokenizer → detokenizer FST per byte policy
(paper 001 Alg. 1 / 004 Alg. 6) → UTF-8 and script acceptors (paper 000 §4.1–4.2) → canonical filter
(004 §6.5) → write (manifest last) → verify by loading. Does nothing ("up to date") when the manifest
matches the tokenizer's fingerprint, the build options and the format version, unless ``--force``.

Exit codes: 0 success / up to date; 2 unsupported tokenizer, missing tokenizer file, or unwritable
output directory (a one-line message on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

from ..errors import FstBackendError, OutputDirError
from .canonical import CANONICAL_VERSION
from .store import FORMAT_VERSION, is_up_to_date, load_artifacts, save_artifacts

DEFAULT_ROOT = Path("tokenizer_artifacts")


def _unicode_filters():
    """The unicode_filters module, or None if it cannot be imported (then utf8/script FSTs are skipped)."""
    try:
        from . import unicode_filters
    except ImportError:  # pragma: no cover - part of the package
        return None
    return unicode_filters


def default_options(canonical: bool = True) -> dict:
    """The build options of this version: byte policies, script names, whether the UTF-8 acceptor and
    the canonical filter are built. Stored in the manifest and compared by :func:`store.is_up_to_date`."""
    from .detokenizer import BYTE_POLICIES

    uf = _unicode_filters()
    return {
        "byte_policies": list(BYTE_POLICIES),
        "scripts": list(uf.SCRIPT_NAMES) if uf is not None else [],
        "utf8": uf is not None,
        "canonical": bool(canonical),
        # the canonical filter's algorithm: artifacts built by another version are rebuilt
        "canonical_version": CANONICAL_VERSION if canonical else None,
        "format_version": FORMAT_VERSION,
    }


def default_name(tokenizer_path: str | os.PathLike) -> str:
    """Artifacts directory name for a tokenizer: the model directory's name for a directory or a
    ``tokenizer.json``/``tekken.json``/``tokenizer.model`` inside one; else the file name without a
    ``.json``/``.model`` suffix, dots replaced by ``_`` (``tokenizer.model.v1`` → ``tokenizer_model_v1``)."""
    p = Path(tokenizer_path).resolve()
    if p.is_dir():
        return p.name
    if p.name in ("tokenizer.json", "tekken.json", "tokenizer.model"):
        return p.parent.name
    name = p.name
    for suffix in (".json", ".model"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name.replace(".", "_") or "tokenizer"


def check_output_dir(out_dir: str | os.PathLike) -> Path:
    """Create ``out_dir`` (with parents) and write/remove a probe file in it.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        OutputDirError: it cannot be created (e.g. a parent is a regular file) or is not writable.
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputDirError(f"cannot create the output directory {out}: {e.strerror or e}") from None
    if not out.is_dir():
        raise OutputDirError(f"the output path {out} exists and is not a directory")
    probe = out / f".write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as e:
        raise OutputDirError(f"the output directory {out} is not writable: {e.strerror or e}") from None
    return out


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (``resource.getrusage``; Linux reports KiB)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1024 if sys.platform != "darwin" else r / (1024 * 1024)


def build_artifacts(tokenizer_path, out_dir, *, force: bool = False, progress: bool = True, canonical: bool = True):
    """Build (or reuse) the artifacts of the tokenizer at ``tokenizer_path`` in ``out_dir``.

    ``canonical=False`` (CLI ``--no-canonical``) skips the canonical filter (the slowest step: for quick
    builds in tests and debugging); such artifacts raise ArtifactError on ``.canonical``.

    Returns:
        ``(TokenizerArtifacts, summary)``; ``summary["up_to_date"]`` is True when nothing was rebuilt.
        Summary keys: ``tokens`` (V), ``alphabet_tokens``, ``kind``, ``n_classes``, ``banned_pairs``,
        ``files`` (name → bytes), ``seconds`` (step → s), ``total_seconds``, ``peak_rss_mb``, ``fst``
        (per detokenizer: states, arcs).

    Raises:
        OutputDirError: ``out_dir`` is not writable (checked before any work).
        UnsupportedTokenizerError: not a supported BPE tokenizer.
        FileNotFoundError: no tokenizer at ``tokenizer_path``.
    """
    from tqdm import tqdm

    t_start = time.perf_counter()
    out = check_output_dir(out_dir)
    options = default_options(canonical)
    if not force and is_up_to_date(out, tokenizer_path, options):
        arts = load_artifacts(out, tokenizer_path=tokenizer_path)
        summary = dict(arts.manifest.get("summary", {}))
        summary.update(up_to_date=True, total_seconds=round(time.perf_counter() - t_start, 3))
        return arts, summary

    from .detokenizer import build_detokenizer
    from .tokenizer_info import load_tokenizer

    uf = _unicode_filters()
    steps = ["tokenizer", "detokenizer"] + (["unicode"] if uf is not None else []) + (["canonical"] if canonical else []) + ["write"]
    seconds: dict[str, float] = {}
    bar = tqdm(total=len(steps), desc="artifacts", unit="step", disable=not progress)

    def step(name: str):
        bar.set_postfix_str(name)
        return time.perf_counter()

    def done(name: str, t0: float):
        seconds[name] = round(time.perf_counter() - t0, 3)
        bar.update(1)

    try:
        t0 = step("tokenizer")
        info = load_tokenizer(tokenizer_path)
        done("tokenizer", t0)

        t0 = step("detokenizer")
        detoks = {}
        if info.byte_fallback:
            for p in options["byte_policies"]:
                detoks[p] = build_detokenizer(info, p)
        else:  # byte-level kinds: every policy is the same FST
            f = build_detokenizer(info, options["byte_policies"][0])
            detoks = {p: f for p in options["byte_policies"]}
        done("detokenizer", t0)

        utf8 = None
        scripts = {}
        if uf is not None:
            t0 = step("unicode")
            utf8 = uf.utf8_fst()
            scripts = {n: uf.script_fst(n) for n in uf.SCRIPT_NAMES}
            done("unicode", t0)

        cfilter = None
        if canonical:
            t0 = step("canonical")
            from .canonical import build_canonical_filter

            cfilter = build_canonical_filter(info, progress=progress)
            done("canonical", t0)

        csum = cfilter.summary() if cfilter is not None else {}
        summary = {
            "kind": info.kind,
            "tokens": info.vocab_size,
            "alphabet_tokens": sum(b is not None for b in info.token_bytes),
            "n_classes": csum.get("n_classes"),
            "banned_pairs": csum.get("banned_pairs", csum.get("banned_pairs_class_level")),
            "canonical": csum,
            "fst": {
                p: {"states": f.num_states(), "arcs": sum(f.num_arcs(s) for s in f.states())}
                for p, f in detoks.items()
            },
        }
        t0 = step("write")
        save_artifacts(
            out, info, detokenizers=detoks, utf8=utf8, scripts=scripts, canonical=cfilter,
            options=options, build_seconds=seconds, summary=summary,
        )
        arts = load_artifacts(out, tokenizer_path=tokenizer_path)
        done("write", t0)
    finally:
        bar.close()
    summary["files"] = {n: m["size"] for n, m in arts.manifest["files"].items()}
    summary["seconds"] = seconds
    summary["total_seconds"] = round(time.perf_counter() - t_start, 3)
    summary["peak_rss_mb"] = round(peak_rss_mb(), 1)
    summary["up_to_date"] = False
    return arts, summary


def format_summary(arts, summary: dict) -> str:
    """Human-readable multi-line summary of a build (what the CLI prints)."""
    lines = [f"artifacts: {arts.directory} ({summary.get('kind', arts.kind)}, fingerprint {arts.fingerprint[:12]})"]
    lines.append(
        f"tokens: {summary.get('tokens', arts.vocab_size)} ({summary.get('alphabet_tokens')} in the alphabet)  "
        f"classes: {summary.get('n_classes')}  banned pairs: {summary.get('banned_pairs')}"
    )
    for p, st in summary.get("fst", {}).items():
        lines.append(f"detokenizer[{p}]: {st['states']} states, {st['arcs']} arcs -> {arts.manifest['detokenizers'][p]}")
    files = summary.get("files", {})
    if files:
        lines.append("files:")
        for n, size in sorted(files.items()):
            lines.append(f"  {n:34s} {size:>12,d} bytes")
        lines.append(f"  {'total':34s} {sum(files.values()):>12,d} bytes")
    secs = summary.get("seconds", {})
    if secs:
        lines.append("seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in secs.items()))
    lines.append(f"total: {summary.get('total_seconds', 0):.2f} s, peak RSS {summary.get('peak_rss_mb', peak_rss_mb()):.0f} MiB")
    return "\n".join(lines)


def main(argv=None) -> int:
    """CLI entry point (see the module docstring). Returns the exit code (0 ok, 2 clean error)."""
    ap = argparse.ArgumentParser(
        prog="build_tokenizer_artifacts.py",
        description="Build the FST backend's artifacts (detokenizer FSTs, canonical filter, Unicode filters) "
        "for one tokenizer.",
    )
    ap.add_argument("--tokenizer", required=True, help="tokenizer file or model directory")
    ap.add_argument("--out", default=None, help="output directory (default: tokenizer_artifacts/NAME)")
    ap.add_argument("--force", action="store_true", help="rebuild even when the artifacts are up to date")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--no-canonical", action="store_true", help="skip the canonical filter (quick builds for tests)")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else DEFAULT_ROOT / default_name(args.tokenizer)
    try:
        arts, summary = build_artifacts(
            args.tokenizer, out, force=args.force, progress=not args.quiet, canonical=not args.no_canonical
        )
    except (FstBackendError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if summary.get("up_to_date"):
        print(f"up to date: {arts.directory} (tokenizer {arts.fingerprint[:12]}, format {FORMAT_VERSION}); "
              "use --force to rebuild")
    else:
        print(format_summary(arts, summary))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
