"""Horovod's spellings in the TensorFlow room: its reduction ops, its ``Compression``, and the
arguments of its signatures that ddl_triton does not honour, refused by name.

Semantics: ``import ddl_triton.tensorflow as hvd`` in place of ``horovod.tensorflow`` keeps the
meaning of every call it accepts, defaults included, or fails naming the argument:

    Average, Sum, Min, Max   Horovod's reduction ops (here the core's names "avg", "sum", "min",
                             "max", so ``op=`` takes either spelling); ``op=None`` is Average, as in
                             Horovod, and so is the tape's and the optimizer's default
    Adasum, Product          Horovod's too, not implemented here: naming them raises AttributeError
                             saying so (the package's ``__getattr__``)
    average=True / False     Horovod's deprecated flag: Average / Sum; given with ``op=``, refused as
                             Horovod refuses it; anything but a bool (an old ``allreduce(t, "sum")``
                             of this room, where the second argument was ``op``) is refused
    Compression.none, .fp16  Horovod's compressors: fp16 casts floating tensors to float16 for the
                             wire and back; the tape and the optimizer run it as the "fp16" method
                             of ddl_triton/compression_methods.py (float16 on the wire, fp32 sums)
    Compression.int8, ...    the registry's other choices (int8, onebit, bf16, auto, and methods
                             registered later), by attribute: the fused reducers run them; a
                             tensor-by-tensor ``allreduce`` refuses them, naming the reducers
    device_dense, process_set, gradient_predivide_factor, ...: ``only_defaults`` refuses any value
                             but Horovod's default, naming the argument and why
"""
from __future__ import annotations

import functools

import tensorflow as tf

from .. import compression_methods

Average, Sum, Min, Max = "avg", "sum", "min", "max"
OPS = (Sum, Average, Min, Max)
_SETS = ("ddl_triton has no process sets: every call runs on the world (process_set=None); a sub-communicator for "
         "the core is ddl_triton.init(mpi_sub_comm)")
_BUILT = "a query of Horovod's build; ddl_triton's bootstrap is ddl_triton.init().bootstrap.kind ('mpi' or 'store')"
_OPS_TF1 = "a TF1 graph op of Horovod's; use {} (a Python int: a constant inside tf.function)"
_PICKLE = ("Horovod pickles the object, and ddl_triton never unpickles what comes from the network: encode it "
           "(e.g. JSON) into an int32 tensor and use {}")
NOT_HERE = {  # Horovod's names (horovod.tensorflow and .keras, 0.28) this room does not implement: __getattr__ says so
    "Adasum": "Horovod's Adasum reduction is not implemented by ddl_triton; use Average (the default) or Sum",
    "Product": "a product reduction is not implemented by ddl_triton; use Sum, Min or Max",
    "global_process_set": _SETS, "ProcessSet": _SETS, "add_process_set": _SETS, "remove_process_set": _SETS,
    "process_set_included_op": _SETS,
    "alltoall": "not implemented in the TensorFlow room; allgather every rank's tensor and keep the blocks meant "
                "for this rank (or use ddl_triton.jax.alltoall / the torch backend's all_to_all)",
    "grouped_allreduce": "not implemented; call allreduce per tensor, or GradientReducer().reduce(tensors) for one "
                         "fused, averaged list",
    "reducescatter": "not implemented in the TensorFlow room; allreduce(t, op=Sum) and keep this rank's block",
    "grouped_reducescatter": "not implemented in the TensorFlow room; allreduce(t, op=Sum) and keep this rank's block",
    "allgather_object": _PICKLE.format("allgather"),
    "broadcast_object": _PICKLE.format("broadcast"),
    "broadcast_object_fn": _PICKLE.format("broadcast"),
    "broadcast_global_variables": "TF1 graph mode only; use broadcast_variables(model.variables, root_rank) or "
                                  "BroadcastGlobalVariablesCallback(root_rank)",
    "BroadcastGlobalVariablesHook": "a TF1 SessionRunHook; use BroadcastGlobalVariablesCallback(root_rank) with "
                                    "model.fit, or broadcast_variables(variables, root_rank)",
    "join": "ddl_triton has no join for uneven inputs; give every rank the same number of steps",
    "is_homogeneous": "not implemented; compare local_size() across ranks with allgather",
    "cross_rank": "not implemented; rank() and local_rank() are", "cross_size": "not implemented; size() and "
                                                                                "local_size() are",
    "rank_op": _OPS_TF1.format("rank()"), "local_rank_op": _OPS_TF1.format("local_rank()"),
    "size_op": _OPS_TF1.format("size()"), "local_size_op": _OPS_TF1.format("local_size()"),
    "mpi_threads_supported": _BUILT, "mpi_enabled": _BUILT, "mpi_built": _BUILT, "gloo_enabled": _BUILT,
    "gloo_built": _BUILT, "nccl_built": _BUILT, "ddl_built": _BUILT, "ccl_built": _BUILT, "cuda_built": _BUILT,
    "rocm_built": _BUILT,
    "start_timeline": "Horovod's timeline is not implemented; ddl_triton traces calls itself (docs/observability.md)",
    "stop_timeline": "Horovod's timeline is not implemented; ddl_triton traces calls itself (docs/observability.md)",
    "PartialDistributedGradientTape": "not implemented; use DistributedGradientTape (every gradient averaged) or "
                                      "GradientReducer().reduce on the gradients to average",
    "SyncBatchNormalization": "not implemented; keras.layers.BatchNormalization keeps per-rank statistics",
    "elastic": "ddl_triton's elastic training is for torch (ddl_triton.torch.elastic); the TensorFlow room has none",
    "LearningRateScheduleCallback": "not implemented; use keras.callbacks.LearningRateScheduler (the same schedule "
                                    "on every rank), or LearningRateWarmupCallback for Horovod's warmup",
    "BestModelCheckpoint": "not implemented; use keras.callbacks.ModelCheckpoint(save_best_only=True) on rank 0, "
                           "after MetricAverageCallback",
    "load_model": "not implemented; keras.models.load_model, then DistributedOptimizer(model.optimizer) and "
                  "model.compile again",
}


