"""The provider modules and the gateway package's contract.

A provider batch is paid for when it is submitted, and a rerun re-attaches a job to a recorded row only when
the request hash it computes now equals the recorded one. So the hash of a given request must not move when
the code around it is reorganized: the values below were computed by the code before the providers got their
own modules, and a change to them strands every batch a user has in flight.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

import interlens.scheduler.gateway as gateway
from interlens._provider_base import APIRequest
from interlens._providers import PROVIDERS, open_client

ROOT = Path(__file__).resolve().parents[1]


def _request(provider: str) -> APIRequest:
    return APIRequest(
        provider=provider,
        model="m-1",
        system="be brief",
        messages=(("user", "q é"), ("assistant", "a")),
        max_tokens=77,
        temperature=0.5,
        top_p=0.9,
        stop=("END",),
        timeout=30.0,
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
