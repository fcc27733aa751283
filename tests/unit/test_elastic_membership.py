"""The membership agreement of elastic jobs (ddl_triton/elastic/membership.py), in one process: members
are Membership objects on one in-memory store, each agreeing on its own thread as a process would.

What must hold: every member that takes part in a generation learns the same list; a silent member
is left out after the grace; a member that comes back later is told it was excluded; joiners are
admitted; a world below min_size ends with PeersLost naming the lost ranks; a store that fails or
holds garbage is an error, never a world."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch.distributed as dist

from ddl_triton.errors import CoordinatorLost, ExcludedFromWorld, PeersLost
from ddl_triton.errors import DDLError
from ddl_triton import job_secret
from ddl_triton.elastic.membership import JOINER_BASE, Membership
from ddl_triton.transports import failure_notice


@pytest.fixture(autouse=True)
def _no_revocation_left():
    yield
    failure_notice.clear_revocation()


SECRET = "the job's secret, 32 chars long"


def _members(store, size: int, grace: float = 0.3, timeout: float = 10.0, secret: str = SECRET) -> list[Membership]:
    out = []
    for rank in range(size):
        m = Membership(store, rank, f"h{rank}", timeout, grace, secret)
        m.start(rank, size)
        out.append(m)
    return out


def _agree_all(members: list[Membership], reason: str = "lost", min_size: int = 1) -> dict[int, object]:
    """Each member agrees on its own thread; returns member id -> its Decision or the error it raised."""
    results: dict[int, object] = {}

    def one(m: Membership) -> None:
        try:
            results[m.member] = m.agree(reason, min_size)
        except Exception as e:  # noqa: BLE001 - the test reads it
            results[m.member] = e

    threads = [threading.Thread(target=one, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_survivors_agree_on_one_world_without_the_silent_member():
    store = dist.HashStore()
    ms = _members(store, 4)
    start = time.monotonic()
    got = _agree_all([ms[0], ms[1], ms[3]])  # member 2 never answers (dead, cut off, stopped)
    took = time.monotonic() - start
    lists = {tuple(d.members) for d in got.values()}
    assert lists == {(0, 1, 3)}, got
    assert [got[m].rank for m in (0, 1, 3)] == [0, 1, 2]  # renumbered in the old order
    assert all(got[m].lost == [2] and got[m].lost_hosts == ["h2"] and got[m].generation == 1 for m in (0, 1, 3))
    assert 0.3 <= took < 5, took  # waited the grace for member 2, no longer than the deadline allows
    # Member 2 comes back (SIGCONT, the link mended): the world was decided without it.
    with pytest.raises(ExcludedFromWorld, match="rank 2 .*generation 1"):
        ms[2].agree("lost")


def test_a_member_known_gone_is_not_waited_for():
    """A survivor that saw a member's process end (its sockets closed, its pid gone) says so: the
    others decide as soon as every other member has answered, not after the grace."""
    store = dist.HashStore()
    ms = _members(store, 3, grace=20.0)
    ms[0].mark_gone([2])
    start = time.monotonic()
    got = _agree_all([ms[0], ms[1]])
    assert {tuple(d.members) for d in got.values()} == {(0, 1)} and got[0].lost == [2]
    assert time.monotonic() - start < 5  # not the 20 s grace


def test_a_member_marked_gone_that_answers_stays_in():
    """A wrong "gone" (the member was alive after all) costs nothing once it has answered."""
    store = dist.HashStore()
    ms = _members(store, 3, grace=0.3)
    ms[0].mark_gone([2])
    ms[2].say_here()  # as its watcher does at once: it had answered before anyone decided
    got = _agree_all(ms)
    assert {tuple(d.members) for d in got.values()} == {(0, 1, 2)}


def test_every_member_present_decides_without_waiting_the_grace():
    store = dist.HashStore()
    ms = _members(store, 3, grace=20.0)
    start = time.monotonic()
    got = _agree_all(ms, reason="grow")
    assert {tuple(d.members) for d in got.values()} == {(0, 1, 2)}
    assert time.monotonic() - start < 5  # all answered: nobody waits for the 20 s grace


def test_two_proposals_one_world():
    """Two survivors that saw different members answer still build the same world: the first
    proposal written wins, and the other reads it back."""
    store = dist.HashStore()
    a, b, c = _members(store, 3, grace=0.05)
    a.say_here()
    first = a.agree("lost")          # proposes [0] alone: b and c had not answered within the grace
    b.say_here()
    c.say_here()
    assert first.members == [0]
    with pytest.raises(ExcludedFromWorld):
        b.agree("lost")              # its own view would be [0, 1, 2]; the decided world is [0]
    # The race itself: c proposes before it could see a's decision (the read and the write are
    # two store calls); the store keeps the first proposal, and c reads that back.
    c._members_of = lambda g, real=c._members_of: None if g == 1 else real(g)
    with pytest.raises(ExcludedFromWorld):
        c.agree("lost")
    assert store.get("ddl_triton/elastic/g1/members") == b"[0]"


def test_too_few_survivors_end_the_job_naming_the_lost():
    store = dist.HashStore()
    ms = _members(store, 3)
    got = _agree_all([ms[0]], min_size=2)
    assert isinstance(got[0], PeersLost), got
    assert "rank 1 on h1" in str(got[0]) and "rank 2 on h2" in str(got[0]) and "min_size=2" in str(got[0])


def test_a_joiner_is_admitted_at_the_next_change_and_numbered_last():
    store = dist.HashStore()
    ms = _members(store, 2, grace=2.0)
    joiner = Membership.as_joiner(store, "h9", timeout=10.0, grace=2.0, secret=SECRET)
    assert joiner.member == JOINER_BASE
    admitted = {}
    waiting = threading.Thread(target=lambda: admitted.setdefault("d", joiner.wait_admitted(10.0)))
    waiting.start()
    deadline = time.monotonic() + 10
    while not ms[0].pending_joiners() and time.monotonic() < deadline:  # what rank 0 checks at a commit
        time.sleep(0.02)
    assert ms[0].pending_joiners() == [JOINER_BASE]
    got = _agree_all(ms, reason="grow")
    waiting.join(15)
    assert got[0].members == got[1].members == admitted["d"].members == [0, 1, JOINER_BASE]
    assert admitted["d"].rank == 2 and got[0].joined == [JOINER_BASE]
    assert ms[0].pending_joiners() == []  # admitted: no longer waiting


def test_a_joiner_that_never_shows_up_is_not_waited_for_again():
    store = dist.HashStore()
    ms = _members(store, 2, grace=0.2)
    ghost = Membership.as_joiner(store, "h9", timeout=10.0, secret=SECRET)
    request = json.dumps({"proof": job_secret.proof(SECRET, store.get("ddl_triton/elastic/job").decode(), ghost.member)})
    store.set(f"ddl_triton/elastic/join/{ghost.member}", request)  # asked, then died before saying it was here
    assert ms[0].pending_joiners() == [ghost.member]
    got = _agree_all(ms, reason="grow")
    assert got[0].members == [0, 1]
    assert ms[0].pending_joiners() == []


def test_a_revocation_reaches_every_process_through_its_watcher():
    store = dist.HashStore()
    (b,) = [m for m in _members(store, 2) if m.member == 1]
    b.watch()
    try:
        # What another process's revoke() writes: the reason, and a notice to each member, which its
        # watcher blocks on (in this process it would also revoke b's waits itself).
        store.set("ddl_triton/elastic/g0/revoked", '[0, "rank 0: allreduce #7 failed: rank 1 died"]')
        store.multi_set(["ddl_triton/elastic/g0/tell/0", "ddl_triton/elastic/g0/tell/1"],
                        ['[0, "rank 0: allreduce #7 failed: rank 1 died"]'] * 2)
        deadline = time.monotonic() + 5
        while not store.check(["ddl_triton/elastic/g1/here/1"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.check(["ddl_triton/elastic/g1/here/1"])  # b's watcher said b is alive
        assert "allreduce #7 failed" in failure_notice.revoked()[1]  # and b's waits give up
    finally:
        b.close()


def test_garbage_in_the_store_is_refused_not_built():
    store = dist.HashStore()
    (a,) = _members(store, 1)
    store.set("ddl_triton/elastic/g1/members", "__import__('os').system('id')")
    with pytest.raises(CoordinatorLost, match="malformed"):
        a.agree("lost")


class _GoneStore:
    """A store whose server went away: every call fails as torch's TCPStore client does."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")
        return fail


