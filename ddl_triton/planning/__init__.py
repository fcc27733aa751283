"""Planning: how a collective will run, decided before it runs.

Here live the topology (the grid of ranks, innermost level first: ranks per node, nodes, ...), the
planner (forced schedule, else the tuning table, else the cost model: one ``Plan`` with its reason)
and the α-β-γ cost model that costs a schedule's steps, and the tuning table's format and loading
(``tuning_table``: the tables that ``ddl_triton.tuning`` writes, read here, by the runtime's table
agreement and by the tuner). Planning imports the schedules of ``schedules/``; it imports no torch at module level
and never talks to other ranks (the runtime agrees on the table across ranks before planning).
"""
