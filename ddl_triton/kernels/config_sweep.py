"""Time every candidate launch configuration of the Triton kernels on a GPU and rank them.

``sweep()`` returns, per kernel::

    {"config": winner,             # a launch_configs config dict: pin() / apply() accept it
     "us": 41.2,                   # the winner's geometric mean over sizes of its median time, µs
     "gbps": 2950.0,               # geometric mean over sizes of bytes moved / median time
     "per_size_us": [...],         # the winner's median time at each size, µs
     "runner_up": {"config": ..., "us": ..., "gbps": ..., "per_size_us": [...]} or None,
     "sizes": [1048576, ...],      # elements of the fp32 tensor, as given
     "timed": "out = a + b, ...",  # what one timed run does
     "candidates": [...],          # every candidate that ran, fastest first, shaped like runner_up
     "failed": [{"config": ..., "error": "..."}]}   # candidates that did not compile or launch

``winners_to_table(result)`` keeps ``{kernel: {"config", "us", "gbps"}}``: the "kernels" section
of a tuning table, which ``launch_configs.apply`` pins at run time.

What is timed. For each kernel, at each size n, the inputs below are made once (seeded randn on
the device); each candidate in ``launch_configs.candidates(kernel)`` (pins are ignored: a sweep is
what produces a pin) then launches the kernel's ``@triton.jit`` function with exactly that
config's meta-parameter, num_warps and num_stages, with the arguments its launcher passes, and
``triton.testing.do_bench`` reports the median of runs, each after an L2 flush:

    reduce           out = a + b: fp32, 2 inputs, the ring's per-hop sum    12n bytes moved
    quantize_int8    fp32 x -> int8 q + fp32 scales, block 256              5n + n/64
    dequantize_int8  int8 q + fp32 scales -> fp32 out, block 256            5n + n/64
    reduce_int8      2 int8 inputs + scales -> requantized sum, block 256   3n + 3n/64
    add_into         r = r + fp32(x), fp32, in place                        12n
    sign_pack        v -> sign bits, v - d written over v, fp32             8n + n/8
    sign_unpack      bits -> fp32 +-scale                                   4n + n/8

add_into and sign_pack rewrite an input on every run; the values stay finite and the work is the
same whatever they are. Ranking: the lowest geometric mean over sizes, so every size weighs the
same (a config 10% faster at one size and 10% slower at another ties); a single size is plain
median time. Bandwidth of small sizes is limited by launch latency and L2 flushing: read "gbps"
at the largest size from "per_size_us" for a roofline comparison.

Without CUDA, ``sweep`` raises :class:`NoGpu` (a RuntimeError) with the message
"no GPU: kernel tuning needs CUDA (torch.cuda.is_available() is False)"; under
``TRITON_INTERPRET=1`` it raises RuntimeError (interpreted kernels cannot be timed).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError

from . import launch_configs
from ._dispatch import interpreting
from ._int8_jit import _dequantize_kernel, _quantize_kernel, _reduce_int8_kernel
from ._onebit_jit import _add_into_kernel, _sign_pack_kernel, _sign_unpack_kernel
from ._reduce_jit import _reduce_kernel
from .int8 import quantize_int8_reference
from .reduce import MAX_ARITY, OP_CODE

DEFAULT_SIZES = (1 << 20, 16 << 20, 64 << 20)
QBLOCK = 256  # the int8 block timed: quantize_int8's default
NO_GPU_MESSAGE = "no GPU: kernel tuning needs CUDA (torch.cuda.is_available() is False)"


class NoGpu(RuntimeError):
    """sweep() was asked to time kernels where CUDA is not available."""


def sweep(*, sizes: Iterable[int] = DEFAULT_SIZES, kernels: Iterable[str] | None = None, device: str = "cuda",
          warmup: int = 25, rep: int = 100, progress: Callable[[str], None] | None = None) -> dict[str, dict]:
    """Time every candidate config of ``kernels`` (None: all) at each of ``sizes`` on ``device``.

    ``warmup`` / ``rep``: milliseconds of warm-up and of timed runs per (config, size), as
    ``triton.testing.do_bench`` takes them. ``progress``, if given, gets one line per config timed.
    Returns ``{kernel: {"config", "us", "gbps", "per_size_us", "runner_up", "sizes", "timed",
    "candidates", "failed"}}`` (see the module docstring). Raises NoGpu without CUDA, ValueError
    for an unknown kernel, a non-positive size or a non-CUDA device, RuntimeError when no
    candidate of a kernel could run.
    """
    sizes = _check_sizes(sizes)
    if isinstance(kernels, str):
        kernels = [kernels]  # one name is a natural thing to pass
    names = launch_configs.names() if kernels is None else [_check_kernel(k) for k in kernels]
    if not names:
        raise ValueError(f"sweep: no kernels named; valid: {', '.join(launch_configs.names())}")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"sweep: times CUDA kernels; device must be a CUDA device, got {device!r}")
    if not torch.cuda.is_available():
        raise NoGpu(NO_GPU_MESSAGE)
    if interpreting():
        raise RuntimeError("sweep: TRITON_INTERPRET=1 interprets the kernels on the host; unset it to time them")
    import triton.testing  # needs a GPU driver: imported only once one is known to exist

    with torch.cuda.device(dev):
        return {name: _sweep_kernel(name, sizes, dev, warmup, rep, progress, triton.testing.do_bench)
                for name in names}


def winners_to_table(result: Mapping[str, Mapping]) -> dict[str, dict]:
    """``{kernel: {"config": ..., "us": ..., "gbps": ...}}`` from a sweep() result: the tuning
    table's "kernels" section, in the shape ``launch_configs.apply`` pins."""
    table = {}
    for kernel, entry in result.items():
        _check_kernel(kernel)
        if not isinstance(entry, Mapping) or "config" not in entry:
            raise ValueError(f"winners_to_table: {kernel}: expected a sweep() entry with a 'config', got {entry!r}")
        table[kernel] = {"config": dict(entry["config"]), "us": entry.get("us"), "gbps": entry.get("gbps")}
    return table


