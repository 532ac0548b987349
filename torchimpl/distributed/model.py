"""Rule 4 and 11 of ``torchimpl.distributed``: the model wrapped for DDP or sharded by FSDP2,
with the gradient reduction the configuration asks for."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchimpl.distributed.reduction import ReductionSettings

__all__ = ["MODES", "wrap_model"]

MODES = ("none", "ddp", "fsdp2")


def _broadcast_from_rank0(model: nn.Module) -> None:
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(t.data, src=0)


def wrap_model(model: nn.Module, mode: str, plan: Any = None, device: torch.device | None = None,
               reduction: ReductionSettings | None = None) -> tuple[nn.Module, nn.Module]:
    """Rules 4 and 11: ``(module, forward_module)`` for ``mode``, on an initialised process group.

    ``module`` owns the parameters (state dicts, the optimizer); ``forward_module`` is what the
    forward pass calls (the DDP wrapper; for FSDP2 the sharded module itself). ``plan`` is the
    precision plan, whose autocast chooses the compute dtype per operation. ``reduction``
    (default: fp32, the parameters' own dtype) sets FSDP2's ``MixedPrecisionPolicy`` or DDP's
    comm hook; `reduction_problems` must have accepted it.
    """
    reduction = reduction or ReductionSettings()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return model, model
    device = device or next(model.parameters()).device
    _broadcast_from_rank0(model)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel  # loaded when used (slow to import)

        ids = [device.index] if device.type == "cuda" and device.index is not None else None
        ddp = DistributedDataParallel(model, device_ids=ids)
        hook = reduction.ddp_hook()
        if hook is not None:
            ddp.register_comm_hook(None, hook)  # None: the default process group
        return model, ddp
    from torch.distributed.device_mesh import init_device_mesh  # loaded when used (slow to import)
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # By default fp32 parameters and reduction: numerics as on one device, autocast does the casting.
    policy = reduction.fsdp_policy()
    for unit in _shard_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, model


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules FSDP2 shards on their own: the root's children that forward calls.

    Containers are never called (their parameters are read directly), so a ``ModuleList`` or
    ``ModuleDict`` contributes its elements and a ``ParameterList``/``ParameterDict`` stays with
    the root, whose own unit covers every parameter not in a child unit.
    """
    units = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += [c for c in child.children() if _has_params(c)]
        elif not isinstance(child, (nn.ParameterList, nn.ParameterDict)) and _has_params(child):
            units.append(child)
    return units
