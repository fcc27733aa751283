"""The call check (ddl_triton/runtime/lanes/call_check.py) on an in-process world: ranks as threads
whose loopback transport carries the call fingerprints as shm does (tests/support/inprocess_world.py).

What it must do, each in milliseconds here (the multi-rank tier's tests/multirank/test_faults.py
shows the same between processes): matching calls run, and the collective inside is exact on every
rank; calls that differ in any field make every rank raise CollectiveMismatch listing each rank's
call, after the collective (shm: no extra synchronisation) or, when the collective would hang, from
inside the wait; a rank that never calls makes the others raise CollectiveTimeout naming it; a
world of one checks nothing.
"""
from __future__ import annotations

import time

import pytest
import torch

from ddl_triton import schedules
from ddl_triton.errors import CollectiveMismatch, CollectiveTimeout
from ddl_triton.runtime.calls.executor import CallContext, Executor
from ddl_triton.runtime.lanes.call_check import CallChecker
from ddl_triton.runtime.lanes.fingerprint import describe, encode
from support.inprocess_world import ThreadWorld

TIMEOUT_S = 10.0


def _checkers(world: ThreadWorld, timeout: float = TIMEOUT_S) -> list[CallChecker]:
    """A checker per rank over its loopback transport, which runs the checker's mismatch watch
    inside its long waits, as the communicator's wiring sets shm's wait hook."""
    checkers = [CallChecker(None, r, world.size, world.transport(r), timeout) for r in range(world.size)]
    for r, checker in enumerate(checkers):
        world.transport(r).wait_hook = checker.look_for_mismatch
    return checkers


def _checked(checker: CallChecker, seq: int, collective: str, op, dtype, numel: int, root: int, run,
             on_gpu: bool = False) -> None:
    """Call ``seq`` as the communicator's runner brackets it: begin, the call, end."""
    fp = checker.begin_call(seq, collective, op, dtype, numel, root, on_gpu)
    run()
    checker.end_call(seq, collective, fp)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 13, 101])
def test_matching_calls_run_and_the_collective_inside_is_exact(n, count):
    world = ThreadWorld(n)
    checkers = _checkers(world)
    executors = [Executor(r, n, world.route(r), timeout=TIMEOUT_S, depth=2) for r in range(n)]
    schedule = schedules.build("ring", "allreduce", n, count, chunk_elems=7)

    def rank_body(rank: int) -> torch.Tensor:
        buf = torch.arange(count, dtype=torch.int64) * (rank + 1)
        for seq in (1, 2):  # the second call checks against a fresh fingerprint of the same shape
            _checked(checkers[rank], seq, "allreduce", "sum", torch.int64, count, 0,
                                   lambda: executors[rank].run(schedule, buf, buf, CallContext("allreduce"), seq))
        return buf

    outs = world.run(rank_body, timeout=TIMEOUT_S)
    want = torch.arange(count, dtype=torch.int64) * sum(r + 1 for r in range(n)) * n  # summed twice: x n
    for out in outs:
        assert torch.equal(out, want) and out.numpy().tobytes() == outs[0].numpy().tobytes()
    assert world.unreleased() == []


# Each case: the call of rank 1 where every other rank calls allreduce(sum, 13 x float32, root 0).
_DIFFERENT = {
    "collective": ("broadcast", None, torch.float32, 13, 0, False),
    "op": ("allreduce", "max", torch.float32, 13, 0, False),
    "dtype": ("allreduce", "sum", torch.int32, 13, 0, False),
    "count": ("allreduce", "sum", torch.float32, 14, 0, False),
    "root": ("allreduce", "sum", torch.float32, 13, 1, False),
    "device": ("allreduce", "sum", torch.float32, 13, 0, True),
}


@pytest.mark.parametrize("field", list(_DIFFERENT))
def test_a_call_that_differs_in_any_field_raises_on_every_rank_listing_each_call(field):
    n = 3
    world = ThreadWorld(n)
    checkers = _checkers(world)
    same = ("allreduce", "sum", torch.float32, 13, 0, False)

    def rank_body(rank: int):
        collective, op, dtype, numel, root, on_gpu = _DIFFERENT[field] if rank == 1 else same
        _checked(checkers[rank], 4, collective, op, dtype, numel, root, lambda: None, on_gpu)

    results = world.run_all(rank_body, timeout=TIMEOUT_S)
    theirs = describe(encode(*_DIFFERENT[field]))
    mine = describe(encode(*same))
    for rank, e in enumerate(results):
        assert isinstance(e, CollectiveMismatch), f"rank {rank}: {e!r}"
        text = str(e)
        assert text.startswith(f"rank {rank}:") and "#4" in text, text
        assert f"rank 0: {mine}" in text and f"rank 1: {theirs}" in text and f"rank 2: {mine}" in text, text


