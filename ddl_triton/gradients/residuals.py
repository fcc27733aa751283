"""The one error-feedback store: per key, what compression lost, to be sent with the next call.

A compressed allreduce with error feedback adds a residual to its input and keeps what its
quantization lost in it (the worker residual; 1-bit also keeps the server's, the size of the
chunk this rank reduces). A residual only means something for the same tensor, method and
layout, so each is held under a key (a bucket's index, DDP's bucket index, or a buffer) with
its signature: the kind of call (method and path), the worker's and the server's element counts.
The reset rules:

- a key asked for with another signature (the bucket changed size, or the method changed) starts
  again from zeros, counted in ``resets``: the old residual belongs to another layout;
- ``clear()`` forgets every residual: after a world change (its chunks are another size, and its
  error was made by other ranks) or a checkpoint load;
- with ``max_keys``, the least recently used key is dropped beyond that many (buffers an
  application allreduces once would otherwise pile up).

Residuals are fp32, on ``device`` (default the CPU): the gradients' side of the wire.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["Residuals"]


class Residuals:
    """Error-feedback residuals per key (module doc). ``resets``: keys restarted from zero
    because their signature changed."""

    def __init__(self, max_keys: int | None = None):
        self.max_keys = max_keys
        self.resets = 0
        self._held: OrderedDict = OrderedDict()  # key -> (signature, worker, server or None)

    def get(self, key, kind: str, worker_numel: int, server_numel: int | None = None, device=None):
        """(worker, server) for ``key``: the held pair when its signature (``kind``, the two sizes,
        the device) is the same, else fresh zeros (a held pair replaced counts in ``resets``).
        ``server_numel`` None: no server residual (the second is None)."""
        device = torch.device("cpu") if device is None else torch.device(device)
        signature = (kind, worker_numel, server_numel, device)
        held = self._held.get(key)
        if held is not None and held[0] == signature:
            self._held.move_to_end(key)
            return held[1], held[2]
        if held is not None:
            self.resets += 1
        worker = torch.zeros(worker_numel, dtype=torch.float32, device=device)
        server = None if server_numel is None else torch.zeros(server_numel, dtype=torch.float32, device=device)
        self._held[key] = (signature, worker, server)
        self._held.move_to_end(key)
        while self.max_keys is not None and len(self._held) > self.max_keys:
            self._held.popitem(last=False)
        return worker, server

    def clear(self) -> None:
        """Forget every residual (a world change, a checkpoint load): the next calls start from zero."""
        self._held.clear()

    def snapshot(self) -> dict:
        """{key: (kind, worker, server or None)}, copied: nothing shared with the held tensors."""
        return {k: (sig[0], w.clone(), None if s is None else s.clone()) for k, (sig, w, s) in self._held.items()}

    def load(self, snapshot: dict) -> None:
        """Hold the residuals of ``snapshot`` (``snapshot``'s format), copied again."""
        self._held = OrderedDict(
            (k, ((kind, w.numel(), None if s is None else s.numel(), w.device), w.clone(),
                 None if s is None else s.clone()))
            for k, (kind, w, s) in snapshot.items())

    def __len__(self) -> int:
        return len(self._held)
