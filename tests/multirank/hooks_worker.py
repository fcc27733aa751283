"""DDP communication hooks and the compressed allreduces under mpiexec (tests/multirank/test_hooks.py, 2 and 3 ranks).

Part 1, the collectives of ``ddl_triton.runtime.compression.compressed`` on their own: the docstrings' worked
examples (2 ranks), then for sizes 0..40000 (empty chunks, short last blocks), fp32 and bf16
inputs, sync and async: bitwise identical results on every rank, exactly ``wire_bytes`` sent
and received, the per-call error bounds (int8, 16-bit), and for 1-bit the error-feedback
identity: after T calls on a fixed input, sum of the outputs == T * mean - mean of the worker
residuals - the server residual (up to fp32 rounding).

Part 2, training: every rank trains examples/train_cnn.py's CNN on its own shard of each global
batch of the digits (the ranks' local gradients differ: checked), once per hook, from the same
initial weights, for ``--steps`` plain-SGD steps, and checks:

1. exactness: ``allreduce_hook`` gives bitwise the parameters of DDP without a hook. DDP's own
   reduction scales each gradient by fp32(1/n) while copying it into the bucket and sums on the
   process group; the hook does the same on ddl_triton's communicator. The sums agree bitwise on
   2 ranks (a + b == b + a) and on the "ddl" backend (the same communicator, the same order);
   on gloo at 3+ ranks the orders may differ: there |diff| <= 1e-5 * max|param|.
2. replicas: after every hook all ranks hold bitwise identical parameters; the hooks ran once
   per bucket and step, also with two buckets in flight at once (``-2buckets``), where DDP's
   bucket rebuild after step 0 resets the residuals once.
3. bytes, measured by ``comm.transport_bytes`` over the whole training, sent and received by
   this rank: fp16/bf16 >= 1.9x, int8 >= 3.9x, 1-bit >= 25x fewer than ``allreduce_hook``; the
   compressed hooks move exactly their ``payload_bytes`` (``compressed.wire_bytes`` per call),
   plus at most 256 B of DDP's own (its bucket rebuild, on the "ddl" backend).
4. loss: the compared loss is the mean global batch loss of the last ``--tail`` steps (the same
   batches for every hook, so batch noise cancels); ``BOUNDS`` below says how far from the
   lossless run's each hook may be, and why; the ``CONTROLS``, deliberately broken hooks, must
   break their bound, so the bounds are shown to bite.

Prints the per-hook table, then "hooks_worker: N ranks, M checks, 0 failures" on rank 0.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import ddl_triton as ddl
from ddl_triton.examples import train_cnn
from ddl_triton.runtime.compression import compressed
from ddl_triton.kernels import dequantize_int8, quantize_int8
from ddl_triton.torch import hooks
from support.checker import Checker

# Loss bounds, for the defaults: 60 steps of plain SGD, lr 0.05, 32 samples per rank per step.
# The lossless tail loss is ~0.24 (from 3.4 at step 0; measured at 2 and 3 ranks).
# fp16, bf16, int8 (two-sided, |gap| <= bound): these perturb each averaged gradient by a
# relative eps, rounding to nearest (unbiased; int8's worker error is even re-sent by error
# feedback). Were the perturbation fully biased against progress, the loss would fall eps less
# per step: at most eps * (3.4 - 0.24) over the run. fp16: eps = 2**-11 (twice: inputs,
# result) -> 0.003, bound 0.005. bf16: eps = 2**-8, twice -> 0.025, bound 0.025. int8:
# eps <= 2/254 of a block's absmax, twice -> 0.05 worst case; the measured gap is ~1e-4, and
# a bound of 0.02 still catches a hook that sums instead of averaging (measured -0.05..-0.07):
# bound 0.02. Measured gaps: all <= 6e-4.
# 1-bit (one-sided, gap <= bound): each step sends every value as +-(mean |v|) of its chunk,
# a different update direction, not a small perturbation; error feedback makes the *sum* of
# the updates the lossless sum up to the current residuals. It may train faster (it does here,
# like signSGD: measured -0.063 at 2 and 3 ranks) but must not trail by more than 0.1, i.e. it
# must achieve 97% of the lossless loss reduction.
BOUNDS = {"fp16": (0.005, True), "bf16": (0.025, True), "int8": (0.02, True), "onebit": (0.1, False)}
# The controls (measured gaps at 2 / 3 ranks): int8 summing instead of averaging (-0.074/-0.053),
# int8 answering with the previous step's result (+0.22/+0.44), 1-bit without error feedback
# (+0.29/+0.22), 1-bit with each chunk's result placed one chunk off (diverges: +49/+31).
CONTROLS = ("int8-summed", "int8-stale", "onebit-noEF", "onebit-shifted")
MIN_BYTE_RATIO = {"fp16": 1.9, "bf16": 1.9, "int8": 3.9, "onebit": 25.0}
# "-2buckets": DDP with bucket_cap_mb=0.1, which (after DDP's rebuild at step 1) splits the model
# into 2 buckets, so two compressed allreduces are in flight at once and the residuals of the
# first step's single bucket are reset once.
ALL_HOOKS = "none,allreduce,fp16,bf16,int8,onebit,int8-2buckets,onebit-2buckets," + ",".join(CONTROLS)


def _bytes(comm) -> tuple[int, int]:
    tb = comm.transport_bytes
    return sum(t["sent"] for t in tb.values()), sum(t["received"] for t in tb.values())


# ------------------------------------------------------------------------------------------------
# Part 1: the compressed collectives
# ------------------------------------------------------------------------------------------------

def _block_absmax(v: torch.Tensor, pad: int) -> torch.Tensor:
    """Per element, the absmax of its 256-element quantization block."""
    return F.pad(v.abs(), (0, pad)).view(-1, 256).amax(1).repeat_interleave(256)[:v.numel()]


def _worked_examples(comm, ck: Checker) -> None:
    r = comm.rank
    x = torch.tensor([[1, 2, 3, 4, 8, 0, 0, 0.], [3, 2, 1, 0, 0, 0, 0, -8.]][r])
    # Two ranks gather: the mean of both dequantized inputs, never requantized (compressed.py)
    want = torch.tensor([2.003937, 2.011811, 1.992126, 2.0, 4.0, 0.0, 0.0, -4.0])
    got = compressed.allreduce_int8(comm, x, block=4)
    ck.true("int8 worked example", torch.allclose(got, want, atol=1e-6), str(got))
    x = torch.tensor([[0.5, -1.5, 2.0, 0.0], [1.0, 1, 1, 1]][r])
    got = compressed.allreduce_onebit(comm, x)
    ck.true("1-bit worked example", torch.equal(got, torch.tensor([1.0, 0.0, 1.0, 1.0])), str(got))
    x = torch.tensor([[1.0, 3.0], [1.00390625, 0.1]][r])
    got = compressed.allreduce_16bit(comm, x, wire_dtype=torch.bfloat16)
    ck.true("bf16 worked example", got.tolist() == [1.0, 1.546875], str(got))
    x = torch.tensor([[1.0, 0.1], [1.0, 0.3]][r])
    got = compressed.allreduce_16bit(comm, x.clone(), wire_dtype=torch.float16)
    ck.true("fp16 hook example", got.tolist() == [1.0, 0.199951171875], str(got))
    got = compressed.allreduce_16bit(comm, x.clone(), wire_dtype=torch.bfloat16)
    ck.true("bf16 hook example", got.tolist() == [1.0, 0.2001953125], str(got))


def _int8_gathered_bits(comm, ck: Checker) -> None:
    """Two ranks: int8's result is exactly dequant(rank 0) + dequant(rank 1), times fp32(1/2) for
    "avg" (gathered.py, which halves the scales instead: the same bits for normal scales)."""
    for numel in (1, 255, 5003, 40013):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(7 * comm.rank + numel)) * torch.logspace(-3, 1, numel)
        both = MPI.COMM_WORLD.allgather(x)
        terms = [dequantize_int8(*quantize_int8(v)) for v in both]
        for op in ("avg", "sum"):
            want = terms[0] + terms[1]
            if op == "avg":
                want = want * torch.tensor(0.5)
            ck.equal(f"int8 gathered bits, {numel}, {op}", compressed.allreduce_int8(comm, x.clone(), op=op), want)


def _collectives(comm, ck: Checker) -> None:
    """Identity across ranks, exact bytes, error bounds, error feedback; many shapes."""
    r, n = comm.rank, comm.size
    if n == 2:
        _worked_examples(comm, ck)
        _int8_gathered_bits(comm, ck)
    for numel in (0, 1, 5, 31, 33, 257, 1000, 4099, 40000):
        g = torch.Generator().manual_seed(1000 * r + numel)
        x32 = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)  # blocks of many magnitudes
        for dtype in (torch.float32, torch.bfloat16):
            x = x32.to(dtype)
            exact = x.to(torch.float64)
            comm.allreduce(exact, op="avg")
            xs = torch.stack(MPI.COMM_WORLD.allgather(x.to(torch.float64))) if numel else torch.zeros(n, 0)
            for kind in ("int8", "onebit", "16bit"):
                what = f"{kind} numel {numel} {dtype}"
                s0, r0 = _bytes(comm)
                t = x.clone()
                if kind == "int8":
                    out = compressed.allreduce_int8(comm, t, async_op=numel % 2 == 1)
                elif kind == "onebit":
                    out = compressed.allreduce_onebit(comm, t, async_op=numel % 2 == 1)
                else:
                    out = compressed.allreduce_16bit(comm, t, wire_dtype=torch.float16, async_op=numel % 2 == 1)
                if numel % 2 == 1:
                    out = out.wait()
                s1, r1 = _bytes(comm)
                ck.true(what, out is t and out.dtype == dtype, "not in place")
                ck.identical(what, out)
                want = compressed.wire_bytes(kind, numel, n)
                ck.true(what, s1 - s0 == want and r1 - r0 == want, f"moved {s1 - s0}/{r1 - r0} B, not {want}")
                err = (out.to(torch.float64) - exact).abs()
                if kind == "int8" and numel:
                    # worker: each rank's block absmax/127 (half of it, +2**-16); server: the mean's, + worker error
                    pad = (-numel) % 256
                    s_w = torch.stack([_block_absmax(v, pad) for v in xs]).max(0).values / 127
                    s_r = (_block_absmax(exact, pad) + s_w) / 127
                    if n == 2:  # gathered: the workers' error alone, nothing requantized (+ fp32 add and scale)
                        s_r = out.to(torch.float64).abs() * 2 ** -22 / (0.5 + 2 ** -16)
                    bound = (s_w + s_r) * (0.5 + 2 ** -16) * (1 + 1e-6) + (out.to(torch.float64).abs() * 2 ** -8
                                                                           if dtype == torch.bfloat16 else 0)
                    ck.true(what, bool((err <= bound).all()), f"error {float((err - bound).max()):.3g} over bound")
                if kind == "16bit" and numel:
                    # inputs and result each rounded to fp16 (subnormals: 2**-25 absolute), then stored as dtype
                    bound = (2 ** -11 * (xs.abs().mean(0) + out.to(torch.float64).abs()) * (1 + 1e-6) + 2 ** -24
                             + (out.to(torch.float64).abs() * 2 ** -8 if dtype == torch.bfloat16 else 0))
                    ck.true(what, bool((err <= bound).all()), f"error {float((err - bound).max()):.3g} over bound")

    # Error feedback: sum_t y_t = T * mean - mean_p(worker residual_p) - server residual, up to fp32 rounding.
    for numel in (1000, 40000):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(r)) * torch.logspace(-2, 1, numel)
        exact = x.to(torch.float64)
        comm.allreduce(exact, op="avg")
        a, b = compressed.chunk_bounds(numel, n, 32)[r]
        w, srv = torch.zeros(numel), torch.zeros(b - a)
        total = torch.zeros(numel, dtype=torch.float64)
        steps = 30
        for t in range(steps):
            total += compressed.allreduce_onebit(comm, x.clone(), residual=w, server_residual=srv).to(torch.float64)
            if t == 0:
                first = float((total - exact).norm() / exact.norm())
        w_mean = w.to(torch.float64)
        comm.allreduce(w_mean, op="avg")
        srv_all = torch.cat(MPI.COMM_WORLD.allgather(srv)).to(torch.float64)
        identity = steps * exact - w_mean - srv_all
        tol = 1e-5 * (steps * exact.abs() + w_mean.abs() + srv_all.abs()).max()
        off = float((total - identity).abs().max())
        ck.true("1-bit error feedback identity", off <= tol, f"off by {off:.3g}")
        later = float((total / steps - exact).norm() / exact.norm())
        if r == 0:
            print(f"1-bit, {numel} elements: relative error of one call {first:.3f}, "
                  f"of the mean of {steps} {later:.3f}")
        # Not 1/30: over 1000x magnitudes the residuals grow until mean |v| reaches the largest values.
        ck.true("1-bit error feedback", later < first / 2, f"error of the mean of {steps} calls {later:.3f} is not "
                                                           f"half of one call's {first:.3f}")
    # int8 error feedback: the residual holds exactly what the last quantization lost.
    x = torch.randn(5000, generator=torch.Generator().manual_seed(r))
    res = torch.zeros(5000)
    out = compressed.allreduce_int8(comm, x.clone(), residual=res)
    q, sc = quantize_int8(x)
    ck.true("int8 residual", torch.equal(res, x - dequantize_int8(q, sc)), "not what quantization lost")
    ck.identical("int8 with residual", out)
    # A strided tensor is reduced through a contiguous copy and written back.
    m = torch.randn(64, 48, generator=torch.Generator().manual_seed(r)).t()
    want = m.contiguous().clone()
    compressed.allreduce_16bit(comm, want, wire_dtype=torch.bfloat16)
    compressed.allreduce_16bit(comm, m, wire_dtype=torch.bfloat16)
    ck.true("strided tensor", torch.equal(m, want), "result differs from the contiguous one")
    # Bad input raises before any communication, on every rank alike.
    for what, bad in (("int8, residual of another size",
                       lambda: compressed.allreduce_int8(comm, torch.zeros(10), residual=torch.zeros(9))),
                      ("int8 of integers", lambda: compressed.allreduce_int8(comm, torch.zeros(10, dtype=torch.int32))),
                      ("1-bit max", lambda: compressed.allreduce_onebit(comm, torch.zeros(10), op="max")),
                      ("int8, block 3", lambda: compressed.allreduce_int8(comm, torch.zeros(10), block=3))):
        ck.raises(f"bad input: {what}", (ValueError, TypeError), bad)
    # 1-bit with one scale per parameter-like group: still identical everywhere, exact bytes.
    x = torch.randn(3000, generator=torch.Generator().manual_seed(r))
    groups = [0, 10, 700, 701, 2048]
    s0, _ = _bytes(comm)
    out = compressed.allreduce_onebit(comm, x, groups=groups)
    s1, _ = _bytes(comm)
    ck.identical("1-bit groups", out)
    ck.true("1-bit groups: bytes", s1 - s0 == compressed.wire_bytes("onebit", 3000, n, groups=groups), str(s1 - s0))


# ------------------------------------------------------------------------------------------------
# Part 2: DDP training with every hook
# ------------------------------------------------------------------------------------------------

def _int8_summed_hook(state, bucket):
    """Control: int8_compress_hook with the ranks' gradients summed, not averaged (a scaling bug)."""
    buf = bucket.buffer()
    residual = state._residual(bucket, "int8", buf.numel())[0]
    return hooks._future(lambda: compressed.allreduce_int8(state.comm, buf, op="sum", residual=residual,
                                                            async_op=True))


