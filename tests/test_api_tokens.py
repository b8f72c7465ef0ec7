"""Hosted turns as training data: ``APIParticipant(record_tokens=True)`` asks the provider for each generated
token's log-probability (chat completions' ``logprobs``) and keeps what it reports in the turn's record
(issue 27), beside local turns that record their ids.

Against the loopback fake provider through the official SDKs: the fake validates the body and answers with
``logprobs.content`` as chat completions do, its tokens and values a fixed function of the reply
(``FakeProviderServer.token_logprobs``), so each record is checked against what was sent on the wire. A
server that ignores the field (``transformers serve``) is in tests/test_transformers_serve.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from interlens import (
    APIParticipant,
    AutoModelParticipant,
    ConfigurationError,
    Conversation,
    FingerprintMismatchError,
    GenerationError,
    InterpModeError,
    Message,
    TokenRecord,
)
from interlens.report import TOKEN_COLUMNS, token_columns
from interlens.scheduler.gateway import BatchPolicy, RetryPolicy
from interlens.testing import FakeProviderServer

FAST = RetryPolicy(initial_s=0.01, max_s=0.05, max_attempts=2)
QUICK = BatchPolicy(idle_s=0.3, poll_initial_s=0.01, poll_max_s=0.05)
MODELS = {"openai": "gpt-test", "openrouter": "vendor/model", "anthropic": "claude-test"}

pytestmark = pytest.mark.usefixtures("hermetic_api_env")


def _api(name: str, provider: str, **settings: Any) -> APIParticipant:
    return APIParticipant(name=name, provider=provider, model_id=MODELS[provider], retry=FAST, **settings)


def _assert_reported(message: Message, provider: str) -> None:
    """The turn's record is what the fake reported for its reply: tokens joining to the text, values in
    float32, named as the provider's, with no ids and no sampling log-probabilities."""
    record = message.tokens
    assert record is not None and record.reported_by == provider
    sent = FakeProviderServer.token_logprobs(message.content)
    assert record.texts == tuple(token for token, _ in sent) and "".join(record.texts) == message.content
    assert record.model_logprobs == pytest.approx([value for _, value in sent], rel=1e-6)
    assert record.model_logprobs != tuple(value for _, value in sent)  # stored as float32, not float64
    assert record.ids == () and record.prompt_ids == () and record.sampling_logprobs is None


def test_hosted_turns_keep_the_log_probabilities_their_provider_reported(
    server: FakeProviderServer, qwen2_path: str, tmp_path: Path
) -> None:
    """A mixed lineup (a local model, OpenAI, OpenRouter), each recording: every request asked for logprobs,
    every turn kept its record through the ledger and a resume, and the token export gives the hosted turns
    their tokens as text and says who computed the values."""
    local = AutoModelParticipant.from_pretrained(
        qwen2_path, name="local", max_new_tokens=6, temperature=0.9, record_tokens=True
    )
    conv = Conversation(
        [local, _api("oa", "openai", record_tokens=True), _api("or", "openrouter", record_tokens=True)],
        shared_context="Is a hot dog a sandwich?",
    ).turns(6)
    first = conv.rollout(n=2, out_dir=tmp_path, seed=3)
    assert not first.failed
    chats = [r for r in server.requests if r.path.endswith("/chat/completions")]
    assert len(chats) == 2 * 4 and all(
        r.json["logprobs"] is True and r.json["top_logprobs"] == 0 for r in chats
    )
    # OpenRouter routes only to hosts that give them; OpenAI refuses the field it does not know
    assert {str(r.json.get("provider")) for r in chats if r.provider == "openrouter"} == {
        "{'require_parameters': True}"
    }
    assert all("provider" not in r.json for r in chats if r.provider == "openai")
    for result in first.results.values():
        for message in result.transcript[1:]:
            if message.author == "local":
                assert message.tokens is not None and message.tokens.reported_by is None
            else:
                _assert_reported(message, "openai" if message.author == "oa" else "openrouter")
    again = conv.rollout(n=2, out_dir=tmp_path, seed=3)
    assert again.skipped == sorted(first.results)
    for job_id, result in first.results.items():
        assert [m.tokens for m in again.results[job_id].transcript] == [m.tokens for m in result.transcript]

    frame = first.to_pandas(tokens=True)
    assert list(frame.columns) == list(TOKEN_COLUMNS) and len(frame) == 2 * 6
    hosted = frame[frame["speaker"] != "local"]
    assert set(hosted["logprobs_source"]) == {"openai", "openrouter"}
    assert hosted["prompt_ids"].isna().all() and hosted["completion_ids"].isna().all()
    assert hosted["completion_sampling_logprobs"].isna().all()
    for row in hosted.itertuples():
        assert "".join(row.completion_tokens) == row.completion
    own = frame[frame["speaker"] == "local"]
    assert set(own["logprobs_source"]) == {"local"} and own["completion_tokens"].isna().all()
    assert all(
        len(ids) == len(lp)
        for ids, lp in zip(own["completion_ids"], own["completion_model_logprobs"], strict=True)
    )
    per_speaker = first.to_pandas(tokens="speakers")  # a row needs ids: the local speaker's only
    assert list(per_speaker.columns) == list(token_columns("speaker")) and set(per_speaker["speaker"]) == {
        "local"
    }


