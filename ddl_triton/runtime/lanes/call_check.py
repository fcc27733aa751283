"""Call fingerprints: before each collective the ranks compare what they are about to run.

Semantics: call number ``seq`` on every rank must be the same collective with the
same op, dtype, element count and root. A rank whose call differs makes every rank
raise ``CollectiveMismatch`` listing each rank's call, instead of a hang or garbage.

A fingerprint is 6 small integers. Within a node they travel through the shm
segments' headers (a rank posts its own, then reads its peers'); when any peer is
reached over MPI or gloo, in the call lane's message to every peer (call_lane.py), where a
small allreduce's data rides with it.
Measured cost (2 ranks, 2 cores): about 1.5 us per call over shm (see README,
"Reliability"); ``Options.check_calls`` (``DDL_CHECK_CALLS=0``) turns the check off.
Small allreduces on the shm lane check their calls in the flag word that publishes
their data instead, and post here only when they wait long (small_allreduce.py).

A peer that left the communicator (finalize, close, a destroyed group, exit: farewell.py) without
issuing the call a rank waits in is found the same way: over shm its farewell word is read in the
long waits with the fingerprints, and raises ``CollectiveSkipped`` naming it and what it did; across
two-sided links its farewell is its last call-lane message (call_lane.py).
"""
from __future__ import annotations

from . import call_lane, farewell
from .fingerprint import CALLS, describe_posted, encode
from ...errors import call_name, calls_disagree, wait_failed
from ...transports import failure_notice
from ...transports.waits import PeerTimeout

