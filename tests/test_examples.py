"""Every example runs, as a user runs it: a subprocess per script, small sizes, its key output lines checked.

The examples are the spec's code blocks made runnable offline (tiny local models, the loopback fake provider
server), so each one doubles as an end-to-end smoke test of the path it shows. They run with the hub forced
offline and a private Hugging Face home, so the GSM8K example takes its documented fallback (the bundled
sample) on every machine. ``examples/steering_debate.py`` has its own test in tests/test_interp.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TESTED_ELSEWHERE = {"steering_debate.py"}  # tests/test_interp.py

# script → (arguments, regexes every one of which must match a line of stdout)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "debate_rollout.py": (
        ["-n", "3", "--turns", "2", "--max-new-tokens", "6"],
        [r"^rollout_0002 → .* \(\d+ tokens\)$", r"^failed: \[\] skipped\(resumed\): 0$"],
    ),
    "data_driven_rollout.py": (
        ["--max-new-tokens", "6"],
        [
            r"^row_00000 +'Motion: Tabs are better than spaces\.' +analysis=\{'motion_id': 'M1', 'turns': 3,",
            r"^row_00003 +'Motion: Monorepos beat many small repositories\.' +analysis=\{'motion_id': 'M4',",
            r"^jobs: 4  failed: 0  skipped\(resumed\): 0$",
        ],
    ),
    "ladder_run.py": (
        ["--turns", "2", "--max-new-tokens", "6"],
        [
            r"^pair_qwen2 +1 +[1-9]\d* +pair_qwen2$",
            r"^solo_llama +1 +[1-9]\d* +solo_llama$",
            r"^quiz_llama +3 +[1-9]\d* +quiz_llama/row_00000$",
            r"^jobs: 10  failed: 0  skipped\(resumed\): 0$",
        ],
    ),
    "analyzers_multi_device.py": (
        ["-n", "4", "--turns", "2", "--max-new-tokens", "6"],
        [
            r"^  rollout_0003 on cpu: \{'n_turns': 3, 'a_stance': ",
            r"^registered analyzer on devices=\['cpu', 'cpu'\]:$",
            r"^  rollout_0003 on cpu: \{'a': .*'worker_pid': \d+\}$",
            r"^worker processes used: 2 \(this process: \d+ not among them: True\)$",
            r"^failed: 0$",
        ],
    ),
    "worker_init.py": (
        ["-n", "4", "--max-new-tokens", "6"],
        [
            r"^rollout_0003: \{'positive_words': \d+, 'classifier_loaded_in': \d+, "
            r"'init_calls_in_this_worker': 1\}",
            r"init calls per process: \{\d+: 1, \d+: 1\}$",
            r"^this process ran the init 0 time\(s\); failed: 0$",
        ],
    ),
    "matched_compute.py": (
        ["-n", "2", "--turns", "2", "--max-new-tokens", "6", "--per-turn", "4"],
        [
            r"^pair: 2 turns, spend per conversation \[\d+, \d+\] → budget \d+$",
            r"^solo rollout_0001: \d+ tokens \(≤ \d+\) in \d+ turns \[",
            r"^ambient TokenBudget\(per_conversation=6\): each conversation spent \[\d, \d\]$",
            r"^failed: 0$",
        ],
    ),
    "api_batch_mode.py": (
        ["-n", "3", "--turns", "2"],
        [
            r"^ +pro: 'reply to Is a hot dog a sandwich\? \[[0-9a-f]{8}\]' \(batch batch_",
            r"^ +con: 'reply to .*' \(batch msgbatch_",
            r"^jobs: 3  failed: 0  skipped\(resumed\): 0$",
            r"^provider batches submitted by this run: 2$",
            r"^batches the fake server received: \{'openai': 1, 'anthropic': 1, 'openrouter': 0\}$",
            r"^openrouter with batch=True is refused: x: OpenRouter has no batch API",
        ],
    ),
    "counterfactual_branches.py": (
        ["--model", "tiny", "-n", "3", "--turns", "4", "--max-new-tokens", "6"],
        [
            r"^parent: 3 debates of 4 turns \(failed 0\)$",
            r"^unchanged branch replays its parent's recorded turns: 3/3$",
            r"^probe on b after turn 2, steered - base: [+-]\d+\.\d+ ± \d+\.\d+ \(95% CI, 3 pairs\)$",
            r"^pairs that diverge at all: [0-3]/3$",
            r"^failed: 0$",
        ],
    ),
    "deterministic_mode.py": (
        ["-n", "2", "--turns", "2", "--max-new-tokens", "5"],
        [
            r"^rollout_0001: tokens per turn \[\d+, \d+\], rerun identical: True$",
            r"^token-identical reruns: 2/2$",
            # co-stepped on the batch-invariant layout: not marked batched (the tokens are each row's alone)
            r"^deterministic: [1-4]/4 turns generated in a batch of more than one, 0 marked batched$",
            r"^batch-invariant \(the engine's self-test\): True$",
            r"^one turn per batch gives the same conversations: True$",
            r"^batched \(default\): ([1-4])/4 turns generated in a batch of more than one, "
            r"\1 marked batched$",
            r"^failed: 0$",
        ],
    ),
}


@pytest.fixture
def example_env(tmp_path: Path) -> dict[str, str]:
    """The user's environment minus provider credentials, with the hub offline and a private HF home."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OPENAI_", "ANTHROPIC_", "OPENROUTER_", "HF_"))
    }
    return env | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PYTHONUNBUFFERED": "1"}