_STALE: dict = {}


def _int8_stale_hook(state, bucket):
    """Control: int8_compress_hook answering with the previous step's result (a stale-future bug)."""
    previous = _STALE.get(bucket.index())

    def stale(fut):
        now = fut.value().clone()
        _STALE[bucket.index()] = now
        return previous if previous is not None and previous.numel() == now.numel() else torch.zeros_like(now)
    return hooks.int8_compress_hook(state, bucket).then(stale)


def _onebit_shifted_hook(state, bucket):
    """Control: onebit_compress_hook whose result lands one chunk off (a chunk-placement bug)."""
    shift = compressed.chunk_bounds(bucket.buffer().numel(), state.comm.size, 32)[0][1]
    return hooks.onebit_compress_hook(state, bucket).then(lambda fut: torch.roll(fut.value(), shift))


HOOKS = {"none": None, "allreduce": hooks.allreduce_hook, "fp16": hooks.fp16_compress_hook,
         "bf16": hooks.bf16_compress_hook, "int8": hooks.int8_compress_hook, "onebit": hooks.onebit_compress_hook,
         "int8-summed": _int8_summed_hook, "int8-stale": _int8_stale_hook,
         "onebit-noEF": hooks.onebit_compress_hook, "onebit-shifted": _onebit_shifted_hook,
         "int8-2buckets": hooks.int8_compress_hook, "onebit-2buckets": hooks.onebit_compress_hook}


