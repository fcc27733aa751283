"""The compression registry (ddl_triton/compression_methods.py), without ranks:

- an unknown method is refused everywhere with the valid names listed (the table, Options, the
  hooks' factory, per-level compression, the torch side naming the rank, the simulator);
- "none" and "auto" are choices, not methods: they cannot be registered, and only the rows marked
  ``auto`` are auto's candidates;
- each row's wire bytes (``compressed.wire_bytes``, from the row's layout) are what its allreduce
  hands to the collectives, counted at a recording communicator that runs the real allreduce
  code in-process (two-shot at 3 and 4 ranks, the gathered form at 2), with and without groups;
- a method registered at run time (a real one: bf16 on the wire under another name) is selectable
  by Options, the hooks, per-level compression, the torch side, the tuner's probe and the
  simulator, with no other file touched; built-in rows cannot be removed;
- the tuner's probe times every row's roundtrip.
"""
from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import pytest
import torch

from ddl_triton import compression_methods as cm
from ddl_triton.options import Options
from ddl_triton.runtime.calls.work import Work
from ddl_triton.runtime.compression import compressed, per_level


class _RecordingComm:
    """A communicator of ``size`` ranks seen from ``rank``, in one process: every peer is taken to
    send what this rank sends, and ``sent`` counts the payload bytes this rank hands to its peers
    (all_to_all: every slot but its own; all_gather: its slot, to each peer)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.sent = rank, size, 0
        self.transport_bytes = {"recording": {"sent": 0, "received": 0}}
        self.placement = SimpleNamespace(node_of_rank=list(range(size)), on_node=[rank])

    def all_to_all(self, out, inp, async_op=False):
        slots = inp.view(self.size, -1)  # each peer sends this rank its slot number ``rank``
        self._count((self.size - 1) * slots[0].numel() * inp.element_size())
        out.view(self.size, -1).copy_(slots[self.rank].expand(self.size, -1))
        return self._done(out)

    def all_gather(self, out, inp, async_op=False):
        self._count((self.size - 1) * inp.numel() * inp.element_size())
        out.copy_(inp.repeat(self.size))
        return self._done(out)

    def _count(self, nbytes: int) -> None:
        self.sent += nbytes
        self.transport_bytes["recording"]["sent"] += nbytes

    @staticmethod
    def _done(value):
        work = Work("recorded")
        work.set_result(value)
        return work


def _run(name: str, comm, numel: int, groups=None) -> torch.Tensor:
    row = cm.get(name)
    x = torch.linspace(-2, 3, numel, dtype=torch.float32)
    residual = torch.zeros(numel) if row.worker_residual else None
    server = None
    if row.server_residual:
        a, b = compressed.chunk_bounds(numel, comm.size, row.align(256))[comm.rank]
        server = torch.zeros(b - a)
    row.run(comm, x, op="avg", residual=residual, server_residual=server,
            groups=groups if row.scale_groups else None)
    return x


def test_an_unknown_method_is_refused_with_the_valid_names_everywhere():
    valid = "int8, onebit, fp16, bf16, int4"
    with pytest.raises(ValueError, match=f"unknown compression method 'zip'; valid: {valid}"):
        cm.get("zip")
    with pytest.raises(ValueError, match=f"DDL_COMPRESSION.*none, {valid}, auto, got 'zip'"):
        Options(compression="zip")
    from ddl_triton.torch.hooks import compress_hook
    from ddl_triton.torch.level_compression import LevelCompression

    with pytest.raises(ValueError, match=f"valid: {valid}"):
        compress_hook("zip")
    with pytest.raises(ValueError, match=f"rank 5: compression must be one of none, {valid}, auto"):
        LevelCompression(SimpleNamespace(rank=5), "zip")
    lv = per_level.Levels(_RecordingComm(1, 2))
    with pytest.raises(ValueError, match=f"rank 1: per-level compression method must be one of {valid}, got 'zip'"):
        per_level.residual_sizes(lv, "zip", 10)
    from ddl_triton.simulation import iteration

    with pytest.raises(ValueError, match=f"unknown compression 'zip'; valid: none, {valid}"):
        iteration.allreduce_time(None, 2, 1 << 20, "ring", compress="zip")


def test_none_and_auto_are_choices_not_methods():
    assert cm.choices() == ("none", *cm.names(), "auto")
    assert set(cm.names()) >= {"int8", "onebit", "fp16", "bf16", "int4"} and not {"none", "auto"} & set(cm.names())
    assert cm.auto_names() == ("int8",)  # 1-bit, 16-bit and int4 must be named (tuning/auto_compression.py)
    row = cm.get("fp16")
    for bad in ("none", "auto", "16bit", "not an identifier"):
        with pytest.raises(ValueError, match="identifier other than 'none' and 'auto'"):
            cm.register(dataclasses.replace(row, name=bad))
    with pytest.raises(ValueError, match="already registered"):
        cm.register(row)
    with pytest.raises(ValueError, match="'module:function'"):
        cm.register(dataclasses.replace(row, name="half", allreduce="no_colon"))
    with pytest.raises(ValueError, match="built in"):
        cm.unregister("bf16")
    with pytest.raises(ValueError, match="rank 0: compression 'fp16' takes no residual"):
        row.run(_RecordingComm(0, 3), torch.ones(4), residual=torch.zeros(4))
    with pytest.raises(TypeError, match="rank 2: compression 'fp16' takes float32, float16, bfloat16 tensors, "
                                        "got int64"):
        row.run(_RecordingComm(2, 3), torch.ones(4, dtype=torch.int64))


@pytest.mark.parametrize("name", cm.names())  # every row, a new one included
def test_each_rows_wire_bytes_are_what_its_allreduce_sends(name):
    for size in (2, 3, 4):
        for numel in (1, 1000, 4099):
            for groups in (None, [0, 100, 517]):
                comm = _RecordingComm(size - 1, size)
                _run(name, comm, numel, groups)
                want = compressed.wire_bytes(name, numel, size, groups=groups if cm.get(name).scale_groups else None)
                assert comm.sent == want, (name, size, numel, groups, comm.sent, want)
    if cm.get(name).word_bytes == 2:  # "16bit", the older name of fp16 and bf16's layout, still sizes it
        assert compressed.wire_bytes("16bit", 1000, 3) == compressed.wire_bytes(name, 1000, 3)


def test_the_rows_ratios_are_the_documented_ones():
    assert cm.get("int8").wire_ratio() == pytest.approx(3.94, abs=0.01)
    assert cm.get("fp16").wire_ratio() == cm.get("bf16").wire_ratio() == 2.0
    assert cm.get("onebit").wire_ratio() == 32.0
    assert cm.get("int4").wire_ratio() == pytest.approx(7.76, abs=0.01)  # 32 / (4 + 32/256)
    # large tensors: the measured bytes per fp32 byte approach the ratio
    for name in cm.names():
        n, size = 1 << 20, 4
        fp32 = 2 * (size - 1) / size * 4 * n
        assert fp32 / compressed.wire_bytes(name, n, size) == pytest.approx(cm.get(name).wire_ratio(), rel=2e-3)


def test_a_registered_method_is_selectable_everywhere_without_touching_another_file(monkeypatch):
    # A real method: bf16 on the wire, under a name no file mentions.
    half = dataclasses.replace(cm.get("bf16"), name="brain_half", auto=False)
    cm.register(half)
    try:
        assert Options(compression="brain_half").compression == "brain_half"
        assert Options.from_env({"DDL_COMPRESSION": "brain_half"}).compression == "brain_half"
        # the hooks: two ranks' hook sends the row's wire bytes and rounds through bf16
        from ddl_triton.torch.hooks import HookState, compress_hook

        comm = _RecordingComm(1, 2)
        state = HookState(comm, compression="brain_half")
        buf = torch.tensor([1.0, 0.1, 3.0, -7.25])
        bucket = SimpleNamespace(buffer=lambda: buf, index=lambda: 0, parameters=lambda: [buf])
        compress_hook("brain_half")(state, bucket).wait()
        assert state.payload_bytes == state.sent_bytes() == compressed.wire_bytes("brain_half", 4, 2) == 4 * 2
        assert buf.tolist() == torch.tensor([1.0, 0.1, 3.0, -7.25]).to(torch.bfloat16).float().tolist()
        # per-level: one rank per host (the cross group is the world), as the torch side runs it
        from ddl_triton.torch.level_compression import LevelCompression

        lc = LevelCompression(_RecordingComm(0, 2), "brain_half")
        assert lc.decide(1 << 20).method == "brain_half"
        assert per_level.residual_sizes(lc.levels, "brain_half", 100) == (0, None)
        x = torch.tensor([0.1, 2.0])
        lc.allreduce(x, key=("k",), method="brain_half", async_op=False)
        assert x.tolist() == torch.tensor([0.1, 2.0]).to(torch.bfloat16).float().tolist()
        assert lc.levels.comm.sent == per_level.wire_bytes(lc.levels, "brain_half", 2)["inter"] == 4
        # the tuner's probe times its roundtrip; the simulator costs its bytes
        from ddl_triton.tuning import auto_compression

        assert auto_compression._time_compressor("brain_half", 1024) > 0
        from ddl_triton.simulation import iteration

        assert "brain_half" in iteration.compression_choices()
    finally:
        cm.unregister("brain_half")
    with pytest.raises(ValueError, match="valid: int8, onebit, fp16, bf16, int4$"):
        cm.get("brain_half")


def test_the_registry_imports_without_torch_and_names_its_functions_lazily():
    import subprocess

    code = ("import sys; from ddl_triton import compression_methods as cm; "
            "assert [cm.get(m).wire_ratio() for m in cm.names()]; assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).returncode == 0
    for name in cm.names():  # every reference resolves to a callable
        row = cm.get(name)
        for ref in (row.allreduce, row.roundtrip, row.gathered):
            assert callable(cm.resolve(ref)), (name, ref)


def test_the_probe_times_every_row():
    from ddl_triton.tuning import auto_compression

    class _Still:  # allreduces that take no time and change nothing: the link figures are not the point
        rank, size = 0, 2

        def allreduce(self, tensor, op="sum"):
            return tensor

    link, speed = auto_compression.probe(SimpleNamespace(comm=_Still(), cross=_Still(), hosts=2))
    assert set(speed.bytes_per_s) == set(speed.fixed_us) == set(cm.names())
    assert all(v > 0 for v in (*speed.bytes_per_s.values(), *speed.fixed_us.values()))
