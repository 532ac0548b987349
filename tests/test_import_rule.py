"""The two implementations stay independent: a shared bug must not be able to hide."""

import ast
import subprocess
import sys
from pathlib import Path

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


def test_only_the_cli_boundary_mentions_reference():
    """Where torchimpl meets the spec (the CLI's replay and the bridge it uses), and nowhere
    else; there, only inside functions, so that importing torchimpl never imports it."""
    root = Path(__file__).resolve().parent.parent / "torchimpl"
    users, top_level = set(), set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "reference" or n.startswith("reference.") for n in names):
                users.add(path.relative_to(root).as_posix())
                if node in tree.body:
                    top_level.add(path.relative_to(root).as_posix())
    assert users <= {"cli/bridges.py", "spec_bridge.py"}, f"torchimpl modules importing reference: {sorted(users)}"
    assert not top_level, f"modules importing reference at import time: {sorted(top_level)}"


def test_torchimpl_reexports_its_public_names():
    import torchimpl

    for name in torchimpl.__all__:
        assert hasattr(torchimpl, name), f"torchimpl.__all__ lists {name!r} but the package lacks it"
