"""GSM8K as a data-driven rollout: one conversation per problem, graded against a gold column, resumable.

    python examples/gsm8k_benchmark_rollout.py [--model ID_OR_PATH] [--limit 200] [--out runs/gsm8k]
        [--source auto|hub|bundled]

The full end-to-end pattern of a benchmark:

- the data: ``load_dataset("openai/gsm8k", "main", split="test")`` when the Hugging Face hub is reachable;
  otherwise (offline, ``HF_HUB_OFFLINE=1`` without a cached copy, ``--source bundled``) a small sample in the
  same format shipped next to this script (``data/gsm8k_sample.jsonl``: problems written for this example in
  GSM8K's style, each answer ending ``#### <n>``). Reachability is checked in a second or two, so an
  offline machine does not sit through the hub client's retries;
- a ``gold`` column added with ``Dataset.map`` (computed into Arrow, on disk; rows are still streamed to
  the rollout one at a time, never materialized as Python objects);
- the question templated into the view with ``dataset_field("question")``; the gold answer is NOT: the
  analyzer reads it from ``conv.row["gold"]`` (templating it would leak it to the model);
- the analyzer grades the solver's ``Final answer: <n>`` against it; accuracy is printed;
- ``out_dir`` makes it resumable: rerun the same command and finished problems are skipped.

Without ``--model`` a tiny random-weight model answers (accuracy 0%, every moving part real); with a real
instruct model (``--model Qwen/Qwen2.5-1.5B-Instruct``) the accuracy means something.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from interlens import AutoModelParticipant, Conversation, dataset_field

BUNDLED = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"
_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"


def normalize(number: str) -> str:
    """``"$1,200.00"`` → ``"1200"``: the form gold and predicted answers are compared in."""
    text = number.replace(",", "").replace("$", "").strip().rstrip(".")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def gold_of(answer: str) -> str:
    """GSM8K's answers end with ``#### <n>``."""
    return normalize(answer.rsplit("####", 1)[-1])


def predicted(reply: str) -> str | None:
    """The number after the LAST ``Final answer:`` in the reply, or None when there is none."""
    found = re.findall(rf"final answer:?\s*\**\s*({_NUMBER})", reply, flags=re.IGNORECASE)
    return normalize(found[-1]) if found else None


def grade(conv: Conversation) -> dict[str, Any]:
    """The analyzer: runs in the worker on each finished conversation; only this dict is kept."""
    assert conv.row is not None  # a job of a data-driven rollout always has its row
    answer = predicted(conv.transcript[-1].content)
    gold = conv.row["gold"]
    return {"answer": answer, "gold": gold, "correct": answer == gold}


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the hub's host answers a TCP connect within ``timeout`` seconds (name lookup included)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}:
        return True  # the datasets cache is used as is: a miss fails at once, with no network
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    reachable: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            reachable.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)  # a hung name lookup must not hang the script
    probe.start()
    probe.join(timeout)
    return bool(reachable)


def load_problems(source: str) -> tuple[Any, str]:
    """The GSM8K test split from the hub, or the bundled sample; and where it came from."""
    from datasets import Dataset, load_dataset

    if source in ("auto", "hub"):
        try:
            if not hub_reachable():
                raise ConnectionError("the Hugging Face hub is not reachable from here")
            return load_dataset("openai/gsm8k", "main", split="test"), "openai/gsm8k (hub)"
        except Exception as exc:  # any failure to fetch: auto falls back, hub insists
            if source == "hub":
                raise
            print(f"GSM8K from the hub unavailable ({str(exc).splitlines()[0][:80]}): using {BUNDLED.name}")
    return Dataset.from_json(str(BUNDLED)), f"{BUNDLED.name} (bundled sample)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="hub id or local path (default: a tiny local test model)")
    parser.add_argument("--source", choices=("auto", "hub", "bundled"), default="auto", help="where the data")
    parser.add_argument("--limit", type=int, default=200, help="first N problems at most")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="token cap of the solver's turn")
    parser.add_argument("--out", default="runs/gsm8k", help="out_dir for the ledger (resumable)")
    args = parser.parse_args()
    if args.model is None:
        from interlens.testing import tiny_model

        args.model = tiny_model("qwen2")

    problems, origin = load_problems(args.source)
    problems = problems.select(range(min(args.limit, len(problems))))
    problems = problems.map(lambda row: {"gold": gold_of(row["answer"])})  # a gold column, for the analyzer
    print(f"{len(problems)} problems from {origin}")

    solver = AutoModelParticipant.from_pretrained(
        args.model,
        name="solver",
        system_prompt="Solve it; end with 'Final answer: <n>'.",
        temperature=0.0,
        max_new_tokens=args.max_new_tokens,
    )
    framing = ("Solve this problem.\n\n", dataset_field("question"))  # per row
    report = (
        Conversation(participants=[solver], shared_context=framing)
        .turns(1)
        .data(problems)
        .analyzer(grade)
        .rollout(out_dir=args.out)  # n defaults to len(data); job ids row_00000...
    )

    graded = report.analyses()
    correct = sum(bool(a["correct"]) for a in graded.values())
    for job_id, analysis in list(graded.items())[:3]:
        print(f"  {job_id}: answer={analysis['answer']} gold={analysis['gold']}")
    jobs, failed, skipped = len(report.results), len(report.failed), len(report.skipped)
    print(f"jobs: {jobs}  failed: {failed}  skipped(resumed): {skipped}")
    accuracy = correct / len(graded) if graded else 0.0
    print(f"accuracy: {correct}/{len(graded)} = {accuracy:.1%}")


if __name__ == "__main__":
    main()
