"""n-ary elementwise reduction: ``out = op(inputs[0], ..., inputs[k-1]) * scale``.

Semantics (what every path computes):
    acc = inputs[0] as accumulator dtype      # fp32 for fp16/bf16, else the dtype itself
    for x in inputs[1:]:                      # strictly in list order
        acc = op(acc, x)                      # op: sum | min | max
    if scale is not None: acc = acc * scale   # how "avg" is done: scale = 1 / world_size
    out = round(acc)                          # rounded to out.dtype once, at the end

Because the order is fixed, every rank that reduces the same inputs in the same
order gets bitwise-identical bits, whichever path (torch or Triton) it runs.

Worked example:
    inputs = [tensor([1., 2., 3.]), tensor([10., 20., 30.]), tensor([100., 0., -3.])]
    reduce(out, inputs, op="sum")             -> out = [111., 22., 30.]
    reduce(out, inputs, op="max")             -> out = [100., 20., 30.]
    reduce(out, inputs, op="sum", scale=0.5)  -> out = [55.5, 11., 15.]

``out`` may alias any input (in-place accumulation, as the ring does).
Memory traffic: k reads + 1 write of n elements; the Triton kernel does it in
one pass for up to ``MAX_ARITY`` inputs and chains passes through an fp32
accumulator beyond that, so rounding still happens once.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from . import launch_configs
from ._dispatch import accumulator_dtype, get_backend, interpreting, use_triton
from ._lazy_kernels import LazyKernels, cdiv

REDUCE_OPS = ("sum", "min", "max")
OP_CODE = {"sum": 0, "min": 1, "max": 2}
MAX_ARITY = 8  # input pointers one kernel launch takes; more inputs are chained
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPES = _FLOATS + (torch.int32, torch.int64)
_SAME_DTYPE_ACC = (torch.float32, torch.float64, torch.int32, torch.int64)  # accumulate in their own dtype


_KERNELS = LazyKernels(__name__, "._reduce_jit", ["_reduce_kernel"])
__getattr__ = _KERNELS.module_getattr  # reduce._reduce_kernel: the @triton.jit kernel, loaded on first use

# Launch configurations (BLOCK, num_warps, num_stages) are data: launch_configs.py, kernel "reduce".
_AUTOTUNE_KEY = ["n_elements", "NUM_INPUTS"]
# Autotuning runs every candidate on the live arguments, and ``out`` may alias an input (the ring
# accumulates in place), so ``out`` is restored between trials: without it, the first launch of
# each size returned inputs[0] + ~7000 x the others (seen on an H200, the first GPU run).
_AUTOTUNE_RESTORE = ["out_ptr"]
_INTERPRETER_BLOCK = 1024  # unless "reduce" is pinned: see launch_configs.interpreter_meta


def reduce_reference(out: torch.Tensor, inputs: Sequence[torch.Tensor], *, op: str = "sum",
                     scale: float | None = None) -> torch.Tensor:
    """Torch-ops implementation of :func:`reduce`; also the CPU fast path.

    Traffic: k reads + 1 write when ``out`` is fp32 (in-place ``add_`` chain),
    plus one fp32 temporary for 16-bit dtypes.
    """
    acc_dtype = accumulator_dtype(out.dtype)
    if acc_dtype == out.dtype and not _aliases_later(out, inputs):
        acc = out  # accumulate straight into out: it is read only through inputs[0]
    else:
        acc = torch.empty(out.shape, dtype=acc_dtype, device=out.device)
    if len(inputs) > 1:
        _combine_into(acc, inputs[0], inputs[1], op)
    elif acc.data_ptr() != inputs[0].data_ptr():
        acc.copy_(inputs[0])
    for x in inputs[2:]:
        _combine_into(acc, acc, x, op)
    if scale is not None:
        acc.mul_(scale)
    if acc is not out:
        out.copy_(acc)
    return out


def _aliases_later(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    """True when out shares memory with inputs[1:], so writing it early would corrupt them."""
    return any(x.data_ptr() == out.data_ptr() or _overlaps(x, out) for x in inputs[1:])


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = a.data_ptr(), a.data_ptr() + a.numel() * a.element_size()
    b0, b1 = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def _combine_into(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    if b.dtype != dst.dtype:
        b = b.to(dst.dtype)
    if op == "sum":
        torch.add(a, b, out=dst)
    elif op == "min":
        torch.minimum(a, b, out=dst)
    else:
        torch.maximum(a, b, out=dst)


def reduce(out: torch.Tensor, inputs: Sequence[torch.Tensor], *, op: str = "sum",
           scale: float | None = None) -> torch.Tensor:
    """``out = op(*inputs) * scale``, accumulated in fp32 for 16-bit dtypes and rounded once.

    All tensors must be contiguous, of one dtype and one number of elements;
    ``out`` may alias any input. Returns ``out``.
    """
    _validate(out, inputs, op, scale)
    return reduce_trusted(out, inputs, op, scale)


def reduce_trusted(out: torch.Tensor, inputs: Sequence[torch.Tensor], op: str, scale: float | None) -> torch.Tensor:
    """:func:`reduce` without validation, for the executor, whose schedules guarantee the
    preconditions (same dtype, size and device; contiguous) and which calls it per chunk."""
    if out.numel() == 0:
        return out
    if len(inputs) == 2 and scale is None and out.dtype in _SAME_DTYPE_ACC and not out.is_cuda \
            and _backend_is_not_triton():
        # The latency path: one torch op; an elementwise op may write over either input exactly.
        _combine_into(out, inputs[0], inputs[1], op)
        return out
    if len(inputs) == 1 and scale is None:
        if inputs[0].data_ptr() != out.data_ptr():
            out.copy_(inputs[0])
        return out
    if not use_triton(out, *inputs):
        return reduce_reference(out, inputs, op=op, scale=scale)
    return _reduce_triton(out, list(inputs), op, scale)


def _backend_is_not_triton() -> bool:
    return get_backend() != "triton"


def _validate(out: torch.Tensor, inputs: Sequence[torch.Tensor], op: str, scale: float | None) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce: unknown op {op!r}; valid: {', '.join(REDUCE_OPS)}")
    if len(inputs) == 0:
        raise ValueError("reduce: needs at least one input")
    if out.dtype not in _DTYPES:
        raise TypeError(f"reduce: unsupported dtype {out.dtype}")
    if scale is not None and out.dtype not in _FLOATS:
        raise TypeError(f"reduce: scale needs a floating dtype, got {out.dtype}")
    for i, x in enumerate(inputs):
        if x.dtype != out.dtype:
            raise TypeError(f"reduce: inputs[{i}] is {x.dtype}, out is {out.dtype}")
        if x.numel() != out.numel():
            raise ValueError(f"reduce: inputs[{i}] has {x.numel()} elements, out has {out.numel()}")
        if x.device != out.device:
            raise ValueError(f"reduce: inputs[{i}] is on {x.device}, out on {out.device}")
    for name, t in [("out", out)] + [(f"inputs[{i}]", x) for i, x in enumerate(inputs)]:
        if not t.is_contiguous():
            # The Triton interpreter silently misreads strided memory: refuse it.
            raise ValueError(f"reduce: {name} must be contiguous")


def _reduce_triton(out: torch.Tensor, inputs: list[torch.Tensor], op: str, scale: float | None) -> torch.Tensor:
    acc_dtype = accumulator_dtype(out.dtype)
    # More inputs than pointer slots: fold the first ones into an accumulator
    # carried in the accumulator dtype, so the final rounding still happens once.
    while len(inputs) > MAX_ARITY:
        acc = torch.empty(out.shape, dtype=acc_dtype, device=out.device)
        _launch(acc, inputs[:MAX_ARITY], op, None)
        # The kernel casts every load to fp32, so an fp32 accumulator may sit beside 16-bit inputs.
        inputs = [acc] + inputs[MAX_ARITY:]
    _launch(out, inputs, op, scale)
    return out


def _tuned():
    """The autotuned wrapper of the reduce kernel over its launch configurations as they are now."""
    return launch_configs.autotuned("reduce", _KERNELS["_reduce_kernel"], key=_AUTOTUNE_KEY,
                                    restore_value=_AUTOTUNE_RESTORE)


def _launch(out: torch.Tensor, inputs: list[torch.Tensor], op: str, scale: float | None) -> None:
    n = out.numel()
    ptrs = list(inputs) + [inputs[0]] * (MAX_ARITY - len(inputs))
    acc_fp32 = accumulator_dtype(out.dtype) == torch.float32 or any(x.dtype != out.dtype for x in inputs)
    args = dict(NUM_INPUTS=len(inputs), OP=OP_CODE[op], HAS_SCALE=scale is not None, ACC_FP32=acc_fp32)
    acc_dtype = torch.float32 if acc_fp32 else out.dtype
    scale_value = torch.full((1,), 1.0 if scale is None else float(scale), dtype=acc_dtype, device=out.device)
    kernel = _KERNELS["_reduce_kernel"]
    if out.is_cuda and not interpreting():
        grid = lambda meta: (cdiv(n, meta["BLOCK"]),)  # noqa: E731
        _tuned()[grid](out, *ptrs, n, scale_value, **args)
    else:
        block = launch_configs.interpreter_meta("reduce", BLOCK=_INTERPRETER_BLOCK)["BLOCK"]
        kernel[(cdiv(n, block),)](out, *ptrs, n, scale_value, BLOCK=block, **args)
