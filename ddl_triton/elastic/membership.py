"""Who is in an elastic job's world: generations of members, decided once through the job's store.

Semantics. The ranks of an elastic job (ddl_triton/torch/elastic/) share a ``torch.distributed.Store``
(the launcher's TCPStore: rank 0's process serves it under ``env://``, torchrun's agent on the first
host under torchrun). Each process has a member id that never changes: its launch ``RANK`` for the
first world, ``JOINER_BASE`` + n for the n-th process that joined later. A *generation* is one world:

    generation 0       the launch: members [0, 1, ..., WORLD_SIZE - 1]
    generation G + 1   decided once, when generation G failed (a rank lost) or grew (a joiner admitted)

Its members, in new-rank order, are the surviving members of G in their old order, then the
admitted joiners by id. Every process of G+1 learns the same list: it is written once, with the
store's ``compare_set``, by whichever survivor proposes first, and read back by all; two survivors
can never build different worlds. A process missing from that list (stopped or cut off while the
others decided) raises ``ExcludedFromWorld`` when it comes back, and touches nothing of the new world.

How generation G ends:
- ``revoke(reason)``: a rank whose collective failed writes ``g<G>/revoked`` (``compare_set``: the first
  reason stays) and, in one ``multi_set``, a notice to each member (``g<G>/tell/<id>``). Each
  process's watcher thread is blocked on its own notice (``wait``, on a store connection of its own),
  so it wakes as soon as the notice is written and revokes the process's waits
  (transports/failure_notice.py): a survivor stuck on another survivor stops too, instead of waiting
  out the deadline. While nothing fails the watcher sends one request per hour (or per deadline, if longer),
  whatever the world's size (it used to poll the store 20 times a second).
- Each live process says it is here for G+1 (``g<G+1>/here/<id>``, appended to ``g<G+1>/word``): the
  watcher thread does it at once, so a rank still computing its backward is counted as alive.
- ``agree`` decides: once every member of G is here or known gone (a counter, ``add``: whoever
  accounts for the last member writes ``g<G+1>/ready``), or ``grace`` seconds after the first of them
  arrived (its timer writes ``ready``), whichever comes first; every process blocks on ``ready``. A
  member whose process ended is known gone when a survivor saw it (its pid gone on the same host,
  its sockets closed: ``mark_gone``); one that is cut off or stopped does not post, and is left out
  after ``grace``. Then one process (the first to ``add`` to ``g<G+1>/proposers``) reads the answers
  (one ``get`` of ``word``) and proposes; the others block on the decided list, and propose
  themselves if it has not come ``grace`` later (the proposer died). Each process makes a number of
  store requests that does not grow with the world's size (joiners aside: each pending one is
  checked).
- A second failure during the agreement or the build of G+1 is handled the same way: the build fails
  (its bootstrap times out or a peer dies), G+1 is revoked, and the survivors agree on G+2.

Who may join: a process that proves it holds the job's secret (``Options.job_secret``,
ddl_triton/job_secret.py), which never enters the store. The members publish a nonce naming
the job (``job``); a joiner posts, with its request, an HMAC of that nonce and its member id under the
secret. Whoever checks the pending joiners (rank 0 at each commit, every member while it
agrees) admits only a joiner whose proof holds: any other request is refused (``refused/<id>`` says
why; the joiner raises it), and the members go on as if it had never asked. A job started without a
secret admits nobody. A joiner is never the source of the state either (state.py takes it from a
member of the previous world), whatever it did before it asked.

The store's host is the coordinator: a store that cannot be reached raises ``CoordinatorLost``
(torchft's Lighthouse has the same single point of failure, and says so).

Nothing read from the store runs: values are JSON of ints and short strings, checked on arrival.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field

from ..errors import CoordinatorLost, DDLError, ExcludedFromWorld, PeersLost
from ..transports import failure_notice
from .. import job_secret
from .store_calls import _PREFIX, StoreCalls
from .watcher import _MOVED, RevocationWatch, notice_key

JOINER_BASE = 1_000_000   # member ids of processes that joined after the launch start here
_POLL_S = 0.05            # a joiner's store polls (joiners only: members block on keys)
_MAX_MEMBERS = 1 << 16


@dataclass
class Decision:
    """Generation ``generation``'s world, as this process takes part in it."""

    generation: int
    members: list[int]                      # member ids in new-rank order
    rank: int                               # this process's rank in it
    lost: list[int] = field(default_factory=list)     # ranks of the previous generation left out
    lost_hosts: list[str] = field(default_factory=list)
    joined: list[int] = field(default_factory=list)   # member ids admitted by this generation
    reason: str = ""

    @property
    def size(self) -> int:
        return len(self.members)

    def prefix(self, what: str) -> str:
        """A store namespace of this generation's own (its process group, its bootstrap)."""
        return f"{_PREFIX}/g{self.generation}/{what}"


