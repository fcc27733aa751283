"""ddl_triton.tensorflow on the ranks of one mpiexec launch: every check in one process per rank.

TensorFlow's import costs seconds per process, so one launch runs every mode, each with its own
closing report (tests/multirank/test_tensorflow.py reads them):

    collectives  allreduce (sum, avg, min, max), broadcast, allgather, broadcast_variables on every
                 dtype the core reduces, sizes 0, 1, primes and not divisible by the ranks: exact
                 integer results, eager and inside tf.function, bitwise equal to the torch path and
                 across ranks; a tf.function of 3 collectives (one result unused) called N times
                 makes exactly 3N collectives in program order; gradients through allreduce and
                 allgather; the fused GradientReducer bitwise equal to per-tensor calls (and its
                 int8 path to the compressed allreduce on the same bucket), one collective per bucket;
                 Horovod's signatures and defaults (allreduce averages unless op=Sum; average=,
                 prescale/postscale, Compression.fp16), and explain with TensorFlow's dtypes
    training     a custom loop (eager and tf.function, DistributedGradientTape) and model.fit
                 (DistributedOptimizer + BroadcastGlobalVariablesCallback, rank-dependent initial
                 weights) against one-process full-batch training, tolerance derived in
                 ``check_close``; replicas bitwise identical, with int8 compression too
    errors       bad input refused on every rank naming it, and Horovod's spellings this room does
                 not honour; a shape mismatch across ranks is the core's call check, eagerly and
                 inside tf.function (its line said first on stderr), within the deadline

Run: mpiexec -n 2 python tests/multirank/tf_worker.py [--modes collectives,training,errors]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ddl_triton  # noqa: E402
import ddl_triton.tensorflow as dtf  # noqa: E402
from support.checker import Checker  # noqa: E402
from support.report import print_line  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)  # 2 ranks on 2 cores: one thread each
tf.config.threading.set_inter_op_parallelism_threads(2)

DTYPES = [tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64]
SIZES = [0, 1, 2, 3, 5, 7, 13, 31, 101, 257, 1031]
TORCH = {tf.float32: torch.float32, tf.float64: torch.float64, tf.float16: torch.float16,
         tf.bfloat16: torch.bfloat16, tf.int32: torch.int32, tf.int64: torch.int64}


def as_torch(t) -> torch.Tensor:
    """A tensor's values as torch (bfloat16 through its bits), for the checker's exact comparisons."""
    if t.dtype == tf.bfloat16:
        return torch.from_numpy(np.array(tf.bitcast(t, tf.uint16).numpy(), dtype=np.uint16).view(np.int16)).view(
            torch.bfloat16)
    return torch.from_numpy(np.array(t.numpy()))


def data(n: int, r: int, dtype) -> tf.Tensor:
    """Small integers, exact in every dtype and in every sum of a few ranks: (i % 7) - 3 + r."""
    return tf.cast(tf.constant(np.arange(n) % 7 - 3 + r, dtype=tf.float64), dtype)


# -- collectives -----------------------------------------------------------------------------------
def check_collectives(ck: Checker, r: int, w: int) -> None:
    comm = ddl_triton.init()

    @tf.function
    def reduced(x):
        return dtf.allreduce(x, op=dtf.Sum), dtf.allreduce(x, op=dtf.Min), dtf.allreduce(x, op=dtf.Max)

    for dtype in DTYPES:
        for n in SIZES:
            x = data(n, r, dtype)
            every = [data(n, q, tf.float64).numpy() for q in range(w)]
            expect = {"sum": np.sum(every, 0), "min": np.min(every, 0), "max": np.max(every, 0),
                      "avg": np.sum(every, 0) / w}
            ops = ["sum", "min", "max"] + (["avg"] if dtype.is_floating and w & (w - 1) == 0 else [])
            for op in ops:
                got = dtf.allreduce(x, op=op)
                ck.equal(f"eager {op} {dtype.name} n={n}", as_torch(got), as_torch(tf.cast(expect[op], dtype)))
                ck.identical(f"eager {op} {dtype.name} n={n} across ranks", as_torch(got))
            for op, got in zip(("sum", "min", "max"), reduced(x)):
                ck.equal(f"tf.function {op} {dtype.name} n={n}", as_torch(got), as_torch(tf.cast(expect[op], dtype)))
            root = n % w
            got = dtf.broadcast(x, root)
            ck.equal(f"broadcast {dtype.name} n={n} root={root}", as_torch(got), as_torch(data(n, root, dtype)))
            rows = [tf.reshape(data(3 * (q + 1) * (n % 4), q, dtype), [(q + 1) * (n % 4), 3]) for q in range(w)]
            got = dtf.allgather(rows[r])
            ck.equal(f"allgather {dtype.name} rows={n % 4}", as_torch(got), as_torch(tf.concat(rows, 0)))

    # bitwise the torch path, on non-integer data (the core's own call on the same bytes)
    g = np.random.default_rng(100 + r)
    for dtype in (tf.float32, tf.float16, tf.bfloat16, tf.float64):
        for n in (1, 7, 1031, 65537):
            x = tf.cast(tf.constant(g.standard_normal(n)), dtype)
            for op in ("sum", "avg"):
                ref = as_torch(x).clone()
                comm.allreduce(ref, op=op)
                ck.equal(f"{op} {dtype.name} n={n} bitwise the torch path", as_torch(dtf.allreduce(x, op=op)), ref)

    # broadcast_variables: every rank ends with root's values
    vs = [tf.Variable(data(n, r, d)) for d in (tf.float32, tf.int64, tf.bfloat16) for n in (1, 5, 0, 257)]
    dtf.broadcast_variables(vs, w - 1)
    for i, v in enumerate(vs):
        ck.equal(f"broadcast_variables {i}", as_torch(tf.convert_to_tensor(v)), as_torch(data(v.shape[0], w - 1, v.dtype)))
    check_order(ck, comm, r, w)
    check_gradients(ck, r, w)
    check_fusion(ck, comm, r, w)
    check_horovod(ck, comm, r, w)


# Horovod's signatures (horovod.tensorflow and .keras, 0.28), each parameter with its default; ours must
# start with the same names in the same order and the same defaults (process_set: None for Horovod's
# global_process_set, compression: our Compression.none). docs/tensorflow.md has the table.
_NONE = object()  # "no default"
HOROVOD = {
    "allreduce": [("tensor", _NONE), ("average", None), ("device_dense", ""), ("device_sparse", ""),
                  ("compression", "Compression.none"), ("op", None), ("prescale_factor", 1.0),
                  ("postscale_factor", 1.0), ("name", None), ("process_set", None), ("ignore_name_scope", False)],
    "broadcast": [("tensor", _NONE), ("root_rank", _NONE), ("name", None), ("ignore_name_scope", False),
                  ("process_set", None)],
    "allgather": [("tensor", _NONE), ("name", None), ("ignore_name_scope", False), ("process_set", None)],
    "broadcast_variables": [("variables", _NONE), ("root_rank", _NONE), ("process_set", None), ("inplace", False)],
    "init": [("comm", None), ("process_sets", None)],
    "barrier": [("process_set", None)],
    "DistributedGradientTape": [("gradtape", _NONE), ("device_dense", ""), ("device_sparse", ""),
                                ("compression", "Compression.none"), ("sparse_as_dense", False), ("op", "Average"),
                                ("gradient_predivide_factor", 1.0), ("num_groups", 0), ("groups", None),
                                ("process_set", None), ("scale_local_gradients", True)],
    "DistributedOptimizer": [("optimizer", _NONE), ("name", None), ("device_dense", ""), ("device_sparse", ""),
                             ("compression", "Compression.none"), ("sparse_as_dense", False),
                             ("gradient_predivide_factor", 1.0), ("op", "Average"), ("backward_passes_per_step", 1),
                             ("average_aggregated_gradients", False), ("num_groups", 0), ("groups", None),
                             ("process_set", None), ("scale_local_gradients", True)],
    "BroadcastGlobalVariablesCallback": [("root_rank", _NONE), ("device", ""), ("local_variables", None)],
    "MetricAverageCallback": [("device", "")],
    "LearningRateWarmupCallback": [("initial_lr", _NONE), ("warmup_epochs", 5), ("momentum_correction", True),
                                   ("steps_per_epoch", None), ("verbose", 0)],
}


def check_horovod(ck: Checker, comm, r: int, w: int) -> None:
    """Names borrowed from Horovod bring its signatures and defaults: allreduce averages by default."""
    import inspect
    named = {"Compression.none": dtf.Compression.none, "Average": dtf.Average}
    for name, params in HOROVOD.items():
        obj = getattr(dtf, name)
        ours = list(inspect.signature(obj.__init__ if inspect.isclass(obj) else obj).parameters.values())
        ours = [q for q in ours if q.name != "self"][:len(params)]
        got = [(q.name, _NONE if q.default is inspect.Parameter.empty else q.default) for q in ours]
        want = [(n, named.get(d, d) if isinstance(d, str) else d) for n, d in params]
        ck.true(f"{name}: Horovod's parameters, order and defaults", got == want, f"{got} != {want}")
    x = data(6, r, tf.float32)
    every = [data(6, q, tf.float64).numpy() for q in range(w)]
    total = tf.cast(np.sum(every, 0), tf.float32)
    if w & (w - 1) == 0:  # the mean is exact in binary
        mean = tf.cast(np.sum(every, 0) / w, tf.float32)
        ck.equal("allreduce averages by default (Horovod's op=None)", as_torch(dtf.allreduce(x)), as_torch(mean))
        ck.equal("average=True averages", as_torch(dtf.allreduce(x, True)), as_torch(mean))
        ck.equal("tf.function: the default averages", as_torch(tf.function(lambda v: dtf.allreduce(v))(x)),
                 as_torch(mean))
    ck.equal("average=False sums", as_torch(dtf.allreduce(x, average=False)), as_torch(total))
    ck.equal("op=Sum sums", as_torch(dtf.allreduce(x, op=dtf.Sum)), as_torch(total))
    ck.equal("prescale 2, postscale 1/2: the sum", as_torch(dtf.allreduce(x, op=dtf.Sum, prescale_factor=2.0,
                                                                         postscale_factor=0.5)), as_torch(total))
    fp16 = dtf.allreduce(x, op=dtf.Sum, compression=dtf.Compression.fp16)
    ck.true("Compression.fp16 hands back the tensor's dtype", fp16.dtype == tf.float32, str(fp16.dtype))
    ck.equal("Compression.fp16: the sum (small integers are exact in float16)", as_torch(fp16), as_torch(total))
    ck.true("local_rank, local_size (one host)", (dtf.local_rank(), dtf.local_size()) == (r, w),
            f"{(dtf.local_rank(), dtf.local_size())}")
    ck.true("Compression.fp16 is the fp16 method for the reducer",
            dtf.GradientReducer(dtf.Compression.fp16).compression == "fp16")
    for choice in ("int8", "onebit", "bf16", "auto"):  # the registry's other choices, by attribute
        ck.true(f"Compression.{choice} is the registry's {choice} for the reducer",
                dtf.GradientReducer(getattr(dtf.Compression, choice)).compression == choice)
    ck.true("explain takes TensorFlow's dtype spelling", comm.explain("allreduce", 1 << 16, tf.float32) ==
            comm.explain("allreduce", 1 << 16, torch.float32) and comm.explain("allreduce", 64, tf.bfloat16) ==
            comm.explain("allreduce", 64, torch.bfloat16))


def check_order(ck: Checker, comm, r: int, w: int) -> None:
    """A tf.function with 3 collectives, the second's result unused, called N times: exactly 3N
    collectives, in program order (each call's first element names it)."""
    log: list[float] = []
    real = comm.allreduce

    def logged(t, *a, **k):
        if not isinstance(t, torch.Tensor):  # the bridge's calls pass NumPy; the core re-enters with torch views
            log.append(float(t.reshape(-1)[0]) if t.size else -1.0)
        return real(t, *a, **k)

    @tf.function
    def three(x):
        a = dtf.allreduce(x + 1.0, op=dtf.Sum)
        dtf.allreduce(x + 2.0, op=dtf.Sum)  # unused: must run all the same
        c = dtf.allreduce(a + 3.0 * w, op=dtf.Sum)
        return c

    comm.allreduce = logged
    try:
        n_calls = 5
        for i in range(n_calls):
            out = three(tf.constant([float(10 * i)] * 3))
    finally:
        del comm.allreduce
    want = [v for i in range(n_calls) for v in (10 * i + 1.0, 10 * i + 2.0, w * (10 * i + 1.0) + 3.0 * w)]
    ck.true("tf.function: 3 collectives per call, N calls, in order", log == want, f"{log} != {want}")
    ck.equal("tf.function: the result", as_torch(out), torch.full((3,), float(w * (w * (40 + 1) + 3 * w))))


def check_gradients(ck: Checker, r: int, w: int) -> None:
    c = float(r + 1)
    for fn in ("eager", "tf.function"):
        for op, scale in (("sum", w), ("avg", 1)):
            def grad(x, op=op):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = tf.reduce_sum(dtf.allreduce(x * c, op=op))
                return tape.gradient(y, x)
            run = tf.function(grad) if fn == "tf.function" else grad
            got = run(tf.constant([1.0, 2.0, 3.0]))
            ck.equal(f"{fn}: gradient of allreduce {op}", as_torch(got), torch.full((3,), c * scale))

        def gathered(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.reduce_sum(dtf.allgather(x) * c)
            return tape.gradient(y, x)
        run = tf.function(gathered) if fn == "tf.function" else gathered
        got = run(tf.ones([r + 1, 2]))
        ck.equal(f"{fn}: gradient of allgather", as_torch(got), torch.full((r + 1, 2), float(sum(range(1, w + 1)))))


def check_fusion(ck: Checker, comm, r: int, w: int) -> None:
    from ddl_triton.tensorflow.fusion import plan_buckets
    f32 = tf.float32
    ck.true("plan_buckets: the docstring's example",
            plan_buckets([(3,), (2, 2), (5,)], [f32] * 3, 32) == [(f32, [(0, 0, 3), (1, 3, 4)], 7), (f32, [(2, 0, 5)], 5)])
    g = np.random.default_rng(7 + r)
    shapes = [(0,), (1,), (3, 5), (13,), (2, 2, 7), (1031,), ()]
    grads = [tf.cast(tf.constant(g.standard_normal(s)), d) for s in shapes for d in (tf.float32, tf.bfloat16, tf.float64)]
    grads.insert(3, None)
    for bucket_bytes in (64, 1 << 20):
        reducer = dtf.GradientReducer(bucket_bytes=bucket_bytes)
        for fn in ("eager", "tf.function"):
            before = reducer.collectives
            run = tf.function(reducer.reduce) if fn == "tf.function" else reducer.reduce
            got = run(grads)
            for i, (a, b) in enumerate(zip(got, grads)):
                if b is None:
                    ck.true(f"fused {fn}: None stays None", a is None)
                    continue
                ref = as_torch(b).clone()
                comm.allreduce(ref, op="avg")
                ck.equal(f"fused {fn} bucket_bytes={bucket_bytes} #{i} bitwise per-tensor", as_torch(a), ref)
            plan = plan_buckets([tuple(x.shape) for x in grads if x is not None],
                                [x.dtype for x in grads if x is not None], bucket_bytes)
            ck.true(f"fused {fn} bucket_bytes={bucket_bytes}: one collective per bucket",
                    reducer.collectives - before == len(plan) and (len(plan) > 3) == (bucket_bytes == 64),
                    f"{reducer.collectives - before} collectives, {len(plan)} buckets")
    # int8: the reducer's one bucket through the registry's allreduce, bitwise, residual kept
    from ddl_triton import compression_methods
    method = compression_methods.DEFAULT
    xs = [tf.constant(g.standard_normal(s), tf.float32) for s in ((300,), (17, 3))]
    reducer = dtf.GradientReducer(method)
    residual = torch.zeros(351)
    for step in range(2):
        flat = torch.cat([as_torch(x).reshape(-1) for x in xs])
        if w > 1:  # one rank sends nothing: the reducer does not compress there (nothing to save)
            compression_methods.get(method).run(comm, flat, op="avg", residual=residual)
        got = torch.cat([as_torch(x).reshape(-1) for x in reducer.reduce(xs)])
        ck.equal(f"fused {method} step {step}: the compressed allreduce of the bucket, with error feedback", got, flat)


# -- training --------------------------------------------------------------------------------------
STEPS, GLOBAL, LR = 5, 24, 0.1  # GLOBAL divisible by 1-4 ranks: equal shards cover the batch
RTOL = 1e-5


def make_model(seed: int):
    import keras
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])
    return model


