"""Rollout throughput, measured side by side in one run (issue #4's benchmark).

    python benchmarks/bench_rollout.py [--rollouts 64] [--turns 4] [--new-tokens 32] [--repeats 3]

A two-model debate (two participants on one ~27M-parameter local Qwen2 model, random weights) rolled out
64 times, three ways, on the same machine in the same process:

1. ``conv.rollout(n=64)`` — the default batched co-stepping path, ledger included (a temp out_dir);
2. ``conv.rollout(n=8, batched=False)`` — every turn generated alone (throughput compared per token);
3. raw ``model.generate`` on the SAME prompts the batched rollout generated from, one 64-row left-padded
   batch per round — the limit on this stack.

And shared prefill: n=32 samples of one ~1,000-token prompt, turn 1 of a rollout, with the engine's shared
prefill on vs off (plain batched prefill).

Prints tok/s (generated tokens only) and the ratios. Targets: batched ≥ 0.85× raw generate and ≥ 4×
batched=False; shared prefill ≥ 2× plain. Medians of ``--repeats`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from interlens import AutoModelParticipant, Conversation
from interlens.testing import tiny_model


def median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    fn()  # warm-up
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def debate(path: str, new_tokens: int, turns: int) -> Conversation:
    def speaker(name: str, side: str) -> Any:
        return AutoModelParticipant.from_pretrained(
            path, name=name, temperature=0.9, max_new_tokens=new_tokens, system_prompt=f"Argue for {side}."
        )

    return Conversation(
        participants=[speaker("a", "tabs"), speaker("b", "spaces")], shared_context="Debate: tabs vs spaces."
    ).turns(turns)


def rollout_tokens(conv: Conversation, n: int, **options: Any) -> tuple[int, Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        report = conv.rollout(n=n, devices=["cpu"], out_dir=out_dir, progress=False, **options)
        assert not report.failed, report.failed
        results = list(report.results.values())
        return sum(r.tokens_generated for r in results), [r.transcript for r in results]


def raw_generate(conv: Conversation, transcripts: list[Any], new_tokens: int) -> int:
    """model.generate on the prompts each round of the batched rollout generated from."""
    import torch

    from interlens._chat_template import render_view

    engine = conv.participants[0].live_engine().engine
    model, tok = engine.model, engine.tokenizer
    tok.padding_side = "left"
    eos = sorted(engine._eos_ids)
    total = 0
    n_turns = len(transcripts[0]) - 1
    for turn in range(n_turns):
        speaker = conv.participants[turn % 2]
        prompts = []
        for transcript in transcripts:
            state = conv._copy()
            state.transcript = transcript[: 1 + turn]
            prompts.append(render_view(tok, state.view(speaker)))
        batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                **batch,
                do_sample=True,
                temperature=0.9,
                max_new_tokens=new_tokens,
                eos_token_id=eos,
                pad_token_id=engine._pad_id,
            )
        generated = out[:, batch["input_ids"].shape[1] :]
        for row in generated.tolist():
            n = len(row)
            for i, token in enumerate(row):
                if token in eos:
                    n = i + 1
                    break
            total += n
    return total


def shared_prefill(path: str, repeats: int) -> tuple[float, float]:
    solver = AutoModelParticipant.from_pretrained(path, name="s", temperature=0.9, max_new_tokens=64)
    engine = solver.live_engine().engine
    words = " ".join(f"word{i % 97}" for i in range(800))  # comfortably past 1,000 tokens, under the max
    ids = engine.tokenizer(words, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 1000, len(ids)
    context = engine.tokenizer.decode(ids[:1000])
    conv = Conversation(participants=[solver], shared_context=context).turns(1)
    times = {}
    for flag in (True, False):
        engine.shared_prefill = flag
        times[flag], _ = median_time(lambda: rollout_tokens(conv, 32), repeats)
    engine.shared_prefill = True
    return times[True], times[False]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--unbatched-rollouts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    path = tiny_model("qwen2", size="bench")
    conv = debate(path, args.new_tokens, args.turns)
    model = conv.participants[0].live_engine().engine.model
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: qwen2 'bench', {params / 1e6:.1f}M parameters, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )

    t_batched, (tok_batched, transcripts) = median_time(
        lambda: rollout_tokens(conv, args.rollouts), args.repeats
    )
    t_raw, tok_raw = median_time(lambda: raw_generate(conv, transcripts, args.new_tokens), args.repeats)
    t_single, (tok_single, _) = median_time(
        lambda: rollout_tokens(conv, args.unbatched_rollouts, batched=False), max(1, args.repeats // 2)
    )
    rate_batched, rate_raw, rate_single = tok_batched / t_batched, tok_raw / t_raw, tok_single / t_single
    print(f"debate, {args.rollouts} rollouts x {args.turns} turns x <= {args.new_tokens} new tokens")
    print(f"  batched rollout: {tok_batched:6d} tok in {t_batched:6.2f} s = {rate_batched:7.1f} tok/s")
    print(f"  raw model.generate, same prompts: {tok_raw:6d} tok in {t_raw:6.2f} s = {rate_raw:7.1f} tok/s")
    print(
        f"  batched=False ({args.unbatched_rollouts} rollouts): {tok_single:6d} tok in {t_single:6.2f} s"
        f" = {rate_single:7.1f} tok/s"
    )
    print(f"  ratio batched / raw generate = {rate_batched / rate_raw:.2f}x   (target >= 0.85x)")
    print(f"  ratio batched / batched=False = {rate_batched / rate_single:.2f}x   (target >= 4x)")

    t_shared, t_plain = shared_prefill(path, args.repeats)
    print("shared prefill: 32 samples of one 1,000-token prompt, 64 new tokens, rollout turn 1")
    print(
        f"  shared prefill {t_shared:.2f} s, plain batched prefill {t_plain:.2f} s -> "
        f"{t_plain / t_shared:.2f}x   (target >= 2x)"
    )


if __name__ == "__main__":
    main()
