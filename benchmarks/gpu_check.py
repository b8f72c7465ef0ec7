"""The GPU check (issues 15, 26): one short script for a lent GPU machine, under 10 minutes on one H200.

    python -u benchmarks/gpu_check.py [--size bench] [--rollouts 16] [--mem-fraction 0.003] [--out DIR]

Each part runs in its own ``try`` (``part``): a failure prints its traceback, is recorded, and the next part
runs. ``--out`` (default ``$OUT``) gets ``gpu_check.json``: every part's figures, ``ok``, ``error`` and
seconds. Read it with ``docs/gpu.md``. Parts, each printing what it saw and the memory in use per GPU:

versions. Python, CUDA and the packages the image has (a missing one is null), checked before anything runs.
0. Greedy tokens vs HF ``generate`` in float32 on the first device: one batch of mixed lengths whose first
   two prompts share a long prefix, and a batch of one; every row must match.
0b. Host syncs per decode step, batched and deterministic (CUDA: ``torch.cuda.set_sync_debug_mode``; CPU:
   the calls that would sync, counted as they pass torch's dispatch). 1 is the floor.
0c. Decode: the engine's batched generation against HF ``generate`` (tok/s, ms a step) on random models of
   Qwen2.5-0.5B and -3B shapes built on the GPU in bfloat16, batches of 1/16/64/256, 128-token prompts, 64
   new tokens (``_gpu_parts.decode_bench``; the rehearsal: a 3-layer shape, batches 1 and 4), and
   deterministic rows against batched ones where the self-test passes.
1. A 2-worker rollout: two GPUs (or two workers on one GPU, or two CPU workers without a GPU). Each job's
   analyzer reports its worker's device as the worker sees it (``interlens.worker_device()``, "cuda:0" in
   every CUDA worker), ``CUDA_VISIBLE_DEVICES`` and the torch memory it holds.
2. An induced OOM (GPU only): each worker caps its allocator (``torch.cuda.set_per_process_memory_fraction``
   in an init hook) and a batch of long prompts must be split until it fits; prints the batch sizes used.
3. A NaN model next to a good one in one ``interlens.run``: the good lineup must succeed; the NaN one must
   fail with a clear error (or, before the NaN check, poison its worker, which is then replaced).
4. Steering + capture: live on the first device, and inside a deterministic 2-worker rollout.
5. Eviction: two models one after the other on one device; the first must be gone when the second runs.
6. Cross-turn KV reuse and shared-prefix prefill on the first device (issue 14): rows sharing a long prefix,
   then their next turns reusing the kept caches, against the same engine with reuse off (float32: tokens
   should be equal; a mismatch here says the layouts' masks or positions differ on this device's kernels);
   then an 8-turn debate rollout with ``kv_reuse`` on and off (the model's dtype), wall time and reuse share.
7. Deterministic co-stepping on the first device (issue 14): the engine's batch-invariance self-test on the
   slot layout in float32 and bfloat16 (its verdict and cost), a deterministic batch of 64 rows against each
   row alone (token-identical only if the verdict is True; 64 rows are probed at their size first), and a
   4-turn deterministic rollout's throughput against the batched one; then, in float32, the self-test's
   verdict with stock and chunked linear layers under each attention kernel (which one breaks invariance).
8. A real device-side assert (GPU only): the first job to reach its analyzer indexes out of range on its
   worker's GPU; the worker must exit and its jobs be retried on a fresh one (no job fails).
9. Decode steps as CUDA graphs (issue 37; run first, right after ``versions``): the static decode step
   (``engine/_static_step.py``) on part 0c's shapes in bfloat16, 128-token prompts, 1/16/64/256 rows, greedy
   and seeded nucleus rows with recording: eager ms a step against the hand-captured graph's replay (CUDA
   events), capture seconds and the shared pool's memory, tokens graph = eager, the whole loop at 16 rows
   against HF ``generate``, and the norms' reductions bitwise across row counts (``_gpu_graphs``; the
   rehearsal: a 3-layer shape, 1 and 4 rows, a stand-in graph that checks the buffers' addresses).

10. Deterministic rows on the GPU (issue 37 §2, ``_gpu_deterministic``, <= 3 minutes): on part 0c's shapes,
   the fixed-order norm bitwise at 4/8/16 rows, the self-test and each row bucket's probe (16/64/256), and
   deterministic / batched throughput at 16, 64 and 256 rows. Run it with cuBLAS's split-K off, as a
   deterministic worker process is started: ``CUBLAS_WORKSPACE_CONFIG=:16:8 CUBLASLT_WORKSPACE_SIZE=1
   python3 -u benchmarks/gpu_check.py --parts 10 --out "$OUT"`` (a process of its own: the variables hold
   process-wide and would change the other parts' batched figures).

The GPU session of issue 37 runs, with ``.whl`` carried (``gpu_wheels.sh``, rebuilt from this tree), one
command of ``timeout_s`` 540 (part 9 ~3-6 minutes, then part 0c's engine and deterministic figures beside it):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && PYTHONPATH=/tmp/site python3 -u benchmarks/gpu_check.py --parts 9,0c --out "$OUT"

Without network on the GPU machine, the wheels the image lacks travel with the tree: ``gpu_wheels.sh``.

The model is a real architecture built locally (``interlens.testing.tiny_model``: qwen2, random weights;
``--size bench`` is ~27M parameters). Without a GPU every part still runs on the CPU (the GPU-only parts say
they are skipped), which is how the test suite runs it (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _gpu_deterministic import deterministic_bench
from _gpu_graphs import graphs_bench
from _gpu_parts import (
    REHEARSAL_SHAPE,
    SHAPES,
    decode_bench,
    deterministic_check,
    generate_check,
    invariance_diagnosis,
    kv_reuse_check,
    syncs_check,
    versions,
)

import interlens
from interlens import AutoModelParticipant, Conversation, SteeringSpec
from interlens.testing import tiny_model

_FRACTION_VAR = "INTERLENS_GPU_CHECK_MEM_FRACTION"


def cap_memory() -> None:
    """Init hook: in a CUDA worker, cap the allocator when the OOM part asks (through the environment)."""
    fraction = os.environ.get(_FRACTION_VAR)
    device = interlens.worker_device() or ""
    if fraction and device.startswith("cuda"):
        import torch

        torch.cuda.set_per_process_memory_fraction(float(fraction), 0)


interlens.register_worker_init(cap_memory)


def where_am_i(conv: Conversation) -> dict[str, Any]:
    import torch

    device = interlens.worker_device() or ""
    cuda = device.startswith("cuda")
    return {
        "pid": os.getpid(),
        "worker_device": device,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "threads": torch.get_num_threads(),
        "allocated_mib": torch.cuda.memory_allocated(0) / 2**20 if cuda else None,
        # two workers on one GPU: 0.5 each (the scheduler's share), and the allocator's configuration
        "memory_fraction": torch.cuda.get_per_process_memory_fraction(0) if cuda else None,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


_FAULT_DIR_VAR = "INTERLENS_GPU_CHECK_FAULT_DIR"


def fault_once(conv: Conversation) -> dict[str, Any]:
    """Analyzer: the first job to get here (a flag file created exclusively) triggers a REAL device-side
    assert on its worker's GPU (an out-of-range index on the device), which leaves the worker's CUDA context
    unusable: the worker must exit and its jobs be retried on a fresh one, where this job then passes."""
    import torch

    try:
        os.close(os.open(os.path.join(os.environ[_FAULT_DIR_VAR], "faulted"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return {"pid": os.getpid()}
    device = interlens.worker_device() or "cuda:0"
    x = torch.zeros(4, device=device)
    x[torch.tensor([10], device=device)] = 1.0
    torch.cuda.synchronize()
    return {"pid": os.getpid(), "faulted": "no assert came"}


def activations(conv: Conversation) -> dict[str, Any]:
    records = list(conv.turn_activations("a", layers=[0]))
    return {
        "records": len(records),
        "shapes": [list(r.answer.shape) for r in records],
        "device": str(records[0].answer.device) if records else None,
        "steered turns": sum(1 for m in conv.transcript[1:] if m.metadata.get("steering")),
    }


def gpu_memory() -> str:
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        return "; ".join(f"GPU {line}" for line in out.splitlines()) or "nvidia-smi printed nothing"
    return "no GPU (nvidia-smi not found)"


#: What each part saw, by part title: written to ``gpu_check.json`` under ``--out`` at the end.
FIGURES: dict[str, dict[str, Any]] = {}


@contextmanager
def part(title: str) -> Iterator[dict[str, Any]]:
    """One part of the check: its figures go in the dict it yields; an exception is printed and recorded as
    the part's error, and the script goes on to the next part (one failure never loses the rest)."""
    print(f"\n== {title}", flush=True)
    figures: dict[str, Any] = {}
    FIGURES[title] = figures
    started = time.perf_counter()
    try:
        yield figures
        figures["ok"] = True
    except Exception as exc:
        traceback.print_exc()
        figures.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        figures["seconds"] = round(time.perf_counter() - started, 2)
        write_figures()
        sys.stdout.flush()


