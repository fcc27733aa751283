"""One device check for a single NVIDIA GPU (an H200): correctness first, then kernel bandwidth.

    python bench/gpu_check.py [--json PATH] [--quick] [--sections "cuda tests,cuda ranks,..."]

Sections, each wrapped so that a failure in one does not stop the others:

1. install      if ``.whl/`` exists at the repository root, pip installs its wheels (nvshmem4py, and
                the ``mpich`` and ``mpi4py`` wheels: MPI for the GPU path) under the prefix
                /tmp/ddl-gpu-prefix (no index, no dependencies; a prefix, not ``--target``, because
                pip's ``--target`` drops the ``mpich`` wheel's lib/, where libmpi lives), and puts
                its site-packages, lib/ and bin/ first on the paths of this process's children.
                A ``cuda_core`` wheel there is installed only when nvshmem.core does not import
                with the machine's own. The project itself is made importable from the checkout
                when it is not installed (see ``make_project_importable``).
2. cuda tests   ``pytest -q --noconftest tests/gpu/test_gpu.py`` in a child process without
                TRITON_INTERPRET, so the Triton kernels run compiled (tests/conftest.py would set
                TRITON_INTERPRET=1 for the CPU tier, hence --noconftest).
3. cuda ranks   ``mpiexec -n 2 tests/gpu/cuda_ranks_worker.py`` with ``DDL_TRANSPORT=mpi``: two ranks on
                the one GPU through the GPU path with host-staged MPI (transports/mpi_device.py):
                every schedule, the other collectives, the compressed allreduces (bitwise the torch
                reference kernels' on the GPU, and int8's bitwise the CPU path's) and DDP on the
                "ddl" backend; its exact checks' count and failures.
4. bandwidth    device copy bandwidth (clone of a 1 GiB tensor, GB/s = 2 * bytes / median time), then
                the reduce kernel (fp32, bf16) and the int8 kernels at >= 1 GiB per input, each against
                the same operation written with plain torch ops. Every time is measured by
                ``ddl_triton.kernels.bandwidth.measure``, as bench/kernels.py measures: CUDA events
                around single calls, L2 flushed before each, ours and torch's alternating.
                A kernel row says PASS when it reaches >= 85% of the copy bandwidth at >= 1 GiB (the
                acceptance bar); below it is reported, not failed. Each kernel's output is also
                compared with the torch result (a wrong result is a failure: its speed would mean
                nothing). ``--quick`` halves the kernel sizes (the copy stays at 1 GiB), so its
                verdicts are indicative only.
5. nvshmem      ``ddl_triton.transports.nvshmem.smoke_test()`` at 1 PE, in a child process: NVSHMEM
                can end its process on an error, and its init/finalize state must not leak into the
                other sections. One row per check it reports. This section and the two after it are
                skipped, with the import error, when nvshmem4py cannot be imported.
6. collectives  world size 1 (a singleton MPI process, no mpiexec) through
                ``ddl.init(transport="nvshmem")``: allreduce (sum, max), reduce_scatter, all_gather and
                broadcast on integer-valued CUDA tensors, each compared with ``torch.equal`` against the
                exact world-size-1 result, in a child process.
7. nvshmem x2   the cuda ranks worker at 2 ranks, two PEs on the one GPU (NVSHMEM's LIMITED MPG mode
                without MPS): with ``DDL_TRANSPORT=auto`` it must pass (over MPI, with the reason);
                with ``DDL_TRANSPORT=nvshmem`` it must pass or refuse on every rank with an error
                naming the mode, never end inside NVSHMEM.

A short table (section, item, value, verdict) is printed last, then the overall verdict; the JSON
file (``--json``, default gpu_check.json in the current directory, rewritten after each section, so
that a run cut short keeps what it measured) holds every number and the environment. The verdict and
exit status (``Report.verdict``): FAIL, 1, when a correctness check failed or could not complete;
else INCOMPLETE, 3, when a section that was asked for (or a measurement within one) was skipped,
whatever the reason (no nvshmem4py, no MPI, running late): what did not run was not checked; else
PASS, 0. The whole run keeps under 8 minutes: each section checks the time left first and is skipped,
with the reason printed, when too little is left.

Without a CUDA GPU (``torch.cuda.is_available()`` false) every section prints that it is skipped,
the JSON is written with ``"gpu": false``, the last line is ``no GPU: skipped`` and the exit status 3
(INCOMPLETE: nothing was checked), in a few seconds: only torch and the standard library are imported
at the top; triton, ddl_triton and nvshmem are imported inside the GPU path.
"""
from __future__ import annotations

import argparse
import glob
import importlib.abc
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

THIS_FILE = Path(__file__).resolve()
REPO_ROOT = THIS_FILE.parent.parent
WHEEL_DIR = REPO_ROOT / ".whl"
WHEEL_PREFIX = "/tmp/ddl-gpu-prefix"
WHEEL_SITE = f"{WHEEL_PREFIX}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
RANKS_WORKER = REPO_ROOT / "tests" / "gpu" / "cuda_ranks_worker.py"
GPU_TEST_FILE = REPO_ROOT / "tests" / "gpu" / "test_gpu.py"

