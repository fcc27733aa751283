"""ddl_triton.jax between processes: every check of the JAX room in one launch (tests/multirank/test_jax_across_ranks.py).

Runs the same under mpiexec and under env:// (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, no MPI
world): its checks and its closing report go through the ddl communicator itself, never MPI.
With 64-bit JAX (every dtype the core reduces), on every rank:

- allreduce (sum/min/max exact on integer-valued data, avg bitwise the torch path), eager and in
  jit, sizes 0, 1, primes (none divisible by 2 or 3), 2-D; allgather (also bool, uint8);
  broadcast of a pytree of every dtype from every root; every result identical on every rank;
- a jitted function called N times makes exactly its collectives N times, in program order, even
  one whose result is unused (counted by a communicator that logs each call);
- jax.grad (and jit of it) through allreduce sum/avg, allgather, broadcast: exact cotangents;
- allreduce_gradients fused into buckets = per-leaf allreduce, bitwise (random floats);
- compressed allreduce_gradients (every method of the registry, two calls: error feedback)
  bitwise what the torch compressed allreduce gives on the same data and residuals;
- data-parallel training through distributed(optax.sgd) inside jit = one-process full-batch
  training, exactly (integer data, a power-of-two step: every value dyadic, checked against
  Fractions), replicas bitwise identical;
- mpi4jax's names: alltoall, barrier, bcast, gather, reduce, scatter, scan (eager and jit, sizes 0,
  1, 7) and, under MPI, send/recv/sendrecv in a ring (status, tags, order, in jit) and
  comm=MPI.COMM_WORLD; under env://, point-to-point refused by name;
- bad input raising on every rank, naming it, within seconds (the shape mismatch last: it poisons).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from fractions import Fraction

import numpy as np

SIZES = (0, 1, 7, 13, 4099)
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")
N_CALLS = 5
MISMATCH_LIMIT_S = 10.0


def values(rank: int, shape, dtype: str) -> np.ndarray:
    """Small integers (sums over 4 ranks exact even in bfloat16), increasing with the rank."""
    n = int(np.prod(shape, dtype=np.int64))
    v = (np.arange(n, dtype=np.int64) % 7) + 3 * rank + 1
    return v.reshape(shape).astype(_np_dtype(dtype))


def _np_dtype(name: str):
    import ml_dtypes
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


class Checks:
    """Counts checks and keeps failures; ``identical`` compares bytes over the ddl communicator."""

    def __init__(self, comm):
        self.comm, self.cases, self.failures = comm, 0, []

    def true(self, what: str, cond: bool, why: str = "") -> None:
        self.cases += 1
        if not cond:
            self.failures.append(f"rank {self.comm.rank}: {what}" + (f": {why}" if why else ""))

    def same(self, what: str, got, expected) -> None:
        got, expected = np.asarray(got), np.asarray(expected)
        ok = got.dtype == expected.dtype and got.shape == expected.shape and got.tobytes() == expected.tobytes()
        self.true(what, ok, f"got {got.dtype}{got.shape} {got.reshape(-1)[:6]}, expected "
                            f"{expected.dtype}{expected.shape} {expected.reshape(-1)[:6]}")

    def identical(self, what: str, *arrays) -> None:
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).digest()
        mine = np.frombuffer(digest, dtype=np.int32).copy()
        every = np.empty(self.comm.size * mine.size, dtype=np.int32)
        self.comm.all_gather(every, mine)
        differs = [q for q in range(self.comm.size) if not (every[q * 8:(q + 1) * 8] == mine).all()]
        self.true(what, not differs, f"bits differ from rank(s) {differs}")

    def raises(self, what: str, exc, fn, mention: str = "") -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a wrong exception is a failure, not a crash
            self.true(what, isinstance(e, exc) and mention in str(e), f"{type(e).__name__}: {str(e)[:300]}")
        else:
            self.true(what, False, "nothing raised")

    def report(self, heading: str) -> int:
        from support.report import print_line, rank_lines
        for f in self.failures[:30]:
            print_line(f"FAIL {f}")
        mine = np.array([self.comm.rank, self.comm.size, self.cases, len(self.failures)], dtype=np.int64)
        every = np.empty(4 * self.comm.size, dtype=np.int64)
        self.comm.all_gather(every, mine)
        rows = [tuple(int(v) for v in every[4 * q: 4 * q + 4]) for q in range(self.comm.size)]
        if self.comm.rank == 0:
            print_line("\n".join(rank_lines(heading, rows)))
            print_line(f"{heading}, {sum(r[2] for r in rows)} checks, {sum(r[3] for r in rows)} failures")
        return 1 if any(r[3] for r in rows) else 0


class Logged:
    """A communicator that logs every collective the JAX room asks of it (name, numel), in order."""

    def __init__(self, comm):
        self._comm, self.log = comm, []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _call(self, name, first, *args, **kwargs):
        self.log.append((name, int(np.asarray(first).size)))
        return getattr(self._comm, name)(first, *args, **kwargs)

    def allreduce(self, *a, **k): return self._call("allreduce", *a, **k)
    def broadcast(self, *a, **k): return self._call("broadcast", *a, **k)
    def all_gather(self, *a, **k): return self._call("all_gather", *a, **k)
    def reduce_scatter(self, *a, **k): return self._call("reduce_scatter", *a, **k)


def exact_collectives(ck: Checks, comm, ddj, jax, jnp, torch) -> None:
    n, r = comm.size, comm.rank
    xs = {d: [values(r, (s,), d) for s in SIZES] + [values(r, (3, 5), d)] for d in DTYPES}
    ops = {d: ("sum", "min", "max") + (("avg",) if d.startswith(("float", "bfloat")) else ()) for d in DTYPES}
    # One program for every dtype, size and op (one compilation), then one for the gathers.
    reduced = jax.jit(lambda xs: {d: [[ddj.allreduce(x, op) for op in ops[d]] for x in xs[d]] for d in DTYPES})(xs)
    gathered = jax.jit(lambda xs: {d: [ddj.allgather(x) for x in xs[d]] for d in DTYPES})(xs)
    for dtype in DTYPES:
        for x, in_jit, got_all in zip(xs[dtype], reduced[dtype], gathered[dtype]):
            every = [values(q, x.shape, dtype) for q in range(n)]
            exp = {"sum": sum(v.astype(np.float64) for v in every).astype(x.dtype), "min": every[0], "max": every[-1]}
            what = f"allreduce {x.shape} {dtype}"
            for op, got in zip(ops[dtype], in_jit):
                if op == "avg":
                    t = torch.from_numpy(np.array(x).view(np.uint16)).view(torch.bfloat16) if dtype == "bfloat16" \
                        else torch.from_numpy(np.array(x))
                    comm.allreduce(t, op="avg")
                    ref = t.view(torch.uint16).numpy().view(x.dtype) if dtype == "bfloat16" else t.numpy()
                    ck.same(f"{what} avg (jit): the torch path's bits", got, ref)
                else:
                    ck.same(f"{what} {op} (jit)", got, exp[op])
            ck.identical(f"{what}: identical on every rank", *in_jit)
            ck.same(f"allgather {x.shape} {dtype} (jit)", got_all, np.concatenate(every))
        x = xs[dtype][3]  # eager: one size per dtype (each eager shape compiles a program of its own)
        ck.same(f"allreduce {x.shape} {dtype} sum (eager) = in jit", ddj.allreduce(x, "sum"), np.asarray(reduced[dtype][3][0]))
        ck.same(f"allgather {x.shape} {dtype} (eager) = in jit", ddj.allgather(x), np.asarray(gathered[dtype][3]))
    for dtype in ("bool", "uint8"):
        x = (np.arange(11) % 2 == r % 2) if dtype == "bool" else (np.arange(11) * (r + 1)).astype(np.uint8)
        exp = np.concatenate([(np.arange(11) % 2 == q % 2) if dtype == "bool" else
                              (np.arange(11) * (q + 1)).astype(np.uint8) for q in range(n)])
        ck.same(f"allgather 11 x {dtype} (bytes)", ddj.allgather(x), exp)
    rows = lambda q: values(q, (q + 1, 3), "float32")  # noqa: E731 - rank q holds q + 1 rows
    ck.same("eager allgather of rows that differ across ranks (Horovod's rule)", ddj.allgather(rows(r)),
            np.concatenate([rows(q) for q in range(n)]))
    ck.same("allgather of a 0-d array: the vector of the values", ddj.allgather(jnp.int32(r)),
            np.arange(n, dtype=np.int32))
    tree = {d: [values(r, (s,), d) for s in SIZES] for d in DTYPES}
    tree["key"] = jax.random.key_data(jax.random.PRNGKey(r))
    tree["flag"] = np.array([r % 2 == 0, True])
    for root in range(n):
        expect = {d: [values(root, (s,), d) for s in SIZES] for d in DTYPES}
        expect["key"], expect["flag"] = jax.random.key_data(jax.random.PRNGKey(root)), np.array([root % 2 == 0, True])
        for how, fn in (("eager", ddj.broadcast), ("jit", jax.jit(ddj.broadcast, static_argnums=1))):
            got = fn(tree, root)
            flat_got, flat_exp = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expect)
            ck.true(f"broadcast from {root} ({how}): every leaf rank {root}'s, bit for bit",
                    all(np.asarray(a).dtype == np.asarray(b).dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
                        for a, b in zip(flat_got, flat_exp)) and len(flat_got) == len(flat_exp))


def calls_in_order(ck: Checks, comm, ddj, jax, jnp) -> None:
    n, r = comm.size, comm.rank
    logged = Logged(comm)
    f = jax.jit(lambda x: (ddj.allreduce(x, "sum", comm=logged), ddj.allgather(x[:2], comm=logged)))
    g = jax.jit(lambda x: (ddj.allreduce(x * 2, "sum", comm=logged), x + 1)[1])  # the collective's result unused
    results = []
    for i in range(N_CALLS):
        x = jnp.full(5, float(i * n + r), jnp.float32)
        results.append((f(x), g(x)))
    jax.effects_barrier()
    expected_log = [("allreduce", 5), ("all_gather", 2 * n), ("allreduce", 5)] * N_CALLS
    ck.true(f"{N_CALLS} calls of jitted functions: exactly their collectives, in program order",
            logged.log == expected_log, f"log {logged.log[:12]}")
    for i, ((summed, gathered), plus) in enumerate(results):
        ck.same(f"call {i}: its own allreduce", summed, np.full(5, sum(i * n + q for q in range(n)), np.float32))
        ck.same(f"call {i}: its own allgather", gathered, np.repeat(np.arange(i * n, i * n + n, dtype=np.float32), 2))
        ck.same(f"call {i}: the other output", plus, np.full(5, i * n + r + 1, np.float32))


def gradients(ck: Checks, comm, ddj, jax, jnp) -> None:
    n, r = comm.size, comm.rank
    m = 6
    c = lambda q: np.arange(m, dtype=np.float32) + q + 1  # noqa: E731 - rank q's cotangent weights
    x = jnp.arange(m, dtype=jnp.float32) * (r + 1)
    for how, wrap in (("eager", lambda fn: fn), ("jit", jax.jit)):
        got = wrap(jax.grad(lambda x: jnp.sum(c(r) * ddj.allreduce(x, "sum"))))(x)
        ck.same(f"grad through allreduce sum ({how}): the cotangents' sum", got, sum(c(q) for q in range(n)))
        got = wrap(jax.grad(lambda x: jnp.sum(c(r) * ddj.allreduce(x, "avg"))))(x)
        ck.same(f"grad through allreduce avg ({how}): the cotangents' avg", got,
                comm.allreduce(c(r).copy(), op="avg"))
        big = lambda q: np.arange(n * m, dtype=np.float32) * (q + 2)  # noqa: E731
        got = wrap(jax.grad(lambda x: jnp.sum(big(r) * ddj.allgather(x))))(x)
        ck.same(f"grad through allgather ({how}): block r of the cotangents' sum", got,
                sum(big(q) for q in range(n))[r * m:(r + 1) * m])
        for root in (0, n - 1):
            got = wrap(jax.grad(lambda x: jnp.sum(c(r) * ddj.broadcast(x, root))))(x)
            ck.same(f"grad through broadcast from {root} ({how})", got,
                    sum(c(q) for q in range(n)) if r == root else np.zeros(m, np.float32))
    ck.raises("grad through allreduce max: refused, naming the rank", NotImplementedError,
              lambda: jax.grad(lambda x: jnp.sum(ddj.allreduce(x, "max")))(x), f"rank {r}: ")


def fused_equals_per_leaf(ck: Checks, comm, ddj, jax, jnp) -> None:
    rng = np.random.default_rng(100 + comm.rank)
    leaves = [rng.standard_normal(s).astype(np.float32) for s in (1, 7, 1000, 33, 4099, 100_000, 3, 17)]
    leaves += [rng.standard_normal(s).astype(_np_dtype("bfloat16")) for s in (5, 300)]
    for op in ("sum", "avg"):
        per_leaf = jax.jit(lambda t: [ddj.allreduce(v, op) for v in t])(leaves)
        for bucket_bytes in (25 << 20, 4096):
            fused = jax.jit(lambda t: ddj.allreduce_gradients(t, op, bucket_bytes=bucket_bytes))(leaves)
            ck.true(f"allreduce_gradients {op}, {bucket_bytes} B buckets: bitwise the per-leaf allreduces",
                    all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(fused, per_leaf)))
        ck.identical(f"allreduce_gradients {op}: identical on every rank", *per_leaf)


def compressed_like_torch(ck: Checks, comm, ddj, jax, jnp, torch) -> None:
    from ddl_triton import compression_methods
    from ddl_triton.runtime.compression import compressed
    rng = np.random.default_rng(7 + comm.rank)
    steps = [[rng.standard_normal(s).astype(np.float32) for s in (1000, 37, 5003)] for _ in range(2)]
    for method in compression_methods.names():
        row = compression_methods.get(method)
        gc = ddj.GradientCompression(method)
        step = jax.jit(lambda t: ddj.allreduce_gradients(t, compression=gc))
        worker = torch.zeros(sum(v.size for v in steps[0]), dtype=torch.float32) if row.worker_residual else None
        server = None
        if row.server_residual:
            a, b = compressed.chunk_bounds(worker.numel(), comm.size, row.align(256))[comm.rank]
            server = torch.zeros(b - a, dtype=torch.float32)
        for k, leaves in enumerate(steps):
            got = np.concatenate([np.asarray(v) for v in step(leaves)])
            t = torch.from_numpy(np.concatenate(leaves))
            row.run(comm, t, op="avg", residual=worker, server_residual=server)
            ck.same(f"{method} call {k}: bitwise the torch compressed allreduce (error feedback kept)", got, t.numpy())
            ck.identical(f"{method} call {k}: identical on every rank", got)
        ck.true(f"{method}: one compressed bucket per call", gc.calls == 2, repr(gc))


def training(ck: Checks, comm, ddj, jax, jnp, optax) -> None:
    """Least squares, integer data, step 2**-10, loss = the batch's sum: every value stays dyadic and
    exact in float64, so data parallel (sum of the shards' gradients) = full batch, bit for bit."""
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(0)  # the same data on every rank
    b, d, steps, lr = 4, 3, 3, 2.0 ** -10
    X = rng.integers(-3, 4, size=(b * n, d)).astype(np.float64)
    y = rng.integers(-5, 6, size=(b * n,)).astype(np.float64)
    p0 = {"w": np.array([1.0, -2.0, 0.0]), "b": np.array(3.0)}

    def loss(p, X, y):
        return 0.5 * jnp.sum((X @ p["w"] + p["b"] - y) ** 2)

    def train(tx, X, y):
        p, s = {k: jnp.asarray(v) for k, v in p0.items()}, tx.init(p0)
        step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(jax.grad(loss)(p, X, y), s, p)))
        for _ in range(steps):
            p, s = step(p, s)
        return p

    dp = train(ddj.distributed(optax.sgd(lr), op="sum"), X[r * b:(r + 1) * b], y[r * b:(r + 1) * b])
    full = train(optax.sgd(lr), X, y)
    w, bias = [Fraction(float(v)) for v in p0["w"]], Fraction(float(p0["b"]))
    for _ in range(steps):  # the exact reference
        res = [sum(Fraction(float(X[i, j])) * w[j] for j in range(d)) + bias - Fraction(float(y[i])) for i in range(b * n)]
        gw = [sum(res[i] * Fraction(float(X[i, j])) for i in range(b * n)) for j in range(d)]
        w, bias = [w[j] - Fraction(lr) * gw[j] for j in range(d)], bias - Fraction(lr) * sum(res)
    exact = [float(v) for v in w] + [float(bias)]
    ck.true("the exact reference is representable (no rounding anywhere)",
            all(Fraction(e) == f for e, f in zip(exact, w + [bias])))
    got = np.concatenate([np.asarray(dp["w"]), np.asarray(dp["b"]).reshape(1)])
    ck.same(f"{steps} data-parallel steps on {n} ranks = one-process full batch, bit for bit", got,
            np.concatenate([np.asarray(full["w"]), np.asarray(full["b"]).reshape(1)]))
    ck.same("... = the exact (Fraction) reference", got, np.array(exact))
    ck.identical("trained replicas identical on every rank", got)


