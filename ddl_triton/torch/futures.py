"""Work and futures of the "ddl" backend: how a ddl_triton collective becomes a torch ``Work``.

Semantics: every operation of the backend returns a torch ``Work`` whose ``wait()`` blocks
until the operation is done and re-raises its error as raised, and whose ``get_future()``
resolves with the output tensors, after the copy-back (``finish``) that staged operations
need, or fails with the error, as a true C++ future error that DDP's waiters see too.

    torch_work(ddl_works, outputs, finish)   one Work for ddl_triton Works (or a point-to-point job)
    then(torch_work, outputs, finish)        a Work done after another Work and a copy-back
    join_torch_works(torch_works, outputs)   one Work for several
    completed_work(outputs)                  a Work already done (synchronous calls)

Callbacks run on ddl_triton's background threads, which must survive a failing callback:
so a failing copy-back goes to the future, never up the thread.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from .compile_boundary import eager_methods


class Promise:
    """A torch Future to complete from Python with a result or a real (C++-visible) error.

    ``torch.futures.Future.set_exception`` only stores the exception as the value, so C++ waiters
    (Work.wait, DDP) would take it for a result; an error raised in a ``then`` callback is a true
    future error. So: complete ``_source`` with the outputs or a ``_Failure``; ``future`` unwraps."""

    def __init__(self):
        self._source = torch.futures.Future()
        self.future = self._source.then(_unwrap)
        self.error: BaseException | None = None  # as raised, for Work.wait to re-raise

    def settle(self, error, finish=None, outputs=()) -> None:
        """Run ``finish`` (copy-back) then resolve with ``outputs``, or fail with ``error`` (or what
        ``finish`` raised). Never raises: it runs on ddl_triton's background threads, which must
        survive a failing callback."""
        try:
            if error is None and finish is not None:
                finish()
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            error = e
        self.error = error
        try:
            self._source.set_result(_Failure(error) if error is not None else outputs)
        except BaseException:  # noqa: BLE001 - a failing torch callback is torch's to report
            pass

    def work(self):
        return FutureWork(self.future, self)


@eager_methods  # like the group's methods, never traced by torch.compile (compile_boundary.py)
class FutureWork(dist.Work):
    """The torch Work of one call: ``wait()`` blocks until ``future`` resolves and re-raises its
    error as raised (a Work from ``_create_work_from_future`` would swallow it; the future itself
    carries it as a RuntimeError quoting it); ``get_future()`` is ``future``."""

    def __init__(self, future, promise: Promise | None = None):
        super().__init__()
        self._future = future
        self._promise = promise
        self.source = None  # a receive from any source: a callable giving the sender's rank once done
        self.parts = ()  # what it is done after: ddl_triton Works or other FutureWorks (see run_here)

    def run_here(self) -> None:
        """Run, on the calling thread, the queued ddl_triton calls this Work waits for, where no
        background thread has started them (ddl_triton.work.Work.run_here)."""
        for part in self.parts:
            part.run_here()

    def release(self) -> None:
        """Wake the background thread for the calls this Work waits for, where they were issued
        without waking it (ddl_triton.work.Work.release)."""
        for part in self.parts:
            part.release()

    def _source_rank(self) -> int:
        """The rank a receive from any source got its message from (torch's ``recv(src=None)``)."""
        self.wait()
        if self.source is None:
            raise RuntimeError("ddl backend: _source_rank() of a Work that is not a receive from any source")
        return self.source()

    def wait(self, timeout=None) -> bool:
        """Block until done (ddl_triton's own deadline, DDL_TIMEOUT, bounds the wait); raise its error."""
        try:
            self.run_here()
            self._future.wait()
        except Exception:
            original = self._promise.error if self._promise is not None else None
            if isinstance(original, Exception):
                raise original from None
            raise
        return True

    def get_future(self):
        self.release()  # whoever asks for the future will wait for it
        return self._future

    def is_completed(self) -> bool:
        if self._future.done():
            return True
        self.release()  # a caller polling it expects progress
        return False

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.wait()
        except Exception:  # noqa: BLE001
            return False
        return True

    def result(self):
        return self._future.wait()


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _unwrap(source):
    value = source.value()
    if isinstance(value, _Failure):
        raise value.error if isinstance(value.error, Exception) else RuntimeError(repr(value.error))
    return value


def torch_work(works, outputs, finish=None):
    """A torch Work whose future gets ``outputs`` once every ddl Work of ``works`` is done and
    ``finish()`` (copy-back) has run; any error goes to the future instead.

    ``works`` may also be a function that issues them and returns them: it is called only once
    the torch Work exists. Issuing hands the job to the communicator's thread, which then holds
    the GIL for stretches, while building torch futures needs it too: building them first keeps
    the issuing thread (DDP's backward) from waiting for the GIL behind its own collective."""
    promise = Promise()
    work = promise.work()
    works = works() if callable(works) else works
    works = works if isinstance(works, list) else [works]

    def done():
        error = next((w.exception() for w in works if w.exception() is not None), None)
        promise.settle(error, finish, outputs)

    _when_all(works, done)
    work.parts = works
    return work


def _when_all(works, callback) -> None:
    """Call ``callback()`` once every ddl Work in ``works`` is complete (at once if none)."""
    if not works:
        callback()
        return
    remaining = [len(works)]
    lock = threading.Lock()

    def one(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            callback()

    for w in works:
        w.add_done_callback(one)


def completed_work(outputs):
    fut = torch.futures.Future()
    fut.set_result(outputs)
    return FutureWork(fut)


def then(torch_work, outputs, finish=None):
    """A Work completed after ``torch_work`` and ``finish()``, with ``outputs`` as its result."""
    promise = Promise()

    def done(_):
        try:
            torch_work.wait()  # done already: this only re-raises its error, as raised
        except Exception as e:  # noqa: BLE001
            promise.settle(e)
            return
        promise.settle(None, finish, outputs)

    torch_work.get_future().add_done_callback(done)
    work = promise.work()
    work.parts = (torch_work,)
    return work


def join_torch_works(torch_works, outputs):
    """One Work for several torch Works: done when all are, with ``outputs`` as its result."""
    if not torch_works:
        return completed_work(outputs)
    promise = Promise()

    def done(_):
        error = None
        for w in torch_works:
            try:
                w.wait()  # done already: this only re-raises its error, as raised
            except Exception as e:  # noqa: BLE001
                error = error or e
        promise.settle(error, None, outputs)

    torch.futures.collect_all([w.get_future() for w in torch_works]).add_done_callback(done)
    work = promise.work()
    work.parts = tuple(torch_works)
    return work

