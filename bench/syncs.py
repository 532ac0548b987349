"""Host syncs per optimizer step: torchimpl's Trainer against a hand loop, Accelerate and Fabric.

What is counted, on every device: calls of ``aten._local_scalar_dense`` (and, listed apart,
``aten.nonzero``, ``aten.masked_select``, ``aten.is_nonzero``, ``aten.equal``), seen by a
``TorchDispatchMode`` active during the measured steps. ``_local_scalar_dense`` is what
``Tensor.item()``, ``float(t)``, ``int(t)``, ``bool(t)`` and ``if t:`` dispatch to, including
such reads inside torch (the for-loop optimizers read their ``step`` counters with it when
``capturable=False``; ``GradScaler.step`` reads ``found_inf`` with it). On CUDA each one
waits for the device.

What the count does NOT see: ``Tensor.tolist()`` and ``Tensor.numpy()`` (they read memory
directly, without dispatching; the script checks this and records it), ``.cpu()`` /
``.to("cpu")`` copies, non-blocking copies and stream or event waits. On a CPU none of these
waits for anything; on CUDA they can, so with ``--device cuda`` the script also runs
``torch.cuda.set_sync_debug_mode("warn")`` and counts the warnings, which cover them.

Also counted: every aten op dispatched (``aten_ops_per_step``), the work a candidate adds
around the same training.

Per optimizer step, after warm-up, each count is split into the microbatch phase (from the
previous step's end to the end of the last backward; for the Trainer this also holds its
log-point flush every 10 steps, amortised) and the step phase (unscale, clip, optimizer step,
scaler update, schedule). Candidates: the hand loop, the Trainer (host mode and, with a
fused optimizer, the sync-free mode), Accelerate and Fabric; for-loop and fused AdamW;
plain mixed precision and the loss-scaler path (bf16 + forced scaler on the CPU, fp16 on CUDA).
Then the Trainer alone for every registered optimizer (``per_optimizer``) on the loss-scaler
path: its default implementation and, where torch has one, its fused kernel (host and
sync-free skip). The for-loop paths of torch's optimizers read their step counters with
``.item()`` (``_get_value``), one sync per parameter per step; that is torch's, not the Trainer's.

    PYTHONPATH=. python bench/syncs.py                 # CPU, well under a minute
    PYTHONPATH=. python bench/syncs.py --device cuda   # also counts CUDA sync warnings
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402
from _loops import RUNNERS, Unsupported, Workload, add_baseline, available, run_trainer  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from torchimpl.config.schema import TaskConfig  # noqa: E402
from torchimpl.task.builtin import build_task  # noqa: E402

aten = torch.ops.aten
SYNC = aten._local_scalar_dense.default
OTHER = {aten.nonzero.default, aten.masked_select.default, aten.is_nonzero.default, aten.equal.default}
_PLUMBING = ("_python_dispatch", "syncs.py", "contextlib.py", "_contextlib.py", "_dynamo", "_compile.py")


def _origin() -> str:
    """Where a sync comes from: the innermost frame that is not plumbing (dispatch mode,
    decorators) and, when that is inside torch, the innermost caller outside torch."""
    frames = [f for f in reversed(traceback.extract_stack(limit=40)[:-2])
              if not any(s in f.filename for s in _PLUMBING)]
    if not frames:
        return "?"

    def short(f: traceback.FrameSummary) -> str:
        return f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} {f.name}"

    inner = frames[0]
    if f"{Path('torch')}/" not in inner.filename.replace("\\", "/") or "site-packages" not in inner.filename:
        return short(inner)
    caller = next((f for f in frames if "site-packages/torch/" not in f.filename.replace("\\", "/")), None)
    return short(inner) + (f" <- {short(caller)}" if caller else "")


class SyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0
        self.other = 0
        self.ops = 0
        self.cuda_warnings = 0
        self.origins: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func is SYNC:
            self.syncs += 1
            self.origins[_origin()] += 1
        elif func in OTHER:
            self.other += 1
            self.origins[f"{func} @ {_origin()}"] += 1
        return func(*args, **(kwargs or {}))


def tolist_is_counted() -> dict[str, bool]:
    t = torch.arange(3.0)
    out = {}
    for name, read in (("item", lambda: t[0].item()), ("float", lambda: float(t[0])),
                       ("tolist", lambda: t.tolist()), ("numpy", lambda: t.numpy())):
        with SyncCounter() as c:
            read()
        out[name] = c.syncs > 0
    return out


def count(runner, w: Workload, steps: int, warmup: int, on_cuda: bool) -> dict:
    counter = SyncCounter()
    snapshots: list[tuple[str, int, int, int, int]] = []
    caught: list[warnings.WarningMessage] = []

    def mark(event: str) -> None:
        snapshots.append((event, counter.syncs, counter.other, len(caught), counter.ops))

    with warnings.catch_warnings(record=True) as caught_list:
        warnings.simplefilter("always")
        caught = caught_list
        if on_cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with counter:
                runner(w, steps, mark)
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode("default")
    sync_warnings = [m for m in caught if "synchroniz" in str(m.message).lower()]
    ends = [s for s in snapshots if s[0] == "step_end"]
    windows = [s for s in snapshots if s[0] == "window_end"]
    measured = range(warmup, len(ends))
    micro, step, other, cw_micro, cw_step, ops = [], [], [], [], [], []
    for i in measured:
        prev = ends[i - 1]
        micro.append(windows[i][1] - prev[1])
        step.append(ends[i][1] - windows[i][1])
        other.append(ends[i][2] - prev[2])
        cw_micro.append(windows[i][3] - prev[3])
        cw_step.append(ends[i][3] - windows[i][3])
        ops.append(ends[i][4] - prev[4])
    n = max(len(measured), 1)
    out = {
        "steps_measured": len(measured),
        "local_scalar_dense_per_step": (sum(micro) + sum(step)) / n,
        "in_microbatches_per_step": sum(micro) / n,
        "in_step_phase_per_step": sum(step) / n,
        "other_sync_ops_per_step": sum(other) / n,
        "aten_ops_per_step": sum(ops) / n,
        "origins_total_all_steps": dict(counter.origins.most_common(8)),
    }
    if on_cuda:
        out["cuda_sync_warnings_per_step"] = (sum(cw_micro) + sum(cw_step)) / n
        out["cuda_sync_warnings_in_microbatches_per_step"] = sum(cw_micro) / n
        out["cuda_sync_warning_sources"] = dict(Counter(
            f"{Path(m.filename).name}:{m.lineno}" for m in sync_warnings).most_common(8))
    return out


def per_optimizer(built, batches, args, on_cuda: bool, lines: list[str]) -> dict:
    """The Trainer's count for every registered optimizer (torchimpl.train.optim.REGISTRY), on the
    loss-scaler path: its default implementation, and its fused kernel in both skip modes
    where torch has one on this device."""
    from torchimpl.train.optim import REGISTRY

    dtype = torch.float16 if on_cuda else torch.bfloat16
    out: dict = {}
    for name, row in REGISTRY.items():
        runs = {"default": (False, False)}
        if args.device in row.fused_devices:
            runs.update({"fused": (True, False), "fused sync_free": (True, True)})
        out[name] = {}
        for label, (fused, sync_free) in runs.items():
            w = Workload(f"{name}/{label}", built.model, batches, args.k, use_scaler=True, fused=fused,
                         autocast_dtype=dtype, device=args.device, optimizer=name)
            out[name][label] = count(lambda w, s, m, sf=sync_free: run_trainer(w, s, m, sync_free=sf), w,
                                     args.steps, args.warmup, on_cuda)
        lines.append(f"{name}: " + ", ".join(f"{k} {v['local_scalar_dense_per_step']:g}" for k, v in out[name].items()))
        print(lines[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps per candidate (>= 2 log points)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--against", default=None, metavar="REV",
                    help="also count the Trainer of this git revision (e.g. HEAD~1)")
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = ap.parse_args(argv)
    on_cuda = args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        print("syncs: --device cuda requested but CUDA is not available; nothing measured")
        return 0
    torch.manual_seed(0)
    built = build_task(TaskConfig(name="mlp", size="small"), seed=0, batch_size=32)
    batches = [built.train_data.batch(0, i) for i in range(args.steps * args.k)]
    skipped_peers = available()

    candidates = {
        "hand": RUNNERS["hand"],
        "ampspec": RUNNERS["ampspec"],
        "ampspec sync_free": lambda w, s, m: run_trainer(w, s, m, sync_free=True),
        "accelerate": RUNNERS["accelerate"],
        "fabric": RUNNERS["fabric"],
    }
    if args.against:
        baseline = RUNNERS[add_baseline(args.against)]
        candidates[f"ampspec@{args.against}"] = baseline
        candidates[f"ampspec@{args.against} sync_free"] = lambda w, s, m: baseline(w, s, m, sync_free=True)
    modes = [("bf16", torch.bfloat16, False)]
    modes.append(("fp16+scaler", torch.float16, True) if on_cuda else ("bf16+scaler", torch.bfloat16, True))
    results: dict = {
        "machine": _harness.machine(),
        "settings": vars(args),
        "model": "torchimpl.task.builtin RegressionMLP (small), batch 32",
        "counted_by_dispatch_mode": tolist_is_counted(),
        "configs": {},
    }
    lines = []
    for mode, dtype, use_scaler in modes:
        for fused in (False, True):
            label = f"{mode}/{'fused' if fused else 'for-loop'}"
            w = Workload(label, built.model, batches, args.k, use_scaler=use_scaler, fused=fused,
                         autocast_dtype=dtype, device=args.device)
            cfg: dict = {}
            for name, runner in candidates.items():
                peer = name.split()[0]
                if skipped_peers.get(peer):
                    cfg[name] = {"skipped": skipped_peers[peer]}
                    continue
                if name.endswith("sync_free") and not fused:
                    cfg[name] = {"skipped": "sync_free needs a fused optimizer"}
                    continue
                try:
                    cfg[name] = count(runner, w, args.steps, args.warmup, on_cuda)
                except Unsupported as exc:
                    cfg[name] = {"skipped": str(exc)}
            results["configs"][label] = cfg
            parts = []
            for name, r in cfg.items():
                if "skipped" in r:
                    parts.append(f"{name} -")
                else:
                    extra = f"/{r['cuda_sync_warnings_per_step']:g}w" if on_cuda else ""
                    parts.append(f"{name} {r['local_scalar_dense_per_step']:g}{extra} ({r['aten_ops_per_step']:.1f} ops)")
            lines.append(f"{label}: " + ", ".join(parts))
            print(lines[-1], flush=True)
    results["per_optimizer"] = per_optimizer(built, batches, args, on_cuda, lines)
    path = _harness.write_result("syncs" if not on_cuda else "syncs_cuda", results, args.out)
    print(f"syncs ({args.device}): _local_scalar_dense per optimizer step, by candidate -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
