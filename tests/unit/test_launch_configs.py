"""Launch configurations as data (ddl_triton.kernels.launch_configs) and the GPU sweep (config_sweep.py), on CPU.

The kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on tiny tensors. That a pinned
config reaches the launch is seen by a spy around each ``@triton.jit`` kernel, which records the
grid and meta-parameters while the result stays bitwise equal to the torch reference. Every test
starts from the shipped table and leaves it as it found it (the ``fresh_table`` fixture).
"""
from __future__ import annotations

import copy
import importlib
import json

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

import ddl_triton.kernels as K
from ddl_triton.kernels import int8, launch_configs as lc, onebit, config_sweep as sw

reduce_mod = importlib.import_module("ddl_triton.kernels.reduce")  # K.reduce is the function

KERNELS = ["reduce", "quantize_int8", "dequantize_int8", "reduce_int8", "add_into", "sign_pack", "sign_unpack"]
# The configs the kernel modules hard-coded before they became data (num_stages: triton.Config's default).
HARD_CODED = {
    "reduce": [("BLOCK", 1024, 4), ("BLOCK", 2048, 8), ("BLOCK", 4096, 8), ("BLOCK", 8192, 16)],
    "quantize_int8": [("TILE", 2048, 4), ("TILE", 4096, 8)],
    "dequantize_int8": [("TILE", 2048, 4), ("TILE", 4096, 8)],
    "reduce_int8": [("TILE", 2048, 4), ("TILE", 4096, 8), ("TILE", 8192, 8)],
    "add_into": [("BLOCK", 1024, 4), ("BLOCK", 4096, 8)],
    "sign_pack": [("BYTES", 256, 4), ("BYTES", 512, 4), ("BYTES", 1024, 8)],
    "sign_unpack": [("BYTES", 256, 4), ("BYTES", 512, 4), ("BYTES", 1024, 8)],
}


@pytest.fixture(autouse=True)
def fresh_table():
    """The shipped table, nothing pinned, during the test; the state before it afterwards."""
    saved_table, saved_pins = copy.deepcopy(lc.LAUNCH_CONFIGS), dict(lc._PINNED)
    lc.reset()
    try:
        yield
    finally:
        lc.LAUNCH_CONFIGS.clear()
        lc.LAUNCH_CONFIGS.update(saved_table)
        lc._PINNED.clear()
        lc._PINNED.update(saved_pins)
        K.set_backend("auto")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


# ------------------------------------------------------------------------------------------
# the data
# ------------------------------------------------------------------------------------------

def test_table_is_valid_and_keeps_the_hard_coded_values():
    assert lc.names() == KERNELS
    assert triton.Config({}).num_stages == lc.DEFAULT_NUM_STAGES  # "the default" is what it says
    assert triton.Config({}).num_warps == lc.DEFAULT_NUM_WARPS
    for kernel in KERNELS:
        configs = lc.candidates(kernel)
        assert configs == [{k: v, "num_warps": w, "num_stages": 3} for k, v, w in HARD_CODED[kernel]], kernel
        assert lc.meta_parameters(kernel) == [HARD_CODED[kernel][0][0]]
        lc.set_candidates(kernel, configs)  # passes its own validation
        assert lc.candidates(kernel) == configs
        tc = lc.triton_configs(kernel)
        assert [(c.kwargs, c.num_warps, c.num_stages) for c in tc] == \
               [({k: v}, w, 3) for k, v, w in HARD_CODED[kernel]]


def test_candidates_and_pinned_are_copies():
    got = lc.candidates("reduce")
    got[0]["BLOCK"] = 64
    got.append({"BLOCK": 128})
    assert lc.candidates("reduce") == lc._SHIPPED["reduce"]
    lc.pin("reduce", {"BLOCK": 512})
    p = lc.pinned("reduce")
    p["BLOCK"] = 64
    assert lc.pinned("reduce")["BLOCK"] == 512


