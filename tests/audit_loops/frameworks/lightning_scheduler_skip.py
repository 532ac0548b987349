"""Lightning's Trainer steps a per-step LR scheduler after an optimizer step the scaler skipped.

Reproduces Lightning-AI/pytorch-lightning#18828 (a duplicate of #5558, open; fix proposed in
#16229 and not merged) at the installed lightning 2.6: with ``16-mixed`` the precision plugin's
``optimizer_step`` (``plugins/precision/amp.py``) calls ``scaler.step``, which skips the step
when the gradients overflow, and the training loop then steps every scheduler whose
``interval`` is ``"step"`` (``loops/training_epoch_loop.py`` ``_update_learning_rates``) without
asking whether the step was applied. The CPU has no fp16 autocast in Lightning's plugin, so the
plugin is given a CPU GradScaler and autocasts to bf16 (as ``fabric_amp.py`` does); the
optimizer step itself is the same as on a GPU.

``--inf-at I,J``: the loss of those steps overflows (the scaler skips them), and the scheduler
steps after each: ``scheduler-on-skipped-step`` at I and J, its call site Lightning's.
``--fix 1``: the module overrides ``lr_scheduler_step`` to skip the scheduler when the scale
dropped (the step was skipped): no finding.
"""

import sys
import warnings
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import batches, make_model, parse  # noqa: E402

args = parse((), fix=0)
warnings.filterwarnings("ignore")


class Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        return loss * float("inf") if batch_idx in args.inf_at else loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class FixedModule(Module):
    """Lightning's hook for stepping a scheduler, overridden to skip it after a skipped step."""

    scale_seen: float | None = None

    def lr_scheduler_step(self, scheduler, metric):
        scale = self.trainer.precision_plugin.scaler.get_scale()
        skipped = self.scale_seen is not None and scale < self.scale_seen  # update() backed off: no step
        self.scale_seen = scale
        if not skipped:
            scheduler.step()


plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
plugin._desired_input_dtype = torch.bfloat16
data = torch.utils.data.DataLoader(list(zip(*[torch.cat(t) for t in zip(*batches(args.steps))])), batch_size=8)
trainer = Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=args.steps, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(FixedModule() if args.fix else Module(), data)
