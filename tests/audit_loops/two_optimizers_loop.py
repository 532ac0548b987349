"""Two models, two optimizers, one GradScaler (PyTorch's "multiple models" AMP pattern).

Both losses are scaled by the one scaler; optimizer 0 is unscaled and clipped explicitly,
optimizer 1 is unscaled inside scaler.step; one update per iteration backs off once.
``--order gan`` steps optimizer 0 before the second loss is even scaled (a GAN's discriminator
then generator), still with one update for both.
"""

import torch

from _common import batches, make_model, parse

args = parse(("zero-grad-in-window",), order="both")
m0, m1 = make_model(0), make_model(1)
opt0 = torch.optim.SGD(m0.parameters(), lr=0.01, momentum=0.9)
opt1 = torch.optim.AdamW(m1.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", growth_interval=15)

for step, (x, y) in enumerate(batches(args.steps)):
    opt0.zero_grad()
    opt1.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out0, out1 = m0(x), m1(x)
        loss0 = torch.nn.functional.mse_loss(out0, y)
        loss1 = torch.nn.functional.mse_loss(out1, y)
    if step in args.inf_at:
        loss1 = loss1 * float("inf")
    scaler.scale(loss0).backward()
    if args.bug == "zero-grad-in-window":
        m0.zero_grad()  # meant for m1, but wipes m0's fresh gradients
    if args.order == "gan":
        scaler.unscale_(opt0)
        torch.nn.utils.clip_grad_norm_(m0.parameters(), 1.0)
        scaler.step(opt0)
        scaler.scale(loss1).backward()
        scaler.step(opt1)
    else:
        scaler.scale(loss1).backward()
        scaler.unscale_(opt0)
        torch.nn.utils.clip_grad_norm_(m0.parameters(), 1.0)
        scaler.step(opt0)
        scaler.step(opt1)
    scaler.update()
