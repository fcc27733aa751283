"""Accelerate and Lightning on "ddl" under ``torchrun --nproc-per-node 2``, beside gloo; skipped where not installed.

Each job trains a few steps and exits 0 only if every rank's parameter bytes equal rank 0's.
With 2 ranks DDP's mean, ``g0/2 + g1/2``, rounds the same in any order, so gloo's losses must
equal "ddl"'s bit for bit. The Accelerate rule that refuses "ddl" on the CPU, and the opt-in
set-up call that lifts it (ddl_triton/torch/accelerate.py), are checked without ranks too.

Four torchrun jobs (Accelerate's three ways need a process each: a torchrun process cannot
initialise a second group), each dominated by the frameworks' imports (Lightning's: 5-9 s per
rank on 2 cores).
"""
from __future__ import annotations

import functools
import inspect
import re
import subprocess

import pytest

from support.launch import TESTS, TORCHRUN, ddl_segments, gloo_exit_abort, torch_launcher_env

ROOT = TESTS.parent
# The jobs with a torch gloo group in them, and the line each prints when its work is done.
_GLOO_JOBS_LAST_LINE = {"gloo": "accelerate_train: replicas bitwise identical:",
                        "multirank/frameworks_worker.py": "frameworks_worker: case gloo identical"}


@functools.cache
def _torchrun(*args: str) -> tuple[int, str, int]:
    """(exit code, output, shm segments left) of ``torchrun --standalone --nproc-per-node 2 args``, run
    once; once more only if torch's own gloo aborted a finished job at exit (support/launch.py)."""
    for attempt in range(2):
        before = ddl_segments()
        proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", *args], env=torch_launcher_env(),
                              capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL, cwd=str(TESTS))
        out = proc.stdout + proc.stderr
        if attempt or not gloo_exit_abort(proc.returncode, out, _GLOO_JOBS_LAST_LINE.get(args[-1], "\0")):
            return proc.returncode, out, len(ddl_segments() - before)


def _clean(*args: str) -> str:
    code, out, leaked = _torchrun(*args)
    assert code == 0, f"exit {code}\n{out[-6000:]}"
    assert leaked == 0, f"{leaked} shared-memory segments left behind"
    return out


def _losses(out: str, prefix: str) -> list[str]:
    return re.findall(rf"{prefix}: losses (\[.*\])", out)


# -- Accelerate ------------------------------------------------------------------------------------

def _accelerate(*args: str) -> str:
    pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install '.[accelerate]')")
    return _clean(str(ROOT / "examples" / "accelerate_train.py"), *args)


def test_accelerate_documented_kwargs_way_trains_on_ddl_after_use_ddl_on_cpu():
    out = _accelerate()
    assert "way kwargs, backend ddl (Accelerate's state.backend ddl, DistributedType.MULTI_CPU)" in out, out[-3000:]
    assert "gather/reduce exact: True" in out and "replicas bitwise identical: True" in out, out[-3000:]


def test_accelerate_pre_initialised_ddl_group_trains_without_any_patch():
    out = _accelerate("--way", "pre-initialised")
    # Accelerate names the group after its own CPU rule (state.py:810-813); the group is "ddl"
    assert "way pre-initialised, backend ddl (Accelerate's state.backend gloo" in out, out[-3000:]
    assert "gather/reduce exact: True" in out and "replicas bitwise identical: True" in out, out[-3000:]
    assert _losses(out, "accelerate_train") == _losses(_accelerate(), "accelerate_train"), out[-3000:]


def test_accelerate_gloo_gives_ddls_losses_bit_for_bit():
    gloo = _accelerate("--backend", "gloo")
    assert "backend gloo (Accelerate's state.backend gloo" in gloo and "replicas bitwise identical: True" in gloo
    assert _losses(gloo, "accelerate_train") and _losses(gloo, "accelerate_train") == _losses(_accelerate(), "accelerate_train")


