"""``ampspec compare``: the same model, seed and data in fp32, bf16, (on CUDA) fp16 and, when
torchao is installed, fp8 (torchao's tensorwise float8 recipe; emulated on a CPU, so its ms/step
there is the emulation's cost, not float8's speed). On a device where none of these uses a
loss scaler (a CPU), a ``bf16+scaler`` run (``train.force_scaler``) shows the scaler at work: its
growth interval is shortened to a tenth of the run so that the growth is visible in the plot.

The task is an embedded one (``lm``, ``mlp``) or the user's ``module:function``; every run
builds a fresh task from the same seed (``torchimpl.task.builtin.build_task``).

Agreement rule (stated in the table's footer, the report and the plot): ``torchimpl.cli.agreement``,
a band relative to fp32's moving average with a floor from fp32's own step-to-step noise.
A run's "max gap" is the largest absolute difference, in loss units, between its smoothed
curve and fp32's. A run's ms/step is the median step after its first :data:`WARMUP_STEPS`
(:func:`timed_steps`): the first steps in a precision pay its one-time costs (kernels chosen
and built, buffers allocated), which would make the first low-precision row look slow.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import warnings
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from torchimpl.cli.agreement import Band, moving_average
from torchimpl.config.schema import Config, load_config
from torchimpl.precision.device import resolve_device
from torchimpl.run.lifecycle import Interrupted
from torchimpl.safe_files import write_report
from torchimpl.run.records import read_trace
from torchimpl.train.reporting import progress_log
from torchimpl.task.builtin import build_task, check_task
from torchimpl.train.trainer import Callback, Trainer
from torchimpl.precision import fp8  # fp8.torchao_available looked up when called (tests replace it)

__all__ = ["CompareResult", "check_inputs", "run_compare", "format_table", "gap_explained"]

log = logging.getLogger(__name__)

SCALER_RUN = "bf16+scaler"

WARMUP_STEPS = 5
"""Steps at the start of each run that its ms/step leaves out (at most half the run)."""


@dataclass
class CompareResult:
    rows: list[dict[str, Any]]
    agree: bool
    rule: str
    gap_note: str
    seconds: float
    report_path: str
    png_path: str | None
    png_note: str | None
    left_out: dict[str, str]
    """Runs that could not be made, with the reason (fp8 on a model with no convertible layer)."""
    interrupted: str | None = None
    """The signal that stopped the comparison (SIGINT, SIGTERM), or None when it ran to the end."""
    finished: list[str] | None = None
    """With ``interrupted``: the runs that finished."""
    cut_short: dict[str, int] | None = None
    """With ``interrupted``: the run the signal stopped, and the steps it had done."""


@dataclass
class _Curves:
    """What one precision's run leaves for the report and the plot."""

    train: list[float]
    """Training loss of every step (index i is step i + 1)."""
    val: list[tuple[int, float]]
    """(steps done, validation loss) at each evaluation."""
    scale: list[float]
    skipped: list[int]
    """1-based steps whose update was skipped (a non-finite gradient)."""
    uses_scaler: bool


class _StepTimes(Callback):
    """The wall time at the start of the run and at the end of each step (on CUDA after the
    step's work has finished), for :func:`timed_steps`."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def _now(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def on_fit_start(self, trainer: Trainer) -> None:
        self._now()

    def on_step_end(self, trainer: Trainer, state: Any) -> None:
        self._now()


def timed_steps(times: list[float]) -> tuple[float, int]:
    """(the median step's seconds after the warm-up, the warm-up's steps) from ``_StepTimes``:
    the median also leaves out the steps followed by an evaluation or a checkpoint."""
    steps = [b - a for a, b in zip(times, times[1:])]
    warm = min(WARMUP_STEPS, len(steps) // 2)
    return (statistics.median(steps[warm:]) if steps[warm:] else math.nan), warm


class _RecordingTrainer(Trainer):
    """A trainer that keeps every evaluation's loss, so that the validation curve can be drawn."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.val_history: list[tuple[int, float]] = []

    def evaluate(self, val_data: Iterable[Any]) -> float:
        value = super().evaluate(val_data)
        self.val_history.append((self.state.step, value))
        return value


