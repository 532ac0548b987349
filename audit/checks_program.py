"""The rules of the program around the steps (autocast regions, checkpoints), each declared on its
check. Each reads what the recorder kept and yields findings; it changes nothing.
"""

from __future__ import annotations

from typing import Iterator

from audit.events import BackwardCall, CheckpointSaved
from audit.findings import ERROR, INFO, WARNING, Finding, rule


@rule("backward-in-autocast", WARNING,
      "backward ran inside an autocast region",
      "end the autocast region after the loss is computed; call backward outside it",
      doc="backward inside an autocast region; info when a framework entered the region around the "
          "code that calls backward (Lightning's manual optimization: `training_step` runs inside "
          "the precision plugin's autocast), which the loop cannot leave",
      uncertain=INFO, events=("BackwardCall",))
def backward_in_autocast(ev: BackwardCall) -> Iterator[Finding]:
    """A backward pass while an autocast region (entered at ``autocast``, None: none) is enabled.
    Info when a framework's code entered the region (``autocast`` carries its call,
    `audit.frameworks.Site`): the framework runs the user's step inside it and the loop has no
    way out; backward's ops keep the dtypes their forward ops had either way."""
    step, where, autocast = ev.step, ev.where, ev.autocast
    if autocast is None:
        return
    via = getattr(autocast, "via", None)
    if via is not None:
        yield Finding("backward-in-autocast", step, where,
                      f"backward at {where} ran inside the autocast region that {via.name} {via.version} entered "
                      f"at {via.frame} around the code it runs: torch advises against it, but the loop cannot "
                      "leave the framework's region, and backward's ops keep their forward ops' dtypes",
                      expected="backward outside autocast", got="backward inside the framework's autocast",
                      level=INFO)
        return
    yield Finding("backward-in-autocast", step, where,
                  f"backward at {where} ran inside the autocast region entered at {autocast}",
                  expected="backward outside autocast", got="backward inside autocast")


# Certain when nothing read the scaler's state after that step and every saved object was read
# whole; a warning when scaler.state_dict() was called (it may have been written by other means)
# or a saved object was too large or deep to read whole (`audit.saved`).
@rule("checkpoint-without-scaler", ERROR,
      "a checkpoint saved the optimizer state but not the scaler state while a GradScaler was in use",
      "save scaler.state_dict() with the model and optimizer, and restore it with scaler.load_state_dict",
      framework_fixes={
          "lightning.fabric": "fabric.save leaves the precision plugin's state out: add "
                              "fabric.strategy.precision.state_dict() to the saved state and restore it with "
                              "fabric.strategy.precision.load_state_dict",
          "accelerate": "save with accelerator.save_state: it writes the scaler's state (scaler.pt)"},
      doc="the files saved after a step hold optimizer state and no scaler state while a GradScaler "
          "is in use; scaler state is recognised by its content at any depth, under any key, in "
          "dicts, lists and objects' attributes (inside an optimizer wrapper's state as MMEngine "
          "saves it, Lightning's `MixedPrecision` entry, Accelerate's `scaler.pt`, DeepSpeed's, "
          "apex's and Megatron's shapes; `audit/saved.py`); a warning when `scaler.state_dict()` was "
          "called (it may be saved by other means) or a saved object was too large or deep to read "
          "whole", uncertain=WARNING, events=("CheckpointSaved",))
def checkpoint_without_scaler(ev: CheckpointSaved) -> Iterator[Finding]:
    """The ``torch.save`` calls after one step (``saves``: where, holds optimizer state, holds
    scaler state (None: not known, the object was not read whole), the step) saved optimizer
    state and no scaler state while ``scaler`` (an enabled GradScaler that scaled a loss; None:
    none) was in use. Scaler state is recognised by its content at any depth (`audit.saved`).
    Several files saved after one step are one checkpoint (Accelerate saves the scaler in a file
    of its own). A warning when ``scaler.state_dict()`` was called since the step (at
    ``state_read``): that state may be written by means the audit does not see; or when a saved
    object was not read whole."""
    saves, scaler, state_read = ev.saves, ev.scaler, ev.state_read
    if scaler is None or not saves or any(holds_scaler for _, _, holds_scaler, _ in saves):
        return
    unread = [where for where, _, holds_scaler, _ in saves if holds_scaler is None]
    for where, holds_opt, _, step in saves:
        if not holds_opt:
            continue
        message = (f"torch.save at {where} saved optimizer state without {scaler}'s state (no file saved after "
                   "this step holds it): a resumed run restarts the loss scale at its initial value and loses the "
                   "growth tracker")
        if state_read is not None:
            message += (f"; scaler.state_dict() was called at {state_read}, so the scaler state may be written by "
                        "means the audit does not see (pickle, safetensors)")
        if unread:
            message += (f"; the object saved at {unread[0]} was too large or deep to read whole, so the scaler state "
                        "may be in the part not read")
        yield Finding("checkpoint-without-scaler", step, where, message,
                      expected="scaler.state_dict() in the checkpoint", got="no scaler state",
                      level=WARNING if state_read is not None or unread else None)
        return
