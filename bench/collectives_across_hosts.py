"""bench/collectives.py across real hosts: a testbed of 2 hosts (docs/testbed.md), links shaped to
``--rate``, every schedule of ddl_triton against MPICH and gloo, at 2 hosts x 1 rank and 2 hosts x
2 ranks. Needs root (the testbed); run from the repository root:

    .venv/bin/python bench/collectives_across_hosts.py --rate 1gbit --max-bytes 16777216

Each layout runs collectives.py under ``ddlrun -H h1:K,h2:K`` inside h1, with ``--schedule all
--link-rate RATE``, so its table adds the link bound and each row's share of it. The JSON of each
layout goes to ``--json-prefix``<layout>.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddl_triton.testbed import Testbed

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--layouts", default="1,2", help="ranks per host, a comma list (2 hosts each)")
    p.add_argument("--json-prefix", default="build/collectives-across-hosts-")
    args, rest = p.parse_known_args(argv)
    env = ["env", "UCX_NET_DEVICES=eth0", "GLOO_SOCKET_IFNAME=eth0", f"HYDRA_LAUNCHER_EXEC={BIN / 'ddl-testbed-ssh'}",
           "DDL_TUNING_FILE=off", "OMP_NUM_THREADS=1"]
    worst = 0
    with Testbed(hosts=2, rate=args.rate) as bed:
        for per_host in (int(k) for k in args.layouts.split(",")):
            out = ROOT / f"{args.json_prefix}2x{per_host}.json"
            command = [*env, str(BIN / "ddlrun"), "-n", str(2 * per_host), "-H", f"h1:{per_host},h2:{per_host}", "--",
                       sys.executable, "bench/collectives.py", "--schedule", "all", "--link-rate", args.rate,
                       "--json", str(out), *rest]
            print(f"# 2 hosts x {per_host} rank{'s' if per_host > 1 else ''}, links {args.rate}", flush=True)
            done = bed.run("h1", command, cwd=str(ROOT), capture_output=False, timeout=3600)
            worst = max(worst, done.returncode)
    return worst


if __name__ == "__main__":
    sys.exit(main())
