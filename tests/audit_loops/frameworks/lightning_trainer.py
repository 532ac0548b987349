"""The Lightning ``Trainer`` on the CPU, in automatic optimization (or ``--manual``).

In automatic optimization the Trainer passes a closure to the step: with ``32-true`` and
``bf16-mixed`` its ``Precision.optimizer_step`` calls ``optimizer.step(closure=...)`` and the
closure runs ``training_step``, ``zero_grad`` (first microbatch of a window) and the backward
pass inside torch's ``Optimizer.step``, then Lightning's ``on_before_optimizer_step`` and its
gradient clipping (``gradient_clip_val``). With ``16-mixed`` its ``MixedPrecision`` plugin runs
the closure first, then ``scaler.unscale_``, the clipping, ``scaler.step(optimizer)`` and
``scaler.update()``. With ``--accumulate K`` the first K-1 batches of a window run the closure
outside any step. ``--manual`` is manual optimization: ``self.manual_backward``,
``self.clip_gradients`` and ``opt.step()`` (which Lightning still routes through its plugin, with
a closure that runs no backward).

``16-mixed`` on the CPU: the Trainer turns ``precision="16-mixed"`` on ``accelerator="cpu"`` into
bf16-mixed, so the loop passes Lightning's ``MixedPrecision("16-mixed", "cpu", scaler=...)`` plugin
itself, with a CPU ``GradScaler`` (initial scale 2**10, so that float16 autocast on the CPU,
which torch supports, does not overflow by itself); ``--inf-at`` forces overflows there.

Planted mistakes: ``--bug clip-before-unscale`` is ``--manual --precision 16-mixed`` with
``self.clip_gradients``, which clips the scaled gradients (Lightning unscales only inside its
``opt.step()``); ``--scheduler step`` with ``16-mixed`` and ``--inf-at`` is Lightning stepping a
per-step scheduler after a step the scaler skipped (scheduler-on-skipped-step).
"""

import warnings

import torch
import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision

from _closure_common import batches, make_model, overflow, parse

args = parse(("clip-before-unscale",), precision="32-true", accumulate=1, clip=0.0, manual=False, scheduler="none")
if args.bug == "clip-before-unscale":
    args.manual, args.precision, args.clip = True, "16-mixed", args.clip or 1.0
warnings.filterwarnings("ignore")


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.automatic_optimization = not args.manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        k = args.accumulate
        # The overflow at optimizer step I: the last microbatch of its window.
        big = batch_idx // k in args.inf_at and batch_idx % k == k - 1
        loss = overflow(torch.nn.functional.mse_loss(self.net(x), y), big)
        if not args.manual:
            return loss  # Lightning divides by accumulate_grad_batches itself
        opt = self.optimizers()
        self.manual_backward(loss / k)
        if (batch_idx + 1) % k == 0:
            if args.clip:
                self.clip_gradients(opt, gradient_clip_val=args.clip, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            if args.scheduler == "step":
                self.lr_schedulers().step()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        if args.scheduler == "none":
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    data = torch.utils.data.DataLoader(list(batches(args.steps * args.accumulate)), batch_size=None)
    options = dict(accelerator="cpu", devices=1, max_steps=args.steps, max_epochs=1, enable_progress_bar=False,
                   logger=False, enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)
    if args.precision == "16-mixed":
        options["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))]
    else:
        options["precision"] = args.precision
    if not args.manual:
        options["accumulate_grad_batches"] = args.accumulate
        options["gradient_clip_val"] = args.clip or None
    trainer = pl.Trainer(**options)
    trainer.fit(Regression(), data)


main()