def make_data():
    g = np.random.default_rng(1234)
    return g.standard_normal((STEPS, GLOBAL, 8)).astype(np.float32), g.standard_normal((STEPS, GLOBAL, 4)).astype(
        np.float32)


def loss_fn(model, x, y):
    return tf.reduce_mean(tf.reduce_sum((model(x) - y) ** 2, axis=1))


def train_loop(model, xs, ys, shard=None, distributed=False, compile_step=False, compression="none"):
    import keras
    opt = keras.optimizers.SGD(LR)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y)
        if distributed:
            tape = dtf.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    run = tf.function(step) if compile_step else step
    for x, y in zip(xs, ys):
        if shard is not None:
            x, y = x[shard], y[shard]
        run(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in model.trainable_variables]


def check_close(ck: Checker, what: str, got: list, ref: list) -> None:
    """Tolerance: data-parallel and full-batch training compute the same gradients, summed and
    scaled in another order (per-rank means of b rows, then the average over w ranks, against one
    mean of w*b rows), so each gradient element differs by a few fp32 roundings, |dg| <~ 4 eps |g|
    (eps = 2**-23). After STEPS=5 SGD steps of LR=0.1 (|g| <~ 10 |p| here) parameters differ by
    <~ 5 * 0.1 * 4 eps * 10 |p| = 2.4e-6 |p| before differences feed back, which 5 steps barely
    amplify; RTOL = 1e-5 of each tensor's max |p| covers that, and is far below what skipping the
    average gives (checked below: training on the local shard alone fails it by > 100x)."""
    for i, (a, b) in enumerate(zip(got, ref)):
        tol = RTOL * float(np.abs(b).max())
        err = float(np.abs(a - b).max())
        ck.true(f"{what}: variable {i}", err <= tol, f"max |diff| {err:.3g} > tolerance {tol:.3g}")