def kind_of(name: str) -> str:
    return name.split("-")[0]


def _training(args, comm, backend: str, ck: Checker) -> None:
    rank, size = comm.rank, comm.size
    data = train_cnn.load_data(0, mpi_comm=MPI.COMM_WORLD)
    x_train, y_train = data[0], data[1]

    # The ranks' gradients really differ: each rank's local gradient on its shard of batch 0.
    model = train_cnn.build_model(0)
    _, idx = next(train_cnn.batches(len(y_train), size * args.batch_size, 1, 1))
    mine = idx[rank * args.batch_size: (rank + 1) * args.batch_size]
    F.cross_entropy(model(x_train[mine]), y_train[mine]).backward()
    local = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    others = MPI.COMM_WORLD.allgather(local)
    ck.true("the ranks' local gradients differ", all(not torch.equal(others[0], g) for g in others[1:]))
    n_params = local.numel()

    results = {}
    for name in args.hooks.split(","):
        two = name.endswith("-2buckets")
        model = DDP(train_cnn.build_model(0), bucket_cap_mb=0.1) if two else DDP(train_cnn.build_model(0))
        state = hooks.HookState(comm, error_feedback=(name != "onebit-noEF"))
        if HOOKS[name] is not None:
            model.register_comm_hook(state, HOOKS[name])
        s0, r0 = _bytes(comm)
        losses = train_cnn.train(model, data, rank=rank, size=size, epochs=100, batch_size=args.batch_size, lr=args.lr,
                          momentum=0.0, seed=0, max_steps=args.steps)
        s1, r1 = _bytes(comm)
        curve = torch.tensor(losses, dtype=torch.float64)
        comm.allreduce(curve, op="avg")  # the global batch loss of every step
        flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
        ck.identical(f"{name}: replicas", flat)
        if HOOKS[name] is not None and name not in CONTROLS:
            calls = 2 * args.steps - 1 if two else args.steps  # step 0 has one bucket: DDP rebuilds after it
            ck.true(f"{name}: hook calls", state.calls == calls, f"{state.calls} in {args.steps} steps, not {calls}")
            resets = 1 if two and kind_of(name) in ("int8", "onebit") else 0
            ck.true(f"{name}: residual resets", state.residual_resets == resets, str(state.residual_resets))
        results[name] = dict(loss=curve[-args.tail:].mean().item(), params=flat, sent=s1 - s0, received=r1 - r0,
                             calls=state.calls, payload=state.payload_bytes,
                             acc=train_cnn.accuracy(model.module, data[2], data[3]))
        if rank == 0 and args.verbose:
            print(name, " ".join(f"{v:.3f}" for v in curve[::5].tolist()), flush=True)

    base = results.get("allreduce")
    if "none" in results and base is not None:
        a, b = results["none"]["params"], base["params"]
        diff = (a - b).abs().max().item()
        if size == 2 or backend == "ddl":
            ck.true("allreduce_hook == DDP without hook", torch.equal(a, b), f"max diff {diff:.3g}, {backend}")
        else:
            ck.true("allreduce_hook near DDP without hook", diff <= 1e-5 * a.abs().max().item(), f"{diff:.3g}")
    for name, res in results.items():
        kind = kind_of(name)
        if base is None or kind not in BOUNDS:
            continue
        gap = res["loss"] - base["loss"]
        bound, two_sided = BOUNDS[kind]
        within = (abs(gap) if two_sided else gap) <= bound
        if name not in CONTROLS:
            ck.true(f"{name}: loss", within, f"{res['loss']:.4f} vs lossless {base['loss']:.4f}: gap {gap:+.4f} "
                                             f"outside the bound {bound}")
            ck.true(f"{name}: not bitwise the lossless run", not torch.equal(res["params"], base["params"]))
            for what in ("sent", "received"):
                ratio = base[what] / max(1, res[what])
                ck.true(f"{name}: {what} bytes", ratio >= MIN_BYTE_RATIO[kind],
                        f"only {ratio:.2f}x fewer than allreduce_hook (need {MIN_BYTE_RATIO[kind]})")
            if name == kind:  # one bucket of all parameters
                wire = compressed.wire_bytes({"fp16": "16bit", "bf16": "16bit"}.get(kind, kind), n_params, size)
                ck.true(f"{name}: payload", res["payload"] == res["calls"] * wire,
                        f"{res['payload']} != calls * {wire}")
            ck.true(f"{name}: measured bytes", 0 <= res["sent"] - res["payload"] <= 256
                    and 0 <= res["received"] - res["payload"] <= 256,
                    f"{res['sent']} B sent, {res['received']} B received; payload {res['payload']}")
        elif name in CONTROLS:
            ck.true(f"control {name}", not within, f"gap {gap:+.4f} is within the {kind} bound {bound}")

    if rank == 0:
        print(f"# backend {backend}, {size} ranks, {args.steps} steps of SGD lr {args.lr}, batch "
              f"{args.batch_size}/rank, {n_params} parameters; loss = mean global batch loss of the last "
              f"{args.tail} steps")
        print(f"{'hook':>15} {'loss':>8} {'gap':>8} {'bound':>8} {'test acc':>8} {'sent B':>10} {'recv B':>10} "
              f"{'x fewer':>8}")
        for name, res in results.items():
            kind = kind_of(name)
            gap = res["loss"] - base["loss"] if base else float("nan")
            ratio = base["received"] / max(1, res["received"]) if base else float("nan")
            bound = (("+-" if BOUNDS[kind][1] else "+") + str(BOUNDS[kind][0])) if kind in BOUNDS else "-"
            print(f"{name:>15} {res['loss']:8.4f} {gap:+8.4f} {bound:>8} {res['acc']:8.4f} {res['sent']:10d} "
                  f"{res['received']:10d} {ratio:8.2f}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="auto", choices=("auto", "ddl", "gloo"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--tail", type=int, default=20, help="compare the mean global batch loss of the last TAIL steps")
    p.add_argument("--hooks", default=ALL_HOOKS)
    p.add_argument("--skip-collectives", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--report-each", action="store_true",
                   help="one report for the collectives, then one for the hooks (two tests read one launch)")
    args = p.parse_args()

    torch.set_num_threads(1)
    backend = train_cnn.init_process_group(args.backend)
    comm = ddl.init()
    if args.report_each:
        status = 0
        for part, run in (("collectives", lambda ck: _collectives(comm, ck)),
                          ("hooks", lambda ck: _training(args, comm, backend, ck))):
            ck = Checker(MPI.COMM_WORLD)
            ck.run(lambda: run(ck))
            status |= ck.report(f"hooks_worker: {comm.size} ranks, {part}")
    else:
        ck = Checker(MPI.COMM_WORLD)

        def body() -> None:
            if not args.skip_collectives:
                _collectives(comm, ck)
            if args.hooks:
                _training(args, comm, backend, ck)

        ck.run(body)
        status = ck.report(f"hooks_worker: {comm.size} ranks")
    dist.destroy_process_group()
    ddl.finalize()
    return status


if __name__ == "__main__":
    sys.exit(main())
