"""The rules of the program around the steps (autocast regions, checkpoints), each declared on its
check. Each reads what the recorder kept and yields findings; it changes nothing.
"""

from __future__ import annotations

from typing import Iterator

from audit.findings import ERROR, WARNING, Finding, rule


@rule("backward-in-autocast", WARNING,
      "backward ran inside an autocast region",
      "end the autocast region after the loss is computed; call backward outside it")
def backward_in_autocast(step: int | None, where: str, autocast: str | None) -> Iterator[Finding]:
    """A backward pass while an autocast region (entered at ``autocast``, None: none) is enabled."""
    if autocast is None:
        return
    yield Finding("backward-in-autocast", step, where,
                  f"backward at {where} ran inside the autocast region entered at {autocast}",
                  expected="backward outside autocast", got="backward inside autocast")


# Certain when nothing read the scaler's state after that step; a warning when
# scaler.state_dict() was called (it may have been written by other means).
@rule("checkpoint-without-scaler", ERROR,
      "a checkpoint saved the optimizer state but not the scaler state while a GradScaler was in use",
      "save scaler.state_dict() with the model and optimizer, and restore it with scaler.load_state_dict")
def checkpoint_without_scaler(saves: list[tuple[str, bool, bool, int | None]], scaler: str | None,
                              state_read: str | None) -> Iterator[Finding]:
    """The ``torch.save`` calls after one step (``saves``: where, holds optimizer state, holds
    scaler state, the step) saved optimizer state and no scaler state while ``scaler`` (an
    enabled GradScaler that scaled a loss; None: none) was in use. Several files saved after one
    step are one checkpoint (Accelerate saves the scaler in a file of its own). A warning when
    ``scaler.state_dict()`` was called since the step (at ``state_read``): that state may be
    written by means the audit does not see."""
    if scaler is None or not saves or any(holds_scaler for _, _, holds_scaler, _ in saves):
        return
    for where, holds_opt, _, step in saves:
        if not holds_opt:
            continue
        message = (f"torch.save at {where} saved optimizer state without {scaler}'s state (no file saved after "
                   "this step holds it): a resumed run restarts the loss scale at its initial value and loses the "
                   "growth tracker")
        if state_read is not None:
            message += (f"; scaler.state_dict() was called at {state_read}, so the scaler state may be written by "
                        "means the audit does not see (pickle, safetensors)")
        yield Finding("checkpoint-without-scaler", step, where, message,
                      expected="scaler.state_dict() in the checkpoint", got="no scaler state",
                      level=WARNING if state_read is not None else None)
        return
