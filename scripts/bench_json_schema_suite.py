#!/usr/bin/env python
"""The official JSON Schema Test Suite (draft 2020-12) through fst, xgrammar, llguidance and outlines-core.

For every schema of ``tests/data/json_schema_test_suite/draft2020-12`` (the top-level files, ``optional/``
and ``refRemote.json``, each reported in its own row: nothing is skipped) and every backend:

* **fst** (canonical mode, tokenizer ``models/SmolLM2-135M-Instruct``, artifacts
  ``tokenizer_artifacts/SmolLM2-135M-Instruct``): :func:`vllm_fst_backend.compiler.constraints.json_schema_to_regex`
  (a named refusal -> "refused", counted by reason), then ``compile_regex`` (canonical, the server's
  budgets; a budget error -> "refused: budget"), then every test instance of the schema is walked through a
  fresh :class:`~vllm_fst_backend.runtime.FstMatcher`, token by token, then EOS: accepted iff every token
  and EOS are accepted. The regex alone is also checked with a backtracking matcher (``regex.fullmatch``,
  at most :data:`REGEX_CHECK_S` per instance: nested repetitions can take it exponential time) on the same
  text; a disagreement with the matcher is reported.
* **xgrammar**, **llguidance**, **outlines-core**: compiled the way vLLM 0.32 compiles a JSON-schema
  request for an explicitly chosen backend (default ``StructuredOutputsConfig``: any whitespace, additional
  properties as the schema says): the request validation vLLM runs in the API server
  (``validate_xgrammar_grammar`` / ``validate_guidance_grammar`` / ``validate_structured_output_request_outlines``;
  a failure -> "refused"), then the backend's own ``compile_grammar`` (vLLM's backend classes, built with the
  same tokenizer and ``vocab_size`` 49152), then the same token sequences + EOS through vLLM's grammar
  wrappers (``accept_tokens``, ``is_terminated``), a fresh matcher per instance.

Test instances: serialized compactly (``json.dumps(obj, separators=(",", ":"), ensure_ascii=False)``) with
object keys reordered into the order fst emits (:func:`order_instance`, the rule is in its docstring), then
tokenized canonically (``tokenizers``, no special tokens). Every backend gets the same token ids.

Budget: a compile (fst: conversion + compile; others: ``compile_grammar``) slower than ``--budget-s``
(default 4 s, the server's ``VLLM_FST_COMPILE_BUDGET_S``) counts as "refused: budget"; each backend runs in
its own worker process, killed (and restarted) when a compile runs past the budget + 1 s, or a walk past
``--walk-limit-s``. ``--max-minutes`` bounds the whole run (schemas left: "not run", reported). fst runs first, alone (its
budget is wall-clock, as in the server); then the others, ``--jobs`` (default 2) at a time.

Outputs a table per backend and suite part, fst's refusals by reason, the valid instances fst rejects
(each matched to a documented smaller-language rule of ``compiler/json_schema.py``, see
:func:`smaller_language_rule`), and every invalid instance a backend accepts (for fst these are converter
bugs: printed with the schema). ``--json-out`` writes everything per schema and instance; without
``--no-write`` the section "JSON Schema Test Suite" of docs/benchmarks.md is replaced.

``--corpus DIR`` runs real-world schemas instead (MaskBench's file format, :func:`load_corpus`: JSONSchemaBench's
``maskbench/data``, or a sample of it), one row per split, and replaces the section "Real-world JSON schemas
(JSONSchemaBench sample)"; fst's rows there also give its time to an answer over all schemas (refusals
included) and its compile memory (peak resident size of the worker over its size before the schema).

Usage: python scripts/bench_json_schema_suite.py [--json-out PATH] [--corpus DIR] [--backends fst,xgrammar,llguidance,outlines]
       [--budget-s 4] [--jobs 2] [--max-minutes 14] [--only FILE[#i],...] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SUITE_DIR = ROOT / "tests" / "data" / "json_schema_test_suite" / "draft2020-12"
TOKENIZER = ROOT / "models" / "SmolLM2-135M-Instruct"
ARTIFACTS = ROOT / "tokenizer_artifacts" / "SmolLM2-135M-Instruct"
DRAFT_URI = "https://json-schema.org/draft/2020-12/schema"
VOCAB_SIZE = 49152  # config.json vocab_size: what vLLM's model_config.get_vocab_size() gives the backends
ALL_BACKENDS = ("fst", "xgrammar", "llguidance", "outlines")
PARTS = ("core", "refRemote", "optional", "optional/format")
CORPUS_TITLE = "Real-world JSON schemas (JSONSchemaBench sample)"
REGEX_CHECK_S = 5.0  # limit of the backtracking regex cross-check of one instance (s)
PART_NOTE = {
    "core": "the top-level files except refRemote.json",
    "refRemote": "refRemote.json: remote $refs to http://localhost:1234/..., whose documents the suite keeps "
                 "in remotes/ (not vendored); no backend fetches them",
    "optional": "optional/*.json except format/ (bignum, ecmascript-regex, non-bmp-regex, unknown keywords, "
                "cross-draft, ...)",
    "optional/format": "optional/format/*.json (format as an assertion)",
}


# --------------------------------------------------------------------------------------------------
# The suite and its instances
# --------------------------------------------------------------------------------------------------


@dataclass
class Instance:
    description: str
    data: Any
    valid: bool
    text: str = ""
    ids: list = field(default_factory=list)
    note: str = ""  # why the text is not the plain compact dump (surrogate escapes)


@dataclass
class Case:
    cid: str  # "file.json#index"
    file: str  # path relative to the draft2020-12 folder
    part: str
    index: int
    description: str
    schema: Any
    instances: list
    source: str = "suite"  # "suite" (the official test suite) or "corpus" (--corpus: real-world schemas)


def part_of(relpath: str) -> str:
    if relpath.startswith("optional/"):
        return "optional/format" if relpath.startswith("optional/format/") else "optional"
    return "refRemote" if relpath == "refRemote.json" else "core"


def load_suite(suite_dir: Path = SUITE_DIR) -> list[Case]:
    """Every schema (test group) of every ``*.json`` file below ``suite_dir``, sorted by path."""
    cases = []
    for path in sorted(suite_dir.rglob("*.json")):
        rel = path.relative_to(suite_dir).as_posix()
        for i, group in enumerate(json.loads(path.read_text(encoding="utf-8"))):
            insts = [Instance(t["description"], t["data"], bool(t["valid"])) for t in group["tests"]]
            cases.append(Case(f"{rel}#{i}", rel, part_of(rel), i, group["description"], group["schema"], insts))
    return cases


def load_corpus(corpus_dir: Path) -> list[Case]:
    """Real-world schemas in MaskBench's file format (JSONSchemaBench, ``maskbench/data/SPLIT---NAME.json``:
    ``{"description", "schema", "tests": [{"description", "valid", "data"}, ...]}``), every ``*.json`` file of
    ``corpus_dir`` sorted by name; the part of a case is its split (the name before ``---``; else its leading
    letters: ``BFCL_java_0.json`` -> BFCL).

    Raises:
        FileNotFoundError: ``corpus_dir`` holds no ``*.json`` file.
    """
    paths = sorted(Path(corpus_dir).glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"no *.json file in {corpus_dir}")
    cases = []
    for path in paths:
        doc = json.loads(path.read_text(encoding="utf-8"))
        # (BFCL's files have no split prefix: BFCL_java_0.json)
        split = path.stem.split("---")[0] if "---" in path.stem else re.match(r"[A-Za-z]*", path.stem).group() or "other"
        insts = [Instance(t.get("description", ""), t["data"], bool(t["valid"])) for t in doc.get("tests", [])]
        cases.append(Case(path.name, path.name, split, 0, doc.get("description", path.stem), doc["schema"], insts,
                          source="corpus"))
    return cases


def parts_of(cases: list[Case]) -> tuple:
    """The parts present in ``cases``: the suite's in :data:`PARTS` order, then the others sorted."""
    present = {c.part for c in cases}
    return tuple(p for p in PARTS if p in present) + tuple(sorted(present - set(PARTS)))


