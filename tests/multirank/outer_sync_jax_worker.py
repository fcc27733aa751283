"""ddl_triton.jax.DiLoCo across ranks (tests/multirank/test_outer_sync.py), on the same core as torch's.

1. per-step averaging: sync_every=1, optax.sgd(1.0) as the outer optimizer, an SGD inner step on
   integer data whose rank offsets sum to zero: after every step the parameters equal (==) a
   reference whose parameters are averaged over the ranks after each step;
2. identical replicas: random data, the outer optimizer optax.sgd(0.7, momentum=0.9, nesterov=True),
   fragments=2 with fragment_sync_delay=1, fp32 and int8 (between the emulated hosts): after every
   fragment's sync its leaves and every backup hold the same bits on every rank.

Prints "outer_sync_jax_worker: N ranks, M checks, 0 failures" on rank 0.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

import ddl_triton as ddl  # noqa: E402
import ddl_triton.jax as ddj  # noqa: E402
from ddl_triton import compression_methods  # noqa: E402
from support.checker import Checker  # noqa: E402


def loss(params, x):
    return jnp.sum((x @ params["w1"] + params["b1"]) @ params["w2"])


def int_params():
    return {"w1": (jnp.arange(12.0).reshape(4, 3) % 5) - 2, "b1": jnp.arange(3.0) - 1,
            "w2": (jnp.arange(6.0).reshape(3, 2) % 3) - 1}


def int_batch(t, rank, n):
    base = (np.arange(12).reshape(3, 4) * (t + 1)) % 3 - 1
    delta = (np.arange(12).reshape(3, 4) + t) % 2
    return jnp.asarray(base + (2 * rank - (n - 1)) * delta, dtype=jnp.float32)


def sgd_step(params, x, lr=1.0):
    g = jax.grad(loss)(params, x)
    return jax.tree_util.tree_map(lambda p, q: p - lr * q, params, g)


def per_step_averaging(ck, comm):
    n, r = comm.size, comm.rank
    d = ddj.DiLoCo(int_params(), optax.sgd(1.0), sync_every=1, comm=comm)
    params, ref = d.params, int_params()
    for t in range(4):
        x = int_batch(t, r, n)
        params = d.step(sgd_step(params, x))
        ref = {k: np.array(v) for k, v in sgd_step(ref, x).items()}
        for k in ref:
            comm.allreduce(ref[k], op="avg")
            ck.equal(f"jax sync_every=1 step {t} {k} == per-step averaging", torch.from_numpy(np.array(params[k])),
                     torch.from_numpy(ref[k]))
        ref = {k: jnp.asarray(v) for k, v in ref.items()}
    d.close()


def identical_replicas(ck, comm, compression, fragments, delay):
    key = jax.random.PRNGKey(7 + comm.rank)  # every rank its own init (replaced by rank 0's) and data
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"w1": jax.random.normal(k1, (8, 16)), "b1": jnp.zeros(16), "w2": jax.random.normal(k2, (16, 4))}
    d = ddj.DiLoCo(params, optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=4, fragments=fragments,
                   fragment_sync_delay=delay, compression=compression, comm=comm)
    params = d.params
    what = f"jax {compression or 'fp32'}, fragments={fragments}, delay={delay}"
    inner = optax.adam(1e-2)
    state = inner.init(params)

    def mse(p, x):
        return jnp.mean(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] ** 2)

    for t in range(8):
        k3, kx = jax.random.split(k3)
        g = jax.grad(mse)(params, jax.random.normal(kx, (4, 8)))
        updates, state = inner.update(g, state, params)
        params = d.step(optax.apply_updates(params, updates))
        f = d.core.schedule.syncs_at(d.step_count)
        if f is None:
            continue
        leaves = jax.tree_util.tree_leaves(params)
        for i in d.core.groups[f]:
            ck.identical(f"{what}: step {d.step_count} leaf {i}", torch.from_numpy(np.array(leaves[i])))
        for g_, b in enumerate(d.core.backups):
            ck.identical(f"{what}: step {d.step_count} backup {g_}", b)
    d.close()


def main() -> int:
    comm = ddl.init()
    ck = Checker()

    def body():
        per_step_averaging(ck, comm)
        identical_replicas(ck, comm, None, 2, 1)
        identical_replicas(ck, comm, compression_methods.DEFAULT, 2, 1)

    ck.run(body)
    status = ck.report(f"outer_sync_jax_worker: {comm.size} ranks")
    ddl.finalize()
    return status


if __name__ == "__main__":
    sys.exit(main())