# --------------------------------------------------------------------------------------------
# timing one kernel
# --------------------------------------------------------------------------------------------

def _sweep_kernel(name: str, sizes: list[int], dev: torch.device, warmup: int, rep: int,
                  progress: Callable[[str], None] | None, do_bench: Callable) -> dict:
    configs = launch_configs.candidates(name)
    times: list[list[float]] = [[] for _ in configs]  # µs, per config per size
    failed: dict[int, str] = {}
    nbytes: list[int] = []
    timed = ""
    for n in sizes:
        case = _case(name, n, dev)
        nbytes.append(case.nbytes)
        timed = case.timed
        for i, config in enumerate(configs):
            if i in failed:
                continue
            try:
                ms = do_bench(lambda: case.launch(config), warmup=warmup, rep=rep, return_mode="median")
            except (OutOfResources, PTXASError, CompilationError) as e:
                # A config the GPU cannot run (too many registers, shared memory, ...) is dropped,
                # as the autotuner drops it; anything else is a bug and propagates.
                failed[i] = f"{type(e).__name__}: {e}"
                continue
            times[i].append(ms * 1e3)
            if progress is not None:
                progress(f"{name} n={n} {_describe(config)}: {ms * 1e3:.1f} us")
        del case  # free this size's tensors before the next size's
    ranked = sorted((_summary(configs[i], times[i], nbytes) for i in range(len(configs)) if i not in failed),
                    key=lambda c: c["us"])
    if not ranked:
        raise RuntimeError(f"sweep: no candidate of {name} could run: {failed}")
    return {**ranked[0], "runner_up": ranked[1] if len(ranked) > 1 else None, "sizes": list(sizes),
            "timed": timed, "candidates": ranked,
            "failed": [{"config": configs[i], "error": e} for i, e in sorted(failed.items())]}


