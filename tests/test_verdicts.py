"""The batch-invariance self-test's verdicts kept on disk (engine._verdicts): a later engine, in this process
or a fresh one, reads its verdict and runs no self-test; any change to what the verdict depends on, a corrupt
file or a model with hooks runs it again; and the tokens are the same with a kept verdict as with a fresh one.

The evidence that a self-test ran is the number of decode steps the engine's runner took: a deterministic
batch with the self-test takes the self-test's probe steps on top of its own, and the batch again takes
only its own (counted, not timed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from verdict_testkit import CountingEngine, counted_requests

from interlens.engine._batch_invariance import probe_definition
from interlens.engine._generation import GenerationRequest, LocalEngine
from interlens.engine._verdicts import VERDICT_FORMAT, VerdictKey, verdict_dir
from interlens.scheduler import ExecutionMode
from interlens.testing import tiny_model

DET = ExecutionMode.DETERMINISTIC
CHILD = Path(__file__).parent / "scripts" / "verdict_child.py"
_FIELDS = ("invariant", "fixed_linear_rows")


@pytest.fixture(autouse=True)
def verdicts_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("INTERLENS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "batch-invariance"


def _engine(dtype: str) -> CountingEngine:
    path = tiny_model("qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return CountingEngine(model, AutoTokenizer.from_pretrained(path), device="cpu")


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def test_a_fresh_engine_reads_its_verdicts_and_runs_no_self_test_nor_size_probe(
    co_step_dtype: str, verdicts_here: Path
) -> None:
    """20 rows: the self-test (at most 12 rows) and the probe at 20 rows both run once, are kept, and a new
    engine over a newly loaded model takes only its own batch's steps, with the same tokens."""
    requests = counted_requests(20)
    first = _engine(co_step_dtype)
    cold, tokens = first.steps_of(requests)
    warm, again = first.steps_of(requests)  # the verdicts in memory: the batch's own steps only
    assert again == tokens and cold > warm
    assert verdict_dir() == verdicts_here and len(_files(verdicts_here)) == 2  # the self-test; 20 rows
    assert sorted(p.suffix for p in verdicts_here.iterdir()) == [".json", ".json"]  # no temporary file left
    kept = [json.loads(p.read_text()) for p in _files(verdicts_here)]
    assert sorted(k["parts"]["probe"]["rows"] or 0 for k in kept) == [0, 20]
    assert {k["format"] for k in kept} == {VERDICT_FORMAT}
    assert all(k["verdict"]["invariant"] is True for k in kept)

    second = _engine(co_step_dtype)
    assert second.steps_of(requests) == (warm, tokens)  # read from disk: no self-test, no probe
    assert second.batch_invariant is True
    assert second._slots.fixed_linear_rows == first._slots.fixed_linear_rows
    assert second._invariant_rows == first._invariant_rows == 20


def test_a_fresh_process_reads_the_verdict_the_first_one_kept(
    co_step_dtype: str, verdicts_here: Path
) -> None:
    args = [sys.executable, str(CHILD), tiny_model("qwen2"), co_step_dtype, "5"]
    env = os.environ | {"INTERLENS_CACHE_DIR": str(verdicts_here.parent)}
    runs = []
    for _ in range(2):
        done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (cold, warm), (read, warm_again) = runs[0]["steps"], runs[1]["steps"]
    assert cold > warm == read == warm_again  # the second process ran no self-test
    assert runs[0]["tokens"] == runs[1]["tokens"] and runs[0]["invariant"] is runs[1]["invariant"] is True
    assert runs[1]["sizes"] == [5] * 5


class Kept:
    """One engine's cold and warm step counts, its tokens and the verdict file its self-test kept."""

    def __init__(self, dtype: str, requests: list[GenerationRequest], folder: Path) -> None:
        engine = _engine(dtype)
        self.cold, self.tokens = engine.steps_of(requests)
        self.warm, _ = engine.steps_of(requests)
        (path,) = _files(folder)
        self.name, self.text = path.name, path.read_text()

    def put(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / self.name).write_text(self.text)
        return folder / self.name


@pytest.fixture(scope="module")
def kept(co_step_dtype: str, tmp_path_factory: pytest.TempPathFactory) -> Kept:
    """The self-test's verdict for 5 rows of the tiny model, run once for the module's tests."""
    folder = tmp_path_factory.mktemp("kept")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("INTERLENS_CACHE_DIR", str(folder))
        return Kept(co_step_dtype, counted_requests(5), folder / "batch-invariance")


