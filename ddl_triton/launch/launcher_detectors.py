"""The launcher detectors, one class per launcher, and what they find (``FoundWorld``).

Each detector has a ``name`` (options.py's LAUNCHERS), ``claims(environ)``: whether its launcher's
own variables are there, and ``world(environ)``: the world they describe, or ``LauncherError``
naming the variable that is missing or malformed, the launcher it looked like and the rank. Each
class's docstring says which variables its launcher sets, and where that is written down. The
order they are tried in, and why, is launchers.py's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .slurm_nodelist import first_host

_PORT_BASE, _PORT_SPAN = 61440, 4096
_JAX_OFFSET = 2048

class LauncherError(ValueError):
    """A launcher's variables are there only in part, or malformed (see the module doc)."""


@dataclass(frozen=True)
class FoundWorld:
    """What a detector found. ``store_host`` None: MPI's world (MPI says rank and size)."""

    launcher: str
    rank: int | None
    size: int | None
    local_rank: int | None
    store_host: str | None = None
    store_port: int | None = None
    where: str = ""                 # how the store's address was found
    read: tuple[str, ...] = ()      # the variables it came from, NAME=value
    agent_store: bool = False       # torchrun's agent serves the store already (TORCHELASTIC_USE_AGENT_STORE)

    @property
    def over_mpi(self) -> bool:
        return self.store_host is None

    def explain(self) -> str:
        """One line: the launcher, this rank's place, the store, and the variables they came from."""
        if self.over_mpi:
            place, store = "rank and size from MPI", "MPI's world (MPI_COMM_WORLD)"
        else:
            local = f", local rank {self.local_rank}" if self.local_rank is not None else ""
            place = f"rank {self.rank} of {self.size}{local}"
            store = f"store at {self.store_host}:{self.store_port} ({self.where})"
        return f"launcher {self.launcher}: {place}; {store}; from {', '.join(self.read) or 'DDL_LAUNCHER'}"

    def store_environment(self) -> dict[str, str]:
        """The world as env://'s variables (bootstrap.store_from_env reads them)."""
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.size), "MASTER_ADDR": self.store_host,
               "MASTER_PORT": str(self.store_port)}
        if self.agent_store:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        return env


class _Reader:
    """One detector's reading of the environment: records what it read, raises what is missing."""

    def __init__(self, env, launcher: str, marks: tuple[str, ...]):
        self.env, self.launcher, self.read = env, launcher, []
        self.rank_hint = None
        self.marks = [f"{m}={env[m]}" for m in marks if m in env]

    def text(self, name: str, required: bool = True) -> str | None:
        value = self.env.get(name)
        if value is None or value == "":
            if required:
                self.fail(f"{name} is not set")
            return None
        self.read.append(f"{name}={value}")
        return value

    def integer(self, name: str, required: bool = True, low: int = 0) -> int | None:
        value = self.text(name, required)
        if value is None:
            return None
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{name}={value!r} is not an integer")
        if number < low:
            self.fail(f"{name}={number} is below {low}")
        return number

    def fail(self, what: str):
        who = f"rank {self.rank_hint}" if self.rank_hint is not None else "rank unknown"
        shown = _SHOWN.get(self.launcher, self.launcher)
        raise LauncherError(f"{who}: ddl_triton: this process looks launched by {shown} "
                            f"({', '.join(self.marks)}), but {what}: {_FIXES.get(self.launcher, '')}".rstrip(": "))

    def world(self, rank: int, size: int, local: int | None, host: str, port: int, where: str,
              agent_store: bool = False) -> FoundWorld:
        if not 0 <= rank < size:
            self.fail(f"rank {rank} is not a rank of a world of {size}")
        if not 0 < port < 65536:
            self.fail(f"the store's port {port} is not a TCP port")
        return FoundWorld(self.launcher, rank, size, local, host, port, where, tuple(self.read), agent_store)

    def override(self, host: str | None, port: int | None, where: str) -> tuple[str, int, str]:
        """MASTER_ADDR / MASTER_PORT where set, over the derived host and port."""
        given_host = self.text("MASTER_ADDR", required=False)
        given_port = self.integer("MASTER_PORT", required=False, low=1)
        if given_host or given_port:
            where = f"{where}; {'MASTER_ADDR' if given_host else ''}{' and ' if given_host and given_port else ''}" \
                    f"{'MASTER_PORT' if given_port else ''} given"
        host, port = given_host or host, given_port or port
        if host is None:
            self.fail("no host for the store was found (set MASTER_ADDR)")
        if port is None:
            self.fail("no port for the store was found (set MASTER_PORT)")
        return host, port, where


