"""The doctor's verdicts: a fixed vocabulary (``torchimpl.doctor.kinds``), each with a module,
numbers and a fix, and "healthy" only where nothing measured contradicts it.

``KINDS`` is the contract of the JSON report, ranked by harm (the report lists verdicts in
this order). The rules, on the numbers of ``torchimpl.doctor.stats`` (thresholds: ``kinds``):

1. ``not-precision``: the fp32 shadow's loss, a layer's shadow output or (on a skipped step)
   its gradients are non-finite on some step; the module is the first layer (in hook order)
   whose shadow output was, or the one in whose backward the shadow's gradient first was. Reduced
   precision is not the cause, so no other verdict is given.
2. ``forward-overflow``: a layer whose output is 16-bit in the mixed run and whose shadow
   values overflow that format on some step, and is the first such layer of that step (the
   later ones see its inf). Loss scaling cannot fix it; the fix names ``precision.fp32_modules``,
   or, where the overflowing layer is one of a row of blocks (``name.0``, ``name.1``, ...)
   whose outputs grow through three or more of them by 8x or more, the architecture change
   (a norm in each block, a scaled init, the residual's scaling): an fp32 island would only
   move the overflow to the next block.
3. ``inner-overflow``: the scan inside a layer whose SQNR collapsed with a finite output
   (``torchimpl.doctor.inner``) found an op that overflowed from finite inputs; the fix is the
   layer in fp32 or the rewrite that keeps its square from overflowing. A normalisation
   problem found there is rule 6's.
4. ``gradient-overflow``: steps skipped after the loss scale settled (``scaling`` rules 1-3);
   the module whose gradient first overflowed. Warm-up backoff is a note.
5. ``unsafe-math``: the op scan of the mixed step found a log of zero or of a negative number,
   a division by zero or the like, in the forward; one verdict per module. Backward findings
   are not judged: the scan cannot name their module, and they follow from the forward's
   values (the backward of a log divides by its input).
6. ``fp16-normalization``: the op scan (of the first step, or inside a collapsed layer) found
   a normalisation of float16 values below float16's smallest normal, a float16 denominator
   below it, or the square root of a subnormal variance; one verdict per module.
7. ``gradient-underflow``: ``scaling`` rules 4-5, weighed by the L1 mass lost.
8. ``fp8-saturation`` / ``fp8-underflow``: a float8 layer with more than ``FP8_SATURATION``
   of an operand saturated, or more than ``FP8_UNDERFLOW`` of its non-zero values flushed
   carrying ``MASS_NEGLIGIBLE`` or more of its L1 mass (less: a note), under the recipe's scale.
9. ``update-underflow``: a module with a 16-bit parameter of which at least
   ``UPDATE_UNDERFLOW`` of the updates were lost (``reference.health`` rule 12); its fix names
   ``precision.master_weights``; fp32 parameters are
   reported as a reference, never judged.
10. ``loss-in-low-precision``: the mixed run's loss is not float32.
11. ``degraded``: no other verdict, but the numbers contradict health: a 16-bit layer's SQNR
    below its format's floor (``SQNR_FLOOR_DB``) or a layer flushing more than
    ``FLUSH_FRACTION`` of its outputs with a non-negligible mass; "cause not located", at the
    first such layer (where the signal first collapses).
12. A healthy model gets no verdict: every step applied or skipped by the scaler's warm-up
    (stated in a note), every 16-bit layer at or above its floor, no layer flushing past the
    threshold.
13. ``verify_fixes``: the first ``_VERIFIED`` verdicts whose fix is a setting the doctor takes
    (an fp32 island, ``init_scale``) are rerun with it; the verdict says whether it cured them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from torchimpl.doctor.kinds import (FLUSH_FRACTION, FP8_SATURATION, FP8_UNDERFLOW, KINDS, MASS_NEGLIGIBLE,
                                    SQNR_FLOOR_DB, UPDATE_UNDERFLOW, Verdict, flush_noise, island, rank,
                                    sqnr_floor_db)
from torchimpl.doctor.scaling import FORWARD_CAUSES, classify_skips, gradient_verdicts, overflow_verdict, skip_notes

__all__ = ["FP8_SATURATION", "FP8_UNDERFLOW", "KINDS", "SQNR_FLOOR_DB", "UPDATE_UNDERFLOW", "Verdict", "judge",
           "judge_notes", "rank", "sqnr_floor_db", "verify_fixes"]

_VERIFIED = 2
_GROWTH_BLOCKS, _GROWTH_FACTOR = 3, 8.0
_pattern = island


def judge(obs: Any) -> list[Verdict]:
    """Rules 1-12 on a doctor run's observations (``torchimpl.doctor.inspect.Observations``), ranked."""
    if obs.shadow_failed is not None:
        return [_not_precision(obs)]
    out: list[Verdict] = []
    for fn in (_forward_overflow, _inner, _scans, _fp8, _updates, _loss):
        out += fn(obs)
    out += gradient_verdicts(obs)[0]
    if not any(v.kind in FORWARD_CAUSES for v in out):
        over = overflow_verdict(obs, classify_skips(obs))
        out += [over] if over is not None else []
    if not out:
        out += _degraded(obs)
    return rank(_dedupe(out))


