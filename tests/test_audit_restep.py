"""A direct ``optimizer.step()`` after ``scaler.step`` on the same gradients (audit/restep.py):
reported as ``step-bypasses-scaler`` at the direct step, and only when no backward, no
``zero_grad`` and no clearing of the gradients came between."""

from __future__ import annotations

import pytest
import torch

from audit import audit


def _loop(between: str, steps: int = 3, inf_at: int = -1) -> list[tuple[str, int | None]]:
    """scaler.step, then ``between``, then a direct optimizer.step, every iteration; the findings."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with audit(replay=False) as session:
        for i in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(3, 4)).float().square().mean()
            if i == inf_at:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if between == "zero_grad":
                opt.zero_grad(set_to_none=False)
            elif between == "module.zero_grad":
                model.zero_grad()
            elif between == "backward":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(torch.randn(3, 4)).float().square().mean()
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            if between != "no direct step":
                opt.step()
                if between == "backward":
                    scaler.update()
    return [(f.rule, f.step) for f in session.report.findings]


def test_a_direct_step_on_the_gradients_scaler_step_used_is_found_at_every_iteration():
    assert _loop("nothing") == [("step-bypasses-scaler", 1), ("step-bypasses-scaler", 3),
                                ("step-bypasses-scaler", 5)]


def test_the_finding_says_when_the_scaler_had_skipped_and_the_step_applies_non_finite_gradients():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with audit(replay=False) as session:
        loss = model(torch.randn(3, 4)).square().mean() * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.step()
    (f,) = session.report.findings
    assert (f.rule, f.step, f.severity) == ("step-bypasses-scaler", 1, "error")
    assert "skipped" in f.message and "non-finite" in f.message


@pytest.mark.parametrize("between", ["zero_grad", "module.zero_grad", "no direct step"])
def test_no_finding_when_the_gradients_were_cleared_or_no_direct_step_came(between):
    assert _loop(between) == []


def test_a_direct_step_after_a_new_backward_is_the_ordinary_bypass_not_a_restep():
    found = _loop("backward")
    assert found and all(rule == "update-without-step" for rule, _ in found), found


def test_gradients_set_to_none_by_hand_are_no_finding():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with audit(replay=False) as session:
        for _ in range(2):
            scaler.scale(model(torch.randn(3, 4)).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            for p in model.parameters():
                p.grad = None
            opt.step()
    assert session.report.findings == []
