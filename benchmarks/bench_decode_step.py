"""Benchmark: the decode loop's own cost per step (everything but the model's forward passes).

Run:  python benchmarks/bench_decode_step.py [--device cpu] [--rows 64] [--new 64] [--repeats 5] [--threads N]

``LocalEngine.generate_batch`` on the "bench" qwen2 tiny model (~27 M parameters, random weights), seeded
sampling at T=0.9, end-of-turn ids disabled so every row runs to its own ``max_new_tokens``:

* uniform: every row stops at ``--new`` tokens (no row leaves early: no cache compaction);
* staggered: row i stops at ``1 + i * new // rows`` tokens, so a row leaves the batch at almost every step
  (the cache is compacted, the sampler rebuilt, the mask re-checked each time).

The model's calls (prefill and each one-token step) are timed apart; what remains of the generate call,
divided by the number of decode steps, is the loop's per-step overhead: sampling, the host sync of the
chosen tokens, the non-finite check, stop checks, and dropping finished rows. Medians of ``--repeats`` runs
after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default="bench", help="tiny model size: bench (~27 M) or tiny")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import GenerationRequest
    from interlens.testing import tiny_model

    path = tiny_model("qwen2", size=args.size)
    model = AutoModelForCausalLM.from_pretrained(path).to(args.device).eval()
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    engine, timer = timed_engine(model, tokenizer, device=args.device)
    timer.eos_ids = frozenset()  # every row runs to its own max_new_tokens
    vocab = model.config.vocab_size
    print(
        f"model: qwen2 {args.size}, vocab {vocab}, device={args.device}, threads={torch.get_num_threads()}, "
        f"{args.rows} rows, up to {args.new} new tokens, seeded T=0.9"
    )
    prompt = tuple(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Debate: tabs versus spaces, in one paragraph."}],
            add_generation_prompt=True,
            return_dict=False,
        )
    )
    cases = {
        "uniform": [args.new] * args.rows,
        "staggered": [1 + i * args.new // args.rows for i in range(args.rows)],
    }
    for name, caps in cases.items():
        requests = [
            # distinct prompts (a row index in front) so the batch is not one shared prefill
            GenerationRequest(
                prompt_ids=(prompt[0], 100 + i, *prompt[1:]), max_new_tokens=cap, temperature=0.9, seed=i
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
            loop = total - timer.model_seconds
            figures.append((total, timer.model_seconds / timer.steps, loop / timer.steps, timer.steps))
        total, model_step, overhead, steps = (statistics.median(f[i] for f in figures) for i in range(4))
        print(
            f"  {name:9s}: {total * 1e3:8.1f} ms per batch, {int(steps)} steps, "
            f"model {model_step * 1e3:6.2f} ms/step, loop overhead {overhead * 1e3:6.3f} ms/step"
        )


def timed_engine(model: Any, tokenizer: Any, *, device: str) -> tuple[Any, Any]:
    """A LocalEngine, and its model runner, which accumulates the seconds spent in the model's calls
    (prefill and steps)."""
    from interlens.engine._decode import ModelRunner
    from interlens.engine._generation import LocalEngine

    class Timed(ModelRunner):
        model_seconds = 0.0
        steps = 0

        def reset(self) -> None:
            self.model_seconds, self.steps = 0.0, 0

        def forward(self, *a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            out = super().forward(*a, **k)
            _sync(self.device)
            self.model_seconds += time.perf_counter() - start
            return out

        def step(self, *a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            out = super().step(*a, **k)
            _sync(self.device)
            self.model_seconds += time.perf_counter() - start
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
