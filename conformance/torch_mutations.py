"""Mutation check at the torch level: plausible bugs in torch itself, each of which the
conformance suite must catch.

``conformance/mutations.py`` mutates ampspec's own trainer. This catalogue mutates what the
suite claims to check in torch: ``GradScaler`` (scale, unscale_, step, update, state_dict,
load_state_dict, pickling and their argument checks), the unscale and update kernels, clipping
(``clip_grad_norm_``, ``get_total_norm``, ``clip_grads_with_norm_``, ``clip_grad_value_``), the
casts, SGD/Adam/AdamW (for-loop, foreach, fused) and the autocast policy. A torch upgrade or a
new backend that brings one of these bugs must fail ``pytest conformance``.

A mutant is installed in the test process by monkeypatching torch, in one of two ways:

- a source edit of one of torch's Python functions: its source is read, one exact text edit is
  applied (it must match exactly once, else the mutant no longer applies and the check stops),
  the result is compiled in the function's own module globals and its code object replaces the
  function's, so every reference to the function (module attribute, re-export, decorator
  wrapper) runs the mutant;
- a replacement of a compiled kernel or method (``torch._amp_update_scale_``,
  ``torch.Tensor.to``, ``F.linear``...) by a Python function built from the original.

Kernels replaced by a Python reimplementation have a *control*: the same reimplementation
without the bug, which must survive (else the reimplementation, not the bug, would be what
the suite catches).

Measured before the lifecycle, call-sequence, 0-d promotion, raw-kernel and error_if_nonfinite
properties were added: 50/77 killed (of the two mutants added later, that suite kills
clip_eps_kept_in_float32 and not adam_tensor_lr_read_as_float), the 27 survivors being the latter
and the scale() dtype mutants,
every argument check of unscale_/step, fused_step_unscales_twice, update(new_scale),
state_dict/load_state_dict/pickling,
growth_in_float32, growth_at_or_past_interval, nan_found_inf_is_clean, clip_coef_true_division,
clip_zero_d_grad_not_promoted and both error_if_nonfinite mutants. After them: 77/77 killed, the two
equivalent mutants surviving as argued and both controls surviving. The tensor-lr mutants of Adagrad (for-loop,
foreach), NAdam (for-loop) and RAdam (foreach) were added after: the tensor-lr property kills each.

Run from the repository root (about 20 s per mutant on 2 cores; not part of ``pytest``):

    PYTHONPATH=. python -m conformance.torch_mutations            # every mutant
    PYTHONPATH=. python -m conformance.torch_mutations --list     # names and bugs
    PYTHONPATH=. python -m conformance.torch_mutations unscale_divides_by_scale ...

Each mutant runs ``pytest -x`` over the conformance suite (the files nearest to the bug first)
in the exact mode (``ATEN_CPU_CAPABILITY=default``, the exact-mode rerun not nested) with the
``ci`` profile, the mutant installed by this module as a pytest plugin
(``-p conformance.torch_mutations`` with ``AMPSPEC_TORCH_MUTANT=<name>``, also passed to any
pytest the suite starts). ``test_distributed.py`` is left out: its ranks are spawned processes
that a plugin of the parent does not reach. The unmutated suite runs first and must pass. A
mutant is killed when pytest fails. Mutants marked equivalent carry the argument why no result
can change; they are run too, and one that is killed is reported as a contradiction. The last
line is ``K/N killed`` over the mutants not marked equivalent; exit status 0 when all are.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import math
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENV = "AMPSPEC_TORCH_MUTANT"
PLUGIN = "conformance.torch_mutations"

SCALER = ("conformance/test_scaler.py",)
CLIP = ("conformance/test_clipping.py",)
OPTIM = ("conformance/test_optimizers.py",)
CASTS = ("conformance/test_casts.py",)
AUTOCAST = ("conformance/test_autocast.py",)
# The files a mutant run never includes (see the module docstring), and this check's own tests.
EXCLUDED = ("test_distributed.py", "test_mutations_apply.py", "test_torch_mutations_apply.py")

GRAD_SCALER = "torch.amp.grad_scaler.GradScaler"
CLIP_GRAD = "torch.nn.utils.clip_grad"


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` by ``new`` (exactly one match) in the source of ``owner.func``."""

    owner: str
    func: str
    old: str
    new: str


@dataclass(frozen=True)
class TorchMutant:
    """One plausible torch bug.

    ``edits``: source edits; ``wraps``: (dotted attribute, factory taking the original and
    returning the replacement). ``first``: conformance files to run first. ``equivalent``: the
    argument why no observable result changes (empty for a real mutant). ``control``: an
    unmutated reimplementation that must survive.
    """

    name: str
    bug: str
    first: tuple[str, ...]
    edits: tuple[Edit, ...] = ()
    wraps: tuple[tuple[str, Callable[[Any], Any]], ...] = ()
    equivalent: str = ""
    control: bool = False


class MutantDoesNotApply(RuntimeError):
    """An edit no longer matches torch's source exactly once (torch changed): update it."""


# ----------------------------------------------------------------------------- installing


def _resolve(dotted: str) -> Any:
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _function(owner: Any, name: str) -> Any:
    raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    return inspect.unwrap(raw)


def _where_to_look(fn: Any, source: str, first_line: int, anchor: str) -> str:
    """The torch file and line(s) to read when ``anchor`` does not match ``source`` exactly once:
    each match, or else the line of the function most like the anchor's first line."""
    path = inspect.getsourcefile(fn) or "<unknown file>"
    starts = sorted({source.count("\n", 0, i) for i in range(len(source)) if source.startswith(anchor, i)})
    if starts:
        return f"{path}, lines {', '.join(str(first_line + n) for n in starts)}"
    lines = source.splitlines()
    head = anchor.strip().splitlines()[0] if anchor.strip() else anchor
    close = difflib.get_close_matches(head.strip(), [ln.strip() for ln in lines], n=1, cutoff=0.0)
    if not close:
        return f"{path}, lines {first_line}-{first_line + len(lines) - 1} (the whole function)"
    n = next(i for i, ln in enumerate(lines) if ln.strip() == close[0])
    return f"{path}, line {first_line + n}, the nearest line: {close[0]!r}"


