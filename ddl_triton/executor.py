"""Runs one rank's steps of a Schedule on transports, with the kernels doing every reduction.

Semantics: each step is executed as the IR defines it (schedules/ir.py), in
order. Pipelining comes from the transports, not from threads: a send is a
copy (or a reduction written straight) into a slot the peer reads, so while
this rank reduces chunk k-1 its neighbour is already moving chunk k; for MPI,
receives are posted ``pipeline_depth`` steps ahead so data lands during the
reduction of the previous chunk.

    rank r:   [send c0][recv+reduce c1 -> send][recv c0 ...]
    rank r+1:     [send c1][recv+reduce c0 -> send][recv c1 ...]
                   ^ overlaps r's reduction of the previous chunk
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .errors import CollectiveTimeout
from .transports.base import PeerTimeout, Transport
from .schedules import IN, Schedule, Span, Step


@dataclass
class CallContext:
    """What the executor needs to know about the call it runs (for errors and the op)."""

    collective: str
    seq: int
    op: str = "sum"
    scale: float | None = None


class Executor:
    """Owns the per-sender message counters and the routing of peers to transports."""

    def __init__(self, rank: int, size: int, route: list[Transport | None], *, timeout: float, depth: int):
        self.rank = rank
        self.size = size
        self.route = route
        self.timeout = timeout
        self.depth = depth
        self.next_msg = [0] * size  # message id of every sender's next message

    def run(self, schedule: Schedule, inbuf: torch.Tensor, outbuf: torch.Tensor, ctx: CallContext) -> None:
        """Execute this rank's steps. ``inbuf``/``outbuf`` are flat contiguous tensors (may be one)."""
        steps = schedule.steps[self.rank]
        base = self.next_msg
        elem = inbuf.element_size()
        dtype = inbuf.dtype
        label = "start"
        try:
            for i, step in enumerate(steps):
                label = step.label
                self._prefetch(steps, i, base, elem)
                self._run_step(step, inbuf, outbuf, base, elem, dtype, ctx)
            label = "flush"
            for t in self._transports():
                t.flush(self.timeout)
        except PeerTimeout as e:
            raise CollectiveTimeout(
                f"rank {self.rank}: {ctx.collective} #{ctx.seq} (schedule {schedule.name}, step {label!r}) "
                f"timed out after {self.timeout:g} s; not heard from rank {e.peer} ({e.what})") from None
        for q in range(self.size):
            base[q] += schedule.sends(q)

    def _transports(self) -> list[Transport]:
        seen: list[Transport] = []
        for t in self.route:
            if t is not None and all(t is not s for s in seen):
                seen.append(t)
        return seen

    def _prefetch(self, steps: tuple[Step, ...], i: int, base: list[int], elem: int) -> None:
        # Look one pipeline window ahead: only the MPI transport does anything here.
        j = i + self.depth - 1
        if j < len(steps):
            s = steps[j]
            for rv in s.recv:
                self.route[rv.peer].prefetch(rv.peer, base[rv.peer] + rv.msg, s.count * elem)
        if i == 0:
            for s in steps[:self.depth - 1]:
                for rv in s.recv:
                    self.route[rv.peer].prefetch(rv.peer, base[rv.peer] + rv.msg, s.count * elem)

    def _run_step(self, s: Step, inbuf: torch.Tensor, outbuf: torch.Tensor, base: list[int], elem: int,
                  dtype: torch.dtype, ctx: CallContext) -> None:
        nbytes = s.count * elem

        def view(span: Span) -> torch.Tensor:
            buf = inbuf if span.buffer == IN else outbuf
            return buf[span.start:span.stop]

        # Acquire send slots first: waiting for a slot while holding a peer's message could deadlock.
        send_bufs: list[tuple[Transport, int, torch.Tensor]] = []
        if s.send:
            msg_id = base[self.rank] + s.msg
            for transport, peers in self._group(s.send):
                raw = transport.acquire(msg_id, peers, nbytes, self.timeout)
                send_bufs.append((transport, msg_id, raw.view(dtype)))
        incoming = [self.route[rv.peer].recv(rv.peer, base[rv.peer] + rv.msg, nbytes, self.timeout).view(dtype)
                    for rv in s.recv]
        scale = ctx.scale if s.final else None

        if s.dst is not None:
            target = view(s.dst)
        elif send_bufs:
            target = send_bufs[0][2]
        else:
            target = None
        if s.reduce:
            operands = list(incoming)
            operands.insert(s.local_pos, view(s.src))  # type: ignore[arg-type]
            kernels.reduce(target, operands, op=ctx.op, scale=scale)
            result = target
        else:
            source = incoming[0] if incoming else view(s.src)  # type: ignore[arg-type]
            if scale is not None:
                kernels.reduce(target, [source], op=ctx.op, scale=scale)
                result = target
            elif target is not None and target.data_ptr() != source.data_ptr():
                target.copy_(source)
                result = target
            else:
                result = source
        for _, _, buf in send_bufs:
            if buf.data_ptr() != result.data_ptr():
                buf.copy_(result)
        for transport, msg_id, _ in send_bufs:
            transport.publish(msg_id)
        for rv in s.recv:
            self.route[rv.peer].release(rv.peer, base[rv.peer] + rv.msg)

    def _group(self, peers: tuple[int, ...]) -> list[tuple[Transport, tuple[int, ...]]]:
        groups: list[tuple[Transport, list[int]]] = []
        for p in peers:
            t = self.route[p]
            for g in groups:
                if g[0] is t:
                    g[1].append(p)
                    break
            else:
                groups.append((t, [p]))  # type: ignore[arg-type]
        return [(t, tuple(ps)) for t, ps in groups]
