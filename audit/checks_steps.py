"""The rules of an optimizer's windows and steps, each declared on its check: what happens between
two steps (zero_grad, the accumulation's losses), the optimizer's parameters, the schedule.

Each check reads what the recorder keeps (`audit.records`: the window's backward passes, the
optimizer's track, the schedule's record) and yields findings; it changes nothing.
"""

from __future__ import annotations

from typing import Iterator

from audit import windows
from audit.events import OptimizerStepBegin, ScheduleAdvance, ScheduleAtEnd, StepClosed, ZeroGradCall
from audit.findings import ERROR, WARNING, Finding, rule


@rule("zero-grad-in-window", ERROR,
      "zero_grad discarded gradients accumulated by a backward pass that no optimizer step has used",
      "zero the gradients once per optimizer step, after the step (or before the window's first backward)",
      framework_fixes={
          "accelerate": "zero_grad the optimizer that accelerator.prepare returned, inside "
                        "`with accelerator.accumulate(model):`: it zeroes only when gradients sync",
          "lightning.pytorch": "accumulate with Trainer(accumulate_grad_batches=k): Lightning zeroes after "
                               "the k-th microbatch"},
      doc="`zero_grad` between a window's backward passes and its step", events=("ZeroGradCall",))
def zero_grad_in_window(ev: ZeroGradCall) -> Iterator[Finding]:
    """``zero_grad`` (of the optimizer, or of a module holding its parameters) after a backward pass
    of the window (``backwards``) and before its step."""
    name, where, optimizer, step, backwards = ev.name, ev.where, ev.optimizer, ev.step, ev.backwards
    if not backwards:
        return
    k = len(backwards)
    yield Finding("zero-grad-in-window", step, where,
                  f"{name}() at {where} discarded the gradients of {k} backward pass(es) (the first at "
                  f"{backwards[0].where}) before {optimizer} stepped",
                  expected="zero_grad after the optimizer step", got=f"zero_grad after {k} backward pass(es)")


# Certain only for micro-batches of one loss; a warning when the graph cannot tell.
@rule("loss-not-divided", ERROR,
      "an accumulation window's losses were not divided by its number of microbatches",
      "divide each microbatch's loss by the window's number of microbatches before scaling and backward",
      framework_fixes={
          "accelerate": "Accelerator(gradient_accumulation_steps=k) and `with accelerator.accumulate(model):` "
                        "around each microbatch: accelerator.backward then divides each loss by k",
          "transformers": "the Trainer divides by gradient_accumulation_steps only when it believes the model "
                          "does not normalise the loss itself: a forward declaring **kwargs must divide by "
                          "num_items_in_batch, or set model.accepts_loss_kwargs = False",
          "lightning.pytorch": "Trainer(accumulate_grad_batches=k) divides training_step's loss by k; with manual "
                               "optimization divide before self.manual_backward",
          "lightning.fabric": "Fabric does not divide: pass loss / k to fabric.backward"},
      doc="an accumulation window of k >= 2 microbatches of one loss, none divided (read from the "
          "autograd graph); several different losses in one step (`retain_graph`, different loss "
          "functions or parameters, surrogate backward passes of cached gradients, a full-batch loss "
          "over cached representations) are no window; a warning where the roots are no loss function"
          " the audit recognises", uncertain=WARNING, events=("StepClosed",))
def loss_not_divided(ev: StepClosed) -> Iterator[Finding]:
    """A window of k >= 2 backward passes whose every loss reached backward undivided (a factor of
    exactly 1 read from the autograd graph, `audit.windows.describe`), and which are microbatches
    of one loss. Not a window: a backward that kept its graph for the next (``retain_graph``),
    one from explicit gradients, different loss functions at the roots, different parameters
    reached, a root mixing constants (`audit.windows.mixes_constants`). An error when every root
    is a loss function (`audit.windows.is_loss_node`), else a warning."""
    step, backwards = ev.step, ev.backwards
    k = len(backwards)
    if k < 2 or not all(b.factor == 1.0 for b in backwards):
        return
    if any(b.retain for b in backwards[:-1]) or any(b.explicit for b in backwards):
        return
    if len({b.loss_fn for b in backwards}) > 1 or len({b.params for b in backwards if b.params is not None}) > 1:
        return
    if any(windows.mixes_constants(b.root) for b in backwards):
        return
    names = sorted({str(b.loss_fn) for b in backwards})
    certain = all(windows.is_loss_node(b.loss_fn) for b in backwards)
    if certain:
        seen = f"each is the output of {names[0]}, with nothing dividing it"
        tail = f": the accumulated gradient is {k} times the mean"
    else:
        seen = (f"each backward started from {', '.join(names)}, which is no loss function the audit recognises: "
                "it cannot tell microbatches of one loss from different losses")
        tail = f"; if they are microbatches of one loss, the accumulated gradient is {k} times the mean"
    yield Finding("loss-not-divided", step, backwards[0].where,
                  f"the {k} losses of the window of step {step} reached backward (first at {backwards[0].where}) "
                  f"undivided ({seen}){tail}", expected=f"each loss divided by {k}", got="each loss undivided",
                  level=None if certain else WARNING)


@rule("optimizer-before-to", ERROR,
      "parameters moved to another device or dtype after the optimizer holding them was built",
      "move the model with model.to(device) before building the optimizer",
      doc="parameters changed dtype (or device, with optimizer state already held) after the "
          "optimizer was built", events=("OptimizerStepBegin",))