def gap_explained(window: int) -> str:
    """What the table's "max gap" column means."""
    return (f"the largest absolute difference, in loss units, between a run's {window}-step moving "
            "average of the training loss and fp32's, over the whole run")


def _runs(dev: torch.device) -> list[tuple[str, str, list[str]]]:
    """(label, precision mode, extra overrides) of every run on ``dev``."""
    runs = [("fp32", "fp32", []), ("bf16", "bf16", [])]
    if dev.type == "cuda":
        runs.append(("fp16", "fp16", []))
    else:
        runs.append((SCALER_RUN, "bf16", ["train.force_scaler=true"]))
    if fp8.torchao_available():
        runs.append(("fp8", "fp8", []))
    return runs


def _progress() -> str:
    """A bar on a terminal; no per-step lines otherwise: the runs evaluate every twentieth of the
    run, and their unlabelled lines (a log point at each evaluation) would bury the table; each
    run's start and end get a line of their own instead."""
    return "auto" if sys.stderr.isatty() else "off"


def run_config(label: str, mode: str, extra: list[str], *, dev: str, task: str, steps: int, seed: int,
               eval_every: int, out: Path) -> Config:
    """The configuration of one run: ``ampspec train``'s for the task (the optimizer, the
    schedule and the embedded tasks' settings of ``torchimpl.config.embedded`` are not changed here),
    with the precision, the steps, the seed and where the files go."""
    if label == SCALER_RUN:
        extra = extra + [f"scaler.growth_interval={max(steps // 10, 1)}"]
    return load_config(overrides=[
        f"device={dev}", f"task.name={task}", f"precision.mode={mode}", f"train.steps={steps}",
        f"train.seed={seed}", "train.log_interval=50", f"train.eval_interval={eval_every}",
        f"train.trace_file={out / f'trace-{label}.jsonl'}", f"logging.dir={out / label}",
        f"logging.progress={_progress()}", *extra,
    ], task_defaults=True)


def _train_one(label: str, mode: str, extra: list[str], *, dev: torch.device, task: str, steps: int, seed: int,
               eval_every: int, out: Path) -> tuple[dict[str, Any], _Curves]:
    trace = out / f"trace-{label}.jsonl"
    cfg = run_config(label, mode, extra, dev=str(dev), task=task, steps=steps, seed=seed, eval_every=eval_every,
                     out=out)
    t = build_task(cfg.task, seed=seed, batch_size=cfg.train.batch_size)
    clock = _StepTimes(dev)
    trainer = _RecordingTrainer(cfg, [clock])
    with warnings.catch_warnings():
        # --out was claimed for this comparison (torchimpl.run.folder rule 4): each run replaces
        # its own files from an earlier comparison there, which that claim already allowed.
        warnings.filterwarnings("ignore", message="overwrite=True: removed the previous run's files")
        summary = trainer.fit(t.model, t.train_data, t.val_data, loss_fn=t.loss_fn, overwrite=True)
    curves = _Curves(train=[loss for _, loss in trainer.loss_history], val=list(trainer.val_history),
                     scale=[s for _, s in trainer.scale_history],
                     skipped=[r.step + 1 for r in read_trace(trace) if not r.applied],
                     uses_scaler=summary.use_scaler)
    seconds, warm = timed_steps(clock.times)
    row = {
        "precision": label, "plan": summary.precision_mode, "final_loss": curves.train[-1],
        "best_val_loss": summary.best_val_loss, "final_val_loss": summary.final_val_loss,
        "steps_skipped": summary.steps_skipped, "final_scale": summary.final_scale,
        "time_per_step_ms": seconds * 1e3, "warmup_steps": warm,
        "peak_memory_mb": None if summary.peak_memory_bytes is None else summary.peak_memory_bytes / 2**20,
        "downgrades": summary.downgrades,
    }
    if summary.outcome.startswith("interrupted"):
        # The trainer stopped at a step boundary on a signal: the whole comparison stops.
        raise _RunInterrupted(summary.outcome.split(":", 1)[1], label, summary.steps)
    return row, curves


