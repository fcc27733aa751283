"""JAX data-parallel step time on "ddl" against JAX's own gloo collectives and mpi4jax, in the same run.

Run (from the repository root; results: bench/results/jax_step_time.md):

    DDL_TUNING_FILE=off OMP_NUM_THREADS=1 .venv/bin/ddlrun -n 2 -- .venv/bin/python bench/jax_step_time.py \
        [--rounds 7] [--steps 20] [--reps 5] [--md bench/results/jax_step_time.md] [--json out.json]
    .venv/bin/python bench/jax_step_time.py --hosts 2 --rate 1gbit   # 2 testbed hosts (root; take the lock)

One MPI job holds all three stacks in each rank, so every peer runs on the same processes, data
and moment: ``ddl_triton.init()`` (shm between the ranks of a host), ``jax.distributed.initialize``
with ``jax_cpu_collectives_implementation="gloo"`` (its coordinator on a port rank 0 picks and
broadcasts), and mpi4jax on ``MPI.COMM_WORLD``. Two measurements, each in interleaved rounds whose
method order rotates every round, each figure the median over rounds of the slowest rank's time:

1. **Training step** of examples/jax_train.py's digits CNN (138,698 fp32 parameters, 542 KiB of
   gradients), batch 32 per rank of synthetic 8x8 images, plain SGD, each step one ``jax.jit``
   program (the inputs already on the device):
   - ``local``: no communication at all (the step's compute, the floor);
   - ``ddl``: ``ddl_triton.jax.distributed(optax.sgd)``: one fused bucket, one ordered io_callback;
   - ``ddl int8``: the same with ``compression="int8"``;
   - ``jax gloo``: ``shard_map`` over the processes' devices, ``jax.lax.pmean`` of the gradients
     (JAX's own multi-process data parallelism on CPU);
   - ``mpi4jax``: ``mpi4jax.allreduce`` of each gradient leaf (its idiom: one MPI_Allreduce per
     leaf, inside jit) divided by n.
   A round runs ``--steps`` steps of each method; its figure is the block's time / steps.
2. **The gradient allreduce alone**, fp32 sums of 1-16 MiB, ``--reps`` calls per round:
   ``ddl`` (``jax.jit(ddl_triton.jax.allreduce)``), ``ddl numpy`` (``comm.allreduce`` on a NumPy
   array in place: the core without JAX's callback), ``jax gloo`` (``psum`` under shard_map),
   ``mpi4jax`` (``mpi4jax.allreduce`` in jit). nccl-tests' columns: algbw = bytes / time,
   busbw = algbw * 2(n-1)/n.
3. **What one call costs**, a 4-byte fp32 sum, ``--reps`` x 10 calls per round: ``plain jit`` (a
   jitted ``x + 1``: JAX's dispatch alone), ``ordered io_callback`` (a jitted ordered callback that
   copies its argument: the mechanism without a collective), ``ddl numpy`` (the core alone),
   ``ddl eager`` (``ddl_triton.jax.allreduce`` on a value), ``ddl jit``, ``jax gloo``, ``mpi4jax``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# One intra-op thread per rank, for every stack alike (torchrun's default): ranks share the host's
# cores, and a pool of two per rank on a busy 2-core host made the core's fp32 reductions (torch
# ops) up to 50x slower (a 542 KiB average: 3 ms instead of 64 us, measured).
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
STEP_METHODS = ("local", "ddl", "ddl int8", "jax gloo", "mpi4jax")
ALLREDUCE_METHODS = ("ddl", "ddl numpy", "jax gloo", "mpi4jax")
_MARK = "jax_step_time: result "
CALL_METHODS = ("plain jit", "ordered io_callback", "ddl numpy", "ddl eager", "ddl jit", "jax gloo", "mpi4jax")


def _setup():
    """(ddl communicator, the gloo mesh): ddl first (MPI), then JAX's distributed runtime on gloo."""
    import ddl_triton
    comm = ddl_triton.init()
    port = np.zeros(1, np.int64)
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1" if _one_host(comm) else "", 0))
            port[0] = s.getsockname()[1]
    comm.broadcast(port, root=0)
    host = np.zeros(64, np.uint8)
    if comm.rank == 0:
        name = ("127.0.0.1" if _one_host(comm) else socket.gethostname()).encode()
        host[:len(name)] = np.frombuffer(name, np.uint8)
    comm.broadcast(host.view(np.int32), root=0)
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"{bytes(host).rstrip(bytes(1)).decode()}:{int(port[0])}", num_processes=comm.size,
                               process_id=comm.rank)
    from jax.sharding import Mesh
    return comm, Mesh(np.array(jax.devices()), ("i",))