def _pointer(root: Any, ref: str) -> Any:
    """Target of a local ``#/...`` reference, or None."""
    from urllib.parse import unquote

    frag = unquote(ref[1:])
    if frag and not frag.startswith("/"):
        return None
    node = root
    for raw in frag.split("/")[1:] if frag else []:
        tok = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and tok in node:
            node = node[tok]
        elif isinstance(node, list) and tok.isdigit() and int(tok) < len(node):
            node = node[int(tok)]
        else:
            return None
    return node


class _Orderer:
    """:func:`order_instance` for one schema document (validators built once)."""

    def __init__(self, root: Any):
        self.root = root
        self._validator = None

    def valid(self, sub: Any, value: Any) -> bool:
        try:
            if self._validator is None:
                from jsonschema import Draft202012Validator

                self._validator = Draft202012Validator(self.root, format_checker=Draft202012Validator.FORMAT_CHECKER)
            return bool(self._validator.evolve(schema=sub).is_valid(value))
        except Exception:  # noqa: BLE001 - unresolvable remote refs etc.: not a match
            return False

    def sources(self, schema: Any, value: Any, depth: int = 0, seen: tuple = ()) -> list[dict]:
        if not isinstance(schema, dict) or depth > 16:
            return []
        out = [schema]
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in seen:
            out += self.sources(_pointer(self.root, ref), value, depth + 1, seen + (ref,))
        if isinstance(schema.get("allOf"), list):
            for sub in schema["allOf"]:
                out += self.sources(sub, value, depth + 1, seen)
        for kw in ("anyOf", "oneOf"):
            if isinstance(schema.get(kw), list):
                for alt in schema[kw]:
                    if self.valid(alt, value):
                        out += self.sources(alt, value, depth + 1, seen)
                        break
        if isinstance(value, dict):  # dependencies whose name is present: the name, then its schema's names
            on, deps = [], []
            old = schema.get("dependencies") if isinstance(schema.get("dependencies"), dict) else {}
            split = ({k: v for k, v in old.items() if isinstance(v, list)},
                     {k: v for k, v in old.items() if not isinstance(v, list)})
            for i, kw in enumerate(("dependentRequired", "dependentSchemas")):
                entries = schema.get(kw) if isinstance(schema.get(kw), dict) else split[i]
                for name, dep in entries.items():
                    if name in value:
                        on.append(name)
                        deps.append({"required": dep} if i == 0 else dep)
            if on:
                out.append({"required": on})
                for dep in deps:
                    out += self.sources(dep, value, depth + 1, seen)
        return out

    def order(self, value: Any, schema: Any) -> Any:
        if _is_container(value):
            for s in self.sources(schema, value):  # an enum / const value: fst emits it as written
                vals = [s["const"]] if "const" in s else s["enum"] if isinstance(s.get("enum"), list) else []
                for v in vals:
                    if _json_equal(value, v):
                        return _order_like(value, v)
        if isinstance(value, dict):
            srcs = self.sources(schema, value)
            names: list = []
            for s in srcs:
                if isinstance(s.get("properties"), dict):
                    names += [n for n in s["properties"] if n not in names]
            for s in srcs:
                if isinstance(s.get("required"), list):
                    names += [n for n in s["required"] if isinstance(n, str) and n not in names]
            keys = [n for n in names if n in value] + [k for k in value if k not in names]
            return {k: self.order(value[k], self.child_of_object(srcs, k)) for k in keys}
        if isinstance(value, list):
            srcs = self.sources(schema, value)
            return [self.order(v, self.child_of_array(srcs, i)) for i, v in enumerate(value)]
        return value

    @staticmethod
    def child_of_object(srcs: list[dict], key: str) -> Any:
        subs = [s["properties"][key] for s in srcs if isinstance(s.get("properties"), dict) and key in s["properties"]]
        if len(subs) == 1:
            return subs[0]
        if subs:
            return {"allOf": subs}
        for kw in ("additionalProperties", "unevaluatedProperties"):
            for s in srcs:
                if kw in s:
                    return s[kw]
        return True

    @staticmethod
    def child_of_array(srcs: list[dict], i: int) -> Any:
        for s in srcs:
            if isinstance(s.get("prefixItems"), list) and i < len(s["prefixItems"]):
                return s["prefixItems"][i]
        for kw in ("items", "unevaluatedItems"):
            for s in srcs:
                if kw in s and isinstance(s[kw], (dict, bool)):
                    return s[kw]
        return True


def _order_like(value: Any, template: Any) -> Any:
    """``value`` with the key order of the equal JSON value ``template`` (recursively)."""
    if isinstance(value, dict) and isinstance(template, dict):
        return {k: _order_like(value[k], template[k]) for k in template}
    if isinstance(value, list) and isinstance(template, list):
        return [_order_like(v, t) for v, t in zip(value, template)]
    return value


def order_instance(value: Any, schema: Any) -> Any:
    """``value`` with object keys reordered the way fst's converter emits them (its docstring, "Output
    shape"): at each object, the names declared by the governing subschema(s) in their order -- its own
    ``properties``, then those of its local ``$ref`` target, then of each ``allOf`` member (recursively),
    then of the first ``anyOf`` / ``oneOf`` alternative the value is valid against (``jsonschema``) --
    then the names in their ``required`` lists that no ``properties`` declares, then the other keys in
    the instance's own order (a ``dependentRequired`` / ``dependentSchemas`` entry whose name is present: that
    name as a required one, then its names). A container equal to a ``const`` / ``enum`` value of its subschema takes
    that value's key order (fst matches enum values in their compact form). Nested values follow the subschema for their key / index when it is simple:
    ``properties[key]`` (several sources: their ``allOf``), else ``additionalProperties`` /
    ``unevaluatedProperties``; ``prefixItems[i]``, else ``items`` / ``unevaluatedItems``; else any schema
    (keys keep the instance's order). Non-objects are returned unchanged."""
    return _Orderer(schema).order(value, schema)


_SURROGATE = re.compile("[\ud800-\udfff]")


def serialize(value: Any, schema: Any) -> tuple[str, str]:
    """(compact text in fst's key order, note). Lone surrogates (not UTF-8) are written as ``\\uXXXX``
    escapes (note "surrogate escape")."""
    text = json.dumps(order_instance(value, schema), separators=(",", ":"), ensure_ascii=False)
    if _SURROGATE.search(text):
        return _SURROGATE.sub(lambda m: "\\u%04x" % ord(m.group()), text), "surrogate escape"
    return text, ""