TIME_LIMIT_S = 8 * 60
RESULT_MARKER = "GPU_CHECK_RESULT "  # a child's one JSON result line starts with this
GIB = 1 << 30
DEVICE = "cuda"
COPY_BAR = 0.85  # a kernel passes at >= 85% of the device copy bandwidth (the acceptance bar)
BANDWIDTH_MIN_CALLS = 10      # timed calls of each side, at least (bandwidth.measure's min_calls)
BANDWIDTH_MIN_SECONDS = 0.2   # and seconds of timed rounds, at least (up to 10 x min_calls calls)
INT8_BLOCK = 256
COLLECTIVE_SIZES = (0, 1, 7, 4099, 1 << 20)

# Seconds each section may take at most (a child past it is killed and reported as timed out).
CUDA_TESTS_BUDGET_S = 200
RANKS_BUDGET_S = 120
SMOKE_BUDGET_S = 40
COLLECTIVES_BUDGET_S = 60
NVSHMEM_RANKS_BUDGET_S = 60
FINISH_RESERVE_S = 15  # table and JSON
# The environment of the two-PE NVSHMEM run on one GPU (shared/GPU_NOTES.md): no multicast, no
# remote transport, the UID bootstrap on loopback, a small symmetric heap.
NVSHMEM_ONE_GPU_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "none",
                       "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo", "NVSHMEM_SYMMETRIC_SIZE": "536870912"}

SECTIONS = ("install", "cuda tests", "cuda ranks", "bandwidth", "nvshmem smoke", "collectives", "nvshmem x2")


# --------------------------------------------------------------------------------------------
# making the project and nvshmem4py importable
# --------------------------------------------------------------------------------------------

