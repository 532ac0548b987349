"""Embedded tasks: small models on data generated in code from a seed (nothing downloaded).

1. ``lm``: a small causal transformer language model on a sequence-reversal task. Each
   sequence is ``x, SEP, reversed(x)`` over a vocabulary of digits; the loss counts only the
   reversed half, so a model that learned the task reaches a loss near 0.
2. ``mlp``: a small MLP (with dropout) regressing a fixed random smooth function.

Batches are a pure function of ``(seed, epoch, index)``: :class:`SyntheticBatches` can start
at any position without replaying the ones before it (``iter_from``), which the trainer uses
to resume. Every model returns its loss when called with ``(inputs, targets)``.

3. A user's task, ``module:function``: the working directory is put at the front of
   ``sys.path`` (as ``python -m`` does), then every generator (Python's ``random``, NumPy's
   global one, torch's on every device) is seeded from ``train.seed`` and ``function()`` is
   called, so the model's initialisation and any data order drawn there are seeded.
"""

from __future__ import annotations

import importlib
import math
import os
import random
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from torchimpl.config.schema import TaskConfig
from torchimpl.task.checks import call_task, check_imported, check_module, check_result, import_failure

__all__ = ["ReverseLM", "RegressionMLP", "SyntheticBatches", "Task", "build_task", "check_task", "seed_everything"]

_DIGITS = 10
_SEP = 10
_VOCAB = 11


class SyntheticBatches:
    """A re-iterable of ``(inputs, targets)`` batches, ``batches_per_epoch`` per epoch."""

    def __init__(self, make: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]],
                 seed: int, batches_per_epoch: int):
        if batches_per_epoch < 1:
            raise ValueError(f"batches_per_epoch must be >= 1, got {batches_per_epoch}")
        self._make = make
        self.seed = seed
        self.batches_per_epoch = batches_per_epoch

    def __len__(self) -> int:
        return self.batches_per_epoch

    def batch(self, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 1_000_003 + index)
        return self._make(g)

    def iter_from(self, epoch: int, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(index, self.batches_per_epoch):
            yield self.batch(epoch, i)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.iter_from(0, 0)


class ReverseLM(nn.Module):
    """A pre-norm causal transformer; ``forward(tokens, targets)`` returns the mean loss."""

    def __init__(self, length: int, d_model: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.seq = 2 * length
        self.embed = nn.Embedding(_VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(self.seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, _VOCAB)
        self.register_buffer(
            "causal", torch.triu(torch.full((self.seq, self.seq), float("-inf")), 1), persistent=False
        )

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        h = self.blocks(h, mask=self.causal[:n, :n], is_causal=True)
        logits = self.head(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, _VOCAB), targets.reshape(-1), ignore_index=-100)


def _reverse_batch(batch_size: int, length: int) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def make(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, _DIGITS, (batch_size, length), generator=g)
        sep = torch.full((batch_size, 1), _SEP)
        seq = torch.cat([x, sep, x.flip(1)], dim=1)
        inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
        targets[:, : length - 1] = -100  # only the reversed half is predictable
        return inputs, targets

    return make


class RegressionMLP(nn.Module):
    """``forward(x, y)`` returns the mean squared error."""

    def __init__(self, features: int = 16, hidden: int = 64, dropout: float = 0.1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.net(x)
        return out if y is None else F.mse_loss(out, y)


def _regression_batch(batch_size: int, features: int, seed: int) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    w = torch.randn(features, 4, generator=torch.Generator().manual_seed(seed + 17)) / math.sqrt(features)

    def make(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, features, generator=g)
        z = x @ w
        y = (torch.sin(2 * z[:, :1]) + z[:, 1:2] * z[:, 2:3] - 0.5 * z[:, 3:4]).contiguous()
        return x, y

    return make


@dataclass
class Task:
    """A model with its data; ``loss_fn(model, batch)`` when the model does not return a loss."""

    model: nn.Module
    train_data: Any
    val_data: Any
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None


def build_task(config: TaskConfig, *, seed: int, batch_size: int) -> Task:
    """The task named by ``config``: embedded (``lm``, ``mlp``) or a user's ``module:function``
    (called after :func:`seed_everything` ``(seed)``; see rule 3)."""
    if config.name == "lm":
        length = 6 if config.size == "tiny" else 8
        d_model = 32 if config.size == "tiny" else 64
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = ReverseLM(length, d_model=d_model, layers=1 if config.size == "tiny" else 2)
        make = _reverse_batch(batch_size, length)
        return Task(model, SyntheticBatches(make, seed, 64), SyntheticBatches(make, seed + 1, 4))
    if config.name == "mlp":
        hidden = 32 if config.size == "tiny" else 64
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = RegressionMLP(hidden=hidden)
        make = _regression_batch(batch_size, 16, seed)
        return Task(model, SyntheticBatches(make, seed, 64), SyntheticBatches(make, seed + 1, 4))
    return _user_task(config.name, seed)


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _put_working_directory_on_path() -> None:
    """Put the working directory first on ``sys.path``, once, as ``python -m`` does.

    It stays there (rather than only for the import) so that what the user's module imports
    later (inside ``make()``, in ``forward``) and DataLoader workers started with ``spawn``
    (which copy the parent's ``sys.path``) find the same modules."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        sys.path.insert(0, cwd)


def _import_user_module(entry: str, module_name: str) -> Any:
    check_module(entry, module_name)
    _put_working_directory_on_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or (module_name + ".").startswith(exc.name + "."):
            raise ValueError(
                f"task.name {entry!r}: no module {module_name!r} in the working directory {os.getcwd()} "
                f"or on sys.path; run from the folder holding {module_name.split('.')[0]}.py, or add "
                "its folder to PYTHONPATH"
            ) from None
        raise ValueError(f"task.name {entry!r}: importing {module_name!r} failed: {exc}") from None
    except ImportError as exc:
        raise ValueError(f"task.name {entry!r}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module: a syntax error, an exception at import
        raise import_failure(entry, module_name, exc) from None
    check_imported(entry, module)
    return module


def check_task(config: TaskConfig) -> None:
    """Rule 3's look-up alone, the module imported and the function found but not called: a
    bad ``task.name`` is named before any work (``ampspec compare`` checks it before its runs)."""
    if config.name not in ("lm", "mlp"):
        _user_function(config.name)


def _user_function(entry: str) -> Callable[[], Any]:
    module_name, _, func_name = entry.partition(":")
    module = _import_user_module(entry, module_name)
    func = getattr(module, func_name, None)
    if func is None:
        raise ValueError(f"task.name {entry!r}: module {module_name!r} has no function {func_name!r}")
    return func


def _user_task(entry: str, seed: int) -> Task:
    func = _user_function(entry)
    seed_everything(seed)
    result = call_task(entry, func)
    check_result(entry, result)
    return Task(*result)
