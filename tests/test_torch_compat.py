"""The private torch names torchimpl and the audit use: all present, and a missing one is named.

torch moves private names between releases without notice. Each package lists the ones it uses
in its ``_torch_compat`` module; these tests fail with the name and the torch version when the
installed torch lacks one, and check that the check itself notices a deleted name.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch

from audit import _torch_compat as audit_compat
from torchimpl import _torch_compat as torchimpl_compat

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("compat", [torchimpl_compat, audit_compat], ids=["torchimpl", "audit"])
def test_every_private_torch_name_is_present(compat):
    missing = compat.missing_names()
    assert not missing, (f"torch {torch.__version__} lacks private names {compat.__name__} lists: {missing}; "
                         f"find where this torch moved them and update {compat.__name__.replace('.', '/')}.py")


@pytest.mark.parametrize("compat, module, name", [
    (torchimpl_compat, "torch.utils._pytree", "tree_leaves"),
    (torchimpl_compat, "torch", "_foreach_mul_"),
    (audit_compat, "torch", "_foreach_sqrt"),
])
def test_a_deleted_private_function_is_named(monkeypatch, compat, module, name):
    monkeypatch.delattr(sys.modules[module], name)
    assert compat.missing_names() == [f"{module}.{name}"]


def test_a_deleted_private_attribute_is_named(monkeypatch):
    from torch.amp.grad_scaler import GradScaler

    monkeypatch.delattr(GradScaler, "_lazy_init_scale_growth_tracker")
    monkeypatch.delattr(torch.nn.Module, "_forward_hooks_always_called", raising=False)
    original = torch.nn.Module.__init__

    def init_without_always_called(self, *args, **kwargs):
        original(self, *args, **kwargs)
        del self.__dict__["_forward_hooks_always_called"]

    monkeypatch.setattr(torch.nn.Module, "__init__", init_without_always_called)
    assert torchimpl_compat.missing_names() == ["GradScaler._lazy_init_scale_growth_tracker",
                                                "nn.Module._forward_hooks_always_called"]


@pytest.mark.parametrize("package, name", [("torchimpl.train.trainer", "_foreach_mul_"), ("audit.recorder", "_foreach_sqrt")])
def test_importing_without_a_private_function_fails_with_its_name_and_the_torch_version(package, name):
    code = f"import torch; del torch.{name}; import {package}"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert f"torch {torch.__version__} has no torch.{name}" in last, out.stderr[-2000:]


def _code_names(path: Path) -> list[str]:
    """Dotted names in ``path``'s code (comments and strings skipped) that reach a private torch name."""
    found, dotted = [], ""
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.NAME and (not dotted or dotted.endswith(".")) or tok.string == ".":
            dotted += tok.string
            continue
        if re.match(r"torch(\.\w+)*\._[a-z]", dotted):
            found.append(dotted)
        dotted = tok.string if tok.type == tokenize.NAME else ""
    return found


@pytest.mark.parametrize("package", ["torchimpl"])
def test_private_torch_names_come_only_from_the_compat_module(package):
    """torchimpl's code names no private torch function or module except in its _torch_compat.py
    (``from torch.utils._pytree import ...`` and ``torch._foreach_mul_(...)`` alike)."""
    users = {str(p.relative_to(ROOT)): names for p in sorted((ROOT / package).rglob("*.py"))
             if p.name != "_torch_compat.py" and (names := _code_names(p))}
    assert not users, (f"private torch names used outside {package}/_torch_compat.py: {users}; import them "
                       f"there with a line on why")