@pytest.fixture
def prepare_backend(monkeypatch):
    """Accelerate's PartialState._prepare_backend as a multi-CPU torchrun rank sees it; restored afterwards."""
    state = pytest.importorskip("accelerate.state", reason="Accelerate is not installed (pip install '.[accelerate]')")
    monkeypatch.setattr(state.PartialState, "_prepare_backend", state.PartialState._prepare_backend)
    for key, value in {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    return state.PartialState


def test_accelerate_turns_ddl_into_gloo_on_the_cpu_unless_asked_not_to(prepare_backend):
    from accelerate.utils import DistributedType

    from ddl_triton.torch.accelerate import use_ddl_on_cpu

    multi_cpu = DistributedType.MULTI_CPU
    assert prepare_backend._prepare_backend(None, True, False, "ddl") == ("gloo", multi_cpu)  # then __init__ raises
    use_ddl_on_cpu()
    use_ddl_on_cpu()  # idempotent: wraps once
    assert prepare_backend._prepare_backend(None, True, False, "ddl") == ("ddl", multi_cpu)
    assert prepare_backend._prepare_backend(None, True, False, "gloo") == ("gloo", multi_cpu)
    assert prepare_backend._prepare_backend(None, True, False, None)[1] == multi_cpu  # mpi or gloo: Accelerate's call
    # No accelerator and no cpu=True: Accelerate would start "ddl" and then train without DDP (DistributedType.NO)
    with pytest.raises(ValueError, match=r"rank 0: .*not wrap the model in DistributedDataParallel.*cpu=True"):
        prepare_backend._prepare_backend(None, False, False, "ddl")
    assert prepare_backend._prepare_backend(None, False, False, "gloo") == ("gloo", DistributedType.NO)  # not ours


def test_use_ddl_on_cpu_refuses_an_untested_accelerate_or_a_changed_method(prepare_backend, monkeypatch):
    import accelerate

    from ddl_triton.torch.accelerate import use_ddl_on_cpu

    original = prepare_backend._prepare_backend
    monkeypatch.setattr(accelerate, "__version__", "1.16.0")
    with pytest.raises(RuntimeError, match=r"accelerate 1\.16\.0 is not a tested release .*init_process_group"):
        use_ddl_on_cpu()
    monkeypatch.setattr(accelerate, "__version__", "1.15.0")
    monkeypatch.setattr(prepare_backend, "_prepare_backend", lambda self, cpu=False, backend=None: (backend, None))
    with pytest.raises(RuntimeError, match=r"_prepare_backend takes \['self', 'cpu', 'backend'\]"):
        use_ddl_on_cpu()
    assert list(inspect.signature(original).parameters) == ["self", "cpu", "sagemaker_dp", "backend"]


# -- Lightning -------------------------------------------------------------------------------------

def _lightning_worker() -> str:
    pytest.importorskip("lightning", reason="Lightning is not installed (pip install '.[lightning]')")
    return _clean("multirank/frameworks_worker.py")


def test_lightning_ddp_strategy_and_ddl_strategy_hooks_train_identical_replicas_and_gloo_agrees():
    out = _lightning_worker()
    for case in ("plain", "hook-allreduce", "hook-int8", "hook-skipped", "gloo"):
        assert f"frameworks_worker: case {case} identical True" in out, out[-4000:]
    plain, allreduce, int8, skipped, gloo = _losses(out, "lightning_train")
    assert "DDLStrategy, hook allreduce calls on rank 0: 4" in out and allreduce == plain, out[-4000:]  # lossless hook
    assert "DDLStrategy, hook int8 calls on rank 0: 4" in out and int8 != plain, out[-4000:]  # the hook did run
    # Lightning's own DDPStrategy drops ddp_comm_hook on the CPU (ddp.py:224): if this starts failing,
    # Lightning registers it now, and docs/frameworks.md's "what does not work" must change.
    assert "DDPStrategy, hook int8 calls on rank 0: 0" in out and skipped == plain, out[-4000:]
    assert "backend gloo, DDPStrategy" in out and gloo == plain, out[-4000:]  # DDP's gradients over gloo: same bits