P2P_SIZES = (0, 1, 7)  # empty, one element, a prime


def mpi4jax_names(ck: Checks, comm, ddj, jax, jnp) -> None:
    """mpi4jax's names on every rank: alltoall, barrier, bcast, gather, reduce, scatter, scan (both
    launches) and, under MPI, send/recv/sendrecv (ring, ordered, status, in jit) and comm=MPI.COMM_WORLD;
    integer-valued data compared bit for bit, sizes 0, 1, a prime, eager and in jit."""
    from mpi4py import MPI
    r, n = comm.rank, comm.size
    mpi = comm.bootstrap.kind == "mpi"
    for m in P2P_SIZES:
        for dt in ("int32", "float64", "bfloat16"):
            k = f"{dt}[{m}]"
            x = np.stack([values(r * n + q, (m,), dt) for q in range(n)])
            want = np.stack([values(q * n + r, (m,), dt) for q in range(n)])
            for how, f in (("eager", ddj.alltoall), ("jit", jax.jit(ddj.alltoall))):
                ck.same(f"alltoall {how} {k}", f(jnp.asarray(x)), want)
            for root in range(n):
                mine = jnp.asarray(values(r, (m,), dt))
                for how, f in (("eager", ddj.bcast), ("jit", jax.jit(ddj.bcast, static_argnums=1))):
                    ck.same(f"bcast {how} {k} root {root}", f(mine, root), values(root, (m,), dt))
                    ck.same(f"gather {how} {k} root {root}", (jax.jit(ddj.gather, static_argnums=1)
                                                             if how == "jit" else ddj.gather)(mine, root),
                            np.stack([values(q, (m,), dt) for q in range(n)]) if r == root else values(r, (m,), dt))
                    whole = jnp.asarray(np.stack([values(q, (m,), dt) for q in range(n)]) if r == root
                                        else np.zeros((m,), values(0, (1,), dt).dtype))
                    ck.same(f"scatter {how} {k} root {root}", (jax.jit(ddj.scatter, static_argnums=1)
                                                              if how == "jit" else ddj.scatter)(whole, root),
                            values(r, (m,), dt))
            if dt == "bfloat16":
                continue
            mine = jnp.asarray(values(r, (m,), dt))
            total = sum(values(q, (m,), "int64") for q in range(n)).astype(_np_dtype(dt))
            for root in range(n):
                ck.same(f"reduce MPI.SUM {k} root {root}", ddj.reduce(mine, MPI.SUM, root),
                        total if r == root else values(r, (m,), dt))
            ck.same(f"scan MPI.SUM {k}", ddj.scan(mine, MPI.SUM),
                    sum(values(q, (m,), "int64") for q in range(r + 1)).astype(_np_dtype(dt)))
            ck.same(f"scan MPI.SUM jit {k}", jax.jit(lambda v: ddj.scan(v, MPI.SUM))(mine),
                    sum(values(q, (m,), "int64") for q in range(r + 1)).astype(_np_dtype(dt)))
            ck.same(f"scan MPI.MIN {k}", ddj.scan(mine, MPI.MIN), values(0, (m,), dt))
            if mpi:
                ck.same(f"allreduce comm=MPI.COMM_WORLD {k}", ddj.allreduce(mine, MPI.SUM, comm=MPI.COMM_WORLD), total)
    ck.true("barrier returns None, eager", ddj.barrier() is None)
    ck.same("barrier inside jit, in order with a collective",
            jax.jit(lambda v: (ddj.barrier(), ddj.allreduce(v, "sum"))[1])(jnp.ones(3, jnp.int32)),
            np.full(3, n, np.int32))
    if not mpi:
        ck.raises("point-to-point without an MPI world: refused, naming the collectives", ValueError,
                  lambda: ddj.send(jnp.ones(2), (r + 1) % n), f"rank {r}: ddl_triton.jax point-to-point")
        ck.raises("comm=MPI.COMM_WORLD when the world is not MPI's", ValueError,
                  lambda: ddj.allreduce(jnp.ones(2), "sum", comm=MPI.COMM_WORLD), "is not ddl_triton's world")
        return
    dest, source = (r + 1) % n, (r - 1) % n
    for m in P2P_SIZES:
        for dt in ("int32", "float64", "bfloat16"):
            k = f"{dt}[{m}]"
            mine, template = jnp.asarray(values(r, (m,), dt)), jnp.zeros((m,), values(0, (1,), dt).dtype)
            ck.same(f"sendrecv ring {k}", ddj.sendrecv(mine, template, source, dest), values(source, (m,), dt))
            ck.same(f"sendrecv ring jit {k}", jax.jit(ddj.sendrecv, static_argnums=(2, 3))(mine, template, source,
                                                                                              dest),
                    values(source, (m,), dt))
            ddj.send(mine, dest, tag=m + 1)  # small: MPI sends it before the peer receives
            status = MPI.Status()
            ck.same(f"send then recv (any source, any tag) {k}", ddj.recv(template, status=status),
                    values(source, (m,), dt))
            ck.true(f"recv's status names the sender and the tag {k}",
                    (status.Get_source(), status.Get_tag()) == (source, m + 1), f"{status.Get_source()}, "
                                                                                 f"{status.Get_tag()}")
    # a jitted function of a send and a recv, called N times: N messages, received in the order sent
    step = jax.jit(lambda v, t: (ddj.send(v, dest, tag=3), ddj.recv(t, source, tag=3))[1])
    got = [np.asarray(step(jnp.full(5, 10 * r + i, jnp.int32), jnp.zeros(5, jnp.int32))) for i in range(N_CALLS)]
    ck.true("jit: send/recv N times, in program order", all((g == 10 * source + i).all() for i, g in enumerate(got)),
            f"{[g[0] for g in got]}")
    for i in range(3):  # two tags interleaved: each tag's messages in order, whichever tag is received first
        ddj.send(jnp.full(2, i, jnp.int64), dest, tag=20)
        ddj.send(jnp.full(2, 100 + i, jnp.int64), dest, tag=21)
    late = [int(ddj.recv(jnp.zeros(2, jnp.int64), source, tag=21)[0]) for _ in range(3)]
    early = [int(ddj.recv(jnp.zeros(2, jnp.int64), source, tag=20)[0]) for _ in range(3)]
    ck.true("messages of one tag arrive in the order sent", (early, late) == ([0, 1, 2], [100, 101, 102]),
            f"{early}, {late}")
    # bad input: named, with the rank, before anything is sent (or, for a mismatch, by the receiver)
    ck.raises("send to a rank that does not exist", ValueError, lambda: ddj.send(jnp.ones(2), n),
              f"rank {r}: ddl_triton.jax.send: dest must be a rank in [0, {n})")
    ck.raises("recv from a negative rank", ValueError, lambda: ddj.recv(jnp.ones(2), -7),
              f"rank {r}: ddl_triton.jax.recv: source must be a rank")
    ck.raises("send to oneself: refused, naming sendrecv", ValueError, lambda: ddj.send(jnp.ones(2), r), "sendrecv(")
    ck.raises("a negative tag", ValueError, lambda: ddj.send(jnp.ones(2), dest, tag=-1), f"rank {r}")
    ddj.send(jnp.arange(7, dtype=jnp.int32), dest, tag=30)
    ck.raises("recv with another dtype and shape than sent: both named", ValueError,
              lambda: ddj.recv(jnp.zeros(4, jnp.float32), source, tag=30),
              f"rank {r}: ddl_triton.jax.recv from rank {source} (tag 30): rank {source} sent int32[7] with tag 30, "
              f"but this rank's template is float32[4]")
    ddj.barrier()


