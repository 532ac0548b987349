"""The trainer's step time with ``train.compile`` against eager, on the CPU, in one run.

Three precisions: ``fp32``, ``bf16`` (autocast) and ``fp16`` with the loss scaler (the CPU runs
fp16 in fp32 with the scaler forced on: the scaler's code path, fp32 arithmetic). For each, an
eager and a compiled (``train.compile: true``, Inductor) Trainer train the embedded task
(``--task``, default the small transformer ``lm``) on the same batches.

Method: R rounds; in each round every candidate trains one fresh block of S steps (a new model,
a new Trainer), the order rotating from round to round. Step time is the time between
consecutive ``on_step_end`` marks; the first W steps of a block are warm-up (a compiled block's
first step compiles, or recompiles for the new model, or loads from the caches). The ratio
``compiled / eager`` is the median over rounds of the per-round ratio of the two blocks'
median step times.

Compile time is reported apart: ``first_step_s``, each compiled candidate's first step in round
0 (Dynamo's trace, AOTAutograd and Inductor's code generation and C++ build, plus one step), and
``eager_step_s`` beside it. Inductor's cache starts empty (a fresh temporary
``TORCHINDUCTOR_CACHE_DIR``, removed at the end; ``--cache DIR`` keeps one), so round 0's first
compiled candidate is cold; the later ones find Inductor's process state warm but compile
their own graphs.

    PYTHONPATH=. python bench/compile_cpu.py                  # ~3-6 minutes on 2 shared cores
    PYTHONPATH=. python bench/compile_cpu.py --rounds 3 --steps 20
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402  (puts the repository root on sys.path)

PRECISIONS = {  # name -> (precision.mode, train.force_scaler)
    "fp32": ("fp32", False),
    "bf16": ("bf16", False),
    "fp16+scaler": ("fp16", True),
}


def _block(task: str, size: str, precision: str, compiled: bool, steps: int, batch_size: int) -> list[float]:
    """One fresh Trainer's block of ``steps`` steps: the wall time of each step."""
    import torch

    from torchimpl.config.schema import Config
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Callback, Trainer

    mode, force = PRECISIONS[precision]
    cfg = Config.from_dict(dict(
        device="cpu", task=dict(name=task, size=size), precision=dict(mode=mode),
        train=dict(steps=steps, batch_size=batch_size, seed=0, compile=compiled, force_scaler=force,
                   log_interval=steps, threads=torch.get_num_threads()),
        logging=dict(dir=None, progress="off"), checkpoint=dict(folder=None),
    ))
    built = build_task(cfg.task, seed=0, batch_size=batch_size)
    marks: list[float] = []

    class Marks(Callback):
        def on_fit_start(self, trainer):
            marks.append(time.perf_counter())

        def on_step_end(self, trainer, state):
            marks.append(time.perf_counter())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fp16 downgrade warns by design
        Trainer(cfg, callbacks=[Marks()]).fit(built.model, built.train_data)
    return [b - a for a, b in zip(marks, marks[1:])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="lm", choices=("lm", "mlp"))
    p.add_argument("--size", default="small", choices=("tiny", "small"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="steps per block")
    p.add_argument("--warmup", type=int, default=5, help="steps of each block left out")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--cache", default=None, help="Inductor cache folder to use and keep (default: a fresh one)")
    p.add_argument("--out", default=None, help="folder for compile_cpu.json (default bench/results)")
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error("--warmup must be below --steps")
    fresh = args.cache is None
    cache = tempfile.mkdtemp(prefix="ampspec-bench-inductor-") if fresh else args.cache
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # before Inductor reads it
    try:
        return _run(args, fresh)
    finally:
        if fresh:
            shutil.rmtree(cache, ignore_errors=True)


def _run(args: argparse.Namespace, fresh_cache: bool) -> int:
    import torch

    candidates = [(prec, compiled) for prec in PRECISIONS for compiled in (False, True)]
    blocks: dict[str, list[float]] = {}
    first: dict[str, float] = {}
    for r in range(args.rounds):
        for prec, compiled in _harness.rotate(candidates, r) if r else candidates:
            name = f"{prec}{'+compile' if compiled else ''}"
            times = _block(args.task, args.size, prec, compiled, args.steps, args.batch_size)
            if r == 0:
                first[name] = times[0]
            blocks.setdefault(name, []).append(_harness.median(times[args.warmup:]))
            print(f"round {r} {name:22s} median step {blocks[name][-1] * 1e3:8.2f} ms, first {times[0]:.2f} s",
                  flush=True)
    rows = {}
    for prec in PRECISIONS:
        eager, comp = prec, f"{prec}+compile"
        rows[prec] = {
            "eager_step_ms": _harness.median(blocks[eager]) * 1e3,
            "compiled_step_ms": _harness.median(blocks[comp]) * 1e3,
            "ratio_compiled_vs_eager": _harness.paired_ratio(blocks, comp, eager),
            "first_step_s": first[comp],
            "eager_first_step_s": first[eager],
        }
    data = {
        "machine": _harness.machine(),
        "task": f"{args.task} ({args.size}), batch {args.batch_size}",
        "method": {"rounds": args.rounds, "steps_per_block": args.steps, "warmup": args.warmup,
                   "inductor_cache": "fresh (empty at start)" if fresh_cache else args.cache,
                   "threads": torch.get_num_threads()},
        "rows": rows,
    }
    path = _harness.write_result("compile_cpu", data, args.out)
    print(f"\n{'precision':14s} {'eager ms':>9s} {'compiled ms':>12s} {'ratio':>7s} {'(min-max)':>13s} "
          f"{'first compiled step s':>22s}")
    for prec, row in rows.items():
        q = row["ratio_compiled_vs_eager"]
        print(f"{prec:14s} {row['eager_step_ms']:9.2f} {row['compiled_step_ms']:12.2f} {q['median']:7.2f} "
              f"{q['min']:6.2f}-{q['max']:<6.2f} {row['first_step_s']:22.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
