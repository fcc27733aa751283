"""Elastic training for JAX on ddl_triton, in Horovod's words: lose a host, keep training; a host that
comes back grows the world again. The same floor as ``ddl_triton.torch.elastic`` (ddl_triton/elastic/).

    import ddl_triton.jax as ddj
    from ddl_triton.jax import elastic

    elastic.init()                               # env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    tx = ddj.distributed(optax.sgd(0.1))         # gradients averaged over the CURRENT world
    state = elastic.JaxState(params=params, opt_state=tx.init(params), step=0)
    state.register_reset_callbacks([reshard])    # reshard for elastic.rank() of elastic.size()

    @jax.jit
    def train_step(params, opt_state, batch): ...   # traced once: it follows every re-form

    @elastic.run                                 # or @elastic.run(min_size=2)
    def train(state):
        while state.step < steps:
            state.params, state.opt_state = train_step(state.params, state.opt_state, batch(state.step))
            state.step += 1
            state.commit()
    train(state)

world.py makes the world (a ddl Communicator over the store's members, no torch.distributed) and
the stand-in through which jitted collectives reach the current one; state.py is ``JaxState``.
This room may import the elastic floor, the runtime and the JAX room. docs/elastic.md has the story.
"""
from __future__ import annotations

from ...elastic.run import make_run
from ...elastic.entry import questions
from ...elastic.world import HostsUpdated
from .state import JaxState
from .world import CURRENT, init

__all__ = ["CURRENT", "HostsUpdated", "JaxState", "generation", "init", "rank", "recoveries", "run", "size"]

run = make_run(JaxState, "ddl_triton.jax.elastic.init()")


rank, size, generation, recoveries = questions("ddl_triton.jax.elastic", "elastic.init()")
