"""The run's state: its counters, the data cursor, and what a checkpoint holds.

A checkpoint (format 1) holds everything that the rest of the run depends on, so that a run
resumed from it is, on the CPU, bit for bit the run that never stopped:

1. the model's state and its signature (parameter names and shapes), checked before loading;
2. the optimizer's state and its kind (a different kind resumes with a warning: fused and
   for-loop updates differ in the last bits);
3. the schedule: its base rates and the count of applied steps;
4. the loss scaler's state (``None`` without one);
5. the counters (:class:`TrainState`);
6. inside an accumulation window, the window's accumulated gradients and loss sum;
7. every random generator's state, restored last;
8. the data position (:class:`DataCursor`): the epoch, the batches of it consumed, and for a
   source without ``iter_from`` the torch generator state its shuffle was drawn from;
9. the configuration and the versions of torch and ampspec.

Resuming (the lifecycle contract). For any sequence of runs, kills at any instant, resumes and
allowed configuration changes, the final model, optimizer, scaler, counters and trace equal the
uninterrupted run's bit for bit on the CPU; anything else is refused before it trains, naming
the fix; a checkpoint that verified is never lost or overwritten by a refused run:

10. ``resume="latest"`` takes the newest checkpoint in the folder that verifies and holds every
    field above (:func:`check_contents`); a damaged or malformed newer one is named in a warning
    and passed over. When the folder holds checkpoints and none can be used, the run is refused
    (``CheckpointError`` naming each file and why), and nothing in the folder is touched. An
    empty folder starts a fresh run, with a warning.
11. Configuration changes between the saving run and the resuming one (:func:`config_changes`):
    the cadence of the run (``train.steps``, the log, evaluation and checkpoint intervals and
    folder, the trace file, the ``logging`` section, the guard, ``compile``, ``on_nonfinite``,
    timeouts) may change freely;
    hyperparameters (the optimizer's ``lr``, ``betas``, ``eps``, ``weight_decay``, ``momentum``,
    ``nesterov``, the schedule, ``train.clip_norm``, the scaler's growth and backoff factors and
    interval, the microbatches per step, the device) take the configuration's value from the
    resumed step on, each change named in a warning with both values; what defines the run
    (the task, the precision, the optimizer's name, kind and parameter groups, the scaler's
    preset and its bounds, the distributed mode, and the microbatches of a checkpoint inside a
    window) is refused with a ``ResumeError`` listing every difference. The model must match
    the checkpoint's parameter names, shapes and dtypes.
12. A user's own optimizer and scheduler (``Trainer.fit(optimizer=..., scheduler=...)``): the
    checkpoint records their classes, and a resume with another class, or with the
    configuration's optimizer where the user's was saved (or the reverse), is refused. Their
    states are restored as torch's ``load_state_dict`` does, hyperparameters included: resuming
    continues the saved run, so a value in the freshly built optimizer that differs from the
    saved one is named in a warning and the saved one is kept. The configuration's
    ``optimizer`` and ``schedule`` sections, unused with a user's optimizer, are not compared.
13. Under ``precision.mode`` bf16-true or fp16-true, the optimizer's entry is the master-weight
    option's state (its master copy, compensation buffer or generator, and the optimizer's state
    in the dtype the option keeps it in), and ``lost_updates`` the run's counts so far; a resume
    with another ``precision.master_weights`` is refused by rule 11 (it is part of the precision).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import warnings
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

import torchimpl
from torchimpl.config.schema import Config
from torchimpl.run.checkpoint import CheckpointError, capture_rng_state, qualified_name, restore_rng_state

__all__ = ["CHECKPOINT_FORMAT", "DataCursor", "ResumeError", "RunState", "TrainState", "check_contents",
           "config_changes", "model_problems"]

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1


class ResumeError(ValueError):
    """A resume refused because the configuration or the model differs from the checkpoint's in
    what defines the run (rule 11)."""


# Rule 10: what a checkpoint must hold, and of which type.
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "format": int, "config": dict, "model": dict, "model_signature": dict, "optimizer": dict, "schedule": dict,
    "trainer": dict, "rng": dict, "data": dict, "scaler": (dict, type(None)), "accumulation": (dict, type(None)),
}


def check_contents(ckpt: Any, path: Path) -> None:
    """Rule 10: ``CheckpointError`` naming what is missing or malformed in ``ckpt``."""
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path} does not hold a checkpoint mapping")
    problems = [f"{key!r} is missing" if key not in ckpt else
                f"{key!r} is a {type(ckpt[key]).__name__}" for key, kind in _REQUIRED.items()
                if key not in ckpt or not isinstance(ckpt[key], kind)]
    if not problems:
        missing = [k for k in ("step", "applied_steps", "window_size", "window_done") if k not in ckpt["trainer"]]
        problems += [f"'trainer' lacks {missing}"] if missing else []
    if not problems:
        problems += _counter_problems(ckpt["trainer"]) + _stream_problems(ckpt["rng"], ckpt["data"])
        problems += model_problems(ckpt["model"], ckpt["model_signature"])
    if problems:
        raise CheckpointError(f"{path} is malformed: {'; '.join(problems)}")


def _counter_problems(trainer: dict[str, Any]) -> list[str]:
    """The counters are non-negative integers (a callback may have set them to anything)."""
    names = ("step", "applied_steps", "skipped_steps", "epoch", "batch_index", "samples", "window_size", "window_done")
    return [f"'trainer.{k}' is {trainer[k]!r}, not an integer >= 0" for k in names
            if k in trainer and (isinstance(trainer[k], bool) or not isinstance(trainer[k], int) or trainer[k] < 0)]


def _stream_problems(rng: dict[str, Any], data: dict[str, Any]) -> list[str]:
    """Rules 7-8 checked before anything is restored: each generator state is set on a
    throwaway generator, so a malformed one is named here rather than failing mid-restore."""
    checks = {
        "rng.python": lambda v: random.Random().setstate((int(v[0]), tuple(int(x) for x in v[1].tolist()), v[2])),
        "rng.numpy": lambda v: np.random.RandomState().set_state((v[0], v[1].numpy().astype(np.uint32), *v[2:])),
        "rng.torch": lambda v: torch.Generator().set_state(v),
        "data.epoch_rng": lambda v: v is None or torch.Generator().set_state(v),
    }
    values = {"rng.python": rng.get("python"), "rng.numpy": rng.get("numpy"), "rng.torch": rng.get("torch"),
              "data.epoch_rng": data.get("epoch_rng")}
    problems = []
    for name, check in checks.items():
        try:
            check(values[name])
        except Exception as exc:  # noqa: BLE001 - any failure means the saved state cannot be restored
            problems.append(f"'{name}' cannot be restored ({type(exc).__name__}: {str(exc)[:120]})")
    for key in ("epoch", "index"):
        v = data.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            problems.append(f"'data.{key}' is {v!r}, not an integer >= 0")
    return problems


def model_problems(model: Any, signature: Any) -> list[str]:
    """Rule 1's signature must describe the tensors actually saved (a checksum proves only
    that the bytes are the ones written, not that they fit)."""
    if not isinstance(model, dict) or not isinstance(signature, dict):
        return ["'model' or 'model_signature' is missing or not a mapping"]
    actual = {k: list(v.shape) for k, v in model.items() if isinstance(v, torch.Tensor)}
    wrong = sorted(k for k in actual if k in signature and list(signature[k]) != actual[k])
    if wrong or set(actual) != set(signature):
        return [f"its model tensors do not match its own signature (shapes of {wrong[:5]}, names "
                f"{sorted(set(actual) ^ set(signature))[:5]})"]
    return []


# Rule 11, by dotted configuration key (a section name covers its keys).
_FREE = ("train.steps", "train.log_interval", "train.eval_interval", "train.trace_file", "train.guard",
         "train.compile", "train.on_nonfinite", "train.distributed_timeout_s", "train.threads", "checkpoint", "logging")
_REFUSED = ("task", "precision", "optimizer.name", "optimizer.fused", "optimizer.foreach",
            "optimizer.no_decay_bias_and_norm", "scaler.preset", "scaler.hysteresis", "scaler.min_scale",
            "scaler.max_scale", "scaler.raise_at_min_scale", "scaler.consecutive_hysteresis", "train.distributed")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _covered(key: str, names: tuple[str, ...]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def config_changes(saved: dict[str, Any], now: dict[str, Any], *, mid_window: bool,
                   user_optimizer: bool = False) -> tuple[list[str], list[str]]:
    """Rule 11: the refused differences and the applied ones, each as ``"key: old -> new"``
    (rule 12: without the unused optimizer and schedule sections when ``user_optimizer``)."""
    old, new = _flatten(saved), _flatten(now)
    for key, default in _flatten(Config().to_dict()).items():
        old.setdefault(key, default)  # a field added since the checkpoint was written: its default
    refused, applied = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b or _covered(key, _FREE) or (user_optimizer and _covered(key, ("optimizer", "schedule"))):
            continue
        line = f"{key}: {a!r} (checkpoint) -> {b!r} (now)"
        if _covered(key, _REFUSED) or (mid_window and key == "train.microbatches"):
            refused.append(line)
        else:
            applied.append(line)
    return refused, applied


@dataclass
class TrainState:
    """Counters of a run; everything here is saved in a checkpoint."""

    step: int = 0
    """Optimizer steps attempted (applied or skipped)."""
    applied_steps: int = 0
    """Optimizer steps applied; drives the learning-rate schedule (read at log points in
    the sync-free mode)."""
    skipped_steps: int = 0
    epoch: int = 0
    batch_index: int = 0
    """Batches of the current epoch consumed by finished microbatches."""
    samples: int = 0
    window_size: int = 0
    """Microbatches in the current accumulation window (0 between steps)."""
    window_done: int = 0
    """Microbatches of the current window already backpropagated."""
    best_val_loss: float | None = None
    last_val_loss: float | None = None
    last_train_loss: float | None = None


class DataCursor:
    """Where the run is in its training data: epochs of batches, windows that never cross an
    epoch, and a position a checkpoint can restore.

    A source with ``iter_from(epoch, index)`` is reopened there. Any other re-iterable source
    (a list, a DataLoader) is reopened from its start and advanced; a DataLoader draws its
    shuffle seed from torch's generator when iterated, so the cursor keeps the state it
    started each epoch from and replays it on a resume.
    """

    def __init__(self, data: Any, state: TrainState):
        self.data, self.state = data, state
        self._it: Iterator[Any] | None = None
        self._epoch_rng: torch.Tensor | None = None

    def _open_epoch(self, index: int = 0) -> None:
        data = self.data
        if hasattr(data, "iter_from"):
            self._epoch_rng = None
            self._it = iter(data.iter_from(self.state.epoch, index))
            return
        self._epoch_rng = torch.get_rng_state()
        for target in (data, getattr(data, "sampler", None), getattr(data, "batch_sampler", None)):
            if hasattr(target, "set_epoch"):
                target.set_epoch(self.state.epoch)
        self._it = iter(data)
        for _ in range(index):
            next(self._it)

    def fetch(self, n: int) -> list[Any]:
        """Up to ``n`` batches; fewer at the end of an epoch."""
        batches: list[Any] = []
        while len(batches) < n:
            if self._it is None:
                self._open_epoch()
            try:
                batches.append(next(self._it))
            except StopIteration:
                if batches:
                    break
                if self.state.batch_index == 0:
                    raise ValueError(
                        f"train_data yielded no batches in epoch {self.state.epoch}; pass a re-iterable "
                        "source (a list, a DataLoader), not a one-shot generator"
                    ) from None
                self._it = None
                self.state.epoch += 1
                self.state.batch_index = 0
        return batches

    def state_dict(self) -> dict[str, Any]:
        st = self.state
        return {"epoch": st.epoch, "index": st.batch_index, "epoch_rng": self._epoch_rng,
                "started": self._it is not None}

    def load_state_dict(self, data_state: dict[str, Any]) -> None:
        self.state.epoch = int(data_state["epoch"])
        index = int(data_state["index"])
        if not data_state.get("started", True):
            self._it = None
            return
        if hasattr(self.data, "iter_from"):
            self._open_epoch(index)
            return
        saved = data_state.get("epoch_rng")
        current = torch.get_rng_state()
        if saved is not None:
            torch.set_rng_state(saved)
        self._open_epoch(index)
        torch.set_rng_state(current)


class RunState:
    """Builds a checkpoint's contents from the live run and restores a run from one."""

    def __init__(self, *, config: Any, model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_kind: str,
                 engine: Any, cursor: DataCursor, plan_mode: str, user_optimizer: bool = False, master: Any = None):
        self.config, self.model, self.optimizer, self.optimizer_kind = config, model, optimizer, optimizer_kind
        self.engine, self.cursor, self.plan_mode = engine, cursor, plan_mode
        self.user_optimizer = user_optimizer
        # Under a *-true plan (rule 13): the master-weight option's step, whose state holds the optimizer's.
        self.master = master

    def optimizer_source(self) -> dict[str, Any]:
        """Rule 12: whose optimizer and scheduler run, by class."""
        sched = getattr(self.engine.skip.schedule, "scheduler", None)
        return {"user": self.user_optimizer, "optimizer": qualified_name(self.optimizer),
                "scheduler": None if sched is None else qualified_name(sched)}

    @property
    def state(self) -> TrainState:
        return self.cursor.state

    def contents(self) -> dict[str, Any]:
        engine, st = self.engine, self.state
        applied, skipped = engine.skip.counters(st)
        # The sync-free device count includes steps whose records are not flushed yet: saved,
        # but the live counters are left to the flushes, which count every record once.
        st = dataclasses.replace(st, applied_steps=applied, skipped_steps=skipped)
        model_state = self.model.state_dict()
        return {
            "format": CHECKPOINT_FORMAT,
            "versions": {"torch": str(torch.__version__), "ampspec": ampspec_version()},
            "config": self.config.to_dict(),
            "model": model_state,
            "model_signature": {k: list(v.shape) for k, v in model_state.items()},
            "optimizer": self.optimizer.state_dict() if self.master is None else self.master.master.state_dict(),
            "lost_updates": None if self.master is None else self.master.state_dict(),
            "optimizer_kind": self.optimizer_kind,
            "optimizer_source": self.optimizer_source(),
            "schedule": engine.skip.schedule_state(applied),
            "scaler": engine.scaling.state_dict(),
            "trainer": dataclasses.asdict(st),
            "accumulation": {
                "grads": [p.grad.detach().clone() if p.grad is not None else None for p in engine.params],
                "loss": engine.loss_acc.detach().clone(),
            } if st.window_size > 0 else None,
            "rng": capture_rng_state(),
            "data": self.cursor.state_dict(),
        }

    def restore(self, ckpt: dict[str, Any], path: Path) -> None:
        """Rules 1-6 (the generators and the data position come later: :meth:`restore_rng_and_data`)."""
        if ckpt.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path}: checkpoint format {ckpt.get('format')!r}, expected {CHECKPOINT_FORMAT}")
        # The configuration first: a changed task (task.size) also changes the model's shapes, and
        # the refusal should name the field, not call a good checkpoint another model's.
        applied = self._check_config(ckpt, path)
        self._check_signature(ckpt["model_signature"], ckpt["model"], path)
        fresh = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                 for g in self.optimizer.param_groups]
        try:
            self.model.load_state_dict(ckpt["model"])
        except RuntimeError as exc:
            raise CheckpointError(f"{path}: its model state does not fit this model: {' '.join(str(exc).split())[:300]}"
                                  ) from None
        try:
            if self.master is None:
                self.optimizer.load_state_dict(ckpt["optimizer"])
            else:  # rule 13
                self.master.master.load_state_dict(ckpt["optimizer"])
                self.master.load_state_dict(ckpt.get("lost_updates"))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: optimizer state does not fit this optimizer: {exc}") from None
        if self.user_optimizer:
            _warn_kept(fresh, self.optimizer.param_groups, path, ckpt["trainer"]["step"])
        else:
            for group, values in zip(self.optimizer.param_groups, fresh):
                group.update(values)  # rule 11: the configuration's hyperparameters, not the saved ones
        engine = self.engine
        engine.skip.load_schedule(ckpt["schedule"], self.config.train.steps)
        if any(line.startswith("optimizer.lr:") for line in applied):
            engine.skip.rebase([float(self.config.optimizer.lr)] * len(self.optimizer.param_groups),
                               self.config.train.steps)
        try:
            engine.scaling.load_state_dict(ckpt.get("scaler"), path, self.plan_mode)
        except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: its loss-scaler state cannot be restored ({type(exc).__name__}: "
                                  f"{str(exc)[:200]})") from None
        if engine.scaling.scaler is not None:
            s = self.config.scaler.resolved()  # rule 11: the configuration's factors
            engine.scaling.scaler.set_growth_factor(s.growth_factor)
            engine.scaling.scaler.set_backoff_factor(s.backoff_factor)
            engine.scaling.scaler.set_growth_interval(s.growth_interval)
        names = {f.name for f in dataclasses.fields(TrainState)}
        saved = TrainState(**{k: v for k, v in ckpt["trainer"].items() if k in names})
        vars(self.state).update(vars(saved))  # in place: the engine and the cursor share it
        acc = ckpt.get("accumulation")
        if acc is not None:
            for p, g in zip(engine.params, acc["grads"]):
                p.grad = None if g is None else g.to(engine.device)
            engine.loss_acc.copy_(acc["loss"])

    def restore_rng_and_data(self, ckpt: dict[str, Any]) -> None:
        """Rules 7-8, last, so that nothing in the set-up consumes the restored streams."""
        restore_rng_state(ckpt["rng"])
        self.cursor.load_state_dict(ckpt["data"])

    def _check_signature(self, theirs: dict[str, list[int]], saved: dict[str, Any], path: Path) -> None:
        """Rule 1: the same parameter and buffer names and shapes, and the same dtypes."""
        model_state = self.model.state_dict()
        mine = {k: list(v.shape) for k, v in model_state.items()}
        dtypes = sorted(f"{k} ({saved[k].dtype} saved, {v.dtype} now)" for k, v in model_state.items()
                        if isinstance(saved.get(k), torch.Tensor) and saved[k].dtype != v.dtype)
        if mine == theirs and not dtypes:
            return
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        shapes = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
        parts = [f"missing {missing[:5]}" if missing else "", f"unexpected {extra[:5]}" if extra else "",
                 f"different shapes for {shapes[:5]}" if shapes else "", f"different dtypes for {dtypes[:5]}" if dtypes else ""]
        raise CheckpointError(f"{path} was saved from a different model: " + "; ".join(p for p in parts if p))

    def _check_config(self, ckpt: dict[str, Any], path: Path) -> list[str]:
        """Rule 11: refuse what defines the run; warn of each applied change; return those."""
        mid_window = int(ckpt["trainer"].get("window_size", 0)) > 0
        refused, applied = config_changes(ckpt["config"], self.config.to_dict(), mid_window=mid_window,
                                          user_optimizer=self.user_optimizer)
        saved_source = ckpt.get("optimizer_source") or {"user": False}
        refused += _source_changes(saved_source, self.optimizer_source())
        if ckpt.get("optimizer_kind") != self.optimizer_kind:
            refused.append(f"the optimizer kind: {ckpt.get('optimizer_kind')!r} (checkpoint) -> "
                           f"{self.optimizer_kind!r} (now)")
        if refused:
            raise ResumeError(
                f"cannot resume from {path}: the configuration differs from the checkpoint's in what defines the "
                f"run: {'; '.join(refused)}. Resume with the checkpoint's values, or start a new run in another "
                "checkpoint.folder")
        step = ckpt["trainer"]["step"]
        for line in applied:
            warnings.warn(f"resume from {path.name} at step {step}: {line}; the new value is used from here on",
                          stacklevel=5)
        return applied


