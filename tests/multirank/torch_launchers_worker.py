"""Ranks that no MPI launcher started: ``torchrun ... tests/multirank/torch_launchers_worker.py MODE`` or RANK/WORLD_SIZE/MASTER_*.

checks  every "ddl" backend operation on exact integer data, sub-groups, futures, errors,
        DDP/gloo/FSDP2 training against a single-process reference (tests/multirank/torch_backend_worker.py's
        checks, here bootstrapped from torchrun's store), the world communicator's own
        collectives at sizes from 0 to several pipeline chunks, the hooks' default
        communicator, and, across emulated hosts (DDL_TOPOLOGY), that the bytes between
        hosts went through gloo; DDP (plain and with the int8 compression hook) and FSDP2
        replicas bitwise identical. Rank 0 prints
        "torch_launchers_worker: N ranks, topology T, checks, K checks, F failures", and per rank
        the transport counters, its hostname and its link to each peer (self, shm or gloo), and
        its rank, world size and checks (tests/support/report.py's rank_lines).
init    ``ddl_triton.init()`` from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, one barrier and an
        allreduce; prints what it raised (the bootstrap-mismatch tests give it bad variables).
mismatch one allreduce (MISMATCH_NUMEL elements, default 10) for which the last rank passes
        another size: every rank must raise CollectiveMismatch (the fingerprints cross the
        emulated hosts over gloo), and exit 0.
die     an allreduce loop on the world communicator in which the last rank kills itself
        (SIGKILL) at iteration 3; survivors print how long they took to notice.

Every rank runs the same calls whatever a check's outcome (a wrong result is reported, never
a desynchronisation); the exit status is 1 if any rank saw a failure.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

import ddl_triton
import ddl_triton.torch  # noqa: F401  (registers "ddl")
from support.report import print_line, rank_lines

warnings.filterwarnings("ignore", category=FutureWarning)


def run_checks() -> int:
    dist.init_process_group("ddl")  # torchrun: env:// (torch's own store)
    r, w = dist.get_rank(), dist.get_world_size()
    given = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    report = dist.new_group(backend="gloo")  # the verdict travels outside what is tested
    import torch_backend_worker as tw  # after init: importing it clears RANK/WORLD_SIZE/MASTER_* (for MPI runs)

    ck = tw.Checker()
    ck.rank = r
    try:
        ck.true("world is torchrun's", (r, w) == given)
        ck.true("the default group runs on the world communicator",
                dist.group.WORLD.communicator is ddl_triton.init())
        from ddl_triton.torch.hooks import HookState
        ck.true("the hooks' default communicator is the world's", HookState().comm is ddl_triton.init())
        tw.check_reductions(ck, r, w)
        tw.check_copies(ck, r, w)
        tw.check_alltoall(ck, r, w)
        tw.check_point_to_point(ck, r, w)
        tw.check_futures_and_errors(ck, r, w)
        tw.check_subgroups(ck, r, w)
        check_world_collectives(ck, r, w)
        tw.check_training(ck, r, w)
        check_replicas_identical(ck, r, w)
        check_transports(ck, r, w)
    except Exception:  # noqa: BLE001 - report, with the others, instead of hanging them
        ck.failures.append(f"rank {r}: exception\n{traceback.format_exc()}")
    return _verdict(ck, r, w, report, "checks")


def check_world_collectives(ck, r: int, w: int) -> None:
    """The world communicator itself: every collective, integers compared with ==, at sizes
    that cross the pipeline chunk (DDL_CHUNK_BYTES) several times, and size 0."""
    comm = ddl_triton.init()
    chunk = comm.options.chunk_bytes // 4
    for n in (0, 1, 7, chunk + 3, 3 * chunk + 5):
        for dtype in (torch.int32, torch.int64, torch.float32):
            t = _ramp(r, n, dtype)
            comm.allreduce(t)
            ck.equal(f"allreduce {n} x {dtype}", t, sum(_ramp(q, n, torch.int64) for q in range(w)).to(dtype))
        t = _ramp(r, n, torch.int64)
        comm.allreduce(t, op="max")
        ck.equal(f"allreduce max {n}", t, torch.stack([_ramp(q, n, torch.int64) for q in range(w)]).max(0).values
                 if n else t)
        out = torch.empty(n, dtype=torch.int64)
        comm.reduce_scatter(out, _ramp(r, w * n, torch.int64))
        ck.equal(f"reduce_scatter {n}", out, sum(_ramp(q, w * n, torch.int64) for q in range(w))[r * n:(r + 1) * n])
        out = torch.empty(w * n, dtype=torch.int32)
        comm.all_gather(out, _ramp(r, n, torch.int32))
        ck.equal(f"all_gather {n}", out, torch.cat([_ramp(q, n, torch.int32) for q in range(w)]))
        out = torch.empty(w * n, dtype=torch.int64)
        comm.all_to_all(out, _ramp(r, w * n, torch.int64))
        ck.equal(f"all_to_all {n}", out, torch.cat([_ramp(q, w * n, torch.int64)[r * n:(r + 1) * n]
                                                    for q in range(w)]))
        for root in range(w):
            t = _ramp(r, n, torch.float32)
            comm.broadcast(t, root=root)
            ck.equal(f"broadcast {n} root {root}", t, _ramp(root, n, torch.float32))
    comm.barrier()


def check_replicas_identical(ck, r: int, w: int) -> None:
    """DDP on "ddl" (plain, then with the int8 compression hook on its default communicator, the
    world's) and FSDP2 on "ddl": a few steps on rank-specific data, then every rank's parameters
    (FSDP2: gathered whole) must hold the same bits, compared over a gloo group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from ddl_triton.torch.hooks import HookState, int8_compress_hook

    gloo = dist.new_group(backend="gloo")
    for name in ("DDP", "DDP + int8 hook", "FSDP2"):
        torch.manual_seed(0 if name == "FSDP2" else r)  # DDP broadcasts rank 0's start; FSDP2 needs one
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        if name == "FSDP2":
            mesh = init_device_mesh("cpu", (w,))
            for layer in (model[0], model[2], model):
                fully_shard(layer, mesh=mesh)
            wrapped = model
        else:
            wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
            if name != "DDP":
                wrapped.register_comm_hook(HookState(), int8_compress_hook)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * step + r))
            opt.zero_grad()
            wrapped(x).square().mean().backward()
            opt.step()
        params = [p.full_tensor() if name == "FSDP2" else p for p in model.parameters()]
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        replicas = [torch.empty_like(flat) for _ in range(w)]
        dist.all_gather(replicas, flat, group=gloo)
        ck.true(f"{name}: replicas bitwise identical",
                all(torch.equal(q.view(torch.int32), replicas[0].view(torch.int32)) for q in replicas))


