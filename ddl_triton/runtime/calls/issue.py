"""The issue path of a communicator: every collective in issue order, recorded, traced, and
failing loudly.

Semantics:
- ``IssuePath.issue`` runs a collective's job after everything issued before it (inline or
  on the communicator's background thread, work.py), with a flight-recorder record that
  follows it from "issued" through "started" to "done" or "failed" (the record keeps the
  call's shape, never its tensors), and, when a tracer is set, a span on the timeline (and
  an async flow from issue to start for ``async_op`` calls).
- The first failure poisons the path: every later call raises ``CommunicatorPoisoned``
  naming it. Timeouts and mismatches also dump the flight recorder; a timeout marks this
  process as having lost a peer (``peers_lost``), which the exit guard (world.py) reads.
- A closed path refuses every call.
- ``run_inline`` keeps the same record for a call that skips the queue (the synchronous
  small allreduce: the latency path).
"""
from __future__ import annotations

import time

import torch
from mpi4py import MPI

from ...errors import CollectiveMismatch, CollectiveSkipped, CollectiveTimeout, CommunicatorPoisoned, DDLError
from ... import status_files
from ...observability import flight
from ...transports import failure_notice
from .work import OrderedRunner

_PROFILER = torch.autograd  # .profiler._is_profiler_enabled: torch's own fast "is it recording" flag
_LOST_PEERS: list[int] = []  # appended when any communicator of this process lost a peer


def peers_lost() -> bool:
    """True once a collective of this process timed out or lost a peer, or the launcher
    reported that a process of the job ended while this process had not finalized MPI.

    Either way MPI_Finalize, which waits for every rank, would wait for the lost one
    forever. A notice received after MPI_Finalize is not a loss: MPI_Finalize is
    collective, and a peer that passed it and exited cleanly is announced too
    (failure_notice explains hydra's behaviour)."""
    return bool(_LOST_PEERS) or (failure_notice.received_at() is not None and not MPI.Is_finalized())


def forget_lost_peers() -> None:
    """An elastic job re-formed its world without the lost ranks (ddl_triton/elastic/membership.py):
    those losses no longer make the exit guard end the process with exit code 1."""
    _LOST_PEERS.clear()


