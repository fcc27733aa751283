"""The transport table (transports/table.py): one ordered list of rows, each saying whether it can
connect two ranks, read by placement, the CPU wiring and the GPU path.

- Every module of transports/ that carries data has a row, and an opener.
- Over a grid of placements (a world of one, one host, emulated hosts, real hosts, uneven hosts;
  MPI or store bootstrap; transport auto, mpi or nvshmem; CPU or CUDA tensors), the transport
  chosen per peer and the transports opened are the ones written out below: what the three
  if-chains chose before the table (placement.py, wiring.py, gpu_path.py at 8d983af).
- The GPU path builds from the table (openers stubbed): NVSHMEM within a node with MPI beside it,
  the fallback to MPI with the reason, and DDL_TRANSPORT=nvshmem's refusal.
- A row added in one place (here, in the test) is what placement chooses, with no other file touched.
"""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from ddl_triton.options import Options
from ddl_triton.runtime.setup import placement as placement_mod
from ddl_triton.transports import table

TRANSPORTS_DIR = Path(__file__).resolve().parents[2] / "transports"

# name: (host of each rank, as the lowest rank on its host; DDL_TOPOLOGY)
LAYOUTS = {
    "one rank": ((0,), ""),
    "one host": ((0, 0, 0, 0), ""),
    "emulated hosts": ((0, 0, 0, 0), "2x2"),
    "real hosts": ((0, 0, 2, 2), ""),
    "a rank per host": ((0, 1, 2), ""),
    "uneven hosts": ((0, 0, 2), ""),
}


class _Bootstrap:
    """What placement asks of a bootstrap, for one rank of a layout (no other rank exists)."""

    def __init__(self, rank: int, hosts: tuple[int, ...], kind: str):
        self.rank, self.size, self.kind, self._hosts = rank, len(hosts), kind, hosts

    def host_of_rank(self) -> list[int]:
        return list(self._hosts)

    def allgather(self, value) -> list:
        return [[f"h{h}", 1000 + r] for r, h in enumerate(self._hosts)]


def _place(layout: str, rank: int, kind: str, transport: str):
    hosts, topology = LAYOUTS[layout]
    return placement_mod.place(_Bootstrap(rank, hosts, kind), Options(topology=topology, transport=transport))


# CPU tensors: rank 0's link to each rank, and the transports rank 0 opens (the row between nodes
# first), per layout, bootstrap and Options.transport.
CPU = {
    ("one rank", "mpi", "auto"): ("self", ["self"]),
    ("one rank", "store", "mpi"): ("self", ["self"]),
    ("one host", "mpi", "auto"): ("self shm shm shm", ["mpi", "shm"]),
    ("one host", "mpi", "mpi"): ("self mpi mpi mpi", ["mpi"]),
    ("one host", "mpi", "nvshmem"): ("self mpi mpi mpi", ["mpi"]),
    ("one host", "store", "auto"): ("self shm shm shm", ["gloo", "shm"]),
    ("one host", "store", "mpi"): ("self gloo gloo gloo", ["gloo"]),
    ("emulated hosts", "mpi", "auto"): ("self shm mpi mpi", ["mpi", "shm"]),
    ("emulated hosts", "mpi", "mpi"): ("self mpi mpi mpi", ["mpi"]),
    ("emulated hosts", "store", "auto"): ("self shm gloo gloo", ["gloo", "shm"]),
    ("emulated hosts", "store", "nvshmem"): ("self gloo gloo gloo", ["gloo"]),
    ("real hosts", "mpi", "auto"): ("self shm mpi mpi", ["mpi", "shm"]),
    ("real hosts", "mpi", "mpi"): ("self mpi mpi mpi", ["mpi"]),
    ("real hosts", "store", "auto"): ("self shm gloo gloo", ["gloo", "shm"]),
    ("real hosts", "store", "mpi"): ("self gloo gloo gloo", ["gloo"]),
    ("a rank per host", "mpi", "auto"): ("self mpi mpi", ["mpi"]),
    ("a rank per host", "store", "auto"): ("self gloo gloo", ["gloo"]),
    ("uneven hosts", "mpi", "auto"): ("self shm mpi", ["mpi", "shm"]),
    ("uneven hosts", "store", "auto"): ("self shm gloo", ["gloo", "shm"]),
}


