"""The audit's mutation check (tests/audit_mutations.py) stays runnable, and, opt-in, kills every mutant.

Each mutant is an exact source edit of a rule's check; if the code moves on, the edit stops
applying and the check would silently lose a mutant: the fast test names the mutant to update.
Running them all takes minutes (one catalogue run per mutant): marked ``slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from audit.rules import RULES
from audit_mutations import MUTANTS, ROOT


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_audit_mutant_edit_applies_exactly_once(mutant):
    count = (ROOT / mutant.file).read_text().count(mutant.old)
    assert count == 1, (f"mutant {mutant.name!r}: its edit matches {count} places in {mutant.file}; update "
                        "tests/audit_mutations.py to the current source")


def test_every_rule_has_a_mutant():
    named = {m.bug.split(":")[0] for m in MUTANTS}
    assert sorted(set(RULES) - named) == []


@pytest.mark.slow
def test_every_audit_mutant_is_killed(request):
    if not (request.config.getoption("--runslow", default=False) or os.environ.get("AMPSPEC_RUNSLOW") == "1"):
        pytest.skip("the mutation check runs the catalogue once a mutant: opt in with --runslow or AMPSPEC_RUNSLOW=1")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "audit_mutations.py")], capture_output=True,
                          text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
