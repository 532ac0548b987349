"""The replay's sampling (`audit.sampling`): deterministic for a seed; a divergence planted in a
sampled element is found and named at its index in the tensor; one outside the sample is not
claimed as checked (the step's verdict and the report say what was); found_inf and the clip's
total norm stay whole; every Nth step leaves the others out while the order rules see them all;
bad options are refused before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from audit import Audit, audit
from audit.runner import split_audit_options
from audit.sampling import MIN_ELEMENTS, Sampling, StepSample

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((64, 32), (64,), (4, 64), (4,))  # the loop's parameters, in param_groups order
FRACTION = 0.05


def _loop(steps: int = 3, plant: tuple[int, int] | None = None, inf: tuple[int, int] | None = None,
          clip_first: bool = False) -> None:
    """A GradScaler loop with AdamW (an element-wise row) and norm clipping. ``plant`` (step, flat
    index): after that step the first weight's element is moved off torch's result (an
    optimizer post hook, before the audit copies the parameters). ``inf`` (step, flat index):
    backward leaves inf in that element of the first weight's gradient (a tensor hook).
    ``clip_first``: the clip before the unscale (an order rule's error at every step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    weight = model[0].weight
    count = [0]
    if plant is not None:
        def moved(optimizer, args, kwargs):
            if count[0] == plant[0]:
                with torch.no_grad():
                    weight.view(-1)[plant[1]] += 1e-3
        opt.register_step_post_hook(moved)
    if inf is not None:
        def with_inf(grad):
            if count[0] != inf[0]:
                return grad
            grad = grad.clone()
            grad.view(-1)[inf[1]] = float("inf")
            return grad
        weight.register_hook(with_inf)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        count[0] = step
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if clip_first:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(opt)
        if not clip_first:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()


def _sample(seed: int, fraction: float = FRACTION) -> StepSample:
    plan = Sampling(1, fraction, seed).plan(SHAPES, "elements")
    assert plan is not None
    return plan


def _inside(seed: int) -> int:
    return int(_sample(seed).indices(0)[3])


def _outside(seed: int, *others: int) -> int:
    taken = set(_sample(seed).indices(0).tolist())
    for s in others:
        taken |= set(_sample(s).indices(0).tolist())
    return next(i for i in range(64 * 32 - 1, 0, -1) if i not in taken)


def _divergences(session: Audit) -> list:
    return [f for f in session.report.findings if f.rule == "replay-divergence"]


# ----------------------------------------------------------------------------- the plan


def test_the_sample_is_a_function_of_the_seed():
    a, b, c = _sample(5), _sample(5), _sample(6)
    assert a == b and all(np.array_equal(a.indices(i), b.indices(i)) for i in range(4) if not a.whole(i))
    assert not np.array_equal(a.indices(0), c.indices(0))
    ix = a.indices(0)
    assert len(ix) == int(np.ceil(FRACTION * 2048)) and len(set(ix.tolist())) == len(ix) and (np.diff(ix) > 0).all()
    # A tensor of at most MIN_ELEMENTS elements is whole; a larger one gives at least that many.
    assert a.whole(1) and a.whole(3) and a.take[2] == MIN_ELEMENTS


def test_a_sample_unpickles_to_one_object_a_process_which_draws_its_indices_once():
    """Every replayed step's job carries its sample to the replay process: each unpickles to the
    same object there, so that its indices are drawn once, not at every step."""
    import pickle

    sent = _sample(11)
    first, second = (pickle.loads(pickle.dumps(sent)) for _ in range(2))
    assert first == sent and first is second
    ix = first.indices(0)
    assert second.indices(0) is ix and np.array_equal(ix, sent.indices(0))
    assert pickle.loads(pickle.dumps(_sample(12))) is not first


def test_auto_replays_everything_up_to_the_budget_and_then_samples():
    from audit.sampling import AUTO_BUDGET, AUTO_WHOLE_BUDGET

    auto = Sampling()
    assert [auto.every_for(n) for n in (1, AUTO_WHOLE_BUDGET, AUTO_WHOLE_BUDGET + 1, 25 * AUTO_WHOLE_BUDGET)] == \
        [1, 1, 2, 25]
    assert Sampling(every=3).every_for(25 * AUTO_WHOLE_BUDGET) == 3
    assert auto.plan(((AUTO_BUDGET // 2,), (AUTO_BUDGET // 2,)), "elements") is None
    big = auto.plan(((AUTO_BUDGET,), (AUTO_BUDGET,)), "elements")
    assert big is not None and big.elements == AUTO_BUDGET
    # A row that is not element-wise (Adafactor) takes whole tensors; a registered one everything.
    tensors = auto.plan(((AUTO_BUDGET,), (AUTO_BUDGET,), (AUTO_BUDGET,)), "tensors")
    assert tensors is not None and sorted(tensors.take) == [0, 0, AUTO_BUDGET]
    assert auto.plan(((4 * AUTO_BUDGET,),), "registered") is None


# ----------------------------------------------------------------------------- the replay


@pytest.mark.parametrize("mode", ["process", "inline"])
def test_a_divergence_in_a_sampled_element_is_found_at_its_index(monkeypatch, mode):
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", mode)
    e = _inside(5)
    with audit(replay_sample=FRACTION, replay_seed=5) as session:
        _loop(plant=(1, e))
    (f,) = _divergences(session)
    assert f.step == 1 and "parameter 0" in f.message
    assert f"first at index [{e // 32}, {e % 32}]" in f.message and "sampled elements (of 2048)" in f.message


def test_a_divergence_outside_the_sample_is_not_claimed_as_checked(monkeypatch):
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")
    e = _outside(5)
    with audit(replay_sample=FRACTION, replay_seed=5) as session:
        _loop(plant=(1, e))
    assert _divergences(session) == []
    taken = _sample(5)
    for rec in session.report.steps:
        assert rec.replay.endswith(f"optimizer stage on a sample: {taken.describe()}"), rec.replay
    sm = session.report.to_dict()["replay"]["sampling"]
    assert sm["steps_sampled"] == 3 and sm["optimizer_stage"] == {"AdamW#0": f"every 1 step; {taken.describe()}"}
    # The same element is found when everything is replayed, and by a seed whose sample holds it.
    with audit(replay_sample="all") as whole:
        _loop(plant=(1, e))
    assert [f.step for f in _divergences(whole)] == [1]
    seed = next(s for s in range(100) if e in set(_sample(s).indices(0).tolist()))
    with audit(replay_sample=FRACTION, replay_seed=seed) as other:
        _loop(plant=(1, e))
    assert [f.step for f in _divergences(other)] == [1]


def test_found_inf_is_checked_over_every_gradient_when_sampling(monkeypatch):
    """An inf outside the sample, which a blind overflow check misses: the spec's check is whole."""
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")
    original = torch._amp_foreach_non_finite_check_and_unscale_

    def blind_check(grads, found_inf, inv_scale):
        original(grads, found_inf, inv_scale)
        found_inf.zero_()

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", blind_check)
    with audit(replay_sample=FRACTION, replay_seed=5) as session:
        _loop(steps=2, inf=(1, _outside(5)))
    f = _divergences(session)[0]
    assert f.step == 1 and "found_inf" in f.message and (f.expected, f.got) == (True, False)
    assert session.report.to_dict()["replay"]["sampling"]["steps_sampled"] == 2


def test_the_clip_norm_is_checked_over_every_gradient_when_sampling(monkeypatch):
    """A total norm that leaves out one element outside the sample: the spec's norm is whole."""
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")
    from torch.nn.utils import clip_grad

    original = clip_grad._get_total_norm
    outside = torch.ones(2048, dtype=torch.bool)
    outside[torch.from_numpy(np.array(_sample(5).indices(0)))] = False

    def short_norm(grads, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        grads = [g.clone() for g in grads]
        flat = grads[0].view(-1)
        flat[int(torch.argmax(flat.abs() * outside))] = 0.0
        return original(grads, norm_type, error_if_nonfinite, foreach)

    monkeypatch.setattr(clip_grad, "_get_total_norm", short_norm)
    with audit(replay_sample=FRACTION, replay_seed=5) as session:
        _loop(steps=2)
    f = _divergences(session)[0]
    assert f.step == 0 and "total norm of clip_grad_norm_" in f.message, f.message


def test_every_nth_step_leaves_the_others_out_and_the_order_rules_see_all(monkeypatch):
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "process")
    with audit(replay_every=2) as session:
        _loop(steps=5, plant=(1, _inside(0)))
    assert _divergences(session) == []  # step 1 is left out
    verdicts = [r.replay for r in session.report.steps]
    assert [v.startswith("not sampled") for v in verdicts] == [False, True, False, True, False], verdicts
    assert session.report.replay["steps_replayed"] == 3
    assert session.report.replay["sampling"]["steps_left_out"] == 2
    with audit(replay_every=2) as found:
        _loop(steps=5, plant=(2, _inside(0)))
    assert [f.step for f in _divergences(found)] == [2]
    with audit(replay_every=3) as rules:
        _loop(steps=4, clip_first=True)
    assert [f.step for f in rules.report.findings if f.rule == "clip-before-unscale"] == [0, 1, 2, 3]


def test_the_text_and_json_reports_state_the_sample(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")
    with audit(replay_every=2, replay_sample=FRACTION, replay_seed=5) as session:
        _loop(steps=3)
    text = session.report.text()
    assert ("sampling: steps every 2 steps (1 left out), optimizer stage 0.05 of the elements, seed 5; order rules "
            "complete: every call of every step, whatever the sampling") in text
    assert f"optimizer stage of AdamW#0: every 2 steps; {_sample(5).describe()}" in text
    assert "whole: found_inf and the skip, the unscale, every clipping call" in text
    data = json.loads(json.dumps(session.report.to_dict()))["replay"]["sampling"]
    assert {k: data[k] for k in ("every", "sample", "seed", "steps_left_out", "steps_sampled")} == \
        {"every": 2, "sample": FRACTION, "seed": 5, "steps_left_out": 1, "steps_sampled": 2}
    assert data["order_rules"].startswith("complete")


# ----------------------------------------------------------------------------- options


def test_the_command_takes_the_sampling_options_after_the_script_too():
    args, own = split_audit_options(["--replay-every", "4", "x", "--replay-sample=0.1", "--replay-seed", "7"])
    assert args == ["x"] and own == {"replay_every": "4", "replay_sample": "0.1", "replay_seed": "7"}


@pytest.mark.parametrize("kwargs, field", [({"replay_every": 0}, "replay_every"),
                                           ({"replay_every": 1.5}, "replay_every"),
                                           ({"replay_sample": 0.0}, "replay_sample"),
                                           ({"replay_sample": "most"}, "replay_sample"),
                                           ({"replay_seed": -1}, "replay_seed")])
def test_bad_sampling_is_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Audit(**kwargs)


@pytest.mark.parametrize("option, value, before", [("--replay-every", "0", False), ("--replay-sample", "2", False),
                                                   ("--replay-seed", "x", False), ("--replay-sample", "none", True)])
def test_bad_sampling_options_stop_the_command_before_the_script_runs(tmp_path, option, value, before):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    argv = [option, value, str(script)] if before else [str(script), option, value]
    out = subprocess.run([sys.executable, "-m", "torchimpl.cli", "audit", *argv],
                         capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         timeout=300)
    assert out.returncode == 2 and option in out.stderr and not marker.exists(), out.stderr


def test_auto_spaces_the_replayed_steps_of_a_large_optimizer(monkeypatch):
    """Past AUTO_WHOLE_BUDGET elements (lowered here to 1000: the loop's AdamW holds 2372) the
    default replays every ceil(2372 / 1000) = 3rd step, and the report says so."""
    from audit import sampling

    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")
    monkeypatch.setattr(sampling, "AUTO_WHOLE_BUDGET", 1000)
    with audit() as session:
        _loop(steps=4)
    verdicts = [r.replay.startswith("not sampled") for r in session.report.steps]
    assert verdicts == [False, True, True, False]
    sm = session.report.replay["sampling"]
    assert sm["every"] == "auto" and sm["optimizer_stage"] == {"AdamW#0": "every 3 steps; whole"}


def _elementwise() -> list[str]:
    from reference.optim import SPECS

    return sorted(n for n, row in SPECS.items() if row.elementwise)


@pytest.mark.parametrize("name", _elementwise())
def test_an_element_wise_rows_step_on_a_sample_is_the_whole_step_at_it(name):
    """What element sampling rests on: each implementation of each row the replay samples by
    element gives, on the sampled elements alone, the whole tensor's results there, bit for bit
    (parameters and every state array), from a state with non-zero moments."""
    from audit.replay import _torch_sqrt
    from reference.optim import SPECS

    spec = SPECS[name]
    cfg = spec.make_config()
    rng = np.random.default_rng(11)
    p = rng.standard_normal((24, 40)).astype(np.float32)
    g = rng.standard_normal((24, 40)).astype(np.float32)
    ix = np.sort(rng.choice(p.size, 97, replace=False))
    for impl in spec.steps:
        kwargs = {"grad_scale": None, "found_inf": 0.0} if impl in spec.kernel_scaled else {"sqrt": _torch_sqrt(impl)}
        (p1,), _, (s1,) = spec.step(impl, [p], [g], (spec.init_state(p, cfg),), cfg, **kwargs)
        (whole_p,), _, (whole_s,) = spec.step(impl, [p1], [g * np.float32(0.5)], (s1,), cfg, **kwargs)
        at = [v.reshape(-1)[ix] for v in (p1, g * np.float32(0.5))]
        state_at = spec.state_from({k: (np.asarray(v).reshape(-1)[ix] if np.shape(v) == p.shape else v)
                                    for k, v in vars(s1).items() if v is not None}, at[0], cfg)
        (some_p,), _, (some_s,) = spec.step(impl, [at[0]], [at[1]], (state_at,), cfg, **kwargs)
        assert np.array_equal(some_p.view(np.uint32), whole_p.reshape(-1)[ix].view(np.uint32)), (name, impl)
        for k, v in vars(whole_s).items():
            if isinstance(v, np.ndarray) and v.shape == p.shape:
                got = np.asarray(getattr(some_s, k))
                assert np.array_equal(got.view(np.uint32), v.reshape(-1)[ix].view(np.uint32)), (name, impl, k)


def test_a_parameter_added_between_backward_and_step_leaves_that_step_not_replayed(monkeypatch):
    """The sample was made for the parameters at the window's first copy (the clip); a group added
    before the step no longer fits it: the step's optimizer stage is not copied and the verdict says why
    (the training goes on)."""
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = nn.Parameter(torch.ones(3))
    with audit(replay_sample=FRACTION) as session:
        for step in range(3):
            opt.zero_grad()
            model(torch.ones(2, 64)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the window's first copy
            if step == 1:
                extra.grad = torch.ones(3)
                opt.add_param_group({"params": [extra]})
            opt.step()
    verdicts = [r.replay for r in session.report.steps]
    assert verdicts[1] == ("partly replayed: the optimizer's parameters changed during the step (the sample no "
                           "longer fits)"), verdicts
    assert "optimizer stage on a sample" in verdicts[0] and "optimizer stage on a sample" in verdicts[2], verdicts


@pytest.mark.parametrize("mode", ["process", "inline"])
def test_adafactor_is_sampled_by_whole_tensors_and_replays_clean(monkeypatch, mode):
    """Adafactor's factored statistics need whole tensors: a sample of a fifth of the elements
    takes whole tensors (in the seed's order), their state with them, and a correct loop
    replays clean on it."""
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", mode)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with audit(replay_sample=0.2, replay_seed=1) as session:
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(8, 32, generator=g)), torch.randn(8, 4, generator=g)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    plan = Sampling(1, 0.2, 1).plan(SHAPES, "tensors")
    assert plan is not None and 0 < plan.tensors < 4 and all(k in (0, n) for k, n in zip(plan.take, plan.sizes))
    assert session.report.findings == [] and session.report.replay["steps_replayed"] == 3
    for rec in session.report.steps:
        assert rec.replay.endswith(f"optimizer stage on a sample: {plan.describe()}"), rec.replay
