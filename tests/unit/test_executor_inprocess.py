"""The executor on an in-process world (tests/support/inprocess_world.py): every schedule and
collective on 1-5 ranks as threads, exact integer data, in milliseconds.

Each case runs the real ``Executor`` of every rank on its own thread over loopback transports and
checks: the result is exact (integer-valued data, compared with ==), it is bitwise identical on
every rank where every rank holds the same result, every message sent was read and released, and
the per-sender message counters advance alike across calls. Sizes: 0, 1, primes, and sizes not
divisible by the world size or the chunk. The multi-rank tier (tests/multirank/test_multirank.py)
runs the same code over shm and MPI between processes.
"""
from __future__ import annotations

import pytest
import torch

from ddl_triton import schedules
from ddl_triton.errors import CollectiveTimeout
from ddl_triton.runtime.calls.executor import CallContext, Executor
from support.inprocess_world import ThreadWorld

SIZES = (0, 1, 2, 7, 13, 97)      # 0, 1, primes; none a multiple of 3 or of the chunks below but 0
CHUNKS = (3, 16)                   # elements per chunk: one that divides nothing above, one larger
WORLDS = (1, 2, 3, 4, 5)
TIMEOUT_S = 10.0


def _grid(name: str, n: int):
    """A grid for the topology-aware schedules: 2 per node where it divides, else flat."""
    if not schedules.uses_grid(name):
        return None
    return (2, n // 2) if n % 2 == 0 and n > 2 else (n,)


def _cases():
    for name in schedules.names():
        for collective in schedules.COLLECTIVES:
            if schedules.supports(name, collective):
                yield name, collective


def _data(collective: str, rank: int, n: int, count: int) -> torch.Tensor:
    """Rank ``rank``'s input: distinct small integers per rank and element (sums stay exact in int32)."""
    numel = count * n if collective in ("reduce_scatter", "all_to_all") else count
    return torch.arange(numel, dtype=torch.int32) * 7 + rank * 1000 + 1


def _expected(collective: str, rank: int, n: int, count: int, root: int) -> torch.Tensor:
    inputs = [_data(collective, r, n, count) for r in range(n)]
    if collective == "allreduce":
        return sum(inputs)
    if collective == "reduce_scatter":
        return sum(inputs)[rank * count:(rank + 1) * count]
    if collective == "all_gather":
        return torch.cat(inputs)
    if collective == "broadcast":
        return inputs[root]
    return torch.cat([inputs[q][rank * count:(rank + 1) * count] for q in range(n)])  # all_to_all


def _run_collective(world: ThreadWorld, executors, name: str, collective: str, count: int, chunk: int,
                    root: int, seq: int) -> list[torch.Tensor]:
    n = world.size
    schedule = schedules.build(name, collective, n, count, chunk_elems=chunk, root=root, grid=_grid(name, n))

    def rank_body(rank: int) -> torch.Tensor:
        inbuf = _data(collective, rank, n, count)
        in_place = collective in ("allreduce", "broadcast")
        outbuf = inbuf if in_place else torch.full((schedule.out_count,), -1, dtype=torch.int32)
        assert inbuf.numel() == schedule.in_count
        executors[rank].run(schedule, inbuf, outbuf, CallContext(collective), seq)
        return outbuf

    return world.run(rank_body, timeout=TIMEOUT_S)


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("name,collective", list(_cases()))
def test_every_schedule_is_exact_and_identical_on_every_rank(name, collective, n):
    world = ThreadWorld(n)
    executors = [Executor(r, n, world.route(r), timeout=TIMEOUT_S, depth=2) for r in range(n)]
    seq = 0
    for count in SIZES:
        for chunk in CHUNKS:
            root = (count + chunk) % n if collective == "broadcast" else 0
            seq += 1
            outs = _run_collective(world, executors, name, collective, count, chunk, root, seq)
            where = f"{name} {collective} n={n} count={count} chunk={chunk} root={root}"
            for rank, out in enumerate(outs):
                assert torch.equal(out, _expected(collective, rank, n, count, root)), f"{where}: rank {rank}"
            if collective in ("allreduce", "all_gather", "broadcast"):
                assert all(o.numpy().tobytes() == outs[0].numpy().tobytes() for o in outs), where
            assert world.unreleased() == [], f"{where}: messages never read and released"
    # Every rank counts every sender's messages alike: they agree on what comes next.
    assert all(e.next_msg == executors[0].next_msg for e in executors)


def test_a_wide_run_rounds_back_once():
    """``run_widened``: 16-bit sums carried in fp32 between ranks, rounded to bf16 once at the end."""
    n, count = 3, 11
    world = ThreadWorld(n)
    executors = [Executor(r, n, world.route(r), timeout=TIMEOUT_S, depth=2) for r in range(n)]
    schedule = schedules.build("ring", "allreduce", n, count, chunk_elems=4)
    data = [torch.arange(count, dtype=torch.bfloat16) + r for r in range(n)]

    def rank_body(rank: int) -> torch.Tensor:
        buf = data[rank].clone()
        executors[rank].run_widened(schedule, buf, buf, CallContext("allreduce"), 1, torch.float32)
        return buf

    outs = world.run(rank_body, timeout=TIMEOUT_S)
    want = sum(d.float() for d in data).to(torch.bfloat16)
    assert all(torch.equal(o, want) and o.dtype == torch.bfloat16 for o in outs)


def test_a_dead_peer_is_a_collective_timeout_naming_it_and_the_step():
    """A rank whose peer died mid-call raises CollectiveTimeout naming the call, the schedule and the
    peer, within the wait (not at the deadline), and its message counters do not advance."""
    n = 3
    world = ThreadWorld(n)
    executors = [Executor(r, n, world.route(r), timeout=TIMEOUT_S, depth=2) for r in range(n)]
    schedule = schedules.build("ring", "allreduce", n, 13, chunk_elems=3)
    world.kill(2)

    def rank_body(rank: int):
        if rank == 2:
            return None  # dead: never calls
        before = list(executors[rank].next_msg)
        try:
            executors[rank].run(schedule, _data("allreduce", rank, n, 13), _data("allreduce", rank, n, 13),
                                CallContext("allreduce"), 5)
        except CollectiveTimeout as e:
            assert executors[rank].next_msg == before
            return str(e)
        return "no error"

    messages = world.run(rank_body, timeout=TIMEOUT_S / 2)
    for rank in (0, 1):
        assert messages[rank].startswith(f"rank {rank}: allreduce #5"), messages[rank]
        assert "ring" in messages[rank] and "rank 2" in messages[rank], messages[rank]
        assert "died" in messages[rank] or "lost" in messages[rank], messages[rank]


def test_a_silent_peer_times_out_at_the_deadline():
    n = 2
    world = ThreadWorld(n)
    executor = Executor(0, n, world.route(0), timeout=0.05, depth=2)
    schedule = schedules.build("one_shot", "allreduce", n, 5, chunk_elems=8)
    buf = torch.ones(5, dtype=torch.int32)
    with pytest.raises(CollectiveTimeout, match=r"^rank 0: allreduce #1 .*(0.05 s.*rank 1|rank 1.*0.05 s)"):
        executor.run(schedule, buf, buf, CallContext("allreduce"), 1)
