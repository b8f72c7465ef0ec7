"""The recipe of the Ray resume test, importable by name: the driver child and the test build the same
Conversation (a scripted participant's replies are fingerprinted by their import path, ``ray_recipe.reply``).

A row whose context names a hold directory waits in their first scripted reply while ``<dir>/hold`` exists,
after writing ``HOLD`` to the ``<dir>/events`` FIFO: the test learns that it started (on the one worker, one
job at a time, so the rows before it are done) without watching the clock, then kills the driver.
"""

from __future__ import annotations

import os
import time
from typing import Any

from interlens import AutoModelParticipant, Conversation, ScriptedParticipant, dataset_field

_MARK = " hold="


def reply(view: object) -> str:
    context = view.messages[0].content  # type: ignore[attr-defined]
    hold = context.partition(_MARK)[2]
    if hold and os.path.exists(os.path.join(hold, "hold")):
        with open(os.path.join(hold, "events"), "a") as events:
            events.write(f"HOLD {os.getpid()}\n")
        while os.path.exists(os.path.join(hold, "hold")):  # the driver is killed meanwhile
            time.sleep(0.05)
    return f"reply {view.own_turns}"  # type: ignore[attr-defined]


def conversation(model: str, hold: str) -> Conversation:
    """Two rows; row 1 holds while ``<hold>/hold`` exists."""
    settings: dict[str, Any] = {"max_new_tokens": 6, "temperature": 0.9, "kv_reuse": False}
    a = AutoModelParticipant.from_pretrained(model, name="a", **settings)
    s = ScriptedParticipant("s", reply)
    rows = [{"q": f"Debate {i}: tabs vs spaces.{_MARK + hold if i >= 1 else ''}"} for i in range(2)]
    return Conversation([a, s], shared_context=dataset_field("q")).turns(3).data(rows)
