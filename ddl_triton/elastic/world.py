"""The elastic job's world in this process, whatever the framework: the store, the membership, the
ddl communicator of the current generation, and how they are re-made when it changes.

A room's world (``ddl_triton.torch.elastic``: torch's default group and DDP too;
``ddl_triton.jax.elastic``: the communicator alone) subclasses ``ElasticWorld`` and says how a
generation is built (``_build_group``), torn down (``_tear_down``) and followed by the state
(``_follow``). ddl_triton/elastic/membership.py decides who is in each generation; state.py says how
the state follows:

    detect    a collective fails here, or the store says another rank's did (revoked)
    restore   the last commit comes back (a failure only)
    agree     generation G+1's members, decided once through the store
    rebuild   the communicator over the members (ranks renumbered, the old one's shared memory
              released), and whatever the room builds on it
    sync      every rank takes the state of the rank with the fewest commits; reset callbacks run

Each change is recorded (``records``) with the time of each phase and printed on stderr.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch

from ..errors import CollectiveTimeout, CommunicatorPoisoned, CoordinatorLost, DDLError, ExcludedFromWorld, \
    PeersLost, this_host
from ..options import Options
from ..runtime import world as ddl_world
from .membership import Decision, Membership
from ..runtime.setup.bootstrap import BootstrapError, launched_by_mpi, store_from_env
from ..transports import failure_notice

JOIN_VARIABLE = "DDL_ELASTIC_JOIN"  # known to Options' check of DDL_* names (options.OTHER_VARIABLES)
_JOIN_POLL_S = 0.25  # rank 0 asks the store for joiners at most this often (admit_joiners)
_ENDING = (PeersLost, ExcludedFromWorld, CoordinatorLost)


class WorldEnded(DDLError):
    """The world failed as training ended on this rank (``finish``)."""


class HostsUpdated(Exception):
    """Raised by ``state.commit()`` on every rank at once when joiners wait: ``elastic.run`` grows the world."""


class ElasticWorld:
    """This process's part of the elastic job (one per process: ``current()``)."""

    def __init__(self, store, membership: Membership, options: Options, joiner: bool):
        self.store, self.membership, self.options = store, membership, options
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
            raise WorldEnded(f"rank {self.decision.rank}: elastic: the world failed as training ended here: "
                             f"{revoked[1]}")
        self.comm.barrier()

    def failed(self, error: BaseException) -> bool:
        """Whether ``error`` means that the world failed (so ``reform`` can go on), not the application."""
        if isinstance(error, _ENDING) or not isinstance(error, Exception):
            return False
        if failure_notice.revoked() is not None or isinstance(error, (CollectiveTimeout, CommunicatorPoisoned,
                                                                       BootstrapError, WorldEnded)):
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

    def start(self, state) -> None:
        """The first call of ``elastic.run``: every rank takes rank 0's state (as Horovod's first sync)."""
        self._follow(state)
        state.save()
        state.sync(self.comm, self.decision.prefix("state"), self.store)

    def _enter(self, decision: Decision, state, old: Decision | None, reason: str, t_failed: float,
               t_agreed: float) -> None:
        """Build the agreed world, make every rank hold the same state, run the reset callbacks, and
        record the change with the time of each phase."""
        failure_notice.clear_revocation()
        from ..runtime.calls.issue import forget_lost_peers
        forget_lost_peers()  # the job goes on: a lost peer of the old world is no reason to exit 1
        self._build_group(decision)
        t_rebuilt = time.time()
        self._follow(state)
        joined = frozenset(decision.members.index(m) for m in decision.joined)  # never a source of the state
        state.sync(self.comm, decision.prefix("state"), self.store, joined)
        state.reset()
        self._record(old, decision, reason, t_failed, t_agreed, t_rebuilt, time.time())

    # -- what a room says ----------------------------------------------------------------------------
    def _build_group(self, decision: Decision, prefix: str | None = None) -> None:
        """Make the ddl world communicator over ``decision``'s members (in a store namespace of the
        generation's own, or ``prefix``). The JAX room's way; torch's makes its default group, whose
        ddl backend makes the communicator."""
        import torch.distributed as dist  # the store's namespaces (torch's PrefixStore), not torch's groups
        ddl_world._store_worlds = 0  # each generation's store namespace is its own: every member counts alike
        store = dist.PrefixStore((prefix or decision.prefix("ddl")) + "/", self.store)
        ddl_world.init(store=store, rank=decision.rank, size=decision.size, options=self.options)

    def _tear_down(self) -> None:
        """Release the failed (or outgrown) generation's communicator (its shared memory unlinked;
        waits on lost peers give up at once, the world being revoked)."""
        ddl_world.finalize()

    def _follow(self, state) -> None:
        """What runs on the world follows it (TorchState: DDP and its hooks)."""
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