def check_transports(ck, r: int, w: int) -> None:
    """Within a host shm; between (emulated) hosts gloo, never MPI: the byte counters say so."""
    comm = ddl_triton.init()
    moved = comm.transport_bytes
    ck.true("no MPI transport without an MPI launcher", "mpi" not in moved, str(moved))
    if comm.topology.nodes > 1:
        ck.true("bytes between hosts went through gloo", moved.get("gloo", {}).get("sent", 0) > 0
                and moved["gloo"]["received"] > 0, str(moved))
    if len(comm.placement.on_node) > 1:
        ck.true("bytes within a host went through shm", moved.get("shm", {}).get("sent", 0) > 0, str(moved))
    ck.moved = moved
    # Where this rank really runs and the link to each peer (what the wiring routes by): across
    # real hosts (the testbed) the test holds these against the hostnames.
    # And what its planner prices the link between hosts with (measured at init where ranks span hosts).
    ck.where = (socket.gethostname(), comm.topology.signature, " ".join(comm.placement.links),
                comm.planner.model_source)


def _verdict(ck, r: int, w: int, group, mode: str) -> int:
    everyone = [None] * w
    where = getattr(ck, "where", None)
    # Each rank's own rank and world size too: the test checks that every rank of the world it asked for reported.
    dist.all_gather_object(everyone, (ck.failures, ck.cases, getattr(ck, "moved", None), where, r, w), group=group)
    dist.destroy_process_group()
    if r != 0:
        return 0
    failures = [f for fs, *_ in everyone for f in fs]
    for f in failures[:50]:
        print("FAIL", f)
    # The topology the communicator used (DDL_TOPOLOGY's, else detected), rank 0's word for it.
    topology = where[1] if where else os.environ.get("DDL_TOPOLOGY", str(w))
    for q, (_, _, moved, at, _, _) in enumerate(everyone):
        print(f"torch_launchers_worker: rank {q} transport bytes: {moved}")
        if at:
            print(f"torch_launchers_worker: rank {q} on host {at[0]}, links {at[2]}")
            print(f"torch_launchers_worker: rank {q} plans with: {at[3]}")
    heading = f"torch_launchers_worker: {w} ranks, topology {topology}, {mode}"
    for line in rank_lines(heading, [(rank, size, cases, len(fs)) for fs, cases, _, _, rank, size in everyone]):
        print(line)
    print(f"{heading}, {sum(c for _, c, *_ in everyone)} checks, {len(failures)} failures", flush=True)
    return 1 if failures else 0


