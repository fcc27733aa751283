"""The link between hosts as measured at init, and the cost model priced with it.

Semantics: a :class:`MeasuredLink` is what ddl_triton/runtime/setup/link_probe.py measured once,
when a communicator spanning hosts started with no fitted cost model (no ``ddl-tune`` table):

- ``alpha``: seconds from a send to the peer host's receive (half an 8-byte round trip);
- ``bytes_per_s``: one host link's rate, each way, with both directions busy at once (an
  allreduce's traffic), from the time difference of two large exchanges, so that a shaper's
  burst allowance (tbf) and the exchange's fixed cost cancel;
- ``cpu_share``: the share of a core each rank got while every rank of the communicator was busy
  at once (1.0: a core each; 0.5: two busy ranks per core).

Every rank holds the same figures (the slowest link's, the ranks' mean share), so every rank plans alike.

``price(model, link, ranks_per_node)`` is ``model`` with the link between hosts and the general
path's step cost replaced:

    mpi.alpha       = link.alpha
    mpi.beta        = ranks_per_node / link.bytes_per_s
    step_overhead   = model.step_overhead + (busy - 1) * STEP_WAIT
    call_allreduce  = model's + busy * GENERAL_CALL

(``busy`` = 1 / cpu_share, or 1 where a rank had most of a core.)

- **beta**: the model charges each rank for the bytes it receives, alone; across hosts the ranks of
  a node receive at once over one host link (one_shot, hierarchical, multidim: every rank crosses),
  so each gets its share of the rate.
- **step_overhead**: where ranks outnumber cores, a general-path step that waits on a peer waits
  until the scheduler runs it. That is why, at 2 hosts x 2 ranks on 2 cores, every general-path
  schedule took 1.4-2.4 ms even at 8 B against the small path's 0.29 ms (one exchange): pricing
  the link alone, without this, made 8-64 KiB 1.4-6.9x slower
  (bench/results/collectives_across_hosts.md, "Tried and not kept"). The small path is one_shot's
  two steps; hierarchical's are eight, so the model now sees the small path win at small sizes.
- **call_allreduce**: an allreduce that does not take the small path (one exchange in the call
  lane) is staged, planned and run by the executor, a fixed cost the default model leaves out
  (it never changes a choice among the general schedules); against the small path it does. With
  the link's true latency (10 us, not the default 25) and without it, the model put
  hierarchical_native (MPI's own allreduce, 80 us at 8 B across the testbed) before the small
  path (27 us).
``STEP_WAIT`` and ``GENERAL_CALL`` were measured on the testbed (their comments).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .costmodel import CALL_KINDS, CostModel, Link

# Seconds a general-path step waits per extra busy rank on a core: 2 testbed hosts x 2 ranks on
# 2 cores (cpu_share 0.5), 8 B allreduce, hierarchical (8 steps on the critical path) 1.47 ms,
# ring (7 steps) 1.82 ms, against 0.17-0.19 ms modelled with the default step cost
# (bench/results/collectives_across_hosts.md): about 160 us more per step.
STEP_WAIT = 160e-6
# Seconds an allreduce on the general path costs beyond its schedule's steps, against the small
# path: 2 testbed hosts x 1 rank, 8 B, hierarchical_native 80 us against the small path's 27 us
# (bench/results/collectives_across_hosts.md, sixth session), modelled 20 and 34 us without it.
GENERAL_CALL = 60e-6
# Shares above this are a core each (timer noise on an idle machine reads 0.9x).
_FULL_SHARE = 0.8


@dataclass(frozen=True)
class MeasuredLink:
    """The link between hosts and the ranks' share of a core, as measured at init (module doc)."""

    alpha: float          # seconds, one way
    bytes_per_s: float    # one host link, each way, both ways busy
    cpu_share: float      # of a core, per rank, every rank busy
    links: int = 1        # host links measured
    seconds: float = 0.0  # what measuring cost this rank at init

    def describe(self) -> str:
        """One line for ``explain``, e.g. "link between hosts measured at init: 0.118 GB/s each way,
        9 us; 0.50 of a core per rank"."""
        links = f" (slowest of {self.links} host links)" if self.links > 1 else ""
        return (f"link between hosts measured at init: {self.bytes_per_s / 1e9:.3f} GB/s each way, "
                f"{self.alpha * 1e6:.0f} us{links}; {min(1.0, self.cpu_share):.2f} of a core per rank "
                f"(probe {self.seconds * 1e3:.0f} ms; DDL_LINK_PROBE=0 turns it off)")

    def to_list(self) -> list:
        return [self.alpha, self.bytes_per_s, self.cpu_share, self.links, self.seconds]


def price(model: CostModel, link: MeasuredLink, ranks_per_node: int) -> CostModel:
    """``model`` with the link between hosts and the step cost as measured (module doc)."""
    busy = 1.0 if link.cpu_share >= _FULL_SHARE else 1.0 / max(link.cpu_share, 0.05)
    calls = list(model.calls)
    calls[CALL_KINDS.index("allreduce")] += busy * GENERAL_CALL
    return replace(model, mpi=Link(alpha=link.alpha, beta=max(1, ranks_per_node) / link.bytes_per_s),
                   step_overhead=model.step_overhead + (busy - 1.0) * STEP_WAIT, calls=tuple(calls))


def rate(small_bytes: int, small_s: float, big_bytes: int, big_s: float) -> float:
    """Bytes per second from two transfers' times: the difference cancels what both pay alike
    (latency, a shaper's burst allowance). Raises ValueError when the larger transfer was not
    slower (nothing to measure a rate from)."""
    if big_bytes <= small_bytes or not big_s > small_s:
        raise ValueError(f"cannot measure a rate: {big_bytes} B took {big_s * 1e6:.0f} us, "
                         f"{small_bytes} B {small_s * 1e6:.0f} us")
    return (big_bytes - small_bytes) / (big_s - small_s)


def agree(figures: list[list]) -> MeasuredLink:
    """What every rank plans with, from every rank's ``[alpha, bytes_per_s, cpu_share, links,
    seconds]`` (a rank that measured no link sends alpha and rate as None): the slowest link (the
    largest alpha, the smallest rate), the ranks' mean share of a core, the longest probe. The same
    list gives the same answer on every rank. Raises ValueError when no rank measured a link or a
    figure is not a finite positive number."""
    measured = [f for f in figures if f[0] is not None]
    if not measured:
        raise ValueError("no rank measured the link between hosts")
    for f in figures:
        numbers = (list(f[:2]) if f[0] is not None else []) + [f[2], f[3], f[4]]
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0
               for x in numbers) or not f[2] > 0 or (f[0] is not None and not f[1] > 0):
            raise ValueError(f"a link probe figure is not a finite positive number: {f!r}")
    # The cores the ranks got together, divided among them: one rank's share over a short window
    # swings with the scheduler's slices (0.2-0.6 for 4 ranks on 2 cores), their sum much less.
    return MeasuredLink(alpha=max(f[0] for f in measured), bytes_per_s=min(f[1] for f in measured),
                        cpu_share=sum(f[2] for f in figures) / len(figures), links=sum(int(f[3]) for f in measured),
                        seconds=max(f[4] for f in figures))

