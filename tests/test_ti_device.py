"""resolve_device: CUDA, then MPS, then CPU; unusable explicit devices name the fix."""

from __future__ import annotations

import pytest
import torch

from torchimpl.precision.device import available_devices, resolve_device, same_device


@pytest.fixture
def machine(monkeypatch):
    """Mock what the machine exposes: call with cuda device count, MPS availability, build."""

    def set_(cuda: int = 0, mps: bool = False, mps_built: bool = False, cuda_built: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
        monkeypatch.setattr(torch.backends.mps, "is_built", lambda: mps or mps_built)
        monkeypatch.setattr(torch.version, "cuda", "12.8" if cuda_built else None)

    return set_


@pytest.mark.parametrize(
    "cuda, mps, expected",
    [(0, False, "cpu"), (1, False, "cuda"), (0, True, "mps"), (2, True, "cuda")],
)
def test_auto_prefers_cuda_then_mps_then_cpu(machine, cuda, mps, expected):
    machine(cuda=cuda, mps=mps)
    assert resolve_device("auto") == torch.device(expected)
    assert resolve_device() == torch.device(expected), "the default request must be 'auto'"
    assert resolve_device(" AUTO ") == torch.device(expected), "'auto' is case-insensitive"


def test_auto_without_mps_backend_attribute(machine, monkeypatch):
    machine(cuda=0)
    monkeypatch.delattr(torch.backends, "mps")
    assert resolve_device("auto") == torch.device("cpu")


def test_explicit_cpu_and_torch_device(machine):
    machine(cuda=0)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("meta") == torch.device("meta"), "other strings go to torch.device"


def test_cuda_unavailable_without_cuda_build(machine):
    machine(cuda=0, cuda_built=False)
    with pytest.raises(RuntimeError) as info:
        resolve_device("cuda")
    msg = str(info.value)
    assert "'cuda' was requested" in msg, msg
    assert "built without CUDA" in msg, msg
    assert "available devices: cpu" in msg, msg
    assert "pass device='auto' or 'cpu'" in msg, msg


def test_cuda_unavailable_with_cuda_build_and_mps(machine):
    machine(cuda=0, mps=True)
    with pytest.raises(RuntimeError) as info:
        resolve_device("cuda:0")
    msg = str(info.value)
    assert "'cuda:0' was requested" in msg, msg
    assert "no CUDA device is visible" in msg, msg
    assert "available devices: mps, cpu" in msg, msg
    assert "'auto' or 'mps' or 'cpu'" in msg, msg


def test_torch_device_cuda_unavailable(machine):
    machine(cuda=0)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        resolve_device(torch.device("cuda"))


def test_cuda_index_beyond_count(machine):
    machine(cuda=2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(RuntimeError) as info:
        resolve_device("cuda:2")
    msg = str(info.value)
    assert "'cuda:2' was requested" in msg, msg
    assert "only 2 CUDA device(s) exist (cuda:0 to cuda:1)" in msg, msg
    assert "'cuda:0' or 'cuda:1' or 'cpu'" in msg, msg


def test_mps_unavailable(machine):
    machine(cuda=1, mps=False, mps_built=True)
    with pytest.raises(RuntimeError) as info:
        resolve_device("mps")
    msg = str(info.value)
    assert "'mps' was requested, but MPS is not available" in msg, msg
    assert "has MPS but it is not available" in msg, msg
    assert "available devices: cuda:0, cpu" in msg, msg

    machine(cuda=0, mps=False, mps_built=False)
    with pytest.raises(RuntimeError, match="does not include MPS"):
        resolve_device("mps")


def test_mps_available(machine):
    machine(cuda=0, mps=True)
    assert resolve_device("mps") == torch.device("mps")
    assert available_devices() == ["mps", "cpu"]


@pytest.mark.parametrize("bad", ["gpu0", "cuda:x", "", "cpu:-1:2"])
def test_invalid_string_is_value_error_naming_it(bad):
    with pytest.raises(ValueError) as info:
        resolve_device(bad)
    assert repr(bad) in str(info.value), str(info.value)


def test_non_string_is_value_error():
    with pytest.raises(ValueError, match="must be a string or torch.device, got int 3"):
        resolve_device(3)  # type: ignore[arg-type]


def test_same_device(machine):
    machine(cuda=2)
    assert same_device("cpu", torch.device("cpu", 0))
    assert same_device("cuda", "cuda:0"), "an absent CUDA index is the current device"
    assert not same_device("cuda", "cuda:1")
    assert not same_device("cpu", "meta")
