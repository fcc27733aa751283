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

Callbacks (``Work.add_done_callback``) run when the Work completes, on the thread that completed
it, before the queue moves on (the composite collectives chain their steps this way). A callback
may issue further calls and wait for them, as torch's PowerSGD hook does in its ``Future.then``
callbacks: a call issued from inside a running call (its job or its callbacks, on the thread
running it) joins the queue right after that call, ahead of every call issued from outside, in
the order issued, and a wait for it on that thread runs it there, nested, with the queued calls
before it. The order is then fixed by the program, not by timing: a call issued from a callback
runs right after the call whose completion ran the callback, on every rank, whether that call
completed before or after others were issued (as long as the callback was registered before any
further call was issued, which every DDP hook does: it returns ``fut.then(...)`` at once). A callback
that raises an ``Exception`` changes nothing: not its Work, which is complete and whose waiters may
already hold its result, nor the queue, whose state a callback cannot reach. The error is printed
to stderr with the Work's name and the traceback, and the other callbacks and the later calls run
as usual. This is what ``torch.futures.Future.add_done_callback`` does (NCCL's Work futures
included); a caller that wants a callback's error delivered chains a Work whose waiter gets it
(``Future.then``; ddl_triton/torch/futures.py). Anything else that escapes on the background
thread (a ``BaseException`` such as ``SystemExit`` from a callback, or a bug) stops the queue
loudly: every queued call fails with a ``DDLError`` naming the cause, later calls raise it, and
``drain``/``close`` return.

No wait without a deadline: ``drain(timeout)`` and ``close(timeout)`` (the communicator passes its
``Options.timeout``) raise ``CollectiveTimeout`` when no call has finished for ``timeout`` seconds;
``close`` then fails the calls still queued with that error and leaves the stuck one to its thread.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections import deque
from typing import Callable, Iterator

