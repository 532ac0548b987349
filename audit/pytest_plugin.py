"""The ``ampspec_audit`` pytest fixture: audit the training loop a test runs.

    def test_my_loop(ampspec_audit):
        train(steps=20)          # the test's own code, unmodified

The audit runs for the whole test, with the numeric replay. When the test's body has run, a
finding fails the test with the text report. A test that calls ``ampspec_audit.stop()`` itself
gets the report (``report.findings``, ``report.ok``) and decides; nothing more fails then.
Registered through the ``pytest11`` entry point of the ampspec distribution; without it, add
``-p audit.pytest_plugin`` (or ``pytest_plugins = ["audit.pytest_plugin"]`` in a conftest).
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

_FIXTURE = "ampspec_audit"


@pytest.fixture
def ampspec_audit(request: Any) -> Iterator[Any]:
    from audit import Audit  # imported when a test asks for it: pytest's start stays torch-free

    session = Audit(replay=True, target=request.node.nodeid)
    session.start()
    try:
        yield session
    finally:
        if session._report is None:
            session.stop()  # the test failed on its own: its error is the one to show


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: Any) -> Iterator[None]:
    """After a test body that used the fixture passed: its findings fail the test (the call phase)."""
    result = yield
    funcargs = getattr(item, "funcargs", {})
    session = funcargs.get(_FIXTURE) if _FIXTURE in getattr(item, "fixturenames", ()) else None
    if session is not None and session._report is None:
        report = session.stop()
        if report.findings:
            pytest.fail(report.text(), pytrace=False)
    return result
