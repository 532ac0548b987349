"""The run's lifecycle contract (``torchimpl.run.state`` rules 10-11), as a state machine.

Hypothesis drives one checkpoint folder through random sequences of: train k more steps
(``--resume`` from the newest usable checkpoint, with a random log and checkpoint interval);
crash at a random step (an exception out of a callback, after which nothing is saved); leave a
torn temporary file as a kill inside a checkpoint write does; corrupt a checkpoint (a flipped
byte); resume with a configuration change that defines the run (refused); and start afresh when
nothing usable is left. After every rule:

- every checkpoint the machine did not corrupt verifies;
- a refused resume changed nothing in the folder, byte for byte;
- after a run that finished, the parameters and the trace equal those of one uninterrupted run
  of as many steps, bit for bit (CPU, one thread; bf16 autocast with a loss scaler that grows
  and backs off; a constant schedule, so ``train.steps`` changes nothing but the length).

Reproduce a failure with the printed ``@reproduce_failure`` blob:
``PYTHONPATH=. python -m pytest conformance/test_lifecycle.py``.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from torchimpl.run.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
from torchimpl.config.schema import load_config
from torchimpl.run.records import read_trace
from torchimpl.run.state import ResumeError
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer

MAX_STEPS = 24
_BASE = ["device=cpu", "task.name=mlp", "task.size=tiny", "train.batch_size=4", "precision.mode=bf16",
         "train.force_scaler=true", "scaler.init_scale=8.0", "scaler.growth_interval=2", "train.microbatches=2",
         "schedule.name=constant", "train.clip_norm=0.5", "optimizer.lr=0.01"]


class Crash(BaseException):
    """A crash at a chosen step: nothing after it runs, as after a kill."""


def _config(folder: Path, steps: int, *sets: str):
    return load_config(overrides=[*_BASE, f"train.steps={steps}", f"checkpoint.folder={folder}",
                                  f"train.trace_file={folder / 'trace.jsonl'}", *sets])


def _fit(cfg, callbacks=(), resume="latest"):
    task = build_task(cfg.task, seed=0, batch_size=cfg.train.batch_size)
    trainer = Trainer(cfg, list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(task.model, task.train_data, loss_fn=task.loss_fn, resume=resume)
    return trainer


_UNINTERRUPTED: dict[str, list] = {}


def _uninterrupted() -> dict[str, list]:
    """Parameters after every step, and the trace, of one run of MAX_STEPS steps (computed once)."""
    if not _UNINTERRUPTED:
        params = []

        class Keep(Callback):
            def on_step_end(self, trainer, state):
                params.append([p.detach().clone() for p in trainer.model.parameters()])

        with tempfile.TemporaryDirectory() as tmp:
            _fit(_config(Path(tmp), MAX_STEPS, "train.log_interval=1"), [Keep()], resume=None)
            _UNINTERRUPTED["trace"] = read_trace(Path(tmp) / "trace.jsonl")
        _UNINTERRUPTED["params"] = params
    return _UNINTERRUPTED


def _bits(ts):
    return [t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32) for t in ts]


class Lifecycle(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.folder = Path(tempfile.mkdtemp(prefix="ampspec-lifecycle-"))
        self.corrupted: set[str] = set()
        self.done = 0  # steps of the last run that finished

    def teardown(self):
        shutil.rmtree(self.folder, ignore_errors=True)

    def _usable(self) -> bool:
        return any(p.name not in self.corrupted for p in list_checkpoints(self.folder))

    def _refresh(self) -> None:
        """A corrupted file that a later save wrote over is a good checkpoint again."""
        still = set()
        for name in self.corrupted:
            try:
                verify_checkpoint(self.folder / name)
            except CheckpointError:
                still.add(name)
        self.corrupted = still

    def _snapshot(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in self.folder.iterdir() if p.is_file()}

    @precondition(lambda self: self._usable() or not list_checkpoints(self.folder))
    @rule(k=st.integers(1, 6), log_interval=st.integers(1, 4), interval=st.integers(0, 3))
    def train(self, k, log_interval, interval):
        start = _resumed_step(self.folder, self.corrupted)
        target = min(MAX_STEPS, start + k)
        t = _fit(_config(self.folder, target, f"train.log_interval={log_interval}",
                         f"checkpoint.interval={interval}"))
        self._refresh()
        assert t.state.step == target
        want = _uninterrupted()
        got = [p.detach() for p in t.model.parameters()]
        for i, (a, b) in enumerate(zip(_bits(got), _bits(want["params"][target - 1]))):
            assert torch.equal(a, b), f"after resuming to step {target}: parameter {i} differs from the uninterrupted run"
        trace = read_trace(self.folder / "trace.jsonl")
        assert [r.step for r in trace] == list(range(target)), f"trace steps {[r.step for r in trace]}"
        for got_r, want_r in zip(trace, want["trace"]):
            assert got_r.same_as(want_r), f"trace step {got_r.step}: {got_r} != uninterrupted {want_r}"
        self.done = target

    @precondition(lambda self: self._usable() or not list_checkpoints(self.folder))
    @rule(k=st.integers(1, 6), at=st.integers(0, 5), interval=st.integers(1, 2))
    def crash(self, k, at, interval):
        start = _resumed_step(self.folder, self.corrupted)

        class Die(Callback):
            def on_step_end(self, trainer, state):
                if state.step >= start + at:
                    raise Crash()

        with pytest.raises(Crash):
            _fit(_config(self.folder, min(MAX_STEPS, start + k + at + 1), f"checkpoint.interval={interval}"), [Die()])
        self._refresh()

    @precondition(lambda self: list_checkpoints(self.folder))
    @rule(data=st.data())
    def torn_write(self, data):
        # What a kill inside a write leaves: a temporary file next to the checkpoints.
        newest = list_checkpoints(self.folder)[-1]
        cut = data.draw(st.integers(0, newest.stat().st_size))
        (self.folder / f".tmp-{newest.name}-torn").write_bytes(newest.read_bytes()[:cut])

    @precondition(lambda self: list_checkpoints(self.folder))
    @rule(data=st.data())
    def corrupt(self, data):
        path = data.draw(st.sampled_from(list_checkpoints(self.folder)))
        raw = bytearray(path.read_bytes())
        raw[data.draw(st.integers(200, len(raw) - 1))] ^= 0x5A
        path.write_bytes(bytes(raw))
        self.corrupted.add(path.name)

    @precondition(lambda self: list_checkpoints(self.folder))
    @rule(change=st.sampled_from(["optimizer.name=sgd", "precision.mode=fp32", "optimizer.fused=true"]))
    def refused_change(self, change):
        before = self._snapshot()
        with pytest.raises((ResumeError, CheckpointError)):
            _fit(_config(self.folder, MAX_STEPS, change))
        assert self._snapshot() == before, "a refused resume changed the folder"

    @precondition(lambda self: list_checkpoints(self.folder) and not self._usable())
    @rule()
    def nothing_usable_is_refused_then_cleared(self):
        before = self._snapshot()
        with pytest.raises(CheckpointError, match="none of the"):
            _fit(_config(self.folder, MAX_STEPS))
        assert self._snapshot() == before, "a refused resume changed the folder"
        for p in list_checkpoints(self.folder):
            p.unlink()
        self.corrupted.clear()

    @invariant()
    def good_checkpoints_verify(self):
        if not hasattr(self, "folder"):
            return
        for p in list_checkpoints(self.folder):
            if p.name not in self.corrupted:
                verify_checkpoint(p)  # raises CheckpointError naming the file


def _resumed_step(folder: Path, corrupted: set[str]) -> int:
    """The step a resume starts from: the newest checkpoint not corrupted (rule 10)."""
    from torchimpl.run.checkpoint import load_checkpoint

    for p in reversed(list_checkpoints(folder)):
        if p.name not in corrupted:
            return int(load_checkpoint(p)["trainer"]["step"])
    return 0


Lifecycle.TestCase.settings = settings(settings.default, max_examples=max(15, settings.default.max_examples // 3),
                                       stateful_step_count=8, deadline=None)
test_lifecycle_contract_holds_over_random_runs = Lifecycle.TestCase
