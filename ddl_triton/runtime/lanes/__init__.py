"""The lanes: one small message per peer per collective, carrying the call check and small data.

``call_check`` compares every call's fingerprint (``fingerprint``: its 6 integers and their
words) across ranks before it runs; over shared memory
it rides a flag word (``small_allreduce``), across two-sided links the call lane (``call_lane``)
carries it, over MPI or its own authenticated TCP sockets (``lane_sockets``, ``lane_handshake``),
together with a small allreduce's data (``small_allreduce_two_sided``). ``farewell`` is what a rank
says on both when it leaves a communicator, so that a peer waiting for a call it never issued
raises at once. The lanes are the lowest
room of runtime: they import only the rooms below runtime (transports, errors, ops).
"""
