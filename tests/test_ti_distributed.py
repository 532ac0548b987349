"""torchimpl.distributed: the single-process helpers, then a 2-rank gloo group (conformance.multiproc).

Every multi-rank job runs on the same two ranks, kept up for the module: training and resuming
bit for bit (at a window boundary and inside an accumulation window), the collective count of a
DDP window, rank 0's outputs, and the failures (mismatched configurations, a hanging rank).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings

import pytest
import torch

from conformance.multiproc import rank_group
from torchimpl.run.checkpoint import CheckpointError
from torchimpl.config.schema import ConfigError, load_config
from torchimpl.distributed import (
    DistributedError,
    ReductionSettings,
    ShardedData,
    config_differences,
    init_distributed,
    rank_seed,
    reduction_problems,
    reduction_settings,
    shard_data,
)
from torchimpl.task.builtin import SyntheticBatches

WORLD = 2
WAIT_S = 120.0


# ---------------------------------------------------------------- single process


def test_config_field_is_validated():
    with pytest.raises(ConfigError, match="train.distributed: must be one of 'none', 'ddp', 'fsdp2'"):
        load_config(overrides=["train.distributed=horovod"])
    with pytest.raises(ConfigError, match="distributed_timeout_s"):
        load_config(overrides=["train.distributed_timeout_s=0"])


def test_reduce_dtype_is_validated_and_refused_where_torch_cannot_run_it():
    with pytest.raises(ConfigError, match="train.reduce_dtype: must be one of 'fp32', 'bf16', got 'fp16'"):
        load_config(overrides=["train.reduce_dtype=fp16", "train.distributed=fsdp2"])
    with pytest.raises(ConfigError, match="train.reduce_dtype: 'bf16' sets the dtype .* distributed='none'"):
        load_config(overrides=["train.reduce_dtype=bf16"])
    with pytest.raises(ConfigError, match="train.reduce_dtype: 'bf16' under distributed='ddp' is torch's "
                                          "bf16_compress_hook, which torch runs only on CUDA"):
        load_config(overrides=["train.reduce_dtype=bf16", "train.distributed=ddp", "device=cpu"])
    assert load_config(overrides=["train.reduce_dtype=bf16", "train.distributed=fsdp2", "device=cpu"]).train.reduce_dtype == "bf16"
    assert load_config().train.reduce_dtype == "fp32"


def test_reduction_problems_follow_torchs_own_check():
    bf16 = ReductionSettings("bf16")
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    # DistributedDataParallel._check_comm_hook: bf16_compress_hook needs CUDA and NCCL >= 2.10.
    assert reduction_problems("ddp", bf16, cuda, nccl_version=(2, 21, 5)) == []
    assert "NCCL 2.9.9" in reduction_problems("ddp", bf16, cuda, nccl_version=(2, 9, 9))[0][1]
    ((field, msg),) = reduction_problems("ddp", bf16, cpu)
    assert field == "train.reduce_dtype" and "not on cpu (gloo)" in msg
    assert reduction_problems("fsdp2", bf16, cpu) == []  # gloo reduces bf16 (measured)
    assert reduction_problems("none", bf16, cpu)[0][0] == "train.reduce_dtype"
    assert reduction_problems("ddp", ReductionSettings(), cpu) == []


def test_a_refused_reduction_stops_before_any_process_group():
    # device=auto resolving to the CPU is refused at run time, with the same field.
    with pytest.raises(ConfigError, match="train.reduce_dtype: 'bf16' under train.distributed='ddp'"):
        init_distributed("ddp", device=torch.device("cpu"), reduction=ReductionSettings("bf16"))
    assert not torch.distributed.is_initialized()


def test_reduction_settings_map_onto_torchs_policy_and_hook():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # the hook torch ships

    fp32_master = reduction_settings("fsdp2", "bf16-true", "fp32", "fp32")
    assert fp32_master == ReductionSettings("fp32", "bf16")
    policy = fp32_master.fsdp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    policy = reduction_settings("fsdp2", "16-true", "fp32", "bf16").fsdp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float16, torch.bfloat16)
    # Autocast modes keep the parameters' own dtype; DDP never changes it.
    assert reduction_settings("fsdp2", "bf16", None, "bf16").fsdp_policy().param_dtype is None
    assert reduction_settings("ddp", "bf16-true", "none", "fp32") == ReductionSettings()
    for option in ("none", "kahan", "stochastic"):
        with pytest.raises(ValueError, match=f"precision.master_weights: '{option}' .* set precision.master_weights='fp32'"):
            reduction_settings("fsdp2", "bf16-true", option, "fp32")
    assert ReductionSettings("bf16").ddp_hook() is default_hooks.bf16_compress_hook
    assert ReductionSettings().ddp_hook() is None
    with pytest.raises(ValueError, match="reduce_dtype must be 'fp32' or 'bf16'"):
        ReductionSettings("fp16")


def test_rank_seed_keeps_rank_0_and_separates_the_others():
    assert rank_seed(7, 0) == 7
    assert len({rank_seed(7, r) for r in range(8)}) == 8


def test_config_differences_names_dotted_fields():
    a = {"train": {"steps": 10, "seed": 0}, "device": "cpu"}
    b = {"train": {"steps": 12, "seed": 0}, "device": "cuda"}
    assert config_differences(a, b) == ["device", "train.steps"]


def test_sharded_positional_data_strides_and_resumes():
    data = SyntheticBatches(lambda g: torch.rand(1, generator=g), seed=3, batches_per_epoch=7)
    shards = [ShardedData(data, r, 2) for r in range(2)]
    assert [len(s) for s in shards] == [3, 3], "every rank must get the same number of batches"
    got = [[b.item() for b in s.iter_from(1, 0)] for s in shards]
    want = [data.batch(1, i).item() for i in range(6)]
    assert got == [want[0::2], want[1::2]]
    assert [b.item() for b in shards[1].iter_from(1, 2)] == [want[5]]


def test_sharded_sequence_and_plain_iterable():
    seq = list(range(9))
    assert list(shard_data(seq, 1, 3)) == [1, 4, 7]
    gen_like = type("Once", (), {"__iter__": lambda self: iter(range(5))})()
    assert list(ShardedData(gen_like, 0, 2)) == [0, 2]
    assert shard_data(seq, 0, 1) is seq


def test_sharded_shuffling_loader_gives_ranks_disjoint_batches():
    loader = torch.utils.data.DataLoader(torch.arange(8), batch_size=1, shuffle=True)
    seen = []
    for r in range(2):
        torch.manual_seed(100 + r)  # ranks' global generators differ
        seen += [int(b) for b in ShardedData(loader, r, 2, seed=5)]
    assert sorted(seen) == list(range(8)), f"ranks must split one shared order, got {seen}"


def test_none_mode_hooks_are_identities():
    ctx = init_distributed("none")
    found, loss = torch.tensor(1.0), torch.tensor(3.0)
    assert ctx.agree(found, None, loss) is found and loss.item() == 3.0
    data = [1, 2, 3]
    assert ctx.shard_data(data) is data and ctx.is_main and not ctx.enabled


def test_under_torchrun_only_rank_0_prints_the_summary(monkeypatch, capsys, tmp_path):
    from torchimpl.cli.app import main

    args = ["train", "--set", "device=cpu", "--set", "task.name=mlp", "--set", "task.size=tiny",
            "--set", "train.steps=2", "--set", "train.batch_size=8"]
    monkeypatch.setenv("RANK", "1")
    assert main(args + ["--set", f"checkpoint.folder={tmp_path / 'rank1'}"]) == 0
    assert capsys.readouterr().out == "", "a rank other than 0 printed"
    monkeypatch.setenv("RANK", "0")
    # A folder of its own: a fresh run into the first one's folder is refused (torchimpl.run.folder).
    assert main(args + ["--set", f"checkpoint.folder={tmp_path / 'rank0'}"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2


# ---------------------------------------------------------------- two ranks

WORLD = 2
WAIT_S = 120.0
MIDWINDOW = "step-00000003-mb001"
# Before any optimizer step, where the optimizer has no state yet: at the start and mid-window.
FIRST_BOUNDARY, FIRST_WINDOW = "step-00000000", "step-00000000-mb001"


def _cfg(mode: str, folder: str, *extra: str):
    return load_config(overrides=[
        "task.name=mlp", "task.size=tiny", "device=cpu", "precision.mode=bf16", "train.force_scaler=true",
        "train.steps=6", "train.batch_size=8", "train.microbatches=2", "train.log_interval=100",
        f"train.distributed={mode}", f"checkpoint.folder={folder}", "checkpoint.interval=3", "checkpoint.keep_last=5",
        "train.distributed_timeout_s=20", *extra,
    ])


def _count_syncs(trainer):
    """Host syncs per optimizer step, counted with a TorchDispatchMode from fit start to fit end."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    per_step, last = [], [0]

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # The optimizer's host-side step counters are not syncs on any device.
            steps = {s["step"].data_ptr() for s in trainer.optimizer.state.values() if "step" in s}
            if func in (aten._local_scalar_dense.default, aten.is_nonzero.default) and not (
                    args and isinstance(args[0], torch.Tensor) and args[0].data_ptr() in steps):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    def step_end():
        per_step.append(Count.n - last[0])
        last[0] = Count.n

    return Count(), per_step, step_end


