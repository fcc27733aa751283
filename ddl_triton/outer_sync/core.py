"""``OuterSync``: the framework-neutral core of DiLoCo and Streaming DiLoCo, on flat CPU buffers.

What it owns, per fragment (fragments.py): the backup of the fragment's global parameters (the
last outer step's result, one flat tensor), the pseudo-gradient's average in flight (averaging.py),
and its error feedback (a ``gradients.Residuals``, keyed by the fragment's index); and the inner
step counter that the schedule (schedule.py) reads. What it leaves to the adapters (torch's
``ddl_triton.torch.DiLoCo``, JAX's ``ddl_triton.jax.DiLoCo``): the parameters themselves, flattened
into and out of the buffers, and the outer optimizer, which steps on the average.

The adapter's loop, after each inner optimizer step::

    starting, applying = core.advance()            # the step counter moves; what is due now
    if starting is not None:
        core.start(starting, flat(local params of fragment starting))    # backup - local, averaged async
    if applying is not None:
        avg = core.finish(applying)                 # the averaged pseudo-gradient, same bits everywhere
        ... params of the fragment = backup; grad = avg; outer optimizer steps ...
        core.set_backup(applying, flat(new global params))

``finish`` of a fragment whose start was lost (a state loaded between start and apply, say after
a world change) starts it first, from the local parameters the adapter passes, and waits: the sync
is redone at once, as with ``fragment_sync_delay=0``.

The state (``state_dict``/``load_state_dict``): the step, the backups and the residuals, plus the
schedule and split they belong to (a load checks them). Tensors are torch CPU tensors (JAX views
its NumPy buffers as torch: ddl_triton/runtime/arrays.py).
"""
from __future__ import annotations

import numpy as np
import torch

from .. import compression_methods
from .averaging import OuterAverage
from .fragments import split
from .schedule import Schedule

__all__ = ["OuterSync"]


