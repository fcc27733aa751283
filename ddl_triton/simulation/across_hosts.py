"""Predictions across real hosts whose link is shaped (the testbed: clusters/testbed.toml).

A calibrated cluster: ddl_triton's own costs are this machine's, the link is the cluster file's.

- **The cost model** (``hosts_model``): the one ``ddl-tune`` fits across the same hosts with their
  links' shaping off, where there are hosts to probe (bench/validate_simulator.py --hosts does);
  else the one it fits on this machine for the same ranks and grid with emulated nodes (``DDL_TOPOLOGY``: the "inter-node" messages go over MPI,
  which MPICH carries through its shared memory), so the executor's steps, the call costs, the
  shm links, the reductions and ddl_triton's side of each MPI message are measured where they
  run. Its MPI link then trades MPICH's same-host latency and per-byte time (the file's
  ``same_host_*``, measured with MPICH alone) for the real link's (``alpha_us``,
  ``bandwidth_gbps``, measured the same way across the hosts with the shaping off).
- **One allreduce** (``hosts_allreduce``): the planner's walk of the real schedule with that model,
  every message between hosts passing the token buckets of the hosts' links
  (simulation/shaped_link.py), as one of a steady stream of calls or of ``calls`` calls after an
  idle spell; beside it, the unshaped walk and the bytes on the busiest host link.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .. import schedules
from ..planning.costmodel import CostModel, Link
from ..planning.planner import Planner
from ..planning.topology import parse
from .cluster import Cluster, local_model
from .shaped_link import ShapedLink, host_link_bytes, schedule_seconds

_MODEL_CHUNKS = 64  # as the planner: a schedule is costed at most this many chunks long, then scaled


@dataclass(frozen=True)
class Prediction:
    seconds: float          # per call, the shaping included
    unshaped: float         # the walk alone: what the call would take on the unshaped link
    link_bytes: float       # bytes on the busiest direction of a host link
    schedule: str
    grid: tuple[int, ...] | None
    algos: tuple[str, ...] | None


def with_rate(cluster: Cluster, rate: str) -> Cluster:
    """``cluster`` with its shaped link at the tbf ``rate`` ("1gbit", "100mbit") and the burst the
    testbed gives that rate (ddl_triton/testbed/hosts.py's ``burst_bytes``), in payload bytes at the
    file's goodput share."""
    from ..testbed.hosts import burst_bytes, parse_rate

    inter = cluster.links["inter"]
    share = inter["goodput_share"]
    link = ShapedLink(rate=parse_rate(rate) / 8 * share, burst=burst_bytes(rate) * share)
    return replace(cluster, links={**cluster.links, "inter": {**inter, "shaped": link}})


def hosts_model(cluster: Cluster, per_host: int, hosts: int, *, probe: bool = False,
                refresh: bool = False, fitted: tuple[CostModel, str] | None = None) -> tuple[CostModel, str]:
    """(the cost model of ``hosts`` hosts x ``per_host`` ranks on ``cluster``, where it came from).

    ``fitted``: a model ddl-tune fitted across those very hosts with their shaping off (and where it
    came from), taken as it is: ddl_triton's costs and the unshaped link as they are there; the
    shaping is the cluster file's, added by ``hosts_allreduce``. Without it: this machine's fitted
    model for the same grid of emulated nodes, its MPI link moved onto the cluster's (see the module
    doc), which needs no hosts to probe but carries what emulated nodes do differently; ``probe``:
    where no table is cached, run a quick ddl-tune for it (asked for only: cluster.local_model)."""
    if fitted is not None:
        return fitted
    inter = cluster.links["inter"]
    model, source = local_model(per_host * hosts, f"{per_host}x{hosts}", probe=probe, refresh=refresh)
    alpha = max(0.0, model.mpi.alpha - inter.get("same_host_alpha_us", 0.0)) + inter["alpha"]
    beta = max(0.0, model.mpi.beta - inter.get("same_host_gbps", 0.0)) + inter["beta"]
    return replace(model, mpi=Link(alpha, beta)), (
        f"{source}, MPI's link moved onto {cluster.name}'s: {model.mpi.alpha * 1e6:.1f} -> {alpha * 1e6:.1f} us, "
        f"{1 / model.mpi.beta / 1e9 if model.mpi.beta else float('inf'):.2f} -> {1 / beta / 1e9:.2f} GB/s")


def hosts_allreduce(cluster: Cluster, model: CostModel, per_host: int, hosts: int, nbytes: int, schedule: str, *,
                    chunk_bytes: int = 2 << 20, grid=None, algos=None, calls: int | None = None,
                    small: bool = False) -> Prediction:
    """One fp32 allreduce of ``nbytes`` on ``hosts`` x ``per_host`` ranks of ``cluster`` with ``model``
    (``hosts_model``), by ``schedule`` with ``grid``/``algos`` (default: the planner's for this model),
    one of ``calls`` back-to-back calls after an idle spell (None: the steady state). ``small``: the
    call takes the small-message path (``one_shot`` within its limit: the model's own fixed cost for
    it, as the planner costs it)."""
    size = per_host * hosts
    planner = Planner(rank=0, size=size, topology=parse(f"{per_host}x{hosts}", size, 0),
                      link_of=lambda a, b: "shm" if a // per_host == b // per_host else "mpi", forced="",
                      slot_bytes=chunk_bytes)
    planner.model = model
    elem = 4
    count, chunk = nbytes // elem, max(1, chunk_bytes // elem)
    if grid is None and algos is None:
        grid, algos = planner.grid_params(schedule, count, chunk, elem)
    unshaped = planner.model_time(schedule, "allreduce", count, chunk, elem, grid, algos, small=small)
    if count == 0 or size == 1:
        return Prediction(unshaped, unshaped, 0.0, schedule, grid, algos)
    model_count = min(count, _MODEL_CHUNKS * chunk)
    built = schedules.build(schedule, "allreduce", size, model_count, chunk_elems=chunk, grid=grid, algos=algos)
    scale = count / model_count
    host_of = lambda r: r // per_host  # noqa: E731
    link_bytes = host_link_bytes(built, host_of, elem, scale)
    shaped: ShapedLink | None = cluster.links["inter"].get("shaped")
    if shaped is None:
        return Prediction(unshaped, unshaped, link_bytes, schedule, grid, algos)
    # As the planner: the fixed call cost once, the rest scaled from the schedule costed.
    fixed = model.call_overhead("allreduce", small, round(count * elem))
    walked = schedule_seconds(model, built, planner.link_of, host_of, elem, shaped, calls, scale, small)
    return Prediction(fixed + (walked - fixed) * scale, unshaped, link_bytes, schedule, grid, algos)
