"""``ampspec compare``: the same model, seed and data in fp32, bf16, (on CUDA) fp16 and, when
torchao is installed, fp8 (torchao's tensorwise float8 recipe; emulated on a CPU, so its ms/step
there is the emulation's cost, not float8's speed).

Agreement rule (stated in the report): the curves are smoothed with a moving average over
``window`` steps; a precision agrees with fp32 when every smoothed point lies within
``rel_tol`` (relative) of fp32's smoothed point, or within ``abs_tol`` times fp32's starting
loss where that is larger (a relative band means nothing once the loss nears 0, and on the
steep part of the curve a shift of a few steps makes large pointwise gaps). The band is wider than the
step-to-step noise of a smoothed curve on these tasks and far narrower than a stalled or
diverged run, which is what the comparison is meant to catch.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from torchimpl.config import load_config
from torchimpl.device import resolve_device
from torchimpl.tasks import build_task
from torchimpl.trainer import Trainer

__all__ = ["CompareResult", "run_compare", "format_table"]

log = logging.getLogger(__name__)


@dataclass
class CompareResult:
    rows: list[dict[str, Any]]
    agree: bool
    rule: str
    seconds: float
    report_path: str
    png_path: str | None
    png_note: str | None


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def run_compare(*, steps: int = 200, device: str = "auto", out: str | Path = "ampspec-compare",
                task: str = "lm", seed: int = 0, window: int = 20, rel_tol: float = 0.10,
                abs_tol: float = 0.05) -> CompareResult:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dev = resolve_device(device)
    from torchimpl.fp8 import torchao_available

    modes = ["fp32", "bf16"] + (["fp16"] if dev.type == "cuda" else []) + (["fp8"] if torchao_available() else [])
    rows, curves, scales = [], {}, {}
    for mode in modes:
        cfg = load_config(overrides=[
            f"device={dev}", f"task.name={task}", f"precision.mode={mode}", f"train.steps={steps}",
            f"train.seed={seed}", "train.log_interval=50", f"train.eval_interval={max(steps // 5, 1)}",
            "optimizer.lr=3.0e-3", f"schedule.warmup_steps={max(steps // 20, 1)}",
            f"train.trace_file={out / f'trace-{mode}.jsonl'}", f"logging.dir={out / mode}",
        ])
        t = build_task(cfg.task, seed=seed, batch_size=cfg.train.batch_size)
        trainer = Trainer(cfg)
        summary = trainer.fit(t.model, t.train_data, t.val_data, loss_fn=t.loss_fn)
        curves[mode] = [loss for _, loss in trainer.loss_history]
        scales[mode] = [s for _, s in trainer.scale_history]
        rows.append({
            "precision": mode, "plan": summary.precision_mode, "final_loss": curves[mode][-1],
            "best_val_loss": summary.best_val_loss, "final_val_loss": summary.final_val_loss,
            "steps_skipped": summary.steps_skipped, "final_scale": summary.final_scale,
            "time_per_step_ms": summary.time_per_step_s * 1e3,
            "peak_memory_mb": None if summary.peak_memory_bytes is None else summary.peak_memory_bytes / 2**20,
            "downgrades": summary.downgrades,
        })
    ref = _smooth(curves["fp32"], window)
    agree = True
    floor = abs_tol * abs(ref[0])
    for row in rows:
        sm = _smooth(curves[row["precision"]], window)
        gaps = [abs(a - b) for a, b in zip(sm, ref)]
        row["max_gap_to_fp32"] = max(gaps)
        row["agrees"] = all(g <= max(rel_tol * abs(b), floor) for g, b in zip(gaps, ref))
        agree = agree and row["agrees"]
    rule = (f"{window}-step moving averages within {rel_tol:.0%} of fp32's, or within {abs_tol:.0%} of "
            f"fp32's starting loss where that is larger (near zero loss a relative band is meaningless)")
    report = {"device": str(dev), "task": task, "steps": steps, "seed": seed, "rule": rule,
              "agree": agree, "rows": rows, "loss_curves": curves, "scale_history": scales}
    report_path = out / "report.json"
    report_path.write_text(json.dumps(report, indent=1))
    png_path, note = _plot(curves, scales, out / "compare.png")
    return CompareResult(rows, agree, rule, time.perf_counter() - t0, str(report_path), png_path, note)


def _plot(curves, scales, path: Path) -> tuple[str | None, str | None]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "PNG skipped: matplotlib is not installed (pip install 'ampspec[plot]')"
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, c in curves.items():
        a.plot(_smooth(c, 20), label=mode)
    a.set(title="training loss (20-step moving average)", xlabel="optimizer step", ylabel="loss")
    a.legend()
    for mode, s in scales.items():
        b.plot(s, label=mode)
    b.set(title="loss scale (1 = no scaler)", xlabel="optimizer step", yscale="log")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path), None


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
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in lines)
