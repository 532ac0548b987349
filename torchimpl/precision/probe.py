"""What the doctor records during one step: every module's forward output and the gradient that
reaches it, and each float8 layer's operands.

1. ``Recorder`` hooks every named module except the root (whose output is the loss): its
   first floating output tensor per call, detached, in the order the hooks fire (innermost
   and earliest first), and the gradient reaching that tensor in backward. A module called
   several times in one forward keeps every call.
2. ``Fp8Probe`` hooks the float8 layers (torchao's ``Float8Linear``): the input as the layer
   receives it (after the autocast cast), the weight, and the gradient of the output.
3. Hooks are removed by ``remove()``; the recorded tensors are references, dropped with the
   recorder after each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Call", "Fp8Operands", "Fp8Probe", "Recorder", "first_float"]


def first_float(value: Any) -> torch.Tensor | None:
    """The first floating tensor in a module's output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for v in items:
        found = first_float(v)
        if found is not None:
            return found
    return None


@dataclass
class Call:
    """One call of a module: its output and (after backward) the gradient reaching it."""

    output: torch.Tensor
    grad: torch.Tensor | None = None


@dataclass
class _Hooks:
    handles: list[Any] = field(default_factory=list)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class Recorder(_Hooks):
    """Rule 1: ``calls[name]`` in call order; ``order`` the names in first-firing order."""

    def __init__(self, model: nn.Module, grads: bool = True) -> None:
        super().__init__()
        self.calls: dict[str, list[Call]] = {}
        self.order: list[str] = []
        for name, module in model.named_modules():
            if name:
                self.handles.append(module.register_forward_hook(self._hook(name, grads)))

    def _hook(self, name: str, grads: bool):  # noqa: ANN202 - a forward hook
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            t = first_float(output)
            if t is None:
                return
            call = Call(t.detach())
            if name not in self.calls:
                self.calls[name] = []
                self.order.append(name)
            self.calls[name].append(call)
            if grads and t.requires_grad and torch.is_grad_enabled():
                def keep(g: torch.Tensor) -> None:
                    call.grad = g.detach()

                t.register_hook(keep)

        return hook


@dataclass
class Fp8Operands:
    """Rule 2: one call of a float8 layer."""

    input: torch.Tensor
    weight: torch.Tensor
    grad_output: torch.Tensor | None = None


def is_float8_layer(module: nn.Module) -> bool:
    """torchao's float8 linear layers (by class name: torchao is imported only for fp8)."""
    return type(module).__name__ in ("Float8Linear", "MXLinear", "MXFP8Linear")


class Fp8Probe(_Hooks):
    """Rule 2: ``calls[name]`` for every float8 layer of ``model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.calls: dict[str, list[Fp8Operands]] = {}
        for name, module in model.named_modules():
            if is_float8_layer(module):
                self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):  # noqa: ANN202 - a forward hook
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is None or not isinstance(output, torch.Tensor):
                return
            ops = Fp8Operands(x.detach(), module.weight.detach())
            self.calls.setdefault(name, []).append(ops)
            if output.requires_grad and torch.is_grad_enabled():
                def keep(g: torch.Tensor) -> None:
                    ops.grad_output = g.detach()

                output.register_hook(keep)

        return hook