class _RepoLayoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``ddl_triton.transports`` and ``ddl_triton.schedules`` in the checkout's top-level
    transports/ and schedules/ folders, as pyproject's package-dir mapping does for an installed
    copy. Without it a bare checkout on sys.path cannot import ddl_triton (its __init__ imports
    .transports). Appended to sys.meta_path, so an installed copy is always found first."""

    def __init__(self, root: Path):
        self.folders = {"ddl_triton.transports": root / "transports", "ddl_triton.schedules": root / "schedules"}

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is None or not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def make_project_importable() -> str:
    """Make ``import ddl_triton`` work here; returns how it is found."""
    how = "installed"
    if importlib.util.find_spec("ddl_triton") is None:
        sys.path.append(str(REPO_ROOT))  # after everything else: never shadows an installed copy
        how = f"checkout {REPO_ROOT} (added to sys.path)"
    if not any(isinstance(f, _RepoLayoutFinder) for f in sys.meta_path):
        sys.meta_path.append(_RepoLayoutFinder(REPO_ROOT))
    return how


_WHEELS_INSTALLED = False


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every child process: compiled Triton kernels, and the wheels' prefix
    first on the paths once they are installed (site-packages, libmpi, mpiexec)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if _WHEELS_INSTALLED:
        for var, path in (("PYTHONPATH", WHEEL_SITE), ("LD_LIBRARY_PATH", f"{WHEEL_PREFIX}/lib"),
                          ("PATH", f"{WHEEL_PREFIX}/bin")):
            env[var] = os.pathsep.join(p for p in (path, env.get(var)) if p)
    env.update(extra)
    return env


def mpiexec() -> str | None:
    """The mpiexec of the installed mpich wheel, else one on the PATH."""
    ours = Path(WHEEL_PREFIX) / "bin" / "mpiexec"
    if _WHEELS_INSTALLED and ours.exists():
        return str(ours)
    import shutil
    return shutil.which("mpiexec")


def run_child(child: str, timeout_s: float, *extra: str) -> dict:
    """Run ``gpu_check.py --child CHILD`` from the repository root.

    Returns rc, stdout, stderr, timed_out and, when the child printed one, its result line parsed.
    """
    cmd = [sys.executable, str(THIS_FILE), "--child", child, *extra]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
                              timeout=max(1.0, timeout_s))
        out = {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "timed_out": False}
    except subprocess.TimeoutExpired as e:
        out = {"rc": None, "stdout": _text(e.stdout), "stderr": _text(e.stderr), "timed_out": True}
    results = [line[len(RESULT_MARKER):] for line in out["stdout"].splitlines() if line.startswith(RESULT_MARKER)]
    out["result"] = json.loads(results[-1]) if results else None
    return out


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _one_line(text: str, limit: int = 300) -> str:
    """The last non-empty line of an error text, shortened: what a table row can hold."""
    last = next((line.strip() for line in reversed(text.strip().splitlines()) if line.strip()), "")
    return last[:limit]


# --------------------------------------------------------------------------------------------
# the report: rows, numbers, the deadline
# --------------------------------------------------------------------------------------------

EXIT_PASS, EXIT_FAIL, EXIT_INCOMPLETE = 0, 1, 3  # not 2: argparse's usage error


class Report:
    def __init__(self, quick: bool):
        self.start = time.monotonic()
        self.deadline = self.start + TIME_LIMIT_S
        self.quick = quick
        self.rows: list[dict] = []
        self.sections: dict[str, dict] = {}
        self.env: dict = {}
        self.failed = False
        self.skipped: list[str] = []  # "section: item (why)" of each skip outside the install section

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def row(self, section: str, item: str, value, verdict: str, *, failure: bool = False) -> None:
        """One table row; ``failure`` marks a correctness check that failed or could not finish."""
        self.rows.append({"section": section, "item": item, "value": str(value), "verdict": verdict})
        self.failed |= failure
        if verdict == "SKIP" and section != "install":  # install's SKIP rows say why later sections skip
            self.skipped.append(f"{section}: {item} ({value})" if item != "-" else f"{section} ({value})")

    def verdict(self) -> tuple[str, int, str]:
        """(verdict, exit status, why): FAIL if a check failed; INCOMPLETE if anything was skipped
        (what did not run was not checked); PASS only when every section asked for ran and passed."""
        if self.failed:
            return "FAIL", EXIT_FAIL, "a check failed"
        if self.skipped:
            return "INCOMPLETE", EXIT_INCOMPLETE, "skipped: " + "; ".join(self.skipped)
        return "PASS", EXIT_PASS, "every check ran and passed"

    def data(self, section: str) -> dict:
        return self.sections.setdefault(section, {})

    def skip(self, section: str, why: str) -> None:
        """Say that ``section`` did not run, and why: printed, a SKIP row, and in its JSON."""
        print(f"[{section}] skipped: {why}", flush=True)
        self.row(section, "-", why, "SKIP")
        self.data(section)["skipped"] = why

    def run_section(self, name: str, fn, needs_s: float) -> None:
        left = self.remaining()
        if left < needs_s:
            self.skip(name, f"running late: {left:.0f} s of the {TIME_LIMIT_S} s left, this section needs "
                            f"{needs_s:.0f} s")
            return
        print(f"[{name}] ...", flush=True)
        t0 = time.monotonic()
        try:
            fn(self)
        except Exception as e:  # noqa: BLE001 - one section's crash must not stop the others
            traceback.print_exc()
            self.row(name, "exception", f"{type(e).__name__}: {e}", "ERROR", failure=True)
            self.data(name)["error"] = f"{type(e).__name__}: {e}"
        self.data(name)["seconds"] = round(time.monotonic() - t0, 2)
        print(f"[{name}] done in {time.monotonic() - t0:.1f} s", flush=True)

    def print_table(self) -> None:
        width = 64
        table = [(r["section"], r["item"], r["value"] if len(r["value"]) <= width else r["value"][:width - 3] + "...",
                  r["verdict"]) for r in self.rows]
        heads = ("section", "item", "value", "verdict")
        widths = [max([len(h)] + [len(t[i]) for t in table]) for i, h in enumerate(heads)]
        line = "  ".join(h.ljust(w) for h, w in zip(heads, widths))
        print(line)
        print("-" * len(line))
        for t in table:
            print("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip())

    def write_json(self, path: str, gpu: bool) -> None:
        doc = {"gpu": gpu, "quick": self.quick, "elapsed_s": round(time.monotonic() - self.start, 2),
               "verdict": self.verdict()[0], "exit_status": self.verdict()[1], "env": self.env, "sections": self.sections,
               "rows": self.rows}
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {path}", flush=True)


def environment(gpu: bool) -> dict:
    """Versions and device, without importing triton or nvshmem (package metadata only)."""
    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "triton": _dist_version("triton")}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("nvshmem4py", "nvidia-nvshmem")):
            env[name] = dist.version
    if gpu:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu_name=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                   gpu_capability=f"{props.major}.{props.minor}", gpu_memory_gib=round(props.total_memory / GIB, 1),
                   gpu_multiprocessors=props.multi_processor_count)
    return env


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------
# 1. install
# --------------------------------------------------------------------------------------------

_NVSHMEM_PROBE = r"""
import json, importlib.metadata as md
import nvshmem.core
versions = {d.metadata["Name"].lower(): d.version for d in md.distributions()
            if (d.metadata["Name"] or "").lower().startswith(("nvshmem4py", "nvidia-nvshmem"))}
