from __future__ import annotations

import datetime
import os
import queue
import socket
import time

import pytest
import torch

from torchimpl.config import ConfigError, load_config
from torchimpl.distributed import (
    DistributedError,
    ShardedData,
    config_differences,
    init_distributed,
    rank_seed,
    shard_data,
)
from torchimpl.tasks import SyntheticBatches

WORLD = 2
WAIT_S = 120.0


# ---------------------------------------------------------------- single process


def test_config_field_is_validated():
    with pytest.raises(ConfigError, match="train.distributed: must be one of 'none', 'ddp', 'fsdp2'"):
        load_config(overrides=["train.distributed=horovod"])
    with pytest.raises(ConfigError, match="distributed_timeout_s"):
        load_config(overrides=["train.distributed_timeout_s=0"])


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


# ---------------------------------------------------------------- two ranks


def _cfg(mode: str, folder: str, *extra: str):
    return load_config(overrides=[
        "task.name=mlp", "task.size=tiny", "device=cpu", "precision.mode=bf16", "train.force_scaler=true",
        "train.steps=6", "train.batch_size=8", "train.log_interval=100", f"train.distributed={mode}",
        f"checkpoint.folder={folder}", "checkpoint.interval=3", "train.distributed_timeout_s=20", *extra,
    ])


def _worker(rank: int, port: int, folder: str, inbox, outbox) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        while True:
            try:
                job = inbox.get(timeout=WAIT_S)
            except queue.Empty:
                return
            if job is None:
                return
            try:
                outbox.put((rank, _JOBS[job](rank, folder)))
            except Exception as exc:
                outbox.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
    finally:
        dist.destroy_process_group()


def _train(mode: str, folder: str, resume=None, extra=()):
    from torchimpl.tasks import build_task
    from torchimpl.trainer import Callback, Trainer

    class Syncs(Callback):
        def on_fit_start(self, trainer):
            from torch.utils._python_dispatch import TorchDispatchMode

            aten = torch.ops.aten

            class Count(TorchDispatchMode):
                n = 0

                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    # The optimizer's host-side step counters are not syncs on any device.
                    steps = {s["step"].data_ptr() for s in trainer.optimizer.state.values() if "step" in s}
                    if func in (aten._local_scalar_dense.default, aten.is_nonzero.default) and not (
                            args and isinstance(args[0], torch.Tensor) and args[0].data_ptr() in steps):
                        Count.n += 1
                    return func(*args, **(kwargs or {}))

            self.mode, self.per_step, self.last = Count(), [], 0
            self.mode.__enter__()

        def on_step_end(self, trainer, state):
            self.per_step.append(type(self.mode).n - self.last)
            self.last = type(self.mode).n

        def on_fit_end(self, trainer, summary):
            self.mode.__exit__(None, None, None)

    cfg = _cfg(mode, folder, *extra)
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    syncs = Syncs()
    summary = Trainer(cfg, [syncs]).fit(task.model, task.train_data, loss_fn=task.loss_fn, resume=resume)
    params = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone().numpy() for p in task.model.parameters()]
    return {"summary": summary.to_dict(), "params": params, "syncs": syncs.per_step}


def _resume_job(mode: str):
    def job(rank, folder):
        import shutil

        whole = _train(mode, os.path.join(folder, mode, "whole"))
        part = os.path.join(folder, mode, "part")
        os.makedirs(part, exist_ok=True)
        src = os.path.join(folder, mode, "whole", "step-00000003" + (".dcp" if mode == "fsdp2" else ".ckpt"))
        if rank == 0:
            (shutil.copytree if mode == "fsdp2" else shutil.copy)(src, os.path.join(part, os.path.basename(src)))
        torch.distributed.barrier()
        resumed = _train(mode, part, resume="latest")
        return {"whole": whole, "resumed": resumed}
    return job


def _mismatch_job(rank, folder):
    try:
        _train("ddp", os.path.join(folder, "mismatch"), extra=[f"train.seed={rank}"])
    except DistributedError as exc:
        return {"raised": str(exc)}
    return {"raised": None}