def prepare_cases(cases: list[Case], tokenizer_path: Path = TOKENIZER) -> None:
    """Fill each instance's text and canonical token ids (in place)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path / "tokenizer.json"))
    for c in cases:
        for inst in c.instances:
            inst.text, inst.note = serialize(inst.data, c.schema)
            inst.ids = tok.encode(inst.text, add_special_tokens=False).ids


# --------------------------------------------------------------------------------------------------
# fst's documented smaller language (compiler/json_schema.py, "Smaller language")
# --------------------------------------------------------------------------------------------------


def _is_container(v: Any) -> bool:
    return isinstance(v, (dict, list))


def _json_equal(a: Any, b: Any) -> bool:
    from vllm_fst_backend.compiler.json_schema import _json_equal as eq

    return eq(a, b)


def _compact(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False)


#: Keywords that constrain the shape of a value: a subschema with none of them is an arbitrary value.
_SHAPE_KW = frozenset({"properties", "required", "additionalProperties", "unevaluatedProperties", "patternProperties",
                       "items", "prefixItems", "unevaluatedItems", "contains", "enum", "const", "$ref", "allOf",
                       "anyOf", "oneOf", "not", "if", "propertyNames", "dependentSchemas"})
_NEEDS_ESCAPE = re.compile(r'[\x00-\x1f"\\]')
_PATTERN_CLASS = re.compile(r"\\[dwsDS]|(?<!\\)\.|\[\^")
_NON_PLAIN = re.compile(r'[^\x20-\x7e]|["\\]')


def _arbitrary(schema: Any) -> bool:
    return schema is True or (isinstance(schema, dict) and not (schema.keys() & _SHAPE_KW))


def smaller_language_rule(case: Case, inst: Instance) -> str | None:
    r"""Name of the documented smaller-language choice of ``compiler/json_schema.py`` (its docstring,
    "Smaller language") that explains why fst may reject this *valid* instance, or None (unexplained: a
    gap to look at). Each rule is a property of the schema and the instance, never a list of cases:

    * ``format-annotation``: a string instance of the core ``format.json``, where ``format`` is an
      annotation (every instance valid); fst asserts the formats it supports (and refuses the others);
    * ``custom-metaschema``: the root ``$schema`` names another metaschema than draft 2020-12's (the suite's
      vocabulary tests turn the validation vocabulary off); fst ignores ``$schema`` / ``$vocabulary`` and
      always applies every draft 2020-12 keyword;
    * ``format-subset``: a string governed by ``format`` ``date-time`` / ``time`` with a lower-case ``t`` /
      ``z``, a leap second (``:60``) or a fraction of more than 9 digits; ``email`` with a quoted local part
      (``"``), an address literal (``[``) or a domain without a dot; ``uri`` / ``uri-reference`` / ``iri`` /
      ``iri-reference`` without ``scheme://``, with user info (``@``) or an IP literal (``[``) in the
      authority, or with a non-ASCII character; ``hostname`` with one label or more than four, a label over
      62 characters, a top-level label that is not 2-62 letters or a trailing dot -- fst's documented format
      subsets;
    * ``pattern-classes``: a string governed by a ``pattern`` that uses ``\d`` ``\w`` ``\s`` ``\D``
      ``\S``, ``.`` or a negated class, holding a character outside printable ASCII or one JSON escapes
      (fst: those classes are ASCII / exclude all Unicode digits and spaces, escaped characters and
      U+2028 / U+2029);
    * ``number-spelling``: a number with an integral value written with a fraction (``1.0``), an exponent or
      as ``-0``, under ``type: integer``, a numeric bound or ``multipleOf`` (fst: integers without fraction or
      exponent; bounded numbers without exponent and no ``-0``; integral values at a bound as integers);
    * ``enum-spelling``: a value equal (JSON Schema equality) to a ``const`` / ``enum`` value of its
      subschema but spelled differently in compact JSON (``-2`` for ``-2.0``): fst matches the value's own
      compact text;
    * ``any-value-depth``: a non-empty container nested deeper than :data:`ANY_VALUE_DEPTH` (counted from the
      root, root container = 1) where the governing subschema does not constrain its shape (``true``, ``{}``,
      only type/annotation keywords);
    * ``closed-object``: an object whose subschema declares names and says nothing about other keys (no
      ``additionalProperties`` / ``unevaluatedProperties``) has an undeclared key (fst's default; not with
      ``VLLM_FST_JSON_OPEN_OBJECTS=1``);
    * ``extra-key``: an object whose subschema declares names has an undeclared key, while extra keys are
      arbitrary (``additionalProperties`` / ``unevaluatedProperties`` absent, ``true`` or ``{}``), and the
      extra value is a non-empty container (:data:`EXTRA_VALUE_DEPTH` 0), or the key needs JSON escapes, or it agrees
      with a declared name of 3+ characters on its first :data:`EXTRA_KEY_PREFIX` characters;
    * ``surrogate-escape``: the instance needs ``\uD800``-``\uDFFF`` escapes (not UTF-8 text).
    """
    from vllm_fst_backend.compiler import json_schema as js

    if case.source == "suite" and case.file == "format.json" and isinstance(inst.data, str):
        return "format-annotation"
    if case.source == "suite" and isinstance(case.schema, dict) and case.schema.get("$schema", DRAFT_URI) != DRAFT_URI:
        return "custom-metaschema"
    if inst.note == "surrogate escape":
        return "surrogate-escape"
    found: list[str] = []
    _Rules(case.schema, js, found).visit(inst.data, case.schema, 0)
    order = ("format-subset", "pattern-classes", "enum-spelling", "number-spelling", "any-value-depth", "closed-object",
             "extra-key")
    for rule in order:
        if rule in found:
            return rule
    return None


def _searches(pattern: str, text: str) -> bool:
    """``patternProperties`` matching for the rules, bounded in time as in the converter (False: no match,
    an invalid pattern, or out of time)."""
    from vllm_fst_backend.compiler.json_schema import pattern_search

    try:
        return pattern_search(pattern, text, REGEX_CHECK_S)
    except Exception:  # noqa: BLE001 - TimeoutError, regex.error
        return False


class _Rules(_Orderer):
    def __init__(self, root: Any, js, found: list):
        from vllm_fst_backend.compiler.constraints import open_objects_from_env

        super().__init__(root)
        self.js, self.found = js, found
        self.open_objects = open_objects_from_env()

    def visit(self, value: Any, schema: Any, level: int) -> None:
        srcs = self.sources(schema, value)
        for s in srcs:
            vals = [s["const"]] if "const" in s else s["enum"] if isinstance(s.get("enum"), list) else []
            if any(_json_equal(value, v) and _compact(value) != _compact(v) for v in vals):
                self.found.append("enum-spelling")
        if isinstance(value, bool) or value is None:
            return
        integral = isinstance(value, float) and value.is_integer()
        if (integral or isinstance(value, (int, float)) and re.search(r"[eE]|^-0(\.0*)?$", json.dumps(value))) and any(
                s.keys() & {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"} or
                "integer" in (s.get("type") if isinstance(s.get("type"), list) else [s.get("type")]) for s in srcs):
            self.found.append("number-spelling")
        if isinstance(value, str):
            self.string(value, srcs)
            return
        if not _is_container(value):
            return
        level += 1
        if value and level > self.js.ANY_VALUE_DEPTH and all(_arbitrary(s) for s in srcs or [True]):
            self.found.append("any-value-depth")
        if isinstance(value, list):
            for i, v in enumerate(value):
                self.visit(v, self.child_of_array(srcs, i), level)
            return
        declared = [n for s in srcs if isinstance(s.get("properties"), dict) for n in s["properties"]]
        declared += [n for s in srcs if isinstance(s.get("required"), list) for n in s["required"]
                     if isinstance(n, str)]
        extra = self.child_of_object(srcs, "\x00not-declared\x00")
        silent = not any(kw in s for s in srcs for kw in ("additionalProperties", "unevaluatedProperties"))
        patterns = [pt for s in srcs if isinstance(s.get("patternProperties"), dict) for pt in s["patternProperties"]]
        for k, v in value.items():
            if patterns and any(_searches(pt, k) for pt in patterns):
                pass  # a pattern key (fst: keys of its one pattern)
            elif (declared or patterns) and k not in declared and silent and not self.open_objects:
                self.found.append("closed-object")
            elif declared and k not in declared and (extra is True or extra == {}):
                prefix = self.js.EXTRA_KEY_PREFIX
                if ((_is_container(v) and v) or _NEEDS_ESCAPE.search(k) or
                        any(len(n) >= prefix and len(k) >= prefix and n[:prefix] == k[:prefix] for n in declared)):
                    self.found.append("extra-key")
            self.visit(v, self.child_of_object(srcs, k), level)

    def string(self, value: str, srcs: list) -> None:
        for s in srcs:
            fmt = s.get("format")
            if fmt in ("date-time", "time") and (re.search("[tz]", value) or ":60" in value or
                                                  re.search(r"\.[0-9]{10,}", value)):
                self.found.append("format-subset")
            if fmt == "email":
                local, _, domain = value.rpartition("@")
                if '"' in local or domain.startswith("[") or "." not in domain:
                    self.found.append("format-subset")
            if fmt in ("uri", "uri-reference", "iri", "iri-reference"):
                m = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)", value)
                if not m or "@" in m.group(1) or "[" in m.group(1) or re.search(r"[^\x00-\x7f]", value):
                    self.found.append("format-subset")
            if fmt == "hostname":
                labels = value.split(".")
                if (not 2 <= len(labels) <= 4 or any(len(x) > 62 for x in labels)
                        or not re.fullmatch("[A-Za-z]{2,62}", labels[-1])):
                    self.found.append("format-subset")
            pat = s.get("pattern")
            if isinstance(pat, str) and _PATTERN_CLASS.search(pat) and _NON_PLAIN.search(value):
                self.found.append("pattern-classes")


# --------------------------------------------------------------------------------------------------
# Backends (run inside worker processes)
# --------------------------------------------------------------------------------------------------


def fst_reason(e: Exception) -> str:
    """Short refusal reason of a named fst error (counted by keyword)."""
    from vllm_fst_backend.errors import (
        CompileBudgetError,
        EmptyLanguageError,
        InputTooLargeError,
        InvalidSchemaError,
        UnsupportedSchemaError,
    )

    msg = str(e)
    if isinstance(e, UnsupportedSchemaError):
        kw = e.keyword or "?"
        if kw == "$ref":
            if not e.regular:
                return "$ref (recursive: not regular)"
            if "only references within the document" in msg:
                return "$ref (remote / relative URI)"
            if "anchor" in msg:
                return "$ref (anchor)"
            if "embedded resource" in msg:
                return "$ref (into an embedded $id resource)"
        if kw == "allOf" and "both use" in msg:
            return "allOf (merge of interacting keywords)"
        if "unknown keyword" in msg:
            return "unknown keyword"
        if "older JSON Schema draft" in msg:
            return f"{kw} (older draft)"
        if not e.regular:
            return f"{kw} (not regular)"
        return kw
    if isinstance(e, InvalidSchemaError):
        return f"invalid schema ({e.keyword or '?'})"
    if isinstance(e, EmptyLanguageError):
        return "empty language (the schema admits no value)"
    if isinstance(e, InputTooLargeError):
        return f"too large ({e.limit_name or '?'})"
    if isinstance(e, CompileBudgetError):
        return "budget"
    return f"{type(e).__name__}: {msg[:80]}"


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> int:
    """Reset this process's peak resident size (Linux ``clear_refs`` 5) and return its resident size (kB);
    0 where /proc is not there."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmRSS")
    except OSError:
        return 0