class Membership(StoreCalls, RevocationWatch):
    """This process's view of the job's generations. ``store``: the job's store; ``member``: this
    process's id; ``host``: its host name (for errors); ``timeout``: the job's deadline (DDL_TIMEOUT),
    which bounds every wait here; ``grace``: how long survivors wait for each other's word;
    ``secret``: the job's credential (``Options.job_secret``; "" admits no joiner)."""

    def __init__(self, store, member: int, host: str, timeout: float, grace: float = 1.0, secret: str = ""):
        self.store, self.member, self.host = store, member, host
        self.timeout, self.grace = float(timeout), float(grace)
        self._secret = secret
        self._verdicts: dict[int, str] = {}  # joiner id -> "" (its proof holds) or why it is refused
        self._hosts: dict[int, str] = {}
        self._lock = threading.Lock()
        self._said_here: set[int] = set()
        self._watcher: threading.Thread | None = None
        self._watching = ""              # the notice key the watcher is blocked on ("" when none)
        self._moved = threading.Event()  # set when ``current`` changes: the watcher looks again
        self._stop = threading.Event()
        self._broken = ""  # why the store client broke for good (_BREAKS_CLIENT)
        self._blocking = None  # the agreement's own store connection (``_wait``)
        self._current: Decision | None = None

    @property
    def current(self) -> Decision | None:
        """The generation this process is in (None: a joiner not admitted yet)."""
        return self._current

    @current.setter
    def current(self, decision: Decision | None) -> None:
        self._current = decision
        self._wake_watcher(_MOVED)

    # -- the first world and joiners ---------------------------------------------------------------
    def start(self, rank: int, size: int) -> Decision:
        """Generation 0: the launch's world (every rank calls this with its launch rank and size)."""
        self._set(f"{_PREFIX}/host/{self.member}", self.host)
        # The job's nonce, which a joiner's proof covers: the first rank to get here draws it.
        self._call(lambda: self.store.compare_set(f"{_PREFIX}/job", "", job_secret.job_nonce()), "naming the job")
        self.current = Decision(0, list(range(size)), rank, reason="launch")
        return self.current

    @classmethod
    def as_joiner(cls, store, host: str, timeout: float, grace: float = 1.0, secret: str = "") -> "Membership":
        """A process that will join a running job: it takes the next joiner id (it asks to be
        admitted in ``wait_admitted``, once it is ready to take part). Without the job's secret it
        asks nothing: ``DDLError`` says why, and the job never hears of it."""
        if not secret:
            raise DDLError(f"elastic joiner on {host}: DDL_JOB_SECRET is not set: a running job admits only a "
                           "process that proves it holds the job's secret (give it the value every process of "
                           "the job was started with; ddlrun draws one for its ranks)")
        probe = cls(store, -1, host, timeout, grace)
        n = probe._call(lambda: store.add(f"{_PREFIX}/joiners", 1), "taking a joiner id")
        self = cls(store, JOINER_BASE + n - 1, host, timeout, grace, secret)
        self._set(f"{_PREFIX}/host/{self.member}", host)
        return self

    def wait_admitted(self, deadline_s: float) -> Decision:
        """Block until a generation admits this joiner (the members admit joiners at their next
        ``state.commit()``); raise ``DDLError`` if none does within ``deadline_s`` seconds. Each round
        it says it is here for the generation after the latest; a generation decided without it (it
        came too late) only means it waits for the next one."""
        from ..errors import DDLError

        end = time.monotonic() + deadline_s
        first = None
        request = json.dumps({"proof": job_secret.proof(self._secret, self._job(end), self.member)})
        while time.monotonic() < end:
            self._raise_if_refused()
            latest = self._latest_generation()
            if first is None:
                first = latest + 1
            self._set(f"{_PREFIX}/g{latest + 1}/here/{self.member}", "1")
            if first == latest + 1 and not self._call(lambda: self.store.check([f"{_PREFIX}/join/{self.member}"]),
                                                     "asking to join"):
                # Here first: the members, who wait for a joiner they were told of, then find it at once.
                self._set(f"{_PREFIX}/join/{self.member}", request)
            for g in range(first, latest + 2):  # every generation since this joiner asked: one may admit it
                members = self._members_of(g)
                if members is not None and self.member in members:
                    self.current = decision = self._decision(g, members, None, "grow")
                    # Which members joined with this one (never a source of the state: state.py), as the
                    # members see it: those not in generation g - 1 (the launch's ids, when that is 0).
                    before = self._members_of(g - 1) if g > 1 else [m for m in members if m < JOINER_BASE]
                    decision.joined = [m for m in members if m not in (before or [])]
                    return decision
            first = max(first, latest)
            time.sleep(_POLL_S * 2)
        self._set(f"{_PREFIX}/gone/{self.member}", "1")
        raise DDLError(f"joiner {self.member} on {self.host}: not admitted into the running job within "
                       f"{deadline_s:g} s: its ranks admit joiners at state.commit(), so a job that commits "
                       "rarely (or has ended) leaves a joiner waiting; raise DDL_TIMEOUT or commit more often")

    def pending_joiners(self) -> list[int]:
        """Member ids that asked to join, proved they hold the job's secret and are in no world yet
        (rank 0 polls this at each commit). A request whose proof does not hold is refused here,
        once: ``refused/<id>`` tells the joiner why, and it is never counted again."""
        n = int(self._call(lambda: self.store.add(f"{_PREFIX}/joiners", 0), "counting joiners"))
        inside = set(self.current.members) if self.current else set()
        asked = [JOINER_BASE + i for i in range(min(n, _MAX_MEMBERS)) if JOINER_BASE + i not in inside]
        asked = [j for j in asked if self._verdicts.get(j, "") == "" and
                 self._call(lambda j=j: self.store.check([f"{_PREFIX}/join/{j}"]) and
                            not self.store.check([f"{_PREFIX}/gone/{j}"]), "counting joiners")]
        return [j for j in asked if self._admissible(j)]

    def _admissible(self, joiner: int) -> bool:
        """Whether ``joiner``'s request proves it holds the job's secret; a request that does not is
        refused (once, in the store, with the reason) and said on stderr."""
        if joiner not in self._verdicts:
            self._verdicts[joiner] = why = self._judge(joiner)
            if why:
                self._set(f"{_PREFIX}/refused/{joiner}", why[:300])
                self._set(f"{_PREFIX}/gone/{joiner}", "1")
                rank = self.current.rank if self.current else "?"
                print(f"ddl_triton elastic: rank {rank}: refused joiner {joiner} on "
                      f"{self.host_of(joiner)}: {why}", file=sys.stderr, flush=True)
        return self._verdicts[joiner] == ""

    def _judge(self, joiner: int) -> str:
        """"" when ``joiner``'s request carries a proof that holds, else why it is refused."""
        if not self._secret:
            return ("this job was started without DDL_JOB_SECRET, so it admits no joiner (start every process "
                    "of a job that may grow with the same DDL_JOB_SECRET)")
        raw = self._call(lambda: self.store.get(f"{_PREFIX}/join/{joiner}"), f"reading joiner {joiner}'s request")
        try:
            claimed = json.loads(raw.decode()).get("proof")
        except (UnicodeDecodeError, ValueError, AttributeError):
            claimed = None
        if not job_secret.holds(self._secret, self._job(time.monotonic() + self.timeout), joiner, claimed):
            return ("its proof of the job's secret does not hold: its DDL_JOB_SECRET is not the one this job was "
                    "started with")
        return ""

    def _job(self, end: float) -> str:
        """The job's nonce (the members publish it at start), waiting for it until ``end``."""
        key = f"{_PREFIX}/job"
        while not self._call(lambda: self.store.check([key]), "reading the job's nonce"):
            if time.monotonic() >= end:
                raise DDLError(f"member {self.member} on {self.host}: elastic: the job's store holds no job "
                               "(no member has started there): is MASTER_ADDR/MASTER_PORT the running job's?")
            time.sleep(_POLL_S)
        raw = self._call(lambda: self.store.get(key), "reading the job's nonce")
        return raw.decode(errors="replace")[:job_secret.NONCE_HEX]

    def _raise_if_refused(self) -> None:
        key = f"{_PREFIX}/refused/{self.member}"
        if self._call(lambda: self.store.check([key]), "asking to join"):
            why = self._call(lambda: self.store.get(key), "asking to join").decode(errors="replace")[:300]
            raise DDLError(f"joiner {self.member} on {self.host}: the running job refused to admit this process: "
                           f"{why}")

    # -- ending a generation --------------------------------------------------------------------------
    def revoke(self, reason: str) -> None:
        """Tell every process that the current generation failed (the first reason stays)."""
        failure_notice.revoke(reason)
        current = self.current
        g = current.generation
        mine = json.dumps([self.member, reason[:300]])
        first = self._call(lambda: self.store.compare_set(f"{_PREFIX}/g{g}/revoked", "", mine),
                           f"revoking generation {g}")
        # One process tells every member (one request, whatever the world's size): the first to revoke,
        # or a later one that finds its own notice missing (the first may have died in between).
        if first != mine.encode() and self._call(lambda: self.store.check([notice_key(g, self.member)]),
                                                 f"revoking generation {g}"):
            pass
        else:
            keys = [notice_key(g, m) for m in current.members]
            self._call(lambda: self.store.multi_set(keys, [first.decode(errors="replace")] * len(keys)),
                       f"revoking generation {g}")
        self.say_here()

    def mark_gone(self, members: list[int]) -> None:
        """Tell the others that these members of the current generation have ended (their process
        exited, their sockets closed): nobody waits the grace for their word."""
        nxt = self.current.generation + 1
        for m in members:
            self._call(lambda m=m: self.store.set(f"{_PREFIX}/g{nxt}/gone/{m}", "1"), f"noting member {m} gone")
            self._call(lambda m=m: self.store.append(f"{_PREFIX}/g{nxt}/word", f"-{m},"), f"noting member {m} gone")
            self._account(nxt, m)

    def say_here(self) -> None:
        """Post that this process is alive and will take part in the next generation (idempotent)."""
        nxt = self.current.generation + 1
        with self._lock:
            if nxt in self._said_here:
                return
            self._said_here.add(nxt)
        what = f"saying this rank is alive for generation {nxt}"
        self._call(lambda: self.store.set(f"{_PREFIX}/g{nxt}/here/{self.member}", "1"), what)
        self._call(lambda: self.store.append(f"{_PREFIX}/g{nxt}/word", f"+{self.member},"), what)
        self._account(nxt, self.member)

    def _account(self, nxt: int, member: int) -> None:
        """Count ``member`` of the current generation as answered for generation ``nxt`` (here or
        gone, once however many say it); whoever counts the last one writes ``ready``: the members
        block on that key instead of reading one key per member."""
        current = self.current
        if member not in current.members:
            return
        what = f"agreeing on generation {nxt}"
        if self._call(lambda: self.store.add(f"{_PREFIX}/g{nxt}/answered/{member}", 1), what) == 1 and \
                self._call(lambda: self.store.add(f"{_PREFIX}/g{nxt}/answered", 1), what) == len(current.members):
            self._call(lambda: self.store.set(f"{_PREFIX}/g{nxt}/ready", "all"), what)

    # -- deciding the next generation -----------------------------------------------------------------
    def agree(self, reason: str, min_size: int = 1) -> Decision:
        """Decide generation G+1 with the other live processes (see the module doc) and return it.

        Raises ``ExcludedFromWorld`` when it was decided without this process, ``PeersLost`` when it
        has fewer than ``min_size`` members, ``CoordinatorLost`` when the store cannot be reached."""
        old = self.current
        g = old.generation + 1
        self.say_here()
        members = self._members_of(g)
        if members is None:
            members = self._propose(old, g)
        self.current = decision = self._decision(g, members, old, reason)
        if self.member not in members:
            raise ExcludedFromWorld(
                f"rank {old.rank} (member {self.member} on {self.host}): the job went on without this rank "
                f"at generation {g} (world of {len(members)}): it was stopped or cut off while the others "
                "decided. It leaves the job untouched and exits; start it again to join as a new host")
        self._set(f"{_PREFIX}/generation", str(g))
        if decision.size < min_size:
            raise PeersLost(f"rank {decision.rank}: elastic job: lost {_ranks_on(decision)}; {decision.size} "
                            f"rank(s) remain, fewer than min_size={min_size}: the job ends")
        return decision

    def _propose(self, old: Decision, g: int) -> list[int]:
        """Wait for the others' word (at most ``grace`` after the first arrival, ``timeout`` in all),
        then propose who answered (one process does; the others read its list); return the list that won."""
        joiners = [j for j in self.pending_joiners() if j not in old.members]
        end = time.monotonic() + self.timeout
        ready = f"{_PREFIX}/g{g}/ready"
        # Everyone's word, or the grace of the first to get here: its timer writes ``ready`` for all.
        timer = threading.Timer(self.grace, self._grace_ended, args=(ready,))
        timer.daemon = True
        timer.start()
        try:
            self._wait(ready, end)
        finally:
            timer.cancel()
        decided = self._members_of(g)
        if decided is not None:
            return decided
        if self._call(lambda: self.store.add(f"{_PREFIX}/g{g}/proposers", 1), f"deciding generation {g}") != 1:
            # Another proposes: wait for its list, and propose too if it never comes (it died meanwhile).
            if self._wait(f"{_PREFIX}/g{g}/members", min(end, time.monotonic() + self.grace)):
                decided = self._members_of(g)
                if decided is not None:
                    return decided
        present = self._answered(g, old, joiners, min(end, time.monotonic() + self.grace))
        won = _member_list(self._call(lambda: self.store.compare_set(f"{_PREFIX}/g{g}/members", "", json.dumps(present)),
                                      f"deciding generation {g}"), f"generation {g}'s members")
        self._set(ready, "decided")  # late arrivals still blocked on it read the decided list at once
        for member in joiners:
            if member not in won:  # silent through an agreement: never waited for again
                self._set(f"{_PREFIX}/gone/{member}", "1")
        return won

    def _grace_ended(self, ready: str) -> None:
        try:
            self._call(lambda: self.store.compare_set(ready, "", "grace"), "ending the grace")
        except CoordinatorLost:
            pass  # the main thread's wait says so

    def _answered(self, g: int, old: Decision, joiners: list[int], until: float) -> list[int]:
        """The members of ``old`` that said they are here for ``g`` (one read of the appended word),
        then the pending joiners that did (each waited for until ``until``), in that order."""
        raw = self._call(lambda: self.store.get(f"{_PREFIX}/g{g}/word"), f"agreeing on generation {g}")
        here = set()
        for token in raw.decode(errors="replace").split(",")[:4 * _MAX_MEMBERS]:
            if token.startswith("+") and token[1:].isdigit():
                here.add(int(token[1:]))
            elif not (token == "" or token.startswith("-") and token[1:].isdigit()):
                raise CoordinatorLost(f"elastic job: the store holds a malformed answer for generation {g} "
                                      f"({token[:50]!r}); the store is the job's own, so something else writes to it")
        present = [m for m in old.members if m in here]
        return present + [j for j in joiners if self._wait(f"{_PREFIX}/g{g}/here/{j}", until)]

    def _decision(self, g: int, members: list[int], old: Decision | None, reason: str) -> Decision:
        rank = members.index(self.member) if self.member in members else -1
        if old is None:
            return Decision(g, members, rank, reason=reason)
        lost = [r for r, m in enumerate(old.members) if m not in members]
        joined = [m for m in members if m not in old.members]
        hosts = [self.host_of(old.members[r]) for r in lost]
        return Decision(g, members, rank, lost, hosts, joined, reason)

    # -- the store -----------------------------------------------------------------------------------------
    def _members_of(self, g: int) -> list[int] | None:
        key = f"{_PREFIX}/g{g}/members"
        if not self._call(lambda: self.store.check([key]), f"reading generation {g}"):
            return None
        return _member_list(self._call(lambda: self.store.get(key), f"reading generation {g}"),
                            f"generation {g}'s members")

    def _latest_generation(self) -> int:
        key = f"{_PREFIX}/generation"
        if not self._call(lambda: self.store.check([key]), "reading the generation"):
            return 0
        raw = self._call(lambda: self.store.get(key), "reading the generation")
        try:
            return max(0, int(raw.decode()[:12]))
        except ValueError:
            return 0

    def host_of(self, member: int) -> str:
        """The host name ``member`` posted when it started ("?" where unknown or the store is gone:
        this only names hosts in messages)."""
        if member not in self._hosts:
            key = f"{_PREFIX}/host/{member}"
            try:
                raw = self._call(lambda: self.store.get(key) if self.store.check([key]) else b"?",
                                 f"reading member {member}'s host")
            except CoordinatorLost:
                raw = b"?"
            self._hosts[member] = raw.decode(errors="replace")[:100].split("|")[0]
        return self._hosts[member]

def _member_list(raw: bytes, what: str) -> list[int]:
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        value = None
    if not isinstance(value, list) or len(value) > _MAX_MEMBERS or \
            not all(isinstance(m, int) and not isinstance(m, bool) and m >= 0 for m in value):
        raise CoordinatorLost(f"elastic job: the store holds a malformed {what} ({raw[:100]!r}); the store is the "
                              "job's own, so something else writes to it")
    return value


def _ranks_on(d: Decision) -> str:
    if not d.lost:
        return "no rank"
    return ", ".join(f"rank {r} on {h}" for r, h in zip(d.lost, d.lost_hosts))
