"""Step time of Keras training on "ddl" (ddl_triton.tensorflow) beside tf.distribute.MultiWorkerMirroredStrategy.

Run (from the repository root; results: bench/results/tf_step_time.md):

    .venv/bin/python bench/tf_step_time.py [--rounds 7] [--steps 20] [--ranks 2] [--json out.json]

One mpiexec launch of ``--ranks`` ranks on this host; every rank holds both set-ups, so the rounds
interleave in the same processes (the order swaps every round):

- ``ddl``: the digits CNN of examples/tf_train.py (138,698 parameters, 555 KB of fp32 gradients),
  batch 32 per rank, SGD; a ``tf.function`` step whose ``DistributedGradientTape`` averages the
  gradients (one fused bucket, shared memory between the ranks, ``DDL_TUNING_FILE=off``);
- ``mwms``: the same model and step under ``MultiWorkerMirroredStrategy`` (TF_CONFIG: localhost
  ports; ``CommunicationOptions(implementation=RING)``, TF's CPU collective ops over gRPC): the
  loss summed over the rank's rows / global batch, and Keras's optimizer all-reduces (sum) the
  gradients across the workers inside ``apply_gradients``, as TF's custom-loop guide does.

A block is ``--steps`` steps timed after a barrier, its time the slowest rank's; a figure is the
median over rounds of the block's time per step. Then the gradient allreduce alone, fp32 of 1-16
MiB, interleaved the same way: ``ddl`` is ``ddl_triton.tensorflow.allreduce(x, "avg")`` inside a
``tf.function``; ``mwms`` is ``replica_context.all_reduce(SUM)`` in ``strategy.run`` inside a
``tf.function``; algbw = bytes / time, busbw = algbw * 2(n-1)/n (nccl-tests). And the cost of one
call: a 4-byte allreduce eagerly, inside a ``tf.function``, and the core's own
``comm.allreduce`` on a NumPy array, for the bridge's overhead (docs/tensorflow.md).

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
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in args.ports]},
                                          "task": {"type": "worker", "index": rank}})
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // size))
    tf.config.threading.set_inter_op_parallelism_threads(2)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=tf.distribute.experimental.
                                                         CommunicationOptions(implementation="RING"))
    import keras

    import ddl_triton
    import ddl_triton.tensorflow as dtf
    sys.path.insert(0, str(ROOT / "examples"))
    from tf_train import build_model

    comm = ddl_triton.init()
    batch = 32
    g = np.random.default_rng(rank)
    x = tf.constant(g.standard_normal((batch, 8, 8, 1)).astype(np.float32))
    y = tf.constant(g.integers(0, 10, batch))
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ce_sum = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    model, opt = build_model(0), keras.optimizers.SGD(0.01)
    reducer = dtf.GradientReducer()

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
        return dtf.allreduce(v, "avg")

    @tf.function
    def mw_allreduce(v):
        return strategy.run(lambda t: tf.distribute.get_replica_context().all_reduce("sum", t * 1.0), args=(v,))

    def block(fn, *a, steps: int) -> float:
        """Seconds per call of ``steps`` calls after a barrier, the slowest rank's."""
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = fn(*a)
        tf.nest.map_structure(lambda t: getattr(t, "numpy", lambda: t)(), out)  # the last call has finished
        mine = np.array([(time.perf_counter() - t0) / steps])
        slowest = np.empty(1)
        world.Allreduce(mine, slowest, op=MPI.MAX)
        return float(slowest[0])

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
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ports", type=lambda s: [int(x) for x in s.split(",")], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return 0
    env = dict(os.environ, DDL_TUNING_FILE="off", TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1")
    ports = ",".join(map(str, _free_ports(args.ranks)))
    load = os.getloadavg()
    t0 = time.time()
    proc = subprocess.run([str(BIN / "mpiexec"), "-n", str(args.ranks), sys.executable, __file__, "--worker",
                           "--ports", ports, "--rounds", str(args.rounds), "--steps", str(args.steps)],
                          env=env, capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
    line = [x for x in proc.stdout.splitlines() if x.startswith(_MARK)]
    if proc.returncode != 0 or not line:
        print((proc.stdout + proc.stderr)[-4000:], file=sys.stderr)
        return 1
    result = json.loads(line[0][len(_MARK):])
    import tensorflow as tf  # noqa: F401 - only for its version in the header
    print(f"{args.ranks} ranks on one host ({os.cpu_count()} cores), TF {tf.__version__}, {args.rounds} rounds of "
          f"{args.steps} steps; load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after; "
          f"{time.time() - t0:.0f} s\n")
    print(_table(result, args.ranks))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