def _train(mode: str, folder: str, resume=None, extra=(), mid_window_save=False, loss_fn=None):
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Callback, Trainer

    class Probe(Callback):
        def on_fit_start(self, trainer):
            if mid_window_save:
                trainer.save_checkpoint()  # must not create the optimizer's state in the live run
            self.mode, self.syncs, self.step_end = _count_syncs(trainer)
            self.mode.__enter__()

        def on_microbatch_end(self, trainer, state):
            # A checkpoint inside an accumulation window, as a callback may write one.
            if mid_window_save and state.step in (0, 3) and state.window_done == 1:
                trainer.save_checkpoint()

        def on_step_end(self, trainer, state):
            self.step_end()

        def on_fit_end(self, trainer, summary):
            self.mode.__exit__(None, None, None)

    cfg = _cfg(mode, folder, *extra)
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    probe = Probe()
    summary = Trainer(cfg, [probe]).fit(task.model, task.train_data, loss_fn=loss_fn or task.loss_fn, resume=resume)
    params = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone().numpy() for p in task.model.parameters()]
    return {"summary": summary.to_dict(), "params": params, "syncs": probe.syncs}


def _resume_from(rank: int, folder: str, mode: str, name: str) -> dict:
    """Copy one checkpoint of the whole run to a fresh folder and resume from it there."""
    ext = ".dcp" if mode == "fsdp2" else ".ckpt"
    part = os.path.join(folder, mode, "from-" + name)
    if rank == 0:
        os.makedirs(part, exist_ok=True)
        src = os.path.join(folder, mode, "whole", name + ext)
        (shutil.copytree if mode == "fsdp2" else shutil.copy)(src, os.path.join(part, name + ext))
    torch.distributed.barrier()
    return _train(mode, part, resume="latest")


