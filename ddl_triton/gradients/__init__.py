"""The framework-neutral gradient-reduction floor: what every room's gradient averaging shares.

    buckets.py    ``plan``: the one bucket planner (tensors in order, per dtype, up to
                  ``bucket_bytes``; every rank plans the same buckets from the same shapes)
    residuals.py  ``Residuals``: the one error-feedback store (per key, reset on a size or method
                  change, or by ``clear`` after a world change or a checkpoint load)
    reducer.py    ``Reducer``: one communicator's compressed-or-not gradient allreduces: the
                  choice ("none", a method of ddl_triton/compression_methods.py, or "auto" from
                  the tuning table's compression section or the probed link), on fp32-equivalent
                  bytes; the residuals; the input checks; and ``reduce_list``, a list of NumPy
                  arrays fused into buckets

The rooms are thin adapters over it: torch's ``LevelCompression`` (torch/level_compression.py,
which adds the backward position as ``behind_us``), JAX's ``GradientCompression`` and
``allreduce_gradients`` (jax/gradients.py), TensorFlow's ``GradientReducer`` (tensorflow/fusion.py).
It works on torch tensors and NumPy buffers (viewed as torch by ``runtime.arrays.torch_view``),
imports torch as the runtime does, and never a framework room, JAX or TensorFlow.
"""
from __future__ import annotations

from .buckets import plan
from .reducer import Reducer
from .residuals import Residuals

__all__ = ["Reducer", "Residuals", "plan"]
