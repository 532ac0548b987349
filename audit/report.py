"""The audit's report: text (one line a finding, grouped by rule, the first in full) and JSON."""

from __future__ import annotations

import json
import math
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from audit.compiled import COMPILED_REPLAY, compile_line
from audit.report_file import write_report_file
from audit.rules import ERROR, RULES, SEVERITIES, Finding

__all__ = ["AuditReport", "EXIT_OK", "EXIT_FINDINGS", "EXIT_FAILED"]

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_FAILED = 2

_LINES_PER_RULE = 10


@dataclass
class AuditReport:
    """What an audit found. ``error`` is the audited program's failure (its traceback), if any;
    ``script_status`` the non-zero status it passed to ``sys.exit`` or ``os._exit``; ``ended``
    how it ended when not by returning (``"the script left by os._exit(0)"``); ``interrupted``
    the signal (``"SIGINT"``, ``"SIGTERM"``) that cut it short.

    ``exit_status``, as linters do it: the script's own status when it exited with one, 128 plus
    the signal's number when one interrupted it (130, 143), 2 when it failed otherwise, else 1
    when a finding is an error (with ``strict``: any finding), else 0.
    """

    findings: list[Finding]
    steps: list[Any]
    replay: dict[str, Any] | None
    target: str = "the audited code"
    argv: list[str] = field(default_factory=list)
    error: str | None = None
    stopped: str | None = None
    strict: bool = False
    script_status: int | None = None
    ended: str | None = None
    interrupted: str | None = None
    reductions: list[dict[str, Any]] = field(default_factory=list)
    """The loop's DDP and FSDP2 gradient reductions (`audit.reductions`), as the report states them."""
    compiled: dict[str, Any] | None = None  # `audit.compiled`: what torch.compile did meanwhile

    def counts(self) -> dict[str, int]:
        """How many findings of each severity (every severity present, in the contract's order)."""
        out = dict.fromkeys(SEVERITIES, 0)
        for f in self.findings:
            out[f.severity] += 1
        return out

    @property
    def failing(self) -> list[Finding]:
        """The findings that fail the audit: the errors; with ``strict``, every finding."""
        return list(self.findings) if self.strict else [f for f in self.findings if f.severity == ERROR]

    @property
    def ok(self) -> bool:
        return self.error is None and self.script_status is None and self.interrupted is None and not self.failing

    @property
    def complete(self) -> bool:
        """Whether the report covers the whole run: not cut short by a signal or the script's failure."""
        return self.error is None and self.interrupted is None

    @property
    def exit_status(self) -> int:
        if self.script_status is not None:
            return self.script_status
        if self.interrupted is not None:
            return 128 + int(getattr(signal, self.interrupted, signal.SIGINT))
        if self.error is not None:
            return EXIT_FAILED
        return EXIT_FINDINGS if self.failing else EXIT_OK

    def rules(self) -> list[str]:
        """The rules found, in order of first occurrence."""
        return list(dict.fromkeys(f.rule for f in self.findings))

    def by_rule(self) -> dict[str, list[Finding]]:
        out: dict[str, list[Finding]] = {}
        for f in sorted(self.findings, key=lambda f: (f.step if f.step is not None else -1)):
            out.setdefault(f.rule, []).append(f)
        return {r: out[r] for r in sorted(out, key=lambda r: min((f.step or 0) for f in out[r]))}

    # ------------------------------------------------------------------ text

    def text(self, include_error: bool = True) -> str:
        """The text report; ``include_error``: end with the audited program's traceback."""
        n_steps = len(self.steps)
        head = f"ampspec audit of {self.target}: {n_steps} optimizer step{'s' if n_steps != 1 else ''}"
        if self.stopped:
            head += f" ({self.stopped})"
        c = self.counts()
        head += (f", {len(self.findings)} finding{'s' if len(self.findings) != 1 else ''} ({c[ERROR]} "
                 f"error{'s' if c[ERROR] != 1 else ''}, {c['warning']} warning{'s' if c['warning'] != 1 else ''}, "
                 f"{c['info']} info)")
        if self.strict:
            head += " [strict: warnings and info fail too]"
        lines = [head, *self._replay_lines()]
        lines.extend(_reduction_lines(self.reductions))
        if self.compiled is not None:
            lines.append(compile_line(self.compiled))
        for rule, fs in self.by_rule().items():
            spec = RULES[rule]
            levels = "/".join(dict.fromkeys(f.severity for f in fs))
            lines.append("")
            lines.append(f"{rule} ({levels}): {spec.summary}; {len(fs)} finding{'s' if len(fs) != 1 else ''}")
            first = fs[0]
            lines.append(f"  step {first.step}, {first.where}: {first.message}")
            if _telling(first.expected, first.got):
                lines.append(f"    expected: {first.expected!r}")
                lines.append(f"    got:      {first.got!r}")
            lines.append(f"    fix: {spec.fix}")
            if first.framework is not None:
                lines.append(f"    {first.framework_note()}")
            for f in fs[1:_LINES_PER_RULE]:
                lines.append(f"  step {f.step}, {f.where}")
            if len(fs) > _LINES_PER_RULE:
                rest = [f.step for f in fs[_LINES_PER_RULE:]]
                lines.append(f"  ... and {len(rest)} more, steps {rest[0]}-{rest[-1]} (all in the JSON report)")
        if not self.steps:
            lines.append("nothing was audited: no optimizer step ran in this process" +
                         (" before the failure" if self.error is not None else ""))
        elif not self.findings:
            lines.append("no findings: every audited step follows the step contract" +
                         (" (up to the failure)" if self.error is not None else
                          " (up to the interruption)" if self.interrupted is not None else ""))
        lines.extend(self._how_it_ended())
        if self.error is not None and not include_error:
            lines.append("")
            lines.append("the audited program failed (its traceback follows on stderr)")
        elif self.error is not None:
            lines.append("")
            lines.append("the audited program failed:")
            lines.append(self.error.rstrip())
        return "\n".join(lines)

    def _replay_lines(self) -> list[str]:
        """The numeric replay's summary: what was replayed, what was not and why, the lost updates
        of 16-bit parameters and what a sampled replay took."""
        r = self.replay
        if r is None:
            return ["numeric replay: off (order rules only)"]
        lines = [f"numeric replay: {r['steps_replayed']} of {len(self.steps)} steps and {r['updates_checked']} scaler "
                 f"updates replayed; {self._matched()}; compared at: {r['exactness']}"]
        lines += [f"  not replayed ({count}x): {reason}" for reason, count in r["not_replayed"].items()]
        compiled = sum(1 for s in self.steps if s.replay.startswith(COMPILED_REPLAY))
        if compiled:
            lines.append(f"  compiled optimizer steps ({compiled}x): copied around the compiled graph (parameters "
                         "and state at the backward before, gradients, parameters and state at the call after) and "
                         "replayed by reference.compile's rules (correctly rounded square root; each field within "
                         "compiled_step_ulp ULPs of x_abs: the row's native bound plus the float32 step scalars' "
                         "error), whatever the CPU kernels")
        if r.get("fallback"):
            lines.append(f"  {r['fallback']}")
        return lines + _lost_lines(r.get("lost_updates")) + _sampling_lines(r.get("sampling"))

    def _how_it_ended(self) -> list[str]:
        """The lines on a run that did not end by returning: a signal, ``sys.exit``, ``os._exit``."""
        lines = []
        if self.interrupted is not None:
            lines += ["", f"interrupted by {self.interrupted}: the report is incomplete, it covers the steps recorded "
                          "before the signal"]
        if self.ended is not None or self.script_status is not None:
            lines.append("")
        if self.ended is not None:
            lines.append(self.ended)
        if self.script_status is not None:
            lines.append(f"the audited program exited with status {self.script_status}")
        return lines

    def _matched(self) -> str:
        """How many replayed steps matched the specification bit for bit, in words that read right
        whether all of them did or not; the others are within the stated bounds or diverged."""
        r = self.replay or {}
        replayed, exact = r.get("steps_replayed", 0), r.get("steps_bit_exact", 0)
        if replayed == 0:
            return "no step to compare"
        if exact == replayed:
            return ("the replayed step matched" if replayed == 1 else f"all {replayed} replayed steps matched") + \
                " the specification bit for bit"
        verdicts = [str(getattr(s, "replay", "")) for s in self.steps]
        diverged = sum(v.startswith("diverged") for v in verdicts)
        rest = replayed - exact - diverged
        parts = [f"{exact} of the {replayed} replayed steps matched the specification bit for bit"]
        if rest > 0:
            parts.append(f"{rest} within the stated bounds")
        if diverged:
            parts.append(f"{diverged} diverged (see the findings)")
        return ", ".join(parts)

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "argv": list(self.argv),
            "status": ("interrupted" if self.interrupted is not None and self.script_status is None
                       else "failed" if self.error is not None or self.script_status is not None
                       else "findings" if self.failing else "ok"),
            "complete": self.complete,
            "ended": self.ended,
            "interrupted": self.interrupted,
            "counts": self.counts(),
            "strict": self.strict,
            "script_status": self.script_status,
            "exit_status": self.exit_status,
            "stopped": self.stopped,
            "replay": self.replay,
            "reductions": self.reductions,
            "compiled": self.compiled,
            "findings": [f.to_dict() for f in self.findings],
            "steps": [s.to_dict() for s in self.steps],
            "error": self.error,
        }

    def write_json(self, path: str | Path, *, force: bool = False, script: str | Path | None = None) -> Path:
        """The JSON report at ``path``, written whole and renamed into place (`audit.report_file`):
        never through a link, never over ``script``, a source file, or (without ``force``) an
        existing file that is not an audit report; a failed write leaves the old report as it was."""
        return write_report_file(Path(path), json.dumps(self.to_dict(), indent=1) + "\n", force=force,
                                 script=None if script is None else Path(script))