def test_a_mismatch_that_would_hang_is_raised_from_inside_the_wait():
    """Rank 0 runs an allreduce and rank 1 a broadcast rooted at itself (rank 1 waits for nothing,
    rank 0 for a message rank 1 never sends): rank 0 raises CollectiveMismatch long before its
    deadline, from its transport's wait hook, and names both calls."""
    n = 2
    world = ThreadWorld(n)
    checkers = _checkers(world, timeout=30.0)
    executors = [Executor(r, n, world.route(r), timeout=30.0, depth=2) for r in range(n)]
    reduce = schedules.build("one_shot", "allreduce", n, 5, chunk_elems=8)

    def rank_body(rank: int):
        buf = torch.ones(5, dtype=torch.int32)
        if rank == 0:
            _checked(checkers[0], 1, "allreduce", "sum", torch.int32, 5, 0,
                                lambda: executors[0].run(reduce, buf, buf, CallContext("allreduce"), 1))
        else:
            _checked(checkers[1], 1, "broadcast", None, torch.int32, 5, 1, lambda: None)

    results = world.run_all(rank_body, timeout=5.0)
    for rank in (0, 1):
        assert isinstance(results[rank], CollectiveMismatch), f"rank {rank}: {results[rank]!r}"
        assert "allreduce(sum, 5 x int32)" in str(results[rank]) and "broadcast(5 x int32, root 1)" in str(results[rank])


def test_a_rank_that_never_calls_times_out_the_others_naming_it():
    n = 3
    world = ThreadWorld(n)
    checkers = _checkers(world, timeout=0.2)

    def rank_body(rank: int):
        if rank != 2:
            _checked(checkers[rank], 1, "barrier", None, None, 0, 0, lambda: None)

    results = world.run_all(rank_body, timeout=5.0)
    for rank in (0, 1):
        assert isinstance(results[rank], CollectiveTimeout), f"rank {rank}: {results[rank]!r}"
        assert str(results[rank]).startswith(f"rank {rank}: barrier #1") and "rank 2" in str(results[rank])
    assert results[2] is None


def test_a_dead_rank_is_named_as_lost():
    world = ThreadWorld(2)
    world.kill(1)
    checker = _checkers(world)[0]
    with pytest.raises(CollectiveTimeout, match=r"^rank 0: allreduce #3 .*rank 1 .*(died|lost)"):
        _checked(checker, 3, "allreduce", "sum", torch.float32, 8, 0, lambda: None)


def test_a_world_of_one_checks_nothing_and_runs_the_call():
    ran = []
    checker = CallChecker(None, 0, 1, None, TIMEOUT_S)
    _checked(checker, 1, "allreduce", "sum", torch.float32, 3, 0, lambda: ran.append(1))
    assert ran == [1]


# -- a peer that left the communicator (ddl_triton/runtime/lanes/farewell.py) --------------------------------------

def _leave(world: ThreadWorld, rank: int, how, calls: int, failed: bool = False) -> None:
    """Rank ``rank`` leaves as the communicator's close (or exit) does over shm: its farewell word."""
    from ddl_triton.runtime.lanes.farewell import Farewell
    world.transport(rank).post_farewell(Farewell(how, calls, failed).shm_word())


@pytest.mark.parametrize("how,words", [("EXIT", "reached exit"), ("FINALIZED", "called finalize"),
                                       ("DESTROYED_GROUP", "destroyed its process group"),
                                       ("CLOSED", "closed its communicator")])