def _mutated_code(edits: list[Edit], mutant: str) -> tuple[Any, Any]:
    """(function, mutated code object) for the edits of one function; raises MutantDoesNotApply."""
    fn = _function(_resolve(edits[0].owner), edits[0].func)
    lines, first_line = inspect.getsourcelines(fn)  # edits are written with the indentation of torch's file
    source = "".join(lines)
    original = source
    for edit in edits:
        count = source.count(edit.old)
        if count != 1:
            import torch

            raise MutantDoesNotApply(
                f"mutant {mutant!r}: its edit of {edit.owner}.{edit.func} matches {count} places in the source of "
                f"torch {torch.__version__} (must be exactly 1). Anchor: {edit.old!r}. Look at "
                f"{_where_to_look(fn, original, first_line, edit.old)}, then update the anchor in "
                "conformance/torch_mutations.py")
        source = source.replace(edit.old, edit.new)
    lines = textwrap.dedent(source).splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("def "))  # drop decorators
    namespace: dict[str, Any] = {}
    exec(compile("".join(lines[start:]), f"<torch mutant {mutant}>", "exec"), fn.__globals__, namespace)
    return fn, namespace[fn.__name__].__code__


def install(mutant: TorchMutant) -> Callable[[], None]:
    """Install ``mutant`` in this process; returns the function that removes it again."""
    undo: list[Callable[[], None]] = []
    try:
        by_function: dict[tuple[str, str], list[Edit]] = {}
        for edit in mutant.edits:
            by_function.setdefault((edit.owner, edit.func), []).append(edit)
        for edits in by_function.values():
            fn, code = _mutated_code(edits, mutant.name)
            old = fn.__code__
            fn.__code__ = code
            undo.append(lambda fn=fn, old=old: setattr(fn, "__code__", old))
        for dotted, factory in mutant.wraps:
            owner_path, attr = dotted.rsplit(".", 1)
            owner = _resolve(owner_path)
            original = getattr(owner, attr)
            setattr(owner, attr, factory(original))
            undo.append(lambda owner=owner, attr=attr, original=original: setattr(owner, attr, original))
    except BaseException:
        for u in reversed(undo):
            u()
        raise

    def remove() -> None:
        for u in reversed(undo):
            u()

    return remove


def by_name(name: str) -> TorchMutant:
    for m in MUTANTS:
        if m.name == name:
            return m
    raise KeyError(f"unknown torch mutant {name!r}; known: {[m.name for m in MUTANTS]}")


def pytest_configure(config: Any) -> None:
    """As a pytest plugin: install the mutant named by ``AMPSPEC_TORCH_MUTANT`` for the session."""
    name = os.environ.get(ENV)
    if name:
        config._ampspec_torch_mutant_remove = install(by_name(name))


# ----------------------------------------------------------------------------- kernels in Python
# Reimplementations of the two scaler kernels with torch ops, so that a mutant can change one
# decision. Each has a control mutant (the reimplementation unchanged) that must survive.


def _f32(x: float) -> float:
    import torch

    return float(torch.tensor(x, dtype=torch.float64).float())  # one round-to-nearest-even


def _update_kernel(bug: str = "") -> Callable[[Any], Any]:
    """torch._amp_update_scale_ in Python (AmpGradScalerKernels.cpp), with an optional bug."""

    def factory(original: Any) -> Any:
        import torch

        def _amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
            s, t, f = float(scale.item()), int(growth_tracker.item()), float(found_inf.item())
            found = (f > 0) if bug == "nan_found_inf_is_clean" else (f != 0.0 or math.isnan(f))
            if found:
                if bug == "backoff_in_float32":
                    new = float(scale * torch.tensor(backoff_factor, dtype=torch.float32))
                else:
                    new = _f32(s * backoff_factor)
                if bug == "backoff_floor_at_smallest_normal" and new < 2.0**-126:
                    new = 2.0**-126
                if bug == "found_inf_sum_backs_off_per_flag" and f >= 2:
                    new = _f32(new * backoff_factor)
                s, t = new, (t if bug == "overflow_keeps_tracker" else 0)
            else:
                successful = t + 1
                due = successful >= growth_interval if bug == "growth_at_or_past_interval" else (
                    successful == growth_interval + 1 if bug == "growth_one_step_late" else successful == growth_interval)
                if due:
                    if bug == "growth_in_float32":
                        grown = float(scale * torch.tensor(growth_factor, dtype=torch.float32))
                    else:
                        grown = _f32(s * growth_factor)
                    if math.isfinite(grown) or bug == "growth_past_float32_max":
                        s = grown
                    t = successful if (bug == "refused_growth_keeps_tracker" and not math.isfinite(grown)) else 0
                else:
                    t = successful
            scale.fill_(s)
            growth_tracker.fill_(t)
            return scale

        return _amp_update_scale_

    return factory


