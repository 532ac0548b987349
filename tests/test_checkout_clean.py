"""The suite leaves the checkout as it found it: where runs go under test, and CI's check."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs_dir_for_a_module_fixture() -> str | None:
    # What a module-scoped fixture (a process group, a shared run) sees when it starts work:
    # such fixtures are set up before any function-scoped autouse fixture.
    return os.environ.get("AMPSPEC_RUNS_DIR")


def test_module_scoped_fixtures_already_send_runs_outside_the_checkout(runs_dir_for_a_module_fixture):
    value = runs_dir_for_a_module_fixture
    assert value, "AMPSPEC_RUNS_DIR is unset while module-scoped fixtures run: their runs land in ./ampspec-runs"
    assert not Path(value).resolve().is_relative_to(ROOT), f"runs go to {value}, inside the checkout {ROOT}"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_ci_leftovers_names_what_tests_left_and_nothing_the_test_command_makes(tmp_path):
    repo = tmp_path / "checkout"
    (repo / "pkg").mkdir(parents=True)
    (repo / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "init")
    script = ROOT / ".ci" / "leftovers"
    assert subprocess.run([str(script), str(repo)], capture_output=True, text=True, check=True).stdout == ""
    # What the README's test command makes is not a leftover...
    for d in (".venv/bin", "pkg/__pycache__", "ampspec.egg-info", ".pytest_cache", ".hypothesis"):
        (repo / d).mkdir(parents=True)
        (repo / d / "f").write_text("")
    assert subprocess.run([str(script), str(repo)], capture_output=True, text=True, check=True).stdout == ""
    # ...runs in ampspec-runs/ (ignored, for users' own runs) and any new or changed file are.
    (repo / "ampspec-runs" / "version_0").mkdir(parents=True)
    (repo / "ampspec-runs" / "version_0" / "metrics.csv").write_text("")
    (repo / "pkg" / "a.py").write_text("x = 2\n")
    (repo / "out.png").write_text("")
    out = subprocess.run([str(script), str(repo)], capture_output=True, text=True, check=True).stdout
    assert sorted(out.splitlines()) == sorted(["!! ampspec-runs/", " M pkg/a.py", "?? out.png"])


def test_ci_run_checks_the_checkout_after_the_readme_command():
    text = (ROOT / ".ci" / "run").read_text()
    command_at = text.index('bash -euo pipefail -c "$cmd"')
    assert text.index("before=$(.ci/leftovers)") < command_at < text.index(".ci/leftovers | sort")
    assert "exit 1" in text[command_at:]
