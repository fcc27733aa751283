"""ddl_triton.launch: starting jobs. It holds ``ddlrun`` (ddlrun.py: its pre-launch checks,
the mpiexec command it builds, the supervision of the running job and the per-rank report),
the rank guard that runs as the parent of each MPICH rank (rank_guard.py, run as a file), and
the per-rank status-file protocol (status.py) that the ranks, the guard, ddlrun and
observability share. It needs neither torch nor MPI: it imports only the standard library and
``ddl_triton.options``, so that ``ddlrun --help`` and a launch start in a fraction of a second.
"""