@pytest.mark.parametrize("change", ["dtype", "threads", "weights", "layout"])
def test_a_verdict_kept_for_another_key_is_not_used(
    change: str, co_step_dtype: str, verdicts_here: Path, monkeypatch: pytest.MonkeyPatch, kept: Kept
) -> None:
    requests = counted_requests(5)
    kept.put(verdicts_here)
    assert _engine(co_step_dtype).steps_of(requests) == (kept.warm, kept.tokens)  # the kept one serves
    dtype = co_step_dtype
    if change == "dtype":
        dtype = "bfloat16" if co_step_dtype == "float32" else "float32"
    elif change == "threads":
        threads = torch.get_num_threads()
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)  # what the key reads; no real pool
    elif change == "layout":
        from interlens.engine import _slot_rows

        monkeypatch.setattr(_slot_rows, "DECODE_CHUNK_ROWS", _slot_rows.DECODE_CHUNK_ROWS * 2)
    engine = _engine(dtype)
    if change == "weights":
        with torch.no_grad():
            next(engine.model.parameters()).view(-1)[0] += 1.0  # one sampled element of another checkpoint
    steps, _ = engine.steps_of(requests)
    rerun, _ = engine.steps_of(requests)
    assert steps > rerun and kept.cold > kept.warm  # the self-test ran again
    assert len(_files(verdicts_here)) == 2  # and kept its verdict beside the first


def _plant(engine: LocalEngine, verdict: dict[str, bool], **changed: Any) -> Path:
    """Write ``verdict`` where ``engine``'s self-test verdict is looked up, its stored key's parts changed by
    ``changed`` (none: the engine's very key)."""
    key, _ = engine._verdicts.lookup({"rows": None, **probe_definition()}, _FIELDS)
    assert key is not None
    parts = key.parts | changed
    key.path.parent.mkdir(parents=True, exist_ok=True)
    key.path.write_text(json.dumps({"format": VERDICT_FORMAT, "parts": parts, "verdict": verdict}))
    return key.path


def test_the_kept_verdict_decides_and_one_whose_stored_key_differs_anywhere_is_ignored(
    co_step_dtype: str,
) -> None:
    """A verdict on disk is authoritative for its exact key (planted False: the rows run alone, no self-test),
    and ignored when the key it stores differs in any part, even in a file of the right name."""
    requests = counted_requests(5)
    engine = _engine(co_step_dtype)
    _plant(engine, {"invariant": False, "fixed_linear_rows": False})
    assert engine.batch_invariant is False
    results = engine.generate_batch(requests, mode=DET)
    assert [r.batch_size for r in results] == [1] * 5  # type: ignore[union-attr]

    other = _engine(co_step_dtype)
    path = _plant(other, {"invariant": False, "fixed_linear_rows": False}, threads=999)
    assert other.batch_invariant is True  # the self-test ran: the stored key is another machine's
    assert json.loads(path.read_text())["parts"]["threads"] == torch.get_num_threads()  # rewritten


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other format", "not bools", "a folder"])
def test_a_corrupt_or_foreign_file_is_a_miss_and_is_written_anew(
    damage: str, co_step_dtype: str, verdicts_here: Path, kept: Kept
) -> None:
    requests = counted_requests(5)
    cold, warm, tokens, whole = kept.cold, kept.warm, kept.tokens, kept.text
    path = kept.put(verdicts_here)
    if damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "truncated":
        path.write_text(whole[: len(whole) // 2])
    elif damage == "other format":
        path.write_text(whole.replace(f'"format": {VERDICT_FORMAT}', '"format": 99'))
    elif damage == "not bools":
        path.write_text(whole.replace('"invariant": true', '"invariant": "yes"'))
    else:
        path.unlink()
        path.mkdir()  # unreadable as a file, and the write cannot replace it: the engine still runs
    engine = _engine(co_step_dtype)
    assert engine.steps_of(requests) == (cold, tokens)  # the self-test ran, the same tokens
    if damage != "a folder":
        assert path.read_text() == whole  # written anew, whole
    assert engine.steps_of(requests) == (warm, tokens)


def test_a_model_with_hooks_neither_reads_nor_keeps_a_verdict(
    co_step_dtype: str, verdicts_here: Path, kept: Kept
) -> None:
    """A hook computes what the weights do not say: the batch-dependent kernel below fails the self-test
    although the very same weights passed it, and nothing is kept for the hooked model."""
    kept.put(verdicts_here)
    before = {p: p.read_text() for p in _files(verdicts_here)}
    engine = _engine(co_step_dtype)
    engine.model.lm_head.register_forward_hook(lambda _m, _i, out: out + 0.25 * (out.shape[0] - 1))
    assert engine.batch_invariant is False
    assert {p: p.read_text() for p in _files(verdicts_here)} == before


def test_a_verdict_key_is_its_parts_digest_and_json_native() -> None:
    key = VerdictKey({"probe": {"rows": (1, 2)}, "threads": 4})
    assert key.parts == {"probe": {"rows": [1, 2]}, "threads": 4}
    assert key.path.parent == verdict_dir() and key.path.suffix == ".json"
    assert VerdictKey({"threads": 4, "probe": {"rows": [1, 2]}}).path == key.path
    assert VerdictKey({"probe": {"rows": [1, 2]}, "threads": 5}).path != key.path
