"""The doctor's picture (``ampspec doctor --plot``): what a person reads at a glance.

1. One row per leaf module: a module none of whose recorded submodules has a row. Containers
   are folded (their output is a child's, or a sum of what the children's rows show); a
   verdict on a container is written below the panels, as every verdict is.
2. Four panels per precision, the rows shared: the forward pass's headroom to overflow (bits
   from the fp32 shadow's amax to the output format's largest value; negative: the values do
   not fit) and its underflow (% of the shadow's non-zero outputs that are zero in the mixed
   run); the gradient's headroom to overflow at the loss scale (bits from the scaled
   gradient's amax to the format's largest value) and its underflow at the loss scale (% of
   the shadow's non-zero gradient entries that flush at the scale). The 0-bit line (the
   format's largest value) and the 0.1 % line (what a loss scale may lose) are drawn.
3. Colours: a row with an error verdict red, with a warning orange (the error wins), else
   blue; each bar is labelled with its number (infinite headroom, an all-zero tensor, is
   labelled and not drawn).
4. Under each precision's panels, its verdicts (severity, kind, module, message, fix),
   wrapped, coloured as their rows; a healthy report says so.
5. Fonts of 10 to 12 points at the figure's own size (100 dpi), so the saved PNG is read
   without zooming. The file is written to a temporary file in its folder and renamed into
   place (a link at the path is refused), like the JSON report.
"""

from __future__ import annotations

import math
import os
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import torch

from torchimpl.precision import health

__all__ = ["COLORS", "PANELS", "doctor_figure", "leaf_layers", "save_plot"]

_PLOT_EXTRA = "pip install 'ampspec[plot]'"
COLORS = {"error": "tab:red", "warning": "tab:orange", None: "tab:blue"}
"""Rule 3: a row's colour by the worst severity of its verdicts."""
PANELS = ("forward: overflow headroom (bits)", "forward: underflow (% flushed)",
          "gradient: overflow headroom (bits, at scale)", "gradient: underflow (% at scale)")
"""Rule 2: the panels' titles, in order."""
_WRAP = 150
_TICK, _LABEL, _TITLE = 10, 11, 12


def leaf_layers(layers: list[Any]) -> list[Any]:
    """Rule 1: the layers (``LayerStats``) of modules with no recorded submodule, in order."""
    names = [s.name for s in layers]
    return [s for s in layers if not any(other.startswith(s.name + ".") for other in names)]


def _severity(report: Any) -> dict[str | None, str]:
    worst: dict[str | None, str] = {}
    for v in report.verdicts:
        if worst.get(v.module) != "error":
            worst[v.module] = v.severity
    return worst


def _bits(value: float, dtype: str) -> float:
    if not dtype or value == 0:
        return math.inf
    return health.headroom_bits(value, getattr(torch, dtype))


def _numbers(s: Any) -> tuple[float, float, float, float]:
    """Rule 2's four numbers for one row (NaN where the layer has none: an output it shares)."""
    if not s.dtype:
        return math.nan, math.nan, math.nan, math.nan
    return (s.headroom_bits, 100 * s.underflow, _bits(s.grad_amax_scaled, s.dtype) if s.grad_flushed[1] else math.nan,
            100 * s.grad_underflow_at_scale)


def _label(x: float, fmt: str) -> str:
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return format(x, fmt)


def _verdict_lines(report: Any) -> list[tuple[str, str]]:
    """Rule 4: (text, colour) lines."""
    if not report.verdicts:
        return [("no verdict: healthy in this precision", "black")]
    out = []
    for v in report.verdicts:
        where = v.module if v.module is not None else "<model>"
        colour = COLORS[v.severity]
        for i, line in enumerate(textwrap.wrap(f"[{v.severity}] {v.kind} in {where}: {v.message}", _WRAP)):
            out.append(("    " + line if i else line, colour))
        out += [("        " + line, colour) for line in textwrap.wrap(f"fix: {v.fix}", _WRAP - 8)]
    return out


