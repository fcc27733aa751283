"""Bootstrap: how the ranks of a communicator first find each other, under any launcher.

Semantics. A bootstrap is what the transports need before any data moves, and nothing
more:

    rank, size             who this process is among the communicator's ranks
    world_rank, world_size who it is in the job (the flight recorder's and tracer's names)
    allgather(obj)         every rank's small JSON-able value, in rank order (init-time
                           control data: host names, tuning-table digests; never tensors)
    bcast(obj, root)       the root's value on every rank
    barrier()              return once every rank has entered
    host_of_rank()         for each rank, the lowest rank on its host (who can share memory)
    split(color)           the bootstrap of the ranks that passed the same ``color`` (collective
                           over every rank; ranks keep their order)
    close()

Two implementations:

- ``MpiBootstrap``: an MPI communicator (launched by ``mpiexec``/``ddlrun``/``srun --mpi=pmi2``), as
  ddl_triton always did. Hosts come from ``Split_type(COMM_TYPE_SHARED)``; the inter-node
  transport is MPI (transports/mpi.py).
- ``StoreBootstrap``: a ``torch.distributed.Store`` (TCPStore, FileStore, HashStore, or any
  store torch hands to a backend), with the rank and size the launcher gave. This is how
  ddl_triton runs under ``torchrun``, ``torch.multiprocessing.spawn``, plain ``srun``, Open MPI's
  ``mpirun``, Kubeflow, ``env://`` and torch's test harnesses, whose processes MPI sees as
  singletons of size 1. Hosts come
  from the host name and boot id every rank posts; the inter-node transport is torch's gloo
  (transports/gloo.py), on a process group over the same store.

Every wait of a ``StoreBootstrap`` is bounded by ``timeout`` (Options.timeout) and polled,
so a bad start fails clearly instead of hanging: a rank whose ``size`` disagrees with
another's, two processes claiming one rank, or a rank out of range raise ``ValueError`` as
soon as the disagreeing ranks have arrived; a rank that never arrives raises
``BootstrapTimeout`` naming it.

Values cross a bootstrap as JSON, checked on arrival and never unpickled (bootstrap_values.py):
a tuple comes back as a list, and bytes that are not JSON raise ``BootstrapError`` naming the
key (or the MPI step) and this rank. Every step of either bootstrap is bounded by ``timeout``
(MPI's through nonblocking collectives), so a rank that fails init cannot hang the others.

``ddl_triton.init`` picks the bootstrap (see its docstring): an MPI launch means MPI;
otherwise an explicit store, torch's default process group's store, or the store the launcher's
own variables describe (ddl_triton/launch/launchers.py; ``store_of_launcher``, over ``store_from_env``).
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from datetime import timedelta
from types import SimpleNamespace

import numpy as np

from ...errors import DDLError
from ...transports.job_network import serve_store
from .bootstrap_values import (BootstrapError, BootstrapTimeout, checked, decode, encode, mpi_allgather,
                               mpi_barrier, mpi_bcast, mpi_wait, shaped)
from ...launch.launchers import detect, mpi_launched
from .roll_call import RollCall

__all__ = ["BootstrapError", "BootstrapTimeout", "MpiBootstrap", "StoreBootstrap", "as_bootstrap", "host_id",
           "launched_by_mpi", "launcher_world", "store_from_env", "store_of_launcher"]

_POLL_FIRST = 1e-3   # seconds between the first store polls; doubled up to _POLL_MAX (waits yield the CPU)
_POLL_MAX = 0.05
# How long a rank that found a world-size mismatch waits for the other ranks it heard from to
# find it too, before it raises: the rank serving the store (rank 0 under env://) exits when
# it raises, and a rank that has not read the hello keys yet would then only learn that the
# store went away, not why.
_MISMATCH_LINGER = 5.0
_HELLO = "hello (every rank's first contact)"
_DEFAULT_TIMEOUT = 300.0  # Options.timeout's default, for bootstraps made without options


def launched_by_mpi() -> bool:
    """True when this process's world is MPI's: an MPI launcher whose protocol the MPI library speaks
    (mpiexec, ddlrun, srun --mpi=pmi2) started it, or DDL_LAUNCHER=mpi (ddl_triton/launch/launchers.py)."""
    return mpi_launched()


def as_bootstrap(comm_or_bootstrap, timeout: float = _DEFAULT_TIMEOUT):
    """A bootstrap as it is, or an mpi4py communicator wrapped (not duplicated) as one."""
    if isinstance(comm_or_bootstrap, (MpiBootstrap, StoreBootstrap)):
        return comm_or_bootstrap
    return MpiBootstrap(comm_or_bootstrap, dup=False, timeout=timeout)


# -- MPI ---------------------------------------------------------------------------------------------
class MpiBootstrap:
    """The bootstrap over an MPI communicator; ``comm`` is a private duplicate (``dup``), which
    the MPI transport then uses too, so ddl_triton's messages never meet the application's.

    Every step waits at most ``timeout`` seconds (Options.timeout), then raises
    BootstrapTimeout: the collectives are MPI's nonblocking ones, and the two that have no
    nonblocking form (``Split_type``, ``Split``) start only once a nonblocking barrier shows
    that every rank has reached them. Past the deadline, a roll call (roll_call.py, over a
    second duplicate of its own) finds the ranks that did not arrive, for the error to name."""

    kind = "mpi"
    launcher = ""  # how the world was found (launchers.py), for explain; set by ddl_triton.init

    def __init__(self, mpi_comm, *, dup: bool = True, timeout: float = _DEFAULT_TIMEOUT,
                 roll: RollCall | None = None):
        from mpi4py import MPI

        self.timeout = float(timeout)
        self.world_rank: int = MPI.COMM_WORLD.Get_rank()
        self.world_size: int = MPI.COMM_WORLD.Get_size()
        self._roll, self._roll_comm, self._steps = roll, None, 0
        if dup:
            self.comm, request = mpi_comm.Idup()
            self._roll_comm, roll_request = mpi_comm.Idup()
            both = SimpleNamespace(Test=lambda: MPI.Request.Testall([request, roll_request]))
            mpi_wait(both, self.timeout, "duplicating the communicator", mpi_comm.Get_rank(), mpi_comm.Get_size())
            self._roll = RollCall(self._roll_comm, list(range(mpi_comm.Get_size())))
        else:
            self.comm = mpi_comm
        self._owned = dup
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()

    def allgather(self, obj) -> list:
        # Control path: small values, at init.
        return mpi_allgather(self.comm, obj, self.timeout, "allgather", self._step("allgather"))

    def bcast(self, obj, root: int = 0):
        return mpi_bcast(self.comm, obj, root, self.timeout, "bcast", self._step("bcast"))

    def barrier(self) -> None:
        mpi_barrier(self.comm, self.timeout, "barrier", self._step("barrier"))

    def _step(self, what: str):
        """The roll call and this step's name, the same on every rank (steps are collective)."""
        self._steps += 1
        return None if self._roll is None else (self._roll, f"{self._steps}-{what}")

    def host_of_rank(self) -> list[int]:
        from mpi4py import MPI

        if self.size == 1:
            return [0]
        mpi_barrier(self.comm, self.timeout, "finding each rank's host", self._step("hosts"))
        host = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            lowest = np.zeros(1, dtype=np.int64)
            mpi_wait(host.Iallreduce(np.array([self.rank], dtype=np.int64), lowest, op=MPI.MIN), self.timeout,
                     "finding each rank's host", host.Get_rank(), host.Get_size())
            first = self.allgather(int(lowest[0]))
            return [checked(f, int, f"rank {r}'s host in finding each rank's host", self.rank)
                    for r, f in enumerate(first)]
        finally:
            host.Free()

    def split(self, color: int) -> "MpiBootstrap":
        # Every rank's color first: it shows that every rank reached the split (Split itself has
        # no deadline), and names the sub-bootstrap's members for its roll call.
        colors = [checked(c, int, f"rank {r}'s color in split", self.rank)
                  for r, c in enumerate(self.allgather(int(color)))]
        members = [r for r, c in enumerate(colors) if c == color]
        roll = self._roll.for_members(members) if self._roll is not None else None
        sub = MpiBootstrap(self.comm.Split(color, self.rank), dup=False, timeout=self.timeout, roll=roll)
        sub._owned = True
        return sub

    def close(self) -> None:
        from mpi4py import MPI

        if self._owned and not MPI.Is_finalized():
            self.comm.Free()
            if self._roll_comm is not None:
                self._roll_comm.Free()
        self._owned = False

    def __repr__(self) -> str:
        return f"MpiBootstrap(rank={self.rank}, size={self.size})"