def judge_notes(obs: Any) -> list[str]:
    """What was measured and judged harmless (the scaler's warm-up, negligible flushes)."""
    if obs.shadow_failed is not None:
        return []
    skips = classify_skips(obs)
    out = skip_notes(obs, skips)
    if skips.unexpected and any(v.kind in FORWARD_CAUSES for v in judge(obs)):
        out.append(f"{len(skips.unexpected)} of {obs.steps} steps had non-finite gradients: they follow from the "
                   "forward's verdict above")
    out += gradient_verdicts(obs)[1]
    out += _fp8_notes(obs)
    for s in obs.layers.values():
        floor = sqnr_floor_db(s.dtype, obs.precision)
        if floor is not None and s.underflow > FLUSH_FRACTION and s.underflow_mass <= flush_noise(floor):
            out.append(f"{s.name!r} flushes {s.underflow:.2%} of the shadow's non-zero outputs, {s.underflow_mass:.2g} "
                       f"of their L1 mass (within the {flush_noise(floor):.2g} its SQNR floor allows): no verdict")
    return out


def _dedupe(verdicts: list[Verdict]) -> list[Verdict]:
    seen, out = set(), []
    for v in verdicts:
        if (v.kind, v.module) not in seen:
            seen.add((v.kind, v.module))
            out.append(v)
    return out


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
        numbers = {"amax": layer.shadow_amax, "format_max": limit, "batches": steps, "of": obs.steps,
                   "headroom_bits": layer.headroom_bits}
        growth = _growth(obs, name)
        if growth is None:
            fix = f"use bf16, or keep that module in fp32: {_pattern(name)}"
        else:
            blocks, amaxes = growth
            numbers["growing_blocks"] = blocks
            fix = (f"the activations grow through every block ({blocks[0]} .. {blocks[-1]}: amax {amaxes[0]:.3g} -> "
                   f"{amaxes[-1]:.3g}), so no single module is the cause and an fp32 island would move the overflow "
                   "to the next block: normalise each block's input (a norm before each residual branch, "
                   "pre-norm), scale the residual branches' initialisation (std / sqrt(2 * number of blocks) on "
                   "each block's output projection), or scale the residual (x + alpha * f(x), alpha < 1); or use "
                   "bf16")
        out.append(Verdict(
            "forward-overflow", name,
            f"{layer.dtype} overflows in {name!r} output (amax {layer.shadow_amax:.3g} > {limit:.6g}) on {steps} of "
            f"{obs.steps} batches: loss scaling cannot fix this", fix, numbers))
    return out


def _growth(obs: Any, name: str) -> tuple[list[str], list[float]] | None:
    """Rule 2: the row of blocks ``prefix.0 .. prefix.k`` holding ``name`` whose outputs grow, or None."""
    for m in re.finditer(r"\.(\d+)(?=\.|$)|^(\d+)(?=\.|$)", name):
        prefix = name[:m.start()] if m.group(1) is not None else ""
        k = int(m.group(1) if m.group(1) is not None else m.group(2))
        blocks = [f"{prefix}.{i}" if prefix else str(i) for i in range(k + 1)]
        amaxes = [obs.layers[b].shadow_amax if b in obs.layers else None for b in blocks]
        if any(a is None or a <= 0 for a in amaxes) or len(blocks) < _GROWTH_BLOCKS:
            continue
        rising = all(later > earlier for earlier, later in zip(amaxes, amaxes[1:]))
        if rising and amaxes[-1] >= _GROWTH_FACTOR * amaxes[0]:
            return blocks, amaxes
    return None


def _inner(obs: Any) -> list[Verdict]:
    """Rules 3 and 6 on the scans inside collapsed layers."""
    out = []
    for f in obs.inner:
        layer = obs.layers.get(f.module)
        sqnr = layer.sqnr_db if layer is not None else float("nan")
        numbers = {"sqnr_db": sqnr, "sqnr_floor_db": sqnr_floor_db(layer.dtype, obs.precision) if layer else None}
        if f.overflow is not None:
            op, what = f.overflow
            hidden = f"; then {f.absorbed[0]}: {f.absorbed[1]}" if f.absorbed else ""
            out.append(Verdict(
                "inner-overflow", f.module,
                f"inside {f.module!r}, {op}: {what}{hidden}. The output is finite but wrong (SQNR {sqnr:.1f} dB "
                "against the fp32 shadow)",
                f"compute it in fp32 ({_pattern(f.module)}), or rewrite it so that the square cannot overflow: "
                "square in float32 (x.float().pow(2).mean(-1, keepdim=True)), or use torch.nn.RMSNorm / "
                "torch.nn.LayerNorm, which reduce in float32",
                {**numbers, "op": op, "absorbed_by": f.absorbed[0] if f.absorbed else None}))
        elif f.normalization is not None:
            op, what = f.normalization
            out.append(Verdict("fp16-normalization", f.module, f"{op} (forward, inside {f.module!r}): {what}",
                               f"compute the normalisation in fp32 ({_pattern(f.module)}), or use bf16; an epsilon "
                               "below float16's smallest subnormal (6e-8) is lost when added in float16",
                               {**numbers, "op": op, "phase": "forward"}))
    return out


