"""The call path: what happens at every collective, from the arguments to the bytes.

A call's arguments are checked (``arguments``), issued in order with a flight record and trace
span (``issue``, ``observing``) on an ordered queue of ``Work`` handles (``work``), planned once
per shape (``plan_cache``) and run by the ``executor`` over the wired transports, with scratch
buffers from ``scratch_pool``; CUDA tensors take the GPU path (``gpu_path``). The call path may
import the set-up and lanes rooms and the rooms below runtime; never compression or the
communicator above it.
"""
