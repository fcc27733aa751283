"""Horovod's Keras callbacks: ``BroadcastGlobalVariablesCallback`` (every replica starts ``model.fit``
from root's variables), ``MetricAverageCallback`` (each epoch's logs averaged over the ranks) and
``LearningRateWarmupCallback`` (Horovod's gradual warmup to a rate scaled by the ranks; their
docstrings say each one's semantics).

    model.fit(x, y, callbacks=[BroadcastGlobalVariablesCallback(0)])      # Horovod's root_rank, required

At the start of training (``on_train_begin``, once per callback: Keras 3 has built the model and
its optimizer by then) it assigns root's value to every variable of the model (trainable or not)
and of its optimizer, fused into one broadcast per dtype bucket (``broadcast_variables``). With a
``DistributedOptimizer`` the replicas then take the same averaged steps and stay bitwise
identical. A model compiled with ``jit_compile=True`` is refused here, naming the rank: XLA cannot
compile the collectives' ops (compile with ``jit_compile=False``; Keras picks False on CPU-only
hosts by itself).
"""
from __future__ import annotations

import keras
import tensorflow as tf

from . import bridge
from .collectives import allreduce, broadcast_variables
from .horovod_args import Average, only_defaults


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and its optimizer's variables from ``root_rank`` when ``fit`` starts
    (module doc). Horovod's signature: ``root_rank`` has no default; ``device`` and
    ``local_variables`` are refused unless at Horovod's defaults ("", None)."""

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        only_defaults(bridge.comm().rank, "BroadcastGlobalVariablesCallback",
                      device=(device, "", "ddl_triton's ops run on the host"),
                      local_variables=(local_variables, None, "every variable of the model is broadcast"))
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        model = self.model
        if getattr(model, "jit_compile", False):
            raise ValueError(f"rank {bridge.comm().rank}: BroadcastGlobalVariablesCallback: the model is compiled "
                             "with jit_compile=True, and XLA cannot compile ddl_triton's collectives; compile it "
                             "with jit_compile=False")
        variables, seen = [], set()
        optimizer = getattr(model, "optimizer", None)
        extra = list(optimizer.variables) if optimizer is not None and getattr(optimizer, "built", False) else []
        for v in [*model.variables, *extra]:
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
        broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Horovod's ``MetricAverageCallback(device='')``: at the end of every epoch, each entry of
    ``logs`` (the loss, the metrics, their ``val_`` twins) is replaced by its average over the ranks,
    so the callbacks after it (checkpointing, early stopping, the progress bar) see the same number
    on every rank. Put it before them in ``callbacks=``, as Horovod asks. The entries are reduced one
    by one in sorted order (Horovod's: every rank issues the same calls whatever its dict's order), each
    as ``allreduce(tf.constant(value))`` (Average, the value's own dtype: a Python float is float32), and
    hold NumPy scalars afterwards, as Horovod's do. ``device`` is refused unless "" (Horovod's default)."""

    def __init__(self, device=""):
        super().__init__()
        only_defaults(bridge.comm().rank, "MetricAverageCallback", device=(device, "", "ddl_triton's ops run on "
                                                                                        "the host"))
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        rank = bridge.comm().rank
        reduced = {}
        for metric, value in sorted(logs.items()):
            t = tf.constant(value)
            if not t.dtype.is_floating:
                raise TypeError(f"rank {rank}: MetricAverageCallback: logs[{metric!r}] = {value!r} is not a float; "
                                "an average of integers would truncate (log it as a float)")
            reduced[metric] = allreduce(t, op=Average).numpy()
        logs.update(reduced)


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Horovod's ``LearningRateWarmupCallback(initial_lr, warmup_epochs=5, momentum_correction=True,
    steps_per_epoch=None, verbose=0)`` (Goyal et al., "Accurate, Large Minibatch SGD"): over the first
    ``warmup_epochs`` epochs the learning rate climbs from ``initial_lr / size()`` to ``initial_lr``
    (the rate already scaled by the number of ranks), set before every batch to

        initial_lr * (e * (size() - 1) / warmup_epochs + 1) / size(),  e = epoch + (batch + 1) / steps_per_epoch

    so it reaches ``initial_lr`` exactly at the last batch of epoch ``warmup_epochs - 1`` and is left
    alone afterwards. ``steps_per_epoch`` None: Keras' ``params["steps"]`` (or samples // batch_size),
    else ValueError. At every epoch's end ``logs["lr"]`` holds the rate; with ``verbose`` > 0 rank 0
    prints when the warmup is done. ``initial_lr`` is required (None is refused, as by Horovod).

    ``momentum_correction`` (Horovod's default True) scales the optimizer's momentum by new_lr/old_lr
    for the one batch after each change. Keras 3 compiles an optimizer's ``momentum`` into the train
    step as a Python constant, so the correction cannot be applied: with a nonzero momentum it is
    refused at ``fit``'s start, naming ``momentum_correction=False`` (optimizers without momentum, or
    with 0, run as Horovod's does, the correction having nothing to scale). A learning-rate schedule in
    place of a rate is refused likewise (the callback sets the rate itself)."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__()
        if initial_lr is None:
            raise ValueError(f"rank {bridge.comm().rank}: LearningRateWarmupCallback: parameter `initial_lr` is "
                             "required")
        self.initial_lr = initial_lr
        self.warmup_epochs = warmup_epochs
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = None

    def multiplier(self, epoch: float) -> float:
        """Horovod's warmup multiplier at fractional ``epoch`` (the batch's start)."""
        size = bridge.comm().size
        epoch += 1.0 / self.steps_per_epoch  # Horovod's shift: round numbers at each epoch's end
        return 1.0 / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def on_train_begin(self, logs=None):
        rank = bridge.comm().rank
        optimizer = self.model.optimizer
        if isinstance(getattr(optimizer, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule):
            raise ValueError(f"rank {rank}: LearningRateWarmupCallback: the optimizer's learning rate is a schedule; "
                             "the callback sets the rate itself: give the optimizer a float learning rate")
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and isinstance(momentum, (int, float)) and momentum != 0:
            raise ValueError(f"rank {rank}: LearningRateWarmupCallback: momentum_correction=True (Horovod's default) "
                             f"cannot scale this optimizer's momentum ({momentum}): Keras 3 compiles it into the "
                             "train step as a constant; pass momentum_correction=False")
        if not self.steps_per_epoch:
            params = self.params or {}
            if params.get("steps"):
                self.steps_per_epoch = params["steps"]
            elif params.get("samples") and params.get("batch_size"):
                self.steps_per_epoch = params["samples"] // params["batch_size"]
            else:
                raise ValueError(f"rank {rank}: LearningRateWarmupCallback: could not autodetect the number of "
                                 "steps per epoch; pass steps_per_epoch=")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch >= self.warmup_epochs:
            return  # outside the warmup: the rate stays where the warmup left it
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(
            self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if logs is not None:
            logs["lr"] = lr
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and bridge.comm().rank == 0:
            print("\nEpoch %d: finished gradual learning rate warmup to %g." % (epoch + 1, lr))
