"""The call path runs one way down (issue 42, item 4): a collective enters the communicator once,
and is handed down as a call value; no lower layer calls back up into it, and no two modules of
the package import each other.

The first check runs a world of one rank in a child process (MPI's singleton init, as
tests/unit/test_mpich_segment.py does) and records, with ``sys.setprofile``, every call into
ddl_triton/runtime/communicator.py made from outside it while collectives run: only the public
entry itself may appear. Before the change, the issue path called back into the communicator for
each call (``_attach`` before and after, the job lambda) and the call check ran the communicator's
``run`` lambda: five entries per allreduce.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_ENTRIES = r"""
import sys, torch, ddl_triton
comm = ddl_triton.init()
t = torch.arange(6, dtype=torch.float32)
comm.allreduce(t)  # plans and caches first: the recorded calls below are the steady state
entries = []

def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.endswith("runtime/communicator.py"):
        caller = frame.f_back
        if caller is None or not caller.f_code.co_filename.endswith("runtime/communicator.py"):
            entries.append(frame.f_code.co_name)

sys.setprofile(profile)
comm.allreduce(t)
comm.broadcast(t, root=0)
comm.all_gather(torch.zeros(6), t)
comm.barrier()
comm.allreduce(t, async_op=True).wait()
sys.setprofile(None)
assert torch.equal(t, torch.arange(6, dtype=torch.float32)), t
print("ENTRIES", ",".join(entries))
ddl_triton.finalize()
"""


@pytest.mark.slow  # seconds: make check, the inner loop, leaves it out
def test_a_collective_enters_the_communicator_once_and_nothing_calls_back_into_it():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDL_", "PMI_", "MPI_", "OMPI_"))}
    proc = subprocess.run([sys.executable, "-c", _ENTRIES], env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("ENTRIES"))
    entries = line.split(" ", 1)[1].split(",")
    assert entries == ["allreduce", "broadcast", "all_gather", "barrier", "allreduce"], entries


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("transports", "schedules"):
        parts = ["ddl_triton", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at any depth of its code."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = (package[:len(package) - node.level + 1] if node.level else []) + \
                (node.module.split(".") if node.module else [])
            found.update(t for t in [".".join(base)] + [".".join(base + [a.name]) for a in node.names] if t in modules)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    return found - {name}


def test_no_two_modules_of_the_package_import_each_other():
    paths = {_module_name(p): p for d in ("ddl_triton", "transports", "schedules") for p in (ROOT / d).rglob("*.py")}
    imports = {name: _imports(path, set(paths)) for name, path in paths.items()}
    circles = sorted({tuple(sorted((a, b))) for a in imports for b in imports[a]
                      if a in imports.get(b, ()) and not a.startswith(b + ".") and not b.startswith(a + ".")})
    assert circles == [], circles  # a package and its own modules excepted (``__init__`` re-exports)