def _judge(rows: list[dict[str, Any]], curves: dict[str, _Curves], band: Band) -> bool:
    """Fill each row's ``max_gap_to_fp32`` and ``agrees``; True when every run agrees."""
    ref = curves["fp32"].train
    for row in rows:
        run = curves[row["precision"]].train
        row["max_gap_to_fp32"] = max(band.gaps(ref, run))
        row["agrees"] = band.agrees(ref, run)
    return all(row["agrees"] for row in rows)


def check_inputs(*, steps: int, device: str, task: str, seed: int, out: str | Path) -> None:
    """Everything a comparison can check before any work (before ``--out`` is made or locked):
    the step count, the device, every run's configuration, and the task's module and function
    (found, not called: calling it is the runs' work)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    dev = resolve_device(device)
    eval_every = max(steps // 20, 1)
    configs = [run_config(label, mode, extra, dev=str(dev), task=task, steps=steps, seed=seed,
                          eval_every=eval_every, out=Path(out)) for label, mode, extra in _runs(dev)]
    check_task(configs[0].task)


def run_compare(*, steps: int = 200, device: str = "auto", out: str | Path = "ampspec-compare",
                task: str = "lm", seed: int = 0, window: int = 20, rel_tol: float = 0.5,
                noise_k: float = 3.0) -> CompareResult:
    """Train ``task`` in every precision ``device`` supports, judge each against fp32, and write
    ``out/report.json`` and (with matplotlib) ``out/compare.png``."""
    check_inputs(steps=steps, device=device, task=task, seed=seed, out=out)
    t0 = time.perf_counter()
    out = Path(out)
    dev = resolve_device(device)
    eval_every = max(steps // 20, 1)  # about 20 points: a validation curve, not a final number
    rows: list[dict[str, Any]] = []
    curves: dict[str, _Curves] = {}
    left_out: dict[str, str] = {}
    runs = _runs(dev)
    out.mkdir(parents=True, exist_ok=True)
    try:
        _train_all(runs, rows, curves, left_out, dev=dev, task=task, steps=steps, seed=seed, eval_every=eval_every,
                   out=out)
    except (_RunInterrupted, Interrupted) as exc:
        return _interrupted(exc, rows, runs, out=out, dev=dev, task=task, steps=steps, seed=seed, t0=t0)
    band = Band(window, rel_tol, noise_k)
    agree = _judge(rows, curves, band)
    rule = band.rule()
    title = f"ampspec compare: task {task} on {dev}, torch {torch.__version__}, {steps} steps, seed {seed}"
    report = {"device": str(dev), "torch": str(torch.__version__), "task": task, "steps": steps, "seed": seed,
              "rule": rule, "max_gap": gap_explained(window), "agree": agree, "rows": rows, "left_out": left_out,
              "loss_curves": {k: c.train for k, c in curves.items()},
              "val_curves": {k: c.val for k, c in curves.items()},
              "skipped_steps": {k: c.skipped for k, c in curves.items()},
              "scale_history": {k: c.scale for k, c in curves.items()}}
    report_path = out / "report.json"
    write_report(report_path, report)
    png_path, note = _plot(curves, rows, band, title, out / "compare.png")
    return CompareResult(rows, agree, rule, gap_explained(window), time.perf_counter() - t0, str(report_path),
                         png_path, note, left_out)


def _train_all(runs: list[tuple[str, str, list[str]]], rows: list[dict[str, Any]], curves: dict[str, _Curves],
               left_out: dict[str, str], **kw: Any) -> None:
    """Every run in turn, filling ``rows``, ``curves`` and ``left_out`` as each finishes."""
    task, steps = kw["task"], kw["steps"]
    for number, (label, mode, extra) in enumerate(runs, 1):
        # One line as each run starts and ends, on a terminal or not (ampspec -q silences them).
        progress_log.info("compare: run %d of %d, %s, %d steps of task %s", number, len(runs), label, steps, task)
        started = time.perf_counter()
        try:
            row, curves[label] = _train_one(label, mode, extra, **kw)
        except ValueError as exc:
            if mode != "fp8":
                raise
            # fp8 is the optional extra: a model it cannot convert leaves that row out, not the comparison.
            left_out[label] = str(exc)
            continue
        rows.append(row)
        progress_log.info("compare: %s done in %.1f s, final loss %.4g", label, time.perf_counter() - started,
                          row["final_loss"])


class _RunInterrupted(Exception):
    """A run that the trainer stopped on a signal (at a step boundary)."""

    def __init__(self, signal_name: str, label: str, steps_done: int):
        super().__init__(f"{label} interrupted by {signal_name} after {steps_done} steps")
        self.signal, self.label, self.steps_done = signal_name, label, steps_done


def _interrupted(exc: BaseException, rows: list[dict[str, Any]], runs: list[tuple[str, str, list[str]]], *,
                 out: Path, dev: torch.device, task: str, steps: int, seed: int, t0: float) -> CompareResult:
    """The report of a comparison a signal stopped: which runs finished, which was cut short and
    where; no verdict and no curves of a cut-short run (``agree`` is null)."""
    name = exc.signal
    finished = [r["precision"] for r in rows]
    cut = {exc.label: exc.steps_done} if isinstance(exc, _RunInterrupted) else {}
    not_run = [label for label, _, _ in runs if label not in finished and label not in cut]
    report = {"device": str(dev), "torch": str(torch.__version__), "task": task, "steps": steps, "seed": seed,
              "interrupted": name, "agree": None, "finished": finished, "cut_short": cut, "not_run": not_run,
              "rows": rows,
              "note": f"the comparison was interrupted by {name}: only the finished runs' rows are reported, "
                      "no run is judged against fp32 and no plot is drawn"}
    report_path = out / "report.json"
    write_report(report_path, report)
    return CompareResult(rows, False, "", "", time.perf_counter() - t0, str(report_path), None,
                         f"plot skipped: the comparison was interrupted by {name}", {}, interrupted=name,
                         finished=finished, cut_short=cut)


def _plot(curves: dict[str, _Curves], rows: list[dict[str, Any]], band: Band, title: str,
          path: Path) -> tuple[str | None, str | None]:
    try:
        # optional dependency: the picture is drawn only where matplotlib is installed
        import matplotlib

        matplotlib.use("Agg")
        # optional dependency: the picture is drawn only where matplotlib is installed
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "PNG skipped: matplotlib is not installed (pip install 'ampspec[plot]')"
    scaled = {k: c for k, c in curves.items() if c.uses_scaler}
    # The scale panel only when some run used a scaler: without one every scale is 1.
    fig = plt.figure(figsize=(14 if scaled else 9.5, 7.5))
    grid = fig.add_gridspec(2, 2 if scaled else 1, height_ratios=[2.2, 1], width_ratios=[2, 1] if scaled else None)
    colours = {k: f"C{i}" for i, k in enumerate(curves)}
    by_label = {r["precision"]: r for r in rows}
    loss_ax = fig.add_subplot(grid[0, 0])
    _plot_losses(loss_ax, curves, by_label, band, colours)
    _plot_gaps(fig.add_subplot(grid[1, 0], sharex=loss_ax), curves, by_label, band, colours)
    if scaled:
        _plot_scales(fig.add_subplot(grid[:, 1]), scaled, colours)
    fig.suptitle(title, fontsize=12)
    footer = textwrap.fill(f"A run agrees with fp32 when it stays inside the shaded band: {band.rule()}.", 200)
    fig.text(0.01, 0.012, f"{footer}\nmax gap: {gap_explained(band.window)}.", fontsize=8.5)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path), None


def _run_label(label: str, row: dict[str, Any]) -> str:
    if label == "fp32":
        return "fp32 (the baseline)"
    verdict = "agrees" if row["agrees"] else "DOES NOT AGREE"
    skipped = f", {row['steps_skipped']} skipped" if row["steps_skipped"] else ""
    return f"{label}: max gap {row['max_gap_to_fp32']:.2g}, {verdict}{skipped}"


def _plot_losses(ax: Any, curves: dict[str, _Curves], by_label: dict[str, dict[str, Any]], band: Band,
                 colours: dict[str, str]) -> None:
    # optional dependency: the picture is drawn only where matplotlib is installed
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ref, half = moving_average(curves["fp32"].train, band.window), band.half_widths(curves["fp32"].train)
    low, high = [r - h for r, h in zip(ref, half)], [r + h for r, h in zip(ref, half)]
    smoothed = {k: moving_average(c.train, band.window) for k, c in curves.items()}
    values = [v for sm in smoothed.values() for v in sm] + [v for c in curves.values() for _, v in c.val]
    positive = [v for v in values if 0 < v < math.inf]
    log_axis = bool(positive) and max(positive) / min(positive) > 20  # a loss falling towards 0 reads on a log axis
    if log_axis:
        low = _log_axis(ax, min(positive), low)
    ax.fill_between(range(1, len(ref) + 1), low, high, color="0.5", alpha=0.18, linewidth=0)
    styles = _styles(smoothed, log_axis)
    handles = []
    for label, c in curves.items():
        sm, (width, alpha, dashes) = smoothed[label], styles[label]
        ax.plot(range(1, len(sm) + 1), sm, color=colours[label], linewidth=width, alpha=alpha, linestyle=dashes)
        if c.val:
            xs, ys = zip(*c.val)
            ax.plot(xs, ys, color=colours[label], linestyle="--", marker="o", markersize=3.5, linewidth=1,
                    alpha=alpha if label == "fp32" else 0.9)
        if c.skipped:
            ax.plot(c.skipped, [sm[s - 1] for s in c.skipped], linestyle="none", marker="x", markersize=8,
                    markeredgewidth=2, color=colours[label])
        twin = next((k for k in list(curves)[:list(curves).index(label)] if curves[k].train == c.train), None)
        text = _run_label(label, by_label[label]) + (f" (identical to {twin})" if twin else "")
        handles.append(Line2D([], [], color=colours[label], linewidth=2, label=text))
    handles += [Line2D([], [], color="0.3", linestyle="--", marker="o", markersize=3.5, linewidth=1,
                       label="validation loss (dashed)"),
                Line2D([], [], color="0.3", linestyle="none", marker="x", markersize=8, markeredgewidth=2,
                       label="skipped step (non-finite gradient)"),
                Patch(color="0.5", alpha=0.18, label="agreement band around fp32")]
    ax.set(title=f"training loss ({band.window}-step moving average) and validation loss", ylabel="loss")
    ax.grid(True, alpha=0.3)
    ax.legend(handles=handles, fontsize=8.5, loc="upper right")


def _log_axis(ax: Any, lowest: float, low: list[float]) -> list[float]:
    """Put ``ax`` on a log scale that shows the band's lower edge, and return the edge to draw.

    The axis reaches down to the edge (to at most a hundredth of the lowest curve point);
    where the edge is at or below 0 (every lower loss agrees) or further down, it is drawn
    along the axis' bottom instead of dropping out of the plot."""
    edge = [v for v in low if v > 0]
    bottom = max(min([0.5 * lowest] + [0.8 * v for v in edge]), lowest / 100)
    ax.set_yscale("log")
    ax.set_ylim(bottom=bottom)
    return [max(v, bottom) for v in low]