from ...errors import CollectiveTimeout, DDLError, queue_stuck
from ...transports.waits import run_in_background


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
        has woken it since; otherwise do nothing. On the thread running a call (a callback of it
        asking for this call's future, which it may wait for where no ``run_here`` is reached, as
        ``torch.futures.Future.wait`` does), run it there, nested: no other thread can meanwhile."""
        if self._runner is not None and not self._done.is_set():
            self._runner._release(self)

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
        """Call ``fn(work)`` once complete (immediately if already). If ``fn`` raises an
        ``Exception``, it is printed and ignored, as ``torch.futures.Future.add_done_callback``
        does (see the module doc): the Work and the queue go on."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._call_back(fn)

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
        escaped = None
        for fn in callbacks:  # all of them, whatever one raises: a composite Work may be waiting on a later one
            try:
                self._call_back(fn)
            except BaseException as e:  # noqa: BLE001 - re-raised below, once every callback ran
                escaped = escaped or e
        if escaped is not None:
            raise escaped

    def _call_back(self, fn: Callable[["Work"], None]) -> None:
        try:
            fn(self)
        except Exception as e:  # noqa: BLE001 - printed, not raised: see the module doc
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            print(f"ddl_triton: a done-callback of {self.description} raised; ignored (the Work and the "
                  f"later calls are unaffected, as with torch.futures):\n{text}", end="", file=sys.stderr, flush=True)

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
        self._finished = 0  # jobs run to the end: drain's deadline counts from the latest
        self._current: Work | None = None  # the running job's Work (None for an inline run_sync)
        self._owner: int | None = None  # the thread running the job (set with _running)
        self._front = 0  # queued calls issued from inside a running call: they run before the others
        self._broken: DDLError | None = None  # why the background thread stopped (see the module doc)

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing running, read without the lock: the synchronous fast entry
        asks at every call, where the lock would cost more than the check. Exact for the thread
        that issues the calls (only an issuer adds to the queue, and a job that ends cannot start
        again); a thread that issues while another runs a call inline is not ordered by it."""
        return not self._queue and not self._running

    def run_sync(self, job: Callable[[], object], describe: Callable[[], str]):
        """Run ``job`` after everything issued before it; return its result."""
        with self._cond:
            self._check_unbroken()
            inline = not self._queue and not self._running
            if inline:
                self._running, self._owner = True, threading.get_ident()
        if inline:
            try:
                return job()
            finally:
                with self._cond:
                    self._running, self._owner, self._front = False, None, 0
                    self._cond.notify_all()
        return self.submit(job, describe()).wait()

    def submit(self, job: Callable[[], object], description: str) -> Work:
        """Queue ``job``; the background thread runs it after everything queued before it. Inside
        ``waking_later`` the thread, if idle, is not woken for it (see ``Work.release``)."""
        work = Work(description, self)
        with self._cond:
            self._check_unbroken()
            if self._stopping:
                raise RuntimeError(f"{self._name}: submit after close")
            if self._running and self._owner == threading.get_ident():
                # issued from inside the running call (a callback of it): next, after the calls its
                # callbacks issued before, ahead of every call issued from outside (module doc)
                self._queue.insert(self._front, (job, work))
                self._front += 1
            else:
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

    def _release(self, work: Work) -> None:
        """``Work.release``: nested on the thread running a call (only this thread sets or clears
        ``_owner`` to itself, so the unlocked read is exact), else wake the background thread."""
        if self._running and self._owner == threading.get_ident():
            self._run_until(work)
        else:
            self._wake_if_held()

    def _wake_if_held(self) -> None:
        if self._held:  # checked before taking the lock: nothing held is the common case
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def _check_unbroken(self) -> None:
        if self._broken is not None:  # a new error each time: one raised in many places grows one traceback
            raise DDLError(*self._broken.args) from self._broken.__cause__

    def _loop(self) -> None:
        try:
            run_in_background()  # waits on this thread nap instead of competing for the application's cores
            while True:
                with self._cond:
                    while not self._stopping and (not self._queue or self._running):
                        self._cond.wait()
                    if not self._queue:
                        return
                    job, work = self._pop()
                    self._running, self._owner = True, threading.get_ident()
                self._execute(job, work)
        except BaseException as e:  # noqa: BLE001 - never a silent death that leaves waiters waiting
            self._break(e)

    def _break(self, cause: BaseException) -> None:
        """The background thread cannot go on: fail every queued call, and every later one, with
        an error naming ``cause``; say so on stderr."""
        error = DDLError(f"{self._name}: the thread running async calls stopped: {cause!r}; "
                         "no queued or later call on this communicator will run")
        error.__cause__ = cause
        with self._cond:
            self._broken = error
            queued = [work for _, work in self._queue]
            self._queue.clear()
            self._front = 0
            self._cond.notify_all()
        text = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
        print(f"ddl_triton: {error}\n{text}", end="", file=sys.stderr, flush=True)
        for work in queued:
            work._finish(error=error)

    def _run_until(self, target: Work) -> None:
        """Run queued jobs on the calling thread, in order, until ``target``'s is done; stop as
        soon as another thread is running one (it then runs the rest). The thread running a call
        may wait here from inside it (a callback waiting for a call it issued): it runs the
        queued jobs nested, in order, as no other thread can while its call runs."""
        me = threading.get_ident()
        while not target._done.is_set():
            with self._cond:
                nested = self._running and self._owner == me
                if (self._running and not nested) or not self._queue:
                    return
                job, work = self._pop()
                if not nested:
                    self._running, self._owner = True, me
            self._execute(job, work, nested)

    def _pop(self) -> tuple[Callable[[], object], Work]:
        """The next queued job (the lock held)."""
        if self._front:
            self._front -= 1
        return self._queue.popleft()

    def _execute(self, job: Callable[[], object], work: Work, nested: bool = False) -> None:
        """Run one dequeued job (``_running`` set, by this thread) and complete its Work. Nested:
        inside another call's job or callbacks on this thread, which keeps the running slot."""
        outer, self._current = self._current, work
        try:
            result = job()
        except BaseException as e:  # delivered to the waiter, never lost on the thread
            work._finish(error=e)
        else:
            work._finish(result=result)
        finally:
            with self._cond:
                self._current = outer
                if not nested:
                    self._running, self._owner = False, None
                self._finished += 1
                self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every issued job has finished. With ``timeout``: raise ``CollectiveTimeout``
        once no job has finished for ``timeout`` seconds (each collective bounds its own waits by
        the communicator's timeout, so a queue that stalls that long is stuck, not slow)."""
        self._wake_if_held()
        if self._running and self._owner == threading.get_ident():
            # from inside a running call (a callback): it cannot wait for itself, but runs the rest
            while self._queue:
                self._run_until(self._queue[-1][1])
            return
        with self._cond:
            finished, since = self._finished, time.monotonic()
            while self._queue or self._running:
                if timeout is None:
                    self._cond.wait()
                    continue
                if self._finished != finished:
                    finished, since = self._finished, time.monotonic()
                left = since + timeout - time.monotonic()
                if left <= 0:
                    running = self._current.description if self._current is not None else "a synchronous call"
                    raise queue_stuck(self._name, running, len(self._queue), timeout)
                self._cond.wait(left)

    def close(self, timeout: float | None = None) -> None:
        """Finish every issued job (``drain``), then stop the background thread. With ``timeout``,
        a stuck queue raises ``drain``'s ``CollectiveTimeout``; the calls still queued fail with it,
        and the stuck one is left to its (daemon) thread: nothing more is waited for."""
        try:
            self.drain(timeout)
        except CollectiveTimeout as e:
            with self._cond:
                self._stopping = True
                queued = [work for _, work in self._queue]
                self._queue.clear()
                self._front = 0
                self._cond.notify_all()
            for work in queued:
                work._finish(error=e)
            raise
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)  # the queue is empty: it leaves at once
            self._thread = None
