"""What a rule is and what it finds: the severity contract, `Rule`, the `rule` decorator, `Finding`.

The severity contract (every rule keeps to it):

- ``error``: the audit is certain, from what its instrumentation saw, that the loop breaks a
  clause of the step contract. Nothing that uninstrumented user code could legitimately do
  explains it (torch would raise, or the numbers show a division or multiplication by the loss
  scale, or a call order that no correct loop has).
- ``warning``: probably wrong, but a cause the audit cannot see could make it right; the
  finding says what was seen and why the audit cannot decide.
- ``info``: the loop's own code changed something the specification does not model (gradients
  edited after ``unscale_``, a learning rate set by hand); stated with its numbers. Not a
  mistake in itself.

A rule with a certain and an uncertain form (``loss-not-divided``, ``clip-threshold-scaled``,
``checkpoint-without-scaler``) gives its finding the lower severity when uncertain
(`Finding.level`). Exit status, as linters do it: 0 when no finding is an error, 1 when one is;
with ``strict`` warnings and info count as well; 2 when the audited program failed.

A rule is declared with its check (`rule`): the row (name, severity, meaning, fix) stands on the
function that decides it, so that a reader finds the two together. No torch here.

Imports run one way: this module <- the checks (`audit.checks_*`) <- the catalogue (`audit.rules`),
which fills `CATALOGUE` (its ``RULES``) when it is imported; ``import audit`` imports it, so every
`Finding` is made after the catalogue is complete.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, TypeVar

from audit.frameworks import FRAMEWORKS, FrameworkCall

__all__ = ["CATALOGUE", "Rule", "rule", "Finding", "ERROR", "WARNING", "INFO", "SEVERITIES", "spec_stages"]

ERROR = "error"
WARNING = "warning"
INFO = "info"
SEVERITIES = (ERROR, WARNING, INFO)

Check = Callable[..., Iterator["Finding"]]
C = TypeVar("C", bound=Callable[..., Any])


@functools.cache
def spec_stages() -> Any:
    """`reference.scaling`, whose stage names (READY, UNSCALED, STEPPED) the checks compare with:
    imported by the first check that runs, so that ``import audit`` (the pytest plugin's start)
    loads neither the specification nor NumPy; every later call returns it at the cost of a
    cache lookup, where an ``import`` statement in the check would cost an import's every step."""
    from reference import scaling

    return scaling


@dataclass(frozen=True)
class Rule:
    """One rule: its name, severity, what breaking it means, the fix, and its ``check`` (a
    generator of findings that reads the recorder's records and changes nothing).

    ``framework_fixes``: the fix as a framework's setting, by framework (a key of
    `audit.frameworks.FRAMEWORKS`), for a finding whose call site lies inside that framework.
    ``doc``: what the loop did, as docs/audit.md's table says it (generated from the rows,
    `audit.rules.markdown_table`); ``uncertain``: the lower severity of the rule's uncertain form
    (`Finding.level`), None for a rule without one. ``events``: the names of the event types
    (small frozen dataclasses, such as `audit.boundaries.Boundary`) whose every instance
    `audit.rules.dispatch` hands the check; a rule decided at a call the recorder tracks itself
    names none (its tracker calls the check)."""

    name: str
    severity: str
    summary: str
    fix: str
    check: Check | None = None
    framework_fixes: Mapping[str, str] = field(default_factory=dict, hash=False)
    doc: str = ""
    uncertain: str | None = None
    events: tuple[str, ...] = ()

    @property
    def severities(self) -> tuple[str, ...]:
        """The severities its findings can have: its own, then its uncertain form's."""
        return (self.severity,) if self.uncertain is None else (self.severity, self.uncertain)


def rule(name: str, severity: str, summary: str, fix: str,
         framework_fixes: Mapping[str, str] | None = None, *, doc: str | None = None,
         uncertain: str | None = None, events: tuple[str, ...] = ()) -> Callable[[C], C]:
    """Declare a rule on its check: the decorated function keeps its row in ``.rule`` (``doc``
    defaults to ``summary``)."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity of rule {name!r} must be one of {SEVERITIES}, got {severity!r}")
    if uncertain is not None and (uncertain not in SEVERITIES
                                  or SEVERITIES.index(uncertain) <= SEVERITIES.index(severity)):
        raise ValueError(f"uncertain severity of rule {name!r} must be one of {SEVERITIES} below {severity!r}, "
                         f"got {uncertain!r}")
    fixes = dict(framework_fixes or {})
    unknown = sorted(set(fixes) - {key for key, _, _ in FRAMEWORKS})
    if unknown:
        raise ValueError(f"framework_fixes of rule {name!r} names unknown frameworks {unknown}; "
                         f"known: {sorted({key for key, _, _ in FRAMEWORKS})}")

    def declare(check: C) -> C:
        check.rule = Rule(name, severity, summary, fix, check, fixes, doc or summary,  # type: ignore[attr-defined]
                          uncertain, tuple(events))
        return check

    return declare


CATALOGUE: dict[str, "Rule"] = {}
"""Every rule of the audit by name: `audit.rules` fills it (it is ``audit.rules.RULES``)."""


@dataclass
class Finding:
    """One finding: a rule broken at one step, at one call site of the user's code.

    ``level``: set for the uncertain form of a rule (a warning where the rule's certain form is an
    error); None keeps the rule's severity.

    ``step`` is the optimizer step (0-based, counting skipped steps) the call belongs to, or None
    when no step has started. ``expected`` and ``got`` are what the contract wants and what the
    loop did (numbers where the replay has them, else a description). ``framework``: the
    framework whose code made the call (`audit.frameworks.FrameworkCall`, taken from a ``where``
    that `audit.records.call_site` attributed), None when the user's code made it.
    """

    rule: str
    step: int | None
    where: str
    message: str
    expected: Any = None
    got: Any = None
    level: str | None = None  # the rule's uncertain form: a lower severity than the rule's own
    framework: FrameworkCall | None = None  # set from ``where`` when a framework's code made the call

    def __post_init__(self) -> None:
        if self.framework is None:
            self.framework = getattr(self.where, "via", None)
        if self.rule not in CATALOGUE:
            raise ValueError(f"unknown rule {self.rule!r}; known: {sorted(CATALOGUE)}")
        if self.level is not None and self.level not in CATALOGUE[self.rule].severities:
            raise ValueError(f"level must be one of {CATALOGUE[self.rule].severities} for a {self.rule} finding "
                             f"(its row's severity and uncertain form), got {self.level!r}")

    @property
    def severity(self) -> str:
        return self.level or CATALOGUE[self.rule].severity

    @property
    def fix(self) -> str:
        return CATALOGUE[self.rule].fix

    @property
    def framework_fix(self) -> str | None:
        """The fix as a setting of the framework that made the call (None: none declared, or no framework)."""
        return None if self.framework is None else CATALOGUE[self.rule].framework_fixes.get(self.framework.name)

    def framework_note(self) -> str | None:
        """The framework attribution in one line of the text report (None without a framework)."""
        fw = self.framework
        if fw is None:
            return None
        fix, user = self.framework_fix, fw.user_frame or "no frame of the user's code"
        return (f"framework: {fw.name} {fw.version} made the call at {fw.frame}, reached from {user}"
                + (f"; fix in {fw.name}: {fix}" if fix else ""))

    def to_dict(self) -> dict[str, Any]:
        fw = self.framework
        return {"rule": self.rule, "severity": self.severity, "step": self.step, "where": str(self.where),
                "message": self.message, "expected": _jsonable(self.expected), "got": _jsonable(self.got),
                "fix": self.fix,
                "framework": None if fw is None else {"name": fw.name, "version": fw.version, "call_site": fw.frame,
                                                      "user_frame": fw.user_frame, "fix": self.framework_fix}}


def _jsonable(value: Any) -> Any:
    """Numbers as JSON numbers when finite, else as their repr; everything else as is or str."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    try:
        return _jsonable(float(value))
    except (TypeError, ValueError):
        return str(value)
