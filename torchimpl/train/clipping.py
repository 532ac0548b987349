"""Clipping the unscaled gradients by their total norm, and the inf/NaN check at a scale of 1.

Rules (torch's, so that the gradients get torch's bits):

1. The total norm is ``torch.nn.utils.get_total_norm`` of every gradient (the global norm over
   ranks and shards in a multi-process run, given by the caller's ``total_norm``).
2. The coefficient is ``clamp(max_norm / (total_norm + 1e-6), max=1.0)``: a float over a tensor,
   which torch computes as a reciprocal and then a multiply. It is computed once, so the
   recorded coefficient is the applied one.
3. It is **always** multiplied in (no branch on ``coef < 1``, so no host sync): one
   ``_foreach_mul_`` per (device, dtype) group of plain tensors, ``mul_`` per tensor otherwise
   (DTensor gradients, which torch multiplies with ``_foreach_mul_``: the same bits).
4. The check without a loss scaler is ``_amp_foreach_non_finite_check_and_unscale_`` with a
   factor of 1: it sets ``found`` to 1.0 when a gradient holds inf or NaN and leaves every bit
   unchanged.
5. When clipping, the check can ride on the clip's multiply: the same kernel with the
   coefficient as its factor tests each value before multiplying and computes ``x * coef`` in
   float32, as ``mul_`` does on the CPU. Off the CPU, torch's ``mul_`` of a 16-bit gradient by a
   0-d float32 device tensor first rounds the factor to the gradient's dtype, which the check
   kernel does not, so there the fusion is used only when the dtypes match.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from torchimpl._torch_compat import _amp_foreach_non_finite_check_and_unscale_, _foreach_mul_

__all__ = ["ParamGroup", "check_nonfinite_", "clip_grad_norm_", "group_by_device_and_dtype"]

# Device types whose gradients torch's clipping multiplies with one _foreach_mul_ per group.
_FOREACH_DEVICE_TYPES = ("cpu", "cuda")
# Gradient dtypes that _amp_foreach_non_finite_check_and_unscale_ multiplies in float32.
_CHECK_AND_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ParamGroup(NamedTuple):
    """Parameters of one (device, dtype), and whether their gradients take foreach kernels."""

    device: torch.device
    params: list[nn.Parameter]
    foreach: bool


def group_by_device_and_dtype(params: list[nn.Parameter]) -> list[ParamGroup]:
    """Parameters grouped by (device, dtype), a gradient's too, in first-seen order, each with
    whether its gradients are plain tensors on a device with foreach kernels (rule 3)."""
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    plain = (torch.Tensor, nn.Parameter)  # a Parameter's gradient is a plain tensor
    return [ParamGroup(device, ps, device.type in _FOREACH_DEVICE_TYPES and all(type(p) in plain for p in ps))
            for (device, _), ps in groups.items()]


def check_nonfinite_(groups: list[ParamGroup], found: torch.Tensor, one: torch.Tensor) -> None:
    """Rule 4: ``found`` becomes 1.0 when a gradient holds inf or NaN; ``one`` is a 0-d float32
    1.0 on ``found``'s device, so every gradient keeps its bits."""
    for _, params, _ in groups:
        # A sharded (DTensor) gradient is checked on this rank's shard; the ranks then agree.
        grads = [_local(p.grad) for p in params if p.grad is not None]
        if grads:
            _amp_foreach_non_finite_check_and_unscale_(grads, found, one)


def _local(grad: torch.Tensor) -> torch.Tensor:
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) and type(grad) is not torch.Tensor else grad


def clip_grad_norm_(groups: list[ParamGroup], params: list[nn.Parameter], max_norm: float,
                    total_norm: Callable[[list[torch.Tensor]], torch.Tensor], one: torch.Tensor,
                    found: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rules 1-3 (and 5 with ``found``): clip ``params``' gradients to ``max_norm``; return the
    total norm before clipping and the coefficient multiplied in, both device tensors."""
    all_grads = [p.grad for p in params if p.grad is not None]
    norm = total_norm(all_grads)
    coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    single = len(groups) == 1
    for group in groups:
        device, group_params, foreach = group
        grads = all_grads if single else [p.grad for p in group_params if p.grad is not None]
        if not grads:
            continue
        coef_here = coef if coef.device == device else coef.to(device)
        if found is not None and foreach and coef.dtype == torch.float32 and device == found.device \
                and group_params[0].dtype in _CHECK_AND_SCALE_DTYPES \
                and (device.type == "cpu" or group_params[0].dtype == coef.dtype):
            _amp_foreach_non_finite_check_and_unscale_(grads, found, coef_here)  # rule 5
            continue
        if found is not None:
            check_nonfinite_([group], found, one)
        if foreach:
            _foreach_mul_(grads, coef_here)
        else:
            for g in grads:
                g.mul_(coef_here)
    return norm, coef
