"""When compression pays: the rule behind ``compression="auto"``, per level and per size.

Only the inter-host level is ever compressed (ddl_triton/runtime/compression/per_level.py); inside a host
the bytes go over shm, where compression lost in every measurement so far, so on one host the
answer is always "none". Between hosts the question is whether the bytes saved on the link are
worth the time spent compressing. Two sources answer it, in this order:

1. **A tuning table's ``compression`` section** (``ddl-tune --compression``, which
   ``sweep_compression`` fills): each level's link as measured (latency, bandwidth), and per size
   the measured time of the full-precision allreduce and of the per-level int8 and 1-bit ones.
   A size takes the entry measured nearest to it (log scale); the winner there decides.
2. **Else, a cost model of the inter-host phase** on the link as probed at first use
   (``probe``: the link the communicator measured at init for its planner, ``shared_link``,
   where it did, else an fp32 allreduce of 8 B and of 1 MiB over the cross group; and int8 /
   1-bit compression of 1 MiB on this CPU; every rank takes the slowest rank's times, so every
   rank decides alike). For a shard of s = 4C bytes (C = ceil(N / L)) on H hosts:

       none:   k * latency + 2(H-1)/H * s / bandwidth
       int8:   k * latency + wire_bytes("int8", C, H) / bandwidth + 2 * (fixed + s / speed)
       onebit: likewise with 1-bit's wire bytes, fixed cost and speed

   (k = ``compressed.latency_steps(H)``: 2(H-1) messages in a row, or 1 on two hosts, which
   exchange once: the compressed call gathers, and fp32 sends the same bytes in one exchange)
   (the intra-host phases are the same fp32 bytes either way, so they cancel; ``fixed`` and
   ``speed`` are one compress + decompress on this CPU, its cost at 1 KiB and its fp32 bytes per
   second at 1 MiB; a call does about two of them: the worker's, and the server's fused
   reduce-and-requantize with the final decompress; on two hosts, the two decompresses).

**A call with backward still behind it.** The times above are the phase's whole time, what a
call costs when the step waits for it (the last DDP bucket: backward has ended). A bucket issued
mid-backward is different: its link time hides behind the backward that follows it, while the
compression kernels' time does not (on a CPU rank with no core to spare they take the core
backward needs; on a GPU, its SMs). So given ``behind_us``, the backward known to follow the
call (measured by ddl_triton/torch/backward_position.py), the rule compares what each method
*adds to the step*:

    exposed(m) = kernels(m) + max(0, phase(m) - kernels(m) - behind_us)

and a call whose full-precision phase fits in ``behind_us`` keeps full precision: nothing of it
shows, and compressing could only add kernel time. ``behind_us = 0`` is the plain comparison.
A table's entries are whole measured calls, kernels and wire together, so there the rule is
``max(0, t(m) - behind_us)``: it cannot tell the kernels' share, and says so in its reason.

``auto`` picks among "none" and the methods whose row in ddl_triton/compression_methods.py says
``auto`` (``compression_methods.auto_names()``: int8). 1-bit's quality depends on the optimizer (it
oscillates under momentum, docs/torch.md), which a rule measuring time cannot see; fp16 and bf16
were added as rows after auto's measurements (bench/results), so they stay out of it until measured
there. Name any of them to use it. The table still records 1-bit's times, and ``Decision.estimates_us``
shows them. Example (2 hosts x 1 rank, 1 Gbit/s: 0.114 GB/s, 150 us; int8: 1 GB/s, 40 us fixed):
a 2 MiB bucket -> none 18.5 ms, int8 9.1 ms: "int8"; a 4 KiB tensor -> none 186 us, int8 247 us: "none".
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from .. import compression_methods
from ..runtime.compression import compressed

__all__ = ["CompressorSpeed", "Decision", "LinkSpeed", "decide", "exposed_us", "from_table",
           "predict_us", "probe", "shared_link", "sweep_compression"]

_PROBE_SMALL, _PROBE_FIXED, _PROBE_BIG = 8, 1 << 10, 1 << 20


@dataclass(frozen=True)
class LinkSpeed:
    """A level's link: fixed cost per message step (us) and bandwidth (bytes/s), and where from."""

    latency_us: float
    bytes_per_s: float
    source: str

    def describe(self) -> str:
        return f"{self.bytes_per_s / 1e9:.3f} GB/s, {self.latency_us:.0f} us per step ({self.source})"