def _source_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Rule 12: the differences in whose optimizer and scheduler run, as refusal lines."""
    def who(source: dict[str, Any]) -> str:
        return "your optimizer" if source.get("user") else "the configuration's optimizer"

    if bool(saved.get("user")) != now["user"]:
        return [f"the optimizer: {who(saved)} (checkpoint) -> {who(now)} (now)"]
    if not now["user"]:
        return []
    return [f"the {key}: {saved.get(key)} (checkpoint) -> {now[key]} (now)"
            for key in ("optimizer", "scheduler") if saved.get(key) != now[key]]


def _warn_kept(fresh: list[dict[str, Any]], loaded: list[dict[str, Any]], path: Path, step: int) -> None:
    """Rule 12: name each hyperparameter of the user's new optimizer that the checkpoint's replaced."""
    for i, (mine, group) in enumerate(zip(fresh, loaded)):
        for key, value in mine.items():
            if key in group and not _same_value(group[key], value):
                warnings.warn(f"resume from {path.name} at step {step}: param_groups[{i}][{key!r}] is "
                              f"{group[key]!r} in the checkpoint and {value!r} in your optimizer; the checkpoint's "
                              "is kept (torch's load_state_dict)", stacklevel=6)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b


def ampspec_version() -> str:
    try:
        return version("ampspec")
    except Exception:  # not installed (running from a checkout)
        return getattr(torchimpl, "__version__", "unknown")
