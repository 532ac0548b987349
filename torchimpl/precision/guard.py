"""Where a non-finite value appears while a model runs, and which tensors sit on the wrong device.

Rules:
1. ``NonFiniteGuard`` checks, while installed, every module's forward outputs (and the root
   module's inputs) and the gradient reaching each module output during backward, and raises
   ``NonFiniteError`` at the first non-finite one, naming the module's qualified name, the tensor
   (``input[0]``, ``output``, ``output[1]``, ``output['logits']``, ``grad_output[0]``), its dtype
   and its counts of inf and NaN. Forward hooks fire innermost-first, so the module named is the
   innermost one whose output went non-finite. Every check forces a host sync: the guard is a
   debugging tool, not for production runs. After ``remove()`` no hook remains and nothing runs.
2. ``check_placement`` lists parameters, buffers and plain tensor attributes (which
   ``module.to()`` does not move, including tensors held one level deep in a list, tuple or dict
   attribute) that are not on the device, or (when ``dtype`` is given) floating tensors whose
   dtype differs from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchimpl.precision.device import same_device

__all__ = ["Misplacement", "NonFiniteError", "NonFiniteGuard", "check_placement"]

log = logging.getLogger(__name__)

_GUARD_MARK = "_ampspec_nonfinite_guard"


class NonFiniteError(RuntimeError):
    """A module's output (or the gradient reaching it) held inf or NaN."""

    def __init__(
        self,
        module_name: str,
        module_type: str,
        tensor: str,
        dtype: torch.dtype,
        num_inf: int,
        num_nan: int,
        numel: int,
        phase: str,
    ) -> None:
        self.module_name = module_name
        self.module_type = module_type
        self.tensor = tensor
        self.dtype = dtype
        self.num_inf = num_inf
        self.num_nan = num_nan
        self.numel = numel
        self.phase = phase
        shown = module_name or "<root>"
        hint = (
            " (the op that consumed this output in forward produced the non-finite gradient)"
            if phase == "backward"
            else ""
        )
        super().__init__(
            f"non-finite {phase} value at module {shown} ({module_type}): {tensor} "
            f"({dtype}) has {num_inf} inf and {num_nan} NaN of {numel} elements{hint}"
        )


def _tensors_with_paths(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _tensors_with_paths(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors_with_paths(v, f"{path}[{k!r}]")


def _nonfinite_counts(t: torch.Tensor) -> tuple[int, int] | None:
    """(inf count, NaN count) when ``t`` is a floating tensor with a non-finite value, else None."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return None
    if bool(torch.isfinite(t).all()):
        return None
    return int(torch.isinf(t).sum()), int(torch.isnan(t).sum())


class NonFiniteGuard:
    """Hooks that raise ``NonFiniteError`` at the first non-finite module output or output
    gradient (rule 1). Installed on construction; use as a context manager or call ``remove()``.
    """

    def __init__(self, model: nn.Module, *, forward: bool = True, backward: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
        if not (forward or backward):
            raise ValueError("at least one of forward and backward must be True")
        self.model = model
        self.forward = forward
        self.backward = backward
        self._handles: list[Any] = []
        self._active = False
        self.install()

    @property
    def installed(self) -> bool:
        return self._active

    def install(self) -> None:
        """Register the hooks (a no-op when already installed)."""
        if self._active:
            return
        self._active = True
        root_hook = self._make_input_hook(type(self.model).__name__)
        self._handles.append(self.model.register_forward_pre_hook(root_hook))
        for name, module in self.model.named_modules():
            hook = self._make_output_hook(name, type(module).__name__)
            self._handles.append(module.register_forward_hook(hook))

    def remove(self) -> None:
        """Remove every hook; gradient hooks already attached to live tensors become no-ops."""
        self._active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> NonFiniteGuard:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _check(self, name: str, mtype: str, path: str, t: torch.Tensor, phase: str) -> None:
        counts = _nonfinite_counts(t)
        if counts is not None:
            raise NonFiniteError(name, mtype, path, t.dtype, counts[0], counts[1], t.numel(), phase)

    def _make_input_hook(self, mtype: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self._active and self.forward:
                for path, t in _tensors_with_paths(args, "input"):
                    self._check("", mtype, path, t, "forward")

        setattr(hook, _GUARD_MARK, True)
        return hook

    def _make_output_hook(self, name: str, mtype: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self._active:
                return
            paths = list(_tensors_with_paths(output, "output"))
            if self.forward:
                for path, t in paths:
                    self._check(name, mtype, path, t, "forward")
            if self.backward and torch.is_grad_enabled():
                for path, t in paths:
                    if t.requires_grad:
                        t.register_hook(self._make_grad_hook(name, mtype, "grad_" + path))

        setattr(hook, _GUARD_MARK, True)
        return hook

    def _make_grad_hook(self, name: str, mtype: str, path: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self._active:
                self._check(name, mtype, path, grad, "backward")

        return hook


def _strip_guard_hooks(model: nn.Module) -> None:
    """Drop NonFiniteGuard hooks from a copied model, leaving the user's own hooks in place."""
    for m in model.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            for key in [k for k, fn in hooks.items() if getattr(fn, _GUARD_MARK, False)]:
                del hooks[key]
                for extra in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                              "_forward_pre_hooks_with_kwargs"):
                    getattr(m, extra, {}).pop(key, None)


# ---------------------------------------------------------------------------------------------
# Placement


@dataclass(frozen=True)
class Misplacement:
    """A tensor not where it should be: its qualified ``name``, ``kind`` (parameter, buffer or
    attribute), its actual ``device`` and ``dtype``, and ``problem`` (device, dtype or both)."""

    name: str
    kind: str
    device: torch.device
    dtype: torch.dtype
    problem: str = "device"


def _attribute_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for attr, value in vars(module).items():
        if attr.startswith("__") or attr in ("_parameters", "_buffers", "_modules"):
            continue
        if isinstance(value, torch.Tensor):
            yield attr, value
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if isinstance(v, torch.Tensor):
                    yield f"{attr}[{i}]", v
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, torch.Tensor):
                    yield f"{attr}[{k!r}]", v


def check_placement(
    model: nn.Module, device: str | torch.device, dtype: torch.dtype | None = None
) -> list[Misplacement]:
    """Tensors of ``model`` that are off ``device`` or (floating ones) not of ``dtype`` (rule 2),
    in the order parameters, buffers, attributes; empty when everything is in place."""
    dev = torch.device(device)
    out: list[Misplacement] = []

    def consider(name: str, kind: str, t: torch.Tensor) -> None:
        wrong_device = not same_device(t.device, dev)
        wrong_dtype = dtype is not None and t.is_floating_point() and t.dtype != dtype
        if wrong_device or wrong_dtype:
            problem = "device and dtype" if wrong_device and wrong_dtype else (
                "device" if wrong_device else "dtype"
            )
            out.append(Misplacement(name, kind, t.device, t.dtype, problem))

    for name, p in model.named_parameters():
        consider(name, "parameter", p)
    for name, b in model.named_buffers():
        consider(name, "buffer", b)
    for mname, module in model.named_modules():
        for attr, t in _attribute_tensors(module):
            consider(f"{mname}.{attr}" if mname else attr, "attribute", t)
    return out


# ---------------------------------------------------------------------------------------------
# Diagnosis
