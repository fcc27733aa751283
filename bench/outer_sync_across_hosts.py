"""Per-step allreduce against outer sync (DiLoCo, Streaming DiLoCo) across testbed hosts whose links
are shaped with tbf: time to a target loss, final eval loss at equal tokens, compute utilisation,
bytes between hosts, replicas bitwise identical, exit codes; the planner's choice beside the best
measured configuration, and the measured crossover beside the simulator's prediction.

On this machine (root; docs/testbed.md), from the repository root:

    .venv/bin/python bench/outer_sync_across_hosts.py --rates 100mbit,10mbit,1gbit --workloads cnn,lm \\
        [--hosts 2] [--steps 256] [--configs "no-comm,gloo fp32,ddl auto,diloco H=8,..."] \\
        [--json-prefix build/outer-sync-] [--markdown build/outer-sync.md]
    .venv/bin/python bench/outer_sync_across_hosts.py --summarize build/outer-sync-   # the tables again

One testbed of ``--hosts`` hosts (one rank each), its links shaped to each rate in turn; per rate
and workload one job: one ``torchrun --node-rank i`` per host at once (bench/_host_jobs.py), running
bench/_outer_sync_rank.py, which trains every configuration in turn in that job (its doc; the names
are bench/_outer_sync_table.py's). The "no-comm" row, the same layout training without any
communication in the same job, is what compute utilisation is measured against (the ranks share this
VM's cores); a second no-comm row ends the job, so the two give the job's drift. Every job's JSON goes to ``<json-prefix><workload>-<rate>.json``, its hosts' exit codes
beside it (``.codes.json``). The tables, the planner's choice against the best measured row, the
measured crossover and the simulator's (ddl_triton/simulation/outer_sync_crossover.py, with the
no-comm step time and the model's size) are printed, and written to ``--markdown`` when given.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _host_jobs import torchrun_on_every_host  # noqa: E402
from _outer_sync_table import best, markdown, measured_crossover, parse_config, rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RANK_SCRIPT = "bench/_outer_sync_rank.py"
PER_STEP = "no-comm,gloo fp32,ddl auto"
OUTER = "diloco H=8,diloco H=32,diloco H=128,streaming {m} H=32 F=4"
TESTBED_GOODPUT = 0.9564  # payload share of a tbf rate (ddl_triton/simulation/clusters/testbed.toml)


def default_configs(method: str, outer: bool) -> str:
    """Every row of the issue's matrix; the outer ones only where DiLoCo exists."""
    return ",".join([PER_STEP] + ([OUTER.format(m=method), "planner"] if outer else []) + ["no-comm again"])


def streaming_method() -> str:
    """The 4-bit registry method where one is registered ("int4"), else int8."""
    from ddl_triton import compression_methods
    return "int4" if "int4" in compression_methods.names() else "int8"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="100mbit,10mbit,1gbit", help="tbf rates, a comma list, run in this order")
    p.add_argument("--workloads", default="cnn,lm")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--configs", default="", help="comma list (default: every row the build can run)")
    p.add_argument("--outer-lr", default="0.7", help="DiLoCo's outer SGD learning rate (the paper's 0.7)")
    p.add_argument("--outer-momentum", default="0.9", help="its Nesterov momentum (0: none; with lr 1.0, plain "
                   "averaging of the replicas)")
    p.add_argument("--link-only-planner", action="store_true", help="the planner row plans on the link alone, as in "
                   "runs 1-3 (default: also the codec and per-step fp32 call it measures, as DiLoCo auto does)")
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per job")
    p.add_argument("--json-prefix", default="build/outer-sync-")
    p.add_argument("--markdown", default="", help="also write the tables to this file")
    p.add_argument("--summarize", default="", help="no run: the tables of the JSON files with this prefix")
    args = p.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize, args.markdown)
    try:
        import ddl_triton.torch as ddt
        has_diloco = hasattr(ddt, "DiLoCo")
    except ImportError:
        has_diloco = False
    method = streaming_method()
    configs = args.configs or default_configs(method, has_diloco)
    for name in configs.split(","):
        if name != "planner":
            parse_config(name)  # a bad name fails here, before any host starts
    (ROOT / args.json_prefix).parent.mkdir(parents=True, exist_ok=True)
    from ddl_triton.testbed import Testbed
    rates = args.rates.split(",")
    worst = 0
    with Testbed(hosts=args.hosts, rate=rates[0]) as bed:
        names = [f"h{i + 1}" for i in range(args.hosts)]
        for n, rate in enumerate(rates):
            for host in names:
                bed.shape(host, rate)
            for w, workload in enumerate(args.workloads.split(",")):
                out = ROOT / f"{args.json_prefix}{workload}-{rate}.json"
                out.unlink(missing_ok=True)  # a failed job must not leave an older run's figures behind
                script = [RANK_SCRIPT, "--workload", workload, "--steps", str(args.steps), "--configs", configs,
                          "--link-rate", rate, "--eval-every", str(args.eval_every), "--streaming-method", method,
                          "--outer-lr", args.outer_lr, "--outer-momentum", args.outer_momentum, "--json", str(out),
                          *(["--no-measured-terms"] if args.link_only_planner else [])]
                print(f"# {workload}, {args.hosts} hosts x 1 rank, links {rate}: {configs}", flush=True)
                codes = _job(bed, names, script, args.port + 10 * n + w, args.timeout)
                (ROOT / f"{args.json_prefix}{workload}-{rate}.codes.json").write_text(json.dumps(codes))
                worst = max(worst, *(abs(c) for c in codes))
    summarize(args.json_prefix, args.markdown)
    return worst