def check_training(ck: Checker, r: int, w: int) -> None:
    import keras
    xs, ys = make_data()
    b = GLOBAL // w
    shard = slice(r * b, (r + 1) * b)
    init = [v.numpy().copy() for v in make_model(0).trainable_variables]
    ref = train_loop(make_model(0), xs, ys)
    ck.true("reference moved", all(np.abs(a - i).max() > 100 * RTOL * np.abs(a).max() for a, i in zip(ref, init)))
    local = train_loop(make_model(0), xs, ys, shard)
    worst = max(float(np.abs(a - c).max() / np.abs(c).max()) for a, c in zip(local, ref))
    ck.true("local-only training differs from the reference", w == 1 or worst > 100 * RTOL, f"only {worst:.3g}")
    for compile_step in (False, True):
        what = "custom loop " + ("tf.function" if compile_step else "eager")
        got = train_loop(make_model(0), xs, ys, shard, distributed=True, compile_step=compile_step)
        check_close(ck, what, got, ref)
        for i, v in enumerate(got):
            ck.identical(f"{what}: replicas identical, variable {i}", torch.from_numpy(v))

    # model.fit: rank-dependent initial weights, the callback broadcasts rank 0's (seed 0)
    order = np.concatenate([np.arange(s * GLOBAL + r * b, s * GLOBAL + (r + 1) * b) for s in range(STEPS)])
    for compression in ("none", "int8"):
        model = make_model(0 if r == 0 else 50 + r)
        opt = dtf.DistributedOptimizer(keras.optimizers.SGD(LR), compression=compression)
        model.compile(optimizer=opt, loss=lambda y, p: tf.reduce_sum((p - y) ** 2, axis=1))
        model.fit(xs.reshape(-1, 8)[order], ys.reshape(-1, 4)[order], batch_size=b, epochs=1, shuffle=False,
                  verbose=0, callbacks=[dtf.BroadcastGlobalVariablesCallback(0)])
        got = [v.numpy() for v in model.trainable_variables]
        if compression == "none":
            check_close(ck, "model.fit", got, ref)
        for i, v in enumerate(got):
            ck.identical(f"model.fit {compression}: replicas identical, variable {i}", torch.from_numpy(v))
        ck.true(f"model.fit {compression}: one fused reduction per step", opt._ddl_reducer.calls == STEPS,
                f"{opt._ddl_reducer.calls} calls")
    check_callbacks(ck, r, w)


