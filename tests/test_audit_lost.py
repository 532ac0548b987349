"""``update-lost-to-rounding``: a model held in bfloat16, its lost updates counted by the replay.

The catalogue (tests/test_audit_catalogue.py) holds the planted loop (a bf16 AdamW at lr 1e-5:
a warning per parameter at step 9) and the correct one (a float32 master copy: no finding).
Here: the counts against torch's own float32 step, the sampled replay, the stochastic-rounding
optimizer's truth and its envelope, a bf16 model whose updates land, and the windows' bookkeeping.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from audit.checks_numbers import LOST_FRACTION, LOST_WINDOW, update_lost_to_rounding
from audit.lost import LostBook, events
from audit.runner import run_script
from reference import lowprec

LOOPS = Path(__file__).resolve().parent / "audit_loops"
LOOP = LOOPS / "lowprec_loop.py"
BUG = ["--bug", "update-lost-to-rounding"]
COUNTED = re.compile(r"were lost, (\d+) of (\d+) element updates")


@pytest.fixture(autouse=True)
def _restore_threads():
    """The loops run on one thread (tests/audit_loops/_common.py); the rest of the suite keeps its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _torch_counts(lr: float, steps: int) -> list[tuple[int, int]]:
    """The planted loop's first window, counted with torch alone: at each step a float32 twin of
    every parameter, gradient and AdamW state steps beside the bf16 optimizer; an element's
    update is lost when its twin moved and its bf16 bits did not. (lost, counted) per parameter."""
    sys.path.insert(0, str(LOOPS))
    try:
        from _common import batches, make_model
    finally:
        sys.path.remove(str(LOOPS))
    model = make_model().to(torch.bfloat16)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    counts = [(0, 0)] * len(params)
    for x, y in batches(steps):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        twins = [p.detach().float() for p in params]
        twin_opt = torch.optim.AdamW(twins, lr=lr, weight_decay=0.01)
        for t, p in zip(twins, params):
            t.grad = p.grad.float()
            if p in opt.state:
                twin_opt.state[t] = {k: v.float().clone() for k, v in opt.state[p].items()}
        twin_opt.step()
        before = [p.detach().clone() for p in params]
        opt.step()
        for i, (b, p, t) in enumerate(zip(before, params, twins)):
            exact = t.double() - b.double()
            moved = torch.isfinite(exact) & (exact != 0)
            same = b.view(torch.int16) == p.detach().view(torch.int16)
            counts[i] = (counts[i][0] + int((moved & same).sum()), counts[i][1] + int(moved.sum()))
    return counts


def test_the_lost_fraction_is_the_one_torch_in_float32_gives():
    """Each parameter's finding states the first window's counts: equal to those torch's own float32
    AdamW step gives beside the bf16 one (the spec's float32 step, from torch's widened inputs, is
    the exact update)."""
    report = run_script(LOOP, [*BUG, "--steps", str(LOST_WINDOW)])
    assert report.error is None and {f.rule for f in report.findings} == {"update-lost-to-rounding"}, report.text()
    got = [tuple(int(n) for n in COUNTED.search(f.message).groups()) for f in report.findings]
    assert got == _torch_counts(1e-5, LOST_WINDOW)
    assert [f.message.split(" (bfloat16")[0] for f in report.findings] == [
        f"AdamW#0's parameter {n}" for n in ("0.weight", "0.bias", "2.weight", "2.bias")]
    for f, (lost, counted) in zip(report.findings, got):
        assert f.got == round(lost / counted, 6) and lost > LOST_FRACTION * counted
        assert "precision.master_weights" in RULE_FIX and f.step == LOST_WINDOW - 1
    # The run's totals are in the report's replay summary, one entry per parameter.
    summary = report.replay["lost_updates"]
    assert [(v["lost"], v["counted"]) for v in summary.values()] == got
    assert "lost updates over the run" in report.text()


RULE_FIX = update_lost_to_rounding.rule.fix


