"""Whether this machine can build testbed hosts (ddl_triton/testbed/), probed once for every test
module that needs them, and the network namespaces that exist (to check a testbed left none)."""
from __future__ import annotations

import subprocess

from ddl_triton.testbed import TestbedUnavailable, check_available

try:
    check_available()
    UNAVAILABLE = ""  # the machine builds hosts
except TestbedUnavailable as e:
    UNAVAILABLE = str(e)  # the one-line reason, which every real-host test skips with


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}
