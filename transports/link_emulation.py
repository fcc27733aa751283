"""Link emulation (a testing tool, off by default): make the MPI transport behave like a slower link.

``DDL_LINK_EMULATION="mpi:bw=1GB/s,lat=50us"`` (``Options.link_emulation``) delays every
message the MPI transport sends, so that ``DDL_TOPOLOGY=2x2`` on one host gives a
slow-network regime to measure and to check the simulator against.

Semantics: each rank has one outgoing link of bandwidth ``bw``. A message of B bytes
published at time t starts when the link is free (``start = max(t, free)``), occupies it
for B / bw (``free = start + B / bw``) and is handed to MPI at ``free + lat``. The sender
never blocks: queued messages are handed over whenever the transport is called again
(publish, acquire, every poll of a receive, flush), so computation overlaps the emulated
wire as it would a real one. The real transfer on this host (microseconds) comes on top.

Accepted units: bw in B/s, KB/s, MB/s, GB/s (decimal) or KiB/s, MiB/s, GiB/s; lat in s, ms,
us, ns. Only the "mpi" transport can be emulated.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

_BW = {"b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "kib/s": 1 << 10, "mib/s": 1 << 20, "gib/s": 1 << 30}
_LAT = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_ITEM = re.compile(r"^\s*(bw|lat)\s*=\s*([0-9.]+(?:e-?[0-9]+)?)\s*([a-zA-Z/]+)\s*$")


@dataclass(frozen=True)
class LinkSpec:
    bandwidth: float  # bytes per second
    latency: float    # seconds

    def __str__(self) -> str:
        return f"mpi:bw={self.bandwidth / 1e9:g}GB/s,lat={self.latency * 1e6:g}us"


def parse(text: str) -> LinkSpec | None:
    """``"mpi:bw=1GB/s,lat=50us"`` -> LinkSpec; "" -> None; anything else raises ValueError."""
    if not text:
        return None
    transport, _, rest = text.partition(":")
    if transport.strip() != "mpi" or not rest:
        raise ValueError(f"DDL_LINK_EMULATION={text!r}: expected 'mpi:bw=<rate>,lat=<time>', "
                         "e.g. 'mpi:bw=1GB/s,lat=50us' (only the mpi transport can be emulated)")
    values = {}
    for item in rest.split(","):
        m = _ITEM.match(item)
        units = _BW if m and m.group(1) == "bw" else _LAT
        if not m or m.group(3).lower() not in units:
            raise ValueError(f"DDL_LINK_EMULATION={text!r}: cannot read {item.strip()!r} (bw units: "
                             f"{', '.join(_BW)}; lat units: {', '.join(_LAT)})")
        values[m.group(1)] = float(m.group(2)) * units[m.group(3).lower()]
    if "bw" not in values or values["bw"] <= 0:
        raise ValueError(f"DDL_LINK_EMULATION={text!r}: needs a positive bw")
    return LinkSpec(bandwidth=values["bw"], latency=values.get("lat", 0.0))


class Pacer:
    """Holds back one rank's outgoing messages until the emulated link would deliver them."""

    def __init__(self, spec: LinkSpec):
        self.spec = spec
        self._free = 0.0
        self._queue: list[tuple[float, object]] = []  # (deliver at, post: a callable that posts the send)

    def submit(self, nbytes: int, post) -> None:
        now = time.monotonic()
        start = max(now, self._free)
        self._free = start + nbytes / self.spec.bandwidth
        self._queue.append((self._free + self.spec.latency, post))
        self.pump()

    def pump(self) -> bool:
        """Hand over every message whose time has come; True when none is left waiting."""
        if self._queue:
            now = time.monotonic()
            while self._queue and self._queue[0][0] <= now:
                self._queue.pop(0)[1]()
        return not self._queue
