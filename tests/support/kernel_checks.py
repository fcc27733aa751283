"""What the CPU kernel tests (tests/unit/test_kernels.py, test_int8.py, test_onebit.py) share: the
``backend`` fixture, the poisoning of outputs, bitwise and error-bound comparisons, and test data.

Every check that takes ``backend`` runs twice: on the Triton kernels (under TRITON_INTERPRET=1, set
in tests/conftest.py) and on the torch path. Output buffers are poisoned, including the ones
launchers allocate themselves (``poison_empty`` wraps ``torch.empty`` to fill NaN / -128 / 0xA5), so
an element a kernel never writes cannot pass by luck. A test module takes the fixtures by importing
them: ``from support.kernel_checks import backend, poison_empty``.
"""
from __future__ import annotations

import os

import pytest
import torch

import ddl_triton.kernels as K
from ddl_triton.kernels._dispatch import interpreting
from support.sentinels import real_empty, sentinel

SIZES = [0, 1, 127, 4097, 65537]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(params=["triton", "torch"])
def backend(request):
    if request.param == "triton":
        assert os.environ.get("TRITON_INTERPRET") == "1" and interpreting(), \
            "the Triton path on CPU needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py)"
    K.set_backend(request.param)
    yield request.param
    K.set_backend("auto")


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Launchers allocate outputs with torch.empty: make unwritten elements visible."""
    def empty(*args, **kwargs):
        return sentinel(real_empty(*args, **kwargs))
    monkeypatch.setattr(torch, "empty", empty)


def poisoned(shape, dtype) -> torch.Tensor:
    return sentinel(real_empty(shape, dtype=dtype))


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so -0.0 vs 0.0 and NaN payloads count as differences."""
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
    diff = (bits_of(actual) != bits_of(expected)).nonzero()
    assert diff.numel() == 0, \
        f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}: " \
        f"{actual.reshape(-1)[diff[0, 0]].item()} vs {expected.reshape(-1)[diff[0, 0]].item()}"


def assert_within(actual: torch.Tensor, oracle: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (actual.double().reshape(-1) - oracle.reshape(-1)).abs()
    ok = err <= bound.reshape(-1)  # NaN (a poisoned, unwritten element) compares False
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0, 0])
        raise AssertionError(f"{what}: {(~ok).sum().item()} elements out of bound, first at {i}: "
                             f"got {actual.reshape(-1)[i].item()!r}, oracle {oracle.reshape(-1)[i].item()!r}, "
                             f"|err| {err[i].item():.3e} > bound {bound.reshape(-1)[i].item():.3e}")


def gamma(k: int) -> float:
    """Higham's gamma_k: the relative error bound of k fp32 roundings in a row."""
    u = 2.0 ** -24
    return k * u / (1 - k * u)


def make(n: int, dtype: torch.dtype, seed: int, spread: int = 6) -> torch.Tensor:
    """randn times 2**U(-spread, spread): many magnitudes in one block, a few exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-spread, spread + 1, (n,), generator=g).double())
    x[torch.rand(n, generator=g) < 0.02] = 0.0
    return x.to(dtype)
