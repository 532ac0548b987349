"""Gradient accumulation with a GradScaler: k microbatches per optimizer step, each loss / k.

for each window: k x (autocast forward, scaler.scale(loss / k).backward()); unscale_; clip;
scaler.step; scaler.update; zero_grad. Planted mistakes (--bug) replace one part.
"""

import torch

from _common import batches, make_model, parse

BUGS = ("loss-not-divided", "zero-grad-in-window")
args = parse(BUGS, k=4)
k, bug = args.k, args.bug

model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
scaler = torch.amp.GradScaler("cpu", growth_interval=25)
data = batches(args.steps * k)

for step in range(args.steps):
    for micro in range(k):
        x, y = next(data)
        if bug == "zero-grad-in-window":
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        if step in args.inf_at and micro == k - 1:
            loss = loss * float("inf")
        if bug != "loss-not-divided":
            loss = loss / k
        scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