@pytest.mark.parametrize("configs,error,match", [
    ([{"BLOCK": 1000}], ValueError, "reduce config 0: BLOCK must be a power of two, got 1000"),
    ([{"BLOCK": 1024}, {"num_warps": 4}], ValueError, r"reduce config 1: missing BLOCK \(a reduce config has BLOCK "
                                                      r"and optionally num_warps, num_stages\)"),
    ([{"BLOCK": 1024, "TILE": 8}], ValueError, "reduce config 0: unknown key.*'TILE'.*a reduce config has BLOCK"),
    ([{"BLOCK": 1024, "num_warps": 3}], ValueError, "num_warps must be a power of two, got 3"),
    ([{"BLOCK": 1024, "num_stages": 0}], ValueError, "num_stages must be a positive int, got 0"),
    ([{"BLOCK": 1024.0}], ValueError, "BLOCK must be a positive int, got 1024.0"),
    ([{"BLOCK": True}], ValueError, "BLOCK must be a positive int, got True"),
    ([{"BLOCK": 1 << 21}], ValueError, "BLOCK must be at most 1048576"),
    ([{"BLOCK": 256}, {"BLOCK": 256, "num_warps": 4, "num_stages": 3}], ValueError, "config 1 repeats"),
    ([], ValueError, "reduce: needs at least one config"),
    ({"BLOCK": 1024}, TypeError, "configs must be a list of dicts, got dict"),
    ([1024], TypeError, "reduce config 0: a config is a dict, got int"),
])
def test_set_candidates_rejects_bad_input(configs, error, match):
    with pytest.raises(error, match=match):
        lc.set_candidates("reduce", configs)
    assert lc.candidates("reduce") == lc._SHIPPED["reduce"]  # nothing changed


def test_unknown_kernel_lists_the_valid_names():
    valid = ", ".join(KERNELS)
    for call in (lambda: lc.candidates("reduse"), lambda: lc.set_candidates("reduse", [{"BLOCK": 1}]),
                 lambda: lc.pin("reduse", {"BLOCK": 1}), lambda: lc.unpin("reduse"), lambda: lc.pinned("reduse"),
                 lambda: lc.triton_configs("reduse"), lambda: lc.apply({"reduse": {"BLOCK": 1}})):
        with pytest.raises(ValueError, match=f"unknown kernel 'reduse'; valid: {valid}"):
            call()


def test_set_candidates_fills_defaults_and_triton_configs_follows():
    lc.set_candidates("sign_pack", [{"BYTES": 64}, {"BYTES": 2048, "num_warps": 16, "num_stages": 2}])
    assert lc.candidates("sign_pack") == [{"BYTES": 64, "num_warps": 4, "num_stages": 3},
                                          {"BYTES": 2048, "num_warps": 16, "num_stages": 2}]
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in lc.triton_configs("sign_pack")] == \
           [({"BYTES": 64}, 4, 3), ({"BYTES": 2048}, 16, 2)]
    assert len(lc.triton_configs("sign_unpack")) == 3  # the other kernels keep theirs


def test_pin_unpin():
    assert lc.pinned("reduce") is None
    lc.pin("reduce", {"BLOCK": 4096, "num_warps": 8, "num_stages": 1})
    assert lc.pinned("reduce") == {"BLOCK": 4096, "num_warps": 8, "num_stages": 1}
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in lc.triton_configs("reduce")] == [({"BLOCK": 4096}, 8, 1)]
    lc.set_candidates("reduce", [{"BLOCK": 256}])  # a pin wins over the candidates
    assert lc.triton_configs("reduce")[0].kwargs == {"BLOCK": 4096}
    lc.unpin("reduce")
    lc.unpin("reduce")  # a no-op when not pinned
    assert lc.pinned("reduce") is None
    assert [c.kwargs for c in lc.triton_configs("reduce")] == [{"BLOCK": 256}]
    with pytest.raises(ValueError, match="reduce pinned config: BLOCK must be a power of two"):
        lc.pin("reduce", {"BLOCK": 3})
    assert lc.pinned("reduce") is None


