"""How a transport waits for a peer: spin, yield, nap, all bounded by a deadline.

Semantics: ``wait_until(ready, timeout, peer, what)`` returns once ``ready()`` is true, or raises
``PeerTimeout`` past the deadline, as soon as the peer's process is known gone, or shortly after
the launcher's notice that a process of the job died. How it spends the meantime (spin, then yield
the CPU, then nap; a background thread naps sooner) is the wait policy below, measured in
bench/results/waits.md. ``progress_hooks`` run before every check of every wait; ``current_wait`` and
``last_stuck`` tell the flight recorder what a rank is, or was last, stuck on.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Callable

from . import failure_notice

# How long a wait spins before it starts yielding the CPU. Spinning catches a
# peer running on another core within a microsecond; with more ranks than cores
# the peer may need this very core, so transports set it to 0 there.
DEFAULT_SPIN_SECONDS = 50e-6
# Iterations between clock reads once yielding (a clock read costs ~50 ns).
_CHECKS_PER_CLOCK = 16
# After this long yielding, a wait naps instead, while every core of the host has a runnable
# thread: a yielding thread stays runnable, so it would take a share of a core the application
# computes on (its own rank's or a peer's). While a core is spare, it keeps yielding: a napping
# wait answers late, and a two-sided protocol (MPI's handshakes, a call check) pays that
# lateness once per round trip, several times per collective.
_YIELD_SECONDS = 1e-3
# A background thread's wait (a communicator's, overlapping the application) yields at most this
# long, spare core or not, then naps. A thread that yields for a whole transfer slows the
# application's compute even where a core looks spare: a hyperthread sibling, or, on the testbed's
# hosts, the peer rank's core. Measured there (2 hosts x 1 rank on 2 cores, the int8 hook): the
# rank waiting in the background for its peer's last bucket yielded for 67-83 ms, and the peer's
# backward ran about 40% slower all that while; with this cap the step went from 291 to 224 ms.
_BACKGROUND_YIELD_SECONDS = 100e-6
# Naps start at the first length and double up to the last: a wait that is already long is
# probably waiting for a peer still computing, and every wake-up costs the core a context
# switch and the GIL. A background thread (a communicator's, overlapping the application) naps
# as soon as its spin ends where the peer wakes it (see _wait_slowly).
_FIRST_NAP_SECONDS = 20e-6
_LONGEST_NAP_SECONDS = 100e-6
# A background thread's polled wait (MPI) that has already lasted a while naps longer: up to an
# eighth of the time it has waited so far, and at most this. Such a wait is on a transfer of
# milliseconds (a bucket across hosts), whose bytes queue in the kernel's socket buffers while it
# naps; the wake-ups, each with its MPI tests, are what cost the core backward computes on.
# Measured on the testbed (2 hosts x 1 rank, 1 Gbit/s, a 2.1 MB exchange beside a 30 ms sleep):
# naps of 100 us cost 6.0 ms of CPU per exchange, naps of 1 ms 3.3 ms, for a finish 0.5 ms later
# (the socket itself: 2.4-3.0 ms). At most an eighth of the wait so far keeps a late answer to
# an eighth of the wait.
_LONGEST_BACKGROUND_NAP_SECONDS = 1e-3
_BACKGROUND_NAP_SHARE = 1 / 8
# The longest nap when the waker wakes the sleeper (a futex: transports/futex.py): the timer then
# only bounds a missed wake-up and paces the liveness checks.
_LONGEST_WOKEN_NAP_SECONDS = 5e-3
_PR_SET_TIMERSLACK = 29

_background = threading.local()  # .on: this thread is a background thread (see run_in_background)


def run_in_background() -> None:
    """Mark the calling thread as a background thread: its waits nap right after their spin.

    Also asks Linux for a 1 us timer slack on this thread, so a first nap of 20 us lasts
    about that long instead of the default slack's 50 us or more (best effort elsewhere)."""
    _background.on = True
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass


# How often a long wait checks that the peer's process still exists.
_LIVENESS_PERIOD = 0.25
# How long after the launcher's failure notice a wait still waits (failure_notice.py):
# long enough for a same-node wait to find and name the dead rank by its pid first.
_NOTICE_GRACE = 0.5

