"""The fake server's provider wires are records in one registry: a new wire is one record and one line.

A test-only wire is registered and talked to over loopback HTTP: every per-provider decision of the server
(which wire a request is for, its routes, credentials, error envelope, base URL, ``env()``, meters, faults)
must come from its record, or the toy wire's requests land on another provider. A scan of the sources checks
that no provider name is compared anywhere else, and the fake wires follow the production registry.
"""

from __future__ import annotations

import ast
import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from interlens.providers import PROVIDERS, provider
from interlens.testing import _fake_provider_registry as registry
from interlens.testing._fake_provider import FakeProviderServer, default_reply
from interlens.testing._fake_provider_core import Ctx, FakeWire, Route, State, json_response
from interlens.testing._fake_provider_http import HttpResponse

pytestmark = pytest.mark.usefixtures("hermetic_api_env")  # conftest: no real key or endpoint leaks in

TESTING = Path(__file__).resolve().parents[1] / "interlens" / "testing"


def _toy_generate(state: State, ctx: Ctx, _: re.Match[str]) -> HttpResponse:
    if not isinstance(ctx.json, dict) or not isinstance(ctx.json.get("prompt"), str):
        return ctx.error(400, "prompt: a string is required")
    body = {"messages": [{"role": "user", "content": ctx.json["prompt"]}]}
    return json_response({"text": state.generate(body, None).text, "provider": ctx.provider})


def _toy_error(status: int, message: str, request_id: str) -> dict[str, Any]:
    return {"toy_error": {"status": status, "message": message, "id": request_id}}


TOY = FakeWire(
    name="toy",
    key_variable="TOY_API_KEY",
    url_variable="TOY_BASE_URL",
    base_path="/toy/v1",
    routes=(Route("POST", re.compile(r"/toy/v1/generate"), _toy_generate, generation=True),),
    error_body=_toy_error,
    path_prefixes=("/toy/",),
    key_headers=("x-toy-key",),
)


def _call(url: str, *, method: str = "POST", body: Any = None, **headers: str) -> tuple[int, Any]:
    """(status, parsed JSON body) of one request, straight over HTTP (no proxy, no SDK)."""
    data = None if body is None else json.dumps(body).encode()
    hdrs = {k.replace("_", "-"): v for k, v in headers.items()} | {"content-type": "application/json"}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, data=data, method=method, headers=hdrs)) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_registered_wire_is_served_from_its_record_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setitem(registry._REGISTRY, "toy", TOY)  # the registry's one line, for this test
        server = FakeProviderServer()  # a server speaks the wires registered when it is built
    with server:
        base = server.base_url_for("toy")
        assert base == f"{server.base_url}/toy/v1"
        env = server.env("sk-toy")
        assert env["TOY_API_KEY"] == "sk-toy" and env["TOY_BASE_URL"] == base
        assert env["OPENAI_BASE_URL"] == server.openai_base_url  # the other wires are still there

        status, answer = _call(f"{base}/generate", body={"prompt": "hi toy"}, x_toy_key="sk-toy")
        assert status == 200 and answer["provider"] == "toy"
        assert answer["text"] == default_reply({"messages": [{"role": "user", "content": "hi toy"}]})
        record = server.requests[-1]
        assert (record.provider, record.authenticated, record.status) == ("toy", True, 200)
        assert record.headers["x-toy-key"] == "***"  # a key header is redacted like any other

        # a path the wire claims is its own, whatever marker header another wire's SDK would send
        status, answer = _call(f"{base}/generate", body={}, authorization="Bearer k", anthropic_version="x")
        assert status == 400 and answer["toy_error"]["message"] == "prompt: a string is required"

        status, answer = _call(f"{base}/generate", body={"prompt": "no key"})
        assert status == 401
        assert answer["toy_error"]["message"] == (
            "missing credentials: send Authorization: Bearer <key> or x-toy-key"
        )
        status, answer = _call(f"{base}/generate", method="GET", x_toy_key="k")
        assert status == 405 and answer["toy_error"]["status"] == 405
        status, answer = _call(f"{base}/nothing", x_toy_key="k", body={})
        assert status == 404 and "no toy route POST /toy/v1/nothing" in answer["toy_error"]["message"]

        server.fail_next(1, status=503, provider="toy", message="toy is down")
        status, answer = _call(f"{server.openai_base_url}/models", method="GET", authorization="Bearer k")
        assert status == 404 and server.requests[-1].provider == "openai"  # the fallback wire; fault kept
        status, answer = _call(f"{base}/generate", body={"prompt": "again"}, x_toy_key="k")
        assert status == 503 and answer["toy_error"]["message"] == "toy is down"

        assert server.max_concurrency_for("toy") == 1 and server.in_flight_for("toy") == 0
        assert server.batches_created == {"openai": 0, "anthropic": 0, "openrouter": 0, "toy": 0}
        assert server.handler_errors == []
    with pytest.raises(ValueError, match="provider must be one of openai, anthropic, openrouter or None"):
        FakeProviderServer().fail_next(1, provider="toy")  # unregistered again: refused


def test_wires_need_distinct_names_and_one_fallback() -> None:
    with pytest.raises(ValueError, match="exactly one fallback"):
        registry.Wires((TOY,))
    openai_wire = registry.registered()["openai"]
    with pytest.raises(ValueError, match="distinct names"):
        registry.Wires((openai_wire, openai_wire))


def test_no_provider_name_is_compared_outside_the_wire_records() -> None:
    """A provider name appears in the fake server's code only as the ``name=`` of its ``FakeWire`` record:
    any other string equal to one (a comparison, a dict key, a default) is a switch on names."""
    names = set(registry.registered().names)
    found = []
    for path in sorted(TESTING.glob("_fake_provider*.py")):
        tree = ast.parse(path.read_text(), str(path))
        allowed = {
            id(kw.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "FakeWire"
            for kw in node.keywords
            if kw.arg == "name"
        }
        found += [
            f"{path.name}:{node.lineno}: {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in allowed
        ]
    assert found == [], "provider names compared outside the FakeWire records:\n" + "\n".join(found)


def test_every_production_provider_has_a_fake_wire_reading_its_variables() -> None:
    """Step 3 of "add a provider": the fake server speaks every provider interlens knows, and ``env()``
    sets the variables the production registry reads."""
    wires = registry.registered()
    assert sorted(wires.names) == sorted(PROVIDERS)
    for name in PROVIDERS:
        record = provider(name)
        assert (wires[name].key_variable, wires[name].url_variable) == (
            record.key_variable,
            record.url_variable,
        )
