"""The package as its users get it: an sdist and a wheel built from a clean copy of the tree,
the wheel installed into a fresh venv, and everything run from that installed copy, never the
checkout (a wheel once lacked ddl_triton.torch.elastic while every test of the checkout passed).

- The build (``python -m build --no-isolation``: the sdist, then the wheel from the unpacked sdist,
  so the sdist must be complete too) prints no warning, and the wheel holds exactly the files of
  the tree's package folders (``support.package_tree``), nothing missing and nothing else.
- In the fresh venv, every module the wheel holds imports, each from the venv's site-packages.
- The venv's own ``ddlrun`` runs a 2-rank job (``installed_wheel_worker.py``): ddl_triton, its
  rank guard and ``from ddl_triton.torch import elastic`` come from the venv, an allreduce is exact.

The fresh venv has no pip and downloads nothing: the wheel goes in with ``--no-deps``, and one
``.pth`` line adds this venv's site-packages after the new one's, for torch, mpi4py and the rest.
A directory added by a ``.pth`` line gets no ``.pth`` processing of its own, so this venv's editable
install of the checkout (a ``.pth`` import hook) stays out; the tests check where each module came
from. Everything runs with its working directory outside the checkout and without PYTHONPATH.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.launch import TESTS, ddl_segments, mpiexec
from support.package_tree import ROOT, read_layout, tree, tree_files
from support.report import read_report


@dataclass
class Installed:
    work: Path            # outside the checkout: every command runs here
    build_output: str
    sdist: Path
    wheel: Path
    python: Path          # the fresh venv's interpreter
    site: Path            # its site-packages, where the wheel went


def _env() -> dict[str, str]:
    # PYTHONDONTWRITEBYTECODE (set on some machines) makes setuptools warn that it skips byte-compiling.
    drop = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "PYTHONHOME")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"OMP_NUM_THREADS": "1", "DDL_TIMEOUT": "60"}


def _run(cmd: list, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    work = tmp_path_factory.mktemp("installed_wheel").resolve()
    assert ROOT not in work.parents, f"{work} is inside the checkout"
    clean = work / "clean"  # what a clone holds (plus uncommitted edits): no build/, no egg-info, no venv
    for f in tree():
        (clean / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, clean / f)
    built = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", work / "dist", clean], work)
    sdist, = (work / "dist").glob("*.tar.gz")
    wheel, = (work / "dist").glob("*.whl")
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], work)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work).stdout.strip())
    ours = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "_dependencies_from_the_test_venv.pth").write_text("".join(p + "\n" for p in ours))
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index", wheel], work)
    _link_mpich(site)
    return Installed(work, built.stdout + built.stderr, sdist, wheel, python, site)


def _link_mpich(site: Path) -> None:
    """Link the files the mpich wheel put outside site-packages (mpiexec and hydra's helpers in bin/,
    libmpi in lib/) into the fresh venv, each where that wheel would have put it there: mpi4py looks
    for libmpi under the running venv's prefix, and ddlrun for the mpiexec beside the interpreter
    (the only one the suite runs: support/launch.py; ``mpiexec()`` checks this venv's first)."""
    mpiexec()
    for f in importlib.metadata.distribution("mpich").files or []:
        if f.parts[0] == "..":
            link = Path(os.path.normpath(site / f))
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path(f.locate()).resolve())


def test_the_build_prints_no_warning(installed):
    warnings = [line for line in installed.build_output.splitlines() if re.search(r"warn|!!", line, re.I)]
    assert not warnings, "the build printed warnings:\n" + "\n".join(warnings[:40])


def test_the_wheel_holds_every_file_of_the_tree_and_nothing_else(installed):
    with zipfile.ZipFile(installed.wheel) as z:
        held = {n for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}
        entry_points = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    want = tree_files(read_layout(), tree())
    assert not want - held, f"the wheel lacks {sorted(want - held)}"
    assert not held - want, f"the wheel holds files the tree's package folders do not: {sorted(held - want)}"
    assert "ddlrun = ddl_triton.launch.ddlrun:main" in entry_points, entry_points
    with tarfile.open(installed.sdist) as t:
        top = t.getnames()[0].split("/")[0]
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md"} <= in_sdist, f"{top}: {sorted(in_sdist)[:20]}"


_IMPORT_ALL = """
import importlib, json, sys
result = {}
for name in sys.argv[1:]:
    try:
        result[name] = getattr(importlib.import_module(name), "__file__", None)
    except BaseException as e:  # SystemExit included: an example must not run on import
        result[name] = "FAILED: " + repr(e)[:300]
print(json.dumps(result))
"""


def test_every_module_of_the_wheel_imports_from_the_installed_copy(installed):
    with zipfile.ZipFile(installed.wheel) as z:
        modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in z.namelist()
                         if n.endswith(".py") and not n.split("/")[0].endswith(".dist-info"))
    assert "ddl_triton.torch.elastic" in modules and len(modules) > 100, modules
    out = _run([installed.python, "-c", _IMPORT_ALL, *modules], installed.work, timeout=240).stdout
    files = json.loads(out.strip().splitlines()[-1])
    failed = {m: f for m, f in files.items() if f is None or f.startswith("FAILED")}
    assert not failed, f"{len(failed)} of {len(modules)} modules failed to import: {failed}"
    site = str(installed.site.resolve()) + os.sep
    outside = {m: f for m, f in files.items() if not os.path.realpath(f).startswith(site)}
    assert not outside, f"imported from outside the fresh venv's {site}: {outside}"


def test_a_two_rank_job_runs_from_the_installed_copy(installed):
    before = ddl_segments()
    ddlrun = installed.python.parent / "ddlrun"
    assert ddlrun.exists(), "the wheel's console scripts were not installed"
    proc = subprocess.run([str(ddlrun), "-n", "2", "--", str(installed.python),
                           str(TESTS / "multirank" / "installed_wheel_worker.py"), str(installed.site)],
                          cwd=installed.work, env=_env(), capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    read_report(proc.stdout, "installed_wheel_worker", 2)
    guard = str(installed.site / "ddl_triton" / "launch" / "rank_guard.py")
    launcher = str(installed.python.parent / "mpiexec")
    assert f"ddlrun: {launcher} " in proc.stderr and guard in proc.stderr, (
        f"ddlrun did not run {launcher} and the installed rank guard {guard}:\n{proc.stderr[-3000:]}")
    leaked = ddl_segments() - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
