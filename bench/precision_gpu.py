"""Five precision modes on one GPU, and the memory-bound unscale/check/clip against the copy limit.

CUDA only: elsewhere it prints why and exits 0 (``--smoke-cpu`` runs the same code at toy
sizes on the CPU to check the script itself; those numbers mean nothing).

Part 1, per model width (multiples of 8, and 513, which is not, to test the old advice that
sizes should be), the same small stack of pre-norm transformer blocks learns to imitate a
fixed random teacher (MSE), from the same initial weights and the same batches, in five modes:
``fp32``, ``fp16+scaler`` (torchimpl's DynamicLossScaler), ``bf16``, ``bf16+compile``
(``torch.compile``, default mode) and ``float8`` (the production path,
``torchimpl.precision.fp8.convert_to_fp8`` with the tensorwise recipe: torchao's
``convert_to_float8_training`` under its module filter, first and last linear layers and
ineligible widths kept in high precision and listed in the JSON; eager, bf16 autocast around
it; skipped with the reason when torchao is missing, the GPU is older than sm_89, or no layer
is eligible). Every mode: unscale (when scaling),
clip at 1.0, fused AdamW. Between modes the caches, peak-memory counters and every RNG are
reset. Per mode: cold time (first step, which includes compilation), warm time per step
(median of CUDA-event timings after warm-up), peak allocated and reserved memory, steps
applied and skipped, validation loss and its difference from fp32's, and the TF32 settings.

Part 2: ``_amp_foreach_non_finite_check_and_unscale_`` + ``get_total_norm`` +
``clip_grads_with_norm_`` over 1B float32 gradient elements (``--grad-elements``), each phase
timed with CUDA events, as bytes moved per second (unscale+check reads and writes 8 B per
element, the norm reads 4, the clip reads and writes 8) against the device's copy bandwidth
measured here with a large ``copy_`` (8 B per element moved).

    PYTHONPATH=. python bench/precision_gpu.py [--out DIR]    # ~1-2 minutes on an H200
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

MODES = ("fp32", "fp16+scaler", "bf16", "bf16+compile", "float8")


class Block(nn.Module):
    """Pre-norm block; attention width fixed at ``heads * 64`` so any model width works."""

    def __init__(self, d: int, heads: int = 8):
        super().__init__()
        self.heads, inner = heads, heads * 64
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * inner)
        self.proj = nn.Linear(inner, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, 64).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, d: int, layers: int):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x))


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also every CUDA generator


def tf32_state() -> dict:
    try:
        from torchimpl.precision.plan import tf32_settings

        return dict(tf32_settings())
    except Exception as exc:  # older or newer torch without the fp32_precision API
        return {"error": repr(exc), "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}


class Clock:
    """CUDA events on a GPU, perf_counter on the CPU (smoke runs)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, started) -> object:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return (started, e)
        return (started, time.perf_counter())

    def seconds(self, pair) -> float:
        a, b = pair
        if self.cuda:
            return a.elapsed_time(b) / 1e3
        return b - a

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def float8_skip_reason(d: int, device: torch.device) -> str | None:
    from torchimpl.precision.fp8 import fp8_kernel, torchao_available

    if not torchao_available():
        return "torchao is not installed (pip install '.[fp8]')"
    why_not, _ = fp8_kernel("tensorwise", device)
    return why_not


