"""Host shared-memory transport: one symmetric POSIX segment per rank of a node.

Every rank maps every node peer's segment. A segment is laid out as

    [0, 64)            published: id of the newest message this rank has written (int64)
    [64, 64 + 8*L)     consumed[q]: id of the newest message of local peer q this rank has read
    [HEADER, ...)      ``depth`` slots of ``slot_bytes``: message m lives in slot m % depth
    [..., + lane_bytes) the small-message lane's two buffers (ddl_triton/runtime/lanes/small_allreduce.py),
                       whose flag word and buffer headers are words 3, 4 and 5 of the header;
                       word 6 holds the rank's farewell once it left (``post_farewell``)

Flags are sequence numbers that only grow, each written by one rank only, so
no barrier or reset is ever needed: a receiver waits for ``published >= m`` in
the sender's segment, reads the slot in place, then sets its own
``consumed[sender] = m``; a sender reuses a slot once every addressee of the
message that last used it has consumed it. Ordering relies on x86-64's total
store order (the data stores are issued before the flag store, by separate C
calls); on weaker memory models this transport would need explicit fences.

Segments are created with mode 0600 under an unguessable per-job name and are
unlinked as soon as every peer has mapped them, so nothing stays in /dev/shm
after the job ends, however it ends. The segments are mapped with ``mmap``
directly rather than through ``multiprocessing.shared_memory``, whose resource
tracker (Python 3.11) would register every attached segment and unlink
segments this process does not own at exit.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import stat

import numpy as np
import torch

from . import failure_notice, futex
from ..errors import DDLError, process_alive  # the one liveness check: a dead peer is told from a slow one
from .waits import DEFAULT_SPIN_SECONDS, PeerTimeout, wait_until, with_calls_first

_SHM_DIR = "/dev/shm"
_HEADER_BYTES = 4096
_PID_OFFSET = 8           # int64: the owner's pid, so waiters can tell a dead peer from a slow one
_LANE_FLAG_WORD = 3       # int64 words of the header owned by the small-message lane
_LANE_HEAD_WORDS = (4, 5)
# int64 word 6: this rank's farewell once it left the communicator (0 until then): how, after how many
# calls (ddl_triton/runtime/lanes/farewell.py encodes it; peers read it in their long waits).
_FAREWELL_WORD = 6
_CONSUMED_OFFSET = 64
_FINGERPRINT_OFFSET = 2048  # ring of call fingerprints: slot i = [seq, f1..f6, unused] (8 int64)
_FINGERPRINT_SLOTS = 4
# sleeping[q] (int64): 1 while local rank q sleeps on this segment's ``published`` word (a futex,
# transports/futex.py); written by q only. ``publish`` wakes the sleepers.
_SLEEPING_OFFSET = _FINGERPRINT_OFFSET + 64 * _FINGERPRINT_SLOTS
_MAX_CACHED_VIEWS = 1024


def _segment_path(creator_pid: int, token: str, local_rank: int) -> str:
    # The creator's pid in the name lets a later job tell a crashed job's segment from a live one.
    return os.path.join(_SHM_DIR, f"ddl_triton-{creator_pid}-{token}-{local_rank}")


def _checked_leader(leader, rank: int) -> list:
    """The [pid, token] the node's first rank sent, checked before it goes into a path: a
    positive pid and 32 hex digits, nothing that could name another file (DDLError otherwise)."""
    shaped = isinstance(leader, list) and len(leader) == 2 and type(leader[0]) is int and isinstance(leader[1], str)
    if not shaped or leader[0] < 1 or not re.fullmatch(r"[0-9a-f]{32}", leader[1]):
        raise DDLError(f"rank {rank}: shm: the node's first rank named its segments {leader!r:.100}, "
                       "not a pid and 32 hex digits")
    return leader


def _check_peer_segment(st: os.stat_result, segment_bytes: int, rank: int, peer: int) -> None:
    """A peer's segment is mapped only when it is what a peer of this job made: a regular file of this
    user (/dev/shm is shared by every user of the host, and its name is known to the node's ranks
    only), of the size every rank of the node agreed on."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"local rank {rank}: shm: local rank {peer}'s segment is not a file of this user "
                              f"(uid {st.st_uid}, mode {oct(st.st_mode)}): refusing to map it")
    if st.st_size != segment_bytes:
        raise ValueError(f"local rank {rank}: shm: local rank {peer}'s segment holds {st.st_size} B, this rank "
                         f"expects {segment_bytes} B: the ranks of a node must agree on chunk_bytes and "
                         "pipeline_depth (DDL_CHUNK_BYTES, DDL_PIPELINE_DEPTH)")