# -- torch.distributed.Store -------------------------------------------------------------------------
class StoreBootstrap:
    """The bootstrap over a ``torch.distributed.Store``: every step is a set of keys under a
    namespace of its own (``prefix``/step number), read back once every rank has written.

    Creating it is the first step, "hello": every rank posts its size, host and pid; the
    constructor checks them (see the module doc) and keeps the hosts for ``host_of_rank``.
    ``split`` and ``store_for`` hand out fresh namespaces, so a communicator's node groups,
    its gloo group and later communicators never share a key. ``host`` replaces this
    process's host identity (ranks with equal ``host`` share memory): a sub-group of a world
    with emulated nodes (DDL_TOPOLOGY) names its emulated node there."""

    kind = "store"
    launcher = ""  # how the world was found (launchers.py), for explain; set by ddl_triton.init

    def __init__(self, store, rank: int, size: int, *, timeout: float, prefix: str = "ddl_triton",
                 world_rank: int | None = None, world_size: int | None = None, host: str | None = None):
        for name, value in (("rank", rank), ("size", size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"ddl_triton bootstrap: {name} must be an int, got {value!r}")
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank}: ddl_triton bootstrap: rank {rank} is not a rank of a world of "
                             f"size {size} (check RANK and WORLD_SIZE)")
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = float(timeout)
        self.prefix = prefix
        self.world_rank = rank if world_rank is None else world_rank
        self.world_size = size if world_size is None else world_size
        self._step = 0
        self._hosts = self._hello(host_id() if host is None else host)

    # -- the steps ------------------------------------------------------------------------------
    def allgather(self, obj) -> list:
        values, keys = self._exchange(encode(obj), "allgather")
        return [decode(v, f"store key {k!r}", self.rank) for v, k in zip(values, keys)]

    def bcast(self, obj, root: int = 0):
        key = self._namespace("bcast")
        with self._store_calls("bcast"):
            if self.rank == root:
                self.store.set(key, encode(obj))
            self._wait([key], [root], "bcast")
            return decode(self.store.get(key), f"store key {key!r}", self.rank)

    def barrier(self) -> None:
        self._exchange(b"", "barrier")

    def host_of_rank(self) -> list[int]:
        first: dict[str, int] = {}
        return [first.setdefault(h, r) for r, h in enumerate(self._hosts)]

    def split(self, color: int) -> "StoreBootstrap":
        colors = [checked(c, int, f"rank {r}'s color in split", self.rank)
                  for r, c in enumerate(self.allgather(int(color)))]
        members = [r for r, c in enumerate(colors) if c == color]
        sub = object.__new__(StoreBootstrap)
        sub.store, sub.timeout = self.store, self.timeout
        sub.rank, sub.size = members.index(self.rank), len(members)
        sub.prefix = f"{self._namespace('split')}/{color}"
        sub.world_rank, sub.world_size = self.world_rank, self.world_size
        sub._step = 0
        sub._hosts = [self._hosts[r] for r in members]
        return sub

    def store_for(self, name: str):
        """A ``PrefixStore`` in a namespace of its own (for a gloo group). Collective: every
        rank must ask in the same order."""
        import torch.distributed as dist

        return dist.PrefixStore(self._namespace(name) + "/", self.store)

    def close(self) -> None:
        """Nothing to release: the store belongs to the caller."""

    def __repr__(self) -> str:
        return f"StoreBootstrap(rank={self.rank}, size={self.size}, prefix={self.prefix!r})"

    # -- mechanics -----------------------------------------------------------------------------
    def _namespace(self, what: str) -> str:
        self._step += 1
        return f"{self.prefix}/{self._step}-{what}"

    @contextlib.contextmanager
    def _store_calls(self, what: str):
        """Around a step's store calls: a store that went away (torch's DistNetworkError & co.)
        becomes a BootstrapError that names this rank, the step and the likely cause. Any call
        can meet it, the first as well as the last: the rank serving the store exits when it
        fails, for example at its own deadline."""
        try:
            yield
        except DDLError:
            raise
        except RuntimeError as e:
            raise BootstrapError(
                f"rank {self.rank}: ddl_triton bootstrap ({what}): lost the store ({str(e).splitlines()[0]}); "
                "the process serving it (rank 0 under torchrun's env:// or RANK/MASTER_PORT) has probably "
                "exited: see its error") from None

    def _exchange(self, value: bytes, what: str) -> tuple[list[bytes], list[str]]:
        """Every rank's ``value``, and the keys they were read from."""
        base = self._namespace(what)
        keys = [f"{base}/{r}" for r in range(self.size)]
        with self._store_calls(what):
            self.store.set(f"{base}/{self.rank}", value)
            self._wait(keys, list(range(self.size)), what)
            return [self.store.get(k) for k in keys], keys

    def _hello(self, host: str) -> list[str]:
        """Post (size, host, pid); return every rank's host once all have posted the same size."""
        base = self._namespace("hello")
        with self._store_calls(_HELLO):
            claims = self.store.add(f"{base}/claims/{self.rank}", 1)
            me = encode([self.size, host, os.getpid()])
            self.store.set(f"{base}/{self.rank}", me)
            if claims > 1:
                raise ValueError(f"rank {self.rank}: ddl_triton bootstrap: another process already started as "
                                 f"rank {self.rank} on this store; every process needs its own RANK")
            keys = [f"{base}/{r}" for r in range(self.size)]
            seen: dict[int, tuple] = {}

            def check(arrived: list[int]) -> None:
                for r in arrived:
                    if r not in seen:
                        seen[r] = self._hello_of(keys[r])
                        if seen[r][0] != self.size:
                            self._linger_after_mismatch(base, [a for a in arrived if a != self.rank])
                            raise ValueError(
                                f"rank {self.rank}: ddl_triton bootstrap: rank {r} (pid {seen[r][2]} on "
                                f"{seen[r][1].split('|')[0]}) was started with world size {seen[r][0]}, this rank "
                                f"with {self.size}; every rank needs the same WORLD_SIZE (or size=)")
                # A rank told of a larger world than ours writes a key we never wait for: look for it too.
                extra = f"{base}/{self.size}"
                if self.store.check([extra]):
                    other = self._hello_of(extra)
                    self._linger_after_mismatch(base, [a for a in arrived if a != self.rank] + [self.size])
                    raise ValueError(f"rank {self.rank}: ddl_triton bootstrap: a process started as rank {self.size} "
                                     f"(world size {other[0]}), outside this rank's world of size {self.size}; "
                                     "every rank needs the same WORLD_SIZE (or size=)")

            self._wait(keys, list(range(self.size)), _HELLO, check)
            return [seen[r][1] for r in range(self.size)]

    def _hello_of(self, key: str) -> list:
        """The [size, host, pid] at ``key``, checked: nothing there runs, whoever wrote it."""
        hello = shaped(decode(self.store.get(key), f"store key {key!r}", self.rank), (int, str, int),
                       f"store key {key!r}", self.rank)
        if hello[0] < 1 or hello[2] < 1:
            raise BootstrapError(f"rank {self.rank}: ddl_triton bootstrap: store key {key!r} holds {hello!r:.200}: "
                                 "a world size and a pid must be positive")
        return hello

    def _linger_after_mismatch(self, base: str, others: list[int]) -> None:
        """Say that this rank found a world-size mismatch, then wait (at most _MISMATCH_LINGER
        seconds) until ``others`` have said so too, so that each names the mismatch itself
        before the rank serving the store exits. Best effort: a store already gone ends it."""
        deadline = time.monotonic() + min(_MISMATCH_LINGER, self.timeout)
        try:
            self.store.set(f"{base}/mismatch/{self.rank}", b"1")
            keys = [f"{base}/mismatch/{r}" for r in others]
            while keys and not self.store.check(keys) and time.monotonic() < deadline:
                time.sleep(_POLL_FIRST)
        except RuntimeError:
            pass

    def _wait(self, keys: list[str], ranks: list[int], what: str, check=None) -> None:
        """Return once every key exists; ``check(arrived ranks)`` runs at each poll and may
        raise. Past ``timeout``: BootstrapTimeout naming the ranks not heard from. Callers
        hold ``_store_calls``."""
        deadline = time.monotonic() + self.timeout
        pause = _POLL_FIRST
        while True:
            if check is None and self.store.check(keys):
                return  # the common case: one round trip
            present = [self.store.check([k]) for k in keys]
            if check is not None:
                check([r for r, p in zip(ranks, present) if p])
            if all(present):
                return
            if time.monotonic() > deadline:
                missing = [r for r, p in zip(ranks, present) if not p]
                raise BootstrapTimeout(
                    f"rank {self.rank}: ddl_triton bootstrap ({what}) timed out after {self.timeout:g} s: "
                    f"rank(s) {', '.join(map(str, missing))} of {self.size} never arrived. A rank that "
                    "did not start or crashed, a WORLD_SIZE larger than the number of processes, or ranks "
                    "given different stores (MASTER_ADDR/MASTER_PORT, init file)")
            time.sleep(pause)
            pause = min(_POLL_MAX, pause * 2)


