"""CLIP-LoRA's few-shot training loop: a cosine schedule stepped every iteration.

Modelled on MaxZanella/CLIP-LoRA, ``lora.py`` (``run_lora``), commit
37a196d9094967b04246c80f072639f2d5a71eca. Reproduced, in its order: AdamW and
``CosineAnnealingLR`` over the LoRA parameters; per iteration the text and image features under
autocast, ``logit_scale * image_features @ text_features.t()``, cross-entropy;
``optimizer.zero_grad()``; ``scaler.scale(loss).backward()``; ``scaler.step(optimizer)``;
``scaler.update()``; ``scheduler.step()``.

The truth, from reading the original: ``scheduler-on-skipped-step``, an error, at every step the
scaler skipped: ``scheduler.step()`` runs after every iteration (a real bug).

``--log-norm 1`` plants a mistake that is not in the original: the gradients divided by
``scaler.get_scale()`` by hand to log their true norm, before ``scaler.step``, which unscales them
again (the update is divided by the scale): ``unscale-twice``, an error, at every step.
"""

import torch
from torch import nn

from _real import batches, overflow, parse

args = parse(log_norm=0)
torch.manual_seed(0)
image_encoder, text_features = nn.Linear(16, 8), torch.randn(4, 8)
lora_a, lora_b = nn.Parameter(torch.randn(16, 2) * 0.1), nn.Parameter(torch.zeros(2, 8))
optimizer = torch.optim.AdamW([lora_a, lora_b], weight_decay=1e-2, betas=(0.9, 0.999), lr=2e-4)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps, eta_min=1e-6)
scaler = torch.amp.GradScaler("cpu")
logit_scale = 100.0

for i, (images, target) in enumerate(batches(args.steps)):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        image_features = image_encoder(images) + images @ lora_a @ lora_b
    image_features = image_features.float()
    image_features = image_features / image_features.norm(dim=-1, keepdim=True)
    txt = text_features / text_features.norm(dim=-1, keepdim=True)
    cosine_similarity = overflow(logit_scale * image_features @ txt.t(), i in args.inf_at)
    loss = nn.functional.cross_entropy(cosine_similarity, target)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    if args.log_norm:
        for p in (lora_a, lora_b):
            p.grad.mul_(1.0 / scaler.get_scale())
        true_norm = torch.stack([p.grad.norm() for p in (lora_a, lora_b)]).norm()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
