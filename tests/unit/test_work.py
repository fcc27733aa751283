"""The ordered queue of async calls (ddl_triton/runtime/calls/work.py): issue order, and a waiter that runs
what the background thread has not started."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from ddl_triton.torch import futures
from ddl_triton.errors import CollectiveTimeout, DDLError
from ddl_triton.runtime.calls.work import OrderedRunner


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
    from ddl_triton.runtime.calls.work import Work

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


# -- no wait without a deadline (issue 41, row 7) --------------------------------------------------

def _returns_within(seconds: float, fn, *args):
    """``fn(*args)`` on a helper thread: its result, or its error raised here; fails, instead of
    hanging the suite, if it has not returned within ``seconds``."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still waiting after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _raise(_work):
    raise ValueError("callback bug")


def test_a_raising_callback_on_the_background_thread_neither_kills_the_queue_nor_hangs_close(capfd):
    r = OrderedRunner("callback-runner")
    ran, release = [], threading.Event()
    first = r.submit(lambda: release.wait(5) and "a", "first call")  # the callback runs on the thread
    first.add_done_callback(_raise)
    seen = []
    first.add_done_callback(lambda w: seen.append(w.wait()))  # the next callback still runs
    second = r.submit(_job(ran, "b"), "second call")
    release.set()
    _returns_within(5, r.close)  # what finalize waits on; it waited forever
    assert first.wait() == "a" and seen == ["a"]  # its Work keeps its result, as a torch Future does
    assert second.wait(timeout=1) == "b" and ran == [("b", "callback-runner")]  # later calls run as usual
    err = capfd.readouterr().err
    assert "a done-callback of first call raised; ignored" in err and "ValueError: callback bug" in err, err


def test_a_raising_callback_never_reaches_the_thread_that_completes_or_registers_it(runner, capfd):
    queued = runner.submit(_job([], "q"), "queued call")
    queued.add_done_callback(_raise)
    assert queued.wait() == "q"  # run on this thread by the wait: the callback's error stays out of it
    queued.add_done_callback(_raise)  # already complete: called at once, and printed
    assert capfd.readouterr().err.count("a done-callback of queued call raised") == 2


def test_finalize_of_a_communicators_queue_returns_after_a_raising_callback(capfd):
    from ddl_triton.runtime.calls.issue import IssuePath

    issuer = IssuePath(0, 99, lambda record: None)
    issuer.timeout = 2.0  # the communicator passes its Options.timeout
    call = ("barrier", "", 0, None, None)
    work = issuer.issue(lambda: "done", True, call)
    work.add_done_callback(_raise)
    later = issuer.issue(lambda: "later", True, call)
    _returns_within(5, issuer.close)
    assert work.wait() == "done" and later.wait(timeout=1) == "later" and issuer.closed
    assert "ValueError: callback bug" in capfd.readouterr().err


def test_a_stuck_call_makes_drain_and_close_raise_within_the_deadline():
    r = OrderedRunner("stuck-runner")
    release = threading.Event()
    stuck = r.submit(lambda: release.wait(10), "allreduce(sum, 4 x int64)")
    behind = r.submit(_job([], "behind"), "broadcast(root 0, 4 x int64)")
    try:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=r"allreduce\(sum, 4 x int64\) still running, 1 more queued"):
            _returns_within(5, r.drain, 0.3)
        with pytest.raises(CollectiveTimeout, match="no call finished for 0.3 s"):
            _returns_within(5, r.close, 0.3)
        assert time.monotonic() - t0 < 3
        with pytest.raises(CollectiveTimeout):  # the call queued behind it is told, never left waiting
            behind.wait(timeout=1)
        with pytest.raises(RuntimeError, match="submit after close"):
            r.submit(_job([], "x"), "x")
    finally:
        release.set()
    assert stuck.wait(timeout=5) is True  # the stuck call was left to finish on its own thread


