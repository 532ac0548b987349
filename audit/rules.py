"""The audit's rules: a short name, a severity, what it means, the fix, and the check that decides it.

Each rule is a clause of the step contract (``reference.step``, rules 1-6) that a user's loop can
break by the order or the arguments of its calls, or a change to the numbers that the replay
measures between two stages. Each is declared on its check (`audit.findings.rule`), in the
module of its family:

- `audit.checks_scaler`: the GradScaler's call sequence (``unscale-twice``,
  ``step-without-update``, ``update-without-step``, ``step-bypasses-scaler``,
  ``new-scaler-mid-run``), read from the spec's stages of each optimizer (`audit.sequence`);
- `audit.checks_clipping`: ``clip-before-unscale``, ``clip-threshold-scaled``;
- `audit.checks_steps`: the windows and steps (``zero-grad-in-window``, ``loss-not-divided``,
  ``optimizer-before-to``, ``scheduler-on-skipped-step``, ``lr-changed-on-skipped-step``);
- `audit.checks_program`: ``backward-in-autocast``, ``checkpoint-without-scaler``;
- `audit.checks_numbers`: what the replay measures (``scale-twice``,
  ``gradients-modified-before-unscale``, ``gradients-modified-after-unscale``,
  ``replay-divergence``).

A check is a generator: it reads one event (`audit.events`, `audit.sequence`'s calls, the
replay's `audit.boundaries.Boundary`) and yields findings, changing nothing. The recorder and the
replay hand each event to `dispatch`, which runs the rules whose rows name its type: no part of
the audit calls a check by name. The severity contract and `Finding` are in `audit.findings`.
Adding a rule (CONTRIBUTING.md): its row and check in its family's module (one function that
declares the event types it reads, ``events``), a
loop of the catalogue (``tests/audit_loops/``) that breaks it, with the steps it must be found at,
and docs/audit.md's table rendered from the rows (``python -m audit.rules_table``, `markdown_table`);
``tests/test_audit_rules.py`` holds every rule to that.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

from audit import checks_clipping, checks_numbers, checks_program, checks_scaler, checks_steps
from audit.checks_numbers import LOST_WINDOW  # the window update-lost-to-rounding counts over (the replay keeps it)
from audit.findings import CATALOGUE, ERROR, INFO, SEVERITIES, WARNING, Finding, Rule, rule

__all__ = ["LOST_WINDOW", "RULES", "FAMILIES", "dispatch", "markdown_table", "Rule", "rule", "Finding", "ERROR", "WARNING", "INFO", "SEVERITIES"]

FAMILIES: tuple[ModuleType, ...] = (checks_clipping, checks_scaler, checks_numbers, checks_steps, checks_program)


def _catalogue() -> dict[str, Rule]:
    rules: dict[str, Rule] = {}
    for family in FAMILIES:
        for value in vars(family).values():
            row = getattr(value, "rule", None)
            if isinstance(row, Rule) and getattr(value, "__module__", None) == family.__name__:
                if row.name in rules:
                    raise ValueError(f"rule {row.name!r} is declared twice ({rules[row.name].check} and {row.check})")
                rules[row.name] = row
    return rules


CATALOGUE.update(_catalogue())
RULES: dict[str, Rule] = CATALOGUE
"""Every rule by name (the dict `audit.findings.Finding` validates against)."""

_BY_EVENT: dict[str, tuple[Rule, ...]] = {}
for _row in RULES.values():
    for _event in _row.events:
        _BY_EVENT[_event] = (*_BY_EVENT.get(_event, ()), _row)


_BY_TYPE: dict[type, tuple[Rule, ...]] = {}  # the rows of an event's class, found by its name once


def dispatch(event: Any) -> list[Finding]:
    """The findings of every rule that reads events of ``event``'s type (its row's ``events``),
    in catalogue order: the recorder and the replay hand an event here, never to a named check.
    A list, not a generator of generators: the recorder dispatches ten events a step, and the
    checks change nothing, so running them at once is the same."""
    kind = type(event)
    rows = _BY_TYPE.get(kind)
    if rows is None:
        rows = _BY_TYPE[kind] = _BY_EVENT.get(kind.__name__, ())
    if len(rows) == 1:  # most events: one rule, its findings as they come
        return list(rows[0].check(event))  # type: ignore[misc]
    found: list[Finding] = []
    for row in rows:
        assert row.check is not None
        found.extend(row.check(event))
    return found


def markdown_table(rules: Iterable[Rule]) -> str:
    """docs/audit.md's table of rules, one line per row in catalogue order: name, severities,
    what the loop did (``doc``)."""
    lines = ["| rule | severity | what the loop did |", "|---|---|---|"]
    lines += [f"| `{r.name}` | {', '.join(r.severities)} | {r.doc} |" for r in rules]
    return "\n".join(lines) + "\n"

