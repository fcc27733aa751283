"""The schedule IR: a collective as plain data, one ordered step list per rank.

A rank owns two flat buffers, ``in`` and ``out`` (the same tensor for an
in-place allreduce or broadcast). A :class:`Step` is one fused primitive, in
the manner of NCCL's recvReduceCopySend:

    incoming = the messages named in ``recv``           (each ``count`` elements)
    if reduce:  result = op over incoming + [in[src]]   (local operand at ``local_pos``)
    elif recv:  result = incoming[0]                    (a plain copy)
    else:       result = in[src]                        (a send of local data, or a local copy)
    if dst is not None:  out[dst] = result              (``scale`` applied here, when final)
    if send:             every peer in ``send`` gets result as this rank's message ``msg``

A *group step* (``group`` set) is instead the transport's own allreduce among the ranks in
``group`` (this rank one of them): ``out[dst] = op over every member's src``, in place
(``src == dst``), with no ``recv`` or ``send``. Each member's k-th step with that group
meets the other members' k-th (they must agree on ``count``). It is how a level whose link
has a collective engine of its own (gloo, MPI) hands its phase to that engine, as Horovod's
hierarchical allreduce does (schedules/native.py); every consumer that walks messages sees
it through ``native.expand``, the p2p ring the engine runs for it.

Messages are numbered per sender: a sender's k-th send in the schedule is its
message k, and a receiver names it as ``Recv(peer, k)``. Between any two ranks,
messages are received in the order they were sent (checked by
:func:`validate`), which lets transports match them by counting.

The same data feeds the executor, the simulator and the tracer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

IN = "in"
OUT = "out"


@dataclass(frozen=True)
class Span:
    """``count`` elements of the rank's ``buffer`` starting at element ``start``."""

    buffer: str
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class Recv:
    """This step consumes elements [offset, offset + step.count) of message ``msg`` of rank ``peer``.

    ``size`` is the whole message's element count (filled in by :func:`assemble`): a
    one-sided transport reads just the slice in place, a two-sided one must receive it all.
    """

    peer: int
    msg: int
    offset: int = 0
    size: int = 0


@dataclass(frozen=True)
class Step:
    count: int
    src: Span | None = None          # local operand (reduce), or what is sent/copied when nothing is received
    dst: Span | None = None          # where the result is stored locally
    recv: tuple[Recv, ...] = ()
    reduce: bool = False
    local_pos: int = 0               # position of src among the reduction operands
    send: tuple[int, ...] = ()       # peers that receive the result
    msg: int = -1                    # this rank's message number for the send
    final: bool = False              # apply the op's scale (avg) when storing/sending this result
    label: str = ""                  # for traces and timeouts, e.g. "rs[2] chunk 5"
    group: tuple[int, ...] = ()      # a group step: the ranks of the transport's own allreduce (sorted)
    native: bool = False             # part of native.expand's stand-in for a group step (costmodel.py)


@dataclass(frozen=True)
class Schedule:
    """A collective on ``nranks`` ranks over ``count`` elements per rank buffer."""

    name: str
    collective: str
    nranks: int
    in_count: int
    out_count: int
    steps: tuple[tuple[Step, ...], ...]
    params: dict = field(default_factory=dict, compare=False)
    # True when the schedule reduces every element in one n-ary pass (fp32 accumulation
    # then needs no wider wire type); False when partial sums travel between ranks.
    single_pass: bool = False
    # True when some step is a group step (schedules/native.py): walkers expand it first.
    native: bool = False

    def sends(self, rank: int) -> int:
        """How many messages ``rank`` sends: the executor advances message counters by this."""
        return sum(1 for s in self.steps[rank] if s.send)


class _MessageCounter:
    """Hands out per-rank message numbers while a schedule is being built."""

    def __init__(self, nranks: int):
        self.next = [0] * nranks

    def take(self, rank: int) -> int:
        m = self.next[rank]
        self.next[rank] += 1
        return m


