"""A mixed local + API debate against the local-only run of the same local turns (#14, #24). Prints only.

    python benchmarks/bench_mixed.py [--model real] [--server fake|serve] [--rollouts 16] [--turns 4]
                                     [--new-tokens 32] [--latency 0.05] [--repeats 3] [--threads N]
                                     [--dtype auto]

Two rollouts of the same shape, interleaved after one warm-up of each:

* mixed: speaker ``local`` (``--model``: the real SmolLM2-135M-Instruct by default, T = 0.9) and speaker
  ``hosted``, an ``APIParticipant`` (openai, single requests, through the official SDK) against
  - ``--server fake``: ``interlens.testing.FakeProviderServer`` answering each request after ``--latency``
    seconds, in its OWN process (in-process its thread would fight the rollout for the GIL, see bench_api.py);
  - ``--server serve``: ``transformers serve --continuous-batching`` (a real OpenAI-compatible server:
    FastAPI, uvicorn, transformers' continuous batching) serving the same model on loopback, on the same CPU
    cores as the local speaker, asked for ``--new-tokens`` tokens at T = 0.9;
* local-only: the same ``local`` speaker and a ``ScriptedParticipant`` answering at once with a reply of the
  hosted one's shape, so the local turns (how many, their batches, their tokens) are the same or close.

The hosted turns of one round run concurrently, so the mixed run can at best take local-only + the hosted
rounds' own time (fake: one latency each; serve: the server's time for the round, printed). Goal with the fake
server: mixed <= local-only + 0.2 s (API turns never hold local batches back). Also printed: the local turns'
batch sizes in each run (a local batch that left before every conversation had caught up would show as smaller
batches), and the gap from each hosted round's last reply to the next local batch's start (from the turns'
recorded ``at`` and ``seconds``: a batch held back by the batcher would show here). Medians of ``--repeats``
with (min-max).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

from _common import add_model_option, cpu_summary, fast_dtype, model_path, spread

KEY = "sk-bench-not-a-real-key"


def _serve_fake(conn: Connection, latency: float) -> None:
    from interlens.testing._fake_provider import FakeProviderServer

    with FakeProviderServer(latency=latency) as server:
        conn.send(server.env(api_key=KEY))
        while conn.recv() != "stop":
            conn.send({"requests": len(server.requests), "errors": len(server.handler_errors)})


@contextmanager
def fake_server(latency: float) -> Iterator[dict[str, Any]]:
    """The fake server in its own process; yields the settings of the hosted speaker, and on exit prints its
    request count (the meters say every hosted turn reached it)."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_serve_fake, args=(theirs, latency), daemon=True)
    server.start()
    os.environ.update(ours.recv())
    try:
        yield {"model_id": "bench-model"}
        ours.send("meters")
        meters = ours.recv()
        print(f"  fake server: {meters['requests']} requests, {meters['errors']} handler errors")
    finally:
        ours.send("stop")
        server.join(timeout=10)


@contextmanager
def served(path: str, dtype: str) -> Iterator[dict[str, Any]]:
    """``transformers serve`` of the model at ``path`` in ``dtype`` on loopback (``interlens.testing``);
    yields the hosted speaker's settings once it is up."""
    from interlens.testing import transformers_serve

    with transformers_serve(path, dtype=dtype) as url:
        print(f"transformers serve of {path} in {dtype} at {url}")
        yield {"model_id": path, "base_url": url}


def conversations(path: str, hosted_settings: dict[str, Any], args: argparse.Namespace) -> tuple[Any, Any]:
    from interlens import APIParticipant, AutoModelParticipant, Conversation, ScriptedParticipant

    local = AutoModelParticipant.from_pretrained(
        path, name="local", temperature=0.9, max_new_tokens=args.new_tokens, dtype=args.dtype
    )
    hosted = APIParticipant(
        name="hosted",
        provider="openai",
        system_prompt="Disagree.",
        temperature=0.9,
        max_tokens=args.new_tokens,
        **hosted_settings,
    )
    # the fake server answers "reply to <the last user message's first 40 chars> [<8 hex digits>]", the
    # script the same shape at once (a real server's replies are longer: the local prompts differ by that)
    scripted = ScriptedParticipant(
        "hosted",
        lambda view: f"reply to {' '.join(view.messages[-1].content.split())[:40]} [0123abcd]",
        system_prompt="Disagree.",
    )
    context = "Debate: tabs vs spaces."
    mixed = Conversation([local, hosted], shared_context=context).turns(args.turns)
    alone = Conversation([local, scripted], shared_context=context).turns(args.turns)
    return mixed, alone


