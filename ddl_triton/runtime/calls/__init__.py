"""The call path: what happens at every collective, from the arguments to the bytes.

A call's arguments are checked (``arguments``), issued in order with a flight record and trace
span (``issue``, ``observing``) on an ordered queue of ``Work`` handles (``work``), and handed,
as a ``Call`` value, to the runner (``running``), which numbers it, plans it once per shape
(``plan_cache``), brackets it with the call check and runs it on the small-message path, the
``executor`` over the wired transports (scratch buffers from ``scratch_pool``) or, for CUDA
tensors, the GPU path (``gpu_path``). Each layer calls only the one below it. The call path may
import the set-up and lanes rooms and the rooms below runtime; never compression or the
communicator above it.
"""