def _peak_rss_mb(rss0_kb: int) -> float | None:
    """Peak resident size since :func:`_reset_peak_rss` less the resident size then (MB), or None."""
    if not rss0_kb:
        return None
    try:
        return max(0, _status_kb("VmHWM") - rss0_kb) / 1024
    except OSError:
        return None


class FstRunner:
    name = "fst"

    def __init__(self, budget_s: float):
        from vllm_fst_backend.artifacts.store import load_artifacts
        from vllm_fst_backend.compiler import CompileBudgets, CompileOptions, prepare

        self.arts = load_artifacts(ARTIFACTS, tokenizer_path=TOKENIZER)
        prepare(self.arts, canonical=True)  # per-tokenizer tables, once (outside the budget, as the server)
        self.opts = CompileOptions(canonical=True)
        self.budgets = CompileBudgets(time_budget_s=budget_s)
        self.budget_s = budget_s

    def compile(self, schema_text: str) -> tuple[Any, dict]:
        from vllm_fst_backend.compiler import compile_regex, forget_verdicts
        from vllm_fst_backend.compiler.constraints import json_schema_to_regex
        from vllm_fst_backend.errors import FstBackendError

        forget_verdicts(self.arts)  # cold, as the other backends' cleared caches
        rss0 = _reset_peak_rss()
        t0 = time.perf_counter()
        try:
            regex = json_schema_to_regex(schema_text, deadline=t0 + self.budget_s)
        except FstBackendError as e:
            return None, {"status": "refused", "stage": "convert", "reason": fst_reason(e), "message": str(e)[:300],
                          "convert_s": time.perf_counter() - t0, "answer_s": time.perf_counter() - t0,
                          "peak_mb": _peak_rss_mb(rss0)}
        t1 = time.perf_counter()
        try:
            compiled = compile_regex(regex, self.arts, self.opts, budgets=self.budgets)
        except FstBackendError as e:
            return None, {"status": "refused", "stage": "compile", "reason": fst_reason(e), "message": str(e)[:300],
                          "convert_s": t1 - t0, "regex_chars": len(regex), "answer_s": time.perf_counter() - t0,
                          "peak_mb": _peak_rss_mb(rss0)}
        t2 = time.perf_counter()
        info = {"status": "compiled", "convert_s": t1 - t0, "compile_s": t2 - t0, "regex_chars": len(regex),
                "mode": getattr(compiled, "mode", ""), "peak_mb": _peak_rss_mb(rss0), "answer_s": t2 - t0}
        import regex as regex_module  # (third-party ``regex``: a match with a timeout, unlike ``re``)

        try:
            pyre = regex_module.compile(regex)
        except regex_module.error as e:
            pyre = None
            info["python_re_error"] = str(e)
        return (compiled, pyre), info

    def walk(self, obj, inst: dict) -> dict:
        from vllm_fst_backend.runtime import FstMatcher

        compiled, pyre = obj
        m = FstMatcher(compiled)
        ok, at = True, None
        for i, t in enumerate(inst["ids"]):
            if not m.accept_tokens("r", [t]):
                ok, at = False, i
                break
        if ok and not (m.accept_tokens("r", [m.eos_ids[0]]) and m.is_terminated()):
            ok, at = False, len(inst["ids"])
        out = {"accepted": ok, "rejected_at": at}
        if pyre is not None:
            # a backtracking matcher can take exponential time on a JSON-schema regex (nested repetitions): bounded
            try:
                out["regex"] = pyre.fullmatch(inst["text"], timeout=REGEX_CHECK_S) is not None
            except TimeoutError:
                out["regex_timeout"] = True
        return out


