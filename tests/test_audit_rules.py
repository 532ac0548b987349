"""The shape of the audit's rules: each row has exactly one check beside it, each is broken by a
loop of the catalogue, and the GradScaler rules read the specification's call sequence.

Adding a rule means one row with its check (`audit.findings.rule`, in its family's
``audit/checks_*.py``) and one catalogue loop that breaks it; these tests hold every rule to that.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from audit import sequence
from audit.findings import rule
from audit.rules import FAMILIES, RULES, markdown_table
from audit.runner import run_script
from reference import scaling
from test_audit_catalogue import PLANTED
from test_audit_real import CASES

ROOT = Path(__file__).resolve().parents[1]
LOOPS = ROOT / "tests" / "audit_loops"


def _declared() -> dict[str, list[str]]:
    """Rule name -> the functions declaring it, read from the source of every audit module."""
    out: dict[str, list[str]] = {}
    for path in sorted((ROOT / "audit").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    if isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "rule" and dec.args:
                        out.setdefault(dec.args[0].value, []).append(f"{path.name}:{node.name}")
    return out


def test_every_rule_row_has_exactly_one_check_beside_it():
    declared = _declared()
    assert sorted(declared) == sorted(RULES), "a rule declared outside the families, or a family not listed"
    assert {n: fs for n, fs in declared.items() if len(fs) != 1} == {}, "a rule declared twice"
    for name, row in RULES.items():
        check = row.check
        assert check is not None and check.rule is row, name
        assert inspect.isgeneratorfunction(check), f"{name}: a check yields its findings"
        assert inspect.getmodule(check) in FAMILIES, f"{name}: its check is in no family module"
        assert check.__doc__ and check.__doc__.strip(), f"{name}: its check says what it decides"


def test_every_rule_is_broken_by_a_loop_of_the_catalogue():
    triggered = {rule for _, _, rule, steps, _ in PLANTED if steps}
    triggered |= {rule for _, _, expected, _ in CASES for (rule, _), steps in expected.items() if steps}
    assert sorted(set(RULES) - triggered) == [], "rules no catalogue loop breaks: add a loop (tests/audit_loops/)"


def test_the_checks_read_and_never_write():
    """A check yields findings; it assigns to nothing but its own locals."""
    offenders = []
    for name, row in RULES.items():
        tree = ast.parse(inspect.getsource(row.check).lstrip())
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            offenders += [f"{name}: {ast.unparse(t)}" for t in targets if not isinstance(t, (ast.Name, ast.Tuple))]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("append", "extend", "add", "pop", "clear", "update", "remove"):
                offenders.append(f"{name}: {ast.unparse(node)}")
    assert offenders == []


@pytest.mark.parametrize("bug,torch_says", [
    ("unscale-twice-call", "unscale_() has already been called on this optimizer since the last update()"),
    ("step-without-update", "unscale_() is being called after step()"),
])
def test_a_call_the_spec_refuses_is_recorded_with_torchs_exception_and_left_to_torch(bug, torch_says):
    """The spec's stage function refuses the call with the exception torch raises: the finding
    quotes it, and the program fails as it would without the audit (torch raised, not the audit)."""
    report = run_script(LOOPS / "scaler_loop.py", ["--bug", bug, "--steps", "3"])
    assert torch_says in report.error
    assert "audit/instrument.py" not in report.error and "audit/track_scaler.py" not in report.error
    assert len(report.findings) == 1 and torch_says in report.findings[0].message, report.text()


def test_the_sequence_advances_through_the_specifications_stages():
    f32 = [sequence.numpy_dtypes(["torch.float32"])[0]]
    ready = sequence.READY_STAGE
    un = sequence.unscale_call(ready, optimizer="SGD#0", step=0, where="t.py:1", scaled=True, grad_dtypes=f32)
    assert un.after == scaling.unscale_stage(ready, scaled=True, grad_dtypes=f32) and un.refused is None
    again = sequence.unscale_call(un.after, optimizer="SGD#0", step=0, where="t.py:2", scaled=True, grad_dtypes=f32)
    assert again.after is None and again.refused.startswith("unscale_() has already been called")
    assert sequence.stage_after(again, ok=False) == un.after  # torch raised: the stage stays
    step = sequence.step_call(ready, optimizer="SGD#0", step=0, where="t.py:3", scaled=True, grad_dtypes=[],
                              closure=False, amp_aware=False)
    assert step.refused == "No inf checks were recorded for this optimizer."
    assert sequence.stage_after(step, ok=False) == scaling.OptimizerStage(scaling.UNSCALED, False)
    fused = sequence.step_call(ready, optimizer="Adam#0", step=0, where="t.py:4", scaled=True, grad_dtypes=[],
                               closure=False, amp_aware=True)
    assert fused.refused is None and fused.after.stage == scaling.STEPPED  # the fused kernel's own inf check
    update = sequence.update_call({}, scaler="GradScaler#0", step=0, where="t.py:5", scaled=True, new_scale=False,
                                  bypasses=[])
    assert update.refused == "No inf checks were recorded prior to update." and not update.stepped
    assert sequence.numpy_dtypes(["torch.float16", "torch.bfloat16", "torch.int64"])[0] == "float16"


# ----------------------------------------------------------------------------- the docs, from the rows


def _docs_rules_table() -> str:
    """The table between the markers of docs/audit.md (blank lines around it dropped)."""
    text = (ROOT / "docs" / "audit.md").read_text()
    start = text.index("by `python -m audit.rules_table` -->") + len("by `python -m audit.rules_table` -->")
    return text[start:text.index("<!-- end of the rules table -->")].strip("\n") + "\n"


def test_the_docs_table_of_rules_is_the_one_the_rows_render():
    assert _docs_rules_table() == markdown_table(RULES.values()), \
        "docs/audit.md's rules table is not the rows': run python -m audit.rules_table and paste it between the markers"


def test_a_rule_s_severities_are_its_own_then_its_uncertain_form_s():
    assert RULES["loss-not-divided"].severities == ("error", "warning")
    assert RULES["backward-in-autocast"].severities == ("warning", "info")
    assert RULES["optimizer-before-to"].severities == (RULES["optimizer-before-to"].severity,)
    line = next(x for x in markdown_table(RULES.values()).splitlines() if x.startswith("| `loss-not-divided`"))
    assert line.startswith("| `loss-not-divided` | error, warning | an accumulation window")
    with pytest.raises(ValueError, match="uncertain severity of rule 'x' must be one of .* below 'warning'"):
        rule("x", "warning", "s", "f", uncertain="error")


def test_every_finding_has_one_of_its_rule_s_severities():
    """The uncertain form a check gives a finding (`Finding.level`) is the one its row declares."""
    levels = {name: set() for name in RULES}
    for path in sorted((ROOT / "audit").glob("checks_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                names = [d.args[0].value for d in node.decorator_list
                         if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "rule"]
                for sub in ast.walk(node):
                    if isinstance(sub, ast.keyword) and sub.arg == "level" and names:
                        levels[names[0]].add(ast.unparse(sub.value))
    for name, found in levels.items():
        assert not found or RULES[name].uncertain is not None, f"{name} gives a level but declares no uncertain form"


def test_every_event_a_rule_reads_is_an_event_type_of_the_audit():
    """A rule's ``events`` name event types (`audit.rules.dispatch` matches on the name), and a
    boundary of the replay reaches each rule that reads boundaries, in catalogue order."""
    from audit import boundaries, events

    kinds = {name for module in (boundaries, sequence, events) for name in dir(module)
             if isinstance(getattr(module, name), type)}
    declared = {e for r in RULES.values() for e in r.events}
    assert declared and declared <= kinds, f"events of no audit type: {sorted(declared - kinds)}"
    reads = [name for name, r in RULES.items() if "Boundary" in r.events]
    assert reads[:2] == ["unscale-twice", "scale-twice"] and len(reads) == 4


def test_every_rule_reads_events_and_no_module_calls_a_check_by_name():
    """The recorder dispatches by event type: each rule declares the events it reads, each event
    type of `audit.events` is read by a rule, and outside `audit.rules` no module of the audit
    imports a check (a check called by name would escape the rows)."""
    from audit import events

    silent = [name for name, r in RULES.items() if not r.events]
    assert not silent, f"rules that declare no event (dispatch never runs them): {silent}"
    read = {e for r in RULES.values() for e in r.events}
    unread = sorted(set(events.__all__) - read)
    assert not unread, f"events of audit.events that no rule reads: {unread}"
    for path in sorted(Path(events.__file__).parent.glob("*.py")):
        if path.name == "rules.py" or path.name.startswith("checks_"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("audit.checks_"):
                names = [a.name for a in node.names]
                raise AssertionError(f"{path.name} imports {names} from {node.module}: hand an event to "
                                     "audit.rules.dispatch instead")
