"""Part 10 of ``gpu_check.py`` (issue 37 §2): deterministic rows on the GPU, on part 0c's shapes.

On the first H200 run deterministic co-stepping fell from 0.65x to 0.18x of batched as rows grew to 256 (the
fixed-row chunked linear layers), and bf16 failed the batch-invariance self-test on the 3B shape. On CUDA the
engine now runs the slot layout with cuBLAS without split-K (a deterministic worker's environment:
``scheduler/_placement.DETERMINISTIC_CUDA_ENV``; run this part with both variables set, as the command in
``gpu_check.py`` does, since cuBLAS reads them when it starts), fixed-order RMSNorms
(``engine/_invariant_norm``), rows padded to their row bucket, never the chunked linears. Per shape:

* ``split_k_off``: whether this process has both variables (the figures mean little without them);
* ``norm``: the fixed-order RMSNorm of rows computed 4, 8 and 16 at a time against each alone, bitwise;
* ``self_test``: the engine's self-test (rows up to ``PROBED_ROWS``) and the probe of each larger row
  bucket (``invariant_at``, as the engine runs before a bucket's first use): passed and seconds;
* ``slot_steps``: how the deterministic decode steps ran (graph replays of ``engine/_slot_decode``'s static
  slot steps, or eager and why; captures, failures);
* ``throughput``: at each of ``rows``, one ``generate_batch`` of random ``prompt``-token prompts, ``new``
  seeded tokens each (T = 0.9), batched then deterministic after a warm-up of each: tok/s, the ratio and
  the deterministic rows' batch size (co-stepped or alone). Where the self-test failed, deterministic rows
  run alone: not timed (256 rows alone would take the part's whole budget), said in the figures.

Figures go into the part's dict as each piece ends and ``flush`` writes them; past ``budget_s`` the
remaining pieces are skipped, said in the figures. On the CPU (``tests/test_gpu_check.py``) the same code
runs on a tiny shape.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

from _gpu_parts import random_model

__all__ = ["deterministic_bench"]


class _NoText:
    """The random-weight model's tokenizer: no text, no end-of-turn id (every row runs its whole length)."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def _norm_check(width: int, device: str, dtype: Any) -> dict[str, Any]:
    """The fixed-order RMSNorm of 16 random rows, 4, 8 and 16 at a time, against each row alone."""
    import torch

    from interlens.engine._invariant_norm import fixed_order_rms_norm

    gen = torch.Generator().manual_seed(width)
    x = (3 * torch.randn(16, width, generator=gen)).to(device=device, dtype=dtype)
    weight = torch.ones(width, device=device, dtype=dtype)
    alone = torch.cat([fixed_order_rms_norm(x[r : r + 1], weight, 1e-6) for r in range(16)])
    return {
        str(n): all(torch.equal(fixed_order_rms_norm(x[:n], weight, 1e-6), alone[:n]) for _ in range(2))
        for n in (4, 8, 16)
    }


def _requests(vocab: int, rows: int, prompt: int, new: int) -> list[Any]:
    import torch

    from interlens.engine._generation import GenerationRequest, SamplingSettings

    ids = torch.randint(1, vocab, (rows, prompt), generator=torch.Generator().manual_seed(rows)).tolist()
    return [
        GenerationRequest(p, sampling=SamplingSettings(max_new_tokens=new, temperature=0.9, seed=i))
        for i, p in enumerate(ids)
    ]


def deterministic_bench(
    path: str,
    device: str,
    shapes: dict[str, dict[str, int]],
    *,
    buckets: list[int],
    rows: list[int],
    prompt: int,
    new: int,
    figures: dict[str, Any],
    flush: Callable[[], None],
    budget_s: float = 170.0,
) -> None:
    """Part 10 (module docstring): for each of ``shapes``, the norm check, the self-test and each bucket's
    probe, then deterministic against batched throughput at each of ``rows``."""
    import torch

    from interlens.engine._batch_invariance import PROBED_ROWS, invariant_at
    from interlens.engine._generation import GenerationResult, LocalEngine
    from interlens.scheduler import ExecutionMode

    cuda = device.startswith("cuda")
    started = time.perf_counter()
    env = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")
    figures["env"] = {name: os.environ.get(name) for name in env}
    figures["split_k_off"] = figures["env"] == {env[0]: ":16:8", env[1]: "1"}

    def over(piece: dict[str, Any], key: str) -> bool:
        if time.perf_counter() - started > budget_s:
            piece[key] = f"skipped: past the part's budget of {budget_s:.0f} s"
            flush()
            return True
        return False

    for name, shape in shapes.items():
        fig: dict[str, Any] = {}
        figures[name] = fig
        if over(figures, name):
            continue
        model = random_model(path, device, shape)
        fig["norm"] = _norm_check(int(model.config.hidden_size), device, model.dtype)
        engine = LocalEngine(model, _NoText(), device=device)
        slots = engine._slots
        fig["layout"] = {
            "fixed_norms": slots.fixed_norms,
            "buckets": slots.buckets,
            "static_steps": slots.static_steps(),  # on CUDA: graphs of ``engine/_slot_decode``
        }
        tests: dict[str, Any] = {}
        fig["self_test"] = tests
        t0 = time.perf_counter()
        passed = engine.batch_invariant
        tests[f"<= {PROBED_ROWS} rows"] = {
            "passed": passed,
            "fixed_linear_rows": slots.fixed_linear_rows,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        print(f"  {name}, self-test: {tests}", flush=True)
        flush()
        with torch.inference_mode():
            for bucket in buckets:
                if bucket <= PROBED_ROWS or not passed or over(tests, str(bucket)):
                    continue
                t0 = time.perf_counter()
                ok = invariant_at(slots, bucket)
                tests[str(bucket)] = {"passed": ok, "seconds": round(time.perf_counter() - t0, 2)}
                print(f"  {name}, bucket {bucket}: {tests[str(bucket)]}", flush=True)
                flush()
        speed: dict[str, Any] = {}
        fig["throughput"] = speed
        vocab = int(model.config.vocab_size)
        for n in rows:
            if over(speed, str(n)):
                continue
            if not passed:
                speed[str(n)] = "not timed: the self-test failed, deterministic rows run alone"
                continue
            requests = _requests(vocab, n, prompt, new)
            entry: dict[str, Any] = {}
            for mode in (ExecutionMode.BATCHED, ExecutionMode.DETERMINISTIC):
                engine.generate_batch(requests, mode=mode)  # warm-up (a new bucket's probe runs here)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = engine.generate_batch(requests, mode=mode)
                if cuda:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                done = [r for r in out if isinstance(r, GenerationResult)]
                tokens = sum(r.n_tokens for r in done)
                entry[mode.name.lower()] = {
                    "tok_s": round(tokens / seconds, 1),
                    "batch_size": max((r.batch_size for r in done), default=0),
                    "failed": len(out) - len(done),
                }
            entry["ratio"] = round(entry["deterministic"]["tok_s"] / entry["batched"]["tok_s"], 3)
            speed[str(n)] = entry
            print(f"  {name}, {n} rows: {entry}", flush=True)
            flush()
        decoder = getattr(slots, "decoder", None)
        if decoder is not None:  # how the deterministic steps ran: graph replays, or eager and why
            graphs = {f"graphs: {key}": n for key, n in decoder.graphs.stats.items()}
            fig["slot_steps"] = {**decoder.stats, **graphs, "graphs failed": decoder.graphs.failed}
            flush()
        del engine, slots, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
