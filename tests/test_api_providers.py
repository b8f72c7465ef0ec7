"""The provider modules and the gateway package's contract.

A provider batch is paid for when it is submitted, and a rerun re-attaches a job to a recorded row only when
the request hash it computes now equals the recorded one. So the hash of a given request must not move when
the code around it is reorganized: the values below were computed by the code before the providers got their
own modules, and a change to them strands every batch a user has in flight.
"""

from __future__ import annotations

import ast
import os
import ssl
import tomllib
from pathlib import Path
from typing import Any, ClassVar

import anyio
import httpx2
import pytest

import interlens.scheduler.gateway as gateway
from interlens import Conversation
from interlens.participants._api_participant import APIParticipant
from interlens.providers import APIRequest, APISettings
from interlens.providers import _base as _provider_base
from interlens.providers._registry import PROVIDERS, open_client
from interlens.testing._fake_provider import FakeProviderServer

ROOT = Path(__file__).resolve().parents[1]


def _request(provider: str) -> APIRequest:
    return APIRequest(
        provider=provider,
        model="m-1",
        system="be brief",
        messages=(("user", "q é"), ("assistant", "a")),
        settings=APISettings(
            max_tokens=77, temperature=0.5, top_p=0.9, stop=("END",), timeout=30.0, prompt_cache=False
        ),
        turn=2,
    )


# provider -> (base_url, request hash, batch row size), as computed before the provider modules existed
PINNED = {
    "openai": (
        "https://u:pw@h.example:8443/v1?x=1",
        "198505f3def268cd26cd0dc3d4cf3d5431ad1fadaf1f5a79f64abaa6f5fce4d7",
        284,
    ),
    "openrouter": (
        "https://u:pw@h.example:8443/v1?x=1",
        "7246f8060a16bab49172b99dd34875bf230b006c57c907740a57ca2359a4ffe8",
        273,
    ),
    "anthropic": (
        "https://h.example",
        "1646df9118443c518d68feb21d732d6db0ce2884f6f101f4575cdbce6ded31fe",
        221,
    ),
}


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_request_hash_and_row_size_are_those_recorded_batches_were_made_with(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_url, digest, size = PINNED[provider]
    monkeypatch.setenv(f"{provider.upper()}_API_KEY", "sk-test-not-a-key")
    client = open_client(provider, base_url=base_url, max_in_flight=3, who="test")
    try:
        assert isinstance(client, gateway.ProviderClient)
        assert client.request_hash(_request(provider)) == digest
        assert client.row_size(_request(provider)) == size
    finally:
        await client.aclose()


def test_the_gateway_package_exports_its_contract_and_is_packaged() -> None:
    for name in gateway.__all__:
        assert getattr(gateway, name) is not None, name
    # a package missing from pyproject's list is absent from the wheel, though an editable install finds it
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for top, installed_as in setuptools["package-dir"].items():
        for init in (ROOT / installed_as).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / installed_as).parts
            assert ".".join((top, *parts)) in listed, f"{init.parent} is not in pyproject's packages"


def test_interlens_imports_no_private_module_path_of_the_scheduler_or_the_store() -> None:
    offending = []
    for path in (ROOT / "interlens").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = node.module.split(".")
                if names[:2] in (["interlens", "scheduler"], ["interlens", "store"]):
                    if any(part.startswith("_") for part in names[2:]):
                        offending.append(f"{path.relative_to(ROOT)}: {node.module}")
    assert offending == []


class _RecordingClient(httpx2.AsyncClient):
    """The HTTP client the SDKs get, noting the TLS context each one is built with (``verify=``)."""

    contexts: ClassVar[list[Any]] = []

    def __init__(self, **kwargs: Any) -> None:
        type(self).contexts.append(kwargs.get("verify"))
        super().__init__(**kwargs)


@pytest.fixture
def tls_meter(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A process without a built TLS context; every CA-store load through httpx2 is appended to the list."""
    monkeypatch.setattr(_provider_base, "_TLS", {})
    loads: list[Any] = []
    real = httpx2.create_ssl_context

    def counting(*args: Any, **kwargs: Any) -> Any:
        context = real(*args, **kwargs)
        loads.append(context)
        return context

    monkeypatch.setattr(httpx2, "create_ssl_context", counting)
    monkeypatch.setattr(_RecordingClient, "contexts", [])
    monkeypatch.setattr(httpx2, "AsyncClient", _RecordingClient)
    return loads


def test_the_ca_store_is_loaded_once_per_process_for_every_https_client_of_every_run(
    tls_meter: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each run's gateway opens its clients anew; loading the CA store (~16 ms) happens once per process."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-key")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test-not-a-key")

    async def one_run() -> None:  # what a run's gateway does with its clients
        for provider in ("openai", "anthropic"):
            client = open_client(provider, base_url="https://h.example/v1", max_in_flight=20, who="test")
            await client.aclose()

    anyio.run(one_run)
    anyio.run(one_run)
    assert len(tls_meter) == 1
    assert len(_RecordingClient.contexts) == 4 and all(c is tls_meter[0] for c in _RecordingClient.contexts)
    assert tls_meter[0].verify_mode == ssl.CERT_REQUIRED and tls_meter[0].check_hostname
    # the CA store is where httpx2 reads it from: another SSL_CERT_FILE is another context, then cached too
    ca_file = Path(os.environ.get("SSL_CERT_FILE") or ssl.get_default_verify_paths().openssl_cafile)
    copy = tmp_path / "ca.pem"
    copy.write_bytes(ca_file.read_bytes())
    monkeypatch.setenv("SSL_CERT_FILE", str(copy))
    assert _provider_base.tls_context("https://h.example") is _provider_base.tls_context("https://x.example")
    assert len(tls_meter) == 2 and tls_meter[1] is not tls_meter[0]


def test_an_http_endpoint_never_loads_the_ca_store_and_its_context_trusts_no_tls_peer(
    tls_meter: list[Any], server: FakeProviderServer, tmp_path: Path
) -> None:
    """Two rollouts against a real loopback server (http): no CA-store load, one shared context for both
    runs' clients, and that context would refuse any TLS peer (it verifies against an empty store)."""
    conv = Conversation(
        [APIParticipant(name="a", provider="openai", model_id="m-1", base_url=server.openai_base_url)],
        shared_context="hi",
    ).turns(1)
    for run in ("one", "two"):
        report = conv.rollout(n=2, out_dir=tmp_path / run)
        assert report.failed == [] and len(report.results) == 2
    assert [r.status for r in server.requests] == [200] * 4
    assert tls_meter == []
    contexts = _RecordingClient.contexts
    assert len(contexts) == 2 and contexts[0] is contexts[1]  # one client (one shard) a run
    assert contexts[0].verify_mode == ssl.CERT_REQUIRED and contexts[0].check_hostname
    assert contexts[0].cert_store_stats()["x509_ca"] == 0
