"""Float8 training on the CPU against bf16: what the emulation costs, and that it trains.

On a CPU torch has no float8 matmul: torchao's scaled matmuls run as torch's emulation (float32
GEMMs of the pre-scaled operands; MX operands dequantized). So this is a correctness
demonstration with its cost against bf16, never a speed claim; float8's speed needs a GPU
(``bench/precision_gpu.py``).

The ampspec trainer trains the embedded task (the small reversal transformer, ``--task``) from
the same seed and data in bf16 and in ``precision.mode=fp8`` with each recipe, interleaved
round by round (the order rotating). Per candidate: the median over rounds of the per-round
ratio of step time to bf16's (``RunSummary.time_per_step_s``, evaluation excluded), the final
training and validation losses, and which layers ran in float8.

    PYTHONPATH=. python bench/fp8_cpu.py [--rounds 3] [--steps 60] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

import torch  # noqa: E402

CANDIDATES = ("bf16", "fp8:tensorwise", "fp8:rowwise", "fp8:rowwise_with_gw_hp", "fp8:mxfp8")


def run(candidate: str, args) -> dict:
    from torchimpl.config.schema import load_config
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Trainer

    mode, _, recipe = candidate.partition(":")
    sets = ["device=cpu", f"task.name={args.task}", f"train.steps={args.steps}", f"precision.mode={mode}",
            "train.log_interval=20", f"train.eval_interval={args.steps}", "optimizer.lr=3.0e-3",
            "schedule.warmup_steps=5", "logging.dir=null", "logging.progress=off"] + ([f"precision.fp8_recipe={recipe}"] if recipe else [])
    cfg = load_config(overrides=sets)
    task = build_task(cfg.task, seed=0, batch_size=cfg.train.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = Trainer(cfg).fit(task.model, task.train_data, task.val_data, loss_fn=task.loss_fn)
    return {"step_s": s.time_per_step_s, "final_train_loss": s.final_train_loss, "val_loss": s.final_val_loss,
            "fp8": s.fp8}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--task", default="lm", choices=["lm", "mlp"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = ap.parse_args(argv)
    from torchimpl.precision.fp8 import torchao_available

    if not torchao_available():
        print("fp8_cpu: torchao is not installed (pip install '.[fp8]'): nothing measured")
        return 0
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    per: dict[str, list[dict]] = {c: [] for c in CANDIDATES}
    for r in range(args.rounds):
        for c in _harness.rotate(CANDIDATES, r):
            per[c].append(run(c, args))
    blocks = {c: [x["step_s"] for x in runs] for c, runs in per.items()}
    rows = {}
    for c, runs in per.items():
        last = runs[-1]
        rows[c] = {"step_ms_median": 1e3 * _harness.median(blocks[c]),
                   "ratio_to_bf16": _harness.paired_ratio(blocks, c, "bf16"),
                   "final_train_loss": last["final_train_loss"], "val_loss": last["val_loss"],
                   "float8_layers": last["fp8"]["converted"] if last["fp8"] else None}
    results = {"machine": _harness.machine(), "settings": vars(args), "emulated": True,
               "note": "float8 matmuls on the CPU are torch's emulation: cost against bf16, not a speed claim",
               "rows": rows, "wall_s": time.perf_counter() - t0}
    path = _harness.write_result("fp8_cpu", results, args.out)
    print(f"{'candidate':24} {'ms/step':>8} {'x bf16':>7} {'train loss':>10} {'val loss':>9}")
    for c, row in rows.items():
        print(f"{c:24} {row['step_ms_median']:8.1f} {row['ratio_to_bf16']['median']:7.2f} "
              f"{row['final_train_loss']:10.4f} {row['val_loss']:9.4f}")
    print(f"(float8 emulated on the CPU: a correctness run, not a speed-up) -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
