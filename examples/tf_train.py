"""Data-parallel Keras training on ddl_triton: the digits CNN of examples/train_cnn.py, its Keras twin.

Run (any launcher that ddl_triton.init() takes; no torch.distributed call anywhere):

    ddlrun -n 2 -- python examples/tf_train.py                        # model.fit, two added lines
    ddlrun -n 2 -- python examples/tf_train.py --loop --compression int8   # a custom tf.function loop
    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 python examples/tf_train.py &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 python examples/tf_train.py  # env://

What it does: every rank builds the same Keras CNN (two 3x3 convolutions of 16 and 32 channels,
a 2x2 max-pool, 512 -> 256 -> 10; He-initialized, 138,698 parameters as in train_cnn.py), loads
scikit-learn's digits (75/25 stratified split, seed 0, standardized) and trains with plain SGD on
a global batch of ranks x --batch-size, rank r taking its slice of each global batch. The data
parallelism is the two lines Horovod users know:

    model.compile(optimizer=ddl_tf.DistributedOptimizer(keras.optimizers.SGD(lr), compression=...), ...)
    model.fit(..., callbacks=[ddl_tf.BroadcastGlobalVariablesCallback(0)])

(``--loop``: a tf.function step with ``DistributedGradientTape`` instead, and
``broadcast_variables`` at the start.) Rank 0 seeds the model differently from the other ranks
on purpose: the broadcast is what makes the replicas start alike. At the end every rank evaluates
the test set; rank 0 prints the test accuracy, whether the replicas are bitwise identical (each
variable's bits, as int32, have equal min and max over the ranks) and one line:

    RESULT mode=fit compression=none ranks=2 accuracy=0.9756 identical=True seconds=12.3 steps=315

Threads: TensorFlow's intra-op pool is set to cores / ranks (at least 1) and its inter-op pool to
2, so that ranks sharing a host do not oversubscribe it (--threads overrides; docs/tensorflow.md).
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def load_data(seed: int = 0):
    """(x_train, y_train, x_test, y_test): digits as [N, 8, 8, 1] fp32 (channels last), int64 labels."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(digits.data, digits.target, test_size=0.25, random_state=seed,
                                              stratify=digits.target)
    x_tr, x_te = x_tr.astype(np.float32).reshape(-1, 8, 8, 1), x_te.astype(np.float32).reshape(-1, 8, 8, 1)
    mean, std = x_tr.mean(), x_tr.std(ddof=1)
    return (x_tr - mean) / std, y_tr.astype(np.int64), (x_te - mean) / std, y_te.astype(np.int64)


def build_model(seed: int = 0):
    """The Keras twin of train_cnn.build_model: same layers and parameter count, He-initialized."""
    import keras

    keras.utils.set_random_seed(seed)
    he = {"kernel_initializer": "he_normal", "bias_initializer": "zeros"}
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", **he),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu", **he),
        keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu", **he), keras.layers.Dense(10, **he)])


def global_order(n_train: int, size: int, batch: int, epochs: int, seed: int, rank: int):
    """This rank's rows, epoch after epoch: a fresh permutation per epoch (the same on every
    rank), cut into global batches of size x batch, rank r taking slice r of each."""
    import numpy as np

    g = np.random.default_rng(seed)
    rows = []
    for _ in range(epochs):
        perm = g.permutation(n_train)
        for start in range(0, n_train - size * batch + 1, size * batch):
            rows.append(perm[start + rank * batch: start + (rank + 1) * batch])
    return np.concatenate(rows)


def replicas_identical(variables) -> bool:
    """Whether every rank holds the same bits in every variable: the min and max over the ranks
    of each variable's bits (as int32) equal this rank's (two collectives per variable)."""
    import tensorflow as tf

    import ddl_triton.tensorflow as ddl_tf

    same = True
    for v in variables:
        bits = tf.bitcast(tf.convert_to_tensor(v), tf.int32)
        same &= bool(tf.reduce_all(ddl_tf.allreduce(bits, op=ddl_tf.Min) == bits) & tf.reduce_all(
            ddl_tf.allreduce(bits, op=ddl_tf.Max) == bits))
    return same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loop", action="store_true", help="a custom tf.function loop instead of model.fit")
    p.add_argument("--compression", default="none", help="none | auto | a method of ddl_triton/compression_methods.py")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="TF intra-op threads (0: cores / ranks)")
    args = p.parse_args(argv)

    import keras
    import numpy as np
    import tensorflow as tf

    import ddl_triton
    import ddl_triton.tensorflow as ddl_tf

    comm = ddl_tf.init()  # ddlrun/mpiexec, or env:// RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, size = comm.rank, comm.size
    tf.config.threading.set_intra_op_parallelism_threads(args.threads or max(1, (os.cpu_count() or 1) // size))
    tf.config.threading.set_inter_op_parallelism_threads(2)
    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    model = build_model(args.seed if rank == 0 else args.seed + 1000 + rank)  # the broadcast makes them alike
    rows = global_order(len(y_tr), size, args.batch_size, args.epochs, args.seed + 1, rank)
    steps = len(rows) // args.batch_size
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(args.lr)
    t0 = time.perf_counter()
    if not args.loop:
        model.compile(optimizer=ddl_tf.DistributedOptimizer(optimizer, compression=args.compression), loss=loss_fn)
        model.fit(x_tr[rows], y_tr[rows], batch_size=args.batch_size, epochs=1, shuffle=False,
                  verbose=2 if rank == 0 else 0, callbacks=[ddl_tf.BroadcastGlobalVariablesCallback(0)])
    else:
        ddl_tf.broadcast_variables(model.variables, 0)
        optimizer.build(model.trainable_variables)
        reducer = ddl_tf.GradientReducer(args.compression)  # error feedback lives as long as the loop

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = ddl_tf.DistributedGradientTape(tape, reducer=reducer)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss

        for s in range(steps):
            mine = rows[s * args.batch_size: (s + 1) * args.batch_size]
            loss = step(tf.constant(x_tr[mine]), tf.constant(y_tr[mine]))
            if rank == 0 and (s + 1) % (steps // args.epochs or 1) == 0:
                print(f"epoch {(s + 1) * args.epochs // steps}: loss {float(loss):.4f}", flush=True)
    seconds = time.perf_counter() - t0
    accuracy = float(np.mean(np.argmax(model.predict(x_te, verbose=0), axis=1) == y_te))
    identical = replicas_identical(model.trainable_variables)
    if rank == 0:
        print(f"test accuracy {accuracy:.4f}; replicas bitwise identical: {identical}")
        print(f"RESULT mode={'loop' if args.loop else 'fit'} compression={args.compression} ranks={size} "
              f"accuracy={accuracy:.4f} identical={identical} seconds={seconds:.1f} steps={steps}", flush=True)
    ddl_triton.finalize()
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
