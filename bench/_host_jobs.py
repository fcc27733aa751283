"""Running one timed job on several hosts: its processes waited for, bounded, and a lock held.

``wait_for_every_host(procs, timeout)`` returns once every process has ended, or ``timeout``
seconds have passed, or 10 s after one of them failed (the others then wait on a rendezvous
or a peer that will never come). Whatever still runs is then terminated, and killed 20 s later.
Returns each process's exit status.
"""
from __future__ import annotations

import contextlib
import fcntl
import subprocess
import time

_AFTER_A_FAILURE_S = 10.0  # the others' grace once one host's process failed


def wait_for_every_host(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [q.poll() for q in procs]  # every one polled: a later host's failure counts too
            if all(code is not None for code in states):
                break
            if any(code not in (None, 0) for code in states):
                deadline = min(deadline, time.monotonic() + _AFTER_A_FAILURE_S)
            time.sleep(0.2)
    finally:
        for q in procs:
            if q.poll() is None:
                q.terminate()
        for q in procs:
            try:
                q.wait(20)
            except subprocess.TimeoutExpired:
                q.kill()
                q.wait(10)
    return [q.returncode for q in procs]


@contextlib.contextmanager
def locked(path: str):
    """Hold an exclusive flock on ``path`` (nothing when ""): one timed job at a time on a shared machine."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
