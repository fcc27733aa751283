"""Fit the cost model's parameters to measured collective times, by least squares.

Semantics: given samples (a schedule's plan and the median seconds it took), find the
non-negative parameters p of ddl_triton/planning/costmodel.py that minimise

    sum over samples of ((coefficients(sample) . p - seconds) / seconds) ** 2

(relative error, so an 8-byte call weighs as much as a 64 MiB one). The model is linear in
p along a fixed critical path, but which path is critical depends on p, so the fit
alternates: compute every sample's critical-path coefficients under the current
parameters, solve the linear problem, repeat until the parameters settle (a few rounds).

Parameters no sample exercises (an MPI link on a one-node sweep, say) keep their starting
values and are reported as not fitted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..planning.costmodel import PARAMETERS, CostModel


@dataclass(frozen=True)
class Sample:
    """One measured call: ``terms(model)`` gives (modelled seconds, coefficients) under ``model``."""

    terms: Callable[[CostModel], tuple[float, tuple[float, ...]]]
    seconds: float
    label: str = ""


@dataclass(frozen=True)
class FitReport:
    model: CostModel
    not_fitted: tuple[str, ...]
    median_abs_rel_error: float
    max_abs_rel_error: float
    samples: int
    rounds: int


def fit(samples: list[Sample], start: CostModel, *, rounds: int = 6) -> FitReport:
    """Least-squares parameters for ``samples``, starting from ``start`` (see the module doc)."""
    if not samples:
        raise ValueError("cannot fit a cost model to no samples")
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    if not np.all(y > 0):
        raise ValueError("every sample needs a positive time")
    model = start
    used = np.zeros(len(PARAMETERS), dtype=bool)
    done = 0
    for done in range(1, rounds + 1):
        a = np.array([s.terms(model)[1] for s in samples], dtype=np.float64)
        used = np.any(a != 0, axis=0)
        fixed = ~used
        v = np.array(model.vector())
        # Unexercised parameters are constants: move their share to the right-hand side.
        rhs = y - a[:, fixed] @ v[fixed]
        solved = _nnls(a[:, used] / y[:, None], rhs / y)
        new = v.copy()
        new[used] = solved
        settled = np.allclose(new, v, rtol=1e-3, atol=0)
        model = CostModel.from_vector(new, cache_bytes=start.cache_bytes)
        if settled:
            break
    predicted = np.array([s.terms(model)[0] for s in samples])
    rel = np.abs(predicted - y) / y
    return FitReport(model, tuple(p for p, u in zip(PARAMETERS, used) if not u), float(np.median(rel)),
                     float(rel.max()), len(samples), done)


def _nnls(a: np.ndarray, b: np.ndarray, iterations: int = 50) -> np.ndarray:
    """min ||a x - b|| with x >= 0, by an active set: solve on the free variables, pin the most
    negative one to zero, repeat; then try to free pinned ones whose gradient points inward."""
    n = a.shape[1]
    free = np.ones(n, dtype=bool)
    x = np.zeros(n)
    for _ in range(iterations):
        x = np.zeros(n)
        if free.any():
            x[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (x[free] >= 0).all():
            gradient = a.T @ (b - a @ x)
            candidates = np.where(~free & (gradient > 1e-12))[0]
            if candidates.size == 0:
                break
            free[candidates[np.argmax(gradient[candidates])]] = True
            continue
        worst = np.where(free)[0][np.argmin(x[free])]
        free[worst] = False
    return np.clip(x, 0.0, None)