def _one_host(comm) -> bool:
    return len(comm.placement.on_node) == comm.size


def _slowest(comm, seconds: float) -> float:
    t = np.array([seconds], np.float64)
    comm.allreduce(t, op="max")
    return float(t[0])


def _step_fns(comm, mesh, batch: int):
    """{method: (run_block(k) -> seconds)} for the training step (module doc)."""
    import jax
    import jax.numpy as jnp
    import mpi4jax
    import optax
    from jax import shard_map
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mpi4py import MPI

    sys.path.insert(0, str(ROOT))
    from examples.jax_train import init_params, loss_fn

    import ddl_triton.jax as ddj
    n = comm.size
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((batch, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)
    params = init_params(jax.random.PRNGKey(0))
    sgd = optax.sgd(0.01)

    def jitted(tx):
        def step(p, s, x, y):
            u, s = tx.update(jax.grad(loss_fn)(p, x, y), s, p)
            return optax.apply_updates(p, u), s
        return jax.jit(step)

    def mpi4jax_tx():
        def update(g, s, p=None):
            g = jax.tree_util.tree_map(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=MPI.COMM_WORLD) / n, g)
            return sgd.update(g, s, p)
        return optax.GradientTransformation(sgd.init, update)

    local = {"local": (jitted(sgd), sgd), "ddl": (jitted(ddj.distributed(sgd)), sgd),
             "ddl int8": (jitted(ddj.distributed(sgd, compression="int8")), sgd),
             "mpi4jax": (jitted(mpi4jax_tx()), sgd)}
    rep, shd = NamedSharding(mesh, P()), NamedSharding(mesh, P("i"))

    def gloo_step(p, s, x, y):
        u, s = sgd.update(jax.lax.pmean(jax.grad(loss_fn)(p, x, y), "i"), s, p)
        return optax.apply_updates(p, u), s

    gloo = jax.jit(shard_map(gloo_step, mesh=mesh, in_specs=(P(), P(), P("i"), P("i")), out_specs=(P(), P())))
    glob = lambda tree, sh: jax.tree_util.tree_map(lambda v: jax.make_array_from_process_local_data(sh, np.asarray(v)), tree)  # noqa: E731
    fns = {}
    for name, (fn, tx) in local.items():
        state = [params, tx.init(params), jnp.asarray(x), jnp.asarray(y)]
        fns[name] = _block(comm, fn, state)
    gstate = [glob(params, rep), glob(sgd.init(params), rep), glob(x, shd), glob(y, shd)]
    fns["jax gloo"] = _block(comm, gloo, gstate)
    return fns


def _block(comm, fn, state):
    import jax
    state[0], state[1] = fn(*state)  # compile outside the timing
    jax.block_until_ready(state[0])

    def run(k: int) -> float:
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            state[0], state[1] = fn(*state)
        jax.block_until_ready(state[0])
        return _slowest(comm, (time.perf_counter() - t0) / k)
    return run


