"""Scratch buffers a collective takes for one call and gives back when it ends, for the next call to reuse.

``take(numel, dtype, device)`` returns a tensor of that shape whose contents are undefined (as
``torch.empty``'s); ``give(t)`` returns it once nothing reads or writes it any more. A later ``take``
of the same numel, dtype and device gets it back instead of fresh memory. Buffers in use are never
shared: each ``take`` hands out a tensor no other caller holds.

Why: on the CPU, a buffer of a few MB that the allocator serves from fresh pages costs a page fault
per 4 KiB page the first time each page is written. On the development machine that is 1.3 ms for
2 MB, about what quantizing those 2 MB to int8 costs. A compressed allreduce of a DDP bucket
(``compressed.py``) needs four message buffers per call (three of one shape), and DDP keeps two in flight; held in this pool, their pages are
written again rather than faulted in again. (GPU tensors come from torch's caching allocator,
which already reuses memory: for them ``take`` is ``torch.empty`` and ``give`` does nothing.)

Bounds: at most ``per_shape`` idle buffers of one (numel, dtype, device), and ``max_bytes`` idle
bytes in all; a buffer given back beyond either is dropped (freed). A buffer a call could not
finish with (an error, a receive that may still land) is simply not given back.

Example:
    buf = pool.take(1 << 20, torch.int32, torch.device("cpu"))   # fresh: no buffer idle yet
    pool.give(buf)
    pool.take(1 << 20, torch.int32, torch.device("cpu")) is buf  # -> True
"""
from __future__ import annotations

import threading

import torch

__all__ = ["ScratchPool", "pool"]


class ScratchPool:
    """Idle CPU buffers by (numel, dtype, device), reused by ``take`` (see the module doc)."""

    def __init__(self, per_shape: int = 8, max_bytes: int = 256 << 20):
        self.per_shape = per_shape
        self.max_bytes = max_bytes
        self._idle: dict[tuple, list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()  # collectives take and give on their queue threads and the caller's

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements, contents undefined, held by the caller alone."""
        device = torch.device(device)
        if device.type == "cpu":
            with self._lock:
                idle = self._idle.get((numel, dtype, device))
                if idle:
                    t = idle.pop()
                    self._idle_bytes -= _nbytes(t)
                    return t
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, tensor: torch.Tensor) -> None:
        """Return ``tensor`` (from ``take``) for reuse; the caller must not touch it afterwards."""
        if tensor.device.type != "cpu":
            return
        key = (tensor.numel(), tensor.dtype, tensor.device)
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) >= self.per_shape or self._idle_bytes + _nbytes(tensor) > self.max_bytes:
                return  # dropped: torch frees it with its last reference
            idle.append(tensor)
            self._idle_bytes += _nbytes(tensor)

    @property
    def idle_bytes(self) -> int:
        """Bytes held idle for reuse now."""
        return self._idle_bytes

    def clear(self) -> None:
        """Drop every idle buffer."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


pool = ScratchPool()  # the process's pool, shared by every communicator