def _summary(config: dict, per_size_us: list[float], nbytes: list[int]) -> dict:
    gbps = [b / (us * 1e-6) / 1e9 for b, us in zip(nbytes, per_size_us)]
    return {"config": config, "us": _geomean(per_size_us), "gbps": _geomean(gbps), "per_size_us": per_size_us}


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _describe(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


# --------------------------------------------------------------------------------------------
# what is timed: the inputs of one kernel at one size, and one launch with a given config
# --------------------------------------------------------------------------------------------

@dataclass
class _Case:
    timed: str                        # what one run does, for the result
    nbytes: int                       # bytes the kernel must read + write
    tensors: dict[str, torch.Tensor]  # its inputs and outputs, by the launcher's names
    launch: Callable[[dict], None]    # one launch with a config dict of launch_configs


def _launch_kwargs(config: dict) -> dict:
    return {k: v for k, v in config.items() if k in ("num_warps", "num_stages")}


def _case(name: str, n: int, dev: torch.device) -> _Case:
    """Inputs for kernel ``name`` at n elements, and a launch that mirrors its launcher's call."""
    g = torch.Generator(device=dev).manual_seed(n)
    x = torch.randn(n, generator=g, device=dev)
    nb = (n + QBLOCK - 1) // QBLOCK
    n_bytes = (n + 7) // 8

    def tile_grid(config: dict) -> tuple[int]:
        return (triton.cdiv(nb, max(1, config["TILE"] // QBLOCK)),)

    if name == "reduce":
        a, b, out = x, torch.randn(n, generator=g, device=dev), torch.empty(n, device=dev)
        ptrs = [a, b] + [a] * (MAX_ARITY - 2)
        scale = torch.ones(1, device=dev)

        def launch(c):
            _reduce_kernel[(triton.cdiv(n, c["BLOCK"]),)](
                out, *ptrs, n, scale, NUM_INPUTS=2, OP=OP_CODE["sum"], HAS_SCALE=False, ACC_FP32=False,
                BLOCK=c["BLOCK"], **_launch_kwargs(c))
        return _Case("out = a + b: fp32, 2 inputs, op sum, no scale", 12 * n, dict(a=a, b=b, out=out), launch)

    if name == "quantize_int8":
        q, s = torch.empty(n, dtype=torch.int8, device=dev), torch.empty(nb, device=dev)

        def launch(c):
            _quantize_kernel[tile_grid(c)](x, q, s, n, nb, QBLOCK=QBLOCK, TILE=c["TILE"], **_launch_kwargs(c))
        return _Case(f"fp32 x -> int8 q + fp32 scales, block {QBLOCK}", 5 * n + 4 * nb, dict(x=x, q=q, s=s), launch)

    if name == "dequantize_int8":
        q, s = quantize_int8_reference(x, block=QBLOCK)
        out = torch.empty(n, device=dev)

        def launch(c):
            _dequantize_kernel[tile_grid(c)](q, s, out, n, nb, QBLOCK=QBLOCK, TILE=c["TILE"], **_launch_kwargs(c))
        return _Case(f"int8 q + fp32 scales -> fp32 out, block {QBLOCK}", 5 * n + 4 * nb,
                     dict(q=q, s=s, out=out), launch)

    if name == "reduce_int8":
        (q0, s0), (q1, s1) = (quantize_int8_reference(t, block=QBLOCK)
                              for t in (x, torch.randn(n, generator=g, device=dev)))
        q_table = torch.tensor([q0.data_ptr(), q1.data_ptr()], dtype=torch.int64, device=dev)
        s_table = torch.tensor([s0.data_ptr(), s1.data_ptr()], dtype=torch.int64, device=dev)
        q_out, s_out = torch.empty(n, dtype=torch.int8, device=dev), torch.empty(nb, device=dev)
        scale = torch.ones(1, device=dev)

        def launch(c):
            # enable_fp_fusion=False, as reduce_int8 launches it (no fma: two roundings, as torch).
            _reduce_int8_kernel[tile_grid(c)](q_table, s_table, 2, q_out, s_out, n, nb, scale, HAS_SCALE=False,
                                              QBLOCK=QBLOCK, TILE=c["TILE"], enable_fp_fusion=False,
                                              **_launch_kwargs(c))
        return _Case(f"2 int8 inputs + scales -> requantized sum, block {QBLOCK}", 3 * n + 12 * nb,
                     dict(q0=q0, s0=s0, q1=q1, s1=s1, q_out=q_out, s_out=s_out), launch)

    if name == "add_into":
        r = torch.randn(n, generator=g, device=dev)

        def launch(c):
            _add_into_kernel[(triton.cdiv(n, c["BLOCK"]),)](x, r, n, BLOCK=c["BLOCK"], **_launch_kwargs(c))
        return _Case("r = r + fp32(x): fp32, in place", 12 * n, dict(x=x, r=r), launch)

    if name == "sign_pack":
        bits = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
        scale = x.abs().mean().reshape(1)

        def launch(c):
            _sign_pack_kernel[(triton.cdiv(n_bytes, c["BYTES"]),)](x, bits, scale, n, n_bytes, BYTES=c["BYTES"],
                                                                   **_launch_kwargs(c))
        return _Case("v -> sign bits, v - d written over v: fp32", 8 * n + n_bytes,
                     dict(v=x, bits=bits, scale=scale), launch)

    if name == "sign_unpack":
        bits = torch.randint(0, 256, (n_bytes,), generator=g, dtype=torch.uint8, device=dev)
        scale = torch.full((1,), 0.75, device=dev)
        out = torch.empty(n, device=dev)

        def launch(c):
            _sign_unpack_kernel[(triton.cdiv(n_bytes, c["BYTES"]),)](bits, scale, out, n, n_bytes, BYTES=c["BYTES"],
                                                                     **_launch_kwargs(c))
        return _Case("sign bits -> fp32 +-scale", 4 * n + n_bytes, dict(bits=bits, scale=scale, out=out), launch)

    raise AssertionError(f"sweep: no timing case for kernel {name!r}")  # names() and this list disagree


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------

def _check_kernel(kernel) -> str:
    if kernel not in launch_configs.names():
        raise ValueError(f"sweep: unknown kernel {kernel!r}; valid: {', '.join(launch_configs.names())}")
    return kernel


def _check_sizes(sizes: Iterable[int]) -> list[int]:
    if isinstance(sizes, int):
        sizes = [sizes]  # one size is a natural thing to pass
    out = list(sizes)
    if not out or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in out):
        raise ValueError(f"sweep: sizes must be positive element counts, got {out!r}")
    return out
