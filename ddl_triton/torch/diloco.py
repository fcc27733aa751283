"""``DiLoCo``: outer-sync training (DiLoCo, Streaming DiLoCo) for torch, in torchft's shape.

    import ddl_triton.torch as ddt
    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)   # DiLoCo's paper
    with ddt.DiLoCo(model, inner, outer, sync_every=100) as diloco:
        for x, y in batches:
            inner.zero_grad(); loss_fn(model(x), y).backward(); inner.step()   # counted by a hook
    diloco.close()

Semantics (torchft's ``DiLoCo``, torchft/local_sgd.py): the inner optimizer steps on this replica's
gradients only; a step post-hook on it counts inner steps (the context registers it; leaving the
context removes it). Every ``sync_every`` // ``fragments`` steps one fragment (fragments are the
model's parameters in order, balanced by bytes: ddl_triton/outer_sync/fragments.py) syncs, in turn
(ddl_triton/outer_sync/schedule.py): its pseudo-gradient, the backup (the last global parameters)
minus the local parameters, is averaged over the replicas (``fragment_sync_delay`` inner steps
before it is applied, overlapped with them); then the fragment's parameters are reset to the
backup, the average is put in their ``.grad``, the outer optimizer steps, the result becomes the
new backup, and with ``fragment_update_alpha`` = a the parameters become
lerp(global, local, a) (torchft's mixing; a = 0 keeps the global parameters). With a = 0 every
replica ends each fragment's sync with the same bits in that fragment (the average is the same
bits everywhere and the outer optimizer's arithmetic is the same), as its backup always is.

What differs from torchft (docs/outer_sync.md has the whole table): no ``manager`` (the replicas are
``comm``'s ranks, default the world ``ddl_triton.init()``; a lost rank is the elastic machinery's:
``state_dict``/``load_state_dict``); the model, not its fragments, is passed, and ``fragments``
says how many; the replicas start from rank 0's parameters (broadcast here); ``compression``
names a registry method (torchft's ``should_quantize`` is a bool); the outer step of one fragment
sees only that fragment's ``.grad`` (the others' inner gradients are set aside and put back).
"""
from __future__ import annotations

import torch

from .. import compression_methods
from ..outer_sync import OuterSync, split
from . import diloco_auto

__all__ = ["DiLoCo"]

# torchft's arguments taken no further here, and what replaces each.
_REFUSED = {
    "manager": "the replicas are the ranks of comm= (default the world, ddl_triton.init()); a lost host is "
               "handled by ddl_triton.torch.elastic with DiLoCo.state_dict()/load_state_dict()",
    "model_fragments": "pass the model; fragments=N splits its parameters into N groups balanced by bytes",
    "pin_memory": "the backups are CPU tensors that the communicator reads directly: nothing to pin",
    "use_bucketization": "each fragment is averaged as one flat buffer (one bucket) already",
    "bucket_cap_mb": "each fragment is averaged as one flat buffer (one bucket) already",
    "should_quantize": "compression= names a method of ddl_triton/compression_methods.py (None: full precision)",
}


