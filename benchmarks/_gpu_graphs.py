"""Part 9 of ``gpu_check.py`` (issue 37): the static decode step (``engine/_static_step.py``) eager against
its CUDA-graph replay, on the shapes of part 0c.

The first H200 run found every decode step bound by the host: ~1,600-2,400 torch calls launched from Python,
25-57 ms a step whatever the batch, where the GPU needs a few. :class:`StaticDecodeStep` owns every tensor a
step touches and runs one pure-tensor function (``_forward_and_sample``); this part captures that function by
hand (``torch.cuda.CUDAGraph``: warm-up on a side stream, capture into one memory pool shared by the shape's
graphs, replay) and measures, per shape and row bucket:

* ``eager_ms`` / ``graph_ms``: a step on the device's clock (CUDA events around ``timed`` steps after
  ``warm``), and ``graph_host_ms``, the host's time to issue a replayed step (pytorch#174575 reported a 7x
  ``cudaGraphLaunch`` regression on torch 2.10 + CUDA 13: the replay's own cost, measured);
* ``capture_s`` (and the side stream's ``warmup_s``), ``pool_mib`` (what the capture added to the
  allocator's reserved memory: the graph's share of the shared pool) and ``allocated_mib``;
* ``tokens_equal``: ``check`` steps' tokens graph against eager from the same prefill, bit for bit; the
  ``top_p`` variant records log-probabilities (``logprobs_equal``) and mixes nucleus, plain-temperature,
  greedy rows with seeds, the ``greedy`` variant records nothing;
* per shape, a whole loop at ``loop_rows`` rows (prefill, ``begin``, a host read of the tokens each step, as
  the engine's loop reads them) graph and eager, against HF ``generate`` with the same sampling settings;
* per shape, the reduction micro-check: ``x.float().pow(2).mean(-1)`` and the model's own final norm on rows
  computed in batches of 4, 8 and 16 against each row computed alone, bitwise (issue 37 §2's suspect for
  the 3B bf16 self-test failure: a reduction whose order follows the row count).

On the CPU (the rehearsal in ``tests/test_gpu_check.py``) the same code runs with a stand-in graph: capture
records every static buffer's address and counts the host reads the step makes (a real capture fails on
one), each replay runs the function and checks that no buffer moved; the clock is ``perf_counter``.

The figures go into the part's dict as each piece ends and ``flush`` writes them: a run stopped at the
machine's limit keeps every row bucket it finished. A piece that raises records its error and the next runs;
past ``budget_s`` the remaining pieces are skipped, said in the figures.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from _gpu_parts import host_syncs, random_model

__all__ = ["graphs_bench", "reduction_check"]

#: The sampler variants measured: greedy without recording, and the full sampler (nucleus) with recording.
VARIANTS: dict[str, bool] = {"greedy": False, "top_p": True}


def _settings(variant: str, rows: int, new: int) -> list[Any]:
    """One setting per row: all greedy, or per row in turn a seeded nucleus row, a seeded plain-temperature
    row, a greedy row and a hotter, narrower seeded nucleus row (row 0 samples, so one row serves too)."""
    from interlens.engine._sampling import SamplingSettings

    if variant == "greedy":
        return [SamplingSettings(max_new_tokens=new, temperature=0)] * rows
    kinds = ((0.9, 0.95), (0.9, 1.0), (0.0, 1.0), (1.2, 0.8))  # (temperature, top-p) in turn
    return [
        SamplingSettings(max_new_tokens=new, temperature=kinds[i % 4][0], top_p=kinds[i % 4][1], seed=i)
        for i in range(rows)
    ]


def _prefill(model: Any, ids: Any) -> tuple[Any, Any, Any]:
    """``ids`` (rows x width, no padding) prefilled eagerly into a static cache of their own: the cache,
    the prompt mask and the last position's logits (what ``StaticDecodeStep.begin`` takes)."""
    import torch

    from interlens.engine._static_step import static_cache

    rows, width = ids.shape
    mask = torch.ones_like(ids)
    kv = static_cache(model, rows=rows, length=width)
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1),
            cache=kv,
            use_cache=True,
            logits_to_keep=1,
        )
    return kv, mask, out.logits[:, -1, :]


