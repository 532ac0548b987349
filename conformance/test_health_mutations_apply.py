"""The health mutation check (`python -m conformance.health_mutations`) stays runnable: each
mutant's edit must match torchimpl/precision/health.py exactly once."""

from __future__ import annotations

import pytest

from conformance.health_mutations import MUTANTS
from conformance.mutations import ROOT


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_health_mutant_edit_applies_exactly_once(mutant):
    count = (ROOT / mutant.file).read_text().count(mutant.old)
    assert count == 1, (f"mutant {mutant.name!r}: its edit matches {count} places in {mutant.file}; "
                        "update conformance/health_mutations.py to the current source")
