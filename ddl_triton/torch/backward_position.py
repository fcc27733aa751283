"""How much backward follows a gradient allreduce: measured from the previous backward pass.

DDP issues its buckets from inside backward, in the same order every step. A bucket issued
early has the rest of backward to hide its link time behind; the last one, issued as backward
ends, has none, and the step waits for all of it. ``compression="auto"`` weighs a bucket's
compression by that (ddl_triton/tuning/auto_compression.py, "A call with backward still behind it"),
so it needs, per bucket, the backward time that follows its issue. :class:`BackwardPositions`
measures it:

- every call is stamped with autograd's graph task (one per ``backward()``:
  ``torch._C._current_graph_task_id()``, -1 outside backward), its place in that pass (the
  k-th call) and its size, and the time of its issue;
- when a call of a new graph task arrives, the previous pass is complete; each of its calls
  gets ``behind = issue time of the pass's last call - its own issue time`` (the last call of
  a pass is issued as backward finishes, so its own ``behind`` is 0), kept under its place and
  size;
- ``observe(nbytes)`` stamps a call and returns its place and the ``behind`` of the call with
  the same place and size in the passes completed so far (the latest), or None: outside
  backward, or before such a pass has completed (the first step, and the first after DDP
  rebuilds its buckets).

A call is known by its place and size, never by its buffer's address: ranks must agree on which
calls have a figure, because agreeing on the figure is a collective (the smallest over the
ranks: ddl_triton/torch/level_compression.py), and DDP issues the same buckets in the same order
on every rank, while the allocator may give a new bucket an old address on one rank only.
Example: a pass issues 1.4 MB at 10 ms and 2.1 MB at 150 ms; in the next pass the first call
observes ((0, 1436200), 140_000.0) (us) and the second ((1, 2115712), 0.0).
"""
from __future__ import annotations

import time
from collections import OrderedDict

import torch

MAX_KEYS = 256  # places remembered at most: DDP's buckets are a few hundred at the most


class BackwardPositions:
    """Per place and size in a backward pass, the backward time (us) that followed the call in
    the latest complete pass (module doc)."""

    def __init__(self):
        self._task = None                          # the graph task of the pass being recorded
        self._issued: dict = {}                    # its calls so far: (place, nbytes) -> issue time (s)
        self._behind: OrderedDict = OrderedDict()  # (place, nbytes) -> us, from completed passes

    def observe(self, nbytes: int) -> tuple[tuple[int, int] | None, float | None]:
        """Stamp a call of ``nbytes`` now: its place ``(k, nbytes)`` (None outside backward) and
        its ``behind`` (us) from a complete pass (None when none is known)."""
        task = torch._C._current_graph_task_id()
        if task < 0:
            return None, None
        now = time.perf_counter()
        if task != self._task:
            self._close_pass()
            self._task = task
        place = (len(self._issued), nbytes)
        self._issued[place] = now
        return place, self._behind.get(place)

    def _close_pass(self) -> None:
        if not self._issued:
            return
        last = max(self._issued.values())
        for place, issued in self._issued.items():
            self._behind[place] = (last - issued) * 1e6
            self._behind.move_to_end(place)
        while len(self._behind) > MAX_KEYS:
            self._behind.popitem(last=False)
        self._issued = {}
