"""Per-turn interp on local participants, at the conversation level, on real tiny models (issue 11).

Capture, steering, probes and logprobs live and inside deterministic rollouts (in-process and in two worker
processes), the refusals on the batched path and on hosted participants, and steering as part of what a
rerun compares. The engine's hooks themselves (values against a teacher-forced forward, every family) are
tested in ``test_interp_engine``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import interlens
from interlens import (
    APIParticipant,
    AutoModelParticipant,
    Conversation,
    InterpModeError,
    Probe,
    ScriptedParticipant,
    SteeringSpec,
)
from interlens.testing import tiny_model


def model(path: str, name: str = "a", **settings: Any) -> Any:
    return AutoModelParticipant.from_pretrained(path, name=name, **{"max_new_tokens": 6, **settings})


def config(path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def debate(path: str, **settings: Any) -> Conversation:
    return Conversation(
        participants=[model(path, "a", **settings), model(path, "b", **settings)],
        shared_context="Debate: tabs vs spaces.",
    ).turns(2)


def direction(path: str, seed: int = 0) -> torch.Tensor:
    return torch.randn(config(path).hidden_size, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- capture, live
@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma2"])
def test_capture_records_every_turn_with_spans_over_exactly_the_generated_tokens(family: str) -> None:
    path = tiny_model(family)
    cfg = config(path)
    conv = debate(path, seed=3)
    with conv.capture(sites=("residual", "attn", "mlp")) as cache:
        conv.run()
    assert len(conv.transcript) == 3  # shared context + 2 turns
    assert len(cache) == 2 * cfg.num_hidden_layers * 3
    for idx, speaker in ((1, "a"), (2, "b")):
        records = cache.query(message_idx=idx)
        assert {r.participant for r in records} == {speaker}
        assert {(r.layer, r.site) for r in records} == {
            (layer, site) for layer in range(cfg.num_hidden_layers) for site in ("residual", "attn", "mlp")
        }
        n = conv.transcript[idx].metadata["n_tokens"]
        prompt_len = conv.transcript[idx].metadata["prompt_tokens"]
        for r in records:
            assert r.answer.shape == (n, cfg.hidden_size)
            assert r.answer.device.type == "cpu" and r.prompt is None and r.kind == "turn"
            assert r.span == (prompt_len, prompt_len + n)
            assert len(r.answer_ids) == n
    tensor = cache.at(participant="b", message_idx=2, layer=0, site="mlp")
    assert tensor.shape == (conv.transcript[2].metadata["n_tokens"], cfg.hidden_size)


def test_capture_with_layers_and_prompt_and_nothing_outside_the_block(qwen2_path: str) -> None:
    conv = debate(qwen2_path, seed=1)
    conv.step()
    with conv.capture(layers=[1], prompt=True) as cache:
        conv.step()
        sampled = conv.sample("a", "And now?")
    conv.step()  # after the block: not recorded
    assert [(r.participant, r.message_idx, r.kind, r.layer) for r in cache] == [
        ("b", 2, "turn", 1),
        ("a", 3, "sample", 1),
    ]
    turn = cache.query(kind="turn")[0]
    assert turn.prompt is not None and turn.prompt.shape[0] == conv.transcript[2].metadata["prompt_tokens"]
    assert cache.query(kind="sample")[0].answer.shape[0] == sampled.metadata["n_tokens"]
    with pytest.raises(interlens.ConfigurationError, match="matches 2 records"):
        cache.at(layer=1)


def test_capture_errors_name_the_argument(qwen2_path: str) -> None:
    conv = debate(qwen2_path)
    with pytest.raises(interlens.ConfigurationError, match=r"capture\(sites=.*choose from"):
        with conv.capture(sites=("resid",)):
            pass
    n_layers = config(qwen2_path).num_hidden_layers
    with conv.capture(layers=[n_layers]):
        with pytest.raises(interlens.ConfigurationError, match=f"{n_layers} decoder layers"):
            conv.step()
    assert len(conv.transcript) == 1  # the refused turn was not appended


def test_turn_activations_reread_each_turn_in_the_view_its_speaker_had(qwen2_path: str) -> None:
    """A teacher-forced pass per turn over the speaker's view at that point plus the message's text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._chat_template import render_view

    conv = debate(qwen2_path, seed=2).turns(3)
    conv.run()
    reread = conv.turn_activations(layers=[0], prompt=True)
    assert [(r.participant, r.message_idx, r.kind) for r in reread] == [
        ("a", 1, "turn"),
        ("b", 2, "turn"),
        ("a", 3, "turn"),
    ]
    tokenizer = AutoTokenizer.from_pretrained(qwen2_path)
    hf = AutoModelForCausalLM.from_pretrained(qwen2_path)
    for record in reread:
        message = conv.transcript[record.message_idx]
        view = conv.view(record.participant, upto=record.message_idx)
        prompt = tokenizer(render_view(tokenizer, view), add_special_tokens=False)["input_ids"]
        answer = tokenizer(message.content, add_special_tokens=False)["input_ids"]
        assert list(record.answer_ids) == answer and record.span == (len(prompt), len(prompt) + len(answer))
        assert record.prompt_len == message.metadata["prompt_tokens"]  # the prompt it was generated from
        with torch.no_grad():
            hidden = hf(torch.tensor([prompt + answer]), output_hidden_states=True).hidden_states[1][0]
        torch.testing.assert_close(record.answer, hidden[len(prompt) :], atol=1e-4, rtol=1e-4)
        assert record.prompt is not None
        torch.testing.assert_close(record.prompt, hidden[: len(prompt)], atol=1e-4, rtol=1e-4)
    only_b = conv.turn_activations("b", layers=1)
    assert [(r.participant, r.layer) for r in only_b] == [("b", 1)]


