"""The job's id: one name that every rank of a job holds, and no other job, agreed at init.

Semantics: ``agree_on_job_id(bootstrap, known)`` is collective over a communicator that spans the
whole job (``bootstrap.size == bootstrap.world_size``: the world communicator, or a duplicate of it)
and returns the same id on every rank. A rank that already holds the job's id (``known``: from an
earlier world communicator of this process) keeps it, and so do the others: the first rank in
rank order that holds one decides, so a world re-formed around survivors (an elastic job) keeps
its id. Where no rank holds one, rank 0 draws it: the UTC time of day and 32 random bits
("20260314-101502-9f3c2a7e"), which sorts by start and differs between jobs started in the same
second. The flight recorder names its default dump folder after it, so the dumps of one job never
mix with another's (ddl_triton/observability/flight.py).

Why agreed, not read from the launcher: every launcher names its jobs differently or not at all
(hydra's mpiexec exports no job id to its ranks; torchrun's run id is "none" unless given, and a
reused ``--rdzv-id`` names two jobs alike), whereas every communicator already has a bootstrap
that reaches every rank once at init. The value crosses the bootstrap as checked JSON and is used
in a path: anything but 1 to 64 letters, digits, dots, dashes and underscores is refused.
"""
from __future__ import annotations

import re
import secrets
import time

from .bootstrap_values import BootstrapError

_SHAPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def fresh_job_id() -> str:
    """A new id: the UTC time (to the second) and 32 random bits."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"


def agree_on_job_id(bootstrap, known: str = "") -> str:
    """The job's id, the same on every rank of ``bootstrap`` (collective; see the module doc)."""
    mine = [True, known] if known else [False, fresh_job_id()]
    every = bootstrap.allgather(mine)
    for rank, value in enumerate(every):
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], bool)
                and isinstance(value[1], str) and _SHAPE.fullmatch(value[1])):
            raise BootstrapError(f"rank {bootstrap.rank}: ddl_triton init: rank {rank} sent {value!r:.120} as its job "
                                 "id, not [held, 1-64 letters, digits, '.', '-', '_']")
    held = [value for held, value in every if held]
    return held[0] if held else every[0][1]
