"""The audit's own dependency rule: it imports torch and ``reference``, never ``torchimpl``.

The audit judges other people's loops against the specification; leaning on ampspec's trainer
would let a trainer bug shape the verdict on someone else's code.
"""

import ast
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent

_IMPORT = """
import importlib, pkgutil, sys
pkg = importlib.import_module("audit")
for name in {names!r} or [i.name for i in pkgutil.walk_packages(pkg.__path__, "audit.")]:
    importlib.import_module(name)
print("\\n".join(sorted(sys.modules)))
"""


def _modules_after_import(*names: str) -> set[str]:
    code = _IMPORT.format(names=list(names))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=_ROOT)
    return set(out.stdout.split())


def _imported_names(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


def test_audit_imports_torch_and_reference_never_torchimpl():
    mods = _modules_after_import()
    leaked = sorted(m for m in mods if m == "torchimpl" or m.startswith("torchimpl."))
    assert not leaked, f"importing audit loaded {leaked}: the audit must not depend on torchimpl"
    assert "torch" in mods and "reference" in mods


def test_no_audit_module_names_torchimpl_even_inside_a_function():
    offenders = {}
    for path in sorted((_ROOT / "audit").glob("*.py")):
        bad = [n for n in _imported_names(path) if n == "torchimpl" or n.startswith("torchimpl.")]
        if bad:
            offenders[path.name] = bad
    assert not offenders, f"audit modules importing torchimpl: {offenders}"


def test_the_pytest_plugin_loads_neither_torch_nor_the_spec():
    """The plugin is an entry point every pytest run of an installed ampspec loads; it must not
    make pytest's start pay for torch."""
    mods = _modules_after_import("audit.pytest_plugin")
    assert "torch" not in mods and "reference" not in mods
