"""The canonical bf16 loop on the CPU: autocast to bfloat16, no loss scaler, float32 parameters.

zero_grad; forward and loss under autocast; backward outside it; clip; step. Planted mistakes
(--bug) replace one part.
"""

import torch

from _common import batches, make_model, parse

BUGS = ("backward-in-autocast", "optimizer-before-to", "zero-grad-in-window", "parameters-altered")
args = parse(BUGS, optimizer="adamw")
bug = args.bug

model = make_model()
if args.optimizer == "sgd":
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
elif args.optimizer == "adam-foreach":
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True, amsgrad=True)
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
if bug == "parameters-altered":
    # A step hook that nudges the weights after every step: not what the optimizer computes.
    opt.register_step_post_hook(lambda *_: next(model.parameters()).data.mul_(0.999))
if bug == "optimizer-before-to":
    model.to(torch.bfloat16)  # the cast belongs before the optimizer (and parameters stay float32)

for step, (x, y) in enumerate(batches(args.steps)):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)), y)
        if bug == "backward-in-autocast":
            loss.backward()
    if bug != "backward-in-autocast":
        loss.backward()
    if bug == "zero-grad-in-window":
        model.zero_grad()  # e.g. meant for another model, but it holds these parameters
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    opt.step()
