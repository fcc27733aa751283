"""bench/train_scaling.py across hosts: 2 hosts, links shaped to ``--rate``, under ddlrun and under
torchrun, at 2 hosts x 1 rank and 2 hosts x 2 ranks; each job's own table as it ends, then one
compact table of every job's shares of the no-comm ceiling beside their bounds, and per job the
exposed communication per step of each mode against its wire bound (train_scaling.py's doc).

On a testbed (docs/testbed.md; needs root), run from the repository root:

    .venv/bin/python bench/train_scaling_across_hosts.py --rate 1gbit [--layouts 1,2]
        [--launchers ddlrun,torchrun] [train_scaling.py's flags: --model cnn --steps 5 --rounds 6 ...]

On real hosts, run it on the first of them, with the repository (and its virtual environment) at
the same path on every host and a shared file system under it (rank 0 writes the JSON there):

    .venv/bin/python bench/train_scaling_across_hosts.py --hosts a,b --rate 10gbit --iface eth1

A testbed run is that same real-hosts run, started inside h1 with ``--hosts h1,h2`` and
``ddl-testbed-ssh`` as the ssh (``--ssh``). Per layout and launcher:
- ddlrun: ``ddlrun -n 2K -H a:K,b:K`` on this host; hydra reaches the other through ``--ssh``
  (HYDRA_LAUNCHER_EXEC);
- torchrun: ``ssh HOST torchrun --nnodes 2 --node-rank i --nproc-per-node K --master-addr a`` on
  each host at once (a static rendezvous: ranks 0..K-1 on a, as under ddlrun). Bounded: past
  ``--timeout``, or 10 s after one host's torchrun failed, the others are stopped.
Every job runs train_scaling.py with ``--link-rate RATE --link-iface IFACE`` and
DDL_TUNING_FILE=off (unless set), OMP_NUM_THREADS=1, GLOO_SOCKET_IFNAME and UCX_NET_DEVICES set
to the interface. The JSON of each job goes to ``--json-prefix``<launcher>-2x<K>.json. ``--lock F``
holds an exclusive lock on F during each job (``--lock /tmp/ddl_bench.lock`` for timed runs on a
shared machine), so other timed runs can go between the jobs.

Several runs (separate jobs, each with its own --json-prefix), summarized without running:

    .venv/bin/python bench/train_scaling_across_hosts.py --summarize build/ts-r1-,build/ts-r2-,build/ts-r3-

prints, per job and mode, the exposed ms of each run (median [p25-p75] of its rounds), of all
runs' rounds together, the wire bound and the exposed time in multiples of it, the share of
no-comm (median and the runs' range), and the paired ratios ddl / gloo and auto / ddl.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _exposure import quartiles  # bench/ is on the path
from _host_jobs import ddl_options_from_shell, locked as _locked, torchrun_on_every_host

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPT = "bench/train_scaling.py"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit", help="the rate of each host's link (the testbed shapes it to this)")
    p.add_argument("--hosts", default="", help="real hosts, a comma list of 2, this one first (default: a testbed)")
    p.add_argument("--ssh", default="ssh", help="the command that runs a command line on another host")
    p.add_argument("--iface", default="eth0", help="the interface between the hosts")
    p.add_argument("--layouts", default="1,2", help="ranks per host, a comma list (2 hosts each)")
    p.add_argument("--launchers", default="ddlrun,torchrun")
    p.add_argument("--port", type=int, default=29431, help="torchrun's store on the first host (+1 per job)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    p.add_argument("--json-prefix", default="build/train-scaling-across-hosts-")
    p.add_argument("--lock", default="", help="a file to hold an exclusive lock on during each job (as flock(1) "
                   "would: /tmp/ddl_bench.lock for timed runs), released between jobs")
    p.add_argument("--summarize", default="", help="no run: print the exposed-time table across the runs whose "
                   "JSON files start with these --json-prefix values (a comma list, one per run)")
    args, rest = p.parse_known_args(argv)
    if args.summarize:
        return _summarize(args.summarize.split(","))
    launchers = args.launchers.split(",")
    if set(launchers) - {"ddlrun", "torchrun"}:
        p.error(f"--launchers: ddlrun and/or torchrun, not {args.launchers!r}")
    layouts = [int(k) for k in args.layouts.split(",")]
    if not args.hosts:
        return _on_testbed(args, argv if argv is not None else sys.argv[1:])
    hosts = args.hosts.split(",")
    if len(hosts) != 2:
        p.error(f"--hosts: two hosts, not {args.hosts!r}")
    (ROOT / args.json_prefix).parent.mkdir(parents=True, exist_ok=True)
    worst, jobs = 0, []
    for per_host in layouts:
        for launcher in launchers:
            out = ROOT / f"{args.json_prefix}{launcher}-2x{per_host}.json"
            out.unlink(missing_ok=True)  # a failed job must not leave an older run's figures behind
            flags = ["--link-rate", args.rate, "--link-iface", args.iface, "--json", str(out), *rest]
            print(f"# {launcher}: 2 hosts x {per_host} rank{'s' if per_host > 1 else ''}, links {args.rate}",
                  flush=True)
            run = _ddlrun if launcher == "ddlrun" else _torchrun
            with _locked(args.lock):
                code = run(args, hosts, per_host, flags, port=args.port + len(jobs))
            worst = max(worst, code)
            jobs.append((launcher, per_host, out))
    _print_summary(jobs, args.rate)
    _print_exposed([_load(jobs)])
    return worst


def _on_testbed(args, argv: list[str]) -> int:
    """Bring up a testbed of 2 hosts at ``args.rate`` and run this script inside h1 against h1,h2."""
    from ddl_triton.testbed import Testbed
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--hosts", "h1,h2",
               "--ssh", str(BIN / "ddl-testbed-ssh")]
    lock_fd = None
    if args.lock:
        # h1 has a /tmp of its own: the lock file it must hold is this one, reached through an
        # inherited descriptor (its /proc/self/fd link opens this very file from any mount namespace).
        lock_fd = os.open(args.lock, os.O_RDWR | os.O_CREAT, 0o666)
        command += ["--lock", f"/proc/self/fd/{lock_fd}"]
    try:
        with Testbed(hosts=2, rate=args.rate) as bed:
            jobs = len(args.layouts.split(",")) * len(args.launchers.split(","))
            done = bed.run("h1", command, cwd=str(ROOT), capture_output=False, timeout=args.timeout * jobs + 60,
                           pass_fds=() if lock_fd is None else (lock_fd,))
            return done.returncode
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def _env(iface: str, ssh: str) -> dict[str, str]:
    env = {"UCX_NET_DEVICES": iface, "GLOO_SOCKET_IFNAME": iface, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "DDL_TUNING_FILE": os.environ.get("DDL_TUNING_FILE", "off"),
           "HYDRA_LAUNCHER_EXEC": shutil.which(ssh) or ssh}
    if os.environ.get("PYTHONPATH"):  # a checkout other than the installed one: the ranks import it too
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    # This shell's other DDL_* options reach every rank under both launchers (ssh passes none).
    env.update({k: v for k, v in ddl_options_from_shell().items() if k not in env})
    return env


def _ddlrun(args, hosts: list[str], per_host: int, flags: list[str], port: int) -> int:
    env = dict(os.environ, **_env(args.iface, args.ssh))
    command = [str(BIN / "ddlrun"), "-n", str(2 * per_host), "-H", ",".join(f"{h}:{per_host}" for h in hosts), "--",
               sys.executable, SCRIPT, *flags]
    try:
        return subprocess.run(command, cwd=ROOT, env=env, timeout=args.timeout, stdin=subprocess.DEVNULL).returncode
    except subprocess.TimeoutExpired:
        print(f"# ddlrun: past --timeout {args.timeout:g} s, stopped", flush=True)
        return 124


def _torchrun(args, hosts: list[str], per_host: int, flags: list[str], port: int) -> int:
    """One torchrun per host, at once, through ``args.ssh``; the first host's output printed, and
    every host's tail on a failure."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in _env(args.iface, args.ssh).items() if k != "HYDRA_LAUNCHER_EXEC")

    def start(host: str, torchrun: list[str], out) -> subprocess.Popen:
        # exec all the way down, so that stopping the ssh stops torchrun (which stops its ranks).
        remote = f"cd {shlex.quote(str(ROOT))} && exec env {env} {shlex.join(torchrun)}"
        return subprocess.Popen([args.ssh, host, remote], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)

    codes, texts = torchrun_on_every_host(start, hosts, per_host, port, [SCRIPT, *flags], args.timeout)
    for i, (host, text) in enumerate(zip(hosts, texts)):
        if i == 0 and not any(codes):
            print(text, end="", flush=True)
        elif any(codes):
            print(f"# torchrun on {host}: exit {codes[i]}\n{text[-4000:]}", flush=True)
    return max(abs(c) for c in codes)