def _unscale_kernel(bug: str = "") -> Callable[[Any], Any]:
    """torch._amp_foreach_non_finite_check_and_unscale_ in Python, with an optional bug.

    The original still validates the arguments (it is called on an empty list of the same
    flag and factor), so argument errors stay torch's."""

    def factory(original: Any) -> Any:
        import torch

        def _amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale):
            original([], found_inf, inv_scale)
            inv = float(inv_scale.item())
            hits = 0
            if bug == "found_inf_overwritten_per_call":
                found_inf.fill_(0.0)
            for g in grads:
                wide = g.double()
                if bug == "found_inf_misses_nan":
                    bad = bool(torch.isinf(wide).any())
                elif bug == "found_inf_misses_negative_inf":
                    bad = bool((wide == math.inf).any() or torch.isnan(wide).any())
                else:
                    bad = not bool(torch.isfinite(wide).all())
                hits += bad
                if bad and bug == "unscale_stops_at_first_nonfinite":
                    found_inf.fill_(1.0)
                    return
                if inv != 1.0 or bug == "no_shortcut_at_inv_one":
                    if g.dtype == torch.float64 and bug == "float64_unscaled_in_float32":
                        g.copy_(g.float() * inv_scale)
                    elif g.dtype == torch.float64:
                        g.mul_(torch.tensor(inv, dtype=torch.float64))  # the float32 inverse, widened
                    elif g.dtype == torch.float32:
                        g.mul_(inv_scale)
                    elif bug == "bfloat16_unscaled_in_bfloat16" and g.dtype == torch.bfloat16:
                        g.mul_(inv_scale.to(torch.bfloat16))
                    else:
                        g.copy_(g.float() * inv_scale)
            if bug == "found_inf_after_unscale":
                hits = sum(not bool(torch.isfinite(g.double()).all()) for g in grads)
            if bug == "found_inf_counts_tensors":
                found_inf.add_(float(hits))
            elif hits:
                found_inf.fill_(1.0)

        return _amp_foreach_non_finite_check_and_unscale_

    return factory


# ----------------------------------------------------------------------------- casts, autocast


