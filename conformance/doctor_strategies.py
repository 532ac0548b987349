"""Generated models for the doctor's health property (conformance/test_health.py).

A drawn ``DoctorCase`` is a small regression network (2-4 linear layers of drawn widths, a drawn
activation) with up to two planted faults whose presence is known by construction, never read
back from the doctor:

- ``poison_steps``: the steps on which a ``Poison`` module turns the 16-bit gradient passing
  through it into infinities (whatever the loss scale: backing off cannot help), as an op whose
  backward misbehaves in 16 bits would. The fp32 shadow's gradient passes untouched, so these
  are steps a real run skips for a reason that is not the scale.
- ``collapse``: a ``Coarse`` module that, in the 16-bit run only, rounds its input to a grid of
  ``collapse`` (a signal of std ~0.3 rounded to 0.25 .. 1): the mixed output loses most of its
  signal, the shadow's is exact.

``init_scale`` is drawn from 2^6 .. 2^24: these networks' gradients stay far below 2^8, so at a
scale of 2^8 or less no step overflows for the scale's sake, and at 2^16 or more the first steps
do (the scaler's warm-up).

The batches carry the step's poison flag as their third element, so every rerun of a step (the
op scans, the fix's rerun) sees the same flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

_LOW = (torch.float16, torch.bfloat16)


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.poison = bool(flag)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.poison and grad.dtype in _LOW:
            grad = grad * float("inf")
        return grad, None


class Poison(nn.Module):
    """Identity forward; on a flagged step, a 16-bit gradient through it becomes infinite."""

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        return _InfGrad.apply(x, flag)


class Coarse(nn.Module):
    """Identity in fp32; in 16 bits the input rounded to multiples of ``step`` (straight-through)."""

    def __init__(self, step: float) -> None:
        super().__init__()
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _LOW or self.step == 0:
            return x
        return x + ((x / self.step).round() * self.step - x).detach()


class Generated(nn.Module):
    def __init__(self, widths: list[int], activation: str, collapse: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.act = {"relu": nn.ReLU(), "gelu": nn.GELU(), "tanh": nn.Tanh()}[activation]
        self.coarse = Coarse(collapse)
        self.poison = Poison()
        self.head = nn.Linear(widths[-1], 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = self.act(layer(x))
            if i == 0:
                x = self.poison(self.coarse(x), flag)
        return F.mse_loss(self.head(x).float(), y)


@dataclass(frozen=True)
class DoctorCase:
    seed: int
    precision: str
    widths: tuple[int, ...]
    activation: str
    collapse: float
    poison_steps: tuple[int, ...]
    steps: int
    init_scale: float = 2.0**8

    def make(self) -> tuple[nn.Module, list]:
        torch.manual_seed(self.seed)
        model = Generated(list(self.widths), self.activation, self.collapse)
        g = torch.Generator().manual_seed(self.seed + 1)
        batches = [(torch.randn(16, self.widths[0], generator=g), torch.randn(16, 1, generator=g),
                    torch.tensor(k in self.poison_steps)) for k in range(self.steps)]
        return model, batches

    def reproduce(self) -> str:
        fields = (self.seed, self.precision, self.widths, self.activation, self.collapse, self.poison_steps,
                  self.steps, self.init_scale)
        return f"DoctorCase{fields}"


@st.composite
def doctor_cases(draw, faults: tuple[str, ...] = ("collapse", "none", "poison", "both")) -> DoctorCase:
    """A generated model and its planted faults, one of ``faults`` (none, a poison, a collapse or both)."""
    steps = draw(st.integers(2, 4))
    widths = tuple(draw(st.lists(st.sampled_from([8, 16, 32]), min_size=2, max_size=4)))
    fault = draw(st.sampled_from(faults))
    poison = draw(st.lists(st.integers(0, steps - 1), min_size=1, max_size=steps, unique=True)
                  .map(lambda v: tuple(sorted(v)))) if fault in ("poison", "both") else ()
    collapse = draw(st.sampled_from([0.25, 0.5, 1.0])) if fault in ("collapse", "both") else 0.0
    return DoctorCase(draw(st.integers(0, 2**16)), draw(st.sampled_from(["fp16", "bf16", "fp16"])), widths,
                      draw(st.sampled_from(["relu", "gelu", "tanh"])), collapse, poison, steps,
                      draw(st.sampled_from([2.0**8, 2.0**6, 2.0**16, 2.0**8, 2.0**24])))
