"""The trainer with ``train.compile: true`` against the spec, step by step, and its resume.

``train.compile`` compiles the module the microbatches call (``torch.compile``, Inductor on the
CPU); the loss function, the scaled backward's seed, the accumulation, unscaling, the inf/NaN
check, clipping, the optimizer, the loss scaler and the schedule stay eager. So:

1. Lockstep (property 5 of ``conformance/test_trainer.py`` with ``compile: true``): every
   step's accumulated scaled gradients equal the spec's accumulation
   (``reference.step.accumulate_gradients``) of the per-microbatch gradients of the spec's
   expression ``(loss / k) * scale``, differentiated by autograd through the trainer's own
   compiled module (``trainer.engine.model``, same parameters, batches and RNG state: Inductor
   draws its dropout seeds from torch's default generator); from there on the optimizer-visible
   gradients, the parameters and every ``StepRecord`` field equal ``reference.step.train_step``'s
   bit for bit, resumes included. What compiling the module changes against eager (a fused
   chain that keeps bf16 intermediates in float32, a reordered reduction, a different dropout
   stream) is the subject of the spec's compile rules, not of this property: on the embedded
   tasks a compiled module's gradients are not eager's (measured, torch 2.13 CPU: the ``lm``
   task in fp32 has an equal loss and 85 % of its gradient elements differ; ``mlp``'s dropout
   draws other bits).
2. Resume: N steps straight and k steps, a checkpoint, a new process's worth of compiling
   (``torch._dynamo.reset()``), then N - k steps end with the same parameters, optimizer state,
   loss scale and trace records, bit for bit.
3. Compiles counted: a run compiles its training graph once, however the loss scale moves and
   whichever steps are skipped (the scale multiplies the loss outside the compiled module), and
   once more for evaluation (``model.eval()`` is a guard: dropout off); no graph break.

Exactness as in property 5: CPU, one thread, ATen's kernels pinned (``ATEN_CPU_CAPABILITY=default``,
a child process when the machine's kernels are native). Inductor reads that variable too, and
on torch 2.13 its scalar (non-vectorised) C++ for bf16 conversions does not build
(``at::vec::convert<at::BFloat16,1,float,2>``: a C++ compile error); so the child pins Inductor's
own vector width (``torch._inductor.config.cpp.simdlen``) to the machine's. Inductor compiles
with ``-ffp-contract=off`` and the lockstep differentiates through the same kernels, so the
vector width changes nothing that is compared.

Compiling costs seconds per run (a cold first compile about 7.5 s on 2 shared cores), so the
``ci`` profile draws 3 cases on top of the 3 explicit ones (fp32, bf16, fp16 with a scaler),
``thorough`` 78. Inductor's cache lives outside the checkout (``TORCHINDUCTOR_CACHE_DIR``,
default ``<tmp>/ampspec-inductor-<user>``) and persists between runs. All tests here carry the
marker ``compile``: ``pytest conformance -m compile``.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings

from conformance import strategies
from conformance import test_trainer as lockstep
from conformance.assertions import Where, assert_equal, assert_same_list
from conformance.bridge import to_numpy
from torchimpl.config.schema import Config
from torchimpl.run.records import FIELDS as RECORD_FIELDS
from torchimpl.run.records import read_trace
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer

pytestmark = pytest.mark.compile

REPRO = ("ATEN_CPU_CAPABILITY=default PYTHONPATH=. python -m pytest -m compile conformance/test_compile_trainer.py "
         "with the @reproduce_failure blob printed above")
_CHILD_ENV = "AMPSPEC_COMPILE_TRAINER_CHILD"
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache_dir() -> str:
    """Inductor's persistent cache: the caller's ``TORCHINDUCTOR_CACHE_DIR``, else one per user in
    the temporary folder (never the checkout: tests leave no files there)."""
    return os.environ.get(CACHE_ENV) or str(Path(tempfile.gettempdir()) / f"ampspec-inductor-{getpass.getuser()}")


def _pin_inductor_vector_width() -> None:
    """Inductor's C++ at the machine's own vector width while ATen's kernels are pinned (see the
    module docstring: the scalar bf16 code does not build on torch 2.13)."""
    # imported here: Inductor's modules load only where a test compiles
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    isas = valid_vec_isa_list()
    if isas and inductor_config.cpp.simdlen is None:
        inductor_config.cpp.simdlen = isas[0].bit_width()


def _in_exact_child(test_id: str) -> bool:
    """Run ``test_id`` in a child with ATen's kernels pinned unless this process is that child
    (or already pinned); True when the caller should run the test body itself."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT" or os.environ.get(_CHILD_ENV):
        _pin_inductor_vector_width()
        return True
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", OMP_NUM_THREADS="1", **{_CHILD_ENV: "1"})
    env[CACHE_ENV] = inductor_cache_dir()
    env["AMPSPEC_HYPOTHESIS_PROFILE"] = settings._current_profile
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:logging", "-m", "compile",
         f"{Path(__file__).resolve()}::{test_id}"],
        cwd=root, env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, (
        f"{test_id} failed in the exact mode (ATEN_CPU_CAPABILITY=default); child output:\n"
        + proc.stdout[-12000:] + proc.stderr[-3000:]
    )
    return False


