"""Rollout throughput against fair baselines, side by side in one run (issues #4 and #14).

    python benchmarks/bench_rollout.py [--rollouts 64] [--turns 4] [--new-tokens 32] [--repeats 3]
                                       [--dtype auto] [--shared-rows 32] [--system-tokens 1000]
                                       [--threads N] [--skip debate shared data samples] [--model real]

Part 1, the 4-turn debate (two speakers on one model: ``--model real``, SmolLM2-135M-Instruct, the default;
``bench``, the toy random-weight Qwen2; or a directory; T = 0.9, top_p = 1), rolled
out ``--rollouts`` times, and two baselines doing the SAME work:

* ``rollout``: ``conv.rollout(n, out_dir=tmp)``, the default batched path, ledger included. Every batch the
  rollout hands the engine (``LocalEngine.generate_batch``) is recorded: its requests (prompt ids, sampling
  settings, seeds, reuse keys) and its mode.
* ``engine``: those recorded batches replayed, in order, straight into ``LocalEngine.generate_batch``
  (kept KV caches cleared first, as at the start of a rollout). rollout ÷ engine is the framework's
  overhead: scheduler, batcher, templating, ledger (goal ≥ 0.95). Whatever the engine does by default
  (shared prefill, KV reuse) it does in both.
* ``hf dynamic`` / ``hf static``: the same batches' prompts as one left-padded ``model.generate`` call per
  batch, what a user would write by hand: ``do_sample=True``, the same temperature and top_p,
  ``top_k=0`` (HF's default top_k=50 off), the batch's max_new_tokens, the model's end-of-turn ids; with
  the default dynamic cache and with ``cache_implementation="static"``.

Rates are generated tokens per second (the random-weight model rarely samples its end-of-turn token; the
real one ends its turns, so the paths' token counts differ with their sampling: rates, not times, compare).
Every measured call runs in a fresh thread, as a rollout's generation does (its in-process worker's thread):
on this shared 2-core VM under load, torch ops called from the MAIN thread ran 2-4x slower than the same ops
in another thread (a 512x512 matmul loop: 1.6-3.4 s vs 0.8 s), which would slow the baselines and flatter
the rollout.
Runs are interleaved (rollout, engine, hf dynamic, hf static, rollout, ...) after one warm-up of each;
medians of ``--repeats`` with (min–max), and the per-repeat ratios' medians.

Part 2, shared-prefix prefill (``interlens.engine._prefill``): a data rollout of ``--shared-rows`` rows whose
speaker has a ``--system-tokens``-token system prompt and a short per-row question, 1 turn, with the
engine's shared prefill on vs off (off: one plain left-padded prefill of every row), interleaved; and n
samples of one ``--system-tokens``-token prompt (identical prompts), on vs off (``--skip data`` / ``samples``
leaves one out).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _common import (
    add_model_option,
    cpu_summary,
    debate,
    fast_dtype,
    in_thread,
    model_path,
    spread,
    stock_attention,
)

from interlens import AutoModelParticipant, Conversation, dataset_field


class Recorder:
    """Wraps one LocalEngine's ``generate_batch`` on the instance and keeps every batch it was handed."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.batches: list[tuple[list[Any], Any]] = []
        self._inner = engine.generate_batch

    def __enter__(self) -> Recorder:
        def recording(requests: Any, **kwargs: Any) -> Any:
            self.batches.append((list(requests), kwargs.get("mode")))
            return self._inner(requests, **kwargs)

        self.engine.generate_batch = recording
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.generate_batch  # the class's method again


SHARED: set[int] = set()  # the debate turns' metadata["shared_prefix_tokens"], for the printout


def rollout(conv: Conversation, n: int, engine: Any) -> tuple[float, int, list[tuple[list[Any], Any]]]:
    engine.clear_reuse()
    with tempfile.TemporaryDirectory() as out_dir, Recorder(engine) as recorder:
        start = time.perf_counter()
        report = conv.rollout(n=n, devices=["cpu"], out_dir=out_dir, progress=False, seed=1)
        seconds = time.perf_counter() - start
        assert not report.failed, report.failed  # (the report reads the ledger: inside the with)
        tokens = sum(r.tokens_generated for r in report.results.values())
        SHARED.update(
            m.metadata["shared_prefix_tokens"] for r in report.results.values() for m in r.transcript[1:]
        )
    assert recorder.batches, "the rollout did not use the recorded engine"
    return seconds, tokens, recorder.batches


