"""Whether several backward passes before one optimizer step are an accumulation window.

They are only when they are microbatches of one loss; several different losses backpropagated
into one step (PyTorch's multiple-losses example with ``retain_graph=True``, a contrastive loss
recomputed once per cached microbatch, a surrogate backward of cached gradients) are not, and
dividing them by their count would be wrong. What the autograd graph shows decides, read when
each backward starts (`describe`) and judged when the step closes (the check of
``loss-not-divided``, `audit.checks_steps.loss_not_divided`):

- not a window (no finding): a backward that kept its graph for the next one
  (``retain_graph=True``: several losses of one forward), different loss functions at the roots,
  different sets of parameters reached, a backward from explicit gradients or from a product
  with a constant tensor (a surrogate of gradients computed elsewhere), or a loss over
  representations concatenated with detached ones (a full-batch loss over cached
  representations);
- certain (error): every backward starts from the output of the same loss function (a torch
  loss, or a mean), with no constant multiply or divide between it and backward, each reaching
  the same parameters;
- otherwise (warning): undivided, but the roots are no loss function the audit recognises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Backward", "describe", "is_loss_node", "mixes_constants"]

_CONST_OPS = {"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"}
_CAST_OPS = {"ToCopyBackward0"}
_JOINS = {"CatBackward0", "StackBackward0"}
_WALK = 128  # graph nodes read at most per backward (only for windows that look undivided)


@dataclass
class Backward:
    """One backward pass as the step's windows see it."""

    where: str
    factor: float | None  # the constant multiplications and divisions between the loss and backward
    scaler: Any  # the ScalerTrack that scaled its loss, or None
    root: Any = None  # the autograd node below those constants (kept alive until the step closes)
    retain: bool = False
    explicit: bool = False  # backward from given gradients, not from a scalar loss
    params: frozenset[int] | None = None  # the parameters whose gradients it changed

    @property
    def loss_fn(self) -> str | None:
        return None if self.root is None else self.root.name()


def describe(start: Any, retain: bool, explicit: bool) -> tuple[float | None, Any]:
    """(factor, root node) for the tensor a backward starts from: the factor is the product of the
    constant multiplications and divisions (and dtype casts) between that tensor and the loss that
    the last other operation produced (the GradScaler's own multiplication is excluded by starting
    below it); exactly 1 means nothing divided the loss; None when it cannot be read."""
    factor = 1.0
    node = getattr(start, "grad_fn", None)
    for _ in range(16):
        if node is None:
            return factor, None
        name = node.name()
        nxt = node.next_functions
        if name in _CAST_OPS:
            node = nxt[0][0] if nxt else None
            continue
        if name not in _CONST_OPS or len(nxt) == 0:
            return factor, node
        const, follow = _constant_operand(node, name, nxt)
        if follow is None:
            return factor, node  # a product of two tensors: the chain of constants ends here
        if const is None:
            return None, node  # the constant is not saved where this torch keeps it: unreadable
        c = _as_float(const)
        if c is None:
            return factor, node  # a constant tensor of many elements: no loss scaling, the chain ends
        factor = factor * c if name.startswith("Mul") else factor / c
        node = follow
    return None, node


def _constant_operand(node: Any, name: str, nxt: Any) -> tuple[Any, Any]:
    if len(nxt) == 1:  # a Scalar overload: one tensor input, the constant saved
        return getattr(node, "_saved_other", None), nxt[0][0]
    if nxt[1][0] is None and nxt[0][0] is not None:
        return getattr(node, "_saved_other", None), nxt[0][0]
    if nxt[0][0] is None and nxt[1][0] is not None and name.startswith("Mul"):
        return getattr(node, "_saved_self", None), nxt[1][0]
    return None, None


def _as_float(const: Any) -> float | None:
    try:
        if hasattr(const, "numel"):
            return float(const) if const.numel() == 1 else None
        return float(const)
    except (TypeError, ValueError, RuntimeError):
        return None


def is_loss_node(name: str | None) -> bool:
    """A torch loss function's node, or a mean (a loss written by hand)."""
    return name is not None and (name.endswith("LossBackward0") or name.startswith(("MeanBackward",
                                 "BinaryCrossEntropy", "KlDivBackward", "NllLoss")))


def mixes_constants(root: Any) -> bool:
    """Whether the graph below ``root`` holds a product with a constant tensor right at the root
    (a surrogate ``dot(reps, cached_grads)``) or a concatenation of tensors with and without
    gradients (live representations among cached ones)."""
    if root is None:
        return False
    if root.name() in ("DotBackward0", "MulBackward0", "SumBackward0", "SumBackward1"):
        node = root
        while node is not None and node.name().startswith("Sum"):
            node = node.next_functions[0][0] if node.next_functions else None
        if node is not None and node.name() in ("DotBackward0", "MulBackward0", "MmBackward0"):
            if any(f is None for f, _ in node.next_functions):
                return True
    seen, stack = set(), [root]
    while stack and len(seen) < _WALK:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nxt = node.next_functions
        if node.name() in _JOINS and any(f is None for f, _ in nxt) and any(f is not None for f, _ in nxt):
            return True
        stack.extend(f for f, _ in nxt)
    return False