print(json.dumps({"module": getattr(nvshmem.core, "__file__", None), "versions": versions}))
"""


def probe_nvshmem() -> tuple[bool, str]:
    """Whether ``import nvshmem.core`` works in a child process (the import loads the NVSHMEM
    libraries: this process stays free of them). Returns (ok, its JSON or the error's last line)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _NVSHMEM_PROBE], env=child_env(), capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False, "import nvshmem.core took over 60 s"
    if proc.returncode == 0:
        return True, proc.stdout.strip().splitlines()[-1]
    return False, _one_line(proc.stderr) or f"exit status {proc.returncode}"


def _pip_install(wheels: list[str]) -> str:
    """pip-install ``wheels`` under WHEEL_PREFIX; returns "" or the error's last line."""
    # --ignore-installed: the same version in the machine's own site-packages would otherwise count as
    # installed, and nothing would land under the prefix (a warm machine's prefix is overwritten).
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--ignore-installed", "--prefix", WHEEL_PREFIX, *wheels]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "pip install took over 120 s"
    return "" if proc.returncode == 0 else (_one_line(proc.stderr) or f"pip exit status {proc.returncode}")


_MPI_PROBE = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"


def probe_mpi() -> tuple[bool, str]:
    """Whether mpi4py finds an MPI library in a child process: (ok, its version line or the error)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _MPI_PROBE], env=child_env(), capture_output=True, text=True,
                              timeout=60)
    except subprocess.TimeoutExpired:
        return False, "MPI init took over 60 s"
    if proc.returncode == 0:
        return True, proc.stdout.strip().splitlines()[-1]
    return False, _one_line(proc.stderr) or f"exit status {proc.returncode}"


def section_install(report: Report) -> None:
    global _WHEELS_INSTALLED
    data = report.data("install")
    data["ddl_triton"] = make_project_importable()
    spec = importlib.util.find_spec("ddl_triton")
    report.row("install", "ddl_triton", f"{data['ddl_triton']}: {spec.origin if spec else '?'}", "ok")

    wheels = sorted(glob.glob(str(WHEEL_DIR / "*.whl")))
    fallback = [w for w in wheels if os.path.basename(w).startswith("cuda_core")]
    first = [w for w in wheels if w not in fallback]
    data["wheels"] = [os.path.basename(w) for w in wheels]
    if first:
        error = _pip_install(first)
        _WHEELS_INSTALLED = not error
        data["pip_error"] = error
        print(f"pip install --prefix {WHEEL_PREFIX}: {', '.join(map(os.path.basename, first))} -> "
              f"{'ok' if not error else 'failed: ' + error}", flush=True)
        report.row("install", f"{len(first)} wheels from .whl/ -> {WHEEL_PREFIX}",
                   ", ".join(map(os.path.basename, first)) if not error else error, "ok" if not error else "FAILED")
    ok, detail = probe_nvshmem()
    if not ok and fallback and _WHEELS_INSTALLED:
        print(f"nvshmem.core does not import ({detail}); installing {', '.join(map(os.path.basename, fallback))}",
              flush=True)
        error = _pip_install(fallback)
        report.row("install", "fallback wheels", ", ".join(map(os.path.basename, fallback)) if not error else error,
                   "ok" if not error else "FAILED")
        ok, detail = probe_nvshmem() if not error else (False, detail)
    data["nvshmem_importable"] = ok
    if ok:
        info = json.loads(detail)
        data["nvshmem"] = info
        report.env.update(info["versions"])
        versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items()) or "version unknown"
        report.row("install", "nvshmem.core", versions, "ok")
    else:
        data["nvshmem_error"] = detail
        report.row("install", "nvshmem.core", f"not importable ({detail})", "SKIP")
    ok, detail = probe_mpi()
    data["mpi_importable"], data["mpi"] = ok, detail
    report.row("install", "mpi4py", detail, "ok" if ok else "SKIP")


# --------------------------------------------------------------------------------------------
# 2. CUDA test tier
# --------------------------------------------------------------------------------------------

def section_cuda_tests(report: Report) -> None:
    data = report.data("cuda tests")
    # Leave the next section its time; the later ones check what is left when they start.
    timeout = min(CUDA_TESTS_BUDGET_S, report.remaining() - RANKS_BUDGET_S - FINISH_RESERVE_S)
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        child = run_child("pytest", timeout, "--junit", junit)
        counts, failing = _junit_counts(junit) if os.path.exists(junit) else (_summary_counts(child["stdout"]), [])
    output = child["stdout"] + child["stderr"]
    data.update(counts, failing=failing, rc=child["rc"], timed_out=child["timed_out"], timeout_s=round(timeout),
                output_tail=_tail(output, 200))
    summary = _summary_line(output)
    print(summary or "(no pytest summary line)", flush=True)
    value = (f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('errors', 0)} errors, "
             f"{counts.get('skipped', 0)} skipped")
    if child["timed_out"]:
        print(_tail(output), flush=True)
        report.row("cuda tests", "tests/gpu/test_gpu.py", f"timed out after {timeout:.0f} s; {value}", "TIMEOUT",
                   failure=True)
    elif counts.get("failed", 0) or counts.get("errors", 0) or child["rc"] not in (0, 5):
        print(_tail(output), flush=True)
        report.row("cuda tests", "tests/gpu/test_gpu.py", value, "FAIL", failure=True)
        for name in failing[:5]:
            report.row("cuda tests", "failed", name, "FAIL")
    elif counts.get("passed", 0) == 0:
        # On a GPU machine the tier must run: all skipped means the kernels were not tested.
        print(_tail(output), flush=True)
        report.row("cuda tests", "tests/gpu/test_gpu.py", f"{value} (nothing ran: see the skip reasons)", "FAIL",
                   failure=True)
    else:
        report.row("cuda tests", "tests/gpu/test_gpu.py", value, "PASS")


def _junit_counts(path: str) -> tuple[dict, list[str]]:
    root = ElementTree.parse(path).getroot()
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    for suite in root.iter("testsuite"):
        counts["tests"] += int(suite.get("tests", 0))
        counts["failed"] += int(suite.get("failures", 0))
        counts["errors"] += int(suite.get("errors", 0))
        counts["skipped"] += int(suite.get("skipped", 0))
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    failing = []
    for case in root.iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            failing.append(f"{case.get('classname')}::{case.get('name')}: {(problem.get('message') or '')[:400]}")
    return counts, failing


def _summary_counts(output: str) -> dict:
    """Counts from pytest's last line ("3 passed, 1 skipped in 2.0s") when there is no junit file."""
    counts: dict = {}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", _summary_line(output)):
        counts["errors" if word.startswith("error") else word] = int(number)
    return counts


def _summary_line(output: str) -> str:
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)]
    return lines[-1].strip("= ") if lines else ""


