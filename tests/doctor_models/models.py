"""The catalogue's models: one precision problem each, small enough to diagnose in seconds.

Each function is a task (``ampspec doctor --task doctor_models.models:forward_overflow`` with
this folder's parent on PYTHONPATH): ``(model, train_batches, val_batches)``, the model
returning its loss from ``model(x, y)``. ``CATALOGUE`` maps each to the doctor's precision,
options and expected verdicts, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F


def _batches(n: int, features: int, batch: int = 16, seed: int = 0, big: tuple[int, ...] = (),
             factor: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of N(0, 1) inputs (times ``factor`` on the batches in ``big``) and zero targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(batch, features, generator=g) * (factor if i in big else 1.0)
        out.append((x, torch.zeros(batch, 1)))
    return out


class Scale(nn.Module):
    """Multiplies by a constant (a fixed gain between layers)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Regressor(nn.Module):
    """fc1 -> act -> fc2 -> shrink -> head; MSE in float32 on the upcast output."""

    def __init__(self, features: int = 8, hidden: int = 32, gain: float = 1.0, shrink: float = 1.0,
                 loss_scale: float = 1.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.shrink = Scale(shrink)
        self.head = nn.Linear(hidden, 1)
        self.loss_scale = loss_scale
        with torch.no_grad():
            self.fc2.weight.mul_(gain)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.head(self.shrink(self.fc2(self.act(self.fc1(x)))))
        return F.mse_loss(out.float(), y) * self.loss_scale


def forward_overflow() -> tuple:
    """fc2's output passes 65504 on the batches whose inputs are 300x larger (3 of 8)."""
    torch.manual_seed(0)
    model = Regressor(gain=1000.0, shrink=1e-3)
    return model, _batches(8, 8, big=(2, 5, 6), factor=300.0), None


def gradient_underflow() -> tuple:
    """A loss multiplied by 1e-6: at loss scale 1 the activation gradients fall below fp16's subnormals."""
    torch.manual_seed(0)
    model = Regressor(loss_scale=1e-6)
    return model, _batches(6, 8), None


def pure_bf16_small_lr() -> tuple:
    """The whole model in bfloat16 (no fp32 master weights) trained with lr 1e-5."""
    torch.manual_seed(0)
    model = _TwoLayer().to(torch.bfloat16)
    return model, _batches(6, 8), None


class _TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))).float(), y.float())


class Distillation(nn.Module):
    """A student matching a frozen teacher with an L1 loss written by hand inside the autocast
    region: both outputs are 16-bit, and sub, abs and mean keep that dtype (on CPU and CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(8, 4)
        self.teacher = nn.Linear(8, 4)
        self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.student(x) - self.teacher(x)).abs().mean()


def loss_in_autocast() -> tuple:
    torch.manual_seed(0)
    return Distillation(), _batches(6, 8), None


class TinyRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps), written by hand: under CPU autocast every op stays in fp16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-8)


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.norm = TinyRMSNorm()
        self.head = nn.Linear(32, 1)
        with torch.no_grad():  # activations near 1e-3: their variance is below fp16's smallest normal
            self.fc1.weight.mul_(3e-3)
            self.fc1.bias.mul_(3e-3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.norm(self.fc1(x))).float(), y)


def fp16_normalization() -> tuple:
    torch.manual_seed(0)
    return NormNet(), _batches(6, 8), None


class Log(nn.Module):
    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return torch.log(p)


class LogOfSigmoid(nn.Module):
    """-log(sigmoid(z)) with z near -20 on some samples: sigmoid gives ~2e-9, which fp16 flushes to 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.sig = nn.Sigmoid()
        self.logp = Log()
        with torch.no_grad():
            self.fc.weight.fill_(3.0)
            self.fc.bias.fill_(-5.0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -self.logp(self.sig(self.fc(x))).float().mean()


def log_near_zero() -> tuple:
    torch.manual_seed(0)
    return LogOfSigmoid(), _batches(6, 8), None


class ChannelGain(nn.Module):
    """Multiplies two channels by a large gain: outlier channels, as in large transformers."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        g[:2] = self.gain
        return x * g


class Fp8Net(nn.Module):
    """first -> outliers -> mid (float8) -> act -> last; only ``mid`` converts (first and last are kept)."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.first = nn.Linear(16, 64)
        self.outliers = ChannelGain(gain)
        self.mid = nn.Linear(64, 64)
        self.act = nn.ReLU()
        self.last = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.last(self.act(self.mid(self.outliers(self.first(x))))).float(), y)


def fp8_outliers() -> tuple:
    torch.manual_seed(0)
    return Fp8Net(gain=1e5), _batches(4, 16), None