def host_id() -> str:
    """What tells this host from others: processes with the same id share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}"


# -- the standard variables ----------------------------------------------------------------------------
def store_from_env(timeout: float, environ=None):
    """(store, rank, size) from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torch's
    ``env://`` reads them. Rank 0 serves a TCPStore on MASTER_PORT of MASTER_ADDR's interface only
    (transports/job_network.py; unless torchrun's agent already serves one there: TORCHELASTIC_USE_AGENT_STORE),
    the others connect to it.
    Nobody waits for the others here: the bootstrap's first step does, bounded by ``timeout``,
    and names what is wrong. ValueError names a missing or malformed variable; BootstrapError
    a store this rank can neither serve (the port is taken) nor reach (within ``timeout``)."""
    import torch.distributed as dist

    env = os.environ if environ is None else environ
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
    if missing:
        raise ValueError(f"ddl_triton.init: not launched by MPI, and {', '.join(missing)} not set: launch with "
                         "mpiexec/ddlrun, or torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or "
                         "pass store=, rank= and size=")
    try:
        rank, size, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
    except ValueError:
        raise ValueError(f"ddl_triton.init: RANK={env['RANK']!r}, WORLD_SIZE={env['WORLD_SIZE']!r} and "
                         f"MASTER_PORT={env['MASTER_PORT']!r} must be integers") from None
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank}: ddl_triton.init: RANK={rank} is not a rank of WORLD_SIZE={size}")
    serve = rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    address = f"{env['MASTER_ADDR']}:{port}"
    if serve:  # on the address the others reach it by, never every interface (transports/job_network.py)
        try:
            return serve_store(env["MASTER_ADDR"], port, size, timeout)[0], rank, size
        except OSError as e:
            raise BootstrapError(f"rank {rank}: ddl_triton.init: cannot serve the store on {address} ({e}); "
                                 "choose a free MASTER_PORT, and run rank 0 on the host MASTER_ADDR names") from None
    try:
        store = dist.TCPStore(env["MASTER_ADDR"], port, size, False, timedelta(seconds=timeout),
                              wait_for_workers=False)
    except RuntimeError as e:  # torch's DistNetworkError: its text says what the socket met, not who we are
        raise BootstrapError(f"rank {rank}: ddl_triton.init: could not reach the store at {address} "
                             f"({str(e).splitlines()[0]}); is rank 0 running, with the same MASTER_ADDR and "
                             "MASTER_PORT?") from None
    return store, rank, size


def launcher_world(launcher: str = ""):
    """The world the launcher's variables describe (ddl_triton/launch/launchers.py ``detect``: a
    ``FoundWorld``, or None), ``launcher`` (Options.launcher) naming the one to read."""
    return detect(launcher=launcher)


def store_of_launcher(found, timeout: float):
    """(store, rank, size) of the world a launcher's variables describe at a store
    (ddl_triton/launch/launchers.py's ``FoundWorld``), as ``store_from_env`` makes it; a failure
    also names the launcher and where the store's address came from."""
    try:
        return store_from_env(timeout, found.store_environment())
    except BootstrapError as e:
        raise BootstrapError(f"{e} [the world: {found.explain()}]") from None