def engine_replay(engine: Any, batches: list[tuple[list[Any], Any]]) -> tuple[float, int]:
    from interlens.scheduler import ExecutionMode

    engine.clear_reuse()
    start = time.perf_counter()
    tokens = 0
    for requests, mode in batches:
        results = engine.generate_batch(requests, mode=mode or ExecutionMode.BATCHED)
        tokens += sum(r.n_tokens for r in results)
    return time.perf_counter() - start, tokens


def hf_generate(engine: Any, batches: list[tuple[list[Any], Any]], *, static: bool) -> tuple[float, int]:
    import torch

    model, eos, pad = engine.model, sorted(engine._runner.eos_ids), engine._runner.pad_id
    start = time.perf_counter()
    tokens = 0
    for requests, _ in batches:
        width = max(len(r.prompt_ids) for r in requests)
        ids = [[pad] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in requests]
        mask = [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in requests]
        settings: dict[str, Any] = {"cache_implementation": "static"} if static else {}
        with torch.inference_mode(), stock_attention(model):
            out = model.generate(
                input_ids=torch.tensor(ids),
                attention_mask=torch.tensor(mask),
                do_sample=True,
                temperature=requests[0].sampling.temperature,
                top_p=requests[0].sampling.top_p,
                top_k=0,
                max_new_tokens=max(r.sampling.max_new_tokens for r in requests),
                eos_token_id=eos,
                pad_token_id=pad,
                **settings,
            )
        for row in out[:, width:].tolist():
            ends = [i for i, t in enumerate(row) if t in eos]
            tokens += ends[0] + 1 if ends else len(row)
    return time.perf_counter() - start, tokens


def part_debate(args: argparse.Namespace, path: str, engine: Any) -> None:
    conv = debate(path, new_tokens=args.new_tokens, turns=args.turns, dtype=args.dtype)
    _, _, batches = in_thread(
        lambda: rollout(conv, args.rollouts, engine)
    )  # warm-up, and the batches the others replay
    for request in batches[0][0][:1]:
        print(f"  sampling: {request.sampling}, reuse_key set: {request.reuse_key is not None}")
    paths: dict[str, Callable[[], tuple[float, int]]] = {
        "engine": lambda: in_thread(lambda: engine_replay(engine, batches)),
        "hf dynamic": lambda: in_thread(lambda: hf_generate(engine, batches, static=False)),
        "hf static": lambda: in_thread(lambda: hf_generate(engine, batches, static=True)),
    }
    for fn in paths.values():
        fn()  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in ("rollout", *paths)}
    tokens: dict[str, int] = {}
    sizes: set[int] = set()
    for _ in range(args.repeats):
        seconds, n, batches_now = in_thread(lambda: rollout(conv, args.rollouts, engine))
        rates["rollout"].append(n / seconds)
        tokens["rollout"] = n
        sizes |= {len(b) for b, _ in batches_now}
        for name, fn in paths.items():
            seconds, n = fn()
            rates[name].append(n / seconds)
            tokens[name] = n
    print(
        f"debate: {args.rollouts} rollouts x {args.turns} turns x {args.new_tokens} new tokens; "
        f"{len(batches)} engine batches, sizes {sorted(sizes)}; turns' shared_prefix_tokens {sorted(SHARED)}"
    )
    for name, r in rates.items():
        print(f"  {name:11s} {tokens[name]:6d} tok  {spread(r)} tok/s")
    for name, goal in (("engine", " (goal >= 0.95)"), ("hf dynamic", ""), ("hf static", "")):
        ratios = [a / b for a, b in zip(rates["rollout"], rates[name], strict=True)]
        print(f"  rollout / {name:10s} = {spread(ratios, '.2f')}x{goal}")