def _cast_wrapper(src: str, dst: str, fix: Callable[[Any, Any, Any], Any]) -> Callable[[Any], Any]:
    """``Tensor.to`` that post-processes conversions from dtype ``src`` to ``dst`` with
    ``fix(original_to, source_tensor, result)``; everything else is the original."""

    def factory(original: Any) -> Any:
        import torch

        s, d = getattr(torch, src), getattr(torch, dst)

        def to(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if isinstance(result, torch.Tensor) and self.dtype == s and result.dtype == d:
                return fix(original, self, result)
            return result

        return to

    return factory


def _bf16_truncate(to: Any, src: Any, result: Any) -> Any:
    import torch

    bits = to(src.contiguous().view(torch.int32) >> 16, torch.int16)  # drop the low half: round toward zero
    return bits.view(torch.bfloat16).to(result.device)


def _fp16_flush(to: Any, src: Any, result: Any) -> Any:
    import torch

    tiny = to(result, torch.float32).abs() < 2.0**-14
    return torch.where(tiny, torch.zeros_like(result) * to(result, torch.float32).sign().to(result.dtype), result)


def _f64_to_f16_once(to: Any, src: Any, result: Any) -> Any:
    import numpy as np
    import torch

    return torch.from_numpy(src.detach().cpu().numpy().astype(np.float16)).to(result.device)  # one rounding


def _e5m2_saturate(to: Any, src: Any, result: Any) -> Any:
    import torch

    wide = to(result, torch.float32)
    over = torch.isinf(wide) & torch.isfinite(to(src, torch.float32))
    return to(torch.where(over, wide.sign() * 57344.0, wide), torch.float8_e5m2)


def _e4m3fn_nan(to: Any, src: Any, result: Any) -> Any:
    import torch

    wide = to(src, torch.float32)
    over = (wide.abs() >= 464.0) | torch.isinf(wide)  # ml_dtypes' non-saturating conversion
    return torch.where(over, torch.full_like(result, float("nan")), result)


def _autocast_dtype(t: Any) -> Any:
    import torch

    return torch.get_autocast_dtype(t.device.type)


def _linear_in_float32(original: Any) -> Any:
    import torch

    def linear(input, weight, bias=None):
        if torch.is_autocast_enabled(input.device.type):
            with torch.autocast(input.device.type, enabled=False):
                return original(input.float(), weight.float(), None if bias is None else bias.float())
        return original(input, weight, bias)

    return linear


def _mse_in_low_precision(original: Any) -> Any:
    import torch

    def mse_loss(input, target, *args, **kwargs):
        if torch.is_autocast_enabled(input.device.type):
            low = _autocast_dtype(input)
            with torch.autocast(input.device.type, enabled=False):
                return original(input.to(low), target.to(low), *args, **kwargs)
        return original(input, target, *args, **kwargs)

    return mse_loss


def _cat_in_low_precision(original: Any) -> Any:
    import torch

    def cat(tensors, *args, **kwargs):
        tensors = list(tensors)
        if tensors and torch.is_autocast_enabled(tensors[0].device.type) and all(t.is_floating_point() for t in tensors):
            low = _autocast_dtype(tensors[0])
            tensors = [t.to(low) for t in tensors]
        return original(tensors, *args, **kwargs)

    return cat


# ----------------------------------------------------------------------------- the catalogue


def _gs(func: str, old: str, new: str) -> Edit:
    return Edit(GRAD_SCALER, func, old, new)


def _clip(func: str, old: str, new: str) -> Edit:
    return Edit(CLIP_GRAD, func, old, new)


_UPDATE = "torch._amp_update_scale_"
_UNSCALE = "torch._amp_foreach_non_finite_check_and_unscale_"
_MUL = "torch._foreach_mul_(device_grads, clip_coef_clamped.to(device))"

MUTANTS: tuple[TorchMutant, ...] = (
    # --- GradScaler.scale
    TorchMutant("scale_casts_scale_to_loss_dtype", "scale() rounds the scale to the loss's dtype before multiplying",
                SCALER, edits=(_gs("scale", "return outputs * scale.to(device=outputs.device, non_blocking=True)",
                                   "return outputs * scale.to(device=outputs.device, dtype=outputs.dtype, "
                                   "non_blocking=True)"),)),
    TorchMutant("scale_keeps_loss_dtype", "scale() casts the product back to the loss's dtype (a 0-d 16-bit "
                "loss stays 16-bit, as ShardedGradScaler does)", SCALER,
                edits=(_gs("scale", "return outputs * scale.to(device=outputs.device, non_blocking=True)",
                           "return (outputs * scale.to(device=outputs.device, non_blocking=True)).to(outputs.dtype)"),)),
    # --- GradScaler.unscale_ and its checks
    TorchMutant("unscale_divides_by_scale", "unscale_ divides the gradients by the scale (true division) instead of "
                "multiplying by the float32 inverse", SCALER,
                edits=(_gs("unscale_", 'optimizer_state["found_inf_per_device"] = self._unscale_grads_(\n'
                           '            optimizer, inv_scale, found_inf, False\n        )',
                           'optimizer_state["found_inf_per_device"] = self._unscale_grads_(\n'
                           '            optimizer, torch.ones_like(inv_scale), found_inf, False\n        )\n'
                           '        for _g in [p.grad for g in optimizer.param_groups for p in g["params"] '
                           'if p.grad is not None]:\n            _g.div_(self._scale)'),)),
    TorchMutant("unscale_reciprocal_in_float32", "the inverse scale is a float32 reciprocal, not a float64 one "
                "rounded to float32", SCALER,
                edits=(_gs("unscale_", "self._scale.double().reciprocal().float()", "self._scale.reciprocal()"),),
                # IEEE float32 division is correctly rounded, and so is f32(1 / f64(S)): rounding the
                # float64 quotient (itself correctly rounded) to float32 is innocuous because
                # 53 >= 2 * 24 + 2, so both give the float32 nearest to 1/S, for every S including
                # subnormal ones (both +inf), 0 (+inf), inf (0) and NaN.
                equivalent="f32(1/f64(S)) is the correctly rounded float32 1/S, which float32 division gives"),
    TorchMutant("unscale_allows_fp16", "unscale_ accepts float16 gradients instead of refusing them", SCALER,
                edits=(_gs("unscale_", "optimizer, inv_scale, found_inf, False", "optimizer, inv_scale, found_inf, True"),)),
    TorchMutant("second_unscale_allowed", "a second unscale_ before update() unscales again instead of raising",
                SCALER, edits=(_gs("unscale_", 'if optimizer_state["stage"] is OptState.UNSCALED:', "if False:"),)),
    TorchMutant("unscale_after_step_allowed", "unscale_ after step() runs instead of raising", SCALER,
                edits=(_gs("unscale_", 'elif optimizer_state["stage"] is OptState.STEPPED:', "elif False:"),)),
    # --- GradScaler.step
    TorchMutant("second_step_allowed", "a second step() before update() steps again instead of raising", SCALER,
                edits=(_gs("step", 'if optimizer_state["stage"] is OptState.STEPPED:', "if False:"),)),
    TorchMutant("closure_accepted", "step(closure=...) runs the closure instead of refusing it", SCALER,
                edits=(_gs("step", 'if "closure" in kwargs:', "if False:"),)),
    TorchMutant("step_without_inf_checks_steps", "step() of an optimizer with no gradient steps instead of raising",
                SCALER, edits=(_gs("step", 'if len(optimizer_state["found_inf_per_device"]) == 0:', "if False:"),)),
    TorchMutant("step_ignores_found_inf", "step() calls optimizer.step() even when a gradient was inf/NaN", SCALER,
                edits=(_gs("_maybe_opt_step", 'if not sum(v.item() for v in optimizer_state["found_inf_per_device"]'
                           '.values()):', "if True:"),)),
    TorchMutant("fused_step_unscales_twice", "step() of a fused optimizer passes the scale even after an explicit "
                "unscale_ (the kernel divides a second time)", OPTIM,
                edits=(_gs("step", 'getattr(optimizer, "grad_scale", None)\n                    if optimizer_state["stage"]'
                           ' == OptState.UNSCALED', 'scaler * getattr(optimizer, "grad_scale", 1)\n'
                           '                    if optimizer_state["stage"] == OptState.UNSCALED'),)),
    # --- GradScaler.update
    TorchMutant("update_reads_only_first_optimizer", "update() takes the first optimizer's found_inf and ignores "
                "the others'", SCALER, edits=(_gs("update", "if len(found_infs) > 1:", "if False:"),)),
    TorchMutant("update_per_optimizer", "update() runs the update kernel once per optimizer (a backoff, or a "
                "tracker step, for each)", SCALER,
                edits=(_gs("update", "            torch._amp_update_scale_(\n                _scale,\n"
                           "                _growth_tracker,\n                found_inf_combined,",
                           "            for found_inf_combined in found_infs[:-1]:\n"
                           "                torch._amp_update_scale_(_scale, _growth_tracker, found_inf_combined,\n"
                           "                    self._growth_factor, self._backoff_factor, self._growth_interval)\n"
                           "            found_inf_combined = found_infs[-1]\n"
                           "            torch._amp_update_scale_(\n                _scale,\n"
                           "                _growth_tracker,\n                found_inf_combined,"),)),
    TorchMutant("update_new_scale_resets_tracker", "update(new_scale) also restarts the growth tracker", SCALER,
                edits=(_gs("update", "self._scale.fill_(new_scale)",
                           "self._scale.fill_(new_scale)\n                _growth_tracker.fill_(0)"),)),
    TorchMutant("update_new_scale_keeps_stages", "update(new_scale) does not reset the per-optimizer stages",
                SCALER, edits=(_gs("update", "                self._scale.copy_(new_scale)\n",
                                   "                self._scale.copy_(new_scale)\n            return\n"),
                               _gs("update", "                self._scale.fill_(new_scale)\n",
                                   "                self._scale.fill_(new_scale)\n                return\n"))),
    # --- state_dict / load_state_dict / lazy init / pickling
    TorchMutant("state_dict_scale_from_init", "state_dict() saves the initial scale instead of the live one",
                SCALER, edits=(_gs("state_dict", '"scale": self.get_scale(),', '"scale": self._init_scale,'),)),
    TorchMutant("state_dict_tracker_from_init", "state_dict() saves the initial growth tracker instead of the live "
                "one", SCALER, edits=(_gs("state_dict", '"_growth_tracker": self._get_growth_tracker(),',
                                          '"_growth_tracker": self._init_growth_tracker,'),)),
    TorchMutant("get_scale_rounds_before_first_scale", "get_scale()/state_dict() before the first scale() give "
                "the float32-rounded init_scale, not the value given", SCALER,
                edits=(_gs("get_scale", "self._init_scale\n",
                           "float(torch.tensor(self._init_scale, dtype=torch.float32))\n"),)),
    TorchMutant("load_state_dict_skips_live_scale", "load_state_dict() into a scaler in use leaves its live scale",
                SCALER, edits=(_gs("load_state_dict", 'self._scale.fill_(state_dict["scale"])', "pass"),)),
    TorchMutant("load_state_dict_skips_live_tracker", "load_state_dict() into a scaler in use leaves its live "
                "growth tracker", SCALER,
                edits=(_gs("load_state_dict", 'self._growth_tracker.fill_(state_dict["_growth_tracker"])', "pass"),)),
    TorchMutant("load_state_dict_keeps_growth_factor", "load_state_dict() keeps the scaler's own growth factor",
                SCALER, edits=(_gs("load_state_dict", 'self._growth_factor = cast(float, state_dict["growth_factor"])',
                                   "pass"),)),
    TorchMutant("load_state_dict_keeps_growth_interval", "load_state_dict() keeps the scaler's own growth interval",
                SCALER, edits=(_gs("load_state_dict",
                                   'self._growth_interval = cast(int, state_dict["growth_interval"])', "pass"),)),
    TorchMutant("lazy_init_ignores_loaded_tracker", "the first scale() after load_state_dict() starts the growth "
                "tracker at 0 instead of the loaded value", SCALER,
                edits=(_gs("_lazy_init_scale_growth_tracker", "(), self._init_growth_tracker,", "(), 0,"),)),
    TorchMutant("pickle_loses_growth_tracker", "pickling a scaler in use drops its growth tracker", SCALER,
                edits=(_gs("__getstate__", 'state["_init_growth_tracker"] = self._get_growth_tracker()', "pass"),)),
    # --- the unscale kernel
    TorchMutant("control_unscale_kernel", "none: the Python unscale kernel these mutants edit", SCALER,
                wraps=((_UNSCALE, _unscale_kernel()),), control=True),
    TorchMutant("found_inf_after_unscale", "the inf check looks at the unscaled values (an overflow the unscale "
                "causes is caught)", SCALER, wraps=((_UNSCALE, _unscale_kernel("found_inf_after_unscale")),)),
    TorchMutant("unscale_stops_at_first_nonfinite", "the kernel stops at the first non-finite gradient, leaving the "
                "rest scaled", SCALER, wraps=((_UNSCALE, _unscale_kernel("unscale_stops_at_first_nonfinite")),)),
    TorchMutant("found_inf_misses_nan", "the inf check sees +-inf but not NaN", SCALER,
                wraps=((_UNSCALE, _unscale_kernel("found_inf_misses_nan")),)),
    TorchMutant("found_inf_misses_negative_inf", "the inf check sees +inf and NaN but not -inf", SCALER,
                wraps=((_UNSCALE, _unscale_kernel("found_inf_misses_negative_inf")),)),
    TorchMutant("found_inf_counts_tensors", "found_inf counts the non-finite tensors instead of being set to 1.0",
                OPTIM + SCALER, wraps=((_UNSCALE, _unscale_kernel("found_inf_counts_tensors")),)),
    TorchMutant("found_inf_overwritten_per_call", "each kernel call (one per dtype) overwrites found_inf instead of "
                "only setting it", SCALER, wraps=((_UNSCALE, _unscale_kernel("found_inf_overwritten_per_call")),)),
    TorchMutant("bfloat16_unscaled_in_bfloat16", "bfloat16 gradients are multiplied by the inverse rounded to "
                "bfloat16", SCALER, wraps=((_UNSCALE, _unscale_kernel("bfloat16_unscaled_in_bfloat16")),)),
    TorchMutant("float64_unscaled_in_float32", "float64 gradients are unscaled in float32", SCALER,
                wraps=((_UNSCALE, _unscale_kernel("float64_unscaled_in_float32")),)),
    TorchMutant("no_shortcut_at_inv_one", "the kernel multiplies by an inverse of exactly 1 instead of leaving the "
                "gradients alone", SCALER, wraps=((_UNSCALE, _unscale_kernel("no_shortcut_at_inv_one")),),
                # x * 1.0 is x exactly for every finite x (subnormals and -0 included) and for +-inf, in
                # every dtype; NaN * 1.0 is NaN, and NaN is compared as a class (its payload is not part
                # of any rule torch keeps across its CPU paths).
                equivalent="x * 1 == x for every non-NaN x; NaN stays NaN and NaN is compared as a class"),
    # --- the update kernel
    TorchMutant("control_update_kernel", "none: the Python update kernel these mutants edit", SCALER,
                wraps=((_UPDATE, _update_kernel()),), control=True),
    TorchMutant("growth_in_float32", "growth multiplies in float32 (f32(S) * f32(growth_factor), as "
                "ShardedGradScaler's CPU update does)", SCALER, wraps=((_UPDATE, _update_kernel("growth_in_float32")),)),
    TorchMutant("backoff_in_float32", "backoff multiplies in float32 (f32(S) * f32(backoff_factor))", SCALER,
                wraps=((_UPDATE, _update_kernel("backoff_in_float32")),)),
    TorchMutant("growth_past_float32_max", "growth keeps a scale that overflowed to inf", SCALER,
                wraps=((_UPDATE, _update_kernel("growth_past_float32_max")),)),
    TorchMutant("refused_growth_keeps_tracker", "a growth refused for overflow leaves the tracker counting", SCALER,
                wraps=((_UPDATE, _update_kernel("refused_growth_keeps_tracker")),)),
    TorchMutant("growth_one_step_late", "the scale grows one clean step after the interval", SCALER,
                wraps=((_UPDATE, _update_kernel("growth_one_step_late")),)),
    TorchMutant("growth_at_or_past_interval", "growth is due when the tracker reaches OR passes the interval",
                SCALER, wraps=((_UPDATE, _update_kernel("growth_at_or_past_interval")),)),
    TorchMutant("nan_found_inf_is_clean", "the update treats a NaN (or negative) found_inf as a clean step", SCALER,
                wraps=((_UPDATE, _update_kernel("nan_found_inf_is_clean")),)),
    TorchMutant("backoff_floor_at_smallest_normal", "backoff never goes below float32's smallest normal", SCALER,
                wraps=((_UPDATE, _update_kernel("backoff_floor_at_smallest_normal")),)),
    TorchMutant("overflow_keeps_tracker", "an overflow leaves the growth tracker where it was", SCALER,
                wraps=((_UPDATE, _update_kernel("overflow_keeps_tracker")),)),
    TorchMutant("found_inf_sum_backs_off_per_flag", "a combined found_inf of 2 or more backs off once per flag",
                SCALER, wraps=((_UPDATE, _update_kernel("found_inf_sum_backs_off_per_flag")),)),
    # --- clipping
    TorchMutant("clip_coef_true_division", "the coefficient is max_norm / (total + eps) by true division, not a "
                "reciprocal then a multiply", CLIP,
                edits=(_clip("_clip_grads_with_norm_", "clip_coef = max_norm / (total_norm + 1e-6)",
                             "clip_coef = torch.div(torch.full_like(total_norm, max_norm), total_norm + 1e-6)"),)),
    TorchMutant("clip_coef_not_clamped", "the coefficient is not clamped to 1 (small gradients are amplified)", CLIP,
                edits=(_clip("_clip_grads_with_norm_", "torch.clamp(clip_coef, max=1.0)", "clip_coef"),)),
    TorchMutant("clip_only_when_coef_below_one", "gradients are multiplied only when the coefficient is below 1",
                CLIP, edits=(_clip("_clip_grads_with_norm_", _MUL, f"if clip_coef_clamped < 1:\n                {_MUL}"),)),
    TorchMutant("clip_eps_dropped", "the coefficient is max_norm / total, without the 1e-6", CLIP,
                edits=(_clip("_clip_grads_with_norm_", "(total_norm + 1e-6)", "total_norm"),)),
    TorchMutant("clip_eps_kept_in_float32", "a 16-bit total norm adds 1e-6 in float32 instead of in its own dtype",
                CLIP, edits=(_clip("_clip_grads_with_norm_", "(total_norm + 1e-6)",
                                   "(total_norm.float() + 1e-6).to(total_norm.dtype)"),)),
    TorchMutant("clip_coef_rounded_to_grad_dtype", "the coefficient is rounded to each gradient's dtype before the "
                "multiply", CLIP, edits=(_clip("_clip_grads_with_norm_", _MUL,
                                               "torch._foreach_mul_(device_grads, clip_coef_clamped.to(device=device, "
                                               "dtype=device_grads[0].dtype))"),)),
    TorchMutant("clip_zero_d_grad_not_promoted", "a 0-d gradient is multiplied by the coefficient rounded to its own "
                "dtype, like a gradient with dimensions", CLIP,
                edits=(_clip("_clip_grads_with_norm_", _MUL,
                             "[g.mul_(clip_coef_clamped.to(device=device, dtype=g.dtype) if g.dim() == 0 else "
                             "clip_coef_clamped.to(device)) for g in device_grads]"),)),
    TorchMutant("error_if_nonfinite_ignored", "get_total_norm(error_if_nonfinite=True) never raises", CLIP,
                edits=(_clip("_get_total_norm", "if error_if_nonfinite and torch.logical_or(",
                             "if False and torch.logical_or("),)),
    TorchMutant("error_if_nonfinite_misses_inf", "error_if_nonfinite raises on a NaN total but not an inf one", CLIP,
                edits=(_clip("_get_total_norm", "torch.logical_or(total_norm.isnan(), total_norm.isinf())",
                             "total_norm.isnan()"),)),
    TorchMutant("total_norm_in_float64", "the total of the per-tensor norms is accumulated in float64", CLIP,
                edits=(_clip("_get_total_norm", "    total_norm = torch.linalg.vector_norm(\n"
                             "        torch.stack([norm.to(first_device) for norm in norms]), norm_type\n    )",
                             "    _stacked = torch.stack([norm.to(first_device) for norm in norms])\n"
                             "    total_norm = torch.linalg.vector_norm(_stacked.double(), norm_type).to(_stacked.dtype)"),)),
    TorchMutant("total_norm_groups_in_first_seen_order", "the per-tensor norms are stacked in order of first "
                "appearance of each dtype, not in ATen's grouping order", CLIP,
                edits=(_clip("_get_total_norm", "    norms: list[Tensor] = []\n",
                             "    grouped_tensors = dict(sorted(grouped_tensors.items(), key=lambda kv: min(kv[1][1])))\n"
                             "    norms: list[Tensor] = []\n"),)),
    TorchMutant("norm_of_16bit_kept_in_float32", "per-tensor norms of 16-bit gradients stay float32, not rounded to "
                "the gradient's dtype", CLIP,
                edits=(_clip("_get_total_norm", "norms.extend(torch._foreach_norm(device_tensors, norm_type))",
                             "norms.extend(torch._foreach_norm([t.float() for t in device_tensors], norm_type))"),)),
    TorchMutant("no_grads_total_is_float64", "with no gradients the total norm is a float64 zero", CLIP,
                edits=(_clip("_get_total_norm", "return torch.tensor(0.0)", "return torch.tensor(0.0, dtype=torch.float64)"),)),
    TorchMutant("clip_grad_value_upper_only", "clip_grad_value_ clamps only from above", CLIP,
                edits=(_clip("clip_grad_value_", "torch._foreach_clamp_min_(cast(list[Tensor], grads), -clip_value)",
                             "pass"),)),
    TorchMutant("clip_grad_value_nan_becomes_bound", "clip_grad_value_ turns NaN into the bound (a where() on "
                "g <= v)", CLIP,
                edits=(_clip("clip_grad_value_", "torch._foreach_clamp_max_(cast(list[Tensor], grads), clip_value)",
                             "[g.copy_(torch.where(g <= clip_value, g, torch.full_like(g, clip_value))) "
                             "for g in grads]"),)),
    # --- optimizers
    TorchMutant("sgd_first_buffer_dampened", "SGD's first momentum buffer is the dampened gradient", OPTIM,
                edits=(Edit("torch.optim.sgd", "_single_tensor_sgd", "buf = grad.detach().clone()",
                            "buf = grad.detach().clone().mul_(1 - dampening)"),)),
    TorchMutant("sgd_weight_decay_times_lr", "SGD's weight decay is scaled by the learning rate", OPTIM,
                edits=(Edit("torch.optim.sgd", "_single_tensor_sgd",
                            "            else:\n                grad = grad.add(param, alpha=weight_decay)",
                            "            else:\n                grad = grad.add(param, alpha=weight_decay * lr)"),)),
    TorchMutant("sgd_nesterov_drops_gradient", "Nesterov SGD steps by momentum * buf without the gradient", OPTIM,
                edits=(Edit("torch.optim.sgd", "_single_tensor_sgd", "grad = grad.add(buf, alpha=momentum)",
                            "grad = buf.mul(momentum)"),)),
    TorchMutant("adam_eps_inside_sqrt", "Adam adds eps under the square root", OPTIM,
                edits=(Edit("torch.optim.adam", "_single_tensor_adam",
                            "denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)",
                            "denom = (exp_avg_sq + eps).sqrt() / bias_correction2_sqrt"),)),
    TorchMutant("adam_bias_correction2_not_rooted", "Adam divides by 1 - beta2**t, not its square root", OPTIM,
                edits=(Edit("torch.optim.adam", "_single_tensor_adam", "bias_correction2_sqrt = bias_correction2**0.5",
                            "bias_correction2_sqrt = bias_correction2"),)),
    TorchMutant("adam_step_size_in_float32", "Adam computes lr / (1 - beta1**t) in float32, not in Python "
                "(float64)", OPTIM,
                edits=(Edit("torch.optim.adam", "_single_tensor_adam",
                            "            step_size = lr / bias_correction1\n\n            bias_correction2_sqrt = "
                            "bias_correction2**0.5",
                            "            step_size = float(torch.tensor(lr, dtype=torch.float32) / "
                            "torch.tensor(bias_correction1, dtype=torch.float32))\n\n"
                            "            bias_correction2_sqrt = bias_correction2**0.5"),)),
    TorchMutant("adam_amsgrad_uses_current_moment", "AMSGrad divides by the current second moment, not the running "
                "maximum", OPTIM,
                edits=(Edit("torch.optim.adam", "_single_tensor_adam",
                            "denom = (max_exp_avg_sqs[i].sqrt() / bias_correction2_sqrt).add_(eps)",
                            "denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)"),)),
    TorchMutant("adam_tensor_lr_read_as_float", "the for-loop Adam reads a tensor lr as a Python float (its step "
                "size then divides in float64, not in the tensor's dtype)", OPTIM,
                edits=(Edit("torch.optim.adam", "_single_tensor_adam", "        lr = _to_scalar(lr)\n",
                            "        lr = _to_scalar(lr)\n        lr = lr.item() if isinstance(lr, Tensor) else lr\n"),)),
    TorchMutant("adagrad_tensor_lr_read_as_float", "the for-loop Adagrad reads a tensor lr as a Python float (its "
                "rate then divides in float64, not in the tensor's dtype)", OPTIM,
                edits=(Edit("torch.optim.adagrad", "_single_tensor_adagrad", "        lr = _to_scalar(lr)\n",
                            "        lr = _to_scalar(lr)\n        lr = lr.item() if isinstance(lr, torch.Tensor) else lr\n"),)),
    TorchMutant("adagrad_foreach_tensor_lr_read_as_float", "the foreach Adagrad reads a tensor lr as a Python float "
                "(a 0-d parameter then meets its rate unpromoted)", OPTIM,
                edits=(Edit("torch.optim.adagrad", "_multi_tensor_adagrad", "    lr = _to_scalar(lr)\n",
                            "    lr = _to_scalar(lr)\n    lr = lr.item() if isinstance(lr, torch.Tensor) else lr\n"),)),
    TorchMutant("nadam_tensor_lr_read_as_float", "the for-loop NAdam reads a tensor lr as a Python float (its step "
                "sizes and decay factor then computed in float64)", OPTIM,
                edits=(Edit("torch.optim.nadam", "_single_tensor_nadam", "        lr = _to_scalar(lr)\n",
                            "        lr = _to_scalar(lr)\n        lr = lr.item() if isinstance(lr, torch.Tensor) else lr\n"),)),
    TorchMutant("radam_foreach_tensor_lr_read_as_float", "the foreach RAdam reads a tensor lr as a Python float (its "
                "step sizes then computed in float64)", OPTIM,
                edits=(Edit("torch.optim.radam", "_multi_tensor_radam", "    lr = _to_scalar(lr)\n",
                            "    lr = _to_scalar(lr)\n    lr = lr.item() if isinstance(lr, torch.Tensor) else lr\n"),)),
    TorchMutant("adamw_decay_without_lr", "AdamW decays the parameter by weight_decay, not lr * weight_decay",
                OPTIM, edits=(Edit("torch.optim.adam", "_single_tensor_adam", "param.mul_(1 - lr * weight_decay)",
                                   "param.mul_(1 - weight_decay)"),)),
    TorchMutant("foreach_adam_eps_before_bias_correction", "foreach Adam adds eps before dividing by the bias "
                "correction", OPTIM,
                edits=(Edit("torch.optim.adam", "_multi_tensor_adam",
                            "            torch._foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt)\n"
                            "            torch._foreach_add_(exp_avg_sq_sqrt, eps)\n            torch._foreach_addcdiv_(",
                            "            torch._foreach_add_(exp_avg_sq_sqrt, eps)\n"
                            "            torch._foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt)\n"
                            "            torch._foreach_addcdiv_("),)),
    TorchMutant("fused_adam_step_counts_skipped_steps", "fused Adam advances the step counter on a skipped step",
                OPTIM, edits=(Edit("torch.optim.adam", "_fused_adam", "if device_found_inf is not None:\n",
                                   "if False:\n"),)),
    TorchMutant("fused_adam_ignores_grad_scale", "fused Adam never unscales (grad_scale dropped)", OPTIM,
                edits=(Edit("torch.optim.adam", "_fused_adam", "grad_scale=device_grad_scale,", "grad_scale=None,"),)),
    # --- casts
    TorchMutant("bfloat16_cast_truncates", "float32 -> bfloat16 rounds toward zero instead of to nearest even",
                CASTS, wraps=(("torch.Tensor.to", _cast_wrapper("float32", "bfloat16", _bf16_truncate)),)),
    TorchMutant("float16_cast_flushes_subnormals", "bfloat16 -> float16 flushes subnormal results to zero", CASTS,
                wraps=(("torch.Tensor.to", _cast_wrapper("bfloat16", "float16", _fp16_flush)),)),
    TorchMutant("float64_to_float16_rounds_once", "float64 -> float16 rounds once, not through float32", CASTS,
                wraps=(("torch.Tensor.to", _cast_wrapper("float64", "float16", _f64_to_f16_once)),)),
    TorchMutant("e5m2_cast_saturates", "float16 -> float8_e5m2 saturates to +-57344 instead of overflowing to inf",
                CASTS, wraps=(("torch.Tensor.to", _cast_wrapper("float16", "float8_e5m2", _e5m2_saturate)),)),
    TorchMutant("e4m3fn_cast_overflow_is_nan", "float32 -> float8_e4m3fn gives NaN on overflow instead of saturating",
                CASTS, wraps=(("torch.Tensor.to", _cast_wrapper("float32", "float8_e4m3fn", _e4m3fn_nan)),)),
    # --- autocast policy
    TorchMutant("autocast_linear_in_float32", "under autocast, linear runs in float32", AUTOCAST,
                wraps=(("torch.nn.functional.linear", _linear_in_float32),)),
    TorchMutant("autocast_mse_loss_in_low_precision", "under autocast, mse_loss runs in the autocast dtype",
                AUTOCAST, wraps=(("torch.nn.functional.mse_loss", _mse_in_low_precision),)),
    TorchMutant("autocast_cat_in_low_precision", "under autocast, cat casts float32 operands to the autocast dtype",
                AUTOCAST, wraps=(("torch.cat", _cat_in_low_precision),)),
)


# ----------------------------------------------------------------------------- the runner


def _test_files(first: tuple[str, ...]) -> list[str]:
    rest = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "conformance").glob("test_*.py") if p.name not in EXCLUDED)
    return list(dict.fromkeys([*first, *rest]))