def bad_input(ck: Checks, comm, ddj, jax, jnp) -> None:
    r = comm.rank
    ck.raises("allreduce of int8: refused on every rank, naming it", TypeError,
              lambda: ddj.allreduce(jnp.ones(3, jnp.int8), "sum"), f"rank {r}: ddl_triton.jax.allreduce: dtype int8")
    ck.raises("allreduce avg of int32: refused", TypeError, lambda: ddj.allreduce(jnp.ones(3, jnp.int32), "avg"),
              f"rank {r}: ")
    ck.raises("broadcast from a rank that does not exist", ValueError,
              lambda: ddj.broadcast(jnp.ones(2), comm.size), f"rank {r}: ")
    ck.raises("an unknown compression", ValueError,
              lambda: ddj.allreduce_gradients({"w": jnp.ones(2)}, compression="zip"), f"rank {r}")
    ck.raises("grad through a compressed allreduce_gradients", NotImplementedError,
              lambda: jax.grad(lambda x: ddj.allreduce_gradients(x, compression=ddj.GradientCompression()).sum())(
                  jnp.ones(4)), f"rank {r}: ")
    t0 = time.monotonic()
    ck.raises("arrays whose shapes differ across ranks (in jit): the mismatch on every rank", Exception,
              lambda: np.asarray(jax.jit(lambda x: ddj.allreduce(x, "sum"))(jnp.ones(5 + r))),
              f"rank {r}: ranks disagree on collective")
    ck.true(f"... told within {MISMATCH_LIMIT_S} s", time.monotonic() - t0 < MISMATCH_LIMIT_S,
            f"{time.monotonic() - t0:.1f} s")


