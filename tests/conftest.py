import os
from pathlib import Path

# The Triton kernels run on CPU tensors only through the interpreter, and triton reads this
# when it is first imported: set it before any test module imports ddl_triton (and triton).
os.environ["TRITON_INTERPRET"] = "1"

# ddl_triton.init looks for a cached tuning table (ddl-tune's) matching the machine: the suite
# must not pick up one a developer made, so every test, and every rank it launches, looks in
# an empty folder of its own (tests that want a table name one with DDL_TUNING_FILE).
import tempfile  # noqa: E402

import atexit  # noqa: E402
import shutil  # noqa: E402

os.environ["DDL_TUNING_DIR"] = tempfile.mkdtemp(prefix="ddl_triton-test-tuning-")
atexit.register(shutil.rmtree, os.environ["DDL_TUNING_DIR"], True)  # the session's own: gone with it

# Workers that tests launch (mpiexec, ddlrun, torchrun) run as scripts from their own folder and
# import tests/support: every process the suite starts finds it through PYTHONPATH.
_TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH", "")) if p)


# ---- Skips that say why, real-host tests that must run, twins of which one must run ----------------
import pytest  # noqa: E402

from support import twins as _twins  # noqa: E402

_SESSION = {"collected": set(), "selected": set(), "passed": set()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip that does not say why fails; so does a real-host test that skips because this machine
    cannot build hosts, where CI_REQUIRE_REAL_HOSTS=1 (tests/support/real_hosts.py)."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    failure = None
    said = reason.removeprefix("Skipped: ").strip()
    if said in ("", "Skipped") or reason.startswith("condition: "):  # pytest.skip() says "Skipped"
        failure = f"skipped without saying why ({reason!r}): give the skip a reason"
    elif os.environ.get("CI_REQUIRE_REAL_HOSTS"):  # real_hosts.REQUIRE_VARIABLE, without importing it
        from support import real_hosts  # only here: importing it probes the machine (it makes a namespace)
        if real_hosts.required() and real_hosts.is_unavailable_skip(reason):
            failure = real_hosts.failure_message(reason)
    if failure:
        report.outcome = "failed"
        report.longrepr = failure


def pytest_configure(config):
    if os.environ.get("CI_REQUIRE_REAL_HOSTS"):  # a bad value is an error now, not a requirement ignored
        from support import real_hosts
        real_hosts.required()


def pytest_itemcollected(item):
    _SESSION["collected"].add(item.nodeid)


def pytest_collection_finish(session):
    _SESSION["selected"] = {item.nodeid for item in session.items}


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _SESSION["passed"].add(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if a group of twins (tests/support/twins.py) all ran and none passed."""
    if session.shouldstop or session.shouldfail or session.config.option.collectonly:
        return  # stopped early (-x, a signal) or ran nothing: the twins were not all given their turn
    problems = _twins.unrun(_SESSION["collected"], _SESSION["selected"], _SESSION["passed"])
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for line in problems:
            if reporter is not None:
                reporter.write_line(f"ERROR: {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---- The suite's budget: its slowest tests and its total, printed at the end of every run -------------
import resource  # noqa: E402
import time  # noqa: E402

_BUDGET = {"start": time.monotonic(), "tests": []}  # (nodeid, wall seconds, CPU seconds of it and its children)


def _cpu_seconds() -> float:
    """CPU seconds of this process, of its children that have ended (the ranks a test launched), and
    of the reused rank worlds still running (tests/support/rank_world.py; once ended, theirs is
    among the children's)."""
    from support import rank_world
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + rank_world.cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Time each test whole (set-up, call, tear-down: a module fixture's launch counts where it runs)."""
    wall, cpu = time.monotonic(), _cpu_seconds()
    yield
    _BUDGET["tests"].append((item.nodeid, time.monotonic() - wall, _cpu_seconds() - cpu))


def pytest_terminal_summary(terminalreporter):
    """The slowest 15 tests, then the suite's wall time and CPU time (its own and its children's): so
    that growth is seen when it happens (tests cost every change that lands, in CI and here)."""
    tests = _BUDGET["tests"]
    if not tests:
        return
    wall = time.monotonic() - _BUDGET["start"]
    write = terminalreporter.write_line
    write("")
    write(f"the suite's budget: the 15 slowest of {len(tests)} tests (wall s, CPU s of the test and its children)")
    for nodeid, seconds, cpu in sorted(tests, key=lambda t: -t[1])[:15]:
        write(f"{seconds:8.1f} {cpu:8.1f}  {nodeid}")
    write(f"total: {wall:.0f} s wall, {_cpu_seconds():.0f} s CPU (this process and its children; "
          f"{sum(t[1] for t in tests):.0f} s in the tests themselves)")
    from support import rank_world
    c = rank_world.counts
    if c["jobs"]:
        write(f"rank worlds: {c['jobs']} jobs on {c['worlds']} worlds started, {c['ranks']} rank processes "
              f"instead of {c['job_ranks']} (tests/support/rank_world.py)")