def child_pytest(junit: str) -> int:
    make_project_importable()
    import pytest
    # --noconftest: tests/conftest.py sets TRITON_INTERPRET=1 for the CPU tier; here the kernels
    # must run compiled. Nothing else in it concerns test_gpu.py.
    # --durations: the slowest tests (Triton compilation and autotuning included), to keep the tier short.
    return int(pytest.main(["-q", "-rfEs", "--tb=short", "--durations=8", "--noconftest", f"--junitxml={junit}",
                            str(GPU_TEST_FILE)]))


# --------------------------------------------------------------------------------------------
# 3. several ranks on the GPU path (and 7., the same over NVSHMEM)
# --------------------------------------------------------------------------------------------

def launch_ranks(report: Report, section: str, ranks: int, budget_s: float, **env: str) -> dict | None:
    """``mpiexec -n ranks cuda_ranks_worker.py --device cuda`` with ``env``; returns rc, output,
    timed_out, seconds and the worker's summary line, or None (after a SKIP row) without MPI."""
    data = report.data(section)
    launcher = mpiexec()
    if launcher is None or not report.data("install").get("mpi_importable"):
        report.skip(section, f"no MPI ({report.data('install').get('mpi', 'install section did not run')})")
        return None
    timeout = max(1.0, min(budget_s, report.remaining() - FINISH_RESERVE_S))
    cmd = [launcher, "-n", str(ranks), sys.executable, str(RANKS_WORKER), "--device", "cuda"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(**env), capture_output=True, text=True,
                              timeout=timeout)
        run = {"rc": proc.returncode, "output": proc.stdout + proc.stderr, "timed_out": False}
    except subprocess.TimeoutExpired as e:
        run = {"rc": None, "output": _text(e.stdout) + _text(e.stderr), "timed_out": True}
    run["seconds"] = round(time.monotonic() - start, 1)
    run["timeout"] = timeout
    run["summary"] = next((line for line in reversed(run["output"].splitlines()) if line.startswith("cuda ranks:")), "")
    run["ranks"] = ranks
    run["item"] = f"{ranks} ranks, " + ", ".join(f"{k}={v}" for k, v in env.items() if k.startswith("DDL_"))
    data.setdefault("runs", []).append({k: (_tail(v, 80) if k == "output" else v) for k, v in run.items()}
                                       | {"env": env})
    print(_tail(run["output"], 40), flush=True)
    return run


def passed(run: dict) -> bool:
    """The worker exited 0 and its report (tests/support/report.py) has every rank of the world
    asked for, each with world size ``run["ranks"]`` and some checks, and no failure: an
    mpiexec that started singletons would otherwise pass on one rank. Sets ``run["problem"]``."""
    if run["rc"] != 0:
        return False
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    try:
        from support.report import read_report
        # Equal counts per rank are not required here: the worker's GPU-only branches were not run on CPU.
        read_report(run["output"], "cuda ranks", run["ranks"], same_on_every_rank=False)
    except AssertionError as e:
        run["problem"] = str(e).splitlines()[0]
        return False
    finally:
        sys.path.remove(str(REPO_ROOT / "tests"))
    return True


def report_ranks(report: Report, section: str, run: dict) -> None:
    """A PASS row with the count of exact checks, or FAIL rows with the failures / the output's tail."""
    if run["timed_out"]:
        report.row(section, run["item"], f"timed out after {run['timeout']:.0f} s", "TIMEOUT", failure=True)
    elif passed(run):
        report.row(section, run["item"], run["summary"].split(", ")[-2] + f" exact, in {run['seconds']:.0f} s", "PASS")
    else:
        report.row(section, run["item"], run.get("problem") or run["summary"]
                   or f"exit status {run['rc']}: {_one_line(run['output'])}", "FAIL", failure=True)
        for line in [line for line in run["output"].splitlines() if line.startswith("FAIL")][:5]:
            report.row(section, "failed", line[5:], "FAIL")
    for line in run["output"].splitlines():  # the worker's path line and timing table, for the JSON
        if line.startswith("allreduce on ") or line.strip().endswith("algbw"):
            report.data(section).setdefault("timings", []).append(line.strip())


def section_cuda_ranks(report: Report) -> None:
    run = launch_ranks(report, "cuda ranks", 2, RANKS_BUDGET_S, DDL_TRANSPORT="mpi")
    if run is not None:
        report_ranks(report, "cuda ranks", run)


