"""Mutation check of the audit's rules: each rule's check broken once, and the catalogue must notice.

Run from the repository root (a few minutes on 2 cores):

    python tests/audit_mutations.py                       # every mutant
    python tests/audit_mutations.py clip_before_unscale   # the ones named

Each mutant is one exact source edit to a check (`audit/checks_*.py`) or to the call sequence the
checks read (`audit/sequence.py`): an inverted condition, a dropped case. For each, the script
copies ``audit/``, ``reference/``, ``conformance/``, ``torchimpl/`` (``tests/test_audit.py`` imports
its command line) and ``tests/`` (with the root ``conftest.py`` and ``pyproject.toml``) into a
temporary folder, applies the edit (it must match the source
exactly once, else the script stops: a mutant that no longer applies is reported, never
silently skipped) and runs ``pytest -x -q`` on the catalogue tests that name the rule's loops.
The unmutated copy runs first and must pass. A mutant is killed when pytest exits non-zero.
Exit status: 0 when every mutant is killed, 1 otherwise. ``tests/test_audit_mutations.py``
checks that every edit still applies (fast) and, marked slow, runs them all.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conformance import mutations  # noqa: E402  (the project's mutant record and runner)
from conformance.mutations import Mutant  # noqa: E402

CATALOGUE = "tests/test_audit_catalogue.py"
PLANTED_TEST = f"{CATALOGUE}::test_each_planted_mistake_is_flagged_at_its_steps_and_nothing_else"
REAL_TEST = "tests/test_audit_real.py::test_each_real_loop_gives_exactly_its_truth"
# A correct GradScaler loop audited in-process (4 steps, one skipped): any false finding fails it.
CORRECT = "tests/test_audit.py::test_a_scaler_override_that_calls_the_base_method_reports_once"


def planted(loop: str, *args: str) -> str:
    """The node id of the catalogue's planted-mistake test for ``loop`` with ``args``."""
    return f"{PLANTED_TEST}[{loop}:{' '.join(args)}]"


SCALER = "audit/checks_scaler.py"
CLIPPING = "audit/checks_clipping.py"
NUMBERS = "audit/checks_numbers.py"
STEPS = "audit/checks_steps.py"
PROGRAM = "audit/checks_program.py"
SEQUENCE = "audit/sequence.py"
_SCHED = ("--steps", "40", "--every", "10", "--rollback", "30", "--inf-at", "5,33")

