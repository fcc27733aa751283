"""``DistributedOptimizer``: a Keras 3 optimizer that averages gradients over the ranks before applying them.

    opt = DistributedOptimizer(keras.optimizers.SGD(0.1))          # or compression=Compression.fp16 | "int8" | ...
    model.compile(optimizer=opt, loss=...)                        # then model.fit(..., callbacks=[
                                                                  #   BroadcastGlobalVariablesCallback(0)])

Keras 3 updates variables through ``optimizer.apply(grads, variables)``; ``apply_gradients(pairs)``
(what ``model.fit``'s TF train step calls) and custom loops both end there. The optimizer given
becomes, in place, an instance of a subclass of its own class whose ``apply`` first reduces the
gradients with its ``GradientReducer`` (fusion.py: buckets, compression, error feedback kept by
this optimizer), then runs the original ``apply`` (loss-scale unscaling, clipping, the update).
Its state, config and class name are kept; it is returned for convenience. Works eagerly and
inside ``model.fit``'s ``tf.function``; not under XLA (``jit_compile=True``: bridge.py).

Horovod's signature and defaults (``horovod.tensorflow.keras.DistributedOptimizer``: op Average); its
arguments ddl_triton does not honour are refused unless at Horovod's default (tape.py's list, and
``backward_passes_per_step``/``average_aggregated_gradients``: no local accumulation here). ``name``
is accepted and unused: the optimizer keeps its own class name.
"""
from __future__ import annotations

import keras

from . import bridge
from .fusion import DEFAULT_BUCKET_BYTES, GradientReducer
from .horovod_args import Average, Compression, method, only_defaults, reduce_op
from .tape import refuse_unhonoured

_SUBCLASSES: dict = {}


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802 - Horovod's name
                         compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=Average, backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=None, scale_local_gradients=True, *,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, error_feedback: bool = True, block: int = 256,
                         reducer: GradientReducer | None = None):
    """``optimizer`` (a ``keras.optimizers.Optimizer``) made to reduce its gradients over the ranks
    first, averaging by default (module doc); ``compression``: Horovod's ``Compression.none`` or
    ``.fp16``, or "none", "auto" or a method of ddl_triton/compression_methods.py. Returns the same object."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer takes a Keras 3 optimizer (keras.optimizers.Optimizer), got "
                        f"{type(optimizer).__name__}")
    rank = bridge.comm().rank
    refuse_unhonoured(rank, "DistributedOptimizer", device_dense, device_sparse, gradient_predivide_factor,
                      num_groups, groups, process_set)
    only_defaults(rank, "DistributedOptimizer",
                  backward_passes_per_step=(backward_passes_per_step, 1, "gradients are not accumulated locally"),
                  average_aggregated_gradients=(average_aggregated_gradients, False,
                                                "gradients are not accumulated locally"))
    op = reduce_op(op, None, rank, "DistributedOptimizer")
    if getattr(optimizer, "_ddl_reducer", None) is not None:
        raise ValueError("DistributedOptimizer: this optimizer is distributed already (its gradients would be "
                         "averaged twice)")
    base = type(optimizer)
    cls = _SUBCLASSES.get(base)
    if cls is None:
        def apply(self, grads, trainable_variables=None):
            return super(cls, self).apply(self._ddl_reducer.reduce(list(grads)), trainable_variables)

        apply.__doc__ = f"{base.__name__}.apply on the gradients averaged over the ranks (ddl_triton.tensorflow)."
        cls = _SUBCLASSES[base] = type(base.__name__, (base,), {"apply": apply, "__module__": base.__module__})
    optimizer._ddl_reducer = reducer if reducer is not None else GradientReducer(
        method(compression, rank, "DistributedOptimizer"), op=op, bucket_bytes=bucket_bytes,
        error_feedback=error_feedback, block=block)
    optimizer.__class__ = cls
    return optimizer
