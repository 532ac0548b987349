"""Choosing the device to train on, and comparing devices.

Rules:
1. ``"auto"`` picks CUDA when it is available, then MPS when this torch build exposes it and it is
   available, then the CPU.
2. An explicit ``cuda``, ``cuda:N`` or ``mps`` that cannot be used raises ``RuntimeError`` saying
   what was asked, what exists, and what to pass instead; so does ``cuda:N`` with ``N`` at or
   beyond the number of visible CUDA devices.
3. Any other string goes to ``torch.device``; one torch cannot parse raises ``ValueError``
   naming it.
4. Two devices are the same when their types match and their indices match, an absent index
   meaning the current device of that type (``"cpu"`` and ``"cpu:0"`` are the same device).
"""

from __future__ import annotations

import torch

__all__ = ["resolve_device", "same_device", "available_devices"]


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not hasattr(mps, "is_available"):
        return False
    return bool(mps.is_available())


def _mps_built() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and hasattr(mps, "is_built") and mps.is_built())


def available_devices() -> list[str]:
    """The devices this process can use, as strings: ``cuda:0`` ... then ``mps``, then ``cpu``."""
    out: list[str] = []
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if _mps_available():
        out.append("mps")
    out.append("cpu")
    return out


def _alternatives() -> str:
    return " or ".join(repr(d) for d in ["auto", *available_devices()])


def _check_cuda(dev: torch.device, asked: str) -> None:
    if not torch.cuda.is_available():
        built = torch.version.cuda is not None
        why = (
            "this torch build has CUDA but no CUDA device is visible"
            if built
            else f"this torch build ({torch.__version__}) was built without CUDA"
        )
        raise RuntimeError(
            f"device {asked!r} was requested, but CUDA is not available: {why}; "
            f"available devices: {', '.join(available_devices())}; pass device={_alternatives()}"
        )
    if dev.index is not None:
        count = torch.cuda.device_count()
        if dev.index >= count:
            raise RuntimeError(
                f"device {asked!r} was requested, but only {count} CUDA device(s) exist "
                f"(cuda:0 to cuda:{count - 1}); pass device={_alternatives()}"
            )


def _check_mps(asked: str) -> None:
    if not _mps_available():
        why = (
            "this torch build has MPS but it is not available on this machine"
            if _mps_built()
            else "this torch build does not include MPS"
        )
        raise RuntimeError(
            f"device {asked!r} was requested, but MPS is not available: {why}; "
            f"available devices: {', '.join(available_devices())}; pass device={_alternatives()}"
        )


def resolve_device(requested: str | torch.device = "auto") -> torch.device:
    """The device to train on.

    ``"auto"`` (any case) gives ``torch.device("cuda")`` when CUDA is available, else
    ``torch.device("mps")`` when MPS is available, else ``torch.device("cpu")``. A
    ``torch.device`` or any other string is parsed by torch and checked: an unusable CUDA or MPS
    device raises ``RuntimeError`` naming the fix; a string torch cannot parse raises
    ``ValueError``. Nothing is initialised beyond the availability queries.
    """
    if isinstance(requested, torch.device):
        dev, asked = requested, str(requested)
    elif isinstance(requested, str):
        asked = requested
        text = requested.strip()
        if text.lower() == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda")
            if _mps_available():
                return torch.device("mps")
            return torch.device("cpu")
        try:
            dev = torch.device(text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(
                f"device must be 'auto' or a torch device string such as 'cpu', 'cuda', 'cuda:1' "
                f"or 'mps', got {requested!r} ({exc})"
            ) from None
    else:
        raise ValueError(
            f"device must be a string or torch.device, got {type(requested).__name__} {requested!r}"
        )
    if dev.type == "cuda":
        _check_cuda(dev, asked)
    elif dev.type == "mps":
        _check_mps(asked)
    return dev


def _index(dev: torch.device) -> int:
    if dev.index is not None:
        return dev.index
    # An absent CUDA index means the current device; querying it only makes sense when CUDA works.
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.current_device()
    return 0


def same_device(a: str | torch.device, b: str | torch.device) -> bool:
    """Whether ``a`` and ``b`` name the same device (rule 4): ``cpu`` equals ``cpu:0``, and
    ``cuda`` equals ``cuda:K`` where K is the current CUDA device."""
    da, db = torch.device(a), torch.device(b)
    return da.type == db.type and _index(da) == _index(db)