class _VllmRunner:
    """Shared by the vLLM backends: a fake ``VllmConfig`` with vLLM's defaults for the fields they read."""

    def __init__(self, budget_s: float):
        import types

        from transformers import AutoTokenizer

        from vllm.sampling_params import SamplingParams, StructuredOutputsParams
        from vllm.v1.structured_output.backend_types import StructuredOutputOptions

        self.SamplingParams, self.SOParams, self.JSON = SamplingParams, StructuredOutputsParams, StructuredOutputOptions.JSON
        self.tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
        self.eos = int(self.tok.eos_token_id)
        self.stop = {self.eos}  # SamplingParams.all_stop_token_ids of a plain request
        so_cfg = types.SimpleNamespace(disable_any_whitespace=False, disable_additional_properties=False)
        self.cfg = types.SimpleNamespace(structured_outputs_config=so_cfg, model_config=None, speculative_config=None)
        self.budget_s = budget_s

    def params(self, schema_text: str):
        return self.SamplingParams(structured_outputs=self.SOParams(json=schema_text))

    def compile(self, schema_text: str) -> tuple[Any, dict]:
        t0 = time.perf_counter()
        try:
            self.validate(self.params(schema_text))
        except Exception as e:  # noqa: BLE001 - VLLMValidationError and whatever the library raises
            return None, {"status": "refused", "stage": "validate", "reason": self.reason(e),
                          "message": f"{type(e).__name__}: {str(e)[:300]}", "validate_s": time.perf_counter() - t0}
        t1 = time.perf_counter()
        try:
            self.clear_cache()
            grammar = self.backend.compile_grammar(self.JSON, schema_text, stop_token_ids=self.stop)
            self.check(grammar)
        except Exception as e:  # noqa: BLE001
            return None, {"status": "refused", "stage": "compile", "reason": self.reason(e),
                          "message": f"{type(e).__name__}: {str(e)[:300]}", "validate_s": t1 - t0}
        t2 = time.perf_counter()
        return (schema_text, grammar, self.keep(schema_text, grammar)), {
            "status": "compiled", "validate_s": t1 - t0, "compile_s": t2 - t1}

    def clear_cache(self) -> None:
        pass

    def check(self, grammar) -> None:
        pass

    def keep(self, schema_text: str, grammar) -> Any:
        """What :meth:`fresh` needs to build more matchers of the compiled grammar."""
        return None

    def reason(self, e: Exception) -> str:
        """Short refusal reason (counted in the report; the full message is in the JSON)."""
        msg = str(e)
        m = re.search(r"Unimplemented keys: (\[[^\]]*\])", msg)
        for needle, short in (("timed out", "budget (vLLM regex compilation timeout)"),
                              ("not supported by xgrammar", "unsupported features (vLLM's xgrammar check)"),
                              ("Unsupported JSON Schema structure", "unsupported JSON Schema structure"),
                              ("cannot accept any value", "schema admits no value"),
                              ("Unsatisfiable schema", "schema admits no value"),
                              ("not present in a registry", "unresolvable remote $ref"),
                              ("oneOf constraints are not supported", "oneOf"),
                              ("vocabulary provided is incompatible", "index: no transition for some character"),
                              ("Invalid reference path", "unresolvable $ref"),
                              ("Cannot find field", "unresolvable $ref"),
                              ("should be a string or a Pydantic model", "boolean schema")):
            if needle in msg:
                return short
        if m:
            return "unimplemented keys " + m.group(1)
        last = msg.split("\n")[0].split(": ")[-1]
        return last[:60] or type(e).__name__

    def walk(self, obj, inst: dict) -> dict:
        g = self.fresh(obj)
        ok, at = True, None
        for i, t in enumerate(inst["ids"]):
            if not g.accept_tokens("r", [t]):
                ok, at = False, i
                break
        if ok and not (g.accept_tokens("r", [self.eos]) and g.is_terminated()):
            ok, at = False, len(inst["ids"])
        return {"accepted": ok, "rejected_at": at}


class XgrammarRunner(_VllmRunner):
    name = "xgrammar"

    def __init__(self, budget_s: float):
        super().__init__(budget_s)
        import xgrammar as xgr

        from vllm.v1.structured_output.backend_xgrammar import (
            XgrammarBackend,
            XgrammarGrammar,
            validate_xgrammar_grammar,
        )

        self.xgr = xgr
        self.validate = validate_xgrammar_grammar
        self.Grammar = XgrammarGrammar
        self.backend = XgrammarBackend(self.cfg, tokenizer=self.tok, vocab_size=VOCAB_SIZE)

    def clear_cache(self) -> None:  # cold compiles (vLLM caches compiled grammars across requests)
        self.backend.compiler.clear_cache()

    def fresh(self, obj):
        ctx = obj[1].ctx
        m = self.xgr.GrammarMatcher(ctx, override_stop_tokens=list(self.stop), max_rollback_tokens=0)
        return self.Grammar(matcher=m, vocab_size=VOCAB_SIZE, ctx=ctx)


class GuidanceRunner(_VllmRunner):
    name = "llguidance"

    def __init__(self, budget_s: float):
        super().__init__(budget_s)
        import llguidance

        from vllm.v1.structured_output.backend_guidance import (
            GuidanceBackend,
            GuidanceGrammar,
            validate_guidance_grammar,
        )

        self.llg = llguidance
        self.Grammar = GuidanceGrammar
        self.backend = GuidanceBackend(self.cfg, tokenizer=self.tok, vocab_size=VOCAB_SIZE)
        self.validate = lambda sp: validate_guidance_grammar(sp, tokenizer=self.backend.ll_tokenizer)

    def check(self, grammar) -> None:
        err = grammar.ll_matcher.get_error()
        if err:  # vLLM only logs it; the request would then produce EOS only
            raise RuntimeError(f"LLMatcher error: {err}")

    def keep(self, schema_text: str, grammar) -> Any:
        return self.backend.serialized_grammar  # what compile_grammar gave LLMatcher

    def fresh(self, obj):
        be = self.backend
        m = self.llg.LLMatcher(be.ll_tokenizer, obj[2], log_level=0)
        return self.Grammar(ll_matcher=m, ll_tokenizer=be.ll_tokenizer, vocab_size=VOCAB_SIZE)


class OutlinesRunner(_VllmRunner):
    name = "outlines"

    def __init__(self, budget_s: float):
        # vLLM's own timeout (a thread that keeps running) is replaced by the forked child's (ISOLATED)
        os.environ["VLLM_REGEX_COMPILATION_TIMEOUT_S"] = "0"
        super().__init__(budget_s)
        import outlines_core as oc

        from vllm.v1.structured_output.backend_outlines import (
            OutlinesBackend,
            OutlinesGrammar,
            validate_structured_output_request_outlines,
        )

        self.oc = oc
        self.validate = validate_structured_output_request_outlines
        self.Grammar = OutlinesGrammar
        self.backend = OutlinesBackend(self.cfg, tokenizer=self.tok, vocab_size=VOCAB_SIZE)

    def clear_cache(self) -> None:
        self.backend.cache.clear()

    def keep(self, schema_text: str, grammar) -> Any:
        import outlines_core.json_schema as ocjs

        regex = ocjs.build_regex_from_schema(schema_text)  # as compile_grammar: the index is in its cache
        return self.backend.cache[f"{self.backend.vocabulary._hash}_{regex}"]

    def fresh(self, obj):
        eos = self.backend.vocabulary.inner.get_eos_token_id()
        return self.Grammar(vocab_size=VOCAB_SIZE, eos_token_id=eos, guide=self.oc.Guide(obj[2], max_rollback=0))


RUNNERS = {"fst": FstRunner, "xgrammar": XgrammarRunner, "llguidance": GuidanceRunner, "outlines": OutlinesRunner}


def _compile_and_walk(runner, cid: str, schema_text: str, insts: list, send) -> None:
    obj, info = runner.compile(schema_text)
    send(("compiled", cid, info))
    if obj is None:
        return
    results = []
    for inst in insts:
        try:
            results.append(runner.walk(obj, inst))
        except Exception as e:  # noqa: BLE001
            results.append({"accepted": False, "error": f"{type(e).__name__}: {str(e)[:120]}"})
    send(("walked", cid, results))