def _allreduce_fns(comm, mesh, nbytes: int):
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from jax import shard_map
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mpi4py import MPI

    import ddl_triton.jax as ddj
    count = nbytes // 4
    x = jnp.full(count, comm.rank + 1.0, jnp.float32)
    buf = np.full(count, comm.rank + 1.0, np.float32)
    gx = jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), np.asarray(x))
    psum = jax.jit(shard_map(lambda v: jax.lax.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()))
    calls = {"ddl": (jax.jit(lambda v: ddj.allreduce(v, "sum")), x), "jax gloo": (psum, gx),
             "mpi4jax": (jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=MPI.COMM_WORLD)), x)}
    fns = {}
    for name, (fn, arg) in calls.items():
        jax.block_until_ready(fn(arg))

        def run(k, fn=fn, arg=arg):
            comm.barrier()
            t0 = time.perf_counter()
            outs = [fn(arg) for _ in range(k)]
            jax.block_until_ready(outs)
            return _slowest(comm, (time.perf_counter() - t0) / k)
        fns[name] = run

    def numpy_run(k):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            comm.allreduce(buf)
        return _slowest(comm, (time.perf_counter() - t0) / k)
    fns["ddl numpy"] = numpy_run
    return fns


def _call_fns(comm, mesh):
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback
    fns = _allreduce_fns(comm, mesh, 4)
    x = jnp.ones(1, jnp.float32)
    plain = jax.jit(lambda v: v + 1)
    cb = jax.jit(lambda v: io_callback(lambda a: np.array(a), jax.ShapeDtypeStruct(v.shape, v.dtype), v, ordered=True))
    import ddl_triton.jax as ddj
    for name, fn in (("plain jit", plain), ("ordered io_callback", cb), ("ddl eager", lambda v: ddj.allreduce(v, "sum"))):
        jax.block_until_ready(fn(x))

        def run(k, fn=fn):
            comm.barrier()
            t0 = time.perf_counter()
            outs = [fn(x) for _ in range(k)]
            jax.block_until_ready(outs)
            return _slowest(comm, (time.perf_counter() - t0) / k)
        fns[name] = run
    fns["ddl jit"] = fns.pop("ddl")
    return fns


def _rounds(fns: dict, rounds: int, k: int) -> dict[str, list[float]]:
    names = list(fns)
    got: dict[str, list[float]] = {m: [] for m in names}
    for r in range(rounds):
        for m in names[r % len(names):] + names[: r % len(names)]:  # rotate: no method always first
            got[m].append(fns[m](k))
    return got


def _machine() -> dict:
    import jax
    import mpi4jax
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"host": platform.node(), "cpus": os.cpu_count(), "load": Path("/proc/loadavg").read_text().split()[:3],
            "python": platform.python_version(), "jax": jax.__version__, "mpi4jax": mpi4jax.__version__,
            "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _markdown(res: dict) -> str:
    n = res["ranks"]
    lines = [f"## {n} ranks, {res['where']} ({res['machine']['date']}, commit {res['machine']['commit']})", "",
             f"Machine: {res['machine']['cpus']} CPUs, load average {' '.join(res['machine']['load_before'])} "
             f"before and {' '.join(res['machine']['load'])} after (other jobs shared it); JAX "
             f"{res['machine']['jax']}, mpi4jax {res['machine']['mpi4jax']}; {res['rounds']} interleaved rounds.", "",
             f"Training step (digits CNN, batch {res['batch']} per rank, {res['steps']} steps per round): "
             "median over rounds of the slowest rank's ms per step", "",
             "| method | ms / step | p20 | p80 | vs ddl |", "|---|---|---|---|---|"]
    ddl = statistics.median(res["step"]["ddl"])
    for m, v in res["step"].items():
        q = statistics.quantiles(v, n=5) if len(v) > 1 else [v[0]] * 4
        lines.append(f"| {m} | {1e3 * statistics.median(v):.2f} | {1e3 * q[0]:.2f} | {1e3 * q[3]:.2f} | "
                     f"{statistics.median(v) / ddl:.2f}x |")
    lines += ["", f"Gradient allreduce alone (fp32 sum, {res['reps']} calls per round): median ms per call, "
              "algbw / busbw in GB/s (busbw = algbw * 2(n-1)/n)", "",
              "| MiB | " + " | ".join(f"{m} ms | algbw | busbw" for m in ALLREDUCE_METHODS) + " |",
              "|---|" + "---|---|---|" * len(ALLREDUCE_METHODS)]
    for mib, per in res["allreduce"].items():
        cells = []
        for m in ALLREDUCE_METHODS:
            t = statistics.median(per[m])
            alg = int(mib) * 2 ** 20 / t / 1e9
            cells.append(f"{1e3 * t:.2f} | {alg:.2f} | {alg * 2 * (n - 1) / n:.2f}")
        lines.append(f"| {mib} | " + " | ".join(cells) + " |")
    lines += ["", f"One call of a 4-byte fp32 sum ({10 * res['reps']} calls per round): median us per call", "",
              "| " + " | ".join(CALL_METHODS) + " |", "|" + "---|" * len(CALL_METHODS),
              "| " + " | ".join(f"{1e6 * statistics.median(res['call'][m]):.0f}" for m in CALL_METHODS) + " |"]
    return "\n".join(lines) + "\n"


