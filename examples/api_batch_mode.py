"""API batch mode: a hosted debate whose every round goes through the providers' batch APIs (~50% cost).

    python examples/api_batch_mode.py [-n 8] [--turns 4] [--out runs/hotdog]
    OPENAI_API_KEY=... ANTHROPIC_API_KEY=... python examples/api_batch_mode.py \\
        --openai-model gpt-5 --anthropic-model claude-sonnet-5

With ``batch=True`` an ``APIParticipant``'s turns wait for their round: when every live conversation is
waiting, the round goes out as ONE provider batch per speaker (so ``--turns 4`` makes two OpenAI and two
Anthropic batches, whatever ``-n``), recorded in the ledger before polling, so a crashed run re-attaches to
a batch in flight instead of paying for it twice. The price is latency: a provider batch takes minutes to
hours. Batch APIs exist for openai and anthropic only; ``batch=True`` with openrouter is refused (shown at
the end), never silently degraded to single calls.

Offline (no model ids given) it starts ``interlens.testing.FakeProviderServer`` on loopback and points both
providers' ``*_BASE_URL`` at it: the official SDKs, batch files and polling all run for real against it, and
batches are polled every few hundredths of a second instead of the default backoff from 5 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from interlens import APIParticipant, BatchPolicy, ConfigurationError, Conversation

if TYPE_CHECKING:
    from interlens.testing import FakeProviderServer


@contextlib.contextmanager
def providers(offline: bool) -> Iterator[FakeProviderServer | None]:
    """Offline: a fake provider server on loopback, with the environment pointing both SDKs at it."""
    if not offline:
        missing = [v for v in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY") if not os.environ.get(v)]
        if missing:
            sys.exit(f"set {' and '.join(missing)} to reach the real providers (or omit the model ids)")
        yield None
        return
    from interlens.testing import FakeProviderServer

    with FakeProviderServer() as server:
        saved = {name: os.environ.get(name) for name in server.env()}
        os.environ.update(server.env(api_key="sk-offline-example"))
        try:
            yield server
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--openai-model", help="a real OpenAI model id (needs OPENAI_API_KEY)")
    parser.add_argument("--anthropic-model", help="a real Anthropic model id (needs ANTHROPIC_API_KEY)")
    parser.add_argument("-n", "--n", type=int, default=8, help="number of rollouts")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=256, help="output cap per turn")
    parser.add_argument("--out", default="runs/hotdog", help="out_dir for the ledger (resumable)")
    args = parser.parse_args()
    offline = args.openai_model is None and args.anthropic_model is None
    if not offline and (args.openai_model is None or args.anthropic_model is None):
        parser.error("give both --openai-model and --anthropic-model, or neither (offline, fake server)")
    quick = BatchPolicy(poll_initial_s=0.02, poll_max_s=0.1) if offline else None  # None: the defaults

    with providers(offline) as server:
        pro = APIParticipant(
            name="pro",
            provider="openai",
            model_id=args.openai_model or "gpt-test",
            batch=True,
            system_prompt="Argue YES.",
            max_tokens=args.max_tokens,
            batch_policy=quick,
        )
        con = APIParticipant(
            name="con",
            provider="anthropic",
            model_id=args.anthropic_model or "claude-test",
            batch=True,
            system_prompt="Argue NO.",
            max_tokens=args.max_tokens,
            batch_policy=quick,
        )
        conv = Conversation(participants=[pro, con], shared_context="Is a hot dog a sandwich?")
        conv = conv.turns(args.turns)
        report = conv.rollout(n=args.n, out_dir=args.out)  # each round → one batch per speaker

        first = next(iter(report.results.values()))
        if first.transcript is not None:
            for message in first.transcript:
                batch = message.metadata.get("batch_id", "-")
                print(f"  {message.author:>9}: {message.content[:60]!r} (batch {batch})")
        jobs, failed, skipped = len(report.results), len(report.failed), len(report.skipped)
        print(f"jobs: {jobs}  failed: {failed}  skipped(resumed): {skipped}")
        print("provider batches submitted by this run:", report.api_stats.get("batches_submitted"))
        if server is not None:
            print("batches the fake server received:", server.batches_created)

    try:
        APIParticipant(name="x", provider="openrouter", model_id="any/model", batch=True)
    except ConfigurationError as exc:
        print("openrouter with batch=True is refused:", str(exc).split(" (")[0])


if __name__ == "__main__":
    main()
