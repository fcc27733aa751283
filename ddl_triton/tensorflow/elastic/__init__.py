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
from ...elastic.world import HostsUpdated, current as _current
from ...runtime import world as _ddl_world
from ...elastic.membership import Decision as _Decision
from .callbacks import CommitStateCallback, UpdateEpochStateCallback
from .state import TensorFlowKerasState

__all__ = ["CommitStateCallback", "HostsUpdated", "TensorFlowKerasState", "UpdateEpochStateCallback", "generation",
           "init", "rank", "recoveries", "run", "size"]

run = make_run(TensorFlowKerasState, "ddl_triton.tensorflow.elastic.init()")


def init(*, grace: float = 1.0) -> None:
    """Start this process's part of an elastic TensorFlow job (Horovod's ``hvd.init()`` for an elastic
    job): env:// as ``ddl_triton.jax.elastic.init`` (a joiner with DDL_ELASTIC_JOIN=1); call it
    before ``DistributedOptimizer`` and any other call of ``ddl_triton.tensorflow``."""
    what = "ddl_triton.tensorflow.elastic.init"
    if _ddl_world.current() is not None:
        raise ValueError(f"{what}: a ddl_triton world communicator already exists in this process (ddl_triton.init() "
                         "or ddl_tf.init() was called): call elastic.init() instead, first")
    options, store, membership, joiner, _ = _floor.open_membership(
        what, grace, "a launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    world = _floor.ElasticWorld(store, membership, options, joiner)
    if joiner:
        world._build_group(_Decision(-1, [membership.member], 0), prefix=_floor.solo_prefix(membership))
    else:
        world._build_group(membership.current)
    _floor.install(world)


def _world():
    world = _current()
    if world is None:
        raise ValueError("ddl_triton.tensorflow.elastic: call elastic.init() first")
    return world


def rank() -> int:
    """This process's rank in the current world."""
    return _world().decision.rank


def size() -> int:
    """The current world's size."""
    return _world().decision.size


def generation() -> int:
    """The current world's generation: 0 at launch, +1 at each change (-1: a joiner not yet admitted)."""
    return _world().decision.generation


def recoveries() -> list[dict]:
    """One record per world change this process took part in (ddl_triton/elastic/world.py)."""
    return list(_world().records)
