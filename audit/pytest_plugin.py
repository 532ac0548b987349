"""The ``ampspec_audit`` pytest fixture: audit the training loop a test runs.

    def test_my_loop(ampspec_audit):
        train(steps=20)          # the test's own code, unmodified

The audit runs for the whole test, with the numeric replay. At teardown, a finding fails the
test with the text report. A test that calls ``ampspec_audit.stop()`` itself gets the report
(``report.findings``, ``report.ok``) and decides; nothing fails at teardown then.
Registered through the ``pytest11`` entry point of the ampspec distribution; without it, add
``-p audit.pytest_plugin`` (or ``pytest_plugins = ["audit.pytest_plugin"]`` in a conftest).
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest


@pytest.fixture
def ampspec_audit(request: Any) -> Iterator[Any]:
    from audit import Audit  # imported when a test asks for it: pytest's start stays torch-free

    session = Audit(replay=True, target=request.node.nodeid)
    session.start()
    try:
        yield session
    finally:
        stopped_by_test = session._report is not None
        report = session.stop()
    if not stopped_by_test and report.findings:
        pytest.fail(report.text(), pytrace=False)