def _resume_job(rank, job):
    mode, folder = job["mode"], job["folder"]
    whole = _train(mode, os.path.join(folder, mode, "whole"), mid_window_save=True)
    unsaved = _train(mode, os.path.join(folder, mode, "unsaved"), extra=["checkpoint.interval=0"])
    return {"whole": whole, "unsaved": unsaved, "boundary": _resume_from(rank, folder, mode, "step-00000003"),
            "window": _resume_from(rank, folder, mode, MIDWINDOW),
            "first_boundary": _resume_from(rank, folder, mode, FIRST_BOUNDARY),
            "first_window": _resume_from(rank, folder, mode, FIRST_WINDOW)}


def _allreduce_job(rank, job):
    """Collectives of DDP training, 3 steps of 4 microbatches, counted by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _train("ddp", os.path.join(job["folder"], "allreduce"),
               extra=["train.steps=3", "train.microbatches=4", "checkpoint.interval=0"])
    return sum(e.name == "gloo:all_reduce" for e in prof.events())


def _nonfinite_job(rank, job):
    """Rank 1 alone gets a NaN loss at step 2: both ranks stop there; rank 0 writes the diagnosis."""
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import default_loss_fn

    folder = os.path.join(job["folder"], "nonfinite-" + job["mode"])
    cfg = _cfg(job["mode"], folder)
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    calls = []

    def loss_fn(model, batch):
        calls.append(None)
        loss = (task.loss_fn or default_loss_fn)(model, batch)
        # Microbatches 4 and 5 are step 2's (2 per step); the diagnosis reruns the window's first.
        return loss * float("nan") if rank == 1 and len(calls) >= 5 else loss

    out = _train(job["mode"], folder, extra=["train.on_nonfinite=stop"], loss_fn=loss_fn)
    return {"summary": out["summary"], "files": sorted(os.listdir(folder)) if rank == 0 else None}


def _mismatch_job(rank, job):
    try:
        _train("ddp", os.path.join(job["folder"], "mismatch"), extra=[f"train.seed={rank}"])
    except DistributedError as exc:
        return {"raised": str(exc)}
    return {"raised": None}


def _hang_job(rank, job):
    if rank == 1:
        time.sleep(1)  # a rank that never joins (it waits for the next job): rank 0 must give up
        return {"raised": None}
    t0 = time.monotonic()
    try:
        _train("ddp", os.path.join(job["folder"], "hang"), extra=["train.distributed_timeout_s=3"])
    except DistributedError as exc:
        return {"raised": str(exc), "after_s": time.monotonic() - t0}
    return {"raised": None}


_JOBS = {"resume": _resume_job, "allreduce": _allreduce_job, "nonfinite": _nonfinite_job,
         "mismatch": _mismatch_job, "hang": _hang_job}


def _serve(rank, job):
    return _JOBS[job["name"]](rank, job)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dist"))
    with rank_group(_serve, WORLD, wait_s=WAIT_S) as run:
        def job(name: str, **kw) -> list:
            return run(dict(kw, name=name, folder=folder))

        job.folder = folder
        yield job


@pytest.fixture(scope="module")
def resumed(ranks):
    """Each mode's whole run and its two resumed runs, computed once for the tests below."""
    return dict({mode: ranks("resume", mode=mode) for mode in ("ddp", "fsdp2")}, folder=ranks.folder)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("start", ["boundary", "window", "first_boundary", "first_window"])
