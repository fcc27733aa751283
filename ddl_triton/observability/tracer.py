"""The timeline: Chrome trace events for every collective and every step it runs.

Semantics: with ``Options.trace`` / ``DDL_TRACE=DIR``, each rank writes
``DIR/trace-rank<R>.json`` (the Chrome trace event format, which Perfetto and
chrome://tracing open) when its world communicator closes or the process exits. ``DIR`` is
created 0700 if missing; the file is a new one of mode 0600 renamed onto that name, so a link
planted there is replaced, never written through (ddl_triton/_private_files.py). The timeline:

- one complete event ("X") per collective on the thread that ran it, named
  "allreduce #57", with bytes, schedule, dtype, sequence number and call site;
- nested "X" events per schedule step, named by the step's label ("rs[2] chunk 5"), with
  the peers, bytes, and its phases as children: ``wait`` (a slot to send from, messages to
  arrive), ``reduce`` or ``copy``, ``send`` (publish);
- async collectives: an async span ("b"/"e") from issue to completion on the issuing
  thread, and a flow arrow ("s"/"f") from the issue to the span that ran it;
- thread names ("M" events), so the executor's thread shows as "ddl_triton-rank0";
- on the GPU path, a span per collective timed by CUDA events (category "gpu").

Timestamps are microseconds on this rank's clock: wall time at the tracer's start plus
``perf_counter`` since. At init the world communicator measures this rank's offset to
rank 0 by ping-pong (the sample with the shortest round trip wins; its half round trip is
the error bound) and stores both in the file; ``python -m ddl_triton.trace merge`` applies
the offsets and reports the bound.

The buffer is bounded (``MAX_EVENTS``; the oldest events are dropped and counted).
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections import deque

from .._private_files import chosen_folder, write_private_file

MAX_EVENTS = 2_000_000


class Tracer:
    def __init__(self, folder: str, rank: int, size: int):
        self.folder, self.rank, self.size = folder, rank, size
        self.events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self.appended = 0
        self.clock_offset_us = 0.0   # add to this rank's timestamps to get rank 0's clock
        self.offset_bound_us = 0.0
        self._wall0 = time.time()
        self._pc0 = time.perf_counter()
        self._threads: set[int] = set()
        self._cuda: list[tuple] = []
        self._cuda_ref = None
        self._flow = 0
        self._lock = threading.Lock()
        self.path = os.path.join(folder, f"trace-rank{rank}.json")
        atexit.register(self.flush)

    def now(self) -> float:
        """Microseconds on this rank's trace clock."""
        return (self._wall0 + (time.perf_counter() - self._pc0)) * 1e6

    def us(self, perf: float) -> float:
        """A ``time.perf_counter()`` reading on the trace clock."""
        return (self._wall0 + (perf - self._pc0)) * 1e6

    def _tid(self) -> int:
        tid = threading.get_ident()
        if tid not in self._threads:
            self._threads.add(tid)
            self._add({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid,
                       "args": {"name": threading.current_thread().name}})
        return tid

    def _add(self, event: dict) -> None:
        self.events.append(event)
        self.appended += 1

    def span(self, name: str, start_us: float, end_us: float, cat: str = "ddl", args: dict | None = None) -> None:
        event = {"ph": "X", "name": name, "cat": cat, "pid": self.rank, "tid": self._tid(), "ts": start_us,
                 "dur": max(0.0, end_us - start_us)}
        if args:
            event["args"] = args
        self._add(event)

    def async_issue(self, name: str, ident: int, comm: int) -> int:
        """On the issuing thread: the async span's start and a flow's start; returns the flow id."""
        with self._lock:
            self._flow += 1
            flow = self._flow
        ts, tid = self.now(), self._tid()
        self._add({"ph": "b", "name": name, "cat": "ddl.async", "id": ident, "pid": self.rank, "tid": tid, "ts": ts,
                   "args": {"comm": comm}})
        self._add({"ph": "s", "name": "issue", "cat": "ddl.flow", "id": flow, "pid": self.rank, "tid": tid, "ts": ts})
        return flow

    def async_start(self, flow: int) -> None:
        """On the running thread, where the collective's span starts: the flow's end."""
        self._add({"ph": "f", "bp": "e", "name": "issue", "cat": "ddl.flow", "id": flow, "pid": self.rank,
                   "tid": self._tid(), "ts": self.now()})

    def async_done(self, name: str, ident: int) -> None:
        self._add({"ph": "e", "name": name, "cat": "ddl.async", "id": ident, "pid": self.rank, "tid": self._tid(),
                   "ts": self.now()})

    def cuda_span(self, name: str, start_event, end_event, args: dict) -> None:
        """A GPU collective timed by two CUDA events, resolved at flush (no sync here)."""
        if self._cuda_ref is None:
            import torch
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            self._cuda_ref = (ref, self.now())
        self._cuda.append((name, start_event, end_event, args))

    def flush(self) -> str:
        """Write the file (idempotent: later events are appended to a rewrite)."""
        events = list(self.events)
        if self._cuda and self._cuda_ref is not None:
            ref, ref_us = self._cuda_ref
            ref.synchronize()
            for name, start, end, args in self._cuda:
                end.synchronize()
                t0 = ref_us + ref.elapsed_time(start) * 1e3
                events.append({"ph": "X", "name": name, "cat": "gpu", "pid": self.rank, "tid": "gpu stream",
                               "ts": t0, "dur": start.elapsed_time(end) * 1e3, "args": args})
        meta = {"ph": "M", "name": "process_name", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}
        data = {"traceEvents": [meta] + events, "displayTimeUnit": "ms",
                "metadata": {"format": "ddl_triton-trace", "rank": self.rank, "size": self.size,
                             "clock_offset_us": self.clock_offset_us, "offset_bound_us": self.offset_bound_us,
                             "dropped_events": max(0, self.appended - len(self.events))}}
        try:
            chosen_folder(self.folder)
            write_private_file(self.path, json.dumps(data))
        except OSError:
            return ""
        return self.path


def measure_clock_offset(comm, tracer: Tracer, rounds: int = 20) -> None:
    """Ping-pong with rank 0 of ``comm`` (an mpi4py communicator; collective): set the
    tracer's offset to rank 0's clock from the sample with the shortest round trip, and its
    error bound to half that round trip."""
    import numpy as np

    rank, size = comm.Get_rank(), comm.Get_size()
    buf = np.zeros(1, dtype=np.float64)
    for peer in range(1, size):
        if rank == 0:
            for _ in range(rounds):
                comm.Recv(buf, source=peer, tag=7301)
                buf[0] = tracer.now()
                comm.Send(buf, dest=peer, tag=7302)
        elif rank == peer:
            best = None
            for _ in range(rounds):
                t1 = tracer.now()
                comm.Send(buf, dest=0, tag=7301)
                comm.Recv(buf, source=0, tag=7302)
                t2 = tracer.now()
                if best is None or t2 - t1 < best[0]:
                    best = (t2 - t1, float(buf[0]) - (t1 + t2) / 2)
            tracer.offset_bound_us, tracer.clock_offset_us = best[0] / 2, best[1]
        comm.Barrier()


# One tracer per trace folder in this process, shared by every communicator that traces there.
TRACERS: dict[str, Tracer] = {}