def section_nvshmem_ranks(report: Report) -> None:
    """Two PEs on the one GPU: NVSHMEM's LIMITED MPG mode. Under "auto" the GPU path must fall back
    to MPI (and pass); under "nvshmem" it must either work or refuse on every rank with an error
    naming the mode, never end the process inside NVSHMEM."""
    section = "nvshmem x2"
    missing = _nvshmem_missing(report)
    if missing:
        report.skip(section, missing)
        return
    quick = dict(CUDA_RANKS_STAGES="others", **NVSHMEM_ONE_GPU_ENV)
    run = launch_ranks(report, section, 2, NVSHMEM_RANKS_BUDGET_S / 2, DDL_TRANSPORT="auto", **quick)
    if run is None:
        return
    report_ranks(report, section, run)
    path = next((line for line in run["output"].splitlines() if line.startswith("allreduce on ")), "")
    report.row(section, "auto: intra-node path", path.split("intra-node: ")[-1] if path else "?", "info")
    run = launch_ranks(report, section, 2, NVSHMEM_RANKS_BUDGET_S / 2, DDL_TRANSPORT="nvshmem", **quick)
    if passed(run):
        report_ranks(report, section, run)
    elif "LIMITED MPG mode" in run["output"] and "not supported with limited MPG" not in run["output"]:
        report.row(section, run["item"], "refused on every rank: " + _one_line(
            "\n".join(line for line in run["output"].splitlines() if "LIMITED MPG mode" in line)), "PASS")
    else:
        report_ranks(report, section, run)
        if not run["timed_out"]:
            report.row(section, "expected", "a clear refusal naming LIMITED MPG mode, or a pass", "FAIL", failure=True)


# --------------------------------------------------------------------------------------------
# 3. NVSHMEM smoke at 1 PE
# --------------------------------------------------------------------------------------------

def _nvshmem_missing(report: Report) -> str | None:
    """Why the NVSHMEM sections cannot run, or None when nvshmem.core imports."""
    install = report.data("install")
    if install.get("nvshmem_importable"):
        return None
    return f"nvshmem4py not importable ({install.get('nvshmem_error', 'install section did not run')})"


def _run_nvshmem_child(report: Report, section: str, child_name: str, budget_s: float, item: str) -> dict | None:
    """Run child ``child_name`` for ``section`` when nvshmem4py imports; returns its result, or
    None after reporting why there is none (a SKIP row, or a FAIL row with the output's tail)."""
    data = report.data(section)
    missing = _nvshmem_missing(report)
    if missing:
        report.skip(section, missing)
        return None
    child = run_child(child_name, min(budget_s, report.remaining() - FINISH_RESERVE_S))
    result = child["result"]
    data.update(rc=child["rc"], timed_out=child["timed_out"], result=result)
    if result is None:
        why = "timed out" if child["timed_out"] else f"exit status {child['rc']}, no result"
        print(_tail(child["stdout"] + child["stderr"]), flush=True)
        data["output_tail"] = _tail(child["stdout"] + child["stderr"], 40)
        report.row(section, item, f"{why}: {_one_line(child['stderr'])}", "FAIL", failure=True)
        return None
    data["output_tail"] = _tail(child["stderr"], 40)
    return result


def section_nvshmem_smoke(report: Report) -> None:
    result = _run_nvshmem_child(report, "nvshmem smoke", "smoke", SMOKE_BUDGET_S, "smoke_test()")
    if result is None:
        return
    report.row("nvshmem smoke", "init status", result.get("init_status"), "info")
    checks = result.get("checks") or {}
    for name, ok in checks.items():
        report.row("nvshmem smoke", name, "ok" if ok else "failed", "PASS" if ok else "FAIL", failure=not ok)
    if result.get("error"):
        report.row("nvshmem smoke", "error", result["error"], "FAIL", failure=True)
    elif not checks:
        report.row("nvshmem smoke", "checks", "smoke_test() reported no checks", "FAIL", failure=True)