_SHOWN = {"env": "env:// (torch's variables)", "mpi": "an MPI launcher", "open-mpi": "Open MPI's mpirun",
          "slurm": "Slurm's srun", "kubeflow-pytorchjob": "a Kubeflow PyTorchJob",
          "kubeflow-trainer": "Kubeflow Trainer", "jobset": "a Kubernetes Indexed Job (JobSet)"}
_FIXES = {
    "torchrun": "torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in every worker; "
                "was one unset on the way?",
    "env": "set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (env://), or launch with torchrun or mpiexec",
    "slurm": "start the ranks with srun (a job step: srun sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, "
             "SLURM_STEP_NODELIST, SLURM_STEP_ID), not in the batch script itself",
    "open-mpi": "Open MPI's mpirun sets OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK and OMPI_MCA_orte_hnp_uri (4.x) "
                "or PMIX_SERVER_URI* and PMIX_NAMESPACE (5.x); set MASTER_ADDR (rank 0's host) and MASTER_PORT "
                "where the launcher's address is not there",
    "kubeflow-pytorchjob": "start the processes of a pod with torchrun (it reads PET_NNODES, "
                           "PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT), or give "
                           "each process of a pod its LOCAL_RANK",
    "kubeflow-trainer": "start the processes of a pod with torchrun (it reads the PET_* variables), or give "
                        "each process of a pod its LOCAL_RANK",
    "jobset": "a Kubernetes Indexed Job (JobSet) gives each pod JOB_COMPLETION_INDEX only: add WORLD_SIZE, "
              "MASTER_ADDR (the first pod's host name, <jobset>-<replicatedJob>-0-0.<subdomain>) and "
              "MASTER_PORT to the pod template",
}


# -- the detectors, in the order they are tried --------------------------------------------------
class Torchrun:
    """torchrun (torch.distributed.run): its agent sets, in every worker, RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT and TORCHELASTIC_RUN_ID (torch's docs, "torchrun:
    Environment Variables"); TORCHELASTIC_USE_AGENT_STORE=True when its agent serves the store."""

    name = "torchrun"
    marks = ("TORCHELASTIC_RUN_ID",)

    def claims(self, env) -> bool:
        return "TORCHELASTIC_RUN_ID" in env

    def world(self, env) -> FoundWorld:
        r = _Reader(env, self.name, self.marks)
        r.rank_hint = env.get("RANK")
        rank, size = r.integer("RANK"), r.integer("WORLD_SIZE", low=1)
        local = r.integer("LOCAL_RANK", required=False)
        host, port = r.text("MASTER_ADDR"), r.integer("MASTER_PORT", low=1)
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return r.world(rank, size, local, host, port, "MASTER_ADDR:MASTER_PORT" + (", torchrun's agent serves it"
                                                                                  if agent else ""), agent)


class _PetWorld:
    """The pod-level torchrun options Kubeflow sets as PET_* variables, read as a process's world:
    PET_NODE_RANK (the pod), PET_NNODES (pods), PET_NPROC_PER_NODE (processes per pod) and, with
    several processes per pod, LOCAL_RANK (which of them this is)."""

    @staticmethod
    def place(r: _Reader, node_rank: int) -> tuple[int, int, int, int]:
        """(rank, size, local rank, pods) of this process."""
        nproc_text = r.text("PET_NPROC_PER_NODE", required=False) or "1"
        if not nproc_text.isdigit() or int(nproc_text) < 1:
            r.fail(f"PET_NPROC_PER_NODE={nproc_text!r} is not a number of processes (torchrun decides "
                   "'auto', 'cpu' and 'gpu')")
        nproc = int(nproc_text)
        nnodes_text = r.text("PET_NNODES")
        if not nnodes_text.isdigit() or int(nnodes_text) < 1:
            r.fail(f"PET_NNODES={nnodes_text!r} is not a number of pods (an elastic range such as 1:4 needs "
                   "torchrun's rendezvous)")
        nnodes = int(nnodes_text)
        if not 0 <= node_rank < nnodes:
            r.fail(f"the pod's index {node_rank} is not below PET_NNODES={nnodes}")
        local = r.integer("LOCAL_RANK", required=False)
        if local is None and nproc > 1:
            r.fail(f"LOCAL_RANK is not set, and PET_NPROC_PER_NODE={nproc} processes share this pod: "
                   f"{node_rank} is the pod's index, not this process's rank")
        local = 0 if local is None else local
        if local >= nproc:
            r.fail(f"LOCAL_RANK={local} is not below PET_NPROC_PER_NODE={nproc}")
        return node_rank * nproc + local, nnodes * nproc, local, nnodes


