"""A job that mixes a local generation with a hosted-model call, for runs with worker processes.

A worker process imports this module by name (tests/ is on the sys.path the parent hands over). What the job
returns was produced where it ran: the pid of its worker, the size of its local batch, and the provider's
answer that came back from the parent's gateway over the pipe.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from interlens.participants._api_participant import APIParticipant
from interlens.providers import APIRequest, APISettings
from interlens.scheduler import ExecutionMode, JobContext, JobResult, JobSpec, LineupSpec


class SizeEngine:
    """Answers each request with the size of the batch it was generated in."""

    def generate_batch(
        self, requests: Sequence[Any], *, mode: ExecutionMode, cancelled: threading.Event | None = None
    ) -> list[Any]:
        return [{"batch": len(requests)} for _ in requests]


@dataclass(frozen=True)
class SizeEngineSpec:
    @property
    def engine_key(self) -> str:
        return "size"

    def load_engine(self, device: str) -> SizeEngine:
        return SizeEngine()


def lineup(name: str, jobs: Sequence[Any]) -> LineupSpec:
    specs = [JobSpec(f"{name}/{i:04d}", name, seed=i, job=job, row_index=i) for i, job in enumerate(jobs)]
    return LineupSpec(name=name, fingerprint=f"fp-{name}", jobs=iter(specs), n_jobs=len(specs))


def ask(question: str) -> APIRequest:
    return APIRequest(
        provider="openai",
        model="gpt-test",
        system=None,
        messages=(("user", question),),
        settings=APISettings(max_tokens=16, prompt_cache=False),
        turn=0,
    )


@dataclass
class MixedJob:
    """A local generation and an API call, in the order ``api_first`` says (``local=False``: API only)."""

    speaker: APIParticipant
    question: str
    api_first: bool
    local: bool = True
    needs_device: bool = True

    async def run(self, ctx: JobContext) -> JobResult:
        out: dict[str, Any] = {"pid": os.getpid()}
        if self.local and not self.api_first:
            out["local"] = await ctx.generate(SizeEngineSpec(), ctx.job_id)
        result = await ctx.call_gateway(self.speaker, ask(self.question))
        out["text"], out["batch_id"] = result.text, result.batch_id
        if self.local and self.api_first:
            out["local"] = await ctx.generate(SizeEngineSpec(), ctx.job_id)
        return JobResult(conversation=out)

    def is_transient(self, exc: BaseException) -> bool:
        return False