def test_a_lost_store_is_the_coordinator_lost():
    m = Membership(_GoneStore(), 1, "h1", 5.0)
    with pytest.raises(CoordinatorLost, match="lost the store .*coordinator"):
        m.start(1, 2)


class _BrokenStore:
    """A TCPStore client whose server died: DistNetworkError on every call, whose text torch follows
    with its C++ frames (and, on stderr, a ~15-line warning per failed call: the cost counted here)."""

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            self.calls += 1
            raise dist.DistNetworkError("Broken pipe\nException raised from sendBytes at Utils.hpp:758\n"
                                        "frame #0: c10::Error::Error(...)")
        return fail


def test_a_broken_store_client_is_called_once_and_the_coordinator_lost_leads_with_its_cause():
    """Once torch's client broke (it never reconnects), neither the watcher's polls nor the rank's own
    calls touch it again: the job ended under about 90 lines of C++ frames, one warning per poll."""
    from ddl_triton.elastic.membership import Decision

    store = _BrokenStore()
    m = Membership(store, 1, "h1", timeout=5.0)
    m.current = Decision(0, [0, 1], 1)
    m.watch()
    try:
        time.sleep(0.6)  # a dozen of the watcher's polls
        assert store.calls == 1, f"the watcher kept calling a broken store: {store.calls} calls"
        with pytest.raises(CoordinatorLost) as lost:
            m.revoke("rank 1: allreduce #3 failed: rank 0 on h0 died")
        assert store.calls == 1  # said at once, from what broke it
        text = str(lost.value)
        assert text.startswith("member 1 on h1: elastic job: lost the store (") and "Broken pipe" in text
        assert len(text.splitlines()) == 1 and "frame #" not in text
    finally:
        m.close()


