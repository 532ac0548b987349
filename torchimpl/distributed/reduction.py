"""Rule 11 of ``torchimpl.distributed``: the gradient reduction and FSDP2's parameter dtype.

``train.reduce_dtype`` and the precision section become a :class:`ReductionSettings`
(`reduction_settings`, pure, no process group); `reduction_problems` refuses, before any
collective, what torch would refuse later or run differently from what the fields say.
``reference.grad_reduction`` states what each setting rounds (rules 4, 7, 8 there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["ReductionSettings", "reduction_problems", "reduction_settings"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Precision modes whose parameters are held in a low-precision dtype (Lightning's spellings).
_HELD_IN = {"bf16-true": "bf16", "fp16-true": "fp16", "16-true": "fp16"}
_NCCL_BF16 = (2, 10)  # DistributedDataParallel._check_comm_hook: bf16_compress_hook needs NCCL >= 2.10


@dataclass(frozen=True)
class ReductionSettings:
    """What the wrapped model reduces in (``reduce_dtype``) and, under FSDP2, computes in
    (``param_dtype``: None keeps the parameters' own dtype; ``"bf16"``/``"fp16"`` casts a compute
    copy of fp32 shards, the sharded form of an fp32 master copy)."""

    reduce_dtype: str = "fp32"
    param_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.reduce_dtype not in ("fp32", "bf16"):
            raise ValueError(f"reduce_dtype must be 'fp32' or 'bf16', got {self.reduce_dtype!r}")
        if self.param_dtype not in (None, "bf16", "fp16"):
            raise ValueError(f"param_dtype must be None, 'bf16' or 'fp16', got {self.param_dtype!r}")

    def fsdp_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy``: ``param_dtype`` from the precision, ``reduce_dtype`` as set."""
        from torch.distributed.fsdp import MixedPrecisionPolicy  # loaded when used (slow to import)

        param = None if self.param_dtype is None else _DTYPES[self.param_dtype]
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=_DTYPES[self.reduce_dtype])

    def ddp_hook(self) -> Callable[..., Any] | None:
        """DDP's comm hook: None (DDP's own float32 averaging) or ``bf16_compress_hook``."""
        if self.reduce_dtype == "fp32":
            return None
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # loaded when used (slow to import)

        return default_hooks.bf16_compress_hook

    def describe(self, mode: str) -> str:
        """One line for the log: what crosses the ranks and how it is divided."""
        if mode == "fsdp2":
            param = "the parameters' own dtype" if self.param_dtype is None else f"{self.param_dtype} copies of fp32 shards"
            return (f"FSDP2 computes in {param}, reduce-scatters gradients in {self.reduce_dtype} "
                    "(ReduceOp.AVG: the sum, then the division by the world size)")
        if self.reduce_dtype == "bf16":
            return "DDP all-reduces gradients in bf16 (bf16_compress_hook: divided by the world size in bf16, then summed)"
        return "DDP all-reduces gradients in fp32 (each rank's share divided before the sum)"


def reduction_settings(mode: str, precision_mode: str, master_weights: str | None,
                       reduce_dtype: str) -> ReductionSettings:
    """The settings for ``train.distributed=mode`` from the configuration's strings.

    Under ``fsdp2``, parameters held in bf16 (``bf16-true``) or fp16 (``fp16-true``) with
    ``master_weights="fp32"`` are ``param_dtype=bf16``/``fp16`` over fp32 shards: FSDP2 keeps the
    fp32 copy and casts the compute copy after each step, which is what the fp32 master does.
    Any other master-weight option would need the shards themselves held in low precision:
    refused (ValueError naming ``precision.master_weights``).
    """
    held = _HELD_IN.get(precision_mode)
    if mode != "fsdp2" or held is None:
        return ReductionSettings(reduce_dtype, None)
    if master_weights != "fp32":
        raise ValueError(
            f"precision.master_weights: {master_weights!r} with precision.mode={precision_mode!r} cannot run under "
            "train.distributed='fsdp2', whose shards are always fp32 with a low-precision compute copy; set "
            "precision.master_weights='fp32' (FSDP2's MixedPrecisionPolicy(param_dtype=...)), or use "
            "train.distributed='ddp' or 'none' for the other options")
    return ReductionSettings(reduce_dtype, held)


def _nccl_version() -> tuple[int, ...] | None:
    try:
        return tuple(torch.cuda.nccl.version()) if torch.cuda.is_available() else None
    except (AttributeError, RuntimeError):  # a build without NCCL
        return None


def reduction_problems(mode: str, settings: ReductionSettings, device: torch.device,
                       nccl_version: tuple[int, ...] | None = None) -> list[tuple[str, str]]:
    """``(field, message)`` for each setting torch cannot run on ``device``; empty if it can.

    DDP's ``bf16_compress_hook`` runs only on CUDA with NCCL >= 2.10 (``nccl_version``, read from
    torch when not given); FSDP2's bf16 reduction runs on gloo and NCCL alike.
    """
    if settings.reduce_dtype == "fp32":
        return []
    if mode == "none":
        return [("train.reduce_dtype", f"{settings.reduce_dtype!r} needs train.distributed 'ddp' or 'fsdp2'")]
    if mode != "ddp":
        return []
    if device.type != "cuda":
        return [("train.reduce_dtype", f"'bf16' under train.distributed='ddp' is torch's bf16_compress_hook, "
                                       f"which torch runs only on CUDA with NCCL >= 2.10, not on {device.type} "
                                       "(gloo): use train.distributed='fsdp2' or train.reduce_dtype='fp32'")]
    version = _nccl_version() if nccl_version is None else nccl_version
    if version is None or tuple(version[:2]) < _NCCL_BF16:
        found = "no NCCL" if version is None else "NCCL " + ".".join(map(str, version))
        return [("train.reduce_dtype", f"'bf16' under train.distributed='ddp' (bf16_compress_hook) needs NCCL >= "
                                       f"2.10; this torch has {found}: use train.distributed='fsdp2' or "
                                       "train.reduce_dtype='fp32'")]
    return []
