"""Waits give the CPU back: a long wait must not burn a core the application computes on.

transports/waits.py: a wait spins briefly, then yields; a background thread's wait (a
communicator's, overlapping DDP's backward) naps right after its spin where its peer wakes it,
and any wait naps after 1 ms of yielding while every core of the host has a runnable thread.
A background wait naps after 100 us of yielding even where a core is spare, and a polled one
naps longer as it lasts (up to 1 ms, never past an eighth of the wait so far).
These tests wait half a second for a condition and look at the CPU time the waiting thread
used: a spinning or yielding wait uses nearly all of it. Where a core is spare, a timed wait on
the application thread keeps yielding (a napping wait answers late, once per round trip of a
two-sided protocol).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from ddl_triton.transports import waits
from ddl_triton.transports.waits import PeerTimeout, run_in_background, wait_until

WAIT_S = 0.5


def _wait_in_thread(background: bool, ready_after: float, sleep=None, prompt: bool = False) -> tuple[float, float]:
    """(CPU seconds the waiting thread used, wall seconds it waited)."""
    out = {}

    def waiter():
        if background:
            run_in_background()
        cpu0, t0 = time.thread_time(), time.monotonic()
        ready_at = t0 + ready_after  # from the wait's start: a loaded host may start the thread late
        wait_until(lambda: time.monotonic() >= ready_at, 10.0, 1, "a test condition", sleep=sleep, prompt=prompt)
        out["cpu"], out["wall"] = time.thread_time() - cpu0, time.monotonic() - t0

    t = threading.Thread(target=waiter)
    t.start()
    t.join()
    return out["cpu"], out["wall"]


@pytest.mark.parametrize("woken", [True, False], ids=["woken naps", "timed naps"])
@pytest.mark.parametrize("background", [True, False], ids=["background thread", "application thread"])
def test_a_long_wait_naps_instead_of_using_the_core(background, woken, monkeypatch):
    monkeypatch.setattr(waits, "_host_has_a_spare_core", lambda: False)  # every core is busy
    cpu, wall = _wait_in_thread(background, WAIT_S, time.sleep if woken else None)
    assert wall >= WAIT_S * 0.9
    # Spinning or yielding for the whole wait would use ~WAIT_S of CPU; napping uses a few percent.
    assert cpu < 0.25 * wall, f"the wait used {cpu:.3f} s of CPU in {wall:.3f} s"


def test_a_timed_wait_on_the_application_thread_keeps_yielding_while_a_core_is_spare(monkeypatch):
    monkeypatch.setattr(waits, "_host_has_a_spare_core", lambda: True)
    naps = []
    monkeypatch.setattr(waits.time, "sleep", lambda s: naps.append(s))
    cpu, wall = _wait_in_thread(False, 0.05)
    assert wall >= 0.05 * 0.9
    assert naps == [], f"a wait with a spare core napped {len(naps)} times"


def test_a_background_wait_naps_after_a_short_yield_even_with_a_spare_core(monkeypatch):
    # Yielding for a whole transfer slows the application's compute even beside a spare core
    # (a hyperthread sibling; the testbed's peer rank): a background wait yields 100 us at most.
    monkeypatch.setattr(waits, "_host_has_a_spare_core", lambda: True)
    cpu, wall = _wait_in_thread(True, WAIT_S)
    assert wall >= WAIT_S * 0.9
    assert cpu < 0.25 * wall, f"a background wait used {cpu:.3f} s of CPU in {wall:.3f} s with a spare core"


def test_a_long_polled_background_wait_naps_longer_but_never_past_an_eighth_of_its_wait(monkeypatch):
    # A background wait on a transfer of milliseconds (MPI, across hosts) wakes less often as it
    # lasts: each wake-up's tests cost the core backward computes on. A nap never exceeds an
    # eighth of the wait so far (bounding how late it answers), nor 1 ms.
    monkeypatch.setattr(waits, "_host_has_a_spare_core", lambda: False)
    naps = []
    real_sleep = time.sleep
    began = []

    def recorded(seconds):
        naps.append((seconds, time.monotonic() - began[0]))
        real_sleep(seconds)

    monkeypatch.setattr(waits.time, "sleep", recorded)
    began.append(time.monotonic())
    _wait_in_thread(True, 0.06)
    longest = max(n for n, _ in naps)
    assert waits._LONGEST_NAP_SECONDS < longest <= waits._LONGEST_BACKGROUND_NAP_SECONDS, naps
    for nap, elapsed in naps:  # elapsed from before the thread started: the wait's own is shorter
        assert nap <= max(waits._LONGEST_NAP_SECONDS, elapsed * waits._BACKGROUND_NAP_SHARE) + 1e-9, (nap, elapsed)
    # The application thread's timed naps stay short: it answers its peer at once.
    naps.clear()
    began[0] = time.monotonic()
    _wait_in_thread(False, 0.06)
    assert naps and max(n for n, _ in naps) <= waits._LONGEST_NAP_SECONDS, naps


@pytest.mark.parametrize("background", [True, False], ids=["background thread", "application thread"])
def test_a_prompt_wait_never_naps_on_the_application_thread(background, monkeypatch):
    # A wait for a two-sided transport's message (MPI, gloo) answers at once however busy the
    # host: a nap would cost the protocol a round trip. A background thread still naps.
    monkeypatch.setattr(waits, "_host_has_a_spare_core", lambda: False)  # every core is busy
    naps = []
    monkeypatch.setattr(waits.time, "sleep", lambda s: naps.append(s))
    _, wall = _wait_in_thread(background, 0.05, prompt=True)
    assert wall >= 0.05 * 0.9
    if background:
        assert naps, "a background thread's prompt wait never napped on a busy host"
    else:
        assert naps == [], f"a prompt wait on the application thread napped {len(naps)} times"


def test_a_host_whose_cores_are_all_busy_has_no_spare_core():
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() + 1)]
    try:
        time.sleep(0.3)  # every spinner is running
        seen = []
        for _ in range(50):
            seen.append(waits._host_has_a_spare_core())
            time.sleep(0.002)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert seen.count(False) > len(seen) // 2, seen


def test_a_napping_wait_still_meets_its_deadline():
    run_in_background()
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout, match="rank 3"):
            wait_until(lambda: False, 0.3, 3, "a condition that never comes")
        assert time.monotonic() - t0 < 0.3 + 0.25  # the longest nap is well under the slack
    finally:
        waits._background.on = False


def test_a_process_confined_to_some_cores_never_counts_on_a_spare_one(monkeypatch):
    # The running count is the whole host's: it says nothing about the cores a pinned process may use.
    monkeypatch.setattr(waits.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(waits.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(waits, "_loadavg_fd", None)
    monkeypatch.setattr(waits, "_cpus", 0)
    assert waits._usable_cpus() == 0
    assert waits._host_has_a_spare_core() is False


def test_a_revoked_world_makes_every_wait_give_up_within_a_liveness_period():
    """An elastic job's revocation (another rank's collective failed, ddl_triton/elastic/membership.py):
    a wait on a peer that is alive but will never send gives up at its next liveness check, not at
    its deadline; once the new world is built, waits wait again."""
    from ddl_triton.transports import failure_notice

    timer = threading.Timer(0.1, failure_notice.revoke, args=("generation 3 revoked: rank 2 died",))
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(PeerTimeout, match="abandoned: generation 3 revoked: rank 2 died") as caught:
            wait_until(lambda: False, 30.0, 4, "message 12")
        assert caught.value.dead and caught.value.peer == 4
        assert time.monotonic() - start < 0.1 + 2 * waits._LIVENESS_PERIOD + 0.5
        # A wait that starts once the world is revoked (the old communicator's close, flushing its
        # sends) gives up at once, not a liveness period later: a close waits on many peers in turn.
        start = time.monotonic()
        with pytest.raises(PeerTimeout, match="abandoned"):
            wait_until(lambda: False, 30.0, 5, "gloo send completion")
        assert time.monotonic() - start < waits._LIVENESS_PERIOD / 2
    finally:
        timer.cancel()
        failure_notice.clear_revocation()
    with pytest.raises(PeerTimeout, match="waited too long"):
        wait_until(lambda: False, 0.3, 4, "message 13")  # a plain deadline again, not the revocation
