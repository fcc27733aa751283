"""Predict allreduce times and training iterations at scale, from the schedule IR.

**One allreduce** (``allreduce_time``) of B bytes over ``gpus`` GPUs of a cluster, with a
schedule by name:

- up to ``_WALK_LIMIT`` GPUs the real schedule is built for the whole cluster grid and
  walked by the cost model (ddl_triton/planning/costmodel.py), intra-node links as one class,
  inter-node as the other: exactly what the planner does;
- beyond it, by symmetry, from real schedules of one representative line per level:
  ``multidim`` and ``hierarchical`` run their dimensions one after another (reduce-scatter
  along X, Y, Z, all-gather back), every line of a dimension alike and on its own links,
  so the time is the sum over dimensions of one line's allreduce (the schedule built for
  that dimension's size and algorithm, on the bytes it owns then, on that level's link).
  Cross-level pipelining of super-chunks is ignored (slightly pessimistic; the suite
  checks the decomposition against the full walk on small grids). ``rhd`` over a grid of
  powers of two is the same exchange as ``multidim`` with rhd on every dimension. A flat
  ``ring`` over N GPUs spanning nodes runs each of its 2(N-1) steps at the slowest link:
  the ring of 16 GPUs on that link with the same bytes per step, scaled by (N-1)/15.
  ``tree`` adds, beyond 64 GPUs, two latency-bound hops per doubling.

**Compression** (``--compress``: "none" or a method of ddl_triton/compression_methods.py) sends
fewer bytes, by the ratio its row's wire bits per element give (``wire_ratio``: int8 3.94x at
block 256, fp16/bf16 2x, 1-bit 32x, as this project's hooks measure them) and pays its kernels: three passes over the
fp32 bucket at memory speed (quantize, dequantize-add-requantize, dequantize).

**One training iteration** (``iteration``): forward then backward on each GPU; layer i's
backward takes ``backward_over_forward`` x its forward time, forward time per layer is
proportional to its multiply-adds; gradients become ready layer by layer in backward order
and fill DDP-style buckets (``bucket_mb``, in reverse layer order); a bucket's allreduce
starts when it is full and the previous allreduce is done, overlapping the rest of
backward (on a cluster whose spec says ``overlap = false``, such as this host, whose ranks
have no spare core, communication adds to the computation instead); the optimizer step
waits for the last allreduce. Concurrent allreduces are
modelled as one FIFO: allreduces in flight at once share the same links, so running them
one after another finishes the last at the same time and keeps the model simple (a
communicator here runs its collectives in issue order anyway). Across hosts whose link is
shaped (the testbed), each bucket's bytes also pass the link's token bucket in issue order
(simulation/shaped_link.py): an allreduce is done when its costed time and its bytes are both
through, and that wire time is not CPU time, so it runs beside the computing even where
communication otherwise adds to it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import compression_methods, schedules
from .cluster import Cluster
from .shaped_link import ShapedLink, TokenBucket
from ..planning.costmodel import CostModel
from ..schedules import grid as grid_mod
from .workload import Layer

_WALK_LIMIT = 32
_CHUNKS = 64                 # schedules are costed at most this many chunks long (as the planner does)
SCHEDULES = ("ring", "rhd", "tree", "hierarchical", "hierarchical_native", "multidim")


def compression_choices() -> tuple[str, ...]:
    """What ``--compress`` accepts: "none" and every compression method (not "auto", a runtime rule)."""
    return (compression_methods.NONE, *compression_methods.names())


def _walk(model: CostModel, name: str, nranks: int, count: int, chunk_elems: int, link_of, grid=None,
          algos=None) -> float:
    """Seconds of one allreduce of ``count`` fp32 elements by walking the real schedule."""
    if count == 0 or nranks == 1:
        return 0.0
    model_count = min(count, _CHUNKS * chunk_elems)
    sched = schedules.build(name, "allreduce", nranks, model_count, chunk_elems=chunk_elems, grid=grid, algos=algos)
    return model.time(sched, link_of, 4) * count / model_count


def _level_name(d: int) -> str:
    return ("intra", "inter", "rack")[min(d, 2)]


_LINES: dict = {}
_RING_SAMPLE = 16


def _sampled_ring(size: int, count: int, walk) -> float:
    """A ring of ``size`` members allreducing ``count``, costed as ``walk(sample, its count)``
    for the ring of sample = min(size, 16) members with the same bytes per step, scaled by
    (size-1)/(sample-1): every step of a ring moves the same bytes on the same links, so a
    long ring is a short one run for longer. (At 16 members or fewer the ring is walked whole.)"""
    if size <= 1 or count == 0:
        return 0.0
    if size <= _RING_SAMPLE:
        return walk(size, count)
    return walk(_RING_SAMPLE, max(1, count * _RING_SAMPLE // size)) * (size - 1) / (_RING_SAMPLE - 1)


def _line(cluster: Cluster, d: int, size: int, count: int, chunk: int, algo: str) -> float:
    """One line of ``size`` GPUs along dimension ``d``: allreduce of ``count`` with ``algo``.
    A ring is ``_sampled_ring``; rhd is walked whole (log steps); longer than 16, direct is not
    a candidate (size^2 messages)."""
    key = (cluster.name, d, size, count, chunk, algo)
    if key not in _LINES:
        model = cluster.level_model(_level_name(d))
        flat = lambda a, b: "shm"  # noqa: E731 - one link class along a line
        if algo == "ring":
            _LINES[key] = _sampled_ring(size, count, lambda n, c: _walk(model, "multidim", n, c, chunk, flat,
                                                                       grid=(n,), algos=("ring",)))
        elif size > _RING_SAMPLE and algo == "direct":
            _LINES[key] = math.inf
        else:
            _LINES[key] = _walk(model, "multidim", size, count, chunk, flat, grid=(size,), algos=(algo,))
    return _LINES[key]


def _engine_line(cluster: Cluster, size: int, count: int, chunk: int) -> float:
    """One line of ``size`` nodes allreducing ``count`` with the inter-node transport's own engine
    (hierarchical_native's group step): its ring, costed as the engine runs it, with no executor
    step overhead or staging copy (schedules/native.py), as ``_sampled_ring``."""
    key = (cluster.name, "engine", size, count, chunk)
    if key not in _LINES:
        model = cluster.level_model("inter")
        flat = lambda a, b: "mpi"  # noqa: E731 - every member on its own node
        _LINES[key] = _sampled_ring(size, count, lambda n, c: _walk(model, "hierarchical_native", n, c, chunk, flat,
                                                                   grid=(1, n)))
    return _LINES[key]


def best_line_algorithm(cluster: Cluster, d: int, size: int, count: int, chunk: int) -> tuple[str, float]:
    return min(((a, _line(cluster, d, size, count, chunk, a)) for a in grid_mod.PHASE_ALGORITHMS),
               key=lambda t: t[1])


def allreduce_time(cluster: Cluster, gpus: int, nbytes: int, schedule: str, *, chunk_bytes: int = 4 << 20,
                   compress: str = "none") -> tuple[float, str]:
    """(seconds, how it was costed) for one fp32 allreduce of ``nbytes`` on ``gpus`` GPUs."""
    if compress not in compression_choices():
        raise ValueError(f"unknown compression {compress!r}; valid: {', '.join(compression_choices())}")
    kernels = 0.0
    if compress != compression_methods.NONE:
        kernels = 3 * nbytes / (cluster.hbm_gbps * 1e9)
        nbytes = int(nbytes / compression_methods.get(compress).wire_ratio())
    count = max(1, nbytes // 4)
    chunk = max(1, chunk_bytes // 4)
    dims = cluster.grid(gpus)
    if gpus <= _WALK_LIMIT:
        model = cluster.two_level_model()
        x = dims[0]
        link_of = lambda a, b: "shm" if a // x == b // x else "mpi"  # noqa: E731
        grid, algos = (dims, None) if schedules.uses_grid(schedule) else (None, None)
        if schedule == "multidim" and len(dims) > 1:
            algos = tuple(best_line_algorithm(cluster, d, dims[d], count, chunk)[0] for d in range(len(dims)))
        return kernels + _walk(model, schedule, gpus, count, chunk, link_of, grid, algos), "full schedule walk"
    if schedule == "hierarchical_native":
        x, nodes = dims[0], gpus // dims[0]
        owned = max(1, count // x)
        total = _line(cluster, 0, x, count, chunk, "ring") if x > 1 else 0.0  # the node's reduce-scatter + all-gather
        total += _engine_line(cluster, nodes, owned, chunk) if nodes > 1 else 0.0
        return kernels + total, f"ring x{x} inside the nodes + the engine's ring x{nodes} between them"
    if schedule in ("multidim", "hierarchical", "rhd"):
        plan = dims if schedule != "hierarchical" else (dims[0], gpus // dims[0])
        total, owned, how = 0.0, count, []
        for d, size in enumerate(plan):
            if size == 1:
                continue
            if schedule == "multidim":
                algo, t = best_line_algorithm(cluster, d, size, owned, chunk)
            else:
                algo = "rhd" if schedule == "rhd" else "ring"
                t = _line(cluster, d, size, owned, chunk, algo)
            total += t
            how.append(f"{algo}x{size}")
            owned = max(1, owned // size)
        return kernels + total, "per-dimension lines: " + " + ".join(how)
    if schedule == "ring":
        slowest = 1 if gpus > dims[0] else 0
        return kernels + _line(cluster, slowest, gpus, count, chunk, "ring"), \
            f"ring of {_RING_SAMPLE} on the {_level_name(slowest)} link, scaled"
    if schedule == "tree":
        model = cluster.two_level_model()
        base = 64
        x = dims[0]
        t = _walk(model, "tree", base, count, chunk, lambda a, b: "shm" if a // x == b // x else "mpi")
        hop = cluster.links["inter"]["alpha"] + cluster.step_overhead + min(count, chunk) * 4 * cluster.links["inter"]["beta"]
        return kernels + t + 2 * math.log2(gpus / base) * hop, f"tree of {base}, plus two hops per doubling"
    raise ValueError(f"schedule {schedule!r} cannot be simulated at scale; valid: {', '.join(SCHEDULES)}")


@dataclass(frozen=True)
class Iteration:
    gpus: int
    compute: float        # forward + backward of one GPU, seconds
    iteration: float      # with communication
    exposed: float        # communication not hidden behind backward
    allreduce_total: float
    buckets: int

    @property
    def efficiency(self) -> float:
        """Against one GPU with no communication at all."""
        return self.compute / self.iteration


def compute_seconds(cluster: Cluster, layers: list[Layer], batch: int, img_per_s: float | None = None,
                    reference_macs: float | None = None) -> float:
    """Forward + backward seconds of one GPU for ``batch`` samples of ``layers``.

    ``img_per_s`` (default the cluster's) is measured on the cluster's reference model; another
    model's rate is scaled by multiply-adds (``reference_macs``: that model's per sample)."""
    rate = img_per_s or cluster.img_per_s
    macs = sum(l.fwd_macs for l in layers)
    if reference_macs:
        rate = rate * reference_macs / macs
    return batch / rate


def straggler_factor(gpus: int, jitter: float) -> float:
    """Expected slowest of ``gpus`` compute times whose coefficient of variation is ``jitter``,
    relative to the mean: 1 + jitter * E[max of n standard normals] (Blom's approximation).
    Synchronous training waits for the slowest rank at every allreduce; one GPU waits for nobody."""
    if gpus <= 1 or jitter <= 0:
        return 1.0
    from statistics import NormalDist
    return 1.0 + jitter * NormalDist().inv_cdf((gpus - 0.375) / (gpus + 0.25))


def iteration(cluster: Cluster, layers: list[Layer], gpus: int, schedule: str, *, batch: int,
              compute: float, bucket_mb: float = 25.0, compress: str = "none",
              allreduce=None, jitter: float = 0.0, bucket_overhead=None, overlapped_overhead=None,
              first_bucket_mb: float | None = None, link: ShapedLink | None = None, link_bytes=None) -> Iteration:
    """One data-parallel iteration on ``gpus`` GPUs (see the module doc). ``allreduce(nbytes)``
    overrides the allreduce time. ``bucket_overhead``: seconds each bucket costs beside its
    allreduce (the comm hook, the hand-off to the communicator's thread; default the
    cluster's), a number or a function of the bucket's bytes. ``overlapped_overhead``: the
    same for a bucket issued while backward still computes (default: ``bucket_overhead``);
    where communication shares compute's cores, as on this host, overlapping costs more than
    the hand-off (bench/validate_simulator.py measures both). ``jitter``: the
    per-GPU compute time's coefficient of variation ([U]; 0 = identical GPUs): every GPU
    count above one computes at the expected pace of its slowest GPU (``straggler_factor``).
    ``first_bucket_mb``: the first bucket's own cap (DDP caps its first bucket at 1 MiB by default;
    None: ``bucket_mb`` like the rest). ``link``: a host link shaped by a token bucket
    (simulation/shaped_link.py), which each bucket's allreduce crosses with ``link_bytes(nbytes)``
    bytes on its busiest direction, in issue order; the allreduce is done when both its costed time
    and its bytes on that link are through; the bucket's level carries over from bucket to bucket, so
    a bucket issued after a spell of computing gets the burst. The allreduce's costed time
    (``allreduce``) is then its unshaped time: the shaping is added here, once."""
    ratio = cluster.backward_over_forward
    total_macs = sum(l.fwd_macs for l in layers) or 1
    forward = compute * straggler_factor(gpus, jitter) / (1 + ratio)
    t = forward
    ready = []
    for layer in reversed(layers):           # backward: last layer first
        t += ratio * forward * layer.fwd_macs / total_macs
        ready.append((t, layer.params * 4))
    backward_end = t
    cap = (bucket_mb if first_bucket_mb is None else first_bucket_mb) * 1e6
    buckets, size, at = [], 0, 0.0
    for when, nbytes in ready:
        size += nbytes
        at = when
        if size >= cap:
            buckets.append((at, size))
            size = 0
            cap = bucket_mb * 1e6
    if size:
        buckets.append((at, size))
    cost = allreduce or (lambda nbytes: allreduce_time(cluster, gpus, nbytes, schedule, compress=compress)[0])
    per_bucket = cluster.bucket_overhead if bucket_overhead is None else bucket_overhead
    per_overlapped = per_bucket if overlapped_overhead is None else overlapped_overhead
    wire = TokenBucket(link) if link is not None else None
    end, spent = 0.0, 0.0
    if gpus > 1:
        for when, nbytes in buckets:
            extra = per_overlapped if when < backward_end else per_bucket
            took = cost(nbytes) + (extra(nbytes) if callable(extra) else extra)
            # Without overlap, the communication done so far has delayed the computing by ``spent``.
            start = max(end, when if cluster.overlap else when + spent)
            end = start + took
            if wire is not None:
                end = max(end, wire.transfer(start, link_bytes(nbytes)))
            spent += took
    finished = max(backward_end, end) if cluster.overlap else max(backward_end + spent, end)
    return Iteration(gpus, compute, finished, finished - backward_end, spent, len(buckets))