def doctor_figure(reports: list[Any]) -> Any:
    """Rules 1-5 as a matplotlib ``Figure`` (one block of panels and verdicts per report)."""
    # optional dependency: the picture is drawn only where matplotlib is installed
    import matplotlib.pyplot as plt

    blocks = [(rep, leaf_layers(rep.layers), _verdict_lines(rep)) for rep in reports]
    heights = [0.34 * max(len(rows), 1) + 1.3 + 0.24 * len(lines) + 0.4 for _, rows, lines in blocks]
    fig = plt.figure(figsize=(17, sum(heights) + 0.7), dpi=100)
    head, body = fig.subfigures(2, 1, height_ratios=[0.7, sum(heights)])
    head.text(0.5, 0.5, "ampspec doctor: one row per leaf module; red: an error's module, orange: a warning's; "
              "0 bits: the format's largest value; dashed: 0.1 %", fontsize=_TITLE, ha="center", va="center")
    subs = body.subfigures(len(blocks), 1, height_ratios=heights, squeeze=False)[:, 0]
    for sub, (rep, rows, lines) in zip(subs, blocks):
        panels_h = 0.34 * max(len(rows), 1) + 1.3
        top, bottom = sub.subfigures(2, 1, height_ratios=[panels_h, 0.24 * len(lines) + 0.4])
        _panels(top, rep, rows)
        top.suptitle(f"{rep.precision} on {rep.device}, {rep.steps} steps", fontsize=_TITLE, x=0.02, ha="left",
                     fontweight="bold")
        for i, (text, colour) in enumerate(lines):
            bottom.text(0.02, 1 - (i + 0.8) / (len(lines) + 0.7), text, fontsize=_LABEL, color=colour, va="center",
                        family="monospace")
    return fig


def _panels(sub: Any, rep: Any, rows: list[Any]) -> None:
    worst = _severity(rep)
    names = [s.name if s.dtype or s.same_as is None else f"{s.name} (= {s.same_as})" for s in rows]
    colours = [COLORS[worst.get(s.name)] for s in rows]
    numbers = [_numbers(s) for s in rows]
    axes = sub.subplots(1, 4, sharey=True)
    for k, (ax, title) in enumerate(zip(axes, PANELS)):
        values = [row[k] for row in numbers]
        drawn = [v if math.isfinite(v) else 0.0 for v in values]
        bars = ax.barh(names, drawn, color=colours)
        for bar, v in zip(bars, values):
            if not math.isfinite(v):
                bar.set_visible(False)
        ax.bar_label(bars, labels=[_label(v, ".1f" if k % 2 == 0 else ".2f") for v in values], fontsize=_TICK - 1,
                     padding=2)
        ax.axvline(0 if k % 2 == 0 else 100 * 0.001, color="black" if k % 2 == 0 else "grey", lw=1,
                   ls="-" if k % 2 == 0 else "--")
        ax.set_title(title, fontsize=_LABEL)
        ax.tick_params(labelsize=_TICK)
        ax.margins(x=0.25)
    axes[0].invert_yaxis()
    sub.subplots_adjust(left=0.2, right=0.98, top=0.82, bottom=0.12, wspace=0.35)


def save_plot(reports: list[Any], path: str) -> str:
    """Rule 5: the figure written to ``path`` (PNG); needs matplotlib (the ``plot`` extra)."""
    try:
        # optional dependency: the picture is drawn only where matplotlib is installed
        import matplotlib

        matplotlib.use("Agg")
        # optional dependency: the picture is drawn only where matplotlib is installed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(f"--plot needs matplotlib: {_PLOT_EXTRA}") from None
    if Path(path).is_symlink():  # never written through: the command refuses it before the diagnosis
        raise ValueError(f"--plot {path} is a symbolic link; remove it or choose another path")
    fig = doctor_figure(reports)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{Path(path).name}-", dir=Path(path).resolve().parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path