def test_apply_takes_both_shapes_and_is_all_or_nothing():
    applied = lc.apply({"reduce": {"config": {"BLOCK": 4096, "num_warps": 8, "num_stages": 1}, "us": 41.0},
                        "sign_unpack": {"BYTES": 128}})
    assert applied == {"reduce": {"BLOCK": 4096, "num_warps": 8, "num_stages": 1},
                       "sign_unpack": {"BYTES": 128, "num_warps": 4, "num_stages": 3}}
    assert lc.pinned("reduce") == applied["reduce"] and lc.pinned("sign_unpack") == applied["sign_unpack"]
    assert lc.pinned("add_into") is None  # not named: untouched
    with pytest.raises(ValueError, match="add_into config in the applied table: missing BLOCK"):
        lc.apply({"sign_pack": {"config": {"BYTES": 64}}, "add_into": {"config": {"TILE": 64}}})
    assert lc.pinned("sign_pack") is None  # the valid half was not applied either
    with pytest.raises(TypeError, match="expected a dict"):
        lc.apply([("reduce", {"BLOCK": 1024})])
    assert lc.apply({}) == {}


def test_reset():
    lc.set_candidates("add_into", [{"BLOCK": 64}])
    lc.pin("add_into", {"BLOCK": 64})
    lc.pin("reduce", {"BLOCK": 64})
    lc.reset("add_into")
    assert lc.candidates("add_into") == lc._SHIPPED["add_into"] and lc.pinned("add_into") is None
    assert lc.pinned("reduce") == {"BLOCK": 64, "num_warps": 4, "num_stages": 3}
    lc.reset()
    assert lc.pinned("reduce") is None


def test_direct_edits_of_the_table_are_validated_when_used():
    lc.LAUNCH_CONFIGS["reduce"].append({"BLOCK": 16384, "num_warps": 16})  # valid: taken as written
    assert [c.kwargs["BLOCK"] for c in lc.triton_configs("reduce")][-1] == 16384
    lc.LAUNCH_CONFIGS["reduce"].append({"BLOCK": 3000})
    with pytest.raises(ValueError, match=r"LAUNCH_CONFIGS\['reduce'\]\[5\]: BLOCK must be a power of two"):
        lc.triton_configs("reduce")
    with pytest.raises(ValueError, match=r"LAUNCH_CONFIGS\['reduce'\]\[5\]"):
        lc.autotuned("reduce", reduce_mod._reduce_kernel, key=reduce_mod._AUTOTUNE_KEY)
    lc.LAUNCH_CONFIGS["reduce"] = [["BLOCK", 1024]]
    with pytest.raises(TypeError, match=r"LAUNCH_CONFIGS\['reduce'\]\[0\]: a config is a dict, got list"):
        lc.autotuned("reduce", reduce_mod._reduce_kernel, key=reduce_mod._AUTOTUNE_KEY)


# ------------------------------------------------------------------------------------------
# the kernels use the data
# ------------------------------------------------------------------------------------------

def test_autotuned_wrapper_follows_the_data():
    # The GPU path's wrapper, checked without a GPU: its configs are the data as of each call.
    fn, key = reduce_mod._reduce_kernel, reduce_mod._AUTOTUNE_KEY
    shipped = lc.autotuned("reduce", fn, key=key)
    assert lc.autotuned("reduce", fn, key=key) is shipped  # unchanged data: cached
    assert [c.kwargs["BLOCK"] for c in shipped.configs] == [1024, 2048, 4096, 8192]
    assert shipped.keys == ["n_elements", "NUM_INPUTS"]
    lc.set_candidates("reduce", [{"BLOCK": 512}, {"BLOCK": 1024}])
    edited = lc.autotuned("reduce", fn, key=key)
    assert edited is not shipped and [c.kwargs["BLOCK"] for c in edited.configs] == [512, 1024]
    lc.pin("reduce", {"BLOCK": 256, "num_warps": 2, "num_stages": 1})
    pinned = lc.autotuned("reduce", fn, key=key)
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in pinned.configs] == [({"BLOCK": 256}, 2, 1)]
    lc.unpin("reduce")
    assert lc.autotuned("reduce", fn, key=key) is edited  # back to the earlier list and its tuning
    lc.reset("reduce")
    assert lc.autotuned("reduce", fn, key=key) is shipped

    # The pinned wrapper launches the pinned BLOCK (the interpreter runs it on CPU tensors).
    n = 1000
    a, b, out = torch.randn(n), torch.randn(n), torch.full((n,), float("nan"))
    blocks = []

    def grid(meta):
        blocks.append(meta["BLOCK"])
        return (triton.cdiv(n, meta["BLOCK"]),)
    pinned[grid](out, a, b, *[a] * 6, n, torch.ones(1), NUM_INPUTS=2, OP=0, HAS_SCALE=False, ACC_FP32=False)
    assert blocks == [256] and same_bits(out, a + b)


