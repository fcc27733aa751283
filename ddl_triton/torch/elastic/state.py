"""``TorchState``: what an elastic job keeps in memory so that a failed step can be undone, and how
every rank of a new world is made to hold the same state.

Semantics (Horovod's ``hvd.elastic.TorchState``):
- ``commit()`` saves the model's and optimizer's state, the counters and the DDP comm hooks'
  error-feedback residuals (a copy in memory), then admits waiting joiners (a new host: the world
  grows at this step boundary). Commit after every step for step-atomic training: a failure then
  undoes at most the step in flight.
- ``restore()`` puts the last commit back (on a failure, before the world is re-formed).
- ``sync(comm)``: every rank takes the state of the rank with the *fewest* commits (the lowest
  rank among them), broadcast bit for bit: a step that did not commit everywhere is undone
  everywhere and redone, never applied twice, and a joiner gets the whole state. The counters come
  with it, so the training loop resumes where that state was taken. Only a member of the previous
  world can be that source: the ranks that just joined are named by the agreed decision, not by
  what they say, so a joiner that saved a state of its own before asking to join (or claims any
  number of commits) is never a source.
- Error-feedback residuals (ddl_triton.torch.hooks): each rank keeps its own, rolled back to the
  commit the world resumes from (its last, or the one before when the source had not committed
  the last step); they are not sent (they are this rank's own compression error); a joiner starts
  from zero, and the lost ranks' residuals are dropped with them. (The 1-bit and per-level hooks'
  residuals, sized by the world, start again from zero when its size changes: hooks.py.)

What crosses the network is raw tensor bytes and a JSON manifest (names, dtypes, shapes, the
optimizer's hyper-parameters): nothing is unpickled.
"""
from __future__ import annotations

import copy
import json
import time

import torch

from ...errors import DDLError

_COUNTER_TYPES = (int, float)


