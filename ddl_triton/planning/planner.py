"""The planner: which schedule, with which parameters, runs a collective, and why.

One decision, three sources, in this order:

1. **forced**: ``Options.schedule`` / ``DDL_SCHEDULE`` names a schedule that implements the
   collective (one that does not falls through, and the reason says so);
2. **table**: a tuning table measured on this machine (ddl_triton/planning/tuning_table.py) has an entry at
   this size, or measured sizes on both sides of it;
3. **model**: otherwise every candidate schedule is built and timed by the alpha-beta-gamma
   cost model (ddl_triton/planning/costmodel.py) walking the very IR the executor runs; the model's
   parameters are the table's fitted ones when a table is loaded, else built-in defaults, with
   the link between hosts and the step cost as measured at init where ranks span hosts
   (planning/measured_link.py).

Every rank holds the same options, the same table (the communicator checks its digest
across ranks at init) and the same topology, so every rank makes the same choice.

``Plan.reason`` says where the choice came from, for ``Communicator.explain``:

    tuned (t.json): one_shot measured 262 us, ring 414 us
    cost model fitted from t.json: fastest of 5 candidates for 1073741824 B on topology 2 [model: ...]
    cost model (built-in defaults): fastest of 5 candidates ...
    cost model (built-in defaults; link between hosts measured at init: 0.118 GB/s each way, 9 us; ...): ...
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

from .. import schedules
from . import measured_link
from .costmodel import DEFAULT as DEFAULT_COST_MODEL, PARAMETERS, CostModel, tensor_bytes
from .measured_link import MeasuredLink
from ..schedules import grid as grid_mod, native
from .topology import Topology
from .tuning_table import TuningTable


@dataclass(frozen=True)
class Plan:
    """What ``explain`` reports: the schedule, its parameters and why it was chosen."""

    schedule: str
    chunk_elems: int
    reason: str
    grid: tuple[int, ...] | None = None        # for topology-aware schedules
    algos: tuple[str, ...] | None = None       # per grid dimension (multidim / hierarchical)
    estimates: tuple[tuple[str, float], ...] = ()  # modelled seconds of every candidate
    world: str = ""  # how the communicator's world was found (Communicator.explain; ddl_triton/launch/launchers.py)

    def __str__(self) -> str:
        extra = f", grid {'x'.join(map(str, self.grid))}" if self.grid else ""
        extra += f", per-dimension {'/'.join(self.algos)}" if self.algos else ""
        est = "; ".join(f"{n} {t * 1e6:.0f} us" for n, t in self.estimates)
        return (f"{self.schedule} (chunk {self.chunk_elems} elements{extra}): {self.reason}"
                + (f" [model: {est}]" if est else "") + (f"\nworld: {self.world}" if self.world else ""))


# The planner never costs more than this many chunks: timing a 64 MiB schedule step by step
# would cost more than it saves; time scales linearly in the chunk count beyond it.
_MODEL_CHUNKS = 64
# The largest call hierarchical_native is a model candidate for where a node holds several ranks
# (``Planner._offers_native``): 2 testbed hosts x 2 ranks, 1 Gbit/s, it was within 5% of the
# fastest up to 1 MiB and 10-15% slower than hierarchical from 2 MiB.
_NATIVE_NODE_BYTES = 1 << 20


class Planner:
    """Plans collectives for one communicator (see the module doc for the order of sources)."""

    def __init__(self, *, rank: int, size: int, topology: Topology, link_of: Callable[[int, int], str],
                 forced: str, slot_bytes: int, table: TuningTable | None = None, table_source: str = "",
                 wire_chunk_bytes: int = 0, link: MeasuredLink | None = None):
        self.rank, self.size, self.topology = rank, size, topology
        self.link_of = link_of
        self.forced = forced
        self.slot_bytes = slot_bytes      # the most bytes one chunk may hold (one shm slot)
        # The chunk of an untuned plan: a slot, or at most wire_chunk_bytes (Options) where a peer
        # is reached over MPI or gloo. Every rank of a communicator that spans nodes has a peer on
        # another node, so every rank picks the same chunk.
        crosses = any(link_of(rank, p) != "shm" for p in range(size) if p != rank)
        self.default_chunk_bytes = min(slot_bytes, wire_chunk_bytes) if crosses and wire_chunk_bytes else slot_bytes
        self.table = table
        self.table_source = table_source
        if table is not None and table.model is not None:
            self.model, self.model_source = table.model, f"cost model fitted from {table_source}"
        else:
            self.model, self.model_source = DEFAULT_COST_MODEL, "cost model (built-in defaults)"
        # The link between hosts as measured at init (runtime/setup/link_probe.py), or None; shared
        # with compression="auto" (tuning/auto_compression.py), which then does not measure it again.
        self.link: MeasuredLink | None = None
        if link is not None:
            self.use_link(link)
        self._override: Plan | None = None
        # (nbytes, dtype) -> whether a one_shot allreduce of that shape would take the
        # small-message path (its own fixed cost in the model); set by the communicator.
        self.small_path: Callable[[int, object], bool] = lambda nbytes, dtype: False
        # Whether the transport between nodes has an allreduce engine of its own (gloo's, MPI's),
        # which hierarchical_native's group steps run on; set by the communicator. Without one the
        # executor would run their p2p stand-in, which hierarchical's pipelined phases beat.
        self.group_engines = False

    def use_link(self, link: MeasuredLink) -> None:
        """Plan with the link between hosts as measured (runtime/setup/link_probe.py): the built-in
        model priced with it, unless a tuning table's fitted model plans (it knows the link
        better). Every rank calls it with the same figures before its first plan (a store
        bootstrap measures once the transports are open, after the planner was made)."""
        self.link = link
        if self.table is None or self.table.model is None:
            self.model = measured_link.price(DEFAULT_COST_MODEL, link, self.topology.ranks_per_node)
            self.model_source = f"cost model (built-in defaults; {link.describe()})"

    def plan(self, collective: str, nbytes: int, dtype) -> Plan:
        """The plan for ``collective`` on ``nbytes`` (the input tensor's bytes) of ``dtype``."""
        elem = dtype.itemsize
        if self._override is not None:
            return self._override
        default_chunk = max(1, self.default_chunk_bytes // elem)
        note = ""
        count = schedules.count_for(collective, nbytes // elem, self.size)
        if self.forced:
            if schedules.supports(self.forced, collective):
                grid, algos = self.grid_params(self.forced, count, default_chunk, elem)
                return Plan(self.forced, default_chunk, "forced by DDL_SCHEDULE / Options.schedule", grid, algos)
            note = f"forced {self.forced} does not implement {collective}; "
        if self.table is not None:
            choice = self.table.choose(collective, str(dtype).replace("torch.", ""), nbytes)
            if choice is not None and schedules.supports(choice.schedule, collective):
                chunk = max(1, min(choice.chunk_bytes, self.slot_bytes) // elem)
                grid = self.topology.dims if schedules.uses_grid(choice.schedule) else None
                algos = choice.algos if choice.schedule == "multidim" else None
                if choice.schedule == "multidim" and algos is None:
                    algos = self.grid_params("multidim", count, chunk, elem)[1]
                return Plan(choice.schedule, chunk, note + f"tuned ({self.table_source}): {choice.evidence}", grid,
                            algos)
        return self._model_plan(collective, nbytes, count, dtype, default_chunk, note)

    @contextlib.contextmanager
    def overriding(self, plan: Plan) -> Iterator[None]:
        """Every plan is ``plan`` inside the block (the tuner times candidates this way; the
        communicator must drop its cached plans around it: ``Communicator.forcing``)."""
        self._override = plan
        try:
            yield
        finally:
            self._override = None

    # -- the cost model ------------------------------------------------------------------
    def _model_plan(self, collective: str, nbytes: int, count: int, dtype, chunk_elems: int, note: str) -> Plan:
        elem = dtype.itemsize
        candidates = [n for n in schedules.names() if schedules.supports(n, collective)
                      and (not schedules.uses_grid(n) or len(self.topology.dims) > 1)
                      and (n != native.NAME or self._offers_native(nbytes))]
        estimates = []
        for name in candidates:
            grid, algos = self.grid_params(name, count, chunk_elems, elem)
            small = collective == "allreduce" and name == "one_shot" and self.small_path(nbytes, dtype)
            estimates.append((self.model_time(name, collective, count, chunk_elems, elem, grid, algos, small=small),
                              name, grid, algos))
        best_time, best, grid, algos = min(estimates, key=lambda e: e[0])
        return Plan(best, chunk_elems,
                    note + f"{self.model_source}: fastest of {len(estimates)} candidates for {nbytes} B on "
                    f"topology {self.topology.signature}", grid, algos,
                    tuple((n, t) for t, n, _, _ in sorted(estimates, key=lambda e: e[0])))

    def _offers_native(self, nbytes: int) -> bool:
        """hierarchical_native is a model candidate where the link between nodes has an engine and
        a node holds one rank. With several, its node phases cannot overlap the engine's, which
        on a slow link cost more than its saved CPU (2 testbed hosts x 2 ranks, 1 Gbit/s, under
        MPI: 7-22% slower than hierarchical from 2 MiB; bench/results/collectives_across_hosts.md),
        and the model, which charges every rank's work in series, cannot tell; a tuning table
        that measured it, or ``DDL_SCHEDULE``, still chooses it there. Below ``_NATIVE_NODE_BYTES``
        those phases are short, and where the link was measured (the only case the model prices
        the waiting steps that native saves) it is a candidate too: at 2 x 2 it took 0.69 and 0.72 ms at
        32 and 64 KiB where hierarchical took 0.79 and 0.84 and one_shot 1.04 and 2.13 (medians of 6 runs)."""
        if not self.group_engines:
            return False
        return self.topology.dims[0] == 1 or (self.link is not None and nbytes <= _NATIVE_NODE_BYTES)

    def model_time(self, name, collective, count, chunk_elems, elem, grid=None, algos=None,
                   model: CostModel | None = None, small: bool = False) -> float:
        """Modelled seconds of one call (``model`` defaults to the planner's; ``small``: the call
        takes the small-message allreduce path)."""
        return self.model_terms(name, collective, count, chunk_elems, elem, grid, algos, model, small, False)[0]

    def model_terms(self, name, collective, count, chunk_elems, elem, grid=None, algos=None,
                    model: CostModel | None = None, small: bool = False, vector: bool = True):
        """(seconds, coefficients or None) of one call under ``model``: the schedule is costed at
        most ``_MODEL_CHUNKS`` chunks long and scaled to ``count`` (the per-call overhead is not)."""
        model = model or self.model
        if count == 0 or self.size == 1:
            return model.call_overhead(collective, small), None
        model_count = min(count, _MODEL_CHUNKS * chunk_elems)
        sched = schedules.build(name, collective, self.size, model_count, chunk_elems=chunk_elems, grid=grid,
                                algos=algos)
        scale = count / model_count
        fixed = model.call_overhead(collective, small, round(tensor_bytes(sched, elem) * scale))
        # The fixed call cost is paid once; everything else grows with the chunk count.
        if not vector:
            full = model.time(sched, self.link_of, elem, small, scale)
            return fixed + (full - fixed) * scale, None
        t, coeffs = model.terms(sched, self.link_of, elem, small, scale)
        scaled = tuple(c if p.startswith(("call_", "stage_")) else c * scale for p, c in zip(PARAMETERS, coeffs))
        return fixed + (t - fixed) * scale, scaled

    def grid_params(self, name: str, count: int, chunk_elems: int, elem: int):
        """(grid, per-dimension algorithms) for the topology-aware schedules; (None, None) otherwise."""
        if not schedules.uses_grid(name):
            return None, None
        dims = self.topology.dims
        if name in ("hierarchical", native.NAME):
            return dims, None
        algos = list(grid_mod.default_algorithms(dims))
        # Each dimension picks its own algorithm: try each in turn, the others held fixed.
        for d in range(len(dims)):
            if dims[d] == 1:
                continue
            timed = []
            for algo in grid_mod.PHASE_ALGORITHMS:
                trial = tuple(algos[:d] + [algo] + algos[d + 1:])
                timed.append((self.model_time(name, "allreduce", count, chunk_elems, elem, dims, trial), algo))
            algos[d] = min(timed)[1]
        return dims, tuple(algos)
