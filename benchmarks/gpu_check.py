"""The GPU check (issue 15): one short script for a lent GPU machine, under 10 minutes on one H200.

    python benchmarks/gpu_check.py [--size bench] [--rollouts 16] [--mem-fraction 0.003]

Seven parts, each printing what it saw and the memory in use per GPU afterwards:

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
   slot layout in float32 and bfloat16 (its verdict and cost), a deterministic batch of 6 rows against each
   row alone (token-identical only if the verdict is True), and a 4-turn deterministic rollout's throughput
   against the batched one.

The model is a real architecture built locally (``interlens.testing.tiny_model``: qwen2, random weights;
``--size bench`` is ~27M parameters). Without a GPU every part still runs on the CPU (the GPU-only parts say
they are skipped), which is how this script is tested.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

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
    held = torch.cuda.memory_allocated(0) / 2**20 if device.startswith("cuda") else None
    return {
        "pid": os.getpid(),
        "worker_device": device,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "threads": torch.get_num_threads(),
        "allocated_mib": held,
    }


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


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def debate(path: str, *, new_tokens: int, name: str, **settings: Any) -> Conversation:
    a = AutoModelParticipant.from_pretrained(path, name="a", max_new_tokens=new_tokens, **settings)
    b = AutoModelParticipant.from_pretrained(path, name="b", max_new_tokens=new_tokens, **settings)
    return Conversation(participants=[a, b], shared_context="Debate: tabs vs spaces.").turns(4).name(name)


def kv_reuse_check(path: str, device: str) -> None:
    """Engine level, float32: a shared-prefix batch, then each row's next turn on its kept cache; both turns
    compared with the same engine code with reuse off."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import GenerationRequest, LocalEngine

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    reusing = LocalEngine(model, tokenizer, device=device)
    full = LocalEngine(model, tokenizer, device=device, kv_reuse_capacity=0)
    rules = "Rules: be brief, cite one fact, answer the other side's last point. " * 4
    topics = ["Tabs.", "Spaces, always and everywhere.", "Neither: use a formatter.", "Both, by file type."]

    def prompt(text: str) -> tuple[int, ...]:
        chat = [{"role": "user", "content": text}]
        return tuple(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))

    def turn(prompts: list[tuple[int, ...]]) -> tuple[list[Any], bool]:
        requests = [
            GenerationRequest(prompt_ids=p, max_new_tokens=12, temperature=0.9, seed=7 + i, reuse_key=f"s{i}")
            for i, p in enumerate(prompts)
        ]
        mine, theirs = reusing.generate_batch(requests), full.generate_batch(requests)
        failed = [r for r in mine + theirs if isinstance(r, Exception)]
        if failed:
            raise failed[0]
        return mine, [r.token_ids for r in mine] == [r.token_ids for r in theirs]

    prompts = [prompt(rules + t) for t in topics]
    first, same = turn(prompts)
    print(f"  turn 1: shared_prefix_tokens {[r.shared_prefix_tokens for r in first]}; equal: {same}")
    more = tuple(tokenizer(" And the other side says no.", add_special_tokens=False).input_ids)
    second, same = turn([(*p, *r.token_ids, *more) for p, r in zip(prompts, first, strict=True)])
    print(f"  turn 2: kv_reused_tokens {[r.kv_reused_tokens for r in second]}; equal: {same}")


