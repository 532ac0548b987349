"""A model that returns its output instead of the loss is refused on the first batch, with the
shape it returned and the two fixes, as an ``ampspec train: error:`` line (no traceback)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

from torchimpl.cli.app import main
from torchimpl.train.loss_protocol import bad_loss_message, default_loss_fn

LOGITS_TASK = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(x)


def make():
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    return Net(), batches, batches[:1]


def make_with_loss_fn():
    model, train, val = make()
    return model, train, val, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
"""


@pytest.fixture
def logits_task(tmp_path, monkeypatch):
    name = f"logits_task_{tmp_path.name.replace('-', '_')}"  # a module name no other test imported
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(LOGITS_TASK))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_train_names_the_shape_and_both_fixes_before_any_step(logits_task, capsys):
    code = main(["train", "--set", f"task.name={logits_task}:make", "--set", "train.steps=3", "--set", "device=cpu",
                 "--set", "logging.dir=null"])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = [ln for ln in err.splitlines() if "error" in ln]
    assert line.startswith("ampspec train: error: the model was called as model(*batch)"), err
    assert "Net(inputs) returned a tensor of shape (16, 3)" in line
    assert "return the loss from forward" in line and "loss_fn(model, batch)" in line and "make()" in line
    assert "Traceback" not in err


def test_the_loss_fn_fix_trains(logits_task, capsys):
    code = main(["train", "--set", f"task.name={logits_task}:make_with_loss_fn", "--set", "train.steps=2",
                 "--set", "device=cpu", "--set", "logging.dir=null", "-q"])
    assert code == 0, capsys.readouterr().err


class TakesTargetsReturnsLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, y=None):
        return self.lin(x)


def test_a_forward_that_ignores_the_targets_is_named_too():
    out = default_loss_fn(TakesTargetsReturnsLogits(), (torch.randn(5, 4), torch.zeros(5)))
    msg = bad_loss_message(out)
    assert "got a tensor of shape (5, 2)" in msg and "return the loss from forward" in msg and "loss_fn" in msg


class BrokenInside(nn.Module):
    def forward(self, x, y):
        return torch.add(x, y, "not an alpha")  # a TypeError of the model's own


def test_a_type_error_inside_a_forward_that_takes_the_batch_is_left_alone():
    with pytest.raises(TypeError) as info:
        default_loss_fn(BrokenInside(), (torch.ones(2), torch.ones(2)))
    assert "loss protocol" not in str(info.value)
