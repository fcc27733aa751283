"""Set-up: making a communicator, once, before any call runs.

The ranks find each other (``bootstrap``: MPI or a torch store; the values they exchange are
checked JSON, ``bootstrap_values``; a ``roll_call`` names who did not arrive), agree on their
options (``option_agreement``), tuning table (``table_agreement``) and job id (``job_id``), learn who shares a host
(``placement``) and open one transport per peer (``wiring``); ``mpich_segment`` keeps MPICH's
init segment from outliving a failed job. Set-up may import the lanes room (wiring opens the call
lane) and the rooms below runtime (transports, planning, tuning's table, kernels); never the call
path or compression.
"""
