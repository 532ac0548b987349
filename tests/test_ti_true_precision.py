"""Training with the parameters held in 16 bits (``precision.mode: bf16-true`` / ``16-true``) and
each ``precision.master_weights`` option: the command line, the run summary's lost updates and
its warning, and checkpoints that resume bit for bit."""

from __future__ import annotations

import json
import re
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from torchimpl.cli.app import main
from torchimpl.config.schema import load_config
from torchimpl.config.sections import MASTER_WEIGHTS
from torchimpl.run.state import ResumeError
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Trainer
from torchimpl.train.true_precision import LOST_UPDATE_WARNING, LostUpdateWarning, cast_batch

TINY = ["device=cpu", "task.name=mlp", "task.size=tiny", "train.batch_size=8", "logging.dir=null",
        "train.threads=1"]


def train_cli(capsys, *sets: str) -> tuple[int, dict, str]:
    args = ["train"]
    for s in (*TINY, *sets):
        args += ["--set", s]
    code = main(args)
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else {}), err


@pytest.mark.parametrize("mw", MASTER_WEIGHTS)
def test_the_cli_trains_the_embedded_task_with_every_option(capsys, mw):
    code, summary, err = train_cli(capsys, "precision.mode=bf16-true", f"precision.master_weights={mw}",
                                   "train.steps=4", "train.log_interval=2")
    assert code == 0, err
    assert summary["precision_mode"] == "bf16-true" and summary["master_weights"] == mw
    assert summary["autocast_dtype"] is None and summary["steps_applied"] == 4
    assert summary["lost_updates"]["counted"] > 0 and summary["lost_updates"]["measured_steps"] > 0
    assert 0.0 <= summary["lost_update_fraction"] <= 1.0


USER_TASK = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, y):
            assert x.dtype == self.lin.weight.dtype == torch.bfloat16, (x.dtype, self.lin.weight.dtype)
            return ((self.lin(x) - y) ** 2).float().mean()

    def make():
        xs = torch.linspace(-1, 1, 64).reshape(16, 4)
        batches = [(xs[i:i + 2], xs[i:i + 2].sum(1, keepdim=True)) for i in range(0, 16, 2)]
        return Net(), batches, batches[:2]
