"""The Hugging Face ``Trainer`` on the CPU: bf16 autocast, gradient accumulation, clipping.

A model defined here (no download): a small ``nn.Module`` whose forward takes the batch's
``x`` and ``labels`` and returns ``{"loss": ..., "logits": ...}``; a torch ``Dataset`` of dicts.
Read from transformers 5's source (``trainer.py``): ``TrainingArguments(bf16=True,
use_cpu=True)`` gives Accelerate ``mixed_precision="bf16"``, whose prepared forward autocasts;
the Trainer accumulates ``gradient_accumulation_steps`` microbatches itself (its Accelerator
gets ``num_steps=1``) and divides each loss by their number in ``training_step`` unless it
believes the model normalises the loss itself (``model_accepts_loss_kwargs``: the forward
declares ``**kwargs``, and the batch has ``labels`` to count ``num_items_in_batch``); it clips
with ``accelerator.clip_grad_norm_`` at ``max_grad_norm``, steps the optimizer, steps its
linear LR schedule unless Accelerate reports the step skipped, and calls ``model.zero_grad()``.

``--bug loss-not-divided``: the forward declares ``**kwargs`` but drops ``num_items_in_batch``,
returning the microbatch's mean loss: the Trainer skips its division and each window's gradient
is k times the mean (huggingface/transformers#47688, as #37766 reported it for 4.47). The call
that reaches ``loss.backward`` is Accelerate's, made from the Trainer's ``training_step``.
"""

import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.utils import logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import batches, make_model, parse  # noqa: E402

args = parse(("loss-not-divided",), k=2, out="")
warnings.filterwarnings("ignore")
logging.set_verbosity_error()


class Regressor(nn.Module):
    """The catalogue's small model; the loss is the batch's mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.net(x)
        return {"logits": out, "loss": None if labels is None else nn.functional.mse_loss(out.float(), labels)}


class KwargsRegressor(Regressor):
    """The same model whose forward declares ``**kwargs`` and ignores ``num_items_in_batch``."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs) -> dict:
        return super().forward(x, labels)


class Rows(torch.utils.data.Dataset):
    """The catalogue's batches, one row an item: the Trainer batches them again."""

    def __init__(self, n: int) -> None:
        self.rows = [{"x": x[i], "labels": y[i]} for x, y in batches(n) for i in range(len(x))]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


model = KwargsRegressor() if args.bug == "loss-not-divided" else Regressor()
training = TrainingArguments(
    output_dir=args.out or tempfile.mkdtemp(prefix="ampspec-audit-"), use_cpu=True, bf16=True,
    per_device_train_batch_size=8, gradient_accumulation_steps=args.k, max_grad_norm=1.0,
    max_steps=args.steps, learning_rate=1e-3, warmup_steps=2, report_to=[], save_strategy="no",
    logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
Trainer(model=model, args=training, train_dataset=Rows(args.steps * args.k)).train()
