"""What ``cluster="ray"`` sends per turn over the actor link, and its wall time beside local worker processes.

    python benchmarks/bench_ray.py [--rollouts 64] [--turns 6] [--new-tokens 32] [--workers 2]

A debate (a tiny local Qwen2 model and a scripted participant) rolled out ``--rollouts`` times on
``--workers`` CPU workers, with a ledger: first with ``cluster="ray"`` on a private local Ray instance (its
start timed apart), then with the same number of local worker processes (their start included, as the
actors' is). For the Ray run, every message over the actor link is
counted by kind with its pickled size, with the Ray calls that carried them (``down`` calls from the
parent, items of the actors' ``uplink`` generators). Needs ``pip install 'interlens[ray]'``.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import statistics
import tempfile
import time
from typing import Any

from interlens import AutoModelParticipant, Conversation, ScriptedParticipant
from interlens.scheduler.workers import _ray_worker
from interlens.testing import tiny_model

COUNTS: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # kind -> [messages, bytes]
SEND_S: list[float] = []


def _count(direction: str, message: Any) -> None:
    kind = type(message).__name__
    if kind == "Call":
        kind = f"Call({type(message.request).__name__})"
    entry = COUNTS[f"{direction} {kind}"]
    entry[0] += 1
    entry[1] += len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def instrument() -> None:
    """Count what crosses the parent's end of every actor link (wrapping its methods, nothing else)."""
    channel = _ray_worker._ActorChannel
    send, recv, ship = channel.send, channel.recv, channel._ship

    async def counted_send(self: Any, *messages: Any) -> None:
        for message in messages:
            _count("parent -> actor", message)
        start = time.perf_counter()
        await send(self, *messages)
        SEND_S.append(time.perf_counter() - start)

    async def counted_recv(self: Any) -> Any:
        if not self._received:
            COUNTS["Ray calls: uplink items"][0] += 1
        message = await recv(self)
        if message is not None:
            _count("actor -> parent", message)
        return message

    def counted_ship(self: Any) -> None:
        COUNTS["Ray calls: down"][0] += 1
        ship(self)

    channel.send, channel.recv, channel._ship = counted_send, counted_recv, counted_ship


def debate(new_tokens: int, turns: int) -> Conversation:
    model = AutoModelParticipant.from_pretrained(tiny_model("qwen2"), name="a", max_new_tokens=new_tokens)
    scripted = ScriptedParticipant("s", lambda view: f"reply {view.own_turns}")
    return Conversation([model, scripted], shared_context="Debate: tabs vs spaces.").turns(turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    conv = debate(args.new_tokens, args.turns)
    devices = ["cpu"] * args.workers
    instrument()
    run = {"n": args.rollouts, "devices": devices, "progress": False}
    with tempfile.TemporaryDirectory() as ray_dir, tempfile.TemporaryDirectory() as local_dir:
        start = time.perf_counter()
        with _ray_worker.RaySession():  # the private local instance the run would start; the run joins it
            up_s = time.perf_counter() - start
            start = time.perf_counter()
            ray_report = conv.rollout(cluster="ray", out_dir=ray_dir, **run)
            ray_s = time.perf_counter() - start
        start = time.perf_counter()
        local_report = conv.rollout(out_dir=local_dir, **run)
        local_s = time.perf_counter() - start
        assert ray_report.failed == [] and local_report.failed == []
    turns = args.rollouts * args.turns
    print(f"{args.rollouts} rollouts x {args.turns} turns = {turns} turns, {args.workers} CPU workers")
    print(f"wall: cluster='ray' {ray_s:.1f} s (Ray started in {up_s:.1f} s), local processes {local_s:.1f} s")
    print(f"{'what':36s} {'count':>7s} {'per turn':>9s} {'bytes':>9s} {'bytes/msg':>9s}")
    for kind, (n, size) in sorted(COUNTS.items()):
        mean = f"{size / n:9.0f}" if size else f"{'':9s}"
        print(f"{kind:36s} {n:7d} {n / turns:9.2f} {size:9d} {mean}")
    print(f"parent's send (until the down call returns): median {statistics.median(SEND_S) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
