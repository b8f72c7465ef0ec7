"""GPU-readiness through the CPU code paths: models leave when the run no longer needs them, kept KV
caches leave with their conversation, models load straight onto their device (``device_map``).

Real tiny models, real from_pretrained loads; one device, so everything runs in this process and the test
can look into the process-wide model cache.
"""

from __future__ import annotations

import gc
import os
import weakref
from typing import Any

import pytest

import interlens
from interlens import AutoModelParticipant, Conversation
from interlens.engine._model_cache import cached_engines, clear_engine_cache


def _loaded(path: str) -> list[Any]:
    want = os.path.realpath(path)
    return [e for e in cached_engines() if os.path.realpath(e.model.config._name_or_path) == want]


def _debate(path: str, name: str) -> Conversation:
    a = AutoModelParticipant.from_pretrained(path, name="a", max_new_tokens=4, kv_reuse=True)
    b = AutoModelParticipant.from_pretrained(path, name="b", max_new_tokens=4, kv_reuse=True)
    rows = [{"topic": "tabs"}, {"topic": "spaces"}]
    return Conversation(participants=[a, b], shared_context="Debate.").turns(3).data(rows).name(name)


def test_a_model_no_remaining_lineup_needs_is_evicted_and_kept_kv_caches_end_with_their_job(
    qwen2_path: str, llama_path: str
) -> None:
    clear_engine_cache()
    refs: list[weakref.ref[Any]] = []

    def on_qwen2(conv: Conversation) -> dict[str, Any]:  # runs in this process, inside the job
        (engine,) = _loaded(qwen2_path)
        refs.append(weakref.ref(engine))
        return {"kept": sorted({key[0] for key in engine._kept})}  # whose streams are kept now

    def on_llama(conv: Conversation) -> dict[str, Any]:
        gc.collect()
        return {
            "qwen2_cached": bool(_loaded(qwen2_path)),
            "qwen2_alive": any(ref() is not None for ref in refs),
            "llama_cached": bool(_loaded(llama_path)),
        }

    first = _debate(qwen2_path, "q").analyzer(on_qwen2)
    second = _debate(llama_path, "l").analyzer(on_llama)
    # One slot on one device: the jobs run one after another, lineup "q" before lineup "l".
    report = interlens.run([first, second], devices=["cpu"], max_batch_size=1)
    assert report.failed == [] and len(report.results) == 4
    q = [report.results[f"q/row_{i:05d}"].analysis for i in range(2)]
    # Each job kept KV caches for its own streams only: the first job's were released when it ended.
    assert q == [{"kept": ["q/row_00000"]}, {"kept": ["q/row_00001"]}]
    for i in range(2):  # once "q" was over, its model left the cache and nothing held its weights
        analysis = report.results[f"l/row_{i:05d}"].analysis
        assert analysis == {"qwen2_cached": False, "qwen2_alive": False, "llama_cached": True}
    (llama,) = _loaded(llama_path)  # the last model stays for the next run in this process ...
    assert dict(llama._kept) == {}  # ... without the kept KV caches of conversations that are over
    clear_engine_cache()


@pytest.mark.floors
def test_weights_load_straight_onto_the_device_through_the_device_map(
    qwen2_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("accelerate")  # how transformers honours device_map (interlens[local] installs it)
    from transformers import AutoModelForCausalLM

    from interlens.engine._model_cache import load_engine

    given: list[dict[str, Any]] = []  # what transformers' from_pretrained is called with (its wire)
    real = AutoModelForCausalLM.from_pretrained.__func__  # type: ignore[attr-defined]

    def recording(cls: Any, *args: Any, **kwargs: Any) -> Any:
        given.append(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recording))
    clear_engine_cache()
    engine = load_engine(qwen2_path, device="cpu")
    # from_pretrained placed the weights itself, no load-then-.to(); on a CPU-only machine the parameters
    # are on the CPU either way, so what tells is what transformers was given. (It sets model.hf_device_map
    # only for a map over several devices, so the engine keeps what it gave: its placement.)
    assert len(given) == 1 and given[0]["device_map"] == {"": "cpu"} and "dtype" not in given[0]
    assert engine.placement == {"device_map": {"": "cpu"}}
    assert {str(p.device) for p in engine.model.parameters()} == {"cpu"}
    assert str(engine.model.dtype) == "torch.float32"  # dtype=None keeps transformers' default off CUDA
    clear_engine_cache()


def test_the_load_plan_for_a_gpu_and_for_a_group_of_gpus() -> None:
    from interlens.engine._model_cache import load_kwargs

    assert load_kwargs("cpu", None) == {"device_map": {"": "cpu"}}
    assert load_kwargs("cuda:1", None) == {"device_map": {"": "cuda:1"}, "dtype": "bfloat16"}  # not fp32
    assert load_kwargs("cuda:0", "float32") == {"device_map": {"": "cuda:0"}, "dtype": "float32"}
    free = {0: 80_000_000_000, 1: 40_000_000_000}
    group = load_kwargs("cuda:0,cuda:1", "float16", free_memory=free.__getitem__)
    assert group == {
        "device_map": "auto",
        "max_memory": {0: 68_000_000_000, 1: 34_000_000_000},  # its own GPUs only, with room to spare
        "dtype": "float16",
    }


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda:0,cpu", "device='cuda:0' does not exist|a group of devices lists distinct CUDA GPUs"),
        ("cpu,cpu", "a group of devices lists distinct CUDA GPUs"),
    ],
)
def test_a_bad_group_is_refused_when_loading(qwen2_path: str, device: str, message: str) -> None:
    from interlens.engine._model_cache import load_engine

    with pytest.raises(interlens.DeviceError, match=message):
        load_engine(qwen2_path, device=device)


def test_two_models_load_at_once_in_a_fresh_process(qwen2_path: str, llama_path: str) -> None:
    """A worker loading two models concurrently: transformers' lazy names must not race (it did)."""
    import subprocess
    import sys

    code = (
        "import sys, threading\n"
        "from interlens.engine._model_cache import load_engine\n"
        "errors = []\n"
        "def load(path):\n"
        "    try:\n"
        "        load_engine(path)\n"
        "    except Exception as exc:\n"
        "        errors.append(repr(exc))\n"
        "threads = [threading.Thread(target=load, args=(p,)) for p in sys.argv[1:]]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "print(errors)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, qwen2_path, llama_path], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_dtype_none_on_cuda_and_bfloat16_share_one_copy_of_the_weights() -> None:
    from interlens.engine._model_cache import recipe_key

    def key(device: str, dtype: str | None) -> tuple[object, ...]:
        return recipe_key("/m", device=device, dtype=dtype, revision=None, trust=False)

    assert key("cuda:0", None) == key("cuda:0", "bfloat16") != key("cuda:0", "float32")
    assert key("cuda:0,cuda:1", None) == key("cuda:0,cuda:1", "bfloat16")
    assert key("cpu", None) != key("cpu", "bfloat16")  # off CUDA, None is float32
