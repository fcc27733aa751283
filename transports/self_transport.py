"""The self transport: loopback for a world of one rank, messages to oneself kept in memory.

Schedules never address a rank's own messages to itself, so at size 1 this
transport only carries what a caller sends explicitly; it exists so that every
communicator, whatever its size, has the same transport protocol underneath.
"""
from __future__ import annotations

import torch


class SelfTransport:
    name = "self"
    completes_sends = False
    posts_receives_early = False
    spin = 0.0  # nothing to wait for

    def __init__(self):
        self.bytes_sent = 0
        self.bytes_received = 0
        self._messages: dict[int, torch.Tensor] = {}
        self._staged: tuple[int, torch.Tensor] | None = None

    def acquire(self, msg_id: int, peers: tuple[int, ...], count: int, dtype: torch.dtype,
                timeout: float) -> torch.Tensor:
        if any(p != 0 for p in peers):
            raise ValueError(f"self transport: no rank {peers} in a world of one")
        buf = torch.empty(count, dtype=dtype)
        self._staged = (msg_id, buf)
        return buf

    def publish(self, msg_id: int) -> None:
        staged_id, buf = self._staged  # type: ignore[misc]
        assert staged_id == msg_id, "publish without a matching acquire"
        self._messages[msg_id] = buf
        self.bytes_sent += buf.numel() * buf.element_size()
        self._staged = None

    def prefetch(self, peer: int, msg_id: int, size: int, dtype: torch.dtype) -> None:
        """Nothing to post: the message is already in memory."""

    def recv(self, peer: int, msg_id: int, count: int, dtype: torch.dtype, timeout: float,
             offset: int = 0, size: int = 0) -> torch.Tensor:
        try:
            buf = self._messages[msg_id]
        except KeyError:
            # In a world of one nobody else can send it: waiting would only hang.
            raise ValueError(f"self transport: message {msg_id} was never sent") from None
        self.bytes_received += count * dtype.itemsize
        return buf[offset:offset + count]

    def release(self, peer: int, msg_id: int) -> None:
        self._messages.pop(msg_id, None)

    def flush(self, timeout: float) -> None:
        """Loopback sends complete at publish."""

    def close(self) -> None:
        self._messages.clear()


def open_for(opening) -> SelfTransport:
    """The self transport of a world of one (transports/table.py's row "self")."""
    return SelfTransport()