def _degraded(obs: Any) -> list[Verdict]:
    """Rule 11: the numbers say not healthy and no rule found why."""
    for s in obs.layers.values():
        if not s.low_precision or s.same_as is not None:
            continue
        floor = sqnr_floor_db(s.dtype, obs.precision)
        if floor is None:
            continue
        if s.sqnr_db < floor:
            return [Verdict("degraded", s.name,
                            f"degraded, cause not located: {s.name!r}'s output has an SQNR of {s.sqnr_db:.1f} dB "
                            f"against the fp32 shadow (step {s.sqnr_step}), below {s.dtype}'s floor of {floor:g} dB; "
                            "the signal collapses here first",
                            f"confirm with that module in fp32 ({_pattern(s.name)}); or use bf16",
                            {"sqnr_db": s.sqnr_db, "sqnr_floor_db": floor, "step": s.sqnr_step})]
        if s.underflow > FLUSH_FRACTION and s.underflow_mass > flush_noise(floor):
            return [Verdict("degraded", s.name,
                            f"degraded, cause not located: {s.name!r} flushes {s.underflow:.2%} of the shadow's "
                            f"non-zero outputs to zero, {s.underflow_mass:.2g} of their L1 mass",
                            f"confirm with that module in fp32 ({_pattern(s.name)}); or use bf16",
                            {"underflow_fraction": s.underflow, "underflow_mass_fraction": s.underflow_mass})]
    return []


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
            mass = s.fraction("underflow_mass", operand)
            numbers = {"operand": operand, "amax": s.amax[operand], "saturated_fraction": sat,
                       "underflow_fraction": under, "underflow_mass_fraction": mass}
            if sat > FP8_SATURATION:
                out.append(Verdict("fp8-saturation", name, f"{sat:.2%} of {name!r}'s {operand} saturate in float8",
                                   "use a recipe with finer scales (rowwise), or keep the layer in high precision",
                                   numbers))
                break
            if under > FP8_UNDERFLOW and mass >= MASS_NEGLIGIBLE:
                out.append(Verdict("fp8-underflow", name,
                                   f"{under:.2%} of {name!r}'s non-zero {operand} values flush to zero in float8, "
                                   f"{mass:.2g} of its L1 mass (amax {s.amax[operand]:.3g} sets the scale: outliers)",
                                   "use precision.fp8_recipe: rowwise (a scale per row), or keep the layer in high "
                                   "precision", numbers))
                break
    return out


def _fp8_notes(obs: Any) -> list[str]:
    out = []
    for name, s in obs.fp8.items():
        for operand in ("input", "weight", "grad_output"):
            under, mass = s.fraction("underflow", operand), s.fraction("underflow_mass", operand)
            if under > FP8_UNDERFLOW and mass < MASS_NEGLIGIBLE:
                out.append(f"{under:.2%} of {name!r}'s non-zero {operand} values flush in float8 but carry {mass:.2g} "
                           f"of its L1 mass (below 2^-20): negligible, no verdict")
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


def _fix_setting(v: Verdict, fp32_modules: tuple[str, ...]) -> dict[str, Any] | None:
    """Rule 13: the doctor's own setting that applies ``v``'s fix, or None."""
    if v.kind == "gradient-underflow" and v.numbers.get("advice") == "init_scale":
        return {"init_scale": 2.0 ** v.numbers["init_scale_log2"]}
    if v.module and _pattern(v.module) in v.fix and "growing_blocks" not in v.numbers:
        return {"fp32_modules": (*fp32_modules, v.module)}
    return None


def verify_fixes(verdicts: list[Verdict], obs: Any, rerun: Callable[..., list[Verdict]],
                 fp32_modules: tuple[str, ...]) -> list[Verdict]:
    """Rule 13: ``rerun(**setting)`` is the doctor with that setting; the first ``_VERIFIED``
    verdicts with a setting say whether it cured them."""
    out, tried = [], 0
    for v in verdicts:
        setting = _fix_setting(v, fp32_modules) if tried < _VERIFIED else None
        if setting is None:
            out.append(v)
            continue
        tried += 1
        after = rerun(**setting)
        cured = not any((w.kind, w.module) == (v.kind, v.module) for w in after) and \
            not any(w.severity == "error" for w in after)
        left = ", ".join(f"{w.kind} in {w.module or '<model>'}" for w in after) or "none"
        shown = ", ".join(f"{k}={val!r}" for k, val in setting.items())
        check = (f" (checked: rerun with {shown}, the verdict is gone)" if cured else
                 f" (checked: rerun with {shown}, it did not cure it; verdicts then: {left})")
        out.append(dataclasses.replace(v, fix=v.fix + check, numbers={**v.numbers, "fix_cures": cured}))
    return out