class _SilentStore:
    """A store across a link cut both ways: torch's TCPStore client then blocks in check/get/compare_set
    past its own timeout (seen for 15 s past a 2 s timeout)."""

    def __getattr__(self, name):
        def hang(*args, **kwargs):
            threading.Event().wait(60)
        return hang


def test_a_store_that_never_answers_ends_the_rank_at_the_deadline():
    m = Membership(_SilentStore(), 1, "h1", timeout=0.5)
    m.current = __import__("ddl_triton.elastic.membership", fromlist=["Decision"]).Decision(0, [0, 1], 1)
    start = time.monotonic()
    with pytest.raises(CoordinatorLost, match="did not answer within 0.5 s .*cut off"):
        m.revoke("rank 1: allreduce #3 timed out")
    assert time.monotonic() - start < 3


def test_a_wait_that_begins_less_than_a_millisecond_before_its_end_returns_then(monkeypatch):
    """torch's stores count waits in whole milliseconds and take 0 ms as "no limit": a wait begun
    0.4 ms before its end once blocked until the job's deadline (the grace's joiner wait, under load)."""
    from ddl_triton.elastic import store_calls
    m = Membership(dist.HashStore(), 0, "h0", timeout=5.0)
    m._blocking_client()
    readings = iter([100.0 - 0.0004])  # the clock as the wait reads it: 0.4 ms left, then past its end
    monkeypatch.setattr(store_calls.time, "monotonic", lambda: next(readings, 101.0))
    start = time.perf_counter()
    assert m._wait("ddl_triton/elastic/never", 100.0) is False  # not CoordinatorLost at the deadline
    assert time.perf_counter() - start < 2.0  # not the 5 s deadline