@pytest.mark.parametrize("layout,kind,transport", sorted(CPU))
def test_placement_and_the_cpu_wiring_choose_as_before(layout, kind, transport):
    links, opened = CPU[(layout, kind, transport)]
    place = _place(layout, 0, kind, transport)
    assert " ".join(place.links) == links
    rows = table.to_open(0, place.node_of_rank, place.host_of_rank, Options(transport=transport), kind, "cpu")
    assert [row.name for row in rows] == opened


def test_a_rank_alone_on_its_host_opens_no_shm_where_other_hosts_do():
    place = _place("uneven hosts", 2, "mpi", "auto")
    assert place.links == ("mpi", "mpi", "self")
    assert [r.name for r in table.to_open(2, place.node_of_rank, place.host_of_rank, Options(), "mpi", "cpu")] == ["mpi"]


# CUDA tensors (the GPU path needs an MPI bootstrap): rank r's transport to each other rank, the
# modules it opens, and why traffic within a node does not take NVSHMEM; per layout,
# Options.transport and whether nvshmem4py imports.
CUDA = {
    ("one rank", 0, "auto", True): ("", ["self_transport"], "no node holds more than one rank"),  # never asked
    ("one rank", 0, "mpi", True): ("", ["self_transport"], "Options.transport is 'mpi'"),
    ("one rank", 0, "nvshmem", True): ("", ["mpi_device", "nvshmem"], ""),
    ("one rank", 0, "nvshmem", False): ("", ["mpi_device"], "nvshmem4py is not installed"),
    ("one host", 0, "auto", True): ("nvshmem nvshmem nvshmem", ["mpi_device", "nvshmem"], ""),
    ("one host", 0, "auto", False): ("mpi mpi mpi", ["mpi_device"], "nvshmem4py is not installed"),
    ("one host", 0, "mpi", True): ("mpi mpi mpi", ["mpi_device"], "Options.transport is 'mpi'"),
    ("one host", 0, "nvshmem", True): ("nvshmem nvshmem nvshmem", ["mpi_device", "nvshmem"], ""),
    ("emulated hosts", 0, "auto", True): ("nvshmem mpi mpi", ["mpi_device", "nvshmem"], ""),
    ("emulated hosts", 3, "auto", False): ("mpi mpi mpi", ["mpi_device"], "nvshmem4py is not installed"),
    ("emulated hosts", 0, "mpi", True): ("mpi mpi mpi", ["mpi_device"], "Options.transport is 'mpi'"),
    ("real hosts", 2, "auto", True): ("mpi mpi nvshmem", ["mpi_device", "nvshmem"], ""),
    ("a rank per host", 0, "auto", True): ("mpi mpi", ["mpi_device"], "no node holds more than one rank"),
    ("a rank per host", 0, "nvshmem", True): ("mpi mpi", ["mpi_device"], ""),
    ("uneven hosts", 2, "auto", True): ("mpi mpi", ["mpi_device", "nvshmem"], ""),  # opening NVSHMEM is collective
    ("uneven hosts", 0, "auto", True): ("nvshmem mpi", ["mpi_device", "nvshmem"], ""),
}


@pytest.mark.parametrize("layout,rank,transport,importable", sorted(CUDA))
def test_the_gpu_path_chooses_as_before(monkeypatch, layout, rank, transport, importable):
    monkeypatch.setattr(table, "nvshmem_importable", lambda: importable)
    peers, modules, why = CUDA[(layout, rank, transport, importable)]
    place = _place(layout, rank, "mpi", transport)
    options = Options(transport=transport)
    links = table.links(rank, place.node_of_rank, place.host_of_rank, options, "mpi", "cuda")
    assert " ".join(links[p].name for p in range(place.size) if p != rank) == peers
    rows = table.to_open(rank, place.node_of_rank, place.host_of_rank, options, "mpi", "cuda")
    assert [row.module for row in rows] == modules
    assert table.why_not_preferred(table.Pair.node_mates(place.size, place.max_ranks_per_node), options, "mpi",
                                   "cuda", {}) == why