def run_mode(mode: str, d: int, args, data, val, teacher_out, device: torch.device) -> dict:
    from torchimpl.train.scaler import DynamicLossScaler

    clock = Clock(device)
    if mode == "float8":
        why = float8_skip_reason(d, device)
        if why:
            return {"skipped": why}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch._dynamo.reset()
    seed_all(args.seed)
    model = Model(d, args.layers).to(device)
    fp8_report = None
    if mode == "float8":
        from torchimpl.precision.fp8 import convert_to_fp8

        try:
            model, fp8_report = convert_to_fp8(model, "tensorwise", device)
        except ValueError as exc:  # no eligible layer at this width
            return {"skipped": str(exc)}
    forward = torch.compile(model) if mode == "bf16+compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    dtype = {"fp16+scaler": torch.float16, "fp32": None}.get(mode, torch.bfloat16)
    scaler = DynamicLossScaler(device.type) if mode == "fp16+scaler" else None
    params = list(model.parameters())
    found = []

    def step(i: int) -> torch.Tensor:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.mse_loss(forward(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            found.append(scaler.found_inf_tensor())
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        return loss.detach()

    clock.sync()
    t0 = time.perf_counter()
    step(0)
    clock.sync()
    cold = time.perf_counter() - t0
    for i in range(1, args.warmup):
        step(i)
    pairs = []
    losses = []
    for i in range(args.warmup, args.warmup + args.steps):
        s = clock.start()
        losses.append(step(i))
        pairs.append(clock.stop(s))
    clock.sync()
    times = [clock.seconds(p) for p in pairs]
    skipped = int(torch.stack(found).ne(0).sum().item()) if found else 0
    total = args.warmup + args.steps
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        val_loss = float(torch.stack([F.mse_loss(forward(x).float(), y) for x, y in val]).mean())
    out = {
        "cold_first_step_s": cold,
        "warm_step_ms_median": 1e3 * _harness.median(times),
        "warm_step_ms_p90": 1e3 * _harness.quantile(times, 0.9),
        "steps": total,
        "steps_applied": total - skipped,
        "steps_skipped": skipped,
        "final_train_loss": float(losses[-1]),
        "val_loss": val_loss,
        "final_scale": float(scaler.get_scale()) if scaler is not None else None,
        "tf32": tf32_state(),
    }
    if fp8_report is not None:
        out["fp8"] = fp8_report.to_dict()
    if device.type == "cuda":
        out["peak_allocated_MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
        out["peak_reserved_MiB"] = torch.cuda.max_memory_reserved(device) / 2**20
    del model, forward, opt
    return out


def precision_table(args, device: torch.device) -> dict:
    results = {}
    for d in args.widths:
        seed_all(args.seed + 1)
        teacher = Model(d, 1).to(device).eval()
        g = torch.Generator(device=device).manual_seed(args.seed)

        def batch():
            x = torch.randn(args.batch, args.seq, d, device=device, generator=g)
            with torch.no_grad():
                return x, teacher(x).float()

        data = [batch() for _ in range(8)]
        val = [batch() for _ in range(4)]
        per_mode = {}
        for mode in MODES:
            try:
                per_mode[mode] = run_mode(mode, d, args, data, val, None, device)
            except Exception as exc:  # one failing mode must not hide the others' numbers
                per_mode[mode] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            r = per_mode[mode]
            note = r.get("skipped") or r.get("error") or (
                f"{r['warm_step_ms_median']:.2f} ms/step warm, cold {r['cold_first_step_s']:.1f} s, "
                f"val {r['val_loss']:.4g}, skipped {r['steps_skipped']}"
                + (f", peak {r['peak_allocated_MiB']:.0f} MiB" if "peak_allocated_MiB" in r else ""))
            print(f"  d={d} {mode}: {note}", flush=True)
        base = per_mode.get("fp32", {})
        for mode, r in per_mode.items():
            if "val_loss" in r and "val_loss" in base:
                r["val_loss_minus_fp32"] = r["val_loss"] - base["val_loss"]
                r["speedup_vs_fp32"] = base["warm_step_ms_median"] / r["warm_step_ms_median"]
        results[str(d)] = per_mode
        del data, val, teacher
    return results


def bandwidth(args, device: torch.device) -> dict:
    clock = Clock(device)
    n = args.grad_elements
    per = min(n, 4 * 2**20)  # 4M-element tensors: the size of a large transformer weight
    sizes = [per] * (n // per) + ([n % per] if n % per else [])
    master = torch.empty(n, device=device).normal_(0, 1e-3 * 65536)
    params = []
    offset = 0
    for s in sizes:
        p = nn.Parameter(torch.empty(s, device=device))
        p.grad = torch.empty(s, device=device)
        params.append((p, offset, s))
        offset += s
    grads = [p.grad for p, _, _ in params]
    found = torch.zeros((), device=device)
    inv = torch.full((), 1.0 / 65536, device=device)

    def reset():
        for p, o, s in params:
            p.grad.copy_(master[o:o + s])
        found.zero_()

    phases = {"unscale_and_check": [], "norm": [], "clip": [], "total": []}
    for rep in range(args.bw_reps + 1):
        reset()
        clock.sync()
        a = clock.start()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        b = clock.start()
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        c = clock.start()
        torch.nn.utils.clip_grads_with_norm_([p for p, _, _ in params], 1.0, norm)
        e = clock.stop(a)
        clock.sync()
        if rep == 0:
            continue  # warm-up
        phases["unscale_and_check"].append(clock.seconds((a, b)))
        phases["norm"].append(clock.seconds((b, c)))
        phases["clip"].append(clock.seconds((c, e[1])))
        phases["total"].append(clock.seconds(e))
    bytes_per_elem = {"unscale_and_check": 8, "norm": 4, "clip": 8, "total": 20}
    # Copy bandwidth: one large device-to-device copy, 4 B read + 4 B written per element.
    dst = torch.empty_like(master)
    copies = []
    for rep in range(args.bw_reps + 1):
        clock.sync()
        a = clock.start()
        dst.copy_(master)
        pair = clock.stop(a)
        clock.sync()
        if rep:
            copies.append(clock.seconds(pair))
    copy_bw = 8 * n / _harness.median(copies)
    out = {"elements": n, "tensors": len(sizes), "copy_bytes_per_s": copy_bw, "found_inf": float(found.item()),
           "phases": {}}
    for k, ts in phases.items():
        t = _harness.median(ts)
        bw = bytes_per_elem[k] * n / t
        out["phases"][k] = {"median_ms": 1e3 * t, "bytes_per_elem": bytes_per_elem[k],
                            "bytes_per_s": bw, "fraction_of_copy_bw": bw / copy_bw}
    del master, dst, grads, params
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[512, 513])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grad-elements", type=int, default=1_000_000_000)
    ap.add_argument("--bw-reps", type=int, default=5)
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="run at toy sizes on the CPU to check the script (numbers mean nothing)")
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = ap.parse_args(argv)

    if args.smoke_cpu:
        device = torch.device("cpu")
        args.widths, args.layers, args.batch, args.seq = [32, 33], 1, 2, 16
        args.steps, args.warmup, args.grad_elements, args.bw_reps = 3, 2, 3_000_000, 2
    elif not torch.cuda.is_available():
        print("precision_gpu: CUDA is not available here; this benchmark needs a GPU (nothing measured). "
              "Run it on a CUDA machine, e.g. with bench/run_gpu.sh OUTDIR.")
        return 0
    else:
        device = torch.device("cuda")
    results: dict = {"machine": _harness.machine(), "settings": vars(args), "smoke_cpu": args.smoke_cpu}
    t0 = time.perf_counter()
    print(f"precision_gpu on {results['machine']['cuda'] or 'cpu (smoke)'}, torch {torch.__version__}", flush=True)
    results["precision"] = precision_table(args, device)
    results["bandwidth"] = bandwidth(args, device)
    bw = results["bandwidth"]
    results["wall_s"] = time.perf_counter() - t0
    name = "precision_gpu_smoke" if args.smoke_cpu else "precision_gpu"
    path = _harness.write_result(name, results, args.out)
    tot = bw["phases"]["total"]
    print(f"precision_gpu: {len(args.widths)} widths x {len(MODES)} modes; unscale+check+clip over "
          f"{bw['elements'] / 1e9:.2g}B elements at {tot['bytes_per_s'] / 1e9:.0f} GB/s = "
          f"{tot['fraction_of_copy_bw']:.2f} of copy bandwidth ({bw['copy_bytes_per_s'] / 1e9:.0f} GB/s) -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
