"""What a new communicator turns on to be observed: the flight recorder, the timeline, debug lines.

Semantics of ``start_observing``:
- the flight recorder (always on) is configured for this process's world rank the first
  time, or again by a communicator spanning the world, and SIGUSR2 dumps it; a communicator
  spanning the world agrees on the job's id first (setup/job_id.py: the recorder's default dump
  folder is named after it), collectively, before any call;
- with ``Options.trace`` set, the named timeline's tracer is returned: the one this process
  already has under that name, else a new one, whose clock every rank aligns here (a
  collective step over the control channel);
- with ``Options.debug``, one stderr line names the communicator, its topology and each
  peer's transport, and rank 0 adds the tuning table and cost model it plans with.
"""
from __future__ import annotations

import sys

from ...observability import flight
from ...observability import tracer as tracer_mod
from ...options import Options
from ...planning.planner import Planner
from ..setup.job_id import agree_on_job_id, fresh_job_id
from ..setup.placement import Placement


def start_observing(bootstrap, placement: Placement, options: Options, planner: Planner, control,
                    comm_id: int):
    """Configure observation for communicator ``comm_id`` (see the module doc); the tracer or None."""
    world_rank, world_size = bootstrap.world_rank, bootstrap.world_size
    rank, size = placement.rank, placement.size
    spans_the_job = size == world_size  # the same on every rank: the agreement below is collective
    if flight.RECORDER.rank < 0 or spans_the_job:
        known = flight.RECORDER.job
        job = "" if not spans_the_job else agree_on_job_id(bootstrap, known) if size > 1 else known or fresh_job_id()
        flight.RECORDER.configure(rank=world_rank, size=world_size, capacity=options.flight_entries,
                                  dump_dir=options.dump_dir, job=job)
        flight.RECORDER.install_sigusr2()
    tracer = None
    if options.trace:
        tracer = tracer_mod.TRACERS.get(options.trace)
        if tracer is None:
            tracer = tracer_mod.Tracer(options.trace, world_rank, world_size)
            if control is not None:  # (none on a store bootstrap of one rank: nothing to align)
                tracer_mod.measure_clock_offset(control, tracer)  # collective: every rank starts tracing here
            tracer_mod.TRACERS[options.trace] = tracer
    if options.debug:
        peers = ", ".join(f"{p}: {name}" for p, name in enumerate(placement.links))
        print(f"ddl_triton[rank {rank}]: communicator #{comm_id} of {size} ranks, topology "
              f"{placement.topology.signature}; transport per peer: {peers}", file=sys.stderr, flush=True)
        if rank == 0:
            table = planner.table
            print(f"ddl_triton[rank 0]: tuning table: {planner.table_source if table else 'none'}; "
                  f"planning with {planner.model_source}", file=sys.stderr, flush=True)
    return tracer
