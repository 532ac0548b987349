"""What each gradient reduction does to the mean of 2 ranks' gradients, measured on gloo.

Both ranks draw 100,000 float32 gradients with magnitudes log-uniform in [1e-10, 10] and random
signs; each regime reduces them as torch does (DDP's fp32 average, its bf16/fp16 compress hooks,
FSDP2's bf16 AVG, an fp16 AVG); reported per regime: the fraction of elements that differ from
fp32 DDP, the median relative error of the mean (against the exact mean in float64) and the
fraction of non-zero means flushed to 0. Accuracy, not time: no baseline ratio is needed.

    python bench/grad_reductions.py          # a few seconds (two processes)
"""

from __future__ import annotations

import datetime
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N = 100_000


def _grads(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    mag = 10 ** (torch.rand(N, generator=g) * 11 - 10)
    sign = torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).float()


def _rank(rank: int, port: int, out: "mp.Queue") -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    g, res = _grads(rank), {}
    t = g * 0.5  # DDP's own average: f32(1/W) times each rank's gradient, then the fp32 sum
    dist.all_reduce(t)
    res["fp32 DDP"] = t.numpy()
    res["DDP bf16_compress_hook"] = hooks.bf16_compress_hook(None, (g.clone(),)).wait().numpy()
    res["DDP fp16_compress_hook (= FSDP2 fp16 at 2 ranks)"] = hooks.fp16_compress_hook(None, (g.clone(),)).wait().numpy()
    for name, dtype in (("FSDP2 bf16 (AVG)", torch.bfloat16), ("fp16 AVG (sum, then /2)", torch.float16)):
        t = g.to(dtype)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        res[name] = t.float().numpy()
    out.put((rank, res))
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    exact = (_grads(0).double().numpy() + _grads(1).double().numpy()) / 2
    nz = exact != 0
    print(f"{N} gradients per rank, |g| log-uniform in [1e-10, 10], 2 ranks, gloo, torch {torch.__version__}")
    print(f"{'regime':52s} {'differs from fp32 DDP':>22s} {'median rel. error':>18s} {'flushed to 0':>13s}")
    for name, v in res[0].items():
        rel = np.abs(v.astype(np.float64) - exact)[nz] / np.abs(exact[nz])
        print(f"{name:52s} {np.mean(v != res[0]['fp32 DDP']):22.1%} {np.median(rel):18.1e} "
              f"{np.mean((v == 0) & nz):13.2%}")


if __name__ == "__main__":
    main()
