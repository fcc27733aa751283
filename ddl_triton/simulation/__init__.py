"""Simulation: predict what no machine here can run.

Here live the ``python -m ddl_triton.simulate`` command, the iteration model (a training step's
compute, its gradient buckets and their overlapped allreduces on a cluster), the clusters
(``clusters/*.toml``: published link and compute facts, e.g. Minsky, Big Basin; this machine and
its testbed's hosts, calibrated; ``shaped_link``: host links shaped by a token bucket;
``across_hosts``: predictions across the testbed's hosts) and the workloads
(``models/*.json`` layer tables, or any ``torch.nn.Module`` traced). It costs the same schedules the
executor runs, with ``ddl_triton.planning``'s cost model, and may read a tuning table's fitted model;
it never starts ranks itself, except to probe this machine through ``ddl-tune``.
"""