def test_autotuning_an_in_place_reduce_leaves_the_result_of_one_launch(monkeypatch):
    """The first launch of a size autotunes: every candidate runs on the live arguments. With
    ``out`` aliasing inputs[0] (the ring's in-place accumulation) each trial would add the other
    inputs once more; the wrapper must restore ``out`` between trials. Run under the interpreter
    with a stand-in timer that launches each candidate three times."""
    trials = []

    def timer(kernel_call, quantiles):
        for _ in range(3):
            kernel_call()
        trials.append(1)
        return [1.0, 1.0, 1.0]

    monkeypatch.setattr(lc, "_trial_timer", timer)
    lc.set_candidates("reduce", [{"BLOCK": 64}, {"BLOCK": 128}])
    n = 1000
    a, b = torch.arange(n, dtype=torch.float32), torch.full((n,), 3.0)
    want = a + b
    reduce_mod._tuned()[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](
        a, a, b, *[a] * 6, n, torch.ones(1), NUM_INPUTS=2, OP=0, HAS_SCALE=False, ACC_FP32=False)
    assert len(trials) == 2, "both candidates were timed"
    assert same_bits(a, want), f"in-place result after autotuning: {a[:4].tolist()}, want {want[:4].tolist()}"


def test_compress_kernels_keep_their_autotuning_arguments():
    for kernel, restore in [("quantize_int8", []), ("dequantize_int8", []), ("reduce_int8", []),
                            ("add_into", ["r_ptr"]), ("sign_pack", ["v_ptr"]), ("sign_unpack", [])]:
        wrapper = (int8 if "int8" in kernel else onebit)._tuned(kernel)
        assert wrapper.restore_value == restore, kernel
        assert wrapper.keys == (["n_elements", "QBLOCK"] if "int8" in kernel else ["n_elements"]), kernel
        assert [c.kwargs for c in wrapper.configs] == [{k: v} for k, v, _ in HARD_CODED[kernel]]


class Spy:
    """Stands in for a @triton.jit kernel: records each launch's grid and keyword arguments."""

    def __init__(self, fn):
        self.fn, self.launches = fn, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.fn[grid](*args, **kwargs)
        return run


def _run_reduce():
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    out = torch.full((1000,), float("nan"))
    K.reduce(out, inputs, op="sum", scale=0.5)
    return [out], [K.reduce_reference(torch.empty(1000), inputs, op="sum", scale=0.5)]


def _int8_inputs():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    return x, K.quantize_int8_reference(x, block=64)


def _run_quantize():
    x, (q, s) = _int8_inputs()
    return list(K.quantize_int8(x, block=64)), [q, s]


def _run_dequantize():
    _, (q, s) = _int8_inputs()
    return [K.dequantize_int8(q, s, block=64)], [K.dequantize_int8_reference(q, s, block=64)]


def _run_reduce_int8():
    _, (q, s) = _int8_inputs()
    q2, s2 = K.quantize_int8_reference(torch.randn(1000, generator=torch.Generator().manual_seed(2)), block=64)
    got = K.reduce_int8([q, q2], [s, s2], block=64, scale=0.5)
    return list(got), list(K.reduce_int8_reference([q, q2], [s, s2], block=64, scale=0.5))


