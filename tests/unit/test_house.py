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