def test_batch_rows_carry_their_log_probabilities(server: FakeProviderServer, tmp_path: Path) -> None:
    """OpenAI's batch API: each row's body asks for logprobs; each row's answer fills its turn's record."""
    conv = Conversation(
        [
            _api("pro", "openai", record_tokens=True, batch=True, batch_policy=QUICK),
            _api("con", "openai", record_tokens=True, batch=True, batch_policy=QUICK),
        ],
        shared_context="Tabs or spaces?",
    ).turns(2)
    report = conv.rollout(n=3, out_dir=tmp_path, seed=1)
    assert not report.failed and server.batch_count("openai") == 2
    for result in report.results.values():
        for message in result.transcript[1:]:
            assert message.metadata["batch_id"]
            _assert_reported(message, "openai")


def test_a_refusal_of_logprobs_names_the_setting_and_the_fix(server: FakeProviderServer) -> None:
    """A model that refuses logprobs (OpenAI's reasoning models answer 400) fails the turn, with the fix."""
    server.fail_next(1, status=400, message="logprobs is not supported with this model", provider="openai")
    conv = Conversation([_api("oa", "openai", record_tokens=True)], shared_context="Hi").turns(1)
    with pytest.raises(GenerationError, match=r"logprobs is not supported.*set record_tokens=False"):
        conv.run()
    # OpenRouter, asked to route only to hosts that honour every parameter, finds none
    none = "No endpoints found that can handle the requested parameters."
    server.fail_next(1, status=404, message=none, provider="openrouter")
    routed = Conversation([_api("or", "openrouter", record_tokens=True)], shared_context="Hi").turns(1)
    with pytest.raises(GenerationError, match=r"No endpoints found.*set record_tokens=False"):
        routed.run()
    server.fail_next(1, status=404, message=none, provider="openrouter")
    plain = Conversation([_api("or", "openrouter")], shared_context="Hi").turns(1)
    with pytest.raises(GenerationError) as raised:
        plain.run()
    assert "record_tokens" not in str(raised.value)  # nothing asked for: no hint about it


def test_an_answer_without_log_probabilities_keeps_its_text_and_says_so(
    server: FakeProviderServer, caplog: pytest.LogCaptureFixture
) -> None:
    """OpenRouter passes logprobs through; a model whose host gives none answers without them. The turn (paid
    for) is kept, its metadata says why it has no record, and the participant warns once, not per turn."""
    from interlens.providers._base import APIResult

    speaker = _api("or-bare", "openrouter", record_tokens=True)  # warned once per name and process
    bare = APIResult(text="Yes.", finish_reason="stop", prompt_tokens=3, output_tokens=1)
    with caplog.at_level(logging.WARNING, logger="interlens"):
        messages = [speaker.message(bare, 0.1) for _ in range(3)]
    for message in messages:
        assert message.tokens is None and message.content == "Yes."
        assert "answered without them" in message.metadata["tokens_missing"]
    warned = [r for r in caplog.records if "keep no token record" in r.getMessage()]
    assert len(warned) == 1 and "record_tokens=False" in warned[0].getMessage()
    plain = _api("p", "openrouter").message(bare, 0.1)
    assert "tokens_missing" not in plain.metadata  # nothing asked, nothing to say


def test_bad_record_tokens_settings_are_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError, match=r"record_tokens=True cannot work: Anthropic reports no"):
        _api("c", "anthropic", record_tokens=True)
    with pytest.raises(ConfigurationError, match="provider='openai' or 'openrouter'"):
        _api("c", "anthropic", record_tokens=True)
    with pytest.raises(ConfigurationError, match="record_tokens must be True or False, got 'yes'"):
        _api("oa", "openai", record_tokens="yes")
    # the interp spelling of the same wish points at the setting that exists
    with pytest.raises(InterpModeError, match=r"pass record_tokens=True .*openai, openrouter"):
        _api("oa", "openai", logprobs=True)


