"""Testbed: real hosts on one Linux machine, so that every "between nodes" claim crosses a socket.

Here live the hosts themselves (``hosts``: a network namespace per host on a shared bridge, its
own hostname, PID namespace, ``/dev/shm``, ``/tmp`` and boot id, links shaped with ``tbf``; built
and torn down by :class:`Testbed`, a context manager, with ``holder``, each host's init), the
processes of hosts seen from the machine (``processes``), where the testbed keeps its state and its
one rule for names (``state``), the ``ddl-testbed`` command line (``cli``: up, exec, list, down),
and the stand-in for ssh that lets MPICH's ssh launcher start ranks on a testbed host (``ssh``),
through the testbed's own sshd (``relay``). It needs root and namespaces, and neither torch nor MPI: it imports only the standard
library, and sends traffic only between the namespaces it made, on the addresses it assigned.
"""
from .hosts import Testbed, TestbedUnavailable, check_available, reap

__all__ = ["Testbed", "TestbedUnavailable", "check_available", "reap"]