class _Opened:
    """A transport an opener stand-in returns: what the executor reads of one."""

    spin = 0.0
    completes_sends = posts_receives_early = False
    bytes_sent = bytes_received = 0

    def __init__(self, name: str):
        self.name = name

    def post_ready_sends(self) -> None:
        """The device MPI transport's progress hook (the GPU path registers it beside NVSHMEM)."""

    def close(self) -> None:
        pass


def _stub_openers(monkeypatch, refuse: dict[str, str] | None = None):
    """Every row opens a stand-in (a row named in ``refuse`` raises CannotOpen with its reason)."""
    def opener(row):
        def open_for(opening):
            if row.module in (refuse or {}):
                raise table.CannotOpen(refuse[row.module])
            return _Opened(row.name)
        return open_for
    monkeypatch.setattr(table, "TRANSPORTS", [dataclasses.replace(r, opener=opener(r)) for r in table.TRANSPORTS])
    monkeypatch.setattr(table, "nvshmem_importable", lambda: True)


def _gpu(layout: str, rank: int, transport: str):
    import torch

    from ddl_triton.runtime.calls import gpu_path
    from ddl_triton.transports import waits
    gpu = gpu_path.GpuPath(_place(layout, rank, "mpi", transport), Options(transport=transport), control=None)
    try:
        gpu._build(torch.device("cpu"))
    except BaseException:
        gpu.close()
        raise
    hooks = [h for h in waits.progress_hooks if getattr(h, "__self__", None) in gpu.transports]
    assert len(hooks) == (len(gpu.transports) if len(gpu.transports) > 1 else 0)  # each MPI's sends move in any wait
    return gpu


def test_the_gpu_path_opens_nvshmem_within_a_node_and_mpi_beside_it(monkeypatch):
    _stub_openers(monkeypatch)
    gpu = _gpu("emulated hosts", 1, "auto")
    try:
        assert [t.name for t in gpu.transports] == ["mpi", "nvshmem"] and gpu.intra_node == "nvshmem"
        assert [t and t.name for t in gpu._executor.route] == ["nvshmem", None, "mpi", "mpi"] and gpu.why == ""
    finally:
        gpu.close()


def test_nvshmem_that_cannot_open_leaves_its_pairs_to_mpi_saying_why(monkeypatch):
    _stub_openers(monkeypatch, {"nvshmem": "LIMITED MPG mode"})
    gpu = _gpu("one host", 0, "auto")
    try:
        assert [t.name for t in gpu.transports] == ["mpi"] and gpu.intra_node == "mpi"
        assert gpu.why == "LIMITED MPG mode"
        assert [t and t.name for t in gpu._executor.route] == [None, "mpi", "mpi", "mpi"]
    finally:
        gpu.close()


def test_transport_nvshmem_refuses_what_auto_falls_back_from(monkeypatch):
    _stub_openers(monkeypatch, {"nvshmem": "LIMITED MPG mode"})
    with pytest.raises(ValueError, match=r"^rank 0: DDL_TRANSPORT=nvshmem but NVSHMEM cannot be used: LIMITED MPG"):
        _gpu("one host", 0, "nvshmem")
    monkeypatch.setattr(table, "nvshmem_importable", lambda: False)
    with pytest.raises(ValueError, match="nvshmem4py is not installed"):
        _gpu("one rank", 0, "nvshmem")


