"""``inspect_precision``: diagnose a model's precision before it fails (``ampspec doctor --task``).

1. For ``steps`` batches the model runs in the requested precision (``bf16``, ``fp16`` or
   ``fp8``) beside an fp32 shadow. Both are deep copies: the user's model, its gradients and
   every random generator are left as they were. On a CPU, fp16 runs under CPU autocast in
   float16 (the trainer refuses it there; the doctor measures it), fp8 through torchao's
   emulation with the rest under bf16 autocast.
2. Each step the shadow starts from the mixed model's weights and optimizer state (one step's
   error, never drift; the state copied into the shadow's own tensors, ``doctor.shadow``) and
   from the same random state; both run forward and backward on the same batch. fp16 runs
   scale the loss as the user's run would: torch's dynamic policy (``torch.amp.GradScaler``'s),
   from ``init_scale``, halving the scale and skipping the step on non-finite gradients,
   doubling it after ``growth_interval`` clean steps. Each step's scale, the skipped steps, and
   on a skipped step the largest scale exponent at which the shadow's gradients would have fit
   in the 16-bit format (``step_high``:
   the output gradients of the 16-bit layers and the parameter gradients of those layers, whose
   GEMMs run in 16 bits) and the module in whose backward the gradient first became non-finite
   (among the leaf modules in forward order: the one after the last whose output gradient is
   non-finite, where its own is finite; else that last one; else the owner of the last
   non-finite parameter gradient) are recorded. A skipped step whose fp32 shadow has
   non-finite parameter gradients too is not precision's doing (``shadow_failed``, at the module
   found the same way in the shadow).
3. The update each parameter should get is the shadow optimizer's (in fp32, from the shadow's
   gradients): the exact update of ``reference.health`` rule 12, against which the mixed step's
   stored weights before and after it are judged (lost: unchanged where the exact update is
   non-zero). ``bf16-true`` holds the mixed model's parameters in bf16 (its batches' floating
   tensors cast, no autocast) and steps them through ``precision.master_weights``
   (``master_weights``; under ``fp32`` the stored weight is the float32 master copy).
4. The first step, and the first two steps whose mixed loss is non-finite, run under an op scan
   (``torchimpl.precision.diagnostics``' scanner): unsafe math and fp16 normalisation, and which
   operations ran in a 16-bit dtype, for the CPU/CUDA autocast note.
5. On the first step on which a 16-bit layer's SQNR falls below its format's floor
   (``kinds.sqnr_floor_db``) with both outputs finite, the first such layer (in hook order) is
   scanned inside (``torchimpl.doctor.inner``); at most ``_INNER_SCANS`` layers a run.
6. The numbers are ``torchimpl.doctor.stats``', computed a step at a time by
   ``torchimpl.doctor.batch`` (the same numbers, bit for bit, in few passes per tensor and one
   host read a step); the verdicts ``torchimpl.doctor.verdicts``'.
7. Where ``verify_fix`` is on, the first verdicts whose fix is a setting the doctor takes
   (``fp32_modules``, ``init_scale``) are rerun with that setting for a few steps; the verdict
   then says whether the fix cured it (``numbers["fix_cures"]``).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchimpl.precision import health
from torchimpl._torch_compat import _foreach_sub, tree_leaves
from torchimpl.precision.diagnostics import Finding, _fp16_norm_problem, _OpScanner, _unsafe_problem
from torchimpl.precision.probe import Fp8Probe, Recorder, is_float8_layer
from torchimpl.doctor.report import PrecisionReport
from torchimpl.doctor.stats import Fp8Stats, LayerStats, ParamStats, dtype_name
from torchimpl.doctor.batch import Scratch, backward_batch, forward_batch, grad_batch, param_batch
from torchimpl.doctor.shadow import RngState, Snapshot, copy_all, copy_optimizer, module_pairs
from torchimpl.doctor.inner import InnerFindings, scan_module
from torchimpl.doctor.verdicts import judge, judge_notes, sqnr_floor_db, verify_fixes
from torchimpl.precision.fp32_modules import apply_fp32_modules
from torchimpl.train.loss_protocol import default_loss_fn
from torchimpl.precision.plan import fp32_island
from torchimpl.spec_bridge import autocast_device_note
from torchimpl.precision.fp8 import convert_to_fp8
from torchimpl.train.master_weights import MasterWeights
from torchimpl.train.true_precision import cast_batch

__all__ = ["DOCTOR_PRECISIONS", "Observations", "inspect_precision"]

DOCTOR_PRECISIONS = ("bf16", "fp16", "fp8", "bf16-true")
_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16, "bf16-true": torch.bfloat16}
_SCANS = 3
_VERIFY_STEPS = 4
_INNER_SCANS = 2
_BACKOFF, _GROWTH = 0.5, 2.0
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                              "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n))


@dataclass
class Observations:
    """What one doctor run saw (the input of ``doctor_verdicts.judge``)."""

    precision: str
    device: str
    use_scaler: bool
    scale: float
    """The initial loss scale (``init_scale``; 1.0 without a scaler)."""
    keep: float
    growth_interval: int = 2000
    steps: int = 0
    skipped_steps: int = 0
    scales: list[float] = field(default_factory=list)
    """The loss scale of each step."""
    skipped: list[int] = field(default_factory=list)
    overflow_module: dict[int, str] = field(default_factory=dict)
    """Skipped step -> the module whose gradient first overflowed ("" when none is known)."""
    step_high: dict[int, int | None] = field(default_factory=dict)
    """Skipped step -> the largest k with the shadow's gradients times 2^k representable."""
    inner: list[InnerFindings] = field(default_factory=list)
    layers: dict[str, LayerStats] = field(default_factory=dict)
    params: dict[str, ParamStats] = field(default_factory=dict)
    param_module: dict[str, str] = field(default_factory=dict)
    fp8: dict[str, Fp8Stats] = field(default_factory=dict)
    first_overflow: dict[str, int] = field(default_factory=dict)
    shadow_failed: str | None = None
    shadow_failed_step: int | None = None
    loss_dtypes: set[str] = field(default_factory=set)
    unsafe: list[Finding] = field(default_factory=list)
    norm: list[Finding] = field(default_factory=list)
    low_ops: dict[str, set[str]] = field(default_factory=dict)

    @staticmethod
    def format_max(dtype: str) -> float:
        return float(torch.finfo(getattr(torch, dtype)).max)


