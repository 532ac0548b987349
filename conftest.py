"""Shared by the unit tests and the conformance suite: runs never write into the checkout."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # logging.dir: auto without checkpoint.folder makes ampspec-runs/version_N in the working
    # directory; tests (and the commands they start, which inherit the environment) use a temporary one.
    monkeypatch.setenv("AMPSPEC_RUNS_DIR", str(tmp_path_factory.mktemp("ampspec-runs")))
