"""Tuning: measuring what is fast on this machine, and remembering it.

Here live ``ddl-tune`` (``cli``: the command line; ``sweep``: every call shape raced into rows;
``candidates``: what is timed; ``race``: how candidates are timed against each other;
``decisions``: the table those rows decide; ``model_check``: the fitted model checked at sizes the
sweep skipped; ``fit``: the least-squares cost-model fit; ``plot``; ``auto_compression``: whether
per-level compression pays, per size, from the table or a probe of the link), the timing harness that
``ddl-tune`` and bench/ share (``timing``). Tuning writes the table that planning reads: the
table's schema, machine key, cache folder and loading live below, in
ddl_triton/planning/tuning_table.py, so that planning and runtime read it without the tuner. The
tuner itself uses runtime to time candidates (communicators forced to each candidate's plan,
through their public ``forcing``, ``planner`` and ``placement``) and planning's ``Plan``,
``Planner`` and cost model to decide and predict; the other rooms import only ``auto_compression``
(the rule ``Options.compression="auto"`` follows), never the tuner. No module here imports torch
or MPI at module level.
"""