def test_finalize_of_a_communicators_stuck_queue_raises_within_its_timeout():
    from ddl_triton.runtime.calls.issue import IssuePath

    issuer = IssuePath(0, 98, lambda record: None)
    issuer.timeout = 0.3
    release = threading.Event()
    call = ("allreduce", "sum", 4, torch.int64, None)
    issuer.issue(lambda: release.wait(10), True, call)
    try:
        with pytest.raises(CollectiveTimeout, match=r"allreduce\(sum, 4 x int64\) still running"):
            _returns_within(5, issuer.close)
        assert issuer.closed  # and stays closed: a second finalize does not wait again
    finally:
        release.set()


def test_drains_deadline_counts_from_the_latest_finished_call():
    r = OrderedRunner("slow-runner")
    for i in range(5):
        r.submit(lambda: time.sleep(0.25), f"call {i}")  # 1.25 s in all, each well within 1 s
    _returns_within(10, r.drain, 1.0)
    r.close(1.0)


def test_an_escape_from_the_background_thread_fails_the_queued_and_later_calls(capfd):
    r = OrderedRunner("broken-runner")
    release = threading.Event()
    first = r.submit(lambda: release.wait(5), "first call")

    def leave(_work):
        raise SystemExit(3)

    first.add_done_callback(leave)
    behind = r.submit(_job([], "behind"), "call behind")
    release.set()
    with pytest.raises(DDLError, match=r"stopped: SystemExit\(3\)"):
        behind.wait(timeout=5)
    with pytest.raises(DDLError, match="stopped"):
        r.submit(_job([], "later"), "later")
    with pytest.raises(DDLError, match="stopped"):
        r.run_sync(_job([], "sync"), lambda: "sync")
    _returns_within(5, r.close, 1.0)
    assert "broken-runner: the thread running async calls stopped" in capfd.readouterr().err


_FINALIZE_AFTER_A_RAISING_CALLBACK = """
import torch, torch.distributed as dist
import ddl_triton as ddl
comm = ddl.init(store=dist.HashStore(), rank=0, size=1, timeout=5)
def bad(work):
    raise ValueError("callback bug")
first = comm.allreduce(torch.ones(4, dtype=torch.int64), async_op=True)
first.add_done_callback(bad)
second = comm.allreduce(torch.full((4,), 2, dtype=torch.int64), async_op=True)
second.release()
ddl.finalize()
print("finalized", first.wait().tolist(), second.wait().tolist(), flush=True)
"""


