"""Device discovery and the early refusal of devices that do not exist here."""

from __future__ import annotations

from pathlib import Path

import pytest

from interlens.scheduler import (
    DeviceError,
    LineupSpec,
    RunConfig,
    available_devices,
    run_jobs,
    validate_devices,
)

torch = pytest.importorskip("torch")
NO_ACCELERATOR = not torch.cuda.is_available() and not torch.backends.mps.is_available()


@pytest.mark.skipif(not NO_ACCELERATOR, reason="this machine has a GPU")
def test_available_devices_on_a_cpu_machine() -> None:
    assert available_devices() == ["cpu"]


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (["cuda:3"], "device 'cuda:3' does not exist"),
        (["tpu"], "unknown device 'tpu': use 'cpu', 'cuda:N' or 'mps'"),
        (["cpu:x"], "unknown device 'cpu:x'"),
        (["cpu", "cuda:x"], "unknown device 'cuda:x'"),
        ([], "devices is empty"),
        ("cpu", r"write devices=\['cpu'\]"),
        ([0], "a device must be a string such as 'cpu' or 'cuda:0', got 0"),
    ],
)
def test_bad_devices_are_refused_naming_the_device_and_what_exists(devices: object, message: str) -> None:
    with pytest.raises(DeviceError, match=message) as info:
        validate_devices(devices)
    if devices and isinstance(devices, list) and isinstance(devices[-1], str):
        assert str(available_devices()) in str(info.value)  # the fix: what does exist here


@pytest.mark.skipif(not NO_ACCELERATOR, reason="this machine has a GPU")
def test_cuda_and_mps_are_refused_without_a_gpu() -> None:
    with pytest.raises(DeviceError, match="no CUDA GPU is visible"):
        validate_devices(["cuda"])
    with pytest.raises(DeviceError, match="'mps' is not available"):
        validate_devices(["mps"])


def test_good_devices_pass_through() -> None:
    assert validate_devices(["cpu", "cpu"]) == ["cpu", "cpu"]
    assert validate_devices([torch.device("cpu")]) == ["cpu"]
    assert validate_devices(available_devices()) == available_devices()


async def test_run_refuses_a_bad_device_before_touching_the_ledger_or_the_data(tmp_path: Path) -> None:
    def untouched():
        raise AssertionError("pulled a job")
        yield

    with pytest.raises(DeviceError, match="cuda:7"):
        await run_jobs(
            [LineupSpec("a", "fp", jobs=untouched())], RunConfig(devices=["cuda:7"], out_dir=tmp_path)
        )
    assert not (tmp_path / "ledger.sqlite").exists()