# ---- who may join: only a process that proves it holds the job's secret ------------------------------
def _ask(store, secret: str, timeout: float = 5.0) -> tuple[Membership, dict]:
    """A joiner asking on its own thread; the dict gets its Decision or its error."""
    joiner = Membership.as_joiner(store, "h9", timeout=timeout, secret=secret)
    out: dict = {}

    def wait():
        try:
            out["decision"] = joiner.wait_admitted(timeout)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["error"] = e
    threading.Thread(target=wait, daemon=True).start()
    return joiner, out


def _until(cond, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)


@pytest.mark.parametrize("members_secret, joiner_secret, why", [
    (SECRET, "another secret, 32 characters..", "its DDL_JOB_SECRET is not the one this job was started with"),
    ("", SECRET, "this job was started without DDL_JOB_SECRET, so it admits no joiner"),
])
def test_a_joiner_without_the_jobs_secret_is_refused_and_the_members_go_on(members_secret, joiner_secret, why,
                                                                            capfd):
    store = dist.HashStore()
    ms = _members(store, 2, grace=0.2, secret=members_secret)
    joiner, out = _ask(store, joiner_secret)
    _until(lambda: store.check([f"ddl_triton/elastic/join/{joiner.member}"]))
    assert ms[0].pending_joiners() == []          # refused: nothing for the members to admit
    _until(lambda: "error" in out)
    assert isinstance(out.get("error"), DDLError) and "refused to admit this process" in str(out["error"]) \
        and why in str(out["error"]), out
    assert f"refused joiner {joiner.member} on h9: " in capfd.readouterr().err
    got = _agree_all(ms, reason="grow")           # a later change of the world does not wait for it
    assert got[0].members == got[1].members == [0, 1]


def test_a_joiner_with_no_secret_asks_nothing():
    store = dist.HashStore()
    _members(store, 2)
    with pytest.raises(DDLError, match="DDL_JOB_SECRET is not set"):
        Membership.as_joiner(store, "h9", timeout=5.0, secret="")
    assert store.add("ddl_triton/elastic/joiners", 0) == 0  # the job never heard of it


def test_a_proof_serves_one_member_of_one_job():
    store = dist.HashStore()
    ms = _members(store, 2)
    job = store.get("ddl_triton/elastic/job").decode()
    good = job_secret.proof(SECRET, job, JOINER_BASE)
    assert job_secret.holds(SECRET, job, JOINER_BASE, good)
    assert not job_secret.holds(SECRET, job, JOINER_BASE + 1, good)          # copied to another id
    assert not job_secret.holds(SECRET, "0" * 32, JOINER_BASE, good)         # replayed in another job
    assert not job_secret.holds("x" * 32, job, JOINER_BASE, good)            # checked with another secret
    altered = good[:-1] + ("1" if good.endswith("0") else "0")  # never the proof itself (it may end in "0")
    assert not job_secret.holds(SECRET, job, JOINER_BASE, altered)
    assert not job_secret.holds(SECRET, job, JOINER_BASE, None) and not job_secret.holds("", job, JOINER_BASE, good)
    # A request copied from a real joiner's key to a second id is refused; the real one is admitted.
    real = Membership.as_joiner(store, "h8", timeout=5.0, secret=SECRET)
    thief = Membership.as_joiner(store, "h9", timeout=5.0, secret="a thief's guess, 32 characters!")
    store.set(f"ddl_triton/elastic/join/{real.member}", json.dumps({"proof": job_secret.proof(SECRET, job, real.member)}))
    store.set(f"ddl_triton/elastic/join/{thief.member}", store.get(f"ddl_triton/elastic/join/{real.member}"))
    assert ms[0].pending_joiners() == [real.member]
    assert store.check([f"ddl_triton/elastic/refused/{thief.member}"])