def test_two_ranks_train_and_resume_bit_for_bit(resumed, mode, start):
    res = resumed[mode]
    for r, out in enumerate(res):
        assert "error" not in out, f"rank {r}: {out.get('error')}\n{out.get('traceback')}"
        whole, again = out["whole"], out[start]
        for i, (a, b) in enumerate(zip(whole["params"], again["params"])):
            assert a.tobytes() == b.tobytes(), f"{mode} rank {r} parameter {i}: run resumed at the {start} differs"
        assert whole["summary"]["final_scale"] == again["summary"]["final_scale"]
        first = 0 if start.startswith("first") else 3
        assert again["summary"]["steps"] == 6 and len(again["syncs"]) == 6 - first, \
            f"the resumed run must run steps {first} to 5"


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_writing_checkpoints_does_not_change_training(resumed, mode):
    # The run that saved at its start, inside windows and every 3 steps against one that never saved.
    for r, out in enumerate(resumed[mode]):
        for i, (a, b) in enumerate(zip(out["whole"]["params"], out["unsaved"]["params"])):
            assert a.tobytes() == b.tobytes(), f"{mode} rank {r} parameter {i}: saving checkpoints changed the run"


def test_ddp_replicas_agree_with_one_host_sync_per_step(resumed):
    res = resumed["ddp"]
    for i, (a, b) in enumerate(zip(res[0]["whole"]["params"], res[1]["whole"]["params"])):
        assert a.tobytes() == b.tobytes(), f"DDP replicas differ in parameter {i}"
    # The single-device budget: one host read per step (the skip decision), none added. The
    # counts of steps 0 and 3 also hold the checkpoints written during them (reads of their state).
    syncs = res[0]["whole"]["syncs"]
    assert [n for i, n in enumerate(syncs) if i not in (0, 3)] == [1] * 4, f"host syncs per step on rank 0: {syncs}"


def test_ddp_reduces_a_window_once(ranks):
    counts = ranks("allreduce")
    # Per step: one gradient all-reduce (the tiny model fits one bucket) after the last of the 4
    # microbatches, and one for the skip decision and the loss. Without no_sync: 4 + 1.
    assert counts == [3 * 2] * WORLD, f"gloo all-reduces over 3 steps of 4 microbatches: {counts}"


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_mid_window_checkpoint_refuses_another_world_size(resumed, tmp_path, mode):
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Trainer

    src = os.path.join(resumed["folder"], mode, "whole", MIDWINDOW + (".dcp" if mode == "fsdp2" else ".ckpt"))
    cfg = _cfg(mode, str(tmp_path))
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    with pytest.raises(CheckpointError, match=r"inside an accumulation window .* by 2 rank\(s\).* cannot resume on 1: "
                       r"resume it on 2 rank\(s\), or from a checkpoint written at a window boundary"):
        Trainer(cfg).fit(task.model, task.train_data, loss_fn=task.loss_fn, resume=src)