def check_callbacks(ck: Checker, r: int, w: int) -> None:
    """Horovod's MetricAverageCallback and LearningRateWarmupCallback inside model.fit: what the
    callbacks after them see, on every rank."""
    import keras
    epochs, warmup, steps, peak = 4, 2, 4, 0.4  # steps a power of two: the warmup's epoch fractions are exact

    class Probe(keras.callbacks.Callback):  # before the averaging: rank-dependent entries
        def __init__(self):
            super().__init__()
            self.local_loss = []

        def on_epoch_end(self, epoch, logs=None):
            logs["probe"] = float(r + 1 + 10 * epoch)  # integer-valued: its average is exact for 2 ranks
            self.local_loss.append(logs["loss"])

    class Seen(keras.callbacks.Callback):  # after it: what later callbacks see
        def __init__(self):
            super().__init__()
            self.logs, self.lrs = [], []

        def on_train_batch_begin(self, batch, logs=None):
            self.lrs.append(np.float32(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

        def on_epoch_end(self, epoch, logs=None):
            self.logs.append(dict(logs))

    xs, ys = make_data()
    b = GLOBAL // w
    x, y = xs.reshape(-1, 8)[r * steps * b:(r + 1) * steps * b], ys.reshape(-1, 4)[r * steps * b:(r + 1) * steps * b]
    model = make_model(0)
    model.compile(optimizer=dtf.DistributedOptimizer(keras.optimizers.SGD(LR)),
                  loss=lambda t, p: tf.reduce_sum((p - t) ** 2, axis=1))
    probe, seen = Probe(), Seen()
    model.fit(x, y, batch_size=b, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[dtf.BroadcastGlobalVariablesCallback(0), dtf.LearningRateWarmupCallback(peak, warmup),
                         probe, dtf.MetricAverageCallback(), seen])
    ck.true("fit ran every epoch", len(seen.logs) == epochs and len(seen.lrs) == epochs * steps,
            f"{len(seen.logs)} epochs, {len(seen.lrs)} batches")
    for e, logs in enumerate(seen.logs):
        want = np.float32(sum(q + 1 + 10 * e for q in range(w))) * np.float32(1 / w)
        ck.true(f"MetricAverageCallback: epoch {e}: the probe averaged over the ranks", logs["probe"] == want,
                f"{logs['probe']!r} != {want!r}")
        ck.identical(f"MetricAverageCallback: epoch {e}: the loss the same on every rank",
                     torch.tensor([float(logs["loss"])], dtype=torch.float64))
        ck.identical(f"MetricAverageCallback: epoch {e}: every key the same on every rank",
                     torch.tensor([len(logs)], dtype=torch.int64))
        losses = dtf.allgather(tf.constant([probe.local_loss[e]], tf.float32)).numpy()
        if w == 2:  # one addition and a halving: the core's average, exactly
            ck.true(f"MetricAverageCallback: epoch {e}: the loss is the ranks' average",
                    logs["loss"] == (losses[0] + losses[1]) * np.float32(0.5), f"{logs['loss']!r} vs {losses}")
        ck.true(f"LearningRateWarmupCallback: epoch {e}: logs['lr'] is the rate", logs["lr"] == seen.lrs[-1 if
                e == epochs - 1 else (e + 1) * steps - 1], f"{logs['lr']!r}")
    for i, got in enumerate(seen.lrs):
        e, k = divmod(i, steps)
        if e < warmup:  # Horovod's rule: peak / w * (f * (w - 1) / warmup + 1), f = e + (k + 1) / steps
            f = e + (k + 1) / steps
            want = np.float32(peak * (1.0 / w * (f * (w - 1) / warmup + 1)))
        else:
            want = np.float32(peak)  # the warmup ends at the peak and leaves it there
        ck.true(f"LearningRateWarmupCallback: epoch {e} batch {k}", got == want, f"{got!r} != {want!r}")
    ck.true("LearningRateWarmupCallback: starts at peak / size", seen.lrs[0] == np.float32(
        peak / w * ((1 / steps) * (w - 1) / warmup + 1)), f"{seen.lrs[0]!r}")
    ck.true("LearningRateWarmupCallback: reaches the peak at the warmup's last batch",
            seen.lrs[warmup * steps - 1] == np.float32(peak), f"{seen.lrs[warmup * steps - 1]!r}")


# -- errors ----------------------------------------------------------------------------------------
def check_errors(ck: Checker, r: int, w: int) -> None:
    import keras
    for what, value in (("string", tf.constant(["a"])), ("complex", tf.constant([1j], tf.complex64)),
                        ("bool", tf.constant([True])), ("int8", tf.constant([1], tf.int8))):
        ck.raises(f"allreduce of {what}", TypeError, lambda v=value: dtf.allreduce(v), f"rank {r}")
    ck.raises("unknown op", ValueError, lambda: dtf.allreduce(tf.ones(2), op="prod"), f"rank {r}")
    ck.raises("avg of integers", TypeError, lambda: dtf.allreduce(tf.ones(2, tf.int32), op=dtf.Average), f"rank {r}")
    ck.raises("the default (Average) of integers", TypeError, lambda: dtf.allreduce(tf.ones(2, tf.int32)),
              "op Average (the default) needs a float tensor")
    ck.raises("broadcast root out of range", ValueError, lambda: dtf.broadcast(tf.ones(2), w), f"rank {r}")
    ck.raises("unknown compression", ValueError, lambda: dtf.GradientReducer("zip"), f"rank {r}")
    ck.raises("optimizer that is not Keras'", TypeError, lambda: dtf.DistributedOptimizer(object()), "Keras")
    # Horovod's spellings that ddl_triton does not honour: refused by name, never silently something else
    t = tf.ones(2)
    for what, exc, fn, says in (
            ("the old allreduce(t, 'sum'): its 2nd argument is Horovod's average", TypeError,
             lambda: dtf.allreduce(t, "sum"), "average='sum' is Horovod's deprecated flag"),
            ("op and average both", ValueError, lambda: dtf.allreduce(t, average=True, op=dtf.Sum), "supersedes"),
            ("device_dense", ValueError, lambda: dtf.allreduce(t, device_dense="/gpu:0"), "device_dense='/gpu:0'"),
            ("a process set", ValueError, lambda: dtf.allreduce(t, process_set="evens"), "no process sets"),
            ("a compression of ddl's own in allreduce", TypeError, lambda: dtf.allreduce(t, compression="int8"),
             "Compression.none or Compression.fp16"),
            ("prescale of integers", TypeError, lambda: dtf.allreduce(tf.ones(2, tf.int32), op=dtf.Sum,
                                                                      prescale_factor=2.0), "need a float tensor"),
            ("Adasum", AttributeError, lambda: dtf.Adasum, "Adasum reduction is not implemented"),
            ("broadcast without root_rank", TypeError, lambda: dtf.broadcast(t), "root_rank"),
            ("the callback without root_rank", TypeError, lambda: dtf.BroadcastGlobalVariablesCallback(), "root_rank"),
            ("the callback on a device", ValueError, lambda: dtf.BroadcastGlobalVariablesCallback(0, device="/gpu:0"),
             "device='/gpu:0'"),
            ("gradient_predivide_factor", ValueError,
             lambda: dtf.DistributedGradientTape(tf.GradientTape(), gradient_predivide_factor=2.0),
             "gradient_predivide_factor=2.0 is not supported"),
            ("backward_passes_per_step", ValueError,
             lambda: dtf.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2),
             "backward_passes_per_step=2"),
            ("init(comm=...)", ValueError, lambda: dtf.init(comm=object()), "comm= and process_sets="),
            ("a registry compression in allreduce", TypeError,
             lambda: dtf.allreduce(t, compression=dtf.Compression.int8), "Compression.int8 runs only inside the fused"),
            ("a compression neither Horovod's nor the registry's", AttributeError, lambda: dtf.Compression.zip,
             "Compression has no 'zip'"),
            ("MetricAverageCallback on a device", ValueError, lambda: dtf.MetricAverageCallback("/gpu:0"),
             "device='/gpu:0'"),
            ("the warmup without initial_lr", ValueError, lambda: dtf.LearningRateWarmupCallback(None),
             "`initial_lr` is required"),
            ("the warmup's momentum correction under Keras 3", ValueError,
             lambda: _fit_with(keras.optimizers.SGD(0.1, momentum=0.9), dtf.LearningRateWarmupCallback(0.1)),
             "pass momentum_correction=False")):
        ck.raises(f"Horovod's spelling refused: {what}", exc, fn, says)
    from ddl_triton.tensorflow.horovod_args import NOT_HERE
    for name, why in NOT_HERE.items():  # every Horovod name not implemented: refused, naming what to use instead
        ck.raises(f"Horovod's {name}: refused by name", AttributeError, lambda n=name: getattr(dtf, n),
                  f"ddl_triton.tensorflow has no {name}: {why}")
    ck.true("NOT_HERE names an alternative for each", all(" use " in w or "; " in w for w in NOT_HERE.values()))
    ck.true("is_initialized", dtf.is_initialized())
    dtf.barrier()
    tf.function(lambda: dtf.barrier())()
    dtf.shutdown()
    ck.true("shutdown: no longer initialized", not dtf.is_initialized())
    dtf.init()
    ck.true("init after shutdown", dtf.is_initialized() and dtf.size() == w)
    lrs = _fit_with(keras.optimizers.SGD(0.1, momentum=0.9), dtf.LearningRateWarmupCallback(
        0.2, warmup_epochs=1, momentum_correction=False, steps_per_epoch=2))
    ck.true("the warmup with momentum_correction=False runs", lrs == [np.float32(0.2 / w * (0.5 * (w - 1) + 1)),
                                                                        np.float32(0.2)], f"{lrs}")
    if w > 1:
        from ddl_triton.errors import CollectiveMismatch
        t0 = time.monotonic()
        ck.raises("eager: shapes differ across ranks", CollectiveMismatch, lambda: dtf.allreduce(tf.ones(r + 1), op=dtf.Sum),
                  f"rank {r}")
        ck.true("eager mismatch within the deadline", time.monotonic() - t0 < 60)
        ddl_triton.finalize()  # the mismatch poisoned the world communicator: a new one for the next case
        ddl_triton.init()
        f = tf.function(lambda x: dtf.allreduce(x, op=dtf.Sum))
        said = io.StringIO()  # what the user's stderr shows first: the mismatch, not TF's trace of the op
        with contextlib.redirect_stderr(said):
            ck.raises("tf.function: shapes differ across ranks", tf.errors.OpError, lambda: f(tf.ones(r + 1)), "rank")
        first = (said.getvalue().splitlines() or [""])[0]
        ck.true("tf.function: the mismatch line comes first on stderr",
                first.startswith(f"ddl_triton.errors.CollectiveMismatch: rank {r}: ranks disagree on collective #")
                and "inside tf.function" in first, said.getvalue()[:600])


def _fit_with(optimizer, callback) -> list:
    """One epoch of two steps of model.fit with ``callback``: the learning rates each batch began with."""
    import keras
    lrs = []
    record = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: lrs.append(
        np.float32(keras.ops.convert_to_numpy(model.optimizer.learning_rate))))
    model = make_model(0)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(np.ones((4, 8), np.float32), np.ones((4, 4), np.float32), batch_size=2, epochs=1, verbose=0,
              callbacks=[callback, record])
    return lrs


MODES = {"collectives": check_collectives, "training": check_training, "errors": check_errors}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    world = MPI.COMM_WORLD
    r, w = world.Get_rank(), world.Get_size()
    status = 0
    for mode in args.modes.split(","):
        ck = Checker(world)
        t0 = time.monotonic()
        ck.run(lambda: MODES[mode](ck, r, w))
        status |= ck.report(f"tf_worker: {w} ranks, {mode}")
        if r == 0:
            print_line(f"tf_worker: {mode} took {time.monotonic() - t0:.1f} s")
    ddl_triton.finalize()
    return status


if __name__ == "__main__":
    sys.exit(main())
