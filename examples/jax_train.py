"""Data-parallel JAX training on ddl_triton: the digits CNN of examples/train_cnn.py, its JAX twin (jax + optax, no flax).

Run (any launcher ddl_triton.init() takes; no torch.distributed call anywhere):

    ddlrun -n 2 -- python examples/jax_train.py
    ddlrun -n 2 -- python examples/jax_train.py --compression int8     # int8 gradients, error feedback
    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29513 python examples/jax_train.py &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29513 python examples/jax_train.py  # env://

What it does: every rank builds the same CNN as train_cnn.py (two 3x3 convolutions of 16 and 32
channels, a 2x2 max-pool, 512 -> 256 -> 10, He-initialized, zero biases: 138,698 parameters),
loads scikit-learn's digits (75/25 stratified split, seed 0, standardized with the training
set's mean and deviation) and trains with plain SGD on a global batch of ranks x --batch-size,
rank r taking rows [r*b, (r+1)*b) of each global batch (a fresh permutation per epoch, the same
on every rank). Data parallelism is the Horovod pattern, for optax:

    ddj.init()
    params = ddj.broadcast_params(params, root=0)                       # replicas start alike
    tx = ddj.distributed(optax.sgd(lr), compression=args.compression)  # gradients averaged first

and the whole step (grad, the gradient allreduce, the update) is one ``jax.jit`` program.
Ranks other than 0 perturb their initial weights on purpose: the broadcast is what makes the
replicas start alike. Rank 0 shows a progress bar on stderr (steps, the loss at each epoch's end;
``--quiet``: none). At the end rank 0 prints the test accuracy, whether the replicas are bitwise
identical (a SHA-256 of every parameter's bytes, allgathered and compared) and one line:

    RESULT compression=none ranks=2 accuracy=0.9800 identical=True seconds=9.1 steps=315 step_ms=20.1
"""
from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np

# One intra-op thread per rank (torchrun's default): the ranks share the host's cores, and the
# core's reductions run on torch's pool (docs/jax.md, "What one call costs").
os.environ.setdefault("OMP_NUM_THREADS", "1")



def load_data(seed: int = 0):
    """(x_train, y_train, x_test, y_test): digits as [N, 8, 8, 1] fp32 (NHWC), int32 labels 0..9."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(digits.data, digits.target, test_size=0.25, random_state=seed,
                                              stratify=digits.target)
    x_tr, x_te = (x.astype(np.float32).reshape(-1, 8, 8, 1) for x in (x_tr, x_te))
    mean, std = x_tr.mean(), x_tr.std(ddof=1)
    return (x_tr - mean) / std, y_tr.astype(np.int32), (x_te - mean) / std, y_te.astype(np.int32)


def init_params(key):
    """The CNN's parameters, He-initialized (normal, std sqrt(2 / fan_in)), zero biases."""
    import jax
    import jax.numpy as jnp

    shapes = {"conv1": (3, 3, 1, 16), "conv2": (3, 3, 16, 32), "fc1": (512, 256), "fc2": (256, 10)}
    params = {}
    for (name, shape), k in zip(shapes.items(), jax.random.split(key, len(shapes))):
        fan_in = int(np.prod(shape[:-1]))
        params[name] = {"w": jax.random.normal(k, shape, jnp.float32) * np.float32(np.sqrt(2.0 / fan_in)),
                        "b": jnp.zeros(shape[-1], jnp.float32)}
    return params


def forward(params, x):
    """Logits for NHWC images x: conv-relu, conv-relu, 2x2 max-pool, flatten, fc-relu, fc."""
    import jax
    import jax.numpy as jnp

    def conv(p, h):
        return jax.lax.conv_general_dilated(h, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) \
            + p["b"]

    h = jax.nn.relu(conv(params["conv1"], x))
    h = jax.nn.relu(conv(params["conv2"], h))
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = h.reshape(h.shape[0], -1)
    h = jax.nn.relu(h @ params["fc1"]["w"] + params["fc1"]["b"])
    return h @ params["fc2"]["w"] + params["fc2"]["b"]


def loss_fn(params, x, y):
    import jax
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(forward(params, x), y).mean() if x.shape[0] else \
        jax.numpy.float32(0)


def replicas_identical(ddj, params) -> bool:
    """Every rank's parameters hold the same bits: their SHA-256 digests, allgathered, agree."""
    import jax
    raw = b"".join(np.asarray(v).tobytes() for v in jax.tree_util.tree_leaves(params))
    digest = np.frombuffer(hashlib.sha256(raw).digest(), dtype=np.int32)
    every = np.asarray(ddj.allgather(digest)).reshape(ddj.size(), -1)
    return bool((every == every[0]).all())


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp
    import optax

    import ddl_triton
    import ddl_triton.jax as ddj
    from ddl_triton import compression_methods

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", choices=compression_methods.choices(), default=compression_methods.NONE)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    ddj.init()
    rank, size = ddj.rank(), ddj.size()
    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    params = init_params(jax.random.PRNGKey(args.seed))
    if rank != 0:  # a different start on purpose: broadcast_params is what makes the replicas alike
        params = jax.tree_util.tree_map(lambda v: v * 1.5 + 0.01, params)
    params = ddj.broadcast_params(params, root=0)
    tx = ddj.distributed(optax.sgd(args.lr), compression=args.compression)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    b, gb = args.batch_size, args.batch_size * size
    rng = np.random.default_rng(args.seed + 1)
    starts = range(0, len(y_tr) - gb + 1, gb)
    bar = None
    if rank == 0 and not args.quiet:
        from tqdm import tqdm
        # On stderr, as train_cnn.py's; after a delay, so a short run shows only its summary.
        bar = tqdm(total=args.epochs * len(starts), unit="step", mininterval=0.25, delay=0.3, dynamic_ncols=True,
                   desc="training")
    steps, t0, first = 0, None, None
    for epoch in range(args.epochs):
        perm = rng.permutation(len(y_tr))
        for start in starts:
            mine = perm[start + rank * b: start + (rank + 1) * b]
            params, opt_state, loss = step(params, opt_state, x_tr[mine], y_tr[mine])
            steps += 1
            if steps == 1:  # the first step compiles: time the others
                loss.block_until_ready()
                t0 = time.perf_counter()
            if bar is not None:
                bar.update()
        if bar is not None and len(starts):  # the loss once an epoch: reading it waits for the step
            bar.set_postfix_str(f"epoch {epoch}  loss {float(loss):.4f}", refresh=False)
    jax.block_until_ready(params)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0 if t0 is not None else 0.0
    accuracy = float(jnp.mean(jnp.argmax(forward(params, jnp.asarray(x_te)), -1) == y_te))
    identical = replicas_identical(ddj, params)
    if rank == 0:
        print(f"test accuracy {accuracy:.4f}; replicas bitwise identical: {identical}")
        print(f"RESULT compression={args.compression} ranks={size} accuracy={accuracy:.4f} identical={identical} "
              f"seconds={seconds:.1f} steps={steps} step_ms={1e3 * seconds / max(1, steps - 1):.2f}", flush=True)
    ddl_triton.finalize()
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
