"""Per-step overhead of torchimpl's Trainer against a hand-written AMP loop, Accelerate and Fabric.

Same model, initial weights, batches, bf16 autocast, ``loss / k`` accumulation over k
microbatches, clipping at norm 1.0 and for-loop AdamW for every candidate (see
``bench/_loops.py``); two configurations: plain bf16, and bf16 with a loss scaler forced on
(the scaler code path, which on a GPU would be fp16's). Two models from ``torchimpl.task.builtin``:
the small MLP (overhead-dominated) and the small transformer.

Method: R rounds; in each round every candidate trains one fresh block of S steps, the order
rotating from round to round; the first W steps of a block are warm-up. Step time is the time
between consecutive ``step_end`` marks. Two ratios to the hand loop, each the median over
rounds of the per-round ratio of block times:

- ``ratio_vs_hand``: a block's time is its median step time: the typical step, which leaves
  out work done once every ``LOG_INTERVAL`` steps (the Trainer's log-point flush, the other
  loops' loss read);
- ``mean_ratio_vs_hand``: a block's time is its mean step time, so that work counts at its
  amortised share. W and S - W are multiples of ``LOG_INTERVAL``, so every candidate's
  measured steps hold the same number of log points.

Beside each ratio, the fixed cost per step in microseconds: the median over rounds of the
per-round difference of the same block times (candidate minus hand loop), from the same paired
rounds (``fixed_cost_us`` and ``mean_fixed_cost_us``). On a model whose step is short (the MLP)
that is what a framework adds to every step whatever the model; a ratio alone hides it behind
the step's length.

    PYTHONPATH=. python bench/trainer_overhead.py            # ~1-2 minutes on 2 cores
    PYTHONPATH=. python bench/trainer_overhead.py --profile  # plus a cProfile of each loop
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402  (puts the repository root on sys.path)
from _loops import LOG_INTERVAL, RUNNERS, Unsupported, Workload, add_baseline, available  # noqa: E402

import torch  # noqa: E402

from torchimpl.config.schema import TaskConfig  # noqa: E402
from torchimpl.task.builtin import build_task  # noqa: E402


def make_workloads(k: int, batch_size: int, n_batches: int) -> list[Workload]:
    out = []
    for task in ("mlp", "lm"):
        built = build_task(TaskConfig(name=task, size="small"), seed=0, batch_size=batch_size)
        batches = [built.train_data.batch(0, i) for i in range(n_batches)]
        for use_scaler in (False, True):
            label = f"{task}/bf16" + ("+scaler" if use_scaler else "")
            out.append(Workload(label, built.model, batches, k, use_scaler=use_scaler, fused=False))
    return out


def time_block(runner, w: Workload, steps: int, warmup: int) -> list[float]:
    marks: list[float] = []

    def mark(event: str) -> None:
        if event == "step_end":
            marks.append(time.perf_counter())

    t0 = time.perf_counter()
    runner(w, steps, mark)
    stamps = [t0] + marks
    return [b - a for a, b in zip(stamps, stamps[1:])][warmup:]


def profile_block(runner, w: Workload, steps: int, top: int = 25) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    runner(w, steps, lambda e: None)
    elapsed = time.perf_counter() - t0
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    stats.print_stats(top)
    return {"wall_s": elapsed, "steps": steps, "top_by_tottime": buf.getvalue()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per block")
    ap.add_argument("--warmup", type=int, default=10, help="steps of each block not measured")
    ap.add_argument("--k", type=int, default=2, help="microbatches per optimizer step")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: steadier on a shared machine)")
    ap.add_argument("--profile", action="store_true", help="also cProfile one block of each candidate")
    ap.add_argument("--only", nargs="+", default=None, metavar="CONFIG",
                    help="run only these configurations (e.g. mlp/bf16+scaler)")
    ap.add_argument("--against", default=None, metavar="REV",
                    help="also run the Trainer of this git revision, paired with today's (e.g. HEAD~1)")
    ap.add_argument("--no-peers", action="store_true", help="leave out Accelerate and Fabric")
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = ap.parse_args(argv)
    if args.warmup % LOG_INTERVAL or (args.steps - args.warmup) % LOG_INTERVAL or args.steps <= args.warmup:
        ap.error(f"--warmup and --steps minus --warmup must be multiples of the log interval ({LOG_INTERVAL}), "
                 f"the latter positive, so that every candidate's measured steps hold the same log points; "
                 f"got --warmup {args.warmup} --steps {args.steps}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    skipped_peers = available()
    if args.no_peers:
        skipped_peers = {n: "left out (--no-peers)" for n in skipped_peers}
    baseline = add_baseline(args.against) if args.against else None
    workloads = make_workloads(args.k, args.batch_size, args.steps * args.k)
    if args.only:
        unknown = sorted(set(args.only) - {w.name for w in workloads})
        if unknown:
            ap.error(f"--only: unknown configuration(s) {unknown}; choose from {[w.name for w in workloads]}")
        workloads = [w for w in workloads if w.name in args.only]
    results: dict = {"machine": _harness.machine(), "settings": vars(args), "configs": {}}

    for w in workloads:
        names = [n for n in RUNNERS if skipped_peers.get(n) is None]
        skip: dict[str, str] = {n: r for n, r in skipped_peers.items() if r}
        # Warm-up block per candidate (imports, allocator, first-call paths); also finds the
        # candidates that cannot run this configuration.
        for n in list(names):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    time_block(RUNNERS[n], w, min(args.steps, 10), 0)
            except Unsupported as exc:
                skip[n] = str(exc)
                names.remove(n)
        samples: dict[str, list[float]] = {n: [] for n in names}
        block_medians: dict[str, list[float]] = {n: [] for n in names}
        block_means: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in _harness.rotate(names, r):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    times = time_block(RUNNERS[n], w, args.steps, args.warmup)
                samples[n] += times
                block_medians[n].append(_harness.median(times))
                block_means[n].append(sum(times) / len(times))
        cfg: dict = {"candidates": {}, "skipped": skip}
        for n in names:
            cfg["candidates"][n] = {
                "median_step_ms": 1e3 * _harness.median(samples[n]),
                "mean_step_ms": 1e3 * sum(samples[n]) / len(samples[n]),
                "p10_step_ms": 1e3 * _harness.quantile(samples[n], 0.1),
                "p90_step_ms": 1e3 * _harness.quantile(samples[n], 0.9),
                "steps_measured": len(samples[n]),
                "ratio_vs_hand": _harness.paired_ratio(block_medians, n, "hand"),
                "mean_ratio_vs_hand": _harness.paired_ratio(block_means, n, "hand"),
                "fixed_cost_us": _us(_harness.paired_difference(block_medians, n, "hand")),
                "mean_fixed_cost_us": _us(_harness.paired_difference(block_means, n, "hand")),
            }
        if args.profile:
            cfg["profiles"] = {n: profile_block(RUNNERS[n], w, args.steps) for n in names}
        results["configs"][w.name] = cfg
        if baseline is not None:
            cfg["new_vs_baseline"] = {
                "by_median_step": _harness.paired_ratio(block_medians, "ampspec", baseline),
                "by_mean_step": _harness.paired_ratio(block_means, "ampspec", baseline),
                "us_by_median_step": _us(_harness.paired_difference(block_medians, "ampspec", baseline)),
                "us_by_mean_step": _us(_harness.paired_difference(block_means, "ampspec", baseline)),
            }
        line = ", ".join(_versus_hand(n, cfg["candidates"][n]) for n in names if n != "hand")
        print(f"{w.name}: hand {cfg['candidates']['hand']['median_step_ms']:.2f} ms/step; vs hand: {line}"
              + (f"; skipped {sorted(skip)}" if skip else ""), flush=True)
        if baseline is not None:
            nb = cfg["new_vs_baseline"]
            print(f"  ampspec / {baseline}: {nb['by_median_step']['median']:.3f} "
                  f"({nb['us_by_median_step']['median']:+.1f} us/step) by median step time, "
                  f"{nb['by_mean_step']['median']:.3f} ({nb['us_by_mean_step']['median']:+.1f} us/step) "
                  "by mean step time", flush=True)
        for n, why in skip.items():
            print(f"  skipped {n}: {why}", flush=True)

    path = _harness.write_result("trainer_overhead", results, args.out)
    ours = [c["candidates"]["ampspec"] for c in results["configs"].values()]
    worst = max(c["ratio_vs_hand"]["median"] for c in ours)
    worst_mean = max(c["mean_ratio_vs_hand"]["median"] for c in ours)
    # The fixed cost is read on the MLP: on the transformer the rounds' spread exceeds it.
    mlp = [c["candidates"]["ampspec"] for name, c in results["configs"].items() if name.startswith("mlp/")]
    fixed = ""
    if mlp:
        fixed = (f"; worst fixed cost on the MLP {max(c['fixed_cost_us']['median'] for c in mlp):+.1f} us/step by "
                 f"median, {max(c['mean_fixed_cost_us']['median'] for c in mlp):+.1f} us/step by mean")
    print(f"trainer_overhead: ampspec/hand worst ratio {worst:.3f}x by median step time, {worst_mean:.3f}x by mean "
          f"step time{fixed}; over {len(workloads)} configs -> {path}")
    return 0


def _us(summary: dict[str, float]) -> dict[str, float]:
    """A :func:`_harness.paired_difference` of times in seconds, in microseconds."""
    return {k: v if k == "rounds" else 1e6 * v for k, v in summary.items()}


def _versus_hand(name: str, row: dict) -> str:
    """``ampspec 1.012x +11.8 us/step (mean 1.020x +19.5 us/step)``: a candidate's ratios to the
    hand loop, each with its fixed cost per step."""
    return (f"{name} {row['ratio_vs_hand']['median']:.3f}x {row['fixed_cost_us']['median']:+.1f} us/step"
            f" (mean {row['mean_ratio_vs_hand']['median']:.3f}x {row['mean_fixed_cost_us']['median']:+.1f} us/step)")


if __name__ == "__main__":
    raise SystemExit(main())
