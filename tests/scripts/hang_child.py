"""A rollout that hangs in user code, for tests/test_overnight_cases.py: ``python hang_child.py OUT WHERE``.

WHERE is ``analyzer`` (a sync analyzer blocks forever on one job) or ``participant`` (a scripted participant's
callable blocks forever on one job). Every other job finishes; the child prints ``HUNG`` when the blocked call
starts, so the test knows when to press Ctrl-C, and ``FINISHED [failed ids]`` if the rollout returns.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from interlens import Conversation, ScriptedParticipant, dataset_field

FOREVER = threading.Event()  # never set


def reply(view: Any) -> str:
    if sys.argv[2] == "participant" and "row 3" in view.messages[0].content:
        print("HUNG", flush=True)
        FOREVER.wait()
    return "fine"


def analyze(conv: Conversation) -> dict[str, int]:
    if sys.argv[2] == "analyzer" and conv.row["i"] == 3:
        print("HUNG", flush=True)
        FOREVER.wait()
    return {"i": conv.row["i"]}


def main() -> None:
    conv = (
        Conversation(
            participants=[ScriptedParticipant("a", reply)], shared_context=("row ", dataset_field("i"))
        )
        .turns(1)
        .data([{"i": i} for i in range(6)])
        .analyzer(analyze)
    )
    limit = float(sys.argv[3]) if len(sys.argv) > 3 else None
    report = conv.rollout(out_dir=sys.argv[1], progress=False, analyzer_timeout=limit, turn_timeout=limit)
    print("FINISHED", sorted(report.failed), flush=True)


if __name__ == "__main__":
    main()
