"""``BroadcastGlobalVariablesCallback``: every replica starts ``model.fit`` from root's variables.

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

from . import bridge
from .collectives import broadcast_variables
from .horovod_args import only_defaults


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
