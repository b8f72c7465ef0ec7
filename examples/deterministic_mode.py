"""Deterministic mode (``batched=False``): the same rollout twice, token-identical, turn by turn.

    python examples/deterministic_mode.py [--model ID_OR_PATH] [-n 4] [--turns 4] [--out runs/deterministic]

Batched co-stepping is the default: local turns of many conversations run as one batched generate, which
trades exact per-row reproducibility for throughput (batch composition perturbs rows; turns are marked
``metadata["batched"]``). ``batched=False`` is ``ExecutionMode.DETERMINISTIC``: each turn is sampled from
its own generator seeded by the participant's ``seed``, the rollout seed and the turn index, so a
conversation is token-identical on the same hardware whatever runs beside it (deterministic turns never
continue a kept KV cache, whatever ``kv_reuse`` says). It is also the only mode with per-turn interp
(capture, steering, probes): see docs/interp.md.

Deterministic turns still co-step where the engine's batch-invariance self-test passed for this model,
device and dtype (``metadata["batch_invariant"]``; docs/deterministic.md): then a turn's tokens are the
same in a batch as alone. The script runs the rollout twice into two ledgers and compares every turn's
text and token count, then once more with one turn per batch (``max_batch_size=1``) to show that
co-stepping changed nothing, and shows the batched default's turn metadata for contrast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from interlens import AutoModelParticipant, Conversation, ExecutionMode, ModelParticipant, RunReport


def co_stepped(report: RunReport) -> str:
    """How many generated turns were co-stepped with others (``metadata["batch_size"]`` > 1), of how many,
    and how many of those are marked ``metadata["batched"]``: tokens that may depend on the batch."""
    turns = [m for res in report.results.values() for m in (res.transcript or [])[1:]]
    together = sum(m.metadata.get("batch_size", 1) > 1 for m in turns)
    marked = sum(bool(m.metadata.get("batched")) for m in turns)
    return f"{together}/{len(turns)} turns generated in a batch of more than one, {marked} marked batched"


def texts(report: RunReport) -> dict[str, list[str]]:
    return {job: [m.content for m in res.transcript or []] for job, res in report.results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="hub id or local path (default: a tiny local test model)")
    parser.add_argument("-n", "--n", type=int, default=4, help="number of rollouts")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="token cap per turn")
    parser.add_argument("--out", default="runs/deterministic", help="parent folder of the runs' ledgers")
    parser.add_argument(
        "--dtype",
        help="float32, bfloat16, ... (default: the checkpoint's); whether deterministic turns co-step "
        "depends on the kernels this CPU runs in that dtype",
    )
    args = parser.parse_args()
    if args.model is None:
        from interlens.testing import tiny_model

        args.model = tiny_model("qwen2")
    out = Path(args.out)

    def speaker(name: str, seed: int) -> ModelParticipant:
        return AutoModelParticipant.from_pretrained(
            args.model,
            name=name,
            temperature=0.9,
            max_new_tokens=args.max_new_tokens,
            seed=seed,  # each turn's generator derives from it
            dtype=args.dtype,
        )

    conv = Conversation([speaker("a", 1), speaker("b", 2)], shared_context="Debate: tabs vs spaces.")
    conv = conv.turns(args.turns)

    first = conv.rollout(n=args.n, batched=False, out_dir=out / "first", seed=0)
    second = conv.rollout(n=args.n, mode=ExecutionMode.DETERMINISTIC, out_dir=out / "second", seed=0)
    identical = 0
    for job_id, res in first.results.items():
        again = second.results[job_id].transcript
        assert res.transcript is not None and again is not None
        turns = [(m.author, m.content, m.n_tokens) for m in res.transcript]
        same = turns == [(m.author, m.content, m.n_tokens) for m in again]
        identical += same
        tokens = [m.n_tokens for m in res.transcript[1:]]
        print(f"{job_id}: tokens per turn {tokens}, rerun identical: {same}")
    print(f"token-identical reruns: {identical}/{len(first.results)}")
    verdicts = {m.metadata.get("batch_invariant") for r in first.results.values() for m in r.transcript[1:]}
    print(f"deterministic: {co_stepped(first)}")
    print(f"batch-invariant (the engine's self-test): {', '.join(sorted(map(str, verdicts)))}")
    alone = conv.rollout(n=args.n, batched=False, max_batch_size=1, out_dir=out / "alone", seed=0)
    print(f"one turn per batch gives the same conversations: {texts(alone) == texts(first)}")

    batched = conv.rollout(n=args.n, out_dir=out / "batched", seed=0)  # the default, for contrast
    print(f"batched (default): {co_stepped(batched)}")
    print("failed:", sum(len(r.failed) for r in (first, second, alone, batched)))


if __name__ == "__main__":
    main()