class CallChecker:
    """Compares fingerprints among all ranks of a communicator, through shm or MPI.

    Over shm the check costs no extra synchronisation: a rank posts its fingerprint,
    runs the collective, and compares every peer's fingerprint afterwards (a peer that
    took part has posted it long before). A mismatch that would make the collective
    hang is caught inside the transport's long waits, which look at the peers'
    fingerprints every quarter second (``look_for_mismatch``: the shm transport's wait hook, set
    when the communicator wires the transports). When any peer is reached over MPI or gloo, the
    ranks exchange fingerprints in the call lane's messages before the collective starts
    (``lane``: call_lane.py). The runner brackets each call: ``begin_call``, the call, ``end_call``.
    """

    def __init__(self, lane, rank: int, size: int, shm, timeout: float, describe=None):
        self.lane = lane  # set when some peer is reached over a two-sided transport
        self.describe = describe  # peer -> how an error names it (Placement.describe), else "rank P"
        self.rank = rank
        self.size = size
        self.shm = shm  # set when every peer is reached over shm
        self.timeout = timeout
        self._current: tuple[int, tuple[int, ...]] | None = None
        self._farewells_only = False  # end()'s wait: look for peers that left, compare fingerprints later
        self._peers = [p for p in range(size) if p != rank]
        self._fingerprints: dict[tuple, tuple] = {}  # call shape -> (its fingerprint, lane header) (bounded)

    def begin_call(self, seq: int, collective: str, op, dtype, numel: int, root: int, on_gpu: bool = False):
        """Before call ``seq`` runs: ``begin`` with its fingerprint, which it returns for ``end_call``.
        A peer lost or silent past the deadline is a CollectiveTimeout naming the call and the peer."""
        key = (collective, op, dtype, numel, root, on_gpu)
        known = self._fingerprints.get(key)
        if known is None:
            if len(self._fingerprints) > 256:
                self._fingerprints.clear()
            fp = encode(collective, op, dtype, numel, root, on_gpu)
            known = self._fingerprints[key] = (fp, None if self.lane is None else call_lane.header(fp, 0))
        fp, head = known
        try:
            self.begin(seq, fp, head)
        except PeerTimeout as e:
            raise wait_failed(self.rank, call_name(collective, seq), e, self.timeout, self.describe) from None
        return fp

    def end_call(self, seq: int, collective: str, fp: tuple[int, ...]) -> None:
        """After call ``seq`` ran: ``end``, with ``begin_call``'s errors."""
        try:
            self.end(seq, fp)
        except PeerTimeout as e:
            raise wait_failed(self.rank, call_name(collective, seq), e, self.timeout, self.describe) from None

    def begin(self, seq: int, fp: tuple[int, ...], head: bytes | None = None) -> None:
        """Before the collective: publish (shm) or exchange and compare (the call lane: ``head``
        is ``call_lane.header(fp, 0)``)."""
        if self.size == 1:
            return
        if self.shm is not None:
            self._current = (seq, fp)
            self.shm.post_fingerprint(seq, fp)
            return
        self.lane.exchange(seq, head, 0)  # raises CollectiveMismatch listing every rank's call

    def end(self, seq: int, fp: tuple[int, ...]) -> None:
        """After the collective (shm): every peer must have posted the same call."""
        if self.shm is None or self.size == 1:
            return
        if self.shm.peers_posted_same(self._peers, seq, fp):
            self._current = None
            return  # the common case, in one load per peer; otherwise wait and list every call
        # While we wait for every peer's fingerprint, look for peers that left (they never post it);
        # the fingerprints themselves are compared once all are in, so the error lists every call.
        self._farewells_only = True
        try:
            theirs = {p: self.shm.peer_fingerprint(p, seq, self.timeout) for p in range(self.size) if p != self.rank}
        finally:
            self._current, self._farewells_only = None, False
        theirs[self.rank] = fp
        self._compare(seq, fp, theirs)

    def watch(self, seq: int | None, fp: tuple[int, ...] | None) -> None:
        """Compare the peers' posted fingerprints with ``fp`` for call ``seq`` inside long waits
        from now on (None: stop). For a path that checks its calls by other means and posts
        only once it waits long (ddl_triton/runtime/lanes/small_allreduce.py)."""
        self._current = None if seq is None else (seq, fp)

    def look_for_mismatch(self) -> None:
        """Raise now, not at the deadline, when a peer posted a different call for this sequence
        number (``CollectiveMismatch``), or left the communicator without issuing it
        (``CollectiveSkipped``): it will never send what we wait for. The shm transport's wait hook
        (``ShmTransport.wait_hook``, set to this when the communicator wires the transports)."""
        if self._current is None:
            return
        seq, fp = self._current
        shm = self.shm
        theirs = {} if self._farewells_only else {p: shm.peer_fingerprint(p, seq, None) for p in self._peers}
        if any(v is not False and v != fp for v in theirs.values()):
            theirs[self.rank] = fp
            self._current = None
            self._compare(seq, fp, theirs)
        left = {p: f for p in self._peers if (f := farewell.from_shm_word(shm.peer_farewell(p))) is not None}
        cause = farewell.most_telling(left, seq) if left else None
        if cause is not None:
            peer, said = cause
            if not said.skipped(seq):  # a consequence: name what this host can see of the cause first
                _cause_seen_first(shm, left)
            self._current = None
            raise farewell.doomed(self.rank, call_name(CALLS[fp[0]], seq), seq, peer, said, self.describe)

    def _compare(self, seq: int, fp: tuple[int, ...], theirs: dict) -> None:
        if all(v == fp for v in theirs.values()):
            return
        raise calls_disagree(self.rank, seq, {p: describe_posted(theirs.get(p)) for p in range(self.size)}, self.size)


def _cause_seen_first(shm, left: dict) -> None:
    """Before reporting a peer that left after its own call failed (a consequence), raise what the
    waits would have found themselves a moment later: a peer on this host whose process ended
    without a farewell (it was killed: the cause), or the launcher's notice that a process died."""
    for peer in shm.exited_peers():
        if peer not in left:
            failure_notice.note_gone(peer)
            raise PeerTimeout(peer, "its process has exited", dead=True)
    if failure_notice.received_at() is not None:
        raise PeerTimeout(-1, "the call's messages (the launcher reported that a process of this job died)", dead=True)
