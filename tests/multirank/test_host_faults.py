"""Faults across real hosts (tests/support/host_faults.py on the testbed): a link cut either way or
one way, a whole host killed, one far rank killed, and a link that only turns slow, under ddlrun
(MPI between hosts) and under torchrun (gloo between hosts), 2 hosts x 2 ranks, DDL_TIMEOUT=5.

For every fault, within the deadline and a few seconds, on both sides: every rank that was not
killed raises a CollectiveTimeout naming a rank and its host (or, under torchrun, is ended by its
host's agent once a rank there failed; but at least one rank of h1, the side that survives every
fault, must have raised it: support/host_faults.problems), every rank ran in a world of 4 (the
testbed gives each host its own PID namespace, as real hosts have), every rank's process is gone, the launchers exit non-zero,
and no host's /dev/shm keeps a segment. The slow link is no error: the job finishes, exact, exit 0.
The jobs run at once, each on a testbed of its own, so that their deadlines overlap. Skipped, with the reason, where the machine cannot build hosts."""
from __future__ import annotations

import re
import threading

import pytest

from ddl_triton.testbed import reap
from support.host_faults import FaultRun, problems, run_fault
from support.real_hosts import UNAVAILABLE as _UNAVAILABLE

TIMEOUT_S = 5.0
SLACK_S = 4.0      # past the deadline, for a rank to report and exit (2 busy cores, 16 ranks at once)
ENDED_S = 15.0     # past the deadline, for every launcher to end (ddlrun's settle, torchrun's agents)
# The full cut ("cut") is in bench/faults_across_hosts.py's table; here each one-way cut stands for it.
SCENARIOS = [("ddlrun", f) for f in ("cut-up", "cut-down", "kill-host", "kill-rank", "slow")] + \
    [("torchrun", f) for f in ("cut-up", "kill-host", "kill-rank")]
WAVES = 1



@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], FaultRun]:
    if _UNAVAILABLE:
        pytest.skip(_UNAVAILABLE)
    reap()
    done: dict[tuple[str, str], FaultRun | BaseException] = {}

    def one(launcher: str, fault: str) -> None:
        try:
            done[(launcher, fault)] = run_fault(fault, launcher, timeout_s=TIMEOUT_S)
        except BaseException as e:  # the test of this scenario reports it
            done[(launcher, fault)] = e

    per_wave = -(-len(SCENARIOS) // WAVES)
    for w in range(WAVES):
        threads = [threading.Thread(target=one, args=s) for s in SCENARIOS[w * per_wave:(w + 1) * per_wave]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return done


def _story(run: FaultRun) -> str:
    lines = [f"{run.launcher} {run.fault}: exit {run.exit_codes}, forced {run.forced}, ended after "
             f"{run.ended_after_s}, ranks gone after {run.ranks_gone_after_s}, shm left {run.shm_left}"]
    lines += [f"  rank {r}: {e}" for r, e in sorted(run.ranks.items())]
    return "\n".join(lines) + "\n" + run.output


def _named(error: str) -> set[tuple[int, str]]:
    """The (rank, host) pairs an error names: "rank 2 on h2", "rank(s) 2, 3 on h2"."""
    return {(int(r), host) for ranks, host in re.findall(r"rank(?:\(s\))? ([\d, ]+) on (h\d)", error)
            for r in ranks.replace(",", " ").split()}


@pytest.mark.parametrize("launcher,fault", SCENARIOS, ids=[f"{a}-{b}" for a, b in SCENARIOS])
def test_a_fault_across_hosts_ends_every_rank_clearly_at_the_deadline(runs, launcher, fault):
    run = runs[(launcher, fault)]
    if isinstance(run, BaseException):
        raise run
    story = _story(run)
    # Every rank ran, in a world of 4, exact until its end; and the surviving side (h1) raised the
    # expected error: a run where no survivor said anything fails here, under either launcher.
    assert not problems(run, size=4), "\n".join(problems(run, size=4)) + "\n" + story
    assert all(not left for left in run.shm_left.values()) and "h1" in run.shm_left, story
    assert run.ranks_gone_after_s is not None, story
    if fault == "slow":  # 10 Mbit/s is slow, not lost
        assert list(run.exit_codes.values()) == [0] * len(run.exit_codes) and not run.forced, story
        assert all(e.recorded and e.error is None and e.done > 1 for e in run.ranks.values()), story
        assert len({e.done for e in run.ranks.values()}) == 1, story
        return
    assert run.ranks_gone_after_s < TIMEOUT_S + SLACK_S, story
    killed = {r for r, e in run.ranks.items() if e.host == "h2"} if fault == "kill-host" else {run.victim} - {None}
    for r, end in run.ranks.items():
        if r in killed:
            assert not end.recorded, story
            continue
        if not end.recorded:
            # torchrun's agent ends its host's ranks once the job failed elsewhere (its fail-fast:
            # a rank of its own exited, or the other host's agent closed the rendezvous store),
            # which may come before their own deadline; they are gone in time (checked above).
            assert launcher == "torchrun", story
            continue
        assert end.error.startswith("CollectiveTimeout: "), story
        assert end.after_s < TIMEOUT_S + SLACK_S, story
        assert _named(end.error), story  # names a rank and its host
    if fault == "kill-rank":  # some rank names the one killed (alone, or among its host's), with its host
        lost = {(run.victim, "h2")}
        if launcher == "torchrun":
            # torchrun's agent on h2 ends the victim's host mates at once (SIGTERM), so the far side may
            # see a mate's connection close first and truthfully name that rank, lost as well.
            lost = {(r, "h2") for r, e in run.ranks.items() if e.host == "h2"}
        assert any(lost & _named(e.error) for e in run.ranks.values() if e.recorded), story
    else:  # each side names a rank of the other host (a rank may also name a peer of its own host
        # that gave up first: the wait it was in when that peer exited). h1 survives every fault and
        # must say so (problems() requires its errors); h2's ranks, where they lived to record one.
        for host, other in (("h1", "h2"), ("h2", "h1")):
            errors = [e.error for e in run.ranks.values() if e.host == host and e.recorded]
            assert (errors or host == "h2") and (not errors or any(f"on {other}" in e for e in errors)), story
    if launcher == "ddlrun":
        assert run.exit_codes["h1"] != 0 and not run.forced, story
        assert run.ended_after_s < TIMEOUT_S + ENDED_S, story
        if fault == "kill-rank":
            assert run.exit_codes["h1"] == 137, story  # the killed rank's 128 + SIGKILL
        if fault == "kill-host":
            assert "ddlrun: ranks whose guard fell silent, their host gone or cut off (h2): rank 2" in run.output, story
        return
    # torchrun: each host's agent exits non-zero (but see docs/testbed.md: the agent of a host cut
    # off both ways from the rendezvous store waits in a TCPStore call until TCP gives up).
    waited_for = {h: code for h, code in run.exit_codes.items() if h not in run.forced}
    assert waited_for.get("h1", 0) != 0, story
    assert all(code != 0 for code in waited_for.values()), story
    assert not run.forced, story