def deterministic_check(path: str, device: str) -> None:
    """Engine level: the self-test's verdict on this device, then 6 deterministic rows together vs alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import GenerationRequest, LocalEngine
    from interlens.scheduler import ExecutionMode

    tokenizer = AutoTokenizer.from_pretrained(path)
    topics = ["Tabs.", "Spaces, always.", "Neither: a formatter.", "Both.", "Why argue?", "Tabs. " * 30]
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        engine = LocalEngine(model, tokenizer, device=device)
        t0 = time.perf_counter()
        verdict = engine.batch_invariant
        took = time.perf_counter() - t0
        requests = [
            GenerationRequest(
                prompt_ids=tuple(
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False
                    )
                ),
                max_new_tokens=8 + 4 * i,
                temperature=0.9,
                seed=3 + i,
            )
            for i, t in enumerate(topics)
        ]
        det = ExecutionMode.DETERMINISTIC
        together = engine.generate_batch(requests, mode=det)
        alone = [engine.generate_batch([r], mode=det)[0] for r in requests]
        same = [
            getattr(a, "token_ids", a) == getattr(b, "token_ids", b)
            for a, b in zip(together, alone, strict=True)
        ]
        sizes = [getattr(r, "batch_size", r) for r in together]
        print(
            f"  {str(dtype).removeprefix('torch.')}: batch_invariant={verdict} (self-test {took:.2f} s); "
            f"batch sizes {sizes}; rows equal to alone: {sum(same)}/{len(same)}"
        )
        del engine, model


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
    args = parser.parse_args()

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    size = args.size or ("bench" if gpus else "tiny")
    devices = ["cuda:0", "cuda:1"] if gpus >= 2 else (["cuda:0", "cuda:0"] if gpus else ["cpu", "cpu"])
    print(f"torch {torch.__version__}, {gpus} GPU(s), devices={devices}, model size {size!r}")
    print(f"memory: {gpu_memory()}")
    path = tiny_model("qwen2", size=size)
    llama = tiny_model("llama", size=size)
    started = time.perf_counter()

    section(f"1. a 2-worker rollout on {devices}")
    t0 = time.perf_counter()
    report = (
        debate(path, new_tokens=32, name="two").analyzer(where_am_i).rollout(n=args.rollouts, devices=devices)
    )
    seconds = time.perf_counter() - t0
    tokens = sum(r.tokens_generated for r in report.results.values())
    print(f"{len(report.results)} jobs, failed {report.failed}, {tokens} tokens in {seconds:.1f} s")
    seen = Counter(
        (r.device, a["worker_device"], a["visible"], a["threads"], a["pid"])
        for r in report.results.values()
        if (a := r.analysis)
    )
    for (device, inner, visible, threads, pid), count in sorted(seen.items()):
        print(
            f"  {count} jobs on {device!r}: pid {pid} sees {inner!r}, "
            f"CUDA_VISIBLE_DEVICES={visible}, torch threads {threads}"
        )
    print(f"memory: {gpu_memory()}")

    section("2. an induced OOM")
    if gpus:
        os.environ[_FRACTION_VAR] = str(args.mem_fraction)
        try:
            a = AutoModelParticipant.from_pretrained(path, name="a", max_new_tokens=16)
            long = (
                Conversation(participants=[a], shared_context="tabs or spaces? " * 400).turns(1).name("oom")
            )
            t0 = time.perf_counter()
            report = long.rollout(n=64, devices=devices, max_batch_size=64, seed=1)
            sizes = Counter(
                m.metadata.get("batch_size") for r in report.results.values() for m in r.transcript[1:]
            )
            errors = Counter(r.error.type for r in report.results.values() if r.error is not None)
            print(
                f"{len(report.results)} jobs in {time.perf_counter() - t0:.1f} s; batch sizes {dict(sizes)}"
            )
            print(f"failed: {len(report.failed)} {dict(errors)}")
        finally:
            os.environ.pop(_FRACTION_VAR, None)
    else:
        print("skipped: no GPU (the OOM bisection is tested on CPU with injected OOMs)")
    print(f"memory: {gpu_memory()}")

    section("3. a NaN model next to a good one")
    with tempfile.TemporaryDirectory() as tmp:
        bad = nan_model(path, os.path.join(tmp, "nan"))
        good = debate(path, new_tokens=16, name="good").turns(2)
        broken = debate(bad, new_tokens=16, name="nan").turns(2)
        t0 = time.perf_counter()
        report = interlens.run([good.data([{}] * 4), broken.data([{}] * 4)], devices=devices, max_attempts=2)
        print(f"{len(report.results)} jobs in {time.perf_counter() - t0:.1f} s")
        for job_id, res in sorted(report.results.items()):
            what = "ok" if res.error is None else f"{res.error.type}: {res.error.message[:300]}"
            print(f"  {job_id}: {what}")
    print(f"memory: {gpu_memory()}")

    section("4. steering + capture")
    import torch

    first = devices[0]
    from transformers import AutoConfig

    d_model = AutoConfig.from_pretrained(path).hidden_size
    spec = SteeringSpec(torch.ones(d_model), layers=[0], coef=2.0)
    a = AutoModelParticipant.from_pretrained(path, name="a", max_new_tokens=8, device=first)
    b = AutoModelParticipant.from_pretrained(path, name="b", max_new_tokens=8, device=first)
    conv = Conversation(participants=[a, b], shared_context="Say something.")
    with conv.capture(layers=[0, 1]) as cache:
        message = conv.step("a", steering=spec)
    record = next(iter(cache))
    print(
        f"live on {first}: {len(cache)} records, answer {list(record.answer.shape)} on {record.answer.device}"
    )
    print(f"  steering metadata: {message.metadata.get('steering')}")
    steered = debate(path, new_tokens=8, name="steered").turns(2)
    held = [p.set(steering=spec) if p.name == "a" else p for p in steered.participants]
    steered = Conversation(participants=held, shared_context="Debate: tabs vs spaces.").turns(2)
    report = steered.analyzer(activations).rollout(n=4, devices=devices, batched=False)
    for job_id, res in sorted(report.results.items()):
        print(f"  {job_id} on {res.device}: {res.analysis if res.error is None else res.error.message[:200]}")
    print(f"memory: {gpu_memory()}")

    section("5. eviction: two models, one after the other, on one device")
    report = interlens.run(
        [
            debate(path, new_tokens=8, name="first").turns(2),
            debate(llama, new_tokens=8, name="second").turns(2),
        ],
        devices=[first],
        max_batch_size=1,
    )
    from interlens.engine._model_cache import cached_engines

    gc.collect()
    names = [os.path.basename(e.model.config._name_or_path) for e in cached_engines()]
    print(f"failed {report.failed}; models still cached after the run: {names}")
    print(f"memory: {gpu_memory()}")

    section(f"6. KV reuse and shared-prefix prefill on {first}")
    kv_reuse_check(path, first)
    for reuse in (True, False):
        conv = debate(path, new_tokens=32, name=f"reuse_{reuse}", kv_reuse=reuse, temperature=0.9).turns(8)
        t0 = time.perf_counter()
        report = conv.rollout(n=args.rollouts, devices=[first], seed=1)
        metas = [m.metadata for r in report.results.values() for m in r.transcript[1:]]
        share = sum(m["kv_reused_tokens"] for m in metas) / max(1, sum(m["prompt_tokens"] for m in metas))
        tokens = sum(r.tokens_generated for r in report.results.values())
        print(
            f"  kv_reuse={reuse}: 8-turn debate x {args.rollouts}: {time.perf_counter() - t0:.2f} s, "
            f"{tokens} tokens, reused {100 * share:.0f} % of prompt tokens, failed {report.failed}"
        )
    print(f"memory: {gpu_memory()}")

    section(f"7. deterministic co-stepping on {first}")
    deterministic_check(path, first)
    rates = {}
    for batched in (True, False):
        conv = debate(path, new_tokens=32, name=f"batched_{batched}", temperature=0.9, seed=1)
        t0 = time.perf_counter()
        report = conv.rollout(n=args.rollouts, devices=[first], seed=1, batched=batched)
        tokens = sum(r.tokens_generated for r in report.results.values())
        rates[batched] = tokens / (time.perf_counter() - t0)
        sizes = sorted({m.metadata["batch_size"] for r in report.results.values() for m in r.transcript[1:]})
        print(f"  batched={batched}: {rates[batched]:.0f} tok/s, batch sizes {sizes}, failed {report.failed}")
    print(
        f"  deterministic / batched = {rates[False] / rates[True]:.2f}x (one run each, each loads the model)"
    )
    print(f"memory: {gpu_memory()}")
    print(f"\ntotal {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