@pytest.mark.slow  # seconds: make check, the inner loop, leaves it out
def test_finalize_returns_and_the_job_exits_0_after_a_raising_callback():
    """The issue's row 7 end to end: ddl_triton.finalize() with a raising callback on the queue's
    thread (it waited forever: the callback had killed the thread before the second call ran)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FINALIZE_AFTER_A_RAISING_CALLBACK], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finalized [1, 1, 1, 1] [2, 2, 2, 2]" in proc.stdout
    assert "a done-callback of allreduce(sum, 4 x int64) raised; ignored" in proc.stderr, proc.stderr[-3000:]


# ---- calls issued from inside callbacks (torch's PowerSGD: Future.then callbacks that issue and wait) ----
def _watchdog(fn, seconds: float = 10.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it is not done in ``seconds``."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"deadlock: not done after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.mark.parametrize("wait", ["wait", "release", "torch future"])
def test_a_callback_on_the_background_thread_may_issue_a_call_and_wait_for_it(wait):
    # The PowerSGD deadlock: the callback runs on the thread that runs the queue, and waits there for a
    # call it issued. The wait runs that call on the same thread, nested.
    runner = OrderedRunner("test-runner")
    ran, inner = [], []
    issued = threading.Event()

    def callback(_):
        inner_work = runner.submit(_job(ran, "inner"), "inner")
        if wait == "wait":
            inner.append(inner_work.wait())
        elif wait == "release":  # get_future() of the torch Work: the call then runs before it returns
            inner_work.release()
            inner.append(inner_work.is_completed())
        else:  # torch.futures.Future.wait(), which no run_here reaches: the torch Work's get_future ran it
            tw = futures.torch_work([inner_work], ["inner"])
            inner.append(tw.get_future().wait())
        issued.set()

    outer = runner.submit(_job(ran, "outer"), "outer")
    outer.add_done_callback(callback)
    try:
        _watchdog(lambda: issued.wait(10) or None)
        assert issued.is_set(), "the callback never finished: the call it waited for did not run"
        assert [n for n, _ in ran] == ["outer", "inner"] and ran[0][1] == ran[1][1] == "test-runner"
        assert inner == [{"wait": "inner", "release": True, "torch future": ["inner"]}[wait]]
    finally:
        runner.close(5)


@pytest.mark.parametrize("completes", ["before the later call is issued", "after the later call is issued"])
def test_a_call_issued_by_a_callback_runs_right_after_its_parent_whatever_the_timing(completes):
    # The order across ranks: the call a callback issues runs right after the call whose completion ran
    # the callback, before a call issued later from outside, whether or not that was issued first.
    runner = _GatedRunner()
    ran = []
    a = runner.submit(_job(ran, "a"), "a")
    a.add_done_callback(lambda _: runner.submit(_job(ran, "from a's callback"), "c"))
    if completes == "before the later call is issued":
        a.wait()  # runs a (and its callback) on this thread
        b = runner.submit(_job(ran, "b"), "b")
    else:
        b = runner.submit(_job(ran, "b"), "b")
    runner.gate.set()
    b.wait(10)
    runner.close(5)
    assert [n for n, _ in ran] == ["a", "from a's callback", "b"]


def test_calls_issued_by_callbacks_keep_their_order_and_nest():
    # Two calls from one callback run in the order issued; a call issued by the callback of a nested
    # call runs after the calls issued before it (breadth first), all before the outside call.
    runner = _GatedRunner()
    ran = []

    def a_done(_):
        c1 = runner.submit(_job(ran, "c1"), "c1")
        c1.add_done_callback(lambda _: runner.submit(_job(ran, "d (c1's callback)"), "d"))
        runner.submit(_job(ran, "c2"), "c2")
        assert c1.wait() == "c1"  # nested: c1 runs here, its callback queues d after c2

    a = runner.submit(_job(ran, "a"), "a")
    a.add_done_callback(a_done)
    b = runner.submit(_job(ran, "b"), "b")
    runner.gate.set()
    _watchdog(lambda: b.wait(10))
    runner.close(5)
    assert [n for n, _ in ran] == ["a", "c1", "c2", "d (c1's callback)", "b"]


def test_a_callback_registered_after_completion_issues_in_program_order(runner):
    # Registered once its call is done, a callback runs at once on the registering thread: what it
    # issues joins the queue like any call from that thread, after the calls issued before.
    ran = []
    a = runner.submit(_job(ran, "a"), "a")
    assert a.wait() == "a"
    b = runner.submit(_job(ran, "b"), "b")
    a.add_done_callback(lambda _: runner.submit(_job(ran, "late callback's"), "c"))
    runner.gate.set()
    runner.drain(5)
    assert [n for n, _ in ran] == ["a", "b", "late callback's"]


def test_a_synchronous_call_from_a_callback_runs_nested_and_drain_from_a_callback_returns():
    runner = OrderedRunner("test-runner")
    ran, seen = [], []

    def callback(_):
        seen.append(runner.run_sync(_job(ran, "sync from callback"), lambda: "s"))
        runner.submit(_job(ran, "async from callback"), "x")
        runner.drain(5)  # from inside a running call: runs what is queued, cannot wait for itself
        seen.append("drained")

    outer = runner.submit(_job(ran, "outer"), "outer")
    outer.add_done_callback(callback)
    _watchdog(lambda: outer.wait(10))
    runner.close(5)
    assert [n for n, _ in ran] == ["outer", "sync from callback", "async from callback"]
    assert seen == ["sync from callback", "drained"]
