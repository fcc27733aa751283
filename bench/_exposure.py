"""The communication backward cannot hide, per DDP step: when each bucket was handed to the comm
hook, and when its collective completed.

``Exposure.wrap(hook)`` is a DDP comm hook that calls ``hook`` and records two times
(``time.perf_counter``): its hand-off (before ``hook`` runs), and the completion of the future
``hook`` returned, through ``add_done_callback``. It adds no synchronization: a torch Future runs
its callbacks in the thread that completes it, right after it does (inline if it is already
done), so the time is the collective's own end, not that of whoever waits for it:
- torch's gloo: its worker thread marks the Work's future done when the algorithm ends; the stock
  ``allreduce_hook``'s ``then`` continuation, then this callback, run there (taking the GIL, which
  DDP's waiting backward does not hold);
- "ddl": ddl_triton's background thread settles the Work's future (ddl_triton/torch/futures.py),
  or the waiting thread, where it ran a queued call itself: that is when the call ran.
Cost: two clock reads and one Python callback per bucket.

``exposed(handoffs, dones)`` of one rank's step = the last completion - the last hand-off: the
time from the end of backward (DDP hands over its last bucket as backward ends) to the end of
every bucket's collective. A rank whose backward ends first also waits there for the others;
``per_step`` therefore keeps, per step, the smallest over the ranks (the last rank to finish
backward: the communication the step pays beyond the slowest backward) and the largest
(skew included). Times are compared within one process only: hosts' clocks need not agree.

``wire_bytes_last(nbytes, method, hosts, per_host)``: the bytes the last bucket puts through
each host's link: 2(H-1)/H * nbytes in fp32; compressed between hosts (per level), what each of
the host's ``per_host`` ranks sends of its shard (ddl_triton/runtime/compression/compressed.py).
Divided by the shaped rate, that is the wire bound of the exposed time.
Example: exposed([1.0, 2.0], [2.5, 2.01]) -> 0.5; wire_bytes_last(2_000_000, "none", 2, 1) -> 2e6.
"""
from __future__ import annotations

import re
import statistics
import time


class Exposure:
    """Per step of one DDP replica: each bucket's hand-off and completion times (module doc)."""

    def __init__(self):
        self._steps: list[tuple[list[float], list[float]]] = []

    def begin_step(self) -> None:
        """A step starts: the buckets handed over from now on belong to it."""
        self._steps.append(([], []))

    def wrap(self, hook):
        """``hook``, timed: a comm hook for ``register_comm_hook`` with the same state."""
        steps = self._steps

        def timed(state, bucket):  # DDP checks the parameter's name: "bucket"
            handoffs, dones = steps[-1]
            handoffs.append(time.perf_counter())
            future = hook(state, bucket)
            future.add_done_callback(lambda _: dones.append(time.perf_counter()))
            return future

        timed.__qualname__ = getattr(hook, "__qualname__", "hook")  # DDP logs the hook's name
        return timed

    def take(self, wait_s: float = 1.0) -> list[float | None]:
        """The exposed time (s) of each step since the last take, in order, and forget them.
        A future wakes its waiters before it runs its callbacks, so the last bucket's may still
        be running as the step returns: wait up to ``wait_s`` for every one (outside the steps)."""
        deadline = time.monotonic() + wait_s
        while any(len(d) < len(h) for h, d in self._steps) and time.monotonic() < deadline:
            time.sleep(0.001)
        out = [exposed(h, d) for h, d in self._steps]
        self._steps.clear()
        return out


def exposed(handoffs: list[float], dones: list[float]) -> float | None:
    """The last completion - the last hand-off, or None unless every bucket handed over completed."""
    if not handoffs or len(dones) != len(handoffs):
        return None
    return max(dones) - max(handoffs)


def per_step(per_rank: list[list[float | None]]) -> tuple[list[float], list[float]]:
    """(smallest, largest) over the ranks of each step's exposed time, for the steps every rank timed."""
    lows, highs = [], []
    for values in zip(*per_rank):
        if values and all(v is not None for v in values):
            lows.append(min(values))
            highs.append(max(values))
    return lows, highs


def quartiles(values: list[float]) -> tuple[float, float, float] | None:
    """(p25, median, p75) of ``values`` (inclusive quantiles), or None when there are none."""
    if not values:
        return None
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


def method_of(explain_line: str, nbytes: int) -> str:
    """The method between hosts that an ``explain`` line states for ``nbytes`` ("none" if it names
    none); the last where several places of that size were decided (the latest used)."""
    found = re.findall(rf"(?:^|; ){nbytes} B: (\S+) between hosts", explain_line)
    return found[-1] if found else "none"


def wire_bytes_last(nbytes: int, method: str, hosts: int, per_host: int, block: int = 256) -> float:
    """The bytes ``nbytes`` of fp32 gradient put through each host's link, sent with ``method``
    between hosts (an explain line is read for it, see method_of); module doc."""
    if " B: " in method:
        method = method_of(method, nbytes)
    if hosts < 2:
        return 0.0
    if method == "none":
        return 2 * (hosts - 1) / hosts * nbytes
    from ddl_triton.runtime.compression.compressed import wire_bytes  # what per_level sends between hosts
    shard = -(-(nbytes // 4) // per_host)
    return per_host * wire_bytes(method, shard, hosts, block=block)
