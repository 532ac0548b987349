"""A raw loop with a SAM-style optimizer (sharpness-aware minimization), on the CPU.

``SAM`` wraps a base optimizer over the same parameter groups, as SAM is usually written: the
first pass's gradients move each parameter up the gradient by ``rho`` (``first_step``, then
``zero_grad``); the loss is evaluated and back-propagated again at the perturbed point; the
parameters are put back and the base optimizer steps with the second pass's gradients
(``second_step``). ``--style two-calls`` calls ``first_step`` and ``second_step`` from the loop;
``--style closure`` calls ``opt.step(closure)``, which runs the second pass inside the step.
``--base sgd|adamw``: the base optimizer, whose steps the audit replays.
"""

import torch

from _closure_common import batches, make_model, parse


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization around ``base`` (an optimizer class and its settings)."""

    def __init__(self, params, base, rho: float = 0.05, **settings) -> None:
        super().__init__(params, dict(rho=rho, **settings))
        self.base = base(self.param_groups, **settings)
        self.param_groups = self.base.param_groups  # one set of groups: a schedule of either moves both

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        norm = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"] if p.grad is not None]))
        for group in self.param_groups:
            factor = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                bump = p.grad * factor
                self.state[p]["bump"] = bump
                p.add_(bump)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "bump" in self.state[p]:
                    p.sub_(self.state[p].pop("bump"))
        self.base.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is None:
            raise ValueError("SAM.step needs a closure that evaluates the loss and its gradients again")
        self.first_step(zero_grad=True)
        with torch.enable_grad():
            loss = closure()
        self.second_step()
        return loss


args = parse((), style="two-calls", base="sgd")
model = make_model()
if args.base == "sgd":
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.05, momentum=0.9)
else:
    opt = SAM(model.parameters(), torch.optim.AdamW, rho=0.05, lr=1e-3)


def loss_of(x, y):
    return torch.nn.functional.mse_loss(model(x), y)


for x, y in batches(args.steps):
    opt.zero_grad()
    loss_of(x, y).backward()
    if args.style == "closure":
        def closure():
            loss = loss_of(x, y)
            loss.backward()
            return loss

        opt.step(closure)
    else:
        opt.first_step(zero_grad=True)
        loss_of(x, y).backward()
        opt.second_step(zero_grad=True)