def _hang_job(rank, folder):
    if rank == 1:
        time.sleep(8)  # a rank that never joins: rank 0 must give up after its timeout
        return {"raised": None}
    t0 = time.monotonic()
    try:
        _train("ddp", os.path.join(folder, "hang"), extra=["train.distributed_timeout_s=3"])
    except DistributedError as exc:
        return {"raised": str(exc), "after_s": time.monotonic() - t0}
    return {"raised": None}


_JOBS = {"ddp": _resume_job("ddp"), "fsdp2": _resume_job("fsdp2"), "mismatch": _mismatch_job, "hang": _hang_job}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = str(tmp_path_factory.mktemp("dist"))
    inboxes = [ctx.Queue() for _ in range(WORLD)]
    outbox = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, folder, inboxes[r], outbox), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()

    def run(job: str) -> list[dict]:
        for box in inboxes:
            box.put(job)
        got = {}
        for _ in range(WORLD):
            try:
                r, res = outbox.get(timeout=WAIT_S)
            except queue.Empty:
                pytest.fail(f"job {job}: a rank did not answer within {WAIT_S:g} s")
            got[r] = res
        return [got[r] for r in range(WORLD)]

    run.folder = folder
    try:
        yield run
    finally:
        for box in inboxes:
            box.put(None)
        for p in procs:
            p.join(timeout=20)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_train_and_resume_bit_for_bit(ranks, mode):
    res = ranks(mode)
    for r, out in enumerate(res):
        assert "error" not in out, f"rank {r}: {out.get('error')}"
        for i, (a, b) in enumerate(zip(out["whole"]["params"], out["resumed"]["params"])):
            assert a.tobytes() == b.tobytes(), f"{mode} rank {r} parameter {i}: resumed run differs"
        assert out["whole"]["summary"]["final_scale"] == out["resumed"]["summary"]["final_scale"]
    if mode == "ddp":
        for i, (a, b) in enumerate(zip(res[0]["whole"]["params"], res[1]["whole"]["params"])):
            assert a.tobytes() == b.tobytes(), f"DDP replicas differ in parameter {i}"
        # The single-device budget: one host read per step (the skip decision), none added. The
        # count of step 3 also holds the checkpoint written after step 2 (reads of its state).
        syncs = res[0]["whole"]["syncs"]
        assert [n for i, n in enumerate(syncs) if i != 3] == [1] * 5, f"host syncs per step on rank 0: {syncs}"


def test_a_two_rank_fsdp2_checkpoint_loads_on_one_rank(ranks):
    from torchimpl.tasks import build_task
    from torchimpl.trainer import Trainer

    path = os.path.join(ranks.folder, "fsdp2", "whole", "step-00000006.dcp")
    if not os.path.isdir(path):
        ranks("fsdp2")
    cfg = _cfg("fsdp2", os.path.join(ranks.folder, "one-rank"))
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    trainer = Trainer(cfg)
    summary = trainer.fit(task.model, task.train_data, loss_fn=task.loss_fn, resume=path)
    assert summary.steps == 6, "the loaded run must be at its last step"
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    saved = _load_state_dict_from_keys(checkpoint_id=path)["model"]
    for name, value in task.model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert torch.equal(full, saved[name]), f"{name} differs after loading on one rank"


def test_mismatched_configs_are_detected_at_start(ranks):
    res = ranks("mismatch")
    for r, out in enumerate(res):
        assert out.get("raised") and "ranks [1] differ from rank 0 in ['train.seed']" in out["raised"], (r, out)


def test_a_rank_that_never_joins_makes_the_others_fail_within_the_timeout(ranks):
    res = ranks("hang")
    assert res[0]["raised"] and "another rank probably died or hangs" in res[0]["raised"], res[0]
    assert res[0]["after_s"] < 15, f"rank 0 gave up after {res[0]['after_s']:.1f} s with a 3 s timeout"
