"""Cluster specifications for the scale-out simulator: levels, links, device and compute, as data.

A cluster is a TOML file in ``ddl_triton/simulation/clusters/`` (``minsky``, ``bigbasin``, ``local``, ``testbed``)
or any path. Every number is a table ``{ value = ..., source = "..." }``: the source is a
citation tag ([C] confirmed, [D] derived, [U] unconfirmed) or the word "assumed", so a
prediction can always say what it rests on. Layout:

    name, description
    [levels]      gpus_per_node, nodes_per_rack            (the X x Y x Z grid: X, Y)
    [links.intra] bandwidth_gbps, slowest_hop_gbps, alpha_us    (within a node)
    [links.inter] bandwidth_gbps, alpha_us                      (between nodes of a rack)
    [links.rack]  bandwidth_gbps, alpha_us                      (between racks)
                  optional on a link: shaped_gbit, goodput_share, burst_bytes (a tbf token bucket
                  on each direction of each host's link, as on the testbed: links[level]["shaped"]);
                  same_host_alpha_us, same_host_gbps (MPI between two ranks of one host, which a
                  fitted model of this host holds and a calibrated cluster replaces by the link's)
    [device]      hbm_gbps (reductions and copies run at memory speed), step_overhead_us,
                  bucket_overhead_us (a DDP bucket's cost beside its allreduce)
    [compute]     img_per_s at a model and batch, backward_over_forward

``local`` ("this host") has no datasheet: ``local_model`` returns the cost model fitted by
``ddl-tune`` for the ranks and topology asked for, where a cached table has one, else the built-in
defaults; it runs a quick ``ddl-tune`` of allreduce only when asked (``probe``: ``simulate --tune``),
since that takes minutes and leaves a table in the tuning cache that every later job's ``init`` uses.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from ._data_files import named_file
from .shaped_link import ShapedLink
from ..planning.costmodel import CostModel, Link

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

CLUSTERS = Path(__file__).with_name("clusters")


@dataclass(frozen=True)
class Cluster:
    name: str
    description: str
    gpus_per_node: int
    nodes_per_rack: int
    links: dict            # level -> {"alpha": seconds, "beta": seconds per byte}
    hbm_gbps: float
    step_overhead: float
    img_per_s: float
    model: str
    batch: int
    backward_over_forward: float
    sources: dict = field(default_factory=dict, compare=False)  # "section.key" -> its source text
    calibrated: bool = False
    # Whether communication runs beside the computation (a GPU's copy engines and NICs) or
    # takes the computing core's time (CPU ranks with no spare core, as on this host).
    overlap: bool = True
    bucket_overhead: float = 0.0  # seconds per DDP bucket beside its allreduce (hook, hand-off)
    file: str = field(default="", compare=False)  # the TOML file the figures came from (said with every prediction)

    def grid(self, gpus: int) -> tuple[int, ...]:
        """The X x Y[ x Z] grid of ``gpus`` (innermost first): whole nodes, then racks."""
        x = min(self.gpus_per_node or gpus, gpus)
        nodes = gpus // x
        if nodes <= 1:
            return (x,)
        y = self.nodes_per_rack or nodes
        if nodes <= y:
            return (x, nodes)
        return (x, y, nodes // y)

    def level_model(self, level: str) -> CostModel:
        """A cost model whose every link is ``level``'s ("intra", "inter", "rack"): what one line
        of ranks along that level's dimension sees. Reductions read their operands and write
        the result at memory speed (gamma = 1.5 / HBM per operand byte, [D]); a copy into a
        send buffer reads and writes (2 / HBM)."""
        link = Link(self.links[level]["alpha"], self.links[level]["beta"])
        hbm = self.hbm_gbps * 1e9
        return CostModel(step_overhead=self.step_overhead, shm=link, mpi=link, gamma=1.5 / hbm, beta_copy=2 / hbm)

    def two_level_model(self) -> CostModel:
        """Intra-node links as "shm", inter-node ones as "mpi" (for walking a whole schedule)."""
        intra, inter = self.level_model("intra"), self.level_model("inter")
        return replace(intra, mpi=inter.mpi)


def _value(section: dict, key: str, sources: dict, where: str):
    item = section.get(key)
    if not isinstance(item, dict) or "value" not in item:
        raise ValueError(f"cluster spec: {where}.{key} must be {{ value = ..., source = \"...\" }}")
    if not str(item.get("source", "")).strip():
        raise ValueError(f"cluster spec: {where}.{key} has no source (cite one, or write \"assumed\")")
    sources[f"{where}.{key}"] = item["source"]
    return item["value"]


def load(name_or_path: str) -> Cluster:
    """A cluster by name (a file in ddl_triton/clusters/) or path; raises ValueError naming
    the missing or unsourced field."""
    path = named_file(name_or_path, CLUSTERS, ".toml", "cluster")
    with open(path, "rb") as f:
        data = tomllib.load(f)
    sources: dict = {}
    levels, compute = data.get("levels", {}), data.get("compute", {})
    links = {}
    for level, spec in data.get("links", {}).items():
        gbps = _value(spec, "bandwidth_gbps", sources, f"links.{level}")
        if "slowest_hop_gbps" in spec:  # a ring within the node runs at its slowest hop
            gbps = min(gbps, _value(spec, "slowest_hop_gbps", sources, f"links.{level}"))
        links[level] = {"alpha": _value(spec, "alpha_us", sources, f"links.{level}") * 1e-6, "beta": 1 / (gbps * 1e9)}
        if "shaped_gbit" in spec:  # a token bucket (tbf) on each direction of each host's link
            share = links[level]["goodput_share"] = _value(spec, "goodput_share", sources, f"links.{level}")
            links[level]["shaped"] = ShapedLink(
                rate=_value(spec, "shaped_gbit", sources, f"links.{level}") * 1e9 / 8 * share,
                burst=_value(spec, "burst_bytes", sources, f"links.{level}") * share)
        for key in ("same_host_alpha_us", "same_host_gbps"):  # MPI between two ranks of one host
            if key in spec:
                value = _value(spec, key, sources, f"links.{level}")
                links[level][key] = value * 1e-6 if key.endswith("_us") else 1 / (value * 1e9)
    device = data.get("device", {})
    img = compute.get("img_per_s", {})
    return Cluster(
        name=data.get("name", path.stem), description=data.get("description", ""),
        gpus_per_node=int(_value(levels, "gpus_per_node", sources, "levels")),
        nodes_per_rack=int(_value(levels, "nodes_per_rack", sources, "levels")),
        links=links,
        hbm_gbps=float(_value(device, "hbm_gbps", sources, "device")) if device else 0.0,
        step_overhead=float(_value(device, "step_overhead_us", sources, "device")) * 1e-6 if device else 0.0,
        img_per_s=float(_value(compute, "img_per_s", sources, "compute")), model=img.get("model", ""),
        batch=int(img.get("batch", 0)),
        backward_over_forward=float(_value(compute, "backward_over_forward", sources, "compute")),
        sources=sources, calibrated=bool(data.get("calibrated", False)),
        overlap=bool(_value(compute, "overlap", sources, "compute")) if "overlap" in compute else True,
        bucket_overhead=float(_value(device, "bucket_overhead_us", sources, "device")) * 1e-6
        if "bucket_overhead_us" in device else 0.0, file=str(path))


# Models probed afresh in this process (local_model(refresh=True)), by layout: they serve
# the later calls here, and never replace a table in the user's tuning cache.
_refreshed: dict[tuple[int, str], tuple[CostModel, str]] = {}  # (ranks, topology) -> model, source


def local_model(ranks: int, topology: str = "", probe: bool = False, refresh: bool = False) -> tuple[CostModel, str]:
    """(the fitted cost model of this host for ``ranks`` on ``topology``, where it came from).

    From the cached ddl-tune table whose key matches; without one, the built-in defaults, said so.
    ``probe`` (asked for: ``simulate --tune``): without a table, a short probe (a quick ddl-tune
    of allreduce up to 64 MiB under ddlrun, about a minute per layout, its progress on stderr)
    makes one and caches it, where every later job's ``init`` on this layout finds it.
    ``refresh``: probe now, whatever the cache holds, into a file of its own (never the cache),
    and use that model for this process's later calls too; for a host whose speed drifts, a
    model is only as good as the host's state when measured."""
    import tempfile

    from ..planning import tuning_table
    from ..planning.costmodel import DEFAULT

    if refresh:
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "probe.json")
            _probe(ranks, topology, ["--no-cache", "--out", out], "probing afresh")
            table = tuning_table.load(out) if os.path.exists(out) else None
        if table is not None and table.model is not None:
            _refreshed[(ranks, topology)] = (table.model, "fitted by ddl-tune (probed afresh in this process)")
    if (ranks, topology) in _refreshed:
        return _refreshed[(ranks, topology)]
    key = tuning_table.machine_key(world_size=ranks, topology=topology or str(ranks), transport="auto")
    resolved = tuning_table.resolve("", key)
    if resolved.table is None and probe:
        _probe(ranks, topology, [], "no ddl-tune table")
        resolved = tuning_table.resolve("", key)
    if resolved.table is not None and resolved.table.model is not None:
        return resolved.table.model, f"fitted by ddl-tune ({resolved.source})"
    layout = f"{ranks} ranks" + (f" on {topology}" if topology else "")
    return DEFAULT, (f"the built-in defaults of ddl_triton/planning/costmodel.py: no ddl-tune table for {layout} "
                     "here" + ("" if probe else "; --tune measures this host (about a minute per layout)"))


def _probe(ranks: int, topology: str, extra: list[str], why: str) -> None:
    """A quick ddl-tune of allreduce on ``ranks`` (``topology``) under ddlrun; ``extra`` arguments.
    It takes minutes, so ddl-tune's progress bar (on stderr) is left on: a long command shows progress."""
    ddlrun = Path(sys.executable).with_name("ddlrun")
    command = [str(ddlrun), "-n", str(ranks)] + (["--topology", topology] if topology else []) + \
        ["--", sys.executable, "-m", "ddl_triton.tune", "--quick", "--max-bytes", "64M", "--collectives", "allreduce",
         "--no-validate", *extra]
    print(f"# {why} for {ranks} ranks{' on ' + topology if topology else ''} here: probing with "
          f"{' '.join(command[3:])} (about a minute per layout)", file=sys.stderr, flush=True)
    subprocess.run(command, check=False, stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
