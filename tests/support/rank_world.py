"""Rank worlds launched once and reused: ``run_in_world`` runs a test worker script on every rank
of an N-rank MPI world that was started once (by the first test that asked for that size and
environment) and is kept for the tests after it, as mpi4py runs its own suite inside one mpiexec.

Why: a launch costs every rank an interpreter, torch, MPI and ddl_triton (about 1.5 s of CPU per
rank, 6 s for a 4-rank job that only initialises), and on 2 cores the suite is CPU-bound. A reused
world pays that once per size; each job then pays only its script (tests/support/world_rank.py
runs it with ``runpy`` as ``__main__``, with the job's environment, arguments and working folder).

What a test sees is what ``subprocess.run`` of mpiexec gives it: a ``CompletedProcess`` whose
stdout and stderr are every rank's, in rank order, and whose return code is the first rank's
nonzero exit status (0 when every rank exited 0), or ``subprocess.TimeoutExpired`` past the job's
deadline, naming the ranks that had not finished. The world is replaced (killed, and started again
by the next job) after a job that failed, timed out, crashed a rank, or left a communicator, a
process group or a thread behind (world_rank.py names it on that rank's stderr): what a failed
collective leaves in flight on ``MPI.COMM_WORLD`` never reaches the next test.

Not for tests that kill ranks, cut links, exit on purpose, or test what happens at interpreter
exit: those launch their own processes (``run_ranks(..., own_launch=True)``, ddlrun, torchrun).

Worlds are keyed by their size and by the environment variables that are not ``DDL_*``: those a
library reads when it is imported (``TRITON_INTERPRET``, ``XLA_FLAGS``, MPICH's ``MPIR_CVAR_*``)
cannot change inside a running process, while ddl_triton reads its ``DDL_*`` twins at ``init``.
At most ``MAX_WORLDS`` are kept; all are ended when the test process exits.
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_WORLDS = 4
START_TIMEOUT = 120.0  # seconds for every rank to import torch and ddl_triton and say hello (4 ranks, 2 cores, loaded)
_RANK = Path(__file__).with_name("world_rank.py")


class RankWorld:
    """One N-rank world under the mpich wheel's mpiexec, its ranks waiting for jobs."""

    def __init__(self, mpiexec: str, n: int, env: dict[str, str]):
        self.n = n
        self.jobs = 0
        self.folder = Path(tempfile.mkdtemp(prefix="ddl_triton-world-"))  # 0700: the socket and the outputs
        token = secrets.token_hex(16)
        keys = self.folder / "started_with.json"
        keys.write_text(json.dumps(sorted(env)))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.folder / "ctl.sock"))
        listener.listen(n)
        self._own_out = open(self.folder / "world.out", "wb")
        self.cmd = [mpiexec, "-n", str(n), sys.executable, str(_RANK), str(self.folder / "ctl.sock"), token, str(keys)]
        # Its own session: the world, and only it, is killed by its process group.
        self.proc = subprocess.Popen(self.cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._own_out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.conns: dict[int, socket.socket] = {}
        try:
            self._accept(listener, token)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def _accept(self, listener: socket.socket, token: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while len(self.conns) < self.n:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                state = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
                raise RuntimeError(f"a {self.n}-rank world did not start within {START_TIMEOUT:g} s (mpiexec "
                                   f"{state}, ranks connected: {sorted(self.conns)}):\n{self._own_output()}")
            listener.settimeout(min(left, 1.0))
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            conn.settimeout(30)
            hello = json.loads(conn.makefile("r", encoding="utf-8").readline() or "null")
            if not hello or hello.get("token") != token:
                conn.close()  # not one of this world's ranks
                continue
            rank, size = hello["rank"], hello["size"]
            if size != self.n or rank in self.conns or "MPICH" not in hello["library"]:
                raise RuntimeError(f"mpiexec -n {self.n} did not start one world of {self.n} MPICH ranks: a rank "
                                   f"said rank {rank} of {size}, {hello['library']!r} "
                                   f"(ranks so far {sorted(self.conns)})")
            conn.settimeout(None)
            self.conns[rank] = conn
        self._readers = {r: c.makefile("r", encoding="utf-8") for r, c in self.conns.items()}

    def alive(self) -> bool:
        return self.proc.poll() is None and len(self.conns) == self.n

    def run(self, script: str, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """Run ``script`` with ``args`` on every rank, under ``env``; see the module's docstring."""
        self.jobs += 1
        outputs = {r: (self.folder / f"job{self.jobs}.{r}.out", self.folder / f"job{self.jobs}.{r}.err")
                   for r in range(self.n)}
        cmd = [*self.cmd[:3], sys.executable, script, *args]  # what run_ranks would have run
        for r, conn in self.conns.items():
            job = {"script": script, "args": list(args), "env": env, "cwd": os.getcwd(),
                   "stdout": str(outputs[r][0]), "stderr": str(outputs[r][1])}
            conn.sendall((json.dumps(job) + "\n").encode())
        codes: dict[int, int] = {}
        fit = True
        lost: list[int] = []
        deadline = time.monotonic() + timeout
        waiting = {self.conns[r].fileno(): r for r in range(self.n)}
        while waiting and not lost:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
            for fd in ready:
                r = waiting.pop(fd)
                line = self._readers[r].readline()
                if not line:
                    lost.append(r)
                    continue
                answer = json.loads(line)
                codes[r] = answer["code"]
                fit = fit and answer["fit"]
        if waiting and not lost:  # the deadline passed
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session; a hung job cannot be asked to leave
            out, err = self._collect(outputs)
            self.close()
            unfinished = sorted(waiting.values())
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=(
                f"{err}\nrank world: ranks {unfinished} of {self.n} had not finished {script} after {timeout:g} s; "
                "the world was killed and will be started again"))
        if lost:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            code = self.proc.poll()
            out, err = self._collect(outputs)
            err = (f"{err}\nrank world: rank {lost[0]} ended during {script} (mpiexec: "
                   f"{'exit ' + str(code) if code is not None else 'still running'}); the world will be started "
                   f"again; the world's own output:\n{self._own_output()}")
            self.close()
            return subprocess.CompletedProcess(cmd, code if code else -signal.SIGKILL, out, err)
        out, err = self._collect(outputs)
        failed = [codes[r] for r in range(self.n) if codes[r] != 0]
        if failed or not fit:
            self.close()
        return subprocess.CompletedProcess(cmd, failed[0] if failed else 0, out, err)

    def _collect(self, outputs: dict[int, tuple[Path, Path]]) -> tuple[str, str]:
        def read(path: Path) -> str:
            try:
                return path.read_text(errors="replace")
            except FileNotFoundError:
                return ""
        out = "".join(read(o) for o, _ in outputs.values())
        err = "".join(read(e) for _, e in outputs.values())
        for o, e in outputs.values():
            o.unlink(missing_ok=True)
            e.unlink(missing_ok=True)
        return out, err

    def _own_output(self) -> str:
        try:
            return (self.folder / "world.out").read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        """Ask the ranks to leave (they exit 0 through MPI_Finalize); kill the world if they do not."""
        if self.proc.poll() is None:
            for conn in self.conns.values():
                try:
                    conn.sendall(b'{"leave": true}\n')
                except OSError:
                    pass
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # our own session, started above
                self.proc.wait()
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        self._own_out.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_worlds: dict[tuple, RankWorld] = {}
# What the worlds saved, for the suite's budget line: worlds started, their rank processes, jobs run.
counts = {"worlds": 0, "ranks": 0, "jobs": 0, "job_ranks": 0}
_PER_JOB = ("PYTEST_CURRENT_TEST",)  # changes with every test, read by nothing at import


def _import_time(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` a world is started with and keyed by: all but ``DDL_*`` and ``_PER_JOB``."""
    return {k: v for k, v in env.items() if not k.startswith("DDL_") and k not in _PER_JOB}


def run_in_world(mpiexec: str, n: int, script: str, args: tuple[str, ...], env: dict[str, str],
                 timeout: float) -> subprocess.CompletedProcess:
    """Run ``script args`` on a reused ``n``-rank world whose ranks were started under ``env``'s
    variables other than ``DDL_*`` (starting one if there is none, and ending the least recently
    used past ``MAX_WORLDS``); the job itself runs under all of ``env``."""
    key = (n, tuple(sorted(_import_time(env).items())))
    world = _worlds.pop(key, None)
    if world is not None and not world.alive():
        world.close()
        world = None
    if world is None:
        while len(_worlds) >= MAX_WORLDS:
            _worlds.pop(next(iter(_worlds))).close()
        world = RankWorld(mpiexec, n, _import_time(env))
        counts["worlds"] += 1
        counts["ranks"] += n
    _worlds[key] = world  # the most recently used last
    counts["jobs"] += 1
    counts["job_ranks"] += n
    return world.run(script, list(args), env, timeout)


def cpu_seconds() -> float:
    """CPU seconds spent so far by the running worlds' processes (mpiexec, its proxy, the ranks, and
    the children they have reaped), read from /proc: the suite's budget counts them per test."""
    roots = {w.proc.pid for w in _worlds.values() if w.proc.poll() is None}
    if not roots:
        return 0.0
    parent_of, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        # After the name: state, ppid, ... utime (14th field of the file), stime, cutime, cstime.
        parent_of[int(entry)] = int(fields[1])
        ticks[int(entry)] = sum(int(x) for x in fields[11:15])
    total = 0
    for pid, t in ticks.items():
        p, seen = pid, 0
        while p > 1 and p not in roots and seen < 64:
            p, seen = parent_of.get(p, 0), seen + 1
        if p in roots:
            total += t
    return total / os.sysconf("SC_CLK_TCK")


@atexit.register
def close_all() -> None:
    """End every world (the test process is exiting)."""
    while _worlds:
        _worlds.popitem()[1].close()
