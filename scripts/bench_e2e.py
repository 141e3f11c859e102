"""End-to-end benchmark of the structured-output backends of vLLM 0.32 on a real CPU server (issue 5).

For each backend in turn (``fst``, ``fst-jump`` = fst with the forced-token proposer and ``fst_jump``,
``xgrammar``, ``guidance``, ``outlines``, ``lm-format-enforcer``, ``unconstrained``) this script starts
the *same* vLLM CPU server on SmolLM2-135M-Instruct (one server at a time, always killed afterwards),
runs the same workloads and writes one section (table + PNG plots) into ``docs/benchmarks.md``:

* ``mc``: multiple-choice fidelity. Questions from pycountry's ISO 3166-2 subdivisions: "Which country
  is the region X in? Options: A, B, C, D" (true country + 3 others, deterministic RNG), regex = exactly
  the options. Reference = the model's own preference over the options, scored offline with the same
  model (transformers, CPU, float32) on the same chat-templated prompt: the total log-probability of each
  option's canonical tokenization (no EOS), normalized over the options. Each backend samples k answers
  per question at temperature 1 (``n=k``, no ``seed``: it kills the CPU engine); we report the mean
  total-variation (TV) distance between the sampled answer frequencies and the reference, plus two
  offline figures: *exact canonical* (k draws from the distribution that exact token-by-token canonical
  sampling produces -- locally renormalized over the canonical tokens of the options, computed with the
  same model) and the *noise floor* (k draws from the reference itself). Greedy accuracy too.
* ``pokedex``: the Pokedex JSON template of paper 000 App. C written as one regex.
* ``json``: the JSON-object schema of paper 001 App. C.4.5 sent as ``structured_outputs.json``.

Per backend and workload: constraint-satisfied rate, canonical-output rate (the returned token ids --
``"return_token_ids": true`` -- equal the tokenizer's encoding of the returned text; an output cut by
max_tokens inside a multi-byte character is judged on its complete characters), mean completion
tokens, tokens/s (completion tokens of the sampling requests / their wall time), time to first token of
the first request with a new constraint (streaming, so it includes compilation), and for fst the share
of tokens emitted in forced states (server log) and, with jumps, the share of tokens that skipped a
model call (accepted drafts / generated tokens, from ``/metrics``).

``--workloads serving`` (not in the default set) is real serving traffic where every request brings its
own constraint, as tool calling does: ``--serving-requests`` (24) streamed chat completions at
``--serving-concurrency`` (8), then a second row of 64 at 32 (``--no-serving-large`` skips it), each with a
distinct tool-calling style JSON schema or regex from a fixed-seed generator (``make_serving_cases``),
temperature 0.7, no seed, max_tokens 96. Per backend and row: TTFT and latency p50/p90, the time per
output token p50, completion tokens/s of the whole batch, the worst ``GET /health`` time while it ran,
constraint-satisfied and canonical rates, failed requests; written as the section "Serving workload" with
``bench_serving.png``. With ``--workloads serving`` alone the backends default to fst, fst-jump, xgrammar,
guidance, outlines. ``--serving-rounds`` / ``--serving-large-rounds`` run each row size again with new
constraints (the targets take the medians); ``--serving-interleave`` runs each round on fresh servers with
the backends' order reversed every other round (on the 2-core host the server that ran first was the slower one).

Run ``python scripts/bench_e2e.py`` (all backends, ~20-25 min on 2 cores) or a subset:
``--backends xgrammar,fst --workloads mc --questions 5 --samples 10``. ``--out-md`` writes elsewhere
than docs/benchmarks.md (PNGs go next to it); ``--no-write`` writes nothing and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shlex
import statistics
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from scripts.bench_common import JSON_OBJECT_SCHEMA  # noqa: E402
from scripts.vllm_server import running_server  # noqa: E402

MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
FST_PROPOSER = "vllm_fst_backend.vllm_plugin.FstForcedTokenProposer"
ALL_BACKENDS = ("fst", "fst-jump", "xgrammar", "guidance", "outlines", "lm-format-enforcer", "unconstrained")
# serving workload only, on request: fst with one setting changed, to measure what a mechanism gains
# (name: (the server's environment variable and value, what its rows show))
EXTRA_SERVING_BACKENDS = {
    "fst-sequential": (("VLLM_FST_OVERLAP_COMPILE", "0"),
                       "a request with a new constraint enters the engine only once the API server's compile check "
                       "has ended (the order before the overlap of compile and prefill, docs/architecture.md)"),
    "fst-overlap-all": (("VLLM_FST_OVERLAP_QUEUED", "1"),
                        "every request with a new constraint enters the engine while its compile check runs, also "
                        "one whose compile waits behind others (the default before the queue rule of "
                        "docs/architecture.md, \"Overlap of compile and prefill\")"),
    "fst-early-prefill": (("VLLM_FST_FIRST_SAMPLE", "0"),
                          "a request whose constraint is still compiling prefills all of its prompt but the last "
                          "token, which waits for the grammar and then takes a step of its own (the way before the "
                          "first sample in the step, docs/architecture.md)"),
}
ALL_WORKLOADS = ("mc", "pokedex", "json")  # the default set; "serving" (below) is selected explicitly
EXTRA_WORKLOADS = ("serving",)
SECTION_TITLE = "End-to-end on a vLLM CPU server (SmolLM2-135M-Instruct): fidelity, canonicality, speed"

# ---------------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------------

_META = set("\\.^$|?*+()[]{}")


def escape_literal(text: str) -> str:
    """Escape regex metacharacters only (no ``\\ `` for spaces: every backend reads this the same)."""
    return "".join("\\" + c if c in _META else c for c in text)


def alternation(options: list[str]) -> str:
    return "(" + "|".join(escape_literal(o) for o in options) + ")"


POKEMON_TYPES = (
    "Bug|Dark|Dragon|Electric|Fairy|Fighting|Fire|Flying|Ghost|Grass|Ground|Ice|Normal|Poison|Psychic|Rock|"
    "Steel|Stellar|Water"
)
POKEMON_ABILITIES = "Overgrow|Blaze|Torrent|Shield Dust|Intimidate|Levitate|Pressure|Static"
# Paper 000 App. C as one regex, on one line with ", " / ": " separators. `[\w\s,.!?]` is written as
# the ASCII class `[A-Za-z0-9_ ,.!?]` so that every backend reads the same language (engines disagree on
# Unicode \w and on \s including newlines).
POKEDEX_REGEX = (
    r'\{"alias": "[a-z]{1,5}", '
    r'"description": "[A-Z][a-z][0-9][A-Za-z0-9_ ,.!?]{1,3}", '
    rf'"type": "({POKEMON_TYPES})", '
    r'"height_m": [0-9]{1,2}\.[0-9], '
    r'"weight_kg": [0-9]{1,3}\.[0-9], '
    r'"evolution_stage": "(Basic|Stage 1|Stage 2)", '
    r'"legendary": "(true|false)", '
    rf'"abilities": \["({POKEMON_ABILITIES})"(, "({POKEMON_ABILITIES})"){{0,6}}\]\}}'
)
POKEDEX_PROMPT = "Write the Pokedex entry of a Pokemon as a JSON object (alias, description, type, height, weight, evolution stage, legendary, abilities)."

# Paper 001 App. C.4.5.
RPG_SCHEMA = JSON_OBJECT_SCHEMA

RPG_PROMPT = "Create a role-playing game character as a JSON object with name, class, life, mana and equipment."


@dataclass
class Question:
    region: str
    answer: str
    options: list[str]
    prompt: str
    regex: str


def _country_names() -> dict[str, str]:
    import pycountry

    out = {}
    for c in pycountry.countries:
        name = getattr(c, "common_name", None) or c.name
        if "," in name or "(" in name:
            continue
        out[c.alpha_2] = name
    return out


def make_questions(n: int, seed: int = 0) -> list[Question]:
    """``n`` deterministic questions from pycountry's ISO 3166-2 subdivisions (a real data set)."""
    import pycountry

    countries = _country_names()
    names = sorted(countries.values())
    subs = sorted(pycountry.subdivisions, key=lambda s: s.code)
    rng = random.Random(seed)
    rng.shuffle(subs)
    out: list[Question] = []
    seen: set[str] = set()
    for s in subs:
        if len(out) >= n:
            break
        country = countries.get(s.country_code)
        name = s.name.strip()
        if not country or not re.fullmatch(r"[A-Za-z][A-Za-z .'-]{2,40}", name) or name in seen:
            continue
        if name.lower() in {c.lower() for c in names} or country.lower() in name.lower():
            continue  # "Luxembourg" (region of Luxembourg) or "Region of X" would give the answer away
        options = [country]
        while len(options) < 4:
            c = rng.choice(names)
            if any(c == o or c.startswith(o) or o.startswith(c) for o in options):
                continue  # prefix-free options: after an option the constraint forces EOS
            options.append(c)
        rng.shuffle(options)
        prompt = f"Which country is the region {name} in? Options: {', '.join(options)}. Answer with the country name only."
        out.append(Question(name, country, options, prompt, alternation(options)))
        seen.add(name)
    return out


# ---------------------------------------------------------------------------------------------------
# Offline reference (transformers, same model, same chat-templated prompt)
# ---------------------------------------------------------------------------------------------------


@dataclass
class Reference:
    prompt_ids: list[int]
    option_ids: list[list[int]]
    p_ref: list[float]  # total log-prob of the canonical tokenization, normalized over the options
    p_canon: list[float]  # exact token-by-token canonical sampling (locally renormalized)


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def score_references(questions: list[Question], tokenizer, progress: bool = True) -> list[Reference]:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = None
    refs = []
    cache_path = Path(tempfile.gettempdir()) / "bench_e2e_reference_cache.json"
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    fp = f"{MODEL}:{(MODEL / 'model.safetensors').stat().st_mtime_ns}"
    for q in tqdm(questions, desc="reference (transformers)", disable=not progress):
        p_ids = chat_prompt_ids(tokenizer, q.prompt)
        opt_ids = [tokenizer.encode(o, add_special_tokens=False) for o in q.options]
        key = json.dumps([fp, p_ids, opt_ids])
        if key in cache:
            refs.append(Reference(p_ids, opt_ids, *cache[key]))
            continue
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
            model.eval()
        L = len(p_ids) + max(len(o) for o in opt_ids)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        batch = torch.full((len(opt_ids), L), pad, dtype=torch.long)
        mask = torch.zeros((len(opt_ids), L), dtype=torch.long)
        for i, o in enumerate(opt_ids):
            seq = p_ids + o
            batch[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        P = len(p_ids)
        with torch.no_grad():  # the prompt once (KV cache), then only the option positions through the LM head
            pre = model(input_ids=torch.tensor([p_ids[:-1]]), use_cache=True)
            past = pre.past_key_values
            past.batch_repeat_interleave(len(opt_ids))
            tail = batch[:, P - 1 :]
            full_mask = torch.cat([torch.ones((len(opt_ids), P - 1), dtype=torch.long), mask[:, P - 1 :]], dim=1)
            logits = model(input_ids=tail, attention_mask=full_mask, past_key_values=past).logits.float()
            logp = torch.log_softmax(logits, dim=-1)
        # logp[i, j] is the distribution after prompt + option[:j]; shift indices so that row P + j - 1 works
        logp = torch.cat([logp.new_zeros((logp.shape[0], P - 1, 1)).expand(-1, -1, logp.shape[2]), logp], dim=1)
        total, local = [], []
        for i, o in enumerate(opt_ids):
            tot, loc = 0.0, 0.0
            for j, t in enumerate(o):
                row = logp[i, P + j - 1]
                tot += float(row[t])
                children = {oo[j] for oo in opt_ids if len(oo) > j and oo[:j] == o[:j]}
                loc += float(row[t]) - float(torch.logsumexp(row[list(children)], dim=0))
            total.append(tot)
            local.append(loc)
        refs.append(Reference(p_ids, opt_ids, _softmax(total), [math.exp(x) for x in local]))
        cache[key] = [refs[-1].p_ref, refs[-1].p_canon]
    with contextlib.suppress(OSError):
        cache_path.write_text(json.dumps(cache))
    return refs


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [x / s for x in e]


def tv(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


def simulated_tv(draw_from: list[list[float]], ref: list[list[float]], k: int, repeats: int = 2000, seed: int = 1):
    """Mean over questions of TV(k draws from ``draw_from[q]``, ``ref[q]``): (mean, 2.5 %, 97.5 %) over repeats."""
    import numpy as np

    rng = np.random.default_rng(seed)
    per_rep = np.zeros(repeats)
    for d, r in zip(draw_from, ref):
        d = np.asarray(d, dtype=float)
        counts = rng.multinomial(k, d / d.sum(), size=repeats)
        per_rep += 0.5 * np.abs(counts / k - np.asarray(r)).sum(axis=1)
    per_rep /= max(1, len(ref))
    return float(per_rep.mean()), float(np.percentile(per_rep, 2.5)), float(np.percentile(per_rep, 97.5))


# ---------------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------------


def ensure_fst_artifacts(directory: Path, progress: bool = True) -> str:
    """Make sure the fst artifacts in ``directory`` load and compile; (re)build them if not."""
    probe = (
        "from vllm_fst_backend.artifacts.store import load_artifacts\n"
        "from vllm_fst_backend.compiler import compile_regex, CompileOptions\n"
        f"compile_regex('(Paris|Berlin)', load_artifacts({str(directory)!r}), CompileOptions())\n"
    )

    def ok() -> tuple[bool, str]:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT)
        return r.returncode == 0, (r.stderr.strip().splitlines() or [""])[-1]

    good, why = ok()
    if good:
        return "up to date"
    print(f"[bench_e2e] fst artifacts unusable ({why[:160]}); rebuilding (takes minutes) ...", flush=True)
    cmd = [sys.executable, "scripts/build_tokenizer_artifacts.py", "--tokenizer", str(MODEL), "--out", str(directory)]
    if directory.exists():
        cmd.append("--force")
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, stdout=None if progress else subprocess.DEVNULL)
    good, why = ok()
    if not good:
        raise RuntimeError(f"fst artifacts still unusable after a rebuild: {why}")
    return "rebuilt"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def pick_port(first: int = 8790, last: int = 8799) -> int:
    for p in range(first, last + 1):
        if _port_free(p):
            return p
    raise RuntimeError(f"no free port in {first}-{last}")