class OuterSync:
    """The outer-sync core over ``comm`` for parameters of the given byte sizes (module doc).

    ``sync_every``, ``fragments``, ``fragment_sync_delay``: torchft's (schedule.py);
    ``compression``: None or "none" (fp32 averages), or a method of ddl_triton/compression_methods.py
    (error feedback per fragment); ``replicas``: "ranks" or "hosts" (averaging.py); ``who`` names the
    API in errors."""

    def __init__(self, comm, nbytes: list[int], *, sync_every: int, fragments: int = 1, fragment_sync_delay: int = 0,
                 compression: str | None = None, replicas: str = "ranks", block: int = 256,
                 error_feedback: bool = True, who: str = "outer sync"):
        rank = comm.rank
        self.comm, self.who = comm, who
        setting = compression_methods.NONE if compression is None else compression
        if setting == compression_methods.AUTO:
            raise ValueError(f"rank {rank}: {who}: compression 'auto' is not taken here: name a method or None "
                             "(sync_every='auto' chooses the compression with the planner)")
        compression_methods.check_choice(setting, f"rank {rank}: {who} compression")
        self.schedule = Schedule(sync_every, fragments, fragment_sync_delay, rank)
        self.groups = split(list(nbytes), fragments, rank)
        self.compression = setting
        self.step = 0
        self.backups: list[torch.Tensor | None] = [None] * fragments
        self._pending: dict[int, object] = {}
        self._averaging = dict(replicas=replicas, block=block, error_feedback=error_feedback)
        self.average = OuterAverage(comm, setting, **self._averaging)

    # -- the schedule ----------------------------------------------------------------------------
    def advance(self) -> tuple[int | None, int | None]:
        """Count one inner step; return (the fragment to start now, the fragment to apply now)."""
        self.step += 1
        return self.schedule.starts_at(self.step), self.schedule.syncs_at(self.step)

    # -- one fragment's sync ---------------------------------------------------------------------
    def set_backup(self, fragment: int, flat: torch.Tensor) -> None:
        """Hold ``flat`` (copied) as the fragment's global parameters."""
        self.backups[fragment] = _as_torch(flat).detach().to("cpu", copy=True).contiguous()

    def start(self, fragment: int, local: torch.Tensor) -> None:
        """Begin averaging the fragment's pseudo-gradient, backup - ``local`` (its flat local
        parameters, a torch tensor or a NumPy array), over the outer group (asynchronous; collective in
        schedule order)."""
        if fragment in self._pending:
            raise RuntimeError(f"rank {self.comm.rank}: {self.who}: fragment {fragment} started twice without being "
                               "applied")
        backup = self._backup(fragment)
        pseudo = backup - _as_torch(local).detach().to("cpu", dtype=backup.dtype).reshape(-1)
        self._pending[fragment] = self.average.start(pseudo.contiguous(), fragment)

    def finish(self, fragment: int, local: torch.Tensor | None = None) -> torch.Tensor:
        """The fragment's averaged pseudo-gradient (the same bits on every rank). If its start was
        lost (module doc), it is started now from ``local``."""
        if fragment not in self._pending:
            if local is None:
                raise RuntimeError(f"rank {self.comm.rank}: {self.who}: fragment {fragment} was never started")
            self.start(fragment, local)
        return self.average.finish(self._pending.pop(fragment))

    def pending(self) -> list[int]:
        """The fragments whose averages are in flight."""
        return sorted(self._pending)

    def wait(self) -> None:
        """Wait for every average in flight (their results stay held for ``finish``)."""
        for p in self._pending.values():
            if p.work is not None:
                p.work.wait()

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{"step", "sync_every", "fragments" (the split), "fragment_sync_delay", "compression",
        "backups" (copies), "residuals" (a snapshot)}. An average in flight is not part of it."""
        residuals = self.average.residuals
        return {"step": self.step, "sync_every": self.schedule.sync_every, "fragments": [list(g) for g in self.groups],
                "fragment_sync_delay": self.schedule.fragment_sync_delay, "compression": self.compression,
                "backups": [None if b is None else b.clone() for b in self.backups],
                "residuals": residuals.snapshot() if residuals is not None else {}}

    def load_state_dict(self, state: dict, *, residuals: bool = True) -> None:
        """Take ``state`` (``state_dict``'s); drop averages in flight, without waiting for them (their
        fragments are redone at their apply step). ``residuals=False`` starts error feedback from
        zero (after a world change: the residuals were made by other ranks). ValueError naming the
        rank when ``state`` belongs to another schedule or split."""
        mine = (self.schedule.sync_every, [list(g) for g in self.groups], self.schedule.fragment_sync_delay)
        theirs = (state.get("sync_every"), [list(g) for g in state.get("fragments", [])],
                  state.get("fragment_sync_delay"))
        if mine != theirs:
            raise ValueError(f"rank {self.comm.rank}: {self.who}: the state is of sync_every, fragments, delay "
                             f"{theirs}, this one of {mine}")
        self._pending.clear()  # not waited for: after a failure they may never complete (elastic restores)
        self.step = int(state["step"])
        self.backups = [None if b is None else torch.as_tensor(b).to("cpu", copy=True).contiguous()
                        for b in state["backups"]]
        held = self.average.residuals
        if held is not None:
            held.clear()
            if residuals and state.get("residuals"):
                held.load(state["residuals"])

    def reset_residuals(self) -> None:
        """Forget every fragment's error feedback."""
        if self.average.residuals is not None:
            self.average.residuals.clear()

    def follow(self, comm) -> None:
        """Average over ``comm`` from now on (an elastic job's new world): averages in flight are
        dropped (redone at their apply step), the residuals start from zero (the old world made
        them), the old world's groups are closed (an error there is the old world's, and ignored)."""
        self._pending.clear()
        try:
            self.average.close()
        except Exception:  # noqa: BLE001 - the old world is gone: nothing of it is needed any more
            pass
        self.comm = comm
        self.average = OuterAverage(comm, self.compression, **self._averaging)

    def close(self) -> None:
        """Wait for what is in flight and close the groups made here (never ``comm``)."""
        self.wait()
        self._pending.clear()
        self.average.close()

    def _backup(self, fragment: int) -> torch.Tensor:
        b = self.backups[fragment]
        if b is None:
            raise RuntimeError(f"rank {self.comm.rank}: {self.who}: fragment {fragment} has no backup "
                               "(set_backup first)")
        return b


def _as_torch(x) -> torch.Tensor:
    """A torch tensor as it is; a NumPy array (JAX's host buffers) as a torch view of a contiguous copy."""
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x, copy=True, order="C"))