def test_a_rank_that_leaves_instead_of_calling_is_named_by_every_waiting_rank_at_once(how, words):
    """Ranks 0 and 2 run allreduce #3 (one_shot: each waits for every peer's message); rank 1 ran two
    calls and left: both raise CollectiveSkipped naming rank 1 and what it did, long before the
    deadline (30 s here), from inside the executor's wait."""
    from ddl_triton.errors import CollectiveSkipped
    from ddl_triton.runtime.lanes.farewell import Leaving

    n = 3
    world = ThreadWorld(n)
    checkers = _checkers(world, timeout=30.0)
    executors = [Executor(r, n, world.route(r), timeout=30.0, depth=2) for r in range(n)]
    reduce = schedules.build("one_shot", "allreduce", n, 5, chunk_elems=8)

    def rank_body(rank: int):
        if rank == 1:
            _leave(world, 1, Leaving[how], calls=2)
            return None
        buf = torch.ones(5, dtype=torch.int32)
        t0 = time.monotonic()
        try:
            _checked(checkers[rank], 3, "allreduce", "sum", torch.int32, 5, 0,
                     lambda: executors[rank].run(reduce, buf, buf, CallContext("allreduce"), 3))
        except CollectiveSkipped as e:
            return e, time.monotonic() - t0
        return None

    results = world.run(rank_body, timeout=10.0)
    for rank in (0, 2):
        error, seconds = results[rank]
        assert str(error).startswith(f"rank {rank}: rank 1 (host unknown) {words} while rank {rank} waits in "
                                     "allreduce #3 (rank 1 had issued 2 collectives on this communicator)"), error
        assert (error.peer, error.did, error.calls, error.failed) == (1, words, 2, False)
        assert seconds < 2.0, f"rank {rank}: {seconds:.2f} s"


def test_a_rank_that_left_after_the_call_dooms_nobody_and_one_that_failed_in_it_does():
    """A farewell after call #3 (its last call was #3, done) leaves a rank in #3 waiting for the
    others as before (it may be slow, not doomed); a farewell after #3 *failed* dooms #3."""
    from ddl_triton.errors import CollectiveSkipped
    from ddl_triton.runtime.lanes.farewell import Leaving

    world = ThreadWorld(3)
    checker = _checkers(world, timeout=0.3)[0]
    world.transport(1).post_fingerprint(3, encode("barrier", None, None, 0, 0))  # rank 1 ran #3, then left
    _leave(world, 1, Leaving.FINALIZED, calls=3)
    with pytest.raises(CollectiveTimeout, match=r"^rank 0: barrier #3 .*rank 2"):
        _checked(checker, 3, "barrier", None, None, 0, 0, lambda: None)
    world = ThreadWorld(3)
    checker = _checkers(world, timeout=30.0)[0]
    _leave(world, 1, Leaving.EXIT, calls=3, failed=True)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"^rank 0: barrier #3 failed: rank 1 \(host unknown\) reached exit "
                                                r"after the same call failed there \(rank 1 had issued 3 collectives"
                                                r" on this communicator; its own error names the cause\)") as failed:
        _checked(checker, 3, "barrier", None, None, 0, 0, lambda: None)
    assert not isinstance(failed.value, CollectiveSkipped)  # rank 1 did issue #3: not a skip
    assert time.monotonic() - t0 < 2.0  # at once, not at the 30 s deadline


def test_a_dead_rank_is_named_before_a_survivor_that_left_after_the_same_call_failed():
    """Rank 2 was killed; rank 1 gave up on call #3 first and reached exit (its farewell: #3 failed).
    Rank 0, still waiting in #3, names the killed rank 2, as rank 1 did, not rank 1's exit: every
    survivor names the cause, whichever gave up first (the race test_faults' kill cases once lost)."""
    from ddl_triton.runtime.lanes.farewell import Leaving

    world = ThreadWorld(3)
    checker = _checkers(world, timeout=30.0)[0]
    _leave(world, 1, Leaving.EXIT, calls=3, failed=True)
    world._dead.add(2)  # dead, but not yet noticed by a wait (the farewell is read first)
    with pytest.raises(CollectiveTimeout, match=r"^rank 0: barrier #3 .*rank 2 .*died"):
        _checked(checker, 3, "barrier", None, None, 0, 0, lambda: None)


def test_the_rank_that_skipped_is_named_before_one_that_left_after_failing():
    """Rank 2 reached exit after its call #4 failed (a consequence); rank 1 left after #3 (the cause):
    a rank waiting in #4 names rank 1."""
    from ddl_triton.errors import CollectiveSkipped
    from ddl_triton.runtime.lanes.farewell import Leaving

    world = ThreadWorld(3)
    checker = _checkers(world, timeout=30.0)[0]
    _leave(world, 2, Leaving.EXIT, calls=4, failed=True)
    _leave(world, 1, Leaving.DESTROYED_GROUP, calls=3)
    with pytest.raises(CollectiveSkipped, match=r"^rank 0: rank 1 \(host unknown\) destroyed its process group "):
        _checked(checker, 4, "allreduce", "sum", torch.float32, 8, 0, lambda: None)
