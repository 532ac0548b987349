"""The audit states how a DDP or FSDP2 loop reduces gradients (audit.reductions): the comm hook,
FSDP2's MixedPrecisionPolicy dtypes and divide factors, in reference.grad_reduction's words.

A 2-rank gloo group (conformance.multiproc) runs the audited loops; each rank audits itself.
"""

from __future__ import annotations

import gc

import pytest

from conformance.multiproc import rank_group


def _audited_loop(rank: int, job: dict) -> dict:
    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from audit import audit

    gc.collect()  # the previous job's wrappers (FSDP2's hooks hold reference cycles)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    if job["wrapper"] == "ddp":
        net = DistributedDataParallel(model)
        if job.get("hook"):
            net.register_comm_hook(None, getattr(default_hooks, job["hook"]))
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, job["reduce"]))
        mesh = init_device_mesh("cpu", (2,))
        for unit in (model[0], model[1], model):
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        if job.get("force_sum"):
            for unit in (model[0], model[1], model):
                unit.set_force_sum_reduction_for_comms(True)
        net = model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with audit(replay=False) as session:
        for _ in range(2):
            opt.zero_grad()
            net(torch.ones(3, 4)).float().sum().backward()
            opt.step()
    report = session.report
    return {"reductions": report.to_dict()["reductions"], "text": report.text()}


@pytest.fixture(scope="module")
def ranks():
    with rank_group(_audited_loop, 2, wait_s=120.0) as run:
        yield lambda job: run(job, check=True)


def test_ddp_without_a_hook_is_stated_as_the_float32_average(ranks):
    got = ranks({"wrapper": "ddp"})
    for r in got:
        (red,) = r["reductions"]
        assert (red["wrapper"], red["world_size"], red["comm_hook"], red["wire_dtype"]) == ("DDP", 2, None, "fp32")
        assert "gradient reduction, DDP over 2 rank(s) (Sequential): float32: each rank's gradient times f32(1/W)" in r["text"]


def test_ddp_with_the_fp16_compress_hook_is_stated_as_dividing_in_fp16_before_the_sum(ranks):
    got = ranks({"wrapper": "ddp", "hook": "fp16_compress_hook"})
    (red,) = got[0]["reductions"]
    assert (red["comm_hook"], red["wire_dtype"]) == ("fp16_compress_hook", "fp16")
    assert "divided by 2 in fp16 before the sum" in red["reduction"] and "rule 7" in red["reduction"]


def test_fsdp2_policy_and_divide_factors_are_stated(ranks):
    got = ranks({"wrapper": "fsdp2", "reduce": "bfloat16"})
    (red,) = got[0]["reductions"]  # three FSDP2 units with one setting: one entry naming them
    assert (red["param_dtype"], red["reduce_dtype"], red["wire_dtype"], red["world_size"]) == ("bf16", "bf16", "bf16", 2)
    assert sorted(red["modules"]) == ["FSDPLinear", "FSDPLinear"], red  # the root holds no parameter of its own
    assert "ReduceOp.AVG: the bf16 sum, then divided by 2 in bf16" in red["reduction"]
    got = ranks({"wrapper": "fsdp2", "reduce": "float16", "force_sum": True})
    (red,) = got[0]["reductions"]
    # reference.grad_reduction rule 8: fp16 at 2 ranks divides by 2 before the sum, by 1 after.
    assert red["wire_dtype"] == "fp16" and "SUM after a pre-division by 2" in red["reduction"]
    assert "then divided" not in red["reduction"]


def test_a_loop_without_ddp_or_fsdp2_states_no_reduction():
    import torch

    from audit import audit

    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    with audit(replay=False) as session:
        (p * 2).sum().backward()
        opt.step()
    assert session.report.reductions == [] and "gradient reduction" not in session.report.text()