def validate(schedule: Schedule) -> None:
    """Structural checks: spans in bounds, counts consistent, every message sent is
    received exactly by its addressees, and per-pair FIFO order holds. Raises ValueError."""
    n = schedule.nranks
    if len(schedule.steps) != n:
        raise ValueError(f"{schedule.name}: {len(schedule.steps)} step lists for {n} ranks")
    sent: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
    met: dict[tuple[tuple[int, ...], int], list[tuple[int, int]]] = {}  # (group, k) -> [(member, count)]
    for r, steps in enumerate(schedule.steps):
        expected_msg = 0
        groups_seen: dict[tuple[int, ...], int] = {}
        for i, s in enumerate(steps):
            where = f"{schedule.name} rank {r} step {i} ({s.label})"
            if s.group:
                _check_group_step(s, r, n, where)
                k = groups_seen.get(s.group, 0)
                groups_seen[s.group] = k + 1
                met.setdefault((s.group, k), []).append((r, s.count))
            for span in (s.src, s.dst):
                if span is None:
                    continue
                limit = schedule.in_count if span.buffer == IN else schedule.out_count
                if span.count != s.count or span.start < 0 or span.stop > limit:
                    raise ValueError(f"{where}: span {span} outside buffer of {limit} or count != {s.count}")
            if s.reduce and (s.src is None or not s.recv):
                raise ValueError(f"{where}: reduce needs a local operand and incoming messages")
            if not s.reduce and len(s.recv) > 1:
                raise ValueError(f"{where}: copying from several messages")
            if not s.recv and s.src is None:
                raise ValueError(f"{where}: nothing to send or copy")
            if s.count <= 0:
                raise ValueError(f"{where}: empty step")
            if s.send:
                if s.msg != expected_msg:
                    raise ValueError(f"{where}: message number {s.msg}, expected {expected_msg}")
                expected_msg += 1
                if r in s.send or len(set(s.send)) != len(s.send):
                    raise ValueError(f"{where}: bad send set {s.send}")
                sent[(r, s.msg)] = (tuple(sorted(s.send)), s.count)
    for (group, k), members in met.items():
        if sorted(m for m, _ in members) != list(group) or len({c for _, c in members}) != 1:
            raise ValueError(f"{schedule.name}: group step {k} among ranks {group} is taken by "
                             f"{[(m, f'{c} elements') for m, c in members]}: every member once, one count")
    received: dict[tuple[int, int], list[int]] = {}
    last_from: dict[tuple[int, int], int] = {}
    for r, steps in enumerate(schedule.steps):
        for i, s in enumerate(steps):
            for rv in s.recv:
                key = (rv.peer, rv.msg)
                if key not in sent:
                    raise ValueError(f"{schedule.name} rank {r} step {i}: receives unsent message {key}")
                if rv.size != sent[key][1] or rv.offset < 0 or rv.offset + s.count > rv.size:
                    raise ValueError(f"{schedule.name} rank {r} step {i}: reads [{rv.offset}, {rv.offset + s.count}) "
                                     f"of message {key}, which has {sent[key][1]} elements (size {rv.size})")
                if last_from.get((rv.peer, r), -1) >= rv.msg:
                    raise ValueError(f"{schedule.name} rank {r} step {i}: message {key} out of FIFO order")
                last_from[(rv.peer, r)] = rv.msg
                received.setdefault(key, []).append(r)
    for key, (peers, _) in sent.items():
        if tuple(sorted(received.get(key, []))) != peers:
            raise ValueError(f"{schedule.name}: message {key} sent to {peers}, received by {received.get(key)}")


def _check_group_step(s: Step, r: int, n: int, where: str) -> None:
    if len(s.group) < 2 or list(s.group) != sorted(set(s.group)) or r not in s.group or \
            s.group[0] < 0 or s.group[-1] >= n:
        raise ValueError(f"{where}: group {s.group} must be 2 or more sorted distinct ranks, this one included")
    if s.recv or s.send or s.reduce or s.src is None or s.src != s.dst:
        raise ValueError(f"{where}: a group step reduces in place (src == dst) and neither sends nor receives")


def assemble(name: str, collective: str, nranks: int, in_count: int, out_count: int,
             drafts: list[list[Step]], *, params: dict | None = None, single_pass: bool = False) -> Schedule:
    """Number the messages of draft step lists and return a validated Schedule.

    In a draft, ``msg`` is ignored and each ``Recv`` names only its peer and
    offset (its ``msg`` and ``size`` are ignored): the i-th receive on rank r
    from peer p is matched with p's i-th send that includes r, which is
    per-pair FIFO by construction.
    """
    counter = _MessageCounter(nranks)
    addressed: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (sender, receiver) -> [(msg, count)]
    numbered: list[list[Step]] = []
    for r, steps in enumerate(drafts):
        out = []
        for s in steps:
            if s.send:
                m = counter.take(r)
                for p in s.send:
                    addressed.setdefault((r, p), []).append((m, s.count))
                s = replace_step(s, msg=m)
            out.append(s)
        numbered.append(out)
    taken: dict[tuple[int, int], int] = {}
    for r, steps in enumerate(numbered):
        for i, s in enumerate(steps):
            if not s.recv:
                continue
            recvs = []
            for rv in s.recv:
                k = taken.get((rv.peer, r), 0)
                queue = addressed.get((rv.peer, r), [])
                if k >= len(queue):
                    raise ValueError(f"{name}: rank {r} step {i} receives from {rv.peer}, which sends it nothing more")
                msg, size = queue[k]
                recvs.append(Recv(rv.peer, msg, rv.offset, size))
                taken[(rv.peer, r)] = k + 1
            steps[i] = replace_step(s, recv=tuple(recvs))
    native = any(s.group for steps in numbered for s in steps)
    schedule = Schedule(name, collective, nranks, in_count, out_count,
                        tuple(tuple(s) for s in numbered), params or {}, single_pass, native)
    validate(schedule)
    return schedule


def replace_step(step: Step, **changes) -> Step:
    """``dataclasses.replace`` for a Step, four times quicker (1.4 against 5.9 us): a schedule
    of thousands of steps renumbers every one, and a new call shape builds several schedules
    (the planner's candidates)."""
    new = object.__new__(Step)
    fields = new.__dict__  # frozen forbids setattr, not filling the fresh instance's dict
    fields.update(step.__dict__)
    fields.update(changes)
    return new