def optimizer_before_to(ev: OptimizerStepBegin) -> Iterator[Finding]:
    """At a step, a parameter's dtype differs from when optimizer track ``o`` received it, or its
    device does while the optimizer already holds state for it (or was built fused). A device
    move of a parameter with no state yet is no finding: parameters keep their identity across
    ``Module.to``, and the optimizer creates their state on the new device (what Lightning
    Fabric's and Accelerate's setup do after the optimizer is built)."""
    o, where = ev.track, ev.where
    fused = any(g.get("fused") for g in o.obj.param_groups)
    for p, device, dtype in o.meta.values():
        if p.dtype != dtype or (p.device != device and (fused or bool(o.obj.state.get(p)))):
            held = " (with optimizer state already on the old device)" if p.device != device else ""
            yield Finding("optimizer-before-to", o.steps, where,
                          f"a parameter of {o.label} (built at {o.where}) is now {p.device} {p.dtype} but was "
                          f"{device} {dtype} when the optimizer received it: the model moved after the optimizer "
                          f"was built{held}", expected=f"{device} {dtype}", got=f"{p.device} {p.dtype}")
            return


@rule("scheduler-on-skipped-step", ERROR,
      "an LR scheduler's position advanced although every optimizer step since its previous advance was skipped",
      "advance the schedule only when the optimizer step was applied (with a GradScaler: when "
      "scaler.get_scale() did not decrease across scaler.update())",
      framework_fixes={
          "lightning.pytorch": "Lightning steps a scheduler of interval 'step' after every optimizer step, "
                               "skipped or not (Lightning-AI/pytorch-lightning#5558): override "
                               "LightningModule.lr_scheduler_step to skip it when the scaler's scale "
                               "decreased, or use interval 'epoch'",
          "accelerate": "pass the scheduler through accelerator.prepare: the AcceleratedScheduler does not "
                        "step after a step the scaler skipped",
          "lightning.fabric": "Fabric does not wrap schedulers: step it only when "
                              "fabric.strategy.precision.scaler.get_scale() did not decrease",
          "transformers": "let the Trainer step its own lr_scheduler (it skips a step Accelerate reports "
                          "skipped) instead of stepping one in a callback"},
      doc="a torch `LRScheduler`'s position (`last_epoch`) advanced although every step of its "
          "optimizer since its previous advance was skipped; judged by where the scheduler stood at "
          "each step, not by its calls: a scheduler stepped at each epoch's start (or set back and "
          "stepped to its built position before the first step, as a resume does) is no finding, and "
          "one stepped per epoch earns its advance with any applied step of the epoch",
      events=("ScheduleAdvance",))
def scheduler_on_skipped_step(ev: ScheduleAdvance) -> Iterator[Finding]:
    """A torch ``LRScheduler``'s position (``last_epoch``) was higher at a step of ``optimizer``
    than at the step before (``advance``, `audit.schedules.Advance`), a ``step()`` of the program
    moved it, and the optimizer took steps since the scheduler's previous advance, all skipped.
    Judged by position, not by calls: a scheduler stepped per epoch earns its advance with any
    applied step of the epoch; one stepped before the first optimizer step, or returned to where
    it stood, advanced across no skipped step."""
    optimizer, advance = ev.optimizer, ev.advance
    a = advance
    if not a.by_call or a.since == 0 or a.applied:
        return
    over = f"step {a.step} of {optimizer} was skipped" if a.since == 1 else \
        f"steps {a.step - a.since + 1} to {a.step} of {optimizer} were all skipped"
    yield Finding("scheduler-on-skipped-step", a.step, a.where,
                  f"{a.scheduler}.step() at {a.where} moved its position from {a.before} to {a.after} after {over}, "
                  "with no applied step since its previous advance: the learning-rate schedule advanced without an "
                  "applied optimizer step",
                  expected="no advance of the schedule without an applied optimizer step",
                  got=f"last_epoch {a.before} -> {a.after}")


@rule("lr-changed-on-skipped-step", WARNING,
      "a learning rate changed across a skipped step, to values no LRScheduler of that optimizer set",
      "if the schedule is a function of the iteration, count applied optimizer steps instead (skip the "
      "update when scaler.get_scale() decreased across scaler.update())",
      doc="a learning rate (or weight decay, momentum, betas) changed across a skipped step to values"
          " no `LRScheduler` set (set by hand, by a scheduler that is no `LRScheduler`, or by hand "
          "over an `LRScheduler`'s rate); says how many skipped steps advanced it (every one) and by "
          "how much", events=("ScheduleAtEnd",))
def lr_changed_on_skipped_step(ev: ScheduleAtEnd) -> Iterator[Finding]:
    """At the end of the run: the scheduled hyperparameters that changed between a skipped step and
    the next (``changes``, `audit.schedules.ScheduleWatch`) to values other than those an
    ``LRScheduler`` of the optimizer set between them (its moves are judged by position, in
    ``scheduler-on-skipped-step``): a schedule the audit cannot see advanced across each of those
    skipped steps. One finding per optimizer, at the first such step, counting every one."""
    optimizer, skipped, changes = ev.optimizer, ev.skipped, ev.changes
    advanced = [c for c in changes if not c.by_scheduler]
    if not advanced:
        return
    steps = [c.step for c in advanced]
    first = "; ".join(advanced[0].moved[:4])
    listed = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
    yield Finding("lr-changed-on-skipped-step", steps[0], advanced[0].where,
                  f"the schedule of {optimizer} advanced across {len(steps)} of its {skipped} skipped step(s) (steps "
                  f"{listed}) to values no LRScheduler set; after step {steps[0]}: {first}: the schedule runs "
                  f"{len(steps)} step(s) ahead of the applied updates",
                  expected="the hyperparameters of the skipped step kept", got="changed")