def _isolated(runner, cid: str, schema_text: str, insts: list, conn, budget_s: float, walk_limit_s: float) -> None:
    """:func:`_compile_and_walk` in a forked child of the (initialized) worker, killed when its compile runs
    past ``budget_s`` + 0.5 s or its walk past ``walk_limit_s``: for compilers that cannot be interrupted
    (outlines-core's ``Index``: vLLM's own timeout leaves the thread running)."""
    import signal

    rd, wr = mp.Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:  # child
        try:
            rd.close()
            _compile_and_walk(runner, cid, schema_text, insts, wr.send)
        finally:
            os._exit(0)
    wr.close()
    try:
        for stage, limit in (("compiled", budget_s + 0.5), ("walked", walk_limit_s)):
            if not rd.poll(limit):
                if stage == "compiled":
                    conn.send(("compiled", cid, {"status": "refused", "stage": "compile", "reason": "budget",
                                                 "message": f"killed after {limit:.1f} s"}))
                return  # the parent's watchdog reports a walk timeout
            try:
                msg = rd.recv()
            except EOFError:
                conn.send(("compiled", cid, {"status": "error", "reason": "compile process died"}))
                return
            conn.send(msg)
            if stage == "compiled" and msg[2]["status"] != "compiled":
                return
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        rd.close()


#: Backends whose compile cannot be interrupted in-process: each schema runs in a forked child.
ISOLATED = frozenset({"outlines"})


