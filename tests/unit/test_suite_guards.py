"""The suite's guards against passing without testing: each is shown failing on what it guards against.

- a worker's closing report must have every rank of the world asked for (``support.report.read_report``):
  N singletons, a missing rank, another world size, a failure or no checks fail it;
- the harness runs only the mpich wheel's mpiexec and checks that it starts one world
  (``support.launch``): an mpiexec on PATH, one that is not the wheel's, or a launcher that
  starts singletons is refused, naming what was found and what was expected;
- skips (tests/conftest.py): a skip without a reason fails; a real-host skip fails under
  ``CI_REQUIRE_REAL_HOSTS=1``; twins that all skipped fail the session; pytest prints skip reasons;
- bench/collectives.py exits 1 when it counted a wrong element.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

from support import launch, real_hosts, twins
from support.report import rank_lines, read_report

ROOT = Path(__file__).resolve().parents[2]


def _report(heading: str, ranks: list[tuple[int, int, int, int]]) -> str:
    total, failed = sum(c for _, _, c, _ in ranks), sum(k for _, _, _, k in ranks)
    return "\n".join(rank_lines(heading, ranks) + [f"{heading}, {total} checks, {failed} failures"]) + "\n"


def test_a_report_of_every_rank_passes():
    out = "noise\n" + _report("w: 3 ranks", [(1, 3, 50, 0), (0, 3, 50, 0), (2, 3, 50, 0)])
    assert read_report(out, "w", 3) == [50, 50, 50]
    uneven = _report("w: 2 ranks", [(0, 2, 51, 0), (1, 2, 50, 0)])
    assert read_report(uneven, "w", 2, same_on_every_rank=False) == [51, 50]
    with pytest.raises(AssertionError, match="differ"):
        read_report(uneven, "w", 2)


@pytest.mark.parametrize("case,out,says", [
    ("singletons", _report("w: 1 ranks", [(0, 1, 50, 0)]) * 3, "found 3"),
    ("one singleton", _report("w: 1 ranks", [(0, 1, 50, 0)]), "asked for 3 ranks"),
    ("a rank missing", _report("w: 3 ranks", [(0, 3, 50, 0), (1, 3, 50, 0)]), "asked for 3 ranks"),
    ("another world size", _report("w: 3 ranks", [(0, 3, 50, 0), (1, 3, 50, 0), (2, 4, 50, 0)]), "asked for 3"),
    ("a rank twice", _report("w: 3 ranks", [(0, 3, 50, 0), (1, 3, 50, 0), (1, 3, 50, 0), (2, 3, 50, 0)]),
     "asked for 3"),
    ("a failure", _report("w: 3 ranks", [(0, 3, 50, 0), (1, 3, 50, 1), (2, 3, 50, 0)]), "1 failures"),
    ("a rank ran fewer checks", _report("w: 3 ranks", [(0, 3, 50, 0), (1, 3, 49, 0), (2, 3, 50, 0)]), "differ"),
    ("no checks", _report("w: 3 ranks", [(0, 3, 0, 0), (1, 3, 0, 0), (2, 3, 0, 0)]), "no checks"),
    ("no report", "w: 3 ranks, 150 checks, 0 failures\n", "asked for 3"),
])
def test_a_report_that_is_not_every_rank_of_the_world_fails(case, out, says):
    with pytest.raises(AssertionError, match=says):
        read_report(out, "w", 3)


def _fake_python(tmp_path: Path) -> Path:
    """A folder standing in for a virtual environment's bin/ (the harness looks beside the interpreter)."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    return bin_dir / "python"


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_an_mpiexec_on_path_is_refused(tmp_path, monkeypatch):
    python = _fake_python(tmp_path)
    on_path = _script(tmp_path / "elsewhere" / "mpiexec", 'exec "$@"\n')  # another MPI's launcher
    monkeypatch.setenv("PATH", f"{on_path.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(sys, "executable", str(python))
    with pytest.raises(RuntimeError) as refused:
        launch.mpiexec()
    assert str(python.parent / "mpiexec") in str(refused.value) and str(on_path) in str(refused.value)


def test_an_mpiexec_that_is_not_the_mpich_wheels_is_refused(tmp_path, monkeypatch):
    python = _fake_python(tmp_path)
    _script(python.parent / "mpiexec", 'exec "$@"\n')
    monkeypatch.setattr(sys, "executable", str(python))
    with pytest.raises(RuntimeError, match="not one of the files the installed mpich wheel provides"):
        launch.mpiexec()


def test_a_launcher_that_starts_singletons_is_refused(tmp_path):
    # Runs the command twice, without a process manager: two MPI singletons, each rank 0 of 1.
    singletons = _script(tmp_path / "mpiexec", 'shift 2\n"$@" & "$@"\nwait\n')
    out = launch._probe(str(singletons), sys.executable, 2)
    with pytest.raises(RuntimeError, match=r"did not start one world of 2 ranks.*\[\(0, 1\), \(0, 1\)\]"):
        launch.assert_world(out, 2)


def test_the_wheels_mpiexec_starts_one_mpich_world():
    # mpiexec() ran the 2-rank probe (once per process) and assert_world accepted it.
    assert Path(launch.mpiexec()) == Path(sys.executable).parent / "mpiexec"


def test_the_real_hosts_requirement_reads_only_one_and_zero():
    assert real_hosts.required({}) is False
    assert real_hosts.required({"CI_REQUIRE_REAL_HOSTS": "1"}) is True
    assert real_hosts.required({"CI_REQUIRE_REAL_HOSTS": "0"}) is False
    with pytest.raises(ValueError, match="CI_REQUIRE_REAL_HOSTS='yes'"):
        real_hosts.required({"CI_REQUIRE_REAL_HOSTS": "yes"})


def test_skip_unless_available_skips_with_the_reason_or_fails_under_ci(monkeypatch):
    monkeypatch.setattr(real_hosts, "UNAVAILABLE", "ddl-testbed: needs root (a stand-in reason)")
    monkeypatch.delenv("CI_REQUIRE_REAL_HOSTS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        real_hosts.skip_unless_available()
    monkeypatch.setenv("CI_REQUIRE_REAL_HOSTS", "1")
    with pytest.raises(pytest.fail.Exception, match="CI_REQUIRE_REAL_HOSTS=1 .* needs root"):
        real_hosts.skip_unless_available()
    monkeypatch.setattr(real_hosts, "UNAVAILABLE", "")
    real_hosts.skip_unless_available()  # hosts can be built: the test goes on


def test_twins_that_all_skipped_are_named():
    a, b = twins.TWINS[0]
    both = {a, b}
    assert twins.unrun(both, both, {b}) == []
    assert twins.unrun(both, both, set())  # both ran, both skipped
    assert twins.unrun(both, {a}, set()) == []  # a subset run (-k, one file): not every twin was asked for
    renamed = {a, b.split("::")[0] + "::test_renamed"}
    assert any("no longer exists" in p for p in twins.unrun(renamed, renamed, {a}))


def test_ci_runs_make_test_requiring_real_hosts_and_pytest_prints_skip_reasons():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci and "make test" in ci
    assert ci.index("export CI_REQUIRE_REAL_HOSTS=1") < ci.index("make test")
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert any(opt.startswith("-r") and "s" in opt for opt in addopts.split()), addopts


_INNER_TESTS = '''
import pytest
from support import real_hosts

def test_says_nothing():
    pytest.skip()

def test_needs_hosts():
    pytest.skip(real_hosts.UNAVAILABLE)

@pytest.mark.skipif(bool(real_hosts.UNAVAILABLE), reason=real_hosts.UNAVAILABLE or "-")
def test_marked_for_hosts():
    pass

def test_twin_one():
    pytest.skip("the other one runs here")

def test_twin_two():
    pytest.skip("the first one runs here")

def test_skips_with_a_reason():
    pytest.skip("a reason of its own")
'''


@pytest.mark.slow  # seconds: make check, the inner loop, leaves it out
def test_conftest_fails_silent_skips_required_real_hosts_and_unrun_twins(tmp_path):
    """One pytest session under tests/conftest.py, with a machine that cannot build hosts and
    CI_REQUIRE_REAL_HOSTS=1: every guarded skip fails, the reasoned skip stays a skip and is printed."""
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    prelude = textwrap.dedent('''
        import support.real_hosts, support.twins
        support.real_hosts.UNAVAILABLE = "ddl-testbed: needs root (a stand-in reason)"
        support.twins.TWINS = [("test_inner.py::test_twin_one", "test_inner.py::test_twin_two")]
    ''')
    (tmp_path / "conftest.py").write_text(conftest + prelude)
    (tmp_path / "test_inner.py").write_text(_INNER_TESTS)
    env = dict(os.environ, CI_REQUIRE_REAL_HOSTS="1", PYTHONPATH=str(ROOT / "tests"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--rootdir",
                           str(tmp_path), "-c", os.devnull, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 failed, 3 skipped, 1 error" in out, out  # the skipif mark's skip fails at setup: an error
    assert "skipped without saying why" in out and "CI_REQUIRE_REAL_HOSTS=1 and this real-host test" in out, out
    assert "none of these twins ran and passed" in out, out
    assert re.search(r"SKIPPED \[1\] test_inner.py:\d+: a reason of its own", out), out


def _bench_collectives():
    spec = importlib.util.spec_from_file_location("bench_collectives_under_test", ROOT / "bench" / "collectives.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no MPI: the module imports mpi4py.MPI only in main
    return module


def test_bench_collectives_exits_nonzero_on_a_wrong_element(capsys):
    bench = _bench_collectives()
    # Rank 1 of 2 holds base + 1; the sum over both ranks is 2 * base + 1 = 2 * t - 1.
    right = bench._Impl("ddl", lambda t: lambda: t.mul_(2).sub_(1))
    corrupt = bench._Impl("ddl", lambda t: lambda: t.mul_(2))  # off by one in every element
    assert bench._count_wrong(corrupt, 10, torch.int32, "sum", rank=1, size=2) == 10
    assert bench._count_wrong(right, 10, torch.int32, "sum", rank=1, size=2) == 0
    rows = [{"bytes": 8, "ddl": {"wrong": 0}, "mpi": {"wrong": 0}}, {"bytes": 64, "ddl": {"wrong": 3}, "mpi": {"wrong": 0}}]
    assert bench._verdict(rows[:1], ["ddl", "mpi"], speak=True) == 0
    assert bench._verdict(rows, ["ddl", "mpi"], speak=True) == 1
    assert "WRONG RESULTS (exit 1): ddl at 64 B: 3 wrong elements" in capsys.readouterr().out


def _imports_tensorflow_when_collected(path: Path) -> bool:
    """Whether ``path``'s module-level statements (what pytest runs as it collects the file) import
    TensorFlow: an ``import``/``from`` of it, or ``pytest.importorskip("tensorflow")``, outside any
    function or class."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] in ("tensorflow", "keras") for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("tensorflow", "keras"):
                return True
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args and \
                    isinstance(node.args[0], ast.Constant) and str(node.args[0].value).split(".")[0] in ("tensorflow", "keras"):
                return True
    return False


def test_no_test_file_imports_tensorflow_into_the_suites_process_as_it_is_collected(tmp_path):
    """TensorFlow loaded into the pytest process before Triton makes Triton's later load there abort
    the whole run (LLVM's command-line options registered twice: docs/tensorflow.md), so a test file
    may ask whether TensorFlow is installed (``importlib.util.find_spec``), never import it at module
    level: its TensorFlow work runs in processes of its own."""
    bad = tmp_path / "test_bad.py"
    bad.write_text('import pytest\n\npytest.importorskip("tensorflow")\n')
    assert _imports_tensorflow_when_collected(bad)  # the check can fail
    fine = tmp_path / "test_fine.py"
    fine.write_text('import importlib.util\n\ndef test_x():\n    import tensorflow\n')
    assert not _imports_tensorflow_when_collected(fine)
    tests = ROOT / "tests"
    found = [str(p.relative_to(ROOT)) for p in sorted(tests.rglob("*.py"))
             if (p.name.startswith("test_") or p.name == "conftest.py") and _imports_tensorflow_when_collected(p)]
    assert not found, f"these test files import TensorFlow as pytest collects them: {found}"


def test_every_test_file_has_a_name_of_its_own():
    """pytest imports test files by their base name (the test folders are not packages): two files of
    one name in different folders stop the whole run at collection, which ``make check`` (the unit
    tier alone) would not show."""
    seen: dict[str, str] = {}
    twice = []
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = str(p.relative_to(ROOT))
        if p.name in seen:
            twice.append(f"{seen[p.name]} and {rel}")
        seen[p.name] = rel
    assert not twice, f"test files sharing a name: {twice}"