def run_example(script: str, args: list[str], env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def assert_lines(stdout: str, patterns: list[str]) -> None:
    lines = stdout.splitlines()
    for pattern in patterns:
        assert any(re.search(pattern, line) for line in lines), f"no line matches {pattern!r} in:\n{stdout}"


def test_every_example_script_has_a_smoke_test() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == set(CASES) | TESTED_ELSEWHERE | {"gsm8k_benchmark_rollout.py"}


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs_offline(
    script: str, example_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    args, patterns = CASES[script]
    if script == "deterministic_mode.py":  # co-stepped turns are shown in the dtype that co-steps here
        args = [*args, "--dtype", request.getfixturevalue("co_step_dtype")]
    stdout = run_example(script, [*args, "--out", str(tmp_path / "run")], example_env, tmp_path)
    assert_lines(stdout, patterns)


def test_gsm8k_falls_back_to_the_bundled_sample_grades_and_resumes(
    example_env: dict[str, str], tmp_path: Path
) -> None:
    args = ["--limit", "4", "--max-new-tokens", "6", "--out", str(tmp_path / "gsm8k")]
    first = run_example("gsm8k_benchmark_rollout.py", args, example_env, tmp_path)
    assert_lines(
        first,
        [
            r"^GSM8K from the hub unavailable \(.*\): using gsm8k_sample\.jsonl$",
            r"^4 problems from gsm8k_sample\.jsonl \(bundled sample\)$",
            r"^  row_00000: answer=\S+ gold=18$",  # the gold column, read by the analyzer from conv.row
            r"^  row_00002: answer=\S+ gold=205$",
            r"^jobs: 4  failed: 0  skipped\(resumed\): 0$",
            r"^accuracy: [0-4]/4 = \d+\.\d%$",
        ],
    )
    again = run_example("gsm8k_benchmark_rollout.py", args, example_env, tmp_path)
    assert_lines(again, [r"^jobs: 4  failed: 0  skipped\(resumed\): 4$", r"^accuracy: [0-4]/4 = "])


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gsm8k_grading_reads_the_last_final_answer_and_normalizes_numbers() -> None:
    gsm8k = load_example("gsm8k_benchmark_rollout")
    assert gsm8k.gold_of("He has 3 * 4 = <<3*4=12>>12 apples.\n#### 1,200") == "1200"
    assert gsm8k.predicted("So 2 + 2 = 4.\nFinal answer: $1,200.") == "1200"
    assert gsm8k.predicted("Final answer: 3. No wait. Final answer: **-7.50**") == "-7.5"
    assert gsm8k.predicted("the answer is 12") is None
    rows = [json.loads(line) for line in (EXAMPLES / "data" / "gsm8k_sample.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all(set(r) == {"question", "answer"} for r in rows)
    assert all(re.fullmatch(r"-?\d+", gsm8k.gold_of(r["answer"])) for r in rows)  # GSM8K's "#### <n>" format


def test_notebook_runs_in_a_jupyter_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbclient  # the test extra installs both
    import nbformat

    for name in list(os.environ):
        if name.startswith(("OPENAI_", "ANTHROPIC_", "OPENROUTER_")):
            monkeypatch.delenv(name)
    notebook = nbformat.read(EXAMPLES / "rollout_in_a_notebook.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on the first cell that fails

    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert [out for out in outputs if out.output_type == "error"] == []
    stdout = "".join(out.text for out in outputs if out.output_type == "stream" and out.name == "stdout")
    results = [out.data.get("text/plain", "") for out in outputs if out.output_type == "execute_result"]
    assert_lines(
        stdout,
        [
            r"^async rollout: 4 jobs, 0 failed$",
            r"^RunResult\('rollout_0000', ok, tokens=\d+, device='cpu'\)$",
            r"^ +b: ",
            r"^sync rerun: skipped \(resumed\) 4 of 4$",
            r"^sync rollout: 2 jobs, 0 failed, [1-9]\d* tokens$",
        ],
    )
    assert "<RunReport jobs=4 done=4 failed=0 skipped=0 out_dir='runs/notebook'>" in results
    # The progress bar: a widget when ipywidgets is installed, else text on stderr; either way it drew.
    stderr = "".join(out.text for out in outputs if out.output_type == "stream" and out.name == "stderr")
    widgets = [out for out in outputs if "application/vnd.jupyter.widget-view+json" in out.get("data", {})]
    assert widgets or re.search(r"rollouts: 100%.*4/4", stderr), stderr
    assert (tmp_path / "runs" / "notebook" / "ledger.sqlite").is_file()
