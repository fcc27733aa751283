"""The elastic job's world in a torch process: the elastic floor's world (ddl_triton/elastic/world.py:
the store, the membership, the ddl communicator, how a generation is re-formed and recorded) plus
torch's default process group, DDP and its comm hooks, and torchrun's exit barrier.

``init_process_group(backend="ddl")`` starts it (instead of ``dist.init_process_group``); the floor's
``reform`` replaces the world after a failure or to admit joiners. What torch adds to each phase:

    rebuild   torch's default group over the members (its ddl backend makes the ddl communicator);
              DDP gets a fresh reducer on it and its comm hooks follow the new communicator
    finish    under torchrun, rank 0 checks in at the agents' exit barrier for the lost agents
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ...elastic import world as floor
from ...elastic.world import HostsUpdated, WorldEnded as _WorldEnded  # noqa: F401 - this module's names before
from ...runtime import world as ddl_world
from ...elastic.membership import Decision
from . import torchrun_exit

_JOIN_VARIABLE = floor.JOIN_VARIABLE
_AGENT_KEY = "ddl_triton/elastic/torchrun_agent"


class ElasticWorld(floor.ElasticWorld):
    """This process's part of the elastic job (one per process: ``current()``)."""

    def __init__(self, store, membership, options, backend: str, joiner: bool):
        super().__init__(store, membership, options, joiner)
        self.backend = backend

    def finish(self) -> None:
        """The floor's check that every rank returned, then torchrun's exit barrier."""
        super().finish()
        if self.decision.rank == 0 and self.decision.generation > 0:
            self._release_torchrun_exit_barrier()

    def _release_torchrun_exit_barrier(self) -> None:
        """Under torchrun, check in at its agents' exit barrier for the agents of the hosts this job
        lost (torchrun_exit.py): torchrun's agents wait there, at exit, for every agent of the
        rendezvous (300 s), and the agent of a lost host never comes. An agent is lost when none of
        the ranks it started is in the world any more (each rank posted its agent at start)."""
        if not os.environ.get("TORCHELASTIC_RUN_ID"):
            return
        try:
            def agent(member: int) -> bytes:
                key = f"{_AGENT_KEY}/{member}"
                return self.store.get(key) if self.store.check([key]) else b""
            launched = {agent(m) for m in range(int(os.environ["WORLD_SIZE"]))} - {b""}
            lost = launched - {agent(m) for m in self.decision.members}
        except (KeyError, ValueError, RuntimeError):
            return
        torchrun_exit.check_in_for(len(lost), self.store, self.options.timeout)

    def _tear_down(self) -> None:
        """Release the failed (or outgrown) generation: torch's group, then the ddl communicator."""
        if dist.is_initialized():
            dist.destroy_process_group()
        ddl_world.finalize()

    def _build_group(self, decision: Decision, prefix: str | None = None) -> None:
        _init_group(self.backend, self.store, decision, self.options.timeout, prefix)

    def _follow(self, state) -> None:
        """DDP, its comm hooks and a DiLoCo onto the current world."""
        model = state.model
        if isinstance(model, DistributedDataParallel):
            _fresh_reducer(model)
        from .state import _hook_states
        for hooks in _hook_states(model):
            hooks.follow(self.comm)
        if getattr(state, "diloco", None) is not None:
            state.diloco.follow(self.comm)
        super()._follow(state)


def _fresh_reducer(ddp) -> None:
    """Put ``ddp`` on the new world's default group with a reducer made anew, as unpickling a DDP
    module does (``DistributedDataParallel.__setstate__``), its comm hooks registered again.

    Why not ``ddp._update_process_group``: it keeps each rank's current buckets, and a rank that joined
    (its buckets as DDP first made them) and a rank that trained (its buckets rebuilt in the order
    gradients came) would reduce buffers of different layouts: every rank gets the same sum, and
    the joiner unpacks it into the wrong parameters. A fresh reducer is the same on every rank."""
    ddp.process_group = dist.group.WORLD
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, ddp._build_debug_param_to_name_mapping(parameters),
                         ddp.static_graph)
    ddp._has_rebuilt_buckets = False
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    for hook, hook_state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, hook_state, hook)


def current() -> ElasticWorld | None:
    """This process's elastic world when torch's room made it, else None."""
    world = floor.current()
    return world if isinstance(world, ElasticWorld) else None


def init_process_group(backend: str = "ddl", *, grace: float = 1.0) -> None:
    """Start this process's part of an elastic job: torch's default process group and the ddl world.

    Use it instead of ``dist.init_process_group``. The ranks meet through the ``env://`` variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; torchrun sets them): the store at MASTER_ADDR is
    the job's coordinator. A process started with DDL_ELASTIC_JOIN=1 (and the same MASTER_ADDR and
    MASTER_PORT) is a joiner: it waits in ``elastic.run`` until the members admit it at a commit.
    ``grace``: how long survivors of a failure wait for each other's word before deciding."""
    what = "elastic.init_process_group"
    if floor.current() is not None:
        raise ValueError(f"{what}: already called in this process")
    if backend != "ddl":
        raise ValueError(f"{what}: backend {backend!r}: elastic jobs run on the 'ddl' backend, "
                         "whose waits give up when the job re-forms (a gloo or NCCL group would wait out its timeout)")
    if dist.is_initialized():
        raise ValueError(f"{what}: torch's default process group already exists; call "
                         "elastic.init_process_group instead of dist.init_process_group")
    options, store, membership, joiner, host = floor.open_membership(what, grace, "torchrun")
    if joiner:
        # A world of one until admitted: the application can build its model, optimizer and DDP.
        solo = Decision(-1, [membership.member], 0)
        _init_group(backend, store, solo, options.timeout, prefix=floor.solo_prefix(membership))
    else:
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # which torchrun agent started this rank (see finish)
            store.set(f"{_AGENT_KEY}/{membership.member}", f"{host}/{os.environ.get('GROUP_RANK', '')}")
        _init_group(backend, store, membership.current, options.timeout)
    floor.install(ElasticWorld(store, membership, options, backend, joiner))


def _init_group(backend: str, store, decision: Decision, timeout: float, prefix: str | None = None) -> None:
    ddl_world._store_worlds = 0  # each generation's store namespace is its own: every member counts alike
    dist.init_process_group(backend, store=dist.PrefixStore((prefix or decision.prefix("pg")) + "/", store),
                            rank=decision.rank, world_size=decision.size, timeout=timedelta(seconds=timeout))