def child_smoke() -> int:
    make_project_importable()
    try:
        from ddl_triton.transports.nvshmem import smoke_test
        result = smoke_test()
    except Exception as e:  # noqa: BLE001 - reported as a failed row by the parent
        traceback.print_exc()
        result = {"init_status": "not run", "checks": {}, "error": f"{type(e).__name__}: {e}"}
    print(RESULT_MARKER + json.dumps(result, default=str), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# 4. collectives at world size 1 through the NVSHMEM path
# --------------------------------------------------------------------------------------------

def section_collectives(report: Report) -> None:
    result = _run_nvshmem_child(report, "collectives", "collectives", COLLECTIVES_BUDGET_S, "world size 1")
    if result is None:
        return
    failures = result["failures"]
    value = f"{result['checks']} checks, {len(failures)} failures"
    if result.get("transport_bytes"):
        value += f"; bytes by transport {result['transport_bytes']}"
    bad = bool(failures) or bool(result.get("error")) or result["checks"] == 0
    report.row("collectives", f"world size {result.get('world_size', '?')}, transport=nvshmem", value,
               "FAIL" if bad else "PASS", failure=bad)
    for failure in failures[:5]:
        report.row("collectives", "failed", failure, "FAIL")
    if result.get("error"):
        report.row("collectives", "error", result["error"], "FAIL")


def _integer_valued(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Integers in [-100, 100] (exact in bf16), made on the CPU so every run sees the same data."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-100, 101, (n,), generator=g).to(dtype).to(DEVICE)


def _poisoned_like(t: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """An output buffer whose unwritten elements cannot equal a correct result."""
    out = torch.empty(t.numel() if n is None else n, dtype=t.dtype, device=t.device)
    return out.fill_(float("nan") if t.dtype.is_floating_point else torch.iinfo(t.dtype).min)


def child_collectives() -> int:
    make_project_importable()
    import ddl_triton as ddl

    result: dict = {"checks": 0, "failures": [], "error": None}

    def check(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        result["checks"] += 1
        if actual.dtype != expected.dtype or not torch.equal(actual, expected):
            result["failures"].append(name)

    try:
        torch.cuda.set_device(0)
        comm = ddl.init(transport="nvshmem")
        result["world_size"] = comm.size
        if comm.size != 1:
            raise RuntimeError(f"expected world size 1 (run without mpiexec), got {comm.size}")
        seed = 0
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            for n in COLLECTIVE_SIZES:
                seed += 1
                data = _integer_valued(n, dtype, seed)
                what = f"{str(dtype).replace('torch.', '')} n={n}"
                # At world size 1 every collective's exact result is its own input.
                for op in ("sum", "max"):
                    t = data.clone()
                    comm.allreduce(t, op=op)
                    check(f"allreduce {op} {what}", t, data)
                out = _poisoned_like(data)
                comm.reduce_scatter(out, data.clone(), op="sum")
                check(f"reduce_scatter sum {what}", out, data)
                out = _poisoned_like(data, n * comm.size)
                comm.all_gather(out, data)
                check(f"all_gather {what}", out, data)
                t = data.clone()
                comm.broadcast(t, root=0)
                check(f"broadcast {what}", t, data)
        torch.cuda.synchronize()
        result["transport_bytes"] = comm.transport_bytes
    except Exception as e:  # noqa: BLE001 - reported as a failed row by the parent
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        try:
            ddl.finalize()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result["error"] = result["error"] or f"finalize: {type(e).__name__}: {e}"
    print(RESULT_MARKER + json.dumps(result, default=str), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# 5. kernel bandwidth against the device copy and plain torch ops
# --------------------------------------------------------------------------------------------

def section_bandwidth(report: Report) -> None:
    make_project_importable()
    import ddl_triton.kernels as K
    from ddl_triton.kernels.bandwidth import CLOCKS, measure as measure_calls
    from kernels import quantize_int8_torch_ops  # bench/kernels.py, beside this script

    K.set_backend("auto")  # CUDA tensors -> the Triton kernels
    data = report.data("bandwidth")
    data["timer"] = (f"ddl_triton.kernels.bandwidth ({CLOCKS['cuda']}): median of single calls, at least "
                     f"{BANDWIDTH_MIN_CALLS} calls and {BANDWIDTH_MIN_SECONDS} s, ours and torch's alternating")
    data["rows"] = []

    def timed(fns, nbytes: int):
        """One measurement per fn (compilation and autotuning happen in its untimed first call)."""
        return measure_calls(fns, nbytes, device=DEVICE, min_calls=BANDWIDTH_MIN_CALLS,
                             min_seconds=BANDWIDTH_MIN_SECONDS)

    # Roofline: a 1 GiB clone reads and writes 1 GiB, also with --quick.
    src = torch.empty(GIB // 4, dtype=torch.float32, device=DEVICE).normal_()
    (copy_t,) = timed([lambda: src.clone()], 2 * GIB)
    copy_gbps = copy_t.gbps
    del src
    data["copy"] = {"bytes_per_tensor": GIB, "bytes_moved": 2 * GIB, "median_ms": copy_t.p50_ms, "gbps": copy_gbps}
    report.row("bandwidth", "device copy (clone 1 GiB)", f"{copy_gbps:.0f} GB/s", "roofline")

    per_input = GIB // 2 if report.quick else GIB  # bytes per kernel input
    data["bytes_per_input"] = per_input

    def measure(item: str, nbytes: int, ours, theirs, same_result=None) -> None:
        if report.remaining() < FINISH_RESERVE_S + 10:
            report.row("bandwidth", item, f"running late: {report.remaining():.0f} s left", "SKIP")
            return
        ours_t, torch_t = timed([ours, theirs], nbytes)
        ours_ms, torch_ms = ours_t.p50_ms, torch_t.p50_ms
        ours_gbps, torch_gbps = ours_t.gbps, torch_t.gbps
        fraction = ours_gbps / copy_gbps
        at_bar_size = per_input >= GIB
        if fraction >= COPY_BAR:
            verdict = "PASS" if at_bar_size else "PASS (quick: < 1 GiB)"
        else:
            verdict = f"below {COPY_BAR:.0%}" + ("" if at_bar_size else " (quick: < 1 GiB)")
        entry = {"kernel": item, "bytes_moved": nbytes, "ours_median_ms": ours_ms, "ours_gbps": ours_gbps,
                 "fraction_of_copy": fraction, "torch_median_ms": torch_ms, "torch_gbps": torch_gbps,
                 "ours_over_torch": ours_gbps / torch_gbps, "meets_bar": fraction >= COPY_BAR and at_bar_size}
        if same_result is not None:
            # A bandwidth number from a kernel that wrote the wrong result would mean nothing.
            entry["result_matches_torch"] = bool(same_result())
            if not entry["result_matches_torch"]:
                report.row("bandwidth", item, "kernel result differs from the torch result", "FAIL", failure=True)
        data["rows"].append(entry)
        report.row("bandwidth", item, f"{ours_gbps:.0f} GB/s = {fraction:.0%} of copy; torch {torch_gbps:.0f} GB/s "
                   f"(x{ours_gbps / torch_gbps:.2f})", verdict)

    # reduce: out = a + b, 2 reads + 1 write of n elements.
    for dtype in (torch.float32, torch.bfloat16):
        n = per_input // torch.empty(0, dtype=dtype).element_size()
        a = torch.randn(n, device=DEVICE).to(dtype)
        b = torch.randn(n, device=DEVICE).to(dtype)
        out, expected = torch.empty_like(a), torch.empty_like(a)
        torch.add(a, b, out=expected)
        measure(f"reduce sum {str(dtype).replace('torch.', '')} k=2", 3 * n * a.element_size(),
                lambda: K.reduce(out, [a, b], op="sum"), lambda: torch.add(a, b, out=expected),
                lambda: torch.equal(out, expected))
        del a, b, out, expected
        torch.cuda.empty_cache()

    # int8, block 256, bytes counted as in bench/kernels.py: what each must read + write.
    n = per_input // 4
    n_blocks = n // INT8_BLOCK
    x = torch.randn(n, device=DEVICE)
    q, scales = K.quantize_int8(x, block=INT8_BLOCK)

    def quantize_matches():
        q_ref, s_ref = K.quantize_int8_reference(x, block=INT8_BLOCK)
        return torch.equal(q, q_ref) and torch.equal(scales, s_ref)

    measure("quantize_int8 fp32", 4 * n + n + 4 * n_blocks, lambda: K.quantize_int8(x, block=INT8_BLOCK),
            lambda: quantize_int8_torch_ops(x, INT8_BLOCK), quantize_matches)
    del x
    torch.cuda.empty_cache()
    out = torch.empty(n, device=DEVICE)
    out_torch = torch.empty(n, device=DEVICE)
    measure("dequantize_int8 -> fp32", n + 4 * n_blocks + 4 * n,
            lambda: K.dequantize_int8(q, scales, out=out, block=INT8_BLOCK),
            lambda: torch.mul(q.view(-1, INT8_BLOCK), scales[:, None], out=out_torch.view(-1, INT8_BLOCK)),
            lambda: torch.equal(out, out_torch))
    del q, scales, out, out_torch
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", default="gpu_check.json", help="results file (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="half the kernel sizes (the copy stays at 1 GiB)")
    ap.add_argument("--sections", default=",".join(SECTIONS[1:]),
                    help="comma-separated sections to run after install (default: all): %(default)s")
    # Internal: the parts that run in child processes.
    ap.add_argument("--child", choices=["pytest", "smoke", "collectives"], help=argparse.SUPPRESS)
    ap.add_argument("--junit", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child == "pytest":
        return child_pytest(args.junit)
    if args.child == "smoke":
        return child_smoke()
    if args.child == "collectives":
        return child_collectives()

    wanted = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in SECTIONS[1:]]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; valid: {', '.join(SECTIONS[1:])}")
    report = Report(args.quick)
    gpu = torch.cuda.is_available()
    report.env = environment(gpu)
    if not gpu:
        for name in SECTIONS:
            report.skip(name, "no CUDA GPU")
        report.write_json(args.json, gpu=False)
        print("no GPU: skipped")
        return report.verdict()[1]

    print(f"GPU: {report.env['gpu_name']}, {report.env['gpu_memory_gib']} GiB; torch {torch.__version__}, "
          f"triton {report.env['triton']}", flush=True)
    runs = {"cuda tests": (section_cuda_tests, 60), "cuda ranks": (section_cuda_ranks, 30),
            "bandwidth": (section_bandwidth, 30), "nvshmem smoke": (section_nvshmem_smoke, 20),
            "collectives": (section_collectives, 30), "nvshmem x2": (section_nvshmem_ranks, 20)}
    report.run_section("install", section_install, needs_s=60)
    for name in SECTIONS[1:]:
        if name in wanted:
            fn, needs = runs[name]
            report.run_section(name, fn, needs_s=needs + FINISH_RESERVE_S)
            report.write_json(args.json, gpu=True)  # so far: a run cut short still leaves its results
    verdict, status, why = report.verdict()
    report.row("overall", "correctness", why, verdict)
    report.write_json(args.json, gpu=True)
    print()
    report.print_table()
    print(f"{verdict} (exit {status}): {why}")
    return status


if __name__ == "__main__":
    sys.exit(main())