def _styles(smoothed: dict[str, list[float]], log_axis: bool, span: float | None = None
            ) -> dict[str, tuple[float, float, Any]]:
    """(width, opacity, line style) of each run: fp32 wide and pale underneath, the others solid
    at one width, except runs that coincide on the plot (within 0.3 % of the axis' ``span``, by
    default the curves' own range; bf16 with and without a scaler are identical): those share
    their line in turn, as interleaved dashes, so that each colour shows."""
    def key(v: float) -> float:
        return math.log(v) if log_axis and v > 0 else v

    if span is None:
        points = [key(v) for sm in smoothed.values() for v in sm if math.isfinite(key(v))]
        span = (max(points) - min(points)) if points else 0.0
    groups: list[list[str]] = []
    for label, sm in smoothed.items():
        if label == "fp32":
            continue
        group = next((g for g in groups if _coincide(smoothed[g[0]], sm, key, 0.003 * span)), None)
        if group is None:
            groups.append([label])
        else:
            group.append(label)
    styles: dict[str, tuple[float, float, Any]] = {"fp32": (4.0, 0.45, "-")}
    dash = 5.0
    for group in groups:
        for j, label in enumerate(group):
            styles[label] = (2.2, 0.95, "-" if len(group) == 1 else (j * dash, (dash, (len(group) - 1) * dash)))
    return styles