def test_a_bf16_model_whose_updates_mostly_land_gives_no_finding():
    """lr 1e-2: most updates exceed half a bf16 gap. The steps are measured and the fraction stays
    under the threshold; the optimizer stage is compared (`reference.lowprec`) on the CPU kernels
    the specification states, else left partly replayed with the reason."""
    report = run_script(LOOP, ["--keep", "none", "--lr", "1e-2", "--steps", "12"])
    assert report.error is None and report.findings == [], report.text()
    if torch.backends.cpu.get_cpu_capability() in lowprec.KERNELS:
        assert not report.replay["not_replayed"], report.replay["not_replayed"]
    else:
        reason = next(iter(report.replay["not_replayed"]))
        assert reason.startswith("bfloat16 parameters") and "lost updates are counted" in reason
    summary = report.replay["lost_updates"]
    assert len(summary) == 4 and all(0 < v["counted"] and v["fraction"] <= LOST_FRACTION for v in summary.values())


def test_a_sampled_replay_counts_over_its_sample_and_says_so():
    """--replay-sample 0.1: the two weights (512 and 128 elements) are sampled to 64 elements each, the
    biases (under 64) taken whole; the findings of the weights state the sample, and each count is
    over the elements taken at each of the 10 steps."""
    report = run_script(LOOP, [*BUG, "--steps", "12"], replay_sample=0.1)
    assert [f.rule for f in report.findings] == ["update-lost-to-rounding"] * 4, report.text()
    said = [re.search(r"\(the replay's sample: ([^)]*)\)", f.message) for f in report.findings]
    assert [s.group(1) if s else None for s in said] == [
        "64 of 512 elements, seed 0", None, "64 of 128 elements, seed 0", None]
    counted = [int(COUNTED.search(f.message).group(2)) for f in report.findings]
    assert counted[0] <= 640 and counted[2] <= 640 and counted[1] <= 320 and counted[3] <= 40


@pytest.mark.parametrize("lr", ["1e-5", "1e-2"])
def test_a_stochastic_rounding_optimizer_is_checked_by_envelope_and_gives_no_finding(lr):
    """torchao's _AdamW(bf16_stochastic_round=True): its random bits are not observable, so each step
    is checked by envelope (every weight one of the two bf16 neighbours of the float32 step's
    result, the state within 1 ULP), and an update below the gap is kept in expectation: no
    lost-update finding, at a tiny and at a large learning rate."""
    pytest.importorskip("torchao.optim", reason="torchao is an extra: pip install torchao")
    report = run_script(LOOP, ["--keep", "stochastic", "--lr", lr, "--steps", "12"])
    assert report.error is None and report.findings == [], report.text()
    assert report.replay["steps_replayed"] == 12 and report.replay["not_replayed"] == {}, report.replay
    assert all(r.replay.startswith("within the envelope of stochastic rounding") for r in report.steps)
    assert report.replay["steps_bit_exact"] == 0 and report.replay["lost_updates"] == {}


def test_a_weight_outside_the_stochastic_rounding_envelope_diverges():
    """A step hook scaling the first weight by 1.05 after each torchao step: outside the envelope at
    the first step (a warning: the hook is the loop's own)."""
    pytest.importorskip("torchao.optim", reason="torchao is an extra: pip install torchao")
    report = run_script(LOOP, ["--keep", "stochastic", "--bug", "parameters-altered", "--steps", "4"])
    assert [(f.rule, f.step, f.severity) for f in report.findings] == [("replay-divergence", 0, "warning")], \
        report.text()
    assert "neither bfloat16 neighbour of the float32 step's result" in report.findings[0].message


def test_the_envelope_takes_both_neighbours_and_nothing_further():
    """Rule 7 of reference.master_weights with every bit pattern's two outcomes: inside; the stored
    weight unchanged under an update of several gaps, two gaps off, or the wrong sign: outside."""
    import ml_dtypes

    from audit.lost import stochastic_envelope
    from reference.master_weights import stochastic_round_bf16

    rng = np.random.default_rng(0)
    before = rng.normal(0, 0.1, 4096).astype(ml_dtypes.bfloat16)
    u = (rng.normal(0, 1e-4, 4096)).astype(np.float32)
    q = (before.astype(np.float32) + u).astype(np.float32)
    for bits in (np.zeros(4096, np.int64), np.full(4096, 0xFFFF, np.int64), rng.integers(0, 1 << 16, 4096)):
        assert stochastic_envelope(stochastic_round_bf16(q, bits), q, before, u).size == 0
    gap = np.spacing(np.abs(q).astype(ml_dtypes.bfloat16)).astype(np.float32)
    big = (before.astype(np.float32) + 4 * gap * np.sign(u)).astype(np.float32)  # an update of 4 gaps ...
    assert stochastic_envelope(before, big, before, big - before.astype(np.float32)).size == 4096  # ... lost
    shifted = (q + 2.5 * gap).astype(ml_dtypes.bfloat16)
    assert stochastic_envelope(shifted, q, before, u).size == 4096
    far = q[np.abs(q) > 1e-2]
    assert stochastic_envelope((-far).astype(ml_dtypes.bfloat16), far, far.astype(ml_dtypes.bfloat16),
                               np.zeros_like(far)).size == far.size