# The wait that has outlasted its spin, for the flight recorder (ddl_triton/observability/flight.py):
# (peer, what, since) or None. Only set on the slow path, so it costs the fast path nothing.
current_wait: tuple[int, str, float] | None = None
# The last wait that gave up (same shape): what a timed-out collective was waiting for.
last_stuck: tuple[int, str, float] | None = None
# Called before every readiness check of every wait (see wait_until); empty unless a
# transport needs progress outside its own waits (transports/link_emulation.py).
progress_hooks: list[Callable[[], object]] = []


class PeerTimeout(Exception):
    """A wait on ``peer`` passed its deadline; the executor adds the collective's context."""

    def __init__(self, peer: int, what: str, dead: bool = False):
        self.peer = peer  # -1: a wait on every rank at once (an MPI collective, a GPU stream)
        self.what = what
        self.dead = dead  # the peer's process is known to be gone, not merely slow
        super().__init__(f"{'lost' if dead else 'waited too long for'} {self.who}: {what}")

    @property
    def who(self) -> str:
        """The rank waited for, or what can be said when the wait was on every rank at once."""
        if self.peer >= 0:
            return f"rank {self.peer}"
        return "a rank (the wait was on all ranks at once: which one is unknown)"


def wait_until(ready: Callable[[], bool], timeout: float, peer: int, what: str,
               spin: float = DEFAULT_SPIN_SECONDS, alive: Callable[[], bool] | None = None,
               sleep: Callable[[float], None] | None = None, prompt: bool = False) -> None:
    """Return once ``ready()`` is true; raise PeerTimeout after ``timeout`` seconds, as
    soon as ``alive()`` (checked every quarter second) says the peer's process is gone,
    half a second after the launcher's notice that a process of the job died, or at the
    first check after the job revoked this process's world (an elastic job: failure_notice.revoke).

    Spins for ``spin`` seconds, then yields the CPU between checks, then naps (see
    ``_wait_slowly``): ``time.sleep`` by default, or ``sleep(seconds)`` when given, which may
    return early when woken (the shm transport sleeps on a futex its peer wakes). Every function in
    ``progress_hooks`` runs before each check (link emulation hands over due messages
    there, whatever transport the wait is on).

    ``prompt``: a wait on a two-sided transport's message (MPI, gloo) on a thread that has nothing
    else to do never naps, however busy the host: it yields between checks, so it answers the
    peer's message at once. A nap there costs the protocol a round trip (MPI's rendezvous
    handshake, a call check), where on shm it only delays reading data that is already there.
    A background thread's wait (run_in_background) naps as usual: the application computes beside it.
    """
    if progress_hooks:
        ready = with_calls_first(progress_hooks, ready)
    if ready():
        return
    start = time.perf_counter()
    while time.perf_counter() - start < spin:
        if ready():
            return
    global current_wait, last_stuck
    revoked = failure_notice.revoked()
    if revoked is not None:  # the world is being given up: every later wait (a close's flush) gives up at once
        raise _abandoned(peer, what, revoked)
    now = time.monotonic()
    current_wait = (peer, what, time.time())
    try:
        _wait_slowly(ready, now + timeout, now + _LIVENESS_PERIOD, peer, what, alive, sleep,
                     prompt and not getattr(_background, "on", False))
    except PeerTimeout:
        last_stuck = current_wait
        raise
    finally:
        current_wait = None


def with_calls_first(calls, ready: Callable[[], bool]) -> Callable[[], bool]:
    """``ready``, with each of ``calls`` (callables, run in order) run before every check: what a
    wait must keep moving meanwhile (progress hooks, another transport's sends)."""
    calls = tuple(calls)

    def check() -> bool:
        for call in calls:
            call()
        return ready()
    return check