def _coincide(a: list[float], b: list[float], key: Any, tol: float) -> bool:
    return len(a) == len(b) and all(abs(key(x) - key(y)) <= tol for x, y in zip(a, b))


def _plot_gaps(ax: Any, curves: dict[str, _Curves], by_label: dict[str, dict[str, Any]], band: Band,
               colours: dict[str, str]) -> None:
    """Each run's smoothed curve minus fp32's, inside the band's half-width: the "max gap" drawn."""
    ref, half = moving_average(curves["fp32"].train, band.window), band.half_widths(curves["fp32"].train)
    ax.fill_between(range(1, len(ref) + 1), [-h for h in half], half, color="0.5", alpha=0.18, linewidth=0)
    ax.axhline(0.0, color=colours["fp32"], linewidth=1)
    gaps = {k: [a - b for a, b in zip(moving_average(c.train, band.window), ref)]
            for k, c in curves.items() if k != "fp32"}
    top = max([*half, *(abs(g) for gap in gaps.values() for g in gap if math.isfinite(g))])
    styles = _styles({"fp32": [0.0] * len(ref), **gaps}, log_axis=False, span=2.2 * top)
    for label, gap in gaps.items():
        # zip stops at the shorter curve: a run with fewer steps than fp32's is drawn as far as it went.
        width, _, dashes = styles[label]
        ax.plot(range(1, len(gap) + 1), gap, color=colours[label], linewidth=width, linestyle=dashes)
    ax.set_ylim(-1.1 * top, 1.1 * top)
    ax.set(title="difference from fp32 (moving averages, loss units); the band is the tolerance",
           xlabel="optimizer step", ylabel="loss - fp32's")
    ax.grid(True, alpha=0.3)