class _Scanner(_OpScanner):
    """The diagnostics' op checks for unsafe math and fp16 normalisation (rule 4), without its
    search for the first non-finite op (a check of every tensor of every op: the doctor compares
    each layer with its shadow instead), and a note of the ops that ran on 16-bit inputs."""

    def __init__(self) -> None:
        super().__init__(unsafe=True, fp16_norm=True, limit=20)
        self.low_ops: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        # torch has no isfinite or comparisons for float8, and tensor subclasses (torchao's float8
        # tensors) refuse them: the casts into float8 and the ops on float8 operands are not scanned.
        if kwargs.get("dtype") in _FLOAT8 or any(
                isinstance(a, torch.Tensor) and (a.dtype in _FLOAT8 or type(a) not in (torch.Tensor, nn.Parameter))
                for a in tree_leaves(args)):
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
        first = args[0] if args else None
        if self.phase == "forward" and isinstance(first, torch.Tensor) and first.dtype in (torch.float16, torch.bfloat16):
            self.low_ops.setdefault(name, set()).add(self._where())
        for findings, check in ((self.unsafe_findings, _unsafe_problem), (self.norm_findings, _fp16_norm_problem)):
            if len(findings) < self.limit:
                problem = check(base, args)
                if problem:
                    findings.append(Finding(str(func), self._where(), self.phase, problem))
        return func(*args, **kwargs)


def _default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return default_loss_fn(model, batch)


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _check_args(precision: str, steps: int, init_scale: float, keep: float) -> None:
    if precision not in DOCTOR_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(DOCTOR_PRECISIONS)}, got {precision!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"init_scale must be a finite positive number, got {init_scale!r}")
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep!r}")