# ---------------------------------------------------------------------- logprobs
def test_logprobs_equal_the_sum_of_per_token_log_softmax_by_hand(qwen2_path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._chat_template import render_view

    conv = debate(qwen2_path, seed=0)
    conv.step()
    text = " Spaces win, always."
    scored = conv.logprobs("b", text)

    tokenizer = AutoTokenizer.from_pretrained(qwen2_path)
    hf = AutoModelForCausalLM.from_pretrained(qwen2_path)
    prompt = tokenizer(render_view(tokenizer, conv.view("b")), add_special_tokens=False)["input_ids"]
    cont = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + cont])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    by_hand = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(cont)]
    assert list(scored.token_ids) == cont
    assert scored.logprobs == pytest.approx(by_hand, abs=1e-4)
    assert scored.total == pytest.approx(sum(by_hand), abs=1e-3)
    assert float(scored) == scored.total  # float(lp): the total, as the spec's comparisons use it
    assert "".join(scored.tokens) and len(scored) == len(cont)
    assert conv.logprobs("b", " Tabs.").total != pytest.approx(scored.total)
    with pytest.raises(interlens.ConfigurationError, match="non-empty str") as excinfo:
        conv.logprobs("b", "")
    assert not isinstance(excinfo.value, InterpModeError)  # bad input, not a mode the call cannot run in


# ---------------------------------------------------------------------- steering
def test_steering_changes_tokens_and_logits_and_is_recorded(qwen2_path: str) -> None:
    spec = SteeringSpec(direction(qwen2_path) * 8, layers=[0, 1], coef=4.0)
    plain = debate(qwen2_path, seed=4)
    steered = plain.set(
        participants=[model(qwen2_path, "a", seed=4, steering=spec), model(qwen2_path, "b", seed=4)]
    )
    plain.run()
    steered.run()
    assert plain.transcript[1].content != steered.transcript[1].content
    assert steered.transcript[1].metadata["steering"] == [spec.summary()]
    assert "steering" not in steered.transcript[2].metadata
    assert plain.logprobs("b", " yes").total != pytest.approx(
        plain.logprobs("b", " yes", steering=spec).total, abs=1e-3
    )


def test_ablate_leaves_no_component_along_the_direction(qwen2_path: str) -> None:
    vec = direction(qwen2_path, seed=9)
    unit = vec / vec.norm()
    conv = debate(qwen2_path, seed=1)
    with conv.capture(layers=[0]) as cache:
        conv.step(steering=SteeringSpec(vec, layers=0, mode="ablate"))
        conv.step()
    ablated, plain = cache.at(message_idx=1, layer=0), cache.at(message_idx=2, layer=0)
    assert float((ablated.float() @ unit).abs().max()) < 1e-4
    assert float((plain.float() @ unit).abs().max()) > 1e-2


def test_participant_set_steering_is_copy_on_write_and_saved(qwen2_path: str, tmp_path: Path) -> None:
    base = model(qwen2_path, "a")
    spec = SteeringSpec(direction(qwen2_path), layers=[1], coef=2.0)
    steered = base.set(steering=spec)
    assert base.steering == () and steered.steering == (spec,)
    with pytest.raises(interlens.ConfigurationTypeError, match="no setting 'steer'"):
        base.set(steer=spec)
    conv = Conversation([steered, model(qwen2_path, "b")], shared_context="hi").turns(1)
    conv.save(tmp_path)
    loaded = Conversation.load(tmp_path)
    assert loaded.participant("a").steering == (spec,)
    assert loaded.fingerprint() == conv.fingerprint()
    assert (
        conv.set(
            participants=[
                base.set(steering=SteeringSpec(spec.direction, [1], coef=3.0)),
                model(qwen2_path, "b"),
            ]
        ).fingerprint()
        != conv.fingerprint()
    )