class _CurrentWorld:
    """Stands for the world communicator of the moment: every attribute is the current
    communicator's (``ddl_triton.runtime.world.current()``), looked up at each use. One object for
    the life of the process: code that keeps a communicator (a compiled step's host callback, a
    cache keyed by communicator) keeps this one, and reaches each generation's in turn."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        comm = ddl_world.current()
        if comm is None:
            raise ValueError("elastic: no world is formed right now (between generations, or before the elastic "
                             "room's init)")
        return getattr(comm, name)

    def __repr__(self) -> str:
        return f"<the current elastic world: {ddl_world.current()!r}>"


CURRENT = _CurrentWorld()

_WORLD: ElasticWorld | None = None


def current() -> ElasticWorld | None:
    """This process's elastic world, or None before a room's init."""
    return _WORLD


def open_membership(what: str, grace: float, launchers: str):
    """The part of every room's init that is the same: refuse MPI launches and fixed topologies,
    meet through the store (env://) as a launched rank or as a joiner (DDL_ELASTIC_JOIN=1), and
    watch the store. Returns ``(options, store, membership, joiner, host)``; the room then builds
    generation 0 (``membership.current``) or the joiner's world of one, and calls ``install``."""
    if _WORLD is not None:
        raise ValueError(f"{what}: already called in this process")
    if launched_by_mpi():
        raise ValueError(f"{what}: this process was launched by MPI (mpiexec/ddlrun/srun), and an MPI job cannot "
                         f"lose a rank and go on (MPI_COMM_WORLD is fixed): launch elastic jobs with {launchers}, or "
                         "set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (env://)")
    if not grace > 0:
        raise ValueError(f"{what}: grace must be > 0 seconds, got {grace!r}")
    options = Options.from_env()
    if options.topology:
        raise ValueError(f"{what}: DDL_TOPOLOGY={options.topology!r} emulates a grid of a fixed size, and an "
                         "elastic world changes size: unset it (elastic jobs find their hosts)")
    failure_notice.set_revocable(True)
    host = this_host()  # for errors and the records: the lost ranks' hosts are named by it
    joiner = os.environ.get(JOIN_VARIABLE, "") not in ("", "0")
    if joiner:
        store = _joiner_store(options.timeout)
        membership = Membership.as_joiner(store, host, options.timeout, grace, options.job_secret)
    else:
        store, rank, size = store_from_env(options.timeout)
        membership = Membership(store, rank, host, options.timeout, grace, options.job_secret)
        membership.start(rank, size)
    return options, store, membership, joiner, host


def solo_prefix(membership: Membership) -> str:
    """The store namespace of a joiner's world of one, before it is admitted."""
    return f"ddl_triton/elastic/solo/{membership.member}"


def install(world: ElasticWorld) -> None:
    """Make ``world`` this process's elastic world and start watching the store for revocations."""
    global _WORLD
    world.membership.watch()
    _WORLD = world


def _joiner_store(timeout: float):
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise ValueError(f"elastic: {JOIN_VARIABLE}=1, but {', '.join(missing)} not set: a joiner needs the "
                         "running job's store address")
    import torch.distributed as dist  # torch's TCPStore client, as runtime/setup/bootstrap.py uses it
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as e:
        raise DDLError(f"elastic joiner on {this_host()}: could not reach the job's store at {address} "
                       f"({str(e).splitlines()[0]})") from None
