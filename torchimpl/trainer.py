"""The trainer: the run's cadence (log, evaluate, save, stop), callbacks and the summary.

Where the rest lives:

- ``torchimpl.step``: the step engine, one optimizer step by the step contract of
  ``reference/step.py`` (the window of microbatches, unscale, check, clip, step or skip,
  update, schedule, the record), its loss scaling and its skip decision;
- ``torchimpl.run_state``: the counters, the data cursor, and what a checkpoint holds and how
  a run is restored from it;
- ``torchimpl.records``: the step record, read from the device at log points, and the trace;
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
import math
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from torchimpl.batches import to_device
from torchimpl.checkpoint import (
    CheckpointError,
    check_loadable,
    checkpoint_name,
    list_checkpoints,
    prune_checkpoints,
    remove_stale_temporaries,
)
from torchimpl.config import Config, ScheduleConfig
from torchimpl.device import resolve_device
from torchimpl.diagnostics import NonFiniteError, report_nonfinite
from torchimpl.distributed import init_distributed
from torchimpl.optim import BuiltOptimizer, OptimizerConfig, adopt_optimizer, build_optimizer
from torchimpl.precision import PrecisionDowngradeWarning, autocast_context, resolve_precision
from torchimpl.lifecycle import Interrupts, outcome, preflight
from torchimpl.loss_protocol import default_loss_fn
from torchimpl.records import StepRecord, TraceWriter
from torchimpl.fp32_modules import apply_fp32_modules
from torchimpl.precision_stats import precision_stats_callbacks
from torchimpl.metrics import CsvMetrics, open_metrics, open_run_folder
from torchimpl.reporting import Reporter, progress_mode
from torchimpl.run_state import DataCursor, RunState, TrainState, check_contents
from torchimpl.scaler import make_grad_scaler
from torchimpl.schedule import AppliedStepSchedule, UserSchedule, adopt_scheduler
from torchimpl.step import StepEngine, bind_hooks, build_step_engine, choose_sync_free

__all__ = ["Callback", "RunSummary", "StopTraining", "Trainer", "TrainState", "default_loss_fn"]

log = logging.getLogger(__name__)


class StopTraining(Exception):
    """Raise from a callback to end ``fit`` cleanly after the current hook."""


class Callback:
    """Hooks called by :class:`Trainer`; override the ones you need.

    Gradients seen by the hooks: ``on_after_backward`` gets the **scaled** gradients of the
    whole window (before unscale); ``on_before_optimizer_step`` the unscaled, clipped ones.
    """

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_microbatch_end(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_after_backward(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_before_optimizer_step(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_step_end(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_log(self, trainer: Trainer, state: TrainState, records: list[StepRecord],
               losses: list[float]) -> None: ...

    def on_fit_end(self, trainer: Trainer, summary: RunSummary) -> None: ...


@dataclass
class RunSummary:
    """What a ``fit`` did, for people and for ``report.json``."""

    device: str
    precision_mode: str
    autocast_dtype: str | None
    use_scaler: bool
    downgrades: list[str]
    optimizer_kind: str
    optimizer_reason: str | None
    sync_free: bool
    compiled: bool
    steps: int
    steps_applied: int
    steps_skipped: int
    final_scale: float | None
    time_per_step_s: float
    samples_per_s: float
    peak_memory_bytes: int | None
    final_train_loss: float | None
    final_val_loss: float | None
    best_val_loss: float | None
    stopped: str | None = None
    last_checkpoint: str | None = None
    diagnosis_report: str | None = None
    outcome: str = "completed"
    """How the run ended (``torchimpl.lifecycle``): completed, stopped, failed, no_progress,
    interrupted:SIGINT or interrupted:SIGTERM."""
    fp8: dict[str, Any] | None = None
    """With ``precision.mode: fp8``: the recipe, what runs where, the converted layers and those
    kept in high precision with the reason for each."""
    precision_note: str | None = None
    """What the precision's spelling means when it was given as another library writes it
    (``'16-mixed' (Lightning) means fp16 autocast ... with a dynamic loss scaler``)."""
    log_dir: str | None = None
    """The run folder holding the metrics files (``logging.dir``), or None when none was written."""
    metrics_file: str | None = None
    """The run's ``metrics.csv`` (``torchimpl.metrics``), or None without one."""
    fp32_modules: list[str] = dataclasses.field(default_factory=list)
    """The modules run in fp32 islands (``precision.fp32_modules``)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values, valid JSON: a non-finite number becomes None."""
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in dataclasses.asdict(self).items()}


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
        # One callback where a sequence belongs is what the user means.
        self.callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks)
        self.callbacks += precision_stats_callbacks(self.config)  # logging.precision_stats
        self._stop_requested: str | None = None
        self._reporter: Reporter | None = None

    # ------------------------------------------------------------------ public helpers

    found_inf = property(lambda self: self.engine.found_inf)
    grad_norm = property(lambda self: self.engine.grad_norm)
    sync_free = property(lambda self: self.engine.skip.sync_free)
    schedule = property(lambda self: self.engine.skip.schedule)
    params = property(lambda self: self.engine.params)
    loss_history = property(lambda self: self._reporter.loss_history if self._reporter else [])
    scale_history = property(lambda self: self._reporter.scale_history if self._reporter else [])

    def request_stop(self, reason: str = "requested") -> None:
        """End ``fit`` after the current hook returns (callable from any callback)."""
        self._stop_requested = reason

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Save now: between steps, inside an accumulation window, or after its last backward
        (from ``on_microbatch_end``, ``on_after_backward``, ``on_step_end``, ``on_log``,
        ``on_fit_end``); every such checkpoint resumes bit for bit. The records pending on the
        device are flushed first, so that the trace holds every step before the checkpoint's."""
        refused = self._save_refused or self.engine.save_refused
        if refused is not None:
            raise RuntimeError(f"save_checkpoint() cannot be called {refused}")
        folder = self.config.checkpoint.folder
        if path is None and folder is None:
            raise ValueError("no path given and checkpoint.folder is not set")
        self._log_point()
        if self._fault is not None:
            raise RuntimeError(f"save_checkpoint(): not saved, the run is stopping on a fault: {self._fault}")
        if path is None:
            path = Path(folder) / checkpoint_name(self.state.step, self.state.window_done)
        written = self._dist.save_checkpoint(self._run.contents(), Path(path))
        self._last_checkpoint = str(written)
        log.info("saved checkpoint %s", written)
        if folder is not None and Path(written).parent == Path(folder) and self._dist.is_main:
            prune_checkpoints(folder, self.config.checkpoint.keep_last)
        return written

    @torch.no_grad()
    def evaluate(self, val_data: Iterable[Any]) -> float:
        """Mean loss over ``val_data`` under the run's autocast; one host read at the end."""
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for batch in val_data:
            with autocast_context(self.plan, self.device):
                loss = self.loss_fn(self.engine.model, to_device(batch, self.device))
            total += loss.detach().to(torch.float64)
            count += 1
        self.model.train(was_training)
        if count == 0:
            raise ValueError("val_data yielded no batches")
        return float(total.item()) / count

    # ------------------------------------------------------------------ the run

    def fit(self, model: nn.Module, train_data: Iterable[Any], val_data: Iterable[Any] | None = None, *,
            loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
            resume: str | Path | None = None, optimizer: Any = None, scheduler: Any = None) -> RunSummary:
        """Train for ``train.steps`` optimizer steps (counting skipped ones) and summarise.

        ``resume``: a checkpoint path, or ``"latest"`` for the newest usable checkpoint in
        ``checkpoint.folder`` (see ``torchimpl.run_state`` for what may change on a resume).
        SIGINT and SIGTERM stop the run at the next step boundary (see ``torchimpl.lifecycle``).

        ``optimizer``: your own ``torch.optim.Optimizer`` over ``model.parameters()``, or a
        function ``params -> Optimizer`` (called once the model is on its device; needed with
        ``train.distributed=fsdp2``, which replaces the parameters); the configuration's
        ``optimizer`` and ``schedule`` sections are then not used. ``scheduler``: your
        ``torch.optim.lr_scheduler.LRScheduler`` on that optimizer (or ``optimizer -> LRScheduler``),
        stepped after each applied step only; without one the optimizer's rates stay as built.
        Both states are checkpointed and resumed with the run (rule 5 of ``torchimpl.optim``,
        rule 4 of ``torchimpl.schedule``).
        """
        cfg = self.config
        if scheduler is not None and optimizer is None:
            raise ValueError("scheduler= needs the optimizer it drives: pass optimizer= too")
        if isinstance(optimizer, torch.optim.Optimizer) and cfg.train.distributed == "fsdp2":
            raise ValueError("train.distributed=fsdp2 replaces the model's parameters with sharded ones, so an "
                             "optimizer built before fit would update the old ones: pass a function "
                             "params -> Optimizer instead (e.g. optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))")
        self._user = (optimizer, scheduler) if optimizer is not None else None
        self._stop_requested = self._last_checkpoint = self._diagnosis = self._fault = None
        self._save_refused: str | None = "before fit has set the run up"
        self.loss_fn = loss_fn or default_loss_fn
        self.device = resolve_device(cfg.device)
        # Multi-process hooks (torchimpl.distributed); identities with train.distributed=none.
        self._dist = init_distributed(cfg.train.distributed, device=self.device,
                                      timeout_s=cfg.train.distributed_timeout_s)
        try:
            preflight(cfg, val_data, is_main=self._dist.is_main)
            self._set_up(model, train_data)
            self._seed()
            resumed = self._resume(resume)
            if cfg.checkpoint.folder is not None and self._dist.is_main:  # only once the run is accepted
                remove_stale_temporaries(cfg.checkpoint.folder)
            guard = self._open(resumed)
            with Interrupts() as self._interrupts:
                stopped, elapsed = self._loop(val_data, guard)
            return self._summarise(stopped, elapsed)
        finally:
            self._dist.close()

    def _set_up(self, model: nn.Module, train_data: Iterable[Any]) -> None:
        """The plan, the model on its device, the optimizer built on it, the step engine."""
        cfg = self.config
        self._dist.check_config(cfg.to_dict())
        self.device = self._dist.place(self.device)
        self.train_data = self._dist.shard_data(train_data, cfg.train.seed)
        with warnings.catch_warnings():
            # resolve_precision warns from inside the trainer; the warning below names the
            # caller's fit() instead, so the downgrade is reported once.
            warnings.simplefilter("ignore", PrecisionDowngradeWarning)
            self.plan = resolve_precision(cfg.precision, self.device)
        self._downgrades = [self.plan.reason] if self.plan.reason else []
        if self.plan.reason:
            warnings.warn(f"precision: {self.plan.reason}", PrecisionDowngradeWarning, stacklevel=3)
        model = model.to(self.device)
        self.fp8_report = None
        if self.plan.mode == "fp8":  # torchao swaps the linear layers: keep the module it returns
            from torchimpl.fp8 import convert_to_fp8

            model, self.fp8_report = convert_to_fp8(model, self.plan.fp8_recipe, self.device,
                                                    skip_first_last=self.plan.fp8_skip_first_last)
            for line in self.fp8_report.lines():
                log.info("precision: %s", line)
        self.fp32_modules = apply_fp32_modules(model, cfg.precision.fp32_modules)  # before DDP wraps it
        self.model, forward_model = self._dist.wrap_model(model, self.plan)
        self.model.train()
        built, self.scheduler, schedule = self._optimizer_and_schedule()
        self.optimizer, self.optimizer_kind, self._optimizer_reason = built.optimizer, built.kind, built.reason
        if built.reason:
            log.info("optimizer: %s (%s)", built.kind, built.reason)
        self.scaler = make_grad_scaler(self.plan, cfg.scaler, force=cfg.train.force_scaler)
        self.state = TrainState()
        self._dist.attach(self.model, self.optimizer)
        if cfg.train.compile:
            forward_model = torch.compile(forward_model)
        self.engine: StepEngine = build_step_engine(
            config=cfg, sync_free=self._sync_free, model=self.model, forward_model=forward_model,
            optimizer=self.optimizer, optimizer_kind=built.kind, scaler=self.scaler, dist=self._dist,
            loss_fn=self.loss_fn, autocast=autocast_context(self.plan, self.device), device=self.device,
            state=self.state, hooks=bind_hooks((), self, Callback), stop_requested=lambda: self._stop_requested,
            schedule=schedule)
        self._run = RunState(config=cfg, model=self.model, optimizer=self.optimizer, optimizer_kind=built.kind,
                             engine=self.engine, cursor=DataCursor(self.train_data, self.state),
                             plan_mode=self.plan.mode, user_optimizer=self._user is not None)

    def _optimizer_and_schedule(self) -> tuple[BuiltOptimizer, Any, Any]:
        """The optimizer (the configuration's, built after the move so that the fused probe sees
        the real parameters, or the user's, checked), the user's scheduler, and the schedule the
        engine runs (``None``: the configuration's), with the sync-free decision they allow."""
        cfg = self.config
        if self._user is None:
            built = build_optimizer(self.model, cfg.optimizer, self.device)
            scheduler = schedule = None
        else:
            built = adopt_optimizer(self.model, self._user[0], self.device)
            scheduler = adopt_scheduler(built.optimizer, self._user[1])
            check_loadable(built.optimizer.state_dict(), "the optimizer")
            if scheduler is not None:
                check_loadable(scheduler.state_dict(), "the scheduler")
            unused = [name for name, default in (("optimizer", OptimizerConfig()), ("schedule", ScheduleConfig()))
                      if getattr(cfg, name) != default]
            if unused:
                warnings.warn(f"the configuration's {' and '.join(unused)} section{'s are' if len(unused) > 1 else ' is'} "
                              f"not used: fit() was given your optimizer{' and scheduler' if scheduler else ''}",
                              stacklevel=4)
        self._sync_free, why = choose_sync_free(cfg.train.sync_free, built.kind, built.optimizer, scheduler=scheduler)
        if why:
            self._downgrades.append(why)
            warnings.warn(why, stacklevel=4)
        if self._user is not None:
            # The sync-free mode tabulates its rates on the host: a constant one for your optimizer.
            schedule = (AppliedStepSchedule(built.optimizer, ScheduleConfig(name="constant"), cfg.train.steps)
                        if self._sync_free else UserSchedule(built.optimizer, scheduler))
        return built, scheduler, schedule

    def _seed(self) -> None:
        """Every generator from ``train.seed`` (a resume overwrites them with the saved states)."""
        seed = self.config.train.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self._dist.seed(seed)

    def _resume(self, resume: str | Path | None) -> dict[str, Any] | None:
        """The checkpoint's contents restored into the run (generators and data come later):
        rule 10 of ``torchimpl.run_state``."""
        if resume is None:
            return None
        folder = self.config.checkpoint.folder
        if str(resume) != "latest":
            paths = [Path(resume)]
        elif folder is None:
            raise ValueError("resume='latest' needs checkpoint.folder")
        else:
            paths = list_checkpoints(folder)[::-1]
            if not paths:
                log.warning("no checkpoint in %s to resume from; starting a fresh run", folder)
                return None
        rejected = []
        for path in paths:
            try:
                contents = self._dist.load_checkpoint(path)
                check_contents(contents, path)
                # Inside the try: a checkpoint that fails to restore is passed over like a damaged one
                # (the next one's restore overwrites all that this one set).
                self._run.restore(contents, path)
            except CheckpointError as exc:
                if len(paths) == 1 and str(resume) != "latest":
                    raise
                rejected.append(str(exc))
                warnings.warn(f"passing over {path}: it cannot be resumed from ({exc})", stacklevel=3)
                continue
            log.info("resumed from %s at step %d", path, self.state.step)
            return contents
        raise CheckpointError(f"none of the {len(paths)} checkpoints in {folder} can be resumed from, so the run is "
                              f"refused and nothing in the folder was changed: {'; '.join(rejected)}. Move the "
                              "damaged files away to start afresh, or resume from a good copy")

    def _open(self, resumed: dict[str, Any] | None) -> Any:
        """The guard, the trace and the metrics files, ``on_fit_start``, then the restored
        generators and data."""
        cfg, st = self.config, self.state
        self.engine.scaling.materialise(self.device)
        guard = None
        if cfg.train.guard:
            from torchimpl.diagnostics import NonFiniteGuard

            guard = NonFiniteGuard(self.model)
        writer, sinks, self._log_dir = None, [], None
        resume_at = st.step if resumed is not None else None
        if cfg.train.trace_file and self._dist.is_main:
            writer = TraceWriter(cfg.train.trace_file, resume_at=resume_at, header=self._trace_header())
            if resumed is not None and writer.kept < st.step:
                log.warning("trace %s holds %d of the %d steps before the resumed step %d (it was not written by "
                            "the runs before); it continues from step %d", cfg.train.trace_file, writer.kept,
                            st.step, st.step, st.step)
        if self._dist.is_main:
            self._log_dir = open_run_folder(cfg)
            sinks = open_metrics(cfg, self._log_dir, resume_at=resume_at)
            csv = next((s for s in sinks if isinstance(s, CsvMetrics)), None)
            if resumed is not None and csv is not None and csv.kept < st.step:
                log.warning("metrics file %s holds %d of the %d steps before the resumed step %d; it continues "
                            "from step %d", csv.path, csv.kept, st.step, st.step, st.step)
        self._metrics_file = next((str(s.path) for s in sinks if isinstance(s, CsvMetrics)), None)
        self._reporter = Reporter(self, writer, metrics=sinks,
                                  progress=progress_mode(cfg.logging.progress, is_main=self._dist.is_main))
        self._save_refused = None if resumed is None else (
            "from on_fit_start of a resumed run: its data position and random streams are restored only after "
            "on_fit_start; save from on_step_end or later")
        for cb in self.callbacks:
            cb.on_fit_start(self)
        self._save_refused = None
        # The step hooks that do something, bound once (Callback's own are no-ops).
        self.engine.hooks = bind_hooks(self.callbacks, self, Callback)
        if resumed is not None:
            self._run.restore_rng_and_data(resumed)
        return guard

    def _trace_header(self) -> dict[str, Any]:
        """What ``ampspec replay`` needs to judge the trace alone (``torchimpl.records``)."""
        cfg = self.config
        policy = self.scaler.policy if self.scaler is not None else cfg.scaler.resolved()
        return {"use_scaler": self.scaler is not None, "scaler": dataclasses.asdict(policy),
                "settings": {"microbatches": cfg.train.microbatches, "clip_norm": cfg.train.clip_norm,
                             "precision_mode": self.plan.mode, "optimizer_kind": self.optimizer_kind,
                             "sync_free": self.sync_free, "torch": torch.__version__}}

    def _loop(self, val_data: Iterable[Any] | None, guard: Any) -> tuple[str | None, float]:
        """Steps until done or stopped, with log points, evaluations and checkpoints at their
        intervals; the stop reason and the step time (evaluation and saving left out)."""
        cfg, st = self.config, self.state
        self._start = (st.step, st.samples)
        t0, excluded, stopped = time.perf_counter(), 0.0, None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        steps, log_interval = cfg.train.steps, cfg.train.log_interval
        # None without val_data/checkpoint.folder, 0 for "at the end only".
        ei = cfg.train.eval_interval if val_data is not None else None
        ci = cfg.checkpoint.interval if cfg.checkpoint.folder is not None else None
        try:
            while st.step < steps:
                try:
                    self._one_step()
                except NonFiniteError as err:  # raised by the guard's hooks (train.guard)
                    self._guard_hit(err)
                step, last = st.step, st.step >= steps
                interrupted = self._interrupts.received
                log_due = step % log_interval == 0 or last or self._stop_requested or interrupted
                eval_due = ei is not None and ((ei and step % ei == 0) or last)
                save_due = ci is not None and ((ci and step % ci == 0) or last or interrupted)
                val_loss = None
                if eval_due:
                    # Collected first: a fault the records show (sync-free) is not evaluated; the
                    # loss then goes on the line of the step it follows, written just after.
                    self._collect()
                    if self._fault is None:
                        te = time.perf_counter()
                        val_loss = self._evaluate(val_data, guard)
                        excluded += time.perf_counter() - te
                if log_due or eval_due:
                    self._log_point(val_loss)
                if save_due and self._fault is None:
                    te = time.perf_counter()
                    self.save_checkpoint()
                    excluded += time.perf_counter() - te
                if interrupted:
                    stopped = f"interrupted by {interrupted} at step {step}"
                    break
                if self._stop_requested:
                    stopped = self._stop_requested
                    break
        except StopTraining as exc:
            stopped = str(exc) or "StopTraining"
        finally:
            self._log_point()
            self._reporter.close()
            if guard is not None:
                guard.remove()
        return stopped, time.perf_counter() - t0 - excluded

    def _log_point(self, val_loss: float | None = None) -> None:
        self._on_problem(self._reporter.flush(val_loss))

    def _collect(self) -> None:
        self._on_problem(self._reporter.collect())

    def _on_problem(self, problem: str | None) -> None:
        if problem is not None:
            self._fault = problem
            self.request_stop(problem)

    def _one_step(self) -> None:
        st, engine = self.state, self.engine
        if st.window_size == 0:
            window = self._run.cursor.fetch(self.config.train.microbatches)
            st.window_size, st.window_done = len(window), 0
            engine.begin_window()
        else:  # resumed inside a window: the rest of it
            window = self._run.cursor.fetch(st.window_size - st.window_done)
        if engine.run_window(window, st.window_size):
            self._handle(engine.finish_step(st.window_size), window)

    def _handle(self, problem: str | None, window: list[Any]) -> None:
        if problem is not None:
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
        self._handle(self.engine.skip_window(rest), rest)

    def _stop_on_nonfinite(self, window: list[Any], what: str) -> None:
        """A fault: write the diagnosis of ``window``'s first batch and stop, saving nothing."""
        cfg = self.config
        folder = Path(cfg.checkpoint.folder or (Path(cfg.train.trace_file).parent if cfg.train.trace_file else "."))
        self._diagnosis = report_nonfinite(
            folder / f"nonfinite-step{self.state.step:08d}.json", step=self.state.step, what=what,
            model=self.model, batch=to_device(window[0], self.device), loss_fn=self.loss_fn, plan=self.plan,
            optimizer=self.optimizer, scaler=self.scaler, dist=self._dist)
        self.state.window_size = self.state.window_done = 0
        self._fault = f"{what} at step {self.state.step}"
        self.request_stop(self._fault)

    def _evaluate(self, val_data: Iterable[Any], guard: Any) -> float:
        # The guard watches training steps; a non-finite validation loss is recorded as is.
        if guard is not None:
            guard.remove()
        try:
            value = self.evaluate(val_data)
        finally:
            if guard is not None:
                guard.install()
        st = self.state
        st.last_val_loss = value
        if math.isfinite(value) and (st.best_val_loss is None or value < st.best_val_loss):
            st.best_val_loss = value
        return value

    def _summarise(self, stopped: str | None, elapsed: float) -> RunSummary:
        st, plan = self.state, self.plan
        st.applied_steps, st.skipped_steps = self.engine.skip.counters(st)
        start_step, start_samples = self._start
        summary = RunSummary(
            device=str(self.device), precision_mode=plan.mode,
            autocast_dtype=str(plan.dtype).replace("torch.", "") if plan.autocast_enabled else None,
            use_scaler=self.scaler is not None, downgrades=self._downgrades, optimizer_kind=self.optimizer_kind,
            optimizer_reason=self._optimizer_reason, sync_free=self.sync_free, compiled=self.config.train.compile,
            steps=st.step, steps_applied=st.applied_steps, steps_skipped=st.skipped_steps,
            final_scale=self.engine.scaling.final_scale(),
            time_per_step_s=elapsed / max(st.step - start_step, 1),
            samples_per_s=(st.samples - start_samples) / elapsed if elapsed > 0 else 0.0,
            peak_memory_bytes=int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None,
            final_train_loss=st.last_train_loss, final_val_loss=st.last_val_loss, best_val_loss=st.best_val_loss,
            stopped=stopped, last_checkpoint=self._last_checkpoint, diagnosis_report=self._diagnosis,
            outcome=outcome(stopped=stopped, fault=self._fault is not None, interrupted=self._interrupts.received,
                            steps_applied=st.applied_steps, final_loss=st.last_train_loss),
            fp8=self.fp8_report.to_dict() if self.fp8_report is not None else None,
            precision_note=plan.spelling_note,
            log_dir=str(self._log_dir) if self._log_dir is not None else None, metrics_file=self._metrics_file,
            fp32_modules=self.fp32_modules,
        )
        for cb in self.callbacks:
            cb.on_fit_end(self, summary)
        return summary
