"""gloo transport: two-sided messages between hosts through torch's ProcessGroupGloo.

The inter-node transport of ranks that MPI did not launch (torchrun, torch.multiprocessing
spawn, SLURM with ``env://``: see ddl_triton/runtime/setup/bootstrap.py). Its semantics are MpiTransport's
(transports/mpi.py): a message is staged in a pooled byte buffer, so the executor reduces
straight into it and keeps overwriting its own data while the send is in flight; the
receiver gets the whole message in a pooled buffer; every wait is polled against the
deadline. Messages are matched by (sender, tag) with tag = message id modulo 2**30, unique
per pair for the communicator's first billion messages. The process group is private to
this transport (its own namespace of the store), so its tags never meet anyone else's.

Completion: gloo's send/recv ``Work`` cannot be polled (``is_completed`` only turns true
inside ``wait``; a ``wait`` with a timeout fails the operation, and closes the pair). gloo
moves the bytes on its own I/O thread, so nothing here needs to make progress for a peer
to receive, and a wait may simply block:
- a receive the executor needs now is waited for in ``Work.wait`` on the executor's thread,
  with the time left to the deadline (the GIL released): the message is answered as soon as
  gloo has it, with no thread hand-off. Past the deadline gloo fails it and the wait raises
  PeerTimeout, as a polled wait would; a dead peer fails it at once;
- sends complete in ``flush``, at the end of every collective, the same way. A collective
  that leaves more than ``_UNWATCHED_SENDS`` messages in flight hands the older ones to
  watcher threads (``Watchers``: a daemon thread blocked in ``wait()`` per operation, from a
  pool that grows whenever every thread is busy), so their buffers return to the pool while
  the collective still runs. The executor never blocks on a send before its last step: a
  send completes only once its receiver posts the receive, and blocking on it earlier could
  deadlock (a receiver that first waits for our next message).
So a small collective costs no thread hand-off; a large one pays one per message beyond
the first few, next to a message's milliseconds on the wire.

Failures: a peer process that dies closes its sockets, gloo fails the pending operations
("Connection closed by peer"), and the wait raises ``PeerTimeout(dead=True)`` at once.

``GlooTransport`` also serves the communicator's control calls when there is no MPI
communicator (``Ibarrier``, ``Send``, ``Recv``, ``Barrier`` with mpi4py's
names and buffer arguments, numpy arrays): the barrier and the tracer's clock alignment. The
call lane has TCP connections of its own (ddl_triton/runtime/lanes/lane_sockets.py).
"""
from __future__ import annotations

import atexit
import ctypes
import queue
import threading
import time
import weakref
from datetime import timedelta

import numpy as np
import torch

from . import failure_notice, waits
from .waits import DEFAULT_SPIN_SECONDS, PeerTimeout, wait_until
from .staged_sends import StagedSends

_TAG_RANGE = 1 << 30
_UNWATCHED_SENDS = 4  # messages in flight before older sends are handed to watcher threads (module doc)

# Live transports, closed at exit (see GlooTransport.close): a gloo send completes only once its
# receiver has posted the receive, so a rank that leaves right after its last collective must
# first let its last sends out, or a slower peer would lose them.
_LIVE: "weakref.WeakSet[GlooTransport]" = weakref.WeakSet()
_exit_hook_installed = False


def _deliver_at_exit() -> None:
    for transport in list(_LIVE):
        transport.close()


class _Pending:
    """The fate of one posted gloo operation, as its watcher thread sets it."""

    __slots__ = ("done", "error")

    def __init__(self):
        self.done = False
        self.error: BaseException | None = None


