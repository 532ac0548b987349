"""Conformance suite configuration: Hypothesis profiles, the device fixture, the report header.

Profiles are registered and loaded here explicitly, so behaviour never depends on whether the
environment happens to set ``CI``:

- ``ci`` (default): bounded and derandomized, sized for CI on 2 cores;
- ``dev``: random, a little more;
- ``thorough``: at least 20x ``ci``, for nightly runs and releases.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ampspec conformance")
    group.addoption(
        "--device",
        action="append",
        default=None,
        help="device type to run the properties on (cpu, cuda); repeatable. "
        "Default: cpu, plus cuda when available.",
    )
    group.addoption("--runslow", action="store_true", default=False, help="run the exhaustive `slow` sweeps")


def _devices(config: pytest.Config) -> list[str]:
    import torch

    requested = config.getoption("--device")
    if requested:
        return requested
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", _devices(metafunc.config), scope="session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    here = Path(__file__).parent
    for item in items:
        if here not in Path(item.path).parents:
            continue  # hooks in this conftest see the whole session; act on conformance only
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(pytest.mark.skip(reason="exhaustive sweep: opt in with --runslow"))
        callspec = getattr(item, "callspec", None)
        if callspec and callspec.params.get("device") == "cuda" and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="--device cuda requested but CUDA is not available here"))


def pytest_report_header(config: pytest.Config) -> list[str]:
    import ml_dtypes
    import numpy
    import torch

    from conformance import expectations

    capability = torch.backends.cpu.get_cpu_capability()
    return [
        f"ampspec conformance: torch {torch.__version__}, numpy {numpy.__version__}, ml_dtypes {ml_dtypes.__version__}",
        f"CPU capability {capability} (ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}), "
        f"torch threads {torch.get_num_threads()}, devices {_devices(config)}",
        f"hypothesis profile: {settings._current_profile}",
        f"float8: {expectations.torchao_provenance()}",
        f"keyed facts: {expectations.version_status()}",
    ]


def pytest_configure(config: pytest.Config) -> None:
    import torch

    # Bits of reductions change with the thread count: pin it for the whole run.
    torch.set_num_threads(int(os.environ.get("AMPSPEC_THREADS", "1")))
