"""The loss protocol: what the trainer calls to get a batch's loss, and what it says when a
model does not follow it.

Without a ``loss_fn``, a batch ``(inputs, targets)`` is passed whole: ``model(inputs, targets)``
must return the batch's mean loss, a 0-d floating tensor. A model whose ``forward`` takes the
inputs alone and returns its output (logits, predictions) is the commonest way to miss this:
on the first batch, before any step, the call is refused with the shape the model returned
and the two fixes (return the loss from ``forward``, or give a ``loss_fn(model, batch)``: the
fourth value of a task's ``make()``, or ``Trainer.fit(loss_fn=...)``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["bad_loss_message", "default_loss_fn"]

_FIXES = ("return the loss from forward (forward(self, inputs, targets) -> the batch's mean loss), or compute it "
          "in a loss_fn(model, batch): the fourth value a task's make() returns, e.g. "
          "(model, train_data, val_data, lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), "
          "batch[1])), or Trainer.fit(..., loss_fn=...) from Python")


def default_loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss protocol: a batch ``(inputs, targets)``; ``model(inputs, targets)`` is the loss."""
    if isinstance(batch, (tuple, list)):
        try:
            return model(*batch)
        except TypeError as exc:
            if _accepts(model, len(batch)):  # the TypeError came from inside the model: not ours to explain
                raise
            raise ValueError(_not_callable_message(model, batch, exc)) from None
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


def bad_loss_message(loss: Any) -> str:
    """What the trainer says when the loss is not a 0-d floating tensor."""
    if isinstance(loss, torch.Tensor):
        got = f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
        if loss.ndim > 0:
            return (f"the loss must be a 0-d floating tensor, got {got}: per-example losses need reducing (e.g. "
                    f"loss.mean()); if it is the model's output rather than a loss, {_FIXES}")
    else:
        got = f"a {type(loss).__name__} ({loss!r})"[:200]
    return (f"the loss must be a 0-d floating tensor, got {got}: return the batch's mean loss as a tensor "
            "from loss_fn (or from model(inputs, targets)), e.g. loss.mean()")


def _unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (``module``) or ``torch.compile`` (``_orig_mod``)."""
    for _ in range(4):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def _accepts(model: nn.Module, n: int) -> bool:
    """Whether ``model.forward`` takes ``n`` positional arguments (True when it cannot tell)."""
    try:
        inspect.signature(_unwrapped(model).forward).bind(*range(n))
    except TypeError:
        return False
    except ValueError:  # no signature to read
        return True
    return True


def _not_callable_message(model: nn.Module, batch: Any, exc: TypeError) -> str:
    name = type(_unwrapped(model)).__name__
    head = (f"the model was called as model(*batch) with the {len(batch)} parts of a batch, which the loss protocol "
            f"needs, and refused them ({exc})")
    if not _accepts(model, 1):
        return f"{head}: {_FIXES}"
    # What forward returns for the inputs alone, so that the message can name it; no gradient,
    # and the generators are restored, so that nothing of the run changes.
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = model(batch[0])
        shape = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
    except Exception as inner:  # noqa: BLE001 - only to describe the output; the refusal stands
        shape = f"an error ({type(inner).__name__}: {inner})"
    return (f"{head}; {name}(inputs) returned {shape}, the model's output, not a loss: {_FIXES}")
