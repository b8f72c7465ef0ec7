"""Long debates: cross-turn KV reuse in co-stepped batches vs re-prefilling every round (issue #14).

    python benchmarks/bench_long_debate.py [--rollouts 16] [--turns 8 12] [--new-tokens 32] [--repeats 3]
                                           [--threads N] [--dtype auto] [--mixed]

A two-speaker debate on the bench-size random-weight Qwen2 (the model of ``bench_deterministic.py``), 32
tokens a turn at T = 0.9, rolled out ``--rollouts`` times, three ways, interleaved with a rotating start after
one warm-up of each:

1. ``reuse``: ``conv.rollout`` with the default ``kv_reuse=True`` (each speaker's kept KV cache, longest
   common prefix reused, suffixes prefilled in the co-stepped batch);
2. ``no reuse``: the same rollout with ``kv_reuse=False`` (every round re-prefills every row's history);
3. ``generate``: raw HF ``model.generate`` on the same rounds (the prompts the rollout rendered, re-rendered
   and re-tokenized each round, one left-padded batch per round, every row re-prefilled): the re-prefilling
   limit a user would write by hand. Same sampling: T = 0.9, top_p = 1, ``top_k=0`` (HF's default top_k=50
   would sample from less), the same max new tokens, the same end-of-turn ids.

Prints generated tok/s per variant (median, min-max), the per-repeat ratios reuse / generate (goal >= 1.3x on
8 turns) and reuse / no reuse, the share of prompt tokens reused, and the command line. The original threaded
runner of issue 14's 12-turn goal is not on this machine; the 12-turn run is reported against the same two
re-prefilling references. ``--mixed`` also times one engine turn whose rows half lost their kept caches, the
rows without one prefilled apart vs joining the layout vs no reuse.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

from _common import (
    add_model_option,
    bare_step_ms,
    cpu_summary,
    debate,
    fast_dtype,
    in_thread,
    model_path,
    spread,
    stock_attention,
)

from interlens import Conversation

R = TypeVar("R")


def decode_limit(conv: Conversation, transcripts: list[Any], rollouts: int) -> float:
    """Generated tok/s if every round's prefill cost nothing and each decode step cost the bare model's step
    at that step's live row count (``bare_step_ms`` at the round's mean context; row counts between the
    measured 1, 2, 4, 8, 16, ... interpolated): the decode limit of these rounds on this machine."""
    import numpy as np

    model = conv.participants[0].live_engine().engine.model
    rounds = len(transcripts[0]) - 1
    sizes = sorted({1, rollouts} | {2**k for k in range(1, rollouts.bit_length()) if 2**k < rollouts})
    context = int(np.mean([m.metadata["prompt_tokens"] for t in transcripts for m in t[1:]]))
    measured = [in_thread(lambda b=b: bare_step_ms(model, b, context)) for b in sizes]
    total_ms, tokens = 0.0, 0
    for turn in range(1, rounds + 1):
        lengths = [t[turn].metadata["n_tokens"] for t in transcripts]
        tokens += sum(lengths)
        for step in range(max(lengths)):
            live = sum(n > step for n in lengths)
            total_ms += float(np.interp(live, sizes, measured))
    print(
        f"  bare decode step at ~{context} cached tokens: "
        + ", ".join(f"B={b} {ms:.1f} ms" for b, ms in zip(sizes, measured, strict=True))
    )
    return tokens * 1000 / total_ms


def rollout(conv: Conversation, n: int) -> tuple[float, int, list[Any], float]:
    """Seconds, generated tokens, transcripts, and the share of prompt tokens that came from kept caches."""
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.perf_counter()
        report = conv.rollout(n=n, devices=["cpu"], out_dir=out_dir, progress=False, seed=1)
        seconds = time.perf_counter() - start
        assert not report.failed, report.failed
        results = list(report.results.values())
        metas = [m.metadata for r in results for m in r.transcript[1:]]
        reused = sum(m["kv_reused_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)
        return seconds, sum(r.tokens_generated for r in results), [r.transcript for r in results], reused


def raw_generate(conv: Conversation, transcripts: list[Any], new_tokens: int) -> tuple[float, int]:
    """HF ``generate`` round by round on the prompts of a finished rollout (rendered and tokenized in the
    timed region, as a hand-written loop would each round), on transformers' own attention."""
    import torch

    from interlens.engine._chat_template import render_view

    engine = conv.participants[0].live_engine().engine
    model, tok = engine.model, engine.tokenizer
    tok.padding_side = "left"
    eos = sorted(engine._runner.eos_ids)
    total = 0
    start = time.perf_counter()
    for turn in range(len(transcripts[0]) - 1):
        speaker = conv.participants[turn % 2]
        prompts = []
        for transcript in transcripts:
            state = conv._copy()
            state.transcript = transcript[: 1 + turn]
            prompts.append(render_view(tok, state.view(speaker)))
        batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode(), stock_attention(model):
            out = model.generate(
                **batch,
                do_sample=True,
                temperature=0.9,
                top_p=1.0,
                top_k=0,
                max_new_tokens=new_tokens,
                eos_token_id=eos,
                pad_token_id=engine._runner.pad_id,
            )
        for row in out[:, batch["input_ids"].shape[1] :].tolist():
            ends = [i for i, token in enumerate(row) if token in eos]
            total += ends[0] + 1 if ends else len(row)
    return time.perf_counter() - start, total


