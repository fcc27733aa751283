"""Hugging Face Accelerate on the "ddl" backend: what works as is, and one opt-in set-up call for the CPU.

Accelerate's documented way to choose a backend is
``Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend=...)])``. What it does with it
depends on the device (accelerate 1.15.0, ``accelerate/state.py``):

- **CUDA** (LOCAL_RANK set, ``torch.cuda.is_available()``, no ``cpu=True``): ``_prepare_backend``
  keeps the asked backend (``state.py:788-791``), ``PartialState.__init__`` calls
  ``torch.distributed.init_process_group(backend="ddl", ...)`` (``state.py:244``), so
  ``InitProcessGroupKwargs(backend="ddl")`` passes as is. Not run on a GPU yet.
- **CPU** (``cpu=True`` under a distributed launch): ``_prepare_backend`` replaces any backend
  but "mpi" by "gloo" (``state.py:810-813``), then ``PartialState.__init__`` raises
  ``ValueError: Your assigned backend ddl is not available, please use gloo``
  (``state.py:196-197``). Accelerate has no list of backend names to join and no hook to
  extend; that ``if`` is the whole decision.

Two ways in on the CPU:

1. **Pre-initialise** (no patch, any Accelerate version): ``dist.init_process_group("ddl")``
   first, then ``Accelerator(cpu=True)``; Accelerate finds the group initialised and does not
   start another (``state.py:284``). Its ``state.backend`` then reads "gloo" (the name line 813
   chose), which only steers ``gather`` to ``all_gather`` on a list instead of
   ``all_gather_into_tensor``; both run on "ddl".
2. **``use_ddl_on_cpu()``** below, then the documented kwargs: it wraps
   ``PartialState._prepare_backend`` so that an explicit ``backend="ddl"`` on a multi-CPU launch
   stays "ddl"; Accelerate then initialises the group itself (``state.py:285``) and
   ``state.backend`` is "ddl". It patches a private method, so it is opt-in, checks the
   installed version and the method's signature, and refuses anything else with the reason.
"""
from __future__ import annotations

import inspect
import os

__all__ = ["TESTED_VERSIONS", "use_ddl_on_cpu"]

# The Accelerate releases whose PartialState._prepare_backend the wrapper below was read against
# and tested on (tests/multirank/test_frameworks.py). Outside them, refuse: the private method
# may have moved, and a silent fallback to "gloo" is exactly what the wrapper exists to prevent.
TESTED_VERSIONS = ((1, 15),)
_SIGNATURE = ["self", "cpu", "sagemaker_dp", "backend"]
_MARK = "_ddl_triton_wraps"


def _launched() -> bool:
    """Accelerate's own test for a distributed launch on the CPU (state.py:803-806)."""
    from accelerate.utils import get_int_from_env

    return int(os.environ.get("LOCAL_RANK", -1)) != -1 or get_int_from_env(
        ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "WORLD_SIZE"], 1) > 1


def use_ddl_on_cpu() -> None:
    """Let ``Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="ddl")])`` run on "ddl".

    Call it once, before the first ``Accelerator`` or ``PartialState`` of the process.
    Afterwards, a multi-CPU launch that asks for backend "ddl" keeps it (Accelerate would
    otherwise pick "gloo" and then refuse the request); every other request is decided by
    Accelerate unchanged, but one: "ddl" asked for under a distributed launch on a host with no
    accelerator and without ``cpu=True``, which Accelerate would initialise and then train without
    DDP (each rank alone, silently), raises ValueError naming the rank. Idempotent. Registers the
    backend too (``import ddl_triton.torch``).

    Raises RuntimeError, naming the installed version or what differs, if Accelerate is not a
    tested release or its ``PartialState._prepare_backend`` no longer has the signature the
    wrapper relies on; pre-initialising (``dist.init_process_group("ddl")`` before the
    ``Accelerator``) needs no patch and works on any version.
    """
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    import ddl_triton.torch  # noqa: F401  (registers the backend "ddl")

    original = PartialState._prepare_backend
    if getattr(original, _MARK, None) is not None:
        return
    release = tuple(int(part) for part in accelerate.__version__.split(".")[:2])
    if release not in TESTED_VERSIONS:
        tested = ", ".join(".".join(map(str, v)) for v in TESTED_VERSIONS)
        raise RuntimeError(
            f"ddl_triton.torch.accelerate.use_ddl_on_cpu: accelerate {accelerate.__version__} is not a tested release "
            f"({tested}); its PartialState._prepare_backend may have changed. Initialise the group first instead: "
            f"dist.init_process_group('ddl'), then Accelerator(cpu=True)")
    params = list(inspect.signature(original).parameters)
    if params != _SIGNATURE:
        raise RuntimeError(
            f"ddl_triton.torch.accelerate.use_ddl_on_cpu: accelerate {accelerate.__version__}'s "
            f"PartialState._prepare_backend takes {params}, not {_SIGNATURE}; initialise the group first instead")

    def _prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend: str | None = None):
        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        # Only the CPU rule (state.py:810-813) is overridden, and only for an explicit "ddl":
        # DistributedType.MULTI_CPU is what Accelerate chose, so the rest of its CPU set-up
        # (RANK/WORLD_SIZE from the launcher, MASTER_PORT, init_process_group) runs unchanged.
        if backend == "ddl" and distributed_type == DistributedType.MULTI_CPU:
            return "ddl", distributed_type
        if backend == "ddl" and distributed_type == DistributedType.NO and _launched():
            # No accelerator and no cpu=True: Accelerate would still initialise "ddl" (state.py:244)
            # but never wrap the model in DDP (multi_device is False), so every rank would train alone.
            raise ValueError(
                f"rank {os.environ.get('RANK', '?')}: Accelerate found no accelerator and cpu=True was not given, so it "
                f"would start the 'ddl' group but not wrap the model in DistributedDataParallel (DistributedType.NO): "
                f"the replicas would diverge. Pass Accelerator(cpu=True, ...) (or set ACCELERATE_USE_CPU=1)")
        return chosen, distributed_type

    setattr(_prepare_backend, _MARK, original)
    _prepare_backend.__doc__ = original.__doc__
    PartialState._prepare_backend = _prepare_backend
