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

A check is a generator: it reads the recorder's records (or the replay's boundary) and yields
findings, changing nothing. The severity contract and `Finding` are in `audit.findings`.
Adding a rule: its row and check in its family's module (one function), and a loop of the
catalogue (``tests/audit_loops/``) that breaks it, with the steps it must be found at;
``tests/test_audit_rules.py`` holds every rule to that. docs/audit.md's table of rules is
generated from the rows: ``python -m audit.rules_table`` prints it (`markdown_table`), and
the test fails while the page's table differs (CONTRIBUTING.md has the recipe).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

from audit import checks_clipping, checks_numbers, checks_program, checks_scaler, checks_steps
from audit.findings import CATALOGUE, ERROR, INFO, SEVERITIES, WARNING, Finding, Rule, rule

__all__ = ["RULES", "FAMILIES", "markdown_table", "Rule", "rule", "Finding", "ERROR", "WARNING", "INFO", "SEVERITIES"]

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


def markdown_table(rules: Iterable[Rule]) -> str:
    """docs/audit.md's table of rules, one line per row in catalogue order: name, severities,
    what the loop did (``doc``)."""
    lines = ["| rule | severity | what the loop did |", "|---|---|---|"]
    lines += [f"| `{r.name}` | {', '.join(r.severities)} | {r.doc} |" for r in rules]
    return "\n".join(lines) + "\n"

