"""Runtime: running collectives, from ``ddl_triton.init`` to the bytes on the transports.

Here live the world's life cycle and exit guard (``world``), the bootstraps that let ranks find
each other (``bootstrap``), the ``Communicator`` that wires, validates and runs (``communicator``)
with its parts: who is where (``placement``), the transports per peer (``wiring``), the tuning
table every rank agrees on (``table_agreement``), argument checks (``validation``), per-shape plans
(``plan_cache``), the issue order, flight records, trace spans and failures (``issue``, over
``work``'s ordered queue and Work handles), call fingerprints (``fingerprints``), the executor, the
small-message path (``small_allreduce``), the GPU path (``gpu_path``) and the compressed allreduces
(``compressed``). Runtime uses planning, observability, transports, schedules and kernels (and
``tuning.table`` to load the table); it is the only room besides ``ddl_triton.torch`` that imports
torch and mpi4py at module level (``import ddl_triton`` loads none of it).
"""