def measure(path: str, args: argparse.Namespace, turns: int) -> None:
    shape = {
        "turns": turns,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "system_tokens": args.system_tokens,
    }
    reuse = debate(path, kv_reuse=True, **shape)
    plain = debate(path, kv_reuse=False, **shape)
    _, _, transcripts, _ = rollout(plain, args.rollouts)  # warm-up, and the rounds generate replays
    rollout(reuse, args.rollouts)
    in_thread(lambda: raw_generate(plain, transcripts, args.new_tokens))

    def run(name: str) -> tuple[float, int]:
        if name == "generate":  # not on the main thread: that would slow every later rollout (in_thread)
            return in_thread(lambda: raw_generate(plain, transcripts, args.new_tokens))
        seconds, tokens, done, share = rollout(reuse if name == "reuse" else plain, args.rollouts)
        if name == "reuse":
            shares.append(share)
            kept_transcripts[:] = done
        return seconds, tokens

    names = ["reuse", "no reuse", "generate"]
    rates: dict[str, list[float]] = {name: [] for name in names}
    shares: list[float] = []
    kept_transcripts: list[Any] = []
    for repeat in range(args.repeats):
        order = names[repeat % 3 :] + names[: repeat % 3]
        for name in order:
            seconds, tokens = run(name)
            rates[name].append(tokens / seconds)
    print(f"{turns}-turn debate, {args.rollouts} rollouts x <= {args.new_tokens} new tokens, {args.dtype}:")
    for name in names:
        print(f"  {name:>9}: {spread(rates[name], '.0f')} tok/s")
    vs_generate = [r / g for r, g in zip(rates["reuse"], rates["generate"], strict=True)]
    vs_plain = [r / p for r, p in zip(rates["reuse"], rates["no reuse"], strict=True)]
    plain_vs_generate = [p / g for p, g in zip(rates["no reuse"], rates["generate"], strict=True)]
    print(f"  reuse / generate  = {spread(vs_generate, '.2f')}x")
    print(f"  reuse / no reuse  = {spread(vs_plain, '.2f')}x")
    print(f"  no reuse / generate = {spread(plain_vs_generate, '.2f')}x")
    print(f"  prompt tokens reused (reuse runs): {spread([100 * s for s in shares], '.1f')} %")
    if args.limit:
        limit = decode_limit(reuse, kept_transcripts, args.rollouts)
        print(
            f"  decode limit of the reuse runs' rounds: {limit:.0f} tok/s; reuse / limit = "
            f"{spread([r / limit for r in rates['reuse']], '.2f')}"
        )