@pytest.fixture(autouse=True)
def _inductor_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, inductor_cache_dir())


# ----------------------------------------------------------------------------- 1. lockstep

_ADAMW = dict(name="adamw", lr=0.01, weight_decay=0.01, no_decay_bias_and_norm=True)
_EXAMPLES = [
    # fp32, the MLP with dropout (Inductor's own random stream), clipping, resume between steps
    dict(task="mlp", precision="fp32", force_scaler=False, steps=4, microbatches=2, batches_per_epoch=5,
         clip_norm=0.5, scaler=dict(preset="torch", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                                    growth_interval=2),
         optimizer=_ADAMW, schedule=dict(name="cosine", warmup_steps=1, min_lr_ratio=0.1, decay_steps=None),
         faults={}, resume=("step", 2), seed=0, compile=True),
    # bf16 autocast, the transformer, a NaN gradient skipped, resume inside a window
    dict(task="lm", precision="bf16", force_scaler=False, steps=4, microbatches=2, batches_per_epoch=5,
         clip_norm=1.0, scaler=dict(preset="torch", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                                    growth_interval=2),
         optimizer=_ADAMW, schedule=dict(name="constant", warmup_steps=1, min_lr_ratio=0.1, decay_steps=None),
         faults={2: ("hook", float("nan"))}, resume=("microbatch", 2, 1), seed=1, compile=True),
    # fp16 with the loss scaler (fp32 compute on the CPU): the scale grows every step and backs
    # off at a planted inf input, resume after the skip
    dict(task="mlp", precision="fp16", force_scaler=True, steps=5, microbatches=1, batches_per_epoch=6,
         clip_norm=None, scaler=dict(preset="torch", init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5,
                                     growth_interval=1),
         optimizer=dict(name="sgd", lr=0.1, weight_decay=0.0, momentum=0.9, nesterov=False,
                        no_decay_bias_and_norm=False),
         schedule=dict(name="constant", warmup_steps=0, min_lr_ratio=0.1, decay_steps=None),
         faults={1: ("data", float("inf"))}, resume=("step", 3), seed=2, compile=True),
]


