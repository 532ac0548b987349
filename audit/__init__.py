"""``ampspec audit``: check anyone's own AMP training loop against the specification.

The audit instruments torch's public AMP surface in the user's own process (`audit.instrument`),
records each optimizer step's calls and numbers (`audit.recorder`), checks the order rules of
the step contract (`audit.rules`) and replays the numbers through ``reference``
(`audit.replay`). Three entries:

- the command ``ampspec audit SCRIPT.py [ARGS...] [--report FILE.json] [--steps N] [--no-replay]
  [--strict]`` (`audit.runner`);
- the context manager: ``with audit.audit() as session: train()``, then ``session.report``;
- the pytest fixture ``ampspec_audit`` (`audit.pytest_plugin`), which fails a test whose loop
  breaks a rule (an error; with ``strict``, any finding).

Severities and exit status: `audit.rules`.

Why a package of its own: the audit compares torch's behaviour with the specification's, so it
must import both. ``reference`` may never import torch, and ``torchimpl`` imports ``reference``
only at the command-line boundary (``torchimpl/spec_bridge.py`` for ``replay``); the audit is
neither of them (it instruments user code, not ampspec's trainer), so it sits beside them,
like the conformance suite, and the ``ampspec`` command imports it lazily in its ``audit``
subcommand. Inside it, the order rules read the specification's GradScaler call sequence
(`reference.scaling`'s stage functions, through `audit.sequence`); only `audit.replay` imports
the rest of ``reference``: an audit without replay loads none of its arithmetic.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

from audit.report import EXIT_FAILED, EXIT_FINDINGS, EXIT_OK, AuditReport
from audit.rules import RULES, Finding
from audit.sampling import Sampling, parse_every, parse_fraction, sampling_statement

__all__ = ["Audit", "AuditReport", "Finding", "RULES", "audit", "register_optimizer", "EXIT_OK", "EXIT_FINDINGS",
           "EXIT_FAILED"]


class Audit:
    """One audit session: instrumentation installed by `start`, removed by `stop`.

    ``replay``: replay the steps through ``reference`` (copies gradients, parameters and state
    each replayed step); False checks the order rules only. ``replay_every`` N: replay steps 0,
    N, 2N, ... of each optimizer (``"auto"``: every step up to `audit.sampling.AUTO_WHOLE_BUDGET`
    elements, then every Nth); ``replay_sample``: of a replayed step's optimizer stage, the
    share of the elements replayed: ``"auto"`` (everything up to `audit.sampling.AUTO_BUDGET`
    elements, then that many), ``"all"``, or a fraction in (0, 1]; ``replay_seed``: the
    sample's seed (`audit.sampling`). The order rules always see every step.
    ``steps``: stop the audited code at the first backward pass after this many optimizer steps (it raises ``StepLimitReached``, a
    BaseException, which the context manager absorbs). ``target``: how the report names what
    was audited. ``strict``: warnings and info fail the report too (`AuditReport.exit_status`).

    A process forked by the audited program inherits the session; `stop` there only removes the
    instrumentation (`forked`): the report is the starting process's.
    """

    def __init__(self, replay: bool = True, steps: int | None = None, target: str = "the audited code",
                 strict: bool = False, *, replay_every: int | str = "auto", replay_sample: float | str = "auto",
                 replay_seed: int = 0) -> None:
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be None or an int >= 1, got {steps!r}")
        if isinstance(replay_seed, bool) or not isinstance(replay_seed, int) or replay_seed < 0:
            raise ValueError(f"replay_seed (--replay-seed) must be an int >= 0, got {replay_seed!r}")
        self.sampling = Sampling(parse_every(replay_every), parse_fraction(replay_sample), replay_seed)
        self.replay = replay
        self.steps = steps
        self.target = target
        self.strict = bool(strict)
        self.pid = os.getpid()
        self.argv: list[str] = []
        self._recorder: Any = None
        self._instr: Any = None
        self._report: AuditReport | None = None

    def start(self) -> "Audit":
        global _CURRENT
        # Here, not at the top: ``import audit`` (the pytest plugin's entry point) stays torch-free.
        from audit.compiled import CompileCounts
        from audit.instrument import Instrumentation
        from audit.recorder import Recorder

        if self._recorder is not None:
            raise RuntimeError("this audit session was already started")
        replayer = None
        if self.replay:
            from audit.replay import Replayer  # only a replaying audit loads the spec's arithmetic

            replayer = Replayer(sampling=self.sampling)
        self._recorder = Recorder(replay=replayer, steps=self.steps)
        self._instr = Instrumentation(self._recorder)
        self._compiles = CompileCounts.now()
        self._instr.install()
        _CURRENT = self  # after the replay worker's fork: that child is no child of the audited program
        return self

    def _detach_in_child(self) -> None:
        """In a process the audited program forked: no instrumentation, nothing sent to the
        replay worker, which belongs to the parent (it must neither be joined nor killed here)."""
        self._instr.uninstall()
        self._recorder.detached = True
        r = self._recorder.replayer
        if r is not None and r.process is not None:
            r.process.forget_in_child()

    def stop(self, error: BaseException | None = None, *, interrupted: str | None = None) -> AuditReport:
        """Remove the instrumentation and build the report. ``error``: the audited code's failure;
        ``interrupted``: the signal that cut it short (the report says so; no end-of-run rules)."""
        if self._report is not None:
            return self._report
        if self._recorder is None:
            raise RuntimeError("this audit session was never started")
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None
        from audit.recorder import StepLimitReached  # torch-free ``import audit`` (see start)

        self._instr.uninstall()
        if self.forked:
            # A child of the audited program: the replay worker and the copies are the parent's.
            self._report = AuditReport(findings=[], steps=[], replay=None, target=self.target, argv=list(self.argv),
                                       stopped="a forked process of the audited program: see its parent's report")
            return self._report
        rec = self._recorder
        limited = isinstance(error, StepLimitReached) or rec.stopped_at_limit
        failed = error is not None and not isinstance(error, StepLimitReached)
        rec.finish(completed=not failed and interrupted is None)
        text = None
        if failed:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        r = rec.replayer
        replay = None if r is None else {
            "exactness": r.exactness(),
            "steps_replayed": r.steps_replayed,
            "steps_bit_exact": r.steps_bit_exact,
            "updates_checked": r.updates_checked,
            "not_replayed": dict(r.not_replayed),
            "runs_in": r.mode,
            "fallback": r.fallback,
            "sampling": sampling_statement(r),
            "lost_updates": dict(r.lost_summary),
        }
        self._report = AuditReport(findings=list(rec.findings), steps=list(rec.records), replay=replay,
                                   target=self.target, argv=list(self.argv), error=text,
                                   stopped=f"stopped after {self.steps} steps as asked" if limited else None,
                                   strict=self.strict, interrupted=interrupted, reductions=list(rec.reductions),
                                   compiled=self._compiles.since())
        return self._report

    @property
    def forked(self) -> bool:
        """Whether this is a process forked from the one that started the audit."""
        return os.getpid() != self.pid

    @property
    def report(self) -> AuditReport:
        if self._report is None:
            raise RuntimeError("the report exists once the audit has stopped (leave the with block, or call stop())")
        return self._report

    def __enter__(self) -> "Audit":
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        from audit.recorder import StepLimitReached  # torch-free ``import audit`` (see start)

        self.stop(exc)
        return isinstance(exc, StepLimitReached)


_CURRENT: Audit | None = None


def _after_fork_in_child() -> None:
    if _CURRENT is not None and _CURRENT._report is None:
        _CURRENT._detach_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def audit(replay: bool = True, steps: int | None = None, strict: bool = False, **sampling: Any) -> Audit:
    """The context manager: ``with audit() as session: train()``; then ``session.report``.

    The code inside runs unmodified; on leaving, torch is restored and ``session.report`` holds
    the findings (``report.ok``, ``report.text()``, ``report.to_dict()``). ``sampling``:
    `Audit`'s ``replay_every``, ``replay_sample`` and ``replay_seed``.
    """
    return Audit(replay=replay, steps=steps, strict=strict, **sampling)


def register_optimizer(cls: type, spec: Any, *, ulp: Any = None) -> None:
    """Replay the user's own optimizer class ``cls`` (and its subclasses that keep or call its
    ``step``) through ``spec``, a ``reference.optim.OptimizerSpec``; ``ulp``: per state field
    (``"param"`` for the parameter) the bound on native kernels. The worked example (Lion in
    NumPy) is in `audit.optimizers`. Imported here on call: an audit without replay never loads
    the specification."""
    from audit.optimizers import register_optimizer as register

    register(cls, spec, ulp=ulp)
