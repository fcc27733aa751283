"""Runs one rank's steps of a Schedule on transports, with the kernels doing every reduction.

Semantics: each step is executed as the IR defines it (schedules/ir.py), in
order. Pipelining comes from the transports, not from threads: a send is a
copy (or a reduction written straight) into a slot the peer reads, so while
this rank reduces chunk k-1 its neighbour is already moving chunk k; for MPI,
receives are posted ``pipeline_depth`` steps ahead so data lands during the
reduction of the previous chunk.

A group step (schedules/native.py) is one call of its transport's own allreduce
(``allreduce_group``) on the step's span; on transports without one, the executor runs the
schedule's point-to-point stand-in (``native.expand``) instead, on every rank alike (the
capability is the inter-node transport's, the same on every rank).

    rank r:   [send c0][recv+reduce c1 -> send][recv c0 ...]
    rank r+1:     [send c1][recv+reduce c0 -> send][recv c1 ...]
                   ^ overlaps r's reduction of the previous chunk
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...kernels.reduce import reduce_trusted as _reduce_trusted
from ...errors import call_name, wait_failed
from ...transports.protocol import Transport
from ...transports.waits import PeerTimeout
from ...schedules import IN, Schedule, Span, Step
from ...schedules.native import expand as _expand_group_steps


@dataclass(frozen=True)
class CallContext:
    """What the executor needs to know about the call it runs: the op, and names for errors."""

    collective: str
    op: str = "sum"
    scale: float | None = None  # applied on the final step (avg = sum * 1/size)


class _Compiled:
    """One step with everything the hot loop needs resolved once per (schedule, rank)."""

    __slots__ = ("step", "src", "dst", "recvs", "sends", "whole_src", "whole_dst", "shape", "engine")

    def __init__(self, step: Step, route: list, in_count: int, out_count: int):
        self.step = step
        self.src = None if step.src is None else (step.src.buffer == IN, step.src.start, step.src.stop)
        self.dst = None if step.dst is None else (step.dst.buffer == IN, step.dst.start, step.dst.stop)
        # A span covering its whole buffer needs no slicing (slicing a tensor costs ~2 µs).
        self.whole_src = step.src is not None and step.src.start == 0 and step.src.count == (
            in_count if step.src.buffer == IN else out_count)
        self.whole_dst = step.dst is not None and step.dst.start == 0 and step.dst.count == (
            in_count if step.dst.buffer == IN else out_count)
        self.recvs = tuple((rv.peer, rv.msg, route[rv.peer], rv.offset, rv.size) for rv in step.recv)
        groups: list[tuple[object, list[int]]] = []
        for p in step.send:
            for g in groups:
                if g[0] is route[p]:
                    g[1].append(p)
                    break
            else:
                groups.append((route[p], [p]))
        self.sends = tuple((t, tuple(ps)) for t, ps in groups)
        # A group step's transport: the one every other member is reached by (None: it has no engine).
        engines = {id(route[p]): route[p] for p in step.group if route[p] is not None}
        self.engine = next(iter(engines.values())) if len(engines) == 1 else None
        if self.engine is not None and not getattr(self.engine, "has_group_allreduce", False):
            self.engine = None
        # The two shapes that make up small-message schedules get a straight-line path.
        if step.group:
            self.shape = "group"
        elif not step.recv and len(self.sends) == 1 and step.dst is None and not step.final:
            self.shape = "send_local"
        elif step.recv and step.reduce and step.dst is not None and not self.sends:
            self.shape = "reduce_store"
        else:
            self.shape = "general"


class Executor:
    """Owns the per-sender message counters and the routing of peers to transports."""

    def __init__(self, rank: int, size: int, route: list[Transport | None], *, timeout: float, depth: int,
                 transports: list[Transport] | None = None):
        self.rank = rank
        self.size = size
        self.route = route
        self.timeout = timeout
        self.depth = depth
        self.next_msg = [0] * size  # message id of every sender's next message
        self._transports = list(transports or [])
        for t in route:
            if t is not None and all(t is not s for s in self._transports):
                self._transports.append(t)
        # Two-sided transports have sends to complete; a GPU transport has its stream to see
        # through under the deadline (its waits are on the device, where no deadline reaches).
        self._flushers = [t for t in self._transports if t.completes_sends]
        self._has_lookahead = any(t.posts_receives_early for t in self._transports) and size > 1
        # Whether group steps (schedules/native.py) run on the two-sided transports' own engines.
        self.group_engines = bool(self._flushers) and all(getattr(t, "has_group_allreduce", False)
                                                          for t in self._flushers)
        # Compiled step lists by schedule identity (schedules are cached, so they recur).
        self._programs: dict[int, tuple[Schedule, list[_Compiled], tuple[int, ...]]] = {}
        self.record = None   # the flight recorder's record of the running call (its step label is kept up to date)
        self.tracer = None   # ddl_triton/observability/tracer.py: when set, every step is a span with its phases
        self.describe = None  # peer -> how an error names it (Placement.describe: with its host); None: no host

    def _program(self, schedule: Schedule) -> tuple[list[_Compiled], tuple[int, ...]]:
        entry = self._programs.get(id(schedule))
        if entry is None or entry[0] is not schedule:
            if len(self._programs) > 256:
                self._programs.clear()
            # Group steps run on the two-sided transports' engines, or all as their p2p stand-in:
            # every rank decides alike (the same inter-node transport), whichever steps it holds.
            run = schedule if self.group_engines else _expand_group_steps(schedule)
            steps = [_Compiled(s, self.route, run.in_count, run.out_count) for s in run.steps[self.rank]]
            for c in steps:
                if c.shape == "group" and c.engine is None:
                    raise ValueError(f"rank {self.rank}: {schedule.name} step {c.step.label!r}: ranks "
                                     f"{c.step.group} are not all reached by one transport with an allreduce engine")
            sends = tuple(run.sends(q) for q in range(self.size))
            entry = (schedule, steps, sends)
            self._programs[id(schedule)] = entry
        return entry[1], entry[2]

    def run_widened(self, schedule: Schedule, inbuf: torch.Tensor, outbuf: torch.Tensor, ctx: CallContext,
                    seq: int, run_dtype: torch.dtype) -> None:
        """``run``; when ``run_dtype`` is wider than the data (16-bit sums carried in fp32),
        through a wide copy, rounded back once at the end."""
        if run_dtype is inbuf.dtype:
            self.run(schedule, inbuf, outbuf, ctx, seq)
            return
        wide_in = inbuf.to(run_dtype)
        wide_out = wide_in if outbuf is inbuf else torch.empty(outbuf.shape, dtype=run_dtype, device=outbuf.device)
        self.run(schedule, wide_in, wide_out, ctx, seq)
        outbuf.copy_(wide_out)  # the one rounding back to 16 bits

    def run(self, schedule: Schedule, inbuf: torch.Tensor, outbuf: torch.Tensor, ctx: CallContext,
            seq: int = 0) -> None:
        """Execute this rank's steps. ``inbuf``/``outbuf`` are flat contiguous tensors (may be one)."""
        program, sends = self._program(schedule)
        base = self.next_msg
        dtype = inbuf.dtype
        label = "start"
        record, tracer = self.record, self.tracer
        try:
            for i, c in enumerate(program):
                label = c.step.label
                if record is not None:
                    record.step = label
                if self._has_lookahead:
                    self._prefetch(program, i, base, dtype)
                if tracer is None:
                    self._run_step(c, inbuf, outbuf, base, dtype, ctx)
                else:
                    self._run_step_traced(c, inbuf, outbuf, base, dtype, ctx)
            label = "flush"
            if record is not None:
                record.step = label
            for t in self._flushers:
                t.flush(self.timeout)
        except PeerTimeout as e:
            raise wait_failed(self.rank, call_name(ctx.collective, seq, schedule.name, label), e, self.timeout,
                              self.describe) from None
        for q in range(self.size):
            base[q] += sends[q]

    def _prefetch(self, program: list[_Compiled], i: int, base: list[int], dtype: torch.dtype) -> None:
        # Post receives one pipeline window ahead (two-sided transports act on this).
        first = 0 if i == 0 else i + self.depth - 1
        for j in range(first, min(len(program), i + self.depth)):
            c = program[j]
            for peer, msg, transport, _, size in c.recvs:
                transport.prefetch(peer, base[peer] + msg, size, dtype)

    def _run_step(self, c: _Compiled, inbuf: torch.Tensor, outbuf: torch.Tensor, base: list[int],
                  dtype: torch.dtype, ctx: CallContext) -> None:
        s = c.step
        if c.shape == "group":
            self._run_group(c, inbuf, outbuf, ctx)
            return
        if c.shape == "send_local":
            is_in, start, stop = c.src
            buf = inbuf if is_in else outbuf
            transport, peers = c.sends[0]
            msg_id = base[self.rank] + s.msg
            transport.acquire(msg_id, peers, s.count, dtype, self.timeout).copy_(
                buf if c.whole_src else buf[start:stop])
            transport.publish(msg_id)
            return
        if c.shape == "reduce_store":
            operands = [transport.recv(peer, base[peer] + msg, s.count, dtype, self.timeout, offset, size)
                        for peer, msg, transport, offset, size in c.recvs]
            is_in, start, stop = c.src
            buf = inbuf if is_in else outbuf
            operands.insert(s.local_pos, buf if c.whole_src else buf[start:stop])
            is_in, start, stop = c.dst
            buf = inbuf if is_in else outbuf
            _reduce_trusted(buf if c.whole_dst else buf[start:stop], operands, ctx.op,
                            ctx.scale if s.final else None)
            for peer, msg, transport, _, _ in c.recvs:
                transport.release(peer, base[peer] + msg)
            return
        self._run_general(c, inbuf, outbuf, base, dtype, ctx, None)

    def _run_step_traced(self, c: _Compiled, inbuf: torch.Tensor, outbuf: torch.Tensor, base: list[int],
                         dtype: torch.dtype, ctx: CallContext) -> None:
        """The general path with its phases timed: a span per step, and one per phase."""
        marks: list = []
        t0 = time.perf_counter()
        if c.shape == "group":
            self._run_group(c, inbuf, outbuf, ctx)
            marks.append(("native", time.perf_counter()))
        else:
            self._run_general(c, inbuf, outbuf, base, dtype, ctx, marks)
        t3 = time.perf_counter()
        s, us = c.step, self.tracer.us
        peers = sorted({peer for peer, *_ in c.recvs} | {p for _, ps in c.sends for p in ps}
                       | {p for p in s.group if p != self.rank})
        self.tracer.span(s.label or "step", us(t0), us(t3), "ddl.step",
                         {"peers": peers, "bytes": s.count * dtype.itemsize, "msg": s.msg if s.send else None})
        start = t0
        for phase, t in marks:
            if t > start:
                self.tracer.span(phase, us(start), us(t), "ddl.phase")
            start = t

    def _run_group(self, c: _Compiled, inbuf: torch.Tensor, outbuf: torch.Tensor, ctx: CallContext) -> None:
        """A group step: the engine's allreduce of the span in place, then the op's scale."""
        is_in, start, stop = c.dst  # src == dst (schedules/ir.py)
        buf = inbuf if is_in else outbuf
        view = buf if c.whole_dst else buf[start:stop]
        c.engine.allreduce_group(c.step.group, view, ctx.op, self.timeout)
        if c.step.final and ctx.scale is not None:
            _reduce_trusted(view, [view], ctx.op, ctx.scale)

    def _run_general(self, c: _Compiled, inbuf: torch.Tensor, outbuf: torch.Tensor, base: list[int],
                     dtype: torch.dtype, ctx: CallContext, marks: list | None) -> None:
        """Any step: acquire send slots, receive, reduce or copy, publish, release. With
        ``marks``, appends (phase, perf_counter at its end) for wait, reduce/copy and send."""
        s = c.step
        count = s.count
        # Acquire send slots first: waiting for a slot while holding a peer's message could deadlock.
        send_bufs = []
        if c.sends:
            msg_id = base[self.rank] + s.msg
            for transport, peers in c.sends:
                send_bufs.append((transport, msg_id, transport.acquire(msg_id, peers, count, dtype, self.timeout)))
        incoming = [transport.recv(peer, base[peer] + msg, count, dtype, self.timeout, offset, size)
                    for peer, msg, transport, offset, size in c.recvs]
        scale = ctx.scale if s.final else None
        if marks is not None:
            marks.append(("wait", time.perf_counter()))

        if c.dst is not None:
            is_in, start, stop = c.dst
            buf = inbuf if is_in else outbuf
            target = buf if c.whole_dst else buf[start:stop]
        elif send_bufs:
            target = send_bufs[0][2]
        else:
            target = None
        local = None
        if c.src is not None:
            is_in, start, stop = c.src
            buf = inbuf if is_in else outbuf
            local = buf if c.whole_src else buf[start:stop]
        if s.reduce:
            operands = incoming
            operands.insert(s.local_pos, local)
            _reduce_trusted(target, operands, ctx.op, scale)
            result = target
        else:
            source = incoming[0] if incoming else local
            if scale is not None:
                _reduce_trusted(target, [source], ctx.op, scale)
                result = target
            elif target is not None and target.data_ptr() != source.data_ptr():
                target.copy_(source)
                result = target
            else:
                result = source
        if marks is not None:
            marks.append(("reduce" if s.reduce or scale is not None else "copy", time.perf_counter()))
        for transport, msg_id, buf in send_bufs:
            if buf.data_ptr() != result.data_ptr():
                buf.copy_(result)
            transport.publish(msg_id)
        for peer, msg, transport, _, _ in c.recvs:
            transport.release(peer, base[peer] + msg)
        if marks is not None:
            marks.append(("send", time.perf_counter()))
