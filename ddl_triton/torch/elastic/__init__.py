"""Elastic training on ddl_triton, in Horovod's words: lose a host, keep training; a host that
comes back grows the world again.

    from ddl_triton.torch import elastic

    elastic.init_process_group("ddl")           # instead of dist.init_process_group (env://, torchrun)
    model = DDP(net)
    state = elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([reshard])   # reshard for elastic.rank() of elastic.size()

    @elastic.run                                 # or @elastic.run(min_size=2)
    def train(state):
        ...                                      # train; state.commit() after each step
    train(state)

The framework-neutral part is the elastic floor's (ddl_triton/elastic/: the retry loop, the state's
counters and byte transfer, the world's re-forming; ddl_triton/elastic/membership.py decides who is
in it). Here: world.py adds torch's default group, DDP and torchrun's exit barrier, state.py the
model's and optimizer's state, run.py the decorator over TorchState. docs/elastic.md tells the
whole story.
"""
from __future__ import annotations

from .run import run
from .state import TorchState
from .world import HostsUpdated, init_process_group
from ...elastic.entry import questions

__all__ = ["HostsUpdated", "TorchState", "generation", "init_process_group", "rank", "recoveries", "run", "size"]


rank, size, generation, recoveries = questions("ddl_triton.torch.elastic", "elastic.init_process_group()")
