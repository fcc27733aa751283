"""Whether this machine can build testbed hosts (ddl_triton/testbed/), probed once for every test
module that needs them; what a real-host test does where it cannot (skip with the reason, or fail
under CI); and the network namespaces that exist (to check a testbed left none).

A real-host test that skips passes nothing. Where the environment sets ``CI_REQUIRE_REAL_HOSTS=1``
(``.ci/run`` does), a real-host test that would skip because hosts cannot be built fails instead:
tests/conftest.py turns every such skip into a failure, however the test skipped (this module's
``skip_unless_available``, or a ``skipif``/``pytest.skip`` with ``UNAVAILABLE`` as its reason).
"""
from __future__ import annotations

import os
import subprocess

import pytest

from ddl_triton.testbed import TestbedUnavailable, check_available

REQUIRE_VARIABLE = "CI_REQUIRE_REAL_HOSTS"  # not DDL_*: those are ddl_triton's options

try:
    check_available()
    UNAVAILABLE = ""  # the machine builds hosts
except TestbedUnavailable as e:
    UNAVAILABLE = str(e)  # the one-line reason, which every real-host test skips with


def required(environ=os.environ) -> bool:
    """Whether real hosts are required (``CI_REQUIRE_REAL_HOSTS=1``); ValueError for a value that
    is neither ``1`` nor ``0``/empty, so that a typo cannot turn the requirement off."""
    value = environ.get(REQUIRE_VARIABLE, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{REQUIRE_VARIABLE}={value!r}: expected 1 (real-host tests must run) or 0")
    return value == "1"


def skip_unless_available() -> None:
    """In a test or fixture: skip with the reason where this machine cannot build hosts (under
    ``CI_REQUIRE_REAL_HOSTS=1``, fail with it instead)."""
    if UNAVAILABLE:
        if required():
            pytest.fail(failure_message(UNAVAILABLE), pytrace=False)
        pytest.skip(UNAVAILABLE)


def failure_message(reason: str) -> str:
    """What a real-host test that could not run says under ``CI_REQUIRE_REAL_HOSTS=1``."""
    return f"{REQUIRE_VARIABLE}=1 and this real-host test could not run: {reason}"


def is_unavailable_skip(reason: str) -> bool:
    """Whether a skip's reason (as pytest reports it, maybe prefixed ``"Skipped: "``) is the
    machine's inability to build hosts (``UNAVAILABLE``)."""
    return bool(UNAVAILABLE) and reason.removeprefix("Skipped: ") == UNAVAILABLE


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}