def _worker(name: str, budget_s: float, walk_limit_s: float, conn) -> None:
    """Worker process: build the runner, then compile + walk the cases the parent sends."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)  # vLLM's wrappers log every rejected token
    t0 = time.perf_counter()
    runner = RUNNERS[name](budget_s)
    conn.send(("ready", time.perf_counter() - t0))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        cid, schema_text, insts = msg
        if name in ISOLATED:
            _isolated(runner, cid, schema_text, insts, conn, budget_s, walk_limit_s)
        else:
            _compile_and_walk(runner, cid, schema_text, insts, conn.send)


# --------------------------------------------------------------------------------------------------
# The parent: one thread per running backend, each driving its worker process with a watchdog
# --------------------------------------------------------------------------------------------------


class BackendRun:
    def __init__(self, name: str, cases: list[Case], args, deadline: float, log):
        self.name, self.cases, self.args, self.deadline, self.log = name, cases, args, deadline, log
        self.results: dict[str, dict] = {}
        self.restarts = 0
        self.init_s: list[float] = []
        self.proc = None
        self.conn = None
        self.wall_s = 0.0

    def start(self) -> bool:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(self.name, self.args.budget_s, self.args.walk_limit_s, child),
                                daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        left = self.deadline - time.monotonic()
        if not parent.poll(max(1.0, min(300.0, left))):
            self.kill()
            return False
        try:
            msg = parent.recv()
        except EOFError:
            self.kill()
            return False
        self.init_s.append(msg[1])
        return True

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.proc = None

    def _wait(self, limit_s: float):
        """The next message within ``limit_s`` (bounded by the global deadline), or None."""
        limit = min(limit_s, self.deadline - time.monotonic())
        if limit <= 0 or not self.conn.poll(limit):
            return None
        try:
            return self.conn.recv()
        except EOFError:
            return None

    def run(self) -> None:
        t_start = time.monotonic()
        try:
            self._run()
        finally:
            if self.proc is not None and self.proc.is_alive():
                try:
                    self.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
                self.proc.join(5)
                self.kill()
            self.wall_s = time.monotonic() - t_start

    def _run(self) -> None:
        alive = False
        for n, case in enumerate(self.cases):
            if time.monotonic() >= self.deadline:
                self.results[case.cid] = {"status": "not run", "reason": "global timeout (--max-minutes)"}
                continue
            if not alive:
                alive = self.start()
                if not alive:
                    self.results[case.cid] = {"status": "error", "reason": "worker did not start"}
                    continue
            if self.args.progress and n % 50 == 0:
                self.log(f"{self.name}: schema {n + 1}/{len(self.cases)}")
            insts = [{"ids": i.ids, "text": i.text} for i in case.instances]
            schema_text = json.dumps(case.schema, ensure_ascii=False)
            t_send = time.monotonic()
            self.conn.send((case.cid, schema_text, insts))
            msg = self._wait(self.args.budget_s + (5.0 if self.name in ISOLATED else 1.0))
            if msg is None:  # compile past the budget (or the global deadline): kill the worker
                self.kill()
                alive = False
                self.restarts += 1
                self.results[case.cid] = (
                    {"status": "not run", "reason": "global timeout (--max-minutes)"}
                    if time.monotonic() >= self.deadline else
                    {"status": "refused", "stage": "compile", "reason": "budget",
                     "message": f"killed after {time.monotonic() - t_send:.1f} s"})
                continue
            info = msg[2]
            self.results[case.cid] = info
            if info["status"] != "compiled":
                continue
            msg = self._wait(self.args.walk_limit_s)
            if msg is None:
                self.kill()
                alive = False
                self.restarts += 1
                info.update(status="error", reason="walk timeout")
                continue
            info["instances"] = msg[2]
            cs = info.get("compile_s", 0.0)
            if cs > self.args.budget_s:  # finished, but slower than the budget: refused (walk kept in the JSON)
                info.update(status="refused", stage="compile", reason="budget", message=f"compiled in {cs:.2f} s")


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(cases: list[Case], results: dict, backend: str, parts=None) -> dict:
    """Counts for one backend over the cases of ``parts`` (None: all)."""
    s = dict(schemas=0, compiled=0, refused=0, budget=0, error=0, not_run=0, valid=0, valid_acc=0, invalid=0,
             invalid_acc=0, compile_s=[], reasons={}, regex_disagree=0, regex_timeouts=0)
    for c in cases:
        if parts is not None and c.part not in parts:
            continue
        r = results.get(c.cid, {"status": "not run"})
        s["schemas"] += 1
        st = r["status"]
        if st == "compiled" and r.get("instances") is not None:
            s["compiled"] += 1
            s["compile_s"].append(r["compile_s"])
            for inst, v in zip(c.instances, r["instances"]):
                if inst.valid:
                    s["valid"] += 1
                    s["valid_acc"] += bool(v["accepted"])
                else:
                    s["invalid"] += 1
                    s["invalid_acc"] += bool(v["accepted"])
                if "regex" in v and v["regex"] != v["accepted"]:
                    s["regex_disagree"] += 1
                s["regex_timeouts"] += bool(v.get("regex_timeout"))
        elif st == "refused":
            s["refused"] += 1
            s["budget"] += r.get("reason", "").startswith("budget")
            s["reasons"][r.get("reason", "?")] = s["reasons"].get(r.get("reason", "?"), 0) + 1
        elif st == "not run":
            s["not_run"] += 1
        else:
            s["error"] += 1
            s["reasons"][r.get("reason", "?")] = s["reasons"].get(r.get("reason", "?"), 0) + 1
    return s


def _ms(x: float) -> str:
    return "–" if x != x else (f"{1e3 * x:.0f}" if x >= 0.01 else f"{1e3 * x:.1f}")


def table(cases: list[Case], results: dict, backends: list[str], part_label: str = "suite part") -> str:
    lines = [f"| backend | {part_label} | schemas | compiled (accepted) | refused (of which budget) | errors / not run | "
             "valid instances accepted | **invalid instances wrongly accepted** | compile ms p50 / p90 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b in backends:
        for label, parts in [("all", None)] + [(p, {p}) for p in parts_of(cases)]:
            s = summarize(cases, results[b], b, parts)
            if not s["schemas"]:
                continue
            va = f"{s['valid_acc']} / {s['valid']}" + (f" ({100 * s['valid_acc'] / s['valid']:.1f} %)" if s["valid"] else "")
            ia = f"**{s['invalid_acc']}** / {s['invalid']}"
            lines.append(f"| {b} | {label} | {s['schemas']} | {s['compiled']} | {s['refused']} ({s['budget']}) | "
                         f"{s['error']} / {s['not_run']} | {va} | {ia} | "
                         f"{_ms(_pct(s['compile_s'], 0.5))} / {_ms(_pct(s['compile_s'], 0.9))} |")
    return "\n".join(lines)


def fst_details(cases: list[Case], res: dict) -> dict:
    """Rejected valid instances of compiled schemas (by rule), invalid accepted ones, regex disagreements."""
    rejected: dict[str, list] = {}
    bad, disagree = [], []
    for c in cases:
        r = res.get(c.cid, {})
        if r.get("status") != "compiled" or r.get("instances") is None:
            continue
        for inst, v in zip(c.instances, r["instances"]):
            if inst.valid and not v["accepted"]:
                rule = smaller_language_rule(c, inst) or "UNEXPLAINED"
                rejected.setdefault(rule, []).append({"case": c.cid, "schema_description": c.description,
                                                      "instance": inst.description, "text": inst.text})
            if not inst.valid and v["accepted"]:
                bad.append({"case": c.cid, "schema_description": c.description, "schema": c.schema,
                            "instance": inst.description, "text": inst.text})
            if "regex" in v and v["regex"] != v["accepted"]:
                disagree.append({"case": c.cid, "instance": inst.description, "text": inst.text,
                                 "regex": v["regex"], "matcher": v["accepted"]})
    return {"valid_rejected_by_rule": rejected, "invalid_accepted": bad, "regex_matcher_disagreements": disagree}


def other_invalid_accepted(cases: list[Case], res: dict) -> list:
    out = []
    for c in cases:
        r = res.get(c.cid, {})
        if r.get("status") == "compiled" and r.get("instances") is not None:
            for inst, v in zip(c.instances, r["instances"]):
                if not inst.valid and v["accepted"]:
                    out.append({"case": c.cid, "schema_description": c.description, "instance": inst.description,
                                "text": inst.text})
    return out


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default=",".join(ALL_BACKENDS))
    ap.add_argument("--budget-s", type=float, default=4.0, help="compile budget per schema (s)")
    ap.add_argument("--walk-limit-s", type=float, default=120.0, help="limit for walking one schema's instances (s)")
    ap.add_argument("--jobs", type=int, default=2, help="backends run at the same time")
    ap.add_argument("--max-minutes", type=float, default=14.0, help="global limit of the run")
    ap.add_argument("--only", default=None, help="comma-separated FILE or FILE#INDEX (paths relative to draft2020-12)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--corpus", default=None, metavar="DIR",
                    help="real-world schemas in MaskBench's format (a folder of SPLIT---NAME.json files, e.g. "
                         "maskbench/data of github.com/guidance-ai/jsonschemabench) instead of the test suite; "
                         "writes the section \"%s\"" % CORPUS_TITLE)
    ap.add_argument("--names", default=None, metavar="FILE",
                    help="with --corpus: only the files named in FILE (one name per line, # comments), e.g. "
                         "docs/jsonschemabench_sample.txt; a name missing from the folder is an error")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + 60.0 * args.max_minutes
    lock = threading.Lock()

    def log(msg: str) -> None:
        with lock:
            print(f"[{time.monotonic() - t_start:6.1f} s] {msg}", flush=True)

    cases = load_corpus(Path(args.corpus)) if args.corpus else load_suite()
    if args.names:
        wanted = [ln.strip() for ln in Path(args.names).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        missing = sorted(set(wanted) - {c.file for c in cases})
        if missing:
            ap.error(f"{len(missing)} files named in {args.names} are not in {args.corpus}: {', '.join(missing[:5])}")
        cases = [c for c in cases if c.file in set(wanted)]
    if args.only:
        keys = set(args.only.split(","))
        cases = [c for c in cases if c.file in keys or c.cid in keys]
    prepare_cases(cases)
    n_inst = sum(len(c.instances) for c in cases)
    log(f"{len(cases)} schemas, {n_inst} instances (tokenized)")
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in RUNNERS:
            ap.error(f"unknown backend {b!r}")
    runs = {b: BackendRun(b, cases, args, deadline, log) for b in backends}
    sem = threading.Semaphore(max(1, args.jobs))

    def go(b: str) -> None:
        with sem:
            log(f"{b}: start")
            runs[b].run()
            log(f"{b}: done in {runs[b].wall_s:.0f} s (worker restarts {runs[b].restarts})")

    if "fst" in runs:  # alone: its budget is wall-clock, as in the server
        go("fst")
    threads = [threading.Thread(target=go, args=(b,)) for b in ("outlines", "xgrammar", "llguidance") if b in runs]
    for th in threads:  # longest first
        th.start()
        time.sleep(0.05)
    for th in threads:
        th.join()
    results = {b: runs[b].results for b in backends}
    total_s = time.monotonic() - t_start

    tbl = table(cases, results, backends, "split" if args.corpus else "suite part")
    print(tbl)
    fst = fst_details(cases, results["fst"]) if "fst" in results else None
    fst_sum = summarize(cases, results["fst"], "fst") if "fst" in results else None
    lines = []
    if fst is not None:
        reasons = sorted(fst_sum["reasons"].items(), key=lambda kv: (-kv[1], kv[0]))
        lines.append("fst refusals by reason: " + ", ".join(f"{k} {v}" for k, v in reasons) + ".")
        rej = fst["valid_rejected_by_rule"]
        lines.append("fst valid instances rejected, by documented smaller-language rule: " +
                     (", ".join(f"{k} {len(v)}" for k, v in sorted(rej.items())) or "none") + ".")
        unexplained = rej.get("UNEXPLAINED", [])
        if unexplained:
            lines.append("Of these, outside every documented rule (converter gaps, reported): " + "; ".join(
                f"`{x['case']}` ({x['schema_description']}): {x['instance']}, `{x['text']}`" for x in unexplained) + ".")
        lines.append(f"fst invalid instances accepted: {len(fst['invalid_accepted'])}" + (": " + "; ".join(
            f"`{x['case']}` ({x['schema_description']}): {x['instance']}, `{x['text']}`"
            for x in fst["invalid_accepted"]) if fst["invalid_accepted"] else "") + ".")
        lines.append(f"fst regex (backtracking `regex.fullmatch`) vs token-level matcher disagreements: "
                     f"{len(fst['regex_matcher_disagreements'])}" + (
                         f" ({fst_sum['regex_timeouts']} instances not cross-checked: the backtracking match ran "
                         f"over {REGEX_CHECK_S:g} s)" if fst_sum["regex_timeouts"] else "") + ".")
        if fst["invalid_accepted"]:
            print("\nfst INVALID INSTANCES ACCEPTED (converter bugs):")
            for b in fst["invalid_accepted"]:
                print(f"  {b['case']} ({b['schema_description']}): {b['instance']}: {b['text']}\n"
                      f"    schema: {json.dumps(b['schema'], ensure_ascii=False)}")
        for rule in ("UNEXPLAINED",):
            for x in rej.get(rule, []):
                print(f"  fst valid rejected, unexplained: {x['case']} ({x['schema_description']}): "
                      f"{x['instance']}: {x['text']}")
        for x in fst["regex_matcher_disagreements"]:
            print(f"  regex/matcher disagreement: {x}")
    for line in lines:
        print(line)
    others = {b: other_invalid_accepted(cases, results[b]) for b in backends if b != "fst"}
    if args.json_out:
        out = {
            "command": "python scripts/bench_json_schema_suite.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": _dt.date.today().isoformat(), "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "budget_s": args.budget_s, "total_s": total_s,
            "backends": {b: {"summary": {p: {k: v for k, v in summarize(cases, results[b], b, None if p == "all" else {p}).items()
                                             if k != "compile_s"} for p in ("all",) + parts_of(cases)},
                             "init_s": runs[b].init_s, "restarts": runs[b].restarts, "wall_s": runs[b].wall_s}
                         for b in backends},
            "fst_details": fst,
            "invalid_accepted_by_other_backends": others,
            "cases": [{"case": c.cid, "part": c.part, "description": c.description,
                       "instances": [{"description": i.description, "valid": i.valid, "text": i.text,
                                      "tokens": len(i.ids)} for i in c.instances],
                       "results": {b: results[b].get(c.cid) for b in backends}} for c in cases],
        }
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=1, ensure_ascii=False))
        print(f"wrote {args.json_out}")
    print(f"total {total_s:.0f} s")
    if args.no_write or args.only:
        return 0
    from scripts.bench_common import write_section

    cmd = "python scripts/bench_json_schema_suite.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.corpus:
        write_section(CORPUS_TITLE, cmd.strip(), tbl, corpus_note(cases, results, others, lines, args, total_s))
        return 0
    n_by_part = {p: sum(1 for c in cases if c.part == p) for p in PARTS}
    note = "\n\n".join([
        f"Suite: JSON-Schema-Test-Suite draft 2020-12 as vendored in `tests/data/json_schema_test_suite` "
        f"({len(cases)} schemas, {n_inst} instances; parts: " +
        "; ".join(f"{p} = {PART_NOTE[p]} ({n_by_part[p]} schemas)" for p in PARTS) + "). "
        "Valid / invalid = the suite's verdict. An instance is accepted when its canonical SmolLM2 token ids "
        "(compact JSON, keys in the order fst emits: `order_instance` in the script) and then EOS are all "
        "accepted, fed one token at a time to a fresh matcher; instances are counted only for compiled schemas. "
        "Compile time = fst: `json_schema_to_regex` + `compile_regex` (canonical); others: vLLM's "
        "`compile_grammar` after its request validation (caches cleared; llguidance builds its parser lazily, so "
        "its cost moves to the first masks). Budget "
        f"{args.budget_s:g} s per schema (over it: refused, budget). Backends run in worker processes, "
        f"{args.jobs} at a time, on a shared {os.cpu_count()}-CPU host (load average {os.getloadavg()[0]:.1f} at "
        f"the end); whole run {total_s / 60:.1f} min.",
        " ".join(lines),
        "Other backends, refusals by reason (top 6): " + "; ".join(
            f"{b}: " + ", ".join(f"{k} {v}" for k, v in sorted(summarize(cases, results[b], b)["reasons"].items(),
                                                                key=lambda kv: (-kv[1], kv[0]))[:6])
            for b in others) + ". Invalid instances they accept, by suite file (top 8): " + "; ".join(
            f"{b}: " + (", ".join(f"`{f}` {n}" for f, n in sorted(_count_files(others[b]).items(),
                                                                  key=lambda kv: (-kv[1], kv[0]))[:8]) or "none")
            for b in others) + "." if others else "",
        "Configuration as vLLM 0.32 with an explicitly chosen backend and default `StructuredOutputsConfig`: "
        "xgrammar `compile_json_schema(any_whitespace=True)` (default `strict_mode`: unevaluated properties and "
        "items false), llguidance `grammar_from_json_schema` with "
        "`whitespace_flexible`, outlines-core `build_regex_from_schema` (its default whitespace) + `Index`. "
        "fst: default whitespace `[ ]?`, canonical tokenizations only; its valid-instance misses are the "
        "documented smaller language of `compiler/json_schema.py` (rules in `smaller_language_rule`).",
    ])
    write_section("JSON Schema Test Suite", cmd.strip(), tbl, note)
    return 0


def corpus_note(cases: list[Case], results: dict, others: dict, fst_lines: list, args, total_s: float) -> str:
    """The notes under the corpus table: the sample, fst's time to an answer and compile memory, refusals."""
    n_inst = sum(len(c.instances) for c in cases)
    by_split = {p: sum(1 for c in cases if c.part == p) for p in parts_of(cases)}
    out = [
        f"Sample: {len(cases)} schemas ({', '.join(f'{p} {n}' for p, n in by_split.items())}) with {n_inst} test "
        "instances, files `maskbench/data/SPLIT---NAME.json` of JSONSchemaBench (github.com/guidance-ai/jsonschemabench: "
        "real-world schemas from GitHub, Kubernetes, Snowplow, JSON Schema Store, the Washington Post's ANS, MCP "
        "and function-calling sets (Glaive, BFCL), with valid and invalid instances generated for them and checked "
        "by the Python and Rust `jsonschema` libraries); not vendored here: the names are in the JSON output "
        "(`--json-out`) and in `docs/jsonschemabench_sample.txt`: run it on a clone with `--corpus "
        "<clone>/maskbench/data --names docs/jsonschemabench_sample.txt`. Instances, compile and budget "
        f"as in the section \"JSON Schema Test Suite\" (budget {args.budget_s:g} s); the suite's two "
        "suite-only rules (format-annotation, custom-metaschema) do not apply here, so valid instances of older "
        "drafts that fst rejects are counted by the other rules or as UNEXPLAINED. "
        f"Whole run {total_s / 60:.1f} min on a {os.cpu_count()}-CPU host.",
    ]
    if "fst" in results:
        res = results["fst"]
        ans = [r["answer_s"] for r in res.values() if "answer_s" in r]
        mem = [r["peak_mb"] for r in res.values() if r.get("peak_mb") is not None]
        slow = sorted(((r["answer_s"], cid) for cid, r in res.items() if "answer_s" in r), reverse=True)[:3]
        heavy = sorted(((r["peak_mb"], cid) for cid, r in res.items() if r.get("peak_mb") is not None), reverse=True)[:3]
        if ans:
            out.append(
                f"fst time to an answer (compiled or a named refusal; conversion + compile, one worker process, "
                f"cold), over all {len(ans)} schemas, ms p50 / p90 / max: {_ms(_pct(ans, 0.5))} / {_ms(_pct(ans, 0.9))}"
                f" / {_ms(max(ans))}; slowest: " + ", ".join(f"`{c}` {_ms(a)}" for a, c in slow) + ". "
                + (f"Compile memory (peak resident size of the worker over its size before the schema), MB p50 / "
                   f"max: {_pct(mem, 0.5):.0f} / {max(mem):.0f}; largest: " +
                   ", ".join(f"`{c}` {m:.0f}" for m, c in heavy) + "." if mem else ""))
    out.append(" ".join(fst_lines))
    if others:
        out.append("Other backends, refusals by reason (top 6): " + "; ".join(
            f"{b}: " + ", ".join(f"{k} {v}" for k, v in sorted(summarize(cases, results[b], b)["reasons"].items(),
                                                                key=lambda kv: (-kv[1], kv[0]))[:6])
            for b in others) + ". Invalid instances they accept (top 8 schemas): " + "; ".join(
            f"{b}: " + (", ".join(f"`{f}` {n}" for f, n in sorted(_count_files(others[b]).items(),
                                                                  key=lambda kv: (-kv[1], kv[0]))[:8]) or "none")
            for b in others) + ".")
    return "\n\n".join(x for x in out if x)


def _count_files(items: list) -> dict:
    out: dict = {}
    for x in items:
        f = x["case"].split("#")[0]
        out[f] = out.get(f, 0) + 1
    return out


if __name__ == "__main__":
    raise SystemExit(main())
