"""Unit tests: a resume warning must be asserted where a test expects it, never left to leak
into the output (where it reads like a problem and hides a new one)."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # pytest.warns still catches these (it records every warning in its block); only one that
    # no test expected turns into an error.
    mark = pytest.mark.filterwarnings("error:resume from .* at step:UserWarning")
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(mark)
