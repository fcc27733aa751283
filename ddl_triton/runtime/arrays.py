"""Arrays from any framework: what the caller passed -> a torch view of it, and how the result goes back.

Semantics. The collectives run on torch tensors; ``as_tensor`` turns what a caller passed into one
and says how to hand the result back in the caller's own terms (``Given``):

- a ``torch.Tensor``: itself; the result is the tensor.
- a NumPy array: ``torch.from_numpy``, zero copy, so the collective works in place on the array's
  memory; the result is the same array object. A strided array works in place too (as a strided
  tensor does: through a contiguous copy written back once done); one torch cannot view (negative
  strides) is copied and written back. ``ml_dtypes.bfloat16`` arrays (what ``np.asarray`` makes of
  a JAX bfloat16 array) travel as torch.bfloat16. A read-only array cannot be written: refused
  where the result lands in it, read without a copy where it is only read (an ``input``).
- any other object with ``__dlpack__`` (JAX, CuPy, TensorFlow's eager tensors): ``torch.from_dlpack``,
  zero copy. Known mutable kinds (CuPy) are written in place and handed back as themselves. Any
  other kind is treated as immutable (JAX arrays and TensorFlow tensors are): read in place, but a collective that writes
  (allreduce, broadcast) runs on a fresh torch copy and returns a NEW array of the caller's type,
  made from that copy by the caller's own ``from_dlpack`` (its ``__array_namespace__``, else its
  top-level module), bitwise the result. As an ``output`` an immutable array is refused.

Every refusal is a TypeError or ValueError naming the rank and the problem, raised before any
communication (the dtype, device and writability of what was passed, in the caller's terms);
arguments.py then checks the torch view as it checks any tensor, and a call whose shape or dtype
differs between ranks is caught on every rank by the call check (lanes/call_check.py), as for tensors.

``handed_back`` gives the caller the result: at once for a synchronous call; for ``async_op=True``
an ``ArrayWork`` whose ``wait()`` (and ``result()``) returns the caller's array, as a torch call's
Work returns its tensor.
"""
from __future__ import annotations

import sys
from typing import Callable

import numpy as np
import torch
from torch.utils.dlpack import to_dlpack

from ..ops import DTYPES
from .calls.gpu_path import available as gpu_available
from .calls.work import Work

READ, WRITTEN, IN_PLACE = "read", "written", "in place"  # what the collective does with the argument
_NUMPY = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
          np.dtype(np.float64): torch.float64, np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}
_MUTABLE_MODULES = ("cupy",)  # DLPack producers whose arrays a write through DLPack changes, as the caller expects
_CPU_DEVICES = (1, 3)  # DLPack's kDLCPU and kDLCUDAHost (pinned host memory)
_SUPPORTED = ("float32, float16, bfloat16 (torch, JAX, ml_dtypes), float64, int32, int64")


class Given:
    """What the caller passed as a torch tensor (``tensor``), and ``back(result)``: the torch result
    in the caller's terms (the same object when the collective worked in place)."""

    __slots__ = ("tensor", "back")

    def __init__(self, tensor: torch.Tensor, back: Callable[[torch.Tensor], object]):
        self.tensor, self.back = tensor, back


def as_tensor(rank: int, x, name: str, role: str) -> Given:
    """``x`` (``name`` in errors: "tensor", "output", "input") as a torch tensor the collective can
    ``role``: READ it, have its result WRITTEN into it, or both (IN_PLACE: allreduce, broadcast)."""
    if isinstance(x, torch.Tensor):
        return Given(x, _itself(x))
    if isinstance(x, np.ndarray):
        return _numpy(rank, x, name, role)
    if isinstance(x, np.generic):
        raise TypeError(f"rank {rank}: {name} is a numpy scalar ({type(x).__name__}); pass an array "
                        "(np.asarray(x), writable) and use the result the call returns")
    if hasattr(x, "__dlpack__"):
        return _dlpack(rank, x, name, role)
    raise TypeError(f"rank {rank}: {name} must be a torch.Tensor, a numpy array or an array with __dlpack__ "
                    f"(JAX, CuPy, ...), got {type(x).__module__}.{type(x).__name__}")


