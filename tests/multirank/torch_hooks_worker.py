"""torch's own DDP communication hooks and optimizers on "ddl", each against gloo in the same job
(tests/multirank/test_torch_hooks.py; 2 ranks under mpiexec).

Every hook of ``torch.distributed.algorithms.ddp_comm_hooks`` (the public ones, every
``DDPCommHookType``, and DDP's fused optimizer, which runs ``_hook_then_optimizer``), and
``PostLocalSGDOptimizer`` and ``ZeroRedundancyOptimizer``, trains the same small model from the
same weights on the same per-rank batches twice: once with DDP on the default "ddl" group, once
on a gloo group of the same ranks. Many of them issue further collectives from inside their
futures' ``then`` callbacks and wait for them there (PowerSGD, the quantization hooks, the
compression wrappers), which is what this worker exists to exercise.

Checks, per case:
1. both backends end the same way: both train, or both raise the same error (torch refuses some
   cases on CPU whatever the backend); a case that fails on one only is a failure, named;
2. when both train: the parameters after every step bitwise equal between "ddl" and gloo. At 2
   ranks every reduction these hooks make is one addition, a + b == b + a, so any difference is
   a wrong or reordered collective, not rounding; and the replicas bitwise identical on each;
3. the case trained (the parameters moved), so that a hook that did nothing would not pass.

Prints one row per case (its outcome on each backend), then the closing report on rank 0.
"""
from __future__ import annotations

import argparse
import functools
import logging
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import DDPCommHookType
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook, debugging_hooks, default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as quant
from torch.nn.parallel import DistributedDataParallel as DDP

import ddl_triton.torch  # noqa: F401 - registers "ddl"
from support.checker import Checker
from support.report import print_line

STEPS = 6
ZERO_WARMUP = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 24, generator=g), torch.randint(0, 4, (8,), generator=g)


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ---- the cases: each builds (model, optimizer step) on a process group -----------------------------
def _powersgd_state(pg, **kw):
    # warm start, error feedback and compression from step 2 on (torch's defaults, but start early)
    return psgd.PowerSGDState(process_group=pg, matrix_approximation_rank=2, start_powerSGD_iter=2,
                              min_compression_rate=0.5, **kw)


def _hooked(hook, state_of=lambda pg: pg, bucket_mb: float | None = None):
    def build(pg):
        model = DDP(_model(), process_group=pg, **({} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}))
        model.register_comm_hook(state_of(pg), _one_at_a_time(hook) if bucket_mb and pg is not WORLD() else hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.05)
    return build


def _one_at_a_time(hook):
    """``hook``, returning only once its future is done: one bucket in flight at a time. gloo runs
    a future's callbacks on its worker threads, and PowerSGD's callbacks issue collectives: with
    several buckets in flight the ranks issue them in different orders and gloo hangs (seen with
    3 buckets, 2 and 8 threads). The reference runs them one by one; "ddl" runs them all at once.
    The numbers are the same: the hook's state is kept per bucket."""
    @functools.wraps(hook)
    def serial(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut
    return serial


def WORLD():  # noqa: N802 - torch's name for the default group, read once it exists
    return dist.group.WORLD


def _enum(member):
    def build(pg):
        model = DDP(_model(), process_group=pg)
        member.value(model=model, state=pg)
        return model, torch.optim.SGD(model.parameters(), lr=0.05)
    return build


def _fused_optimizer(pg):
    model = DDP(_model(), process_group=pg)
    model._register_fused_optim(torch.optim.SGD, lr=0.05)  # runs _hook_then_optimizer's callback
    return model, None


def _post_local_sgd(pg):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    # one rank per subgroup: local steps do not communicate; every 2nd step averages the world's models
    subgroup, _ = dist.new_subgroups(group_size=1, backend=dist.get_backend(pg))
    model = DDP(_model(), process_group=pg)
    state = post_local.PostLocalSGDState(process_group=pg, subgroup=subgroup, start_localSGD_iter=2)
    model.register_comm_hook(state, post_local.post_localSGD_hook)
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                PeriodicModelAverager(period=2, warmup_steps=2, process_group=pg))
    return model, opt


def _zero(pg):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = DDP(_model(), process_group=pg)
    return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, process_group=pg,
                                          lr=0.05)


def _zero_hook(hook):
    def build(pg):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = DDP(_model(), process_group=pg)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, process_group=pg,
                                       overlap_with_ddp=True, lr=0.05)
        model.register_comm_hook(pg, hook(default_hooks.allreduce_hook, model, zero))
        return model, None  # the hook steps the optimizer; ZeRO's own step() must not be called
    return build


def _sgd_from_step(first: int):
    """DDP and SGD that updates from step ``first`` on: the reference for ZeRO's DDP-overlapped
    step, which gloo refuses ("may meet hangs"): its hook warms up for the first steps ("two or
    three training iterations do not perform parameter updates", its docstring), then runs the
    same SGD update on each parameter's shard, which ZeRO then broadcasts."""
    def build(pg):
        model = DDP(_model(), process_group=pg)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        steps = [0]

        class Step:
            def zero_grad(self):
                sgd.zero_grad()

            def step(self):
                if steps[0] >= first:
                    sgd.step()
                steps[0] += 1
        return model, Step()
    return build


