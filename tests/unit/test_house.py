"""The house rules (docs/design.md): rooms by concern, dependencies one way, configuration read
in one place, and files small enough to read.

Each rule is checked against the source tree or a fresh interpreter, so that breaking it fails here
instead of being noticed by the next reader."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("ddl_triton", "transports", "schedules")
# The only readers of DDL_* variables: the options object, and the rank guard, which runs as a file
# below each MPICH rank before any package import (the launcher-to-guard protocol).
ENV_READERS = {"ddl_triton/options.py", "ddl_triton/launch/rank_guard.py"}
MAX_LINES = 450
MAX_TOP_LEVEL_MODULES = 12


def _sources() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def _reads_ddl_variable(tree: ast.AST) -> list[int]:
    """Lines that read an environment variable named by a "DDL_..." literal: ``os.environ.get("DDL_X")``,
    ``os.environ["DDL_X"]`` (a load), ``os.getenv("DDL_X")``, ``os.environ.pop("DDL_X")``. Writing one
    (ddlrun sets them for its ranks) is not reading."""
    def names_ddl(node) -> bool:
        return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("DDL_")
                   for n in ast.walk(node))

    def is_environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
            (isinstance(node, ast.Name) and node.id == "environ")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value) \
                and names_ddl(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and names_ddl(node.args[0]):
            f = node.func
            if (f.attr in ("get", "pop") and is_environ(f.value)) or f.attr == "getenv":
                lines.append(node.lineno)
    return lines


def test_the_env_check_finds_each_way_of_reading_a_variable():
    sample = ("import os\nfrom os import environ\na = os.environ.get('DDL_A')\nb = os.environ['DDL_B']\n"
              "c = os.getenv('DDL_C', '')\nd = environ.pop('DDL_D', None)\nos.environ['DDL_E'] = '1'\n"
              "env = {}\nenv['DDL_F'] = 'x'\nname = os.environ.get('HOME')\n")
    assert _reads_ddl_variable(ast.parse(sample)) == [3, 4, 5, 6]


def test_only_the_options_object_and_the_rank_guard_read_ddl_variables():
    readers = {}
    for path in _sources():
        lines = _reads_ddl_variable(ast.parse(path.read_text(), str(path)))
        if lines:
            readers[str(path.relative_to(ROOT))] = lines
    assert set(readers) <= ENV_READERS, {k: v for k, v in readers.items() if k not in ENV_READERS}


def _fresh_modules(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after ``statement``."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


@pytest.mark.parametrize("statement", ["import ddl_triton", "import ddl_triton.launch",
                                       "import ddl_triton.launch.ddlrun", "import ddl_triton.options"])
def test_importing_the_package_or_the_launcher_starts_no_mpi_and_loads_no_torch(statement):
    loaded = _fresh_modules(statement)
    assert "mpi4py.MPI" not in loaded
    assert "torch" not in loaded


@pytest.mark.parametrize("room", ["launch", "observability", "testbed"])
def test_launch_observability_and_the_testbed_need_neither_torch_nor_mpi(room):
    modules = sorted(f"ddl_triton.{room}.{p.stem}" for p in (ROOT / "ddl_triton" / room).glob("*.py")
                     if p.stem != "__init__")
    loaded = _fresh_modules("\n".join(f"import {m}" for m in modules))
    assert {"torch", "mpi4py.MPI"} & loaded == set(), modules


def test_the_gradient_floor_loads_neither_jax_nor_tensorflow():
    # ddl_triton/gradients/ serves every framework room: it may use torch (as the runtime does), and
    # must not pull a framework in (a torch job would pay TensorFlow's seconds of import).
    modules = sorted(f"ddl_triton.gradients.{p.stem}" for p in (ROOT / "ddl_triton" / "gradients").glob("*.py"))
    loaded = _fresh_modules("\n".join(f"import {m}" for m in modules))
    assert {"jax", "tensorflow", "ddl_triton.torch", "ddl_triton.jax", "ddl_triton.tensorflow"} & loaded == set()


@pytest.mark.slow  # seconds: make check, the inner loop, leaves it out
def test_the_public_names_still_resolve_lazily():
    loaded = _fresh_modules("import ddl_triton as ddl\nassert callable(ddl.init) and callable(ddl.finalize)\n"
                            "assert ddl.Options().timeout > 0\nassert callable(ddl.schedules.register)")
    assert "torch" in loaded  # ddl.init lives beside the communicator, which needs torch: imported on use


def test_no_source_file_is_longer_than_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_few_modules_remain_at_the_top_of_the_package():
    top = sorted(p.name for p in (ROOT / "ddl_triton").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_every_subpackage_says_what_lives_there():
    for init in sorted((ROOT / "ddl_triton").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.split()) >= 25, f"{init.relative_to(ROOT)}: its docstring should say what lives there " \
                                       f"and what it may import; it has {doc!r}"


# ---- runtime's rooms (ddl_triton/runtime/__init__.py): each imports only the rooms below it -------
RUNTIME_ROOMS = ("compression", "calls", "setup", "lanes")  # highest first; the communicator and world above all
RUNTIME_ROOM_MAX_FILES = 10  # a room that outgrows this is two concerns


def _imported_modules(path: Path) -> set[str]:
    """The absolute module names ``path`` imports (relative imports resolved against its package)."""
    rel = path.relative_to(ROOT).with_suffix("")
    package = ["ddl_triton", *rel.parts[1:-1]] if rel.parts[0] == "ddl_triton" else ["ddl_triton", *rel.parts[:-1]]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            if node.module is None or node.level:
                found.update(".".join(module + [a.name]) for a in node.names)
            found.add(".".join(module))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _runtime_room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["ddl_triton", "runtime"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in RUNTIME_ROOMS else "top"  # communicator, world: the top


def test_the_import_check_resolves_relative_imports():
    sample = ROOT / "ddl_triton" / "runtime" / "calls" / "executor.py"
    assert any(m.startswith("ddl_triton.") for m in _imported_modules(sample))


def test_each_runtime_room_imports_only_the_rooms_below_it():
    wrong = []
    for path in sorted((ROOT / "ddl_triton" / "runtime").rglob("*.py")):
        mine = _runtime_room(".".join(("ddl_triton", *path.relative_to(ROOT / "ddl_triton").with_suffix("").parts)))
        if mine in (None, "top"):
            continue
        for module in _imported_modules(path):
            theirs = _runtime_room(module)
            if theirs is None or theirs == mine:
                continue
            if theirs == "top" or RUNTIME_ROOMS.index(theirs) < RUNTIME_ROOMS.index(mine):
                wrong.append(f"{path.relative_to(ROOT)} ({mine}) imports {module} ({theirs})")
    assert not wrong, "an arrow up the runtime's rooms (order: " + " > ".join(RUNTIME_ROOMS) + "):\n" + "\n".join(wrong)


def test_runtime_rooms_stay_small_and_say_what_lives_there():
    runtime = ROOT / "ddl_triton" / "runtime"
    top = sorted(p.name for p in runtime.glob("*.py") if p.name != "__init__.py")
    assert top == ["arrays.py", "communicator.py", "world.py"], top
    for room in RUNTIME_ROOMS:
        files = sorted(p.name for p in (runtime / room).glob("*.py") if p.name != "__init__.py")
        assert 0 < len(files) <= RUNTIME_ROOM_MAX_FILES, (room, files)


def test_the_compression_registry_is_the_only_place_a_method_is_named():
    """A compression method's name ("int8", ...) as a string literal outside the registry
    (ddl_triton/compression_methods.py) is a list of methods waiting to drift from the table: only
    a method's own code, a function named after it (allreduce_int8, gathered.onebit,
    fp16_compress_hook), may name it, to read its own row. Docstrings are whole strings: not names."""
    from ddl_triton import compression_methods

    methods = set(compression_methods.names())

    def named(tree: ast.AST) -> list[tuple[int, str]]:
        found = []

        def visit(node, scope: tuple[str, ...]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, scope + (child.name,))
                    continue
                if isinstance(child, ast.Constant) and isinstance(child.value, str) and child.value in methods \
                        and not any(child.value in function for function in scope):
                    found.append((child.lineno, child.value))
                visit(child, scope)

        visit(tree, ())
        return found

    sample = "M = ('int8', 'onebit')\ndef allreduce_int8(x):\n    return x == 'int8' or x == 'fp16'\n"
    assert named(ast.parse(sample)) == [(1, "int8"), (1, "onebit"), (3, "fp16")]  # the check can fail
    registry = ROOT / "ddl_triton" / "compression_methods.py"
    listed = {str(p.relative_to(ROOT)): hits for p in _sources() if p != registry
              and (hits := named(ast.parse(p.read_text(), str(p))))}
    assert not listed, f"compression methods named outside {registry.relative_to(ROOT)}: {listed}"


# ---- the package's rooms (ddl_triton/_rooms.py): every import runs one way, down -------------------
# The one exception, justified: Options validates DDL_LINK_EMULATION at init with the parser of the
# transport that emulates the link, so that a bad spec fails on every rank before anything is built.
CORE_REACHES_DOWN = {("ddl_triton/options.py", "transports")}


def _module_parts(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = parts if parts[0] == "ddl_triton" else ["ddl_triton", *parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def test_the_rooms_order_lists_each_room_after_the_rooms_it_imports():
    from ddl_triton._rooms import ROOMS
    order = [room for room, _ in ROOMS]
    for i, (room, may_import) in enumerate(ROOMS):
        assert all(order.index(r) < i for r in may_import), (room, may_import)
    subpackages = {p.parent.name for p in (ROOT / "ddl_triton").glob("*/__init__.py")} | {"transports", "schedules"}
    assert subpackages == set(order), f"rooms not in ddl_triton/_rooms.py: {subpackages ^ set(order)}"


def _room_violations(imports: dict[str, set[str]]) -> list[str]:
    """For {source path relative to the root: the modules it imports}, each import against the order."""
    from ddl_triton._rooms import COMMANDS, CORE, ROOMS
    allowed = dict(ROOMS)
    wrong = []
    for where, modules in imports.items():
        parts = _module_parts(ROOT / where)
        mine = parts[1] if len(parts) > 1 else None
        if mine is not None and mine not in allowed and mine not in CORE and mine not in COMMANDS and mine != "_rooms":
            wrong.append(f"{where}: {mine} is neither a room, a core module nor a command (ddl_triton/_rooms.py)")
        for module in modules:
            target = module.split(".")
            if target[0] != "ddl_triton" or len(target) < 2:
                continue
            theirs = target[1]
            if theirs == mine or theirs not in allowed:
                continue  # the same room, or a top-level module (core, a command, a name of the package)
            if mine in allowed and theirs not in allowed[mine]:
                wrong.append(f"{where} ({mine}) imports {module} ({theirs})")
            elif mine in CORE and (where, theirs) not in CORE_REACHES_DOWN:
                wrong.append(f"{where} (a core module) imports {module} ({theirs})")
    return sorted(set(wrong))


def test_no_import_runs_from_a_lower_room_into_a_higher_one():
    wrong = _room_violations({str(p.relative_to(ROOT)): _imported_modules(p) for p in _sources()})
    assert not wrong, "imports against ddl_triton/_rooms.py's order:\n" + "\n".join(wrong)


def test_the_room_check_sees_a_wrong_way_import():
    sample = {"ddl_triton/planning/costmodel.py": {"ddl_triton.runtime.communicator", "ddl_triton.schedules.ir"},
              "ddl_triton/errors.py": {"ddl_triton.runtime.setup.bootstrap"},
              "transports/shm.py": {"ddl_triton.errors", "ddl_triton.transports.waits"}}
    assert _room_violations(sample) == [
        "ddl_triton/errors.py (a core module) imports ddl_triton.runtime.setup.bootstrap (runtime)",
        "ddl_triton/planning/costmodel.py (planning) imports ddl_triton.runtime.communicator (runtime)"]


# mpi4py's lowercase methods pickle their arguments, and unpickle what arrives: on any path that a
# peer, a launcher or an attacker on the network could feed, that is code execution. The library and
# the examples use the buffer methods (Bcast, Allreduce, ...), or JSON over them.
_PICKLING_MPI = {"allgather", "allreduce", "alltoall", "bcast", "bsend", "exscan", "gather", "ibsend", "irecv",
                 "isend", "issend", "mrecv", "recv", "reduce", "scan", "scatter", "send", "sendrecv", "ssend"}
_MPI_RECEIVER = r"(MPI\.COMM_\w+|\bworld\b|mpi_comm|_mpi\b|Dup\(\)|Idup\(\))"


def _pickling_mpi_calls(tree: ast.AST) -> list[int]:
    """Lines calling one of mpi4py's pickling methods on what is evidently an MPI communicator: a
    receiver named like one (MPI.COMM_WORLD, world, mpi_comm, a Dup), or any call passing op=MPI.X."""
    import re

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _PICKLING_MPI:
            receiver = ast.unparse(node.func.value)
            mpi_op = any(k.arg == "op" and ast.unparse(k.value).startswith("MPI.") for k in node.keywords)
            if re.search(_MPI_RECEIVER, receiver) or mpi_op:
                lines.append(node.lineno)
    return lines


def test_the_pickling_check_finds_mpi4pys_lowercase_calls():
    sample = ("from mpi4py import MPI\nw = MPI.COMM_WORLD\nMPI.COMM_WORLD.bcast(x, root=0)\nworld.allgather(h)\n"
              "comm.allreduce(1, op=MPI.MAX)\nmpi_comm.recv(source=0)\ncomm.allreduce(t, op='avg')\n"
              "world.Bcast(buf, root=0)\nself._mpi.send(x, 1)\n")
    assert _pickling_mpi_calls(ast.parse(sample)) == [3, 4, 5, 6, 9]


def test_no_pickling_mpi_call_in_the_library_or_the_examples_and_no_mktemp_anywhere():
    # The benchmarks are ours to run on our own hosts: their timing control values may still pickle.
    library = [*_sources(), *sorted((ROOT / "examples").glob("*.py"))]
    found = {}
    for path in [*library, *sorted((ROOT / "bench").glob("*.py"))]:
        tree = ast.parse(path.read_text(), str(path))
        lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "mktemp"]
        if path in library:
            lines += _pickling_mpi_calls(tree)
        if lines:
            found[str(path.relative_to(ROOT))] = sorted(lines)
    assert not found, f"pickling MPI calls or tempfile.mktemp (racy: use mkdtemp/NamedTemporaryFile): {found}"


def test_the_elastic_floor_imports_no_framework_room_nor_jax_nor_tensorflow():
    """ddl_triton/elastic/ is every framework's floor: torch's process groups, JAX and TensorFlow stay
    in their rooms (torch itself it uses as the runtime does: tensors as bytes, the store's client)."""
    wrong = [f"{p.relative_to(ROOT)} imports {m}" for p in sorted((ROOT / "ddl_triton" / "elastic").glob("*.py"))
             for m in _imported_modules(p) if m.split(".")[0] in ("jax", "jaxlib", "tensorflow", "optax")
             or m.startswith(("ddl_triton.torch", "ddl_triton.jax", "ddl_triton.tensorflow", "torch.nn"))]
    assert not wrong, wrong
