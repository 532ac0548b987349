"""``ampspec --help``, ``--version`` and argument errors answer without importing torch (it
takes seconds); ``bench/cli_startup.py`` measures the time, this checks the cause."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys
from torchimpl.cli.app import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "numpy", "yaml", "reference", "audit") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.__stderr__)
"""


def _probe(*argv: str) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
    *text, last = r.stderr.strip().splitlines()
    return json.loads(last), r.stdout + "\n".join(text)


@pytest.mark.parametrize("argv", [
    ("--help",),
    ("--version",),
    ("compare", "--help"),
    ("train", "--help"),
    ("audit", "--help"),
    ("compare", "--steps", "x"),
    ("compare", "--task", "nocolon"),
    ("train", "--bogus"),
    ("-v", "-q", "doctor"),
])
def test_help_version_and_argument_errors_do_not_import_torch(argv):
    seen, out = _probe(*argv)
    assert seen["heavy"] == [], f"ampspec {' '.join(argv)} imported {seen['heavy']}:\n{out}"
    assert seen["code"] in (0, 2), out


def test_version_names_the_installed_torch_without_importing_it():
    import torch

    seen, out = _probe("--version")
    assert f"(torch {torch.__version__}, python " in out and seen["heavy"] == []