def test_difference_of_means_from_two_small_activation_sets(qwen2_path: str) -> None:
    conv = debate(qwen2_path, seed=0)
    conv.step()
    with conv.capture(layers=[1]) as cache:
        for prompt in ("I love it.", "Wonderful!", "Great idea."):
            conv.sample("b", prompt)
    pos = cache.query()
    with conv.capture(layers=[1]) as cache2:
        for prompt in ("I hate it.", "Terrible!", "Awful idea."):
            conv.sample("b", prompt)
    neg = cache2.query()
    spec = SteeringSpec.difference_of_means(pos, neg, layers=[1], coef=2.0)
    expected = torch.cat([r.answer for r in pos]).float().mean(0) - torch.cat(
        [r.answer for r in neg]
    ).float().mean(0)
    torch.testing.assert_close(spec.direction, expected)
    probe = Probe.difference_of_means(pos, neg, layer=1)
    # by hand: each record pooled (mean over its tokens), the direction between the classes' means, the bias
    # putting 0 halfway between them
    pos_means = torch.stack([r.answer.float().mean(0) for r in pos])
    neg_means = torch.stack([r.answer.float().mean(0) for r in neg])
    d = pos_means.mean(0) - neg_means.mean(0)
    bias = -float(d @ (pos_means.mean(0) + neg_means.mean(0))) / 2
    for record in (*pos, *neg):
        assert probe.read(record) == pytest.approx(float(d @ record.answer.float().mean(0)) + bias, rel=1e-5)
    assert sum(probe.read(r) for r in pos) / 3 == pytest.approx(-sum(probe.read(r) for r in neg) / 3)
    last = Probe.difference_of_means(pos, neg, layer=1, pool="last")
    d_last = torch.stack([r.answer[-1].float() for r in pos]).mean(0) - torch.stack(
        [r.answer[-1].float() for r in neg]
    ).mean(0)
    torch.testing.assert_close(last.direction, d_last)
    fitted = Probe.fit(pos, neg, layer=1)
    assert all(fitted.read(r) > 0 for r in pos) and all(fitted.read(r) < 0 for r in neg)


# ---------------------------------------------------------------------- refusals
def test_batched_rollouts_refuse_steering_before_start_and_capture_at_use(
    qwen2_path: str, tmp_path: Path
) -> None:
    spec = SteeringSpec(direction(qwen2_path), layers=[0])
    steered = Conversation([model(qwen2_path, "a", steering=spec)], shared_context="hi").turns(1)
    with pytest.raises(InterpModeError, match="batched=False"):
        steered.rollout(n=2, out_dir=tmp_path / "x", progress=False)
    assert not (tmp_path / "x" / "ledger.sqlite").exists()

    def capture_in_analyzer(conv: Conversation) -> Any:
        with conv.capture():
            conv.sample("a")
        return 1

    report = debate(qwen2_path).analyzer(capture_in_analyzer).rollout(n=1, progress=False)
    [error] = [r.error for r in report.results.values()]
    assert error is not None and "batched=False" in error.message and error.type == "InterpModeError"


def test_hosted_and_scripted_participants_refuse_interp() -> None:
    with pytest.raises(InterpModeError, match="cannot do interp"):
        APIParticipant(name="g", provider="openai", model_id="gpt-x", steering=object())
    api = APIParticipant(name="g", provider="openai", model_id="gpt-x")
    conv = Conversation([api, ScriptedParticipant("s", ["ok"])], shared_context="hi")
    with conv.capture():
        with pytest.raises(InterpModeError, match="cannot do interp"):
            conv.step("g")
    with pytest.raises(InterpModeError, match="no local model"):
        conv.logprobs("g", "hello")
    with pytest.raises(InterpModeError, match="no model to steer"):
        conv.step("s", steering=SteeringSpec([1.0, 0.0], layers=0))


