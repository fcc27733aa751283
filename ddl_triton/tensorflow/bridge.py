"""How a collective becomes a TensorFlow op: dtypes, the one-op call, the communicator.

A collective here is a Python function over NumPy arrays that calls the world communicator
(``ddl_triton.init()``). ``call`` runs it:

- eagerly, the function itself, on the tensors' NumPy values: errors keep their type
  (TypeError, ValueError, ``ddl_triton.DDLError``) and name the rank;
- inside ``tf.function``, as ONE ``tf.numpy_function(..., stateful=True)`` op. A stateful op is
  never pruned by grappler, even when its result is unused, nor merged with a twin, and
  ``tf.function``'s automatic control dependencies chain the stateful ops of a function in
  program order: a function with k collectives, called N times, makes exactly kN collectives,
  in the order written, on every rank (tests/multirank/tf_worker.py counts them). An error
  inside arrives as a ``tf.errors.OpError`` whose message is the core's (naming the rank), after
  the op's whole trace: its one-line cause is said on stderr first (errors.say_first).
  XLA (``jit_compile=True``) cannot compile such an op: it is refused when TF traces it.

The core takes NumPy arrays in place, without a copy (ddl_triton/runtime/arrays.py; bfloat16 as
TF's NumPy bfloat16, ``ml_dtypes.bfloat16``); the one copy per call is the input's into a fresh
writable buffer, which becomes the result (TF tensors are immutable). The compressed allreduces
take torch tensors: ``ddl_triton.runtime.arrays.torch_view`` views the same buffer, again without a copy.

dtypes reduced: float32, float64, float16, bfloat16, int32, int64 (the core's six). Any other
(bool, int8, uint8, complex, string, ...) is refused before any communication, naming the rank.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..errors import say_first
from ..runtime import world

_DTYPES = (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64)  # the core's six


def comm():
    """The world communicator: the one ``ddl_triton.init()`` made, else made now (ddlrun/mpiexec,
    or the launcher's variables: ddl_triton/launch/launchers.py). Called when a collective is written
    (eagerly, or while ``tf.function`` traces), so MPI starts on the user's thread, not TF's."""
    from ..elastic import world as elastic_world
    if elastic_world.current() is not None:  # an elastic job: the stand-in that follows every re-form
        return elastic_world.CURRENT
    return world.current() or world.init()


def check_dtype(dtype, what: str, rank: int):
    """``dtype`` as a ``tf.DType`` if the core reduces it, else TypeError naming the rank."""
    dtype = tf.as_dtype(dtype)
    if dtype not in _DTYPES:
        raise TypeError(f"rank {rank}: ddl_triton.tensorflow.{what}: dtype {dtype.name} is not reduced; "
                        f"use one of {', '.join(d.name for d in _DTYPES)}")
    return dtype


def writable(value: np.ndarray, dtype) -> np.ndarray:
    """A fresh C-contiguous buffer holding ``value`` (a NumPy value of a tensor of ``dtype``): the
    one copy of a call, and later the result's memory."""
    return np.array(value, dtype=dtype.as_numpy_dtype, order="C", copy=True)


def empty(shape, dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype.as_numpy_dtype)


def call(fn, tensors: list, out_dtypes: list, out_shapes: list, name: str) -> list:
    """``fn(*numpy_values) -> list of numpy arrays`` as tensors of ``out_dtypes`` / ``out_shapes``:
    run now when eager, else one stateful ``tf.numpy_function`` op (module doc)."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(fn(*[t.numpy() for t in tensors]), out_dtypes)]
    if not tensors:  # a numpy_function needs an input to hang on; an empty list has nothing to reduce
        return []

    def said_first(*values):
        try:
            return list(fn(*values))
        except Exception as e:  # reaches the user as TF's OpError, the cause under the op's whole trace
            say_first(e, "inside tf.function: TensorFlow's report of it follows")
            raise
    outs = tf.numpy_function(said_first, tensors, list(out_dtypes), stateful=True, name=name)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for o, s in zip(outs, out_shapes):
        o.set_shape(s)
    return outs