class KubeflowPyTorchJob:
    """Kubeflow training-operator's PyTorchJob (pkg/controller.v1/pytorch/envvar.go, master.go): every
    container gets MASTER_ADDR, MASTER_PORT, PET_MASTER_ADDR, PET_MASTER_PORT, RANK = the pod's
    index (master 0, worker i+1), PET_NODE_RANK = the same, PET_NPROC_PER_NODE, PET_NNODES = pods,
    and WORLD_SIZE = pods (operator <= 1.6) or pods x PET_NPROC_PER_NODE (>= 1.7). The trap: RANK and
    WORLD_SIZE are the pod's and the pods' (or a product), not the process's: read as env:// does,
    two processes of a pod would both be rank RANK. Here the process's rank is
    PET_NODE_RANK x PET_NPROC_PER_NODE + LOCAL_RANK (LOCAL_RANK required with several per pod)."""

    name = "kubeflow-pytorchjob"
    marks = ("PET_NODE_RANK", "RANK")

    def claims(self, env) -> bool:
        return "PET_NODE_RANK" in env and "RANK" in env

    def world(self, env) -> FoundWorld:
        r = _Reader(env, self.name, self.marks)
        r.rank_hint = f"unknown (pod {env.get('RANK')})"
        pod = r.integer("RANK")
        if r.integer("PET_NODE_RANK") != pod:
            r.fail(f"RANK={pod} is not PET_NODE_RANK={env['PET_NODE_RANK']} (a PyTorchJob sets both to the pod's "
                   "index; something else set RANK)")
        rank, size, local, pods = _PetWorld.place(r, pod)
        r.rank_hint = rank
        world_size = r.integer("WORLD_SIZE", low=1)
        if world_size not in (pods, size):
            r.fail(f"WORLD_SIZE={world_size} is neither the pods (PET_NNODES={pods}) nor the processes ({size})")
        host, port = r.text("MASTER_ADDR"), r.integer("MASTER_PORT", low=1)
        return r.world(rank, size, local, host, port, "MASTER_ADDR:MASTER_PORT, the master pod's service")


class JobSet:
    """A Kubernetes Indexed Job, which is what a JobSet's replicated Jobs are: Kubernetes gives each
    pod JOB_COMPLETION_INDEX (its index in the Job); JobSet adds labels and annotations only
    (jobset.sigs.k8s.io/*), which reach the environment only where the template maps them. So the
    rank is JOB_COMPLETION_INDEX (one process per pod, one Job: a JobSet of several Jobs needs RANK
    from jobset.sigs.k8s.io/job-global-index), and WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from
    the template (JobSet's own PyTorch example sets them). jax.distributed asks the Kubernetes API
    instead; ddl_triton does not call it."""

    name = "jobset"
    marks = ("JOB_COMPLETION_INDEX",)

    def claims(self, env) -> bool:
        return "JOB_COMPLETION_INDEX" in env and "RANK" not in env

    def world(self, env) -> FoundWorld:
        r = _Reader(env, self.name, self.marks)
        rank = r.integer("JOB_COMPLETION_INDEX")
        r.rank_hint = rank
        size = r.integer("WORLD_SIZE", low=1)
        host, port = r.text("MASTER_ADDR"), r.integer("MASTER_PORT", low=1)
        return r.world(rank, size, 0, host, port, "MASTER_ADDR:MASTER_PORT from the pod template")


class EnvInit:
    """env:// as torch reads it: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (mp.spawn, hand-set, the
    wrappers people write around srun); LOCAL_RANK where given."""

    name = "env"
    marks = ("RANK", "WORLD_SIZE")

    def claims(self, env) -> bool:
        return "RANK" in env or "WORLD_SIZE" in env

    def world(self, env) -> FoundWorld:
        r = _Reader(env, self.name, self.marks)
        r.rank_hint = env.get("RANK")
        rank, size = r.integer("RANK"), r.integer("WORLD_SIZE", low=1)
        host, port = r.text("MASTER_ADDR"), r.integer("MASTER_PORT", low=1)
        local = r.integer("LOCAL_RANK", required=False)
        return r.world(rank, size, local, host, port, "MASTER_ADDR:MASTER_PORT")