class Watchers:
    """Daemon threads that block in ``Work.wait()`` and mark the operation done (see the
    module doc); one more is started whenever none is idle."""

    def __init__(self, name: str):
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0

    def watch(self, work, on_done=None) -> _Pending:
        """Watch ``work``; ``on_done(pending)``, if given, runs on the watcher thread once it is done."""
        pending = _Pending()
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                self._threads += 1
                threading.Thread(target=self._serve, name=f"{self._name}-{self._threads}", daemon=True).start()
        self._jobs.put((work, pending, on_done))
        return pending

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            work, pending, on_done = job
            try:
                work.wait()  # releases the GIL
            except BaseException as e:  # noqa: BLE001 - delivered to the waiting rank
                pending.error = e
            pending.done = True
            if on_done is not None:
                try:
                    on_done(pending)
                except BaseException:  # noqa: BLE001 - the callback delivers its own errors
                    pass
            del work, job, on_done
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """Let idle threads end (threads still inside a wait end with the process)."""
        with self._lock:
            n = self._threads
        for _ in range(n):
            self._jobs.put(None)


def _failed(peer: int, what: str, error: BaseException) -> PeerTimeout:
    report = str(error).splitlines()[0][:300]
    if "Timed out" not in report:
        failure_notice.note_gone(peer)  # its sockets closed: the process has ended (module doc)
    return PeerTimeout(peer, f"{what}: gloo reported: {report}", dead=True)


class _Request:
    """An asynchronous gloo collective with mpi4py's ``Test()``: True once done; raises
    PeerTimeout(dead=True) if gloo failed it (a peer's process has gone)."""

    __slots__ = ("_work", "_what")

    def __init__(self, work, what: str):
        self._work = work
        self._what = what

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name, so waits treat both alike
        if not self._work.is_completed():
            return False
        try:
            self._work.wait()
        except RuntimeError as e:
            raise _failed(-1, self._what, e) from None
        return True


