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
- ``diloco=`` (a ``ddl_triton.torch.DiLoCo``): its backups (the last global parameters), inner step
  counter and outer optimizer state are saved, restored and synced with the model, so an outer
  step a lost rank interrupted is undone everywhere and redone on the survivors (an average in
  flight is dropped and redone at its apply step); its error-feedback residuals start again from
  zero after every restore or sync (they were made in, and sized by, the old world); after a
  world change it averages over the new world (``DiLoCo.follow``).
- Error-feedback residuals (ddl_triton.torch.hooks): each rank keeps its own, rolled back to the
  commit the world resumes from (its last, or the one before when the source had not committed
  the last step); they are not sent (they are this rank's own compression error); a joiner starts
  from zero, and the lost ranks' residuals are dropped with them. (The 1-bit and per-level hooks'
  residuals, sized by the world, start again from zero when its size changes: hooks.py.)

What crosses the network is raw tensor bytes and a JSON manifest (names, dtypes, shapes, the
optimizer's hyper-parameters): nothing is unpickled. The counters, the commits, the choice of the
source and the byte transfer are the elastic floor's (ddl_triton/elastic/state.py); this module says
what a torch model and optimizer add to them.
"""
from __future__ import annotations

import copy

import torch

from ...elastic.state import State, _pack, _unpack  # noqa: F401 - _pack, _unpack: this module's names before
from ...errors import DDLError


class TorchState(State):
    """The state of an elastic training job: ``model`` (an ``nn.Module`` or its DDP wrapper),
    ``optimizer`` (a ``torch.optim.Optimizer`` or None) and counters, each a keyword argument that
    becomes an attribute (``TorchState(model, opt, epoch=0, batch=0)``; ``state.epoch += 1``)."""

    _reserved = ("model", "optimizer", "diloco")

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 diloco=None, **counters):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"elastic.TorchState: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"elastic.TorchState: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if model is None and optimizer is None and not counters:
            raise ValueError("elastic.TorchState: nothing to keep: give a model, an optimizer or counters")
        super().__init__(**counters)
        if model is not None and optimizer is not None:
            owned = {id(p) for p in model.parameters()}
            if not any(id(p) in owned for g in optimizer.param_groups for p in g["params"]):
                raise ValueError("elastic.TorchState: the optimizer updates none of the model's parameters "
                                 "(give the optimizer made from this model's parameters)")
        if diloco is not None and not hasattr(diloco, "core"):
            raise TypeError(f"elastic.TorchState: diloco must be a ddl_triton.torch.DiLoCo, got "
                            f"{type(diloco).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.diloco = diloco

    # -- what the floor's State asks of a torch state ----------------------------------------------
    def _check_runnable(self) -> None:
        """``elastic.run``'s refusal of a model trained without its optimizer in the state."""
        if self.optimizer is None and self.model is not None and any(p.requires_grad for p in self.model.parameters()):
            raise ValueError("elastic.run: the state has a model but no optimizer: pass TorchState(model, "
                             "optimizer), or a rolled-back step would leave the optimizer's state ahead")

    def _save_extra(self, saved: dict) -> None:
        module = _module(self.model)
        saved["model"] = _copy_into(saved.get("model"), module.state_dict()) if module is not None else None
        if self.optimizer is not None:
            saved["optimizer"] = _optimizer_copy(self.optimizer.state_dict())
        # The commit before too: ranks are at most one commit apart (a commit follows a collective
        # every rank took part in), and a rank synced back to the previous one takes its residuals.
        saved["residuals_before"] = saved.get("residuals", [])
        saved["residuals"] = [h.residuals_snapshot() for h in _hook_states(self.model)]
        if _outer(self.diloco):  # the backups, the step, the outer optimizer (its residuals: module doc)
            saved["diloco"] = self.diloco.state_dict()
            saved["diloco"]["outer_optimizer"] = _optimizer_copy(saved["diloco"]["outer_optimizer"])

    def _restore_extra(self, saved: dict) -> None:
        """The model's parameters and buffers in place, the optimizer's state, the hooks' residuals."""
        module = _module(self.model)
        if module is not None:
            with torch.no_grad():
                module.load_state_dict(saved["model"])
            module.zero_grad(set_to_none=True)  # a failed backward's partial gradients
        if self.optimizer is not None:
            self.optimizer.load_state_dict(_optimizer_copy(saved["optimizer"]))  # a copy: loading aliases tensors
        for hooks, snapshot in zip(_hook_states(self.model), saved["residuals"]):
            hooks.load_residuals(snapshot)
        if _outer(self.diloco) and saved.get("diloco") is not None:
            held = saved["diloco"]
            self.diloco.load_state_dict({"outer_sync": held["outer_sync"],
                                         "outer_optimizer": _optimizer_copy(held["outer_optimizer"])}, residuals=False)

    def _one_commit_back(self) -> None:
        # The step is redone, so this rank's own error feedback goes back one commit too (the
        # module doc's rule for residuals).
        for hooks, snapshot in zip(_hook_states(self.model), self._saved["residuals_before"]):
            hooks.load_residuals(snapshot)

    # -- the manifest and the bytes ------------------------------------------------------------------
    def _packed(self) -> tuple[list[torch.Tensor], dict]:
        """This rank's tensors in manifest order, and the manifest."""
        module = _module(self.model)
        model = module.state_dict() if module is not None else {}
        names, tensors = list(model), [model[n].detach() for n in model]
        manifest = self._manifest()
        manifest["model"] = [[n, str(t.dtype), list(t.shape)] for n, t in zip(names, tensors)]
        if self.optimizer is not None:
            manifest["optimizer"] = _optimizer_manifest(self.optimizer.state_dict(), tensors)
        if _outer(self.diloco):
            core = self.diloco.core.state_dict()
            tensors.extend(core["backups"])
            manifest["diloco"] = {"step": core["step"], "backups": [[str(b.dtype), list(b.shape)] for b in
                                                                    core["backups"]],
                                  "outer_optimizer": _optimizer_manifest(self.diloco.outer_optimizer.state_dict(),
                                                                         tensors)}
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
        if _outer(self.diloco):
            theirs = manifest.get("diloco")
            mine = [[str(b.dtype), list(b.shape)] for b in self.diloco.core.backups]
            if theirs is None or theirs["backups"] != mine:
                raise DDLError(f"rank {rank}: elastic: this rank's DiLoCo has other fragments than rank {source}'s: "
                               "every rank must build the same DiLoCo")
            out.extend(torch.empty(shape, dtype=_dtype(dtype, rank)) for dtype, shape in theirs["backups"])
            for entry in theirs["outer_optimizer"]["state"]:
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
            self.optimizer.load_state_dict(_optimizer_from(manifest["optimizer"], rest))
        if _outer(self.diloco):  # the source's backups, step and outer optimizer; residuals from zero
            theirs = manifest["diloco"]
            core = self.diloco.core.state_dict()
            core["step"], core["backups"] = int(theirs["step"]), [next(rest) for _ in theirs["backups"]]
            self.diloco.load_state_dict({"outer_sync": core, "outer_optimizer": _optimizer_from(
                theirs["outer_optimizer"], rest)}, residuals=False)
        super()._load(manifest, tensors)


def _optimizer_manifest(sd: dict, tensors: list) -> dict:
    """An optimizer state dict's manifest entry; its tensors appended to ``tensors`` in entry order."""
    entries = []
    for index, slots in sd["state"].items():
        for key, value in slots.items():
            if isinstance(value, torch.Tensor):
                entries.append([int(index), key, str(value.dtype), list(value.shape)])
                tensors.append(value.detach())
            else:
                entries.append([int(index), key, "value", _json_value(value, f"optimizer state {key}")])
    return {"state": entries, "param_groups": _json_value(sd["param_groups"], "optimizer param_groups")}


def _optimizer_from(entry: dict, rest) -> dict:
    """The optimizer state dict of a manifest entry, its tensors taken from the iterator ``rest``."""
    state: dict = {}
    for index, key, kind, value in entry["state"]:
        state.setdefault(index, {})[key] = next(rest) if kind != "value" else value
    return {"state": state, "param_groups": entry["param_groups"]}


def _outer(diloco) -> bool:
    """Whether ``diloco`` holds outer state (a DiLoCo whose sync_every="auto" is still measuring, or chose
    per-step averaging, holds none: the model and the inner optimizer are the whole state then)."""
    return diloco is not None and diloco.core is not None


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
