"""Schedulers' launches across real hosts (the testbed, ddl_triton/testbed/), without a wrapper:
2 hosts x 2 ranks, each process started with only the variables its launcher would set (and
PATH, HOME, OMP_NUM_THREADS=1 and ddl_triton's DDL_TIMEOUT/DDL_TUNING_FILE), no RANK or
MASTER_ADDR of ours: plain ``srun`` (SLURM_* only), Open MPI 4's ``mpirun`` (OMPI_* and PMIX_*, which
would make the project's MPICH abort in MPI_Init) and a Kubeflow PyTorchJob with nprocPerNode 2 (RANK
is the pod's index, WORLD_SIZE counts processes; the pod's command starts its two processes with
LOCAL_RANK 0 and 1). Each rank runs ``dist.init_process_group("ddl")``, exact integer allreduces
and a DDP step with replicas bitwise identical (tests/multirank/launcher_worker.py); every process
must exit 0. The variable sets are those of tests/unit/test_launcher_detectors.py, which cites
where each comes from. One testbed for the three; skipped, with the reason, where the machine
cannot build hosts."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from ddl_triton import testbed  # the module, not its classes: pytest would try to collect Testbed*
from ddl_triton.testbed import reap
from support.launch import TESTS
from support.real_hosts import namespaces as _namespaces, skip_unless_available

pytestmark = pytest.mark.slow

HOSTS, PER_HOST = ("h1", "h2"), 2


@pytest.fixture(scope="module")
def bed():
    skip_unless_available()
    reap()
    with testbed.Testbed(hosts=2, rate="1gbit") as made:
        yield made
    assert not {ns for ns in _namespaces() if ns.startswith(f"{made.name}-")}


def _base() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
            "OMP_NUM_THREADS": "1", "DDL_TIMEOUT": "60", "DDL_TUNING_FILE": "off"}


def _slurm(bed, node: int, local: int) -> dict[str, str]:
    """plain ``srun -N2 -n4`` (block distribution: tasks 0, 1 on h1), job JOB step 0."""
    rank, job = node * PER_HOST + local, str(_JOB)
    return {"SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node), "SLURM_NTASKS": "4",
            "SLURM_NPROCS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2",
            "SLURM_STEP_NODELIST": "h[1-2]", "SLURM_JOB_NODELIST": "h[1-2]", "SLURM_NODELIST": "h[1-2]",
            "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURMD_NODENAME": HOSTS[node],
            "SLURM_CPUS_ON_NODE": "2", "SLURM_GTIDS": ",".join(str(node * PER_HOST + i) for i in range(PER_HOST)),
            "SLURM_LAUNCH_NODE_IPADDR": bed.address["h1"], "SLURM_SRUN_COMM_HOST": bed.address["h1"],
            "SLURM_CLUSTER_NAME": "testbed", "SLURM_SUBMIT_DIR": str(TESTS)}


def _open_mpi(bed, node: int, local: int) -> dict[str, str]:
    """Open MPI 4's ``mpirun -np 4 --map-by node:PE=1`` from h1 (by slot: ranks 0, 1 on h1): ORTE's
    HNP URI names mpirun's host; each node's orted serves PMIx to its ranks."""
    rank, job = node * PER_HOST + local, _JOB * 4096  # ORTE job ids are multiples of 2**12
    host = bed.address[HOSTS[node]]
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": str(local), "OMPI_UNIVERSE_SIZE": "4",
            "OMPI_MCA_orte_hnp_uri": f"{job}.0;tcp://{bed.address['h1']}:41234",
            "OMPI_MCA_ess_base_jobid": str(job + 1), "OMPI_MCA_ess_base_vpid": str(rank),
            "OMPI_MCA_orte_ess_num_procs": "4", "OMPI_MCA_orte_num_nodes": "2",
            "PMIX_RANK": str(rank), "PMIX_NAMESPACE": str(job + 1), "PMIX_HOSTNAME": HOSTS[node],
            "PMIX_SERVER_URI3": f"{job}.{node};tcp4://{host}:4100{node}",
            "PMIX_SERVER_URI2": f"{job}.{node};tcp4://{host}:4100{node}",
            "PMIX_SERVER_URI21": f"{job}.{node};tcp4://{host}:4100{node}",
            "PMIX_SECURITY_MODE": "native", "PMIX_PTL_MODULE": "tcp,usock", "PMIX_VERSION": "3.2.3"}


def _pytorchjob(bed, node: int, local: int) -> dict[str, str]:
    """A PyTorchJob (training-operator >= 1.7) of a master and one worker, nprocPerNode 2: the pod
    env of pod ``node`` (RANK = the pod's index), and the LOCAL_RANK its command gives each process."""
    return {"PYTHONUNBUFFERED": "0", "MASTER_ADDR": "h1", "MASTER_PORT": "23456", "PET_MASTER_ADDR": "h1",
            "PET_MASTER_PORT": "23456", "WORLD_SIZE": "4", "RANK": str(node), "PET_NPROC_PER_NODE": "2",
            "PET_NODE_RANK": str(node), "PET_NNODES": "2", "KUBERNETES_SERVICE_HOST": "10.96.0.1",
            "KUBERNETES_SERVICE_PORT": "443", "HOSTNAME": HOSTS[node], "LOCAL_RANK": str(local)}


_JOB = random.Random().randrange(1000, 100000)  # a job id of this run (the derived store ports follow it)
LAUNCHES = {"slurm": _slurm, "open-mpi": _open_mpi, "kubeflow-pytorchjob": _pytorchjob}


def _start_all(bed, variables, timeout: float = 150) -> list[tuple[int, str]]:
    """Every process of the job at once (2 per host); (exit status, output) per rank in rank order.
    Bounded: past ``timeout``, or 15 s after one failed, every process still running is stopped."""
    outs, procs = [], []
    for node, host in enumerate(HOSTS):
        for local in range(PER_HOST):
            env = {**_base(), **variables(bed, node, local)}
            out = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the rank
            procs.append(bed.popen(host, [sys.executable, "multirank/launcher_worker.py"], cwd=str(TESTS), env=env,
                                   stdout=out, stderr=subprocess.STDOUT))
            outs.append(out)
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + 15)
            time.sleep(0.2)
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:  # every thread's stack into its output first (launcher_worker.py registers it)
            p.send_signal(signal.SIGUSR1)
        if hung:
            time.sleep(2)
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(20)
    results = []
    for p, out in zip(procs, outs):
        out.seek(0)
        results.append((p.returncode, out.read()))
        out.close()
    return results


@pytest.mark.parametrize("launcher", list(LAUNCHES))
def test_a_schedulers_own_variables_make_an_exact_world(bed, launcher):
    results = _start_all(bed, LAUNCHES[launcher])
    everything = "\n".join(f"--- process {i} exit {code}\n{out[-4000:]}" for i, (code, out) in enumerate(results))
    assert [code for code, _ in results] == [0, 0, 0, 0], everything
    text = "\n".join(out for _, out in results)
    for q in range(4):
        done = re.search(rf"launcher_worker: rank {q} of 4 on (\S+): exact, replicas identical", text)
        assert done and done.group(1) == HOSTS[q // PER_HOST], everything  # ranks 0, 1 on h1; 2, 3 on h2
        world = re.search(rf"launcher_worker: rank {q} world: (.*)", text).group(1)
        assert f"launcher {launcher}: rank {q} of 4" in world, world
    summary = [line for line in text.splitlines() if line.startswith("launcher_worker:")]
    print(f"\n[{launcher}] every process exited 0\n" + "\n".join(sorted(summary)))
