"""Clipping the unscaled gradients by their total norm, and the inf/NaN check at a scale of 1.

Rules (torch's, so that the gradients get torch's bits):

1. The total norm is ``torch.nn.utils.get_total_norm`` of every gradient (the global norm over
   ranks and shards in a multi-process run, given by the caller's ``total_norm``). For plain
   gradients on a foreach device it is made by the same calls without its per-call grouping
   (:class:`ForeachTotalNorm`): one ``_foreach_norm`` per (device, dtype) group, visited in
   torch's order, which is its C++ hash map's and not first-seen, then the norm of the stack.
2. The coefficient is ``clamp(max_norm / (total_norm + 1e-6), max=1.0)``: a float over a tensor,
   which torch computes as a reciprocal and then a multiply. It is computed once, in place on
   one new tensor, so the recorded coefficient is the applied one.
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

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import nn

from torchimpl._torch_compat import (
    _amp_foreach_non_finite_check_and_unscale_,
    _foreach_mul_,
    _foreach_norm,
    _group_tensors_by_device_and_dtype,
)

__all__ = ["ForeachTotalNorm", "ParamGroup", "check_nonfinite_", "clip_coefficient", "clip_grad_norm_",
           "foreach_total_norm", "group_by_device_and_dtype", "torch_group_order"]

# Device types whose gradients torch's clipping multiplies with one _foreach_mul_ per group.
_FOREACH_DEVICE_TYPES = ("cpu", "cuda")
# Gradient dtypes that _amp_foreach_non_finite_check_and_unscale_ multiplies in float32.
_CHECK_AND_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOAT32 = torch.float32


class ParamGroup(NamedTuple):
    """Parameters of one (device, dtype), whether their gradients take foreach kernels, and
    whether the clip's multiply can carry the check (rule 5, save the coefficient's dtype)."""

    device: torch.device
    params: list[nn.Parameter]
    foreach: bool
    fusable: bool = False


def group_by_device_and_dtype(params: list[nn.Parameter]) -> list[ParamGroup]:
    """Parameters grouped by (device, dtype), a gradient's too, in first-seen order, each with
    whether its gradients are plain tensors on a device with foreach kernels (rule 3) and
    whether the check-and-multiply kernel gives its multiply's bits (rule 5)."""
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    plain = (torch.Tensor, nn.Parameter)  # a Parameter's gradient is a plain tensor
    out = []
    for (device, dtype), ps in groups.items():
        foreach = device.type in _FOREACH_DEVICE_TYPES and all(type(p) in plain for p in ps)
        fusable = foreach and dtype in _CHECK_AND_SCALE_DTYPES and (device.type == "cpu" or dtype == _FLOAT32)
        out.append(ParamGroup(device, ps, foreach, fusable))
    return out


def check_nonfinite_(groups: list[ParamGroup], found: torch.Tensor, one: torch.Tensor) -> None:
    """Rule 4: ``found`` becomes 1.0 when a gradient holds inf or NaN; ``one`` is a 0-d float32
    1.0 on ``found``'s device, so every gradient keeps its bits."""
    for group in groups:
        # A sharded (DTensor) gradient is checked on this rank's shard; the ranks then agree.
        grads = [_local(p.grad) for p in group.params if p.grad is not None]
        if grads:
            _amp_foreach_non_finite_check_and_unscale_(grads, found, one)


def _local(grad: torch.Tensor) -> torch.Tensor:
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) and type(grad) is not torch.Tensor else grad


def torch_group_order(groups: list[ParamGroup], params: list[nn.Parameter]) -> list[ParamGroup]:
    """``groups`` in the order ``get_total_norm`` visits them when every one of ``params`` (in
    their order) has a gradient: torch groups by (device, dtype) in a C++ hash map, whose order
    is not first-seen; the norms are stacked in that order (rule 1)."""
    by_key = {(g.device, g.params[0].dtype): g for g in groups}
    with torch.no_grad():
        keys = list(_group_tensors_by_device_and_dtype([[p.detach() for p in params]]))
    return [by_key[key] for key in keys]


@dataclass(frozen=True, eq=False)  # compared by identity: its fields are parameters
class ForeachTotalNorm:
    """Rule 1 for plain gradients on foreach devices: ``get_total_norm``'s calls, its grouping
    done once. ``groups`` holds each (device, dtype) group's parameters in torch's visiting
    order (:func:`torch_group_order`); ``count`` all of them. Called with the gradients present
    in the parameters' order; when some are missing from a run of several groups, torch's
    order may differ, and ``get_total_norm`` itself is called."""

    groups: tuple[tuple[nn.Parameter, ...], ...]
    count: int

    def __call__(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if len(self.groups) == 1 and grads:  # one group: its tensors are the gradients present
            return torch.linalg.vector_norm(torch.stack(_foreach_norm(grads, 2.0)), 2.0)
        if len(grads) != self.count or not grads:
            return torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
        first = grads[0].device
        norms: list[torch.Tensor] = []
        for params in self.groups:
            norms.extend(_foreach_norm([p.grad for p in params], 2.0))
        return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)


def foreach_total_norm(groups: list[ParamGroup], params: list[nn.Parameter]) -> ForeachTotalNorm | None:
    """Rule 1's norm for ``params`` without torch's per-call grouping, or None when a group's
    gradients do not take foreach kernels (DTensor shards: the caller's global norm)."""
    if not groups or not all(g.foreach for g in groups):
        return None
    ordered = torch_group_order(groups, params)
    return ForeachTotalNorm(tuple(tuple(g.params) for g in ordered), len(params))


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Rule 2: ``clamp(max_norm / (norm + 1e-6), max=1.0)`` as torch computes it (the quotient
    as ``reciprocal() * max_norm``), each op in place on the one new tensor the sum makes."""
    coef = norm + 1e-6
    coef.reciprocal_()
    coef.mul_(max_norm)
    return coef.clamp_(max=1.0)


def clip_grad_norm_(groups: list[ParamGroup], params: list[nn.Parameter], max_norm: float,
                    total_norm: Callable[[list[torch.Tensor]], torch.Tensor], one: torch.Tensor,
                    found: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rules 1-3 (and 5 with ``found``): clip ``params``' gradients to ``max_norm``; return the
    total norm before clipping and the coefficient multiplied in, both device tensors."""
    all_grads = [p.grad for p in params if p.grad is not None]
    norm = total_norm(all_grads)
    coef = clip_coefficient(norm, float(max_norm))
    single = len(groups) == 1
    for group in groups:
        device, group_params, foreach, fusable = group
        grads = all_grads if single else [p.grad for p in group_params if p.grad is not None]
        if not grads:
            continue
        coef_here = coef if coef.device == device else coef.to(device)
        if found is not None and fusable and coef.dtype is _FLOAT32 and device == found.device:
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
