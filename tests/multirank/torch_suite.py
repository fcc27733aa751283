"""torch's own distributed test suite on a backend: ``python tests/multirank/torch_suite.py --backend ddl``.

Runs ``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase``
(the body of torch's test_distributed_spawn.py, about 300 tests) the way torch's CI does:
each test spawns WORLD_SIZE ranks with ``MultiProcessTestCase`` (torch.multiprocessing,
"spawn"), and every rank calls ``dist.init_process_group(backend, init_method="file://...")``.
No MPI launcher is involved: the "ddl" ranks bootstrap from the FileStore torch hands the
backend (ddl_triton/runtime/setup/bootstrap.py).

The same harness runs any backend (``--backend gloo`` for the reference). The suite gates
tests on ``DistTestCases.backend_feature``; "ddl" is declared there for what it implements
(``_DDL_FEATURES``), the same features gloo is declared for. Tests gated on a backend's
name (gloo, nccl, mpi) skip, with that reason.

Prints one line per test (``PASS``/``SKIP reason``/``FAIL first line``), then the counts;
``--json FILE`` writes them; ``-k SUBSTRING`` (repeatable) selects tests by name. Exits 0
when no selected test failed or errored. Each test is bounded (DISTRIBUTED_TESTS_DEFAULT_TIMEOUT,
default here 120 s) and the ranks' own waits by DDL_TIMEOUT (default here 60 s).
"""
from __future__ import annotations

import argparse
import os
import sys


def _configure(backend: str, world_size: int) -> None:
    """The environment torch's suite reads at import (BACKEND, WORLD_SIZE, ...). This process
    and the ranks it spawns only: the harness is never imported by another test session."""
    os.environ["BACKEND"] = backend
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
    os.environ.setdefault("DDL_TIMEOUT", "60")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for var in ("PMI_RANK", "PMI_SIZE", "PMI_FD", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"):
        os.environ.pop(var, None)  # never "launched by MPI": the store is the source of truth


# Spawned ranks import this module as __mp_main__ with the parent's environment: configure
# and declare before torch's suite is imported (its decorators read both at import).
if "BACKEND" in os.environ and __name__ != "__main__":
    _configure(os.environ["BACKEND"], int(os.environ["WORLD_SIZE"]))


# What "ddl" implements, in the suite's vocabulary: DDP, sub-groups, a plugin backend, and
# CUDA tensors ("gpu"/"cuda": the backend is registered for cpu and cuda, like gloo). Several
# CPU tests are gated on the "gpu" set; the GPU ones skip here for want of GPUs, as gloo's do.
_DDL_FEATURES = ("ddp", "subgroup", "plugin", "gpu", "cuda")


def _declare_ddl() -> None:
    import ddl_triton.torch  # noqa: F401  (registers "ddl")
    from torch.testing._internal.common_distributed import DistTestCases

    for feature in _DDL_FEATURES:
        DistTestCases.backend_feature[feature].add("ddl")


def _suite_class():
    _declare_ddl()
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TestWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()

    TestWithSpawn.__module__ = __name__
    TestWithSpawn.__qualname__ = "TestWithSpawn"
    return TestWithSpawn


if "BACKEND" in os.environ:
    TestWithSpawn = _suite_class()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ddl")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", action="append", default=[], help="run tests whose name contains this (repeatable)")
    parser.add_argument("--json", default="", help="write the per-test outcomes and counts here")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the counts of earlier runs side by side, "
                        "and each one's failures and skip reasons, instead of running anything (a later "
                        "file of the same backend, a rerun of some tests, overrides their outcomes)")
    args = parser.parse_args()
    if args.table:
        return _table(args.table)
    _configure(args.backend, args.world_size)
    import json
    import time
    import unittest

    cls = _suite_class()
    globals()["TestWithSpawn"] = cls  # the spawned ranks find the class by this name
    names = sorted(n for n in unittest.TestLoader().getTestCaseNames(cls)
                   if not args.k or any(k in n for k in args.k))
    outcomes: dict[str, dict] = {}
    t_start = time.monotonic()
    for name in names:
        result = unittest.TestResult()
        t0 = time.monotonic()
        cls(name).run(result)
        outcome, detail = "pass", ""
        if result.skipped:
            outcome, detail = "skip", str(result.skipped[0][1])
        elif result.failures or result.errors:
            outcome = "fail"
            detail = _essence((result.failures or result.errors)[0][1])
        outcomes[name] = {"outcome": outcome, "detail": detail, "seconds": round(time.monotonic() - t0, 1)}
        print(f"{outcome.upper():4} {name} ({outcomes[name]['seconds']} s){': ' + detail if detail else ''}",
              flush=True)
    counts = {k: sum(1 for o in outcomes.values() if o["outcome"] == k) for k in ("pass", "skip", "fail")}
    summary = (f"torch_suite: backend {args.backend}, world size {args.world_size}, {len(names)} tests: "
               f"{counts['pass']} passed, {counts['skip']} skipped, {counts['fail']} failed "
               f"({time.monotonic() - t_start:.0f} s)")
    print(summary, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "world_size": args.world_size, "counts": counts,
                       "tests": outcomes}, f, indent=1)
    return 1 if counts["fail"] else 0


def _table(paths: list[str]) -> int:
    """Markdown: one row per run (backend, world size, passed, skipped, failed), then per run the
    failures with their first line and the skip reasons with how many tests each covers."""
    import json
    from collections import Counter

    runs: list[dict] = []
    for path in paths:  # a later run of the same backend (a rerun of some tests) overrides per test
        run = json.load(open(path))
        same = next((r for r in runs if (r["backend"], r["world_size"]) == (run["backend"], run["world_size"])), None)
        if same is None:
            runs.append(run)
        else:
            same["tests"].update(run["tests"])
    for run in runs:
        run["counts"] = {k: sum(1 for t in run["tests"].values() if t["outcome"] == k) for k in ("pass", "skip", "fail")}
    print("| backend | world size | tests | passed | skipped | failed |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        c = run["counts"]
        print(f"| {run['backend']} | {run['world_size']} | {len(run['tests'])} | {c['pass']} | {c['skip']} | {c['fail']} |")
    for run in runs:
        failed = {n: t["detail"] for n, t in run["tests"].items() if t["outcome"] == "fail"}
        print(f"\n{run['backend']}: {len(failed)} failed")
        for name, detail in sorted(failed.items()):
            print(f"- {name}: {detail}")
        reasons = Counter(t["detail"] for t in run["tests"].values() if t["outcome"] == "skip")
        print(f"\n{run['backend']}: skip reasons")
        for reason, n in reasons.most_common():
            print(f"- {n} x {reason}")
    return 0


def _essence(trace: str) -> str:
    """The line of a failure that says what went wrong (the last exception line, first of the ranks')."""
    lines = [ln.strip() for ln in trace.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ("Error" in ln or "Exception" in ln or "assert" in ln.lower()) and not ln.startswith("File "):
            return ln[:400]
    return lines[-1][:400] if lines else ""


if __name__ == "__main__":
    sys.exit(main())