def test_a_world_of_one_on_cuda_runs_on_the_loopback_unless_nvshmem_is_asked_for(monkeypatch):
    _stub_openers(monkeypatch)
    gpu = _gpu("one rank", 0, "auto")
    assert [t.name for t in gpu.transports] == ["self"] and gpu._executor.route == gpu.transports
    gpu.close()
    gpu = _gpu("one rank", 0, "nvshmem")
    try:
        assert [t.name for t in gpu.transports] == ["mpi", "nvshmem"] and gpu.intra_node == ""
        assert [t.name for t in gpu._executor.route] == ["self"]
    finally:
        gpu.close()


def _carries_data(path: Path) -> bool:
    """Whether the module defines a transport: a class named ``...Transport`` (the protocol itself,
    a ``Protocol``, aside)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name.endswith("Transport") and \
                not any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases):
            return True
    return False


def test_the_table_lists_every_transport_module_that_carries_data_and_each_opens():
    carriers = {p.stem for p in TRANSPORTS_DIR.glob("*.py") if _carries_data(p)}
    assert carriers == {row.module for row in table.TRANSPORTS}
    assert carriers >= {"shm", "mpi", "gloo", "self_transport", "nvshmem", "mpi_device"}
    for module in carriers:
        assert "\ndef open_for(opening)" in (TRANSPORTS_DIR / f"{module}.py").read_text(), module
    for kind in table.KINDS:  # every kind of tensor has a row that connects any two ranks
        assert table.between_nodes(2, 1, Options(), "mpi", kind) and table.between_nodes(2, 1, Options(), "store", "cpu")


def test_a_new_row_is_what_placement_chooses_with_no_other_file_touched(monkeypatch):
    # A transport for ranks of one host on different (emulated) nodes, preferred over MPI.
    opened = []
    row = table.Row("hostlink", "hostlink", "cpu",
                    lambda pair, options, kind: "" if pair.same_host and not pair.same_node else "not that pair",
                    opener=lambda opening: opened.append(opening.placement.rank) or "a hostlink transport")
    rows = list(table.TRANSPORTS)
    rows.insert(rows.index(table.named("mpi", "cpu")), row)
    monkeypatch.setattr(table, "TRANSPORTS", rows)
    place = _place("emulated hosts", 1, "mpi", "auto")
    assert place.links == ("shm", "self", "hostlink", "hostlink")
    assert _place("real hosts", 1, "mpi", "auto").links == ("shm", "self", "mpi", "mpi")  # other hosts: MPI still
    to_open = table.to_open(1, place.node_of_rank, place.host_of_rank, Options(), "mpi", "cpu")
    assert [r.name for r in to_open] == ["mpi", "shm", "hostlink"]
    assert to_open[-1].open(table.Opening(place, Options())) == "a hostlink transport" and opened == [1]


def test_no_row_for_a_pair_is_an_error_naming_each_rows_reason(monkeypatch):
    monkeypatch.setattr(table, "TRANSPORTS", [r for r in table.TRANSPORTS if r.name not in ("mpi", "gloo")])
    with pytest.raises(ValueError, match=r"no transport connects .* for cpu tensors: self: the ranks differ; "
                                         r"shm: the ranks are on different nodes"):
        _place("real hosts", 0, "mpi", "auto")
    with pytest.raises(ValueError, match="not 'tpu'"):
        table.rows("tpu")


def test_the_choice_takes_a_few_choices_however_many_ranks(monkeypatch):
    # 4096 ranks in 512 nodes of 8: rank 0's links and what it opens, without a choice per pair of ranks.
    nodes = tuple(r // 8 for r in range(4096))
    hosts = tuple(8 * n for n in nodes)
    calls = []
    real = table.choose

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(table, "choose", counted)
    assert [r.name for r in table.to_open(0, nodes, hosts, Options(), "mpi", "cpu")] == ["mpi", "shm"]
    assert len(calls) < 10


def test_reading_the_table_loads_neither_torch_nor_mpi():
    code = ("import sys\nfrom ddl_triton.transports import table\ntable.to_open(0, (0, 0), (0, 0), "
            "type('O', (), {'transport': 'auto'})(), 'mpi', 'cpu')\n"
            "print(sorted(m for m in ('torch', 'mpi4py', 'nvshmem') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