CASES = {
    "allreduce_hook": _hooked(default_hooks.allreduce_hook),
    "fp16_compress_hook": _hooked(default_hooks.fp16_compress_hook),
    "bf16_compress_hook": _hooked(default_hooks.bf16_compress_hook),
    "fp16_compress_wrapper(powerSGD)": _hooked(default_hooks.fp16_compress_wrapper(psgd.powerSGD_hook),
                                               _powersgd_state),
    "bf16_compress_wrapper(powerSGD)": _hooked(default_hooks.bf16_compress_wrapper(psgd.powerSGD_hook),
                                               _powersgd_state),
    "powerSGD_hook": _hooked(psgd.powerSGD_hook, _powersgd_state),
    "powerSGD_hook, 3 buckets": _hooked(psgd.powerSGD_hook, _powersgd_state, bucket_mb=0.001),
    "powerSGD_hook, no error feedback": _hooked(psgd.powerSGD_hook,
                                                lambda pg: _powersgd_state(pg, use_error_feedback=False,
                                                                           warm_start=False)),
    "batched_powerSGD_hook": _hooked(psgd.batched_powerSGD_hook, _powersgd_state),
    "quantization_pertensor_hook": _hooked(quant.quantization_pertensor_hook),
    "quantization_perchannel_hook": _hooked(quant.quantization_perchannel_hook),
    "noop_hook": _hooked(debugging_hooks.noop_hook),
    "post_localSGD_hook + PostLocalSGDOptimizer": _post_local_sgd,
    "ZeroRedundancyOptimizer": _zero,
    "hook_with_zero_step": (_zero_hook(ddp_zero_hook.hook_with_zero_step), _sgd_from_step(ZERO_WARMUP)),
    "hook_with_zero_step_interleaved": (_zero_hook(ddp_zero_hook.hook_with_zero_step_interleaved),
                                        _sgd_from_step(ZERO_WARMUP)),
    "DDP fused optimizer (_hook_then_optimizer)": _fused_optimizer,
    **{f"DDPCommHookType.{m.name}": _enum(m) for m in DDPCommHookType},
}


# The steps after which the replicas are the same, where not every step: the no-op hooks never
# synchronise; local SGD (start_localSGD_iter=2, subgroups of one rank) allreduces gradients at
# steps 0 and 1, then only the averager (period 2, warmup 2) brings the models together, after
# steps 2 and 4.
SYNCED_STEPS = {"noop_hook": (), "DDPCommHookType.NOOP": (),
                "post_localSGD_hook + PostLocalSGDOptimizer": (0, 1, 2, 4)}


def _drifted(t: torch.Tensor) -> bool:
    """Whether some rank's ``t`` differs from rank 0's, on every rank (over MPI: the reference
    must not depend on the backends under test)."""
    from mpi4py import MPI

    first = t.clone()
    MPI.COMM_WORLD.Bcast(first.numpy(), root=0)
    differs = torch.tensor([int(not torch.equal(t, first))], dtype=torch.int32)
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, differs.numpy(), op=MPI.MAX)
    return bool(differs.item())


def _train(build, pg, rank: int) -> list[torch.Tensor]:
    """The parameters after every step of ``build``'s model and optimizer on ``pg``."""
    model, opt = build(pg)
    after = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if opt is not None:
            opt.zero_grad()
        else:  # the hook steps the optimizer (fused, ZeRO overlapped)
            model.zero_grad(set_to_none=True)
        loss.backward()
        if opt is not None:
            opt.step()
        after.append(_params(model.module))
    return after


def _outcome(build, pg, rank: int):
    """("ok", params per step) or ("error", "<type>: <first line>")."""
    try:
        return "ok", _train(build, pg, rank)
    except Exception as e:  # noqa: BLE001 - an outcome to compare between the backends
        line = (str(e).strip().splitlines() or [""])[0]
        return "error", f"{type(e).__name__}: {line[:160]}", traceback.format_exc()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="", help="case names separated by ; (default: all)")
    p.add_argument("--gloo-first", action="store_true", help="run each case on gloo before ddl")
    args = p.parse_args()
    torch.set_num_threads(1)
    # torch's own notes on what these cases do (deprecations, ZeRO's warm-up): not this test's output
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    dist.init_process_group("ddl")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    names = [n for n in args.cases.split(";") if n] or list(CASES)
    ck = Checker()
    initial = _params(_model())

    def body() -> None:
        for name in names:
            build, reference = CASES[name] if isinstance(CASES[name], tuple) else (CASES[name], CASES[name])
            if args.gloo_first:
                ref = _outcome(reference, gloo, rank)
                ddl = _outcome(build, dist.group.WORLD, rank)
            else:
                ddl = _outcome(build, dist.group.WORLD, rank)
                ref = _outcome(reference, gloo, rank)
            gloo_name = "gloo" if reference is build else "gloo reference"
            row = f"{name}: ddl {ddl[0] if ddl[0] == 'ok' else ddl[1]} | {gloo_name} " \
                  f"{ref[0] if ref[0] == 'ok' else ref[1]}"
            if rank == 0:
                print_line(f"case {row}")
            ck.true(f"{name}: the same outcome on ddl and gloo", ddl[0] == ref[0] and
                    (ddl[0] == "ok" or ddl[1] == ref[1]),
                    row + "".join(f"\n{o[2]}" for o in (ddl, ref) if o[0] == "error"))
            if ddl[0] != "ok":
                continue
            synced = SYNCED_STEPS.get(name, range(STEPS))
            for step, (a, b) in enumerate(zip(ddl[1], ref[1])):
                ck.true(f"{name}: ddl == gloo after step {step}", torch.equal(a, b),
                        f"max |diff| {(a - b).abs().max().item():.3g}")
                if step in synced:
                    ck.identical(f"{name}: replicas after step {step} on ddl", a)
                else:  # a step that synchronises nothing: the replicas must have drifted apart
                    ck.true(f"{name}: replicas differ after step {step} (not synchronised)", _drifted(a))
            ck.true(f"{name}: trained", not torch.equal(ddl[1][-1], initial))

    ck.run(body)
    status = ck.report(f"torch_hooks_worker: {dist.get_world_size()} ranks")
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
