"""Testbed: real hosts on one Linux machine, so that every "between nodes" claim crosses a socket.

Here live the hosts themselves (``hosts``: a network namespace per host on a shared bridge, its
own hostname, ``/dev/shm``, ``/tmp`` and boot id, links shaped with ``tbf``; built and torn down
by :class:`Testbed`, a context manager), the ``ddl-testbed`` command line (``cli``: up, exec, list,
down), and the stand-in for ssh that lets MPICH's ssh launcher start ranks on a testbed host
(``ssh``). It needs root and namespaces, and neither torch nor MPI: it imports only the standard
library, and sends traffic only between the namespaces it made, on the addresses it assigned.
"""
from .hosts import Testbed, TestbedUnavailable, check_available, reap

__all__ = ["Testbed", "TestbedUnavailable", "check_available", "reap"]