def test_recording_is_part_of_the_recipe_a_resume_compares(
    server: FakeProviderServer, tmp_path: Path
) -> None:
    plain = Conversation([_api("oa", "openai")], shared_context="Hi").turns(2)
    assert "record_tokens" not in json.dumps(plain.to_json())  # older recipes keep their fingerprint
    recording = Conversation([_api("oa", "openai", record_tokens=True)], shared_context="Hi").turns(2)
    plain.rollout(n=1, out_dir=tmp_path)
    with pytest.raises(FingerprintMismatchError, match="resume=False"):
        recording.rollout(n=1, out_dir=tmp_path)
    copy = APIParticipant.from_json(_api("oa", "openai", record_tokens=True).to_json())
    assert copy.settings.record_tokens is True


def test_a_provider_record_round_trips_and_validates() -> None:
    record = TokenRecord.reported("openai", ["Hel", "lo"], [-0.25, -1.5])
    data = record.to_json()
    assert data["format"] == 2 and data["texts"] == ["Hel", "lo"] and "ids" not in data
    assert TokenRecord.from_json(json.loads(json.dumps(data))) == record
    with pytest.raises(ConfigurationError, match="texts aligned with model_logprobs"):
        TokenRecord((), (-1.0,), None, (), ("a", "b"), "openai")
    with pytest.raises(ConfigurationError, match="must align"):
        TokenRecord((1,), (-1.0,), None)


def test_a_rollout_can_ask_every_participant_that_can_to_record(
    server: FakeProviderServer, qwen2_path: str, tmp_path: Path
) -> None:
    """``rollout(record_tokens=True)``: the local model and OpenAI record without being told one by one;
    Anthropic and a scripted speaker cannot, and their turns say why. The option is part of the recipe a
    resume compares: the same call resumes, one without it is refused."""
    from interlens import ScriptedParticipant, run

    local = AutoModelParticipant.from_pretrained(qwen2_path, name="local", max_new_tokens=5)
    lineup = Conversation(
        [local, _api("oa", "openai"), _api("an", "anthropic"), ScriptedParticipant(name="s", replies=["ok"])],
        shared_context="Is a hot dog a sandwich?",
    ).turns(4)
    report = lineup.rollout(n=2, out_dir=tmp_path, seed=1, record_tokens=True)
    assert not report.failed
    for result in report.results.values():
        local_turn, openai_turn, anthropic_turn, scripted_turn = result.transcript[1:]
        assert local_turn.tokens is not None and local_turn.tokens.reported_by is None
        _assert_reported(openai_turn, "openai")
        assert anthropic_turn.tokens is None and scripted_turn.tokens is None
        assert anthropic_turn.metadata["tokens_missing"] == (
            "asked for (record_tokens=True): Anthropic reports no token log-probabilities"
        )
        assert "has no model tokens to record" in scripted_turn.metadata["tokens_missing"]
        assert "tokens_missing" not in local_turn.metadata | openai_turn.metadata
    again = lineup.rollout(n=2, out_dir=tmp_path, seed=1, record_tokens=True)
    assert again.skipped == sorted(report.results)
    assert again.results["rollout_0000"].transcript[3].metadata["tokens_missing"]  # read back from the ledger
    with pytest.raises(FingerprintMismatchError, match="resume=False"):
        lineup.rollout(n=2, out_dir=tmp_path, seed=1)
    plain = lineup.rollout(n=1, seed=1)  # the lineup itself is unchanged: nothing recorded, nothing said
    assert all(
        m.tokens is None and "tokens_missing" not in m.metadata
        for m in plain.results["rollout_0000"].transcript
    )
    both = run([lineup.name("a"), lineup.name("b")], seed=1, record_tokens=True)
    assert all(r.transcript[2].tokens is not None for r in both.results.values())


def test_record_tokens_as_a_run_option_must_be_a_bool(server: FakeProviderServer) -> None:
    from interlens import ConfigurationTypeError

    conv = Conversation([_api("oa", "openai")], shared_context="Hi").turns(1)
    with pytest.raises(ConfigurationTypeError, match=r"rollout\(\): record_tokens must be True or False"):
        conv.rollout(n=1, record_tokens="yes")  # type: ignore[typeddict-item]
