"""The same training work done four ways: a hand-written loop, torchimpl's Trainer, Accelerate
and Lightning Fabric.

Each runner takes a :class:`Workload` and a ``mark(event)`` callable and trains for
``steps`` optimizer steps of ``k`` microbatches from the same pre-made batches, starting from
a copy of the same initial model. ``mark("window_end")`` is called once per step after the
last microbatch's backward (before unscale/clip/step), ``mark("step_end")`` after the step
(after the scaler's update). Everything is built fresh for each call, so one call is one
independent block of a benchmark round.

What is the same for every candidate: model and initial weights, batches, autocast dtype,
loss scaler or none, ``loss / k`` accumulation, clipping of the unscaled gradients at norm 1.0,
and AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on weights and 0 on biases
and norm parameters, torchimpl's default split) as the for-loop or the fused implementation,
and the loss logged every ``LOG_INTERVAL`` steps (the Trainer's default ``log_interval``).
What differs is each framework's own machinery, which is what is measured.

Logging the loss: the hand, Accelerate and Fabric loops do what a careful hand-written loop does
(nanoGPT's, say): at a log point they read the last microbatch's loss with one ``item()``, and
track nothing in between. The Trainer's contract asks for more, and it does it: every window's
loss is accumulated per microbatch and read with the step's one host read (together with
found_inf), and each step's record (scale, found_inf, gradient norm, clip coefficient, lr) is
kept and read at the log point.
"""

from __future__ import annotations

import copy
import importlib
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

Mark = Callable[[str], None]

LOG_INTERVAL = 10


def _log_point(step: int, loss: torch.Tensor) -> float | None:
    """At every ``LOG_INTERVAL``-th step: the window's last microbatch loss, read to the host."""
    return None if (step + 1) % LOG_INTERVAL else loss.item()


class Unsupported(Exception):
    """A candidate cannot run this configuration; the message says why."""


@dataclass
class Workload:
    name: str
    model: nn.Module
    batches: list[Any]
    k: int
    use_scaler: bool
    fused: bool
    autocast_dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    clip_norm: float = 1.0
    lr: float = 1e-3
    weight_decay: float = 0.01
    optimizer: str = "adamw"  # the Trainer's optimizer.name (the hand loops and peers run AdamW)


def _adamw(model: nn.Module, w: Workload) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": w.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    impl = {"fused": True} if w.fused else {"foreach": False}
    return torch.optim.AdamW(groups, lr=w.lr, betas=(0.9, 0.999), eps=1e-8, **impl)


def run_hand(w: Workload, steps: int, mark: Mark) -> None:
    """The canonical loop: scale/backward per microbatch, unscale_, clip, step, update; the loss
    read at log points."""
    dev = torch.device(w.device)
    model = copy.deepcopy(w.model).to(dev)
    model.train()
    opt = _adamw(model, w)
    scaler = torch.amp.GradScaler(dev.type) if w.use_scaler else None
    params = [p for p in model.parameters() if p.requires_grad]
    it = iter(w.batches)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(w.k):
            x, y = (t.to(dev, non_blocking=True) for t in next(it))
            with torch.autocast(dev.type, dtype=w.autocast_dtype):
                loss = model(x, y)
            scaled = loss / w.k
            if scaler is not None:
                scaler.scale(scaled).backward()
            else:
                scaled.backward()
        mark("window_end")
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, w.clip_norm)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        _log_point(step, loss)
        mark("step_end")


