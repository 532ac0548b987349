"""Finding where non-finite values come from: the automated debugging order of a failed step.

Rules (1 and 2, the guard and the placement check, are ``torchimpl.precision.guard``'s):
3. ``diagnose_nonfinite`` automates the debugging order on deep copies of the model (the model,
   its gradients and the RNG state are left as they were), each rerun starting from the same RNG
   state:
   (1) ``fp32_rerun``: the same step (forward, loss, backward) in fp32; non-finite there too
       means reduced precision is not the cause;
   (2) ``loss_in_fp32``: the loss computed under the plan's autocast is float32;
   (3) ``unscale_before_clip``: the scaler's record for the optimizer shows ``unscale_`` was
       called (unknown when the record does not say);
   (4) ``unsafe_math``: in the fp32 step, no log/log2/log10 of <= 0, log1p of <= -1, division
       by zero, reciprocal of zero, sqrt of a negative, rsqrt of <= 0, zero to a negative power
       or negative number to a fractional power (forward and backward);
   (5) ``fp16_normalization``: in the plan's step, no normalisation of float16 tensors whose
       variance is below float16's smallest normal (2**-14), and no rsqrt/reciprocal/division of
       float16 denominators holding values below it (``var + eps`` with eps lost in fp16);
   (6) ``bf16_rerun``: for an fp16 plan, whether the step is finite under bf16 autocast.
   A check's ``passed`` is True (no problem found), False (this is a cause) or None (unknown or
   not applicable); ``first_failure`` is the first check that failed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchimpl._torch_compat import TorchDispatchMode, tree_leaves
from torchimpl.precision.guard import _nonfinite_counts, _strip_guard_hooks
from torchimpl.precision.plan import PrecisionPlan, cuda_bf16_supported
from torchimpl.safe_files import replace_text

__all__ = [
    "Check",
    "Finding",
    "DiagnosisReport",
    "diagnose_nonfinite",
    "report_nonfinite",
]

log = logging.getLogger(__name__)

_FP16_TINY = torch.finfo(torch.float16).tiny  # 2**-14, float16's smallest normal


@dataclass(frozen=True)
class Check:
    """One step of the diagnosis: True = no problem found, False = a cause, None = unknown."""

    name: str
    passed: bool | None
    detail: str


@dataclass(frozen=True)
class Finding:
    """An op that did something unsafe (or produced the first non-finite value)."""

    op: str
    module: str
    phase: str
    problem: str

    def __str__(self) -> str:
        return f"{self.op} in module {self.module or '<root>'} ({self.phase}): {self.problem}"


@dataclass(frozen=True)
class DiagnosisReport:
    """The checks in order; ``reproduced`` says whether the rerun under the plan was
    non-finite; ``first_nonfinite_op`` maps a run (``plan``, ``fp32``, ``bf16``) to the first op
    that turned finite inputs into a non-finite output, where one did."""

    checks: tuple[Check, ...]
    reproduced: bool
    first_nonfinite_op: dict[str, Finding] = field(default_factory=dict)
    findings: dict[str, tuple[Finding, ...]] = field(default_factory=dict)

    @property
    def first_failure(self) -> Check | None:
        return next((c for c in self.checks if c.passed is False), None)

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise ValueError(f"no check named {name!r}; checks: {[c.name for c in self.checks]}")

    def __str__(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "?   "}
        lines = [f"non-finite step reproduced: {self.reproduced}"]
        lines += [f"[{mark[c.passed]}] {c.name}: {c.detail}" for c in self.checks]
        for run, f in self.first_nonfinite_op.items():
            lines.append(f"first non-finite op ({run} run): {f}")
        return "\n".join(lines)


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _count(mask: torch.Tensor) -> int:
    return int(mask.sum())


def _unsafe_problem(base: str, args: tuple[Any, ...]) -> str | None:
    """What is unsafe about calling aten op ``base`` on ``args``, or None."""
    x = args[0] if args else None
    if base in ("log", "log2", "log10") and _is_float(x):
        zero, neg = _count(x == 0), _count(x < 0)
        if zero or neg:
            return f"log of zero ({zero}) / of a negative number ({neg}) among {x.numel()} elements"
    elif base == "log1p" and _is_float(x):
        n = _count(x <= -1)
        if n:
            return f"log1p of a value <= -1 in {n} of {x.numel()} elements"
    elif base == "sqrt" and _is_float(x):
        n = _count(x < 0)
        if n:
            return f"sqrt of a negative number in {n} of {x.numel()} elements"
    elif base == "rsqrt" and _is_float(x):
        zero, neg = _count(x == 0), _count(x < 0)
        if zero or neg:
            return (
                f"rsqrt of zero ({zero}) / of a negative number ({neg}) among {x.numel()} elements"
            )
    elif base == "reciprocal" and _is_float(x):
        n = _count(x == 0)
        if n:
            return f"reciprocal of zero in {n} of {x.numel()} elements"
    elif base in ("div", "true_divide") and len(args) >= 2:
        d = args[1]
        floating = _is_float(x) or _is_float(d) or isinstance(d, float)
        if floating and isinstance(d, torch.Tensor):
            n = _count(d == 0)
            if n:
                return f"division by zero in {n} of {d.numel()} divisor elements"
        elif floating and isinstance(d, (int, float)) and d == 0:
            return "division by the scalar zero"
    elif base == "pow" and len(args) >= 2:
        return _pow_problem(args[0], args[1])
    return None


def _pow_problem(x: Any, e: Any) -> str | None:
    if not (_is_float(x) or _is_float(e)):
        return None
    xt = x if isinstance(x, torch.Tensor) else torch.tensor(float(x))
    et = e if isinstance(e, torch.Tensor) else torch.tensor(float(e))
    xt, et = torch.broadcast_tensors(xt.detach(), et.detach().to(xt.device))
    zero_neg = _count((xt == 0) & (et < 0))
    neg_frac = _count((xt < 0) & (et != torch.round(et)))
    if zero_neg:
        return f"zero to a negative power in {zero_neg} elements"
    if neg_frac:
        return f"negative number to a fractional power in {neg_frac} elements"
    return None


_NORM_OPS = {
    "native_layer_norm",
    "native_group_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
    "_batch_norm_with_update",
    "_batch_norm_no_update",
    "cudnn_batch_norm",
}


def _norm_variance(base: str, args: tuple[Any, ...]) -> torch.Tensor | None:
    x = args[0].detach().float()
    if base == "native_layer_norm":
        inner = math.prod(x.shape[x.ndim - len(args[1]) :])
        return x.reshape(-1, max(inner, 1)).var(dim=-1, correction=0)
    if base == "native_group_norm":
        n, groups = int(args[3]), int(args[6])
        return x.reshape(n, groups, -1).var(dim=-1, correction=0)
    if x.ndim < 2:
        return None
    return x.transpose(0, 1).reshape(x.shape[1], -1).var(dim=-1, correction=0)


def _fp16_norm_problem(base: str, args: tuple[Any, ...]) -> str | None:
    """Normalisation-style math on float16 tensors that fp16 cannot resolve, or None."""
    x = args[0] if args else None
    if base in _NORM_OPS and isinstance(x, torch.Tensor) and x.dtype == torch.float16:
        var = _norm_variance(base, args)
        if var is not None and var.numel() and float(var.min()) < _FP16_TINY:
            n = _count(var < _FP16_TINY)
            return (
                f"{base} on a float16 input: {n} of {var.numel()} groups have variance below "
                f"float16's smallest normal {_FP16_TINY:.3g} (min {float(var.min()):.3g})"
            )
        return None
    denominator = None
    if base in ("rsqrt", "reciprocal"):
        denominator = x
    elif base in ("div", "true_divide") and len(args) >= 2:
        denominator = args[1]
    elif base == "pow" and len(args) >= 2 and isinstance(args[1], (int, float)) and args[1] < 0:
        denominator = x
    if isinstance(denominator, torch.Tensor) and denominator.dtype == torch.float16:
        tiny = denominator.detach().abs() < _FP16_TINY
        n = _count(tiny)
        if n:
            return (
                f"{base} of a float16 denominator with {n} of {denominator.numel()} values below "
                f"float16's smallest normal {_FP16_TINY:.3g} (e.g. var + eps with eps lost in "
                "fp16): compute it in fp32 (fp32_island and upcast)"
            )
    return None


class _OpScanner(TorchDispatchMode):
    """Inspects every aten op's inputs; records unsafe math, fp16 normalisation problems, and
    the first op that turned finite inputs into a non-finite output."""

    def __init__(self, unsafe: bool, fp16_norm: bool, limit: int) -> None:
        super().__init__()
        self.unsafe = unsafe
        self.fp16_norm = fp16_norm
        self.limit = limit
        self.module_stack: list[str] = []
        self.phase = "forward"
        self.unsafe_findings: list[Finding] = []
        self.norm_findings: list[Finding] = []
        self.first_nonfinite: Finding | None = None

    def _where(self) -> str:
        if self.phase == "backward":
            return "(unknown: backward)"
        return self.module_stack[-1] if self.module_stack else ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
        if self.unsafe and len(self.unsafe_findings) < self.limit:
            problem = _unsafe_problem(base, args)
            if problem:
                self.unsafe_findings.append(Finding(str(func), self._where(), self.phase, problem))
        if self.fp16_norm and len(self.norm_findings) < self.limit:
            problem = _fp16_norm_problem(base, args)
            if problem:
                self.norm_findings.append(Finding(str(func), self._where(), self.phase, problem))
        watch = self.first_nonfinite is None and not any(
            _nonfinite_counts(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        )
        out = func(*args, **kwargs)
        if watch:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    counts = _nonfinite_counts(t)
                    if counts:
                        self.first_nonfinite = Finding(
                            str(func),
                            self._where(),
                            self.phase,
                            f"output {t.dtype} has {counts[0]} inf and {counts[1]} NaN "
                            f"from finite inputs",
                        )
                        break
        return out


@dataclass
class _Outcome:
    loss_dtype: torch.dtype
    loss_value: float
    nonfinite_grads: list[str]
    scanner: _OpScanner

    @property
    def finite(self) -> bool:
        return self.loss_value == self.loss_value and abs(self.loss_value) != float("inf") and (
            not self.nonfinite_grads
        )

    def describe(self) -> str:
        if self.finite:
            return f"finite (loss {self.loss_value:.6g})"
        grads = ", ".join(self.nonfinite_grads[:3]) or "none"
        more = f" and {len(self.nonfinite_grads) - 3} more" if len(self.nonfinite_grads) > 3 else ""
        return f"loss {self.loss_value}, non-finite gradients: {grads}{more}"


def _upcast_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.element_size() < 4:
            return value.float()
        return value
    if isinstance(value, tuple):
        return tuple(_upcast_tree(v) for v in value)
    if isinstance(value, list):
        return [_upcast_tree(v) for v in value]
    if isinstance(value, dict):
        return {k: _upcast_tree(v) for k, v in value.items()}
    return value


def _run_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    autocast: tuple[str, torch.dtype] | None,
    fp32: bool,
    scale: float | None,
    unsafe: bool,
    fp16_norm: bool,
    limit: int,
) -> _Outcome:
    copy_ = copy.deepcopy(model)
    _strip_guard_hooks(copy_)
    if fp32:
        copy_.float()
        batch = _upcast_tree(batch)
    copy_.zero_grad(set_to_none=True)
    scanner = _OpScanner(unsafe, fp16_norm, limit)
    handles = []

    def enter(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            scanner.module_stack.append(name)

        return hook

    def leave(*_: Any) -> None:  # a forward hook returning a value would replace the output
        scanner.module_stack.pop()

    for name, m in copy_.named_modules():
        handles.append(m.register_forward_pre_hook(enter(name)))
        handles.append(m.register_forward_hook(leave))
    cuda_devices = sorted(
        {p.device.index or 0 for p in copy_.parameters() if p.device.type == "cuda"}
    )
    ctx = torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext()
    try:
        with torch.random.fork_rng(devices=cuda_devices), scanner:
            with ctx:
                loss = loss_fn(copy_, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn(model, batch) must return a one-element loss tensor")
            scanner.phase = "backward"
            if loss.requires_grad:
                (loss * scale if scale is not None else loss).backward()
    finally:
        for h in handles:
            h.remove()
    bad = [
        n for n, p in copy_.named_parameters() if p.grad is not None and _nonfinite_counts(p.grad)
    ]
    return _Outcome(loss.dtype, float(loss.detach().float()), bad, scanner)


def _unscale_check(
    plan: PrecisionPlan, optimizer: torch.optim.Optimizer | None, scaler: Any
) -> Check:
    name = "unscale_before_clip"
    if scaler is None:
        if plan.use_scaler:
            return Check(name, None, "the plan uses a loss scaler but none was passed: unknown")
        return Check(name, True, "no loss scaler: gradients are never scaled")
    if hasattr(scaler, "is_enabled") and not scaler.is_enabled():
        return Check(name, True, "the loss scaler is disabled: gradients are never scaled")
    if optimizer is None:
        return Check(name, None, "unknown: pass the optimizer to read the scaler's record")
    states = getattr(scaler, "_per_optimizer_states", {})
    if id(optimizer) not in states:
        return Check(
            name,
            None,
            "unknown: the scaler holds no record for this optimizer in this iteration (update() "
            "already ran, or neither unscale_ nor step ran); clip only after "
            "scaler.unscale_(optimizer)",
        )
    stage = getattr(states[id(optimizer)].get("stage"), "name", "")
    if stage == "UNSCALED":
        return Check(name, True, "scaler.unscale_(optimizer) was called this iteration")
    if stage == "READY":
        return Check(
            name,
            False,
            "gradients are still scaled: call scaler.unscale_(optimizer) before clipping, or "
            "the clip threshold applies to gradients multiplied by the scale",
        )
    return Check(
        name,
        None,
        "unknown: the optimizer already stepped this iteration, so whether unscale_ came before "
        "clipping cannot be told afterwards",
    )


def diagnose_nonfinite(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    plan: PrecisionPlan,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    *,
    max_findings: int = 10,
) -> DiagnosisReport:
    """Run the debugging order of rule 3 on one step and report it.

    ``loss_fn(model, batch)`` runs the forward and returns the one-element loss; it is called
    under the plan's autocast (the diagnosis enters autocast itself, so ``loss_fn`` must not).
    ``scaler`` (a ``torch.amp.GradScaler``) multiplies the loss as in training and is read for
    check 3; nothing of ``model``, ``optimizer`` or ``scaler`` is changed. The op scans force a
    host sync per op: this is for debugging one step, not for training loops.
    """
    if not isinstance(plan, PrecisionPlan):
        raise ValueError(f"plan must be a PrecisionPlan, got {type(plan).__name__}")
    if max_findings < 1:
        raise ValueError(f"max_findings must be >= 1, got {max_findings!r}")
    common = dict(loss_fn=loss_fn, limit=max_findings)
    scale = None
    if scaler is not None and plan.use_scaler and getattr(scaler, "is_enabled", lambda: True)():
        scale = float(scaler.get_scale())
    autocast = (plan.device_type, plan.dtype) if plan.autocast_enabled else None
    planned = _run_step(
        model, batch, autocast=autocast, fp32=False, scale=scale, unsafe=False, fp16_norm=True,
        **common,
    )
    fp32 = _run_step(
        model, batch, autocast=None, fp32=True, scale=None, unsafe=True, fp16_norm=False, **common
    )
    reproduced = not planned.finite
    summary = f"plan ({plan.mode}) step: {planned.describe()}; fp32 step: {fp32.describe()}"
    checks = [_fp32_rerun_check(summary, fp32.finite, reproduced), _loss_dtype_check(planned.loss_dtype),
              _unscale_check(plan, optimizer, scaler)]
    unsafe = fp32.scanner.unsafe_findings
    checks.append(_scan_check("unsafe_math", unsafe, "no log of <= 0, division by zero, sqrt of a "
                              "negative or similar in the fp32 step"))
    norm = planned.scanner.norm_findings
    checks.append(_scan_check("fp16_normalization", norm, "no normalisation of float16 tensors "
                              "below float16's resolution in the plan's step"))
    bf16 = None
    if plan.mode == "fp16" and not (plan.device_type == "cuda" and not cuda_bf16_supported()):
        bf16 = _run_step(
            model, batch, autocast=(plan.device_type, torch.bfloat16), fp32=False, scale=None,
            unsafe=False, fp16_norm=False, **common,
        )
    checks.append(_bf16_rerun_check(plan, reproduced, bf16))
    first_ops: dict[str, Finding] = {}
    for run, outcome in (("plan", planned), ("fp32", fp32), ("bf16", bf16)):
        if outcome is not None and outcome.scanner.first_nonfinite is not None:
            first_ops[run] = outcome.scanner.first_nonfinite
    findings = {
        "unsafe_math": tuple(unsafe),
        "fp16_normalization": tuple(norm),
    }
    return DiagnosisReport(tuple(checks), reproduced, first_ops, findings)


def _fp32_rerun_check(summary: str, fp32_finite: bool, reproduced: bool) -> Check:
    """Check 1: the same step in fp32."""
    if not fp32_finite:
        return Check("fp32_rerun", False, summary + ": non-finite in fp32 too, so reduced "
                     "precision is not the cause (see unsafe_math)")
    if reproduced:
        return Check("fp32_rerun", True, summary + ": finite in fp32, so reduced precision is the cause")
    return Check("fp32_rerun", True, summary + ": the step did not reproduce as non-finite (the fault "
                 "may depend on data, RNG or optimizer state)")


def _loss_dtype_check(loss_dtype: torch.dtype | None) -> Check:
    """Check 2: the loss is computed in float32."""
    if loss_dtype == torch.float32:
        return Check("loss_in_fp32", True, "the loss is float32 under the plan")
    return Check("loss_in_fp32", False, f"the loss is {loss_dtype} under the plan: compute it in fp32 (outside "
                 "autocast, or upcast the logits with torchimpl.precision.plan.upcast)")


def _scan_check(name: str, findings: list[Any], clean: str) -> Check:
    """Checks 4 and 5: the first finding of an op scan, and how many more."""
    if not findings:
        return Check(name, True, clean)
    more = f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""
    return Check(name, False, f"{findings[0]}{more}")


def _bf16_rerun_check(plan: PrecisionPlan, reproduced: bool, bf16: Any) -> Check:
    """Check 6: an fp16 step rerun in bf16 (``bf16`` is that rerun, or None when not run)."""
    if plan.mode != "fp16":
        return Check("bf16_rerun", None, f"not applicable: the plan is {plan.mode}")
    if bf16 is None:
        return Check("bf16_rerun", None, "not applicable: this CUDA device lacks bf16")
    if not reproduced:
        return Check("bf16_rerun", None, f"the fp16 step did not reproduce; bf16 step: {bf16.describe()}")
    if bf16.finite:
        return Check("bf16_rerun", False, f"bf16 step: {bf16.describe()}: fp16's range or resolution is "
                     "the cause; precision mode bf16 fixes it")
    return Check("bf16_rerun", True, f"bf16 step: {bf16.describe()}: bf16 would not fix it")


def report_nonfinite(path: Path, *, step: int, what: str, model: nn.Module, batch: Any,
                     loss_fn: Callable[[nn.Module, Any], torch.Tensor], plan: PrecisionPlan,
                     optimizer: torch.optim.Optimizer | None, scaler: Any, dist: Any) -> str:
    """Diagnose a step that stopped on a non-finite value and write the report to ``path``
    (JSON); returns the path. Call on every rank: each diagnoses its own batch (the fault may
    be in any rank's data), and rank 0 alone writes the file, with the other ranks'
    diagnoses under ``other_ranks``. Under FSDP2 the file says why there is no diagnosis.
    A failing diagnosis is recorded in the file, never raised over the original problem."""
    try:
        if dist.sharded:  # the diagnosis reruns the step on a copy of the whole model
            raise ValueError("FSDP2 shards the parameters; rerun from the last checkpoint with "
                             "train.distributed=ddp or none to diagnose")
        report = diagnose_nonfinite(model, batch, loss_fn, plan, optimizer, scaler)
        data = report.to_dict() if hasattr(report, "to_dict") else dataclasses.asdict(report)
    except Exception as exc:
        data = {"error": f"diagnosis failed: {exc!r}"}
    data = {"step": step, "problem": what, "diagnosis": json.loads(json.dumps(data, default=str))}
    by_rank = dist.gather(data["diagnosis"], "gathering the non-finite diagnoses")
    if by_rank is not None:
        if len(by_rank) > 1:
            data["other_ranks"] = {str(r): d for r, d in enumerate(by_rank) if r}
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_text(path, json.dumps(data, indent=2), what="diagnosis report")  # never through a planted link
    log.error("%s at step %d; diagnosis %s %s", what, step,
              "written to" if by_rank is not None else "of this rank written by rank 0 to", path)
    return str(path)
