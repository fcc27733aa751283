"""``JaxState``: the elastic state of a JAX job, pytrees of arrays and counters (Horovod's
``hvd.elastic.State`` for JAX; Horovod has no JAX room, so the names follow its TorchState).

Semantics: ``JaxState(params=params, opt_state=opt_state, step=0)``: each keyword becomes an
attribute. An int or a float is a counter (``state.step += 1``); anything else is a pytree whose
leaves are arrays (JAX or NumPy), replaced by the training loop (``state.params = new_params``).
The floor's rules hold (ddl_triton/elastic/state.py): ``commit()`` keeps the current pytrees (JAX
arrays are immutable: the commit holds them, NumPy leaves are copied) and admits joiners;
``restore()`` puts the committed pytrees and counters back; ``sync`` gives every rank the state of
the rank with the fewest commits, bit for bit: each leaf's raw bytes in one broadcast, and a JSON
manifest naming each pytree's leaves (key path, dtype, shape), which every rank checks against its
own pytrees (every rank builds the same ones; the structure itself never crosses the network).
A received leaf lands where this rank's leaf was (its sharding), as a new JAX array.
"""
from __future__ import annotations

import jax
import numpy as np
import torch

from ...elastic.state import State
from ...errors import DDLError

_COUNTER_TYPES = (int, float)


class JaxState(State):
    """Pytrees of arrays and counters, as keyword arguments (module doc)."""

    def __init__(self, **pytrees_and_counters):
        if not pytrees_and_counters:
            raise ValueError("elastic.JaxState: nothing to keep: give pytrees (params=...) or counters (step=0)")
        counters, trees = {}, {}
        for name, value in pytrees_and_counters.items():
            if hasattr(JaxState, name) or name.startswith("_") or name == "commits":
                raise ValueError(f"elastic.JaxState: name {name!r} is reserved")
            if isinstance(value, _COUNTER_TYPES) and not isinstance(value, bool):
                counters[name] = value
            else:
                _leaves(value, name)  # refuses a pytree of anything but arrays
                trees[name] = value
        super().__init__(**counters)
        self._tree_names = tuple(trees)
        for name, value in trees.items():
            setattr(self, name, value)

    def commit(self) -> None:
        """The floor's commit (module doc), once every collective dispatched so far has run: a jitted
        step returns before its ordered collectives are done, and the commit's own collective (the
        joiners' flag) must come after them on every rank, as the program order says."""
        jax.effects_barrier()
        super().commit()

    # -- what the floor's State asks of a JAX state ---------------------------------------------------
    def _save_extra(self, saved: dict) -> None:
        saved["pytrees"] = {n: jax.tree_util.tree_map(_kept, getattr(self, n)) for n in self._tree_names}

    def _restore_extra(self, saved: dict) -> None:
        for name, tree in saved["pytrees"].items():
            setattr(self, name, jax.tree_util.tree_map(_kept, tree))

    def _packed(self) -> tuple[list[torch.Tensor], dict]:
        manifest = self._manifest()
        tensors, listed = [], []
        for name in self._tree_names:
            leaves = _leaves(getattr(self, name), name)
            listed.append([name, [[path, np.dtype(leaf.dtype).name, list(leaf.shape)] for path, leaf in leaves]])
            tensors.extend(torch.from_numpy(_bytes_of(leaf)) for _, leaf in leaves)
        manifest["pytrees"] = listed
        manifest["nbytes"] = sum(t.numel() for t in tensors)
        return tensors, manifest

    def _receiving(self, manifest: dict, rank: int, source: int) -> list[torch.Tensor]:
        listed = manifest.get("pytrees")
        if not isinstance(listed, list) or [e[0] for e in listed] != list(self._tree_names):
            theirs = [e[0] for e in listed] if isinstance(listed, list) else "none"
            raise DDLError(f"rank {rank}: elastic: this rank's JaxState holds pytrees {list(self._tree_names)}, "
                           f"rank {source}'s {theirs}: every rank must build the same state")
        out = []
        for (name, leaves_there) in listed:
            own = _leaves(getattr(self, name), name)
            mine = [[p, np.dtype(x.dtype).name, list(x.shape)] for p, x in own]
            if mine != leaves_there:
                first = next((m, t) for m, t in zip(mine + [None] * len(leaves_there), leaves_there + [None] *
                                                    len(mine)) if m != t)
                raise DDLError(f"rank {rank}: elastic: pytree {name!r} differs from rank {source}'s: leaf "
                               f"{_said(first[0])} here, {_said(first[1])} there: every rank must build the same "
                               "state")
            out.extend(torch.empty(_nbytes(x), dtype=torch.uint8) for _, x in own)
        return out

    def _load(self, manifest: dict, tensors: list[torch.Tensor]) -> None:
        received = iter(tensors)
        for name in self._tree_names:
            tree = getattr(self, name)
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            new = [_leaf_from(next(received).numpy(), leaf) for leaf in leaves]
            setattr(self, name, jax.tree_util.tree_unflatten(treedef, new))
        super()._load(manifest, tensors)


def _leaves(tree, name: str) -> list[tuple[str, object]]:
    """``(key path, leaf)`` of every leaf of ``tree``; refuses a leaf that is not an array."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not (hasattr(leaf, "dtype") and hasattr(leaf, "shape")):
            raise TypeError(f"elastic.JaxState: {name}{jax.tree_util.keystr(path)} is a {type(leaf).__name__}: "
                            "a pytree's leaves must be arrays (JAX or NumPy); give a number as its own counter")
        out.append((jax.tree_util.keystr(path), leaf))
    return out


def _kept(leaf):
    """A leaf as a commit holds it: a JAX array itself (immutable), a NumPy array copied."""
    return leaf if isinstance(leaf, jax.Array) else np.array(leaf, copy=True)


def _bytes_of(leaf) -> np.ndarray:
    """The leaf's raw bytes, a fresh writable uint8 vector (torch views it)."""
    return np.array(np.ascontiguousarray(np.asarray(leaf)).reshape(-1).view(np.uint8), copy=True)


def _nbytes(leaf) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def _leaf_from(raw: np.ndarray, like):
    """The received bytes as a leaf of ``like``'s kind, dtype and shape (a JAX array where ``like`` was)."""
    value = raw.view(np.asarray(like).dtype).reshape(like.shape)
    if isinstance(like, jax.Array):
        return jax.device_put(np.array(value, copy=True), like.sharding)
    return np.array(value, copy=True)


def _said(entry) -> str:
    return "(none)" if entry is None else f"{entry[0]} {entry[1]}{entry[2]}"
