"""A batch on its way to the model: moved to the device, and its samples counted.

A batch is a tensor, or a tuple, list or dict of them (nested or not); anything else passes
through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["batch_size", "to_device"]


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with its tensors on ``device``."""
    # Containers are told first: isinstance(x, torch.Tensor) is slow for anything that is not a
    # tensor (its metaclass's instance check), and this runs for every microbatch.
    if isinstance(batch, (tuple, list)):
        if device.type == "cpu":
            for b in batch:
                if not (isinstance(b, torch.Tensor) and b.is_cpu):
                    break
            else:
                return batch  # the common case on a CPU: nothing to move, no new container
        return type(batch)([to_device(b, device) for b in batch])
    if isinstance(batch, torch.Tensor):
        if batch.is_cpu and device.type == "cpu":
            return batch  # what batch.to(device) returns, without its argument parsing
        if device.type == "cuda":
            # Pinned source, asynchronous copy. The pinned block stays referenced by the window
            # until the step ends, and the caching host allocator keeps it from reuse until the
            # copy's stream event has completed.
            src = batch if batch.is_pinned() else batch.pin_memory()
            return src.to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (1 for a scalar or none)."""
    while True:
        if isinstance(batch, (tuple, list)):  # first: see to_device
            if not batch:
                return 1
            batch = batch[0]
        elif isinstance(batch, torch.Tensor):
            return batch.shape[0] if batch.ndim else 1
        elif isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        else:
            return 1