def server_command(backend: str, port: int, jump_k: int, extra: list[str], eager: bool = True) -> list[str]:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(MODEL), "--max-model-len", "2048", "--port", str(port),
    ]  # fmt: skip
    if backend.startswith("fst"):
        cmd += ["--structured-outputs-config.backend", "fst"]
    elif backend != "unconstrained":
        cmd += ["--structured-outputs-config.backend", backend]
    if backend == "fst-jump":
        spec = {"method": "custom_class", "model": FST_PROPOSER, "num_speculative_tokens": jump_k}
        cmd += ["--speculative-config", json.dumps(spec)]
    if eager:
        cmd.append("--enforce-eager")
    return cmd + list(extra)


@contextlib.contextmanager
def vllm_server(
    backend: str, port: int, log_path: Path, jump_k: int, extra: list[str], timeout: float, artifacts: Path | None = None, eager: bool = True
):
    """Start the server, wait for /health, yield (base_url, seconds to ready, proc); always kill the group.
    Raises :class:`scripts.vllm_server.ServerStartError` when it does not come up."""
    cmd = server_command(backend, port, jump_k, extra, eager)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), HF_HUB_OFFLINE="1")
    if backend.startswith("fst") and artifacts is not None:
        env["VLLM_FST_ARTIFACTS_DIR"] = str(artifacts)
    if backend in EXTRA_SERVING_BACKENDS:
        var, value = EXTRA_SERVING_BACKENDS[backend][0]
        env[var] = value
    with contextlib.ExitStack() as stack:
        if backend.startswith("fst"):
            # a fresh host-shared compile cache per server: every constraint is compiled in the run,
            # none is left over from an earlier run of the same (fixed-seed) workload
            shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            env["VLLM_FST_DISK_CACHE_DIR"] = stack.enter_context(tempfile.TemporaryDirectory(prefix="fst_bench_cache-", dir=shm))
        yield stack.enter_context(running_server(cmd, port, env, log_path, timeout, cwd=REPO_ROOT, name=backend))


def scrape_metrics(base: str) -> dict[str, float]:
    import requests

    out: dict[str, float] = {}
    try:
        text = requests.get(base + "/metrics", timeout=10).text
    except requests.RequestException:
        return out
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)$", line.strip())
        if m:
            with contextlib.suppress(ValueError):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


# ---------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    finish: str | None


@dataclass
class Stats:
    """Everything measured for one (backend, workload)."""

    samples: list[Sample] = field(default_factory=list)  # sampled (temperature 1) outputs
    greedy: list[Sample] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # first request with a new constraint (streaming)
    stream_rates: list[float] = field(default_factory=list)  # greedy streams: tokens/s after the first token
    sample_wall: float = 0.0
    sample_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    requests: int = 0
    forced_tokens: int = 0  # tokens emitted in forced states (fst server log)
    constrained_tokens: int = 0
    drafts_accepted: float = 0.0  # spec-decode accepted tokens (jumps), /metrics delta
    generated_tokens: float = 0.0
    mc_counts: list[list[int]] = field(default_factory=list)
    mc_greedy: list[str | None] = field(default_factory=list)
    prompt_mismatch: int = 0


class Client:
    def __init__(self, base: str, timeout: float = 600.0):
        import requests

        self.base = base
        self.http = requests.Session()
        self.timeout = timeout

    def body(self, prompt: str, constraint: dict | None, *, n: int, temperature: float, max_tokens: int, xargs: dict | None):
        b: dict[str, Any] = {
            "model": str(MODEL),
            "messages": [{"role": "user", "content": prompt}],
            "n": n,
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": -1,
            "max_tokens": max_tokens,
            "return_token_ids": True,
        }
        if constraint is not None:
            b["structured_outputs"] = constraint
        if xargs:
            b["vllm_xargs"] = xargs
        return b

    def complete(self, body: dict) -> tuple[list[Sample], list[int] | None, float]:
        t0 = time.perf_counter()
        r = self.http.post(self.base + "/v1/chat/completions", json=body, timeout=self.timeout)
        wall = time.perf_counter() - t0
        if r.status_code != 200:
            raise RequestFailed(r.status_code, r.text[:300])
        j = r.json()
        out = [
            Sample(c["message"].get("content") or "", list(c.get("token_ids") or []), c.get("finish_reason"))
            for c in sorted(j["choices"], key=lambda c: c["index"])
        ]
        return out, j.get("prompt_token_ids"), wall

    def stream(self, body: dict) -> tuple[Sample, list[int] | None, float]:
        """One streamed completion (n=1): (sample, prompt ids, time to the first content token). The
        decode rate of the stream (tokens after the first / seconds from the first to the end) is left in
        ``self.last_stream_rate`` (None when fewer than two tokens came)."""
        body = dict(body, stream=True, n=1)
        self.last_stream_rate = None
        t0 = time.perf_counter()
        ttft = None
        text, ids, finish, prompt_ids = [], [], None, None
        with self.http.post(self.base + "/v1/chat/completions", json=body, timeout=self.timeout, stream=True) as r:
            if r.status_code != 200:
                raise RequestFailed(r.status_code, r.text[:300])
            for line in r.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                j = json.loads(data)
                if "error" in j and not j.get("choices"):
                    err = j["error"] if isinstance(j["error"], dict) else {"message": str(j["error"])}
                    raise RequestFailed(int(err.get("code") or 500), json.dumps(err)[:300])
                prompt_ids = j.get("prompt_token_ids") or prompt_ids
                for c in j.get("choices", []):
                    delta = (c.get("delta") or {}).get("content") or ""
                    tids = c.get("token_ids") or []
                    if ttft is None and (delta or tids):
                        ttft = time.perf_counter() - t0
                    text.append(delta)
                    ids.extend(tids)
                    finish = c.get("finish_reason") or finish
        end = time.perf_counter()
        if ttft is not None and len(ids) > 1 and end - t0 > ttft:
            self.last_stream_rate = (len(ids) - 1) / (end - t0 - ttft)
        return Sample("".join(text), ids, finish), prompt_ids, (ttft if ttft is not None else end - t0)


class RequestFailed(RuntimeError):
    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


# ---------------------------------------------------------------------------------------------------
# Running one backend
# ---------------------------------------------------------------------------------------------------


@dataclass
class Config:
    questions: list[Question]
    refs: list[Reference]
    k: int
    template_samples: int
    batch: int
    mc_max_tokens: int
    template_max_tokens: int
    workloads: tuple[str, ...]
    fail_fast: int = 3  # stop a workload after this many failed requests in a row
    stream_repeats: int = 3  # template workloads: greedy streams after the first (single-stream decode rate)


def _constraint(backend: str, kind: str, spec: Any) -> dict | None:
    if backend == "unconstrained":
        return None
    return {kind: spec}


def _xargs(backend: str) -> dict | None:
    return {"fst_jump": True} if backend == "fst-jump" else None