def _testbed(args) -> int:
    """This benchmark on 2 testbed hosts (docs/testbed.md; root), one rank each, links shaped to
    ``args.rate``: ddlrun inside h1 (MPI between the hosts, UCX on eth0); the markdown and JSON
    come back on stdout and go where ``--md`` / ``--json`` say. The caller holds the testbed lock."""
    from ddl_triton.testbed import Testbed
    bin_ = Path(sys.executable).parent
    env = {"DDL_TUNING_FILE": "off", "OMP_NUM_THREADS": "1", "UCX_NET_DEVICES": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
           "HYDRA_LAUNCHER_EXEC": str(bin_ / "ddl-testbed-ssh"), "PATH": os.environ.get("PATH", "")}
    worker = [str(bin_ / "python"), str(Path(__file__).resolve()), "--rounds", str(args.rounds), "--steps",
              str(args.steps), "--reps", str(args.reps), "--sizes-mib", args.sizes_mib, "--batch", str(args.batch),
              "--where", f"2 testbed hosts x 1 rank, links {args.rate}", "--print-json"]
    with Testbed(hosts=2, rate=args.rate) as bed:  # torn down on the way out, failure or not
        proc = bed.run("h1", ["env", *(f"{k}={v}" for k, v in env.items()), str(bin_ / "ddlrun"), "-n", "2",
                              "-H", "h1:1,h2:1", "--", *worker], cwd=str(ROOT), timeout=1500)
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-6000:], file=sys.stderr)
        return 1
    res = json.loads([x for x in proc.stdout.splitlines() if x.startswith(_MARK)][0][len(_MARK):])
    text = _markdown(res)
    print(text, flush=True)
    if args.md:
        with open(args.md, "a") as f:
            f.write("\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sizes-mib", default="1,2,4,8,16")
    p.add_argument("--where", default="one host")
    p.add_argument("--md", help="append the tables to this markdown file (rank 0)")
    p.add_argument("--json", help="write the figures as JSON here (rank 0)")
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                   help="2: start the job itself on a testbed of 2 hosts, 1 rank each (root; hold the lock)")
    p.add_argument("--rate", default="1gbit", help="the testbed's link rate (--hosts 2)")
    p.add_argument("--print-json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hosts == 2:
        return _testbed(args)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    comm, mesh = _setup()
    res = {"ranks": comm.size, "where": args.where, "rounds": args.rounds, "steps": args.steps, "reps": args.reps,
           "batch": args.batch}
    fns = _step_fns(comm, mesh, args.batch)
    res["step"] = {m: v for m, v in _rounds({m: fns[m] for m in STEP_METHODS}, args.rounds, args.steps).items()}
    res["allreduce"] = {}
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        fns = _allreduce_fns(comm, mesh, mib << 20)
        res["allreduce"][str(mib)] = _rounds({m: fns[m] for m in ALLREDUCE_METHODS}, args.rounds, args.reps)
    fns = _call_fns(comm, mesh)
    res["call"] = _rounds({m: fns[m] for m in CALL_METHODS}, args.rounds, 10 * args.reps)
    res["machine"] = dict(_machine(), load_before=load_before)
    if comm.rank == 0 and args.print_json:
        print(_MARK + json.dumps(res), flush=True)
    elif comm.rank == 0:
        text = _markdown(res)
        print(text, flush=True)
        if args.md:
            with open(args.md, "a") as f:
                f.write("\n" + text)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
    import ddl_triton
    ddl_triton.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
