"""ddl_triton.launch: starting jobs. It holds ``ddlrun`` (ddlrun.py: its pre-launch checks,
the mpiexec command it builds, the supervision of the running job and the per-rank report),
the rank guard that runs as the parent of each MPICH rank (rank_guard.py, run as a file), and
the detectors that find, from a launcher's own variables, the world a process belongs to
(launchers.py, launcher_detectors.py, slurm_nodelist.py; mpi_start.py has MPI start as a world of
one where that world is not MPI's: the runtime reads them, ``import ddl_triton`` installs it); the
per-rank status-file protocol they share with the ranks and observability sits below every room,
in ddl_triton/status_files.py. It needs neither torch nor MPI: it imports only the standard library,
``ddl_triton.options`` and that protocol, so that ``ddlrun --help`` and a launch start in a fraction of a second.
"""