def trainer_config(w: Workload, steps: int, *, sync_free: bool = False, package: str = "torchimpl"):
    # The package's public names, which stay where they are whatever module defines them (so that
    # --against REV runs a revision of another layout).
    config = importlib.import_module(package)
    Config, ScheduleConfig, TrainConfig = config.Config, config.ScheduleConfig, config.TrainConfig
    OptimizerConfig, PrecisionConfig = config.OptimizerConfig, config.PrecisionConfig

    cpu = torch.device(w.device).type == "cpu"
    if cpu and w.autocast_dtype != torch.bfloat16:
        raise Unsupported("torchimpl on the CPU autocasts to bf16 only (fp16 resolves to fp32)")
    # No metrics files or progress lines: the hand loops write none, and revisions before the
    # logging section have none (--against REV).
    quiet = {"logging": config.LoggingConfig(dir=None, progress="off")} if hasattr(config, "LoggingConfig") else {}
    return Config(
        **quiet,
        device=w.device,
        precision=PrecisionConfig(mode="bf16" if w.autocast_dtype == torch.bfloat16 else "fp16"),
        optimizer=OptimizerConfig(name=w.optimizer, lr=w.lr, weight_decay=w.weight_decay, fused=w.fused),
        schedule=ScheduleConfig(name="constant"),
        # Production defaults otherwise: log_interval 10, no trace file, no guard, no checkpoints.
        train=TrainConfig(steps=steps, microbatches=w.k, clip_norm=w.clip_norm,
                          force_scaler=w.use_scaler and cpu, sync_free=sync_free),
    )


def run_trainer(w: Workload, steps: int, mark: Mark, *, sync_free: bool = False, package: str = "torchimpl") -> Any:
    trainer = importlib.import_module(package)  # its public names (see trainer_config)
    Callback, Trainer = trainer.Callback, trainer.Trainer

    class Marks(Callback):
        def on_after_backward(self, trainer, state):
            mark("window_end")

        def on_step_end(self, trainer, state):
            mark("step_end")

    model = copy.deepcopy(w.model)
    cfg = trainer_config(w, steps, sync_free=sync_free, package=package)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Trainer(cfg, callbacks=[Marks()]).fit(model, w.batches[: steps * w.k])


_ACCELERATORS: dict[tuple[str, str], Any] = {}


def _accelerator(mixed_precision: str, device: str, k: int):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    key = (mixed_precision, device)
    if key not in _ACCELERATORS:
        # AcceleratorState is a process-wide singleton: reset it to change the precision.
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        _ACCELERATORS.clear()
        _ACCELERATORS[key] = Accelerator(cpu=device == "cpu", mixed_precision=mixed_precision)
    acc = _ACCELERATORS[key]
    acc.gradient_accumulation_steps = k
    return acc


def run_accelerate(w: Workload, steps: int, mark: Mark) -> None:
    cpu = torch.device(w.device).type == "cpu"
    if cpu and w.use_scaler:
        raise Unsupported(
            "Accelerate has no loss scaler on the CPU: mixed_precision='fp16' with cpu=True runs "
            "fp32 without a scaler (native_amp False), and its unscale_gradients acts only for fp16"
        )
    if cpu and w.autocast_dtype != torch.bfloat16:
        raise Unsupported("Accelerate autocasts to bf16 only on the CPU")
    mp = "bf16" if w.autocast_dtype == torch.bfloat16 else "fp16"
    if mp == "bf16" and w.use_scaler:
        raise Unsupported("Accelerate uses a loss scaler only with mixed_precision='fp16'")
    acc = _accelerator(mp, w.device, w.k)
    acc.free_memory()  # also resets the accumulation step counter
    model = copy.deepcopy(w.model)
    opt = _adamw(model, w)
    model, opt = acc.prepare(model, opt)
    model.train()
    it = iter(w.batches)
    for step in range(steps):
        for _ in range(w.k):
            x, y = (t.to(acc.device, non_blocking=True) for t in next(it))
            with acc.accumulate(model):
                loss = model(x, y)
                acc.backward(loss)
                if acc.sync_gradients:
                    mark("window_end")
                    acc.clip_grad_norm_(model.parameters(), w.clip_norm)
                opt.step()
                opt.zero_grad()
        _log_point(step, loss)
        mark("step_end")
    acc.free_memory()


_FABRICS: dict[tuple[str, bool, torch.dtype], Any] = {}


