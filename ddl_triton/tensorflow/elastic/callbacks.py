"""Horovod's elastic Keras callbacks, with its names, arguments and semantics
(``horovod.tensorflow.keras.elastic``):

    CommitStateCallback(state, batches_per_commit=1)   ``state.commit()`` after every
                                                       ``batches_per_commit`` batches and at each
                                                       epoch's end (the count restarts at each fit)
    UpdateEpochStateCallback(state)                    at each epoch's end, ``state.epoch`` becomes
                                                       its value when ``fit`` began + Keras' epoch
                                                       index + 1: the number of epochs done across
                                                       resets. As in Horovod, call
                                                       ``fit(..., epochs=total - state.epoch)``
                                                       (Keras then counts from 0; with
                                                       ``initial_epoch=state.epoch`` they would be
                                                       counted twice)
"""
from __future__ import annotations

import keras


class CommitStateCallback(keras.callbacks.Callback):
    """Commit the elastic state every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        if not isinstance(batches_per_commit, int) or isinstance(batches_per_commit, bool) or batches_per_commit < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be an int >= 1, got {batches_per_commit!r}")
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # every rank counts alike after a reset

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` the number of epochs done across resets (module doc)."""

    def __init__(self, state):
        super().__init__()
        if not hasattr(state, "epoch"):
            raise ValueError("UpdateEpochStateCallback: the state has no epoch counter (give epoch=0 to the state)")
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
