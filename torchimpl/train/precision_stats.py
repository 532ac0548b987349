"""``logging.precision_stats: N``: per-layer precision statistics while training.

1. Every N optimizer steps (the steps whose 0-based index is a multiple of N: 0, N, 2N, ...)
   forward hooks on every module of the trained model record each module's first floating
   output of the step's first microbatch: its dtype, amax, headroom in bits to the dtype's
   largest finite value, and the fraction of its values in the dtype's subnormal range (the
   values underflow is eating into; training has no fp32 shadow, so values already flushed
   to zero cannot be told from true zeros). They are ``torchimpl.precision.health``'s functions, the ones
   the doctor uses and the conformance suite checks against the spec.
2. The rows go to ``precision_stats.csv`` in the run folder (``step, module, dtype, amax,
   headroom_bits, subnormal_fraction``), written at the end of each measured step, and as
   TensorBoard scalars ``precision/<module>/amax`` (and ``headroom_bits``, ``subnormal_fraction``)
   when the run writes TensorBoard. A resumed run cuts the file back to the resumed step. The
   file is a run file (``torchimpl.safe_files``): never written through a link, rewritten
   whole on a resume, a failed write named.
3. Off by default (0). A measured step reads every statistic on the host (a sync per module
   and statistic): ``bench/doctor_cost.py`` states the cost.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from torch import nn

from torchimpl.precision import health
from torchimpl.precision.probe import first_float
from torchimpl.run.folder import PRECISION_STATS
from torchimpl.train.callbacks import Callback
from torchimpl.safe_files import open_run_file, replace_text, writing
from torchimpl.run.metrics import TensorBoardMetrics

__all__ = ["COLUMNS", "FILE_NAME", "PrecisionStats", "precision_stats_callbacks"]

COLUMNS = ("step", "module", "dtype", "amax", "headroom_bits", "subnormal_fraction")
FILE_NAME = PRECISION_STATS


def precision_stats_callbacks(config: Any) -> list[Any]:
    """The callback for ``logging.precision_stats`` (none when it is 0)."""
    every = config.logging.precision_stats
    if not every:
        return []
    return [type("PrecisionStatsCallback", (PrecisionStats, Callback), {})(every)]


def _truncate(path: Path, step: int) -> None:
    """Keep the header and the rows of steps before ``step`` (rule 2)."""
    if not path.exists():
        return
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    kept = [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) < step]
    text = io.StringIO(newline="")
    csv.writer(text).writerows([list(COLUMNS), *kept])
    replace_text(path, text.getvalue(), what="precision statistics file")


class PrecisionStats:
    """Rules 1-2, as a trainer callback (``torchimpl.train.trainer.Callback``'s hooks)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.rows: list[dict[str, Any]] = []
        self._handles: list[Any] = []
        self._active = False
        self._seen: set[str] = set()
        self.path: Path | None = None
        self._tb: Any = None

    def on_fit_start(self, trainer: Any) -> None:
        folder = getattr(trainer, "log_dir", None)
        if folder is None:
            return
        self.path = Path(folder) / FILE_NAME
        step = trainer.state.step
        if step and self.path.exists():
            _truncate(self.path, step)
        else:
            with writing(self.path, "precision statistics file"), \
                    open_run_file(self.path, "w", what="precision statistics file") as f:
                csv.writer(f).writerow(COLUMNS)

        self._tb = next((s for s in getattr(trainer.reporter, "metrics", ()) if isinstance(s, TensorBoardMetrics)), None)
        for name, module in trainer.model.named_modules():
            if name:
                self._handles.append(module.register_forward_hook(self._hook(name)))
        self._arm(step)

    def _arm(self, step: int) -> None:
        self._active, self._step, self._seen = step % self.every == 0, step, set()

    def _hook(self, name: str):  # noqa: ANN202 - a forward hook
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._active or name in self._seen:
                return
            t = first_float(output)
            if t is None:
                return
            self._seen.add(name)
            with health.one_thread(t.device):
                amax = health.amax(t)
                row = {"step": self._step, "module": name, "dtype": str(t.dtype).replace("torch.", ""), "amax": amax,
                       "headroom_bits": health.headroom_bits(amax, t.dtype),
                       "subnormal_fraction": health.subnormal_fraction(t, t.dtype)}
            self.rows.append(row)

        return hook

    def on_step_end(self, trainer: Any, state: Any) -> None:
        self._flush()
        self._arm(state.step)

    def on_fit_end(self, trainer: Any, summary: Any) -> None:
        self._flush()
        self.release()

    def release(self) -> None:
        """Remove the forward hooks from the model; the trainer calls it on every exit, a failed fit's too."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _flush(self) -> None:
        if not self.rows or self.path is None:
            self.rows.clear()
            return
        with writing(self.path, "precision statistics file"), \
                open_run_file(self.path, "a", what="precision statistics file") as f:
            w = csv.writer(f)
            for r in self.rows:
                w.writerow([r[c] if not isinstance(r[c], float) else repr(r[c]) for c in COLUMNS])
        writer = getattr(self._tb, "_writer", None)
        if writer is not None:
            for r in self.rows:
                for key in ("amax", "headroom_bits", "subnormal_fraction"):
                    if math.isfinite(r[key]):
                        writer.add_scalar(f"precision/{r['module']}/{key}", r[key], r["step"])
        self.rows.clear()
