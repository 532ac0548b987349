"""The exact mode: the bit-exact properties again, with torch's scalar CPU kernels.

``ATEN_CPU_CAPABILITY=default`` makes ATen round every operation separately, and the thread
count is pinned: there clipping, the optimizers (every path), the scaler and the casts must
match the spec bit for bit (docs/architecture.md). This reruns those properties in a subprocess with
that environment, so that one ``pytest conformance`` covers both the native and the exact
kernels. The subprocess is marked with ``expectations.EXACT_MODE_ENV`` and does not recurse.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conformance import expectations

ROOT = Path(__file__).resolve().parent.parent
EXACT_PROPERTIES = ["test_clipping.py", "test_optimizers.py", "test_scaler.py", "test_casts.py", "test_reductions.py",
                    "test_optim_adafactor.py", "test_master_weights.py"]
TAIL = 6000


def _exact_env() -> dict[str, str]:
    env = dict(os.environ)
    env["ATEN_CPU_CAPABILITY"] = "default"
    env[expectations.EXACT_MODE_ENV] = "1"
    env["AMPSPEC_THREADS"] = str(torch.get_num_threads())  # the count this run pinned
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


@pytest.mark.skipif(bool(os.environ.get(expectations.EXACT_MODE_ENV)),
                    reason="already the exact-mode rerun: it does not start another")
def test_bit_exact_properties_hold_with_exact_kernels():
    env = _exact_env()
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "DEFAULT", (
        f"ATEN_CPU_CAPABILITY=default did not select the scalar kernels: got {probe.stdout.strip()!r}")
    tests = [str(Path("conformance") / name) for name in EXACT_PROPERTIES]
    result = subprocess.run([sys.executable, "-m", "pytest", *tests, "-q", "--tb=short", "-p", "no:cacheprovider", "--device", "cpu"],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    output = (result.stdout + result.stderr)[-TAIL:]
    assert result.returncode == 0, (
        f"the bit-exact properties failed with ATEN_CPU_CAPABILITY=default and "
        f"AMPSPEC_THREADS={env['AMPSPEC_THREADS']} (exit code {result.returncode}); rerun with that "
        f"environment: {' '.join(tests)}\n--- output (tail) ---\n{output}")
