"""The issue path (ddl_triton/runtime/calls/issue.py) without ranks, and under an in-process world.

What it must do: run every collective in issue order, inline or on its thread, each with a
flight-recorder record that goes issued -> started -> done (or failed); the first failure poisons
the path (every later call raises CommunicatorPoisoned naming it, queued ones included); a timeout
or a mismatch marks this process as having lost a peer and dumps the recorder; a closed path
refuses every call. Under tests/support/inprocess_world.py, async collectives issued on every rank
run their real executor in issue order and come out exact and identical on every rank.
"""
from __future__ import annotations

import pytest
import torch

from ddl_triton import schedules
from ddl_triton.errors import CollectiveMismatch, CollectiveTimeout, CommunicatorPoisoned, DDLError
from ddl_triton.observability import flight
from ddl_triton.runtime.calls import issue as issue_module
from ddl_triton.runtime.calls.executor import CallContext, Executor
from ddl_triton.runtime.calls.issue import IssuePath
from support.inprocess_world import ThreadWorld

CALL = ("allreduce", "sum", 4, torch.float32, None)


@pytest.fixture(autouse=True)
def _process_state(monkeypatch, tmp_path):
    """Keep this process's lost-peer list and flight dumps to the test: the exit guard reads the one."""
    monkeypatch.setattr(issue_module, "_LOST_PEERS", [])
    monkeypatch.setattr(flight.RECORDER, "dump_dir", str(tmp_path))


def _path(attached: list | None = None) -> IssuePath:
    return IssuePath(0, 7, (attached.append if attached is not None else lambda record: None), timeout=5.0)


def test_a_synchronous_call_runs_inline_with_its_record_attached_while_it_runs():
    attached: list = []
    path = _path(attached)
    seen = []
    assert path.issue(lambda: seen.append(attached[-1].state) or 42, False, CALL) == 42
    record = attached[0]
    assert seen == ["started"] and attached == [record, None]
    assert (record.state, record.seq, record.comm, record.call) == ("done", 1, 7, CALL)
    assert record.t_issue <= record.t_start <= record.t_end
    path.close()


def test_async_calls_run_in_issue_order_and_number_their_records():
    path = _path()
    order: list[int] = []
    works = [path.issue(lambda i=i: order.append(i) or i, True, CALL) for i in range(20)]
    assert [w.wait() for w in works] == list(range(20))
    assert order == list(range(20)) and path.issued == 20
    path.close()


def test_the_first_failure_poisons_every_later_call_and_names_it():
    path = _path()
    failing = path.issue(lambda: 1 / 0, True, CALL)
    queued = path.issue(lambda: "ran", True, CALL)
    with pytest.raises(DDLError, match=r"rank 0: collective failed: ZeroDivisionError"):
        failing.wait()
    with pytest.raises(CommunicatorPoisoned, match=r"rank 0: communicator unusable after an earlier failure"):
        queued.wait()  # issued before the failure showed, refused when its turn came
    with pytest.raises(CommunicatorPoisoned, match="division by zero"):
        path.check_usable()
    assert not issue_module.peers_lost()  # an ordinary error is not a lost peer
    path.close()


def test_the_poison_stays_the_first_failure_however_many_calls_are_refused():
    path = _path()
    failing = path.issue(lambda: 1 / 0, True, CALL)
    refused = [path.issue(lambda: "ran", True, CALL) for _ in range(3)]
    for work in [failing, *refused]:
        with pytest.raises(DDLError):
            work.wait()
    assert isinstance(path.poison, ZeroDivisionError), repr(path.poison)
    path.close()


@pytest.mark.parametrize("error", [CollectiveTimeout("rank 0: allreduce #1 timed out"),
                                   CollectiveMismatch("rank 0: ranks disagree on collective #1")])
def test_a_timeout_or_mismatch_is_raised_as_is_and_dumps_the_flight_recorder(error, tmp_path):
    path = _path()

    def job():
        raise error

    with pytest.raises(type(error), match=r"\[flight recorder: .*flight-rank") as raised:
        path.issue(job, False, CALL)
    assert raised.value is error
    assert issue_module.peers_lost() is isinstance(error, CollectiveTimeout)
    assert list(tmp_path.glob("flight-rank*.json")), "no dump written"
    with pytest.raises(CommunicatorPoisoned):
        path.issue(lambda: None, False, CALL)


def test_a_closed_path_finishes_queued_work_then_refuses_every_call():
    path = _path()
    done = []
    work = path.issue(lambda: done.append(1), True, CALL)
    path.close()
    assert done == [1] and work.is_completed()
    with pytest.raises(DDLError, match="rank 0: communicator is closed"):
        path.check_usable()


def test_run_inline_keeps_the_record_of_a_call_that_skips_the_queue():
    path = _path()
    out = []
    path.run_inline(CALL, "small", out.append, 5)
    assert out == [5] and path.issued == 1
    with pytest.raises(DDLError, match=r"rank 0: collective failed: ValueError\('bad'\)"):
        path.run_inline(CALL, "small", lambda: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(CommunicatorPoisoned):
        path.check_usable()
    path.close()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_async_collectives_on_every_rank_run_in_issue_order_and_are_exact(n):
    """Each rank issues allreduces of sizes 0, 1 and primes, then an all_gather, all async, and waits
    at the end: each ran its real executor after the one issued before it (the message counters of
    every rank agree), exact and bitwise identical on every rank."""
    world = ThreadWorld(n)
    sizes = (0, 1, 2, 3, 11, 31)

    def rank_body(rank: int):
        executor = Executor(rank, n, world.route(rank), timeout=10.0, depth=2)
        path = IssuePath(rank, 1, lambda record: setattr(executor, "record", record), timeout=10.0)
        works, bufs = [], []
        for seq, count in enumerate(sizes, start=1):
            buf = torch.arange(count, dtype=torch.int64) + 100 * rank
            schedule = schedules.build("ring", "allreduce", n, count, chunk_elems=2)
            works.append(path.issue(lambda s=schedule, b=buf, q=seq: executor.run(s, b, b, CallContext("allreduce"), q),
                                    True, ("allreduce", "sum", count, torch.int64, None)))
            bufs.append(buf)
        gathered = torch.full((5 * n,), -1, dtype=torch.int64)
        mine = torch.full((5,), rank, dtype=torch.int64)
        gather = schedules.build("ring", "all_gather", n, 5, chunk_elems=2)
        works.append(path.issue(lambda: executor.run(gather, mine, gathered, CallContext("all_gather"), 99), True,
                                ("all_gather", None, 5, torch.int64, None)))
        for w in works:
            w.wait()
        path.close()
        return bufs, gathered, list(executor.next_msg)

    results = world.run(rank_body, timeout=20.0)
    for rank, (bufs, gathered, counters) in enumerate(results):
        for count, buf in zip(sizes, bufs):
            want = torch.arange(count, dtype=torch.int64) * n + 100 * sum(range(n))
            assert torch.equal(buf, want), f"rank {rank}, {count} elements"
        assert torch.equal(gathered, torch.arange(n, dtype=torch.int64).repeat_interleave(5))
        assert counters == results[0][2]
    assert world.unreleased() == []