class GlooTransport(StagedSends):
    """Messages to any rank over a gloo process group made on ``store`` (a namespace of
    the bootstrap's store that nobody else uses). Collective: every rank constructs it."""

    name = "gloo"
    completes_sends = True  # two-sided: sends to complete, receives to post
    posts_receives_early = True
    has_group_allreduce = True  # gloo's own ring allreduce (allreduce_group)

    def __init__(self, store, rank: int, size: int, timeout: float):
        import torch.distributed as dist

        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))
        self._store = store
        self._group_pgs: dict[tuple[int, ...], object] = {tuple(range(size)): self.pg}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.spin = DEFAULT_SPIN_SECONDS
        self._watchers = Watchers(f"ddl_triton-gloo-rank{rank}")
        self._init_staging()
        self._closed = False
        global _exit_hook_installed
        _LIVE.add(self)
        if not _exit_hook_installed:
            atexit.register(_deliver_at_exit)
            _exit_hook_installed = True

    def _sends_done(self, sends) -> bool:
        # A send nobody watches cannot be told done without blocking: it waits for flush.
        return all(isinstance(s, _Pending) and s.done for s in sends)

    def _progress(self) -> None:
        """Hand all but the newest ``_UNWATCHED_SENDS`` messages' sends to watcher threads."""
        sending = self._sending
        if len(sending) > _UNWATCHED_SENDS:
            for i in range(len(sending) - _UNWATCHED_SENDS):
                sends, buf, dest = sending[i]
                if sends and not isinstance(sends[0], _Pending):
                    sending[i] = ([self._watchers.watch(w) for w in sends], buf, dest)

    # -- sender (acquire: staged_sends.py) ------------------------------------------------
    def publish(self, msg_id: int) -> None:
        peers, nbytes, buf = self._unstage(msg_id)
        self.bytes_sent += nbytes * len(peers)
        wire = buf[:max(nbytes, 1)]  # gloo moves no empty message: an empty one travels as one byte
        sends = [self.pg.send([wire], p, msg_id % _TAG_RANGE) for p in peers]
        self._sending.append((sends, buf, peers[0]))

    # -- receiver ------------------------------------------------------------------------
    def prefetch(self, peer: int, msg_id: int, size: int, dtype: torch.dtype) -> None:
        """Post the receive of the whole ``size``-element message."""
        key = (peer, msg_id)
        if key in self._posted:
            return
        nbytes = size * dtype.itemsize
        buf = self._take(nbytes)
        self._posted[key] = (self.pg.recv([buf[:max(nbytes, 1)]], peer, msg_id % _TAG_RANGE), [buf, False])

    def recv(self, peer: int, msg_id: int, count: int, dtype: torch.dtype, timeout: float,
             offset: int = 0, size: int = 0) -> torch.Tensor:
        size = max(size, offset + count)
        self.prefetch(peer, msg_id, size, dtype)
        work, entry = self._posted[(peer, msg_id)]
        buf, received = entry
        if not received:  # a step may read one message in several parts
            self.wait_work(work, timeout, peer, f"gloo message {msg_id}")
            entry[1] = True
            self.bytes_received += size * dtype.itemsize  # the whole message crossed the wire
        item = dtype.itemsize
        return buf[offset * item:(offset + count) * item].view(dtype)

    def release(self, peer: int, msg_id: int) -> None:
        _, (buf, _) = self._posted.pop((peer, msg_id))
        self._give(buf)

    def flush(self, timeout: float) -> None:
        """Complete every outstanding send (its receiver may be the last to arrive)."""
        for sends, buf, dest in self._sending:
            for s in sends:
                if isinstance(s, _Pending):
                    if not s.done:
                        wait_until(lambda s=s: s.done, timeout, dest, "gloo send completion", spin=self.spin)
                    if s.error is not None:
                        raise _failed(dest, "gloo send", s.error)
                else:
                    self.wait_work(s, timeout, dest, "gloo send completion")
            self._give(buf)
        self._sending = []

    def wait_work(self, work, timeout: float, peer: int, what: str) -> None:
        """Block in ``work.wait`` until gloo completes it (see the module doc); PeerTimeout
        after ``timeout`` seconds, or at once (dead) when gloo fails it: a peer gone."""
        if failure_notice.revocable():
            # An elastic job: a blocked Work.wait cannot be interrupted (neither abort nor shutdown
            # wakes it), so a watcher thread blocks instead and this thread polls, giving up when
            # the job revokes the world (one thread hand-off per message: elastic jobs only).
            pending = self._watchers.watch(work)
            wait_until(lambda: pending.done, timeout, peer, what, spin=self.spin, prompt=True)
            if pending.error is not None:
                if "Timed out" in str(pending.error):
                    raise PeerTimeout(peer, what) from None
                raise _failed(peer, what, pending.error)
            return
        waits.current_wait = (peer, what, time.time())  # for the flight recorder, as wait_until sets it
        start = time.monotonic()
        try:
            work.wait(timedelta(seconds=timeout))
        except RuntimeError as e:
            waits.last_stuck = waits.current_wait
            if "Timed out" in str(e) or time.monotonic() - start >= timeout:
                raise PeerTimeout(peer, what) from None  # gloo's deadline, which is ours
            raise _failed(peer, what, e) from None
        finally:
            waits.current_wait = None

    # -- group steps (schedules/native.py) ------------------------------------------------------
    def allreduce_group(self, group: tuple[int, ...], tensor: torch.Tensor, op: str, timeout: float) -> None:
        """gloo's own allreduce of ``tensor`` among ``group`` (transports/protocol.py), on the process
        group of those ranks: the whole one, or one made for the group on first use, which is
        collective over its members (every member reaches the same group step). gloo reduces on
        its worker threads; this thread waits in ``Work.wait`` as for a receive (module doc)."""
        import torch.distributed as dist

        pg = self._group_pgs.get(group)
        peer = next(p for p in group if p != self.rank) if len(group) == 2 else -1
        what = f"gloo allreduce among ranks {', '.join(map(str, group))}"
        if pg is None:
            if len(self._group_pgs) > 64:
                raise ValueError(f"rank {self.rank}: more than 64 rank groups asked of one gloo transport")
            prefix = "group-" + "-".join(map(str, group))
            pg = self._group_pgs[group] = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix, self._store), group.index(self.rank), len(group),
                timedelta(seconds=self.timeout))
        opts = dist.AllreduceOptions()
        opts.reduceOp = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        self.wait_work(pg.allreduce([tensor], opts), timeout, peer, what)
        moved = 2 * (len(group) - 1) * tensor.numel() * tensor.element_size() // len(group)
        self.bytes_sent += moved
        self.bytes_received += moved

    # -- control calls (mpi4py's names: see the module doc) ------------------------------------
    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Ibarrier(self) -> _Request:  # noqa: N802
        return _Request(self.pg.barrier(), "barrier")

    def Barrier(self) -> None:  # noqa: N802
        req = self.Ibarrier()
        wait_until(req.Test, self.timeout, -1, "barrier", spin=self.spin)

    def Send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:  # noqa: N802
        self._control_wait(self.pg.send([torch.from_numpy(buf)], dest, _TAG_RANGE + tag), dest, "control send")

    def Recv(self, buf: np.ndarray, source: int, tag: int = 0) -> None:  # noqa: N802
        self._control_wait(self.pg.recv([torch.from_numpy(buf)], source, _TAG_RANGE + tag), source, "control recv")

    def _control_wait(self, work, peer: int, what: str) -> None:
        pending = self._watchers.watch(work)
        wait_until(lambda: pending.done, self.timeout, peer, what, spin=self.spin)
        if pending.error is not None:
            raise _failed(peer, what, pending.error)

    def Dup(self):  # noqa: N802
        # The GPU path builds its transports on an MPI communicator of its own (ddl_triton/runtime/calls/gpu_path.py).
        raise ValueError(f"rank {self.rank}: CUDA tensors need ranks launched by MPI for now: the GPU path "
                         "(NVSHMEM within a host, host-staged MPI between hosts) is built on MPI, and these "
                         "ranks bootstrapped from a torch store. Launch with mpiexec/ddlrun, or move the "
                         "tensors to the CPU")

    def Free(self) -> None:  # noqa: N802
        """The process group goes with ``close``."""

    def close(self) -> None:
        """Let the sends in flight reach their receivers (a collective returns before its
        last sends complete; tearing the group down under them would fail the peers' receives;
        a dead peer fails them at once), then release everything."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush(self.timeout)
            delivered = not self._posted
        except PeerTimeout:
            delivered = False  # the peers are gone or stuck: nothing left to deliver to them
        self._posted.clear()
        self._free.clear()
        self._watchers.close()
        if delivered:
            # Free the groups now, while the interpreter is whole: each one's destructor joins its
            # worker threads. A group that lives on into interpreter exit can abort the process
            # ("terminate called without an active exception"): a worker that drops its last
            # collective's tensors then takes the GIL of a dying interpreter. After a failure the
            # groups are kept, because a destructor would wait on a receive that never comes.
            self._group_pgs.clear()
            self.pg = None
        elif failure_notice.revocable():
            # An elastic job goes on after this failure and one day exits normally: its interpreter's
            # teardown would then destroy these groups (the abort above, or a wait with no end). They
            # are made immortal instead: their threads end with the process.
            for pg in self._group_pgs.values():
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


def open_for(opening) -> GlooTransport:
    """The gloo transport of ranks that met through a store (transports/table.py's row "gloo"): its
    process group on the bootstrap's store, which also serves as the communicator's control channel."""
    place, options = opening.placement, opening.options
    if options.link_emulation:
        raise ValueError(f"rank {place.rank}: DDL_LINK_EMULATION emulates the MPI transport, but these "
                         "ranks were not launched by MPI: their inter-node transport is gloo")
    return GlooTransport(opening.bootstrap.store_for("gloo"), place.rank, place.size, options.timeout)