def fp8_healthy() -> tuple:
    torch.manual_seed(0)
    return Fp8Net(gain=1.0), _batches(4, 16), None


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x - 100.0)


class NanNet(nn.Module):
    """sqrt of a negative number: NaN in every precision, fp32 included."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bad = Sqrt()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.bad(self.fc(x))).float(), y)


def nan_in_fp32() -> tuple:
    torch.manual_seed(0)
    return NanNet(), _batches(4, 8), None


class WeightedSum(nn.Module):
    """A loss weighting samples from 1e3 down to 1e-10: its gradients span more binades than fp16
    holds, so no loss scale keeps 99.9 % of them; but the ones lost carry ~1e-13 of the mass, and
    the model trains in fp16 as in fp32 (the scaler backs off; the tiny samples never mattered)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.register_buffer("w", torch.tensor([1e3] * 8 + [1e-10] * 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.fc(x).float().squeeze(-1) * self.w).sum()


def spread_gradients() -> tuple:
    torch.manual_seed(0)
    return WeightedSum(), _batches(6, 8), None


class HandRMSNorm(nn.Module):
    """RMSNorm written as a new user would: under fp16 autocast every op stays in float16, and
    on activations of std ~100 ``x * x`` passes 65504, so ``rsqrt(inf)`` is 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)


class HandLayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + 1e-8)`` written by hand: on activations of variance ~1e-6 the
    float16 variance is a subnormal and the 1e-8 (below fp16's smallest subnormal) is lost."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-8)


class NormedRegressor(nn.Module):
    """fc1 (its output scaled by ``gain``) -> norm -> head, MSE in float32."""

    def __init__(self, norm: nn.Module, gain: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.norm = norm
        self.head = nn.Linear(64, 1)
        with torch.no_grad():
            self.fc1.weight.mul_(gain)
            self.fc1.bias.mul_(gain)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.norm(self.fc1(x))).float(), y)


def rmsnorm_overflow() -> tuple:
    """Activations of std ~100 into a hand-written RMSNorm: finite output, mostly zeros."""
    torch.manual_seed(0)
    return NormedRegressor(HandRMSNorm(), 170.0), _batches(6, 16), None


def layernorm_tiny_variance() -> tuple:
    """Activations of variance ~1e-6 into a hand-written LayerNorm."""
    torch.manual_seed(0)
    return NormedRegressor(HandLayerNorm(), 1.7e-3), _batches(6, 16), None


class Length(nn.Module):
    """The length of each row, ``sqrt(sum(h * h))``, written by hand: float16 flushes squares of
    values below ~1.7e-4 to zero, and the derivative of sqrt at 0 is infinite."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((h * h).sum(-1, keepdim=True))


class LengthNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.length = Length()
        self.head = nn.Linear(1, 1)
        with torch.no_grad():  # features of ~1e-5: their squares are below fp16's subnormals
            self.fc.weight.mul_(3e-5)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.length(self.fc(x))).float(), y)


def gradient_overflow() -> tuple:
    """Every step's gradient is infinite in fp16 whatever the scale (sqrt' at a flushed 0)."""
    torch.manual_seed(0)
    return LengthNet(), _batches(4, 8), None


class PaddedLength(nn.Module):
    """``sqrt(sum(h * h))`` over padded rows that are exactly zero: the derivative there is
    0 * inf = NaN in every precision, fp32 included."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4, bias=False)
        self.length = Length()
        self.head = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.length(self.fc(x))).float(), y)


def nan_gradient_in_fp32() -> tuple:
    torch.manual_seed(0)
    batches = _batches(3, 8)
    for x, _ in batches:
        x[-4:] = 0.0  # padding rows
    return PaddedLength(), batches, None


def readme_model() -> tuple:
    """The README's example (one linear layer, MSE under autocast): it trains in fp16 as in fp32;
    a dynamic scaler backs off once or twice on the first steps."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(self.lin(x), y)

    x = torch.randn(256, 8)
    y = x.mean(1, keepdim=True)
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 256, 32)]
    return Net(), batches, batches[:2]


class SmallMLP(nn.Module):
    """A few linear layers and MSE, as a new user writes them (the loss under autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


def small_mlp() -> tuple:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return SmallMLP(), [(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)) for _ in range(8)], None


class AuxHead(nn.Module):
    """A trunk with a main head and an auxiliary head whose loss weight is 1e-9: the gradient
    reaching ``aux`` is far below fp16's subnormals at any scale the main head allows."""

    def __init__(self, aux_weight: float = 1e-9) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.main = nn.Linear(32, 1)
        self.aux = nn.Linear(32, 4)
        self.aux_weight = aux_weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        main = F.mse_loss(self.main(h).float(), y)
        aux = F.mse_loss(self.aux(h).float(), y.expand(-1, 4))
        return main + self.aux_weight * aux


