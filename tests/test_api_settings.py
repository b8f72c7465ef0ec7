"""``APISettings``, the one record of a hosted turn's settings: one check, one JSON form, requests unchanged.

The participant holds the record whole and every request carries it whole, so the rules and the JSON live in
the record alone. What must not move with it: a participant's recipe JSON (saved recipes and the recipes a
ledger stores once per lineup), and the body and digest of each request it builds. A rerun re-attaches a
job to a provider batch row only when today's digest of its request equals the recorded one, so the values
pinned below were computed by the code before the record existed, and a change to them strands every batch
a user has in flight.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from interlens import APIParticipant, ConfigurationError, ConfigurationTypeError
from interlens._core._view import GenerationOptions, View, ViewMessage
from interlens.providers import APISettings
from interlens.providers._base import request_digest
from interlens.providers._registry import request_body

VIEW = View(
    "a",
    "sys text",
    (
        ViewMessage("user", "hello", "b"),
        ViewMessage("assistant", "mine", "a"),
        ViewMessage("user", "mod", "moderator"),
    ),
)
OPTIONS = (
    GenerationOptions(),
    GenerationOptions(seed=2**40 + 5, max_new_tokens=10),  # a budgeted cap; a seed beyond 31 bits
    GenerationOptions(ephemeral=True, seed=3),
)
SET_EVERYTHING: dict[str, Any] = {
    "temperature": 1,
    "top_p": 0.5,
    "max_tokens": 33,
    "stop": "END",
    "batch": True,
    "base_url": "http://localhost:8000/v1",
    "timeout": 5,
    "max_in_flight": 7,
    "auth": False,
    "prompt_cache": False,
    "record_tokens": True,
    "system_prompt": "Be {x}.",
}
CASES: dict[str, dict[str, Any]] = {
    "default": {"provider": "openai", "model_id": "gpt-x"},
    "everything": {"provider": "openai", "model_id": "gpt-x", **SET_EVERYTHING},
    "anthropic": {"provider": "anthropic", "model_id": "claude-x", "stop": ["A", "B"], "batch": True},
    "openrouter": {
        "provider": "openrouter",
        "model_id": "v/m",
        "temperature": 0.0,
        "top_p": 1,
        "record_tokens": True,
    },
    "uncached": {"provider": "anthropic", "model_id": "claude-x", "prompt_cache": False, "max_tokens": 5},
}

# case -> sha256 of each OPTIONS' request (provider, "https://h.example/v1", "/v1/x", body), as computed
# before APISettings existed
PINNED_DIGESTS = {
    "everything": (
        "4760956d320ed538822dfbcac6254afccf267d7df25e2a330e0f67f27c8f33e8",
        "525f03ccf8d5b5b104a991cea492e774d7f85d7db01a9c5aa90800df1a973355",
        "280f0dc5e6d7fd658a065a0534598ad48dbf4c22530ef1d77288bf09b5898a36",
    ),
    "anthropic": (
        "bc278eef41caa48c968b42ef3f708e33f3fb9c80d1cc2243b4f05ca3f40e0a76",
        "f2dfa025752b6daf24337940da4b6fb2721dcc87f24f10914bc2cc85bf6887e0",
        "bc278eef41caa48c968b42ef3f708e33f3fb9c80d1cc2243b4f05ca3f40e0a76",
    ),
    "openrouter": (
        "bd62e58457eafbd8cd73a8de24e95ffd1e41d86102b59f6b8e12d7778808d65d",
        "ab3d7e2a8b5a569fbc68a8debf3b682cec6c7416deca71d301d4fbf1d454f036",
        "c3dda129af2c0d814b4d67ea3f6961be429dedfaaa9656e822a65c4d7138553f",
    ),
    "uncached": ("a41274527c682cbc9872cb852e2b306c0c08c2ae108f1b79651451fdc15bfb0b",) * 3,
}

_RETRY = (
    '"retry": {"max_attempts": 6, "initial_s": 0.5, "max_s": 30.0, "multiplier": 2.0, "jitter": 0.25, '
    '"max_retry_after_s": 120.0}, "batch_policy": {"max_rows": null, "max_wait_s": 60.0, "idle_s": 2.0, '
    '"poll_initial_s": 5.0, "poll_max_s": 60.0, "poll_multiplier": 1.5}'
)
# case -> its recipe JSON (json.dumps of to_json, keys in the order written), as written before APISettings
PINNED_JSON = {
    "default": '{"kind": "api", "name": "default", "provider": "openai", "model_id": "gpt-x", '
    '"system_prompt": null, "temperature": null, "top_p": null, "max_tokens": 1024, "stop": [], '
    f'"batch": false, "base_url": null, "timeout": 120.0, "max_in_flight": 64, {_RETRY}, "auth": null, '
    '"prompt_cache": true}',
    "everything": '{"kind": "api", "name": "everything", "provider": "openai", "model_id": "gpt-x", '
    '"system_prompt": "Be {x}.", "temperature": 1.0, "top_p": 0.5, "max_tokens": 33, "stop": ["END"], '
    '"batch": true, "base_url": "http://localhost:8000/v1", "timeout": 5.0, "max_in_flight": 7, '
    f'{_RETRY}, "auth": false, "prompt_cache": false, "record_tokens": true}}',
}
PINNED_DESCRIBE = (
    '{"kind": "api", "name": "everything", "provider": "openai", "model_id": "gpt-x", "system_prompt": '
    '"Be {x}.", "temperature": 1.0, "top_p": 0.5, "max_tokens": 33, "stop": ["END"], "record_tokens": true}'
)


def participant(case: str) -> APIParticipant:
    return APIParticipant(name=case, **CASES[case])


# -- one record, one check


def test_every_setting_of_the_record_is_a_participant_keyword_that_reaches_the_record() -> None:
    changed: dict[str, Any] = {
        "temperature": 0.25,
        "top_p": 0.5,
        "max_tokens": 7,
        "stop": ("END",),
        "timeout": 9.0,
        "prompt_cache": False,
        "record_tokens": True,
    }
    assert set(changed) == set(APISettings.names())  # a new field: give it a value here too
    assert all(changed[k] != getattr(APISettings(), k) for k in changed)  # each away from its default
    speaker = APIParticipant(name="p", provider="openai", model_id="m", **changed)
    assert speaker.settings == APISettings(**changed)
    assert APIParticipant.from_json(speaker.to_json()).settings == speaker.settings
    plain = APIParticipant(name="p", provider="openai", model_id="m")
    assert plain.replace(**changed).settings == speaker.settings and plain.settings == APISettings()
    request = speaker.request(VIEW, GenerationOptions(seed=4))
    assert request.settings == dataclasses.replace(speaker.settings, seed=4)  # the record whole, per turn


@pytest.mark.parametrize(
    ("setting", "value", "error"),
    [
        ("temperature", 3, ConfigurationError),
        ("temperature", "hot", ConfigurationTypeError),
        ("top_p", 0, ConfigurationError),
        ("max_tokens", 0, ConfigurationError),
        ("stop", ("ok", ""), ConfigurationError),
        ("timeout", 0, ConfigurationError),
        ("prompt_cache", "yes", ConfigurationError),
        ("record_tokens", "yes", ConfigurationError),
    ],
)
def test_the_participant_refuses_a_setting_by_the_record_s_one_check(
    setting: str, value: Any, error: type[Exception]
) -> None:
    with pytest.raises(error) as by_record:
        APISettings(**{setting: value}).check("APIParticipant('p')")
    message = str(by_record.value)
    assert message.startswith(f"APIParticipant('p'): {setting} must be") and repr(value) in message
    with pytest.raises(error) as at_construction:
        APIParticipant(name="p", provider="openai", model_id="m", **{setting: value})
    with pytest.raises(error) as by_replace:
        APIParticipant(name="p", provider="openai", model_id="m").replace(**{setting: value})
    assert str(at_construction.value) == str(by_replace.value) == message


def test_a_provider_that_cannot_take_a_setting_refuses_it_on_replace_too() -> None:
    claude = APIParticipant(name="c", provider="anthropic", model_id="claude-x")
    with pytest.raises(ConfigurationError, match="record_tokens=True cannot work: Anthropic reports no"):
        claude.replace(record_tokens=True)
    with pytest.raises(ConfigurationError, match=r"API version \(2026-10-21\) has no temperature/top_p"):
        claude.replace(temperature=0.5)
    with pytest.raises(ConfigurationError, match="has no setting 'nope'"):
        claude.replace(nope=1)


def test_the_seed_is_a_request_s_own_and_checked_as_an_int() -> None:
    with pytest.raises(ConfigurationError, match="seed must be an int or None"):
        APISettings(seed="1").check("X")  # type: ignore[arg-type]
    assert "seed" not in APISettings.names() and "seed" not in APISettings(seed=5).to_json()


# -- one JSON form


def test_the_record_round_trips_and_writes_a_newer_setting_only_when_set() -> None:
    record = APISettings(
        temperature=1,
        top_p=0.5,
        max_tokens=33,
        stop=("END",),
        timeout=5,
        prompt_cache=False,
        record_tokens=True,
    )
    text = json.dumps(record.to_json())
    assert text == (
        '{"temperature": 1.0, "top_p": 0.5, "max_tokens": 33, "stop": ["END"], "timeout": 5.0, '
        '"prompt_cache": false, "record_tokens": true}'
    )
    assert APISettings.from_json(json.loads(text)) == record
    assert APISettings.from_json({}) == APISettings()
    assert "record_tokens" not in APISettings().to_json()  # recipes written before it keep their JSON
    assert APISettings().describe() == {"temperature": None, "top_p": None, "max_tokens": 1024, "stop": []}


@pytest.mark.parametrize("case", sorted(PINNED_JSON))
def test_a_participant_s_recipe_json_is_the_one_written_before_the_record(case: str) -> None:
    speaker = participant(case)
    assert json.dumps(speaker.to_json()) == PINNED_JSON[case]
    assert json.dumps(APIParticipant.from_json(json.loads(PINNED_JSON[case])).to_json()) == PINNED_JSON[case]


def test_a_participant_s_fingerprint_description_is_the_one_written_before_the_record() -> None:
    assert json.dumps(participant("everything").describe()) == PINNED_DESCRIBE


# -- requests unchanged on the wire


@pytest.mark.parametrize("case", sorted(PINNED_DIGESTS))
def test_a_participant_s_requests_hash_as_before_the_record(case: str) -> None:
    speaker = participant(case)
    for options, digest in zip(OPTIONS, PINNED_DIGESTS[case], strict=True):
        request = speaker.request(VIEW, options)
        body = request_body(request)
        assert request_digest(speaker.provider, "https://h.example/v1", "/v1/x", body) == digest
    assert [speaker.request(VIEW, o).turn for o in OPTIONS] == [2, 2, None]


def test_participants_with_the_same_settings_share_provider_batches() -> None:
    one, two = participant("anthropic"), APIParticipant(name="other", **CASES["anthropic"])
    assert one.batch_key == two.batch_key is not None
    assert one.replace(stop=("C",)).batch_key != one.batch_key
    assert participant("default").batch_key is None  # batch=False: single requests