def _job(bed, hosts: list[str], script: list[str], port: int, timeout: float) -> list[int]:
    env = ["env", "GLOO_SOCKET_IFNAME=eth0", "UCX_NET_DEVICES=eth0", "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1",
           f"DDL_TUNING_FILE={os.environ.get('DDL_TUNING_FILE', 'off')}"]

    def start(host: str, argv: list[str], out) -> subprocess.Popen:
        return bed.popen(host, env + argv, cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT)

    codes, texts = torchrun_on_every_host(start, hosts, 1, port, script, timeout)
    for host, code, text in zip(hosts, codes, texts):
        lines = [x for x in text.splitlines() if x.startswith("# ")] if code == 0 else text.splitlines()[-60:]
        if lines:
            print(f"## {host}: exit {code}\n" + "\n".join(lines), flush=True)
    return codes


def _rate_bits(rate: str) -> float:
    from ddl_triton.testbed.hosts import parse_rate
    return float(parse_rate(rate))


def summarize(prefix: str, markdown_path: str = "") -> int:
    """The tables of every job whose JSON starts with ``prefix`` (module doc)."""
    from ddl_triton.planning.outer_sync import format_rate
    from ddl_triton.simulation.outer_sync_crossover import crossover

    found = sorted(p for p in (ROOT / prefix).parent.glob(Path(prefix).name + "*.json")
                   if not p.name.endswith(".codes.json"))
    if not found:
        print(f"outer_sync_across_hosts.py: no JSON file starts with {prefix!r}", file=sys.stderr)
        return 2
    text, by_workload = [], {}
    for path in found:
        result = json.loads(path.read_text())
        meta = result["meta"]
        codes_path = path.with_name(path.name[:-5] + ".codes.json")
        codes = json.loads(codes_path.read_text()) if codes_path.exists() else None
        table = rows(result)
        by_workload.setdefault(meta["workload"], {})[_rate_bits(meta["link_rate"])] = (table, result)
        top = best(table)
        planner = next((r for r in table if r["config"].startswith("planner")), None)
        local = [r["train_s"] for r in result["results"] if r["config"] in ("no-comm", "no-comm again")]
        drift = f"; no-comm {', '.join(f'{x:.2f}' for x in local)} s" if len(local) > 1 else ""
        outer = f"; outer SGD lr {meta.get('outer_lr', 0.7)}, momentum {meta.get('outer_momentum', 0.9)}"
        text.append(f"\n### {meta['workload']}, {meta['hosts']} hosts x 1 rank, links {meta['link_rate']} "
                    f"({meta['steps']} steps, batch {meta['batch']} per rank, {meta['model_bytes'] / 1e6:.2f} MB fp32"
                    f"{outer}; exit codes {codes}{drift})\n")
        text.append(markdown(table))
        why = next((r.get("why") for r in result["results"] if r["config"] == "planner"), None)
        if why:
            text.append(f"\nPlanner: {why}")
        if top and planner and planner["time_to_target_s"] is not None:
            text.append(f"\nPlanner's choice ({planner['config'][9:]}) {planner['time_to_target_s']:.2f} s to target "
                        f"against the best measured ({top['config']}) {top['time_to_target_s']:.2f} s: "
                        f"{planner['time_to_target_s'] / top['time_to_target_s'] - 1:+.0%}")
        elif top:
            text.append(f"\nBest measured: {top['config']}, {top['time_to_target_s']:.2f} s to target"
                        + (f"; the planner's choice ({planner['config'][9:]}) did not reach it" if planner else ""))
    for workload, per_rate in by_workload.items():
        any_result = next(iter(per_rate.values()))[1]
        no_comm = [r for _, res in per_rate.values() for r in res["results"] if r["config"] == "no-comm"]
        step_s = sorted(r["train_s"] / r["steps"] for r in no_comm)[len(no_comm) // 2] if no_comm else None
        measured = measured_crossover({rate: table for rate, (table, _) in per_rate.items()})
        line = f"\n**{workload}: crossover.** Measured: {measured}."
        if step_s:
            method = any_result["meta"].get("streaming_method", "int4")
            sim = crossover(model_bytes=any_result["meta"]["model_bytes"], step_s=step_s,
                            hosts=any_result["meta"]["hosts"], link_latency_s=8.5e-6, compression=method)
            rates = dict(sim.rates)
            line += (f" Simulator (the median no-comm step, {step_s * 1e3:.1f} ms; the planner's model): per-step "
                     f"fp32 reaches 90% utilisation down to {format_rate(rates['fp32'])} of payload, the planner's "
                     f"per-step candidates (fp32, int8, {method} named) down to "
                     f"{format_rate(sim.planner) if sim.planner else 'no rate'}; below, the planner chooses outer sync "
                     f"(about {format_rate(sim.planner / TESTBED_GOODPUT) if sim.planner else '-'} of tbf rate).")
        text.append(line)
    out = "\n".join(text)
    print(out, flush=True)
    if markdown_path:
        Path(markdown_path).write_text(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