def inspect_precision(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    precision: str = "bf16",
    steps: int = 20,
    *,
    device: str | torch.device | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    init_scale: float = 2.0**16,
    fp32_modules: Iterable[str] = (),
    fp8_recipe: str = "tensorwise",
    keep: float = 0.999,
    sqnr_threshold_db: float = 20.0,
    master_weights: str = "none",
    growth_interval: int = 2000,
    verify_fix: bool = True,
) -> PrecisionReport:
    """Diagnose ``model``'s precision on ``steps`` batches of ``batches`` (reused from the start
    when there are fewer); see the module docstring. ``loss_fn(model, batch)`` (default: the
    model returns the loss of ``model(*batch)``) is called under autocast, as in training.
    ``optimizer`` builds the optimizer from parameters (default AdamW, lr 1e-3); ``init_scale``
    is the fp16 initial loss scale and ``growth_interval`` the clean steps before it doubles
    (torch's dynamic policy); ``fp32_modules`` are patterns of modules to run in an fp32 island
    (``precision.fp32_modules``); ``keep`` is the share of non-zero gradients a scale must keep
    representable; ``sqnr_threshold_db`` the SQNR below which a layer is reported;
    ``master_weights`` the option of ``precision: bf16-true`` (none, fp32, kahan, stochastic);
    ``verify_fix`` reruns the doctor with its own fix (rule 7)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_args(precision, steps, init_scale, keep)
    if not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"growth_interval must be a positive integer, got {growth_interval!r}")
    batches = batches if isinstance(batches, (list, tuple)) else list(itertools.islice(_cycle(batches), steps))
    if master_weights != "none" and precision != "bf16-true":
        raise ValueError(f"master_weights={master_weights!r} applies to precision 'bf16-true' (parameters held in "
                         f"bf16), got precision {precision!r}")
    dev = torch.device(device) if device is not None else next(
        (p.device for p in model.parameters()), torch.device("cpu"))
    runner = _Runner(model, precision, dev, loss_fn or _default_loss, optimizer or _default_optimizer,
                     init_scale if precision == "fp16" else 1.0, tuple(fp32_modules), fp8_recipe, keep,
                     growth_interval, master_weights)
    rng = RngState.capture()
    try:
        for i, batch in enumerate(itertools.islice(_cycle(batches), steps)):
            runner.step(i, batch)
    finally:
        rng.restore()
    obs = runner.obs
    verdicts = judge(obs)
    if verify_fix and verdicts:
        def rerun(**fix: Any) -> list[Any]:
            options = {"device": device, "optimizer": optimizer, "init_scale": init_scale,
                       "fp32_modules": tuple(fp32_modules), "fp8_recipe": fp8_recipe, "keep": keep,
                       "growth_interval": growth_interval, "master_weights": master_weights, **fix}
            return inspect_precision(model, batches, loss_fn, precision, min(steps, _VERIFY_STEPS),
                                     verify_fix=False, **options).verdicts

        verdicts = verify_fixes(verdicts, obs, rerun, tuple(fp32_modules))
    return PrecisionReport(obs, verdicts, judge_notes(obs) + runner.notes(), sqnr_threshold_db)


def _cycle(batches: Iterable[Any]) -> Iterable[Any]:
    while True:
        empty = True
        for b in batches:
            empty = False
            yield b
        if empty:
            raise ValueError("batches yielded nothing: pass at least one batch")


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


class _Runner:
    """The mixed model, its fp32 shadow, their optimizers, and what they showed (rules 1-4)."""

    def __init__(self, model: nn.Module, precision: str, device: torch.device, loss_fn: Callable, make_opt: Callable,
                 scale: float, fp32_modules: tuple[str, ...], fp8_recipe: str, keep: float,
                 growth_interval: int = 2000, master_weights: str = "none") -> None:
        self.device, self.loss_fn, self.scale = device, loss_fn, scale
        self.dtype = _DTYPE[precision]
        self.shadow = copy.deepcopy(model).to(device).float().train()
        mixed = copy.deepcopy(model).to(device).train()
        self.fp8_report = None
        if precision == "fp8":
            mixed, self.fp8_report = convert_to_fp8(mixed, fp8_recipe, device)
        self.fp32_modules = apply_fp32_modules(mixed, fp32_modules)
        self.true = precision == "bf16-true"
        self.mixed = mixed.to(self.dtype) if self.true else mixed
        self.opt, self.shadow_opt = make_opt(self.mixed.parameters()), make_opt(self.shadow.parameters())
        self.master = MasterWeights(self.opt, master_weights) if self.true else None
        mixed = self.mixed
        self.obs = Observations(precision, str(device), precision == "fp16", scale, keep, growth_interval)
        self._tracker = 0
        self._inner_scans = 0
        # the parameters by name, once: a module walk per step costs more than the step's counts
        self._mixed_params, self._shadow_params = dict(mixed.named_parameters()), dict(self.shadow.named_parameters())
        for name, p in self._mixed_params.items():
            self.obs.params[name] = ParamStats(name, dtype_name(p.dtype))
            self.obs.param_module[name] = name.rpartition(".")[0]
        rowwise = fp8_recipe.startswith("rowwise")
        for name in self._fp8_names(mixed):
            self.obs.fp8[name] = Fp8Stats(name, rowwise=rowwise)
        self._scans = 0
        self._scratch = Scratch()  # the statistics' buffers, reused every step
        self._before, self._stored_before = Snapshot(), Snapshot()  # rule 3's weights before the step
        self._state_modules = module_pairs(self.shadow, mixed)

    @staticmethod
    def _fp8_names(model: nn.Module) -> list[str]:
        return [n for n, m in model.named_modules() if is_float8_layer(m)]

    def _align(self) -> None:
        """Rule 2: the shadow takes the mixed model's weights, buffers and optimizer state (its
        ``state_dict``, read from the modules' own tables where no module shapes it)."""
        with torch.no_grad():
            if self._state_modules is None:
                theirs = self.mixed.state_dict()
                for k, v in self.shadow.state_dict().items():
                    v.copy_(theirs[k])
            else:  # walked each step: a module may replace a buffer's tensor
                into, values = [], []
                for mine, theirs in self._state_modules:
                    for name, p in mine._parameters.items():
                        if p is not None:
                            into.append(p)
                            values.append(theirs._parameters[name])
                    for name, b in mine._buffers.items():
                        if b is not None and name not in mine._non_persistent_buffers_set:
                            into.append(b)
                            values.append(theirs._buffers[name])
                copy_all(into, values)
        copy_optimizer(self.opt, self.shadow_opt)

    def _run(self, model: nn.Module, batch: Any, mixed: bool, rng: RngState, scanner: _Scanner | None) -> tuple:
        rng.restore()
        model.zero_grad(set_to_none=True)
        rec = Recorder(model)
        probe = Fp8Probe(model) if mixed and self.obs.fp8 else None
        handles = _scan_hooks(model, scanner) if scanner is not None else []
        ctx = torch.autocast(self.device.type, dtype=self.dtype) if mixed and not self.true else _NoAutocast()
        if mixed and self.true:
            batch = cast_batch(batch, self.dtype)
        try:
            with (scanner if scanner is not None else _Null()):
                with ctx:
                    loss = self.loss_fn(model, batch)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError("loss_fn(model, batch) must return a one-element loss tensor")
                if scanner is not None:
                    scanner.phase = "backward"
                if loss.requires_grad and bool(torch.isfinite(loss.detach()).all()):
                    (loss.float() * self.scale if mixed else loss).backward()
        finally:
            for h in [*rec.handles, *(probe.handles if probe else []), *handles]:
                h.remove()
        return loss.detach(), rec, probe

    def step(self, i: int, batch: Any) -> None:
        batch = _to(batch, self.device)
        self._align()
        rng = RngState.capture()
        scanner = _Scanner() if self._scans == 0 else None
        loss, rec, probe = self._run(self.mixed, batch, True, rng, scanner)
        if scanner is None and not bool(torch.isfinite(loss).all()) and self._scans < _SCANS:
            scanner = _Scanner()
            loss, rec, probe = self._run(self.mixed, batch, True, rng, scanner)
        if scanner is not None:
            self._scans += 1
            self.obs.unsafe += scanner.unsafe_findings
            self.obs.norm += scanner.norm_findings
            for op, where in scanner.low_ops.items():
                self.obs.low_ops.setdefault(op, set()).update(where)
        shadow_loss, shadow_rec, _ = self._run(self.shadow, batch, False, rng, None)
        self.obs.steps += 1
        self.obs.scales.append(self.scale)
        self.obs.loss_dtypes.add(dtype_name(loss.dtype))
        with health.one_thread(self.device):
            self._layers(i, rec, shadow_rec, shadow_loss)
            if probe is not None:
                self._fp8_layers(probe)
        self._inner_scan(rec, batch, rng)
        self._update_scale(i, self._params_and_update(), rec, shadow_rec)
        rng.restore()

    def _inner_scan(self, rec: Recorder, batch: Any, rng: RngState) -> None:
        """Rule 5: the first layer whose SQNR collapsed this step, with finite outputs, scanned inside."""
        if self._inner_scans >= _INNER_SCANS or self.obs.shadow_failed is not None:
            return
        scanned = {f.module for f in self.obs.inner}
        for name in rec.order:
            s = self.obs.layers.get(name)
            if s is None or not s.low_precision or s.same_as is not None or name in scanned:
                continue
            floor = sqnr_floor_db(s.dtype, self.obs.precision)
            if floor is not None and s.last_sqnr_db < floor:
                def forward() -> None:
                    rng.restore()
                    with torch.autocast(self.device.type, dtype=self.dtype):
                        self.loss_fn(self.mixed, batch)

                self._inner_scans += 1
                self.obs.inner.append(scan_module(self.mixed, name, forward))
                return

    def _update_scale(self, i: int, finite: bool, rec: Recorder, shadow_rec: Recorder) -> None:
        """Rule 2: torch's dynamic policy (backoff on non-finite gradients, growth after the interval)."""
        if finite:
            if not self.obs.use_scaler:
                return
            self._tracker += 1
            if self._tracker >= self.obs.growth_interval:
                self._tracker = 0
                if math.isfinite(self.scale * _GROWTH):
                    self.scale *= _GROWTH
            return
        self.obs.skipped_steps += 1
        self.obs.skipped.append(i)
        self.obs.overflow_module[i] = self._first_overflow(rec, self.mixed)
        if self.obs.shadow_failed is None and any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
                                                  for p in self.shadow.parameters()):
            self.obs.shadow_failed, self.obs.shadow_failed_step = self._first_overflow(shadow_rec, self.shadow), i
        with health.one_thread(self.device):
            self.obs.step_high[i] = self._step_high(shadow_rec)
        if self.obs.use_scaler:
            self.scale *= _BACKOFF
            self._tracker = 0

    def _step_high(self, shadow_rec: Recorder) -> int | None:
        """Rule 2: the largest k at which this step's shadow gradients times 2^k fit the 16-bit format."""
        top = float(torch.finfo(self.dtype).max)
        amaxes = []
        for name in shadow_rec.order:
            if name in self.obs.layers and self.obs.layers[name].low_precision:
                amaxes += [health.amax(c.grad) for c in shadow_rec.calls[name] if c.grad is not None]
        for name, p in self.shadow.named_parameters():
            layer = self.obs.layers.get(self.obs.param_module[name])
            if p.grad is not None and layer is not None and layer.low_precision:
                amaxes.append(health.amax(p.grad))
        amaxes = [a for a in amaxes if 0 < a < math.inf]
        if not amaxes:
            return None
        f, e = math.frexp(max(amaxes))
        high = math.frexp(top)[1] - e
        while math.ldexp(f, e + high) > top:
            high -= 1
        return high

    def _first_overflow(self, rec: Recorder, model: nn.Module) -> str:
        """The module in whose backward the gradient first became non-finite (rule 2)."""
        leaves = [n for n in rec.order if not any(o.startswith(n + ".") for o in rec.order)]
        bad = [any(c.grad is not None and not bool(torch.isfinite(c.grad).all()) for c in rec.calls[n])
               for n in leaves]
        if any(bad):
            j = max(k for k, b in enumerate(bad) if b)
            return leaves[j + 1] if j + 1 < len(leaves) else leaves[j]
        for name, p in reversed(list(model.named_parameters())):
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return self.obs.param_module[name]
        return ""

    def _layers(self, i: int, rec: Recorder, shadow_rec: Recorder, shadow_loss: torch.Tensor) -> None:
        """Rule 6: every call's numbers in one pass (``doctor.batch``), then taken in hook order."""
        outputs: dict[tuple, str] = {}
        work: list[tuple[str, Any, Any, str | None]] = []  # (module, call, twin, the module it repeats)
        for name in rec.order:
            for call, twin in zip(rec.calls[name], shadow_rec.calls.get(name, [])):
                key = _identity(call.output)
                work.append((name, call, twin, outputs.get(key)))
                outputs.setdefault(key, name)  # the same tensor as an inner module's: a container, a no-op dropout
        calls = [(c, t) for _, c, t, same in work if same is None]
        forward = iter(forward_batch([(c.output, t.output) for c, t in calls], self._scratch))
        grads = [(c.grad, t.grad) for c, t in calls if c.grad is not None and t.grad is not None]
        backward = iter(backward_batch(grads, self.scale, self.obs.keep, self._scratch))
        first, todo = None, iter(work)
        pending = next(todo, None)
        for name in rec.order:
            stats = self.obs.layers.setdefault(name, LayerStats(name))
            while pending is not None and pending[0] == name:
                _, call, twin, same = pending
                pending = next(todo, None)
                if same is not None:
                    stats.same_as = same
                    continue
                if stats.take_forward(call.output.dtype, next(forward), i) and first is None:
                    first = name
                if call.grad is not None and twin.grad is not None:
                    stats.take_backward(next(backward), self.scale)
            if stats.shadow_nonfinite and self.obs.shadow_failed is None:
                self.obs.shadow_failed, self.obs.shadow_failed_step = name, i
        if self.obs.shadow_failed is None and not bool(torch.isfinite(shadow_loss).all()):
            self.obs.shadow_failed, self.obs.shadow_failed_step = "", i
        if first is not None:
            self.obs.layers[first].overflow_steps += 1
            self.obs.first_overflow[first] = self.obs.first_overflow.get(first, 0) + 1

    def _fp8_layers(self, probe: Fp8Probe) -> None:
        for name, calls in probe.calls.items():
            for ops in calls:
                stats = self.obs.fp8[name]
                stats.add("input", ops.input)
                stats.add("weight", ops.weight)
                stats.add("grad_output", ops.grad_output)

    def _params_and_update(self) -> bool:
        """Rules 2-3: the mixed step (unscaled, skipped on non-finite gradients) and the shadow's
        update judged against the mixed model's stored weights; whether the gradients were finite."""
        mixed, shadow = self._mixed_params, self._shadow_params
        before = dict(zip(shadow, self._before.take(list(shadow.values()))))
        stored = self._stored()
        stored = dict(zip(stored, self._stored_before.take(list(stored.values()))))
        if self.scale != 1.0:  # x / 1 is x, bit for bit (signed zeros, infinities and NaN too)
            with torch.no_grad():
                for p in mixed.values():
                    if p.grad is not None:
                        p.grad.div_(self.scale)
        if all(p.grad is None for p in shadow.values()):
            return True
        named = [(n, p.grad) for n, p in mixed.items() if p.grad is not None]
        with health.one_thread(self.device):  # rule 3's gradient counts, before a step could touch a gradient
            finite, counts = grad_batch([g for _, g in named], [shadow[n].grad if n in shadow else None
                                                                for n, _ in named])
        flushed = {n: c for (n, _), c in zip(named, counts) if c is not None}
        self.shadow_opt.step()
        if finite:
            if self.master is None:
                self.opt.step()
            else:
                self.master.step()  # its own counts are unused: rule 3 counts against the shadow
        after = self._stored() if finite else {}
        judged = [n for n in mixed if n in after and n in shadow and shadow[n].grad is not None]
        with health.one_thread(self.device), torch.no_grad():
            updates = _foreach_sub([shadow[n] for n in judged], [before[n] for n in judged]) \
                if judged else []
            lost = dict(zip(judged, param_batch([stored[n] for n in judged], [after[n] for n in judged], updates)))
        for n in mixed:
            self.obs.params[n].take(lost.get(n), flushed.get(n))
        return finite

    def _stored(self) -> dict[str, torch.Tensor]:
        """Where each weight is stored (rule 3): the parameter, or under ``fp32`` its master copy."""
        masters = self.master.masters if self.master is not None and self.master.option == "fp32" else None
        named = self._mixed_params
        if masters is None:
            return dict(named)
        index = {id(p): i for i, p in enumerate(self.master.params)}
        return {n: masters[index[id(p)]] for n, p in named.items()}

    def notes(self) -> list[str]:
        out = []
        if self.obs.device.startswith("cpu") and self.obs.precision in ("fp16", "bf16", "fp8"):
            note = autocast_device_note(self.obs.low_ops, dtype_name(self.dtype))
            if note:
                out.append(note)
        if self.fp32_modules:
            out.append(f"fp32 islands: {', '.join(self.fp32_modules)}")
        if self.fp8_report is not None:
            out += self.fp8_report.lines()
        return out


def _identity(t: torch.Tensor) -> tuple:
    """What makes two recorded outputs the same tensor (a container returns its last child's)."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) if t.numel() else (id(t),)


def _scan_hooks(model: nn.Module, scanner: _Scanner) -> list[Any]:
    """The scanner's module stack, kept by pre- and post-forward hooks (as the diagnosis does)."""
    def leave(*_: Any) -> None:  # a forward hook returning a value would replace the output
        scanner.module_stack.pop()

    handles = []
    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(lambda *_, n=name: scanner.module_stack.append(n)))
        handles.append(m.register_forward_hook(leave))
    return handles


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _NoAutocast(_Null):
    """The shadow runs in fp32: autocast off even if the caller has it on."""

    def __enter__(self) -> None:
        self._cm = fp32_island()
        self._cm.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)

