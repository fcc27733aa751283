"""ddl_triton.launch: starting jobs. It holds ``ddlrun`` (ddlrun.py: its pre-launch checks,
the mpiexec command it builds, the supervision of the running job and the per-rank report),
and the rank guard that runs as the parent of each MPICH rank (rank_guard.py, run as a file); the
per-rank status-file protocol they share with the ranks and observability sits below every room,
in ddl_triton/status_files.py. It needs neither torch nor MPI: it imports only the standard library,
``ddl_triton.options`` and that protocol, so that ``ddlrun --help`` and a launch start in a fraction of a second.
"""