def test_the_windows_close_every_few_steps_and_the_last_may_be_shorter():
    """25 measured steps: windows of 10, 10 and 5; each event holds its steps and the run's totals."""
    book = LostBook()
    before = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    after = np.array([1.0, 2.5, 3.0, 4.0], np.float32)  # the second element moved
    exact = np.array([1e-9, 0.5, 0.0, 1e-9])  # the third had no update: not counted
    for step in range(25):
        book.add("AdamW#0", 0, step, "loop.py:9", before, after, exact, (4,), None)
        book.step_done("AdamW#0")
    evs = events(book, {"AdamW#0": ["w"]})
    assert [(e.steps[0], e.steps[-1], e.step, e.lost, e.counted) for e in evs] == [
        (0, 9, 9, 20, 30), (10, 19, 19, 20, 30), (20, 24, 24, 10, 15)]
    assert {(e.run_lost, e.run_counted, e.parameter) for e in evs} == {(50, 75, "w")}
    assert [f.step for e in evs for f in update_lost_to_rounding(e)] == [9, 19, 24]
    # A parameter the recorder could not name is named by its index.
    assert events(book, {})[0].parameter == "0"


def _replay_cases(cases: list[list[str]], capability: str | None, prelude: str = "") -> list:
    """The planted loop under ``cases`` in a fresh process on ``capability`` (None: the machine's
    own kernels), after ``prelude`` (Python run first): per case [exit status, steps bit exact,
    each step's replay, finding rules, divergence texts]."""
    code = (
        prelude + "import json, sys\nfrom audit.runner import run_script\nout = []\n"
        "for args in json.loads(sys.argv[2]):\n"
        "    r = run_script(sys.argv[1], args)\n"
        "    out.append([r.exit_status, r.replay['steps_bit_exact'], [s.replay for s in r.steps],\n"
        "                [f.rule for f in r.findings], [str(f.message) for f in r.findings]])\n"
        "print(json.dumps(out))\n")
    root = LOOPS.parent.parent
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["PYTHONPATH"] = str(root)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    r = subprocess.run([sys.executable, "-c", code, str(LOOP), json.dumps(cases)], env=env, capture_output=True,
                       text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


PLAIN = ["--keep", "none", "--steps", "6", "--lr", "1e-2"]
CASES = [[*PLAIN, "--impl", impl] for impl in ("for-loop", "foreach", "fused")]
CASES += [[*PLAIN, "--skip-rounding"], [*PLAIN, "--optimizer", "nadam", "--impl", "foreach"],
          [*PLAIN, "--optimizer", "adafactor", "--impl", "foreach"], [*PLAIN, "--optimizer", "adagrad", "--impl", "fused"],
          [*PLAIN, "--optimizer", "sgd", "--impl", "fused"],
          [*PLAIN, "--optimizer", "sgd", "--impl", "fused", "--momentum", "0.9"]]


@pytest.mark.parametrize("capability", ["default", "avx2", None], ids=["scalar-kernels", "avx2-kernels",
                                                                        "native-kernels"])
def test_a_pure_bf16_adamw_loop_is_replayed_and_a_skipped_rounding_diverges(capability):
    """The optimizer stage of bf16 parameters stepped by torch itself is compared through
    `reference.lowprec`, on torch's scalar kernels, AVX2's and the machine's own (rule 13): every step
    of the plain bf16 AdamW loop (for-loop, foreach, fused) is replayed with no divergence (bit
    for bit, the fused path on native kernels within ``FUSED_NATIVE_ULPS``); the loop whose step
    is computed in float32 and rounded once (``--skip-rounding``, the op-by-op roundings
    skipped) diverges at every step. The foreach NAdam loop is replayed bit for bit too (the
    audit reads the specification's coverage, `reference.lowprec.covered`), and so is the foreach
    Adafactor loop (rule 16: its factored and unfactored moments, norms and rsqrt). Fused Adagrad and fused SGD are replayed bit for bit on both (rule 15): the fused
    SGD kernel never stores the weights of its vector loop, so the three parameters of 32 elements
    or more keep every weight and the audit finds their updates lost (the 4-element bias, all
    tail, learns); with momentum the stage is partly replayed, naming the setting."""
    if capability == "avx2" and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this machine has no AVX2 kernels to run")
    native = capability == "avx2" or (capability is None and torch.backends.cpu.get_cpu_capability() != "DEFAULT")
    out = _replay_cases(CASES, capability)
    for args, (status, exact, per_step, rules, _) in zip(CASES[:3], out[:3]):
        assert status == 0 and rules == [] and len(per_step) == 6, (args, per_step, rules)
        assert not [s for s in per_step if s.startswith(("diverged", "partly", "not"))], (args, per_step)
        if not (native and "fused" in args):
            assert exact == 6, (args, per_step)
    status, _, per_step, rules, messages = out[3]
    # the mutated loop's own float32 AdamW steps are replayed too (bit for bit); each bf16 step diverges
    assert [s for s in per_step if s.startswith("diverged")] == ["diverged: parameter 0"] * 6, per_step
    assert "replay-divergence" in rules
    status, exact, per_step, rules, _ = out[4]
    assert status == 0 and rules == [] and exact == 6, (per_step, rules)
    status, exact, per_step, rules, _ = out[5]
    assert status == 0 and rules == [] and exact == 6, ("foreach Adafactor", per_step, rules)
    status, exact, per_step, rules, _ = out[6]
    assert status == 0 and rules == [] and exact == 6, ("fused Adagrad", per_step, rules)
    status, exact, per_step, rules, messages = out[7]
    assert status == 0 and exact == 6 and rules == ["update-lost-to-rounding"] * 3, ("fused SGD", per_step, rules)
    assert [m.split(" (")[0] for m in messages] == [f"SGD#0's parameter {p}" for p in ("0.weight", "0.bias", "2.weight")]
    assert all("100.0% of its updates" in m for m in messages), messages
    _, exact, per_step, rules, _ = out[8]
    assert exact == 0 and set(per_step) == {
        "partly replayed: bfloat16 parameters: the specification does not model torch's SGD (fused) on "
        "low-precision parameters with " + lowprec.refused("SGD", "fused", SimpleNamespace(momentum=0.9))}


def test_a_pair_the_specification_does_not_model_leaves_the_stage_partly_replayed_naming_it():
    """A pair `reference.lowprec` does not cover (here foreach Adafactor, its entry taken out of
    ``COVERED`` in the audited process, as a pair a later torch adds would be): the optimizer stage
    is not compared, the reason names the pair, the lost updates are still counted."""
    prelude = "from reference import lowprec\nlowprec.COVERED['Adafactor'] = ('for-loop',)\n"
    (status, exact, per_step, rules, _), = _replay_cases(
        [[*PLAIN, "--steps", "2", "--optimizer", "adafactor", "--impl", "foreach"]], "default", prelude)
    assert status == 0 and exact == 0 and rules == [] and set(per_step) == {
        "partly replayed: bfloat16 parameters: the optimizer stage is not compared (torch's Adafactor (foreach) on "
        "bfloat16 tensors is not modelled); its lost updates are counted (update-lost-to-rounding)"}, per_step


def test_a_capability_the_specification_does_not_state_leaves_the_stage_partly_replayed_naming_it():
    """A capability `reference.lowprec` does not state on 16-bit tensors (rule 13; here AVX2 with
    its entry taken out of ``KERNELS`` in the audited process, as a capability of another machine
    would be): the optimizer stage is not compared, the reason names the capability, the lost
    updates are still counted."""
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this machine has no AVX2 kernels to run")
    prelude = "from reference import lowprec\ndel lowprec.KERNELS['AVX2']\n"
    (status, exact, per_step, rules, _), = _replay_cases([[*PLAIN, "--steps", "2"]], "avx2", prelude)
    want = ("partly replayed: bfloat16 parameters: the optimizer stage is not compared (AVX2 kernels: the "
            "specification states torch's kernels on bfloat16 tensors for DEFAULT, AVX512 only)")
    assert status == 0 and exact == 0 and all(s.startswith(want) for s in per_step), per_step
