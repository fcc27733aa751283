"""torchrun's exit barrier after a host was lost: the survivors check in for the lost agents, so that
their own agents exit at once instead of waiting out the barrier (300 s, not settable from torchrun's
command line).

Semantics. Each torchrun agent whose workers succeed waits at exit until every agent of its
rendezvous round has arrived (``torch.distributed.elastic.agent.server.api._exit_barrier``: a
counter in the agents' store, and a key set by the last agent to arrive). The agent of a lost host
never arrives. ``check_in_for(lost, store)`` increments that counter once for each lost agent, as
the agent would have done. Rank 0 of the last world calls it as training ends, before its own agent
gets there. Which store holds the barrier depends on torchrun's rendezvous:

    static (``--master-addr``/``--node-rank``)  the workers' own store, under the run id
    c10d (``--rdzv-backend c10d``)              the rendezvous's store at ``--rdzv-endpoint``, under
                                                "torch.rendezvous.<run id>.<round>"; the round is
                                                the last one whose agents posted their role there

The rendezvous backend and endpoint are read from torchrun's settings: its ``PET_*`` environment
variables, which the workers inherit, else its command line (``/proc/<parent>/cmdline``, the agent
that started this worker, which ``TORCHELASTIC_RUN_ID`` says exists). Only host:port and names are
taken from it; nothing is executed or unpickled, and no value of torchrun's keys is read (the
rendezvous state there is pickled: only whether a key exists is asked). Written against torch 2.13's
key names; under another layout the check-in finds nothing to do, and the agents wait out their
barrier as they would without it.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

_BARRIER = "torchelastic/agent/terminal_state"
_ROLE_INFO = "torchelastic/role_info/"   # each agent of a round posts its role there (api._assign_worker_ranks)
_MAX_ROUNDS = 10_000


def check_in_for(lost: int, workers_store, timeout: float) -> bool:
    """Check in ``lost`` times at the exit barrier of this worker's torchrun agents; True if done.
    ``workers_store``: the store torchrun gave the workers (MASTER_ADDR/MASTER_PORT)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if lost < 1 or not run_id or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    try:
        from torch.distributed.elastic.utils.store import _barrier_nonblocking

        agents = _agents_store(run_id, workers_store, timeout)
        if agents is None:
            return False
        for _ in range(lost):
            _barrier_nonblocking(agents, int(os.environ["GROUP_WORLD_SIZE"]), _BARRIER)
        return True
    except (ImportError, KeyError, ValueError, RuntimeError, OSError):
        return False  # another torch or layout: the agents wait out their barrier, as without this


def _agents_store(run_id: str, workers_store, timeout: float):
    """The store (prefixed) in which this worker's agents keep their exit barrier, or None."""
    settings = launcher_settings()
    backend = settings.get("rdzv_backend", "static")
    if backend == "static":
        return dist.PrefixStore(run_id, workers_store)  # the agents' keys: "<run id>/torchelastic/..."
    if backend != "c10d" or ":" not in settings.get("rdzv_endpoint", ""):
        return None
    host, _, port = settings["rdzv_endpoint"].rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        return None
    rendezvous = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=timeout))
    me = f"{_ROLE_INFO}{int(os.environ['GROUP_RANK'])}"
    round_ = None
    for r in range(_MAX_ROUNDS):
        if not dist.PrefixStore(f"torch.rendezvous.{run_id}.{r}", rendezvous).check([me]):
            break
        round_ = r
    return None if round_ is None else dist.PrefixStore(f"torch.rendezvous.{run_id}.{round_}", rendezvous)


def launcher_settings(environ=None, parent_cmdline: list[str] | None = None) -> dict[str, str]:
    """torchrun's ``rdzv_backend`` and ``rdzv_endpoint``, from its ``PET_*`` variables, else from the
    command line of the agent that started this process (see the module doc). Missing ones are absent."""
    environ = os.environ if environ is None else environ
    out = {name: environ[f"PET_{name.upper()}"] for name in ("rdzv_backend", "rdzv_endpoint")
           if environ.get(f"PET_{name.upper()}")}
    if len(out) == 2:
        return out
    argv = parent_cmdline if parent_cmdline is not None else _parent_cmdline()
    for i, word in enumerate(argv):
        for name in ("rdzv_backend", "rdzv_endpoint"):
            for flag in (f"--{name}", f"--{name.replace('_', '-')}"):
                if word == flag and i + 1 < len(argv):
                    out.setdefault(name, argv[i + 1])
                elif word.startswith(flag + "="):
                    out.setdefault(name, word[len(flag) + 1:])
    return out


def _parent_cmdline() -> list[str]:
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            raw = f.read(1 << 16)
    except OSError:
        return []
    return [w.decode(errors="replace") for w in raw.split(b"\0") if w]