""")


@pytest.mark.parametrize("mw", MASTER_WEIGHTS)
def test_the_cli_trains_a_users_own_task_with_every_option(capsys, tmp_path, monkeypatch, mw):
    name = f"bf16task_{mw}"
    (tmp_path / f"{name}.py").write_text(USER_TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        code, summary, err = train_cli(capsys, f"task.name={name}:make", "precision.mode=bf16-true",
                                       f"precision.master_weights={mw}", "train.steps=5", "train.log_interval=1")
    finally:
        sys.modules.pop(name, None)
    assert code == 0, err  # the model's assert: its inputs were cast to the parameters' bf16
    assert summary["master_weights"] == mw and summary["outcome"] == "completed"
    assert summary["lost_updates"]["measured_steps"] == 5


def test_none_with_a_tiny_learning_rate_loses_its_updates_and_warns_fp32_loses_none(capsys):
    code, none, err = train_cli(capsys, "precision.mode=bf16-true", "optimizer.lr=1e-7", "train.steps=3",
                                "train.log_interval=1")
    assert code == 0, err
    assert none["lost_update_fraction"] > 0.9
    assert "were lost" in err and "precision.master_weights to fp32" in err and "kahan" in err
    code, fp32, err = train_cli(capsys, "precision.mode=bf16-true", "precision.master_weights=fp32",
                                "optimizer.lr=1e-7", "train.steps=3", "train.log_interval=1")
    assert code == 0, err
    assert fp32["lost_update_fraction"] == 0.0 and fp32["lost_updates"]["counted"] > 0
    assert "were lost" not in err


def test_the_warning_comes_once_and_only_past_its_threshold():
    def fit(lr):
        cfg = load_config(overrides=TINY + ["precision.mode=bf16-true", f"optimizer.lr={lr}", "train.steps=4",
                                            "train.log_interval=1"], task_defaults=True)
        task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary = Trainer(cfg).fit(task.model, task.train_data, loss_fn=task.loss_fn)
        return summary, [w for w in caught if issubclass(w.category, LostUpdateWarning)]

    summary, caught = fit(1e-7)
    assert summary.lost_update_fraction > LOST_UPDATE_WARNING and len(caught) == 1
    summary, caught = fit(1e-2)
    assert summary.lost_update_fraction <= LOST_UPDATE_WARNING and caught == []


def test_16_true_trains_in_fp16_with_its_loss_scaler(capsys):
    code, summary, err = train_cli(capsys, "precision=16-true", "precision.master_weights=fp32", "train.steps=3")
    assert code == 0, err
    assert summary["precision_mode"] == "fp16-true" and summary["use_scaler"] is True
    assert summary["final_scale"] is not None and "Lightning" in summary["precision_note"]


def test_batches_are_cast_as_lightning_casts_them():
    batch = {"x": torch.ones(2, dtype=torch.float32), "ids": torch.arange(2), "pair": (torch.zeros(1), "name")}
    out = cast_batch(batch, torch.bfloat16)
    assert out["x"].dtype == torch.bfloat16 and out["ids"].dtype == torch.int64
    assert out["pair"][0].dtype == torch.bfloat16 and out["pair"][1] == "name"


# ---------------------------------------------------------------- checkpoints


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 1)

    def forward(self, x, y):
        return ((self.b(torch.tanh(self.a(x))) - y) ** 2).float().mean()


def _data():
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(40, 6, generator=g)
    return [(xs[i:i + 4], xs[i:i + 4, :1] * 0.5) for i in range(0, 40, 4)]


def _run(folder, mw, steps, *, resume=False, lr=1e-3):
    cfg = load_config(overrides=["device=cpu", "precision.mode=bf16-true", f"precision.master_weights={mw}",
                                 f"train.steps={steps}", "train.log_interval=1", f"optimizer.lr={lr}", "schedule.name=constant",
                                 f"checkpoint.folder={folder}", "logging.dir=null", "train.threads=1"])
    torch.manual_seed(0)
    trainer = Trainer(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LostUpdateWarning)
        summary = trainer.fit(_Net(), _data(), resume="latest" if resume else None)
    return trainer, summary


def _state(trainer) -> dict:
    master = trainer._fit.master.master.state_dict()
    return {"params": {k: v.clone() for k, v in trainer.model.state_dict().items()}, "master": master}


def _assert_bitwise(a, b, where=""):
    if isinstance(a, torch.Tensor):
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits)), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("mw", MASTER_WEIGHTS)
def test_a_resumed_run_equals_the_straight_run_bit_for_bit(tmp_path, mw):
    straight, s1 = _run(tmp_path / "a", mw, 6)
    _run(tmp_path / "b", mw, 3)
    resumed, s2 = _run(tmp_path / "b", mw, 6, resume=True)
    _assert_bitwise(_state(straight), _state(resumed), mw)
    assert s1.lost_updates == s2.lost_updates  # the counts are carried by the checkpoint
    held = {"fp32": "masters", "kahan": "compensation", "stochastic": "generator"}.get(mw)
    if held:
        assert _state(straight)["master"][held] is not None


def test_changing_the_option_across_a_resume_is_refused_naming_the_field(tmp_path):
    _run(tmp_path, "kahan", 2)
    with pytest.raises(ResumeError, match=r"precision\.master_weights: 'kahan' \(checkpoint\) -> 'fp32' \(now\)"):
        _run(tmp_path, "fp32", 4, resume=True)


# ---------------------------------------------------------------- the doctor and the replay


def doctor_cli(capsys, mw: str) -> str:
    code = main(["doctor", "--task", "mlp", "--size", "tiny", "--precision", "bf16-true", "--master-weights", mw,
                 "--lr", "1e-7", "--steps", "2", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_the_doctor_finds_the_lost_updates_of_none_and_names_the_key_and_none_under_fp32(capsys):
    out = doctor_cli(capsys, "none")
    assert "update-underflow" in out and "100.0% of the updates of 'net.0.weight' (bfloat16) were lost" in out
    assert "fix: set precision.master_weights to fp32" in out
    out = doctor_cli(capsys, "fp32")
    # The float32 master keeps the updates; what is left is where the bf16 gradient itself was 0.
    largest = float(re.search(r"lost updates \(rule 12\): largest ([0-9.]+)%", out).group(1))
    assert "update-underflow" not in out and largest < 1.0


def test_the_doctor_refuses_master_weights_outside_bf16_true(capsys):
    assert main(["doctor", "--task", "mlp", "--precision", "bf16", "--master-weights", "fp32"]) != 0
    assert "--master-weights fp32 applies to --precision bf16-true" in capsys.readouterr().err


def test_a_16_true_trace_replays_through_the_spec(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    # The gradient of an fp16 loss is the scale itself: 2**19 down to 2**16 pass fp16's 65504 and
    # back off; from 2**15 the steps apply.
    code, summary, err = train_cli(capsys, "precision=16-true", "precision.master_weights=kahan", "train.steps=8",
                                   f"scaler.init_scale={2.0**19}", f"train.trace_file={trace}")
    assert code == 0, err
    assert summary["steps_skipped"] == 4 and summary["final_scale"] == 2.0**15
    assert main(["replay", str(trace)]) == 0
    assert "8 steps replayed: the scale history matches the reference" in capsys.readouterr().out
