"""How much backward follows a gradient allreduce: measured from the previous backward pass.

DDP issues its buckets from inside backward, in the same order every step. A bucket issued
early has the rest of backward to hide its link time behind; the last one, issued as backward
ends, has none, and the step waits for all of it. ``compression="auto"`` weighs a bucket's
compression by that (ddl_triton/tuning/compression.py, "A call with backward still behind it"),
so it needs, per bucket, the backward time that follows its issue. :class:`BackwardPositions`
measures it:

- every call is stamped with autograd's graph task (one per ``backward()``:
  ``torch._C._current_graph_task_id()``, -1 outside backward) and the time of its issue;
- when a call of a new graph task arrives, the previous pass is complete; each of its keys
  gets ``behind = issue time of the pass's last call - its own issue time`` (the last call of
  a pass is issued as backward finishes, so its own ``behind`` is 0);
- ``observe(key)`` returns the key's ``behind`` from the last complete pass that held it, or
  None: outside backward, or before a pass with the key has completed (the first step, and
  the first after DDP rebuilds its buckets, whose buffers are new keys).

The issue times are this rank's; ranks agree on one figure before they decide
(ddl_triton/torch/level_compression.py takes the smallest over the ranks).
Example: a pass issues key A at 10 ms and key B at 150 ms; in the next pass observe(A) is
140_000.0 (us) and observe(B) is 0.0.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import torch

MAX_KEYS = 256  # keys remembered at most: DDP's buckets are a few hundred at the most


class BackwardPositions:
    """Per key, the backward time (us) that followed its call in the last complete pass (module doc)."""

    def __init__(self):
        self._task = None                      # the graph task of the pass being recorded
        self._issued: dict = {}                # its calls so far: key -> issue time (s)
        self._behind: OrderedDict = OrderedDict()  # key -> us, from completed passes

    def observe(self, key) -> float | None:
        """Stamp a call of ``key`` now; its ``behind`` (us) from the last complete pass, or None."""
        task = torch._C._current_graph_task_id()
        if task < 0:
            return None
        now = time.perf_counter()
        if task != self._task:
            self._close_pass()
            self._task = task
        self._issued[key] = now
        return self._behind.get(key)

    def _close_pass(self) -> None:
        if not self._issued:
            return
        last = max(self._issued.values())
        for key, issued in self._issued.items():
            self._behind[key] = (last - issued) * 1e6
            self._behind.move_to_end(key)
        while len(self._behind) > MAX_KEYS:
            self._behind.popitem(last=False)
        self._issued = {}
