"""Elastic data-parallel training with JAX: lose a host, keep training; start one again, and it joins.

    export DDL_JOB_SECRET=...   # the same for every process of the job: only its holders may join later
    RANK=0 WORLD_SIZE=3 MASTER_ADDR=h1 MASTER_PORT=29500 python examples/elastic_train_jax.py   # env://, per process
    DDL_ELASTIC_JOIN=1 MASTER_ADDR=h1 MASTER_PORT=29500 python examples/elastic_train_jax.py    # a host joining later

A small MLP fitted to a fixed synthetic regression for ``--steps`` steps of one global batch
(``--global-batch`` rows, split evenly over however many ranks are alive, so every world computes
the same mean gradient), SGD with momentum through ``ddl_triton.jax.distributed`` inside one
``jax.jit`` step traced once, a commit after every step. Kill a rank mid-run: the survivors roll
back the step in flight, re-form the world and go on, with the same jitted step; the last line
says how many world changes there were and whether every rank ends bitwise identical (exit status 0
only then). ``--record FILE`` appends one JSON line per step and rank (the parameters' hash, the
loss, the world) for fault drills to compare.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ddl_triton
import ddl_triton.jax as ddj
from ddl_triton.jax import elastic


def params_hash(tree) -> str:
    """A digest of every leaf's bytes: equal digests mean bitwise-identical replicas."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def data(n: int = 960, features: int = 8, seed: int = 0):
    """A fixed regression problem, the same on every rank: y = tanh(x @ w) + noise."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    w = rng.standard_normal((features, 1)).astype(np.float32)
    return x, (np.tanh(x @ w) + 0.05 * rng.standard_normal((n, 1))).astype(np.float32)


def init_params(features: int = 8, hidden: int = 16, seed: int = 0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w1": jax.random.normal(k1, (features, hidden)) * 0.3, "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, 1)) * 0.3, "b2": jnp.zeros(1)}


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def batch_rows(step: int, n: int, global_batch: int, seed: int = 1) -> np.ndarray:
    """The rows of global batch ``step``: a fresh permutation per epoch, the same on every rank and
    in every world, so a redone step sees the same data."""
    per_epoch = n // global_batch
    perm = np.random.default_rng(seed + step // per_epoch).permutation(n)
    at = (step % per_epoch) * global_batch
    return perm[at: at + global_batch]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=120, help="rows per step, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--min-size", type=int, default=1)
    parser.add_argument("--record", default="", help="append a JSON line per step and rank to this file")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long in each step")
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args(argv)

    elastic.init()
    x_all, y_all = data()
    tx = ddj.distributed(optax.sgd(args.lr, momentum=0.9))  # averages over the CURRENT world
    params = init_params()
    state = elastic.JaxState(params=params, opt_state=tx.init(params), step=0)
    record = open(args.record, "a") if args.record else None

    def write(line: dict) -> None:
        if record is not None:
            record.write(json.dumps({**line, "pid": os.getpid(), "t": time.time()}) + "\n")
            record.flush()

    state.register_reset_callbacks([lambda: write(
        {"reset": True, "step": state.step, "rank": elastic.rank(), "size": elastic.size(),
         "generation": elastic.generation(), "hash": params_hash(state.params),
         "optimizer": params_hash(state.opt_state)})])

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @elastic.run(min_size=args.min_size)
    def train(state):
        while state.step < args.steps:
            rank, size = elastic.rank(), elastic.size()
            if args.global_batch % size:
                raise ValueError(f"--global-batch {args.global_batch} does not split evenly over {size} ranks")
            per = args.global_batch // size
            rows = batch_rows(state.step, len(y_all), args.global_batch)[rank * per: (rank + 1) * per]
            if args.step_seconds:
                time.sleep(args.step_seconds)
            state.params, state.opt_state, loss = train_step(state.params, state.opt_state, x_all[rows], y_all[rows])
            # (a step whose collective failed raises here, or at the commit's collective)
            state.step += 1
            state.commit()
            if rank == 0 and args.log_every and (state.step % args.log_every == 0 or state.step == args.steps):
                print(f"step {state.step}/{args.steps}: loss {float(loss):.4f}, world {size}, "
                      f"{len(elastic.recoveries())} world change(s)", flush=True)
            write({"step": state.step, "rank": rank, "size": size, "generation": elastic.generation(),
                   "hash": params_hash(state.params), "loss": float(loss)})

    train(state)
    comm = ddl_triton.init()
    digest = np.array([int(params_hash(state.params), 16) & ((1 << 62) - 1)], dtype=np.int64)
    digests = np.zeros(comm.size, dtype=np.int64)
    comm.all_gather(digests, digest)
    identical = bool((digests == digests[0]).all())
    if comm.rank == 0:
        print(f"elastic_train_jax: {args.steps} steps, world {comm.size} at the end, {len(elastic.recoveries())} "
              f"world change(s), replicas bitwise identical: {identical}", flush=True)
    write({"final": True, "rank": comm.rank, "identical": identical, "recoveries": elastic.recoveries()})
    if record is not None:
        record.close()
    ddl_triton.finalize()
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
