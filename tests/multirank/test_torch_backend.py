"""The torch.distributed backend "ddl": tests/multirank/torch_backend_worker.py under mpiexec, plus in-process checks
of the pieces that need no peers (registration, futures, dtype staging, op mapping)."""
from __future__ import annotations

import functools
import re
import subprocess

import pytest
import torch
import torch.distributed as dist

import ddl_triton
import ddl_triton.torch
from ddl_triton.torch import backend, futures, process_group, rendezvous, staging
from support.launch import ddl_segments, run_ranks
from support.report import read_report


@functools.cache
def _launch(n: int) -> tuple[subprocess.CompletedProcess, set[str]]:
    """One launch of ``n`` ranks running both modes, ops then train, each with its own report: the
    two tests of a world size read theirs from it (one launch per world size, not two). The launch,
    and the segments it left behind."""
    before = ddl_segments()
    proc = run_ranks(n, "multirank/torch_backend_worker.py", "ops,train", timeout=200)
    return proc, ddl_segments() - before


def _run(n: int, mode: str, min_checks: int) -> str:
    proc, leaked = _launch(n)
    # Every rank, each of world size n; the root of a collective checks more than the others.
    checks = read_report(proc.stdout, f"torch_backend_worker: {n} ranks, {mode}", n, same_on_every_rank=False)
    assert sum(checks) >= min_checks, f"the worker ran suspiciously few checks: {checks}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}"
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
    return proc.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_every_backend_op_exact(n):
    # Plain init_process_group("ddl") with no MASTER_ADDR; every op on integer data; subgroups.
    _run(n, "ops", 70 * n)


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_gloo_and_fsdp2_match_single_process_training(n):
    # Reference: one process on the global batch. DDP/"ddl", DDP/gloo and FSDP2/"ddl" on shards.
    _run(n, "train", 18 * n)


# -- in-process ----------------------------------------------------------------------------------------
def test_registration_is_idempotent():
    ddl_triton.torch.register()
    ddl_triton.torch.register()
    assert "ddl" in dist.Backend.backend_list
    assert dist.Backend._plugins["DDL"].creator_fn is backend.create_process_group
    assert dist.Backend.backend_capability["ddl"] == ["cpu", "cuda"]
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # we never take over plain CPU
    assert dist.Backend.default_device_backend_map.get("cuda") != "ddl"  # nor NCCL's place
    rdzv = __import__("torch.distributed.rendezvous", fromlist=["_rendezvous_handlers"])
    env = rdzv._rendezvous_handlers["env"]
    assert hasattr(env, "_ddl_wraps") and not hasattr(env._ddl_wraps, "_ddl_wraps")
    assert rdzv._rendezvous_handlers["ddl"] is rendezvous.mpi_rendezvous


def test_env_rendezvous_is_torchs_own_outside_mpi(monkeypatch):
    for var in ("MASTER_ADDR", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        next(dist.rendezvous("env://"))


def test_future_carries_result_and_error():
    t = torch.ones(3)
    ok = ddl_triton.Work("ok")
    tw = futures.torch_work(ok, [t])
    assert not tw.is_completed()
    ok._finish(result=t)
    assert tw.is_completed() and tw.wait()
    assert tw.get_future().wait()[0] is t

    bad = ddl_triton.Work("bad")
    tw = futures.torch_work(bad, [t])
    bad._finish(error=ddl_triton.CollectiveTimeout("rank 0: boom"))
    with pytest.raises(RuntimeError, match="boom"):
        tw.get_future().wait()  # a real future error: C++ waiters (DDP) see it too
    with pytest.raises(ddl_triton.CollectiveTimeout, match="boom"):
        tw.wait()  # Work.wait re-raises it as raised
    assert not tw.is_success()


def test_failing_copy_back_goes_to_the_future_not_the_thread():
    w = ddl_triton.Work("x")
    tw = futures.torch_work(w, [], finish=lambda: 1 / 0)
    w._finish(result=None)  # would kill a ddl_triton runner thread if the callback raised
    with pytest.raises(Exception, match="division"):
        tw.get_future().wait()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.bool, torch.complex64,
                                   torch.complex128, torch.uint32, torch.float8_e4m3fn])
def test_copy_staging_round_trips_bits(dtype):
    src = torch.randint(0, 255, (2, 6), dtype=torch.uint8)
    item = torch.empty(0, dtype=dtype).element_size()
    t = src.view(-1)[: (12 // item) * item].view(dtype) if dtype != torch.bool else src % 2 == 1
    wire, finish = staging.copy_stage(t)
    assert wire.dtype in (torch.int32, torch.int64)
    out = torch.empty_like(t)
    wire2, finish2 = staging.copy_stage(out, fresh=True)
    wire2.copy_(wire)
    finish2()
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_reduce_ops_map_and_refuse_by_name():
    assert process_group._op(dist.ReduceOp.SUM, "x") == ("sum", None)
    assert process_group._op(dist.ReduceOp.AVG, "x") == ("avg", None)
    assert process_group._op(dist.ReduceOp.MIN, "x") == ("min", None)
    assert process_group._op(dist.ReduceOp.MAX, "x") == ("max", None)
    assert process_group._op(dist._make_nccl_premul_sum(0.25), "x") == ("sum", 0.25)
    for op in ("PRODUCT", "BAND", "BOR", "BXOR"):  # all-gathered, then folded in rank order
        assert process_group._op(getattr(dist.ReduceOp, op), "x") == (op.lower(), None)
    with pytest.raises(ValueError, match="PREMUL_SUM"):  # a tensor factor: not supported
        process_group._op(dist._make_nccl_premul_sum(torch.tensor([0.5])), "allreduce")
    with pytest.raises(TypeError, match="complex64"):
        staging.reduce_stage(torch.ones(2, dtype=torch.complex64), "sum", "allreduce")
