"""What each ``precision.master_weights`` option costs and what it keeps, against ``bf16-mixed``.

For the embedded task (``mlp`` or ``lm``, small) trained by ``torchimpl``'s Trainer with AdamW:

- ``bytes_per_parameter``: measured from the tensors the run holds after training (the
  parameters, the float32 masters, the compensation buffers and the optimizer's state tensors;
  no gradients), divided by the number of parameters;
- ``step_time_ratio``: the median over rounds of the per-round ratio of the candidate's mean
  step time to ``bf16-mixed``'s (bf16 autocast over float32 weights) in the same round; the
  candidates run interleaved, in an order rotating each round, each a fresh run of S steps
  whose first W are warm-up. The mean, not the median: on a shared machine a step is either
  uninterrupted or preempted for a scheduler slice (about 10 ms), and the share of preempted
  steps grows with the step's work, which a median hides. ``none`` counts its lost updates only at step 0 here (in the
  warm-up); the other options count theirs on every step, as the trainer does;
- ``lost_update_fraction``: the run summary's (``reference.health`` rule 12, counted on every
  applied step, ``train.log_interval=1``) after N steps, at the task's learning rate and at a
  small one (1e-5), with the final training loss.

    PYTHONPATH=. python bench/master_weights.py             # ~3 minutes on 2 cores
    PYTHONPATH=. python bench/master_weights.py --task lm --rounds 3
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402  (puts the repository root on sys.path)

import torch  # noqa: E402

from torchimpl.config.schema import load_config  # noqa: E402
from torchimpl.task.builtin import build_task  # noqa: E402
from torchimpl.train.callbacks import Callback  # noqa: E402
from torchimpl.train.trainer import Trainer  # noqa: E402

OPTIONS = ("none", "fp32", "kahan", "stochastic")
CANDIDATES = ("bf16-mixed",) + tuple(f"bf16-true/{o}" for o in OPTIONS)


class _Clock(Callback):
    """The time of each step's end."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_step_end(self, trainer, state) -> None:
        self.marks.append(time.perf_counter())


def _settings(candidate: str) -> list[str]:
    if candidate == "bf16-mixed":
        return ["precision.mode=bf16"]
    return ["precision.mode=bf16-true", f"precision.master_weights={candidate.split('/')[1]}"]


def _fit(task: str, candidate: str, steps: int, extra: list[str]) -> tuple[Trainer, object, _Clock]:
    cfg = load_config(overrides=[f"task.name={task}", "task.size=small", "device=cpu", f"train.steps={steps}",
                                 "logging.dir=null", "train.threads=1", *_settings(candidate), *extra],
                      task_defaults=True)
    built = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    clock = _Clock()
    trainer = Trainer(cfg, callbacks=[clock])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lost-update warning of none at a small rate
        summary = trainer.fit(built.model, built.train_data, loss_fn=built.loss_fn)
    return trainer, summary, clock


def bytes_per_parameter(trainer: Trainer) -> float:
    """The parameters, masters, compensation buffers and optimizer state tensors held, per parameter."""
    fit = trainer._fit
    if fit.master is not None:
        return fit.master.master.bytes_per_parameter()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    tensors = list(params)
    for state in trainer.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) / sum(p.numel() for p in params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="mlp", choices=("mlp", "lm"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=60, help="steps of each timed run (S)")
    ap.add_argument("--warmup", type=int, default=10, help="warm-up steps of each timed run (W)")
    ap.add_argument("--lost-steps", type=int, default=100, help="steps of the lost-update runs (N)")
    ap.add_argument("--small-lr", type=float, default=1e-5)
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("torchimpl").setLevel(logging.WARNING)  # no progress lines

    blocks: dict[str, list[float]] = {c: [] for c in CANDIDATES}
    held: dict[str, float] = {}
    for r in range(args.rounds):
        for candidate in _harness.rotate(CANDIDATES, r):
            trainer, _, clock = _fit(args.task, candidate, args.steps, [f"train.log_interval={args.steps}"])
            gaps = [b - a for a, b in zip(clock.marks, clock.marks[1:])][args.warmup:]
            blocks[candidate].append(sum(gaps) / len(gaps))
            held[candidate] = bytes_per_parameter(trainer)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{c} {blocks[c][-1] * 1e3:.2f} ms" for c in CANDIDATES),
              flush=True)

    rows = []
    for candidate in CANDIDATES:
        row = {"candidate": candidate, "bytes_per_parameter": held[candidate],
               "step_time_s": _harness.median(blocks[candidate]),
               "step_time_ratio": _harness.paired_ratio(blocks, candidate, "bf16-mixed")}
        for label, lr in (("task_lr", None), ("small_lr", args.small_lr)):
            extra = ["train.log_interval=1"] + ([f"optimizer.lr={lr}"] if lr is not None else [])
            _, summary, _ = _fit(args.task, candidate, args.lost_steps, extra)
            row[label] = {"lost_update_fraction": summary.lost_update_fraction,
                          "final_train_loss": summary.final_train_loss}
        rows.append(row)
        print(f"{candidate:20} {row['bytes_per_parameter']:5.1f} B/param  x{row['step_time_ratio']['median']:.2f}  "
              f"lost {row['task_lr']['lost_update_fraction']} (task lr), "
              f"{row['small_lr']['lost_update_fraction']} (lr {args.small_lr:g})", flush=True)
    data = {"machine": _harness.machine(), "task": args.task, "optimizer": "AdamW (for-loop)",
            "settings": vars(args), "rows": rows}
    print(f"wrote {_harness.write_result(f'master_weights_{args.task}', data, args.out)}")


if __name__ == "__main__":
    main()
