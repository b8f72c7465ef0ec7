"""Benchmark: the engine's decode step against the bare model's, and the loop's own cost per step.

Run:  python benchmarks/bench_decode_step.py [--model real] [--rows 1 16 64] [--new 32] [--repeats 3]
                                             [--dtype auto] [--device cpu] [--threads N] [--attention]
                                             [--context N] [--static]

``LocalEngine.generate_batch`` on the real model (``--model bench``: the toy random-weight Qwen2), seeded
sampling at T=0.9, end-of-turn ids disabled so every row runs to its own ``max_new_tokens``, at each
``--rows`` batch size:

* uniform: every row stops at ``--new`` tokens (no row leaves early: no cache compaction);
* staggered: row i stops at ``1 + i * new // rows`` tokens, so a row leaves the batch at almost every step
  (the cache is compacted, the sampler rebuilt, the mask re-checked each time).

The model's calls (prefill and each one-token step) are timed apart: the engine's step is the generate
call less its prefill, divided by the decode steps; what the one-token calls leave of it is the loop's own
cost: sampling, the host sync of the chosen tokens, the non-finite check, stop checks, and dropping finished
rows. The bare model's step (``_common.bare_step_ms``: one token per row into a static cache, the same kind
the engine uses, at the uniform case's mean context, logits included) is the limit: engine / bare, goal
<= 1.05. Medians of ``--repeats`` runs after a warm-up.

``--context N`` repeats the chat question until the prompt holds at least N tokens (default: the one
question, ~30 tokens). ``--attention`` instead times the engine's model step (rows' prompts cut by 0-6
tokens: padded rows, a mask) on transformers' own SDPA attention and on the decode-step attention a CPU
engine installs (``interlens/engine/_cpu_attention.py``), interleaved, and prints SDPA / interlens per
batch size. ``--static`` instead times whole ``generate_batch`` calls through the eager decode loop and
through the static-step decoder (``interlens/engine/_static_decode.py``; graphs on CUDA, eager steps over
whole length buckets on the CPU), interleaved, and prints eager / static.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from typing import Any

from _common import add_model_option, bare_step_ms, cpu_summary, fast_dtype, model_path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    add_model_option(parser)
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the hardware has it, else fp32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--attention", action="store_true", help="SDPA vs interlens' CPU decode attention")
    parser.add_argument("--context", type=int, default=0, help="prompt tokens, at least")
    parser.add_argument("--static", action="store_true", help="the eager loop vs the static-step decoder")
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import GenerationRequest, SamplingSettings

    path, label = model_path(parser, args.model)
    dtype = fast_dtype(args.dtype) if args.device == "cpu" else "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(args.device).eval()
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    engine, timer = timed_engine(model, tokenizer, device=args.device)
    timer.eos_ids = frozenset()  # every row runs to its own max_new_tokens
    print(
        f"model: {label}, vocab {model.config.vocab_size}, {dtype}, device={args.device}, "
        f"threads={torch.get_num_threads()}, up to {args.new} new tokens, seeded T=0.9; CPU: {cpu_summary()}"
    )
    question, prompt = "Debate: tabs versus spaces, in one paragraph.", ()
    for copies in range(1, 10_000):
        prompt = tuple(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": " ".join([question] * copies)}],
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        if len(prompt) >= args.context:
            break
    print(f"prompt: {len(prompt)} tokens")
    if args.attention:
        compare_attention(engine, timer, prompt, args)
        return
    if args.static:
        compare_static(engine, timer, prompt, args)
        return
    for rows in args.rows:
        cases = {"uniform": [args.new] * rows}
        if rows > 1:
            cases["staggered"] = [1 + i * args.new // rows for i in range(rows)]
        # the bare model's step at the uniform case's mean context, in the same (static) cache kind
        bare = bare_step_ms(model, rows, len(prompt) + 1 + args.new // 2, repeats=args.repeats)
        for name, caps in cases.items():
            requests = [
                # distinct prompts (a row index in front) so the batch is not one shared prefill
                GenerationRequest(
                    prompt_ids=(prompt[0], 100 + i, *prompt[1:]),
                    sampling=SamplingSettings(max_new_tokens=cap, temperature=0.9, seed=i),
                )
                for i, cap in enumerate(caps)
            ]
            engine.generate_batch(requests)  # warm-up
            figures = []
            for _ in range(args.repeats):
                timer.reset()
                start = time.perf_counter()
                engine.generate_batch(requests)
                total = time.perf_counter() - start
                decoding = total - timer.prefill_seconds  # the decode loop: steps, sampling, bookkeeping
                figures.append(
                    (
                        decoding / timer.steps,
                        timer.step_seconds / timer.steps,
                        (decoding - timer.step_seconds) / timer.steps,
                    )
                )
            step, model_step, overhead = (statistics.median(f[i] for f in figures) for i in range(3))
            line = (
                f"  B={rows:3d} {name:9s}: engine {step * 1e3:7.2f} ms/step (model {model_step * 1e3:7.2f}, "
                f"loop {overhead * 1e3:6.3f})"
            )
            if name == "uniform":
                line += f"; bare model step {bare:7.2f} ms: engine / bare = {step * 1e3 / bare:.3f}"
            print(line)


def compare_attention(engine: Any, timer: Any, prompt: tuple[int, ...], args: argparse.Namespace) -> None:
    """The engine's model step on transformers' SDPA and on interlens' CPU decode attention, interleaved."""
    from _common import stock_attention

    from interlens.engine._cpu_attention import CPU_DECODE_ATTENTION
    from interlens.engine._generation import GenerationRequest, SamplingSettings

    model = engine.model
    if model.config._attn_implementation != CPU_DECODE_ATTENTION:
        raise SystemExit(f"the engine's model runs {model.config._attn_implementation!r}: nothing to compare")
    for rows in args.rows:
        requests = [
            GenerationRequest(
                prompt_ids=prompt[: len(prompt) - i % 7],
                sampling=SamplingSettings(max_new_tokens=args.new, temperature=0.9, seed=i),
            )
            for i in range(rows)
        ]
        ms: dict[str, list[float]] = {"sdpa": [], CPU_DECODE_ATTENTION: []}
        for repeat in range(args.repeats + 1):  # the first round is the warm-up
            order = list(ms) if repeat % 2 else list(ms)[::-1]
            for name in order:
                with stock_attention(model, name):
                    timer.reset()
                    engine.generate_batch(requests)
                if repeat:
                    ms[name].append(timer.step_seconds * 1e3 / timer.steps)
        stock, ours = (statistics.median(ms[n]) for n in ms)
        ratios = [a / b for a, b in zip(*ms.values(), strict=True)]
        print(
            f"  B={rows:3d}: model step on sdpa {stock:6.2f} ms, on {CPU_DECODE_ATTENTION} {ours:6.2f} ms: "
            f"sdpa / interlens = {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        )


def compare_static(engine: Any, timer: Any, prompt: tuple[int, ...], args: argparse.Namespace) -> None:
    """Whole ``generate_batch`` calls through the eager decode loop and through the static-step decoder
    (``engine/_static_decode.py``: graphs on CUDA, its steps eager on the CPU), interleaved, uniform and
    staggered token caps; per batch size the median seconds of each and eager / static with its spread."""
    from interlens.engine._generation import GenerationRequest, SamplingSettings
    from interlens.engine._static_decode import StaticDecoder

    decoder = StaticDecoder(timer)
    for rows in args.rows:
        cases = {"uniform": [args.new] * rows}
        if rows > 1:
            cases["staggered"] = [1 + i * args.new // rows for i in range(rows)]
        for case, caps in cases.items():
            requests = [
                GenerationRequest(
                    prompt_ids=(prompt[0], 100 + i, *prompt[1:]),
                    sampling=SamplingSettings(max_new_tokens=cap, temperature=0.9, seed=i),
                )
                for i, cap in enumerate(caps)
            ]
            seconds: dict[str, list[float]] = {"eager": [], "static": []}
            tokens: dict[str, list[Any]] = {}
            for repeat in range(args.repeats + 1):  # the first round is the warm-up
                order = list(seconds) if repeat % 2 else list(seconds)[::-1]
                for name in order:
                    timer.static_decode = decoder if name == "static" else None
                    start = time.perf_counter()
                    results = engine.generate_batch(requests)
                    _sync(args.device)
                    if repeat:
                        seconds[name].append(time.perf_counter() - start)
                    tokens[name] = [r.token_ids for r in results]
            ratios = [a / b for a, b in zip(seconds["eager"], seconds["static"], strict=True)]
            eager, static = (statistics.median(seconds[n]) for n in seconds)
            print(
                f"  B={rows:3d} {case:9s}: eager loop {eager:6.3f} s, static steps {static:6.3f} s: "
                f"eager / static = {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); "
                f"tokens equal: {tokens['eager'] == tokens['static']}"
            )
    timer.static_decode = None


def timed_engine(model: Any, tokenizer: Any, *, device: str) -> tuple[Any, Any]:
    """A LocalEngine, and its model runner, which accumulates the seconds spent in the model's calls
    (prefill and steps)."""
    from interlens.engine._decode import ModelRunner
    from interlens.engine._generation import LocalEngine

    class Timed(ModelRunner):
        prefill_seconds = 0.0  # the prefill's model calls
        step_seconds = 0.0  # the one-token model calls of the decode loop
        steps = 0

        def reset(self) -> None:
            self.prefill_seconds, self.step_seconds, self.steps = 0.0, 0.0, 0

        def forward(self, *a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            out = super().forward(*a, **k)
            _sync(self.device)
            self.prefill_seconds += time.perf_counter() - start
            return out

        def step(self, *a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            out = super().step(*a, **k)
            _sync(self.device)
            self.step_seconds += time.perf_counter() - start
            self.steps += 1
            return out

    class TimedEngine(LocalEngine):
        _runner_type = Timed

    engine = TimedEngine(model, tokenizer, device=device)
    return engine, engine._runner


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
