"""Scaled float8 training through torchao: which layers convert, and what runs where.

``precision.mode: fp8`` with ``precision.fp8_recipe``:

- ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``: torchao's float8 recipes, applied with
  ``torchao.float8.convert_to_float8_training`` (the module it returns is the one trained);
- ``mxfp8``: torchao's MX recipe (``MXFP8Linear``: e4m3 elements in blocks of 32 with e8m0
  scales, rceil rounding of the scales), from its prototype namespace.

Rules:

1. Only ``nn.Linear`` layers convert, through a module filter that reports every decision. A
   layer stays in high precision when the kernels cannot take its dimensions (in_features and
   out_features multiples of 16 for the float8 recipes, of 32 for mxfp8), when it is the first
   or the last linear layer of the model (``precision.fp8_skip_first_last``, on by default: the
   layers nearest the inputs and the logits are the most sensitive to float8 rounding), or when
   it is ``nn.MultiheadAttention``'s output projection (attention reads its weight directly:
   its forward never runs, so a conversion would claim float8 that never happens).
2. A model with no eligible layer is refused with the reasons and the fix.
3. The rest of the model runs under bf16 autocast with no loss scaler (bf16 has float32's range;
   the float8 casts scale each tensor themselves). torchao's Float8Linear follows CUDA autocast
   only: on other devices a forward pre-hook casts its input to the autocast dtype as torchao
   itself does under CUDA autocast (without it the float8 matmul would quantize from float32,
   and ``rowwise_with_gw_hp``'s high-precision grad_weight would multiply a bf16 gradient by a
   float32 input and raise). The emulated MXFP8Linear multiplies in its weight's dtype: a
   pre-hook gives it float32 inputs, and its output is float32.
4. On a CPU the float8 matmuls are torch's emulation (float32 GEMMs of the pre-scaled operands;
   MX operands dequantized): a correctness run, slower than bf16, never a speed-up. On CUDA
   the float8 recipes need compute capability 8.9 (Ada, Hopper); mxfp8's native kernels need
   10.0 (Blackwell) and are emulated below that.
5. A recipe the installed torch cannot run on the device is refused before any work
   (:func:`check_recipe`, a ``ValueError`` naming ``precision.fp8_recipe`` and the fix): the
   rowwise recipes on a CPU whose ``torch._scaled_mm`` takes per-tensor scales only (torch
   2.11), found by a probe of one small matmul, not by the version number.
6. An MX layer's backward quantizes its input and gradient in blocks of 32 along the
   flattened rows (every dimension but the last), which torchao asserts mid-backward. Each MX
   layer checks its input's rows in its forward (a ``ValueError`` naming the layer, the shape
   and the fix, before any backward), and :func:`check_mx_rows` runs one batch forward before
   training (no gradients, eval mode, generators restored) so that a batch shape the blocks
   cannot take is refused before the first step.
7. Converted layers keep their parameter names (``weight``, ``bias``): model state dicts and
   checkpoints are the same as without float8, and a run resumes bit for bit on CPU.

torchao is an optional dependency (``pip install 'ampspec[fp8]'``, pinning 0.18.0, the version
whose arithmetic ``reference.fp8`` states); it is imported only when fp8 is requested.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable

import torch
from torch import nn

from torchimpl._torch_compat import scaled_mm
from torchimpl.config.sections import FP8_RECIPES
from torchimpl.precision.batches import to_device

__all__ = [
    "FP8_RECIPES",
    "ROWWISE_RECIPES",
    "TORCHAO_VERSION",
    "Fp8NotApplicable",
    "Fp8Report",
    "check_mx_batch",
    "check_mx_rows",
    "check_recipe",
    "convert_to_fp8",
    "fp8_kernel",
    "require_torchao",
    "rowwise_refusal",
    "torchao_available",
]

TORCHAO_VERSION = "0.18.0"
"""The torchao release reference.fp8 states and the conformance suite checks."""

ROWWISE_RECIPES = ("rowwise", "rowwise_with_gw_hp")
"""The recipes whose matmuls pass torch._scaled_mm an (M, 1) and a (1, N) scale."""

_FLOAT8_CAPABILITY = (8, 9)
_MX_CAPABILITY = (10, 0)


def torchao_available() -> bool:
    """Whether torchao can be imported (without importing it)."""
    return importlib.util.find_spec("torchao") is not None


def _torchao_version() -> str | None:
    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return None


def require_torchao() -> None:
    """Raise ``RuntimeError`` naming the fix when torchao is missing; warn when it is not the
    pinned version (its float8 internals change between releases)."""
    if not torchao_available():
        raise RuntimeError(
            "precision.mode 'fp8' needs torchao, which is not installed: pip install 'ampspec[fp8]' "
            f"(torchao=={TORCHAO_VERSION}), or choose precision.mode bf16")
    version = _torchao_version()
    if version is not None and version != TORCHAO_VERSION:
        warnings.warn(f"torchao {version} is installed; ampspec's float8 path was checked against "
                      f"{TORCHAO_VERSION} (pip install 'ampspec[fp8]'): run pytest conformance/test_fp8.py",
                      stacklevel=3)


def fp8_kernel(recipe: str, device: torch.device | str) -> tuple[str | None, str]:
    """(None or a reason float8 cannot run here, what runs) for ``recipe`` on ``device``."""
    dev = torch.device(device)
    if dev.type == "cpu":
        what = ("dequantized MX operands" if recipe == "mxfp8" else "float32 GEMMs of the pre-scaled float8 operands")
        return None, (f"float8 {recipe} on the CPU runs torch's emulation ({what}): a correctness run, "
                      "slower than bf16, not a speed-up")
    if dev.type != "cuda":
        return f"float8 training is not supported on {dev.type}", ""
    cap = torch.cuda.get_device_capability(dev)
    if recipe == "mxfp8":
        if cap >= _MX_CAPABILITY:
            return None, f"mxfp8 on CUDA capability {cap[0]}.{cap[1]}: native MX matmuls"
        return None, (f"mxfp8 on CUDA capability {cap[0]}.{cap[1]} (native MX needs 10.0): emulated, "
                      "a correctness run, not a speed-up")
    if cap < _FLOAT8_CAPABILITY:
        return (f"float8 matmuls need CUDA compute capability 8.9 or newer (Ada, Hopper), this GPU has "
                f"{cap[0]}.{cap[1]}"), ""
    return None, f"float8 {recipe} on CUDA capability {cap[0]}.{cap[1]}: native torch._scaled_mm"


@functools.cache
def rowwise_refusal() -> str | None:
    """None when the CPU's ``torch._scaled_mm`` takes rowwise scales, else torch's refusal.

    torch 2.11 refuses them on the CPU ("Now _scaled_mm only supports per-tensor scaling for
    CPU backend"); 2.12 and later compute them. The first rowwise forward would raise that
    mid-run, so the recipe is checked here, on a 2x16 by 16x2 matmul, once per process.
    """
    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    b = torch.ones(2, 16).to(torch.float8_e4m3fn).t()
    try:
        scaled_mm(a, b, scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2), out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError) as exc:  # an internal assert is a RuntimeError
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        return lines[-1] if lines else type(exc).__name__
    return None


def check_recipe(recipe: str, device: torch.device | str) -> None:
    """Rule 5: raise ``ValueError`` naming ``precision.fp8_recipe`` and the fix when the
    installed torch cannot run ``recipe`` on ``device``."""
    if recipe not in ROWWISE_RECIPES or torch.device(device).type != "cpu":
        return
    refused = rowwise_refusal()
    if refused is not None:
        raise ValueError(
            f"precision.fp8_recipe {recipe!r}: torch {torch.__version__}'s CPU torch._scaled_mm does not take "
            f"rowwise scales ({refused}), so its first float8 matmul would fail. Fix: precision.fp8_recipe "
            "tensorwise or mxfp8, or torch 2.12 or newer for the rowwise recipes on the CPU")


@dataclass(frozen=True)
class Fp8Report:
    """What ``convert_to_fp8`` did: the recipe, what runs where, the converted layers and the
    layers kept in high precision with the reason for each."""

    recipe: str
    kernel: str
    converted: tuple[str, ...]
    kept: tuple[tuple[str, str], ...] = field(default=())

    def lines(self) -> list[str]:
        """Human-readable lines for the log and the run summary."""
        def show(name: str) -> str:
            return name or "the model (a root nn.Linear)"

        out = [self.kernel, f"float8 ({self.recipe}): {len(self.converted)} layers: "
                            f"{', '.join(map(show, self.converted))}"]
        out += [f"high precision: {show(name)} ({why})" for name, why in self.kept]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "kernel": self.kernel, "converted": list(self.converted),
                "kept": {name: why for name, why in self.kept}}


def _decisions(model: nn.Module, recipe: str, skip_first_last: bool) -> dict[str, str | None]:
    """Rule 1: for every nn.Linear (by qualified name), None to convert or the reason to keep it."""
    attention_out = {f"{name}.out_proj" if name else "out_proj"
                     for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    multiple = 32 if recipe == "mxfp8" else 16
    out: dict[str, str | None] = {}
    callable_linears = [name for name, _ in linears if name not in attention_out]
    ends = {callable_linears[0], callable_linears[-1]} if skip_first_last and callable_linears else set()
    for name, m in linears:
        if name in attention_out:
            out[name] = "MultiheadAttention reads its weight directly; its forward never runs"
        elif m.in_features % multiple or m.out_features % multiple:
            out[name] = (f"{m.in_features}x{m.out_features}: the float8 kernels need dimensions that are "
                         f"multiples of {multiple}")
        elif name in ends:
            out[name] = ("first linear layer" if name == callable_linears[0] else "last linear layer") + \
                " (precision.fp8_skip_first_last)"
        else:
            out[name] = None
    return out


def _cast_input_hook(dtype_of: Callable[[nn.Module, torch.Tensor], torch.dtype | None]) -> Callable:
    def hook(module: nn.Module, args: tuple) -> tuple | None:
        x = args[0]
        target = dtype_of(module, x)
        if target is None or not x.is_floating_point() or x.dtype == target:
            return None
        return (x.to(target), *args[1:])

    return hook


def _autocast_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    # torchao casts for CUDA autocast itself (Float8Linear.forward); elsewhere this does the same.
    dev = x.device.type
    if dev == "cuda" or not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


def _weight_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    return module.weight.dtype


class Fp8NotApplicable(ValueError):
    """The model has no linear layer float8 can run (``convert_to_fp8`` found none eligible)."""


def convert_to_fp8(model: nn.Module, recipe: str, device: torch.device | str, *,
                   skip_first_last: bool = True) -> tuple[nn.Module, Fp8Report]:
    """Rules 1-4: the model with its eligible linear layers in float8, and the report.

    Returns the module torchao returns (a root ``nn.Linear`` is replaced, not changed in place).
    Raises ``Fp8NotApplicable`` (a ``ValueError``) when no layer is eligible, ``ValueError`` when
    the recipe cannot run here (rule 5) and
    ``RuntimeError`` when torchao is missing
    or float8 cannot run on ``device``.
    """
    if recipe not in FP8_RECIPES:
        raise ValueError(f"precision.fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {recipe!r}")
    require_torchao()
    check_recipe(recipe, device)
    why_not, kernel = fp8_kernel(recipe, device)
    if why_not is not None:
        raise RuntimeError(f"precision.mode 'fp8': {why_not}; use precision.mode bf16")
    decisions = _decisions(model, recipe, skip_first_last)
    converted = tuple(name for name, why in decisions.items() if why is None)
    kept = tuple((name, why) for name, why in decisions.items() if why is not None)
    if not converted:
        found = "; ".join(f"{n}: {w}" for n, w in kept) or "the model has no nn.Linear layer"
        raise Fp8NotApplicable(
            f"precision.mode 'fp8' found no linear layer to run in float8 ({found}). Fix: give the model "
            "nn.Linear layers whose in/out features are multiples of 16 (32 for mxfp8), set "
            "precision.fp8_skip_first_last=false to convert the first and last layers too, or choose "
            "precision.mode bf16")
    _import_torchao_quietly()
    eligible = set(converted)

    def keep(module: nn.Module, fqn: str) -> bool:
        return fqn in eligible

    if recipe == "mxfp8":
        model = _convert_mx(model, keep, device)
        hook = _cast_input_hook(_weight_dtype) if torch.device(device).type != "cuda" or \
            torch.cuda.get_device_capability(device) < _MX_CAPABILITY else None
        for name, module in model.named_modules():
            if (name or "") in eligible:
                module.register_forward_pre_hook(_mx_rows_hook(name))
    else:
        # optional dependency: torchao, only for fp8
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        model = convert_to_float8_training(model, module_filter_fn=keep,
                                           config=Float8LinearConfig.from_recipe_name(recipe))
        hook = _cast_input_hook(_autocast_dtype)
    if hook is not None:
        for name, module in model.named_modules():
            if (name or "") in eligible:
                module.register_forward_pre_hook(hook)
    return model, Fp8Report(recipe, kernel, converted, kept)


MX_BLOCK = 32
_probing = [False]  # check_mx_rows's forward checks without gradients too


def _mx_rows_message(name: str, shape: tuple[int, ...]) -> str:
    rows = math.prod(shape[:-1])
    return (f"precision.fp8_recipe 'mxfp8': layer {name or '(the root nn.Linear)'!r} gets an input of shape "
            f"{list(shape)}, {rows} rows once its leading dimensions are flattened; its backward quantizes them "
            f"in MX blocks of {MX_BLOCK}, so they must be a multiple of {MX_BLOCK}. Fix: a batch size (times the "
            f"sequence length) that is a multiple of {MX_BLOCK} (drop_last=True for a DataLoader's short last "
            "batch), or precision.fp8_recipe tensorwise")


def _mx_rows_hook(name: str) -> Callable:
    """Rule 6: refuse an input whose flattened rows the MX backward cannot block."""
    def hook(module: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or not (torch.is_grad_enabled() or _probing[0]):
            return
        if math.prod(x.shape[:-1]) % MX_BLOCK:
            raise ValueError(_mx_rows_message(name, tuple(x.shape)))

    return hook


def check_mx_rows(model: nn.Module, train_data: Any, run: Callable[[nn.Module, Any], Any]) -> None:
    """Rule 6 before training: ``run(model, batch)`` (the loss function, under the run's
    autocast) on ``train_data``'s first batch without gradients, in eval mode, with torch's
    generators restored, so that a layer's ``ValueError`` comes before step 1. A one-shot
    iterator is not read (its batches belong to the run); each forward still checks."""
    if isinstance(train_data, Iterator):
        return
    was_training = model.training
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            batch = next(iter(train_data), None)
            if batch is None:
                return
            model.eval()
            _probing[0] = True
            run(model, batch)
        finally:
            _probing[0] = False
            model.train(was_training)


def check_mx_batch(model: nn.Module, train_data: Any, loss_fn: Callable[[nn.Module, Any], Any],
                   autocast: Any, device: torch.device) -> None:
    """:func:`check_mx_rows` with the trainer's loss function under the run's autocast."""

    def forward(m: nn.Module, batch: Any) -> Any:
        with autocast:
            return loss_fn(m, to_device(batch, device))

    check_mx_rows(model, train_data, forward)


def _import_torchao_quietly() -> None:
    # torchao's compiled extensions are CUDA-only; at import it logs about triton (absent
    # without CUDA) and torch logs about torchao's enum registrations: none of it concerns the run.
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
        import torchao.prototype.moe_training.mxfp8_linear  # noqa: F401
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _convert_mx(model: nn.Module, keep: Callable[[nn.Module, str], bool], device: torch.device | str) -> nn.Module:
    # optional dependency: torchao, only for fp8
    from torchao.float8.float8_linear_utils import swap_linear_layers
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    dev = torch.device(device)
    native = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= _MX_CAPABILITY
    preference = KernelPreference.AUTO if native else KernelPreference.EMULATED

    def swap(linear: nn.Linear) -> nn.Module:
        with torch.device("meta"):
            mx = MXFP8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                             kernel_preference=preference, scale_calculation_mode=ScaleCalculationMode.RCEIL)
        mx.weight, mx.bias = linear.weight, linear.bias  # the same parameters, as torchao's own swap
        return mx

    return swap_linear_layers(model, swap, module_filter_fn=keep)
