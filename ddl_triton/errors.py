"""Errors ddl_triton raises beyond ValueError/TypeError for bad input."""
from __future__ import annotations


class DDLError(RuntimeError):
    """Base class of ddl_triton's runtime failures."""


class CollectiveTimeout(DDLError):
    """A wait passed its deadline: a peer is slow, dead, or called a different collective.

    The communicator that raised it is poisoned: every later call raises at once,
    because the peers' state is unknown and a retry could pair mismatched messages.
    """


class CommunicatorPoisoned(DDLError):
    """A previous collective on this communicator failed; it cannot be used again."""


class CollectiveMismatch(DDLError):
    """Ranks called different collectives (or the same one with different arguments) as the
    same call in sequence. Raised on every rank, with what each rank called."""