MUTANTS = (
    Mutant("clip_before_unscale", "clip-before-unscale: only clips of unscaled gradients are flagged", CLIPPING,
           "    if stage is None or stage.stage == UNSCALED:\n", "    if stage is None or stage.stage != UNSCALED:\n",
           (planted("scaler_loop.py", "--bug", "clip-before-unscale"),)),
    Mutant("clip_threshold_warning", "clip-threshold-scaled: a threshold below the scale is suspected", CLIPPING,
           "and scale >= 2.0**10 and max_norm >= scale:", "and scale >= 2.0**10 and max_norm < scale:",
           (planted("scaler_loop.py", "--bug", "clip-threshold-scaled"),)),
    Mutant("clip_threshold_certain", "clip-threshold-scaled: certain when the scale did not change", CLIPPING,
           "    elif scale != held[1]:\n", "    elif scale == held[1]:\n",
           # With the scale changing at step 3 the error comes either way; with a constant scale the
           # threshold must stay a warning.
           (planted("scaler_loop.py", "--bug", "clip-threshold-scaled", "--inf-at", "3"),
            planted("scaler_loop.py", "--bug", "clip-threshold-scaled"))),
    Mutant("unscale_twice_call", "unscale-twice: a second unscale_ is judged from READY", SCALER,
           'if ev.call == "unscale_" and ev.before.stage == UNSCALED:',
           'if ev.call == "unscale_" and ev.before.stage != UNSCALED:',
           # torch raises at the second unscale_ of step 0, so the planted loop gets its one finding
           # at step 0 either way; a correct loop's first unscale_ must give none.
           (planted("scaler_loop.py", "--bug", "unscale-twice-call"), CORRECT)),
    Mutant("unscale_twice_numbers", "unscale-twice: the numbers' second division is not one", SCALER,
           '    if ch.kind == "unscale":\n', '    if ch.kind != "unscale":\n',
           (planted("scaler_loop.py", "--bug", "unscale-by-hand"),)),
    Mutant("step_without_update", "step-without-update: READY taken for STEPPED", SCALER,
           "    if ev.before.stage != STEPPED:\n", "    if ev.before.stage == STEPPED:\n",
           (planted("scaler_loop.py", "--bug", "step-without-update"),)),
    Mutant("update_without_step_direct", "update-without-step: a direct optimizer.step() before update is missed",
           SCALER, "    for optimizer, step, where in ev.bypasses:\n", "    for optimizer, step, where in ev.bypasses[1:]:\n",
           (planted("scaler_loop.py", "--bug", "update-without-step", "--inf-at", "5"),)),
    Mutant("update_without_step_alone", "update-without-step: an update after scaler.step is flagged", SCALER,
           "    if not ev.stepped and not ev.bypasses:\n", "    if ev.stepped and not ev.bypasses:\n", (CORRECT,)),
    Mutant("step_bypasses_scaler", "step-bypasses-scaler: the direct steps are not reported", SCALER,
           "    for optimizer, step, where in bypasses:\n", "    for optimizer, step, where in bypasses[1:]:\n",
           (planted("scaler_loop.py", "--bug", "step-bypasses-scaler"),)),
    Mutant("new_scaler_mid_run", "new-scaler-mid-run: only scalers sharing no parameters are flagged", SCALER,
           "    if loaded or not earlier:\n", "    if loaded or earlier:\n",
           (planted("scheduler_loop.py", "--bug", "new-scaler-mid-run", *_SCHED),)),
    Mutant("scale_twice", "scale-twice: every other boundary kind is taken for it", NUMBERS,
           '    if ch.kind != "scale":\n', '    if ch.kind == "scale":\n',
           (planted("scaler_loop.py", "--bug", "scale-twice"),)),
    Mutant("modified_before_unscale", "gradients-modified-before-unscale: read after the unscale", NUMBERS,
           "and not ev.divergence and not ev.after_unscale:", "and not ev.divergence and ev.after_unscale:",
           (planted("scaler_loop.py", "--bug", "gradients-masked"),)),
    Mutant("modified_after_unscale", "gradients-modified-after-unscale: read before the unscale", NUMBERS,
           "and not ev.divergence and ev.after_unscale:", "and not ev.divergence and not ev.after_unscale:",
           (planted("scaler_loop.py", "--bug", "gradients-altered"),)),
    Mutant("replay_divergence", "replay-divergence: divergences are dropped", NUMBERS,
           "    if not divergences:\n        return\n", "    if divergences:\n        return\n",
           (planted("bf16_loop.py", "--bug", "parameters-altered"),)),
    Mutant("lost_counts_changed", "update-lost-to-rounding: the changed elements are counted as lost", "audit/lost.py",
           "w.where, w.lost, w.counted = where, w.lost + lost, w.counted + counted",
           "w.where, w.lost, w.counted = where, w.lost + (counted - lost), w.counted + counted",
           (planted("lowprec_loop.py", "--bug", "update-lost-to-rounding"),
            "tests/test_audit_lost.py::test_the_lost_fraction_is_the_one_torch_in_float32_gives")),
    Mutant("lost_threshold", "update-lost-to-rounding: a window under the threshold is flagged", NUMBERS,
           "    if not ev.counted or ev.lost <= LOST_FRACTION * ev.counted:\n",
           "    if not ev.counted or ev.lost > LOST_FRACTION * ev.counted:\n",
           (planted("lowprec_loop.py", "--bug", "update-lost-to-rounding"),
            "tests/test_audit_lost.py::test_a_bf16_model_whose_updates_mostly_land_gives_no_finding")),
    Mutant("stochastic_envelope_away", "replay-divergence: a stochastic rounding away from zero is outside the envelope",
           "audit/lost.py", "ceil_bits = (high.view(np.uint32) & np.uint32(0xFFFF0000)) + np.uint32(0x10000)",
           "ceil_bits = (high.view(np.uint32) & np.uint32(0xFFFF0000)) + np.uint32(0)",
           ("tests/test_audit_lost.py::test_the_envelope_takes_both_neighbours_and_nothing_further",)),
    Mutant("zero_grad_in_window", "zero-grad-in-window: only a zero_grad with no backward is flagged", STEPS,
           "    if not backwards:\n", "    if backwards:\n", (planted("bf16_loop.py", "--bug", "zero-grad-in-window"),)),
    Mutant("loss_not_divided", "loss-not-divided: a divided window is taken for an undivided one", STEPS,
           "    if k < 2 or not all(b.factor == 1.0 for b in backwards):\n",
           "    if k < 2 or all(b.factor == 1.0 for b in backwards):\n",
           (planted("accumulation_loop.py", "--bug", "loss-not-divided"),)),
    Mutant("loss_not_divided_certain", "loss-not-divided: a torch loss at every root is uncertain", STEPS,
           "    certain = all(windows.is_loss_node(b.loss_fn) for b in backwards)\n",
           "    certain = not all(windows.is_loss_node(b.loss_fn) for b in backwards)\n",
           (planted("accumulation_loop.py", "--bug", "loss-not-divided"),)),
    Mutant("optimizer_before_to", "optimizer-before-to: a dtype change is not one", STEPS,
           "        if p.dtype != dtype or (", "        if p.dtype == dtype and (",
           (planted("bf16_loop.py", "--bug", "optimizer-before-to"),)),
    Mutant("scheduler_on_skipped_step", "scheduler-on-skipped-step: an applied step is taken for none", STEPS,
           "    if not a.by_call or a.since == 0 or a.applied:\n", "    if not a.by_call or a.since == 0 or not a.applied:\n",
           (planted("scheduler_loop.py", "--bug", "scheduler-on-skipped-step", *_SCHED),)),
    Mutant("lr_changed_on_skipped_step", "lr-changed-on-skipped-step: only changes an LRScheduler made count", STEPS,
           "    advanced = [c for c in changes if not c.by_scheduler]\n",
           "    advanced = [c for c in changes if c.by_scheduler]\n",
           (f"{REAL_TEST}[nanogpt_train.py:--inf-at 3,7]",)),
    Mutant("backward_in_autocast", "backward-in-autocast: only a backward outside autocast is flagged", PROGRAM,
           "    if autocast is None:\n", "    if autocast is not None:\n",
           (planted("scaler_loop.py", "--bug", "backward-in-autocast"),)),
    Mutant("checkpoint_without_scaler", "checkpoint-without-scaler: saves without optimizer state are read", PROGRAM,
           "        if not holds_opt:\n", "        if holds_opt:\n",
           (planted("scheduler_loop.py", "--bug", "checkpoint-without-scaler", *_SCHED),)),
    Mutant("sequence_stage_kept", "the call sequence: a call that returned leaves the stage as it was", SEQUENCE,
           "        if call.after is not None:\n            return call.after\n",
           "        if call.after is not None:\n            return call.before\n",
           (planted("scaler_loop.py", "--bug", "unscale-twice-call"),)),
)

_COPIED = ("audit", "reference", "conformance", "torchimpl", "tests", "conftest.py", "pyproject.toml")


def run(names: list[str]) -> int:
    """Run the mutants named (all when ``names`` is empty); 0 when every one is killed. The
    conformance catalogue's runner, over a copy holding the audit and its tests, in the
    environment the suite runs in (native kernels, the default profile)."""
    return mutations.run(names, MUTANTS, copied=_COPIED, env={})


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
