"""Running one timed job on several hosts: its processes waited for, bounded, and a lock held.

``wait_for_every_host(procs, timeout)`` returns once every process has ended, or ``timeout``
seconds have passed, or 10 s after one of them failed (the others then wait on a rendezvous
or a peer that will never come). Whatever still runs is then terminated, and killed 20 s later.
Returns each process's exit status.

``torchrun_on_every_host`` starts one ``torchrun --node-rank i`` per host at once and waits for
them so; ``ddl_options_from_shell`` is the shell's ``DDL_*`` options, for the ranks' environment.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, IO

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
    # Read-only, never through a link (a lock under /tmp is shared: another user may have planted
    # one); 0644 so that other users' timed jobs can open it too. A flock needs no write access.
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def ddl_options_from_shell() -> dict[str, str]:
    """This shell's ``DDL_*`` variables: a job's ranks take the options its caller set."""
    return {k: v for k, v in os.environ.items() if k.startswith("DDL_")}


def torchrun_on_every_host(start: Callable[[str, list[str], IO], subprocess.Popen], hosts: list[str], per_host: int,
                           port: int, script_argv: list[str], timeout: float) -> tuple[list[int], list[str]]:
    """One ``torchrun --nnodes H --node-rank i --nproc-per-node per_host`` per host, all at once,
    meeting at ``hosts[0]:port``, each running ``script_argv``; ``start(host, argv, out)`` starts
    ``argv`` on ``host`` with its output to the file ``out`` and returns the process. Waits as
    ``wait_for_every_host`` does; returns each host's exit status and output. The output goes to
    files, not pipes: nothing is read until every host is done, and a full pipe would stall a rank."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    outs = [tempfile.TemporaryFile("w+") for _ in hosts]
    procs = []
    for i, (host, out) in enumerate(zip(hosts, outs)):
        argv = [torchrun, "--nnodes", str(len(hosts)), "--node-rank", str(i), "--nproc-per-node", str(per_host),
                "--master-addr", hosts[0], "--master-port", str(port), *script_argv]
        procs.append(start(host, argv, out))
    codes = wait_for_every_host(procs, timeout)
    texts = []
    for out in outs:
        out.seek(0)
        texts.append(out.read())
        out.close()
    return codes, texts
