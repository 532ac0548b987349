"""Inside a module: the ops of one module whose output is finite but wrong.

A module's output can be finite while its computation overflowed: a hand-written RMSNorm
``x * rsqrt((x * x).mean(-1) + eps)`` on float16 activations of std ~100 squares past 65504,
``rsqrt(inf)`` is 0, and the output is finite zeros. Comparing outputs with the fp32 shadow
shows the collapse (the SQNR); this scan names the op. Rules:

1. ``scan_module`` reruns the mixed model's forward (the same batch, random state and autocast,
   no gradient, buffers restored afterwards) with a dispatch mode that looks only at the ops
   run while ``module`` is on the stack (a pre-hook and a hook on it), so a model's other
   modules cost nothing but their forward.
2. ``overflow``: the first op whose floating inputs are all finite and whose output holds
   ±inf or NaN (a 16-bit op overflowed from finite values).
3. ``absorbed``: the first op that turns a non-finite value back into a finite one:
   ``rsqrt`` / ``reciprocal`` of ±inf, or a division whose divisor holds ±inf while the
   result is finite. With an ``overflow`` before it, this is why the output is finite.
4. ``normalization``: the first fp16 normalisation problem (``diagnostics``' check: a
   normalisation of float16 values of variance below float16's smallest normal, an fp16
   denominator below it), or ``sqrt`` / ``rsqrt`` of float16 values below the smallest normal
   that are not zero (a variance that is a subnormal: ``var + eps`` with eps lost).
5. Float8 operands and tensor subclasses are not inspected (torch has no comparisons for them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchimpl._torch_compat import TorchDispatchMode, tree_leaves
from torchimpl.precision.diagnostics import _fp16_norm_problem

__all__ = ["InnerFindings", "scan_module"]

_FP16_TINY = torch.finfo(torch.float16).tiny
_ABSORBING = ("rsqrt", "reciprocal", "div", "true_divide")


@dataclass
class InnerFindings:
    """What the scan of ``module`` saw (rules 2-4); each an (op, what happened) pair or None."""

    module: str
    overflow: tuple[str, str] | None = None
    absorbed: tuple[str, str] | None = None
    normalization: tuple[str, str] | None = None

    @property
    def found(self) -> bool:
        return any((self.overflow, self.absorbed, self.normalization))


def _plain_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, nn.Parameter) and t.is_floating_point() \
        and t.element_size() >= 2


def _subnormal_root(base: str, args: tuple) -> str | None:
    """Rule 4's second half: a square root of float16 values in (0, smallest normal)."""
    x = args[0] if args else None
    if base not in ("sqrt", "rsqrt") or not isinstance(x, torch.Tensor) or x.dtype != torch.float16:
        return None
    a = x.detach().abs()
    n = int(((a > 0) & (a < _FP16_TINY)).sum())
    if not n:
        return None
    return (f"{base} of float16 values below float16's smallest normal {_FP16_TINY:.3g} in {n} of {x.numel()} "
            f"elements (min {float(a[a > 0].min()):.3g}): a variance that float16 holds as a subnormal, with "
            "the epsilon added to it lost")


class _Scan(TorchDispatchMode):
    """Rules 2-4 on the ops run while the module is on the stack (``depth`` > 0)."""

    def __init__(self, found: InnerFindings) -> None:
        super().__init__()
        self.found = found
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if self.depth <= 0 or not all(_plain_float(t) or not t.is_floating_point() for t in leaves):
            return out
        name = func.overloadpacket.__name__
        base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
        f = self.found
        floats = [t for t in leaves if t.is_floating_point()]
        results = [t for t in tree_leaves(out) if _plain_float(t)]
        if f.overflow is None and floats and all(bool(torch.isfinite(t).all()) for t in floats):
            for t in results:
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    f.overflow = (str(func), f"{str(t.dtype).replace('torch.', '')} output has {bad} of {t.numel()} values ±inf or NaN "
                                             "from finite inputs (it overflowed)")
                    break
        if f.absorbed is None and base in _ABSORBING and results and all(bool(torch.isfinite(t).all())
                                                                         for t in results):
            source = args[1] if base in ("div", "true_divide") and len(args) > 1 else (args[0] if args else None)
            if _plain_float(source) and not bool(torch.isfinite(source).all()):
                f.absorbed = (str(func), f"{base} of an overflowed (±inf) value gave a finite result (0): the "
                                         "overflow is hidden from the module's output")
        if f.normalization is None:
            problem = _fp16_norm_problem(base, args) or _subnormal_root(base, args)
            if problem:
                f.normalization = (str(func), problem)
        return out


def scan_module(model: nn.Module, module: str, run: Callable[[], Any]) -> InnerFindings:
    """Rule 1: ``run()`` is the mixed forward (under the step's autocast and random state); the
    findings are those of the ops run inside ``model.get_submodule(module)``."""
    found = InnerFindings(module)
    scan = _Scan(found)
    target = model.get_submodule(module)

    def enter(*_: Any) -> None:
        scan.depth += 1

    def leave(*_: Any) -> None:  # a forward hook returning a value would replace the output
        scan.depth -= 1

    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    handles = [target.register_forward_pre_hook(enter), target.register_forward_hook(leave)]
    try:
        with torch.no_grad(), scan:
            run()
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
    return found
