"""Step time of Keras training on "ddl" (ddl_triton.tensorflow) beside tf.distribute.MultiWorkerMirroredStrategy.

Run (from the repository root; results: bench/results/tf_step_time.md):

    .venv/bin/python bench/tf_step_time.py [--rounds 7] [--steps 20] [--ranks 2] [--json out.json]
    .venv/bin/python bench/tf_step_time.py --hosts 2 --rate 1gbit     # a testbed of 2 hosts, 1 rank each
    ... [--launcher env] [--compression auto]   # env:// instead of mpiexec; the ddl step's compression

One launch of ``--ranks`` ranks (mpiexec, or with ``--launcher env`` one process per rank given
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: ``ddl_triton.init()`` takes either); every rank holds
both set-ups, so the rounds interleave in the same processes (the order swaps every round):

- ``ddl``: the digits CNN of examples/tf_train.py (138,698 parameters, 555 KB of fp32 gradients),
  batch 32 per rank, SGD; a ``tf.function`` step whose ``DistributedGradientTape`` averages the
  gradients (one fused bucket, shared memory between the ranks, ``DDL_TUNING_FILE=off``);
- ``mwms``: the same model and step under ``MultiWorkerMirroredStrategy`` (TF_CONFIG: localhost
  ports; ``CommunicationOptions(implementation=RING)``, TF's CPU collective ops over gRPC): the
  loss summed over the rank's rows / global batch, and Keras's optimizer all-reduces (sum) the
  gradients across the workers inside ``apply_gradients``, as TF's custom-loop guide does.

A block is ``--steps`` steps timed after a barrier, its time the slowest rank's; a figure is the
median over rounds of the block's time per step. Then the gradient allreduce alone, fp32 of 1-16
MiB, interleaved the same way: ``ddl`` is ``ddl_triton.tensorflow.allreduce(x)`` (Average, the default) inside a
``tf.function``; ``mwms`` is ``replica_context.all_reduce(SUM)`` in ``strategy.run`` inside a
``tf.function``; algbw = bytes / time, busbw = algbw * 2(n-1)/n (nccl-tests). And the cost of one
call: a 4-byte allreduce eagerly, inside a ``tf.function``, and the core's own
``comm.allreduce`` on a NumPy array, for the bridge's overhead (docs/tensorflow.md).

``--hosts 2``: a testbed of two hosts whose links are shaped to ``--rate`` (docs/testbed.md; needs
root, and the caller holds the testbed lock), one rank per host: started by ``ddlrun -H h1:1,h2:1``
("ddl" crosses the hosts over MPI, UCX on eth0) or, with ``--launcher env``, one process per host
meeting at h1 ("ddl" crosses over its gloo transport); the strategy's gRPC runs between h1 and h2.
``--compression``: the ddl step's ``GradientReducer`` compression (default "none").

TF's threads: intra-op cores / ranks, inter-op 2, both set before the strategy is made (it must be
made before any other TF op). The host's load average is printed with the results: other jobs
on a shared 2-core machine shift every figure, which is why the rounds interleave.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SIZES_MIB = (1, 2, 4, 8, 16)
_MARK = "tf_step_time: result "


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# -- one rank (under mpiexec) -----------------------------------------------------------------------
def _worker(args) -> None:
    import ddl_triton
    comm = ddl_triton.init()  # MPI's ranks under mpiexec/ddlrun, else env:// (RANK, WORLD_SIZE, MASTER_ADDR)
    rank, size = comm.rank, comm.size
    addrs = args.addrs.split(",") if args.addrs else ["localhost"] * size
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"{a}:{p}" for a, p in zip(addrs, args.ports)]},
                                          "task": {"type": "worker", "index": rank}})
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // size))
    tf.config.threading.set_inter_op_parallelism_threads(2)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=tf.distribute.experimental.
                                                         CommunicationOptions(implementation="RING"))
    import keras

    import ddl_triton.tensorflow as dtf
    sys.path.insert(0, str(ROOT / "examples"))
    from tf_train import build_model

    batch = 32
    g = np.random.default_rng(rank)
    x = tf.constant(g.standard_normal((batch, 8, 8, 1)).astype(np.float32))
    y = tf.constant(g.integers(0, 10, batch))
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ce_sum = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    model, opt = build_model(0), keras.optimizers.SGD(0.01)
    reducer = dtf.GradientReducer(args.compression)

    @tf.function
    def ddl_step(x, y):
        with tf.GradientTape() as tape:
            loss = ce(y, model(x, training=True))
        tape = dtf.DistributedGradientTape(tape, reducer=reducer)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    with strategy.scope():
        mw_model, mw_opt = build_model(0), keras.optimizers.SGD(0.01)

    def mw_replica(x, y):
        with tf.GradientTape() as tape:
            loss = ce_sum(y, mw_model(x, training=True)) / (batch * size)
        mw_opt.apply_gradients(zip(tape.gradient(loss, mw_model.trainable_variables), mw_model.trainable_variables))
        return loss

    @tf.function
    def mw_step(x, y):
        return strategy.run(mw_replica, args=(x, y))

    @tf.function
    def ddl_allreduce(v):
        return dtf.allreduce(v, op=dtf.Average)

    @tf.function
    def mw_allreduce(v):
        return strategy.run(lambda t: tf.distribute.get_replica_context().all_reduce("sum", t * 1.0), args=(v,))

    def block(fn, *a, steps: int) -> float:
        """Seconds per call of ``steps`` calls after a barrier, the slowest rank's."""
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = fn(*a)
        tf.nest.map_structure(lambda t: getattr(t, "numpy", lambda: t)(), out)  # the last call has finished
        return float(comm.allreduce(np.array([(time.perf_counter() - t0) / steps]), op="max")[0])

    def interleaved(pair: dict, steps: int, rounds: int) -> dict:
        for fn, a in pair.values():  # warm: tracing, the first collectives
            block(fn, *a, steps=2)
        times = {k: [] for k in pair}
        for r in range(rounds):
            for k in (list(pair) if r % 2 == 0 else list(pair)[::-1]):
                times[k].append(block(pair[k][0], *pair[k][1], steps=steps))
        return times

    result = {"steps": interleaved({"ddl": (ddl_step, (x, y)), "mwms": (mw_step, (x, y))}, args.steps, args.rounds)}
    result["allreduce"] = {}
    for mib in SIZES_MIB:
        v = tf.constant(np.full(mib * 262144, float(rank), dtype=np.float32))
        result["allreduce"][mib] = interleaved({"ddl": (ddl_allreduce, (v,)), "mwms": (mw_allreduce, (v,))},
                                               max(3, args.steps // mib), args.rounds)
    small = tf.constant([1.0])
    buf = np.ones(1, dtype=np.float32)
    result["per_call"] = interleaved({"eager": (lambda t: dtf.allreduce(t), (small,)),
                                      "tf.function": (ddl_allreduce, (small,)),
                                      "core numpy": (lambda b: comm.allreduce(b), (buf,)),
                                      "mwms tf.function": (mw_allreduce, (small,))}, 200, args.rounds)
    if rank == 0:
        print(_MARK + json.dumps(result), flush=True)
    ddl_triton.finalize()


# -- the launcher ----------------------------------------------------------------------------------
def _env_job(start, n: int, argv: list[str]) -> subprocess.CompletedProcess:
    """Rank r of n started by ``start(r, argv, out)`` with env:// variables, output to a private
    temporary file each (not pipes: nothing is read until all are done); rank 0's output and the
    worst exit status, as one CompletedProcess. Bounded by _host_jobs.wait_for_every_host."""
    import tempfile

    from _host_jobs import wait_for_every_host  # bench/ is on the path when run as a script
    with tempfile.TemporaryDirectory(prefix="tf_step_time-") as tmp:  # 0700, this run's own
        outs = [open(os.path.join(tmp, f"rank{r}.txt"), "w+") for r in range(n)]
        try:
            codes = wait_for_every_host([start(r, argv, outs[r]) for r in range(n)], timeout=1200)
            texts = []
            for out in outs:
                out.seek(0)
                texts.append(out.read())
        finally:
            for out in outs:
                out.close()
    return subprocess.CompletedProcess(argv, max(codes, key=abs), texts[0], "\n".join(texts[1:]))


def _median(xs) -> float:
    return statistics.median(xs)


def _table(result: dict, n: int) -> str:
    s = result["steps"]
    rows = ["| set-up | step time, median (ms) | per-round ratio ddl / mwms, median |", "|---|---|---|"]
    ratio = _median([a / b for a, b in zip(s["ddl"], s["mwms"])])
    rows += [f"| ddl (DistributedGradientTape) | {_median(s['ddl']) * 1e3:.2f} | {ratio:.2f} |",
             f"| MultiWorkerMirroredStrategy (RING) | {_median(s['mwms']) * 1e3:.2f} | |", "",
             "| fp32 allreduce | ddl (ms) | ddl busbw (GB/s) | mwms (ms) | mwms busbw (GB/s) | ratio ddl / mwms |",
             "|---|---|---|---|---|---|"]
    for mib, t in result["allreduce"].items():
        nbytes = int(mib) * 1 << 20
        d, m = _median(t["ddl"]), _median(t["mwms"])
        bus = 2 * (n - 1) / n
        rows.append(f"| {mib} MiB | {d * 1e3:.2f} | {nbytes / d * bus / 1e9:.2f} | {m * 1e3:.2f} | "
                    f"{nbytes / m * bus / 1e9:.2f} | {_median([a / b for a, b in zip(t['ddl'], t['mwms'])]):.2f} |")
    rows += ["", "| one 4-byte allreduce | median (us) |", "|---|---|"]
    rows += [f"| {k} | {_median(v) * 1e6:.0f} |" for k, v in result["per_call"].items()]
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default="")
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1, help="2: a testbed of 2 hosts, 1 rank each")
    p.add_argument("--rate", default="1gbit", help="the testbed's link rate (--hosts 2)")
    p.add_argument("--addrs", default="", help=argparse.SUPPRESS)
    p.add_argument("--launcher", choices=("mpi", "env"), default="mpi",
                   help="how the ranks start: mpiexec/ddlrun, or env:// (RANK, WORLD_SIZE, MASTER_ADDR/PORT)")
    p.add_argument("--compression", default="none", help="the ddl step's gradient compression (none, auto, a method)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ports", type=lambda s: [int(x) for x in s.split(",")], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return 0
    env = {"DDL_TUNING_FILE": "off", "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    load = os.getloadavg()
    t0 = time.time()
    worker = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rounds", str(args.rounds),
              "--steps", str(args.steps), "--compression", args.compression]
    if args.hosts == 1 and args.launcher == "mpi":
        ports = ",".join(map(str, _free_ports(args.ranks)))
        proc = subprocess.run([str(BIN / "mpiexec"), "-n", str(args.ranks), *worker, "--ports", ports],
                              env=dict(os.environ, **env), capture_output=True, text=True, timeout=1200,
                              stdin=subprocess.DEVNULL)
    elif args.hosts == 1:
        ports = _free_ports(args.ranks + 1)
        proc = _env_job(lambda r, argv, out: subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(
            os.environ, **env, RANK=str(r), WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(ports[-1])), stdin=subprocess.DEVNULL),
            args.ranks, [*worker, "--ports", ",".join(map(str, ports[:-1]))])
    else:
        from ddl_triton.testbed import Testbed
        args.ranks = 2
        env.update(UCX_NET_DEVICES="eth0", GLOO_SOCKET_IFNAME="eth0", HYDRA_LAUNCHER_EXEC=str(BIN / "ddl-testbed-ssh"))
        with Testbed(hosts=2, rate=args.rate) as bed:  # torn down on the way out, failure or not
            if args.launcher == "mpi":
                proc = bed.run("h1", ["env", *(f"{k}={v}" for k, v in env.items()), str(BIN / "ddlrun"), "-n", "2",
                                      "-H", "h1:1,h2:1", "--", *worker, "--ports", "23456,23457", "--addrs", "h1,h2"],
                               cwd=str(ROOT), timeout=1200)
            else:
                proc = _env_job(lambda r, argv, out: bed.popen(f"h{r + 1}", ["env", *(f"{k}={v}" for k, v in env.items()),
                                f"RANK={r}", "WORLD_SIZE=2", "MASTER_ADDR=h1", "MASTER_PORT=23458", *argv],
                                cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT), 2,
                                [*worker, "--ports", "23456,23457", "--addrs", "h1,h2"])
    where = (f"{args.ranks} ranks on one host" if args.hosts == 1 else f"2 testbed hosts x 1 rank, links {args.rate}") \
        + f", launched by {'mpiexec/ddlrun' if args.launcher == 'mpi' else 'env://'}, ddl compression {args.compression}"
    line = [x for x in proc.stdout.splitlines() if x.startswith(_MARK)]
    if proc.returncode != 0 or not line:
        print((proc.stdout + proc.stderr)[-4000:], file=sys.stderr)
        return 1
    result = json.loads(line[0][len(_MARK):])
    import tensorflow as tf  # noqa: F401 - only for its version in the header
    print(f"{where} ({os.cpu_count()} cores), TF {tf.__version__}, {args.rounds} rounds of "
          f"{args.steps} steps; load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after; "
          f"{time.time() - t0:.0f} s\n")
    print(_table(result, args.ranks))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
