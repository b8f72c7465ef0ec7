"""The worker pipe's own contract, over a real socket pair: typed messages only, notes before answers.

Both ends run in this event loop here (the process tests in test_scheduler_workers drive the same code
across a real process boundary); what is checked is the order in which one end sees what the other sent.
"""

from __future__ import annotations

import pickle
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from interlens.scheduler.workers._wire import (
    Answers,
    Blocked,
    Call,
    Calls,
    Connection,
    GatewayCall,
    Reply,
    Unblocked,
)


class Log:
    """A job's device batcher as the worker's :class:`Calls` sees it (a ``Blocker``), plus what arrived."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.blocked = 0

    def block(self) -> None:
        self.blocked += 1
        self.events.append("block")

    def unblock(self) -> None:
        self.blocked -= 1
        self.events.append("unblock")


@asynccontextmanager
async def pipe(log: Log) -> AsyncIterator[tuple[Connection, Calls, Answers]]:
    """(the parent's end, the worker's calls, the parent's answers); the worker's end reads as the worker
    process does, logging each Reply as it arrives."""
    ours, theirs = socket.socketpair()
    parent = await Connection.from_socket(ours)
    worker = await Connection.from_socket(theirs)
    calls = Calls(worker)

    async def worker_reads() -> None:
        while (message := await worker.recv()) is not None:
            match message:
                case Reply() as reply:
                    log.events.append("reply")
                    calls.resolve(reply)
                case Blocked() | Unblocked() as note:
                    calls.noted(note)

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker_reads)
        yield parent, calls, Answers(parent, tg)
        tg.cancel_scope.cancel()
    await parent.aclose()
    await worker.aclose()


async def test_a_gateway_calls_notes_reach_the_worker_before_its_answer() -> None:
    log = Log()
    with anyio.fail_after(10):
        async with pipe(log) as (parent, calls, answers), anyio.create_task_group() as tg:
            result: list[object] = []

            async def job() -> None:
                result.append(await calls.call(GatewayCall("j", "spec", "request", notes=True), log))

            tg.start_soon(job)
            message = await parent.recv()
            assert isinstance(message, Call) and message.request == GatewayCall("j", "spec", "request", True)
            blocker = answers.blocker(message.call)
            blocker.block()  # the row joins a round ...
            blocker.unblock()  # ... and is delivered, in the same step as the gateway answers
            await answers.reply(Reply(message.call, True, "answer"))
    assert result == ["answer"]
    assert log.events == ["block", "unblock", "reply"] and log.blocked == 0


async def test_a_block_never_undone_by_the_parent_is_undone_when_the_call_ends() -> None:
    log = Log()
    with anyio.fail_after(10):
        async with pipe(log) as (parent, calls, answers), anyio.create_task_group() as tg:

            async def job() -> None:
                with pytest.raises(ValueError, match="provider refused"):
                    await calls.call(GatewayCall("j", "spec", "request", notes=True), log)

            tg.start_soon(job)
            message = await parent.recv()
            assert isinstance(message, Call)
            answers.blocker(message.call).block()  # the gateway call then failed: no Unblocked comes
            await answers.reply(Reply(message.call, False, ValueError("provider refused")))
    assert log.events == ["block", "reply", "unblock"] and log.blocked == 0


async def test_an_untyped_message_on_the_pipe_is_refused() -> None:
    ours, theirs = socket.socketpair()
    data = pickle.dumps(("reply", 0, True, None))  # the tagged tuples of old
    ours.sendall(struct.pack("!I", len(data)) + data)
    worker = await Connection.from_socket(theirs)
    try:
        with pytest.raises(ValueError, match="malformed message on the worker pipe: tuple"):
            await worker.recv()
    finally:
        ours.close()
        await worker.aclose()