@dataclass(frozen=True)
class CompressorSpeed:
    """One compress + decompress on this CPU, per method: fp32 bytes per second (at 1 MiB) and
    the fixed cost per call (us, at 1 KiB)."""

    bytes_per_s: dict
    fixed_us: dict


@dataclass(frozen=True)
class Decision:
    """What auto chose for one size, and why (``reason``: one line, as explain prints it)."""

    method: str                         # "none", or a method of ddl_triton/compression_methods.py
    reason: str
    estimates_us: dict = field(default_factory=dict)


def predict_us(method: str, nbytes: int, hosts: int, local: int, link: LinkSpeed, speed: CompressorSpeed,
               block: int = 256) -> float:
    """The cost model's time (us) of the inter-host phase for an ``nbytes`` fp32 tensor (module doc)."""
    return _link_us(method, nbytes, hosts, local, link, block) + _kernels_us(method, nbytes, hosts, local, speed)


def exposed_us(method: str, nbytes: int, hosts: int, local: int, link: LinkSpeed, speed: CompressorSpeed,
               behind_us: float, block: int = 256) -> float:
    """What the phase adds to the step (us) when ``behind_us`` of backward follows the call: the
    kernels whole, the link time beyond ``behind_us`` (module doc)."""
    return (_kernels_us(method, nbytes, hosts, local, speed)
            + max(0.0, _link_us(method, nbytes, hosts, local, link, block) - behind_us))


def decide(nbytes: int, hosts: int, local: int, link: LinkSpeed | None, speed: CompressorSpeed | None, *,
           uniform: bool = True, methods=None, block: int = 256, behind_us: float = 0.0) -> Decision:
    """auto's choice for an ``nbytes`` fp32 allreduce on ``hosts`` hosts of ``local`` ranks, with
    ``behind_us`` of backward known to follow the call (0: the step waits for it), among "none"
    and ``methods`` (default: the rows auto may choose, ``compression_methods.auto_names()``)."""
    methods = compression_methods.auto_names() if methods is None else tuple(methods)
    if hosts == 1:
        return Decision("none", "one host: every level is shm, where compression never pays")
    if not uniform:
        return Decision("none", "hosts hold unequal rank counts: no per-level groups, full precision")
    if behind_us <= 0:
        est = {m: predict_us(m, nbytes, hosts, local, link, speed, block) for m in (compression_methods.NONE, *methods)}
        what = "cost model of the inter-host phase"
    else:
        est = {m: exposed_us(m, nbytes, hosts, local, link, speed, behind_us, block)
               for m in (compression_methods.NONE, *methods)}
        what = (f"cost model of what the inter-host phase adds to the step, {behind_us / 1e3:.1f} ms of backward "
                "behind it,")
    best = _fastest(est)
    return Decision(best, f"{what} on {link.describe()}: {_shown(est)}", est)


def from_table(section: dict, nbytes: int, hosts: int, methods=None, behind_us: float = 0.0) -> Decision | None:
    """The table's choice for ``nbytes`` (the entry measured nearest in log size), or None when
    the section has no entries. ``section``: a tuning table's ``compression`` (module doc);
    ``methods`` and ``behind_us``: as for ``decide``."""
    methods = compression_methods.auto_names() if methods is None else tuple(methods)
    rows = section.get("entries") or []
    if hosts == 1:
        return Decision("none", "one host: every level is shm, where compression never pays")
    if not rows:
        return None
    row = min(rows, key=lambda r: (abs(math.log(max(r["bytes"], 1) / max(nbytes, 1))), r["bytes"]))
    times = {m: t for m, t in row["by_method"].items() if m == compression_methods.NONE or m in methods}
    inter = section.get("levels", {}).get("inter")
    link = f" on an inter-host link of {inter['bytes_per_s'] / 1e9:.3f} GB/s" if inter else ""
    if behind_us <= 0:
        return Decision(_fastest(times), f"tuning table: measured at {row['bytes']} B{link}: "
                                         f"{_shown(row['by_method'])}", dict(times))
    shown = {m: max(0.0, t - behind_us) for m, t in times.items()}
    return Decision(_fastest(shown), f"tuning table: measured at {row['bytes']} B{link}, less the "
                                     f"{behind_us / 1e3:.1f} ms of backward behind the call (kernels' share "
                                     f"not known, so hidden alike): {_shown(shown)}", shown)


