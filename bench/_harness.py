"""Shared helpers of the benchmark scripts: machine description, statistics, JSON output.

Every script runs its candidates in one process, interleaved round by round (the order
rotates each round), after warm-up, and reports medians and ratios. On a shared CPU an
absolute time means little; a ratio between candidates measured in the same rounds does.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

RESULTS = Path(__file__).resolve().parent / "results"

# Run from a checkout without installing: the repository root on the path.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def machine() -> dict[str, Any]:
    """Where and with what the numbers were measured."""
    import numpy as np
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for name in ("accelerate", "lightning", "torchao", "hypothesis", "ml_dtypes"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "unknown")
        except Exception:  # an optional peer that is missing or broken is simply absent
            info[name] = None
    return info


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    i = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return float(s[i])


def rotate(items: Sequence[Any], r: int) -> list[Any]:
    """The round-``r`` order: a rotation, so no candidate always runs first or last."""
    n = len(items)
    return [items[(i + r) % n] for i in range(n)]


def paired_ratio(blocks: dict[str, list[float]], name: str, base: str) -> dict[str, float]:
    """Ratios of per-round block times (``name`` over ``base`` in the same round), summarised.

    Pairing by round cancels the slow drift of a shared machine's load.
    """
    pairs = [a / b for a, b in zip(blocks[name], blocks[base]) if b > 0]
    return {
        "median": median(pairs),
        "min": min(pairs) if pairs else float("nan"),
        "max": max(pairs) if pairs else float("nan"),
        "rounds": len(pairs),
    }


def paired_difference(blocks: dict[str, list[float]], name: str, base: str) -> dict[str, float]:
    """Differences of per-round block times (``name`` minus ``base`` in the same round), summarised:
    what ``name`` adds to ``base``'s time, in the blocks' unit."""
    diffs = [a - b for a, b in zip(blocks[name], blocks[base])]
    return {
        "median": median(diffs),
        "min": min(diffs) if diffs else float("nan"),
        "max": max(diffs) if diffs else float("nan"),
        "rounds": len(diffs),
    }


def write_result(name: str, data: dict[str, Any], out_dir: str | Path | None = None) -> Path:
    folder = Path(out_dir) if out_dir is not None else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def require_valgrind(what: str) -> None:
    """Exit with a message naming ``what`` when Valgrind's callgrind tools are not on PATH
    (the instruction counts of ``--instructions`` and ``bench/step_instructions.py`` need them)."""
    missing = [tool for tool in ("valgrind", "callgrind_control", "callgrind_annotate") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"{what} needs Valgrind's {', '.join(missing)} on PATH (e.g. apt-get install valgrind)")