def interleaved(modes: list[str], repeats: int, once: Callable[[str], R]) -> dict[str, list[R]]:
    """``once(mode)`` for each mode ``repeats`` times, the order rotating each repeat, after one warm-up of
    each (not kept): a drift of the machine's speed then lands on every mode alike."""
    for mode in modes:
        once(mode)
    runs: dict[str, list[R]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
            runs[mode].append(once(mode))
    return runs


def keyed_turn(engine: Any, keys: list[str], new_tokens: int) -> Callable[[list[tuple[int, ...]]], list[Any]]:
    """One engine turn of these prompts, row i on the reuse stream ``keys[i]`` with seed i, T = 0.9."""
    from interlens.engine._generation import GenerationRequest, SamplingSettings

    def turn(prompts: list[tuple[int, ...]]) -> list[Any]:
        requests = [
            GenerationRequest(
                prompt_ids=p,
                sampling=SamplingSettings(max_new_tokens=new_tokens, temperature=0.9, seed=i),
                reuse_key=k,
            )
            for i, (p, k) in enumerate(zip(prompts, keys, strict=True))
        ]
        return engine.generate_batch(requests)

    return turn


def mixed_batch(path: str, args: argparse.Namespace) -> None:
    """One turn of 16 rows where half the streams lost their kept caches (evicted, or new jobs that start
    with a long prompt): those rows prefilled apart and laid in next to the reusing rows ("split", the
    default), joining the reusing rows' layout with a hole ("join"), or no reuse at all ("full")."""
    from interlens.engine._model_cache import load_engine

    engine = load_engine(path, dtype=args.dtype)
    words = engine.tokenizer(
        " ".join(f"point{i % 50}" for i in range(600)), add_special_tokens=False
    ).input_ids
    prompts = [tuple(words[i : i + 300 + 8 * i]) for i in range(16)]
    keys = [f"mixed{i}" for i in range(16)]

    turn = keyed_turn(engine, keys, args.new_tokens)

    def once(mode: str) -> float:
        engine.clear_reuse()
        first = turn(prompts)
        later = [(*p, *r.token_ids, *words[:40]) for p, r in zip(prompts, first, strict=True)]
        for key in keys[8:] if mode != "full" else keys:
            engine.release(key)
        engine._reused.split_fresh_rows = mode != "join"
        engine._reused.always_reuse = mode != "full"  # the layouts compared, whatever the decision says
        start = time.perf_counter()
        results = turn(later)
        seconds = time.perf_counter() - start
        engine._reused.split_fresh_rows, engine._reused.always_reuse = True, False
        assert sum(r.kv_reused_tokens > 0 for r in results) == (8 if mode != "full" else 0)
        return seconds

    modes = ["split", "join", "full"]
    times = interleaved(modes, args.repeats, once)
    engine.clear_reuse()
    print(f"mixed batch: 16 rows (prompts 300-420 + {args.new_tokens} + 40 tokens), 8 with kept caches:")
    for mode in modes:
        print(f"  {mode:>5}: {spread(times[mode], '.3f')} s for the turn")


def decision(path: str, args: argparse.Namespace) -> None:
    """The per-batch reuse decision (``ReusedPrefixBatch.reuse_pays``): one engine turn of 16 rows whose
    streams kept a prefix of n tokens of a 300-token prompt, timed with the kept prefixes laid out
    ("reuse", forced), prefilled in full ("full": the plain path, a shared prefix once) and as the engine
    decides ("auto"); rows distinct, or sharing a 200-token system block (which the plain path prefills
    once, so laying out kept prefixes saves less there)."""
    from interlens.engine._model_cache import load_engine

    engine = load_engine(path, dtype=args.dtype)
    words = engine.tokenizer(
        " ".join(f"point{i % 50} about item{i % 37}" for i in range(700)), add_special_tokens=False
    ).input_ids
    system = engine.tokenizer(" ".join(f"rule{i}" for i in range(200)), add_special_tokens=False).input_ids
    keys = [f"decide{i}" for i in range(16)]

    turn = keyed_turn(engine, keys, args.new_tokens)

    def once(mode: str, head: list[list[int]], kept: int) -> tuple[float, int]:
        engine.clear_reuse()
        turn([tuple(h[:kept]) for h in head])
        if mode == "full":
            for key in keys:
                engine.release(key)
        engine._reused.always_reuse = mode == "reuse"
        start = time.perf_counter()
        results = turn([tuple(h[:300]) for h in head])
        seconds = time.perf_counter() - start
        engine._reused.always_reuse = False
        return seconds, sum(r.kv_reused_tokens for r in results) // len(results)

    shapes = [("distinct", 0, n) for n in (40, 100, 200, 280)] + [
        ("shared 200", 200, n) for n in (220, 250, 280)
    ]
    modes = ["reuse", "full", "auto"]
    print(f"reuse decision: 16 rows, 300-token prompts, {args.new_tokens} new tokens; seconds for the turn")
    for family, shared, kept in shapes:
        head = [(system[:shared] if shared else []) + words[7 * i : 7 * i + 300] for i in range(16)]
        runs = interleaved(modes, args.repeats, lambda mode, head=head, kept=kept: once(mode, head, kept))
        times = {mode: [seconds for seconds, _ in runs[mode]] for mode in modes}
        reused = {mode: runs[mode][-1][1] for mode in modes}
        auto = "laid out" if reused["auto"] else "full"
        cells = "  ".join(f"{mode} {spread(times[mode], '.2f')}" for mode in modes)
        print(f"  {family:>10}, kept {kept:3d} (reused {reused['reuse']:3d}): {cells}  -> auto chose {auto}")
    engine.clear_reuse()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 12])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=0, help="grow each system prompt to ~N tokens")
    add_model_option(parser)
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the hardware has it, else fp32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--mixed", action="store_true", help="also time a turn whose rows half lost their caches"
    )
    parser.add_argument(
        "--limit", action="store_true", help="also the rounds' decode limit (bare model steps, no prefill)"
    )
    parser.add_argument(
        "--decision", action="store_true", help="only time the per-batch reuse decision on single turns"
    )
    args = parser.parse_args()
    args.dtype = fast_dtype(args.dtype)
    print("command:", shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    path, label = model_path(parser, args.model)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, {args.dtype}; medians of {args.repeats} (min-max)")
    print(f"CPU: {cpu_summary()}; model: {label}; system prompts ~{args.system_tokens} tokens")
    if args.decision:
        decision(path, args)
        return
    for turns in args.turns:
        measure(path, args, turns)
    if args.mixed:
        mixed_batch(path, args)


if __name__ == "__main__":
    main()
