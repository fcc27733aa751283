"""What every framework's elastic room offers in the same words: its ``init`` (``start``) and the
four questions about the world of the moment (``questions``: ``rank``, ``size``, ``generation``,
``recoveries``), as Horovod's ``hvd.elastic`` rooms answer them.

    rank, size, generation, recoveries = questions("ddl_triton.jax.elastic", "elastic.init()")

Each answer reads the current world at the call (a re-form changes them); before the room's init
they raise ValueError naming the call to make first.
"""
from __future__ import annotations

from ..runtime import world as ddl_world
from . import world as floor
from .membership import Decision


def start(world_type, what: str, grace: float, plain_init: str):
    """The body of a room's ``init``: refuse a process that already made a ddl_triton world (``plain_init``
    names the call that made it, e.g. "ddl_triton.jax.init()"), meet through the store
    (``floor.open_membership``), build generation 0, or a joiner's world of one until it is admitted
    (so that the application can build its model and trace its step), install it and return it.
    ``world_type``: ``floor.ElasticWorld`` or a room's subclass of it."""
    if ddl_world.current() is not None:
        raise ValueError(f"{what}: a ddl_triton world communicator already exists in this process (ddl_triton.init() "
                         f"or {plain_init} was called): call elastic.init() instead, first")
    options, store, membership, joiner, _ = floor.open_membership(
        what, grace, "a launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    world = world_type(store, membership, options, joiner)
    if joiner:
        world._build_group(Decision(-1, [membership.member], 0), prefix=floor.solo_prefix(membership))
    else:
        world._build_group(membership.current)
    floor.install(world)
    return world


def questions(room: str, first: str):
    """``(rank, size, generation, recoveries)`` for ``room`` ("ddl_triton.jax.elastic"), whose init is
    called as ``first`` ("elastic.init()")."""
    def _world():
        world = floor.current()
        if world is None:
            raise ValueError(f"{room}: call {first} first")
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

    return rank, size, generation, recoveries