def sweep_stale_segments() -> list[str]:
    """Unlink this user's ddl_triton segments whose creating process is gone.

    Segments are unlinked as soon as every peer has mapped them, so only a job killed
    inside that window (during init) can leave one behind; this removes them at the
    next start. Returns the names removed.
    """
    removed = []
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if parts[0] != "ddl_triton" or len(parts) != 4 or not parts[1].isdigit():
            continue
        path = os.path.join(_SHM_DIR, name)
        try:
            if os.stat(path).st_uid != os.getuid() or process_alive(int(parts[1])):
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue  # another rank swept it first, or it is not ours to remove
    return removed


class ShmTransport:
    """Messages between the ranks of one node through each other's segments.

    ``world_of_local[i]`` is the communicator rank of node-local rank ``i``;
    peers are named by communicator rank in every call.
    """

    name = "shm"
    completes_sends = False  # one-sided: a publish is the whole send
    posts_receives_early = False
    LANE_FLAG_WORD = _LANE_FLAG_WORD
    LANE_HEAD_WORDS = _LANE_HEAD_WORDS

    def __init__(self, node, world_of_local: list[int], *, slot_bytes: int, depth: int, lane_bytes: int = 0):
        # ``node``: the ranks of this node as a bootstrap (rank, size, bcast, barrier, each bounded by the
        # job's deadline: ddl_triton/runtime/setup/bootstrap.py), made by the caller; the transports
        # room sits below the runtime and imports none of it.
        self.local_rank = node.rank
        self.local_size = node.size
        self.slot_bytes = slot_bytes
        self.depth = depth
        self.lane_bytes = lane_bytes
        self.segment_bytes = _HEADER_BYTES + depth * slot_bytes + lane_bytes
        if _CONSUMED_OFFSET + 8 * self.local_size > _FINGERPRINT_OFFSET or \
                _SLEEPING_OFFSET + 8 * self.local_size > _HEADER_BYTES:
            raise ValueError(f"shm: {self.local_size} ranks on one node exceed the header's capacity")
        self._local_of_world = {w: i for i, w in enumerate(world_of_local)}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.spin = DEFAULT_SPIN_SECONDS
        self._maps: list[mmap.mmap] = []
        self.swept: list[str] = []  # stale segments of crashed jobs removed at start-up
        self._closed = False

        if self.local_rank == 0:
            self.swept = sweep_stale_segments()
        leader = _checked_leader(node.bcast([os.getpid(), secrets.token_hex(16)] if self.local_rank == 0 else None,
                                            root=0), node.rank)
        path = _segment_path(leader[0], leader[1], self.local_rank)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.segment_bytes)
            own = mmap.mmap(fd, self.segment_bytes)
        finally:
            os.close(fd)
        try:
            node.barrier()  # every segment exists
            for i in range(self.local_size):
                if i == self.local_rank:
                    self._maps.append(own)
                    continue
                pfd = os.open(_segment_path(leader[0], leader[1], i), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    _check_peer_segment(os.fstat(pfd), self.segment_bytes, node.rank, i)
                    self._maps.append(mmap.mmap(pfd, self.segment_bytes))
                finally:
                    os.close(pfd)
            node.barrier()  # every peer has mapped every segment
        finally:
            os.unlink(path)

        self._flags = [np.frombuffer(m, dtype=np.int64, count=_HEADER_BYTES // 8) for m in self._maps]
        self._bytes = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        own_flags = self._own_flags = self._flags[self.local_rank]
        self._published_address = [f.ctypes.data for f in self._flags]  # word 0 of each segment
        self._views: dict[tuple, torch.Tensor] = {}
        own_flags[0] = -1
        own_flags[_CONSUMED_OFFSET // 8:_CONSUMED_OFFSET // 8 + self.local_size] = -1
        own_flags[_PID_OFFSET // 8] = os.getpid()
        own_flags[_FAREWELL_WORD] = 0  # still here
        fp = _FINGERPRINT_OFFSET // 8
        own_flags[fp:fp + 8 * _FINGERPRINT_SLOTS] = -1
        node.barrier()  # flags initialised before anyone reads them
        # slot -> (message id, local addressees) of the message that used it last
        self._slot_user: list[tuple[int, tuple[int, ...]]] = [(-1, ())] * depth
        # Called during long waits, may raise: set once when the communicator wires the transports (the call
        # check's look_for_mismatch, ddl_triton/runtime/lanes/call_check.py), so this transport imports none of it.
        self.wait_hook = None
        # Called at every check of a wait for a peer's message or slot: the same communicator's MPI
        # sends, which must progress meanwhile (MpiTransport.push_sends; set by runtime/setup/wiring.py).
        self.keep_moving = None
        self._pending: tuple[int, int, tuple[int, ...]] | None = None
        self._readers: dict[tuple[int, ...], tuple[int, ...]] = {}  # peers -> their local ranks

    # -- helpers -------------------------------------------------------------------------
    def _local(self, peer: int) -> int:
        return self._local_of_world[peer]

    def _slot_view(self, local: int, msg_id: int, count: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """Typed view of elements [offset, offset+count) of the slot holding ``msg_id`` in ``local``'s
        segment (cached: making a view costs microseconds)."""
        key = (local, msg_id % self.depth, count, dtype, offset)
        view = self._views.get(key)
        if view is None:
            nbytes = (offset + count) * dtype.itemsize
            if nbytes > self.slot_bytes:
                raise ValueError(f"shm: message of {nbytes} B exceeds the {self.slot_bytes} B slot")
            if len(self._views) > _MAX_CACHED_VIEWS:
                self._views.clear()
            start = _HEADER_BYTES + key[1] * self.slot_bytes + offset * dtype.itemsize
            view = self._bytes[local][start:start + count * dtype.itemsize].view(dtype)
            self._views[key] = view
        return view

    def slot_array(self, local: int, msg_id: int, count: int, dtype: torch.dtype) -> np.ndarray:
        """``_slot_view`` as a numpy array (cached too: ``Tensor.numpy()`` costs about a microsecond)."""
        key = (local, msg_id % self.depth, count, dtype, "numpy")
        array = self._views.get(key)
        if array is None:
            array = self._slot_view(local, msg_id, count, dtype).numpy()
            self._views[key] = array
        return array

    def flag_words(self, local: int) -> memoryview:
        """The header of ``local``'s segment as int64 words (a memoryview: a load or store of one
        word costs about 30 ns, half of numpy's scalar indexing). The small-message lane owns
        words ``LANE_FLAG_WORD`` and ``LANE_HEAD_WORDS``."""
        return memoryview(self._maps[local]).cast("B")[:_HEADER_BYTES].cast("q")

    def lane_buffer(self, local: int, parity: int) -> np.ndarray:
        """The small-message lane's buffer ``parity`` (0 or 1) in ``local``'s segment, as bytes."""
        half = self.lane_bytes // 2
        start = _HEADER_BYTES + self.depth * self.slot_bytes + parity * half
        return np.frombuffer(self._maps[local], dtype=np.uint8, count=half, offset=start)

    def liveness_check(self, local: int):
        """A check, run every quarter second of a long wait, that the process owning segment
        ``local`` still exists; it also runs ``wait_hook`` (the call checker's), which may raise."""
        pid = int(self._flags[local][_PID_OFFSET // 8])

        def alive() -> bool:
            if self.wait_hook is not None:
                self.wait_hook()
            if not process_alive(pid):
                return False
            # Any dead rank dooms the collective, even one this wait does not name: a chain
            # of survivors waiting on each other would otherwise wait out the deadline.
            for other in range(self.local_size):
                if other != local and other != self.local_rank and \
                        not process_alive(int(self._flags[other][_PID_OFFSET // 8])):
                    failure_notice.note_gone(self._world_of(other))
                    raise PeerTimeout(self._world_of(other), "its process has exited", dead=True)
            return True
        return alive

    def exited_peers(self) -> list[int]:
        """The world ranks of this host's peers whose process has ended (``process_alive``)."""
        return [self._world_of(other) for other in range(self.local_size) if other != self.local_rank
                and not process_alive(int(self._flags[other][_PID_OFFSET // 8]))]

    # -- call fingerprints ---------------------------------------------------------------
    def post_fingerprint(self, seq: int, values: tuple[int, ...]) -> None:
        """Publish what this rank is about to call as collective number ``seq`` (6 ints, then
        their hash in the 8th word, so that peers can compare with one load)."""
        base = _FINGERPRINT_OFFSET // 8 + 8 * (seq % _FINGERPRINT_SLOTS)
        flags = self._own_flags
        flags[base + 1:base + 1 + len(values)] = values
        flags[base + 7] = hash(values)
        flags[base] = seq  # after the values: TSO keeps the order

    def peers_posted_same(self, peers: list[int], seq: int, values: tuple[int, ...]) -> bool:
        """Fast check: every peer has posted exactly ``values`` for ``seq`` (no waiting)."""
        base = _FINGERPRINT_OFFSET // 8 + 8 * (seq % _FINGERPRINT_SLOTS)
        digest = hash(values)
        for peer in peers:
            flags = self._flags[self._local_of_world[peer]]
            if flags[base] != seq or flags[base + 7] != digest:
                return False
        return True

    def peer_fingerprint(self, peer: int, seq: int, timeout: float | None) -> tuple[int, ...] | None | bool:
        """The fingerprint ``peer`` posted for ``seq``; None when it has already posted a later
        one in that slot (it is ahead: it called more collectives than this rank). With
        ``timeout=None`` it does not wait, and returns False when nothing is posted yet."""
        local = self._local_of_world[peer]
        flags = self._flags[local]
        base = _FINGERPRINT_OFFSET // 8 + 8 * (seq % _FINGERPRINT_SLOTS)
        if flags[base] < seq:
            if timeout is None:
                return False
            wait_until(lambda: flags[base] >= seq, timeout, peer, f"its call #{seq}", spin=self.spin,
                       alive=self.liveness_check(local))
        values = tuple(int(v) for v in flags[base:base + 7])
        return values[1:] if values[0] == seq else None

    # -- farewells ------------------------------------------------------------------------
    def post_farewell(self, word: int) -> None:
        """Say, in this rank's header, that it left the communicator (``word``: nonzero, encoded by
        ddl_triton/runtime/lanes/farewell.py). Peers keep reading it after this rank unmaps its
        segment, or exits: their own mappings stay."""
        if self._own_flags is not None:
            self._own_flags[_FAREWELL_WORD] = word

    def peer_farewell(self, peer: int) -> int:
        """``peer``'s farewell word: 0 while it has not left (one load; for long waits only)."""
        return int(self._flags[self._local_of_world[peer]][_FAREWELL_WORD])

    def _consumed(self, reader_local: int, sender_local: int) -> int:
        return int(self._flags[reader_local][_CONSUMED_OFFSET // 8 + sender_local])

    # -- sender --------------------------------------------------------------------------
    def acquire(self, msg_id: int, peers: tuple[int, ...], count: int, dtype: torch.dtype,
                timeout: float) -> torch.Tensor:
        slot = msg_id % self.depth
        old_id, old_readers = self._slot_user[slot]
        me = self.local_rank
        for reader in old_readers:
            if self._consumed(reader, me) < old_id:
                wait_until(self._moving(lambda: self._consumed(reader, me) >= old_id), timeout, self._world_of(reader),
                           f"to release shm slot {slot} (message {old_id})", spin=self.spin,
                           alive=self.liveness_check(reader))
        readers = self._readers.get(peers)
        if readers is None:
            readers = self._readers[peers] = tuple(self._local(p) for p in peers)
        self._pending = (msg_id, count * dtype.itemsize, readers)
        return self._slot_view(me, msg_id, count, dtype)

    def publish(self, msg_id: int) -> None:
        pending_id, nbytes, readers = self._pending  # type: ignore[misc]
        assert pending_id == msg_id, "publish without a matching acquire"
        self._slot_user[msg_id % self.depth] = (msg_id, readers)
        own_flags = self._own_flags
        own_flags[0] = msg_id  # after the data: TSO keeps the order
        for reader in readers:
            if own_flags[_SLEEPING_OFFSET // 8 + reader]:  # a reader sleeps on word 0: wake it
                futex.wake(self._published_address[self.local_rank])
                break
        self.bytes_sent += nbytes * len(readers)
        self._pending = None

    # -- receiver ------------------------------------------------------------------------
    def prefetch(self, peer: int, msg_id: int, size: int, dtype: torch.dtype) -> None:
        """Nothing to post: the data is read in place from the peer's slot."""

    def recv(self, peer: int, msg_id: int, count: int, dtype: torch.dtype, timeout: float,
             offset: int = 0, size: int = 0) -> torch.Tensor:
        local = self._arrived(peer, msg_id, timeout)
        self.bytes_received += count * dtype.itemsize
        return self._slot_view(local, msg_id, count, dtype, offset)

    def recv_array(self, peer: int, msg_id: int, count: int, dtype: torch.dtype, timeout: float) -> np.ndarray:
        """``recv`` of a whole message as a numpy array (the small-message path's form)."""
        local = self._arrived(peer, msg_id, timeout)
        self.bytes_received += count * dtype.itemsize
        return self.slot_array(local, msg_id, count, dtype)

    def _arrived(self, peer: int, msg_id: int, timeout: float) -> int:
        """Wait until ``peer`` has published ``msg_id``; returns the peer's local rank."""
        local = self._local_of_world[peer]
        flags = self._flags[local]
        if flags[0] < msg_id:
            wait_until(self._moving(lambda: flags[0] >= msg_id), timeout, peer, f"shm message {msg_id}",
                       spin=self.spin,
                       alive=self.liveness_check(local), sleep=self._sleeper(local, msg_id) if futex.AVAILABLE else None)
        return local

    def _moving(self, ready):
        """``ready``, with ``keep_moving`` called before each check when it is set."""
        return ready if self.keep_moving is None else with_calls_first((self.keep_moving,), ready)

    def _sleeper(self, local: int, msg_id: int):
        """A nap that ends as soon as ``local`` publishes: it sleeps on the peer's ``published``
        word after raising its own ``sleeping`` mark there, which the peer's ``publish`` checks.
        A wake-up missed in the race between the two is bounded by the nap's length."""
        flags = self._flags[local]
        mark = _SLEEPING_OFFSET // 8 + self.local_rank
        address = self._published_address[local]

        def sleep(seconds: float) -> None:
            flags[mark] = 1
            seen = int(flags[0])
            if seen < msg_id:
                futex.wait(address, seen, seconds)
            flags[mark] = 0
        return sleep

    def release(self, peer: int, msg_id: int) -> None:
        self._own_flags[_CONSUMED_OFFSET // 8 + self._local_of_world[peer]] = msg_id

    def flush(self, timeout: float) -> None:
        """Sends complete at publish: the reader copies out of our slot."""

    def _world_of(self, local: int) -> int:
        for w, i in self._local_of_world.items():
            if i == local:
                return w
        return -1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Drop every view before unmapping: torch/numpy views keep exported buffers alive.
        self._flags = []
        self._bytes = []
        self._views = {}
        self._own_flags = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when it is collected
        self._maps = []


def open_for(opening) -> ShmTransport:
    """Host shared memory among the ranks of this rank's node (transports/table.py's row "shm"),
    collective over them: ``pipeline_depth`` slots of ``chunk_bytes`` each, and the small-message
    lane's bytes."""
    place, options = opening.placement, opening.options
    return ShmTransport(opening.node, list(place.on_node), slot_bytes=options.chunk_bytes,
                        depth=options.pipeline_depth, lane_bytes=opening.lane_bytes)
