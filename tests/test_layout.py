"""The house: torchimpl in rooms by concern, each room importing only along its documented arrows,
no import cycle in any package, and the public names unchanged by where the code lives."""

from __future__ import annotations

import ast
import importlib
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

_ROOT = Path(__file__).resolve().parent.parent
_TORCHIMPL = _ROOT / "torchimpl"

# Each part of torchimpl and the parts it may import (docs/architecture.md draws these arrows;
# each subpackage's docstring says the same). "torchimpl" is the package itself (its version).
ARROWS = {
    "cli": {"config", "doctor", "precision", "run", "task", "train", "spec_bridge", "safe_files", "torchimpl"},
    "doctor": {"precision", "run", "train", "spec_bridge", "_torch_compat"},
    "spec_bridge": {"train"},
    "task": {"config"},
    "train": {"config", "precision", "run", "distributed", "safe_files", "_torch_compat"},
    "distributed": {"run", "config"},
    "config": set(),
    "run": {"config", "task", "safe_files", "torchimpl"},
    "precision": {"config", "safe_files", "_torch_compat"},
    "safe_files": set(),
    "_torch_compat": set(),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (imports that never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(k) for stmt in node.body for k in ast.walk(stmt))
    return skip


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports, at module level or in a function, not
    counting ``TYPE_CHECKING`` imports; a name resolves to the deepest known module it names."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != me and not me.startswith(target + "."):
                found.add(target)
    return found


def import_graph(package: str) -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in sorted((_ROOT / package).rglob("*.py"))}
    return {m: imports_of(p, set(paths)) for m, p in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_cycles_finds_a_cycle_through_a_function_level_import():
    """The detector itself: a two-module loop is found, and a ``TYPE_CHECKING`` import is not one."""
    assert cycles({"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": set()}) == [["p.a", "p.b"]]
    assert cycles({"p.a": {"p.b"}, "p.b": set()}) == []


def test_function_level_and_type_checking_imports_are_told_apart(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "_ROOT", tmp_path)
    graph = import_graph("pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == set()


@pytest.mark.parametrize("package", ["reference", "torchimpl", "audit", "conformance"])
def test_no_import_cycle_inside_the_package(package):
    found = cycles(import_graph(package))
    assert not found, f"import cycles in {package} (function-level imports count): {found}"


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "torchimpl"


def test_each_part_of_torchimpl_imports_only_along_its_arrows():
    graph = import_graph("torchimpl")
    assert {_part(m) for m in graph} - {"torchimpl"} == set(ARROWS), "a part without arrows, or arrows of no part"
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                   if _part(t) != _part(m) and _part(m) != "torchimpl" and _part(t) not in ARROWS[_part(m)])
    assert not wrong, f"imports outside the documented arrows (docs/architecture.md): {wrong}"


def test_the_part_arrows_have_no_cycle():
    """No loop between rooms: config, the bottom room, imports none of them (the sections live in
    config, beside the rest of the configuration, and the code they configure reads them)."""
    graph = {part: set(targets) for part, targets in ARROWS.items()}
    graph["torchimpl"] = set()  # the package's own names: its version, and lazily its public names
    assert not cycles(graph)


def test_only_the_command_line_imports_audit():
    def names(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        return [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []

    users = sorted(str(p.relative_to(_TORCHIMPL)) for p in _TORCHIMPL.rglob("*.py")
                   if any(n.split(".")[0] == "audit" for node in ast.walk(ast.parse(p.read_text())) for n in names(node)))
    assert set(users) <= {"cli/bridges.py"}, f"torchimpl modules importing audit: {users}"


def _unexplained_function_imports(path: Path) -> list[str]:
    """In-function imports with no comment on their line or atop their group of imports."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    skip = _type_checking_nodes(tree)
    in_function = {id(k) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for k in ast.walk(f)}
    bad = []
    for node in ast.walk(tree):
        if id(node) in in_function and id(node) not in skip and isinstance(node, (ast.Import, ast.ImportFrom)):
            first = last = node.lineno - 1  # the group of import lines around it
            while first > 0 and lines[first - 1].strip().startswith(("from ", "import ")):
                first -= 1
            while last + 1 < len(lines) and lines[last + 1].strip().startswith(("from ", "import ")):
                last += 1
            if not any("#" in line for line in lines[first:last + 1]) and not lines[first - 1].strip().startswith("#"):
                bad.append(f"{path.relative_to(_ROOT)}:{node.lineno}")
    return bad


def test_each_function_level_import_says_why():
    """An import inside a function is for the command line's start-up time or an optional
    dependency, never to hide a cycle; a comment says which."""
    bad = [b for p in sorted(_TORCHIMPL.rglob("*.py")) for b in _unexplained_function_imports(p)]
    assert not bad, f"function-level imports without their reason: {bad}"


def test_torchimpl_keeps_at_most_twelve_modules_at_its_top_level():
    top = sorted(p.name for p in _TORCHIMPL.iterdir()
                 if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    assert len(top) <= 12, top
    for sub in (p for p in _TORCHIMPL.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((sub / "__init__.py").read_text())) or ""
        assert "Holds:" in doc and "import" in doc, f"{sub.name}/__init__.py must say what it holds and may import"


def test_no_torchimpl_module_is_over_600_lines():
    long = {str(p.relative_to(_TORCHIMPL)): n for p in sorted(_TORCHIMPL.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines: {long}; split where the file holds two ideas"


PUBLIC_NAMES = [
    "BuiltOptimizer", "Callback", "CheckpointConfig", "CheckpointError", "Config", "ConfigError", "DiagnosisReport",
    "DynamicLossScaler", "FusedOptimizerWarning", "LoggingConfig", "NonFiniteError", "NonFiniteGuard",
    "OptimizerConfig", "PrecisionConfig", "PrecisionDowngradeWarning", "PrecisionPlan", "PrecisionReport",
    "ResumeError", "RunSummary", "ScaleAtMinimumError", "ScalerConfig", "ScheduleConfig", "StepRecord",
    "StopTraining", "TaskConfig", "TrainConfig", "TrainState", "Trainer", "apply_overrides", "autocast_context",
    "build_optimizer", "canonical_mode", "check_placement", "configure_reduced_precision_reduction",
    "configure_tf32", "default_loss_fn", "diagnose_nonfinite", "fp32_island", "inspect_precision",
    "latest_checkpoint", "load_checkpoint", "load_config", "load_weights", "make_grad_scaler", "read_trace",
    "resolve_device", "resolve_precision", "save_checkpoint", "supports_fused_adamw", "upcast",
]


def test_the_public_names_stay_what_they_were():
    import torchimpl

    assert sorted(torchimpl.__all__) == sorted(PUBLIC_NAMES)
    for name in PUBLIC_NAMES:
        value = getattr(torchimpl, name)
        assert getattr(value, "__name__", name) == name, f"torchimpl.{name} is {value!r}"


def test_the_ampspec_command_entry_point_resolves():
    entry = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]["scripts"]["ampspec"]
    module, _, attr = entry.partition(":")
    assert entry == "torchimpl.cli:main" and callable(getattr(importlib.import_module(module), attr))


def test_the_per_fit_state_names_the_type_of_each_field():
    """One fit's state is a typed object: no field of ``_Fit`` is ``Any`` (the user's own
    objects, of types the trainer cannot know, are the only ``Any`` inside a field's type)."""
    import typing

    from torchimpl.train.trainer import _Fit

    untyped = sorted(name for name, tp in typing.get_type_hints(_Fit).items() if tp is Any)
    assert not untyped, f"_Fit fields typed Any: {untyped}"


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def test_a_checkpoint_names_no_torchimpl_module(tmp_path):
    """The checkpoint format does not depend on where torchimpl's code lives: no module path of
    torchimpl is stored (so a checkpoint written before a move resumes after it)."""
    import torch
    from torch import nn

    import torchimpl

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    trainer = torchimpl.Trainer(precision="fp32", device="cpu", max_steps=2, checkpoint_dir=str(tmp_path),
                                checkpoint_interval=1, overrides={"logging.progress": "off", "logging.dir": None})
    trainer.fit(model, data, loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), optimizer=opt,
                scheduler=sched)
    contents = torchimpl.load_checkpoint(torchimpl.latest_checkpoint(tmp_path))
    named = sorted({s for s in _strings(contents) if "torchimpl." in s})
    assert not named, f"the checkpoint names torchimpl modules: {named}"
    assert "torch.optim.sgd.SGD" in _strings(contents)  # what it does name: the user's classes
