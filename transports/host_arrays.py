"""NumPy views of CPU tensors that leave the tensor as it was.

Semantics: ``numpy_view(tensor)`` is a NumPy array over ``tensor``'s memory (same shape, strides
and element type; writes go through), which keeps the tensor alive. Unlike ``Tensor.numpy()``, it
does not mark the tensor's storage as not resizable: torch does that for every storage it hands
to NumPy, and a collective must not change a caller's tensor beyond its values. torch's batched
PowerSGD hook resizes DDP's bucket buffer in place, which failed on "ddl" after a small allreduce
of that buffer (gloo never touches resizability). Costs about 0.8 us more than ``numpy()``, so
paths that reuse a view cache it (the small path's fast arrays). 16-bit floats with no NumPy type
(bfloat16) must be viewed as int16 first, as with ``numpy()``.
"""
from __future__ import annotations

import numpy as np
import torch

_TYPESTR: dict[torch.dtype, str] = {}


class _Interface:
    """What ``np.asarray`` reads: the array interface, and the tensor it keeps alive."""

    __slots__ = ("__array_interface__", "_tensor")


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy array over ``tensor``'s memory (a CPU tensor), its storage left resizable."""
    typestr = _TYPESTR.get(tensor.dtype)
    if typestr is None:
        typestr = _TYPESTR[tensor.dtype] = torch.empty(0, dtype=tensor.dtype).numpy().dtype.str
    face = _Interface()
    face._tensor = tensor
    if tensor.dim() == 1 and tensor.is_contiguous():  # the data paths' flat buffers: no strides to build
        face.__array_interface__ = {"data": (tensor.data_ptr(), False), "shape": (tensor.numel(),),
                                    "typestr": typestr, "version": 3}
    else:
        item = tensor.element_size()
        face.__array_interface__ = {"data": (tensor.data_ptr(), False), "shape": tuple(tensor.shape),
                                    "strides": tuple(s * item for s in tensor.stride()), "typestr": typestr,
                                    "version": 3}
    return np.asarray(face)
