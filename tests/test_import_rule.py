"""The two implementations stay independent: a shared bug must not be able to hide."""

import subprocess
import sys

_IMPORT_ALL = """
import importlib, pkgutil, sys
pkg = importlib.import_module({package!r})
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    if info.name.endswith("__main__"):
        continue
    importlib.import_module(info.name)
print("\\n".join(sorted(sys.modules)))
"""


def _modules_after_import(package: str) -> set[str]:
    code = _IMPORT_ALL.format(package=package)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(out.stdout.split())


def test_reference_never_imports_torch():
    mods = _modules_after_import("reference")
    assert "torch" not in mods, "reference imported torch: the spec must stay pure NumPy + ml_dtypes"
    assert not any(m.startswith("torchimpl") for m in mods)


def test_torchimpl_never_imports_reference():
    mods = _modules_after_import("torchimpl")
    leaked = sorted(m for m in mods if m == "reference" or m.startswith("reference."))
    assert not leaked, f"torchimpl imported {leaked}: the two implementations must stay independent"


def test_torchimpl_reexports_its_public_names():
    import torchimpl

    for name in torchimpl.__all__:
        assert hasattr(torchimpl, name), f"torchimpl.__all__ lists {name!r} but the package lacks it"
