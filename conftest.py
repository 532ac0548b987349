"""Shared by the unit tests and the conformance suite: runs never write into the checkout."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

RUNS_ENV = "AMPSPEC_RUNS_DIR"  # torchimpl.run.metrics.RUNS_ENV, spelled here so that no test imports torch for it


@pytest.fixture(autouse=True, scope="session")
def _session_runs_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # logging.dir: auto without checkpoint.folder makes ampspec-runs/version_N in the working
    # directory. Session scope, so that it is set before any module- or class-scoped fixture
    # starts work (a process group, a shared training run), and the processes they start
    # inherit it.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUNS_ENV, str(tmp_path_factory.mktemp("ampspec-runs-session")))
        yield


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # A folder of its own for each test, so that counting version_N folders sees only its runs.
    monkeypatch.setenv(RUNS_ENV, str(tmp_path_factory.mktemp("ampspec-runs")))