def _wait_slowly(ready, deadline: float, next_liveness: float, peer: int, what: str, alive, sleep,
                 never_nap: bool = False) -> None:
    # A background wait (the application computes beside it) naps at once where the peer's publish
    # wakes it (a futex) or no core is spare, else after at most 100 us of yielding, spare core or
    # not (_BACKGROUND_YIELD_SECONDS). A yielding thread keeps a share of a core, which it takes
    # from the application's compute for as long as the transfer lasts (across hosts: milliseconds
    # per bucket); a nap of at most 100 us, or up to 1 ms once the wait has lasted 8 ms, still
    # calls into MPI often enough for a transfer to progress (1 Gbit/s moves 125 KB in 1 ms, well
    # within a socket's buffer). An application-thread wait yields for its first millisecond, then
    # naps only while no core is spare.
    woken = sleep is not None
    background = getattr(_background, "on", False)
    now = began = time.monotonic()
    if not background:
        start_napping = now + _YIELD_SECONDS
    elif woken or not _host_has_a_spare_core():
        start_napping = now
    else:
        start_napping = now + _BACKGROUND_YIELD_SECONDS
    longest = _LONGEST_WOKEN_NAP_SECONDS if woken else _LONGEST_NAP_SECONDS
    stretch = background and not woken  # a polled background wait: naps grow with the wait (above)
    sleep = sleep or time.sleep
    nap = 0.0
    while True:
        if nap:
            sleep(nap)  # releases the GIL and the core
            if ready():
                return
            if stretch:
                longest = min(_LONGEST_BACKGROUND_NAP_SECONDS,
                              max(_LONGEST_NAP_SECONDS, (time.monotonic() - began) * _BACKGROUND_NAP_SHARE))
            nap = min(2 * nap, longest)
        else:
            for _ in range(_CHECKS_PER_CLOCK):
                os.sched_yield()  # also releases the GIL, so a training thread keeps running
                if ready():
                    return
        now = time.monotonic()
        if now >= start_napping and not never_nap:
            if woken or background or not _host_has_a_spare_core():
                nap = nap or _FIRST_NAP_SECONDS
            else:
                nap = 0.0  # back to yielding: nobody needs this core, and the peer's answer is near
        if now > deadline:
            raise PeerTimeout(peer, what)
        if now > next_liveness:
            next_liveness = now + _LIVENESS_PERIOD
            if alive is not None and not alive() and not ready():
                failure_notice.note_gone(peer)
                raise PeerTimeout(peer, what + " (its process has exited)", dead=True)
            notice = failure_notice.received_at()
            if notice is not None and now > notice + _NOTICE_GRACE and not ready():
                raise PeerTimeout(peer, what + " (the launcher reported that a process of this job died)",
                                  dead=True)
            revoked = failure_notice.revoked()
            if revoked is not None and not ready():
                raise _abandoned(peer, what, revoked)


def _abandoned(peer: int, what: str, revoked: tuple[float, str]) -> PeerTimeout:
    """The error of a wait given up because the job revoked this process's world (failure_notice.revoke)."""
    return PeerTimeout(peer, f"{what} (abandoned: {revoked[1]})", dead=True)


_loadavg_fd: int | None = None  # /proc/loadavg, opened once (None: not opened yet; -1: unavailable)
_cpus = 0  # the cores the host-wide count is compared with (set with the descriptor)


def _host_has_a_spare_core() -> bool:
    """Whether this host has no more runnable threads than cores, the caller included (Linux:
    /proc/loadavg's running count, read in about a microsecond). False where it cannot tell,
    so a wait then naps as it always did: off Linux, and for a process confined to some of the
    host's cores (the count is the whole host's, so it says nothing about those cores)."""
    global _loadavg_fd, _cpus
    if _loadavg_fd is None:
        _cpus = _usable_cpus()
        try:
            _loadavg_fd = os.open("/proc/loadavg", os.O_RDONLY) if _cpus else -1
        except OSError:
            _loadavg_fd = -1
    if _loadavg_fd < 0:
        return False
    try:
        running = int(os.pread(_loadavg_fd, 128, 0).split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return False
    return running <= _cpus


def _usable_cpus() -> int:
    """The host's cores when this process may run on all of them, fewer under a CPU quota
    (cgroup v2 ``cpu.max``); 0 when it is confined to a subset (pinned by its launcher)."""
    cpus = os.cpu_count() or 1
    try:
        if len(os.sched_getaffinity(0)) < cpus:
            return 0
    except (AttributeError, OSError):
        return 0
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus
