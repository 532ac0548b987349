"""A raw loop with ``torch.optim.LBFGS`` and a closure, on the CPU (float32, or ``--bf16``
autocast in the closure).

Each optimizer step calls ``opt.step(closure)``; LBFGS evaluates the closure (zero_grad,
forward, backward) once, then again at each of its inner iterations (``--max-iter``, with
``--line-search strong_wolfe`` or its fixed step), moving the parameters between evaluations.
A step is checked by the order rules; it is not replayed: the specification has no LBFGS.
``--bug backward-in-autocast`` runs the closure's backward inside its (bf16) autocast region.
"""

import torch

from _closure_common import batches, make_model, parse

args = parse(("backward-in-autocast",), max_iter=4, line_search="none", bf16=False)
args.bf16 = args.bf16 or args.bug == "backward-in-autocast"  # the mistake needs an autocast region
model = make_model()
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=args.max_iter, history_size=5,
                        line_search_fn=None if args.line_search == "none" else args.line_search)

for x, y in batches(args.steps):
    def closure():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = torch.nn.functional.mse_loss(model(x), y)
            if args.bug == "backward-in-autocast":
                loss.backward()
        if args.bug != "backward-in-autocast":
            loss.backward()
        return loss

    opt.step(closure)