def timed(conv: Any, n: int) -> tuple[float, list[int], int, list[float], float]:
    """Wall seconds, the local turns' batch sizes, tokens generated locally, for each local turn after a
    hosted round the gap from that round's LAST reply to the local batch's start, and the hosted rounds' own
    seconds (each round from its first request to its last reply, summed). Run in a fresh thread: torch work
    on the main thread slows later rollouts (``_common.in_thread``)."""
    out: list[Any] = []

    def target() -> None:
        with tempfile.TemporaryDirectory() as out_dir:
            start = time.perf_counter()
            report = conv.rollout(n=n, devices=["cpu"], out_dir=out_dir, progress=False, seed=1)
            seconds = time.perf_counter() - start
            assert not report.failed, [report.results[j].error for j in report.failed[:3]]
            transcripts = [list(r.transcript[1:]) for r in report.results.values()]
        local = [m for t in transcripts for m in t if m.author == "local"]
        gaps = []
        hosted_s = 0.0
        for k in range(1, len(transcripts[0]), 2):  # the hosted turns
            if any("at" not in t[k].metadata for t in transcripts):
                break  # scripted replies carry no time
            last_reply = max(t[k].metadata["at"] for t in transcripts)
            hosted_s += last_reply - min(t[k].metadata["at"] - t[k].metadata["seconds"] for t in transcripts)
            if k + 1 < len(transcripts[0]):  # a local turn follows
                batch_start = min(t[k + 1].metadata["at"] - t[k + 1].metadata["seconds"] for t in transcripts)
                gaps.append(batch_start - last_reply)
        sizes = sorted({m.metadata["batch_size"] for m in local})
        out.append((seconds, sizes, sum(m.n_tokens for m in local), gaps, hosted_s))

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError("the rollout failed (see the traceback above)")
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_option(parser)
    parser.add_argument("--server", choices=("fake", "serve"), default="fake")
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.05, help="the fake server's seconds a request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the hardware has it, else fp32")
    args = parser.parse_args()
    args.dtype = fast_dtype(args.dtype)
    print("command:", shlex.join(["python", *sys.argv]))
    path, label = model_path(parser, args.model)
    serving = fake_server(args.latency) if args.server == "fake" else served(path, args.dtype)
    with serving as hosted_settings:
        import torch

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        mixed, alone = conversations(path, hosted_settings, args)
        hosted_rounds = args.turns // 2
        answers = f"at {args.latency * 1000:.0f} ms" if args.server == "fake" else "by transformers serve"
        print(
            f"{label}; {args.rollouts} rollouts x {args.turns} turns (local first), "
            f"{args.new_tokens} new tokens a turn, {hosted_rounds} hosted rounds {answers}, "
            f"{torch.get_num_threads()} torch threads, {args.dtype}; CPU: {cpu_summary()}"
        )
        runs: dict[str, list[tuple[float, list[int], int, list[float], float]]] = {
            "local-only": [],
            "mixed": [],
        }
        timed(alone, args.rollouts)  # warm-ups
        timed(mixed, args.rollouts)
        for _ in range(args.repeats):
            runs["local-only"].append(timed(alone, args.rollouts))
            runs["mixed"].append(timed(mixed, args.rollouts))
        for name, rs in runs.items():
            sizes = sorted({s for r in rs for s in r[1]})
            walls = spread([r[0] for r in rs], ".2f")
            tokens = spread([float(r[2]) for r in rs], ".0f")
            print(f"  {name:10s} wall {walls} s; local tokens {tokens}; local batch sizes {sizes}")
        pairs = list(zip(runs["local-only"], runs["mixed"], strict=True))
        extra = [m[0] - a[0] for a, m in pairs]
        hosted = [m[4] for _, m in pairs]
        print(f"  mixed - local-only = {spread(extra, '.2f')} s per run")
        print(
            f"  the hosted rounds' own time (first request to last reply, summed): {spread(hosted, '.2f')} s"
        )
        left = [e - h for e, h in zip(extra, hosted, strict=True)]
        print(f"  mixed - local-only - hosted rounds = {spread(left, '.2f')} s (the mix's cost beyond them)")
        if args.server == "fake":
            print(
                f"  (hosted floor {hosted_rounds * args.latency:.2f} s; goal: mixed - local-only <= 0.20 s)"
            )
        gaps = [g * 1000 for r in runs["mixed"] for g in r[3]]
        if gaps:
            print(
                "  mixed: a hosted round's last reply -> the next local batch's start: median "
                f"{statistics.median(gaps):.1f} ms, max {max(gaps):.1f} ms ({len(gaps)} rounds; a batch held "
                "back would show as a long gap)"
            )


if __name__ == "__main__":
    main()