# ---------------------------------------------------------------------- inside rollouts
def probe_analyzer(probe: Probe) -> Any:
    def analyze(conv: Conversation) -> Any:
        cache = conv.turn_activations("b", layers=[probe.layer])
        with conv.capture(layers=[probe.layer]) as live:
            conv.sample("a", "One more point?")
        return {
            "probe": {str(k): v for k, v in probe.per_turn(cache).items()},
            "sample_rows": int(live.at(layer=probe.layer).shape[0]),
            "pid": os.getpid(),
        }

    return analyze


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["one-device", "two-workers"])
def test_probe_per_turn_from_a_deterministic_rollout_analyzer(qwen2_path: str, devices: list[str]) -> None:
    spec = SteeringSpec(direction(qwen2_path, seed=5), layers=[0], coef=3.0)
    probe = Probe(direction(qwen2_path, seed=6), layer=1)
    conv = Conversation(
        [model(qwen2_path, "a", steering=spec), model(qwen2_path, "b")], shared_context="Debate: tabs."
    ).turns(4)
    report = conv.analyzer(probe_analyzer(probe)).rollout(n=2, devices=devices, batched=False, progress=False)
    assert report.failed == []
    for result in report.results.values():
        scores = result.analysis["probe"]
        assert sorted(scores) == ["2", "4"]  # b spoke at message indices 2 and 4
        assert all(isinstance(v, float) for v in scores.values())
        assert result.analysis["sample_rows"] >= 1
        assert all("steering" in m.metadata for m in result.transcript if m.author == "a")
        # the same scalars, re-read here from the returned transcript and computed by hand
        cache = result.conversation.turn_activations("b", layers=[1])
        by_hand = {
            str(k): float(probe.direction @ cache.at(participant="b", message_idx=k, layer=1).float().mean(0))
            for k in (2, 4)
        }
        assert by_hand == pytest.approx(scores, abs=1e-4)
    if len(devices) == 2:
        assert {r.analysis["pid"] for r in report.results.values()} != {os.getpid()}


def test_steered_turns_in_worker_processes_equal_the_steered_turns_in_process(qwen2_path: str) -> None:
    """The spec crosses the worker pipe intact: a two-worker deterministic rollout gives the in-process
    rollout's steered transcripts (a direction changed on the way, negated say, would not), and every
    steered turn records the spec's own digest; the steering changes the text at all."""
    spec = SteeringSpec(direction(qwen2_path, seed=7) * 4, layers=[0, 1], coef=3.0)

    def texts(report: Any) -> dict[str, list[str]]:
        return {job: [m.content for m in r.transcript] for job, r in report.results.items()}

    steered = Conversation(
        [model(qwen2_path, "a", steering=spec, temperature=0.8), model(qwen2_path, "b", temperature=0.8)],
        shared_context="Debate: tabs vs spaces.",
    ).turns(3)
    here = steered.rollout(n=3, devices=["cpu"], batched=False, seed=11, progress=False)
    there = steered.rollout(n=3, devices=["cpu", "cpu"], batched=False, seed=11, progress=False)
    assert here.failed == [] and there.failed == []
    assert texts(there) == texts(here)
    digests = {
        m.metadata["steering"][0]["sha256"] for r in there.results.values() for m in r.transcript[1::2]
    }
    assert digests == {spec.sha256}
    plain = steered.set(
        participants=[model(qwen2_path, "a", temperature=0.8), model(qwen2_path, "b", temperature=0.8)]
    )
    assert texts(plain.rollout(n=3, devices=["cpu"], batched=False, seed=11, progress=False)) != texts(here)


def test_the_steering_debate_example_runs_and_resumes(tmp_path: Path) -> None:
    import subprocess
    import sys

    example = Path(__file__).parent.parent / "examples" / "steering_debate.py"
    args = [sys.executable, str(example), "--out", str(tmp_path / "runs"), "-n", "2"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = [line for line in first.stdout.splitlines() if "probe on b" in line]
    assert [line.split(":")[0].strip() for line in lines] == ["plain", "steered"]
    assert all("failed 0, resumed 0" in line for line in lines), first.stdout
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = [line for line in again.stdout.splitlines() if "probe on b" in line]
    assert all("resumed 2" in line for line in resumed), again.stdout
    # the same jobs read back from the ledger give the same numbers
    assert [line.split("(")[0] for line in resumed] == [line.split("(")[0] for line in lines]


def test_a_rerun_with_another_steering_direction_is_refused(qwen2_path: str, tmp_path: Path) -> None:
    def lineup(spec: SteeringSpec) -> Conversation:
        return Conversation([model(qwen2_path, "a", steering=spec)], shared_context="hi").turns(1)

    first = SteeringSpec(direction(qwen2_path, seed=1), layers=[0], coef=2.0)
    report = lineup(first).rollout(n=1, out_dir=tmp_path, batched=False, progress=False)
    assert report.failed == []
    again = lineup(first).rollout(n=1, out_dir=tmp_path, batched=False, progress=False)
    assert len(again.skipped) == 1  # the same steering: resumed, not rerun
    other = SteeringSpec(direction(qwen2_path, seed=2), layers=[0], coef=2.0)
    with pytest.raises(interlens.FingerprintMismatchError, match=r"steering.*sha256"):
        lineup(other).rollout(n=1, out_dir=tmp_path, batched=False, progress=False)
