"""The doctor's verdicts: a fixed vocabulary, each with a module, numbers and a fix.

``KINDS`` is the contract of the JSON report, ranked by harm (the report lists verdicts in
this order). The rules, on the numbers of ``torchimpl.doctor.stats``:

1. ``not-precision``: the fp32 shadow's loss or a layer's shadow output is non-finite on some
   step; the module is the first layer (in hook order) whose shadow output was. Reduced
   precision is not the cause, so no other verdict is given.
2. ``forward-overflow``: a layer whose output is 16-bit in the mixed run and whose shadow
   values overflow that format on some step, and is the first such layer of that step (the
   later ones see its inf). Loss scaling cannot fix it; the fix names ``precision.fp32_modules``.
3. ``gradient-overflow``: with a loss scaler, no power-of-two scale keeps every layer's
   gradient representable (rules 10-11 of the spec: the combined low > high).
4. ``unsafe-math``: the op scan of the mixed step found a log of zero or of a negative number,
   a division by zero or the like, in the forward; one verdict per module. Backward findings
   are not judged: the scan cannot name their module, and they follow from the forward's
   values (the backward of a log divides by its input).
5. ``fp16-normalization``: the op scan found a normalisation of float16 values below
   float16's smallest normal, or a float16 denominator below it; one verdict per module.
6. ``gradient-underflow``: with a loss scaler, more than ``1 - keep`` of the shadow's non-zero
   gradient entries reaching a 16-bit layer output underflow at the loss scale (the spec's
   underflow rule on the shadow's gradient times the scale: zeros for other reasons, such as
   an fp16 sigmoid saturating to 1, are not the scale's fault); the module is the layer with
   the largest such fraction, the fix the scale range.
7. ``fp8-saturation`` / ``fp8-underflow``: a float8 layer with more than ``FP8_SATURATION``
   of an operand saturated, or more than ``FP8_UNDERFLOW`` of its non-zero values flushed,
   under the recipe's scale.
8. ``update-underflow``: a module with a 16-bit parameter of which at least
   ``UPDATE_UNDERFLOW`` of the updates were lost (``reference.health`` rule 12); its fix names
   ``precision.master_weights``; fp32 parameters are
   reported as a reference, never judged.
9. ``loss-in-low-precision``: the mixed run's loss is not float32.
10. A healthy model gets no verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["FP8_SATURATION", "FP8_UNDERFLOW", "KINDS", "UPDATE_UNDERFLOW", "Verdict", "rank"]

KINDS: tuple[str, ...] = (
    "not-precision", "forward-overflow", "gradient-overflow", "unsafe-math", "fp16-normalization",
    "gradient-underflow", "fp8-saturation", "fp8-underflow", "update-underflow", "loss-in-low-precision",
)
SEVERITY = {"not-precision": "error", "forward-overflow": "error", "gradient-overflow": "error",
            "unsafe-math": "error", "fp16-normalization": "warning", "gradient-underflow": "warning",
            "fp8-saturation": "warning", "fp8-underflow": "warning", "update-underflow": "warning",
            "loss-in-low-precision": "warning"}
FP8_SATURATION = 0.0
"""Any saturated value of a float8 operand is a verdict (torchao's dynamic scales never saturate)."""
FP8_UNDERFLOW = 0.01
"""More than 1 % of a float8 operand's non-zero values flushed to zero."""
UPDATE_UNDERFLOW = 0.5
"""At least half of a 16-bit parameter's updates round away."""


@dataclass(frozen=True)
class Verdict:
    """One finding: ``kind`` from ``KINDS``, the ``module`` (qualified name, or None for the model
    as a whole), ``severity`` (error or warning), what was seen, the numbers, and the fix."""

    kind: str
    module: str | None
    message: str
    fix: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown verdict kind {self.kind!r}; kinds: {', '.join(KINDS)}")

    @property
    def severity(self) -> str:
        return SEVERITY[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "module": self.module, "severity": self.severity, "message": self.message,
                "fix": self.fix, "numbers": self.numbers}


def rank(verdicts: Iterable[Verdict]) -> list[Verdict]:
    """Rule order: by kind's rank, then by module name (None first)."""
    return sorted(verdicts, key=lambda v: (KINDS.index(v.kind), v.module or ""))


def _pattern(name: str) -> str:
    return f"precision.fp32_modules: [{name!r}]"


def judge(obs: Any) -> list[Verdict]:
    """Rules 1-10 on a doctor run's observations (``torchimpl.doctor.inspect.Observations``), ranked."""
    if obs.shadow_failed is not None:
        return [_not_precision(obs)]
    out: list[Verdict] = []
    for fn in (_forward_overflow, _gradients, _scans, _fp8, _updates, _loss):
        out += fn(obs)
    return rank(out)


def _not_precision(obs: Any) -> Verdict:
    where = obs.shadow_failed or None
    seen = f"in {where!r}" if where else "in the loss"
    return Verdict("not-precision", where, f"the fp32 shadow is non-finite too ({seen}, step {obs.shadow_failed_step}): "
                   "reduced precision is not the cause", "look for the unsafe operation in fp32 "
                   "(torchimpl.diagnose_nonfinite names it); then rerun the doctor",
                   {"step": obs.shadow_failed_step})


def _forward_overflow(obs: Any) -> list[Verdict]:
    out = []
    for name, steps in obs.first_overflow.items():
        layer = obs.layers[name]
        limit = obs.format_max(layer.dtype)
        out.append(Verdict(
            "forward-overflow", name,
            f"{layer.dtype} overflows in {name!r} output (amax {layer.shadow_amax:.3g} > {limit:.6g}) on {steps} of "
            f"{obs.steps} batches: loss scaling cannot fix this",
            f"use bf16, or keep that module in fp32: {_pattern(name)}",
            {"amax": layer.shadow_amax, "format_max": limit, "batches": steps, "of": obs.steps,
             "headroom_bits": layer.headroom_bits}))
    return out


def _gradients(obs: Any) -> list[Verdict]:
    if not obs.use_scaler:
        return []
    low_layers = [s for s in obs.layers.values() if s.low_precision and s.grad_flushed[1]]
    lows = [s.scale_low for s in low_layers if s.scale_low is not None]
    highs = [s.scale_high for s in low_layers if s.scale_high is not None]
    low, high = (max(lows) if lows else None), (min(highs) if highs else None)
    numbers = {"init_scale": obs.scale, "scale_range_log2": [low, high]}
    if low is not None and high is not None and low > high:
        return [Verdict("gradient-overflow", None,
                        f"no power-of-two loss scale works: keeping {obs.keep:.1%} of the gradients representable "
                        f"needs >= 2^{low}, and 2^{high} is the largest that does not overflow",
                        "use bf16 (float32's range), or keep the layers with the widest gradients in fp32 "
                        "(precision.fp32_modules)", numbers)]
    worst = max(low_layers, key=lambda s: s.grad_underflow_at_scale, default=None)
    if worst is None or worst.grad_underflow_at_scale <= 1 - obs.keep:
        return []
    target = f"raise init_scale to >= 2^{low}" + (f" (2^{low} .. 2^{high} keeps {obs.keep:.1%} of the gradients "
                                                   "representable without overflow)" if high is not None else "")
    return [Verdict("gradient-underflow", worst.name,
                    f"{worst.grad_underflow_at_scale:.2%} of the non-zero gradient entries reaching {worst.name!r} "
                    f"underflow to zero at loss scale {obs.scale:g}", target if low is not None else "raise init_scale",
                    {**numbers, "grad_underflow_at_scale_fraction": worst.grad_underflow_at_scale,
                     "grad_underflow_fraction": worst.grad_underflow, "grad_amax": worst.grad_amax})]


def _scans(obs: Any) -> list[Verdict]:
    out, seen = [], set()
    for kind, findings, fix in (
        ("unsafe-math", obs.unsafe, "compute it in fp32 ({pattern}) or keep its input away from the "
         "singularity in the low dtype (clamp_min with a value the dtype represents)"),
        ("fp16-normalization", obs.norm, "compute the normalisation in fp32 ({pattern}, or fp32_island "
         "and upcast around it), or use bf16"),
    ):
        for f in findings:
            if f.phase != "forward":  # backward ops have no module; they follow from the forward's
                continue
            module = f.module
            if (kind, module) in seen:
                continue
            seen.add((kind, module))
            pattern = _pattern(module) if module else "precision.fp32_modules"
            out.append(Verdict(kind, module or None, f"{f.op} ({f.phase}): {f.problem}", fix.format(pattern=pattern),
                               {"op": f.op, "phase": f.phase}))
    return out


def _fp8(obs: Any) -> list[Verdict]:
    out = []
    for name, s in obs.fp8.items():
        for operand in ("input", "weight", "grad_output"):
            sat, under = s.fraction("saturated", operand), s.fraction("underflow", operand)
            numbers = {"operand": operand, "amax": s.amax[operand], "saturated_fraction": sat,
                       "underflow_fraction": under}
            if sat > FP8_SATURATION:
                out.append(Verdict("fp8-saturation", name, f"{sat:.2%} of {name!r}'s {operand} saturate in float8",
                                   "use a recipe with finer scales (rowwise), or keep the layer in high precision",
                                   numbers))
                break
            if under > FP8_UNDERFLOW:
                out.append(Verdict("fp8-underflow", name,
                                   f"{under:.2%} of {name!r}'s non-zero {operand} values flush to zero in float8 "
                                   f"(amax {s.amax[operand]:.3g} sets the scale: outliers)",
                                   "use precision.fp8_recipe: rowwise (a scale per row), or keep the layer in high "
                                   "precision", numbers))
                break
    return out


def _updates(obs: Any) -> list[Verdict]:
    by_module: dict[str, list[Any]] = {}
    for name, p in obs.params.items():
        if p.dtype in ("bfloat16", "float16") and p.lost[1] and p.lost_update_fraction >= UPDATE_UNDERFLOW:
            by_module.setdefault(obs.param_module[name], []).append(p)
    out = []
    for module, ps in by_module.items():
        worst = max(ps, key=lambda p: p.lost_update_fraction)
        out.append(Verdict("update-underflow", module or None,
                           f"{worst.lost_update_fraction:.1%} of the updates of {worst.name!r} ({worst.dtype}) were "
                           "lost: the stored weight did not change although the exact update was non-zero",
                           "set precision.master_weights to fp32 (a float32 master copy), kahan or stochastic "
                           "(or train under autocast over float32 weights: precision.mode bf16), or raise the "
                           "learning rate",
                           {"parameters": [p.name for p in ps], "lost_update_fraction": worst.lost_update_fraction}))
    return out


def _loss(obs: Any) -> list[Verdict]:
    low = sorted(d for d in obs.loss_dtypes if d != "float32")
    if not low:
        return []
    return [Verdict("loss-in-low-precision", None, f"the loss is computed in {', '.join(low)} under autocast",
                    "compute the loss in fp32: outside autocast, or on upcast inputs (torchimpl.upcast)",
                    {"loss_dtype": low[0]})]