def _fst_log_counts(log_path: Path, start: int) -> tuple[int, int, int]:
    """(constrained tokens, forced tokens, new offset) from the fst 'done' lines written after ``start``."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            chunk = f.read().decode("utf-8", "replace")
            end = f.tell()
    except OSError:
        return 0, 0, start
    n = f_ = 0
    for m in re.finditer(r"fst: request \S+ done: (\d+) constrained tokens, (\d+) forced", chunk):
        n += int(m.group(1))
        f_ += int(m.group(2))
    return n, f_, end


def run_backend(backend: str, client: Client, cfg: Config, log_path: Path, progress: bool) -> dict[str, Stats]:
    from tqdm import tqdm

    results: dict[str, Stats] = {}
    for wl in cfg.workloads:
        if wl not in ALL_WORKLOADS:  # "serving" runs separately (serving_rows)
            continue
        st = Stats()
        results[wl] = st
        offset = log_path.stat().st_size if log_path.exists() else 0
        m0 = scrape_metrics(client.base)
        if wl == "mc":
            jobs = [(q.prompt, q.regex, q) for q in cfg.questions]
        elif wl == "pokedex":
            jobs = [(POKEDEX_PROMPT, POKEDEX_REGEX, None)]
        else:
            jobs = [(RPG_PROMPT, RPG_SCHEMA, None)]
        kind = "json" if wl == "json" else "regex"
        max_tokens = cfg.mc_max_tokens if wl == "mc" else cfg.template_max_tokens
        n_total = cfg.k if wl == "mc" else cfg.template_samples
        n_steps = len(jobs) * (1 + math.ceil(n_total / cfg.batch))
        fails_in_row = 0
        with tqdm(total=n_steps, desc=f"{backend}/{wl}", disable=not progress, leave=True) as bar:
            for qi, (prompt, spec, q) in enumerate(jobs):
                if fails_in_row >= cfg.fail_fast:
                    st.errors.append(f"skipped {len(jobs) - qi} more prompts after {fails_in_row} failures in a row")
                    break
                constraint = _constraint(backend, kind, spec)
                xargs = _xargs(backend)
                # 1. greedy, streamed: TTFT of the first request with this (new) constraint
                body = client.body(prompt, constraint, n=1, temperature=0.0, max_tokens=max_tokens, xargs=xargs)
                st.requests += 1
                try:
                    g, p_ids, ttft = client.stream(body)
                    st.greedy.append(g)
                    st.ttft.append(ttft)
                    if q is not None:
                        st.mc_greedy.append(g.text)
                        ref = cfg.refs[qi]
                        if p_ids is not None and list(p_ids) != ref.prompt_ids:
                            st.prompt_mismatch += 1
                    fails_in_row = 0
                except Exception as e:  # noqa: BLE001 - measured, reported
                    st.errors.append(f"greedy: {e}")
                    fails_in_row += 1
                    if q is not None:
                        st.mc_greedy.append(None)
                if q is None and client.last_stream_rate is not None:
                    st.stream_rates.append(client.last_stream_rate)
                bar.update(1)
                # 1b. template workloads: the same greedy stream again, the constraint now compiled: the
                # single-stream decode rate (n = 1), where skipping model calls pays on any hardware
                for _ in range(cfg.stream_repeats if q is None else 0):
                    st.requests += 1
                    try:
                        g2, _, _ = client.stream(body)
                        st.greedy.append(g2)
                        if client.last_stream_rate is not None:
                            st.stream_rates.append(client.last_stream_rate)
                    except Exception as e:  # noqa: BLE001 - measured, reported
                        st.errors.append(f"greedy: {e}")
                # 2. sampling at temperature 1 (n per request, no seed)
                left, texts = n_total, []
                while left > 0:
                    n = min(cfg.batch, left)
                    left -= n
                    body = client.body(prompt, constraint, n=n, temperature=1.0, max_tokens=max_tokens, xargs=xargs)
                    st.requests += 1
                    try:
                        outs, _, wall = client.complete(body)
                        st.samples.extend(outs)
                        texts.extend(o.text for o in outs)
                        st.sample_wall += wall
                        st.sample_tokens += sum(len(o.token_ids) for o in outs)
                        fails_in_row = 0
                    except Exception as e:  # noqa: BLE001
                        st.errors.append(f"sample: {e}")
                        fails_in_row += 1
                    bar.update(1)
                if q is not None:
                    st.mc_counts.append([sum(1 for t in texts if _match_option(t, q.options) == o) for o in q.options])
        m1 = scrape_metrics(client.base)
        st.drafts_accepted = m1.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) - m0.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
        st.generated_tokens = m1.get("vllm:generation_tokens_total", 0.0) - m0.get("vllm:generation_tokens_total", 0.0)
        time.sleep(0.5)  # let the engine flush its log lines
        st.constrained_tokens, st.forced_tokens, _ = _fst_log_counts(log_path, offset)
    return results


def _match_option(text: str, options: list[str]) -> str | None:
    """The option the answer names: exact match, else (unconstrained) the only option mentioned."""
    t = text.strip().rstrip(".")
    if t in options:
        return t
    hits = [o for o in options if re.search(r"(?<!\w)" + re.escape(o) + r"(?!\w)", text)]
    return hits[0] if len(hits) == 1 else None


# ---------------------------------------------------------------------------------------------------
# Metrics, table, plots
# ---------------------------------------------------------------------------------------------------


def strip_stop(ids: list[int], stop_ids: set[int]) -> list[int]:
    ids = list(ids)
    while ids and ids[-1] in stop_ids:
        ids.pop()
    return ids


def sample_canonical(s: Sample, tokenizer, stop_ids: set[int]) -> bool:
    """:func:`output_canonical` of a sample, with its finish reason (an output cut by ``max_tokens`` inside a
    multi-byte character is judged on its complete characters); a sample left without ids counts as canonical."""
    return output_canonical(s.token_ids, s.text, tokenizer, stop_ids, finish=s.finish) is not False


def canonical_rate(samples: list[Sample], tokenizer, stop_ids: set[int]) -> float | None:
    ok = tot = 0
    for s in samples:
        if not s.token_ids:
            continue
        tot += 1
        ok += sample_canonical(s, tokenizer, stop_ids)
    return ok / tot if tot else None


def satisfied_rate(wl: str, samples: list[Sample], cfg: Config) -> float | None:
    if not samples:
        return None
    if wl == "pokedex":
        import regex as _re

        rx = _re.compile(POKEDEX_REGEX)
        return sum(bool(rx.fullmatch(s.text)) for s in samples) / len(samples)
    if wl == "json":
        ok = 0
        for s in samples:
            try:
                v = json.loads(s.text)
                ok += isinstance(v, dict)
            except ValueError:
                pass
        return ok / len(samples)
    return None


def summarize(backend: str, wl: str, st: Stats, cfg: Config, tokenizer, stop_ids: set[int]) -> dict[str, Any]:
    allout = st.greedy + st.samples
    row: dict[str, Any] = {
        "backend": backend,
        "workload": wl,
        "requests": st.requests,
        "failed": len([e for e in st.errors if not e.startswith("skipped")]),
        "errors": st.errors[:3],
        "outputs": len(allout),
        "canonical": canonical_rate(allout, tokenizer, stop_ids),
        "mean_tokens": (sum(len(strip_stop(s.token_ids, stop_ids)) for s in st.samples) / len(st.samples)) if st.samples else None,
        "tok_s": (st.sample_tokens / st.sample_wall) if st.sample_wall > 0 else None,
        "ttft_ms": (1e3 * sorted(st.ttft)[len(st.ttft) // 2]) if st.ttft else None,
        "stream_tok_s": statistics.median(st.stream_rates) if st.stream_rates else None,
        "greedy_ids": [s.token_ids for s in st.greedy],
        "forced": (st.forced_tokens / st.constrained_tokens) if st.constrained_tokens else None,
        "skipped": (st.drafts_accepted / st.generated_tokens) if backend == "fst-jump" and st.generated_tokens else None,
        "prompt_mismatch": st.prompt_mismatch,
        "examples": [
            {"text": s.text, "token_ids": s.token_ids, "finish": s.finish,
             "canonical_ids": tokenizer.encode(s.text, add_special_tokens=False)}
            for s in (st.greedy[:1] + st.samples[:2])
        ],
        "noncanonical_examples": [
            {"text": s.text, "token_ids": s.token_ids, "finish": s.finish,
             "canonical_ids": tokenizer.encode(s.text, add_special_tokens=False)}
            for s in allout if s.token_ids and not sample_canonical(s, tokenizer, stop_ids)
        ][:3],
    }
    if wl == "mc":
        in_opt = sum(sum(c) for c in st.mc_counts)
        row["satisfied"] = in_opt / len(st.samples) if st.samples else None
        tvs = []
        for c, ref in zip(st.mc_counts, cfg.refs):
            tot = sum(c)
            if tot:
                tvs.append(tv([x / tot for x in c], ref.p_ref))
        row["tv"] = sum(tvs) / len(tvs) if tvs and backend != "unconstrained" else None
        row["tv_list"] = tvs
        greedy_ok = [_match_option(g, q.options) == q.answer for g, q in zip(st.mc_greedy, cfg.questions) if g is not None]
        row["greedy_acc"] = sum(greedy_ok) / len(greedy_ok) if greedy_ok else None
    else:
        row["satisfied"] = satisfied_rate(wl, st.samples, cfg)
    return row


def _fmt(v, kind="f", nd=3):
    if v is None:
        return "–"
    if kind == "%":
        return f"{100 * v:.1f} %"
    if kind == "d":
        return f"{v:.0f}"
    return f"{v:.{nd}f}"


def render_table(rows: list[dict]) -> str:
    head = (
        "| backend | workload | ok / failed requests | constraint satisfied | canonical outputs | mean completion tokens "
        "| tokens/s | × unconstrained | single-stream tokens/s | TTFT incl. compile (median ms) | forced-state tokens | model calls skipped | MC mean TV | greedy acc. |"
    )
    sep = "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"
    lines = [head, sep]
    unc = {r["workload"]: r.get("tok_s") for r in rows if r["backend"] == "unconstrained"}
    for r in rows:
        ratio = (r["tok_s"] / unc[r["workload"]]) if r.get("tok_s") and unc.get(r["workload"]) else None
        lines.append(
            "| "
            + " | ".join(
                [
                    r["backend"],
                    r["workload"],
                    f"{r['requests'] - r['failed']} / {r['failed']}",
                    _fmt(r.get("satisfied"), "%"),
                    _fmt(r.get("canonical"), "%"),
                    _fmt(r.get("mean_tokens"), "f", 1),
                    _fmt(r.get("tok_s"), "f", 1),
                    _fmt(ratio, "f", 2),
                    _fmt(r.get("stream_tok_s"), "f", 1),
                    _fmt(r.get("ttft_ms"), "d"),
                    _fmt(r.get("forced"), "%"),
                    _fmt(r.get("skipped"), "%"),
                    _fmt(r.get("tv"), "f", 3),
                    _fmt(r.get("greedy_acc"), "%"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def make_plots(rows: list[dict], fid: dict, out_dir: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    mc = [r for r in rows if r["workload"] == "mc" and r["backend"] != "unconstrained"]
    if mc or fid:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        ax = axes[0]
        names = [r["backend"] for r in mc]
        vals = [r["tv"] if r.get("tv") is not None else 0.0 for r in mc]
        bars = ax.bar(names, vals, color=["tab:green" if n.startswith("fst") else "tab:gray" for n in names])
        for b, r in zip(bars, mc):
            ax.annotate("failed" if r.get("tv") is None else f"{r['tv']:.3f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
        if fid:
            ax.axhline(fid["canon"][0], color="tab:blue", ls="--", label=f"exact canonical sampling {fid['canon'][0]:.3f}")
            ax.axhline(fid["noise"][0], color="tab:red", ls=":", label=f"noise floor (k draws of the reference) {fid['noise'][0]:.3f}")
            ax.axhspan(fid["noise"][1], fid["noise"][2], color="tab:red", alpha=0.1)
            ax.legend(fontsize=7, loc="upper left")
        ax.set_ylim(0, 1.35 * max([0.1, *vals, fid.get("canon", (0,))[0] if fid else 0.0]))
        ax.set_ylabel("mean total-variation distance to the reference")
        ax.set_title(f"MC fidelity (k={fid.get('k', '?')} samples/question)")
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax = axes[1]
        acc_rows = [r for r in rows if r["workload"] == "mc"]
        names = ["reference (argmax)"] + [r["backend"] for r in acc_rows]
        vals = [fid.get("ref_acc", 0.0)] + [r.get("greedy_acc") or 0.0 for r in acc_rows]
        ax.bar(names, [100 * v for v in vals], color=["tab:blue"] + ["tab:green" if r["backend"].startswith("fst") else "tab:gray" for r in acc_rows])
        ax.set_ylabel("greedy accuracy (%)")
        ax.set_title("MC greedy accuracy (chance = 25 %)")
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        fig.tight_layout()
        p = out_dir / f"{stem}_fidelity.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    wls = [w for w in ALL_WORKLOADS if any(r["workload"] == w for r in rows)]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    if wls and backends:
        fig, ax = plt.subplots(figsize=(11, 4))
        width = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            ys = [next((r.get("tok_s") or 0.0 for r in rows if r["backend"] == b and r["workload"] == w), 0.0) for w in wls]
            ax.bar([x + i * width for x in range(len(wls))], ys, width, label=b)
        ax.set_xticks([x + width * (len(backends) - 1) / 2 for x in range(len(wls))], wls)
        ax.set_ylabel("completion tokens/s (sampling requests)")
        ax.set_title("Throughput per backend and workload (vLLM CPU, 2 cores)")
        ax.legend(fontsize=7, ncol=4)
        fig.tight_layout()
        p = out_dir / f"{stem}_throughput.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def targets_text(rows: list[dict], fid: dict) -> list[str]:
    def get(b, w, key):
        return next((r.get(key) for r in rows if r["backend"] == b and r["workload"] == w), None)

    out = []
    fst_rows = [r for r in rows if r["backend"].startswith("fst") and r.get("canonical") is not None]
    if fst_rows:
        worst = min(r["canonical"] for r in fst_rows)
        out.append(f"- fst canonical-output rate 100 %: {'met' if worst == 1.0 else 'NOT met'} (lowest {100 * worst:.1f} %).")
    fst_tv = get("fst", "mc", "tv")
    if fst_tv is not None and fid:
        peers = {r["backend"]: r["tv"] for r in rows if r["workload"] == "mc" and r.get("tv") is not None and not r["backend"].startswith("fst")}
        within = abs(fst_tv - fid["canon"][0]) <= 0.03
        below = all(fst_tv < v for v in peers.values())
        out.append(
            f"- fst fidelity within 0.03 of exact canonical ({fst_tv:.3f} vs {fid['canon'][0]:.3f}): {'met' if within else 'NOT met'}; "
            f"below every peer ({', '.join(f'{k} {v:.3f}' for k, v in peers.items()) or 'no peer measured'}): {'met' if below and peers else 'NOT met'}."
        )
        out.append(
            f"  If \"exact canonical\" is read as k draws of the reference itself (the noise floor, {fid['noise'][0]:.3f}), fst is "
            f"{fst_tv - fid['noise'][0]:+.3f} from it ({'met' if abs(fst_tv - fid['noise'][0]) <= 0.03 else 'NOT met'}): the gap is the "
            f"local-renormalization bias of token-by-token sampling, which no per-step mask removes."
        )
    for b in ("fst", "fst-jump"):
        ratios = []
        for w in ALL_WORKLOADS:
            a, u = get(b, w, "tok_s"), get("unconstrained", w, "tok_s")
            if a and u:
                ratios.append(f"{w} {a / u:.2f}×")
        if ratios:
            met = all(float(x.split()[1][:-1]) >= 0.95 for x in ratios)
            out.append(f"- {b} throughput ≥ 0.95× unconstrained: {', '.join(ratios)} ({'met' if met else 'NOT met'}).")
    for key, label in (("tok_s", "n = 50 per request"), ("stream_tok_s", "single stream (greedy, n = 1)")):
        j, x = get("fst-jump", "pokedex", key), get("xgrammar", "pokedex", key)
        if not (j and x):
            continue
        u, f = get("unconstrained", "pokedex", key), get("fst", "pokedex", key)
        notes = ([f"the model's own rate, unconstrained, is {u / x:.2f}× xgrammar's"] if u and key == "tok_s" else []) + (
            [f"fst without jumps {f / x:.2f}×"] if f else [])
        out.append(f"- fst with jumps ≥ 1.5× xgrammar tokens/s on the Pokédex template, {label}: {j / x:.2f}× "
                   f"({'; '.join([f'{j:.1f} vs {x:.1f}'] + notes)}) ({'met' if j / x >= 1.5 else 'NOT met'}).")
    same = []
    for w in ALL_WORKLOADS:
        a, b = get("fst", w, "greedy_ids"), get("fst-jump", w, "greedy_ids")
        if a and b:
            if w == "mc":  # one greedy stream per question, in question order
                same.append((w, sum(x == y for x, y in zip(a, b)), len(b), None))
            else:  # one prompt, streamed 1 + --stream-repeats times
                plain = {tuple(x) for x in a}
                same.append((w, sum(tuple(x) in plain for x in b), len(b), f"fst: {len(plain)} distinct in {len(a)}"))
    if same:
        ok = all(k == n for _, k, n, _ in same)
        out.append("- greedy output identical with and without jumps (a greedy stream with jumps equals fst's greedy "
                   "output of the same request, or one of them where fst streamed it several times: the server's own "
                   "greedy outputs can differ between a first and a repeated request, where bf16 numerics of a cached "
                   "prompt flip a near-tie): "
                   + ", ".join(f"{w} {k} of {n}" + (f" ({d})" if d else "") for w, k, n, d in same)
                   + f" ({'met' if ok else 'NOT met'}).")
    return out


# ---------------------------------------------------------------------------------------------------
# Serving workload: every request brings its own constraint (tool-calling style), streamed, concurrent
# ---------------------------------------------------------------------------------------------------

SERVING_TITLE = "Serving workload"
SERVING_SEED = 20261124  # fixed: every run (and every backend) gets the same constraints and prompts
SERVING_PNG = "bench_serving.png"
SERVING_BACKENDS = ("fst", "fst-jump", "xgrammar", "guidance", "outlines")
SERVING_REGEX_EVERY = 3  # request i is a regex when i % 3 == 2 (a third), a JSON schema otherwise


@dataclass
class ServingCase:
    """One request of the serving workload: its own constraint (``kind`` "json": a JSON schema,
    "regex": a regex) and a prompt that asks for it."""

    name: str
    kind: str
    spec: Any  # dict (JSON schema) or str (regex)
    prompt: str

    def key(self) -> str:
        return self.kind + ":" + (json.dumps(self.spec, sort_keys=True) if self.kind == "json" else self.spec)


_TOOLS = (
    ("get_weather", "get the weather forecast"), ("search_flights", "search for flights"), ("create_order", "create a shop order"),
    ("open_ticket", "open a support ticket"), ("schedule_meeting", "schedule a meeting"), ("send_invoice", "send an invoice"),
    ("update_user", "update a user profile"), ("find_products", "find products in the catalogue"), ("book_hotel", "book a hotel room"),
    ("set_reminder", "set a reminder"), ("create_playlist", "create a playlist"), ("find_recipes", "find cooking recipes"),
    ("export_report", "export a report"), ("track_shipment", "track a shipment"), ("create_event", "create a calendar event"),
    ("make_payment", "make a payment"), ("reserve_table", "reserve a restaurant table"), ("rent_car", "rent a car"),
    ("add_task", "add a task to a to-do list"), ("post_review", "post a product review"), ("plan_route", "plan a route"),
    ("convert_currency", "convert an amount of money"), ("register_guest", "register a conference guest"),
    ("log_workout", "log a workout"), ("file_expense", "file an expense claim"),
)  # fmt: skip
_STRING_PROPS = (
    "city", "query", "title", "customer_name", "note", "address", "description", "username", "language",
    "topic", "destination", "subject", "recipient", "product_name", "author", "keyword", "country", "message",
    "comment", "company",
)  # fmt: skip
_ENUM_PROPS = (
    ("unit", ["celsius", "fahrenheit"]),
    ("priority", ["low", "medium", "high", "urgent"]),
    ("status", ["open", "closed", "pending"]),
    ("currency", ["USD", "EUR", "GBP", "JPY", "CHF"]),
    ("sort_order", ["asc", "desc"]),
    ("file_format", ["pdf", "csv", "json", "xlsx"]),
    ("category", ["books", "electronics", "clothing", "garden", "toys"]),
    ("travel_mode", ["driving", "walking", "cycling", "transit"]),
    ("size", ["S", "M", "L", "XL"]),
    ("weekday", ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]),
    ("cabin_class", ["economy", "premium_economy", "business", "first"]),
    ("visibility", ["public", "private", "unlisted"]),
    ("payment_method", ["card", "paypal", "bank_transfer", "cash"]),
    ("tone", ["formal", "casual", "friendly"]),
)
_INT_PROPS = (
    ("limit", 1, 50), ("quantity", 1, 99), ("days", 1, 14), ("age", 0, 120), ("page", 1, 100), ("rating", 1, 5),
    ("year", 1990, 2030), ("duration_minutes", 5, 240), ("guests", 1, 12), ("floor", -2, 60), ("max_results", 1, 25),
    ("nights", 1, 30), ("seats", 1, 9), ("priority_level", 0, 10),
)  # fmt: skip
_NUMBER_PROPS = (
    ("price", 0, 10000), ("latitude", -90, 90), ("longitude", -180, 180), ("budget", 0, 50000), ("weight_kg", 0, 500),
    ("discount", 0, 1), ("temperature", -50, 60), ("amount", 0, 100000),
)  # fmt: skip
_BOOL_PROPS = ("include_archived", "urgent", "notify", "is_public", "dry_run", "verbose", "refundable", "confirmed", "recurring")
_FORMAT_PROPS = (
    ("start_date", "date"), ("due_date", "date"), ("birth_date", "date"), ("check_in", "date"), ("deadline", "date"),
    ("email", "email"), ("contact_email", "email"), ("request_id", "uuid"), ("account_id", "uuid"),
)  # fmt: skip
_PATTERN_PROPS = (
    ("zip_code", "^[0-9]{5}$"), ("country_code", "^[A-Z]{2}$"), ("sku", "^[A-Z]{3}-[0-9]{4}$"),
    ("hex_color", "^#[0-9a-f]{6}$"), ("flight_number", "^[A-Z]{2}[0-9]{3,4}$"), ("room", "^[A-D][0-9]{3}$"),
)  # fmt: skip
_NESTED_NAMES = ("address", "location", "contact", "dimensions", "filters", "schedule", "price_range", "options", "passenger", "shipping")
_ARRAY_NAMES = ("tags", "attendees", "ingredients", "keywords", "labels", "items", "stops", "recipients", "line_items", "participants")


def _serving_leaf(rng: random.Random, used: set[str]) -> tuple[str, dict] | None:
    """One scalar property (name, schema) whose name is not in ``used``."""
    for _ in range(20):
        kind = rng.choices(("string", "enum", "integer", "number", "boolean", "format", "pattern"), (25, 20, 20, 8, 10, 9, 8))[0]
        if kind == "string":
            name, s = rng.choice(_STRING_PROPS), {"type": "string"}
            if rng.random() < 0.6:
                s["maxLength"] = rng.choice((16, 24, 32, 48))
            if rng.random() < 0.2:
                s["minLength"] = 1
        elif kind == "enum":
            name, vals = rng.choice(_ENUM_PROPS)
            k = rng.randint(2, len(vals))
            s = {"type": "string", "enum": sorted(rng.sample(vals, k), key=vals.index)}
        elif kind == "integer":
            name, lo, hi = rng.choice(_INT_PROPS)
            s = {"type": "integer"}
            if rng.random() < 0.85:
                s["minimum"] = lo
            if rng.random() < 0.85:
                s["maximum"] = rng.choice((hi, max(lo + 1, hi // 2), hi * 2))
        elif kind == "number":
            name, lo, hi = rng.choice(_NUMBER_PROPS)
            s = {"type": "number", "minimum": lo, "maximum": hi} if rng.random() < 0.5 else {"type": "number"}
        elif kind == "boolean":
            name, s = rng.choice(_BOOL_PROPS), {"type": "boolean"}
        elif kind == "format":
            name, fmt = rng.choice(_FORMAT_PROPS)
            s = {"type": "string", "format": fmt}
        else:
            name, pat = rng.choice(_PATTERN_PROPS)
            s = {"type": "string", "pattern": pat}
        if name not in used:
            used.add(name)
            if rng.random() < 0.3:
                s["description"] = name.replace("_", " ").capitalize()
            return name, s
    return None


def _serving_object(rng: random.Random, n_props: int, depth: int) -> dict:
    """An object schema with ``n_props`` properties; at ``depth`` 1 up to two of them are containers
    (an object or an array of scalars/objects) whose members are scalars (≤ 2 nesting levels)."""
    used: set[str] = set()
    props: dict[str, dict] = {}
    containers = 0
    while len(props) < n_props:
        r = rng.random()
        if depth == 1 and containers < 2 and r < 0.14:
            name = rng.choice(_NESTED_NAMES)
            if name in used:
                continue
            used.add(name)
            props[name] = _serving_object(rng, rng.randint(2, 3), 2)
            containers += 1
            continue
        if depth == 1 and containers < 2 and r < 0.28:
            name = rng.choice(_ARRAY_NAMES)
            if name in used:
                continue
            used.add(name)
            what = rng.random()
            if what < 0.4:
                items: dict = {"type": "string", "maxLength": rng.choice((12, 20, 32))}
            elif what < 0.6:
                items = {"type": "string", "enum": list(rng.choice(_ENUM_PROPS)[1])}
            elif what < 0.75:
                items = {"type": "integer", "minimum": 0, "maximum": rng.choice((10, 100, 1000))}
            else:
                items = _serving_object(rng, 2, 2)
            arr = {"type": "array", "items": items}
            if rng.random() < 0.5:
                arr["minItems"] = 1
            if rng.random() < 0.8:
                arr["maxItems"] = rng.randint(2, 4)
            props[name] = arr
            containers += 1
            continue
        leaf = _serving_leaf(rng, used)
        if leaf is not None:
            props[leaf[0]] = leaf[1]
    names = list(props)
    required = [n for i, n in enumerate(names) if i == 0 or rng.random() < 0.75]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _serving_schema_case(rng: random.Random) -> ServingCase:
    name, what = rng.choice(_TOOLS)
    schema = _serving_object(rng, rng.choice((3, 3, 4, 4, 5, 5, 6, 7, 8)), 1)
    prompt = (
        f"You can call the function `{name}` ({what}). Its arguments follow this JSON "
        f"schema: {json.dumps(schema)}\nCall it with plausible arguments. Reply with the arguments as one JSON object only."
    )
    return ServingCase(name, "json", schema, prompt)


_DATE_PARTS = {"Y": ("(19[5-9][0-9]|20[0-4][0-9])", "20[0-9]{2}", "(202[4-9]|2030)"), "M": ("(0[1-9]|1[0-2])",), "D": ("(0[1-9]|[12][0-9]|3[01])",)}
_EVENTS = ("the dentist appointment", "the product launch", "the next team offsite", "the concert", "the contract renewal", "your birthday party", "the tax deadline")
_PHONES = (
    ("US", r"\+1 \([2-9][0-9]{2}\) [0-9]{3}-[0-9]{4}"),
    ("UK mobile", r"\+44 7[0-9]{3} [0-9]{6}"),
    ("German", r"\+49 [1-9][0-9]{1,3} [0-9]{5,8}"),
    ("French", r"\+33 [1-9]( [0-9]{2}){4}"),
    ("Japanese", r"\+81 [0-9]{1,2}-[0-9]{4}-[0-9]{4}"),
    ("Indian", r"\+91 [6-9][0-9]{9}"),
    ("Brazilian", r"\+55 \([1-9][0-9]\) 9[0-9]{4}-[0-9]{4}"),
    ("US local", r"[2-9][0-9]{2}-[0-9]{3}-[0-9]{4}"),
)
_BUSINESSES = ("the pizza place downtown", "a dental clinic", "the city library", "a taxi company", "the hotel front desk", "a bike repair shop")
_ID_PREFIXES = ("TCK", "ORD", "INV", "BUG", "REQ", "SKU", "PRJ", "CASE", "EMP")
_TOPICS = ("the ocean", "friendship", "mountains", "coffee", "learning to code", "autumn", "trains", "the moon", "gardening")


def _serving_regex_case(rng: random.Random) -> ServingCase:
    fam = rng.choice(("date", "time", "phone", "identifier", "quoted", "email", "money", "misc", "answer", "list"))
    if fam == "date":
        order = rng.choice(("YMD", "DMY", "MDY"))
        sep = rng.choice(("-", "/", "."))
        year = rng.choice(_DATE_PARTS["Y"])
        parts = {"Y": year, "M": _DATE_PARTS["M"][0], "D": _DATE_PARTS["D"][0]}
        rx = escape_literal(sep).join(parts[c] for c in order)
        fmt = sep.join({"Y": "YYYY", "M": "MM", "D": "DD"}[c] for c in order)
        prompt = f"On which date is {rng.choice(_EVENTS)}? Answer with the date only, formatted {fmt}."
    elif fam == "time":
        if rng.random() < 0.5:
            rx, fmt = "([01][0-9]|2[0-3]):[0-5][0-9]" + (":[0-5][0-9]" if rng.random() < 0.5 else ""), "24-hour HH:MM"
        else:
            rx, fmt = "(1[0-2]|[1-9]):[0-5][0-9] " + rng.choice(("(AM|PM)", "(am|pm)", "(a\\.m\\.|p\\.m\\.)")), "12-hour h:mm with AM/PM"
        prompt = f"At what time does {rng.choice(_EVENTS)} start? Answer with the time only ({fmt})."
    elif fam == "phone":
        country, rx = rng.choice(_PHONES)
        prompt = f"What is the phone number of {rng.choice(_BUSINESSES)}? Reply with a {country} phone number only."
    elif fam == "identifier":
        style = rng.randrange(4)
        if style == 0:
            p, a = rng.choice(_ID_PREFIXES), rng.randint(3, 5)
            rx, what = f"{p}-[0-9]{{{a},{a + rng.randint(0, 3)}}}", f"{p} ticket"
        elif style == 1:
            a = rng.randint(2, 3)
            rx, what = f"[A-Z]{{{a},{a + 1}}}-[0-9]{{{rng.randint(3, 4)},6}}", "project issue key"
        elif style == 2:
            rx, what = f"[a-z][a-z0-9_]{{{rng.randint(2, 4)},{rng.choice((12, 15, 20))}}}", "snake_case variable name"
        else:
            rx, what = f"[0-9a-f]{{{rng.choice((7, 8, 12))}}}", "short git commit hash"
        prompt = f"Invent a {what} for a bug about {rng.choice(_TOPICS)}. Reply with the identifier only."
    elif fam == "quoted":
        if rng.random() < 0.6:
            rx = f'"[^"\\\\]{{1,{rng.choice((20, 30, 40, 60))}}}"'
        else:
            rx = f"'[A-Za-z ,.!?]{{{rng.randint(3, 8)},{rng.choice((30, 45, 60))}}}'"
        prompt = f"Quote one short sentence about {rng.choice(_TOPICS)}, in quotation marks, nothing else."
    elif fam == "email":
        dom = "(" + "|".join(rng.sample(("example", "mail", "corp", "acme", "school", "shop"), rng.randint(1, 3))) + ")"
        tld = "(" + "|".join(rng.sample(("com", "org", "net", "io", "de", "fr"), rng.randint(1, 3))) + ")"
        rx = f"[a-z]{{2,{rng.choice((8, 10, 12))}}}(\\.[a-z]{{2,12}})?@{dom}\\.{tld}"
        prompt = f"Write the email address of someone who works at {rng.choice(_BUSINESSES)}. The address only."
    elif fam == "money":
        cur = rng.choice(("\\$", "EUR ", "GBP ", "CHF "))
        rx = f"{cur}[1-9][0-9]{{0,{rng.randint(2, 5)}}}\\.[0-9]{{2}}"
        prompt = f"How much does a ticket for {rng.choice(_EVENTS)} cost? Answer with the amount only, e.g. {cur.replace(chr(92), '')}12.50."
    elif fam == "misc":
        what, rx = rng.choice(
            (
                ("an IPv4 address of a home router", r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])(\.(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])){3}"),
                ("a semantic version number", r"[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}"),
                ("a hex color code", r"#[0-9a-fA-F]{6}"),
                ("a US ZIP code", r"[0-9]{5}(-[0-9]{4})?"),
                ("a web address", r"https://(www\.)?[a-z]{3,12}\.(com|org|io)(/[a-z]{1,10}){0,2}"),
                ("a UK postcode", r"[A-Z]{1,2}[0-9][A-Z0-9]? [0-9][A-Z]{2}"),
                ("an ISBN-13", r"97[89]-[0-9]{1,5}-[0-9]{1,7}-[0-9]{1,6}-[0-9]"),
                ("a percentage", r"(100|[1-9]?[0-9])(\.[0-9])?%"),
            )
        )
        prompt = f"Give {what} that fits a story about {rng.choice(_TOPICS)}. Reply with it only."
    elif fam == "answer":
        yes_no = rng.choice(("(Yes|No)", "(yes|no)", "(True|False)", "(Agree|Disagree|Unsure)"))
        rx = f"{yes_no}[,.] [A-Z][a-z ,']{{{rng.randint(8, 15)},{rng.choice((40, 60, 80))}}}\\."
        prompt = f"Is {rng.choice(_TOPICS)} a good subject for a poem? Answer, then give one short reason."
    else:
        lo, hi = rng.randint(1, 2), rng.randint(3, 5)
        rx = f"[A-Z][a-z]{{2,12}}(, [A-Z][a-z]{{2,12}}){{{lo},{hi}}}"
        prompt = f"List a few names of pets for a story about {rng.choice(_TOPICS)}, separated by commas."
    return ServingCase(fam, "regex", rx, prompt)


def make_serving_cases(n: int, seed: int = SERVING_SEED) -> list[ServingCase]:
    """``n`` requests with pairwise distinct constraints (deterministic for a ``seed``): request ``i`` is a
    regex when ``i % 3 == 2`` (dates, times, phone numbers, identifiers, quoted text, ...), otherwise a
    tool-calling style JSON schema (3-8 properties, ≤ 2 nesting levels, enums, integer ranges, formats,
    patterns, bounded arrays, ``additionalProperties: false``). A prefix of a longer list is the shorter
    list, so the rows of one run draw from one list without sharing a constraint."""
    rng = random.Random(seed)
    out: list[ServingCase] = []
    seen: set[str] = set()
    while len(out) < n:
        case = _serving_regex_case(rng) if len(out) % SERVING_REGEX_EVERY == SERVING_REGEX_EVERY - 1 else _serving_schema_case(rng)
        if case.key() not in seen:
            seen.add(case.key())
            out.append(case)
    return out


def serving_body(case: ServingCase, backend: str, max_tokens: int = 96, temperature: float = 0.7, json_via: str = "response_format") -> dict:
    """The streamed chat-completions request of one serving case (no ``seed``: it kills the CPU engine)."""
    b: dict[str, Any] = {
        "model": str(MODEL),
        "messages": [{"role": "user", "content": case.prompt}],
        "temperature": temperature,
        "top_p": 1.0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if backend != "unconstrained":
        if case.kind == "regex":
            b["structured_outputs"] = {"regex": case.spec}
        elif json_via == "response_format":
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.spec}}
        else:
            b["structured_outputs"] = {"json": case.spec}
    xargs = _xargs(backend)
    if xargs:
        b["vllm_xargs"] = xargs
    return b


def output_valid(case: ServingCase, text: str) -> bool:
    """Whether ``text`` satisfies the case's constraint: ``re.fullmatch`` for a regex; for a schema,
    JSON that validates (Draft 2020-12 with the format checker: ``date``, ``email``, ``uuid``)."""
    if case.kind == "regex":
        return re.fullmatch(case.spec, text) is not None
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(case.spec, format_checker=jsonschema.FormatChecker()).is_valid(value)


def output_canonical(token_ids: list[int], text: str, tokenizer, stop_ids: set[int],
                     finish: str | None = None) -> bool | None:
    """Returned completion ids (trailing EOS removed) == the tokenizer's encoding of the returned text;
    None when the server returned no ids. With ``finish`` "length" (cut by ``max_tokens``): an output cut
    inside a multi-byte character has no such encoding (its text ends in U+FFFD), so its last tokens that
    do not complete a character are left out of the comparison."""
    if not token_ids:
        return None
    ids = strip_stop(token_ids, stop_ids)
    if finish == "length":
        for _ in range(4):  # (a UTF-8 character has at most 4 bytes: at most 3 tokens short of it)
            if not ids or not tokenizer.decode(ids).endswith("\ufffd"):
                break
            ids = ids[:-1]
        text = tokenizer.decode(ids)
    return ids == tokenizer.encode(text, add_special_tokens=False)


def _pct(xs: list[float], q: float) -> float | None:
    """Percentile ``q`` (0-100) with linear interpolation (numpy's default); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def _stream_one(session, base: str, body: dict) -> dict:
    """One streamed request: text, ids, finish reason, usage, TTFT (send → first content token) and
    latency (send → end of stream), or ``error``."""
    res: dict[str, Any] = {"ok": False, "error": None, "text": "", "token_ids": [], "finish": None,
                           "ttft": None, "latency": None, "completion_tokens": None}  # fmt: skip
    text: list[str] = []
    t0 = time.perf_counter()
    try:
        async with session.post(base + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                res["error"] = f"HTTP {r.status}: {(await r.text())[:300]}"
                return res
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                j = json.loads(data)
                if "error" in j and not j.get("choices"):
                    err = j["error"] if isinstance(j["error"], dict) else {"message": str(j["error"])}
                    res["error"] = f"HTTP {err.get('code') or 500} (in stream): {json.dumps(err)[:300]}"
                    return res
                for c in j.get("choices") or []:
                    delta = (c.get("delta") or {}).get("content") or ""
                    tids = c.get("token_ids") or []
                    if res["ttft"] is None and (delta or tids):
                        res["ttft"] = time.perf_counter() - t0
                    text.append(delta)
                    res["token_ids"].extend(tids)
                    res["finish"] = c.get("finish_reason") or res["finish"]
                usage = j.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res["completion_tokens"] = int(usage["completion_tokens"])
    except Exception as e:  # noqa: BLE001 - connection errors and timeouts are failed requests
        res["error"] = f"{type(e).__name__}: {e}"[:300]
        return res
    res["latency"] = time.perf_counter() - t0
    res["text"] = "".join(text)
    if res["ttft"] is None:
        res["ttft"] = res["latency"]
    if res["completion_tokens"] is None:
        res["completion_tokens"] = len(res["token_ids"])
    res["ok"] = True
    return res


# The /health poller: a process of its own (its own interpreter and connection), so that what it measures is
# the server's answer time, not the wait of a poll behind the client's own streams on one event loop.
_HEALTH_POLLER = r"""
import http.client, json, sys, threading, time, urllib.parse
u = urllib.parse.urlsplit(sys.argv[1])
period, timeout = float(sys.argv[2]), float(sys.argv[3])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
times, errors = [], []
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
print("ready", flush=True)
while not stop.is_set():
    t0 = time.perf_counter()
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            errors.append("HTTP %d" % r.status)
    except Exception as e:  # the time it took is what is measured
        errors.append(("%s: %s" % (type(e).__name__, e))[:200])
        conn.close()
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    dt = time.perf_counter() - t0
    times.append(dt)
    stop.wait(max(0.0, period - dt))
print(json.dumps({"times": times, "errors": errors}), flush=True)
"""


class HealthPoller:
    """``GET /health`` every ``period`` s from a separate process until :meth:`stop`; :meth:`stop` returns
    ``{"times": [s, ...], "errors": [...]}`` (a failed poll counts with the time it took)."""

    def __init__(self, base: str, period: float = 0.02, timeout: float = 30.0):
        self.proc = subprocess.Popen([sys.executable, "-c", _HEALTH_POLLER, base, str(period), str(timeout)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.proc.stdout.readline()  # "ready": polling starts now

    def stop(self) -> dict:
        try:
            out, _ = self.proc.communicate(input="", timeout=120)
            return json.loads(out.strip().splitlines()[-1])
        except Exception as e:  # noqa: BLE001 - a broken poller must not lose the batch's results
            self.proc.kill()
            return {"times": [], "errors": [f"health poller: {type(e).__name__}: {e}"[:200]]}


async def _serving_batch(base: str, bodies: list[dict], concurrency: int, timeout: float) -> tuple[list[dict], float, dict]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = [{} for _ in bodies]

    async def one(i: int, body: dict, session) -> None:
        async with sem:
            sent = time.perf_counter() - t0
            results[i] = await _stream_one(session, base, body)
            results[i]["sent_s"] = sent

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        poller = HealthPoller(base)
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(one(i, b, session) for i, b in enumerate(bodies)))
        finally:
            wall = time.perf_counter() - t0
            health = poller.stop()
    return results, wall, health


def run_serving(base: str, backend: str, cases: list[ServingCase], concurrency: int, max_tokens: int = 96,
                temperature: float = 0.7, json_via: str = "response_format", timeout: float = 600.0):
    """All ``cases`` as streamed requests, at most ``concurrency`` in flight, while ``/health`` is polled:
    (per-request results, wall time of the whole batch, ``{"times": /health response times, "errors": [...]}``)."""  # fmt: skip
    bodies = [serving_body(c, backend, max_tokens, temperature, json_via) for c in cases]
    return asyncio.run(_serving_batch(base, bodies, concurrency, timeout))


def serving_warmup(base: str, backend: str, max_tokens: int = 16) -> None:
    """Two untimed requests (a regex, a JSON schema; neither is among the generated constraints) so the
    first timed batch does not pay the server's one-time start-up work."""
    warm = [
        ServingCase("warmup", "regex", "(yes|no)", "Is the sky blue? Answer yes or no."),
        ServingCase("warmup", "json", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
                    "Reply with a JSON object with the key ok."),
    ]  # fmt: skip
    for c in warm:
        asyncio.run(_serving_batch(base, [serving_body(c, backend, max_tokens)], 1, 300.0))


def summarize_serving(backend: str, cases: list[ServingCase], results: list[dict], wall: float, health: dict,
                      concurrency: int, tokenizer, stop_ids: set[int]) -> dict[str, Any]:
    """One table row of the serving workload (times in ms); ``health`` as :func:`run_serving` returns it."""  # fmt: skip
    htimes = list(health.get("times", []))
    ok = [(c, r) for c, r in zip(cases, results) if r.get("ok")]
    failed = [r for r in results if not r.get("ok")]
    valid = [output_valid(c, r["text"]) for c, r in ok]
    canons = [output_canonical(r["token_ids"], r["text"], tokenizer, stop_ids, finish=r["finish"]) for _, r in ok]
    canon = [x for x in canons if x is not None]
    ttft = [1e3 * r["ttft"] for _, r in ok]
    lat = [1e3 * r["latency"] for _, r in ok]
    tokens = sum(r["completion_tokens"] or 0 for _, r in ok)
    chars = sum(len(r["text"] or "") for _, r in ok)
    bad = []  # up to 3 examples: the non-canonical outputs first (with their ids), then the invalid ones
    for (c, r), v, cn in sorted(zip(ok, valid, canons), key=lambda x: x[2] is not False):
        if (not v or cn is False) and len(bad) < 3:
            ex = {"kind": c.kind, "spec": c.spec if c.kind == "regex" else c.name, "text": r["text"][:300],
                  "finish": r["finish"], "valid": v, "canonical": cn}
            if cn is False:
                ex["token_ids"] = list(r["token_ids"])
            bad.append(ex)
    row = {
        "backend": backend,
        "workload": "serving",
        "requests": len(results),
        "concurrency": concurrency,
        "json_requests": sum(c.kind == "json" for c in cases),
        "regex_requests": sum(c.kind == "regex" for c in cases),
        "ok": len(ok),
        "failed": len(failed),
        "errors": [r.get("error") or "?" for r in failed[:3]],
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p90_ms": _pct(ttft, 90),
        "lat_p50_ms": _pct(lat, 50),
        "lat_p90_ms": _pct(lat, 90),
        "wall_s": wall,
        "completion_tokens": tokens,
        "tok_s": tokens / wall if wall > 0 and ok else None,
        "chars_s": chars / wall if wall > 0 and ok else None,
        "mean_tokens": tokens / len(ok) if ok else None,
        "capped": sum(r["finish"] == "length" for _, r in ok),
        "health_max_ms": 1e3 * max(htimes) if htimes else None,
        "health_p50_ms": _pct([1e3 * h for h in htimes], 50),
        "health_polls": len(htimes),
        "health_errors": len(health.get("errors", [])),
        "health_first_error": (health.get("errors") or [None])[0],
        "valid": sum(valid) / len(valid) if valid else None,
        "canonical": sum(canon) / len(canon) if canon else None,
        "canonical_n": len(canon),
        "bad_examples": bad,
        # one record per request (JSON output only): which constraint, when it was sent (ms after the
        # batch began), its TTFT and latency -- where a row's TTFT percentiles come from
        "per_request": [{"name": c.name, "kind": c.kind, "ok": bool(r.get("ok")),
                         "sent_ms": 1e3 * r.get("sent_s", 0.0),
                         "ttft_ms": 1e3 * r["ttft"] if r.get("ok") and r.get("ttft") is not None else None,
                         "latency_ms": 1e3 * r["latency"] if r.get("ok") and r.get("latency") is not None else None,
                         "tokens": r.get("completion_tokens"), "finish": r.get("finish")}
                        for c, r in zip(cases, results)],
    }
    row["tpot_p50_ms"] = _tpot_p50(row)
    row["ttft_burst_ms"], row["ttft_later_ms"] = _ttft_phases(row)
    return row


def _tpot_p50(r: dict) -> float | None:
    """Time per output token of a serving row, ms: the p50 over its requests with at least two tokens of
    (latency - TTFT) / (tokens - 1), from its ``per_request`` records. Unlike tokens/s over the batch's wall
    time, it does not depend on how many tokens the outputs have (a backend whose outputs end earlier, or
    spell a text in fewer tokens, produces fewer tokens in the same wall time)."""
    if r.get("tpot_p50_ms") is not None:
        return r["tpot_p50_ms"]
    vals = [(p["latency_ms"] - p["ttft_ms"]) / (p["tokens"] - 1) for p in r.get("per_request") or []
            if p.get("ok") and p.get("latency_ms") is not None and p.get("ttft_ms") is not None and (p.get("tokens") or 0) > 1]
    return _pct(vals, 50) if vals else None


def _ttft_phases(r: dict) -> tuple[float | None, float | None]:
    """TTFT medians (ms) of a serving row's first ``concurrency`` requests (the burst sent at once, which
    fills the server) and of the later ones (each sent as one before it ends), from its ``per_request``
    records (in the order sent); (None, None) without them. A row's TTFT p50 falls between the two when
    half its requests are the burst (64 × 32): the medians show which of them moves it."""
    if "ttft_burst_ms" in r:
        return r["ttft_burst_ms"], r.get("ttft_later_ms")
    burst, later = ([p["ttft_ms"] for p in recs] for recs in _sent_phases(r))
    return (_pct(burst, 50) if burst else None), (_pct(later, 50) if later else None)


def _sent_phases(r: dict) -> tuple[list[dict], list[dict]]:
    """A serving row's ``per_request`` records with a TTFT, split into its first ``concurrency`` requests
    (sent at once) and the later ones (each sent as one before it ends)."""
    recs = r.get("per_request") or []
    c = r["concurrency"]
    return ([p for p in recs[:c] if p.get("ttft_ms") is not None],
            [p for p in recs[c:] if p.get("ttft_ms") is not None])


def _size_key(r: dict) -> tuple:
    """Row size of a serving row: (requests, concurrency, constraints seen before)."""
    return (r["requests"], r["concurrency"], bool(r.get("repeat")))


def _size_label(n: int, c: int, repeat: bool) -> str:
    return f"{n} × {c}" + (", repeated" if repeat else "")


def _row_label(r: dict) -> str:
    return _size_label(*_size_key(r)) + (f", round {r['round']}" if r.get("round") else "")


def _merge_rounds(rs: list[dict]) -> dict:
    """One row for the targets from the rounds of a row size (same backend): medians of TTFT p50 / p90,
    tokens/s and wall time, the worst /health over all, pooled validity and canonicality."""
    if len(rs) == 1:
        return rs[0]
    out = dict(rs[0])
    for k in ("ttft_p50_ms", "ttft_p90_ms", "tok_s", "chars_s", "wall_s"):
        vals = [r[k] for r in rs if r.get(k) is not None]
        out[k] = _pct(vals, 50) if vals else None
    tp = [v for v in map(_tpot_p50, rs) if v is not None]
    out["tpot_p50_ms"] = _pct(tp, 50) if tp else None
    for i, k in enumerate(("ttft_burst_ms", "ttft_later_ms")):
        vals = [v[i] for v in map(_ttft_phases, rs) if v[i] is not None]
        out[k] = _pct(vals, 50) if vals else None
    hs = [r["health_max_ms"] for r in rs if r.get("health_max_ms") is not None]
    out["health_max_ms"] = max(hs) if hs else None
    out["health_errors"] = sum(r.get("health_errors", 0) for r in rs)
    ok = sum(r["ok"] for r in rs)
    out["ok"], out["failed"] = ok, sum(r["failed"] for r in rs)
    out["valid"] = sum((r.get("valid") or 0) * r["ok"] for r in rs) / ok if ok else None
    n = sum(r.get("canonical_n", 0) for r in rs)
    out["canonical_n"] = n
    out["canonical"] = sum((r.get("canonical") or 0) * r.get("canonical_n", 0) for r in rs) / n if n else None
    out["rounds"] = len(rs)
    return out


def render_serving_table(rows: list[dict]) -> str:
    head = (
        "| backend | requests × concurrency | ok / failed | TTFT p50 / p90 ms | latency p50 / p90 ms | time per output token p50 ms | completion tokens/s "
        "| completion characters/s | batch wall s | mean completion tokens | hit max_tokens | worst /health ms | constraint satisfied | canonical outputs |"
    )
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        cells = [
            r["backend"],
            _row_label(r),
            f"{r['ok']} / {r['failed']}",
            f"{_fmt(r.get('ttft_p50_ms'), 'd')} / {_fmt(r.get('ttft_p90_ms'), 'd')}",
            f"{_fmt(r.get('lat_p50_ms'), 'd')} / {_fmt(r.get('lat_p90_ms'), 'd')}",
            _fmt(_tpot_p50(r), "f", 1),
            _fmt(r.get("tok_s"), "f", 1),
            _fmt(r.get("chars_s"), "d"),
            _fmt(r.get("wall_s"), "f", 2),
            _fmt(r.get("mean_tokens"), "f", 1),
            f"{r.get('capped', 0)}" if r["ok"] else "–",
            _fmt(r.get("health_max_ms"), "f", 1),
            _fmt(r.get("valid"), "%"),
            _fmt(r.get("canonical"), "%"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def serving_targets(rows: list[dict]) -> list[str]:
    """The serving targets per row size, for fst (and fst-jump when measured), each met / NOT met."""
    out: list[str] = []

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    for size in dict.fromkeys(_size_key(r) for r in rows if not r.get("repeat")):  # targets: new constraints
        by: dict[str, list] = {}
        for r in rows:
            if _size_key(r) == size:
                by.setdefault(r["backend"], []).append(r)
        at = {b: _merge_rounds(rs) for b, rs in by.items()}
        x = at.get("xgrammar")
        for b in ("fst", "fst-jump"):
            f = at.get(b)
            if f is None:
                continue
            tag = f"{b} @ {size[0]} × {size[1]}" + (f" (median of {f['rounds']} rounds)" if f.get("rounds") else "")
            for key, lim, what in (("ttft_p50_ms", 1.0, "TTFT p50"), ("ttft_p90_ms", 1.5, "TTFT p90")):
                if x and f.get(key) is not None and x.get(key):
                    ratio = f[key] / x[key]
                    out.append(f"- {tag}: {what} ≤ {lim:.1f}× xgrammar: {ratio:.2f}× ({f[key]:.0f} vs {x[key]:.0f} ms) — {mark(ratio <= lim)}.")
                else:
                    out.append(f"- {tag}: {what} ≤ {lim:.1f}× xgrammar: not measured — NOT met.")
            if x and f.get("tok_s") and x.get("tok_s"):
                ratio = f["tok_s"] / x["tok_s"]
                ctx = ""
                if f.get("chars_s") and x.get("chars_s"):
                    ctx = f"; characters/s {f['chars_s'] / x['chars_s']:.2f}× ({f['chars_s']:.0f} vs {x['chars_s']:.0f})"
                out.append(f"- {tag}: tokens/s ≥ 1.0× xgrammar: {ratio:.2f}× ({f['tok_s']:.1f} vs {x['tok_s']:.1f}{ctx}) — {mark(ratio >= 1.0)}.")
            else:
                out.append(f"- {tag}: tokens/s ≥ 1.0× xgrammar: not measured — NOT met.")
            tf, tx = _tpot_p50(f), (_tpot_p50(x) if x else None)
            if tf is not None and tx:
                out.append(f"- {tag}: (context, not a target) time per output token p50: {tf:.1f} vs {tx:.1f} ms "
                           f"({tf / tx:.2f}× xgrammar's).")
            fb, fl = _ttft_phases(f)
            xb, xl = _ttft_phases(x) if x else (None, None)
            if fb is not None and fl is not None and xb and xl:
                out.append(f"- {tag}: (context, not a target) TTFT median of the burst (the first {size[1]} requests, "
                           f"sent at once) / of the later requests (each sent as one ends): {fb:.0f} / {fl:.0f} vs "
                           f"{xb:.0f} / {xl:.0f} ms ({fb / xb:.2f}× / {fl / xl:.2f}× xgrammar's).")
            if x and f.get("wall_s") and x.get("wall_s"):
                out.append(f"- {tag}: (context, not a target) batch wall time, the same requests to their end: "
                           f"{f['wall_s']:.2f} vs {x['wall_s']:.2f} s ({f['wall_s'] / x['wall_s']:.2f}× xgrammar's).")
            h, he = f.get("health_max_ms"), f.get("health_errors", 0)
            extra = f", {he} failed polls" if he else ""
            if x and x.get("health_max_ms") is not None:
                extra += f" (xgrammar {x['health_max_ms']:.1f} ms)"
            out.append(f"- {tag}: worst /health ≤ 50 ms: {_fmt(h, 'f', 1)} ms{extra} — {mark(h is not None and h <= 50.0 and not he)}.")
            v, c = f.get("valid"), f.get("canonical")
            good = f["failed"] == 0 and v == 1.0 and c == 1.0 and f.get("canonical_n") == f["ok"]
            out.append(
                f"- {tag}: 100 % valid and canonical: valid {_fmt(v, '%')}, canonical {_fmt(c, '%')} "
                f"({f.get('canonical_n', 0)} of {f['ok']} outputs with ids), {f['failed']} failed — {mark(good)}."
            )
    return out


def make_serving_plot(rows: list[dict], path: Path) -> Path | None:
    """TTFT p50/p90 and completion tokens/s per backend, one bar group per row size."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = list(dict.fromkeys(r["backend"] for r in rows))
    sizes = list(dict.fromkeys(_size_key(r) for r in rows))
    get = {(r["backend"],) + _size_key(r): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(sizes))
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for si, (n, c, again) in enumerate(sizes):
        xs = [i + si * width for i in range(len(backends))]
        p50 = [(get.get((b, n, c, again)) or {}).get("ttft_p50_ms") or 0.0 for b in backends]
        p90 = [(get.get((b, n, c, again)) or {}).get("ttft_p90_ms") or 0.0 for b in backends]
        col = colors[si % len(colors)]
        lab = _size_label(n, c, again)
        axes[0].bar(xs, p90, width, color=col, alpha=0.35, label=f"{lab}: p90")
        axes[0].bar(xs, p50, width, color=col, label=f"{lab}: p50")
        tps = [(get.get((b, n, c, again)) or {}).get("tok_s") or 0.0 for b in backends]
        axes[1].bar(xs, tps, width, color=col, label=lab)
    for ax in axes:
        top = max([0.0] + [p.get_height() for p in ax.patches])
        ax.set_ylim(0, 1.3 * top if top > 0 else 1.0)  # room for the legend
        ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(backends))], backends)
        ax.tick_params(axis="x", rotation=20, labelsize=8)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("time to first token (ms)")
    axes[0].set_title("TTFT per request (p50 solid, p90 light)")
    axes[1].set_ylabel("completion tokens/s (whole batch)")
    axes[1].set_title("Throughput (streamed, temperature 0.7)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def host_note() -> str:
    import platform

    try:
        from importlib.metadata import version

        try:
            v = version("vllm-cpu")
        except Exception:  # noqa: BLE001
            v = version("vllm")
    except Exception:  # noqa: BLE001
        v = "?"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load} at the end of the run, vLLM {v}"


def serving_notes(meta: dict, rows: list[dict]) -> list[str]:
    s = meta.get("serving", {})
    notes = [
        f"Each request brings its own constraint (none repeats within a run, the two row sizes included): a "
        f"tool-calling style JSON schema (two requests in three: 3-8 properties, ≤ 2 nesting levels, enums, integer "
        f"ranges, `format` date/email/uuid, `pattern`, bounded arrays, `additionalProperties: false`; sent as "
        f"`{s.get('json_via', 'response_format')}`) or a regex (one in three: dates, times, phone numbers, identifiers, "
        f"quoted text, emails, amounts, ...; `structured_outputs.regex`), generated by `make_serving_cases` with the fixed "
        f"seed {SERVING_SEED}. Chat completions, streamed, temperature {s.get('temperature', 0.7)}, no seed, "
        f"max_tokens {s.get('max_tokens', 96)}, the prompt shows the schema or describes the format. Two untimed "
        f"warm-up requests per server first.",
        "TTFT: request sent → first streamed chunk with content (includes compilation and queueing behind the other "
        "requests in flight); latency: sent → end of stream; tokens/s: completion tokens (`usage`, "
        "`stream_options.include_usage`) of all requests / wall time of the whole batch (column \"batch wall s\": the "
        "backends' outputs differ in text and in length, a non-canonical path often spells a text in more tokens, so "
        "tokens/s and the batch's wall time can rank backends differently; characters/s: the outputs' characters / "
        "the same wall time, a measure that does not depend on how many tokens spell a text); worst /health: slowest "
        "`GET /health` answer while the batch ran (polled every 20 ms over its own connection by a separate client "
        "process, `HealthPoller`: a poll of the client's own event loop also waited for the streams it reads); constraint satisfied: `re.fullmatch`, or `json.loads` + `Draft202012Validator` with `FormatChecker` "
        "(outputs cut by max_tokens count as unsatisfied: column \"hit max_tokens\"); canonical: the streamed "
        "`token_ids` (trailing EOS removed) == the tokenizer's encoding of the text (an output cut by max_tokens inside a "
        "multi-byte character: its last tokens that do not complete a character left out, as in the other workloads). "
        "Servers run with `--enforce-eager`.",
        f"Host: {meta.get('host', '?')}. The client shares the machine with the server: speed figures are noisy.",
    ]
    if any(r.get("round") for r in rows):
        where = ("on a fresh server per backend and round (`--serving-interleave`; the backends in the order of "
                 "`--backends` in odd rounds, reversed in even ones, so that no backend always runs first)"
                 if meta.get("serving", {}).get("interleave") else "again on the same server")
        notes.append(
            f"Rows \"round k\": a row size run {where}, each round with new constraints "
            "(the next cases of the same seeded list; round 1 of every size first, then round 2, ...): a run's figures vary a lot on this "
            "host, so the targets use each backend's medians over the rounds (TTFT p50 / p90, tokens/s), its worst "
            "/health over all of them, and its outputs pooled."
        )
    if any(r.get("repeat") for r in rows):
        notes.append(
            "Rows \"repeated\": the first row's requests sent again to the same server after the other rows, so every "
            "constraint has been seen before (each backend's own compile cache: fst's host-shared disk cache, "
            "xgrammar's and llguidance's in-process caches), as when an application sends the same tool schemas "
            "again. The targets apply to the rows with new constraints only. Each fst server starts with an empty "
            "disk cache (a fresh `VLLM_FST_DISK_CACHE_DIR`)."
        )
    for name, ((var, value), what) in EXTRA_SERVING_BACKENDS.items():
        if any(r["backend"] == name for r in rows):
            notes.append(f"Rows \"{name}\": fst with `{var}={value}`: {what}; same constraints and prompts as the fst rows.")
    split = serving_steady_split(rows)
    if split:
        notes.append(
            "Per request (the JSON output's `per_request` records): TTFT p50 in ms of the JSON-schema / regex "
            "requests sent after the first `concurrency` ones (those are sent together, at the start), rows with new "
            "constraints: " + "; ".join(split) + "."
        )
    for r in rows:
        if r["failed"]:
            notes.append(f"{r['backend']} @ {_row_label(r)}: {r['failed']} failed requests, first error: `{(r['errors'] or ['?'])[0][:200]}`")
        if r.get("health_errors"):
            notes.append(f"{r['backend']} @ {_row_label(r)}: {r['health_errors']} failed /health polls, first: `{r.get('health_first_error')}`")
    return notes


_CACHE_HIT_LINE = re.compile(r"fst: request \S+: \w+ constraint \(.*\) compiled in ([0-9.]+) ms \(cache hit\)")


def engine_load_stats(log_paths: list[Path]) -> dict | None:
    """p50 / p90 / max ms (and n) of the fst engine's grammar creations from the disk cache, read from
    server logs (``FstBackend.compile_request``'s line ending in "(cache hit)"); None without any."""
    try:
        ms = [float(m.group(1)) for p in log_paths
              for m in map(_CACHE_HIT_LINE.search, p.read_text(errors="replace").splitlines()) if m]
    except OSError:
        return None
    if not ms:
        return None
    return {"n": len(ms), "p50": _pct(ms, 50), "p90": _pct(ms, 90), "max": max(ms)}


def serving_steady_split(rows: list[dict]) -> list[str]:
    """Per row with ``per_request`` records (not the repeated rows): ``"<backend> @ <size>: J / R"``, the
    TTFT p50 (ms) of the JSON-schema (J) and regex (R) requests after the first ``concurrency`` requests."""
    out = []
    for r in rows:
        recs = r.get("per_request") or []
        if r.get("repeat") or len(recs) <= r["concurrency"]:
            continue
        later = _sent_phases(r)[1]
        med = [_pct([p["ttft_ms"] for p in later if p["kind"] == k], 50) for k in ("json", "regex")]
        out.append(f"{r['backend']} @ {_row_label(r)}: {_fmt(med[0], 'd')} / {_fmt(med[1], 'd')}")
    return out


def write_serving_report(out_md: Path, data: dict) -> list[str]:
    """The "## Serving workload" section (table, plot, notes, targets) of the serving rows in ``data``."""
    rows = [r for r in data["rows"] if r.get("workload") == "serving"]
    meta = data["meta"]
    out_md.parent.mkdir(parents=True, exist_ok=True)
    png = make_serving_plot(rows, out_md.parent / SERVING_PNG)
    body = render_serving_table(rows) + (f"\n\n![serving workload]({png.name})" if png else "")
    notes = serving_notes(meta, rows)
    for b, e in data.get("server_fail", {}).items():
        notes.append(f"{b}: server did not start: `{e}`")
    for b, e in data.get("serving_fail", {}).items():
        notes.append(f"{b}: the serving workload stopped with an error: `{e}`")
    loads = {b: v for b, v in data.get("engine_loads", {}).items() if v}
    if loads:
        notes.append(
            "Engine side of an fst request whose automaton the API server's compile check stored (from the server log, "
            "`compiled in X ms (cache hit)`: the grammar made in the engine core from the host's disk cache, every request "
            "of the run, warm-ups included), ms p50 / p90 / max: "
            + "; ".join(f"{b} {v['p50']:.1f} / {v['p90']:.1f} / {v['max']:.1f} (n = {v['n']})" for b, v in loads.items()) + "."
        )
    startup = {b: v for b, v in data.get("startup_s", {}).items() if any(r["backend"] == b for r in rows)}
    if startup:
        notes.append("Server start-up (s): " + ", ".join(f"{k} {v:.0f}" for k, v in startup.items()) + f". Whole run: {meta['total_s'] / 60:.1f} min.")
    tgt = serving_targets(rows)
    if tgt:
        notes.append("Targets:\n" + "\n".join(tgt))
    _write_section(out_md, SERVING_TITLE, meta["command"], body, "\n\n".join(notes))
    return tgt


def _write_section(out_md: Path, title: str, command: str, body: str, note: str) -> None:
    from scripts import bench_common

    old = bench_common.BENCH_MD
    bench_common.BENCH_MD = out_md
    try:
        bench_common.write_section(title, command, body, note)
    finally:
        bench_common.BENCH_MD = old


@dataclass
class ServingConfig:
    sizes: list[tuple[int, int]]  # (requests, concurrency) per row
    max_tokens: int = 96
    temperature: float = 0.7
    json_via: str = "response_format"
    timeout: float = 600.0
    repeat: bool = False  # run the first row size again on the same server (its constraints seen before)
    rounds: int = 1  # runs of the first row size, each with new constraints (targets: their medians)
    large_rounds: int = 1  # the same for the other row sizes
    interleave: bool = False  # each round on fresh servers, the backends' order reversed every other round


def serving_plan(scfg: ServingConfig, round_no: int | None = None) -> list[tuple[int, int, int, bool, int]]:
    """The runs of the serving workload on one server, in order: ``(first case, requests, concurrency,
    constraints seen before, round or 0)``, indices into :func:`make_serving_cases`. Round 1 of every row
    size, then round 2 of every size that has one, and so on (a spell of host noise does not fall on the
    rounds of one size only); every run has new constraints but the first size repeated, last.
    ``round_no``: only the runs of that round (round 1: with the unnumbered runs and the repeated one,
    which must run on the server that saw its constraints), the same case indices."""
    rounds = [max(scfg.rounds if i == 0 else scfg.large_rounds, 1) for i in range(len(scfg.sizes))]
    runs, start = [], 0
    for k in range(1, max(rounds, default=1) + 1):
        for (n, conc), r in zip(scfg.sizes, rounds):
            if k <= r:
                runs.append((start, n, conc, False, k if r > 1 else 0))
                start += n
    if scfg.sizes and scfg.repeat:
        runs.append((0, scfg.sizes[0][0], scfg.sizes[0][1], True, 0))
    if round_no is not None:
        runs = [x for x in runs if max(x[4], 1) == round_no]
    return runs


def serving_round_count(scfg: ServingConfig) -> int:
    """The rounds of :func:`serving_plan` (the most of any row size)."""
    return max([max(scfg.rounds, 1)] + [max(scfg.large_rounds, 1)] * (len(scfg.sizes) > 1))


def serving_order(backends: list[str], round_no: int) -> list[str]:
    """The backends' order in a round of ``--serving-interleave``: as given in odd rounds, reversed in
    even ones (no backend always runs first, on a host that has just started or finished another
    server)."""
    return list(backends) if round_no % 2 else list(reversed(backends))


def serving_rows(backend: str, base: str, scfg: ServingConfig, tokenizer, stop_ids: set[int],
                 round_no: int | None = None) -> list[dict]:
    """Every run of :func:`serving_plan` (of round ``round_no`` only, when given) on one running server."""
    full = serving_plan(scfg)
    cases = make_serving_cases(max((a + n for a, n, _, again, _ in full if not again), default=0))
    plan = full if round_no is None else serving_plan(scfg, round_no)
    serving_warmup(base, backend)
    runs = [(cases[a : a + n], conc, again, rnd) for a, n, conc, again, rnd in plan]
    rows = []
    for part, conc, again, rnd in runs:
        print(f"[bench_e2e] {backend}/serving: {_size_label(len(part), conc, again)}{f', round {rnd}' if rnd else ''} ...", flush=True)
        results, wall, health = run_serving(base, backend, part, conc, scfg.max_tokens, scfg.temperature, scfg.json_via, scfg.timeout)
        row = summarize_serving(backend, part, results, wall, health, conc, tokenizer, stop_ids)
        if again:
            row["repeat"] = True
        if rnd:
            row["round"] = rnd
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--backends", default=None,
        help=f"comma list of {', '.join(ALL_BACKENDS)} (default: all; with --workloads serving alone: {','.join(SERVING_BACKENDS)}; "
             "serving alone also takes "
             + ", ".join(f"{b}: fst with {v}={x}" for b, ((v, x), _) in EXTRA_SERVING_BACKENDS.items()) + ")",
    )  # fmt: skip
    ap.add_argument(
        "--workloads", default=",".join(ALL_WORKLOADS),
        help=f"comma list of {', '.join(ALL_WORKLOADS + EXTRA_WORKLOADS)} (default {','.join(ALL_WORKLOADS)})",
    )  # fmt: skip
    ap.add_argument("--questions", type=int, default=20, help="multiple-choice questions")
    ap.add_argument("--samples", type=int, default=30, help="k: sampled answers per question (temperature 1, n=k)")
    ap.add_argument("--template-samples", type=int, default=50, help="samples of each template workload")
    ap.add_argument("--batch", type=int, default=50, help="max n per sampling request")
    ap.add_argument("--stream-repeats", type=int, default=3,
                    help="template workloads: greedy streams after the first one (single-stream tokens/s)")
    ap.add_argument("--mc-max-tokens", type=int, default=16)
    ap.add_argument("--template-max-tokens", type=int, default=192)
    ap.add_argument("--serving-requests", type=int, default=24, help="serving workload: requests of the first row (each its own constraint)")
    ap.add_argument("--serving-concurrency", type=int, default=8, help="serving workload: requests in flight in the first row")
    ap.add_argument("--serving-large-requests", type=int, default=64, help="serving workload: requests of the second row")
    ap.add_argument("--serving-large-concurrency", type=int, default=32, help="serving workload: requests in flight in the second row")
    ap.add_argument("--no-serving-large", action="store_true", help="serving workload: skip the second (64 × 32) row")
    ap.add_argument(
        "--serving-repeat", action="store_true",
        help="serving workload: run the first row again on the same server, its constraints now seen before "
             "(each backend's compile cache), as the row '<n> × <c>, repeated'",
    )  # fmt: skip
    ap.add_argument(
        "--serving-rounds", type=int, default=1,
        help="serving workload: run the first row size this many times on the same server, each round with new "
             "constraints (rows '<n> × <c>, round k'); the targets then use the medians over the rounds",
    )  # fmt: skip
    ap.add_argument(
        "--serving-large-rounds", type=int, default=1,
        help="serving workload: the same for the second row size (64 × 32)",
    )  # fmt: skip
    ap.add_argument(
        "--serving-interleave", action="store_true",
        help="serving workload alone: each round on fresh servers, the backends in the given order in odd rounds "
             "and reversed in even ones (else each backend's server runs every round, one backend after the other)",
    )  # fmt: skip
    ap.add_argument("--serving-max-tokens", type=int, default=96)
    ap.add_argument("--serving-temperature", type=float, default=0.7)
    ap.add_argument(
        "--serving-json-via", choices=("response_format", "structured_outputs"), default="response_format",
        help="how the serving workload sends its JSON schemas (regexes always go in structured_outputs.regex)",
    )  # fmt: skip
    ap.add_argument("--jump-k", type=int, default=8, help="num_speculative_tokens of the forced-token proposer")
    ap.add_argument("--seed", type=int, default=0, help="RNG of the question set (never sent to the server)")
    ap.add_argument("--port", type=int, default=None, help="default: first free port in 8790-8799")
    ap.add_argument("--server-url", default=None, help="use this running server (one backend, named by --backends) instead of starting one")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument(
        "--fst-artifacts", type=Path, default=Path(os.environ.get("VLLM_FST_ARTIFACTS_DIR", REPO_ROOT / "tokenizer_artifacts" / MODEL.name)),
        help="fst tokenizer artifacts (checked first, rebuilt if unusable); default $VLLM_FST_ARTIFACTS_DIR or tokenizer_artifacts/<model>",
    )
    ap.add_argument(
        "--compiled", action="store_true",
        help="let vLLM torch.compile the model (~60 s more per server start on 2 cores); default --enforce-eager",
    )  # fmt: skip
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for every server (repeatable)")
    ap.add_argument("--out-md", type=Path, default=None, help="benchmarks file to write (default docs/benchmarks.md); PNGs go next to it")
    ap.add_argument("--no-write", action="store_true", help="print the tables and targets, write no markdown and no plots")
    ap.add_argument("--json-out", type=Path, default=None, help="also dump the raw rows as JSON")
    ap.add_argument("--rerender", type=Path, default=None, help="re-write the section from a --json-out file of an earlier run (no server)")
    ap.add_argument("--log-dir", type=Path, default=None, help="keep the server logs here (default: a temp dir)")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    a.workloads = tuple(w.strip() for w in a.workloads.split(",") if w.strip())
    if a.backends is None:
        a.backends = ",".join(SERVING_BACKENDS if a.workloads == ("serving",) else ALL_BACKENDS)
    a.backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    for b in a.backends:
        if b not in ALL_BACKENDS and not (b in EXTRA_SERVING_BACKENDS and a.workloads == ("serving",)):
            ap.error(f"unknown backend {b!r}")
    for w in a.workloads:
        if w not in ALL_WORKLOADS + EXTRA_WORKLOADS:
            ap.error(f"unknown workload {w!r}")
    for name in ("serving_requests", "serving_concurrency", "serving_large_requests", "serving_large_concurrency", "serving_max_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be ≥ 1")
    if a.server_url and len(a.backends) != 1:
        ap.error("--server-url needs exactly one backend in --backends")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rerender:  # re-write the section(s) from a stored run (its own command and numbers), no server
        data = json.loads(args.rerender.read_text())
        out_md = args.out_md or (REPO_ROOT / "docs" / "benchmarks.md")
        print("\n".join(write_report(out_md, data)))
        return 0
    argv_list = sys.argv[1:] if argv is None else list(argv)
    command = "python scripts/bench_e2e.py" + (" " + shlex.join(argv_list) if argv_list else "")
    progress = not args.no_progress
    from transformers import AutoTokenizer

    t_start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    stop_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}
    stop_ids |= {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tokenizer.get_vocab()}

    questions = make_questions(args.questions, args.seed) if "mc" in args.workloads else []
    refs = score_references(questions, tokenizer, progress) if questions else []
    fid: dict[str, Any] = {}
    if refs:
        p_ref = [r.p_ref for r in refs]
        fid = {
            "k": args.samples,
            "canon": simulated_tv([r.p_canon for r in refs], p_ref, args.samples),
            "noise": simulated_tv(p_ref, p_ref, args.samples),
            "canon_exact_tv": sum(tv(r.p_canon, r.p_ref) for r in refs) / len(refs),
            "ref_acc": sum(q.options[max(range(4), key=lambda i: r.p_ref[i])] == q.answer for q, r in zip(questions, refs)) / len(refs),
        }
    cfg = Config(
        questions, refs, args.samples, args.template_samples, args.batch, args.mc_max_tokens, args.template_max_tokens, args.workloads,
        stream_repeats=args.stream_repeats,
    )
    sizes = [(args.serving_requests, args.serving_concurrency)]
    if not args.no_serving_large:
        sizes.append((args.serving_large_requests, args.serving_large_concurrency))
    scfg = ServingConfig(sizes, args.serving_max_tokens, args.serving_temperature, args.serving_json_via, repeat=args.serving_repeat,
                         rounds=max(1, args.serving_rounds), large_rounds=max(1, args.serving_large_rounds),
                         interleave=args.serving_interleave)
    do_serving = "serving" in args.workloads

    serving_fail: dict[str, str] = {}

    def serving(backend: str, base: str, round_no: int | None = None) -> None:
        if not do_serving:
            return
        try:
            got = serving_rows(backend, base, scfg, tokenizer, stop_ids, round_no)
        except Exception as e:  # noqa: BLE001 - reported in the section, the other backends go on
            serving_fail[backend] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            print(f"[bench_e2e] {backend}/serving failed: {e!r}", file=sys.stderr, flush=True)
            return
        for row in got:
            rows.append(row)
            print(f"[bench_e2e] {backend}/serving {_row_label(row)}: " + json.dumps({k: v for k, v in row.items() if k not in ("bad_examples", "per_request")}, default=str), flush=True)

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    startup: dict[str, float] = {}
    server_fail: dict[str, str] = {}
    artifacts = args.fst_artifacts.resolve()
    if any(b.startswith("fst") for b in args.backends) and not args.server_url:
        print(f"[bench_e2e] fst artifacts {artifacts}: {ensure_fst_artifacts(artifacts, progress)}", flush=True)
    # (backend, serving round or None: every round); with --serving-interleave, one server per round
    servers = [(b, None) for b in args.backends]
    if scfg.interleave and not args.server_url:
        servers = [(b, k) for k in range(1, serving_round_count(scfg) + 1) for b in serving_order(args.backends, k)]
    logs: dict[str, list[Path]] = {}
    for backend, round_no in servers:
        log_path = log_dir / (f"server_{backend}.log" if round_no is None else f"server_{backend}_round{round_no}.log")
        if args.server_url:  # a server somebody else started (e.g. a test fixture): no start, no log
            log_path.touch()
            res = run_backend(backend, Client(args.server_url.rstrip("/")), cfg, log_path, progress)
            for wl, st in res.items():
                rows.append(summarize(backend, wl, st, cfg, tokenizer, stop_ids))
            serving(backend, args.server_url.rstrip("/"))
            continue
        port = args.port or pick_port()
        print(f"[bench_e2e] starting the {backend} server on port {port} (log {log_path}) ...", flush=True)
        try:
            with vllm_server(backend, port, log_path, args.jump_k, args.server_arg, args.start_timeout, artifacts, not args.compiled) as (base, ready_s, _proc):
                startup.setdefault(backend, ready_s)  # (the first start's)
                print(f"[bench_e2e] {backend} server ready in {ready_s:.0f} s", flush=True)
                if round_no in (None, 1):
                    res = run_backend(backend, Client(base), cfg, log_path, progress)
                    for wl, st in res.items():
                        row = summarize(backend, wl, st, cfg, tokenizer, stop_ids)
                        rows.append(row)
                        print(f"[bench_e2e] {backend}/{wl}: " + json.dumps({k: v for k, v in row.items() if k not in ('tv_list', 'examples', 'greedy_ids')}, default=str), flush=True)
                serving(backend, base, round_no)
            if backend.startswith("fst") and do_serving:
                logs.setdefault(backend, []).append(log_path)
        except Exception as e:  # noqa: BLE001 - a backend that cannot start is reported, the others go on
            server_fail[backend] = str(e).splitlines()[0][:200]
            print(f"[bench_e2e] {backend} failed: {e}", file=sys.stderr, flush=True)
            continue

    engine_loads = {b: engine_load_stats(paths) for b, paths in logs.items()}  # (every round's log, read once)
    total_s = time.monotonic() - t_start
    meta = {"command": command, "total_s": total_s, "questions": len(questions), "samples": args.samples, "batch": args.batch,
            "host": host_note(), "workloads": list(args.workloads),
            "serving": {"sizes": sizes, "max_tokens": scfg.max_tokens, "temperature": scfg.temperature, "json_via": scfg.json_via,
                        "interleave": bool(scfg.interleave and not args.server_url)}}  # fmt: skip
    data = {"meta": meta, "rows": rows, "fidelity": fid, "startup_s": startup, "server_fail": server_fail, "serving_fail": serving_fail,
            "engine_loads": engine_loads}
    if args.json_out:
        args.json_out.write_text(json.dumps(data, indent=1, default=str))
    srows = [r for r in rows if r.get("workload") == "serving"]
    if srows:
        print("\n" + render_serving_table(srows))
    if args.no_write:
        tgt = targets_text([r for r in rows if r.get("workload") != "serving"], fid) + serving_targets(srows)
        print(f"[bench_e2e] --no-write: nothing written ({len(rows)} rows) in {total_s / 60:.1f} min", flush=True)
    else:
        out_md = args.out_md or (REPO_ROOT / "docs" / "benchmarks.md")
        tgt = write_report(out_md, data)
        print(f"[bench_e2e] wrote {out_md} ({len(rows)} rows) in {total_s / 60:.1f} min", flush=True)
    print("\n".join(tgt))
    return 0


def write_report(out_md: Path, data: dict) -> list[str]:
    """Sections of one run (``data`` = what ``--json-out`` stores) into ``out_md``: the end-to-end section
    when the run has rows of mc/pokedex/json, the "Serving workload" section when it has serving rows
    (each section is replaced on its own; the other sections of the file stay as they are)."""
    tgt: list[str] = []
    wls = data["meta"].get("workloads")  # None in files of runs from before the serving workload
    main_rows = [r for r in data["rows"] if r.get("workload") != "serving"]
    if main_rows or wls is None or any(w in ALL_WORKLOADS for w in wls):
        tgt += _write_e2e_report(out_md, dict(data, rows=main_rows))
    if len(main_rows) < len(data["rows"]) or (wls is not None and "serving" in wls):
        tgt += write_serving_report(out_md, data)
    return tgt


def _write_e2e_report(out_md: Path, data: dict) -> list[str]:
    """Table, plots and notes of the mc/pokedex/json rows of one run into ``out_md``."""
    meta, rows, fid = data["meta"], data["rows"], data["fidelity"]
    startup, server_fail = data.get("startup_s", {}), data.get("server_fail", {})
    out_md.parent.mkdir(parents=True, exist_ok=True)
    pngs = make_plots(rows, fid, out_md.parent, "bench_e2e")
    body = render_table(rows)
    body += "\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs)
    notes = []
    if fid:
        notes.append(
            f"Fidelity ({meta['questions']} ISO 3166-2 questions, k={meta['samples']} samples each at temperature 1): reference = "
            f"normalized total log-probability of each option's canonical tokenization (transformers, float32; vLLM serves "
            f"bf16). Offline, from the same reference: **exact canonical sampling** (k draws from the distribution token-by-token "
            f"canonical sampling gives, i.e. renormalized over the canonical tokens at each step) mean TV "
            f"{fid['canon'][0]:.3f} (95 % range {fid['canon'][1]:.3f}–{fid['canon'][2]:.3f}; its exact distribution is "
            f"{fid['canon_exact_tv']:.3f} from the reference: the local renormalization of *any* token-by-token constrained "
            f"sampler, e.g. after `B` of `Bermuda` the constraint forces `erm` whatever the model thinks of it); **noise floor** "
            f"(k draws from the reference itself) {fid['noise'][0]:.3f} (95 % range {fid['noise'][1]:.3f}–{fid['noise'][2]:.3f}). "
            f"Reference argmax accuracy {100 * fid['ref_acc']:.1f} %."
        )
    mism = sum(r.get("prompt_mismatch", 0) for r in rows)
    notes.append(
        "Canonical outputs: returned `token_ids` (trailing EOS removed) == the tokenizer's encoding of the returned text; "
        "an output cut by max_tokens inside a multi-byte character is judged on its complete characters "
        "(unconstrained sampling at temperature 1 is itself not always canonical, e.g. ` sp` `ark` for ` spark`). "
        "tokens/s: completion tokens of the temperature-1 requests / their wall time (one request at a time, n samples each, "
        f"max n={meta['batch']}); the ratio to unconstrained compares runs whose outputs differ in length (unconstrained "
        "answers of the MC prompts run ~14 tokens vs ~3.5 constrained, so per-request overhead dominates the constrained MC "
        "figure; template outputs run to max_tokens unconstrained). On this CPU a step of the 135M model over 50 sequences is "
        "bound by its arithmetic, so every backend's n = 50 rate is capped by the unconstrained one, and forced tokens, which "
        "the model must still read, save little there. Single-stream tokens/s: greedy streamed requests (n = 1, template "
        "workloads: the first one and the same request again `--stream-repeats` times, the median), tokens after the first / "
        "time from the first token to the end of the stream: the decode rate one user sees, where a step's cost is mostly "
        "fixed and skipping model calls pays. TTFT: streamed greedy request, the first one with its "
        "constraint (includes compilation). Forced-state tokens: share of fst tokens emitted where only one token was allowed "
        "(server log); model calls skipped: accepted forced drafts / generated tokens (jumps, `/metrics`). Servers run with "
        "`--enforce-eager` (saves ~60 s of torch.compile per start; `--compiled` to change) on a 2-core machine shared with "
        f"other work: speed figures are noisy. Prompts the server tokenized differently from the offline reference: {mism}."
    )
    if startup:
        notes.append("Server start-up (s): " + ", ".join(f"{k} {v:.0f}" for k, v in startup.items()) + f". Whole run: {meta['total_s'] / 60:.1f} min.")
    for r in rows:
        if r["failed"]:
            notes.append(f"{r['backend']}/{r['workload']}: {r['failed']} failed requests, e.g. `{(r['errors'] or [''])[0][:160]}`")
    for b, e in server_fail.items():
        notes.append(f"{b}: server did not start: `{e}`")
    tgt = targets_text(rows, fid)
    if tgt:
        notes.append("Targets:\n" + "\n".join(tgt))

    _write_section(out_md, SECTION_TITLE, meta["command"], body, "\n\n".join(notes))
    return tgt

if __name__ == "__main__":
    sys.exit(main())
