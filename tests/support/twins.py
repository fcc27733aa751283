"""Tests that stand in for each other: each skips where its twin runs, so a suite in which both
skipped passed while testing neither. tests/conftest.py fails such a session (``unrun``).

Each group names its tests by pytest node id (relative to the repository root).
"""
from __future__ import annotations

TWINS = [
    # Every collective exact across two hosts under torchrun, bytes between them through gloo:
    # on emulated hosts where the machine cannot build real ones, else across two testbed hosts.
    ("tests/multirank/test_torch_launchers.py::"
     "test_two_emulated_hosts_under_torchrun_every_collective_exact_bytes_through_gloo",
     "tests/multirank/test_testbed_torchrun.py::"
     "test_every_collective_exact_grid_detected_and_bytes_between_hosts_through_gloo_only"),
]


def unrun(collected: set[str], selected: set[str], passed: set[str]) -> list[str]:
    """What is wrong with the session's twins, one line each (none: all is well). ``collected``:
    every node id pytest collected (before ``-k`` or ``--deselect``); ``selected``: those it ran;
    ``passed``: those that passed. A twin whose file was collected but which no longer exists (a
    renamed test) is named; a group all of whose members ran, none passing, is named."""
    files = {nodeid.split("::")[0] for nodeid in collected}
    problems = []
    for group in TWINS:
        for member in group:
            if member.split("::")[0] in files and member not in collected:
                problems.append(f"{member} is named as a twin (tests/support/twins.py) but no longer exists")
        if all(member in selected for member in group) and not any(member in passed for member in group):
            problems.append("none of these twins ran and passed (each skips where another runs): " + ", ".join(group))
    return problems
