"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient`` returns gradients averaged
over the ranks (Horovod's name and use).

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = DistributedGradientTape(tape)                   # or compression="int8" | "auto" | ...
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
from .fusion import DEFAULT_BUCKET_BYTES, GradientReducer

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


class DistributedGradientTape:
    """Wraps ``tape``; ``gradient(target, sources)`` returns the gradients reduced over the ranks
    (``op="avg"`` by default, "sum" to sum), with ``compression`` ("none", "auto" or a method of
    ddl_triton/compression_methods.py). Module doc for the reducer's lifetime."""

    def __init__(self, tape: tf.GradientTape, compression: str = compression_methods.NONE, *, op: str = "avg",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, error_feedback: bool = True, block: int = 256,
                 reducer: GradientReducer | None = None):
        if not isinstance(tape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(tape).__name__}")
        self._tape = tape
        self.reducer = reducer if reducer is not None else shared_reducer(
            compression, op=op, bucket_bytes=bucket_bytes, error_feedback=error_feedback, block=block)

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
