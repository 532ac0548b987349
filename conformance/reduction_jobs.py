"""What each rank of the 2-rank gloo group runs for the gradient-reduction properties.

`conformance/test_distributed.py` sends a job (a dict with a ``kind``) to both ranks of its
group (`conformance.multiproc`); each returns float32 NumPy arrays. Gradients are planted: the
module's loss is ``sum(p * G)``, so the gradient each rank holds before the reduction is exactly
its ``G`` in the parameter's dtype (a bf16 parameter gets ``bf16(G)``), and what comes back is
the reduction alone. torch is imported inside the jobs: they run in the spawned ranks.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["JOBS", "TORCH_DTYPES", "fp32_master_run", "trainer_bf16_true"]

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _dtype(name: str | None) -> Any:
    import torch

    return None if name is None else getattr(torch, TORCH_DTYPES[name])


def _planted(init: list[np.ndarray]) -> Any:
    import torch
    from torch import nn

    class Planted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ps = nn.ParameterList([nn.Parameter(torch.from_numpy(a.copy())) for a in init])

        def forward(self, g: list[torch.Tensor]) -> torch.Tensor:
            return sum((p * gi).sum() for p, gi in zip(self.ps, g))

    return Planted()


def collective(rank: int, job: dict) -> list[np.ndarray]:
    """``all_reduce`` (or ``reduce_scatter_tensor``) of this rank's values in the wire dtype."""
    import torch
    import torch.distributed as dist

    t = torch.from_numpy(job["x"][rank]).to(_dtype(job["wire"]))
    op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}[job["op"]]
    if job.get("scatter"):
        out = torch.empty(t.numel() // dist.get_world_size(), dtype=t.dtype)
        dist.reduce_scatter_tensor(out, t, op=op)
        t = out
    else:
        dist.all_reduce(t, op=op)
    return [t.float().numpy()]


def hook(rank: int, job: dict) -> list[np.ndarray]:
    """DDP's compress hook on this rank's float32 bucket: called directly, or registered on a DDP module."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    fn = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}[job["wire"]]
    x = job["x"][rank]
    if not job.get("via_ddp"):
        buffer = torch.from_numpy(x.copy())
        return [fn(None, (buffer,)).wait().numpy().copy()]
    from torch.nn.parallel import DistributedDataParallel

    model = _planted([np.zeros_like(x)])
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, fn)
    ddp([torch.from_numpy(x)]).backward()
    return [model.ps[0].grad.numpy().copy()]


def fsdp(rank: int, job: dict) -> list[np.ndarray]:
    """FSDP2 over a planted module with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``: the shards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    grads = job["G"][rank]
    model = _planted([np.zeros_like(g) for g in grads])
    policy = MixedPrecisionPolicy(param_dtype=_dtype(job["param"]), reduce_dtype=_dtype(job["reduce"]))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), mp_policy=policy)
    if job.get("factor") is not None:
        model.set_gradient_divide_factor(job["factor"])
    if job.get("force_sum"):
        model.set_force_sum_reduction_for_comms(True)
    model([torch.from_numpy(g) for g in grads]).backward()
    return [p.grad.to_local().float().numpy().copy() for p in model.ps]


def _mlp(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _data(seed: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _loss(out: Any, y: Any) -> Any:
    return ((out.float() - y) ** 2).mean()


def _adamw(params: Any, job: dict) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=job["lr"], weight_decay=0.01, foreach=False)


def fsdp_bf16_params(rank: int, job: dict) -> list[np.ndarray]:
    """An MLP under FSDP2 with ``param_dtype=bf16`` (fp32 shards), AdamW, the same data on both ranks;
    sharded by hand or (``via="torchimpl"``) by ``torchimpl.distributed.wrap_model``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _mlp(job["seed"])
    if job.get("via") == "torchimpl":  # the trainer's own wrapping (rule 11 of torchimpl.distributed)
        from torchimpl.distributed import ReductionSettings, wrap_model

        wrap_model(model, "fsdp2", device=torch.device("cpu"), reduction=ReductionSettings(job["reduce"], job["param"]))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=_dtype(job["param"]), reduce_dtype=_dtype(job["reduce"]))
        for unit in (model[0], model[2], model):
            fully_shard(unit, mesh=mesh, mp_policy=policy)
    opt = _adamw(model.parameters(), job)
    x, y = _data(job["seed"])
    for _ in range(job["steps"]):
        opt.zero_grad()
        _loss(model(x), y).backward()
        opt.step()
    return [p.full_tensor().detach().numpy().copy() for p in model.parameters()]


def fp32_master_run(job: dict) -> list[np.ndarray]:
    """One process, ``bf16-true`` with an fp32 master copy, written out by hand: the bf16 model
    runs forward and backward; the fp32 masters take the bf16 gradients (cast exactly) and step;
    the bf16 parameters are cast from the masters after each step. Returns the masters."""
    import torch

    model = _mlp(job["seed"])
    masters = [p.detach().clone() for p in model.parameters()]
    model = model.to(torch.bfloat16)
    opt = _adamw(masters, job)
    x, y = _data(job["seed"])
    for _ in range(job["steps"]):
        model.zero_grad()
        _loss(model(x.to(torch.bfloat16)), y).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return [m.numpy().copy() for m in masters]


def trainer_bf16_true(rank: int, job: dict) -> list[np.ndarray]:
    """The trainer with ``precision.mode=bf16-true``, ``master_weights=fp32``, AdamW, on
    ``job["distributed"]`` (``none`` in one process; ``fsdp2`` on the group, every batch given
    twice so that both ranks get the same ones). Returns the fp32 masters (FSDP2: the shards, whole)."""
    import torch

    from torchimpl.config.schema import load_config
    from torchimpl.train.trainer import Callback, Trainer

    class Masters(Callback):
        def on_step_end(self, trainer, state):
            if job["distributed"] == "fsdp2":
                self.got = [p.detach().full_tensor().numpy().copy() for p in trainer.params]
            else:
                mw = trainer._fit.master.master  # the masters follow the optimizer's groups: map them back
                by_param = {id(p): m for p, m in zip(mw.params, mw.masters)}
                self.got = [by_param[id(p)].numpy().copy() for p in trainer.params]

    cfg = load_config(overrides=[
        "device=cpu", "precision.mode=bf16-true", "precision.master_weights=fp32", f"train.distributed={job['distributed']}",
        f"train.reduce_dtype={job['reduce']}", f"train.steps={job['steps']}", "train.log_interval=1000",
        "optimizer.name=adamw", f"optimizer.lr={job['lr']}", "schedule.name=constant", "train.distributed_timeout_s=60",
        # No clipping: one process clips the bf16 gradients, FSDP2 the fp32 reduced shards, whose
        # norms differ by bf16's rounding of each gradient.
        "train.clip_norm=null"])
    g = torch.Generator().manual_seed(job["seed"] + 1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(job["steps"])]
    if job["distributed"] == "fsdp2":
        batches = [b for b in batches for _ in range(2)]
    probe = Masters()
    Trainer(cfg, [probe]).fit(_mlp(job["seed"]), batches, loss_fn=lambda m, b: _loss(m(b[0]), b[1]))
    return probe.got


JOBS: dict[str, Callable[[int, dict], list[np.ndarray]]] = {
    "collective": collective, "hook": hook, "fsdp": fsdp, "fsdp_bf16_params": fsdp_bf16_params,
    "trainer_bf16_true": trainer_bf16_true,
}