class _RegistryCompressions(type):
    """``Compression.<name>`` for the other choices of ddl_triton/compression_methods.py ("int8",
    "onebit", "bf16", "auto", and any method registered later): looked up when asked, so a method
    registered after import is reachable too."""

    def __getattr__(cls, name):
        if not name.startswith("_") and name in compression_methods.choices():
            return _registry_compressor(name)
        raise AttributeError(f"Compression has no {name!r}: Horovod's Compression.none and Compression.fp16, or "
                             f"a choice of ddl_triton's registry: {', '.join(compression_methods.choices())}")

    def __dir__(cls):
        return sorted({*type.__dir__(cls), *compression_methods.choices()})


@functools.lru_cache(maxsize=None)
def _registry_compressor(name: str):
    """The compressor class ``Compression.<name>`` stands for: it names a method the fused reducers
    run (DistributedOptimizer, DistributedGradientTape, GradientReducer), with its error feedback;
    it has no tensor-by-tensor compress/decompress, so ``allreduce`` refuses it."""

    def refuse(*_):
        raise TypeError(f"Compression.{name} runs inside the fused reducers (DistributedOptimizer, "
                        "DistributedGradientTape, GradientReducer), not tensor by tensor; allreduce takes "
                        "Compression.none or Compression.fp16")

    return type(name, (), {"method": name, "compress": staticmethod(refuse), "decompress": staticmethod(refuse),
                           "__doc__": compression_methods.get(name).summary if name in compression_methods.names()
                           else f"the registry's choice {name!r} (ddl_triton/compression_methods.py)"})


class Compression(metaclass=_RegistryCompressions):
    """Horovod's compressors (``Compression.none``, ``Compression.fp16``): ``compress(tensor)`` ->
    ``(tensor, ctx)`` before a collective, ``decompress(tensor, ctx)`` after it. The registry's other
    choices are ``Compression.int8``, ``.onebit``, ``.bf16``, ``.auto``, ... (ddl_triton/compression_methods.py):
    the fused reducers run them, ``allreduce`` refuses them by name."""

    class none:  # noqa: N801 - Horovod's name (and the registry's choice "none")
        @staticmethod
        def compress(tensor):
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

    class fp16:  # noqa: N801 - Horovod's name (and the registry's 16-bit method)
        @staticmethod
        def compress(tensor):
            """Floating tensors as float16 (their dtype kept as the context); others unchanged."""
            if tensor.dtype.is_floating:
                return tf.cast(tensor, tf.float16), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else tf.cast(tensor, ctx)


def reduce_op(op, average, rank: int, what: str) -> str:
    """The op a call means: ``op`` (Horovod's constant or the core's name), else Horovod's deprecated
    ``average`` flag, else Average (Horovod's default); refuses both given, a non-bool ``average`` and
    an unknown op, naming the rank."""
    where = f"rank {rank}: ddl_triton.tensorflow.{what}"
    if average is not None and not isinstance(average, bool):
        raise TypeError(f"{where}: average={average!r} is Horovod's deprecated flag and takes True or False; "
                        f"name the reduction with op= (Average, Sum, Min, Max)")
    if op is not None and average is not None:
        raise ValueError(f"{where}: the op parameter supersedes average; provide only one of them (as Horovod)")
    if op is None:
        return Sum if average is False else Average
    if op not in OPS:
        raise ValueError(f"{where}: op must be one of Average, Sum, Min, Max (or 'avg', 'sum', 'min', 'max'), "
                         f"got {op!r}")
    return op


def compressor(compression, rank: int, what: str):
    """Horovod's ``Compression.none`` or ``.fp16`` (the class itself), else a TypeError naming it."""
    if compression in (Compression.none, Compression.fp16):
        return compression
    if getattr(compression, "method", None) is not None:
        raise TypeError(f"rank {rank}: ddl_triton.tensorflow.{what}: Compression.{compression.method} runs only "
                        "inside the fused reducers (DistributedOptimizer, DistributedGradientTape, GradientReducer); "
                        "here compression must be Compression.none or Compression.fp16 (Horovod's)")
    raise TypeError(f"rank {rank}: ddl_triton.tensorflow.{what}: compression must be Compression.none or "
                    f"Compression.fp16 (Horovod's), got {compression!r}")


def method(compression, rank: int, what: str) -> str:
    """The compression method a reducer runs: Horovod's ``Compression.none``/``.fp16`` as "none"/"fp16",
    or a choice of ddl_triton/compression_methods.py by name ("int8", "auto", ...)."""
    if isinstance(compression, str):
        return compression
    if isinstance(compression, type) and isinstance(getattr(compression, "method", None), str):
        return compression.method  # Compression.int8, .auto, ...: the registry's choice by name
    return compressor(compression, rank, what).__name__  # Horovod's class names are the registry's: none, fp16


def only_defaults(rank: int, what: str, **given) -> None:
    """Refuse a Horovod argument ddl_triton does not honour unless it has Horovod's default:
    ``given`` maps each name to (value, default, why it is not honoured)."""
    for name, (value, default, why) in given.items():
        if value != default:
            raise ValueError(f"rank {rank}: ddl_triton.tensorflow.{what}: {name}={value!r} is not supported "
                             f"({why}); leave it at Horovod's default {default!r}")
