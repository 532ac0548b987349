"""The trainer: the run's loop (step, then the periodic work due, stop), callbacks and the summary.

Everything one ``fit`` builds and changes is held in one object made at its start (``_Fit``).
Where the rest lives:

- ``torchimpl.train.step``: the step engine, one optimizer step by the step contract of
  ``reference/step.py`` (the window of microbatches, unscale, check, clip, step or skip,
  update, schedule, the record), its loss scaling and its skip decision;
- ``torchimpl.run.state``: the counters, the data cursor, and what a checkpoint holds and how
  a run is restored from it;
- ``torchimpl.train.cadence``: the log points, the evaluation, the checkpoints (each deciding when it
  is due) and the step clock;
- ``torchimpl.train.reporting``, ``torchimpl.run.records``: the log point's reading and writing, the step
  record and the trace;
- ``torchimpl.distributed``: the multi-process hooks (identities in a single process).

A run, as :meth:`Trainer.fit` tells it: resolve the device and the precision plan; move the
model and build the optimizer on it; build the step engine from the plan; seed every
generator; resume from a checkpoint if asked; then, until ``train.steps`` optimizer steps
(applied or skipped) are done or a stop is requested: one step, and at their intervals a log
point (the records read in one transfer, the trace written, ``on_log``), an evaluation and a
checkpoint; finally a summary.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from torchimpl.train.callback_checks import checked_hook
from torchimpl.train.cadence import Checkpointer, Evaluator, LogPoints, StepClock, quiet_steps
from torchimpl.run.checkpoint import CheckpointError, check_loadable, remove_stale_temporaries
from torchimpl.config.schema import Config, ScheduleConfig
from torchimpl.precision.device import resolve_device
from torchimpl.precision.diagnostics import report_nonfinite
from torchimpl.precision.guard import NonFiniteError, NonFiniteGuard
from torchimpl.distributed import DistributedContext, init_distributed, reduction_settings
from torchimpl.train.optim import BuiltOptimizer, OptimizerConfig, adopt_optimizer, build_optimizer
from torchimpl.precision.plan import PrecisionDowngradeWarning, PrecisionPlan, autocast_context, resolve_precision
from torchimpl.run.lifecycle import Interrupts, check_train_data, outcome, preflight
from torchimpl.train.loss_protocol import default_loss_fn
from torchimpl.precision.fp32_modules import apply_fp32_modules
from torchimpl.train.precision_stats import precision_stats_callbacks
from torchimpl.train.reporting import Reporter, open_reporter
from torchimpl.run.folder import claimed_run
from torchimpl.run.state import DataCursor, RunState, TrainState
from torchimpl.train.scaler import DynamicLossScaler, make_grad_scaler
from torchimpl.train.schedule import AppliedStepSchedule, UserSchedule, adopt_scheduler
from torchimpl.train.callbacks import Callback, StopTraining
from torchimpl.train.step import StepEngine, bind_hooks, build_step_engine, choose_sync_free
from torchimpl.train.summary import RunSummary
from torchimpl.train.true_precision import MasterStep, batch_preparer, cast_model, master_step
from torchimpl.train.threads import run_threads
from torchimpl.precision.fp8 import Fp8Report, check_mx_batch, convert_to_fp8

__all__ = ["Callback", "RunSummary", "StopTraining", "Trainer", "TrainState", "default_loss_fn"]

log = logging.getLogger(__name__)


@dataclass
class _Fit:
    """Everything one ``fit`` builds and changes, made at its start: the trainer keeps only its
    configuration and callbacks between runs, and a second ``fit`` starts from nothing."""

    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    device: torch.device
    user: tuple[Any, Any] | None
    """Your optimizer and scheduler (or functions building them), when ``fit`` was given them."""
    dist: DistributedContext | None = None
    stop_requested: str | None = None
    fault: str | None = None
    """Why the run stops on a fault (a non-finite value, a collapsed scale), else None."""
    diagnosis: str | None = None
    save_refused: str | None = "before fit has set the run up"
    stopped: str | None = None
    train_data: Iterable[Any] | None = None
    plan: PrecisionPlan | None = None
    downgrades: list[str] = dataclasses.field(default_factory=list)
    fp8_report: Fp8Report | None = None
    fp32_modules: list[str] = dataclasses.field(default_factory=list)
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    optimizer_kind: str = ""
    optimizer_reason: str | None = None
    scheduler: LRScheduler | ReduceLROnPlateau | None = None
    """Your scheduler, when ``fit`` was given one (the configuration's schedule is the engine's)."""
    scaler: DynamicLossScaler | None = None
    master: MasterStep | None = None
    """Under a ``*-true`` plan: the applied step through ``precision.master_weights``."""
    sync_free: bool = False
    state: TrainState = dataclasses.field(default_factory=TrainState)
    engine: StepEngine | None = None
    run: RunState | None = None
    interrupts: Interrupts | None = None
    reporter: Reporter | None = None
    log_dir: Path | None = None
    metrics_file: str | None = None
    guard: NonFiniteGuard | None = None
    logs: LogPoints | None = None
    evaluator: Evaluator | None = None
    checkpointer: Checkpointer | None = None
    clock: StepClock | None = None
    quiet: Callable[[int], bool] = lambda step: False  # torchimpl.train.cadence.quiet_steps, once the parts are made


def _optimizer_and_schedule(cfg: Config, fit: _Fit) -> tuple[BuiltOptimizer, Any, Any]:
    """The optimizer (the configuration's, built after the move so that the fused probe sees
    the real parameters, or the user's, checked), the user's scheduler, and the schedule the
    engine runs (``None``: the configuration's), with the sync-free decision they allow."""
    if fit.user is None:
        built = build_optimizer(fit.model, cfg.optimizer, fit.device)
        scheduler = schedule = None
    else:
        built = adopt_optimizer(fit.model, fit.user[0], fit.device)
        scheduler = adopt_scheduler(built.optimizer, fit.user[1])
        check_loadable(built.optimizer.state_dict(), "the optimizer")
        if scheduler is not None:
            check_loadable(scheduler.state_dict(), "the scheduler")
        unused = [name for name, default in (("optimizer", OptimizerConfig()), ("schedule", ScheduleConfig()))
                  if getattr(cfg, name) != default]
        if unused:
            warnings.warn(f"the configuration's {' and '.join(unused)} section{'s are' if len(unused) > 1 else ' is'} "
                          f"not used: fit() was given your optimizer{' and scheduler' if scheduler else ''}",
                          stacklevel=4)
    fit.sync_free, why = choose_sync_free(cfg.train.sync_free, built.kind, built.optimizer, scheduler=scheduler)
    if why:
        fit.downgrades.append(why)
        warnings.warn(why, stacklevel=4)
    if fit.user is not None:
        # The sync-free mode tabulates its rates on the host: a constant one for your optimizer.
        schedule = (AppliedStepSchedule(built.optimizer, ScheduleConfig(name="constant"), cfg.train.steps)
                    if fit.sync_free else UserSchedule(built.optimizer, scheduler))
    return built, scheduler, schedule


def _checked_callbacks(callbacks: Any) -> list[Callback]:
    """``Trainer(callbacks=...)`` as a list, each a ``Callback`` instance, else ``TypeError`` naming it."""
    # One callback where a sequence belongs is what the user means.
    if isinstance(callbacks, Callback):
        return [callbacks]
    if isinstance(callbacks, (str, bytes)) or not hasattr(callbacks, "__iter__"):
        raise TypeError(f"callbacks must be a list of Callback instances, got {type(callbacks).__name__}")
    out = list(callbacks)
    for i, cb in enumerate(out):
        if isinstance(cb, type):
            raise TypeError(f"callbacks[{i}] is the class {cb.__name__}, not an instance: pass {cb.__name__}()")
        if not isinstance(cb, Callback):
            raise TypeError(f"callbacks[{i}] is a {type(cb).__name__}, not a Callback: subclass torchimpl.Callback "
                            "and override the hooks you need (the others stay no-ops)")
    return out


def _check_resume_target(resume: str | Path | None, cfg: Config, overwrite: bool) -> None:
    """``fit(resume=...)`` that names nothing to resume from, or with ``overwrite``: refused."""
    if resume is None:
        return
    if overwrite:
        raise ValueError("fit(resume=..., overwrite=True) contradict each other: resume continues the run in the "
                         "folder, overwrite replaces it; give one")
    if str(resume) == "latest":
        if cfg.checkpoint.folder is None:
            raise ValueError("resume='latest' needs checkpoint.folder (the folder to look in): set it, or give "
                             "resume= a checkpoint file")
    elif not Path(resume).exists():
        raise CheckpointError(f"cannot read checkpoint {resume}: No such file or directory; give an existing "
                              "checkpoint file, or resume='latest' with checkpoint.folder")


def _reduction(cfg: Config) -> Any:
    """Rule 11 of torchimpl.distributed: the gradient reduction and FSDP2's parameter dtype."""
    p = cfg.precision
    return reduction_settings(cfg.train.distributed, p.mode, p.master_weights, cfg.train.reduce_dtype)


def _held_model(model: nn.Module, plan: Any, dist: DistributedContext) -> tuple[nn.Module, bool]:
    """The model in the dtype its parameters are held in, and whether FSDP2's fp32 shards are the
    master copy: a ``*-true`` plan casts the model to 16 bits, except under FSDP2 with
    ``param_dtype`` set, where the parameters stay fp32 and FSDP2 casts the compute copies. They
    start from the 16-bit values, as one process's fp32 master copy of a cast model does."""
    if dist.reduction.param_dtype is not None:
        return cast_model(model, plan).to(torch.float32), True
    return cast_model(model, plan), False


def _close(fit: _Fit, callbacks: list[Callback]) -> None:
    """On every exit from ``fit``: the run's files close (a fit that failed between opening them
    and its loop, e.g. in a callback's ``on_fit_start``, never reached the loop's close; closing
    twice is a no-op), callbacks drop what they hung on the user's model, then the processes close."""
    try:
        if fit.reporter is not None:
            fit.reporter.close()
        for cb in callbacks:
            release = getattr(cb, "release", None)
            if release is not None:
                release()  # a failed fit never reaches on_fit_end: its hooks would stay on the model
    finally:
        fit.dist.close()


class Trainer:
    """Trains a model by the step contract; see the module docstring.

    Attributes available to callbacks during ``fit``: ``model`` (the module being trained,
    uncompiled), ``optimizer``, ``scheduler`` (yours, or ``None``), ``scaler`` (``None``
    without loss scaling), ``plan``, ``device``, ``state``, ``schedule``, ``params`` (the trained parameters), ``found_inf``
    (this step's device flag, from ``on_before_optimizer_step`` until the next window starts)
    and ``grad_norm`` (this step's total gradient norm before clipping, a device tensor;
    ``None`` without clipping).
    """

    def __init__(self, config: Config | None = None, callbacks: Sequence[Callback] = (), **kwargs: Any):
        """``config`` (default: the defaults) with the keywords of :meth:`Config.from_kwargs`
        applied: ``Trainer(precision="bf16-mixed", max_steps=200, accumulate=2)``. Everything is
        validated here, never first at ``fit``: one ``ConfigError`` names every bad keyword."""
        self.config = Config.from_kwargs(config, **kwargs)
        self.callbacks = _checked_callbacks(callbacks)
        self.callbacks += precision_stats_callbacks(self.config)  # logging.precision_stats
        self._fit: _Fit | None = None

    # ------------------------------------------------------------------ public helpers

    model = property(lambda self: self._fit.model)
    optimizer = property(lambda self: self._fit.optimizer)
    optimizer_kind = property(lambda self: self._fit.optimizer_kind)
    scheduler = property(lambda self: self._fit.scheduler)
    scaler = property(lambda self: self._fit.scaler)
    plan = property(lambda self: self._fit.plan)
    device = property(lambda self: self._fit.device)
    state = property(lambda self: self._fit.state)
    engine = property(lambda self: self._fit.engine)
    loss_fn = property(lambda self: self._fit.loss_fn)
    fp8_report = property(lambda self: self._fit.fp8_report)
    fp32_modules = property(lambda self: self._fit.fp32_modules)
    log_dir = property(lambda self: self._fit.log_dir if self._fit else None)
    reporter = property(lambda self: self._fit.reporter if self._fit else None)
    found_inf = property(lambda self: self.engine.found_inf)
    grad_norm = property(lambda self: self.engine.grad_norm)
    sync_free = property(lambda self: self.engine.skip.sync_free)
    schedule = property(lambda self: self.engine.skip.schedule)
    params = property(lambda self: self.engine.params)
    loss_history = property(lambda self: self._fit.reporter.loss_history if self._fit and self._fit.reporter else [])
    scale_history = property(lambda self: self._fit.reporter.scale_history if self._fit and self._fit.reporter else [])

    def request_stop(self, reason: str = "requested") -> None:
        """End ``fit`` after the current hook returns (callable from any callback)."""
        if self._fit is not None:
            self._fit.stop_requested = reason

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Save now: between steps, inside an accumulation window, or after its last backward
        (from ``on_microbatch_end``, ``on_after_backward``, ``on_step_end``, ``on_log``,
        ``on_fit_end``); every such checkpoint resumes bit for bit. The records pending on the
        device are flushed first, so that the trace holds every step before the checkpoint's."""
        fit = self._fit
        refused = "before fit" if fit is None else fit.save_refused or fit.engine.save_refused
        if refused is not None:
            raise RuntimeError(f"save_checkpoint() cannot be called {refused}")
        if path is None and fit.checkpointer.folder is None:
            raise ValueError("no path given and checkpoint.folder is not set")
        self._log_point()
        if fit.fault is not None:
            raise RuntimeError(f"save_checkpoint(): not saved, the run is stopping on a fault: {fit.fault}")
        return fit.checkpointer.save(fit.run.contents(), fit.state, path)

    @torch.no_grad()
    def evaluate(self, val_data: Iterable[Any]) -> float:
        """Mean loss over ``val_data`` under the run's autocast; one host read at the end."""
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for batch in val_data:
            with autocast_context(self.plan, self.device):
                loss = self.loss_fn(self.engine.model, self.engine.prepare(batch, self.device))
            total += loss.detach().to(torch.float64)
            count += 1
        self.model.train(was_training)
        if count == 0:
            raise ValueError("val_data yielded no batches")
        return float(total.item()) / count

    # ------------------------------------------------------------------ the run

    def fit(self, model: nn.Module, train_data: Iterable[Any], val_data: Iterable[Any] | None = None, *,
            loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
            resume: str | Path | None = None, optimizer: Any = None, scheduler: Any = None,
            overwrite: bool = False) -> RunSummary:
        """Train for ``train.steps`` optimizer steps (counting skipped ones) and summarise.

        ``resume``: a checkpoint path, or ``"latest"`` for the newest usable checkpoint in
        ``checkpoint.folder`` (see ``torchimpl.run.state`` for what may change on a resume).
        SIGINT and SIGTERM stop the run at the next step boundary (see ``torchimpl.run.lifecycle``).

        A fresh ``fit`` into another run's folders is refused unless ``resume`` continues it or
        ``overwrite=True`` replaces it; so is one into folders a run trains in (``torchimpl.run.folder``).

        ``optimizer``: your own ``torch.optim.Optimizer`` over ``model.parameters()``, or a
        function ``params -> Optimizer`` (called once the model is on its device; needed with
        ``train.distributed=fsdp2``, which replaces the parameters); the configuration's
        ``optimizer`` and ``schedule`` sections are then not used. ``scheduler``: your
        ``torch.optim.lr_scheduler.LRScheduler`` on that optimizer (or ``optimizer -> LRScheduler``),
        stepped after each applied step only; without one the optimizer's rates stay as built.
        Both states are checkpointed and resumed with the run (rule 5 of ``torchimpl.train.optim``,
        rule 4 of ``torchimpl.train.schedule``).
        """
        cfg = self.config
        _check_resume_target(resume, cfg, overwrite)  # before any work (the model moved, the folders claimed)
        check_train_data(train_data)
        if scheduler is not None and optimizer is None:
            raise ValueError("scheduler= needs the optimizer it drives: pass optimizer= too")
        if isinstance(optimizer, torch.optim.Optimizer) and cfg.train.distributed == "fsdp2":
            raise ValueError("train.distributed=fsdp2 replaces the model's parameters with sharded ones, so an "
                             "optimizer built before fit would update the old ones: pass a function "
                             "params -> Optimizer instead (e.g. optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))")
        fit = self._fit = _Fit(loss_fn=loss_fn or default_loss_fn, device=resolve_device(cfg.device),
                               user=(optimizer, scheduler) if optimizer is not None else None)
        # Multi-process hooks (torchimpl.distributed); identities with train.distributed=none.
        fit.dist = init_distributed(cfg.train.distributed, device=fit.device, timeout_s=cfg.train.distributed_timeout_s,
                                    reduction=_reduction(cfg))  # refused here, before any process group, if torch cannot run it
        try:
            preflight(cfg, val_data, is_main=fit.dist.is_main)
            with claimed_run(cfg, resume=resume is not None, overwrite=overwrite, is_main=fit.dist.is_main), \
                    run_threads(cfg.train.threads):
                self._set_up(model, train_data)
                self._seed()
                resumed = self._resume(resume)
                if cfg.checkpoint.folder is not None and fit.dist.is_main:  # only once the run is accepted
                    remove_stale_temporaries(cfg.checkpoint.folder)
                self._open(resumed, val_data)
                with Interrupts() as fit.interrupts:
                    self._loop()
                return self._summarise()
        finally:
            _close(fit, self.callbacks)

    def _set_up(self, model: nn.Module, train_data: Iterable[Any]) -> None:
        """The plan, the model on its device, the optimizer built on it, the step engine."""
        cfg, fit = self.config, self._fit
        fit.dist.check_config(cfg.to_dict())
        fit.device = device = fit.dist.place(fit.device)
        fit.train_data = fit.dist.shard_data(train_data, cfg.train.seed)
        with warnings.catch_warnings():
            # resolve_precision warns from inside the trainer; the warning below names the
            # caller's fit() instead, so the downgrade is reported once.
            warnings.simplefilter("ignore", PrecisionDowngradeWarning)
            fit.plan = plan = resolve_precision(cfg.precision, device)
        fit.downgrades = [plan.reason] if plan.reason else []
        if plan.reason:
            warnings.warn(f"precision: {plan.reason}", PrecisionDowngradeWarning, stacklevel=3)
        model, sharded_master = _held_model(model.to(device), plan, fit.dist)
        if plan.mode == "fp8":  # torchao swaps the linear layers: keep the module it returns

            model, fit.fp8_report = convert_to_fp8(model, plan.fp8_recipe, device,
                                                   skip_first_last=plan.fp8_skip_first_last)
            for line in fit.fp8_report.lines():
                log.info("precision: %s", line)
            if plan.fp8_recipe == "mxfp8":  # a batch shape MX blocks cannot take, refused before step 1
                check_mx_batch(model, fit.train_data, fit.loss_fn, autocast_context(plan, device), device)
        fit.fp32_modules = apply_fp32_modules(model, cfg.precision.fp32_modules)  # before DDP wraps it
        fit.model, forward_model = fit.dist.wrap_model(model, plan)
        fit.model.train()
        built, fit.scheduler, schedule = _optimizer_and_schedule(cfg, fit)
        fit.optimizer, fit.optimizer_kind, fit.optimizer_reason = built.optimizer, built.kind, built.reason
        if built.reason:
            log.info("optimizer: %s (%s)", built.kind, built.reason)
        fit.scaler = make_grad_scaler(plan, cfg.scaler, force=cfg.train.force_scaler)
        fit.master = None if sharded_master else master_step(fit.optimizer, plan, seed=cfg.train.seed, state=fit.state,
                                                             measure_every=cfg.train.log_interval)
        fit.dist.attach(fit.model, fit.optimizer)
        if cfg.train.compile:
            forward_model = torch.compile(forward_model)
        fit.engine = build_step_engine(
            config=cfg, sync_free=fit.sync_free, model=fit.model, forward_model=forward_model,
            optimizer=fit.optimizer, optimizer_kind=built.kind, scaler=fit.scaler, dist=fit.dist,
            loss_fn=fit.loss_fn, autocast=autocast_context(plan, device), device=device,
            state=fit.state, hooks=bind_hooks((), self, Callback), stop_requested=lambda: fit.stop_requested,
            schedule=schedule, stepper=fit.master, prepare=batch_preparer(plan))
        fit.run = RunState(config=cfg, model=fit.model, optimizer=fit.optimizer, optimizer_kind=built.kind,
                           engine=fit.engine, cursor=DataCursor(fit.train_data, fit.state),
                           plan_mode=plan.mode, user_optimizer=fit.user is not None, master=fit.master)
        fit.checkpointer = Checkpointer(cfg.checkpoint, fit.dist)

    def _seed(self) -> None:
        """Every generator from ``train.seed`` (a resume overwrites them with the saved states)."""
        seed = self.config.train.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self._fit.dist.seed(seed)

    def _resume(self, resume: str | Path | None) -> dict[str, Any] | None:
        """The checkpoint's contents restored (generators, data later): ``torchimpl.run.state`` rule 10."""
        found = self._fit.checkpointer.find(resume, self._fit.run.restore) if resume is not None else None
        if found is None:
            return None
        contents, path = found
        log.info("resumed from %s at step %d", path, self.state.step)
        return contents

    def _open(self, resumed: dict[str, Any] | None, val_data: Iterable[Any] | None) -> None:
        """The guard, the periodic parts, the trace and the metrics files, ``on_fit_start``, then
        the restored generators and data."""
        cfg, fit = self.config, self._fit
        fit.engine.scaling.materialise(fit.device)
        if cfg.train.guard:
            fit.guard = NonFiniteGuard(fit.model)
        fit.logs = LogPoints(cfg.train.log_interval)
        fit.evaluator = Evaluator(val_data, cfg.train.eval_interval, fit.guard)
        fit.clock, fit.quiet = StepClock(fit.device), quiet_steps(fit.logs, fit.evaluator, fit.checkpointer)
        fit.reporter, fit.log_dir, fit.metrics_file = open_reporter(
            self, cfg, is_main=fit.dist.is_main, resume_at=fit.state.step if resumed is not None else None,
            header=self._trace_header)
        fit.save_refused = None if resumed is None else (
            "from on_fit_start of a resumed run: its data position and random streams are restored only after "
            "on_fit_start; save from on_step_end or later")
        for cb in self.callbacks:
            checked_hook(cb.on_fit_start, lambda: fit.state)(self)
        fit.save_refused = None
        # The step hooks that do something, bound once (Callback's own are no-ops).
        fit.engine.hooks = bind_hooks(self.callbacks, self, Callback)
        if resumed is not None:
            fit.run.restore_rng_and_data(resumed)

    def _trace_header(self) -> dict[str, Any]:
        """What ``ampspec replay`` needs to judge the trace alone (``torchimpl.run.records``)."""
        cfg = self.config
        policy = self.scaler.policy if self.scaler is not None else cfg.scaler.resolved()
        return {"use_scaler": self.scaler is not None, "scaler": dataclasses.asdict(policy),
                "settings": {"microbatches": cfg.train.microbatches, "clip_norm": cfg.train.clip_norm,
                             "precision_mode": self.plan.mode, "optimizer_kind": self.optimizer_kind,
                             "sync_free": self.sync_free, "torch": torch.__version__}}

    def _loop(self) -> None:
        """Steps until done or stopped, each followed by the periodic work due after it."""
        fit = self._fit
        fit.clock.start(fit.state)
        try:
            while fit.state.step < self.config.train.steps:
                try:
                    self._one_step()
                except NonFiniteError as err:  # raised by the guard's hooks (train.guard)
                    self._guard_hit(err)
                if self._after_step():
                    break
        except StopTraining as exc:
            fit.stopped = str(exc) or "StopTraining"
        finally:
            self._log_point()
            fit.reporter.close()
            if fit.guard is not None:
                fit.guard.remove()
        fit.clock.stop()

    def _after_step(self) -> bool:
        """The log point, evaluation and checkpoint due after this step; whether to stop here."""
        fit, step = self._fit, self._fit.state.step
        if fit.quiet(step) and step < self.config.train.steps and not (fit.stop_requested or fit.interrupts.received):
            return False  # most steps: nothing is due and nothing stops
        last, interrupted = step >= self.config.train.steps, fit.interrupts.received
        val_loss = None
        eval_due = fit.evaluator.due(step, last=last)
        if eval_due:
            # Collected first: a fault the records show (sync-free) is not evaluated; the loss
            # then goes on the line of the step it follows, written just after.
            self._on_problem(fit.reporter.collect())
            if fit.fault is None:
                with fit.clock.paused():
                    val_loss = fit.evaluator.run(self.evaluate, fit.state)
        if eval_due or fit.logs.due(step, last=last, stopping=bool(fit.stop_requested or interrupted)):
            self._log_point(val_loss)
        if fit.checkpointer.due(step, last=last, interrupted=bool(interrupted)) and fit.fault is None:
            with fit.clock.paused():
                self.save_checkpoint()
        if interrupted:
            fit.stopped = f"interrupted by {interrupted} at step {step}"
        elif fit.stop_requested:
            fit.stopped = fit.stop_requested
        return bool(interrupted or fit.stop_requested)

    def _log_point(self, val_loss: float | None = None) -> None:
        self._on_problem(self._fit.reporter.flush(val_loss))

    def _on_problem(self, problem: str | None) -> None:
        if problem is not None:
            self._fit.fault = problem
            self.request_stop(problem)

    def _one_step(self) -> None:
        st, engine, cursor = self.state, self.engine, self._fit.run.cursor
        if st.window_size == 0:
            window = cursor.fetch(self.config.train.microbatches)
            st.window_size, st.window_done = len(window), 0
            engine.begin_window()
        else:  # resumed inside a window: the rest of it
            window = cursor.fetch(st.window_size - st.window_done)
        if engine.run_window(window, st.window_size) and (problem := engine.finish_step(st.window_size)):
            self._stop_on_nonfinite(window, problem)

    def _guard_hit(self, err: NonFiniteError) -> None:
        """The guard stopped a microbatch at a non-finite value: follow ``train.on_nonfinite``.

        ``stop`` writes the diagnosis and ends ``fit`` cleanly. ``skip`` counts the window's
        remaining batches as consumed and takes the step with every gradient set to NaN (on
        every rank, through the engine's all-reduced flag).
        """
        if self.engine.window is None:  # not from a microbatch's forward or backward (e.g. a callback's)
            raise err
        log.warning("step %d: %s", self.state.step, err)
        rest = self.engine.fail_window()  # rest[0] hit the guard
        if self.config.train.on_nonfinite == "stop":
            self._stop_on_nonfinite(rest, f"non-finite value ({err})")
            return
        if (problem := self.engine.skip_window(rest)) is not None:
            self._stop_on_nonfinite(rest, problem)

    def _stop_on_nonfinite(self, window: list[Any], what: str) -> None:
        """A fault: write the diagnosis of ``window``'s first batch and stop, saving nothing."""
        cfg, fit = self.config, self._fit
        folder = Path(cfg.checkpoint.folder or (Path(cfg.train.trace_file).parent if cfg.train.trace_file else "."))
        fit.diagnosis = report_nonfinite(
            folder / f"nonfinite-step{fit.state.step:08d}.json", step=fit.state.step, what=what,
            model=fit.model, batch=fit.engine.prepare(window[0], fit.device), loss_fn=fit.loss_fn, plan=fit.plan,
            optimizer=fit.optimizer, scaler=fit.scaler, dist=fit.dist)
        fit.state.window_size = fit.state.window_done = 0
        fit.fault = f"{what} at step {fit.state.step}"
        self.request_stop(fit.fault)

    def _summarise(self) -> RunSummary:
        fit, st, plan = self._fit, self._fit.state, self._fit.plan
        st.applied_steps, st.skipped_steps = fit.engine.skip.counters(st)
        summary = RunSummary(
            device=str(fit.device), precision_mode=plan.mode,
            autocast_dtype=str(plan.dtype).replace("torch.", "") if plan.autocast_enabled else None,
            use_scaler=fit.scaler is not None, downgrades=fit.downgrades, optimizer_kind=fit.optimizer_kind,
            optimizer_reason=fit.optimizer_reason, sync_free=self.sync_free, compiled=self.config.train.compile,
            steps=st.step, steps_applied=st.applied_steps, steps_skipped=st.skipped_steps,
            final_scale=fit.engine.scaling.final_scale(), **fit.clock.rates(st),
            final_train_loss=st.last_train_loss, final_val_loss=st.last_val_loss, best_val_loss=st.best_val_loss,
            stopped=fit.stopped, last_checkpoint=fit.checkpointer.last, diagnosis_report=fit.diagnosis,
            outcome=outcome(stopped=fit.stopped, fault=fit.fault is not None, interrupted=fit.interrupts.received,
                            steps_applied=st.applied_steps, final_loss=st.last_train_loss),
            fp8=fit.fp8_report.to_dict() if fit.fp8_report is not None else None,
            precision_note=plan.spelling_note,
            log_dir=str(fit.log_dir) if fit.log_dir is not None else None, metrics_file=fit.metrics_file,
            fp32_modules=fit.fp32_modules, **(fit.master.summary() if fit.master else {}))
        for cb in self.callbacks:
            checked_hook(cb.on_fit_end, lambda: fit.state)(self, summary)
        return summary