def _telling(expected: Any, got: Any) -> bool:
    """Whether an expected/got pair says something: not when absent, nor when both are the same
    non-finite number (``nan`` and ``nan``, ``inf`` and ``inf``: the message names the values)."""
    if expected is None and got is None:
        return False
    if isinstance(expected, float) and isinstance(got, float) and not (math.isfinite(expected) or math.isfinite(got)):
        return not (expected == got or (math.isnan(expected) and math.isnan(got)))
    return True


def _reduction_lines(reductions: list[dict[str, Any]]) -> list[str]:
    """The loop's DDP/FSDP2 gradient reductions as the text report states them (audit.reductions)."""
    out = []
    for red in reductions:
        modules = red.get("modules") or []
        named = f" ({', '.join(modules[:3])}{', ...' if len(modules) > 3 else ''})" if modules else ""
        out.append(f"gradient reduction, {red['wrapper']} over {red.get('world_size', '?')} rank(s){named}: "
                   f"{red['reduction']}")
    return out


def _lost_lines(lost: dict[str, Any] | None) -> list[str]:
    """The replay summary's line of the lost updates of 16-bit parameters (none when none was measured)."""
    if not lost:
        return []
    return ["  lost updates over the run (update-lost-to-rounding; bfloat16/float16 parameters): " +
            ", ".join(f"{name} {v['fraction']:.1%} ({v['lost']} of {v['counted']}"
                      f"{'; sampled ' + v['sampled'] if v['sampled'] else ''})" for name, v in lost.items())]


def _sampling_lines(sm: dict[str, Any] | None) -> list[str]:
    """The replay's sampling as the text report states it (audit.sampling)."""
    if not sm:
        return []
    sample = sm["sample"]
    what = (f"auto (whole up to {sm['auto_budget']} elements a step, then that many)" if sample == "auto"
            else "all" if sample == 1.0 else f"{sample:g} of the elements")
    every = (f"auto (every step up to {sm['auto_whole_budget']} elements, then every Nth)" if sm["every"] == "auto"
             else f"every {sm['every']} step{'s' if sm['every'] != 1 else ''}")
    out = [f"  sampling: steps {every} ({sm['steps_left_out']} left out), optimizer stage {what}, seed {sm['seed']}; "
           f"order rules {sm['order_rules']}"]
    for label, taken in sm["optimizer_stage"].items():
        out.append(f"  optimizer stage of {label}: {taken}")
    if sm["steps_left_out"] or sm["steps_sampled"]:
        out.append(f"  whole: {sm['whole']}")
    return out