def probe(levels) -> tuple[LinkSpeed, CompressorSpeed]:
    """Measure the inter-host link and this CPU's compressors, every method of
    ddl_triton/compression_methods.py (collective over ``levels.comm``: every rank, same point;
    about 10 fp32 allreduces of at most 1 MiB). Every rank returns the slowest rank's figures, so
    every rank decides alike."""
    import torch

    comm, cross, hosts = levels.comm, levels.cross, levels.hosts
    methods = compression_methods.names()  # the same table on every rank: the same figures, in order
    measured = shared_link(levels)
    mine = [] if measured is not None else [_time_allreduce(cross, _PROBE_SMALL), _time_allreduce(cross, _PROBE_BIG)]
    mine += [_time_compressor(m, n) for m in methods for n in (_PROBE_FIXED, _PROBE_BIG)]
    agreed = torch.tensor(mine, dtype=torch.float64)
    comm.allreduce(agreed, op="max")  # same figures everywhere: the same decisions everywhere
    figures = agreed.tolist()
    if measured is not None:
        link, kernels = measured, figures
    else:
        small, big, *kernels = figures
        latency = small / max(1, compressed.latency_steps(hosts)) * 1e6  # an 8 B allreduce: its latency steps alone
        bw = 2 * (hosts - 1) / hosts * _PROBE_BIG / max(big - small, 1e-9)
        link = LinkSpeed(latency, bw, f"probed at first use over the {hosts} hosts")
    fixed = dict(zip(methods, kernels[0::2]))
    whole = dict(zip(methods, kernels[1::2]))
    return link, CompressorSpeed({m: _PROBE_BIG / max(whole[m] - fixed[m], 1e-9) for m in methods},
                                 {m: fixed[m] * 1e6 for m in methods})


def shared_link(levels) -> LinkSpeed | None:
    """The link between hosts as ``levels.comm`` measured it at init (runtime/setup/link_probe.py,
    every rank the same figures), or None where it did not, as one cross group sees it: the host
    link's rate divided among the ``levels.local_size`` ranks of a host, whose groups cross it at once
    (what timing an allreduce on every cross group at once measured). Its latency is one message's,
    not an 8 B allreduce's: both methods pay the same latency steps (module doc), so only the rate
    decides."""
    link = getattr(getattr(levels.comm, "planner", None), "link", None)
    if link is None:
        return None
    return LinkSpeed(link.alpha * 1e6, link.bytes_per_s / max(1, levels.local_size),
                     "measured at init, shared with the planner")


def sweep_compression(levels, sizes: list[int], rounds: int = 5) -> dict:
    """The tuning table's ``compression`` section: each level's link, and per size the median
    time (slowest rank, interleaved rounds) of the plain fp32 allreduce ("none") and of the
    per-level allreduce of every method of ddl_triton/compression_methods.py, with error feedback
    where it keeps it. Collective over ``levels.comm``."""
    import torch

    from ..runtime.compression import per_level

    comm = levels.comm
    out: dict = {"levels": {}, "entries": []}
    if levels.node is not None and levels.local_size > 1:
        out["levels"]["intra"] = _link_entry(levels.node, 1, "shm")
    if levels.cross is not None:
        out["levels"]["inter"] = _link_entry(levels.cross, levels.hosts, "inter-host")
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        runs = {"none": lambda: comm.allreduce(x, op="avg")}
        if levels.hosts > 1 and levels.uniform:
            for m in compression_methods.names():
                w, s = per_level.residual_sizes(levels, m, x.numel())
                res = torch.zeros(w) if w else None
                srv = torch.zeros(s) if s is not None else None
                runs[m] = lambda m=m, res=res, srv=srv: per_level.allreduce(levels, x, method=m, residual=res,
                                                                            server_residual=srv)
        samples: dict = {m: [] for m in runs}
        for _ in range(rounds):
            for m, run in runs.items():
                samples[m].append(_slowest(comm, run))
        out["entries"].append({"bytes": nbytes, "by_method": {m: round(statistics.median(t) * 1e6, 3)
                                                              for m, t in samples.items()}})
    return out