def main() -> int:
    import jax
    jax.config.update("jax_enable_x64", True)  # every dtype the core reduces
    import jax.numpy as jnp
    import optax
    import torch

    import ddl_triton
    import ddl_triton.jax as ddj

    comm = ddj.init()
    ck = Checks(comm)
    launcher = "env" if "MASTER_ADDR" in os.environ else "mpi"
    for part, args in ((exact_collectives, (torch,)), (calls_in_order, ()), (gradients, ()),
                       (fused_equals_per_leaf, ()), (compressed_like_torch, (torch,)), (training, (optax,)),
                       (mpi4jax_names, ())):
        t0 = time.monotonic()
        part(ck, comm, ddj, jax, jnp, *args)
        if os.environ.get("JAX_WORKER_TIMES") and comm.rank == 0:
            print(f"{part.__name__}: {time.monotonic() - t0:.1f} s", flush=True)
    ck.true("rank() and size() are the communicator's", (ddj.rank(), ddj.size()) == (comm.rank, comm.size))
    status = ck.report(f"jax_worker: {comm.size} ranks, {launcher}")
    bad_input(ck, comm, ddj, jax, jnp)  # after the report's collective: the mismatch poisons comm
    from support.report import print_line  # one write per line: ranks share the pipe
    if ck.failures:
        print_line("\n".join(f"FAIL {f}" for f in ck.failures))
    print_line(f"jax_worker bad input: rank {comm.rank}: {ck.cases} checks, {len(ck.failures)} failed")
    ddl_triton.finalize()
    return status or (1 if ck.failures else 0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support
    raise SystemExit(main())