class _Clock:
    """Milliseconds on the device's clock: CUDA events on CUDA, ``perf_counter`` on the CPU. ``stop``
    returns (device ms, host ms): the host's time to issue the work, taken before waiting for it."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self.cuda = cuda
        if cuda:
            torch.cuda.synchronize()
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[float, float]:
        host = 1000 * (time.perf_counter() - self.t0)
        if not self.cuda:
            return host, host
        self.events[1].record()
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]), host


class _StandInGraph:
    """The rehearsal's ``torch.cuda.CUDAGraph``: :meth:`capture` records every static buffer's address,
    shape and dtype and counts the host reads the step's function makes (on CUDA a capture fails on one);
    :meth:`replay` runs the function and checks that no buffer moved (a real graph replays its kernels over
    the captured addresses whatever the Python objects point to by then)."""

    def __init__(self, step: Any) -> None:
        self.step = step
        self.captured: dict[str, tuple[int, tuple[int, ...], Any]] = {}
        self.syncs = 0
        self.moved = 0

    def _addresses(self) -> dict[str, tuple[int, tuple[int, ...], Any]]:
        return {k: (t.data_ptr(), tuple(t.shape), t.dtype) for k, t in self.step.buffers().items()}

    def capture(self) -> None:
        self.captured = self._addresses()
        with host_syncs("cpu") as counted:
            self.step._forward_and_sample()
        self.syncs = counted["sync"]

    def replay(self) -> None:
        self.step._forward_and_sample()
        self.moved += self._addresses() != self.captured


def _capture(step: Any, pool: Any, cuda: bool, warmups: int = 3) -> tuple[Callable[[], None], dict[str, Any]]:
    """The step's function captured: its replay and the capture's figures. On CUDA: ``warmups`` runs on a
    side stream (the kernels' lazy set-up, cuBLAS workspaces), then one capture into ``pool``."""
    import torch

    t0 = time.perf_counter()
    if not cuda:
        graph = _StandInGraph(step)
        graph.capture()
        seconds = time.perf_counter() - t0
        return graph.replay, {
            "capture_s": round(seconds, 3),
            "capture_syncs": graph.syncs,
            "pool_mib": None,
            "allocated_mib": None,
            "stand_in": graph,
        }
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step._forward_and_sample()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    # the capture empties the allocator's cache as it starts: emptied first, what it reserves after is the
    # graph's (new segments of the shared pool; a graph that reuses the pool's free blocks adds little)
    torch.cuda.empty_cache()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    cuda_graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(cuda_graph, pool=pool):
        step._forward_and_sample()
    torch.cuda.synchronize()
    return cuda_graph.replay, {
        "warmup_s": round(warmup_s, 3),
        "capture_s": round(time.perf_counter() - t0, 3),
        "capture_syncs": 0,  # a sync inside a capture raises: it captured, so there was none
        "pool_mib": round((torch.cuda.memory_reserved() - reserved) / 2**20, 1),
        "allocated_mib": round((torch.cuda.memory_allocated() - allocated) / 2**20, 1),
        "graph": cuda_graph,
    }


def _run(step: Any, start: dict[str, Any], steps: int) -> Any:
    """``begin`` from the kept prefill, then ``steps`` steps; every step's tokens (and log-probabilities
    where the step records) gathered on the device and read once at the end: (tokens, logprobs or None)."""
    import torch

    first = step.begin(start["settings"], kv=start["kv"], prompt_mask=start["mask"], logits=start["logits"])
    tokens = torch.empty((steps, step.rows), dtype=torch.long, device=step.device)
    logprobs = torch.empty((steps, step.rows, 2), dtype=torch.float32, device=step.device)
    for i in range(steps):
        step.step()
        tokens[i].copy_(step.tokens)
        logprobs[i].copy_(step.logprobs)
    return [first.tokens.tolist(), *tokens.tolist()], logprobs if step.record else None


def _timed(step: Any, start: dict[str, Any], *, warm: int, timed: int, cuda: bool) -> tuple[float, float]:
    """(device ms, host ms) a step over ``timed`` steps after ``warm``, from a fresh ``begin``."""
    step.begin(start["settings"], kv=start["kv"], prompt_mask=start["mask"], logits=start["logits"])
    for _ in range(warm):
        step.step()
    clock = _Clock(cuda)
    for _ in range(timed):
        step.step()
    device_ms, host_ms = clock.stop()
    return device_ms / timed, host_ms / timed


def _bucket(
    model: Any,
    start: dict[str, Any],
    variant: str,
    pool: Any,
    *,
    warm: int,
    timed: int,
    check: int,
    cuda: bool,
) -> tuple[Any, dict[str, Any]]:
    """One row bucket and sampler variant: eager steps timed and their tokens, the capture, the replayed
    steps timed and their tokens. Returns the step and its graph (which replays into the step's buffers:
    both are kept alive together) and the figures."""
    import torch

    from interlens.engine._static_step import StaticDecodeStep

    step = StaticDecodeStep(
        model, rows=start["rows"], length=start["length"], variant=variant, record=VARIANTS[variant]
    )
    eager_ms, _ = _timed(step, start, warm=warm, timed=timed, cuda=cuda)
    eager_tokens, eager_lps = _run(step, start, check)
    replay, fig = _capture(step, pool, cuda)
    step.run = replay
    graph_ms, host_ms = _timed(step, start, warm=warm, timed=timed, cuda=cuda)
    graph_tokens, graph_lps = _run(step, start, check)
    stand_in = fig.pop("stand_in", None)
    graph = fig.pop("graph", None)
    fig = {
        "eager_ms": round(eager_ms, 3),
        "graph_ms": round(graph_ms, 3),
        "graph_host_ms": round(host_ms, 3),
        "eager_over_graph": round(eager_ms / graph_ms, 2),
        **fig,
        "tokens_equal": graph_tokens == eager_tokens,
        "steps_compared": check,
    }
    if eager_lps is not None:
        fig["logprobs_equal"] = torch.equal(graph_lps, eager_lps)
    if stand_in is not None:
        fig["buffers_moved"] = stand_in.moved
    return (step, graph), fig


def _loop(
    step: Any, model: Any, ids: Any, settings: list[Any], new: int, cuda: bool
) -> tuple[float, list[Any]]:
    """The whole loop as the engine runs it: prefill, ``begin``, then a step and a host read of its tokens
    per token. Seconds and each step's tokens."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    kv, mask, logits = _prefill(model, ids)
    seen = [step.begin(settings, kv=kv, prompt_mask=mask, logits=logits).tokens.tolist()]
    for _ in range(new - 1):
        step.step()
        seen.append(step.tokens.tolist())
    return time.perf_counter() - t0, seen


def _hf_generate(model: Any, ids: Any, new: int, cuda: bool) -> float:
    """Seconds of one HF ``generate`` over ``ids``' rows with the pieces' sampling (T = 0.9, top-p 0.95,
    exactly ``new`` tokens each, dynamic cache), the device synchronised on both sides."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=0.9,
            top_p=0.95,
            top_k=0,
            max_new_tokens=new,
            min_new_tokens=new,
        )
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _loop_vs_generate(model: Any, step: Any, ids: Any, new: int, cuda: bool) -> dict[str, Any]:
    """``step`` (rows = ``ids``' rows, the ``top_p`` variant, its graph captured) through the whole loop,
    graph and eager, against HF ``generate`` (dynamic cache) with the same settings: T = 0.9, top-p 0.95,
    ``new`` tokens each. One warm-up of each, one timed run."""

    from interlens.engine._sampling import SamplingSettings

    rows = ids.shape[0]
    settings = [
        SamplingSettings(max_new_tokens=new, temperature=0.9, top_p=0.95, seed=i) for i in range(rows)
    ]
    replay = step.run
    runs: dict[str, tuple[float, list[Any]]] = {}
    for name, run in (("graph", replay), ("eager", step._forward_and_sample)):
        step.run = run
        _loop(step, model, ids, settings, new, cuda)
        runs[name] = _loop(step, model, ids, settings, new, cuda)
    step.run = replay

    _hf_generate(model, ids, new, cuda)
    theirs = _hf_generate(model, ids, new, cuda)
    tokens = rows * new
    return {
        "rows": rows,
        "new": new,
        "graph_tok_s": round(tokens / runs["graph"][0], 1),
        "eager_tok_s": round(tokens / runs["eager"][0], 1),
        "generate_tok_s": round(tokens / theirs, 1),
        "graph_over_generate": round(theirs / runs["graph"][0], 2),
        "graph_over_eager": round(runs["eager"][0] / runs["graph"][0], 2),
        "tokens_equal": runs["graph"][1] == runs["eager"][1],
    }