# -- private ----------------------------------------------------------------------------------
def _link_us(method: str, nbytes: int, hosts: int, local: int, link: LinkSpeed, block: int) -> float:
    """The phase's time on the link (us): its latency steps and its bytes (module doc)."""
    if hosts == 1 or nbytes == 0:
        return 0.0
    c = -(-(nbytes // 4) // local)
    steps = compressed.latency_steps(hosts) * link.latency_us
    if method == "none":
        return steps + 2 * (hosts - 1) / hosts * 4 * c / link.bytes_per_s * 1e6
    return steps + compressed.wire_bytes(method, c, hosts, block=block) / link.bytes_per_s * 1e6


def _kernels_us(method: str, nbytes: int, hosts: int, local: int, speed: CompressorSpeed) -> float:
    """The phase's compression kernels (us): about two compress + decompress (module doc)."""
    if method == "none" or hosts == 1 or nbytes == 0:
        return 0.0
    c = -(-(nbytes // 4) // local)
    return 2 * (speed.fixed_us[method] + 4 * c / speed.bytes_per_s[method] * 1e6)


def _fastest(times: dict) -> str:
    return min(times, key=lambda m: (times[m], m != "none"))  # a tie keeps full precision


def _shown(times: dict) -> str:
    return ", ".join(f"{m} {t:.0f} us" for m, t in sorted(times.items(), key=lambda kv: kv[1]))


def _time_allreduce(comm, nbytes: int, reps: int = 5) -> float:
    """Median seconds of an fp32 allreduce of ``nbytes`` on ``comm``, after one warm-up."""
    import torch

    x = torch.zeros(nbytes // 4, dtype=torch.float32)
    comm.allreduce(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        comm.allreduce(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_compressor(method: str, nbytes: int, reps: int = 5) -> float:
    """Median seconds of one compress + decompress of ``nbytes`` of fp32 with ``method``'s kernels
    (its row's ``roundtrip``)."""
    import torch

    roundtrip = compression_methods.resolve(compression_methods.get(method).roundtrip)
    x = torch.linspace(-1, 1, nbytes // 4, dtype=torch.float32)
    out = torch.empty_like(x)
    roundtrip(x, out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        roundtrip(x, out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _slowest(comm, run) -> float:
    """Seconds of ``run()`` after a barrier, the slowest rank's (every rank gets the same)."""
    import torch

    comm.barrier()
    t0 = time.perf_counter()
    run()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    comm.allreduce(t, op="max")
    return float(t[0])


def _link_entry(comm, hosts: int, what: str) -> dict:
    """A level's link as a fp32 allreduce of 8 B and 1 MiB on ``comm`` measures it."""
    small = _slowest_median(comm, _PROBE_SMALL)
    big = _slowest_median(comm, _PROBE_BIG)
    steps = max(1, compressed.latency_steps(max(hosts, comm.size)))
    return {"what": what, "ranks": comm.size, "latency_us": round(small / steps * 1e6, 3),
            "bytes_per_s": round(2 * (comm.size - 1) / comm.size * _PROBE_BIG / max(big - small, 1e-9), 1)}


def _slowest_median(comm, nbytes: int, reps: int = 5) -> float:
    import torch

    x = torch.zeros(nbytes // 4, dtype=torch.float32)
    comm.allreduce(x)
    return statistics.median(_slowest(comm, lambda: comm.allreduce(x)) for _ in range(reps))
