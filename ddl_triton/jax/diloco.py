"""``DiLoCo``: outer-sync training (DiLoCo, Streaming DiLoCo) for JAX, with an optax outer optimizer.

    import optax, ddl_triton.jax as ddj
    outer = ddj.DiLoCo(params, optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=100)
    params = outer.params                              # rank 0's parameters, on every rank
    for batch in batches:
        params, opt_state = inner_step(params, opt_state, batch)    # this replica's own step (jit)
        params = outer.step(params)                    # counts the inner step; syncs when due

The same core as torch's ``ddl_triton.torch.DiLoCo`` (ddl_triton/outer_sync/: the fragment split, torchft's
staggered schedule, the pseudo-gradient average over the replicas, fp32 or a registry method with
per-fragment error feedback, the backups and the step); JAX has no optimizer hooks, so the inner
step is counted by ``step(params)``, which takes the parameters after each inner update and returns
the parameters to continue from (the same pytree structure). When a fragment applies, its leaves
are reset to the backup (the last global parameters), the averaged pseudo-gradient (backup minus
local) is the outer optimizer's gradient, ``optax.apply_updates`` makes the new global leaves, which
become the backup, and with ``fragment_update_alpha`` = a the leaves are global + a (local - global)
(torchft's lerp; a = 0 keeps the global leaves, the same bits on every rank).

The outer optimizer's state is held per fragment (``outer_optimizer.init`` of that fragment's leaves,
as a list), as torchft does with a list of outer optimizers: an elementwise optimizer (SGD, Nesterov,
Adam) steps alike either way. Leaves are float16/32/64 arrays (the averages run on host buffers);
``state_dict()``/``load_state_dict`` hold the core's state and the optax states.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import world
from ..outer_sync import OuterSync

__all__ = ["DiLoCo"]

_FLOATS = ("float16", "float32", "float64")


class DiLoCo:
    """Outer sync of the pytree ``params`` (module doc). ``outer_optimizer``: an optax
    GradientTransformation; sync_every, fragments, fragment_sync_delay, fragment_update_alpha:
    torchft's (ddl_triton/outer_sync/schedule.py); compression: None or a method of
    ddl_triton/compression_methods.py; replicas: "ranks" or "hosts" (ddl_triton/outer_sync/averaging.py);
    comm: default the world. Errors name the rank."""

    def __init__(self, params, outer_optimizer, sync_every: int, *, fragments: int = 1, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0, compression: str | None = None, replicas: str = "ranks",
                 comm=None, block: int = 256, error_feedback: bool = True):
        comm = self.comm = world.resolve(comm)
        rank = comm.rank
        if not (hasattr(outer_optimizer, "init") and hasattr(outer_optimizer, "update")):
            raise TypeError(f"rank {rank}: ddl_triton.jax.DiLoCo: outer_optimizer must be an optax "
                            f"GradientTransformation, got {type(outer_optimizer).__name__}")
        if sync_every == "auto":
            raise ValueError(f"rank {rank}: ddl_triton.jax.DiLoCo: sync_every='auto' is torch's only for now; "
                             "pass an int")
        if isinstance(fragment_update_alpha, bool) or not isinstance(fragment_update_alpha, (int, float)) \
                or not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(f"rank {rank}: ddl_triton.jax.DiLoCo: fragment_update_alpha must be in [0, 1], got "
                             f"{fragment_update_alpha!r}")
        leaves, self._treedef = jax.tree_util.tree_flatten(params)
        if not leaves:
            raise ValueError(f"rank {rank}: ddl_triton.jax.DiLoCo: params has no leaves")
        for leaf in leaves:
            if np.dtype(leaf.dtype).name not in _FLOATS:
                raise ValueError(f"rank {rank}: ddl_triton.jax.DiLoCo: leaves must be float16/32/64 arrays, got "
                                 f"one of {leaf.dtype}")
        self._shapes = [tuple(leaf.shape) for leaf in leaves]
        self._dtypes = [np.dtype(leaf.dtype) for leaf in leaves]
        self.outer_optimizer = outer_optimizer
        self.fragment_update_alpha = float(fragment_update_alpha)
        self.core = OuterSync(comm, [int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in
                                     zip(self._shapes, self._dtypes)],
                              sync_every=sync_every, fragments=fragments, fragment_sync_delay=fragment_sync_delay,
                              compression=compression, replicas=replicas, block=block, error_feedback=error_feedback,
                              who="ddl_triton.jax.DiLoCo")
        leaves = list(leaves)
        for f, group in enumerate(self.core.groups):  # the replicas start alike: rank 0's leaves, bit for bit
            flat = self._flat(leaves, f)
            comm.broadcast(flat, root=0)
            self._put(leaves, f, flat)
            self.core.set_backup(f, flat)
        self.opt_states = [outer_optimizer.init([leaves[i] for i in group]) for group in self.core.groups]
        self.params = jax.tree_util.tree_unflatten(self._treedef, leaves)

    @property
    def step_count(self) -> int:
        """Inner steps counted so far."""
        return self.core.step

    def step(self, params):
        """Count one inner step taken to ``params``; start and apply the syncs it makes due (module
        doc). Returns the parameters to continue from."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if treedef != self._treedef:
            raise ValueError(f"rank {self.comm.rank}: ddl_triton.jax.DiLoCo.step: params has another structure "
                             f"than the one DiLoCo was made with ({treedef} vs {self._treedef})")
        starting, applying = self.core.advance()
        if starting is not None:
            self.core.start(starting, self._flat(leaves, starting))
        if applying is None:
            return params
        leaves = list(leaves)
        self._apply(leaves, applying)
        self.params = jax.tree_util.tree_unflatten(self._treedef, leaves)
        return self.params

    def state_dict(self) -> dict:
        """{"outer_sync": the core's state (step, backups, residuals), "outer_optimizer": the optax
        states, one per fragment}."""
        return {"outer_sync": self.core.state_dict(), "outer_optimizer": list(self.opt_states)}

    def load_state_dict(self, state: dict, *, residuals: bool = True) -> None:
        """Take ``state_dict()``'s (``residuals=False`` after a world change)."""
        self.core.load_state_dict(state["outer_sync"], residuals=residuals)
        self.opt_states = list(state["outer_optimizer"])

    def close(self) -> None:
        """Wait for averages in flight and close the groups made for them (idempotent)."""
        self.core.close()

    # -- private ---------------------------------------------------------------------------------
    def _apply(self, leaves: list, f: int) -> None:
        group = self.core.groups[f]
        average = self.core.finish(f, self._flat(leaves, f))
        local = [leaves[i] for i in group]
        global_leaves = self._split(self.core.backups[f], f)
        grads = self._split(average, f)
        updates, self.opt_states[f] = self.outer_optimizer.update(grads, self.opt_states[f], global_leaves)
        new = optax.apply_updates(global_leaves, updates)
        self.core.set_backup(f, self._flat(new, None))
        a = self.fragment_update_alpha
        for k, i in enumerate(group):
            leaves[i] = new[k] if not a else new[k] + a * (local[k] - new[k])

    def _dtype(self, f: int) -> np.dtype:
        kinds = {self._dtypes[i] for i in self.core.groups[f]}
        return kinds.pop() if len(kinds) == 1 else np.dtype(np.float32)

    def _flat(self, leaves: list, f: int | None) -> np.ndarray:
        """The fragment's leaves (all of ``leaves`` when ``f`` is None) as one writable flat array."""
        picked = leaves if f is None else [leaves[i] for i in self.core.groups[f]]
        dtype = np.result_type(*[np.dtype(x.dtype) for x in picked]) if f is None else self._dtype(f)
        return np.concatenate([np.asarray(x, dtype=dtype).reshape(-1) for x in picked])

    def _split(self, flat, f: int) -> list:
        out, o = [], 0
        data = np.asarray(flat)  # a torch CPU tensor (the core's backups) or a NumPy array
        for i in self.core.groups[f]:
            n = int(np.prod(self._shapes[i], dtype=np.int64))
            out.append(jnp.asarray(data[o: o + n].reshape(self._shapes[i]), dtype=self._dtypes[i]))
            o += n
        return out

    def _put(self, leaves: list, f: int, flat: np.ndarray) -> None:
        for i, leaf in zip(self.core.groups[f], self._split(flat, f)):
            leaves[i] = leaf