class Mpi:
    """An MPI launcher whose protocol the project's MPI speaks (PMI): hydra's mpiexec and ddlrun set
    PMI_RANK, PMI_SIZE (and PMI_FD); Intel MPI's mpiexec.hydra the same; srun --mpi=pmi2 PMI_RANK,
    PMI_SIZE, PMI_FD; MVAPICH's mpirun_rsh MV2_COMM_WORLD_RANK/SIZE. MPI's world, as always."""

    name = "mpi"
    marks = ("PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")

    def claims(self, env) -> bool:
        return any(v in env for v in self.marks)

    def world(self, env) -> FoundWorld:
        read = tuple(f"{v}={env[v]}" for v in ("PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE")
                     if v in env)
        return FoundWorld(self.name, None, None, None, read=read)


class OpenMpi:
    """Open MPI's mpirun (docs.open-mpi.org, "Environment variables set for MPI applications"):
    OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK (and _LOCAL_SIZE,
    _NODE_RANK, OMPI_UNIVERSE_SIZE), with PMIX_RANK and PMIX_NAMESPACE. The launcher's address, as
    jax.distributed's detectors read it (jax/_src/clusters/ompi_cluster.py, prrte_cluster.py):
    Open MPI 4 (ORTE) sets OMPI_MCA_orte_hnp_uri="<jobid>.<vpid>;tcp://<ip>[,<ip>...]:<port>", the
    host of mpirun: the store is on its first address, port from the job id; Open MPI 5 (PRRTE,
    PRTE_LAUNCHED=1) sets PMIX_SERVER_URI41/4/3/21/2="<ns>.<rank>;tcp4://<ip>:<port>" and
    PMIX_NAMESPACE="prterun-<host>-<jobid>@1": the store on that ip, port from that job id. Rank 0
    must run on that host (mpirun's default mapping puts it there) or MASTER_ADDR must say where."""

    name = "open-mpi"
    marks = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
    _URIS = ("PMIX_SERVER_URI41", "PMIX_SERVER_URI4", "PMIX_SERVER_URI3", "PMIX_SERVER_URI21", "PMIX_SERVER_URI2")

    def claims(self, env) -> bool:
        return any(v in env for v in self.marks)

    def world(self, env) -> FoundWorld:
        r = _Reader(env, self.name, self.marks)
        r.rank_hint = env.get("OMPI_COMM_WORLD_RANK")
        rank, size = r.integer("OMPI_COMM_WORLD_RANK"), r.integer("OMPI_COMM_WORLD_SIZE", low=1)
        local = r.integer("OMPI_COMM_WORLD_LOCAL_RANK", required=False)
        host = port = None
        where = "MASTER_ADDR:MASTER_PORT"
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            host, port, where = self._launcher_address(r, env)
        host, port, where = r.override(host, port, where)
        return r.world(rank, size, local, host, port, where)

    def _launcher_address(self, r: _Reader, env) -> tuple[str | None, int | None, str]:
        if "OMPI_MCA_orte_hnp_uri" in env:
            uri = r.text("OMPI_MCA_orte_hnp_uri")
            job = re.match(r"(\d+)\.", uri)
            ip = re.search(r"tcp://([^,:;\]]+)[,:]|tcp6://\[([^,\]]+)[,\]]", uri)
            if job is None or ip is None:
                r.fail(f"OMPI_MCA_orte_hnp_uri={uri!r} is not '<jobid>.<vpid>;tcp://<ip>,...:<port>'")
            # ORTE's job ids are multiples of 2**12 (jax's ompi_cluster.py divides them out too)
            return ip.group(1) or ip.group(2), _derived_port(int(job.group(1)) >> 12), \
                "mpirun's host, from OMPI_MCA_orte_hnp_uri; port from its job id"
        name = next((v for v in self._URIS if v in env), None)
        if name is not None:
            uri = r.text(name)
            ip = re.search(r"tcp4://([^,:;]+):", uri) or re.search(r"tcp6://\[([^,\]]+)\]", uri)
            if ip is None:
                r.fail(f"{name}={uri!r} holds no tcp4:// or tcp6:// address")
            namespace = r.text("PMIX_NAMESPACE", required="MASTER_PORT" not in env) or ""
            job = re.search(r"-(\d+)@", namespace)
            if job is None and "MASTER_PORT" not in env:
                r.fail(f"PMIX_NAMESPACE={namespace!r} holds no job id ('prterun-<host>-<jobid>@1')")
            return ip.group(1), _derived_port(int(job.group(1))) if job else None, \
                f"the PMIx server's host, from {name}; port from PMIX_NAMESPACE's job id"
        return None, None, "no launcher address (neither OMPI_MCA_orte_hnp_uri nor PMIX_SERVER_URI* is set)"


