"""``TensorFlowKerasState``: the elastic state of a Keras 3 job, a model's and an optimizer's variables
and counters (Horovod's ``hvd.elastic.TensorFlowKerasState``, its signature and defaults).

Semantics: ``TensorFlowKerasState(model, optimizer=None, **counters)``; ``optimizer`` defaults to
``model.optimizer``, as Horovod's does, and is built here on the model's trainable variables when it
is not yet (so every rank, a joiner included, holds the same variables). Horovod's ``backend``
argument is refused unless at its default (None). The floor's rules hold
(ddl_triton/elastic/state.py): ``commit()`` copies the variables' values aside and admits joiners;
``restore()`` assigns them back; ``sync`` gives every rank the state of the rank with the fewest
commits, bit for bit: each variable's raw bytes in one broadcast, and a JSON manifest of the
variables' paths, dtypes and shapes, which every rank checks against its own, variable by variable
in order (the model's weights, then the optimizer's variables).
"""
from __future__ import annotations

import keras
import numpy as np
import torch

from ...elastic.state import State
from ...errors import DDLError


class TensorFlowKerasState(State):
    """A Keras model's and optimizer's variables, and counters (module doc)."""

    _reserved = ("model", "optimizer")

    def __init__(self, model, optimizer=None, backend=None, **counters):
        if not isinstance(model, keras.Model):
            raise TypeError(f"elastic.TensorFlowKerasState: model must be a keras.Model, got {type(model).__name__}")
        if backend is not None:
            raise ValueError("elastic.TensorFlowKerasState: backend= is Horovod's Keras 2 session backend; "
                             "ddl_triton runs Keras 3 on TensorFlow and takes none (leave it None)")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"elastic.TensorFlowKerasState: optimizer must be a keras.optimizers.Optimizer, got "
                            f"{type(optimizer).__name__}")
        super().__init__(**counters)
        if not model.built:
            raise ValueError("elastic.TensorFlowKerasState: the model is not built: build it (model.build(shape) "
                             "or call it once) so that every rank holds the same variables")
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.model, self.optimizer = model, optimizer

    def _variables(self) -> list:
        return list(self.model.weights) + (list(self.optimizer.variables) if self.optimizer is not None else [])

    # -- what the floor's State asks of a Keras state ---------------------------------------------------
    def _save_extra(self, saved: dict) -> None:
        saved["values"] = [np.array(v.numpy(), copy=True) for v in self._variables()]

    def _restore_extra(self, saved: dict) -> None:
        for v, value in zip(self._variables(), saved["values"]):
            v.assign(value)

    def _listed(self) -> list[list]:
        return [[v.path, np.dtype(v.dtype).name, list(v.shape)] for v in self._variables()]

    def _packed(self) -> tuple[list[torch.Tensor], dict]:
        manifest = self._manifest()
        manifest["variables"] = self._listed()
        tensors = [torch.from_numpy(np.array(np.ascontiguousarray(v.numpy()).reshape(-1).view(np.uint8), copy=True))
                   for v in self._variables()]
        manifest["nbytes"] = sum(t.numel() for t in tensors)
        return tensors, manifest

    def _receiving(self, manifest: dict, rank: int, source: int) -> list[torch.Tensor]:
        mine, theirs = self._listed(), manifest.get("variables")
        theirs = theirs if isinstance(theirs, list) else []
        # By position, dtype and shape: Keras names layers from a per-process counter (dense_2 in a
        # process that built another model first), so the paths name, they do not identify.
        if len(mine) != len(theirs) or any(m[1:] != t[1:] for m, t in zip(mine, theirs)):
            first = next(((m, t) for m, t in zip(mine + [None] * len(theirs), theirs + [None] * len(mine))
                          if m is None or t is None or m[1:] != t[1:]), (None, None))
            raise DDLError(f"rank {rank}: elastic: this rank's model and optimizer differ from rank {source}'s: "
                           f"{_said(first[0])} here, {_said(first[1])} there: every rank must build the same model")
        return [torch.empty(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize, dtype=torch.uint8)
                for _, dtype, shape in mine]

    def _load(self, manifest: dict, tensors: list[torch.Tensor]) -> None:
        for v, t in zip(self._variables(), tensors):
            v.assign(t.numpy().view(np.dtype(v.dtype)).reshape(tuple(v.shape)))
        super()._load(manifest, tensors)


def _said(entry) -> str:
    return "(none)" if entry is None else f"{entry[0]} {entry[1]}{entry[2]}"