def _fabric(device: str, use_scaler: bool, dtype: torch.dtype):
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision.amp import MixedPrecision

    key = (device, use_scaler, dtype)
    if key not in _FABRICS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if device != "cpu":
                precision = "bf16-mixed" if dtype == torch.bfloat16 else "16-mixed"
                fabric = Fabric(accelerator=device, devices=1, precision=precision)
            elif use_scaler:
                # Fabric refuses a scaler with bf16-mixed and maps 16-mixed on the CPU to
                # bf16-mixed without one; its plugin built explicitly as 16-mixed with a CPU
                # scaler, retargeted to bf16, gives the bf16 + scaler path the others run.
                plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
                plugin._desired_input_dtype = torch.bfloat16
                fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
            else:
                fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
        _FABRICS[key] = fabric
    return _FABRICS[key]


def run_fabric(w: Workload, steps: int, mark: Mark) -> None:
    cpu = torch.device(w.device).type == "cpu"
    if cpu and w.autocast_dtype != torch.bfloat16:
        raise Unsupported("the Fabric candidate autocasts to bf16 only on the CPU")
    if not cpu and (w.autocast_dtype == torch.bfloat16) == w.use_scaler:
        raise Unsupported("Fabric on CUDA: bf16-mixed has no scaler, 16-mixed always has one")
    fabric = _fabric(torch.device(w.device).type, w.use_scaler, w.autocast_dtype)
    if w.use_scaler:
        # A fresh scaler per block, as every other candidate gets.
        fabric._precision.scaler = torch.amp.GradScaler(torch.device(w.device).type)
    model = copy.deepcopy(w.model)
    opt = _adamw(model, w)
    model, opt = fabric.setup(model, opt)
    model.train()
    it = iter(w.batches)
    for step in range(steps):
        for j in range(w.k):
            x, y = fabric.to_device(next(it))
            with fabric.no_backward_sync(model, enabled=j < w.k - 1):
                loss = model(x, y)
                fabric.backward(loss / w.k)
        mark("window_end")
        try:
            fabric.clip_gradients(model, opt, max_norm=w.clip_norm)
        except NotImplementedError as exc:
            raise Unsupported(f"Fabric: {exc}") from None
        opt.step()
        opt.zero_grad()
        _log_point(step, loss)
        mark("step_end")


def available() -> dict[str, str | None]:
    """Peer name -> None when importable, else the reason it is skipped."""
    out: dict[str, str | None] = {}
    for name, module in (("accelerate", "accelerate"), ("fabric", "lightning.fabric")):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                __import__(module)
            out[name] = None
        except Exception as exc:  # any import failure means the peer cannot be measured here
            out[name] = f"{module} does not import: {exc!r} (install the 'bench' extra)"
    return out


RUNNERS: dict[str, Callable[..., Any]] = {
    "hand": run_hand,
    "ampspec": run_trainer,
    "accelerate": run_accelerate,
    "fabric": run_fabric,
}


def add_baseline(ref: str) -> str:
    """Register the Trainer of git revision ``ref`` as a candidate beside today's; its name.

    ``torchimpl`` at ``ref`` is extracted from this repository into a temporary folder as the
    package ``torchimpl_at_<ref>`` (every ``torchimpl`` name in its source renamed), so that the
    old and the new trainer run side by side in one process.
    """
    root = Path(__file__).resolve().parent.parent
    package = "torchimpl_at_" + re.sub(r"\W", "_", ref)
    dest = Path(tempfile.mkdtemp(prefix="ampspec-baseline-"))
    try:
        tar = subprocess.run(["git", "archive", ref, "torchimpl"], cwd=root, check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"--against {ref}: git archive failed ({exc}); give a revision of this repository")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    (dest / "torchimpl").rename(dest / package)
    for path in (dest / package).rglob("*.py"):
        path.write_text(re.sub(r"\btorchimpl\b", package, path.read_text()))
    sys.path.insert(0, str(dest))
    name = f"ampspec@{ref}"
    RUNNERS[name] = lambda w, steps, mark, **kw: run_trainer(w, steps, mark, package=package, **kw)
    return name
