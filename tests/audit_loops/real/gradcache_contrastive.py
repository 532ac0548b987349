"""Contrastive training with a gradient cache: a large-batch loss over microbatches.

Modelled on luyug/GradCache, ``src/grad_cache/grad_cache.py`` (``GradCache.cache_step``:
``forward_no_grad``, ``build_cache``, ``forward_backward``), commit
906f03835fbc183132a9db32612a9e8f180ca3b4, used as its README's mixed-precision example shows.
Reproduced, in its order: each microbatch's representations computed without gradients; the
full-batch contrastive loss (cross-entropy of the query-passage score matrix) over those
representations, detached and made to require gradients, ``scaler.scale(loss).backward()``,
whose gradients on the representations are the cache; then per microbatch a second forward with
gradients and the surrogate ``torch.dot(reps.flatten(), cached_gradient.flatten()).backward()``;
then ``scaler.step(optimizer)``, ``scaler.update()``, ``optimizer.zero_grad()``.

The truth, from reading the original: correct. The k surrogate backward passes are not the
microbatches of an undivided loss (each carries its share of the full-batch loss's gradient,
already scaled): dividing them by k would be wrong. No finding.
"""

import torch
from torch import nn

from _real import overflow, parse

args = parse(chunks=4)
torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)

for step in range(args.steps):
    queries = torch.randn(4 * args.chunks, 16, generator=g)
    passages = queries + 0.3 * torch.randn(4 * args.chunks, 16, generator=g)
    q_chunks, p_chunks = queries.split(4), passages.split(4)
    with torch.no_grad():  # forward_no_grad
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q_reps = [encoder(x).float() for x in q_chunks]
            p_reps = [encoder(x).float() for x in p_chunks]
    q_all = torch.cat(q_reps).detach().requires_grad_()  # build_cache
    p_all = torch.cat(p_reps).detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = q_all @ p_all.t()
        loss = nn.functional.cross_entropy(overflow(scores.float(), step in args.inf_at), torch.arange(len(q_all)))
    scaler.scale(loss).backward()
    q_cache, p_cache = q_all.grad.split(4), p_all.grad.split(4)
    for chunks, cache in ((q_chunks, q_cache), (p_chunks, p_cache)):  # forward_backward
        for x, gradient in zip(chunks, cache):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                reps = encoder(x).float()
            surrogate = torch.dot(reps.flatten(), gradient.flatten())
            surrogate.backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
