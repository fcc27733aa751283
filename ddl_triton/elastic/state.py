"""``State``: what an elastic job keeps in memory so that a failed step can be undone, and how every
rank of a new world is made to hold the same state, whatever the framework (Horovod's ``State``).

Semantics (each room's state, TorchState or JaxState, adds what its framework holds):
- counters: keyword arguments that become attributes (``state.epoch += 1``), ints or floats.
- ``commit()`` saves the state (a copy in memory, or references to immutable arrays), then admits
  waiting joiners (the world may grow at this step boundary: ``HostsUpdated``). Commit after every
  step for step-atomic training: a failure then undoes at most the step in flight.
- ``restore()`` puts the last commit back (on a failure, before the world is re-formed).
- ``sync(comm, ...)``: every rank takes the state of the rank with the *fewest* commits (the lowest
  rank among them), broadcast bit for bit: a step that did not commit everywhere is undone
  everywhere and redone, never applied twice, and a joiner gets the whole state. The counters come
  with it. Only a member of the previous world can be that source: the ranks that just joined are
  named by the agreed decision, not by what they say.

What crosses the network is raw bytes (one broadcast of int32 words) and a JSON manifest through
the store (names, dtypes, shapes, counters): nothing is unpickled. A subclass says what its bytes
are: ``_save_extra``/``_restore_extra`` (the copy aside), ``_packed`` (its tensors and manifest),
``_receiving`` (empty tensors for a source's manifest, checked against its own) and ``_load``.
"""
from __future__ import annotations

import json
import time

import torch

from ..errors import DDLError

_COUNTER_TYPES = (int, float)
_RESERVED = ("commits",)


class State:
    """Counters and commits, saved, restored and synchronized; a room's state adds its arrays."""

    _reserved: tuple[str, ...] = ()  # more attribute names a subclass keeps for itself

    def __init__(self, **counters):
        what = f"elastic.{type(self).__name__}"
        for name, value in counters.items():
            if name.startswith("_") or name in _RESERVED + self._reserved:
                raise ValueError(f"{what}: counter name {name!r} is reserved")
            if not isinstance(value, _COUNTER_TYPES) or isinstance(value, bool):
                raise TypeError(f"{what}: counter {name}={value!r} must be an int or a float")
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
                raise TypeError(f"elastic.{type(self).__name__}.register_reset_callbacks: {cb!r} is not callable")
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
        saved = self._saved or {}
        self._save_extra(saved)
        saved["counters"] = {n: getattr(self, n) for n in self._counter_names}
        saved["commits"] = self.commits
        self._saved = saved

    def restore(self) -> None:
        """Put the last saved state back."""
        if self._saved is None:
            raise DDLError(f"elastic.{type(self).__name__}.restore: nothing was saved yet")
        self._restore_extra(self._saved)
        for name, value in self._saved["counters"].items():
            setattr(self, name, value)
        self.commits = self._saved["commits"]

    def reset(self) -> None:
        """Run the reset callbacks (after a world change)."""
        for cb in self._reset_callbacks:
            cb()

    def sync(self, comm, manifest_key: str, store, joined: frozenset[int] = frozenset()) -> int:
        """Make every rank of ``comm`` hold the state of the rank with the fewest commits among the
        ranks not in ``joined`` (see the module doc); returns that rank. Collective over ``comm``.
        ``store`` and ``manifest_key`` carry the source's JSON manifest (shapes a joiner cannot
        know). ``joined``: the ranks admitted by this change of the world."""
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
            self._one_commit_back()
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

    # -- what a room's state says ------------------------------------------------------------------
    def _save_extra(self, saved: dict) -> None:
        """Put the framework's state aside into ``saved`` (kept between saves: reuse its buffers)."""

    def _restore_extra(self, saved: dict) -> None:
        """Bring back what ``_save_extra`` put aside."""

    def _one_commit_back(self) -> None:
        """This rank committed a step the source did not: the step is redone (TorchState rolls its
        own error feedback back one commit here)."""

    def _manifest(self) -> dict:
        """The manifest's part every state has: the counters and the commits."""
        return {"counters": {n: getattr(self, n) for n in self._counter_names}, "commits": self.commits}

    def _packed(self) -> tuple[list[torch.Tensor], dict]:
        """This rank's tensors in manifest order, and the manifest (with ``nbytes``)."""
        manifest = self._manifest()
        manifest["nbytes"] = 0
        return [], manifest

    def _receiving(self, manifest: dict, rank: int, source: int) -> list[torch.Tensor]:
        """Empty tensors for the source's, checked against this rank's own state."""
        return []

    def _load(self, manifest: dict, tensors: list[torch.Tensor]) -> None:
        """Take the source's state (``tensors`` hold its bytes): the counters and commits here."""
        counters = manifest.get("counters")
        if not isinstance(counters, dict):
            raise DDLError("elastic: the state manifest has no counters")
        for name in self._counter_names:
            if name in counters:
                setattr(self, name, counters[name])
        self.commits = int(manifest["commits"])


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
