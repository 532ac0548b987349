"""LICENSE, CHANGELOG.md and CONTRIBUTING.md agree with pyproject.toml and with what exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> str:
    return (ROOT / "pyproject.toml").read_text()


def test_the_license_file_is_the_license_pyproject_names():
    assert 'license = { text = "Apache-2.0" }' in _pyproject()
    text = (ROOT / "LICENSE").read_text()
    assert " ".join(text.split()[:6]) == "Apache License Version 2.0, January 2004"
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 170  # the full text


def test_the_changelog_has_the_current_version():
    version = re.search(r'^version = "([^"]+)"', _pyproject(), re.M).group(1)
    assert re.search(rf"^## {re.escape(version)}\b", (ROOT / "CHANGELOG.md").read_text(), re.M)


def test_contributing_names_every_mutant_catalogue_and_every_benchmark():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    assert ".venv/bin/python -m pytest -q tests && .venv/bin/python -m pytest -q conformance" in text
    for path in sorted((ROOT / "conformance").glob("*mutations.py")):
        assert f"python -m conformance.{path.stem}" in text, path.name
    # Each benchmark's command is in CONTRIBUTING.md or on the page that quotes its figures.
    documented = _readme_benches() | set(re.findall(r"bench/(\w+\.py)", text))
    missing = [p.name for p in sorted((ROOT / "bench").glob("*.py")) if not p.name.startswith("_")
               and p.name not in documented]
    assert not missing, missing


def _readme_benches() -> set[str]:
    """Benchmarks the README documents with their command (CONTRIBUTING points there)."""
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    return {m for p in pages for m in re.findall(r"bench/(\w+\.py)", p.read_text())}


def test_the_audit_extra_brings_what_the_pytest_fixture_imports():
    """The pytest11 entry point's module imports pytest: ``pip install 'ampspec[audit]'`` brings it,
    and the page that documents the fixture says so."""
    import ast
    import tomllib

    project = tomllib.loads(_pyproject())["project"]
    module = project["entry-points"]["pytest11"]["ampspec_audit"]
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "pytest" in imported
    assert any(re.match(r"pytest\b", req) for req in project["optional-dependencies"]["audit"])
    assert "pip install 'ampspec[audit]'" in (ROOT / "docs" / "audit.md").read_text()
