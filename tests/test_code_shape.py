"""The shape the code keeps: small functions in torchimpl, and a Trainer that holds only the run's
loop, with one fit's state in one object (so that it cannot grow back into a bag of attributes)."""

import ast
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def test_no_torchimpl_function_is_over_60_lines():
    long = [f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted((_ROOT / "torchimpl").rglob("*.py"))
            for node in ast.walk(_tree(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long, f"functions over 60 lines: {long}; split them where the steps are"


def _trainer() -> ast.ClassDef:
    tree = _tree(_ROOT / "torchimpl" / "train" / "trainer.py")
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")


def test_the_trainer_stays_under_350_lines():
    cls = _trainer()
    assert cls.end_lineno - cls.lineno + 1 <= 350, "Trainer is over 350 lines: move a part out to its own object"


def test_the_trainer_creates_no_attribute_outside_init():
    """A fit's state goes into the object made at the start of the fit, not onto the trainer."""
    created = set()
    for method in _trainer().body:
        if isinstance(method, ast.FunctionDef) and method.name != "__init__":
            for node in ast.walk(method):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
                created |= {t.attr for target in targets for t in ast.walk(target)
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert created <= {"_fit"}, f"Trainer methods create attributes {sorted(created - {'_fit'})}: keep them in _Fit"
