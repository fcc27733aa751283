"""TensorFlow 2 and Keras 3 on ddl_triton, with Horovod's names, signatures and defaults: data-parallel
training in two lines.

    import ddl_triton.tensorflow as ddl_tf
    ddl_tf.init()                                                   # ddl_triton.init(): ddlrun/mpiexec or env://
    model.compile(optimizer=ddl_tf.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=...)
    model.fit(x, y, callbacks=[ddl_tf.BroadcastGlobalVariablesCallback(0)])

A name borrowed from Horovod brings its meaning: ``allreduce`` averages unless told ``op=Sum``, as
Horovod's does; an argument of Horovod's that ddl_triton does not honour is refused by name
(horovod_args.py); docs/tensorflow.md has the table of every name against Horovod's.

What lives here, one concept per file:

    collectives.py  ``allreduce``, ``broadcast``, ``allgather``, ``broadcast_variables``, ``barrier``; ``init``,
                    ``rank``, ``size``, ``local_rank``, ``local_size``, ``is_initialized``, ``shutdown``:
                    eager and inside ``tf.function``, each one
                    stateful graph op that grappler never prunes and automatic control dependencies
                    keep in program order; ``allreduce``'s gradient is an allreduce (Sum -> Sum,
                    Average -> Average)
    horovod_args.py Horovod's spellings: ``Average``, ``Sum``, ``Min``, ``Max``, ``Compression`` (Horovod's
                    none and fp16, and the registry's int8, onebit, bf16, auto, ...), and the
                    arguments refused by name unless at Horovod's default
    bridge.py       how a collective becomes a TF op: dtypes (TF -> NumPy -> torch, zero copy), the
                    one-op call (the function itself when eager, ``tf.numpy_function`` in a graph),
                    the communicator; refuses what the core does not reduce, naming the rank
    fusion.py       ``GradientReducer``: averages a list of gradients in buckets (one collective per
                    bucket of one dtype, like DDP's and Horovod's tensor fusion), compressed or not
                    (ddl_triton/compression_methods.py), with error feedback kept per reducer
    tape.py         ``DistributedGradientTape``: ``tape.gradient`` returns averaged gradients
    optimizer.py    ``DistributedOptimizer``: a Keras 3 optimizer whose ``apply`` averages first
    callbacks.py    Horovod's Keras callbacks: ``BroadcastGlobalVariablesCallback`` (rank 0's variables
                    everywhere at ``fit``'s start), ``MetricAverageCallback`` (each epoch's logs
                    averaged over the ranks), ``LearningRateWarmupCallback`` (Horovod's warmup)

It may import the rooms kernels (to load Triton before TensorFlow), planning, runtime, schedules,
transports and tuning (ddl_triton/_rooms.py), not ddl_triton.torch nor ddl_triton.jax. Importing it without TensorFlow installed raises ImportError
naming the extra to install. docs/tensorflow.md says what works, what a call costs, what does not.
"""
from __future__ import annotations

import sys as _sys

if "tensorflow" not in _sys.modules:
    # Triton first: loaded after TensorFlow it aborts the process (their LLVMs clash), and a GPU
    # collective or DDL_KERNELS=triton loads it later (ddl_triton/kernels/_lazy_kernels.py: load_triton).
    # Where triton is not installed (the default install), there is nothing to load.
    from ..kernels import load_triton as _load_triton
    _load_triton(if_installed=True)

try:
    import tensorflow as _tf  # noqa: F401 - fail here, with the extra to install, not deep in a call
except ImportError as e:  # pragma: no cover - exercised by tests/unit/test_tensorflow.py in a stub world
    raise ImportError("ddl_triton.tensorflow needs TensorFlow: pip install 'ddl_triton[tensorflow]' "
                      f"(tensorflow-cpu 2.21 with Keras 3); importing it failed: {e}") from e

from .callbacks import BroadcastGlobalVariablesCallback, LearningRateWarmupCallback, MetricAverageCallback
from .collectives import (allgather, allreduce, barrier, broadcast, broadcast_variables, init, is_initialized,
                          local_rank, local_size, rank, shutdown, size)
from .fusion import GradientReducer
from .horovod_args import NOT_HERE as _NOT_HERE
from .horovod_args import Average, Compression, Max, Min, Sum
from .optimizer import DistributedOptimizer
from .tape import DistributedGradientTape

__all__ = ["Average", "BroadcastGlobalVariablesCallback", "Compression", "DistributedGradientTape",
           "DistributedOptimizer", "GradientReducer", "LearningRateWarmupCallback", "Max", "MetricAverageCallback",
           "Min", "Sum", "allgather", "allreduce", "barrier", "broadcast",
           "broadcast_variables", "init", "is_initialized", "local_rank", "local_size", "rank", "shutdown", "size"]


def __getattr__(name: str):
    """Horovod's names this room does not implement (``Adasum``, ...): an AttributeError saying so."""
    if name in _NOT_HERE:
        raise AttributeError(f"ddl_triton.tensorflow has no {name}: {_NOT_HERE[name]}")
    raise AttributeError(f"module 'ddl_triton.tensorflow' has no attribute {name!r}")
