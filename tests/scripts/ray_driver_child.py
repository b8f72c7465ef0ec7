"""A driver on an existing Ray cluster (``RAY_ADDRESS``) for the resume test, which SIGKILLs it mid-run.

Usage: ``python ray_driver_child.py MODEL OUT_DIR HOLD_DIR`` (see ``ray_recipe``).
"""

from __future__ import annotations

import sys

import ray_recipe

if __name__ == "__main__":
    model, out_dir, hold = sys.argv[1:4]
    conv = ray_recipe.conversation(model, hold).name("r")
    conv.rollout(
        cluster="ray",
        devices=["cpu"],
        out_dir=out_dir,
        batched=False,
        seed=3,
        max_batch_size=1,
        progress=False,
    )
