"""Elastic data-parallel training with Keras 3 on TensorFlow: lose a rank, keep training; start one
again, and it joins (Horovod's ``hvd.elastic`` for Keras, on ddl_triton).

    export DDL_JOB_SECRET=...   # the same for every process of the job: only its holders may join later
    RANK=0 WORLD_SIZE=3 MASTER_ADDR=h1 MASTER_PORT=29500 python examples/elastic_train_tf.py   # env://, per process
    DDL_ELASTIC_JOIN=1 MASTER_ADDR=h1 MASTER_PORT=29500 python examples/elastic_train_tf.py    # a host joining later

A small MLP fitted with ``model.fit`` to a fixed synthetic regression, ``--epochs`` epochs of
``--steps-per-epoch`` global batches of ``--global-batch`` rows split evenly over the ranks alive,
``DistributedOptimizer(SGD with momentum)``, ``CommitStateCallback`` (a commit per batch) and
``UpdateEpochStateCallback``; each call of ``fit`` runs the ``--epochs - state.epoch`` epochs left. The last
line says whether every rank ends bitwise identical (exit status 0 only then). ``--record FILE``
appends one JSON line per batch and rank (the weights' hash, the world) for drills to compare.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import numpy as np

import ddl_triton.tensorflow as ddl_tf  # before keras: it loads what must come before TensorFlow
from ddl_triton.tensorflow import elastic

import keras  # noqa: E402


def weights_hash(model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()[:16]


def data(n: int, features: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    w = rng.standard_normal((features, 1)).astype(np.float32)
    return x, (np.tanh(x @ w) + 0.05 * rng.standard_normal((n, 1))).astype(np.float32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps-per-epoch", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=120)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--record", default="")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long after each batch")
    args = parser.parse_args(argv)

    elastic.init()
    keras.utils.set_random_seed(0)
    x_all, y_all = data(args.steps_per_epoch * args.global_batch)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=ddl_tf.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9)), loss="mse")
    state = elastic.TensorFlowKerasState(model, epoch=0)
    record = open(args.record, "a") if args.record else None

    def write(line: dict) -> None:
        if record is not None:
            record.write(json.dumps({**line, "pid": os.getpid(), "t": time.time()}) + "\n")
            record.flush()

    state.register_reset_callbacks([lambda: write({"reset": True, "epoch": state.epoch, "rank": elastic.rank(),
                                                   "size": elastic.size(), "generation": elastic.generation(),
                                                   "hash": weights_hash(model)})])

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            write({"epoch": state.epoch, "batch": batch, "commits": state.commits, "rank": elastic.rank(),
                   "size": elastic.size(), "generation": elastic.generation(), "hash": weights_hash(model),
                   "loss": float(logs["loss"])})
            if args.step_seconds:
                time.sleep(args.step_seconds)

    callbacks = [elastic.CommitStateCallback(state), elastic.UpdateEpochStateCallback(state), Record()]

    @elastic.run
    def train(state):
        rank, size = elastic.rank(), elastic.size()
        per = args.global_batch // size
        # Batch b of every epoch: rows [b * global, (b + 1) * global), this rank's share of them.
        rows = np.concatenate([np.arange(b * args.global_batch, (b + 1) * args.global_batch)[rank * per:(rank + 1) * per]
                               for b in range(args.steps_per_epoch)])
        # Horovod's way: Keras counts this call's epochs from 0, UpdateEpochStateCallback adds them up.
        model.fit(x_all[rows], y_all[rows], batch_size=per, epochs=args.epochs - state.epoch, shuffle=False,
                  callbacks=callbacks, verbose=0)

    train(state)
    import ddl_triton
    comm = ddl_triton.init()
    digest = np.array([int(weights_hash(model), 16) & ((1 << 62) - 1)], dtype=np.int64)
    digests = np.zeros(comm.size, dtype=np.int64)
    comm.all_gather(digests, digest)
    identical = bool((digests == digests[0]).all())
    if comm.rank == 0:
        print(f"elastic_train_tf: {args.epochs} epochs, world {comm.size} at the end, {len(elastic.recoveries())} "
              f"world change(s), replicas bitwise identical: {identical}", flush=True)
    write({"final": True, "rank": comm.rank, "identical": identical, "epoch": state.epoch})
    if record is not None:
        record.close()
    ddl_triton.finalize()
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
