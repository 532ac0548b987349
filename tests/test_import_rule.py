"""The two implementations stay independent: a shared bug must not be able to hide."""

import subprocess
import sys


def _modules_after_import(package: str) -> set[str]:
    code = f"import sys, {package}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(out.stdout.split())


def test_reference_never_imports_torch():
    mods = _modules_after_import("reference")
    assert "torch" not in mods, "reference imported torch: the spec must stay pure NumPy + ml_dtypes"
    assert not any(m.startswith("torchimpl") for m in mods)


def test_torchimpl_never_imports_reference():
    mods = _modules_after_import("torchimpl")
    assert not any(m == "reference" or m.startswith("reference.") for m in mods)
