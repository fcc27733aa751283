"""How an elastic job finds torchrun's exit barrier (ddl_triton/torch/elastic/torchrun_exit.py): the
rendezvous's backend and endpoint, from torchrun's PET_* variables or its command line. The check-in
itself runs across real hosts (tests/multirank/test_elastic_faults.py, kill-torchrun-c10d) and on one
host under the static rendezvous (tests/multirank/test_elastic_one_host.py)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from ddl_triton.torch.elastic import torchrun_exit


@pytest.mark.parametrize("argv", [
    ["python", "-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h1:29400", "t.py"],
    ["torchrun", "--rdzv_backend=c10d", "--rdzv_endpoint=h1:29400", "t.py", "--rdzv-endpoint", "h9:1"],
    ["torchrun", "--rdzv-backend=c10d", "--rdzv_endpoint", "h1:29400", "t.py"],
])
def test_the_rendezvous_is_read_from_torchruns_command_line_in_any_spelling(argv):
    # The first occurrence is torchrun's own: a script's arguments of the same name come after it.
    assert torchrun_exit.launcher_settings({}, argv) == {"rdzv_backend": "c10d", "rdzv_endpoint": "h1:29400"}


def test_torchruns_variables_come_first_and_nothing_is_invented():
    env = {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "[fe80::1]:29400"}
    assert torchrun_exit.launcher_settings(env, ["torchrun", "--rdzv-endpoint", "h9:1"]) == \
        {"rdzv_backend": "c10d", "rdzv_endpoint": "[fe80::1]:29400"}
    assert torchrun_exit.launcher_settings({}, ["torchrun", "--nnodes", "2", "t.py"]) == {}  # static: the default


def test_no_check_in_outside_torchrun_or_without_a_lost_agent(monkeypatch):
    store = dist.HashStore()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not torchrun_exit.check_in_for(1, store, 5.0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    assert not torchrun_exit.check_in_for(0, store, 5.0)


def test_under_the_static_rendezvous_the_check_in_is_the_agents_own_counter(monkeypatch):
    # Two agents of three arrive; the job checks in for the lost one: the last arrival sets the key
    # every agent waits for, as torch's barrier does when all three come.
    from torch.distributed.elastic.utils.store import _barrier_nonblocking

    store = dist.HashStore()
    for name, value in {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "GROUP_WORLD_SIZE": "3", "PET_RDZV_BACKEND": "static", "PET_RDZV_ENDPOINT": "h1:1"}.items():
        monkeypatch.setenv(name, value)
    agents = dist.PrefixStore("job", store)
    assert torchrun_exit.check_in_for(1, store, 5.0)
    _barrier_nonblocking(agents, 3, "torchelastic/agent/terminal_state")
    key = _barrier_nonblocking(agents, 3, "torchelastic/agent/terminal_state")
    assert agents.check([key])