def _plot_scales(ax: Any, scaled: dict[str, _Curves], colours: dict[str, str]) -> None:
    for label, c in scaled.items():
        ax.step(range(1, len(c.scale) + 1), c.scale, where="post", color=colours[label], label=label)
        if c.skipped:
            ax.plot(c.skipped, [c.scale[s - 1] for s in c.skipped], linestyle="none", marker="x", markersize=8,
                    markeredgewidth=2, color=colours[label], label=f"{label}: skipped, scale backed off")
    ax.set_yscale("log", base=2)
    ax.set(title="loss scale after each step", xlabel="optimizer step", ylabel="scale (log2 axis)")
    if SCALER_RUN in scaled:
        ax.text(0.02, 0.97, f"{SCALER_RUN}: bf16 needs no scaler; this run uses one\nto show it: the scale "
                            "doubles after every\ngrowth interval of clean steps (shortened to\na tenth of the "
                            "run) and halves on an overflow", transform=ax.transAxes, va="top", fontsize=8.5)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8.5, loc="lower right")


def format_table(rows: list[dict[str, Any]]) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = ["precision", "final loss", "best val", "skipped", "final scale", "ms/step", "peak MB", "max gap", "agrees"]
    lines = [head]
    for r in rows:
        lines.append([r["precision"], f(r["final_loss"], ".4f"), f(r["best_val_loss"], ".4f"),
                      str(r["steps_skipped"]), f(r["final_scale"], "g"), f(r["time_per_step_ms"], ".1f"),
                      f(r["peak_memory_mb"], ".1f"), f(r["max_gap_to_fp32"], ".4f"),
                      "yes" if r["agrees"] else "NO"])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    table = "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in lines)
    warm = sorted({r["warmup_steps"] for r in rows})
    return table + (f"\nms/step: the median step after {' or '.join(map(str, warm))} warm-up steps in each "
                    "precision, which are not counted (they pay the precision's one-time costs)" if rows else "")
