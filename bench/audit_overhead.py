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

Model sizes (``--sizes 0.2M,3M,12.8M,50M``): the MLP of depth 4 at the width giving about that
many parameters (batch 64), each with ``plain``, ``order-rules``, ``replay`` (the default
sampling, ``auto``: the optimizer stage whole up to ``audit.sampling.AUTO_BUDGET`` elements, then
that many, and past ``AUTO_WHOLE_BUDGET`` elements every Nth step only; a block then holds
whole periods of N steps and the table reports the mean step) and ``replay-all`` (``--replay-sample all``: every element; left out above
``--whole-up-to`` parameters, whose copies would take gigabytes). Keep the large sizes to a few
steps: ``--steps 6 --warmup 2 --rounds 2``.

Method: R rounds; in each round every candidate runs one block of S steps (the order rotating
from round to round); the first W steps of a block are warm-up. A block's time is its median
step time (the time between consecutive step-end stamps); the ratio to ``plain`` is taken per
round and its median over rounds reported (bench/_harness.py). Targets: replay
under 2x, order rules under 1.1x. Beside the ratios: the replay process's CPU time a step
(user and system; the difference of a block of S steps and one of 2S, run after the rounds,
so that the worker's start and end cancel out).
The training and its replay run side by side, each step at the pace of the slower: where that
figure exceeds plain's step, the worker sets the replay's ratio, not the training's own cost.

Instructions (``--instructions``): where the timings drown in the load of a shared machine, the
script runs itself under ``valgrind --tool=callgrind --instr-atstart=no`` (imports and set-up
uncounted) and counts the instructions of one step of each candidate at each size: for each, a
block of ``--short`` steps and one of ``--short + --extra`` steps, the counts zeroed before and
dumped after each, the difference over ``--extra`` steps (the audit's start cancels out; its
report's share of a step stays in). It prints the candidates' counts per step and the audit's extra over ``plain``. Only this
process is counted: the replay's own arithmetic runs in its worker process (forked, uncounted),
so ``replay`` counts what the training pays for it (the copies, the jobs sent, any wait); with
``AMPSPEC_AUDIT_REPLAY=thread`` (``replay-thread``) it is counted whole. A proxy, as in
``bench/step_instructions.py``: 3.5 minutes for the three default candidates on the 2-core VM.

    PYTHONPATH=. python bench/audit_overhead.py            # a few minutes on 2 cores
    PYTHONPATH=. python bench/audit_overhead.py --only mlp --rounds 5
    PYTHONPATH=. python bench/audit_overhead.py --only mlp --instructions   # ~5 minutes
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _harness  # noqa: E402  (puts the repository root on sys.path)
import _audit_timer  # noqa: E402

import torch  # noqa: E402

from audit.runner import run_script  # noqa: E402
from audit.sampling import Sampling  # noqa: E402

SCRIPT = HERE / "_audit_workload.py"
SIZES = {
    "tiny": ["--width", "32", "--depth", "1", "--batch", "8"],
    "mlp": ["--width", "256", "--depth", "4", "--batch", "64"],
    "mlp-b512": ["--width", "256", "--depth", "4", "--batch", "512"],
    "wide": ["--width", "1024", "--depth", "4", "--batch", "256"],
}
CANDIDATES = ("plain", "order-rules", "replay", "replay-thread")
SIZE_CANDIDATES = ("plain", "order-rules", "replay", "replay-all")


def parse_size(label: str) -> tuple[int, list[str]]:
    """``12.8M`` (or ``200k``, ``50000000``): the width of the depth-4 MLP (64 in, 8 out) with about
    that many parameters, and its parameter count and workload arguments."""
    text = label.strip().upper()
    scale = {"K": 1e3, "M": 1e6}.get(text[-1:], 1.0)
    try:
        want = float(text[:-1] if text[-1:] in "KM" else text) * scale
    except ValueError:
        raise SystemExit(f"--sizes: {label!r} is not a parameter count such as 0.2M, 3M or 50M") from None
    width = max(8, round(((72 ** 2 + 12 * want) ** 0.5 - 72) / 6))  # 3w^2 + 72w + 8 parameters (+ biases)
    params = 64 * width + width + 3 * (width * width + width) + width * 8 + 8
    return params, ["--width", str(width), "--depth", "4", "--batch", "64"]


# CPU seconds (user and system) of the replay process over the latest ``replay`` block: the
# worker is this process's child, counted once it has ended (it ends with its audit).
LAST_WORKER_CPU: list[float] = [0.0]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_block(candidate: str, size: str, steps: int) -> list[float]:
    """Step times of one block (all steps; the caller drops the warm-up)."""
    args = [*SIZES[size], "--steps", str(steps)]
    children = _children_cpu()
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
            sample = {"replay_sample": "all"} if candidate == "replay-all" else {}
            report = run_script(SCRIPT, args, replay=candidate.startswith("replay"), **sample)
        finally:
            if saved_mode is None:
                os.environ.pop("AMPSPEC_AUDIT_REPLAY", None)
            else:
                os.environ["AMPSPEC_AUDIT_REPLAY"] = saved_mode
        if report.error is not None or report.findings:
            raise RuntimeError(f"the audited workload is not clean:\n{report.text()}")
    LAST_WORKER_CPU[0] = _children_cpu() - children
    stamps = [t0] + list(_audit_timer.STAMPS)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def instructions_inner(size: str, candidates: list[str], short: int, extra: int) -> None:
    """Under Valgrind: for each candidate, a block of ``short`` and of ``short + extra`` steps,
    each between a zeroing and a dump of the counts."""

    def control(*args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)

    for c in candidates:
        run_block(c, size, 2)  # first-call paths, uncounted
    control("-i", "on")
    for c in candidates:
        for steps in (short, short + extra):
            control("-z")
            run_block(c, size, steps)
            control("-d", f"{c}-{steps}")


def instructions(size: str, candidates: list[str], args: argparse.Namespace) -> dict:
    """Instructions per step of each candidate at ``size`` (`instructions_inner` under Valgrind)."""
    from step_instructions import dump_totals

    with tempfile.TemporaryDirectory(prefix="ampspec-callgrind-") as folder:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={folder}/cg.out",
               sys.executable, __file__, "--inner-instructions", "--only", size, "--short", str(args.short),
               "--extra", str(args.extra), "--threads", str(args.threads), "--candidates", *candidates]
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        dumps = {}
        for path in Path(folder).glob("cg.out*"):
            head = path.read_text(errors="replace")[:3000]
            m = re.search(r"^desc: Trigger: dump (.*)$", head, re.M)
            if m:
                dumps[m.group(1)] = dump_totals(path)[0]
    if len(dumps) != 2 * len(candidates):
        raise SystemExit(f"{size}: valgrind left {len(dumps)} of {2 * len(candidates)} dumps; its output ends:\n"
                         + (done.stdout + done.stderr)[-2000:])
    per_step = {c: (dumps[f"{c}-{args.short + args.extra}"] - dumps[f"{c}-{args.short}"]) / args.extra
                for c in candidates}
    plain = per_step.get("plain")
    print(f"{size:8}" + "".join(
        f"   {c} {n / 1e6:.3f} M" + (f" ({(n - plain) / 1e3:+.1f} k)" if plain is not None and c != "plain" else "")
        for c, n in per_step.items()) + "  instructions/step", flush=True)
    return {"instructions_per_step": per_step}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per block")
    ap.add_argument("--warmup", type=int, default=5, help="steps of each block not measured")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared machine)")
    ap.add_argument("--only", nargs="+", choices=sorted(SIZES), default=None)
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    ap.add_argument("--sizes", default=None, help="parameter counts of the MLP instead of the named sizes, "
                    "e.g. 0.2M,3M,12.8M,50M (candidates: plain, order-rules, replay, replay-all)")
    ap.add_argument("--whole-up-to", type=float, default=13e6,
                    help="with --sizes: run replay-all only up to this many parameters")
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions per step under Valgrind's callgrind instead of timing")
    ap.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=["plain", "order-rules", "replay"],
                    help="with --instructions: the candidates counted")
    ap.add_argument("--short", type=int, default=3, help="with --instructions: steps of the shorter block")
    ap.add_argument("--extra", type=int, default=5, help="with --instructions: steps the longer block adds")
    ap.add_argument("--inner-instructions", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    torch.set_num_threads(args.threads)
    if args.inner_instructions:
        instructions_inner(args.only[0], args.candidates, args.short, args.extra)
        return 0
    if args.instructions:
        _harness.require_valgrind("--instructions")
        if args.sizes:
            ap.error("--instructions counts the named sizes (--only), not --sizes")
        counted = {"machine": _harness.machine(), "settings": vars(args), "sizes": {}}
        for size in args.only or ["mlp"]:
            counted["sizes"][size] = instructions(size, args.candidates, args)
        print(f"results: {_harness.write_result('audit_instructions', counted, args.out)}")
        return 0
    results: dict = {"machine": _harness.machine(), "settings": vars(args), "sizes": {}}
    if args.sizes:
        for label in args.sizes.split(","):
            params, SIZES[label] = parse_size(label)
            cands = tuple(c for c in SIZE_CANDIDATES if c != "replay-all" or params <= args.whole_up_to)
            # Whole periods of the default's replayed steps (audit.sampling: every Nth past a size),
            # so that a block's mean step holds its share of replayed steps.
            every = Sampling().every_for(params)
            measured = -(-(args.steps - args.warmup) // every) * every
            row = measure(label, cands, args, steps=args.warmup + measured)
            row["parameters"], row["replay_every"], row["steps_measured"] = params, every, measured
            results["sizes"][label] = row
    else:
        for size in args.only or list(SIZES):
            results["sizes"][size] = measure(size, CANDIDATES, args)
    if args.sizes:
        # The mean step: with every Nth step replayed, the median step would be an unreplayed one.
        print("parameters  every  " + "  ".join(f"{c:>12}" for c in SIZE_CANDIDATES[1:])
              + "   (ratio of the mean step to plain's, median over rounds)")
        for label, row in results["sizes"].items():
            print(f"{row['parameters']:>10}  {row['replay_every']:>5}  " + "  ".join(
                f"{'x%.3f' % row['mean_ratio_vs_plain'][c]['median'] if c in row['mean_ratio_vs_plain'] else '-':>12}"
                for c in SIZE_CANDIDATES[1:]))
    path = _harness.write_result("audit_overhead", results, args.out)
    print(f"results: {path}")
    return 0


def measure(size: str, candidates: tuple[str, ...], args: argparse.Namespace, steps: int | None = None) -> dict:
    """Interleaved paired rounds of ``candidates`` at one size (``steps`` a block, default
    ``--steps``); prints and returns its row."""
    steps = steps or args.steps
    run_block("replay", size, 2)  # imports, first-call costs: outside every measured block
    blocks: dict[str, list[float]] = {c: [] for c in candidates}
    means: dict[str, list[float]] = {c: [] for c in candidates}
    for r in range(args.rounds):
        for c in _harness.rotate(candidates, r):
            times = run_block(c, size, steps)[args.warmup:]
            blocks[c].append(_harness.median(times))
            means[c].append(sum(times) / len(times))
    worker: list[float] = []  # the replay process's CPU ms a step
    if "replay" in candidates:
        # Two blocks, of S and 2S steps: their difference leaves out the worker's start and end.
        cpu = []
        for n in (steps, 2 * steps):
            run_block("replay", size, n)
            cpu.append(LAST_WORKER_CPU[0])
        worker.append(1e3 * (cpu[1] - cpu[0]) / steps)
    row = {"median_step_ms": {c: 1e3 * _harness.median(blocks[c]) for c in candidates},
           "ratio_vs_plain": {c: _harness.paired_ratio(blocks, c, "plain") for c in candidates[1:]},
           "mean_ratio_vs_plain": {c: _harness.paired_ratio(means, c, "plain") for c in candidates[1:]}}
    if worker:
        # The replay runs at the pace of whichever is slower, the training or its worker: a worker
        # busier than plain's step is what sets the replay's ratio.
        row["replay_process_cpu_ms_per_step"] = worker[0]
    ms = row["median_step_ms"]
    ratio = row["ratio_vs_plain"]
    print(f"{size:8}  plain {ms['plain']:7.2f} ms/step" + "".join(
        f"   {c} {ms[c]:7.2f} (x{ratio[c]['median']:.3f})" for c in candidates[1:])
        + (f"   (replay process: {row['replay_process_cpu_ms_per_step']:.2f} ms CPU/step)" if worker else ""),
        flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