def _run_pytest(name: str | None, files: list[str]) -> subprocess.CompletedProcess:
    from conformance import expectations

    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", AMPSPEC_HYPOTHESIS_PROFILE="ci", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env[expectations.EXACT_MODE_ENV] = "1"
    env.pop(ENV, None)
    if name:
        env[ENV] = name
        env["PYTEST_ADDOPTS"] = f"-p {PLUGIN}"  # reaches any pytest the suite itself starts
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *files],
                          cwd=ROOT, env=env, capture_output=True, text=True)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _first_failure(text: str) -> str:
    return next((ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))), "") or _last_line(text)


def run(names: list[str]) -> int:
    unknown = sorted(set(names) - {m.name for m in MUTANTS})
    if unknown:
        print(f"unknown mutants {unknown}; known: {[m.name for m in MUTANTS]}", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not names or m.name in names]
    for m in chosen:  # every edit must still apply before minutes are spent
        install(m)()
    t0 = time.perf_counter()
    proc = _run_pytest(None, _test_files(()))
    if proc.returncode != 0:
        print(f"baseline (no mutant) FAILS, so kills would mean nothing:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")
        return 1
    print(f"baseline passes: {_last_line(proc.stdout)}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    real = [m for m in chosen if not m.control and not m.equivalent]
    killed, survivors, problems = 0, [], []
    for m in chosen:
        t1 = time.perf_counter()
        proc = _run_pytest(m.name, _test_files(m.first))
        dead = proc.returncode != 0
        kind = "control" if m.control else "equivalent" if m.equivalent else "mutant"
        verdict = "killed" if dead else "SURVIVED"
        if kind == "mutant":
            killed += dead
            if not dead:
                survivors.append(m)
        elif dead:
            problems.append(f"{m.name} ({kind}) was killed: {_first_failure(proc.stdout)}")
        print(f"{m.name:44s} {verdict:8s} [{kind}] ({time.perf_counter() - t1:.0f} s)  {m.bug}\n"
              f"    {_first_failure(proc.stdout) if dead else _last_line(proc.stdout)}", flush=True)
    print(f"survivors: {', '.join(m.name for m in survivors) or 'none'}")
    for p in problems:
        print(f"CONTRADICTION: {p}")
    equivalents = [m.name for m in chosen if m.equivalent]
    if equivalents:
        print(f"equivalent (argued in the catalogue, not counted): {', '.join(equivalents)}")
    print(f"{killed}/{len(real)} killed in {time.perf_counter() - t0:.0f} s")
    return 0 if killed == len(real) and not problems else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.torch_mutations", description=__doc__.split("\n\n")[0])
    parser.add_argument("mutants", nargs="*", help="names of the mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            tag = " [control]" if m.control else " [equivalent]" if m.equivalent else ""
            print(f"{m.name:44s}{tag} {m.bug}")
        return 0
    return run(args.mutants)


if __name__ == "__main__":
    sys.exit(main())
