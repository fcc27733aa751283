"""Outer-sync training (DiLoCo, Streaming DiLoCo), framework-neutral: the floor under torch's and JAX's ``DiLoCo``.

Each replica takes inner steps on its own; every ``sync_every`` steps the replicas average their
pseudo-gradient (the last global parameters minus the local ones) across the outer group and an
outer optimizer steps on it. This room holds what every framework shares:

    fragments.py  ``split``: parameters, in order, into ``fragments`` contiguous groups balanced by
                  bytes (every rank splits alike)
    schedule.py   ``Schedule``: torchft's staggered schedule (which fragment starts and applies at
                  which inner step, with ``fragment_sync_delay``)
    averaging.py  ``OuterAverage``: the pseudo-gradient average over the outer group, fp32 or a
                  registry method with per-fragment error feedback, crossing the slow link once per
                  host (``replicas`` "ranks" or "hosts")
    core.py       ``OuterSync``: the backups, the step, the averages in flight, the state dict

It imports the gradient floor (``Reducer``, ``Residuals``) and the runtime, torch as they do, and
never JAX, TensorFlow or a framework room; the adapters (ddl_triton/torch/diloco.py,
ddl_triton/jax/diloco.py) flatten parameters into its buffers and run the outer optimizer.
docs/outer_sync.md has the semantics and torchft's names.
"""
from __future__ import annotations

from .averaging import REPLICAS, OuterAverage
from .core import OuterSync
from .fragments import split
from .schedule import Schedule

__all__ = ["REPLICAS", "OuterAverage", "OuterSync", "Schedule", "split"]
