"""A rank of a job run from an installed wheel, not the checkout (test_installed_wheel.py).

Usage: ``<venv>/bin/ddlrun -n N -- <venv>/bin/python installed_wheel_worker.py SITE_PACKAGES``

Checks that ddl_triton and ``ddl_triton.torch.elastic`` (the room a wheel once
lacked) come from SITE_PACKAGES, that an allreduce of integer-valued tensors gives the exact sum,
and that every ddl_triton module the job loaded came from SITE_PACKAGES; then the closing report.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support.report only

import torch  # noqa: E402

import ddl_triton  # noqa: E402
from ddl_triton.torch import elastic  # noqa: E402 - the issue's line: it failed for anyone who installed the wheel
from support.report import gather_and_report  # noqa: E402


def main() -> int:
    site = os.path.realpath(sys.argv[1]) + os.sep
    failures: list[str] = []
    checks = 0

    def check(ok: bool, what: str) -> None:
        nonlocal checks
        checks += 1
        if not ok:
            failures.append(f"rank {os.environ.get('PMI_RANK', '?')}: {what}")

    def installed(module) -> bool:
        return os.path.realpath(module.__file__).startswith(site)

    check(installed(ddl_triton), f"ddl_triton came from {ddl_triton.__file__}, not {site}")
    check(installed(elastic), f"ddl_triton.torch.elastic came from {elastic.__file__}, not {site}")
    comm = ddl_triton.init()
    for count in (1, 1000, 65537):
        x = torch.full((count,), float(comm.rank + 1))
        comm.allreduce(x)
        want = float(comm.size * (comm.size + 1) // 2)
        check(bool((x == want).all()), f"allreduce of {count}: got {x[:3].tolist()}..., want {want}")
    outside = sorted(name for name, m in list(sys.modules.items()) if name.split(".")[0] == "ddl_triton"
                     and getattr(m, "__file__", None) and not installed(m))
    check(not outside, f"modules loaded from outside {site}: {outside}")
    code = gather_and_report("installed_wheel_worker", failures, checks)
    ddl_triton.finalize()
    return code


if __name__ == "__main__":
    sys.exit(main())