def _print_summary(jobs: list[tuple[str, int, Path]], rate: str) -> None:
    """Per model: each mode's share of the no-comm ceiling and its bound, one column per job."""
    loaded = []
    for launcher, per_host, path in jobs:
        results = json.loads(path.read_text())["results"] if path.exists() else []
        loaded.append((f"{launcher} 2x{per_host}", {r["model"]: r for r in results}))
    models = list(dict.fromkeys(m for _, by_model in loaded for m in by_model))
    for model in models:
        print(f"\n# {model}, links {rate}: share of the no-comm ceiling (paired medians) / the mode's bound "
              f"(from the bytes it put on the link)", flush=True)
        columns = [(name, by_model.get(model)) for name, by_model in loaded]
        modes = list(dict.fromkeys(_row_name(row["mode"]) for _, r in columns if r for row in r["rows"]))
        print(f"{'':>16}" + "".join(f" {name:>17}" for name, _ in columns))

        def line(label: str, cell) -> None:
            print(f"{label:>16}" + "".join(f" {cell(r) if r else 'failed':>17}" for _, r in columns), flush=True)

        line("fp32 bound", lambda r: _pct(r["fp32_bound"]))
        line("no-comm step ms", lambda r: next((f"{x['step_ms']:.1f}" for x in r["rows"]
                                                 if x["mode"] == "ddp no-comm"), "-"))
        # What the machine allows: every rank training alone at once, against one rank alone (with
        # more ranks than cores, this is where oversubscription shows).
        line("ceiling/1 rank", lambda r: next((_pct(x["efficiency"]) for x in r["rows"]
                                               if _row_name(x["mode"]) == "N independent"), "-"))
        for mode in modes:
            def cell(r, mode=mode) -> str:
                row = next((x for x in r["rows"] if _row_name(x["mode"]) == mode), None)
                if row is None:
                    return "-"
                if row["bound"] is None:
                    return _pct(row["of_no_comm"])
                return f"{_pct(row['of_no_comm'])} / {_pct(row['bound'])}"
            line(mode, cell)


