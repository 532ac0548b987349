"""What a converted float8 layer computes with, read back from the layer and seen in its casts.

The float8 properties compare torchimpl's converted layers with ``reference.fp8``; before the
numbers, they check that the layer is configured as the spec's recipe says:

- a torchao ``Float8Linear`` carries its configuration: the six casts (granularity, float8
  format), power-of-two scales and fast accumulation per matmul are read from it and built into
  the spec's ``Float8Recipe``, so that a comparison names the field that differs;
- torchao's ``MXFP8Linear`` carries only its scale mode: the element format, block size and
  mode of each of its six casts are recorded as they happen (torchao's ``to_mx``, which every
  emulated MX cast goes through), with the shape cast, so that the axes along which it blocks
  are checked too.

Imports torchao: used only by the float8 properties, which skip without it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torchao.float8.config import ScalingGranularity, ScalingType
from torchao.float8.float8_linear import Float8Linear
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
from torchao.prototype.mx_formats import mx_tensor

from conformance.bridge import to_numpy
from reference import fp8
from torchimpl.train.trainer import Callback

_GRANULARITY = {ScalingGranularity.TENSORWISE: "tensorwise", ScalingGranularity.AXISWISE: "axiswise"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cast(config) -> fp8.Cast:
    if config.scaling_type is ScalingType.DISABLED:
        return fp8.Cast("disabled")
    return fp8.Cast(_GRANULARITY[config.scaling_granularity], _dtype_name(config.target_dtype))


def float8_recipe_of(layer: torch.nn.Module, name: str) -> fp8.Float8Recipe:
    """The spec's recipe as a converted ``Float8Linear`` is configured (its ``config``)."""
    if not isinstance(layer, Float8Linear):
        raise AssertionError(f"recipe {name!r}: the converted layer is a {type(layer).__name__}, not a Float8Linear")
    c = layer.config
    return fp8.Float8Recipe(
        name, _cast(c.cast_config_input), _cast(c.cast_config_weight), _cast(c.cast_config_grad_output),
        _cast(c.cast_config_input_for_grad_weight), _cast(c.cast_config_weight_for_grad_input),
        _cast(c.cast_config_grad_output_for_grad_weight), power_of_2=c.round_scales_to_power_of_2,
        fast_accum_output=c.gemm_config_output.use_fast_accum,
        fast_accum_grad_input=c.gemm_config_grad_input.use_fast_accum,
        fast_accum_grad_weight=c.gemm_config_grad_weight.use_fast_accum)


@dataclass(frozen=True)
class MXCast:
    """One MX cast as it ran: the spec's recipe fields it used and the shape it blocked."""

    recipe: fp8.MXRecipe
    shape: tuple[int, ...]


@contextlib.contextmanager
def recorded_mx_casts(name: str) -> Iterator[list[MXCast]]:
    """Every MX cast torchao makes inside the block, in order (element format, block size,
    scale mode and the shape of the high-precision tensor, blocked along its last axis)."""
    seen: list[MXCast] = []
    original = mx_tensor.to_mx
    signature = inspect.signature(original)

    def recording(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        seen.append(MXCast(fp8.MXRecipe(name, _dtype_name(a["elem_dtype"]), a["block_size"], a["scaling_mode"].value),
                           tuple(a["data_hp"].shape)))
        return original(*args, **kwargs)

    mx_tensor.to_mx = recording  # the module attribute: MXTensor.to_mx and the dim1 casts look it up
    try:
        yield seen
    finally:
        mx_tensor.to_mx = original


def mx_cast_shapes(rows: int, k: int, n: int) -> list[tuple[int, ...]]:
    """The shapes rule 12 casts, in torchao's order: input and weight for the output,
    grad_output and the weight's transpose for grad_input, the transposes of grad_output and of
    the input (blocks along the flattened rows) for grad_weight."""
    return [(rows, k), (n, k), (rows, n), (k, n), (n, rows), (k, rows)]


def mx_layer_mode(layer: torch.nn.Module, name: str) -> str:
    """The scale mode an ``MXFP8Linear`` was built with (what torchimpl picked)."""
    if not isinstance(layer, MXFP8Linear):
        raise AssertionError(f"recipe {name!r}: the converted layer is a {type(layer).__name__}, not an MXFP8Linear")
    if layer.wgrad_with_hp:
        raise AssertionError(f"recipe {name!r}: the MX layer computes grad_weight in high precision; the spec casts it")
    return layer.scale_calculation_mode.value


class LayerRecorder(Callback):
    """A trainer callback recording, at every training step, what each converted layer computed:
    its input (as the layer received it, after torchimpl's pre-hook), weight and bias, output,
    grad_output, grad_input and the weight's gradient after the backward. Forwards without
    autograd (evaluation) are not recorded."""

    def __init__(self) -> None:
        self.steps: list[dict[str, dict]] = []
        self._current: dict[str, dict] = {}
        self._layers: dict[str, torch.nn.Module] = {}

    def on_fit_start(self, trainer) -> None:
        for name in trainer.fp8_report.converted:
            layer = trainer.model.get_submodule(name)
            self._layers[name] = layer
            layer.register_forward_hook(self._forward_hook(name))

    def _forward_hook(self, name: str):
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not output.requires_grad:
                return
            x = args[0]
            rec = {"x": to_numpy(x), "weight": to_numpy(module.weight),
                   "bias": None if module.bias is None else to_numpy(module.bias), "output": to_numpy(output)}
            output.register_hook(lambda g: rec.__setitem__("grad_output", to_numpy(g)))
            x.register_hook(lambda g: rec.__setitem__("grad_input", to_numpy(g)))
            if name in self._current:
                raise AssertionError(f"layer {name!r} ran twice in one microbatch; the recorder expects one forward")
            self._current[name] = rec

        return hook

    def on_after_backward(self, trainer, state) -> None:
        for name, rec in self._current.items():
            rec["grad_weight"] = to_numpy(self._layers[name].weight.grad)
        self.steps.append(self._current)
        self._current = {}
