"""Elastic training for TensorFlow/Keras 3 on ddl_triton, in Horovod's words
(``horovod.tensorflow.keras.elastic``), over the elastic floor (ddl_triton/elastic/):

    import ddl_triton.tensorflow as ddl_tf
    from ddl_triton.tensorflow import elastic

    elastic.init()                               # env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    model.compile(optimizer=ddl_tf.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=...)
    state = elastic.TensorFlowKerasState(model, epoch=0)
    callbacks = [elastic.CommitStateCallback(state), elastic.UpdateEpochStateCallback(state)]

    @elastic.run
    def train(state):
        model.fit(x, y, epochs=epochs - state.epoch, callbacks=callbacks)   # Horovod's way
    train(state)

state.py is ``TensorFlowKerasState``, callbacks.py Horovod's two elastic callbacks. The world is the
floor's (a ddl Communicator over the store's members, as the JAX room's); after ``init()`` every
collective of ``ddl_triton.tensorflow`` runs on the floor's ``CURRENT`` (bridge.py), so a traced
``fit`` step follows each re-form. docs/elastic.md has the story.
"""
from __future__ import annotations

from ...elastic import world as _floor
from ...elastic.run import make_run
from ...elastic.entry import questions, start
from ...elastic.world import HostsUpdated
from .callbacks import CommitStateCallback, UpdateEpochStateCallback
from .state import TensorFlowKerasState

__all__ = ["CommitStateCallback", "HostsUpdated", "TensorFlowKerasState", "UpdateEpochStateCallback", "generation",
           "init", "rank", "recoveries", "run", "size"]

run = make_run(TensorFlowKerasState, "ddl_triton.tensorflow.elastic.init()")


def init(*, grace: float = 1.0) -> None:
    """Start this process's part of an elastic TensorFlow job (Horovod's ``hvd.init()`` for an elastic
    job): env:// as ``ddl_triton.jax.elastic.init`` (a joiner with DDL_ELASTIC_JOIN=1); call it
    before ``DistributedOptimizer`` and any other call of ``ddl_triton.tensorflow``."""
    start(_floor.ElasticWorld, "ddl_triton.tensorflow.elastic.init", grace, "ddl_tf.init()")


rank, size, generation, recoveries = questions("ddl_triton.tensorflow.elastic", "elastic.init()")
