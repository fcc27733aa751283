"""Observability: what happened, and why a job is stuck.

Here live the flight recorder (the last collectives of every rank, dumped on a timeout, a mismatch
or SIGUSR2), the tracer (a Chrome-trace timeline per rank, with clock alignment), the diagnosis of
dumps from many ranks, and the ``python -m ddl_triton.trace`` command (merge, summary, plot, why).
It needs neither torch nor MPI, so its tools run where the job's output was copied to; it may
import the transports' wait bookkeeping and the status-file protocol (``ddl_triton.status_files``).
"""