#: Where ``write_figures`` puts ``gpu_check.json`` (``--out``), and when the run started.
RUN: dict[str, Any] = {"out": None, "started": time.perf_counter()}


def write_figures() -> None:
    """Rewrites ``gpu_check.json`` after every part: a run stopped at the machine's time limit still brings
    back the figures of every part it finished."""
    if RUN["out"]:
        out = Path(RUN["out"]) / "gpu_check.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        total = round(time.perf_counter() - RUN["started"], 1)
        out.write_text(json.dumps({"total_seconds": total, "parts": FIGURES}, indent=2, default=str))


def debate(path: str, *, new_tokens: int, name: str, **settings: Any) -> Conversation:
    a = AutoModelParticipant.from_pretrained(path, name="a", max_new_tokens=new_tokens, **settings)
    b = AutoModelParticipant.from_pretrained(path, name="b", max_new_tokens=new_tokens, **settings)
    return Conversation(participants=[a, b], shared_context="Debate: tabs vs spaces.").turns(4).name(name)


def nan_model(path: str, into: str) -> str:
    """A copy of the model whose final norm is NaN: every logit is NaN."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.get_decoder().norm.weight.fill_(float("nan"))
    model.save_pretrained(into)
    AutoTokenizer.from_pretrained(path).save_pretrained(into)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default=None, help="tiny_model size (default: bench on GPU, tiny on CPU)")
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--mem-fraction", type=float, default=0.003, help="allocator cap for the OOM part")
    parser.add_argument(
        "--parts", default=None, help="comma-separated part numbers to run, e.g. 0c,7,8 (default: all)"
    )
    parser.add_argument(
        "--out", default=os.environ.get("OUT"), help="where gpu_check.json goes (default: $OUT, else nowhere)"
    )
    args = parser.parse_args()
    RUN["out"] = args.out
    chosen = {p.strip() for p in args.parts.split(",")} if args.parts else None

    def wanted(key: str) -> bool:
        return chosen is None or key in chosen

    with part("versions") as fig:
        fig.update(versions())

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    size = args.size or ("bench" if gpus else "tiny")
    devices = ["cuda:0", "cuda:1"] if gpus >= 2 else (["cuda:0", "cuda:0"] if gpus else ["cpu", "cpu"])
    print(f"torch {torch.__version__}, {gpus} GPU(s), devices={devices}, model size {size!r}")
    print(f"memory: {gpu_memory()}")
    path = tiny_model("qwen2", size=size)
    llama = tiny_model("llama", size=size)
    started = time.perf_counter()
    first = devices[0]

    if wanted("9"):  # first: issue 37's figures before anything else takes the machine's time
        with part(f"9. decode steps as CUDA graphs on {first}") as fig:
            if gpus:
                graphs_bench(
                    path, first, SHAPES, [1, 16, 64, 256], prompt=128, warm=20, timed=50, check=32,
                    loop_rows=16, loop_new=64, figures=fig, flush=write_figures,
                )  # fmt: skip
            else:  # the rehearsal: part 0c's small shape and batches, a stand-in graph
                graphs_bench(
                    path, first, REHEARSAL_SHAPE, [1, 4], prompt=16, warm=2, timed=4, check=8,
                    loop_rows=4, loop_new=8, figures=fig, flush=write_figures, engine_repeats=1,
                )  # fmt: skip

    if wanted("10"):  # issue 37 section 2, after part 9: run with the split-K variables (docstring)
        with part(f"10. deterministic rows: self-test per bucket, vs batched on {first}") as fig:
            if gpus:
                deterministic_bench(
                    path, first, SHAPES, buckets=[1, 16, 64, 256], rows=[16, 64, 256], prompt=128, new=32,
                    figures=fig, flush=write_figures,
                )  # fmt: skip
            else:  # the rehearsal: a tiny shape, small buckets
                deterministic_bench(
                    path, first, REHEARSAL_SHAPE, buckets=[1, 16], rows=[16], prompt=16, new=4,
                    figures=fig, flush=write_figures,
                )  # fmt: skip

    if wanted("0"):
        with part(f"0. greedy tokens vs HF generate, float32 on {first}") as fig:
            fig.update(generate_check(path, first))

    if wanted("0b"):
        with part(f"0b. host syncs per decode step on {first}") as fig:
            fig.update(syncs_check(path, first))

    if wanted("0c"):
        with part(f"0c. decode: the engine vs HF generate on {first}") as fig:
            if gpus:
                fig.update(decode_bench(path, first, SHAPES, [1, 16, 64, 256], new=64, prompt=128))
            else:  # the rehearsal: the tiny model's own shape, small batches
                fig.update(decode_bench(path, first, REHEARSAL_SHAPE, [1, 4], new=8, prompt=16))

    if wanted("1"):
        with part(f"1. a 2-worker rollout on {devices}") as fig:
            t0 = time.perf_counter()
            report = (
                debate(path, new_tokens=32, name="two")
                .analyzer(where_am_i)
                .rollout(n=args.rollouts, devices=devices)
            )
            seconds = time.perf_counter() - t0
            tokens = sum(r.tokens_generated for r in report.results.values())
            print(f"{len(report.results)} jobs, failed {report.failed}, {tokens} tokens in {seconds:.1f} s")
            fig.update(jobs=len(report.results), failed=report.failed, tok_s=round(tokens / seconds, 1))
            seen = Counter(
                (r.device, a["worker_device"], a["visible"], a["threads"], a["pid"], a["memory_fraction"])
                for r in report.results.values()
                if (a := r.analysis)
            )
            for (device, inner, visible, threads, pid, share), count in sorted(seen.items()):
                print(
                    f"  {count} jobs on {device!r}: pid {pid} sees {inner!r}, "
                    f"CUDA_VISIBLE_DEVICES={visible}, torch threads {threads}, memory fraction {share}"
                )
            fig["workers"] = [list(key) for key in seen]
            print(f"memory: {gpu_memory()}")

    if wanted("2"):
        with part("2. an induced OOM") as fig:
            if gpus:
                os.environ[_FRACTION_VAR] = str(args.mem_fraction)
                try:
                    a = AutoModelParticipant.from_pretrained(path, name="a", max_new_tokens=16)
                    long = (
                        Conversation(participants=[a], shared_context="tabs or spaces? " * 400)
                        .turns(1)
                        .name("oom")
                    )
                    t0 = time.perf_counter()
                    report = long.rollout(n=64, devices=devices, max_batch_size=64, seed=1)
                    sizes = Counter(
                        m.metadata.get("batch_size")
                        for r in report.results.values()
                        for m in r.transcript[1:]
                    )
                    errors = Counter(r.error.type for r in report.results.values() if r.error is not None)
                    took = time.perf_counter() - t0
                    print(f"{len(report.results)} jobs in {took:.1f} s; batch sizes {dict(sizes)}")
                    print(f"failed: {len(report.failed)} {dict(errors)}")
                    fig.update(batch_sizes=dict(sizes), failed=len(report.failed))
                finally:
                    os.environ.pop(_FRACTION_VAR, None)
            else:
                print("skipped: no GPU (the OOM bisection is tested on CPU with injected OOMs)")
                fig["skipped"] = "no GPU"
            print(f"memory: {gpu_memory()}")

    if wanted("3"):
        with part("3. a NaN model next to a good one") as fig:
            with tempfile.TemporaryDirectory() as tmp:
                bad = nan_model(path, os.path.join(tmp, "nan"))
                good = debate(path, new_tokens=16, name="good").turns(2)
                broken = debate(bad, new_tokens=16, name="nan").turns(2)
                t0 = time.perf_counter()
                report = interlens.run(
                    [good.data([{}] * 4), broken.data([{}] * 4)], devices=devices, max_attempts=2
                )
                print(f"{len(report.results)} jobs in {time.perf_counter() - t0:.1f} s")
                for job_id, res in sorted(report.results.items()):
                    what = "ok" if res.error is None else f"{res.error.type}: {res.error.message[:300]}"
                    print(f"  {job_id}: {what}")
                fig["failed"] = sorted(report.failed)
            print(f"memory: {gpu_memory()}")

    if wanted("4"):
        with part("4. steering + capture") as fig:
            from transformers import AutoConfig

            d_model = AutoConfig.from_pretrained(path).hidden_size
            spec = SteeringSpec(torch.ones(d_model), layers=[0], coef=2.0)
            a = AutoModelParticipant.from_pretrained(path, name="a", max_new_tokens=8, device=first)
            b = AutoModelParticipant.from_pretrained(path, name="b", max_new_tokens=8, device=first)
            conv = Conversation(participants=[a, b], shared_context="Say something.")
            with conv.capture(layers=[0, 1]) as cache:
                message = conv.step("a", steering=spec)
            record = next(iter(cache))
            shape, where = list(record.answer.shape), record.answer.device
            print(f"live on {first}: {len(cache)} records, answer {shape} on {where}")
            fig.update(records=len(cache), answer_shape=shape)
            print(f"  steering metadata: {message.metadata.get('steering')}")
            steered = debate(path, new_tokens=8, name="steered").turns(2)
            held = [p.set(steering=spec) if p.name == "a" else p for p in steered.participants]
            steered = Conversation(participants=held, shared_context="Debate: tabs vs spaces.").turns(2)
            report = steered.analyzer(activations).rollout(n=4, devices=devices, batched=False)
            for job_id, res in sorted(report.results.items()):
                seen = res.analysis if res.error is None else res.error.message[:200]
                print(f"  {job_id} on {res.device}: {seen}")
            fig["rollout_failed"] = sorted(report.failed)
            print(f"memory: {gpu_memory()}")

    if wanted("5"):
        with part("5. eviction: two models, one after the other, on one device") as fig:
            report = interlens.run(
                [
                    debate(path, new_tokens=8, name="first").turns(2).analyzer(where_am_i),
                    debate(llama, new_tokens=8, name="second").turns(2).analyzer(where_am_i),
                ],
                devices=[first],
                max_batch_size=1,
            )
            # the worker's allocated memory as each job ended: the second model's jobs must not hold both
            held = {
                job_id: round(r.analysis["allocated_mib"], 1)
                for job_id, r in sorted(report.results.items())
                if r.analysis and r.analysis["allocated_mib"] is not None
            }
            print(f"  worker memory (MiB allocated) at each job's end: {held}")
            fig["allocated_mib"] = held
            from interlens.engine._model_cache import cached_engines

            gc.collect()
            names = [os.path.basename(e.model.config._name_or_path) for e in cached_engines()]
            print(f"failed {report.failed}; models still cached after the run: {names}")
            fig.update(failed=sorted(report.failed), cached=names)
            print(f"memory: {gpu_memory()}")

    if wanted("6"):
        with part(f"6. KV reuse and shared-prefix prefill on {first}") as fig:
            fig["engine_turns_equal"] = kv_reuse_check(path, first)
            for reuse in (True, False):
                conv = debate(path, new_tokens=32, name=f"reuse_{reuse}", kv_reuse=reuse, temperature=0.9)
                conv = conv.turns(8)
                t0 = time.perf_counter()
                report = conv.rollout(n=args.rollouts, devices=[first], seed=1)
                metas = [m.metadata for r in report.results.values() for m in r.transcript[1:]]
                prompt_tokens = max(1, sum(m["prompt_tokens"] for m in metas))
                share = sum(m["kv_reused_tokens"] for m in metas) / prompt_tokens
                tokens = sum(r.tokens_generated for r in report.results.values())
                fig[f"reuse_{reuse}"] = {"reused_share": round(share, 3), "failed": len(report.failed)}
                print(
                    f"  kv_reuse={reuse}: 8-turn debate x {args.rollouts}: {time.perf_counter() - t0:.2f} s, "
                    f"{tokens} tokens, reused {100 * share:.0f} % of prompt tokens, failed {report.failed}"
                )
            print(f"memory: {gpu_memory()}")

    if wanted("7"):
        with part(f"7. deterministic co-stepping on {first}") as fig:
            fig["engine"] = deterministic_check(path, first)
            fig["float32 diagnosis"] = invariance_diagnosis(path, first)
            rates = {}
            for batched in (True, False):
                conv = debate(path, new_tokens=32, name=f"batched_{batched}", temperature=0.9, seed=1)
                t0 = time.perf_counter()
                report = conv.rollout(n=args.rollouts, devices=[first], seed=1, batched=batched)
                tokens = sum(r.tokens_generated for r in report.results.values())
                rates[batched] = tokens / (time.perf_counter() - t0)
                sizes = sorted(
                    {m.metadata["batch_size"] for r in report.results.values() for m in r.transcript[1:]}
                )
                rate, failed = rates[batched], report.failed
                print(f"  batched={batched}: {rate:.0f} tok/s, batch sizes {sizes}, failed {failed}")
            ratio = rates[False] / rates[True]
            print(f"  deterministic / batched = {ratio:.2f}x (one run each, each loads the model)")
            fig["deterministic_over_batched"] = round(ratio, 3)
            print(f"memory: {gpu_memory()}")
    if wanted("8"):
        with part("8. a device-side assert on a job's first attempt") as fig:
            if gpus:
                with tempfile.TemporaryDirectory() as flags:
                    os.environ[_FAULT_DIR_VAR] = flags
                    try:
                        conv = debate(path, new_tokens=8, name="assert").turns(2).analyzer(fault_once)
                        report = conv.rollout(n=8, devices=devices, max_attempts=3)
                    finally:
                        os.environ.pop(_FAULT_DIR_VAR, None)
                pids = sorted({r.analysis["pid"] for r in report.results.values() if r.analysis})
                print(
                    f"  failed {report.failed}; jobs ran in worker pids {pids} (a replaced worker adds one)"
                )
                fig.update(failed=report.failed, worker_pids=len(pids))
            else:
                print("skipped: no GPU (tests/scheduler/test_scheduler_fatal.py raises its text on CPU)")
                fig["skipped"] = "no GPU"

    total = time.perf_counter() - started
    failed = [title for title, figures in FIGURES.items() if not figures["ok"]]
    print(f"\ntotal {total:.1f} s; parts failed: {failed or 'none'}")
    write_figures()
    if args.out:
        print(f"figures: {Path(args.out) / 'gpu_check.json'}")


if __name__ == "__main__":
    sys.exit(main())
