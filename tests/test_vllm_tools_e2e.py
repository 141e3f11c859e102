"""Tool calling through a real vLLM CPU server with ``--structured-outputs-config.backend fst`` and a tool-call
parser (``--enable-auto-tool-choice --tool-call-parser pythonic``, a parser SmolLM2's tokenizer passes):
``tool_choice="required"`` and a named ``tool_choice`` make vLLM constrain the answer with a JSON schema
built from the request's tools (``ToolParser.adjust_request``), which fst compiles like any other schema.

Checked on every choice: the answer comes back as ``tool_calls`` (not as content), each call names one of
the request's tools and its arguments validate against that tool's ``parameters``; the generated token ids
are the canonical tokenization of the JSON text vLLM parsed them from; no request went to the fallback
backend. One server for the module (``--enforce-eager``, ~35 s to start); ``VLLM_FST_E2E=0`` opts out.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

from server_testlib import e2e_opted_out, fst_server, metrics, without_eos
from server_testlib import assert_canonical as _assert_canonical
from server_testlib import eos_ids, tok  # noqa: F401  (fixtures)

if e2e_opted_out():
    pytest.skip("VLLM_FST_E2E=0: end-to-end server tests opted out", allow_module_level=True)


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
FLIGHTS = {
    "type": "object",
    "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "date": {"type": "string", "format": "date"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["origin", "destination", "date", "passengers"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search_flights", "description": "Flights between two airports.",
                                      "parameters": FLIGHTS}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    artifacts = request.getfixturevalue("built_artifacts")("smollm2", canonical=True)
    args = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
    with fst_server(artifacts, tmp_path_factory.mktemp("vllm_tools_server"), args=args) as srv:
        yield srv


def _fallback_count(server) -> float:
    return metrics(server).get("vllm_fst_fallback_requests_total", 0.0)  # (all constraint kinds)


def _tool_chat(server, content: str, tool_choice, temperature: float, n: int = 1, **kw):
    import requests

    body = {"model": server.model, "messages": [{"role": "user", "content": content}], "tools": TOOLS,
            "tool_choice": tool_choice, "temperature": temperature, "n": n, "max_tokens": 160,
            "return_token_ids": True, **kw}
    r = requests.post(server.base + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def _check_calls(choice, tok, eos_ids, names: set[str]) -> tuple[list[dict], str]:
    """``(calls, text)``: the choice's tool calls (``[{"name", "parameters"}]``) and the text its token ids
    spell (EOS removed), after checking the calls against the tools and the ids for canonicality."""
    import jsonschema

    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    assert calls, f"no tool calls: {choice}"
    assert not msg.get("content"), choice
    out = []
    for c in calls:
        name = c["function"]["name"]
        assert name in names, c
        args = json.loads(c["function"]["arguments"])
        jsonschema.validate(args, PARAMS[name], format_checker=jsonschema.FormatChecker())
        out.append({"name": name, "parameters": args})
    assert choice["token_ids"], choice
    ids = without_eos(choice["token_ids"], eos_ids)
    text = tok.decode(ids)
    _assert_canonical(tok, text, ids)
    return out, text


def test_tool_choice_required(server, tok, eos_ids):
    """``tool_choice="required"``, one call per answer (``parallel_tool_calls=false``: vLLM's schema is an
    array of at most one ``{"name", "parameters"}`` object, an anyOf over the tools), greedy and sampled."""
    before = _fallback_count(server)
    prompts = ["What is the weather like in Lisbon right now? Use celsius.",
               "Find me a flight from JFK to LHR on 2025-03-14 for two people."]
    seen = set()
    for prompt in prompts:
        for temperature, n in ((0.0, 1), (1.0, 3)):
            for choice in _tool_chat(server, prompt, "required", temperature, n, parallel_tool_calls=False):
                assert choice["finish_reason"] == "tool_calls", choice
                calls, text = _check_calls(choice, tok, eos_ids, set(PARAMS))
                assert len(calls) == 1, calls
                assert json.loads(text) == calls, (text, calls)  # the calls are the generated JSON
                print(f"\n{prompt[:30]!r} T={temperature}: {text}")
                seen.add(calls[0]["name"])
    assert seen, seen
    assert _fallback_count(server) == before  # fst compiled every one of them


def test_named_tool_choice(server, tok, eos_ids):
    """A named ``tool_choice``: the answer is that tool's arguments (the schema is its ``parameters``)."""
    before = _fallback_count(server)
    named = {"type": "function", "function": {"name": "search_flights"}}
    for temperature, n in ((0.0, 1), (1.0, 2)):
        for choice in _tool_chat(server, "I need to fly from Paris to Rome next Friday.", named, temperature, n):
            assert choice["finish_reason"] == "stop", choice
            calls, text = _check_calls(choice, tok, eos_ids, {"search_flights"})
            assert len(calls) == 1 and json.loads(text) == calls[0]["parameters"], (text, calls)
    assert _fallback_count(server) == before
