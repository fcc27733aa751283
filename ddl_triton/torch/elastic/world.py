"""The elastic job's world in this process: the store, the membership, torch's default process group
and the ddl communicator of the current generation, and how they are re-made when it changes.

``init_process_group(backend="ddl")`` starts it (instead of ``dist.init_process_group``); ``reform``
replaces the world after a failure or to admit joiners (see ddl_triton/runtime/membership.py for how
the members agree, ddl_triton/torch/elastic/state.py for how the state follows):

    detect    a collective fails here, or the store says another rank's did (revoked)
    restore   the last commit comes back (a failure only)
    agree     generation G+1's members, decided once through the store
    rebuild   torch's default group and the ddl communicator over the members (ranks renumbered,
              the old group's shared memory released); DDP and its comm hooks follow
    sync      every rank takes the state of the rank with the fewest commits; reset callbacks run

Each change is recorded (``recoveries()``) with the time of each phase and printed on stderr.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ...errors import CollectiveTimeout, CommunicatorPoisoned, CoordinatorLost, DDLError, ExcludedFromWorld, \
    PeersLost, this_host
from ...options import Options
from ...runtime import world as ddl_world
from ...runtime.membership import Decision, Membership
from ...runtime.setup.bootstrap import BootstrapError, launched_by_mpi, store_from_env
from ...transports import failure_notice
from . import torchrun_exit

_JOIN_VARIABLE = "DDL_ELASTIC_JOIN"  # known to Options' check of DDL_* names (options.OTHER_VARIABLES)
_AGENT_KEY = "ddl_triton/elastic/torchrun_agent"
_JOIN_POLL_S = 0.25  # rank 0 asks the store for joiners at most this often (admit_joiners)
_ENDING = (PeersLost, ExcludedFromWorld, CoordinatorLost)


class _WorldEnded(DDLError):
    """The world failed as training ended on this rank (``finish``)."""


class HostsUpdated(Exception):
    """Raised by ``state.commit()`` on every rank at once when joiners wait: ``elastic.run`` grows the world."""


class ElasticWorld:
    """This process's part of the elastic job (one per process: ``current()``)."""

    def __init__(self, store, membership: Membership, options: Options, backend: str, joiner: bool):
        self.store, self.membership, self.options, self.backend = store, membership, options, backend
        self.joiner_waiting = joiner
        self.records: list[dict] = []
        self._flag = None
        self._next_join_poll = 0.0

    # -- the current world -------------------------------------------------------------------------
    @property
    def decision(self) -> Decision:
        return self.membership.current

    @property
    def comm(self):
        return ddl_world.current()

    def admit_joiners(self) -> None:
        """At a commit: rank 0 looks for joiners and every rank learns its answer (one small
        allreduce, the latency path); when some wait, every rank raises ``HostsUpdated`` together.
        Rank 0 asks the store at most every ``_JOIN_POLL_S``: a store round trip at every commit
        cost more than the allreduce (a joiner waits that much longer, next to its seconds of start-up)."""
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int64)
        waiting = 0
        if self.comm.rank == 0 and time.monotonic() >= self._next_join_poll:
            self._next_join_poll = time.monotonic() + _JOIN_POLL_S
            waiting = len(self.membership.pending_joiners())
        self._flag[0] = waiting
        self.comm.allreduce(self._flag, op="max")
        if int(self._flag[0]):
            raise HostsUpdated(f"{int(self._flag[0])} joiner(s) waiting")

    def finish(self) -> None:
        """The training function returned here: check with every rank that it returned there too
        (one small collective; it fails, and the world re-forms, if a rank was lost meanwhile)."""
        revoked = failure_notice.revoked()
        if revoked is not None:
            raise _WorldEnded(f"rank {self.decision.rank}: elastic: the world failed as training ended here: "
                              f"{revoked[1]}")
        self.comm.barrier()
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

    def failed(self, error: BaseException) -> bool:
        """Whether ``error`` means that the world failed (so ``reform`` can go on), not the application."""
        if isinstance(error, _ENDING) or not isinstance(error, Exception):
            return False
        if failure_notice.revoked() is not None or isinstance(error, (CollectiveTimeout, CommunicatorPoisoned,
                                                                       BootstrapError, _WorldEnded)):
            return True
        comm = self.comm
        return comm is not None and comm.failure is not None

    # -- changing it ---------------------------------------------------------------------------------
    def reform(self, state, reason: str, error: BaseException | None, min_size: int) -> None:
        """Replace the world (see the module doc); ``reason``: "lost" (``error`` says what failed) or "grow"."""
        t_failed = time.time()
        old = self.decision
        if reason == "lost":
            self.membership.revoke(str(error).splitlines()[0][:300] if error is not None else "a failure")
            # Ranks this process saw end (a pid gone, sockets closed): the others need not wait for them.
            comm = self.comm
            gone = comm.peers_gone() if comm is not None else sorted(failure_notice.gone())
            self.membership.mark_gone([old.members[r] for r in gone if r < old.size])
            state.restore()
        self._tear_down()
        decision = self.membership.agree(reason, min_size)
        self._enter(decision, state, old, reason, t_failed, time.time())

    def admit(self, state) -> None:
        """A joiner: wait until the members admit this process, then build the world and take the state."""
        t_asked = time.time()
        decision = self.membership.wait_admitted(self.options.timeout)
        t_admitted = time.time()
        self._tear_down()  # the world of one it waited in
        self._enter(decision, state, None, "joined", t_asked, t_admitted)
        self.joiner_waiting = False

    def _enter(self, decision: Decision, state, old: Decision | None, reason: str, t_failed: float,
               t_agreed: float) -> None:
        """Build the agreed world, put DDP and the hooks on it, make every rank hold the same state,
        run the reset callbacks, and record the change with the time of each phase."""
        self._build(decision)
        t_rebuilt = time.time()
        self._follow(state)
        joined = frozenset(decision.members.index(m) for m in decision.joined)  # never a source of the state
        state.sync(self.comm, decision.prefix("state"), self.store, joined)
        state.reset()
        self._record(old, decision, reason, t_failed, t_agreed, t_rebuilt, time.time())

    def start(self, state) -> None:
        """The first call of ``elastic.run``: every rank takes rank 0's state (as Horovod's first sync)."""
        self._follow(state)
        state.save()
        state.sync(self.comm, self.decision.prefix("state"), self.store)

    def _tear_down(self) -> None:
        """Release the failed (or outgrown) generation: torch's group, then the ddl communicator
        (its shared memory unlinked; waits on lost peers give up at once, the world being revoked)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        ddl_world.finalize()

    def _build(self, decision: Decision) -> None:
        failure_notice.clear_revocation()
        from ...runtime.calls.issue import forget_lost_peers
        forget_lost_peers()  # the job goes on: a lost peer of the old world is no reason to exit 1
        _init_group(self.backend, self.store, decision, self.options.timeout)

    def _follow(self, state) -> None:
        """DDP and its comm hooks onto the current world."""
        model = state.model
        if isinstance(model, DistributedDataParallel):
            _fresh_reducer(model)
        from .state import _hook_states
        for hooks in _hook_states(model):
            hooks.follow(self.comm)
        state._world = self

    def _record(self, old: Decision | None, new: Decision, reason: str, t_failed: float, t_agreed: float,
                t_rebuilt: float, t_resumed: float) -> None:
        record = {"generation": new.generation, "reason": reason, "lost": new.lost, "lost_hosts": new.lost_hosts,
                  "joined": len(new.joined), "size_before": old.size if old else 0, "size_after": new.size,
                  "rank": new.rank, "t_failed": t_failed, "t_agreed": t_agreed, "t_rebuilt": t_rebuilt,
                  "t_resumed": t_resumed}
        self.records.append(record)
        lost = ", ".join(f"rank {r} on {h}" for r, h in zip(new.lost, new.lost_hosts)) or "none"
        print(f"ddl_triton elastic: rank {new.rank}: generation {new.generation} ({reason}): world "
              f"{record['size_before']} -> {new.size}; lost {lost}; joined {len(new.joined)}; agreement "
              f"{t_agreed - t_failed:.2f} s, rebuild {t_rebuilt - t_agreed:.2f} s, sync "
              f"{t_resumed - t_rebuilt:.2f} s", file=sys.stderr, flush=True)


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


_WORLD: ElasticWorld | None = None


def current() -> ElasticWorld | None:
    return _WORLD


def init_process_group(backend: str = "ddl", *, grace: float = 1.0) -> None:
    """Start this process's part of an elastic job: torch's default process group and the ddl world.

    Use it instead of ``dist.init_process_group``. The ranks meet through the ``env://`` variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; torchrun sets them): the store at MASTER_ADDR is
    the job's coordinator. A process started with DDL_ELASTIC_JOIN=1 (and the same MASTER_ADDR and
    MASTER_PORT) is a joiner: it waits in ``elastic.run`` until the members admit it at a commit.
    ``grace``: how long survivors of a failure wait for each other's word before deciding."""
    global _WORLD
    if _WORLD is not None:
        raise ValueError("elastic.init_process_group: already called in this process")
    if launched_by_mpi():
        raise ValueError("elastic.init_process_group: this process was launched by MPI (mpiexec/ddlrun/srun), "
                         "and an MPI job cannot lose a rank and go on (MPI_COMM_WORLD is fixed): launch elastic "
                         "jobs with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (env://)")
    if backend != "ddl":
        raise ValueError(f"elastic.init_process_group: backend {backend!r}: elastic jobs run on the 'ddl' backend, "
                         "whose waits give up when the job re-forms (a gloo or NCCL group would wait out its timeout)")
    if dist.is_initialized():
        raise ValueError("elastic.init_process_group: torch's default process group already exists; call "
                         "elastic.init_process_group instead of dist.init_process_group")
    if not grace > 0:
        raise ValueError(f"elastic.init_process_group: grace must be > 0 seconds, got {grace!r}")
    options = Options.from_env()
    if options.topology:
        raise ValueError(f"elastic.init_process_group: DDL_TOPOLOGY={options.topology!r} emulates a grid of a "
                         "fixed size, and an elastic world changes size: unset it (elastic jobs find their hosts)")
    failure_notice.set_revocable(True)
    host = this_host()  # for errors and the records: the lost ranks' hosts are named by it
    joiner = os.environ.get(_JOIN_VARIABLE, "") not in ("", "0")
    if joiner:
        store = _joiner_store(options.timeout)
        membership = Membership.as_joiner(store, host, options.timeout, grace, options.job_secret)
        # A world of one until admitted: the application can build its model, optimizer and DDP.
        solo = Decision(-1, [membership.member], 0)
        _init_group(backend, store, solo, options.timeout, prefix=f"ddl_triton/elastic/solo/{membership.member}")
    else:
        store, rank, size = store_from_env(options.timeout)
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # which torchrun agent started this rank (see finish)
            store.set(f"{_AGENT_KEY}/{rank}", f"{host}/{os.environ.get('GROUP_RANK', '')}")
        membership = Membership(store, rank, host, options.timeout, grace, options.job_secret)
        decision = membership.start(rank, size)
        _init_group(backend, store, decision, options.timeout)
    membership.watch()
    _WORLD = ElasticWorld(store, membership, options, backend, joiner)


def _init_group(backend: str, store, decision: Decision, timeout: float, prefix: str | None = None) -> None:
    ddl_world._store_worlds = 0  # each generation's store namespace is its own: every member counts alike
    dist.init_process_group(backend, store=dist.PrefixStore((prefix or decision.prefix("pg")) + "/", store),
                            rank=decision.rank, world_size=decision.size, timeout=timedelta(seconds=timeout))


def _joiner_store(timeout: float):
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise ValueError(f"elastic: {_JOIN_VARIABLE}=1, but {', '.join(missing)} not set: a joiner needs the "
                         "running job's store address")
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as e:
        raise DDLError(f"elastic joiner on {this_host()}: could not reach the job's store at {address} "
                       f"({str(e).splitlines()[0]})") from None
