"""The ``ampspec_audit`` pytest fixture: audit the training loop a test runs.

    def test_my_loop(ampspec_audit):
        train(steps=20)          # the test's own code, unmodified

    @pytest.mark.ampspec_audit(strict=True)   # warnings and info fail the test too
    def test_my_strict_loop(ampspec_audit):
        train(steps=20)

The audit runs for the whole test, with the numeric replay. When the test's body has run, an
error-level finding fails the test with the text report (with ``strict=True``, any finding);
other findings are issued as a pytest warning carrying the report. A test that calls
``ampspec_audit.stop()`` itself gets the report (``report.findings``, ``report.ok``) and
decides; nothing more fails then. Registered through the ``pytest11`` entry point of the
ampspec distribution; without it, add ``-p audit.pytest_plugin`` (or ``pytest_plugins =
["audit.pytest_plugin"]`` in a conftest).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import pytest

_FIXTURE = "ampspec_audit"


class AuditFindingsWarning(UserWarning):
    """Warnings or info findings of an audited test that passed (not strict)."""


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "ampspec_audit(strict=False): options of the ampspec_audit fixture")


@pytest.fixture
def ampspec_audit(request: Any) -> Iterator[Any]:
    from audit import Audit  # imported when a test asks for it: pytest's start stays torch-free

    marker = request.node.get_closest_marker(_FIXTURE)
    options = dict(marker.kwargs) if marker is not None else {}
    unknown = set(options) - {"strict"}
    if unknown:
        raise pytest.UsageError(f"@pytest.mark.ampspec_audit takes strict=True|False; got {sorted(unknown)}")
    session = Audit(replay=True, target=request.node.nodeid, strict=bool(options.get("strict", False)))
    session.start()
    try:
        yield session
    finally:
        if session._report is None:
            session.stop()  # the test failed on its own: its error is the one to show


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: Any) -> Iterator[None]:
    """After a test body that used the fixture passed: its failing findings fail the test (the
    call phase); the others are a warning."""
    result = yield
    funcargs = getattr(item, "funcargs", {})
    session = funcargs.get(_FIXTURE) if _FIXTURE in getattr(item, "fixturenames", ()) else None
    if session is not None and session._report is None:
        report = session.stop()
        if report.failing:
            pytest.fail(report.text(), pytrace=False)
        elif report.findings:
            warnings.warn(AuditFindingsWarning(report.text()), stacklevel=1)
    return result