class DiLoCo:
    """Outer-sync training of ``model`` (module doc): a context manager over ``inner_optimizer``.

    sync_every: inner steps between two syncs of a fragment (an int >= 1, a multiple of
    ``fragments``), or "auto" (the planner's choice, with ``max_sync_every``); fragments,
    fragment_sync_delay, fragment_update_alpha: torchft's; compression: None or a method name;
    replicas: "ranks" (every rank a replica) or "hosts" (the ranks of a host one replica, kept
    identical by DDP over ``host_group()``): ddl_triton/outer_sync/averaging.py; comm: the
    communicator of the replicas (default ``ddl_triton.init()``); backup_device: None or the CPU
    (the backups live on the host); init_sync: broadcast rank 0's parameters first (DDP's name and
    default; False under ``ddl_triton.torch.elastic``, whose first sync of a ``TorchState(diloco=...)``
    does it, and where a rank joining later must make no collective call of its own). Errors name
    the rank."""

    def __init__(self, model: torch.nn.Module, inner_optimizer, outer_optimizer, sync_every, *, fragments: int = 1,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0, compression: str | None = None,
                 replicas: str = "ranks", comm=None, backup_device=None, max_sync_every: int | None = None,
                 block: int = 256, error_feedback: bool = True, init_sync: bool = True, **torchft_only):
        if comm is None:
            import ddl_triton
            comm = ddl_triton.init()
        self.comm = comm
        rank = self.rank = comm.rank
        for name in torchft_only:
            why = _REFUSED.get(name)
            raise TypeError(f"rank {rank}: DiLoCo: " + (f"torchft's {name}= is not taken here: {why}" if why
                                                         else f"unexpected keyword argument {name!r}"))
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"rank {rank}: DiLoCo: model must be a torch.nn.Module, got {type(model).__name__}")
        if backup_device is not None and torch.device(backup_device).type != "cpu":
            raise ValueError(f"rank {rank}: DiLoCo: backup_device must be None or the CPU, got {backup_device!r}")
        if isinstance(fragment_update_alpha, bool) or not isinstance(fragment_update_alpha, (int, float)) \
                or not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(f"rank {rank}: DiLoCo: fragment_update_alpha must be in [0, 1], got "
                             f"{fragment_update_alpha!r}")
        auto = isinstance(sync_every, str) and sync_every == "auto"
        if auto and diloco_auto.planner() is None:
            raise ValueError(f"rank {rank}: DiLoCo: sync_every='auto' needs the outer-sync planner "
                             "(ddl_triton/planning/outer_sync.py), which this build does not have; pass an int")
        if auto and (isinstance(max_sync_every, bool) or not isinstance(max_sync_every, int) or max_sync_every < 1):
            raise ValueError(f"rank {rank}: DiLoCo: sync_every='auto' needs a bound, max_sync_every (an int >= 1: "
                             f"the largest H you accept), got {max_sync_every!r}")
        if isinstance(sync_every, str) and not auto:
            raise ValueError(f"rank {rank}: DiLoCo: sync_every must be an int >= 1 or 'auto', got {sync_every!r}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"rank {rank}: DiLoCo: the model has no parameters that require grad")
        for p in self.params:
            if not p.is_floating_point() or p.device.type != "cpu":
                raise ValueError(f"rank {rank}: DiLoCo: parameters must be floating-point CPU tensors, got one of "
                                 f"{p.dtype} on {p.device}")
        _check_optimizer(rank, "inner_optimizer", inner_optimizer, self.params, whole=False)
        _check_optimizer(rank, "outer_optimizer", outer_optimizer, self.params, whole=True)
        if inner_optimizer is outer_optimizer:
            raise ValueError(f"rank {rank}: DiLoCo: inner_optimizer and outer_optimizer must be two optimizers")
        if compression is not None and compression == compression_methods.AUTO:
            raise ValueError(f"rank {rank}: DiLoCo: compression='auto' is not taken: name a method or None")
        self.inner_optimizer, self.outer_optimizer = inner_optimizer, outer_optimizer
        self.fragment_update_alpha = float(fragment_update_alpha)
        self.max_sync_every = max_sync_every
        self._outer_args = dict(fragments=fragments, fragment_sync_delay=fragment_sync_delay, compression=compression,
                                replicas=replicas, block=block, error_feedback=error_feedback, who="DiLoCo")
        self._nbytes = [p.numel() * p.element_size() for p in self.params]
        self.core: OuterSync | None = None
        self.auto: diloco_auto.AutoSync | None = None
        self._step_offset = 0  # inner steps taken before the core began (sync_every="auto")
        self._hooks: list = []
        self._closed = False
        if init_sync:  # the replicas start alike: rank 0's parameters, bit for bit (DDP's init_sync)
            with torch.no_grad():
                for p in self.params:
                    comm.broadcast(p.data, root=0)
        if auto:  # the checks the core would make now, before the plan
            self.fragments = [[self.params[i] for i in g] for g in split(self._nbytes, fragments, rank)]
            self.auto = diloco_auto.AutoSync(comm, self.params, max_sync_every, compression, fragments, block,
                                             error_feedback)
        else:
            self._start_core(sync_every, fragment_sync_delay)

    @property
    def plan(self):
        """What ``sync_every="auto"`` chose (the planner's SyncPlan), or None (an int, or not yet)."""
        return self.auto.plan if self.auto is not None else None

    def _start_core(self, sync_every: int, fragment_sync_delay: int) -> None:
        args = dict(self._outer_args, fragment_sync_delay=fragment_sync_delay)
        self.core = OuterSync(self.comm, self._nbytes, sync_every=sync_every, **args)
        self.fragments = [[self.params[i] for i in g] for g in self.core.groups]
        for f in range(len(self.fragments)):
            self.core.set_backup(f, self._flat(f))

    # -- the context -----------------------------------------------------------------------------
    def __enter__(self) -> "DiLoCo":
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: DiLoCo: entered after close()")
        if self._hooks:
            raise RuntimeError(f"rank {self.rank}: DiLoCo: already entered (a DiLoCo is one context at a time)")
        self._hooks.append(self.inner_optimizer.register_step_post_hook(self._after_inner_step))
        if self.auto is not None:
            self._hooks.append(self.inner_optimizer.register_step_pre_hook(self._before_inner_step))
        return self

    def __exit__(self, *exc) -> bool:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return False  # exceptions propagate

    @property
    def step(self) -> int:
        """Inner steps counted so far."""
        return self._step_offset + self.core.step if self.core is not None else self.auto.steps

    @property
    def sync_every(self) -> int | None:
        """H: inner steps between two syncs of a fragment (None while "auto" measures, or per step)."""
        return self.core.schedule.sync_every if self.core is not None else None

    def close(self) -> None:
        """Remove the hooks, wait for averages in flight, close the groups made for them (idempotent)."""
        self.__exit__(None, None, None)
        if not self._closed:
            self._closed = True
            if self.core is not None:
                self.core.close()
            if self.auto is not None:
                self.auto.close()

    # -- state (elastic, checkpoints) ------------------------------------------------------------
    def follow(self, comm) -> None:
        """Average over ``comm`` from now on: an elastic job's new world (ddl_triton.torch.elastic calls it
        for a ``TorchState(..., diloco=this)``); averages in flight and residuals start again."""
        self.comm = comm
        self.rank = comm.rank
        if self.core is not None:
            self.core.follow(comm)
        if self.auto is not None:
            self.auto.follow(comm)

    def state_dict(self) -> dict:
        """{"outer_sync": the core's state (step, backups, residuals), "outer_optimizer": its state_dict}."""
        if self.core is None:
            raise RuntimeError(f"rank {self.rank}: DiLoCo: no outer state yet: sync_every='auto' has not chosen outer "
                               "sync (it measures, or chose per-step averaging)")
        return {"outer_sync": self.core.state_dict(), "outer_optimizer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state: dict, *, residuals: bool = True) -> None:
        """Take ``state_dict()``'s; averages in flight are dropped (redone at their apply step);
        ``residuals=False`` after a world change (docs/outer_sync.md, elastic)."""
        self.core.load_state_dict(state["outer_sync"], residuals=residuals)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])

    # -- the hook --------------------------------------------------------------------------------
    def _before_inner_step(self, _optimizer, _args, _kwargs) -> None:
        if self.core is None and self.auto.per_step:
            self.auto.before_inner_step()

    def _after_inner_step(self, _optimizer, _args, _kwargs) -> None:
        if self.core is None:
            plan = self.auto.after_inner_step()
            if plan is not None and plan.mode == "outer":  # the parameters are identical here: per-step so far
                f = self._outer_args["fragments"]
                h = max(f, plan.sync_every - plan.sync_every % f)  # a multiple of fragments (torchft's rule)
                delay = self._outer_args["fragment_sync_delay"] or (h // f - 1 if f > 1 else 0)
                self._step_offset = self.auto.steps
                self._outer_args["compression"] = None if plan.compression == compression_methods.NONE \
                    else plan.compression
                self._start_core(h, delay)
            return
        starting, applying = self.core.advance()
        if starting is not None:
            self.core.start(starting, self._flat(starting))
        if applying is not None:
            self._apply(applying)

    @torch.no_grad()
    def _apply(self, f: int) -> None:
        params = self.fragments[f]
        average = self.core.finish(f, self._flat(f))
        backup = self.core.backups[f]
        local = [p.detach().clone() for p in params] if self.fragment_update_alpha else None
        synced = {id(p) for p in params}
        others = [(p, p.grad) for p in self.params if id(p) not in synced]
        for p, _ in others:  # the outer step sees this fragment's pseudo-gradient only
            p.grad = None
        o = 0
        for p in params:
            n = p.numel()
            p.copy_(backup[o: o + n].view_as(p))
            p.grad = average[o: o + n].view_as(p).to(p.dtype, copy=True)
            o += n
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad()
        self.core.set_backup(f, self._flat(f))
        if local is not None:
            for p, mine in zip(params, local):
                p.lerp_(mine, self.fragment_update_alpha)
        for p, g in others:
            p.grad = g

    def _flat(self, f: int) -> torch.Tensor:
        params = self.fragments[f]
        dtypes = {p.dtype for p in params}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        return torch.cat([p.detach().reshape(-1).to(dtype) for p in params])


def _check_optimizer(rank: int, what: str, optimizer, params: list, whole: bool) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"rank {rank}: DiLoCo: {what} must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    mine = {id(p) for p in params}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    stray = [p for p in held if id(p) not in mine]
    if stray:
        raise ValueError(f"rank {rank}: DiLoCo: {what} holds {len(stray)} tensor(s) that are not the model's "
                         "parameters (build it over model.parameters())")
    if not held or (whole and {id(p) for p in held} != mine):
        raise ValueError(f"rank {rank}: DiLoCo: {what} must be over " + ("every one of the model's parameters"
                         if whole else "the model's parameters") + f" ({len(mine)}), it holds {len(held)}")