def _engine_vs_generate(
    model: Any, tokenizer: Any, ids: Any, new: int, cuda: bool, *, repeats: int = 3
) -> dict[str, Any]:
    """The engine's real ``generate_batch`` over ``ids``' rows (T = 0.9, top-p 0.95, seeded rows, ``new``
    tokens each, no end of turn): its decode as replayed graphs (``StaticDecoder``, the CUDA default, with
    its grouped-query decode attention), the same graphs over transformers' ``sdpa`` (``graphs_sdpa``), the
    same static steps run eagerly, and the eager loop it had before; against HF ``generate`` with the same
    sampling (``sdpa``). One warm-up of each graph side (the graphs are captured there; the eager kernels
    ran in the pieces before), then ``repeats`` timed runs of each, interleaved; medians and spreads of
    tokens a second. On the CPU the graphs are the stand-in and every run has the CPU's attention. The three
    static engines decode over one KV pool sized as the engine sizes its own (from its token budget on
    CUDA, ``LocalEngine.token_budget``; by need on the CPU), as one engine's two decoders share one: the
    figures are the budget-sized pool's (its size in ``pool_mib``), and three pools of 70 % of the free
    memory each would not fit."""
    import statistics

    import torch

    from interlens.engine._decode_graphs import GraphRunner
    from interlens.engine._generation import GenerationRequest, LocalEngine
    from interlens.engine._kv_pool import KVPool
    from interlens.engine._sampling import SamplingSettings
    from interlens.engine._static_decode import StaticDecoder

    device = str(ids.device)
    rows = ids.shape[0]
    requests = [
        GenerationRequest(
            prompt_ids=tuple(ids[i].tolist()),
            sampling=SamplingSettings(max_new_tokens=new, temperature=0.9, top_p=0.95, seed=i),
        )
        for i in range(rows)
    ]
    engines: dict[str, Any] = {}
    attention: dict[str, str] = {}  # on CUDA, the attention each run's model calls (eager ones read it live)
    sdpa = str(model.config._attn_implementation)
    pool: KVPool | None = None  # the static engines' one pool (docstring)
    for name in ("graphs", "graphs_sdpa", "static_eager", "eager_loop"):
        if cuda:
            model.set_attn_implementation(sdpa)
        engine = LocalEngine(model, tokenizer, device=device, kv_reuse_capacity=0)
        engine._runner.eos_ids = frozenset()  # every row runs its whole length
        if name == "eager_loop":
            engine._runner.static_decode = None
        else:
            graphs = GraphRunner(
                device=device,
                graph_type=None if cuda else _StandInGraph,
                capture=name != "static_eager",
            )
            if pool is None:  # sized when first needed, from the free memory then (None on the CPU)
                pool = KVPool(model, budget=engine.token_budget)
            engine._runner.static_decode = StaticDecoder(
                engine._runner, graphs=graphs, grouped_attention=cuda and name != "graphs_sdpa", pool=pool
            )
        attention[name] = str(model.config._attn_implementation)
        engines[name] = engine
    attention["generate"] = sdpa

    def run(engine: Any) -> tuple[float, list[Any]]:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = engine.generate_batch(requests)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, [r.token_ids for r in results]

    def generate() -> tuple[float, list[Any]]:
        return _hf_generate(model, ids, new, cuda), []

    runners: dict[str, Callable[[], tuple[float, list[Any]]]] = {
        name: (lambda engine=engine: run(engine)) for name, engine in engines.items()
    }
    runners["generate"] = generate
    if cuda:  # each run under its own attention (a graph keeps the one it was captured with)
        plain = runners

        def under(name: str) -> Callable[[], tuple[float, list[Any]]]:
            def go() -> tuple[float, list[Any]]:
                model.set_attn_implementation(attention[name])
                return plain[name]()

            return go

        runners = {name: under(name) for name in plain}
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    tokens: dict[str, list[Any]] = {}
    for name, runner in runners.items():  # warm-up: the graphs' captures (the eager kernels ran before)
        if name.startswith("graphs"):
            runner()
    for _ in range(repeats):
        for name, runner in runners.items():
            seconds[name], tokens[name] = [*seconds[name], (ran := runner())[0]], ran[1]
    total = rows * new
    fig: dict[str, Any] = {"rows": rows, "new": new, "repeats": repeats}
    for name, times in seconds.items():
        rates = [total / t for t in times]
        fig[f"{name}_tok_s"] = round(statistics.median(rates), 1)
        fig[f"{name}_tok_s_spread"] = [round(min(rates), 1), round(max(rates), 1)]
    median = {name: statistics.median(times) for name, times in seconds.items()}
    fig["graphs_over_generate"] = round(median["generate"] / median["graphs"], 2)
    fig["graphs_over_eager_loop"] = round(median["eager_loop"] / median["graphs"], 2)
    fig["graphs_over_static_eager"] = round(median["static_eager"] / median["graphs"], 2)
    fig["grouped_over_sdpa_graphs"] = round(median["graphs_sdpa"] / median["graphs"], 2)
    fig["attention"] = attention
    fig["tokens_graphs_equal_static_eager"] = tokens["graphs"] == tokens["static_eager"]
    fig["tokens_grouped_equal_sdpa"] = tokens["graphs"] == tokens["graphs_sdpa"]
    fig["tokens_graphs_equal_eager_loop"] = tokens["graphs"] == tokens["eager_loop"]
    decoder = engines["graphs"]._runner.static_decode
    fig["graphs_stats"] = {**decoder.stats, **decoder.graphs.stats}
    fig["pool_mib"] = round(decoder.pool.nbytes() / 2**20, 1)
    return fig