def test_a_two_rank_fsdp2_checkpoint_loads_on_one_rank(resumed, tmp_path):
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Trainer

    path = os.path.join(resumed["folder"], "fsdp2", "whole", "step-00000006.dcp")
    cfg = _cfg("fsdp2", str(tmp_path))
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    summary = Trainer(cfg).fit(task.model, task.train_data, loss_fn=task.loss_fn, resume=path)
    assert summary.steps == 6, "the loaded run must be at its last step"
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # reading in this single process is the intent
        warnings.filterwarnings("ignore", "torch.distributed is unavailable", UserWarning)
        saved = _load_state_dict_from_keys(checkpoint_id=path)["model"]
    for name, value in task.model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert torch.equal(full, saved[name]), f"{name} differs after loading on one rank"


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_nonfinite_loss_on_one_rank_stops_both_and_rank_0_writes_the_diagnosis(ranks, mode):
    res = ranks("nonfinite", mode=mode)
    for r, out in enumerate(res):
        assert "error" not in out, f"rank {r}: {out.get('error')}\n{out.get('traceback')}"
        assert out["summary"]["steps"] == 2 and out["summary"]["stopped"].startswith("non-finite loss at step 2"), out
    report = res[0]["summary"]["diagnosis_report"]
    assert os.path.basename(report) == "nonfinite-step00000002.json"
    assert [f for f in res[0]["files"] if f.startswith("nonfinite")] == ["nonfinite-step00000002.json"]
    with open(report) as f:
        data = json.load(f)
    assert data["problem"] == "non-finite loss" and set(data["other_ranks"]) == {"1"}, data.keys()
    if mode == "ddp":  # rank 1's own batch is the culprit, and its diagnosis reproduces it
        assert not data["diagnosis"]["reproduced"] and data["other_ranks"]["1"]["reproduced"], data
    else:
        assert "FSDP2 shards the parameters" in data["diagnosis"]["error"], data


def test_mismatched_configs_are_detected_at_start(ranks):
    res = ranks("mismatch")
    for r, out in enumerate(res):
        assert out.get("raised") and "ranks [1] differ from rank 0 in ['train.seed']" in out["raised"], (r, out)


def test_a_rank_that_never_joins_makes_the_others_fail_within_the_timeout(ranks):
    res = ranks("hang")
    assert res[0]["raised"] and "another rank probably died or hangs" in res[0]["raised"], res[0]
    assert res[0]["after_s"] < 15, f"rank 0 gave up after {res[0]['after_s']:.1f} s with a 3 s timeout"


def _damaged_fsdp2_folder(resumed, tmp_path):
    """A copy of the fsdp2 run's checkpoint folder (steps 0, 0-mb1, 3-mb1, 3 and 6)."""
    dest = tmp_path / "ck"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(os.path.join(resumed["folder"], "fsdp2", "whole"), dest)
    return dest


def _resume_one_rank(folder, resume):
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Trainer

    cfg = _cfg("fsdp2", str(folder), "train.steps=6")
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.distributed's single-process notes
        summary = Trainer(cfg).fit(task.model, task.train_data, loss_fn=task.loss_fn, resume=resume)
    return summary, [v.full_tensor() if hasattr(v, "full_tensor") else v for v in task.model.state_dict().values()]


@pytest.mark.parametrize("damage", ["shard", "metadata", "meta"])
def test_a_damaged_fsdp2_checkpoint_is_passed_over_for_the_previous_one(resumed, tmp_path, damage, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="torchimpl")
    folder = _damaged_fsdp2_folder(resumed, tmp_path / "damaged")
    newest = folder / "step-00000006.dcp"
    victim = {"shard": sorted(newest.glob("*.distcp"))[-1], "metadata": newest / ".metadata",
              "meta": newest / "meta.ckpt"}[damage]
    victim.unlink()
    summary, params = _resume_one_rank(folder, "latest")
    messages = [r.getMessage() for r in caplog.records]
    passed_over = [m for m in messages if m.startswith("cannot resume from step-00000006.dcp")]
    assert passed_over and "Traceback" not in passed_over[0], f"the damaged checkpoint must be named in one line: {messages}"
    assert any("resumed from" in m and "step-00000003.dcp" in m for m in messages), messages
    # A failed (partial) read of the damaged one leaves nothing behind: the run equals a clean
    # resume from step 3.
    clean = _damaged_fsdp2_folder(resumed, tmp_path / "clean")
    _, expected = _resume_one_rank(clean, clean / "step-00000003.dcp")
    assert summary.steps == 6
    assert all(torch.equal(a, b) for a, b in zip(params, expected)), "the fallback resume was contaminated"


def test_a_kill_during_the_rename_leaves_a_temporary_folder_that_the_next_run_removes(resumed, tmp_path):
    folder = _damaged_fsdp2_folder(resumed, tmp_path)
    # A kill after every rank wrote its shards but before the rename: the temporary name remains.
    os.rename(folder / "step-00000006.dcp", folder / ".tmp-step-00000006.dcp")
    summary, _ = _resume_one_rank(folder, "latest")
    assert summary.steps == 6 and not (folder / ".tmp-step-00000006.dcp").exists()
    assert (folder / "step-00000006.dcp" / ".metadata").is_file()