def _lockstep_property() -> None:
    @settings(max_examples=max(3, settings.default.max_examples // 16))
    @given(case=strategies.trainer_case())
    def check(case):
        torch._dynamo.reset()  # each case compiles as a fresh process would
        lockstep.run_case(dict(case, compile=True), "cpu")

    for ex in _EXAMPLES:
        check = example(case=ex)(check)
    check()


def test_compiled_trainer_matches_the_spec(device):
    if device != "cpu":
        pytest.skip("the end-to-end bit comparison needs pinned arithmetic (CPU, ATEN_CPU_CAPABILITY=default)")
    if _in_exact_child("test_compiled_trainer_matches_the_spec[cpu]"):
        _lockstep_property()


# ----------------------------------------------------------------------------- 2. resume, 3. compiles


class _Compiles(Callback):
    """Torch's own counters at the end of a fit (frames compiled, graph breaks); with
    ``stop_at``, a checkpoint after that step and the run stopped there."""

    def __init__(self, stop_at: int | None):
        self.stop_at = stop_at

    def on_step_end(self, trainer, st):
        if st.step == self.stop_at:
            trainer.save_checkpoint()
            trainer.request_stop("resume point")

    def on_fit_end(self, trainer, summary):
        # imported here: torch._dynamo loads only where a test compiles
        from torch._dynamo.utils import counters

        self.frames = counters["frames"]["ok"]
        self.graph_breaks = sum(counters["graph_break"].values())


def _run(precision: str, steps: int, folder: Path, *, resume: bool = False, stop_at: int | None = None):
    """One compiled run of the MLP (dropout on) with a loss scaler whose scale grows every step
    and an inf input at microbatch 3 (a skipped step); evaluation every 2 steps."""
    cfg = Config.from_dict(dict(
        device="cpu", task=dict(name="mlp", size="tiny"), precision=dict(mode=precision),
        scaler=dict(init_scale=2.0**10, growth_interval=1),
        train=dict(steps=steps, microbatches=2, batch_size=4, seed=3, compile=True, force_scaler=True,
                   eval_interval=2, trace_file=str(folder / "trace.jsonl"), on_nonfinite="skip"),
        checkpoint=dict(folder=str(folder / "ckpt")),
    ))
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    data = lockstep.FaultyBatches(task.train_data, 7, {3: float("inf")})
    torch._dynamo.reset()  # a new process: nothing compiled yet
    torch._dynamo.utils.counters.clear()
    compiles = _Compiles(stop_at)
    trainer = Trainer(cfg, callbacks=[compiles])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fp16 downgrade warns by design
        summary = trainer.fit(task.model, data, task.val_data, resume="latest" if resume else None)
    return trainer, summary, compiles


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_compiled_trainer_resumes_bit_for_bit(precision, tmp_path):
    if not _in_exact_child(f"test_compiled_trainer_resumes_bit_for_bit[{precision}]"):
        return
    n, k = 6, 3
    straight, s_sum, s_compiles = _run(precision, n, tmp_path / "straight")
    assert s_sum.outcome == "completed" and s_sum.steps_skipped >= 1, (s_sum.outcome, s_sum.steps_skipped)
    _run(precision, n, tmp_path / "split", stop_at=k)
    resumed, r_sum, r_compiles = _run(precision, n, tmp_path / "split", resume=True)
    where = Where(f"compiled trainer [{precision}]", n, "parameters", "ATEN_CPU_CAPABILITY=default PYTHONPATH=. "
                  f"python -m pytest -m compile 'conformance/test_compile_trainer.py::"
                  f"test_compiled_trainer_resumes_bit_for_bit[{precision}]'")
    assert_same_list([to_numpy(p) for p in resumed.params], [to_numpy(p) for p in straight.params], where)
    a, b = resumed.optimizer.state_dict()["state"], straight.optimizer.state_dict()["state"]
    for i in sorted(b):
        for name, value in b[i].items():
            assert_same_list([to_numpy(torch.as_tensor(a[i][name]))], [to_numpy(torch.as_tensor(value))],
                             where.at(f"optimizer state[{i}].{name}"))
    assert_equal(float(resumed.scaler._scale), float(straight.scaler._scale), where.at("loss scale"))
    left, right = read_trace(tmp_path / "split" / "trace.jsonl"), read_trace(tmp_path / "straight" / "trace.jsonl")
    assert_equal(len(left), len(right), where.at("trace records"))
    for x, y in zip(left, right):
        for name in RECORD_FIELDS:
            assert_equal(getattr(x, name), getattr(y, name), where.at(f"record.{name}", y.step))
    # 3: the scale moved every applied step and one step was skipped: still one training graph
    # and one evaluation graph, in the straight run and in the resumed process alike.
    for run, compiles in (("straight", s_compiles), ("resumed", r_compiles)):
        assert_equal(compiles.frames, 2, where.at(f"frames compiled ({run}: training and evaluation)"))
        assert_equal(compiles.graph_breaks, 0, where.at(f"graph breaks ({run})"))
    scales = {r.scale_before for r in right}
    assert len(scales) >= 3, f"the scale should have moved: {sorted(scales)}"
