"""A model held in bfloat16 on the CPU, fine-tuned with AdamW: three ways to keep its weights.

- ``--keep master`` (the correct loop): the optimizer steps a float32 master copy of every
  parameter; the loop hands it the bf16 gradients widened to float32 and writes the bf16 model
  from it after each step. The optimizer holds float32 parameters: every step is replayed.
- ``--bug update-lost-to-rounding``: ``model.to(torch.bfloat16)`` and a plain ``torch.optim.AdamW``
  over the bf16 parameters (its state is bf16 too). With ``--lr 1e-5`` an update is about 1e-5,
  far below half the bf16 spacing of a weight near 0.1 (2**-12, 2.4e-4): nearly every update
  rounds back to the stored weight (the audit warns at the end of its first window, step 9).
- ``--keep stochastic``: torchao's ``_AdamW(bf16_stochastic_round=True)`` over the bf16
  parameters: the update is computed in float32 and rounded to bf16 stochastically, kept in
  expectation. Its random bits are not observable: its steps are checked by envelope (each
  weight one of the two bf16 neighbours of the float32 step's result), and no
  update-lost-to-rounding finding is made. ``--bug parameters-altered`` adds a step hook that
  scales the first weight by 1.05 after every step: outside the envelope (a divergence, a
  warning as the hook is the loop's own).
- ``--keep none``: the plain bf16 optimizer without the bug's learning rate; ``--impl`` chooses
  torch's for-loop, foreach or fused AdamW, ``--optimizer nadam`` an NAdam instead (its foreach
  path is modelled on bf16 tensors too), ``--optimizer adagrad`` or ``--optimizer sgd`` an Adagrad or
  an SGD (``--momentum``; torch's fused SGD on bf16 tensors never stores the weights of its vector
  loop: the replay reproduces it, and the lost updates are found), ``--optimizer adafactor`` an
  Adafactor (modelled on bf16 tensors too, `reference.lowprec` rule 16).
  ``--skip-rounding`` mutates the step: after each AdamW step a hook overwrites the bf16 weights
  with the update computed in float32 from the same weights, gradients and state and rounded
  once (the op-by-op roundings skipped): with torch's scalar kernels the replay diverges.
"""

import torch

from _common import batches, make_model, parse

BUGS = ("update-lost-to-rounding", "parameters-altered")
args = parse(BUGS, keep="master", lr=1e-5, impl="for-loop", optimizer="adamw", skip_rounding=False, momentum=0.0)
IMPL = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[args.impl]

model = make_model().to(torch.bfloat16)
if args.bug == "update-lost-to-rounding" or args.keep == "none":
    params = list(model.parameters())  # the optimizer steps the bf16 weights themselves
    if args.optimizer == "nadam":
        opt = torch.optim.NAdam(params, lr=args.lr, weight_decay=0.01, **IMPL)
    elif args.optimizer == "adagrad":
        opt = torch.optim.Adagrad(params, lr=args.lr, weight_decay=0.01, **IMPL)
    elif args.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=0.01, **IMPL)
    elif args.optimizer == "adafactor":
        opt = torch.optim.Adafactor(params, lr=args.lr, weight_decay=0.01, **IMPL)
    else:
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, **IMPL)
elif args.keep == "stochastic":
    from torchao.optim import _AdamW

    params = list(model.parameters())
    opt = _AdamW(params, lr=args.lr, weight_decay=0.01, bf16_stochastic_round=True)
else:
    params = [p.detach().float() for p in model.parameters()]  # the float32 master copy
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
if args.skip_rounding:  # the step's update in float32, rounded once into the bf16 weights
    twins = [p.detach().float() for p in params]
    twin_opt = torch.optim.AdamW(twins, lr=args.lr, weight_decay=0.01)

    def widen(*_):
        for t, p in zip(twins, params):
            t.data.copy_(p.detach())
            t.grad = p.grad.float()
            twin_opt.state[t] = {k: v.float().clone() for k, v in opt.state[p].items()}

    def round_once(*_):
        twin_opt.step()
        with torch.no_grad():
            for t, p in zip(twins, params):
                p.copy_(t)

    opt.register_step_pre_hook(widen)
    opt.register_step_post_hook(round_once)
if args.bug == "parameters-altered":
    opt.register_step_post_hook(lambda *_: params[0].data.mul_(1.05))

for step, (x, y) in enumerate(batches(args.steps)):
    model.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
    loss.backward()
    if params[0] is not next(model.parameters()):
        for master, p in zip(params, model.parameters()):
            master.grad = p.grad.float()
    opt.step()
    if params[0] is not next(model.parameters()):
        with torch.no_grad():
            for master, p in zip(params, model.parameters()):
                p.copy_(master)  # the bf16 model from the master copy, rounded to nearest
