"""Measure the testbed's link as MPI sees it: the numbers that ddl_triton/simulation/clusters/testbed.toml
holds. Needs root (the testbed); run from the repository root:

    .venv/bin/python bench/testbed_link.py [--rate 1gbit] [--json out.json]

What it measures, with MPICH (ch4:ucx, TCP between hosts) on one rank per host, nothing of
ddl_triton's own in the way:

- **latency**: half the round trip of an 8-byte ping-pong (``Send``/``Recv`` on prebuilt numpy
  buffers), the median over 2,000 round trips, across the hosts and, for comparison, between two
  ranks of one host (MPICH's shared memory), on the same machine in the same minutes;
- **rate**: the steady goodput of one stream, h1 to h2: 48 MiB's time minus 16 MiB's over the
  32 MiB between them, each sent as 1 MiB messages after an idle second, so that the latency
  and ``tbf``'s burst (what the token bucket lets through at the veth's speed after an idle
  spell) cancel out; shaped at ``--rate``, with the shaping removed (the veth and TCP on this
  machine's CPUs), and between two ranks of one host (MPICH's shared memory);
- **burst**: the same two transfers also give what the idle spell bought: 16 MiB's time against
  16 MiB at the steady rate, in bytes (``tbf``'s configured burst is ddl_triton/testbed/hosts.py's
  ``burst_bytes``).

Medians over ``--repeats`` alternations of each measurement.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = ["env", "UCX_NET_DEVICES=eth0", "GLOO_SOCKET_IFNAME=eth0", f"HYDRA_LAUNCHER_EXEC={BIN / 'ddl-testbed-ssh'}",
       "DDL_TUNING_FILE=off", "OMP_NUM_THREADS=1"]
_SMALL, _LARGE, _MESSAGE = 16 << 20, 48 << 20, 1 << 20


def _latency(world, trips: int = 2000) -> float:
    """Half the median round trip of an 8-byte ping-pong between ranks 0 and 1 (seconds)."""
    import numpy as np
    buf = np.zeros(1, dtype=np.float64)
    peer = 1 - world.rank
    times = []
    for i in range(trips + 100):
        t0 = time.perf_counter()
        if world.rank == 0:
            world.Send(buf, dest=peer)
            world.Recv(buf, source=peer)
        else:
            world.Recv(buf, source=peer)
            world.Send(buf, dest=peer)
        if i >= 100:  # the first round trips set up the connection
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / 2


def _stream(world, nbytes: int) -> float:
    """Seconds for rank 0 to deliver ``nbytes`` to rank 1 in 1 MiB messages, after an idle second
    (the token bucket full), as rank 1 sees it (until its last byte and its reply)."""
    import numpy as np
    buf = np.zeros(_MESSAGE, dtype=np.uint8)
    world.Barrier()
    time.sleep(1.0)
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(nbytes // _MESSAGE):
        if world.rank == 0:
            world.Send(buf, dest=1)
        else:
            world.Recv(buf, source=0)
    world.Barrier()
    return time.perf_counter() - t0


def worker(kind: str, repeats: int) -> None:
    """Under MPI on two ranks: print one JSON line of what ``kind`` ("latency" or "rate") measured."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.size != 2:
        raise SystemExit(f"testbed_link.py: rank {world.rank}: needs exactly 2 ranks, got {world.size}")
    if kind == "latency":
        out = {"latency_s": statistics.median(_latency(world) for _ in range(repeats))}
    else:
        _stream(world, 4 * _MESSAGE)  # the connection, and UCX's rendezvous for large messages
        small, large = [], []
        for _ in range(repeats):
            small.append(_stream(world, _SMALL))
            large.append(_stream(world, _LARGE))
        t_small, t_large = statistics.median(small), statistics.median(large)
        # The slope between the two sizes cancels the fixed costs. Where both are too fast for it
        # (within a host, noise can make the larger stream the quicker), the larger stream's own
        # rate stands in: a lower bound, said so.
        bound = t_large <= t_small
        rate = _LARGE / t_large if bound else (_LARGE - _SMALL) / (t_large - t_small)
        out = {"rate_Bps": rate, "rate_is_lower_bound": bound, "t16_s": t_small, "t48_s": t_large,
               "burst_bytes": 0.0 if bound else max(0.0, _SMALL - rate * t_small)}
    if world.rank == 0:
        print("LINK " + json.dumps(out), flush=True)


def _parse(stdout: str) -> dict:
    return json.loads(next(line[5:] for line in stdout.splitlines() if line.startswith("LINK ")))


def measure(bed, rate: str, repeats: int = 3) -> dict:
    """The link of ``bed`` (a Testbed of 2 or more hosts, shaped at ``rate``): latency across hosts and
    within one host, the steady rate shaped and unshaped (see the module doc). Leaves h2's link shaped
    at ``rate`` again."""
    def job(hosts: str, kind: str) -> dict:
        command = [*ENV, str(BIN / "ddlrun"), "-n", "2", "-H", hosts, "--", sys.executable, __file__, "--worker", kind,
                   "--repeats", str(repeats)]
        done = bed.run("h1", command, cwd=str(ROOT), timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"testbed_link.py: {' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return _parse(done.stdout)

    result = {"rate": rate, "across_hosts": job("h1:1,h2:1", "latency")["latency_s"],
              "within_host": job("h1:2", "latency")["latency_s"]}
    shaped = job("h1:1,h2:1", "rate")
    same_host = job("h1:2", "rate")
    for host in bed.hosts:
        bed.shape(host, "")
    try:
        unshaped = job("h1:1,h2:1", "rate")
    finally:
        for host in bed.hosts:
            bed.shape(host, rate)
    result.update(shaped_rate_Bps=shaped["rate_Bps"], shaped_burst_bytes=shaped["burst_bytes"],
                  unshaped_rate_Bps=unshaped["rate_Bps"], within_host_rate_Bps=same_host["rate_Bps"],
                  within_host_rate_is_lower_bound=same_host["rate_is_lower_bound"], shaped=shaped,
                  unshaped=unshaped)
    return result


def describe(link: dict) -> str:
    return (f"latency (8 B ping-pong, one way): {link['across_hosts'] * 1e6:.1f} us across hosts, "
            f"{link['within_host'] * 1e6:.1f} us within a host; steady rate h1->h2: "
            f"{link['shaped_rate_Bps'] * 8 / 1e9:.3f} Gbit/s shaped at {link['rate']} (an idle spell bought "
            f"{link['shaped_burst_bytes'] / 1e3:.0f} KB at the veth's speed), "
            f"{link['unshaped_rate_Bps'] / 1e9:.2f} GB/s unshaped, "
            f"{'at least ' if link.get('within_host_rate_is_lower_bound') else ''}"
            f"{link['within_host_rate_Bps'] / 1e9:.2f} GB/s within a host")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("latency", "rate"))
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.repeats)
        return 0
    from ddl_triton.testbed import Testbed
    with Testbed(hosts=2, rate=args.rate) as bed:
        link = measure(bed, args.rate, args.repeats)
    print(describe(link))
    if args.json:
        Path(args.json).write_text(json.dumps(link, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
