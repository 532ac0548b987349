"""Conformance suite configuration: Hypothesis profiles, the device fixture, the report header.

Profiles are registered and loaded here explicitly, so behaviour never depends on whether the
environment happens to set ``CI``:

- ``ci`` (default): bounded and derandomized, sized for CI on 2 cores;
- ``dev``: random, a little more;
- ``thorough``: at least 20x ``ci``, for nightly runs and releases.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

_CI_EXAMPLES = 50

settings.register_profile(
    "ci",
    max_examples=_CI_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=2 * _CI_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=25 * _CI_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("AMPSPEC_HYPOTHESIS_PROFILE", "ci"))
