"""Runtime: running collectives, from ``ddl_triton.init`` to the bytes on the transports.

Its top holds the world's life cycle and exit guard (``world``), the ``Communicator``
(``communicator``), what turns a caller's array of any framework (NumPy, anything with
``__dlpack__``) into a torch view and back (``arrays``); the communicator composes four rooms,
each with its own docstring, highest first (who is in an elastic job's world, generation after
generation, is the elastic floor's: ddl_triton/elastic/membership.py):

- ``compression/``: compressed collectives between hosts (int8, 1-bit, per-level);
- ``calls/``: the call path (argument checks, issue order and Work handles, plans, the
  executor, the GPU path);
- ``setup/``: making a communicator (bootstraps, option and table agreement, placement, wiring);
- ``lanes/``: the small-message lanes and the call check that rides them.

A room imports only the rooms below it and the rooms below runtime (planning, observability,
transports, schedules, kernels); tests/unit/test_house.py checks the order.
Runtime is the only room that imports mpi4py at module level; torch is imported at module level by
runtime, kernels and the framework rooms (``import ddl_triton`` loads none of it).
"""
