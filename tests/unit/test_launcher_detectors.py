"""The launcher detectors (ddl_triton/launch/launchers.py) and Slurm's node lists
(slurm_nodelist.py): each detector against the variables its launcher really sets (literal sets,
each citing where they come from), the order when launchers nest, half-set environments refused
by name, and the world found at a store. One process, no launch: the end-to-end runs are
tests/multirank/test_testbed_launchers.py."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from ddl_triton.options import LAUNCHERS, Options
from ddl_triton.launch import launchers
from ddl_triton.launch.launchers import LauncherError, detect, mpi_launched
from ddl_triton.launch.mpi_start import mpi_environment
from ddl_triton.launch.slurm_nodelist import expand, first_host
from ddl_triton.runtime.setup.bootstrap import store_of_launcher

# -- what each launcher sets (literal, from its source or documentation) -------------------------

# srun, task 2 of `srun -N2 -n4 python train.py` in job 4242 (Slurm's srun(1), "OUTPUT ENVIRONMENT
# VARIABLES"; jax/_src/clusters/slurm_cluster.py reads the same five).
SRUN = {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
        "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "node[07-08]",
        "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_NODELIST": "node[07-08]", "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURMD_NODENAME": "node08", "SLURM_CPUS_ON_NODE": "2",
        "SLURM_LAUNCH_NODE_IPADDR": "10.1.0.5", "SLURM_SRUN_COMM_HOST": "10.1.0.5", "SLURM_GTIDS": "2,3"}
# The batch script of `sbatch -n4` (sbatch(1), "OUTPUT ENVIRONMENT VARIABLES": no SLURM_STEP_*).
SBATCH = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
          "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_NODELIST": "node[07-08]"}
# srun --mpi=pmix adds Slurm's PMIx plugin's variables (slurm src/plugins/mpi/pmix/pmixp_client.c).
SRUN_PMIX = {**SRUN, "PMIX_RANK": "2", "PMIX_NAMESPACE": "slurm.pmix.4242.0",
             "PMIX_SERVER_URI3": "pmix-server.12345;tcp4://127.0.0.1:40001", "PMIX_SERVER_TMPDIR": "/var/spool"}
# torchrun's worker (torch docs, "torchrun (Elastic Launch)", Environment Variables).
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default", "MASTER_ADDR": "node07",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job1", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}
# Open MPI 4.x mpirun (docs.open-mpi.org "Environment variables set for MPI applications"; the HNP
# URI's format from jax/_src/clusters/ompi_cluster.py); rank 1 of 4, 2 per node.
OMPI4 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_UNIVERSE_SIZE": "4",
         "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1,10.108.0.1:34911",
         "OMPI_MCA_ess_base_jobid": "1531576321", "PMIX_RANK": "1", "PMIX_NAMESPACE": "1531576321",
         "PMIX_SERVER_URI3": "1531576320.1;tcp4://10.96.0.2:40001"}
# Open MPI 5.x mpirun (PRRTE; jax/_src/clusters/prrte_cluster.py).
OMPI5 = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PRTE_LAUNCHED": "1", "PMIX_RANK": "3",
         "PMIX_NAMESPACE": "prterun-node07-33812@1",
         "PMIX_SERVER_URI41": "prterun-node07-33812@0.0;tcp4://10.96.0.1:53233",
         "PMIX_SERVER_URI4": "prterun-node07-33812@0.0;tcp4://10.96.0.1:53233"}
# hydra's mpiexec (MPICH; what ddlrun starts): PMI_RANK, PMI_SIZE, PMI_FD.
HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "4", "PMI_FD": "9", "HYDRA_CONTROL_FD": "8"}
# Kubeflow training-operator >= 1.7 PyTorchJob, pod worker-0 (RANK 1) of master + 1 worker,
# nprocPerNode 2 (pkg/controller.v1/pytorch/envvar.go setPodEnv, master.go).
PYTORCHJOB = {"PYTHONUNBUFFERED": "0", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
              "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456", "WORLD_SIZE": "4", "RANK": "1",
              "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1", "PET_NNODES": "2"}
# Kubeflow Trainer v2's torch plugin: torchrun's options as PET_* (pod 1 of 2, 2 processes each).
TRAINER = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "train-node-0-0.train", "PET_MASTER_PORT": "29400"}
# A JobSet's (Indexed) Job pod: Kubernetes sets JOB_COMPLETION_INDEX; the template of JobSet's
# PyTorch example adds MASTER_ADDR, MASTER_PORT and the size.
JOBSET = {"JOB_COMPLETION_INDEX": "2", "KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "ps-workers-0-2",
          "WORLD_SIZE": "4", "MASTER_ADDR": "ps-workers-0-0.ps", "MASTER_PORT": "3389"}


def _port(job: int, step: int = 0) -> int:
    return 61440 + (job + 997 * step + 2048) % 4096


# -- Slurm's node lists ----------------------------------------------------------------------------
@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("node[009-011]", ["node009", "node010", "node011"]),   # padding of the lower bound kept
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("h1", ["h1"]),
    ("gpu[1-2]-ib,login", ["gpu1-ib", "gpu2-ib", "login"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),     # several brackets: a product
    ("a[1-2],a2,b", ["a1", "a2", "b"]),                      # a host twice: kept once
])
def test_nodelist_expands_as_scontrol_does(nodelist, hosts):
    assert expand(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist, says", [
    ("", "empty"), ("n[1-", "never closed"), ("n1]", "without '['"), ("a,,b", "empty item"),
    ("n[2-1]", "backwards"), ("n[a-b]", "not a number"), ("n[[1]]", "nested"), ("n[1-99999999]", "more than"),
])
def test_nodelist_malformed_is_refused_by_name(nodelist, says):
    with pytest.raises(ValueError) as e:
        expand(nodelist)
    assert says in str(e.value) and repr(nodelist) in str(e.value), str(e.value)


# -- each detector against its launcher's variables -------------------------------------------------
def test_plain_srun_store_on_the_first_host_port_from_job_and_step():
    found = detect(SRUN)
    assert (found.launcher, found.rank, found.size, found.local_rank) == ("slurm", 2, 4, 0)
    assert (found.store_host, found.store_port) == ("node07", _port(4242))
    assert 61440 <= found.store_port <= 65535
    line = found.explain()
    for shown in ("launcher slurm", "rank 2 of 4", "node07", "SLURM_PROCID=2", "SLURM_STEP_NODELIST=node[07-08]"):
        assert shown in line, line


def test_slurm_steps_of_one_job_get_different_ports_and_master_port_overrides():
    assert detect({**SRUN, "SLURM_STEP_ID": "1"}).store_port == _port(4242, 1) != _port(4242, 0)
    found = detect({**SRUN, "MASTER_PORT": "29999"})
    assert found.store_port == 29999 and "MASTER_PORT given" in found.explain()
    assert detect({**SRUN, "MASTER_ADDR": "10.0.0.9"}).store_host == "10.0.0.9"


def test_torchrun_worker():
    found = detect(TORCHRUN)
    assert (found.launcher, found.rank, found.size, found.local_rank) == ("torchrun", 3, 4, 1)
    assert (found.store_host, found.store_port, found.agent_store) == ("node07", 29500, True)
    assert found.store_environment()["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_open_mpi_4_store_at_mpiruns_host():
    found = detect(OMPI4)
    assert (found.launcher, found.rank, found.size, found.local_rank) == ("open-mpi", 1, 4, 1)
    # the first of the HNP's addresses; port from the job id (ORTE's, a multiple of 2**12, divided out)
    assert found.store_host == "10.96.0.1"
    assert found.store_port == 61440 + (1531576320 // 4096 + 2048) % 4096
    assert "OMPI_MCA_orte_hnp_uri" in found.explain()


def test_open_mpi_5_store_at_the_pmix_servers_host():
    found = detect(OMPI5)
    assert (found.launcher, found.rank, found.size) == ("open-mpi", 3, 4)
    assert (found.store_host, found.store_port) == ("10.96.0.1", 61440 + (33812 + 2048) % 4096)


def test_hydra_mpiexec_is_mpis_world():
    found = detect(HYDRA)
    assert found.launcher == "mpi" and found.over_mpi and "PMI_RANK=1" in found.explain()
    assert mpi_launched(HYDRA, "") and not mpi_launched(OMPI4, "") and not mpi_launched(SRUN_PMIX, "")


def test_pytorchjob_rank_is_the_pods_index_times_its_processes_plus_local_rank():
    found = detect({**PYTORCHJOB, "LOCAL_RANK": "1"})
    assert (found.launcher, found.rank, found.size, found.local_rank) == ("kubeflow-pytorchjob", 3, 4, 1)
    assert (found.store_host, found.store_port) == ("job-master-0", 23456)
    # operator <= 1.6 counted pods in WORLD_SIZE: the same world
    assert detect({**PYTORCHJOB, "WORLD_SIZE": "2", "LOCAL_RANK": "0"}).rank == 2
    # one process per pod (nprocPerNode 1, the default): RANK is right as it stands
    one = detect({**PYTORCHJOB, "PET_NPROC_PER_NODE": "1", "WORLD_SIZE": "2"})
    assert (one.rank, one.size) == (1, 2)


def test_pytorchjob_trap_refused_without_local_rank():
    with pytest.raises(LauncherError) as e:
        detect(PYTORCHJOB)  # two processes of a pod would both be RANK=1
    for said in ("Kubeflow PyTorchJob", "LOCAL_RANK is not set", "PET_NPROC_PER_NODE=2", "pod's index", "torchrun"):
        assert said in str(e.value), str(e.value)
    with pytest.raises(LauncherError, match="neither the pods"):
        detect({**PYTORCHJOB, "WORLD_SIZE": "3", "LOCAL_RANK": "0"})
    with pytest.raises(LauncherError, match="torchrun decides"):
        detect({**PYTORCHJOB, "PET_NPROC_PER_NODE": "auto"})


def test_kubeflow_trainer_without_torchrun():
    found = detect({**TRAINER, "LOCAL_RANK": "0"})
    assert (found.launcher, found.rank, found.size) == ("kubeflow-trainer", 2, 4)
    assert (found.store_host, found.store_port) == ("train-node-0-0.train", 29400)
    with pytest.raises(LauncherError, match="LOCAL_RANK is not set"):
        detect(TRAINER)
    with pytest.raises(LauncherError, match="elastic range"):
        detect({**TRAINER, "PET_NNODES": "1:4", "PET_NPROC_PER_NODE": "1"})


def test_jobset_rank_from_the_completion_index():
    found = detect(JOBSET)
    assert (found.launcher, found.rank, found.size) == ("jobset", 2, 4)
    bare = {k: v for k, v in JOBSET.items() if k not in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    with pytest.raises(LauncherError, match="rank 2: .*Indexed Job .*WORLD_SIZE is not set"):
        detect(bare)


def test_no_launcher_is_a_world_of_one():
    assert detect({"PATH": "/bin", "HOME": "/root"}) is None
    assert detect(SBATCH | {"SLURM_NTASKS": "1"}) is None  # a batch script of one task


# -- half-set environments: the missing variable, the launcher it looked like, the rank ---------------
@pytest.mark.parametrize("env, missing, launcher, rank", [
    ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_NODELIST"}, "SLURM_STEP_NODELIST", "Slurm's srun", "rank 2"),
    (SBATCH, "SLURM_STEP_NODELIST", "Slurm's srun", "rank 0"),  # python in the batch script, no srun
    ({k: v for k, v in SRUN.items() if k != "SLURM_NTASKS"}, "SLURM_NTASKS", "Slurm's srun", "rank 2"),
    ({**SRUN, "SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer", "Slurm's srun", "rank x"),
    ({k: v for k, v in OMPI4.items() if k != "OMPI_COMM_WORLD_SIZE"}, "OMPI_COMM_WORLD_SIZE", "Open MPI", "rank 1"),
    ({k: v for k, v in OMPI4.items() if not k.startswith(("OMPI_MCA", "PMIX_SERVER"))}, "MASTER_ADDR",
     "Open MPI", "rank 1"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_PORT", "torchrun", "rank 3"),
    ({"RANK": "1", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "WORLD_SIZE", "env://", "rank 1"),
    ({"MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK", "env://", "rank unknown"),
])
def test_half_set_environment_names_what_is_missing(env, missing, launcher, rank):
    with pytest.raises(LauncherError) as e:
        detect(env)
    said = str(e.value)
    assert missing in said and launcher in said and said.startswith(rank), said


def test_slurm_rank_0_off_the_first_host_is_refused():
    env = {**SRUN, "SLURM_PROCID": "0", "SLURM_NODEID": "1"}
    with pytest.raises(LauncherError, match="rank 0 runs on node SLURM_NODEID=1.*MASTER_ADDR"):
        detect(env)
    assert detect({**env, "MASTER_ADDR": "node08"}).store_host == "node08"


# -- the order, where launchers nest -----------------------------------------------------------------
def test_order_is_the_options_list():
    assert tuple(d.name for d in launchers.DETECTORS) == LAUNCHERS


@pytest.mark.parametrize("env, winner", [
    ({**SRUN, **TORCHRUN}, "torchrun"),              # torchrun inside a Slurm allocation: torchrun's RANK wins
    ({**PYTORCHJOB, **TORCHRUN, "PET_NODE_RANK": "1"}, "torchrun"),  # torchrun in a PyTorchJob pod
    ({**TRAINER, **TORCHRUN}, "torchrun"),           # torchrun in a Trainer v2 pod
    ({**SRUN, "RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "env"),  # a wrapper's RANK
    ({**SRUN, **HYDRA}, "mpi"),                       # mpiexec (hydra) inside an allocation
    ({**HYDRA, "RANK": "1", "WORLD_SIZE": "4"}, "mpi"),  # under MPI, MPI's ranks (RANK must agree)
    ({**SRUN, **OMPI4}, "open-mpi"),                  # Open MPI's mpirun inside an allocation
    (SRUN_PMIX, "slurm"),                             # srun --mpi=pmix: the MPICH wheel cannot speak PMIx
    ({**SRUN, "PMI_RANK": "2", "PMI_SIZE": "4", "PMI_FD": "5"}, "mpi"),  # srun --mpi=pmi2: MPI's world
    ({**PYTORCHJOB, "LOCAL_RANK": "1"}, "kubeflow-pytorchjob"),  # before env://, whose RANK would be the pod's
])
def test_which_launcher_wins(env, winner):
    assert detect(env).launcher == winner


def test_ddl_launcher_forces_one_detector():
    assert detect(SRUN_PMIX, launcher="mpi").over_mpi
    assert mpi_launched(SRUN_PMIX, "mpi")
    assert detect({**SRUN, **TORCHRUN}, launcher="slurm").launcher == "slurm"
    with pytest.raises(LauncherError, match="Slurm's srun.*SLURM_PROCID is not set"):
        detect(HYDRA, launcher="slurm")
    assert Options.from_env({"DDL_LAUNCHER": "slurm"}).launcher == "slurm"
    with pytest.raises(ValueError, match="DDL_LAUNCHER.*one of torchrun"):
        Options(launcher="srun")


# -- MPI's start where the world is not MPI's --------------------------------------------------------
def test_pmix_variables_hidden_while_mpi_starts_then_back():
    env = dict(SRUN_PMIX)
    with mpi_environment(env, "", modules={}):
        assert not [k for k in env if k.startswith(("PMIX_", "PMI_"))] and env["SLURM_PROCID"] == "2"
    assert env == SRUN_PMIX
    env = dict(OMPI4)
    with mpi_environment(env, "", modules={}):
        assert sorted(env) == ["OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_hnp_uri", "OMPI_UNIVERSE_SIZE"]
    assert env == OMPI4
    env = dict(HYDRA)
    with mpi_environment(env, "", modules={}):
        assert env == HYDRA  # MPI's own launcher: untouched
    env = dict(SRUN_PMIX)
    with mpi_environment(env, "", modules={"mpi4py.MPI": object()}):
        assert env == SRUN_PMIX  # MPI already started: nothing to hide


def test_world_found_at_a_store_serves_and_explains():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**SRUN, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    store, rank, size = store_of_launcher(detect(env), 10.0)
    store.set("k", b"v")
    assert (rank, size, store.get("k")) == (0, 1, b"v")


@pytest.mark.slow
def test_init_under_open_mpi_and_pmix_variables_starts_and_says_so():
    # One process with an Open MPI + PMIx launch's variables: MPICH would abort in MPI_Init on the
    # PMIx ones ("unsupported PMI version PMIx"); ddl_triton.init() finds a world of 1 at a store.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_", "SLURM_", "RANK", "WORLD_SIZE",
                                                                    "MASTER_", "TORCHELASTIC", "DDL_"))}
    env.update({**OMPI4, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "PMIX_RANK": "0", "OMPI_MCA_orte_hnp_uri": f"1531576320.0;tcp://127.0.0.1:{port}",
                "MASTER_PORT": str(port), "DDL_TUNING_FILE": "off", "DDL_TIMEOUT": "30"})
    code = ("import os, torch, ddl_triton as ddl; c = ddl.init(); t = torch.arange(5); c.allreduce(t); "
            "assert t.tolist() == [0, 1, 2, 3, 4]; print(c.explain('allreduce', 64).world); "
            "print('PMIX_RANK' in os.environ); ddl.finalize()")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    world, pmix_back = out.stdout.strip().splitlines()[-2:]
    assert world.startswith("launcher open-mpi: rank 0 of 1") and f"127.0.0.1:{port}" in world, world
    assert pmix_back == "True" and "suspicious MPI execution environment" not in out.stderr, out.stderr
