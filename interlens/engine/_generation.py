"""Batched text generation for a local HuggingFace causal LM: the engine behind every local-model turn.

The scheduler coalesces the turn requests that are pending for one model on one device and hands them to
:meth:`LocalEngine.generate_batch` as ONE call, in a worker thread. This module is the engine's public face:
it checks the rows, decides which path each row takes (:meth:`LocalEngine._route`) and holds the lock. The
engine is composed of one object per concern, each in its own module and readable (and testable) alone:

* ``_decode.ModelRunner``: the model, its tokenizer and special ids, the model calls and THE decode loop
  every path ends in (per-row sampling, row dropping, stop strings, non-finite logits);
* ``_kept_kv.KeptKV``: the kept KV caches by reuse stream, an LRU bounded by ``kv_reuse_capacity`` streams
  and ``kv_reuse_budget`` bytes;
* the generation paths, each over the runner: ``_prefill.PlainBatch`` (one left-padded batch from scratch:
  static cache, shared prefill of identical prompts and of long common prefixes, length-grouped prefill);
  ``_kv_reuse.ReusedPrefixBatch`` (rows on reuse streams prefill only past their kept prefix, co-stepped with
  the batch's other rows; over the plain path and the store); ``_slot_rows.SlotLayout`` (deterministic rows
  on a batch-invariant layout, so that they co-step and stay token-identical to running alone; gated by the
  ``_batch_invariance`` self-test); ``_interp_rows.HookedRow`` (a row with ``capture``/``steering`` alone,
  with forward hooks on its decoder layers; and :meth:`LocalEngine.score`'s teacher-forced rows);
* ``_kv_pool.KVPool``: the engine's one KV pool, built here and handed to both static-shape decoders (the
  batched rows' ``_static_decode``, the deterministic rows' ``_slot_decode``; CUDA by default), sized from
  :meth:`LocalEngine.token_budget` on CUDA: a process running both modes holds one pool, counted once;
* ``_generation_types``: the request/result records crossing the engine's boundary.

Out-of-memory errors are deliberately NOT caught: the scheduler splits a batch that ran out of memory in
halves and retries (after :meth:`LocalEngine.release_memory`). A request that is bad on its own (a token id
outside the vocabulary) is returned in place as an exception instance, so it fails only its own caller (see
``interlens.scheduler.Engine``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

from interlens.scheduler import ExecutionMode

from .._core import ConfigurationError, GenerationError
from ..interp import text_config
from ._batch_invariance import PROBED_ROWS, invariant_at, probe_definition
from ._batch_invariance import batch_invariant as _self_test
from ._decode import ModelRunner, raise_if_cancelled
from ._device_memory import model_cuda_devices, usable_cuda_bytes
from ._generation_types import GenerationRequest, GenerationResult, ScoreRequest, ScoreResult
from ._interp_rows import HookedRow
from ._kept_kv import KeptKV
from ._kv_pool import KVPool
from ._kv_reuse import ReusedPrefixBatch
from ._load_options import require_transformers
from ._prefill import PlainBatch
from ._prefill import prefill_groups as _prefill_groups
from ._sampling import SamplingSettings
from ._slot_decode import slot_decoder_for
from ._slot_rows import SlotLayout, padded_rows
from ._static_decode import static_decoder_for
from ._step_loop import static_wanted
from ._verdicts import Verdicts

log = logging.getLogger("interlens")

__all__ = [
    "GenerationRequest",
    "GenerationResult",
    "LocalEngine",
    "SamplingSettings",
    "ScoreRequest",
    "ScoreResult",
    "_prefill_groups",
    "token_budget_estimate",
]

#: A generation path's entry point: its rows' requests in, one result (or the row's error) per row out.
_Path = Callable[[list[GenerationRequest], threading.Event | None], list[GenerationResult | Exception]]


class LocalEngine:
    """A loaded causal LM plus its tokenizer on one device; satisfies ``interlens.scheduler.Engine``.

    ``generate_batch`` runs one batch at a time (a lock), because live use may call it from several threads
    and the model, the RNG streams and the kept KV caches are shared state.
    """

    #: The runner class: a test or a benchmark may subclass it to observe the model calls.
    _runner_type: ClassVar[type[ModelRunner]] = ModelRunner

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: str,
        kv_reuse_capacity: int = 1024,
        kv_reuse_budget: int | None = None,
        shared_prefill: bool = True,
        decode_attention: bool = True,
    ) -> None:
        """``kv_reuse_capacity``: most streams whose KV cache is kept between turns (0: no reuse);
        ``kv_reuse_budget``: most bytes those kept caches may hold on this device (None: a quarter of the
        free memory, measured on first use; 0: no reuse). Over either, the least recently used go.
        ``decode_attention``: on the CPU, decode steps through interlens' own attention where the model runs
        transformers' ``sdpa`` (``_cpu_attention``); False keeps the model's attention as it was loaded."""
        _check_limit("kv_reuse_capacity", kv_reuse_capacity, "a number of streams such as 1024")
        if kv_reuse_budget is not None:
            _check_limit("kv_reuse_budget", kv_reuse_budget, "bytes such as 2 << 30, or None for the default")
        import transformers

        require_transformers(transformers.__version__)
        self._runner = runner = self._runner_type(
            model, tokenizer, device=device, decode_attention=decode_attention
        )
        #: Every CUDA device holding the weights ("cuda:0,cuda:1" for a model split over a group): what
        #: the budgets count and the out-of-memory retry empties.
        self._memory_devices = (model_cuda_devices(model) if device.startswith("cuda") else "") or device
        self._kept = KeptKV(capacity=kv_reuse_capacity, budget=kv_reuse_budget, device=self._memory_devices)
        self._plain = PlainBatch(runner, shared_prefill=shared_prefill)
        self._reused = ReusedPrefixBatch(runner, plain=self._plain, kept=self._kept)
        self._slots = SlotLayout(runner)
        # One KV pool for both static decoders, sized from the batch budget (CUDA; by need elsewhere): a
        # process running batched and deterministic rows holds one pool (``_kv_pool``). None where neither
        # decoder runs (the CPU's default): the eager paths keep their own caches, whatever the layers.
        pool = KVPool(model, budget=self.token_budget) if static_wanted(runner) else None
        # None: the eager loop (the CPU's default)
        runner.static_decode = static_decoder_for(runner, pool=pool)
        # the deterministic rows' static steps over the same pool (None: the eager slot steps)
        self._slots.decoder = slot_decoder_for(runner, pool=pool)
        self._hooked = HookedRow(runner, plain=self._plain)
        self._lock = threading.Lock()
        #: How ``from_pretrained`` placed the weights (``device_map``, ``max_memory``, ``dtype``), when
        #: ``interlens.engine._model_cache`` loaded it: what a GPU run's memory depends on, for diagnostics.
        self.placement: dict[str, Any] = {}
        self._batch_invariant: bool | None = None  # the self-test's verdict, once run (``batch_invariant``)
        self._verdicts = Verdicts(model, device=device)  # the verdicts kept on disk (``_verdicts``)
        # Deterministic batch sizes (rows, padded) that co-step: up to ``_invariant_rows`` they were probed
        # and passed; from ``_variant_rows`` on one failed, so larger batches co-step in chunks instead.
        self._invariant_rows = PROBED_ROWS
        self._variant_rows: int | None = None

    @property
    def model(self) -> Any:
        return self._runner.model

    @property
    def tokenizer(self) -> Any:
        return self._runner.tokenizer

    @property
    def device(self) -> str:
        return self._runner.device

    @property
    def kv_reuse_capacity(self) -> int:
        """Most streams whose KV cache is kept between turns (the kept-KV store's bound)."""
        return self._kept.capacity

    @kv_reuse_capacity.setter
    def kv_reuse_capacity(self, value: int) -> None:
        self._kept.capacity = value

    @property
    def kv_reuse_budget(self) -> int | None:
        """Most bytes the kept caches may hold (None: a share of the free memory, measured on first use)."""
        return self._kept.budget

    @kv_reuse_budget.setter
    def kv_reuse_budget(self, value: int | None) -> None:
        self._kept.budget = value  # as before: the bound in force is fixed once the first cache is kept

    @property
    def shared_prefill(self) -> bool:
        """Whether the plain batch path prefills identical prompts and long common prefixes once."""
        return self._plain.shared_prefill

    @shared_prefill.setter
    def shared_prefill(self, value: bool) -> None:
        self._plain.shared_prefill = value

    def __repr__(self) -> str:
        name = getattr(self.model.config, "_name_or_path", type(self.model).__name__)
        return f"LocalEngine({name!r}, device={self.device!r})"

    # ------------------------------------------------------------------ public face

    @property
    def batch_invariant(self) -> bool:
        """Whether rows get bitwise the same logits alone and in any batch on the slot layout, for this
        model, device and dtype (``_batch_invariance``): when True, deterministic rows co-step. Measured
        once, on first use; False without running anything for a model the layout does not support."""
        with self._lock:
            return self._invariant()

    def _invariant(self) -> bool:
        """The cached self-test verdict, running it first if needed (call under the lock)."""
        if self._batch_invariant is None:
            import torch

            with torch.inference_mode():
                try:
                    self._batch_invariant = self._slots.supported() and self._passes_self_test()
                except torch.OutOfMemoryError:
                    raise  # the scheduler's to handle (it halves the batch); the test runs again next time
                except Exception as exc:  # a model the layout cannot drive: its rows run alone
                    log.warning(
                        "%r: the batch-invariance self-test failed to run (%r); deterministic rows run alone",
                        self,
                        exc,
                    )
                    self._batch_invariant = False
        return self._batch_invariant

    def _co_steps(self, rows: int) -> int:
        """How many deterministic rows co-step in one batch: all ``rows`` where that size is known to be
        invariant, after probing it once if it is larger than any probed (``invariant_at``: kernels are
        picked by the batch's size); else the largest size that passed (call under the lock)."""
        import torch

        slots = self._slots
        size = padded_rows(rows, buckets=slots.buckets)  # on CUDA its row bucket: one probe per bucket
        if size > self._invariant_rows and (self._variant_rows is None or size < self._variant_rows):
            kernels = {"fixed_linear_rows": slots.fixed_linear_rows, "fixed_norms": slots.fixed_norms}
            probe = {**self._self_test_probe(rows=size), "bucket": slots.buckets, **kernels}
            key, known = self._verdicts.lookup(probe, ("invariant",))
            with torch.inference_mode():
                passed = known["invariant"] if known else invariant_at(self._slots, size)
                if not known:
                    self._verdicts.store(key, {"invariant": passed})
                if passed:
                    self._invariant_rows = size
                else:
                    self._variant_rows = size
                    log.info(
                        "%r: %d deterministic rows are not batch-invariant; they co-step in chunks",
                        self,
                        size,
                    )
        return rows if size <= self._invariant_rows else self._invariant_rows

    def _self_test_probe(self, *, rows: int | None) -> dict[str, Any]:
        """What a verdict of the self-test (``rows`` None) or of a batch size probed depends on besides the
        model and machine (``_verdicts``): the test's definition, and whether it probed the static slot
        steps (``_slot_decode``; said only when it did, so the eager steps' verdicts keep their keys)."""
        probe: dict[str, Any] = {"rows": rows, **probe_definition()}
        if self._slots.static_steps():
            probe["static_steps"] = True
        return probe

    def _passes_self_test(self) -> bool:
        """The self-test on the stock kernels, else with every linear layer in fixed-row chunks (slower, so
        only where the stock kernels pick their kernel by the batch's row count: ``_slot_rows``). A verdict
        kept on disk for this very key (``_verdicts``) is used instead; one computed here is kept."""
        slots = self._slots
        fields = ("invariant", "fixed_linear_rows")
        key, known = self._verdicts.lookup(self._self_test_probe(rows=None), fields)
        if known:
            slots.fixed_linear_rows = known["fixed_linear_rows"]
            return bool(known["invariant"])
        slots.fixed_linear_rows = False
        if _self_test(slots):
            self._verdicts.store(key, {"invariant": True, "fixed_linear_rows": False})
            return True
        if self.device.startswith("cuda"):  # chunked linears re-read every weight rows/8 times a step there
            log.warning(
                "%r: the slot layout is not batch-invariant on this GPU with cuBLAS without split-K and "
                "fixed-order norms (a deterministic run's worker process sets CUBLAS_WORKSPACE_CONFIG=:16:8 "
                "and CUBLASLT_WORKSPACE_SIZE=1; a run in your own process must set them before torch "
                "loads); deterministic rows run one at a time (results say batch_invariant=False)",
                self,
            )
            self._verdicts.store(key, {"invariant": False, "fixed_linear_rows": False})
            return False
        slots.fixed_linear_rows = True
        passed = False
        try:
            passed = _self_test(slots)
        finally:
            slots.fixed_linear_rows = passed
        self._verdicts.store(key, {"invariant": passed, "fixed_linear_rows": passed})
        if passed:
            log.info(
                "%r: the stock kernels are not batch-invariant here; deterministic rows co-step with every "
                "linear layer computed in fixed-row chunks",
                self,
            )
        return passed

    def generate_batch(
        self,
        requests: Sequence[GenerationRequest],
        *,
        mode: ExecutionMode = ExecutionMode.BATCHED,
        cancelled: threading.Event | None = None,
    ) -> list[GenerationResult | Exception]:
        """Generate one result per request, in order, as one batched call; :meth:`_route` picks each row's
        path.

        In ``ExecutionMode.DETERMINISTIC`` every request runs from scratch (``reuse_key`` ignored: a reused
        KV cache gives logits a few ulps off a fresh prefill, and whether a stream's cache is still there
        depends on what else ran), so a seeded row is token-identical on the same hardware whatever else ran
        with or before it. Where the engine passed its batch-invariance self-test on the slot layout
        (:attr:`batch_invariant`: run on its first deterministic batch; False without running for a model
        whose layers the layout cannot drive), every deterministic row, alone or not, runs on that layout
        (``_slot_rows``) and the rows co-step in one batch (a batch larger than the self-test ran is probed at
        its size first, and co-steps in chunks of the largest size that passed where it fails); otherwise
        each row runs alone through the plain batch path. A row with ``capture`` or ``steering`` runs alone
        and from scratch in every mode, with its hooks installed only during its own forward passes
        (``_interp_rows``). When ``cancelled`` is set, generation stops within one decode step and
        :class:`interlens.scheduler.BatchCancelled` is raised.
        """
        import torch

        requests = list(requests)
        for request in requests:
            if not isinstance(request, GenerationRequest):
                kind = type(request).__name__
                raise TypeError(f"LocalEngine.generate_batch expects GenerationRequest objects, got {kind}.")
        out: list[GenerationResult | Exception | None] = [None] * len(requests)
        valid: list[int] = []
        context = self._context()
        for i, request in enumerate(requests):
            problem = self._check(request)
            if problem is not None:
                out[i] = problem
                continue
            valid.append(i)
            room = None if context is None else context - len(request.prompt_ids)
            if room is not None and request.sampling.max_new_tokens > room:
                # a turn ends ("length") where the model's positions end, as it would at its own cap: past
                # them RoPE extrapolates into noise and a learned position table fails mid-forward
                requests[i] = request.capped(room)
        with self._lock, torch.inference_mode():
            for path, rows in self._route(requests, valid, deterministic=mode is ExecutionMode.DETERMINISTIC):
                results = path([requests[i] for i in rows], cancelled)
                invariant_path = path == self._slots.generate  # a row's arithmetic whatever its company
                for i, result in zip(rows, results, strict=True):
                    if isinstance(result, GenerationResult):
                        result.batch_invariant = self._batch_invariant
                        result.batch_dependent = result.batch_size > 1 and not invariant_path
                    out[i] = result
        return [r for r in out if r is not None]

    def _route(
        self, requests: list[GenerationRequest], rows: list[int], *, deterministic: bool
    ) -> list[tuple[_Path, list[int]]]:
        """Which path each of ``rows`` takes, and why; the batches run in the order returned (call under
        the lock: the self-test may run)."""
        hooked = [i for i in rows if requests[i].interp]
        rest = [i for i in rows if not requests[i].interp]
        routes: list[tuple[_Path, list[int]]] = []
        if rest and deterministic:
            # A seeded row's tokens must not depend on its company (and never on a kept cache): co-step on
            # the slot layout where the self-test found it batch-invariant, else each row alone from scratch.
            if self._invariant():
                step = self._co_steps(len(rest))
                for i in range(0, len(rest), step):
                    part = rest[i : i + step]
                    routes += [(self._slots.generate, chunk) for chunk in self._slot_chunks(requests, part)]
            else:
                routes += [(self._plain.generate, [i]) for i in rest]
        elif rest:
            # Batched: one co-stepped batch; if a row is on a reuse stream, the rows with a kept prefix
            # prefill only past it (and every stream keeps its KV for its next turn).
            reuse = self._kept.enabled and any(requests[i].reuse_key is not None for i in rest)
            path = self._reused.generate if reuse else self._plain.generate
            routes += [(path, [rest[j] for j in chunk]) for chunk in self._pool_chunks(requests, rest)]
        # A forward hook sees every row of its batch: a hooked row runs alone, from scratch, in every mode.
        routes += [(self._hooked.generate, [i]) for i in hooked]
        return routes

    def _pool_chunks(self, requests: list[GenerationRequest], rows: list[int]) -> list[list[int]]:
        """A batched batch in consecutive pieces that each fit the static decoder's KV pool where it is
        sized from the budget (``StaticDecoder.chunks``; by need, or no static decoder: one piece)."""
        decoder = self._runner.static_decode
        if decoder is None or len(rows) < 2:
            return [list(range(len(rows)))]
        prompts = [len(requests[i].prompt_ids) for i in rows]
        return decoder.chunks(prompts, [requests[i].sampling.max_new_tokens for i in rows])

    def _slot_chunks(self, requests: list[GenerationRequest], rows: list[int]) -> list[list[int]]:
        """Deterministic ``rows`` in consecutive pieces that each fit the KV pool where it is sized from the
        budget (``SlotDecoder.chunks``; by need, or no slot decoder: one piece)."""
        decoder = self._slots.decoder
        if decoder is None or len(rows) < 2:
            return [rows]
        prompts = [len(requests[i].prompt_ids) for i in rows]
        caps = [requests[i].sampling.max_new_tokens for i in rows]
        chunks = decoder.chunks(prompts, caps, buckets=self._slots.buckets)
        return [[rows[j] for j in chunk] for chunk in chunks]

    def score(
        self, requests: Sequence[ScoreRequest], *, cancelled: threading.Event | None = None
    ) -> list[ScoreResult | Exception]:
        """Teacher-forced log-probabilities of each row's continuation, one result per request, in order.

        Each row is one forward pass over prompt + continuation, with its hooks (capture, steering) if it
        asks for them; a row that is bad for this model is answered in place with a ``ConfigurationError``.
        When ``cancelled`` is set, :class:`interlens.scheduler.BatchCancelled` is raised before the next row.
        """
        import torch

        requests = list(requests)
        for request in requests:
            if not isinstance(request, ScoreRequest):
                kind = type(request).__name__
                raise TypeError(f"LocalEngine.score expects ScoreRequest objects, got {kind}.")
        out: list[ScoreResult | Exception] = []
        with self._lock, torch.inference_mode():
            for request in requests:
                problem = self._check_score(request)
                if problem is not None:
                    out.append(problem)
                    continue
                raise_if_cancelled(cancelled)
                out.append(self._hooked.score(request))
        return out

    def request_tokens(self, request: GenerationRequest) -> int:
        """What ``request`` costs in a batch (prompt + max_new tokens): the scheduler's batch budget unit."""
        return len(request.prompt_ids) + request.sampling.max_new_tokens

    def token_budget(self) -> int | None:
        """A first batch budget in tokens from the device's free memory (CUDA only; None elsewhere).

        Only a starting point for the scheduler's adaptive budget, which shrinks on an out-of-memory error
        and grows after successes: the allocator's cached-but-unused blocks count as free.
        """
        import torch

        if not self.device.startswith("cuda") or not torch.cuda.is_available():
            return None
        # this worker's share where workers share the GPU, every member's where the model spans a group
        return self._tokens_fitting(usable_cuda_bytes(self._memory_devices))

    def _tokens_fitting(self, usable: int) -> int:
        """:meth:`token_budget` from ``usable`` bytes: the KV pool's bytes are the batches' own (counted
        back in: their KV goes there), the prefix store's room still to fill is not theirs (counted out)."""
        import torch

        usable += self.memory_held()["kv_pool"] - self._slots.prefixes.room()
        dtype_bytes = torch.finfo(self.model.dtype).bits // 8 if self.model.dtype.is_floating_point else 2
        return token_budget_estimate(self.model.config, free_bytes=max(0, usable), dtype_bytes=dtype_bytes)

    def release(self, reuse_key: Hashable) -> None:
        """Free the KV cache kept for ``reuse_key`` (e.g. when its conversation is over)."""
        with self._lock:
            self._kept.drop(reuse_key)

    def clear_reuse(self) -> None:
        """Free every kept KV cache (and the deterministic path's kept prompt blocks)."""
        with self._lock:
            self._kept.clear()
            self._slots.prefixes.clear()

    def kept_bytes(self) -> int:
        """Bytes the kept KV caches hold now."""
        return self._kept.kept_bytes()

    def memory_held(self) -> dict[str, int]:
        """Bytes the engine holds between batches, by holder: the kept KV caches, the deterministic path's
        kept prompt blocks (``_slot_prefix``), the static decoders' KV pool (one, shared by the batched
        and the deterministic rows' decoders: counted once); :meth:`release_memory` (the out-of-memory
        retry) frees them all, and :meth:`token_budget` counts them."""
        decoders = (self._runner.static_decode, self._slots.decoder)
        pools = {id(d.pool): d.pool for d in decoders if d is not None}  # one pool, counted once
        return {
            "kept_kv": self._kept.kept_bytes(),
            "prefix_store": self._slots.prefixes.nbytes(),
            "kv_pool": sum(pool.nbytes() for pool in pools.values()),
        }

    def release_memory(self) -> None:
        """Before an out-of-memory retry: drop the kept KV caches (their streams prefill in full next
        time), collect garbage cycles, return CUDA's cached blocks."""
        import gc

        import torch

        self.clear_reuse()
        if self._runner.static_decode is not None:
            self._runner.static_decode.release()  # the engine's KV pool, the decode steps and graphs
        if self._slots.decoder is not None:
            self._slots.decoder.release()  # the deterministic rows' steps and graphs (the pool: freed above)
        gc.collect()
        if self.device.startswith("cuda") and torch.cuda.is_available():
            for member in self._memory_devices.split(","):  # every GPU of a group
                with torch.cuda.device(member):
                    torch.cuda.empty_cache()

    # ------------------------------------------------------------------ validation

    def _check(self, request: GenerationRequest) -> Exception | None:
        """Problems only this engine can see (the request validated itself); returned in place, not raised."""
        vocab = self._runner.vocab_size
        highest = max(request.prompt_ids)
        if highest >= vocab:
            return ConfigurationError(
                f"prompt token id {highest} is outside this model's vocabulary (size {vocab}); "
                "tokenize the prompt with this model's own tokenizer."
            )
        context = self._context()
        if context is not None and len(request.prompt_ids) >= context:
            # past its positions a model's output is not an answer: RoPE extrapolates into noise, learned
            # position tables fail with an index error deep in the forward pass
            return GenerationError(
                f"the prompt is {len(request.prompt_ids):,} tokens, and this model's context holds "
                f"{context:,} positions (max_position_embeddings): shorten the conversation (fewer turns, "
                "a TokenBudget stop condition, shorter system prompts or data rows) or use a model with a "
                "longer context."
            )
        return self._hooked.check(request.capture, request.steering)

    def _context(self) -> int | None:
        """How many positions the model holds (``max_position_embeddings``), where its config says."""
        context = getattr(text_config(self.model.config), "max_position_embeddings", None)
        return context if isinstance(context, int) and not isinstance(context, bool) else None

    def _check_score(self, request: ScoreRequest) -> Exception | None:
        if not request.continuation_ids:
            return ConfigurationError(
                "ScoreRequest(continuation_ids=()): nothing to score; pass at least one continuation token id"
            )
        vocab = self._runner.vocab_size
        highest = max(request.prompt_ids + request.continuation_ids)
        if highest >= vocab:
            return ConfigurationError(
                f"ScoreRequest: token id {highest} is outside this model's vocabulary (size "
                f"{vocab}); tokenize the prompt and continuation with this model's own tokenizer."
            )
        return self._hooked.check(request.capture, request.steering)


def _check_limit(name: str, value: object, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"LocalEngine({name}={value!r}): must be an int >= 0; pass {example} (0 turns KV reuse off)."
        )


def token_budget_estimate(config: Any, *, free_bytes: int, dtype_bytes: int, headroom: float = 0.7) -> int:
    """How many batch tokens (rows × (prompt + max_new)) fit in ``headroom`` of ``free_bytes``.

    A token costs its KV (2 × layers × kv heads × head dim) for the whole batch, plus the prefill's
    activations, which live one layer at a time (a few hidden- and MLP-wide vectors per token). Rough by
    design: the scheduler's budget corrects it on the first out-of-memory error.
    """
    text = text_config(config)
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    mlp = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    kv = 2 * int(text.num_hidden_layers) * kv_heads * head_dim
    per_token = (kv + 4 * hidden + 3 * mlp) * dtype_bytes
    return max(1, int(free_bytes * headroom) // per_token)
