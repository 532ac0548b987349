"""The healthy catalogue: a GPT-2-style language model, a ViT, a ResNet with BatchNorm, a U-Net,
an LSTM language model and a mixture-of-experts block (see the package docstring)."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- GPT-2 style


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2's layout and initialisation (std 0.02, residual projections 0.02 / sqrt(2 n_layer)), tied embeddings."""

    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 3, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") or name.endswith("mlp.2.weight") \
                    else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def gpt2() -> tuple:
    torch.manual_seed(0)
    g = _gen(10)
    batches = []
    for _ in range(4):
        seq = torch.randint(0, 512, (4, 65), generator=g)
        batches.append((seq[:, :-1], seq[:, 1:]))
    return GPT(), batches, None


# ---------------------------------------------------------------- ViT


class ViT(nn.Module):
    """Patch embedding, a class token, pre-norm encoder layers (torch's), a linear head."""

    def __init__(self, image: int = 32, patch: int = 4, d: int = 96, layers: int = 3, heads: int = 4,
                 classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        n = (image // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, n + 1, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = self.patch(x).flatten(2).transpose(1, 2)
        z = torch.cat([self.cls.expand(z.shape[0], -1, -1), z], dim=1) + self.pos
        z = self.norm(self.encoder(z))
        return F.cross_entropy(self.head(z[:, 0]).float(), y)


def _images(n: int, batch: int, seed: int, size: int = 32, classes: int = 10) -> list:
    g = _gen(seed)
    return [(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n)]


def vit() -> tuple:
    torch.manual_seed(0)
    return ViT(), _images(4, 8, 11), None


# ---------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet(nn.Module):
    """A CIFAR ResNet (He init, BatchNorm) with three stages."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.layer3 = BasicBlock(2 * width, 4 * width, 2)
        self.fc = nn.Linear(4 * width, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return F.cross_entropy(self.fc(z.mean((2, 3))).float(), y)


def resnet() -> tuple:
    torch.manual_seed(0)
    return ResNet(), _images(4, 8, 12), None


# ---------------------------------------------------------------- U-Net


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())


class UNet(nn.Module):
    """Two downsamplings, skip connections, GroupNorm and SiLU; a denoiser (MSE on the noise)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.down1, self.down2 = _double_conv(3, width), _double_conv(width, 2 * width)
        self.mid = _double_conv(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = _double_conv(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = _double_conv(2 * width, width)
        self.out = nn.Conv2d(width, 3, 1)

    def forward(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x + noise)
        d2 = self.down2(F.max_pool2d(d1, 2))
        m = self.mid(F.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], 1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], 1))
        return F.mse_loss(self.out(u1).float(), noise)


def unet() -> tuple:
    torch.manual_seed(0)
    g = _gen(13)
    return UNet(), [(torch.randn(4, 3, 32, 32, generator=g), torch.randn(4, 3, 32, 32, generator=g))
                    for _ in range(4)], None


# ---------------------------------------------------------------- LSTM


class LSTMLM(nn.Module):
    """A two-layer LSTM language model, unrolled over time with ``nn.LSTMCell`` (CPU autocast has no
    float16 kernel for the fused ``nn.LSTM``: oneDNN refuses it; the cells run through the linear
    layers autocast casts, as the fused kernel does on CUDA)."""

    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.cells = nn.ModuleList(nn.LSTMCell(d, d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for cell in self.cells:
            h = c = x.new_zeros(x.shape[0], cell.hidden_size)
            outs = []
            for t in range(x.shape[1]):
                h, c = cell(x[:, t], (h, c))
                outs.append(h)
            x = torch.stack(outs, 1)
        logits = self.head(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lstm() -> tuple:
    torch.manual_seed(0)
    g = _gen(14)
    batches = []
    for _ in range(4):
        seq = torch.randint(0, 256, (8, 17), generator=g)
        batches.append((seq[:, :-1], seq[:, 1:]))
    return LSTMLM(), batches, None


# ---------------------------------------------------------------- mixture of experts


class MoE(nn.Module):
    """A top-2 router over MLP experts (softmax in float32, as Switch / Mixtral do), between
    pre-norm residual connections, with the load-balancing auxiliary loss."""

    def __init__(self, d: int = 96, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                     for _ in range(experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x)
        probs = self.router(h).float().softmax(-1)
        top, idx = probs.topk(self.k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = (idx == e)
            rows = chosen.any(-1)
            if rows.any():
                weight = (top * chosen).sum(-1)[rows].unsqueeze(-1)
                out[rows] = out[rows] + (expert(h[rows]).float() * weight).to(out.dtype)
        load = F.one_hot(idx[..., 0], probs.shape[-1]).float().mean(0)
        aux = probs.shape[-1] * (load * probs.mean(0)).sum()
        return x + out, aux


class MoEModel(nn.Module):
    def __init__(self, d: int = 96, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(32, d)
        self.moe = MoE(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, aux = self.moe(self.embed(x))
        return F.cross_entropy(self.head(h).float(), y) + 0.01 * aux


def moe() -> tuple:
    torch.manual_seed(0)
    g = _gen(15)
    return MoEModel(), [(torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))
                        for _ in range(4)], None


HEALTHY: dict[str, Callable[[], tuple]] = {"gpt2": gpt2, "vit": vit, "resnet": resnet, "unet": unet,
                                           "lstm": lstm, "moe": moe}
CI = ("gpt2", "resnet", "moe")
"""Diagnosed on every test run (in both precisions); the others with --runslow."""
