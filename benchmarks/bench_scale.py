"""The measured pieces of docs/scale.md (issue 13: a 64-GPU run of 100,000 conversations, on paper).
Prints figures; asserts nothing.

    .venv/bin/python benchmarks/bench_scale.py --part memory [--jobs 5000 25000 100000] [--repeats 3]
    .venv/bin/python benchmarks/bench_scale.py --part memory --jobs 20000 --concurrency 256 1024 4096 \
        --gc on high off
    .venv/bin/python benchmarks/bench_scale.py --part wire [--rollouts 32] [--new-tokens 48] [--repeats 3]
    .venv/bin/python benchmarks/bench_scale.py --part pipe [--calls 20000] [--repeats 3]
    python benchmarks/bench_scale.py --part ray [--calls 20000] [--repeats 3]   # any Python with ray

``memory``: the driver's (parent's) memory for a rollout of many jobs with a ledger (``out_dir``), a fresh
process per rollout: a 4-turn debate of two ``ScriptedParticipant``s, each reply a distinct ~1,360-character
string (about 300 tokens of English), so no job costs a model. It prints the RSS after a warm-up, the peak
RSS of the rollout (``ru_maxrss``), the RSS after reading every result's transcript back through the lazy
report, the ledger's size on disk, the parent's wall and CPU time per turn (in-process jobs: the turn loop
and the ledger, nothing else) and the cyclic garbage collector's share of that CPU (``--gc off`` turns it
off during the rollout, ``--gc high`` raises its thresholds, for comparison). The growth between the
smallest and the largest job count is the cost of a finished job; between the smallest and the largest
``--concurrency``, the cost of a live job.

``wire``: the bytes that cross the worker pipe, counted in the parent (both directions are visible there)
by wrapping ``Connection.send``/``recv`` in this script, for a real rollout on two CPU worker processes
(``devices=["cpu", "cpu"]``) of a tiny random-weight model: a local debate, then a local-vs-API debate
against the loopback fake provider (the API speaker's turns go up to the parent's gateway as
``GatewayCall``s). Each message is re-pickled to size it as ``_wire`` frames it (4-byte header + pickle).
The conversation text inside (``content``/``text``/``messages``/``system`` strings) is counted apart, so a
message's fixed overhead, and its size for a realistic 300-token turn, can be read off. First, unmetered,
the parent's CPU per local turn: the difference between ``--rollouts`` and a quarter as many (what every
run pays once cancels), medians of ``--repeats``.

``pipe``: what one pipe carries: round trips of ``Call(TurnCall)`` with a realistic ~1,360-character turn,
answered by ``Reply``, 64 in flight, over the same framing (``_wire.Connection`` and ``Calls``), between
this process and an echo process; round trips/s and CPU microseconds per round trip on each end.

``ray``: the same round trip through a Ray actor, as the Ray backend would carry a turn record (the actor's
streaming-generator uplink answered by ``actor.reply.remote``), and a plain driver -> actor call; round
trips/s and the driver's CPU per round trip (Ray's own processes not counted). Run it with any Python that
has ``ray`` installed; it imports nothing of interlens.

Medians of ``--repeats`` runs. The development machine is a shared 2-core VM: expect ±30 % between sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

# About 300 tokens of English (≈ 4 characters a token); each reply is made distinct (see _reply).
TEXT = (
    "The question turns on what we mean by a sandwich. If a sandwich is any filling held between two pieces "
    "of bread, the hinge of a hot dog bun is no objection: a sub roll is hinged too, and nobody doubts that "
    "a sub is a sandwich. "
) * 6
_HEADER = 4  # the frame's length prefix


def _reply(view: Any) -> str:
    return f"{TEXT} ({random.random():.12f})"  # a new string object every turn, as real text would be


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


# --- memory -------------------------------------------------------------------------------------------------


def _memory_child(jobs: int, concurrency: int, collect: str) -> None:
    """One rollout in this fresh process; prints one JSON line. ``collect``: the cyclic garbage collector
    during the rollout: "on" (Python's defaults), "high" (``gc.set_threshold(50_000, 20, 100)``, fewer and
    rarer collections) or "off" (to see its share of the parent's CPU)."""
    import gc

    collector = {"seconds": 0.0, "full": 0, "since": 0.0}

    def timed(phase: str, info: dict[str, int]) -> None:  # the collector's own time, from its callbacks
        if phase == "start":
            collector["since"] = time.process_time()
        else:
            collector["seconds"] += time.process_time() - collector["since"]
            collector["full"] += info["generation"] == 2

    from interlens import Conversation, ScriptedParticipant

    conv = Conversation(
        participants=[ScriptedParticipant("pro", _reply), ScriptedParticipant("con", _reply)],
        shared_context="Is a hot dog a sandwich?",
    ).turns(4)
    with tempfile.TemporaryDirectory() as root:
        conv.rollout(n=16, out_dir=os.path.join(root, "warm"), progress=False)  # imports, caches
        gc.collect()
        base, base_peak = _rss(), _peak()
        out = Path(root) / "run"
        gc.callbacks.append(timed)
        thresholds = gc.get_threshold()
        if collect == "off":
            gc.disable()
        elif collect == "high":
            gc.set_threshold(50_000, 20, 100)
        cpu, start = time.process_time(), time.perf_counter()
        report = conv.rollout(n=jobs, out_dir=out, progress=False, max_concurrency=concurrency)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        gc.enable()
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(timed)
        peak, after = _peak(), _rss()
        assert report.counts["done"] == jobs, report.counts
        messages = sum(len(r.transcript or ()) for r in report.results.values())  # lazy: one at a time
        read = _rss()
        size = sum(p.stat().st_size for p in out.iterdir() if p.name.startswith("ledger.sqlite"))
    print(
        json.dumps(
            {
                "jobs": jobs,
                "concurrency": concurrency,
                "base": base,
                "base_peak": base_peak,
                "peak": peak,
                "after": after,
                "after_read": read,
                "messages_read": messages,
                "ledger_bytes": size,
                "wall": wall,
                "cpu": cpu,
                "gc": collector["seconds"],
                "gc_full": collector["full"],
            }
        )
    )


def _memory(job_counts: list[int], concurrencies: list[int], repeats: int, gc_modes: list[str]) -> None:
    print(
        f"driver memory: 4-turn scripted debate, ~{len(TEXT):,} characters a turn, ledger on; "
        f"a fresh process per rollout; medians of {repeats}"
    )
    Key = tuple[int, int, str]
    rows: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for _ in range(repeats):  # interleaved, so a burst of load hits every size alike
        for mode in gc_modes:
            for concurrency in concurrencies:
                for jobs in job_counts:
                    cmd = [sys.executable, __file__, "--child-memory", str(jobs)]
                    cmd += ["--concurrency", str(concurrency), "--gc", mode]
                    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    rows[(jobs, concurrency, mode)].append(json.loads(done.stdout.strip().splitlines()[-1]))
    med = {key: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for key, runs in rows.items()}
    print(
        f"  {'jobs':>8} {'concur.':>7} {'gc':>4} {'RSS base':>10} {'peak':>10} {'growth':>10} {'after':>10} "
        f"{'after read':>10} {'ledger':>11} {'per job':>9} {'turns/s':>8} {'CPU/turn':>9} {'GC share':>8}"
    )
    for (jobs, concurrency, mode), m in sorted(med.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        turns = jobs * 4
        print(
            f"  {jobs:>8,} {concurrency:>7,} {mode:>4} {_mib(m['base']):>10} {_mib(m['peak']):>10} "
            f"{_mib(m['peak'] - m['base']):>10} {_mib(m['after']):>10} {_mib(m['after_read']):>10} "
            f"{_mib(m['ledger_bytes']):>11} {m['ledger_bytes'] / jobs / 1024:>6.1f} KiB "
            f"{turns / m['wall']:>8,.0f} {m['cpu'] / turns * 1e6:>6.0f} µs {m['gc'] / m['cpu']:>8.0%}"
        )
    jobs0, concurrency0 = job_counts[0], concurrencies[0]
    for mode in gc_modes:
        for small, big, name, pairs in (
            (jobs0, job_counts[-1], "job", ((j, concurrency0) for j in (jobs0, job_counts[-1]))),
            (
                concurrency0,
                concurrencies[-1],
                "live job",
                ((jobs0, c) for c in (concurrency0, concurrencies[-1])),
            ),
        ):
            lo, hi = (med[(*pair, mode)]["peak"] for pair in pairs)
            if big != small:
                slope = (hi - lo) / (big - small)
                print(
                    f"  gc {mode}: peak RSS grows {slope:,.0f} bytes per {name} between {small:,} and {big:,}"
                )


# --- wire ---------------------------------------------------------------------------------------------------


_TEXT_FIELDS = frozenset({"content", "text", "messages", "system"})


def _content_bytes(obj: Any, text: bool = False, depth: int = 0) -> int:
    """UTF-8 bytes of conversation text inside ``obj``: every string under a key or attribute named
    ``content``, ``text``, ``messages`` or ``system`` (dicts, lists, dataclasses, slotted objects)."""
    if isinstance(obj, str):
        return len(obj.encode()) if text else 0
    if depth > 12 or isinstance(obj, bytes | int | float | bool) or obj is None:
        return 0
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list | tuple | set | frozenset):
        return sum(_content_bytes(v, text, depth + 1) for v in obj)
    else:
        names = getattr(obj, "__dataclass_fields__", None) or getattr(obj, "__slots__", None) or ()
        items = [(n, getattr(obj, n, None)) for n in names] or list(getattr(obj, "__dict__", {}).items())
    return sum(_content_bytes(v, text or k in _TEXT_FIELDS, depth + 1) for k, v in items)


class _Meter:
    """Wraps ``Connection.send``/``recv`` in this (the parent) process and tallies every message."""

    def __init__(self) -> None:
        self.tally: dict[str, list[tuple[int, int]]] = defaultdict(list)  # kind -> [(bytes, content)]
        self.calls: dict[tuple[int, int], str] = {}  # (connection, call id) -> what was asked

    def install(self) -> None:
        from interlens.scheduler.workers import _wire

        meter, send, recv = self, _wire.Connection.send, _wire.Connection.recv

        async def counted_send(conn: Any, *messages: Any) -> None:
            for message in messages:
                meter.count(conn, message, up=False)
            await send(conn, *messages)

        async def counted_recv(conn: Any) -> Any:
            message = await recv(conn)
            if message is not None:
                meter.count(conn, message, up=True)
            return message

        _wire.Connection.send = counted_send  # type: ignore[method-assign,unused-ignore]
        _wire.Connection.recv = counted_recv  # type: ignore[method-assign,unused-ignore]

    def count(self, conn: Any, message: Any, *, up: bool) -> None:
        kind = type(message).__name__
        if kind == "Call":
            kind = f"Call({type(message.request).__name__})"
            self.calls[(id(conn), message.call)] = kind
        elif kind == "Reply":
            kind = f"Reply to {self.calls.pop((id(conn), message.call), '?')}"
        size = _HEADER + len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        self.tally[f"{'up  ' if up else 'down'} {kind}"].append((size, _content_bytes(message)))


def _debate(new_tokens: int, api: bool) -> Any:
    from interlens import APIParticipant, AutoModelParticipant, Conversation
    from interlens.testing import tiny_model

    path = tiny_model("qwen2")
    pro = AutoModelParticipant.from_pretrained(
        path, name="pro", temperature=0.9, max_new_tokens=new_tokens, system_prompt="Argue YES."
    )
    if api:
        con: Any = APIParticipant(
            name="con", provider="openai", model_id="bench-model", system_prompt="Argue NO.", max_tokens=300
        )
    else:
        con = AutoModelParticipant.from_pretrained(
            path, name="con", temperature=0.9, max_new_tokens=new_tokens, system_prompt="Argue NO."
        )
    return Conversation(participants=[pro, con], shared_context="Is a hot dog a sandwich?").turns(4)


def _rollout(conv: Any, n: int) -> tuple[int, float, float]:
    """Roll ``conv`` out ``n`` times on two CPU worker processes; (turns, wall s, parent CPU s)."""
    with tempfile.TemporaryDirectory() as out:
        cpu, start = time.process_time(), time.perf_counter()
        report = conv.rollout(n=n, devices=["cpu", "cpu"], out_dir=out, progress=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        assert not report.failed, report.failed
        return sum(len(r.transcript or ()) - 1 for r in report.results.values()), wall, cpu


def _wire(rollouts: int, new_tokens: int, repeats: int) -> None:
    from interlens.testing import FakeProviderServer

    # The parent's CPU per turn, unmetered: the difference between n and n/4 rollouts cancels what every
    # run pays once (spawning the workers, their handshakes), after one warm-up run (imports).
    local = _debate(new_tokens, api=False)
    _rollout(local, 2)
    runs = [(_rollout(local, rollouts // 4), _rollout(local, rollouts)) for _ in range(repeats)]
    per_turn = statistics.median((big[2] - small[2]) / (big[0] - small[0]) for small, big in runs)
    print(
        f"parent CPU per local turn: {per_turn * 1000:.2f} ms (difference of {rollouts} and {rollouts // 4} "
        f"rollouts of a 4-turn local debate on 2 CPU worker processes, medians of {repeats}; workers' CPU "
        "not included: the parent's share only)"
    )
    meter = _Meter()
    meter.install()
    with FakeProviderServer(reply=lambda body: TEXT) as server:
        os.environ.update(server.env(api_key="sk-bench-not-a-real-key"))
        for api in (False, True):
            meter.tally.clear()
            what = "local pro vs API con (fake provider)" if api else "local debate (both speakers local)"
            turns, wall, _ = _rollout(_debate(new_tokens, api), rollouts)
            print(
                f"pipe traffic, {what}: {rollouts} rollouts x 4 turns on 2 CPU worker processes, "
                f"tiny qwen2, <= {new_tokens} new tokens, {turns} turns in {wall:.1f} s "
                "(metered: every message re-pickled)"
            )
            head = f"{'count':>6} {'bytes each':>11} {'text':>7} {'overhead':>9} {'per turn':>9}"
            print(f"  {'message':<32} {head}")
            total = 0
            for kind, sizes in sorted(meter.tally.items()):
                n, size = len(sizes), statistics.median(s for s, _ in sizes)
                content = statistics.median(c for _, c in sizes)
                overhead = statistics.median(s - c for s, c in sizes)
                total += sum(s for s, _ in sizes)
                print(
                    f"  {kind:<32} {n:>6} {size:>11,.0f} {content:>7,.0f} {overhead:>9,.0f} "
                    f"{sum(s for s, _ in sizes) / turns:>9,.0f}"
                )
            print(f"  all messages: {total / turns:,.0f} bytes per turn (medians; this run's turn lengths)")


# --- pipe ---------------------------------------------------------------------------------------------------


def _echo_child(fd: int) -> None:
    """The far end: answer every Call with Reply(call, True, None), as the parent answers a TurnCall."""
    import anyio

    from interlens.scheduler.workers._wire import Call, Connection, Reply

    async def serve() -> None:
        conn = await Connection.from_socket(socket.socket(fileno=fd))
        start = None  # CPU from the first call on: not this process's startup
        while (message := await conn.recv()) is not None:
            if isinstance(message, Call):
                start = time.process_time() if start is None else start
                await conn.send(Reply(message.call, True, None))
        print(json.dumps({"cpu": time.process_time() - (start or 0.0)}))

    anyio.run(serve)


def _pipe_once(calls: int, in_flight: int) -> tuple[float, float, float]:
    import anyio

    from interlens.scheduler.workers._wire import Calls, Connection, Reply, TurnCall

    turn = {"speaker": "pro", "content": _reply(None), "metadata": {"n_tokens": 300, "finish_reason": "eos"}}
    ours, theirs = socket.socketpair()
    child = subprocess.Popen(
        [sys.executable, __file__, "--child-echo", str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        stdout=subprocess.PIPE,
        text=True,
    )
    theirs.close()

    async def drive() -> tuple[float, float]:
        conn = await Connection.from_socket(ours)
        pending = Calls(conn)

        async def reader() -> None:
            while (message := await conn.recv()) is not None:
                if isinstance(message, Reply):
                    pending.resolve(message)

        async def caller(k: int) -> None:
            for i in range(k, calls, in_flight):
                await pending.call(TurnCall(k, i, turn))

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await pending.call(TurnCall(0, -1, turn))  # the echo process is up
            cpu, start = time.process_time(), time.perf_counter()
            async with anyio.create_task_group() as callers:
                for k in range(in_flight):
                    callers.start_soon(caller, k)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            await conn.send_eof()
        await conn.aclose()
        return wall, cpu

    wall, cpu = anyio.run(drive)
    out, _ = child.communicate(timeout=60)
    return calls / wall, cpu / calls, json.loads(out.strip().splitlines()[-1])["cpu"] / calls


def _pipe(calls: int, repeats: int) -> None:
    runs = [_pipe_once(calls, 64) for _ in range(repeats)]
    rate = statistics.median(r[0] for r in runs)
    print(
        f"pipe capacity: {calls:,} Call(TurnCall) -> Reply round trips, a {len(_reply(None)):,}-character "
        f"turn, 64 in flight, _wire framing between two processes (medians of {repeats}):\n"
        f"  {rate:,.0f} round trips/s; CPU per round trip "
        f"{statistics.median(r[1] for r in runs) * 1e6:.0f} µs (caller end, incl. the Calls bookkeeping), "
        f"{statistics.median(r[2] for r in runs) * 1e6:.0f} µs (answering end)"
    )


# --- ray ----------------------------------------------------------------------------------------------------


def _ray(calls: int, repeats: int) -> None:
    """The same turn-record round trip through a Ray actor, in the shape /work/shared/notes/ray.md recommends:
    the actor yields its calls on a streaming generator (the uplink), the driver answers each with
    ``actor.reply.remote``. Needs ``pip install ray`` (no interlens import: the payload is a turn record's
    size and shape)."""
    import asyncio
    import logging

    import ray

    turn = {"speaker": "pro", "content": _reply(None), "metadata": {"n_tokens": 300, "finish_reason": "eos"}}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)

    class _Worker:
        def __init__(self) -> None:
            self.pending: dict[int, asyncio.Future[None]] = {}
            self.up: asyncio.Queue[tuple[int, Any]] | None = None

        def _queue(self) -> asyncio.Queue[tuple[int, Any]]:
            if self.up is None:
                self.up = asyncio.Queue()
            return self.up

        async def produce(self, n: int, in_flight: int, payload: Any) -> None:
            gate, loop = asyncio.Semaphore(in_flight), asyncio.get_running_loop()

            async def one(i: int) -> None:
                async with gate:
                    fut = self.pending[i] = loop.create_future()
                    self._queue().put_nowait((i, payload))
                    await fut

            await asyncio.gather(*(one(i) for i in range(n)))

        async def uplink(self) -> Any:
            while True:
                yield await self._queue().get()

        async def reply(self, rid: int) -> None:
            self.pending.pop(rid).set_result(None)

        async def record(self, payload: Any) -> None:
            return None

    Worker: Any = ray.remote(max_restarts=0, max_task_retries=0)(_Worker)

    async def uplink_once(actor: Any) -> tuple[float, float]:
        gen = actor.uplink.remote()

        async def pump() -> None:
            async for ref in gen:
                rid, _ = await ref
                actor.reply.remote(rid)

        task = asyncio.ensure_future(pump())
        cpu, start = time.process_time(), time.perf_counter()
        await actor.produce.remote(calls, 64, turn)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        task.cancel()
        ray.cancel(gen)
        return calls / wall, cpu / calls

    async def direct_once(actor: Any) -> tuple[float, float]:
        gate = asyncio.Semaphore(64)

        async def one() -> None:
            async with gate:
                await actor.record.remote(turn)

        cpu, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(calls)))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return calls / wall, cpu / calls

    async def bench() -> None:
        actor = Worker.remote()
        await actor.record.remote(turn)  # started
        for name, once in (
            ("actor -> driver (uplink + reply)", uplink_once),
            ("driver -> actor call", direct_once),
        ):
            runs = [await once(actor) for _ in range(repeats)]
            print(
                f"  {name:<34} {statistics.median(r[0] for r in runs):>8,.0f} round trips/s; driver CPU "
                f"{statistics.median(r[1] for r in runs) * 1e6:,.0f} µs each"
            )

    print(
        f"Ray {ray.__version__} actor round trips: {calls:,} calls of a {len(turn['content']):,}-character "
        f"turn record, 64 in flight, one local actor, medians of {repeats}:"
    )
    try:
        asyncio.run(bench())
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["memory", "wire", "pipe", "ray"], default="memory")
    parser.add_argument("--jobs", type=int, nargs="+", default=[5_000, 25_000, 100_000])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--gc",
        nargs="+",
        choices=["on", "high", "off"],
        default=["on"],
        help="the cyclic GC during the rollout: defaults, high thresholds, off",
    )
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--child-memory", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-echo", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory is not None:
        _memory_child(args.child_memory, args.concurrency[0], collect=args.gc[0])
    elif args.child_echo is not None:
        _echo_child(args.child_echo)
    elif args.part == "memory":
        _memory(args.jobs, args.concurrency, args.repeats, args.gc)
    elif args.part == "wire":
        _wire(args.rollouts, args.new_tokens, args.repeats)
    elif args.part == "pipe":
        _pipe(args.calls, args.repeats)
    else:
        _ray(args.calls, args.repeats)


if __name__ == "__main__":
    main()
