"""Options every rank must share, compared once at init, by name.

Semantics: ``agree_on_options(bootstrap, options)`` is the first exchange of a new
communicator, before any shared segment, transport or tuning table: one allgather of the
fields in ``MUST_AGREE``, and whether those in ``SET_OR_NOT`` are set (a small JSON dict). When a field differs between ranks, every rank
raises ``OptionsDiffer`` (a ValueError), naming each differing field, its value on each
rank and its environment twin:

    rank 1: options differ across ranks: chunk_bytes is 1048576 on rank 0, 4194304 on rank 1 (DDL_CHUNK_BYTES)

Which fields must agree, and why: those that decide what crosses the wire or how a shared
segment is laid out, so that a difference would otherwise surface later as a crash or a
hang that does not name its cause:
- ``chunk_bytes``, ``pipeline_depth``: the shm segment's size and slots (a difference: one
  rank maps past the end of another's segment), and every schedule's chunking;
- ``wire_chunk_bytes``, ``schedule``, ``topology``, ``transport``: the plan each rank makes for
  one call, and the placement of ranks into nodes (a difference: ranks wait for messages their
  peers never send, a timeout naming nothing);
- ``check_calls``: whether every call's fingerprint crosses the call lane first (the lane's
  protocol; a difference desynchronises it);
- ``kernels``: which kernel reduces; ranks reducing one chunk with different kernels could
  hold different bits, where every rank must end with the same bits;
- ``compression``: the format of compressed buckets between hosts;
- ``link_emulation``: the emulated link between two ranks is one link, not two;
- ``link_probe``: measuring the link at init is collective (link_probe.py), and the planner's
  model comes from it.
Whether ``trace`` is set must agree too (``SET_OR_NOT``), not its folder: a new tracer aligns
its clock with rank 0's in a collective exchange that every rank must join. Whether ``job_secret``
is set must agree, never its value, which no exchange carries: a rank without it could not check a
joiner's proof that the others accept.
Fields that are this rank's own may differ: ``timeout`` (how long this rank waits),
``status_dir``, ``trace``'s folder, ``dump_dir``, ``flight_entries``, ``debug`` (what this rank
records and where), ``tuning_file`` and ``tuning_dir`` (where this rank looks: the tables found
are compared by digest in table_agreement.py), ``mpi_cuda_aware`` (how this rank hands CUDA
buffers to its MPI; the bytes on the wire are the same), and ``launcher`` (which variables this
rank read to find the world: read before any agreement is possible, and ranks that found
different worlds never meet to compare).
"""
from __future__ import annotations

from ...options import Options

MUST_AGREE = ("chunk_bytes", "pipeline_depth", "wire_chunk_bytes", "schedule", "topology", "transport",
              "check_calls", "kernels", "compression", "link_emulation", "link_probe")
SET_OR_NOT = ("trace", "job_secret")  # fields whose being set ("" or not) must agree, their values not
_COMPARED = MUST_AGREE + SET_OR_NOT
_KINDS = {"chunk_bytes": int, "pipeline_depth": int, "wire_chunk_bytes": int, "check_calls": bool,
          "link_probe": bool,
          **{name: bool for name in SET_OR_NOT}}  # else str


class OptionsDiffer(ValueError):
    """Ranks of one communicator were given different values of an option that must agree
    (see ``MUST_AGREE``). Raised on every rank, with every rank's value."""


def agree_on_options(bootstrap, options: Options) -> None:
    """Compare ``options`` across the ranks of ``bootstrap`` (collective: every rank calls it
    first); raise ``OptionsDiffer`` on every rank when a field of ``MUST_AGREE`` differs."""
    if bootstrap.size == 1:
        return
    mine = {name: getattr(options, name) for name in MUST_AGREE} | \
        {name: getattr(options, name) != "" for name in SET_OR_NOT}
    every = bootstrap.allgather(mine)
    problem = differences(bootstrap.rank, [_checked(v, r, bootstrap.rank) for r, v in enumerate(every)])
    if problem:
        raise OptionsDiffer(problem)


def differences(rank: int, every: list[dict]) -> str:
    """The error text for ``every`` rank's values of ``MUST_AGREE`` (and ``SET_OR_NOT``, as
    bools) as seen by ``rank``, or "" when they agree. Each differing field gets one clause:
    its values in order of the lowest rank holding each, with the ranks holding it."""
    clauses = []
    for name in _COMPARED:
        holders: dict = {}
        for r, values in enumerate(every):
            holders.setdefault(_key(values[name]), (values[name], []))[1].append(r)
        if len(holders) > 1:
            show = (lambda v: "set" if v else "''") if name in SET_OR_NOT else _show
            parts = [f"{show(value)} on {_ranks(ranks)}" for value, ranks in holders.values()]
            clauses.append(f"{name} is {', '.join(parts)} (DDL_{name.upper()})")
    if not clauses:
        return ""
    return f"rank {rank}: options differ across ranks: " + "; ".join(clauses)


def _checked(values, sender: int, rank: int) -> dict:
    """``values`` from rank ``sender`` when it is a dict of exactly the fields of MUST_AGREE with
    values of their types; else the bootstrap's error (a peer of another version, or not a peer)."""
    from .bootstrap_values import BootstrapError, checked

    where = f"rank {sender}'s options"
    if not isinstance(values, dict) or set(values) != set(_COMPARED):
        got = sorted(values) if isinstance(values, dict) else type(values).__name__
        raise BootstrapError(f"rank {rank}: ddl_triton init: {where} name the fields {got}, not {list(_COMPARED)} "
                             "(every rank must run the same ddl_triton version)")
    for name in _COMPARED:
        checked(values[name], _KINDS.get(name, str), f"{where} ({name})", rank)
    return values


def _key(value):
    return (type(value).__name__, value)  # True and 1 are different values here


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(int(value)) if isinstance(value, bool) else str(value)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