class IssuePath:
    """The ordered queue, flight records, trace spans and failure state of one communicator.

    ``attach(record)`` tells whoever runs the collectives which call is running (None after): the
    communicator passes its call runner's (running.py: ``CallRunner.attach``) when it is built, so
    that the path only ever calls down, into the runner, never back into the communicator.
    ``tracer``: the timeline (observability/tracer.py) or None; settable. ``timeout``: the
    communicator's (``Options.timeout``), which bounds ``close``'s wait for the queue."""

    def __init__(self, rank: int, comm_id: int, attach, tracer=None, timeout: float | None = None):
        self.rank = rank
        self.timeout = timeout
        self.comm_id = comm_id          # tells this communicator's records from others' in a dump
        self.runner = OrderedRunner(f"ddl_triton-rank{rank}")
        self.tracer = tracer
        self.issued = 0                 # collectives issued (the flight recorder's sequence numbers)
        self.poison: BaseException | None = None
        self.closed = False
        self._attach = attach

    def check_usable(self) -> None:
        """Raise if the path is closed or an earlier collective failed."""
        if self.closed:
            raise DDLError(f"rank {self.rank}: communicator is closed")
        if self.poison is not None:
            raise CommunicatorPoisoned(f"rank {self.rank}: communicator unusable after an earlier failure: "
                                       f"{self.poison}") from self.poison

    def issue(self, job, async_op: bool, call: tuple):
        """Run ``job`` in issue order. ``call`` = (collective, op, input numel, dtype, root): what
        the flight recorder keeps (never the tensors: 2,000 records must not hold 2,000
        buckets alive), and what names the Work handle (ddl_triton/observability/flight.py formats it)."""
        self.issued += 1
        record = flight.RECORDER.issue(self.comm_id, self.issued, call)
        if async_op:
            tracer = self.tracer
            flow = tracer.async_issue(f"{call[0]} #{record.seq}", id(record), self.comm_id) if tracer is not None else 0
            return self.runner.submit(lambda: self._guarded(job, record, flow), flight.describe(call))
        return self.runner.run_sync(lambda: self._guarded(job, record, 0), lambda: flight.describe(call))

    def run_inline(self, call: tuple, schedule: str, run, *args) -> None:
        """``run(*args)`` now, on this thread, recorded as ``call`` on ``schedule`` like an issued
        call but without the queue (the caller checked that nothing is queued or running)."""
        self.issued += 1
        record = flight.RECORDER.issue(self.comm_id, self.issued, call)
        record.state, record.t_start, record.schedule = "started", record.t_issue, schedule
        try:
            run(*args)
        except Exception as e:
            self.raise_failure(record, e)
        finally:
            record.t_end = time.time()
        record.state = "done"

    def close(self) -> None:
        """Finish queued work, then refuse every later call. A queue stuck for ``timeout`` raises
        ``CollectiveTimeout`` (work.py: ``OrderedRunner.close``); the path is closed all the same."""
        try:
            self.runner.close(self.timeout)
        finally:
            self.closed = True

    def _guarded(self, job, record, flow: int = 0):
        """Run one collective with its record kept current; errors poison the communicator
        (timeouts and mismatches also dump the flight recorder)."""
        record.state = "started"
        record.t_start = time.time()
        self._attach(record)
        tracer = self.tracer
        t0 = 0.0 if tracer is None else time.perf_counter()
        try:
            self.check_usable()  # an earlier queued collective may have failed
            if tracer is not None and flow:
                tracer.async_start(flow)
            if _PROFILER.profiler._is_profiler_enabled:  # torch.profiler is recording: appear in its trace
                with torch.autograd.profiler.record_function(f"ddl:{flight.describe(record.call)} #{record.seq}"):
                    result = job()
            else:
                result = job()
        except Exception as e:
            self.raise_failure(record, e)
        else:
            record.state = "done"
            return result
        finally:
            record.t_end = time.time()
            self._attach(None)
            if tracer is not None:
                self._trace_call(tracer, record, t0, flow)

    def raise_failure(self, record, e: Exception):
        """Mark ``record``'s collective failed with ``e``, poison the communicator, and raise
        ``e`` (a DDLError wrapping it when it is unexpected). Timeouts and mismatches also
        dump the flight recorder."""
        self._fail(record, e)
        if isinstance(e, (CollectiveTimeout, CollectiveMismatch)):
            if isinstance(e, CollectiveTimeout):
                record.waiting = flight.stuck_wait()
                _LOST_PEERS.append(self.rank)  # MPI_Finalize would wait for the lost rank: skip it at exit
            elif isinstance(e, CollectiveSkipped):  # `trace why` names the rank that never issued the call
                record.left = {"rank": e.peer, "did": e.did, "calls": e.calls, "failed": e.failed}
            path = flight.RECORDER.dump(f"{type(e).__name__}: {e}")
            if path:
                e.args = (f"{e.args[0]} [flight recorder: {path}]",) + e.args[1:]
        if isinstance(e, DDLError):
            status_files.error(str(e))
            raise e
        raise DDLError(f"rank {self.rank}: collective failed: {e!r}") from e

    def _fail(self, record, error: BaseException) -> None:
        if self.poison is None:  # the first failure is the cause; later refusals only repeat it
            self.poison = error
        record.state = "failed"
        record.error = str(error)

    def _trace_call(self, tracer, record, t0: float, flow: int) -> None:
        info = record.to_json()
        tracer.span(f"{info['collective']} #{record.seq}", tracer.us(t0), tracer.now(), "ddl.collective",
                    {"seq": record.seq, "bytes": info["bytes"], "schedule": record.schedule, "call": info["call"],
                     "dtype": info["dtype"], "site": info["site"], "state": record.state, "comm": self.comm_id})
        if flow:
            tracer.async_done(f"{info['collective']} #{record.seq}", id(record))