def torch_dtype(rank: int, dtype) -> torch.dtype:
    """``dtype`` in any spelling a collective's array may carry, as the torch dtype the call runs on:
    a torch dtype; a name ("float32", "torch.float32", "bfloat16", and the aliases torch and NumPy
    agree on: "half", "double", "f4", ...; "float" and "int", which they read differently, are
    refused as ambiguous); a NumPy dtype or scalar type (np.float32, np.dtype("int64"),
    ml_dtypes.bfloat16), JAX's (jnp.float32) and TensorFlow's (tf.float32). Anything else, or a dtype
    the collectives do not take, is a TypeError naming the rank and the supported ones."""
    if isinstance(dtype, torch.dtype):
        found = dtype
    elif isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        by_torch = getattr(torch, name, None) if name.isidentifier() else None  # torch's names and aliases
        by_torch = by_torch if isinstance(by_torch, torch.dtype) else None
        by_numpy = None if dtype.startswith("torch.") else _from_numpy(dtype)
        if by_torch is not None and by_numpy is not None and by_torch != by_numpy:
            raise TypeError(f"rank {rank}: dtype {dtype!r} is ambiguous: {str(by_torch).removeprefix('torch.')} to torch, "
                            f"{str(by_numpy).removeprefix('torch.')} to NumPy; name the one meant (e.g. 'float32')")
        found = by_torch or by_numpy
    else:
        as_numpy = getattr(dtype, "as_numpy_dtype", None)  # a TensorFlow DType
        found = _from_numpy(as_numpy if as_numpy is not None and not isinstance(dtype, np.dtype) else dtype)
    if found not in DTYPES:
        raise TypeError(f"rank {rank}: dtype {dtype!r} is not one the collectives take; supported: {_SUPPORTED} "
                        "(in torch's, NumPy's, JAX's or TensorFlow's spelling, or by name)")
    return found


def _from_numpy(dtype) -> torch.dtype | None:
    try:
        dt = np.dtype(dtype)
    except TypeError:  # not a NumPy spelling (a name NumPy does not know, an object)
        return None
    if dt.name == "bfloat16" and dt.itemsize == 2:  # ml_dtypes' (JAX's, TensorFlow's NumPy type)
        return torch.bfloat16
    return _NUMPY.get(dt)


def torch_view(rank: int, array: np.ndarray) -> torch.Tensor:
    """A torch tensor over the memory of ``array`` (a writable C-contiguous NumPy array; bfloat16
    through its bits), no copy: how the framework rooms hand their NumPy buckets to the torch-only
    compressed allreduces. Refuses what ``as_tensor`` refuses, naming ``rank``."""
    if not array.flags.c_contiguous:
        raise ValueError(f"rank {rank}: torch_view needs a C-contiguous array, got strides {array.strides}")
    return _numpy(rank, array, "array", IN_PLACE).tensor


def handed_back(result, given: Given, async_op: bool):
    """The result of a collective run on ``given.tensor``, for the caller: ``given.back`` of the
    tensor, or for ``async_op`` (``result`` a Work) an ArrayWork completing with it."""
    if not async_op:
        return given.back(result)
    outer = ArrayWork(result.description, result)
    result.add_done_callback(lambda inner: outer.hand_back(inner, given.back))
    return outer


class ArrayWork(Work):
    """The Work of a collective on a caller's array: ``wait()`` and ``result()`` return the array
    (the same object when in place, else the new one), or raise the collective's error. Waiting
    runs or wakes the collective's own queued Work, as waiting on that Work would."""

    __slots__ = ("_inner",)

    def __init__(self, description: str, inner: Work):
        super().__init__(description)
        self._inner = inner

    def run_here(self) -> None:
        self._inner.run_here()

    def release(self) -> None:
        self._inner.release()

    def hand_back(self, inner: Work, back) -> None:
        """Complete with ``back`` of ``inner``'s tensor, or with ``inner``'s (or ``back``'s) error."""
        error = inner.exception()
        if error is None:
            try:
                value = back(inner.wait(0))
            except Exception as e:  # noqa: BLE001 - delivered to the waiter, like the collective's own
                error = e
        if error is not None:
            self.set_exception(error)
        else:
            self.set_result(value)


# -- NumPy -----------------------------------------------------------------------------------
def _numpy(rank: int, x: np.ndarray, name: str, role: str) -> Given:
    dtype = _NUMPY.get(x.dtype)
    bf16 = dtype is None and x.dtype.name == "bfloat16" and x.dtype.itemsize == 2 and x.dtype.isnative
    if dtype is None and not bf16:
        raise TypeError(f"rank {rank}: {name} has unsupported dtype {_numpy_dtype(x.dtype)} (a numpy array); "
                        f"supported: {_SUPPORTED}")
    writes = role != READ
    if writes and not x.flags.writeable:
        raise ValueError(f"rank {rank}: {name} is read-only (a numpy array with flags.writeable False), and the "
                         "collective writes its result into it: pass a writable array, or a writable copy "
                         "(np.array(x)) and use the result the call returns")
    if not writes:
        # DLPack reads a read-only array without torch's warning about writing into it. Negative
        # strides never go to torch.from_dlpack: torch 2.13 aborts the process on them (a C++
        # error it does not turn into a Python one); a contiguous copy is read instead.
        raw = x.view(np.uint16) if bf16 else x
        try:
            t = torch.from_dlpack(raw) if min(x.strides, default=0) >= 0 else None
        except (BufferError, RuntimeError, TypeError, ValueError):  # e.g. misaligned: numpy will not export it
            t = None
        t = torch.from_numpy(np.ascontiguousarray(raw)) if t is None else t
        return Given(t.view(torch.bfloat16) if bf16 else t, _itself(x))
    try:
        t = torch.from_numpy(x.view(np.uint16) if bf16 else x)
    except ValueError:
        # Negative strides: torch has no view of it. Run on a contiguous copy, written back once done.
        copy = np.ascontiguousarray(x)
        t = torch.from_numpy(copy.view(np.uint16) if bf16 else copy)
        return Given(t.view(torch.bfloat16) if bf16 else t, lambda result: _written_back(x, copy))
    return Given(t.view(torch.bfloat16) if bf16 else t, _itself(x))


