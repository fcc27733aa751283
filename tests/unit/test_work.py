"""The ordered queue of async calls (ddl_triton/runtime/work.py): issue order, and a waiter that runs
what the background thread has not started."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from ddl_triton.torch import futures
from ddl_triton.runtime.work import OrderedRunner


class _GatedRunner(OrderedRunner):
    """A runner whose background thread starts working only once ``gate`` is set."""

    def __init__(self):
        super().__init__("test-runner")
        self.gate = threading.Event()

    def _loop(self) -> None:
        self.gate.wait()
        super()._loop()


def _job(ran: list, name: str, fail: bool = False):
    def run():
        ran.append((name, threading.current_thread().name))
        if fail:
            raise ValueError(f"{name} failed")
        return name
    return run


@pytest.fixture
def runner():
    r = _GatedRunner()
    timer = threading.Timer(5.0, r.gate.set)  # never a hang: the background thread wakes in the end
    timer.start()
    yield r
    r.gate.set()
    timer.cancel()
    r.close()


def test_a_wait_runs_the_queued_calls_up_to_its_own_on_the_waiting_thread_in_order(runner):
    ran = []
    first = runner.submit(_job(ran, "a"), "a")
    second = runner.submit(_job(ran, "b"), "b")
    third = runner.submit(_job(ran, "c"), "c")
    me = threading.current_thread().name
    assert second.wait() == "b"
    assert ran == [("a", me), ("b", me)] and first.is_completed() and not third.is_completed()
    runner.gate.set()
    assert third.wait() == "c"
    assert [name for name, _ in ran] == ["a", "b", "c"]


def test_a_wait_with_a_timeout_leaves_the_call_to_the_background_thread(runner):
    ran = []
    work = runner.submit(_job(ran, "a"), "a")
    with pytest.raises(TimeoutError):
        work.wait(timeout=0.05)
    assert ran == []
    runner.gate.set()
    assert work.wait(timeout=5) == "a" and ran == [("a", "test-runner")]


def test_a_wait_leaves_the_rest_to_a_background_thread_already_running_one():
    r = OrderedRunner("busy-runner")
    started, release, ran = threading.Event(), threading.Event(), []

    def blocking():
        started.set()
        release.wait(5)
        ran.append(("block", threading.current_thread().name))

    r.submit(blocking, "block")
    later = r.submit(_job(ran, "later"), "later")
    assert started.wait(5)
    threading.Timer(0.1, release.set).start()
    assert later.wait() == "later"
    assert ran == [("block", "busy-runner"), ("later", "busy-runner")]
    r.close()


def test_an_error_of_a_call_run_by_the_waiter_reaches_its_own_waiter_only(runner):
    ran = []
    bad = runner.submit(_job(ran, "bad", fail=True), "bad")
    good = runner.submit(_job(ran, "good"), "good")
    assert good.wait() == "good"
    with pytest.raises(ValueError, match="bad failed"):
        bad.wait()


def test_a_torch_work_waited_on_runs_its_calls_on_the_waiting_thread(runner):
    ran = []
    t = torch.ones(2)
    inner = futures.torch_work(lambda: [runner.submit(_job(ran, "x"), "x")], [t])
    outer = futures.then(inner, [t], finish=lambda: t.mul_(3))
    joined = futures.join_torch_works([outer], [t])
    assert joined.wait()
    assert ran == [("x", threading.current_thread().name)] and torch.equal(t, torch.full((2,), 3.0))


def _idle_runner(name: str, ran: list) -> OrderedRunner:
    """A runner whose background thread exists and sits idle, waiting to be woken."""
    r = OrderedRunner(name)
    assert r.submit(_job(ran, "warm-up"), "warm-up").wait(timeout=5) == "warm-up"
    time.sleep(0.05)  # the thread is back in its wait for work
    return r


@pytest.mark.parametrize("how", ["release", "wait with a timeout", "is_completed", "a later call", "drain"])
def test_a_call_issued_waking_later_runs_once_something_asks_for_it(how):
    ran = []
    r = _idle_runner("held-runner", ran)
    with r.waking_later():
        held = r.submit(_job(ran, "held"), "held")
    time.sleep(0.1)
    assert [name for name, _ in ran] == ["warm-up"], "the idle thread was woken for a call issued waking_later"
    if how == "release":
        held.release()
    elif how == "wait with a timeout":
        assert held.wait(timeout=5) == "held"
    elif how == "is_completed":
        deadline = time.monotonic() + 5
        while not held.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
    elif how == "a later call":
        assert r.submit(_job(ran, "later"), "later").wait(timeout=5) == "later"
    else:
        r.drain()
    assert held.wait(timeout=5) == "held"
    assert ran[1] == ("held", "held-runner")  # run by the background thread, before any later call
    r.close()


def test_waking_later_applies_to_the_issuing_thread_and_block_only():
    ran = []
    r = _idle_runner("held-runner-2", ran)
    with r.waking_later():
        other = []
        t = threading.Thread(target=lambda: other.append(r.submit(_job(ran, "other thread"), "other thread")))
        t.start()
        t.join()
    assert other[0].wait(timeout=5) == "other thread"
    with r.waking_later():
        pass
    assert r.submit(_job(ran, "after the block"), "after").wait(timeout=5) == "after the block"
    r.close()


def test_get_future_of_a_torch_work_wakes_its_calls():
    ran = []
    r = _idle_runner("held-runner-3", ran)
    t = torch.ones(2)
    with r.waking_later():
        work = futures.torch_work(lambda: [r.submit(_job(ran, "x"), "x")], [t])
    time.sleep(0.1)
    assert [name for name, _ in ran] == ["warm-up"], "the idle thread was woken for a call issued waking_later"
    future = work.get_future()
    assert future.wait()[0] is t and ran[-1] == ("x", "held-runner-3")
    r.close()


def test_a_work_completed_by_its_maker_delivers_its_result_or_error_and_runs_its_callbacks():
    from ddl_triton.runtime.work import Work

    seen = []
    ok = Work("made outside the queue")
    ok.add_done_callback(lambda w: seen.append(("ok", w.wait())))
    assert not ok.is_completed()
    ok.set_result(41)
    assert ok.is_completed() and ok.wait() == 41 and ok.exception() is None and seen == [("ok", 41)]
    bad = Work("failing")
    bad.set_exception(ValueError("boom"))
    bad.add_done_callback(lambda w: seen.append(("bad", type(w.exception()).__name__)))  # already done: at once
    assert seen[-1] == ("bad", "ValueError")
    with pytest.raises(ValueError, match="boom"):
        bad.wait()
