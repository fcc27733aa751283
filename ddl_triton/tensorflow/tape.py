"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient`` returns gradients averaged
over the ranks (Horovod's name, signature and defaults: op Average; its arguments ddl_triton does
not honour are refused unless at Horovod's default, horovod_args.py).

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = DistributedGradientTape(tape)                   # or compression=Compression.fp16 | "int8" | "auto" | ...
    grads = tape.gradient(loss, model.trainable_variables)  # averaged: one collective per bucket
    opt.apply_gradients(zip(grads, model.trainable_variables))

Eager and inside ``tf.function``. The reduction is a fusion.GradientReducer: gradients fused in
buckets, None gradients left None, ``tf.IndexedSlices`` (embeddings) made dense. A training loop
makes a new tape every step, so the reducer (and with it the error feedback of a compressed
reduction) is not the tape's: tapes with the same settings share one, kept for the process
(``shared_reducer``); pass ``reducer=GradientReducer(...)`` to keep one of your own (e.g. one per
model). Everything else (``watch``, ``jacobian``, ``stop_recording``, ...) is the wrapped tape's.
"""
from __future__ import annotations

import tensorflow as tf

from .. import compression_methods
from . import bridge
from .fusion import DEFAULT_BUCKET_BYTES, GradientReducer
from .horovod_args import Average, Compression, method, only_defaults, reduce_op

_SHARED: dict = {}


def shared_reducer(compression: str = compression_methods.NONE, *, op: str = "avg",
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, error_feedback: bool = True,
                   block: int = 256) -> GradientReducer:
    """The process's GradientReducer for these settings (made at first use): the one tapes share."""
    key = (compression, op, bucket_bytes, bool(error_feedback), block)
    held = _SHARED.get(key)
    if held is None:
        held = _SHARED[key] = GradientReducer(compression, op=op, bucket_bytes=bucket_bytes,
                                              error_feedback=error_feedback, block=block)
    return held


def refuse_unhonoured(rank: int, what: str, device_dense, device_sparse, gradient_predivide_factor, num_groups,
                      groups, process_set) -> None:
    """The tape's and the optimizer's Horovod arguments that ddl_triton does not honour, unless at their default."""
    only_defaults(rank, what, device_dense=(device_dense, "", "ddl_triton's ops run on the host"),
                  device_sparse=(device_sparse, "", "ddl_triton's ops run on the host"),
                  gradient_predivide_factor=(gradient_predivide_factor, 1.0, "the average is the sum times 1/size"),
                  num_groups=(num_groups, 0, "gradients are fused in buckets of bucket_bytes"),
                  groups=(groups, None, "gradients are fused in buckets of bucket_bytes"),
                  process_set=(process_set, None, "ddl_triton has no process sets: every call runs on the world"))


class DistributedGradientTape:
    """Wraps ``gradtape``; ``gradient(target, sources)`` returns the gradients reduced over the ranks
    (``op=Average`` by default, Sum to sum), with ``compression`` (Horovod's ``Compression.none`` or
    ``.fp16``, or "none", "auto" or a method of ddl_triton/compression_methods.py). Horovod's signature;
    ``sparse_as_dense``: sparse gradients are always made dense here (the values Horovod's allgathered
    slices sum to); ``scale_local_gradients``: there are no local sources here, so nothing to scale.
    Module doc for the reducer's lifetime."""

    def __init__(self, gradtape: tf.GradientTape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=None, scale_local_gradients=True, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 error_feedback: bool = True, block: int = 256, reducer: GradientReducer | None = None):
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        rank = bridge.comm().rank
        refuse_unhonoured(rank, "DistributedGradientTape", device_dense, device_sparse, gradient_predivide_factor,
                          num_groups, groups, process_set)
        op = reduce_op(op, None, rank, "DistributedGradientTape")
        self._tape = gradtape
        self.reducer = reducer if reducer is not None else shared_reducer(
            method(compression, rank, "DistributedGradientTape"), op=op, bucket_bytes=bucket_bytes,
            error_feedback=error_feedback, block=block)

    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
        """``tape.gradient(...)`` reduced over the ranks, in the structure of ``sources``."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        return tf.nest.pack_sequence_as(grads, self.reducer.reduce(flat), expand_composites=False)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)