def aux_head() -> tuple:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    return AuxHead(), [(torch.randn(16, 16, generator=g), torch.randn(16, 1, generator=g)) for _ in range(6)], None


class Block(nn.Module):
    """x + fc(x), no normalisation: with a gain above 1 the residual stream grows every block."""

    def __init__(self, width: int, gain: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        with torch.no_grad():
            nn.init.orthogonal_(self.fc.weight, gain=gain)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class GrowingStream(nn.Module):
    def __init__(self, blocks: int = 8, width: int = 32, gain: float = 3.0) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width, gain) for _ in range(blocks)))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.blocks(x * 30.0)).float(), y)


def residual_growth() -> tuple:
    """The residual stream grows 4x a block (no norm): it passes 65504 in a late block."""
    torch.manual_seed(0)
    return GrowingStream(), _batches(4, 32), None


class TinyWeightsFp8(nn.Module):
    """A float8 layer whose loss weights samples by 1 and 1e-12: the tiny samples' gradients
    flush in float8_e5m2, carrying ~1e-12 of the gradient's mass."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 64)
        self.mid = nn.Linear(64, 64)
        self.last = nn.Linear(64, 1)
        self.register_buffer("w", torch.tensor([1.0] * 8 + [1e-12] * 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.last(torch.relu(self.mid(self.first(x)))).float().squeeze(-1)
        return ((out - y.squeeze(-1)) ** 2 * self.w).sum()


def fp8_negligible_flush() -> tuple:
    torch.manual_seed(0)
    return TinyWeightsFp8(), _batches(3, 16), None


def _adam_lr(lr: float) -> Callable:
    return lambda params: torch.optim.Adam(params, lr=lr)


@dataclass(frozen=True)
class Case:
    """A catalogue entry: the task, the doctor's precision and options, the exact verdicts."""

    make: Callable[[], tuple]
    precision: str
    expected: tuple[tuple[str, str | None], ...]
    options: dict[str, Any] = field(default_factory=dict)
    steps: int = 6
    needs_torchao: bool = False


CATALOGUE: dict[str, Case] = {
    "forward_overflow": Case(forward_overflow, "fp16", (("forward-overflow", "fc2"),), {"init_scale": 2.0**8}, 8),
    "gradient_underflow": Case(gradient_underflow, "fp16", (("gradient-underflow", "fc1"),), {"init_scale": 1.0}),
    "pure_bf16_small_lr": Case(pure_bf16_small_lr, "bf16", (("update-underflow", "fc1"), ("update-underflow", "fc2")),
                               {"optimizer": _adam_lr(1e-5)}),
    "loss_in_autocast": Case(loss_in_autocast, "bf16", (("loss-in-low-precision", None),)),
    "fp16_normalization": Case(fp16_normalization, "fp16", (("fp16-normalization", "norm"),), {"init_scale": 1.0}),
    "log_near_zero": Case(log_near_zero, "fp16", (("unsafe-math", "logp"),)),
    "fp8_outliers": Case(fp8_outliers, "fp8", (("fp8-underflow", "mid"),), steps=3, needs_torchao=True),
    "gradient_overflow": Case(gradient_overflow, "fp16", (("gradient-overflow", "length"),), steps=3),
    "rmsnorm_overflow": Case(rmsnorm_overflow, "fp16", (("inner-overflow", "norm"),), steps=4),
    "layernorm_tiny_variance": Case(layernorm_tiny_variance, "fp16", (("fp16-normalization", "norm"),), steps=4),
    "readme_model": Case(readme_model, "fp16", (), steps=8),
    "spread_gradients": Case(spread_gradients, "fp16", (), steps=12),
    "small_mlp": Case(small_mlp, "fp16", (), steps=8),
    "aux_head": Case(aux_head, "fp16", (("gradient-underflow", "aux"),), steps=3),
    "residual_growth": Case(residual_growth, "fp16", (("forward-overflow", "blocks.5.fc"),), steps=3),
    "fp8_negligible_flush": Case(fp8_negligible_flush, "fp8", (), steps=3, needs_torchao=True),
    "nan_in_fp32": Case(nan_in_fp32, "fp16", (("not-precision", "bad"),), steps=3),
    "nan_gradient_in_fp32": Case(nan_gradient_in_fp32, "fp16", (("not-precision", "length"),), steps=3),
    "fp8_healthy": Case(fp8_healthy, "fp8", (), steps=3, needs_torchao=True),
}
