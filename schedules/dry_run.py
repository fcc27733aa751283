"""Run a Schedule for every rank in one process, without transports.

Two uses:
- ``contributions``: each element carries a vector counting how often each
  rank's input went into it, so tests can prove that every chunk is reduced
  exactly once and every rank ends with every chunk;
- ``execute``: the same walk on real numbers, an oracle for the executor.

Ranks advance round-robin, each as far as its received messages allow (and,
given ``depth``, as far as a per-sender ring of ``depth`` message slots allows,
as in the shm transport); a round in which no rank can advance is a deadlock
and raises.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .ir import IN, Schedule, Step
from .native import expand


def contributions(schedule: Schedule, depth: int | None = None) -> list[np.ndarray]:
    """Per rank, an (out_count, nranks) array: how many times rank q's input reached each output element.

    Inputs are one-hot per rank (rank q's ``in`` is e_q everywhere); reduction is addition;
    a rank's untouched output elements stay zero.
    """
    n = schedule.nranks
    ins = []
    for q in range(n):
        a = np.zeros((schedule.in_count, n), dtype=np.int64)
        a[:, q] = 1
        ins.append(a)
    return _walk(schedule, ins, np.add, depth)


def execute(schedule: Schedule, inputs: list[np.ndarray], op: str = "sum", depth: int | None = None) -> list[np.ndarray]:
    """Numeric oracle: the ``out`` buffer of every rank after running the schedule on ``inputs``."""
    combine = {"sum": np.add, "min": np.minimum, "max": np.maximum}[op]
    return _walk(schedule, [np.array(x, copy=True) for x in inputs], combine, depth)


def walk(schedule: Schedule, depth: int | None = None) -> Iterator[tuple[int, Step]]:
    """Yield (rank, step) in an order a real run could take: a step comes after the steps
    that send the messages it receives and, given ``depth``, after its sender's slot for
    the message is free again. Raises RuntimeError naming the stuck steps on deadlock.
    Shared by the numeric oracle below and the cost model (ddl_triton/planning/costmodel.py).
    Group steps are walked as the ring allreduce their engine runs (``native.expand``)."""
    schedule = expand(schedule)
    n = schedule.nranks
    sent: set[tuple[int, int]] = set()
    unread: dict[tuple[int, int], set[int]] = {}  # (sender, msg) -> addressees yet to read it
    pc = [0] * n
    steps = schedule.steps
    while any(pc[r] < len(steps[r]) for r in range(n)):
        progressed = False
        for r in range(n):
            while pc[r] < len(steps[r]):
                s = steps[r][pc[r]]
                if any((rv.peer, rv.msg) not in sent for rv in s.recv):
                    break
                # A transport with ``depth`` slots per sender reuses message m-depth's slot for m.
                if depth is not None and s.send and unread.get((r, s.msg - depth)):
                    break
                yield r, s
                if s.send:
                    sent.add((r, s.msg))
                    unread[(r, s.msg)] = set(s.send)
                for rv in s.recv:
                    unread[(rv.peer, rv.msg)].discard(r)
                pc[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: steps[r][pc[r]].label for r in range(n) if pc[r] < len(steps[r])}
            raise RuntimeError(f"{schedule.name}/{schedule.collective}: deadlock, ranks stuck at {stuck}")


def _walk(schedule: Schedule, ins: list[np.ndarray], combine, depth: int | None) -> list[np.ndarray]:
    same_buffer = schedule.collective in ("allreduce", "broadcast")
    outs = [ins[r] if same_buffer else np.zeros((schedule.out_count,) + ins[r].shape[1:], ins[r].dtype)
            for r in range(schedule.nranks)]
    mailbox: dict[tuple[int, int], np.ndarray] = {}
    for r, s in walk(schedule, depth):
        incoming = [mailbox[(rv.peer, rv.msg)][rv.offset:rv.offset + s.count] for rv in s.recv]

        def view(span, r=r):
            buf = ins[r] if span.buffer == IN else outs[r]
            return buf[span.start:span.stop]

        if s.reduce:
            operands = list(incoming)
            operands.insert(s.local_pos, view(s.src))
            result = operands[0].copy()
            for x in operands[1:]:
                result = combine(result, x)
        else:
            result = (incoming[0] if incoming else view(s.src)).copy()
        if s.dst is not None:
            view(s.dst)[...] = result
        if s.send:
            mailbox[(r, s.msg)] = result.copy()
    return outs