class Slurm:
    """Slurm's srun, in a job step (Slurm's srun(1), "OUTPUT ENVIRONMENT VARIABLES"): SLURM_PROCID
    (the task's rank), SLURM_NTASKS (the step's tasks), SLURM_LOCALID (the task's index on its node),
    SLURM_NODEID, SLURM_STEP_NODELIST (the step's hosts, Slurm's bracket syntax), SLURM_JOB_ID,
    SLURM_STEP_ID. The store is on the first host of SLURM_STEP_NODELIST, where task 0 runs (rank 0
    serves it; a rank 0 on another node is refused, naming MASTER_ADDR); its port is
    61440 + (SLURM_JOB_ID + 997 x SLURM_STEP_ID + 2048) mod 4096: the steps of one job differ, and
    so does jax.distributed's choice for the same job. The batch script itself (SLURM_PROCID=0, no
    job step) is not a world of SLURM_NTASKS ranks: with several tasks it is refused, naming srun."""

    name = "slurm"
    marks = ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEP_NODELIST")

    def claims(self, env) -> bool:
        if "SLURM_PROCID" not in env:
            return False
        in_step = "SLURM_STEP_NODELIST" in env or "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
        return in_step or env.get("SLURM_NTASKS", "1") not in ("", "1")

    def world(self, env) -> FoundWorld:
        r = _Reader(env, self.name, self.marks)
        r.rank_hint = env.get("SLURM_PROCID")
        rank, size = r.integer("SLURM_PROCID"), r.integer("SLURM_NTASKS", low=1)
        local = r.integer("SLURM_LOCALID", required=False)
        nodelist = r.text("SLURM_STEP_NODELIST")
        try:
            host = first_host(nodelist)
        except ValueError as e:
            r.fail(str(e))
        port = None
        if not env.get("MASTER_PORT"):
            job = r.integer("SLURM_JOB_ID")
            step = r.integer("SLURM_STEP_ID" if "SLURM_STEP_ID" in env or "SLURM_STEPID" not in env else "SLURM_STEPID")
            port = _PORT_BASE + (job + 997 * step + _JAX_OFFSET) % _PORT_SPAN
        host, port, where = r.override(host, port, "the first host of SLURM_STEP_NODELIST; port from SLURM_JOB_ID "
                                                   "and SLURM_STEP_ID")
        node = r.integer("SLURM_NODEID", required=False)
        if rank == 0 and node not in (None, 0) and not env.get("MASTER_ADDR"):
            r.fail(f"rank 0 runs on node SLURM_NODEID={node}, not on {host}, the first host of SLURM_STEP_NODELIST, "
                   "where the store must be (set MASTER_ADDR to rank 0's host)")
        return r.world(rank, size, local, host, port, where)


class KubeflowTrainer:
    """Kubeflow Trainer v2 (its torch plugin): each pod gets torchrun's options as PET_NNODES,
    PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, meant for torchrun, whose
    RANK then wins (detector 1). A process started without torchrun: rank
    PET_NODE_RANK x PET_NPROC_PER_NODE + LOCAL_RANK, the store at PET_MASTER_ADDR:PET_MASTER_PORT."""

    name = "kubeflow-trainer"
    marks = ("PET_NNODES", "PET_NODE_RANK")

    def claims(self, env) -> bool:
        return any(v in env for v in self.marks)

    def world(self, env) -> FoundWorld:
        r = _Reader(env, self.name, self.marks)
        rank, size, local, _ = _PetWorld.place(r, r.integer("PET_NODE_RANK"))
        r.rank_hint = rank
        host, port = r.text("PET_MASTER_ADDR"), r.integer("PET_MASTER_PORT", low=1)
        return r.world(rank, size, local, host, port, "PET_MASTER_ADDR:PET_MASTER_PORT")


# In options.py's LAUNCHERS order (the names DDL_LAUNCHER may take; tests/unit/test_launcher_detectors.py).


def _derived_port(job: int) -> int:
    return _PORT_BASE + (job + _JAX_OFFSET) % _PORT_SPAN
