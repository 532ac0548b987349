"""The GradScaler loop with FSDP's ShardedGradScaler, in a one-rank gloo process group on the CPU.

``--fsdp`` shards the model with FSDP2's ``fully_shard`` (its parameters and gradients become
DTensors); without it the model stays plain and only the scaler is FSDP's. Planted mistakes
(--bug) replace one part.
"""

import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from _common import batches, make_model, parse

args = parse(("clip-before-unscale", "step-without-update"), fsdp=False)
with tempfile.NamedTemporaryFile(delete=False) as f:
    store = f.name
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
model = make_model()
if args.fsdp:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = ShardedGradScaler("cpu", growth_interval=5)

try:
    for step, (x, y) in enumerate(batches(args.steps)):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        if step in args.inf_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if args.bug == "clip-before-unscale":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.unscale_(opt)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        if args.bug != "step-without-update":
            scaler.update()
finally:
    dist.destroy_process_group()