def timed_rollout(conv: Conversation, n: int | None) -> tuple[float, Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.perf_counter()
        report = conv.rollout(n=n, devices=["cpu"], out_dir=out_dir, progress=False, seed=1)
        seconds = time.perf_counter() - start
        assert not report.failed, report.failed
        return seconds, [r.transcript[1].metadata for r in report.results.values()]


def on_off(label: str, conv: Conversation, n: int | None, engine: Any, repeats: int) -> None:
    times: dict[bool, list[float]] = {True: [], False: []}
    shared: dict[bool, set[int]] = {}
    try:
        for flag in (True, False):
            engine.shared_prefill = flag
            in_thread(lambda: timed_rollout(conv, n))  # warm-up
        for _ in range(repeats):
            for flag in (True, False):
                engine.shared_prefill = flag
                seconds, metas = in_thread(lambda: timed_rollout(conv, n))
                times[flag].append(seconds)
                shared[flag] = {m["shared_prefix_tokens"] for m in metas}
    finally:
        engine.shared_prefill = True
    ratios = [off / on for on, off in zip(times[True], times[False], strict=True)]
    print(label)
    for flag, name in ((True, "on: "), (False, "off:")):
        times_s, tokens = spread(times[flag], ".2f"), sorted(shared[flag])
        print(f"  shared prefill {name} {times_s} s; shared_prefix_tokens {tokens}")
    print(f"  off / on = {spread(ratios, '.2f')}x")


def part_shared(args: argparse.Namespace, path: str, engine: Any) -> None:
    tok = engine.tokenizer
    ids = tok(" ".join(f"word{i % 97}" for i in range(4 * args.system_tokens)), add_special_tokens=False)
    block = tok.decode(ids["input_ids"][: args.system_tokens])
    solver = AutoModelParticipant.from_pretrained(
        path, name="s", temperature=0.9, max_new_tokens=args.new_tokens, dtype=args.dtype, system_prompt=block
    )
    rows = [{"q": f"What is {i} plus {i + 1}? Answer in one line."} for i in range(args.shared_rows)]
    data = Conversation(participants=[solver], shared_context=("Q: ", dataset_field("q"))).turns(1).data(rows)
    if "data" not in args.skip:
        on_off(
            f"data rollout: {args.shared_rows} rows, a {args.system_tokens}-token system prompt + a short "
            f"question, {args.new_tokens} new tokens, 1 turn",
            data,
            None,
            engine,
            args.repeats,
        )
    if "samples" in args.skip:
        return
    plain = AutoModelParticipant.from_pretrained(
        path, name="s", temperature=0.9, max_new_tokens=args.new_tokens, dtype=args.dtype
    )
    same = Conversation(participants=[plain], shared_context=block).turns(1)
    on_off(
        f"n samples: {args.shared_rows} samples of one {args.system_tokens}-token prompt, "
        f"{args.new_tokens} new tokens, 1 turn",
        same,
        args.shared_rows,
        engine,
        args.repeats,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the hardware has it, else fp32")
    parser.add_argument("--shared-rows", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument(
        "--skip",
        nargs="*",
        choices=["debate", "shared", "data", "samples"],
        default=[],
        help="parts left out",
    )
    add_model_option(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    args.dtype = fast_dtype(args.dtype)
    print("command:", shlex.join(["python", *sys.argv]))

    import torch
    import transformers

    if args.threads is not None:
        torch.set_num_threads(args.threads)  # global: the rollout's in-process worker thread uses it too

    from interlens.engine._model_cache import load_engine

    path, label = model_path(parser, args.model)
    engine = load_engine(path, dtype=args.dtype)
    params = sum(p.numel() for p in engine.model.parameters())
    print(
        f"model: {label}, {params / 1e6:.1f}M parameters, {args.dtype}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {torch.get_num_threads()} threads; CPU: {cpu_summary()}"
    )
    if "debate" not in args.skip:
        part_debate(args, path, engine)
    if "shared" not in args.skip:
        part_shared(args, path, engine)


if __name__ == "__main__":
    main()
