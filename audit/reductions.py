"""How the audited loop reduces gradients across ranks: its DDP modules (and their comm hooks)
and FSDP2 modules (their ``MixedPrecisionPolicy`` and divide factor), stated in the words of
`reference.grad_reduction`.

Read once, at the loop's first optimizer step (the wrappers exist by then), from the live
objects: nothing is patched. Only when a process group is initialised (both wrappers need one;
any other loop pays nothing). The private names read are in
``audit._torch_compat.REDUCTION_ATTRIBUTES``.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import torch

from audit._torch_compat import REDUCTION_ATTRIBUTES  # noqa: F401  (the names read below, with why)

__all__ = ["describe_ddp", "describe_fsdp2", "find_reductions"]

_WIRE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_HOOKS = {"fp16_compress_hook": "fp16", "bf16_compress_hook": "bf16"}


def _name(dtype: Any) -> str:
    return _WIRE.get(dtype, str(dtype).replace("torch.", "")) if dtype is not None else "the parameters' own dtype"


def describe_ddp(ddp: Any) -> dict[str, Any]:
    """One DDP module: its world size, comm hook and what the reduction rounds (rules 6, 7)."""
    from reference import grad_reduction  # only a loop with DDP loads the spec's arithmetic here

    world = int(ddp.process_group.size())
    hooks = [getattr(h, "__name__", type(h).__name__) for h, _ in getattr(ddp, "_comm_hooks", [])]
    hook = hooks[-1] if hooks else None
    if hook is None:
        red = grad_reduction.ddp_default(world)
        how = "float32: each rank's gradient times f32(1/W) before the float32 sum (reference.grad_reduction rule 6)"
    elif hook in _HOOKS:
        red = grad_reduction.ddp_compress_hook(_HOOKS[hook], world)
        how = (f"{red.wire}: cast to {red.wire}, divided by {world} in {red.wire} before the sum, summed in "
               f"{red.wire}, copied back into float32 (reference.grad_reduction rule 7)")
    else:
        red, how = None, f"comm hook {hook}: a reduction the specification does not state"
    return {"wrapper": "DDP", "module": type(ddp.module).__name__, "world_size": world, "comm_hook": hook,
            "wire_dtype": None if red is None else red.wire, "reduction": how}


def describe_fsdp2(module: Any) -> list[dict[str, Any]]:
    """One FSDP2 module: per parameter group, the policy's dtypes and divide factors (rule 8)."""
    from reference import grad_reduction  # only a loop with FSDP2 loads the spec's arithmetic here

    out = []
    for group in module._get_fsdp_state()._fsdp_param_groups:
        policy = group.mp_policy
        world = int(getattr(group.mesh_info, "shard_mesh_size", 1))
        factor = group.gradient_divide_factor
        force = bool(group.force_sum_reduction_for_comms)
        params = {p.dtype for p in module.parameters(recurse=False)} or {torch.float32}
        wire_dtype = policy.reduce_dtype or policy.param_dtype or next(iter(params))
        wire = _WIRE.get(wire_dtype)
        entry = {"wrapper": "FSDP2", "module": type(module).__name__, "world_size": world,
                 "param_dtype": _name(policy.param_dtype), "reduce_dtype": _name(policy.reduce_dtype),
                 "divide_factor": factor, "force_sum": force, "wire_dtype": wire}
        if wire is None:
            entry["reduction"] = f"reduce-scattered in {_name(wire_dtype)}: a dtype the specification does not state"
        else:
            pre, post, op = grad_reduction.fsdp2_divide_factors(wire, world, factor, force)
            if op == "avg":
                steps = f"ReduceOp.AVG: the {wire} sum, then divided by {world} in {wire}"
            elif op == "premul_sum":
                steps = f"ReduceOp.PREMUL_SUM(1/{factor:g}) (NCCL only: gloo refuses it)"
            else:
                steps = ("SUM" + (f" after a pre-division by {pre:g}" if pre not in (None, 1) else "")
                         + (f", then divided by {post:g}" if post not in (None, 1) else ""))
            entry["reduction"] = (f"computed in {_name(policy.param_dtype)}, reduce-scattered in {wire}: {steps} "
                                  "(reference.grad_reduction rule 8)")
        out.append(entry)
    return out


def find_reductions() -> list[dict[str, Any]]:
    """Every live DDP and FSDP2 module's reduction settings (empty when neither is imported)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):  # both wrappers need a process group
        return []
    ddp_mod = sys.modules.get("torch.nn.parallel.distributed")
    fsdp_mod = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    if ddp_mod is None and fsdp_mod is None:
        return []
    ddp_cls = getattr(ddp_mod, "DistributedDataParallel", None)
    fsdp_cls = getattr(fsdp_mod, "FSDPModule", None)
    out: list[dict[str, Any]] = []
    for obj in gc.get_objects():
        try:
            # type(), not isinstance: some objects warn when their __class__ is read.
            if ddp_cls is not None and issubclass(type(obj), ddp_cls):
                out.append(describe_ddp(obj))
            elif fsdp_cls is not None and issubclass(type(obj), fsdp_cls):
                out += describe_fsdp2(obj)
        except (AttributeError, RuntimeError, TypeError, ReferenceError) as e:  # a wrapper torch reorganised
            out.append({"wrapper": type(obj).__name__, "reduction": f"not read: {type(e).__name__}: {e}"})
    # One entry per distinct setting, naming the modules that share it (FSDP2 wraps many).
    merged: dict[tuple, dict[str, Any]] = {}
    for entry in out:
        key = tuple(sorted((k, repr(v)) for k, v in entry.items() if k != "module"))
        seen = merged.setdefault(key, {**{k: v for k, v in entry.items() if k != "module"}, "modules": []})
        if entry.get("module") is not None:
            seen["modules"].append(entry["module"])
    return list(merged.values())
