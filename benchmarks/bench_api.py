"""API rollout throughput against the loopback fake provider (issue #6's benchmark). Prints; asserts nothing.

    .venv/bin/python benchmarks/bench_api.py [--conversations 2000] [--turns 4] [--limit 64] [--latency 0.05]
                                             [--provider openai|anthropic|openrouter] [--repeats 1]

A two-speaker API debate rolled out ``--conversations`` times, ``--turns`` turns each, every turn one request
through the official SDK, at most ``--limit`` requests in flight, the server answering each after
``--latency`` seconds; the ledger (a temp out_dir) records every turn. The ideal wall time is
``conversations * turns / limit * latency`` (the limit never idle, zero client cost); the target is 1.2x.

The fake server runs in its OWN process: in-process, its thread would fight the client's event loop for the
GIL and measure that contention rather than our overhead. Also printed: the server's peak concurrency
(should equal ``--limit``) and the client process's CPU seconds per request (what bounds the ratio on a
small machine: at 64 x 50 ms the budget is 0.78 ms of client CPU per request).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any


def _serve(conn: Connection, latency: float) -> None:
    from interlens.testing._fake_provider import FakeProviderServer

    with FakeProviderServer(latency=latency) as server:
        conn.send(server.env(api_key="sk-bench-not-a-real-key"))
        while True:
            command = conn.recv()
            if command == "stop":
                return
            if command == "meters":
                conn.send(
                    {
                        "peak": server.max_concurrency,
                        "requests": len(server.requests),
                        "errors": len(server.handler_errors),
                    }
                )
                server.reset_meters()


def _debate(provider: str, model: str, limit: int, turns: int) -> Any:
    from interlens import Conversation
    from interlens.participants._api_participant import APIParticipant

    def speaker(name: str, side: str) -> APIParticipant:
        return APIParticipant(
            name=name,
            provider=provider,
            model_id=model,
            system_prompt=f"Argue {side}.",
            max_tokens=64,
            max_in_flight=limit,
        )

    return Conversation(
        participants=[speaker("pro", "YES"), speaker("con", "NO")], shared_context="Is a hot dog a sandwich?"
    ).turns(turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--provider", default="openai", choices=["openai", "anthropic", "openrouter"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-concurrency", type=int, default=256, help="conversations live at once")
    parser.add_argument(
        "--no-ledger", action="store_true", help="run without out_dir (to see the ledger's cost)"
    )
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(theirs, args.latency), daemon=True)
    server.start()
    os.environ.update(ours.recv())
    model = "vendor/bench" if args.provider == "openrouter" else "bench-model"
    conv = _debate(args.provider, model, args.limit, args.turns)
    requests = args.conversations * args.turns
    ideal = requests / args.limit * args.latency
    print(
        f"API rollout benchmark: {args.conversations:,} conversations x {args.turns} turns = {requests:,} "
        f"{args.provider} requests, limit {args.limit}, server latency {args.latency * 1000:.0f} ms "
        f"(server in its own process), ledger on"
    )
    with tempfile.TemporaryDirectory() as root:
        warm = conv.turns(1).rollout(n=args.limit, out_dir=os.path.join(root, "warm"), progress=False)
        assert not warm.failed, warm.failed
        ours.send("meters")
        ours.recv()
        walls = []
        for repeat in range(args.repeats):
            out_dir = None if args.no_ledger else os.path.join(root, f"run{repeat}")
            cpu, start = time.process_time(), time.perf_counter()
            report = conv.rollout(
                n=args.conversations, out_dir=out_dir, progress=False, max_concurrency=args.max_concurrency
            )
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            walls.append(wall)
            assert not report.failed, report.failed[:5]
            ours.send("meters")
            meters = ours.recv()
            print(
                f"  run {repeat + 1}: {wall:6.2f} s wall, ideal {ideal:5.2f} s, ratio {wall / ideal:4.2f}x; "
                f"server peak in flight {meters['peak']} (limit {args.limit}), {meters['requests']:,} "
                f"requests; client CPU {cpu:5.2f} s = {cpu / requests * 1000:.2f} ms/request"
            )
    best = min(walls)
    median = statistics.median(walls)
    print(f"  best {best:.2f} s, median {median:.2f} s: {best / ideal:.2f}x ideal (target <= 1.2x)")
    ours.send("stop")
    server.join(timeout=10)


if __name__ == "__main__":
    main()
