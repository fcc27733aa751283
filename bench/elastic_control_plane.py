"""The elastic control plane's store traffic: requests per process per second while nothing fails,
and the time (and requests) to agree on a new world after a process is killed.

Only ddl_triton/elastic/membership.py runs here, over a real TCPStore served by this (parent)
process, as rank 0's process serves it under ``env://``: no process group, no DDP, no training, so
that 32 or 64 processes fit on a small machine. Each child is one member: ``Membership.start``,
``watch()``, then an idle window, then the parent SIGKILLs the last member (a child it started) and
tells rank 0, which does what a survivor whose collective failed does (``revoke``, ``mark_gone`` of
the member whose sockets closed, ``agree``); every other survivor agrees once its watcher has seen
the revocation (in training its own collective would fail then too).

Requests are counted in each child by wrapping its store client (and the clones the membership
makes of it): one per call of the store's API. A ``wait`` that times out costs one more message
(its cancel), not counted; the harness's own coordination uses a second client, not counted.

    .venv/bin/python bench/elastic_control_plane.py --sizes 8,16,32 [--idle 5] [--grace 1.0]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

_TIMEOUT_S = 60.0


class _Counting:
    """A store client that counts the calls made through it (its clones count into the same box)."""

    def __init__(self, store, box=None):
        self._store, self._box = store, box if box is not None else {"n": 0, "lock": threading.Lock()}

    @property
    def calls(self) -> int:
        return self._box["n"]

    def clone(self):
        return _Counting(self._store.clone(), self._box)

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr) or name in ("host", "port"):
            return attr

        def counted(*args, **kwargs):
            with self._box["lock"]:
                self._box["n"] += 1
            return attr(*args, **kwargs)
        return counted


def _child(port: int, rank: int, size: int, idle: float, grace: float) -> None:
    import torch.distributed as dist

    from ddl_triton.elastic.membership import Membership
    from ddl_triton.transports import failure_notice

    timeout = timedelta(seconds=_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout, wait_for_workers=False)
    ctl = dist.TCPStore("127.0.0.1", port, size, False, timeout, wait_for_workers=False)  # not counted
    counted = _Counting(store)
    failure_notice.set_revocable(True)
    m = Membership(counted, rank, f"bench{rank}", _TIMEOUT_S, grace)
    m.start(rank, size)
    m.watch()
    ctl.add("bench/ready", 1)
    ctl.wait(["bench/go"])
    n0, t0 = counted.calls, time.monotonic()
    time.sleep(idle)
    idle_calls, idle_s = counted.calls - n0, time.monotonic() - t0
    ctl.add("bench/idle_done", 1)
    victim = size - 1
    if rank == victim:
        ctl.wait(["bench/never"])  # killed before this returns
        return
    ctl.wait(["bench/killed"])
    n1 = counted.calls
    t_kill = float(ctl.get("bench/killed").decode())
    if rank == 0:  # the survivor whose collective failed: it saw the victim's sockets close
        m.revoke(f"bench: member {victim} killed")
        m.mark_gone([victim])
    else:
        end = time.monotonic() + _TIMEOUT_S
        while failure_notice.revoked() is None and time.monotonic() < end:
            time.sleep(0.001)  # local only: the watcher revokes this process's waits
    t_revoked = time.time()
    decision = m.agree("lost")
    t_agreed = time.time()
    print(json.dumps({"rank": rank, "idle_calls": idle_calls, "idle_s": idle_s, "agree_calls": counted.calls - n1,
                      "revoked_s": t_revoked - t_kill, "agreed_s": t_agreed - t_kill,
                      "members": decision.members}), flush=True)
    ctl.add("bench/done", 1)
    m.close()


def _run(size: int, idle: float, grace: float) -> dict:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, size + 1, True, timedelta(seconds=_TIMEOUT_S), wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    children = [subprocess.Popen([sys.executable, __file__, "--child", str(server.port), str(r), str(size),
                                  str(idle), str(grace)], stdout=subprocess.PIPE, text=True, env=env)
                for r in range(size)]
    try:
        end = time.monotonic() + 600
        while server.add("bench/ready", 0) < size:
            if time.monotonic() > end or any(c.poll() is not None for c in children):
                raise SystemExit(f"{size} members: not all started")
            time.sleep(0.2)
        server.set("bench/go", "1")
        while server.add("bench/idle_done", 0) < size:
            if time.monotonic() > end:
                raise SystemExit(f"{size} members: idle window did not end")
            time.sleep(0.05)
        victim = children[-1]
        victim.send_signal(signal.SIGKILL)  # our own child, by its Popen
        victim.wait()
        server.set("bench/killed", repr(time.time()))
        rows = []
        for c in children[:-1]:
            out, _ = c.communicate(timeout=120)
            rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if c.returncode != 0:
                raise SystemExit(f"{size} members: a survivor exited {c.returncode}")
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    assert len(rows) == size - 1 and len({tuple(r["members"]) for r in rows}) == 1, rows
    assert rows[0]["members"] == list(range(size - 1)), rows[0]["members"]
    if os.environ.get("BENCH_VERBOSE"):
        print(rows, file=sys.stderr)
    per_s = [r["idle_calls"] / r["idle_s"] for r in rows]
    return {"size": size, "idle_per_process": sum(per_s) / len(per_s), "idle_total": sum(per_s) * size / len(per_s),
            "agree_calls_mean": sum(r["agree_calls"] for r in rows) / len(rows),
            "agree_calls_max": max(r["agree_calls"] for r in rows),
            "revoked_max_s": max(r["revoked_s"] for r in rows), "agreed_max_s": max(r["agreed_s"] for r in rows)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        port, rank, size, idle, grace = sys.argv[2:7]
        _child(int(port), int(rank), int(size), float(idle), float(grace))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,16,32")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of the idle window")
    parser.add_argument("--grace", type=float, default=1.0)
    args = parser.parse_args()
    print("| processes | idle requests/s per process | idle requests/s in all | requests per process to agree "
          "(mean, max) | revoked (last survivor) s | agreed (last survivor) s |")
    print("|---|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        r = _run(size, args.idle, args.grace)
        print(f"| {size} | {r['idle_per_process']:.2f} | {r['idle_total']:.1f} | {r['agree_calls_mean']:.0f}, "
              f"{r['agree_calls_max']} | {r['revoked_max_s']:.3f} | {r['agreed_max_s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