def _numpy_dtype(dtype: np.dtype) -> str:
    if not dtype.isnative:
        return f"{dtype.str} (non-native byte order: pass x.astype(x.dtype.newbyteorder('=')))"
    return str(dtype)


def _written_back(x: np.ndarray, copy: np.ndarray) -> np.ndarray:
    np.copyto(x, copy)
    return x


# -- DLPack ----------------------------------------------------------------------------------
def _dlpack(rank: int, x, name: str, role: str) -> Given:
    kind = f"{type(x).__module__}.{type(x).__name__}"
    device = _dlpack_device(x)
    if device is not None and device[0] not in _CPU_DEVICES and not gpu_available():
        raise ValueError(f"rank {rank}: {name} is a {kind} on a GPU (DLPack device {device}), but this process "
                         "has no GPU path (torch.cuda.is_available() is False); move it to the CPU")
    mutable = type(x).__module__.partition(".")[0] in _MUTABLE_MODULES
    if role == WRITTEN and not mutable:
        raise TypeError(f"rank {rank}: {name} is a {kind}, which cannot be written in place (treated as immutable: "
                        "only numpy, torch and CuPy arrays are written through); pass a writable numpy array, "
                        "torch tensor or CuPy array as the output")
    if min(getattr(x, "strides", None) or (0,)) < 0:  # torch.from_dlpack would abort the process (above)
        raise ValueError(f"rank {rank}: {name} is a {kind} with negative strides, which torch cannot take "
                         "through DLPack: pass a contiguous copy (e.g. xp.ascontiguousarray(x)) and use the result")
    make = None if mutable or role == READ else _maker(rank, x, name, kind)
    try:
        t = torch.from_dlpack(x)
    except (BufferError, RuntimeError, TypeError, ValueError) as e:
        raise TypeError(f"rank {rank}: {name} ({kind}, dtype {getattr(x, 'dtype', '?')}) could not be read "
                        f"through DLPack: {e}; supported dtypes: {_SUPPORTED}") from None
    if t.dtype not in DTYPES:
        raise TypeError(f"rank {rank}: {name} has unsupported dtype {getattr(x, 'dtype', t.dtype)} (a {kind}); "
                        f"supported: {_SUPPORTED}")
    if make is None:
        return Given(t, _itself(x))
    # Immutable: the collective writes into a fresh copy (never pooled: the new array may alias it).
    return Given(t.clone(memory_format=torch.contiguous_format), make)


def _dlpack_device(x):
    probe = getattr(x, "__dlpack_device__", None)
    if probe is None:
        return None
    device = probe()
    return (int(device[0]), int(device[1]))


def _maker(rank: int, x, name: str, kind: str):
    """``result tensor -> a new array of x's type``, found before anything is sent (a rank that
    cannot hand back refuses the call instead of failing after the collective ran): the array API's
    ``x.__array_namespace__().from_dlpack`` (JAX), else the type's top-level module's ``from_dlpack``,
    else its ``experimental.dlpack.from_dlpack`` of a DLPack capsule (TensorFlow's eager tensors)."""
    namespace = getattr(x, "__array_namespace__", None)
    from_dlpack = getattr(namespace(), "from_dlpack", None) if namespace is not None else None
    module = sys.modules.get(type(x).__module__.partition(".")[0])
    if from_dlpack is None:
        from_dlpack = getattr(module, "from_dlpack", None)
    if from_dlpack is None:  # TensorFlow's: tf.experimental.dlpack.from_dlpack, which takes a capsule
        from_capsule = getattr(getattr(getattr(module, "experimental", None), "dlpack", None), "from_dlpack", None)
        if from_capsule is not None:
            return lambda result: from_capsule(to_dlpack(result))
    if from_dlpack is None:
        raise TypeError(f"rank {rank}: {name} is a {kind}, treated as immutable, and neither its "
                        "__array_namespace__ nor its module has from_dlpack to make the result one: pass a "
                        "writable numpy array or torch tensor")
    return from_dlpack


def _itself(x):
    return lambda result: x