def _load(jobs: list[tuple[str, int, Path]]) -> dict:
    """{(job name, model): result} of the jobs' JSON files that exist."""
    out = {}
    for launcher, per_host, path in jobs:
        if path.exists():
            for r in json.loads(path.read_text())["results"]:
                out[(f"{launcher} 2x{per_host}", r["model"])] = r
    return out


def _summarize(prefixes: list[str]) -> int:
    runs = []
    for prefix in prefixes:
        found = sorted((ROOT / prefix).parent.glob(Path(prefix).name + "*-2x*.json"))
        if not found:
            print(f"train_scaling_across_hosts.py: no JSON file starts with {prefix!r}", file=sys.stderr)
            return 2
        jobs = [(f.stem[len(Path(prefix).name):].rsplit("-2x", 1)[0], int(f.stem.rsplit("-2x", 1)[1]), f)
                for f in found]
        runs.append(_load(jobs))
    _print_exposed(runs)
    return 0


def _print_exposed(runs: list[dict]) -> None:
    """Per job and mode: the exposed time per step of each run (median [p25-p75] of its rounds),
    of every run's rounds together, the wire bound and the share of no-comm (median, the runs'
    range); then the paired figures the issue asks for (ddl / gloo, ddl / its bound, auto / ddl)."""
    keys = list(dict.fromkeys(k for run in runs for k in run))
    for key in keys:
        results = [run.get(key) for run in runs]
        first = next(r for r in results if r)
        print(f"\n# {key[1]}, {key[0]}, links {first['link_rate']}: exposed ms per step, median [p25-p75] over "
              f"rounds, per run and all runs' rounds together; wire bound ms; share of no-comm (runs' range)",
              flush=True)
        modes = list(dict.fromkeys(row["mode"] for r in results if r for row in r["rows"]
                                   if row.get("exposed_ms_quartiles")))
        print(f"{'mode':>16}" + "".join(f" {'run ' + str(i + 1):>21}" for i in range(len(runs)))
              + f" {'all runs':>21} {'wire ms':>8} {'x wire':>7} {'of no-comm':>21}")
        pooled = {}
        for mode in modes:
            rows = [next((x for x in r["rows"] if x["mode"] == mode), None) if r else None for r in results]
            cells = [_q(row["exposed_ms_quartiles"]) if row else "-" for row in rows]
            every = [v for row in rows if row for v in row["exposed_ms_rounds"]]
            pooled[mode] = quartiles(every)
            wire = next((row["wire_bound_ms"] for row in rows if row and row["wire_bound_ms"] is not None), None)
            ratio = f"{pooled[mode][1] / wire:.2f}" if pooled[mode] and wire and wire >= 0.01 else "-"
            shares = [row["of_no_comm"] for row in rows if row and row["of_no_comm"]]
            share = f"{statistics.median(shares):.1%} ({min(shares):.1%}-{max(shares):.1%})" if shares else "-"
            print(f"{mode:>16}" + "".join(f" {c:>21}" for c in cells) + f" {_q(pooled[mode]):>21} "
                  f"{wire if wire is not None else float('nan'):>8.2f} {ratio:>7} {share:>21}", flush=True)
        auto = next((m for m in ("ddl[auto]", "ddl+auto") if m in pooled), None)
        for a, b in (("ddl", "gloo"), (auto, "ddl")):
            if a in pooled and b in pooled and pooled[a] and pooled[b]:
                per_run = [_median_of(r, a) / _median_of(r, b) for r in results
                           if r and _median_of(r, a) is not None and _median_of(r, b)]
                print(f"# {a} / {b} exposed: {pooled[a][1] / pooled[b][1]:.2f} (all rounds); per run "
                      + ", ".join(f"{x:.2f}" for x in per_run), flush=True)


def _median_of(result: dict, mode: str) -> float | None:
    row = next((x for x in result["rows"] if x["mode"] == mode), None)
    return row["exposed_ms_quartiles"][1] if row and row.get("exposed_ms_quartiles") else None


def _q(q) -> str:
    return f"{q[1]:.2f} [{q[0]:.2f}-{q[2]:.2f}]" if q else "-"


def _row_name(mode: str) -> str:
    """One row for the ceiling across layouts: "2 independent" and "4 independent" are "N independent"."""
    return "N independent" if mode.endswith(" independent") else mode


def _pct(x) -> str:
    return f"{x:.1%}" if x else "-"


if __name__ == "__main__":
    sys.exit(main())
