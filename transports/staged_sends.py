"""Staged sends for two-sided transports (MPI, gloo): pooled buffers and the sends in flight.

Semantics: ``acquire`` hands out a staging buffer for one message (from a pool of power-of-two
size classes, so a training loop's buckets reuse the same few buffers); the transport fills
it, posts its sends in ``publish`` and records them with ``_sending_from``. A buffer returns
to the pool once every send from it has completed (``_reap_sends``, run at each acquire).
Subclasses say when their send handles are done (``_sends_done``) and may pump their own
progress first (``_progress``).
"""
from __future__ import annotations

from collections import defaultdict

import torch


def size_class(nbytes: int) -> int:
    """The pool's size class for a message of ``nbytes``: the next power of two, at least 64."""
    return max(64, 1 << (max(nbytes, 1) - 1).bit_length())


class StagedSends:
    """The buffer pool and in-flight sends a two-sided transport shares (see the module doc)."""

    def _init_staging(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._sending: list[tuple[object, torch.Tensor, int]] = []  # (send handles, buffer, first dest)
        self._staged: tuple[int, tuple[int, ...], int, torch.Tensor] | None = None
        self._posted: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}  # (peer, msg) -> (recv, buffer)

    def _sends_done(self, handles) -> bool:
        raise NotImplementedError

    def _progress(self) -> None:
        """Called before sends are reaped (MPI's link emulation releases due messages here)."""

    def _take(self, nbytes: int) -> torch.Tensor:
        cls = size_class(nbytes)
        pool = self._free[cls]
        return pool.pop() if pool else torch.empty(cls, dtype=torch.uint8)

    def _give(self, buf: torch.Tensor) -> None:
        self._free[buf.numel()].append(buf)

    def _reap_sends(self) -> None:
        self._progress()
        still = []
        for handles, buf, dest in self._sending:
            if self._sends_done(handles):
                self._give(buf)  # a failed send surfaces at the receiver, or in flush
            else:
                still.append((handles, buf, dest))
        self._sending = still

    def acquire(self, msg_id: int, peers: tuple[int, ...], count: int, dtype: torch.dtype,
                timeout: float) -> torch.Tensor:
        self._reap_sends()
        nbytes = count * dtype.itemsize
        buf = self._take(nbytes)
        self._staged = (msg_id, peers, nbytes, buf)
        return buf[:nbytes].view(dtype)

    def release(self, peer: int, msg_id: int) -> None:
        _, buf = self._posted.pop((peer, msg_id))
        self._give(buf)

    def _unstage(self, msg_id: int):
        """(peers, nbytes, buffer) of the message ``acquire`` staged as ``msg_id``."""
        staged_id, peers, nbytes, buf = self._staged  # type: ignore[misc]
        assert staged_id == msg_id, "publish without a matching acquire"
        self._staged = None
        return peers, nbytes, buf
