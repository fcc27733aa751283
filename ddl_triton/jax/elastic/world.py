"""The JAX elastic world: the elastic floor's world (ddl_triton/elastic/world.py) over a ddl
Communicator made from the store's members, and the stand-in through which jitted code reaches it.

How the JAX room bootstraps without torch.distributed: ``init()`` meets the other ranks through the
``env://`` variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0's process serves the
store), as ddl_triton's own env:// bootstrap does; for each generation the floor makes the world
communicator with ``ddl_triton.init(store=<the generation's namespace>, rank=, size=)`` over the
members the store agreed on (elastic/membership.py). No torch process group exists.

How a jitted step reaches the current world after a re-form, without re-tracing: ``init()`` makes
``ddl_triton.jax``'s default communicator (``jax/world.py: resolve(None)``) the floor's ``CURRENT``,
one object for the life of the process that forwards every attribute to the world communicator of
the moment (``ddl_triton.runtime.world.current()``). The room's jitted collectives are cached per
communicator object and close over it (collectives.py), and their ordered io_callbacks call it on
the host at run time: with ``CURRENT`` they find the current generation's communicator at every
execution, and the mean's divisor (``op="avg"``) is the communicator's size at that moment.
jit's cache never sees a change, so nothing is traced again. What is fixed at trace time stays
fixed: a shape that depends on the size (``allgather``'s output inside jit) is the size it was
traced at, so such a function must be traced again after a re-form (``jax.clear_caches()``).

After a failure inside a jitted step, the failed ordered effect's error is raised again by the
next ``jax.effects_barrier()``: the world's tear-down waits it out there (it is the failure being
recovered), so the next generation's barriers start clean.
"""
from __future__ import annotations

from ...elastic import world as floor
from ...elastic.entry import start


CURRENT = floor.CURRENT  # the stand-in for the world of the moment (ddl_triton/elastic/world.py)


class JaxElasticWorld(floor.ElasticWorld):
    """The floor's world; its tear-down also waits out JAX's ordered effects (module doc)."""

    def _tear_down(self) -> None:
        _wait_out_effects()
        super()._tear_down()

    def _follow(self, state) -> None:
        """Before the state's sync (a collective from this thread): the collectives of jitted calls
        already dispatched run first, in program order."""
        import jax
        jax.effects_barrier()
        super()._follow(state)


def _wait_out_effects() -> None:
    """Wait for the ordered effects in flight; a failed one raises here, and that failure is the
    one being recovered (reform's caller saw it): it is dropped, not raised again."""
    import jax
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - the failure that brought us here
        pass


def init(*, grace: float = 1.0) -> None:
    """Start this process's part of an elastic JAX job (Horovod's ``hvd.init()`` for an elastic job).

    The ranks meet through the ``env://`` variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): the
    store at MASTER_ADDR (served by rank 0's process) is the job's coordinator. A process started
    with DDL_ELASTIC_JOIN=1 (and the same MASTER_ADDR and MASTER_PORT) is a joiner: it waits in
    ``elastic.run`` until the members admit it at a commit. ``grace``: how long survivors of a
    failure wait for each other's word before deciding. From here on ``ddl_triton.jax``'s
    collectives run on the current world by default (``CURRENT``)."""
    from .. import world as jax_world
    start(JaxElasticWorld, "ddl_triton.jax.elastic.init", grace, "ddl_triton.jax.init()")
    jax_world.use_elastic_world(CURRENT)
