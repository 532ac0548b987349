"""Overhead of ``ampspec audit``: time per step of a script audited against the same script unaudited.

Four candidates run the same user script (``bench/_audit_workload.py``, the canonical
GradScaler loop with for-loop AdamW on an MLP) in this process: ``plain`` (``runpy``, no
audit), ``order-rules`` (the audit with ``--no-replay``: the instrumentation and the order
rules, no copies), ``replay`` (the full audit as it runs by default: every step's gradients,
parameters and state copied into shared memory and recomputed by ``reference`` in the replay
process) and ``replay-thread`` (the same replay on a thread of this process,
``AMPSPEC_AUDIT_REPLAY=thread``). Four sizes: ``tiny`` (the catalogue's 16-32-4 MLP, batch 8:
all overhead), ``mlp`` (width 256, depth 4, batch 64, 0.2M parameters), ``mlp-b512`` (the same
model at batch 512: the same replay, eight times the training work) and ``wide`` (width 1024,
depth 4, batch 256, 3.2M parameters). The replay's work grows with the parameters, the
training's with the parameters times the batch: the replay's ratio falls as the batch grows.

Method: R rounds; in each round every candidate runs one block of S steps (the order rotating
from round to round); the first W steps of a block are warm-up. A block's time is its median
step time (the time between consecutive step-end stamps); the ratio to ``plain`` is taken per
round and its median over rounds reported (bench/_harness.py). Targets: replay
under 2x, order rules under 1.1x.

    PYTHONPATH=. python bench/audit_overhead.py            # a few minutes on 2 cores
    PYTHONPATH=. python bench/audit_overhead.py --only mlp --rounds 5
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _harness  # noqa: E402  (puts the repository root on sys.path)
import _audit_timer  # noqa: E402

import torch  # noqa: E402

from audit.runner import run_script  # noqa: E402

SCRIPT = HERE / "_audit_workload.py"
SIZES = {
    "tiny": ["--width", "32", "--depth", "1", "--batch", "8"],
    "mlp": ["--width", "256", "--depth", "4", "--batch", "64"],
    "mlp-b512": ["--width", "256", "--depth", "4", "--batch", "512"],
    "wide": ["--width", "1024", "--depth", "4", "--batch", "256"],
}
CANDIDATES = ("plain", "order-rules", "replay", "replay-thread")


def run_block(candidate: str, size: str, steps: int) -> list[float]:
    """Step times of one block (all steps; the caller drops the warm-up)."""
    args = [*SIZES[size], "--steps", str(steps)]
    _audit_timer.STAMPS.clear()
    import time

    t0 = time.perf_counter()
    if candidate == "plain":
        saved = sys.argv
        sys.argv = [str(SCRIPT), *args]
        try:
            runpy.run_path(str(SCRIPT), run_name="__main__")
        finally:
            sys.argv = saved
    else:
        saved_mode = os.environ.get("AMPSPEC_AUDIT_REPLAY")
        if candidate == "replay-thread":
            os.environ["AMPSPEC_AUDIT_REPLAY"] = "thread"
        try:
            report = run_script(SCRIPT, args, replay=candidate.startswith("replay"))
        finally:
            if saved_mode is None:
                os.environ.pop("AMPSPEC_AUDIT_REPLAY", None)
            else:
                os.environ["AMPSPEC_AUDIT_REPLAY"] = saved_mode
        if report.error is not None or report.findings:
            raise RuntimeError(f"the audited workload is not clean:\n{report.text()}")
    stamps = [t0] + list(_audit_timer.STAMPS)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per block")
    ap.add_argument("--warmup", type=int, default=5, help="steps of each block not measured")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared machine)")
    ap.add_argument("--only", nargs="+", choices=sorted(SIZES), default=None)
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    torch.set_num_threads(args.threads)
    sizes = args.only or list(SIZES)
    results: dict = {"machine": _harness.machine(), "settings": vars(args), "sizes": {}}
    for size in sizes:
        run_block("replay", size, 2)  # imports, first-call costs: outside every measured block
        blocks: dict[str, list[float]] = {c: [] for c in CANDIDATES}
        means: dict[str, list[float]] = {c: [] for c in CANDIDATES}
        for r in range(args.rounds):
            for c in _harness.rotate(CANDIDATES, r):
                times = run_block(c, size, args.steps)[args.warmup:]
                blocks[c].append(_harness.median(times))
                means[c].append(sum(times) / len(times))
        row = {"median_step_ms": {c: 1e3 * _harness.median(blocks[c]) for c in CANDIDATES},
               "ratio_vs_plain": {c: _harness.paired_ratio(blocks, c, "plain") for c in CANDIDATES[1:]},
               "mean_ratio_vs_plain": {c: _harness.paired_ratio(means, c, "plain") for c in CANDIDATES[1:]}}
        results["sizes"][size] = row
        ms = row["median_step_ms"]
        ratio = row["ratio_vs_plain"]
        print(f"{size:8}  plain {ms['plain']:7.2f} ms/step" + "".join(
            f"   {c} {ms[c]:7.2f} (x{ratio[c]['median']:.3f})" for c in CANDIDATES[1:]), flush=True)
    path = _harness.write_result("audit_overhead", results, args.out)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