class TorchState:
    """The state of an elastic training job: ``model`` (an ``nn.Module`` or its DDP wrapper),
    ``optimizer`` (a ``torch.optim.Optimizer`` or None) and counters, each a keyword argument that
    becomes an attribute (``TorchState(model, opt, epoch=0, batch=0)``; ``state.epoch += 1``)."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **counters):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"elastic.TorchState: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"elastic.TorchState: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if model is None and optimizer is None and not counters:
            raise ValueError("elastic.TorchState: nothing to keep: give a model, an optimizer or counters")
        for name, value in counters.items():
            if name.startswith("_") or name in ("model", "optimizer", "commits"):
                raise ValueError(f"elastic.TorchState: counter name {name!r} is reserved")
            if not isinstance(value, _COUNTER_TYPES) or isinstance(value, bool):
                raise TypeError(f"elastic.TorchState: counter {name}={value!r} must be an int or a float")
        if model is not None and optimizer is not None:
            owned = {id(p) for p in model.parameters()}
            if not any(id(p) in owned for g in optimizer.param_groups for p in g["params"]):
                raise ValueError("elastic.TorchState: the optimizer updates none of the model's parameters "
                                 "(give the optimizer made from this model's parameters)")
        self.model = model
        self.optimizer = optimizer
        self._counter_names = tuple(counters)
        for name, value in counters.items():
            setattr(self, name, value)
        self.commits = 0          # how many commits this rank's current state has seen
        self._saved: dict | None = None
        self._reset_callbacks: list = []
        self._world = None        # set by elastic.run: the job's ElasticWorld

    # -- the user's calls -------------------------------------------------------------------------
    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called (no arguments) after every change of the world, once the state is
        synchronized: re-shard the data for ``elastic.rank()`` of ``elastic.size()`` there."""
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"elastic.TorchState.register_reset_callbacks: {cb!r} is not callable")
        self._reset_callbacks.extend(callbacks)

    def commit(self) -> None:
        """Save the state in memory, then admit waiting joiners (the world may grow here: the call
        then does not return; ``elastic.run`` re-forms the world and calls the function again)."""
        self.commits += 1
        self.save()
        if self._world is not None:
            self._world.admit_joiners()

    def save(self) -> None:
        """Copy the current state aside (``restore`` brings it back); no communication."""
        module = _module(self.model)
        saved = self._saved or {}
        saved["model"] = _copy_into(saved.get("model"), module.state_dict()) if module is not None else None
        if self.optimizer is not None:
            saved["optimizer"] = _optimizer_copy(self.optimizer.state_dict())
        saved["counters"] = {n: getattr(self, n) for n in self._counter_names}
        saved["commits"] = self.commits
        # The commit before too: ranks are at most one commit apart (a commit follows a collective
        # every rank took part in), and a rank synced back to the previous one takes its residuals.
        saved["residuals_before"] = saved.get("residuals", [])
        saved["residuals"] = [h.residuals_snapshot() for h in _hook_states(self.model)]
        self._saved = saved

    def restore(self) -> None:
        """Put the last saved state back (the model's parameters and buffers in place)."""
        if self._saved is None:
            raise DDLError("elastic.TorchState.restore: nothing was saved yet")
        saved = self._saved
        module = _module(self.model)
        if module is not None:
            with torch.no_grad():
                module.load_state_dict(saved["model"])
            module.zero_grad(set_to_none=True)  # a failed backward's partial gradients
        if self.optimizer is not None:
            self.optimizer.load_state_dict(_optimizer_copy(saved["optimizer"]))  # a copy: loading aliases tensors
        for name, value in saved["counters"].items():
            setattr(self, name, value)
        self.commits = saved["commits"]
        for hooks, snapshot in zip(_hook_states(self.model), saved["residuals"]):
            hooks.load_residuals(snapshot)

    def sync(self, comm, manifest_key: str, store, joined: frozenset[int] = frozenset()) -> int:
        """Make every rank of ``comm`` hold the state of the rank with the fewest commits among the
        ranks not in ``joined`` (see the module doc); returns that rank. Collective over ``comm``.
        ``store`` and ``manifest_key`` carry the source's JSON manifest (shapes and hyper-parameters
        a joiner cannot know). ``joined``: the ranks admitted by this change of the world."""
        commits = torch.zeros(comm.size, dtype=torch.int64)
        mine = self.commits if self._saved is not None and comm.rank not in joined else -1
        comm.all_gather(commits, torch.tensor([mine]))
        # Every rank knows from the decision which ranks joined: what those send is not read.
        known = [(int(c), r) for r, c in enumerate(commits.tolist()) if c >= 0 and r not in joined]
        if not known:
            raise DDLError(f"rank {comm.rank}: elastic: no rank of the new world holds a state (every one is a "
                           "joiner)")
        source_commits, source = min(known)
        if self._saved is not None and self.commits == source_commits + 1:
            # This rank committed a step the source did not: the step is redone, so this rank's own
            # error feedback goes back one commit too (the module doc's rule for residuals).
            for hooks, snapshot in zip(_hook_states(self.model), self._saved["residuals_before"]):
                hooks.load_residuals(snapshot)
        if comm.rank == source:
            tensors, manifest = self._packed()
            store.set(manifest_key, json.dumps(manifest))
        else:
            manifest = _read_manifest(store, manifest_key, comm.options.timeout, comm.rank, source)
            tensors = self._receiving(manifest, comm.rank, source)
        words = torch.empty((manifest["nbytes"] + 3) // 4, dtype=torch.int32)  # the bytes, as a dtype ddl moves
        flat = words.view(torch.uint8)
        if comm.rank == source:
            _pack(tensors, flat)
        comm.broadcast(words, root=source)
        if comm.rank != source:
            _unpack(flat, tensors)
            self._load(manifest, tensors)
        self.save()
        return source

    def reset(self) -> None:
        """Run the reset callbacks (after a world change)."""
        for cb in self._reset_callbacks:
            cb()

    # -- the manifest and the bytes ------------------------------------------------------------------
    def _packed(self) -> tuple[list[torch.Tensor], dict]:
        """This rank's tensors in manifest order, and the manifest."""
        module = _module(self.model)
        model = module.state_dict() if module is not None else {}
        names, tensors = list(model), [model[n].detach() for n in model]
        manifest: dict = {"counters": {n: getattr(self, n) for n in self._counter_names}, "commits": self.commits,
                          "model": [[n, str(t.dtype), list(t.shape)] for n, t in zip(names, tensors)]}
        if self.optimizer is not None:
            sd = self.optimizer.state_dict()
            entries = []
            for index, slots in sd["state"].items():
                for key, value in slots.items():
                    if isinstance(value, torch.Tensor):
                        entries.append([int(index), key, str(value.dtype), list(value.shape)])
                        tensors.append(value.detach())
                    else:
                        entries.append([int(index), key, "value", _json_value(value, f"optimizer state {key}")])
            manifest["optimizer"] = {"state": entries,
                                     "param_groups": _json_value(sd["param_groups"], "optimizer param_groups")}
        manifest["nbytes"] = sum(t.numel() * t.element_size() for t in tensors)
        return tensors, manifest

    def _receiving(self, manifest: dict, rank: int, source: int) -> list[torch.Tensor]:
        """Empty tensors for the source's, checked against this rank's own model."""
        module = _module(self.model)
        mine = module.state_dict() if module is not None else {}
        listed = manifest.get("model", [])
        if [e[0] for e in listed] != list(mine):
            raise DDLError(f"rank {rank}: elastic: this rank's model has other parameters than rank {source}'s "
                           f"({len(mine)} tensors against {len(listed)}): every rank must build the same model")
        out = []
        for name, dtype, shape in listed:
            if str(mine[name].dtype) != dtype or list(mine[name].shape) != shape:
                raise DDLError(f"rank {rank}: elastic: {name} is {mine[name].dtype}{list(mine[name].shape)} here, "
                               f"{dtype}{shape} on rank {source}: every rank must build the same model")
            out.append(torch.empty(shape, dtype=mine[name].dtype))
        for entry in manifest.get("optimizer", {}).get("state", []):
            if entry[2] != "value":
                out.append(torch.empty(entry[3], dtype=_dtype(entry[2], rank)))
        return out

    def _load(self, manifest: dict, tensors: list[torch.Tensor]) -> None:
        module = _module(self.model)
        listed = manifest.get("model", [])
        if module is not None:
            with torch.no_grad():
                module.load_state_dict({e[0]: t for e, t in zip(listed, tensors)})
        rest = iter(tensors[len(listed):])
        if self.optimizer is not None:
            if "optimizer" not in manifest:
                raise DDLError("elastic: the source rank has no optimizer state and this rank has an optimizer")
            state: dict = {}
            for index, key, kind, value in manifest["optimizer"]["state"]:
                state.setdefault(index, {})[key] = next(rest) if kind != "value" else value
            self.optimizer.load_state_dict({"state": state, "param_groups": manifest["optimizer"]["param_groups"]})
        for name in self._counter_names:
            if name in manifest["counters"]:
                setattr(self, name, manifest["counters"][name])
        self.commits = int(manifest["commits"])


def _module(model):
    """The module whose state is kept: a DDP wrapper's inner module (its state_dict has no prefix)."""
    return getattr(model, "module", model) if model is not None else None


def _hook_states(model) -> list:
    from ..hooks import HookState
    return [s for _, s in getattr(model, "_comm_hooks", []) if isinstance(s, HookState)]


def _copy_into(held: dict | None, current: dict) -> dict:
    """``current``'s tensors copied (into ``held``'s when the shapes still match: no allocation)."""
    out = {}
    with torch.no_grad():
        for name, t in current.items():
            old = None if held is None else held.get(name)
            if old is not None and old.shape == t.shape and old.dtype == t.dtype:
                out[name] = old.copy_(t)
            else:
                out[name] = t.detach().clone()
    return out


def _optimizer_copy(sd: dict) -> dict:
    """A copy of an optimizer state dict whose tensors share nothing with the optimizer's."""
    return {"state": {k: {n: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                          for n, v in slots.items()} for k, slots in sd["state"].items()},
            "param_groups": copy.deepcopy(sd["param_groups"])}


def _json_value(value, what: str):
    """``value`` as JSON-able data (tuples become lists); refuses what JSON cannot say exactly."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v, what) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_value(v, f"{what}.{k}") for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise DDLError(f"elastic: {what} holds a {type(value).__name__}, which cannot be sent to a new rank "
                   "(only numbers, strings, lists and tensors are)")


def _dtype(name: str, rank: int) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DDLError(f"rank {rank}: elastic: the state manifest names an unknown dtype {name!r:.40}")
    return dtype


def _read_manifest(store, key: str, timeout: float, rank: int, source: int) -> dict:
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise DDLError(f"rank {rank}: elastic: rank {source} did not publish its state within {timeout:g} s")
        time.sleep(0.005)
    try:
        manifest = json.loads(store.get(key).decode())
    except (UnicodeDecodeError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("nbytes"), int) or manifest["nbytes"] < 0:
        raise DDLError(f"rank {rank}: elastic: rank {source}'s state manifest is malformed")
    return manifest


def _pack(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    at = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        flat[at:at + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        at += n


def _unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    at = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        t.reshape(-1).view(torch.uint8).copy_(flat[at:at + n])
        at += n
