"""The one-shot GPU script, rehearsed on the CPU: every part runs and answers (issue 26).

A GPU machine is lent for one short run, so ``benchmarks/gpu_check.py`` must work the first time: this runs
it here as that machine will (a fresh process, ``python -u``, figures to ``--out``), at the tiny model size,
and reads what it wrote. Parts that need a GPU say they were skipped; part 9 (issue 37) replays the static
decode step through a stand-in graph that checks every buffer's address.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"


def test_the_gpu_check_runs_every_part_on_the_cpu(tmp_path: Path) -> None:
    parts = _run_script(tmp_path, "--rollouts", "2")
    failed = {title: p["error"] for title, p in parts.items() if not p["ok"]}
    assert failed == {}  # each part's error says what went wrong
    by_number = {title.split(" ")[0]: p for title, p in parts.items()}
    assert set(by_number) == {
        "versions", "0.", "0b.", "0c.", "1.", "2.", "3.", "4.", "5.", "6.", "7.", "8.", "9.", "10.",
    }  # fmt: skip
    assert by_number["versions"]["torch"] and by_number["versions"]["transformers"]
    correct = by_number["0."]
    assert correct["batch_equal"] == [True] * 4 and correct["alone_equal"] is True
    assert min(correct["shared_prefix_tokens"]) > 0  # the two prompts with a long common prefix shared it
    # one read a step (the chosen tokens), and the uniforms' block every 16 steps
    assert by_number["0b."] == {
        "batched": 1.0625,
        "deterministic": 1.0625,
        "deterministic_rows_co_step": True,
        "ok": True,
        "seconds": by_number["0b."]["seconds"],
    }
    assert by_number["2."]["skipped"] == "no GPU"
    assert by_number["3."]["failed"] == [f"nan/row_{i:05d}" for i in range(4)]  # the good lineup succeeded
    assert by_number["5."]["failed"] == [] and len(by_number["5."]["cached"]) <= 1  # the first model evicted
    assert by_number["6."]["engine_turns_equal"] == [True, True]
    for dtype in ("float32", "bfloat16"):  # 64 rows, probed at their size, each equal to itself alone
        assert by_number["7."]["engine"][dtype]["equal_to_alone"] == 64, by_number["7."]
    decode = by_number["0c."]["3 layers"]
    assert decode["1"]["engine_tok_s"] > 0 and decode["4"]["generate_tok_s"] > 0
    assert decode["4"]["deterministic_over_batched"] > 0  # the self-test passes on this CPU: rows co-step
    # float32's diagnosis: the self-test's verdict under each attention kernel (here every one passes or
    # cannot run on this device)
    diagnosis = by_number["7."]["float32 diagnosis"]
    assert diagnosis["stock linears, default attention"] is True
    assert diagnosis["chunked linears, math attention"] is True
    assert by_number["8."]["skipped"] == "no GPU"
    _check_graphs_part(by_number["9."])


def test_the_deterministic_part_rehearses_every_piece_on_the_cpu(tmp_path: Path) -> None:
    """Part 10 (issue 37 §2) on a tiny shape: the norm bitwise at every row count, the self-test and the
    16-row bucket's probe passed, deterministic rows co-stepped at 16 rows beside batched ones, through the
    static slot steps a GPU replays as graphs (switched on here: eager on the CPU, and said so)."""
    parts = _run_script(tmp_path, "--parts", "10", env={"INTERLENS_STATIC_DECODE": "1"})
    (title,) = [t for t in parts if t.startswith("10.")]
    part = parts[title]
    assert part["ok"], part.get("error")
    assert part["split_k_off"] is False  # the rehearsal runs without the variables, and says so
    shape = part["3 layers"]
    assert shape["norm"] == {"4": True, "8": True, "16": True}
    # the CPU: stock norms, row blocks; the static slot steps where switched on
    assert shape["layout"] == {"fixed_norms": False, "buckets": False, "static_steps": True}
    tests = shape["self_test"]
    assert [t["passed"] for t in tests.values()] == [True, True] and list(tests)[1] == "16"
    speed = shape["throughput"]["16"]
    assert speed["deterministic"]["batch_size"] == 16 and speed["batched"]["batch_size"] == 16
    assert speed["deterministic"]["failed"] == speed["batched"]["failed"] == 0 and speed["ratio"] > 0
    steps = shape["slot_steps"]
    assert steps["batches"] == 2 and steps["steps: eager: not CUDA"] > 0 and steps["graphs failed"] is None


def _check_graphs_part(graphs: dict[str, Any]) -> None:
    """Part 9's rehearsal (issue 37): every row bucket and variant timed eager and replayed through the
    stand-in graph, which saw no buffer move and no host read in the captured function; the replayed tokens
    (and recorded log-probabilities) equal the eager ones; the loop's figures, the engine's own
    ``generate_batch`` with graphs, eager and against HF ``generate``, and the reduction verdicts."""
    shape = graphs["3 layers"]
    assert shape["length_bucket"] == 256 and shape["prompt"] == 16
    for rows in ("1", "4"):
        for variant in ("greedy", "top_p"):
            step = shape[rows][variant]
            assert "error" not in step, step
            assert step["tokens_equal"] is True and step["steps_compared"] == 8, (rows, variant)
            assert step["buffers_moved"] == 0 and step["capture_syncs"] == 0, (rows, variant)
            assert step["eager_ms"] > 0 and step["graph_ms"] > 0 and step["capture_s"] >= 0
            assert step.get("logprobs_equal") is (True if variant == "top_p" else None)  # recorded or not
    assert shape["graphs"]["count"] == 4
    loop = shape["loop"]
    assert loop["tokens_equal"] is True and loop["rows"] == 4
    assert loop["graph_tok_s"] > 0 and loop["eager_tok_s"] > 0 and loop["generate_tok_s"] > 0
    # the engine's own generate_batch: static steps through the stand-in graphs, the same steps eager, the
    # eager loop and HF generate, the graph sides run once to warm up (capture), then each once timed (the
    # GPU run: 3 times; here the graphs' 2 runs of 7 steps each)
    engine = shape["engine"]
    assert "error" not in engine, engine
    assert engine["rows"] == 4 and engine["repeats"] == 1
    assert engine["tokens_graphs_equal_static_eager"] is True
    assert engine["tokens_graphs_equal_eager_loop"] is True
    assert engine["graphs_stats"]["captures"] == 1 and engine["graphs_stats"]["steps: graph"] == 14
    assert engine["tokens_grouped_equal_sdpa"] is True
    names = ("graphs", "graphs_sdpa", "static_eager", "eager_loop", "generate")
    assert all(engine[f"{name}_tok_s"] > 0 for name in names)
    # a row's mean of squares and norm do not depend on its batch on this CPU
    assert shape["reduction"] == {
        "width": 64,
        "mean_sq": {"4": True, "8": True, "16": True},
        "norm": {"4": True, "8": True, "16": True},
    }


def test_a_part_that_fails_is_recorded_and_the_next_still_runs(tmp_path: Path) -> None:
    """One failure never loses the rest: a part that raises prints its traceback, records its error and
    lets the script go on (run in a process of its own: importing the script registers a worker hook). The
    figures are on disk after each part: a run stopped at the machine's limit keeps what it finished."""
    code = f"""
import json, sys
sys.path.insert(0, {str(SCRIPT.parent)!r})
import gpu_check
gpu_check.RUN["out"] = {str(tmp_path)!r}
with gpu_check.part("broken") as fig:
    fig["before"] = 1
    raise ValueError("a kernel failed")
with gpu_check.part("next") as fig:
    fig["on disk"] = json.load(open({str(tmp_path / "gpu_check.json")!r}))["parts"]["broken"]["error"]
    fig["ran"] = True
print(json.dumps(gpu_check.FIGURES))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["next"]["on disk"] == "ValueError: a kernel failed"
    assert figures["broken"]["ok"] is False and figures["broken"]["before"] == 1
    assert figures["broken"]["error"] == "ValueError: a kernel failed"
    assert "Traceback" in done.stderr and "a kernel failed" in done.stderr
    assert figures["next"]["ok"] is True and figures["next"]["ran"] is True


def test_parts_runs_only_the_parts_named(tmp_path: Path) -> None:
    """``--parts`` reruns the parts a first run found wrong, in what is left of the machine's time."""
    parts = _run_script(tmp_path, "--parts", "0b")
    assert [title.split(" ")[0] for title in parts] == ["versions", "0b."]
    assert parts[next(t for t in parts if t.startswith("0b."))]["batched"] == 1.0625


def _run_script(out: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The script in a fresh process as the GPU machine runs it (``python -u``, figures to ``--out``; ``env``
    on top of this process's environment): the figures it wrote, by part title."""
    done = subprocess.run(
        [sys.executable, "-u", str(SCRIPT), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parts: dict[str, dict[str, Any]] = json.loads((out / "gpu_check.json").read_text())["parts"]
    return parts