def _run_sign_compress():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    r0 = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 0.1
    r, r_ref = r0.clone(), r0.clone()
    bits, scale = K.sign_compress(x, r)
    bits_ref, scale_ref = K.sign_compress_reference(x, r_ref)
    return [bits, scale, r], [bits_ref, scale_ref, r_ref]


def _run_sign_decompress():
    bits = torch.randint(0, 256, (125,), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    scale = torch.tensor([0.375])
    return [K.sign_decompress(bits, scale, 1000)], [K.sign_decompress_reference(bits, scale, 1000)]


# kernel -> (module, jit kernel attribute, meta-parameter, interpreter default, pinned value,
#            programs launched when pinned, a run returning (results, references)). n = 1000 elements;
# the int8 runs use block 64, so a 256-element TILE is 4 blocks per program (16 blocks: 4 programs).
PIN_CASES = {
    "reduce": (reduce_mod, "_reduce_kernel", "BLOCK", 1024, 256, 4, _run_reduce),
    "quantize_int8": (int8, "_quantize_kernel", "TILE", 4096, 256, 4, _run_quantize),
    "dequantize_int8": (int8, "_dequantize_kernel", "TILE", 4096, 256, 4, _run_dequantize),
    "reduce_int8": (int8, "_reduce_int8_kernel", "TILE", 4096, 256, 4, _run_reduce_int8),
    "add_into": (onebit, "_add_into_kernel", "BLOCK", 4096, 128, 8, _run_sign_compress),
    "sign_pack": (onebit, "_sign_pack_kernel", "BYTES", 512, 32, 4, _run_sign_compress),
    "sign_unpack": (onebit, "_sign_unpack_kernel", "BYTES", 512, 32, 4, _run_sign_decompress),
}


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_pinned_config_is_what_the_kernel_launches(monkeypatch, kernel):
    module, attr, meta, default, value, programs, run = PIN_CASES[kernel]
    spy = Spy(getattr(module, attr))
    monkeypatch.setattr(module, attr, spy)
    K.set_backend("triton")
    for pinned_value in (None, value):
        if pinned_value is not None:
            lc.pin(kernel, {meta: pinned_value, "num_warps": 2, "num_stages": 1})
        spy.launches.clear()
        got, want = run()
        assert len(spy.launches) == 1, spy.launches
        grid, kwargs = spy.launches[0]
        assert kwargs[meta] == (default if pinned_value is None else pinned_value)
        if pinned_value is not None:
            assert grid == (programs,)
        for g, w in zip(got, want):
            assert same_bits(g, w), f"{kernel} pinned to {meta}={pinned_value}: result differs from the reference"


# ------------------------------------------------------------------------------------------
# the sweep
# ------------------------------------------------------------------------------------------

def test_sweep_without_a_gpu_raises_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(sw.NoGpu) as info:
        sw.sweep(sizes=[1024], kernels=["reduce"])
    assert isinstance(info.value, RuntimeError)
    assert str(info.value) == "no GPU: kernel tuning needs CUDA (torch.cuda.is_available() is False)"
    with pytest.raises(sw.NoGpu):
        K.config_sweep.sweep()


def test_sweep_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown kernel 'pack'; valid: reduce, quantize_int8"):
        sw.sweep(kernels=["pack"])
    with pytest.raises(ValueError, match="unknown kernel 'pack'"):
        sw.sweep(kernels="pack")  # one name, not its letters
    with pytest.raises(ValueError, match="sizes must be positive"):
        sw.sweep(sizes=[0])
    with pytest.raises(ValueError, match="no kernels named"):
        sw.sweep(kernels=[])
    with pytest.raises(ValueError, match="must be a CUDA device"):
        sw.sweep(device="cpu")


def _expected_after(kernel: str, before: dict) -> dict:
    """What one launch of ``kernel`` must leave in the sweep case's tensors, from torch references."""
    t = before
    if kernel == "reduce":
        return {"out": t["a"] + t["b"]}
    if kernel == "quantize_int8":
        q, s = int8.quantize_int8_reference(t["x"], block=sw.QBLOCK)
        return {"q": q, "s": s}
    if kernel == "dequantize_int8":
        return {"out": int8.dequantize_int8_reference(t["q"], t["s"], block=sw.QBLOCK)}
    if kernel == "reduce_int8":
        q, s = int8.reduce_int8_reference([t["q0"], t["q1"]], [t["s0"], t["s1"]], block=sw.QBLOCK)
        return {"q_out": q, "s_out": s}
    if kernel == "add_into":
        return {"r": t["r"] + t["x"]}
    if kernel == "sign_pack":
        pos = t["v"] >= 0
        bits = torch.empty_like(t["bits"])
        onebit._pack_signs(pos, bits)
        return {"v": t["v"] - torch.where(pos, t["scale"], -t["scale"]), "bits": bits}
    return {"out": onebit.sign_decompress_reference(t["bits"], t["scale"], t["out"].numel())}


@pytest.mark.parametrize("kernel", KERNELS)
def test_sweep_launches_every_candidate_correctly(kernel):
    # What the sweep times must be the kernel doing its real work: each candidate, launched as the
    # sweep launches it (here interpreted on CPU), leaves the references' results.
    case = sw._case(kernel, 1001, torch.device("cpu"))  # short last int8 block and last byte
    for config in lc.candidates(kernel):
        before = {k: v.clone() for k, v in case.tensors.items()}
        case.launch(config)
        for name, want in _expected_after(kernel, before).items():
            assert same_bits(case.tensors[name], want), f"{kernel} {config}: {name}"
        for k, v in before.items():  # undo in-place updates, so every config sees the same inputs
            case.tensors[k].copy_(v)


def test_sweep_ranks_by_geometric_mean_and_drops_configs_that_cannot_run():
    # The ranking, result shape and failure handling, with a stand-in timer (no GPU here).
    lc.set_candidates("add_into", [{"BLOCK": 256}, {"BLOCK": 512}, {"BLOCK": 1024}])
    times_ms = iter([0.010, 0.015, None,   # size 1000: BLOCK 256, 512; 1024 cannot run
                     0.040, 0.030])        # size 4000: 256, 512 (1024 is not tried again)

    def fake_do_bench(fn, warmup, rep, return_mode):
        assert return_mode == "median"
        ms = next(times_ms)
        if ms is None:
            raise OutOfResources(1 << 20, 1 << 16, "shared memory")
        fn()
        return ms

    lines = []
    got = sw._sweep_kernel("add_into", [1000, 4000], torch.device("cpu"), 1, 1, lines.append, fake_do_bench)
    # geomean: 256 -> sqrt(10 * 40) = 20 us; 512 -> sqrt(15 * 30) = 21.2 us.
    assert got["config"] == {"BLOCK": 256, "num_warps": 4, "num_stages": 3}
    assert got["us"] == pytest.approx(20.0) and got["per_size_us"] == pytest.approx([10.0, 40.0])
    assert got["gbps"] == pytest.approx(((12 * 1000 / 10e-6) * (12 * 4000 / 40e-6)) ** 0.5 / 1e9)
    assert got["runner_up"]["config"]["BLOCK"] == 512 and got["runner_up"]["us"] == pytest.approx(450 ** 0.5)
    assert got["sizes"] == [1000, 4000] and "r = r + fp32(x)" in got["timed"]
    assert [c["config"]["BLOCK"] for c in got["candidates"]] == [256, 512]
    assert got["failed"][0]["config"]["BLOCK"] == 1024 and "OutOfResources" in got["failed"][0]["error"]
    assert len(lines) == 4 and lines[0].startswith("add_into n=1000 BLOCK=256")

    table = sw.winners_to_table({"add_into": got})
    assert table == {"add_into": {"config": got["config"], "us": got["us"], "gbps": got["gbps"]}}
    applied = lc.apply(json.loads(json.dumps(table)))  # through a JSON tuning table and back
    assert applied == {"add_into": got["config"]} and lc.pinned("add_into") == got["config"]
    with pytest.raises(ValueError, match="expected a sweep\\(\\) entry with a 'config'"):
        sw.winners_to_table({"add_into": {"us": 1.0}})
