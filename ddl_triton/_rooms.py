"""The rooms of the package and the one way their imports run, written down once.

``ROOMS`` lists each room (a subpackage of ``ddl_triton``; ``transports`` and ``schedules`` live at
the top of the repository but install as ``ddl_triton.transports`` and ``ddl_triton.schedules``)
from the bottom up, each with the rooms it may import: only rooms listed before it, so that no
arrow runs from a lower room into a higher one and no two rooms import each other. A room absent
from another's list may not be imported by it at all, at module level or inside a function.
``CORE`` are the modules at the top of the package that every room may import (they import no
room, but for ``options`` parsing the link-emulation setting with ``transports.link_emulation``);
``COMMANDS`` are the ``python -m ddl_triton.<name>`` entry points, above every room.
tests/unit/test_house.py reads this order and checks every import of the source tree against it.

Why this order: schedules are pure functions and transports a protocol (the two extension points,
which import no room); kernels know nothing of ranks; planning decides before anything runs and
reads the tuning table's format (planning/tuning_table.py); launch, the testbed and observability
run without torch or MPI; the runtime composes those; the tuner times communicators and the
simulator costs what the runtime would run; the gradient-reduction floor (gradients: buckets,
compression choices, error feedback) composes the runtime's collectives and the tuner's rule for
every framework, importing torch as the runtime does but never JAX, TensorFlow or a framework
room (tests/unit/test_house.py checks that too); the elastic floor (the retry loop, the state's
bytes, the world's re-forming) composes the runtime for every framework; the outer-sync floor
(DiLoCo's fragments, schedule, pseudo-gradient averages and state) composes the gradient floor for
torch's and JAX's ``DiLoCo``; the framework rooms
(torch, jax, tensorflow) sit on top of them all, side by side: none imports another.
"""
from __future__ import annotations

ROOMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("schedules", ()),
    ("transports", ()),
    ("kernels", ()),
    ("planning", ("schedules",)),
    ("launch", ()),
    ("testbed", ()),
    ("observability", ("schedules", "transports")),
    ("runtime", ("kernels", "launch", "observability", "planning", "schedules", "transports")),
    ("tuning", ("kernels", "planning", "runtime", "schedules")),
    ("simulation", ("planning", "runtime", "schedules", "testbed", "transports")),
    ("gradients", ("runtime", "tuning")),
    ("elastic", ("runtime", "transports")),
    ("outer_sync", ("gradients", "runtime")),
    ("torch", ("elastic", "gradients", "outer_sync", "planning", "runtime", "schedules", "transports", "tuning")),
    ("jax", ("elastic", "gradients", "outer_sync", "planning", "runtime", "schedules", "transports", "tuning")),
    ("tensorflow", ("elastic", "gradients", "kernels", "planning", "runtime", "schedules", "transports", "tuning")),
)
CORE = ("_private_files", "compression_methods", "errors", "job_secret", "ops", "options", "status_files")
COMMANDS = ("simulate", "trace", "tune")