def _ramp(r: int, n: int, dtype) -> torch.Tensor:
    return (torch.arange(n) * (r + 1) + 3 * r - 4).to(dtype)


def run_init() -> int:
    rank = os.environ.get("RANK", "?")
    t0 = time.monotonic()
    try:
        comm = ddl_triton.init()
        comm.barrier()
        t = torch.full((3,), comm.rank + 1, dtype=torch.int64)
        comm.allreduce(t)
        print_line(f"torch_launchers_worker init: rank {comm.rank} of {comm.size}: allreduce gave {t.tolist()}")
        ddl_triton.finalize()
        return 0
    except Exception as e:  # noqa: BLE001
        print_line(f"torch_launchers_worker init: rank {rank} raised after {time.monotonic() - t0:.1f} s: "
                   f"{type(e).__name__}: {e}")
        return 3


def run_mismatch() -> int:
    comm = ddl_triton.init()
    numel = int(os.environ.get("MISMATCH_NUMEL", "10"))
    t = torch.ones(numel)
    comm.allreduce(t)
    comm.barrier()
    t0 = time.monotonic()
    try:
        comm.allreduce(torch.ones(numel + (comm.rank == comm.size - 1)))  # the last rank calls another size
    except ddl_triton.DDLError as e:
        print_line(f"torch_launchers_worker mismatch: rank {comm.rank} after {time.monotonic() - t0:.2f} s: "
                   f"{type(e).__name__}: {e}")
        return 0
    print_line(f"torch_launchers_worker mismatch: rank {comm.rank} raised nothing")
    return 2


def run_die() -> int:
    comm = ddl_triton.init()
    victim = comm.size - 1
    t = torch.ones(int(os.environ.get("DIE_NUMEL", "1000")))
    for i in range(1000):
        if i == 3 and comm.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        if i == 3:
            t0 = time.monotonic()
        try:
            comm.allreduce(t)
        except ddl_triton.DDLError as e:
            print_line(f"torch_launchers_worker die: rank {comm.rank} noticed after {time.monotonic() - t0:.2f} s: "
                       f"{type(e).__name__}: {e}")
            return 1
        time.sleep(0.01)
    print_line(f"torch_launchers_worker die: rank {comm.rank} never noticed")
    return 2


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "checks"
    sys.exit({"checks": run_checks, "init": run_init, "die": run_die, "mismatch": run_mismatch}[mode]())
