"""Asynchronous collectives: Work handles and the ordered queue that runs them.

Semantics: collectives run one at a time, in the order they were issued,
whether they were issued synchronously or with ``async_op=True``. A
synchronous call with nothing queued runs inline on the caller's thread (no
thread hand-off on the latency path); otherwise it joins the queue and waits.
Async calls are run by one background thread per communicator, so a training
thread keeps computing while they progress: every wait in the transports
yields the GIL. A thread that waits for an async call the background thread has
not started yet runs it itself, with everything queued before it (in issue
order, the background thread idle meanwhile): it was going to block anyway, and
waking the background thread costs a hand-off of the core and the GIL.

An issuer may also ask that the background thread not be woken for a call yet
(``OrderedRunner.waking_later``): the call waits in the queue until ``release()``
of its Work, a ``wait()`` on it, a later call, or ``drain``. The torch backend
does this for calls DDP's C++ reducer makes in backward, which asks for the
call's future right after issuing it: a thread woken in between takes the GIL,
and backward would wait for it (ddl_triton/torch/process_group.py).
"""
from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Callable, Iterator

from ..transports.base import run_in_background


class Work:
    """Handle of an issued collective. ``wait()`` returns its result or raises its error."""

    __slots__ = ("_done", "_result", "_error", "_callbacks", "_lock", "description", "_runner")

    def __init__(self, description: str, runner: "OrderedRunner | None" = None):
        self.description = description
        self._done = threading.Event()
        self._result = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Work"], None]] = []
        self._lock = threading.Lock()
        self._runner = runner  # the queue it waits in, if any (see run_here)

    def wait(self, timeout: float | None = None):
        """Block until complete; return the result tensor or re-raise the collective's error.

        Without a timeout, a call still queued runs on this thread (see ``run_here``)."""
        if timeout is None:
            self.run_here()
        else:
            self.release()
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.description} not complete after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def run_here(self) -> None:
        """If this call is still queued and the background thread is idle, run it on the calling
        thread, after the calls queued before it; otherwise do nothing. The caller is about to
        block on it: running it here saves waking the background thread."""
        if self._runner is not None and not self._done.is_set():
            self._runner._run_until(self)

    def release(self) -> None:
        """Wake the background thread for this call if it was issued ``waking_later`` and no one
        has woken it since; otherwise do nothing."""
        if self._runner is not None and not self._done.is_set():
            self._runner._wake_if_held()

    def is_completed(self) -> bool:
        if self._done.is_set():
            return True
        self.release()  # a caller polling it expects progress
        return False

    def result(self):
        return self.wait()

    def exception(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def add_done_callback(self, fn: Callable[["Work"], None]) -> None:
        """Call ``fn(work)`` once complete (immediately if already)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def set_result(self, value) -> None:
        """Complete this Work with ``value`` (for a Work made outside the queue, e.g. one that
        resolves when two queued collectives and a step of its own are done); runs the callbacks."""
        self._finish(result=value)

    def set_exception(self, exc: BaseException) -> None:
        """Complete this Work with ``exc``: ``wait()`` raises it; runs the callbacks."""
        self._finish(error=exc)

    def _finish(self, result=None, error: BaseException | None = None) -> None:
        with self._lock:
            self._result, self._error = result, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def __repr__(self) -> str:
        state = "done" if self._done.is_set() else "pending"
        return f"Work({self.description}, {state})"


class OrderedRunner:
    """Runs jobs one at a time in issue order; async jobs on a lazily started thread."""

    def __init__(self, name: str):
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[Callable[[], object], Work]] = deque()
        self._running = False  # a job is executing (inline or on the thread)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._held = False  # queued calls the background thread was not woken for
        self._issuer = threading.local()  # .later: this thread issues waking_later

    def run_sync(self, job: Callable[[], object], describe: Callable[[], str]):
        """Run ``job`` after everything issued before it; return its result."""
        with self._cond:
            inline = not self._queue and not self._running
            if inline:
                self._running = True
        if inline:
            try:
                return job()
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()
        return self.submit(job, describe()).wait()

    def submit(self, job: Callable[[], object], description: str) -> Work:
        """Queue ``job``; the background thread runs it after everything queued before it. Inside
        ``waking_later`` the thread, if idle, is not woken for it (see ``Work.release``)."""
        work = Work(description, self)
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"{self._name}: submit after close")
            self._queue.append((job, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            if getattr(self._issuer, "later", False):
                self._held = True
            else:
                self._held = False
                self._cond.notify_all()
        return work

    @contextlib.contextmanager
    def waking_later(self) -> Iterator[None]:
        """Calls this thread submits inside the block do not wake the background thread; it runs
        them once woken by ``Work.release()`` (or ``wait()``) of any of them, by a later call,
        or by ``drain``. For an issuer that asks for the result's future right after issuing."""
        self._issuer.later = True
        try:
            yield
        finally:
            self._issuer.later = False

    def _wake_if_held(self) -> None:
        if self._held:  # checked before taking the lock: nothing held is the common case
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def _loop(self) -> None:
        run_in_background()  # waits on this thread nap instead of competing for the application's cores
        while True:
            with self._cond:
                while not self._stopping and (not self._queue or self._running):
                    self._cond.wait()
                if not self._queue:
                    return
                job, work = self._queue.popleft()
                self._running = True
            self._execute(job, work)

    def _run_until(self, target: Work) -> None:
        """Run queued jobs on the calling thread, in order, until ``target``'s is done; stop as
        soon as the background thread is running one (it then runs the rest)."""
        while not target._done.is_set():
            with self._cond:
                if self._running or not self._queue:
                    return
                job, work = self._queue.popleft()
                self._running = True
            self._execute(job, work)

    def _execute(self, job: Callable[[], object], work: Work) -> None:
        """Run one dequeued job (``_running`` set) and complete its Work."""
        try:
            result = job()
        except BaseException as e:  # delivered to the waiter, never lost on the thread
            work._finish(error=e)
        else:
            work._finish(result=result)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every issued job has finished."""
        self._wake_if_held()
        with self._cond:
            while self._queue or self._running:
                self._cond.wait()

    def close(self) -> None:
        self.drain()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