def reduction_check(norm: Any, width: int, device: str, dtype: Any) -> dict[str, dict[str, bool]]:
    """Bitwise batch invariance of a norm's reduction: 16 rows of ``width`` random values in ``dtype``,
    ``x.float().pow(2).mean(-1)`` and ``norm`` (the model's own RMSNorm, fed decode's (rows, 1, width))
    computed in batches of 4, 8 and 16 rows, each against the same rows computed one at a time."""
    import torch

    x = torch.randn(16, width, generator=torch.Generator().manual_seed(width)).to(device=device, dtype=dtype)
    funcs: dict[str, Callable[[Any], Any]] = {
        "mean_sq": lambda t: t.float().pow(2).mean(-1),
        "norm": lambda t: norm(t.unsqueeze(1)),
    }
    found: dict[str, dict[str, bool]] = {}
    with torch.no_grad():
        for name, func in funcs.items():
            alone = torch.cat([func(x[i : i + 1]) for i in range(16)])
            found[name] = {str(k): torch.equal(func(x[:k]), alone[:k]) for k in (4, 8, 16)}
    return found


def graphs_bench(
    path: str,
    device: str,
    shapes: dict[str, dict[str, int]],
    batches: list[int],
    *,
    prompt: int,
    warm: int,
    timed: int,
    check: int,
    loop_rows: int,
    loop_new: int,
    figures: dict[str, Any],
    flush: Callable[[], None],
    budget_s: float = 330.0,
    engine_repeats: int = 3,
) -> None:
    """Part 9 (module docstring): for each shape of ``shapes`` (built as part 0c builds them) and each row
    count of ``batches``, random ``prompt``-token prompts prefilled once, then each variant's step eager and
    replayed; the loop against ``generate`` at ``loop_rows`` rows (one of ``batches``), and the engine's own
    ``generate_batch`` against it (``engine_repeats`` timed runs of each); the reduction check.
    ``figures`` gets them as they come, ``flush`` is called after each piece."""
    import torch
    from transformers import AutoTokenizer

    from interlens.engine._buckets import length_bucket

    cuda = device.startswith("cuda")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path)
    figures["pool"] = "one CUDA graph memory pool per shape, shared by its graphs" if cuda else "stand-in"
    figures["steps"] = {"warm": warm, "timed": timed, "check": check}
    for name, shape in shapes.items():
        model = random_model(path, device, shape)
        pool = torch.cuda.graph_pool_handle() if cuda else None
        vocab = int(model.config.vocab_size)
        length = length_bucket(prompt + max(warm + timed, check, loop_new) + 1)
        fig: dict[str, Any] = {
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6),
            "prompt": prompt,
            "length_bucket": length,
        }
        figures[name] = fig
        kept: list[Any] = []  # every step whose graph is alive: the shared pool's total is theirs
        loop_step = None
        for rows in batches:
            if time.perf_counter() - started > budget_s:
                fig[str(rows)] = f"skipped: past the part's budget of {budget_s:.0f} s"
                continue
            ids = torch.randint(1, vocab, (rows, prompt), generator=torch.Generator().manual_seed(rows))
            ids = ids.to(device)
            kv, mask, logits = _prefill(model, ids)
            fig[str(rows)] = {}
            for variant in VARIANTS:
                start = {
                    "rows": rows,
                    "length": length,
                    "settings": _settings(variant, rows, check + 1),
                    "kv": kv,
                    "mask": mask,
                    "logits": logits,
                }
                try:
                    step, entry = _bucket(
                        model, start, variant, pool, warm=warm, timed=timed, check=check, cuda=cuda
                    )
                    kept.append(step)
                    if rows == loop_rows and variant == "top_p":
                        loop_step = (step[0], ids)
                except (
                    Exception
                ) as exc:  # one bucket's failure (a capture the device refuses) never loses the rest
                    entry = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                fig[str(rows)][variant] = entry
                print(f"  {name}, {rows} rows, {variant}: {entry}", flush=True)
                flush()
            del kv, mask, logits
        graphed = [f for r in batches if isinstance(fig.get(str(r)), dict) for f in fig[str(r)].values()]
        graphed = [f for f in graphed if "capture_s" in f]
        fig["graphs"] = {
            "count": len(graphed),
            "capture_s": round(sum(f["capture_s"] for f in graphed), 3),
            "pool_mib": round(sum(f["pool_mib"] for f in graphed), 1) if cuda else None,
        }
        flush()
        try:
            if loop_step is None:
                raise RuntimeError(f"no top_p step of {loop_rows} rows was captured")
            fig["loop"] = _loop_vs_generate(model, loop_step[0], loop_step[1], loop_new, cuda)
        except Exception as exc:
            fig["loop"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(f"  {name}, loop: {fig['loop']}", flush=True)
        flush()
        try:
            if loop_step is None:
                raise RuntimeError(f"no prompts of {loop_rows} rows were made")
            fig["engine"] = _engine_vs_generate(
                model, tokenizer, loop_step[1], loop_new, cuda, repeats=engine_repeats
            )
        except Exception as exc:
            fig["engine"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(f"  {name}, engine: {fig['engine']}", flush=True)
        flush()
        try:
            width = int(model.config.hidden_size)
            fig["reduction"] = {
                "width": width,
                **reduction_check(model.get_decoder().norm, width, device, model.dtype),
            }
        except Exception as exc:
            fig["reduction"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(f"  {name}, reduction: {fig['reduction']}", flush=True)
        flush()
        del kept, loop_step, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
