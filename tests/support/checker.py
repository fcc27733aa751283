"""The multi-rank workers' checker: exact comparisons that record a failure instead of raising.

Every rank must run the same sequence of collectives whatever a check's outcome: an assertion
that stopped one rank would leave the others waiting for it, and the test would see a hang
instead of the wrong value. So a check only counts a case and, when it fails, appends one line
naming the rank; the worker goes on, and reports every failure at the end (``report``).
"""
from __future__ import annotations

import time
import traceback

import torch

from support.report import gather_and_report, print_line


class Checker:
    """Counts checks (``cases``) and collects failed ones (``failures``, lines ``"rank R: what: why"``).

    - ``equal``: ``got`` equals ``expected`` exactly: the same dtype, shape and values (``torch.equal``).
    - ``identical``: every rank of ``group`` holds the same bits in a tensor (compared as raw bytes,
      so that -0.0 and 0.0 differ), and the tensor equals itself, so that a NaN never passes.
    - ``raises``: a call raises the expected exception, whose message mentions a given text; each
      call is also kept in ``raised`` (what, expected, raised, seconds, first line of the message),
      for tables of bad inputs.
    - ``true``: a condition holds.

    ``world`` (default ``MPI.COMM_WORLD``) is the communicator that ``run`` aborts and ``report``
    gathers over; ``group`` (``world`` until a worker sets it, say to a sub-group's own MPI
    communicator) is the one whose ranks ``identical`` compares.
    """

    def __init__(self, world=None):
        if world is None:
            from mpi4py import MPI  # here, not at the top: importing it starts MPI
            world = MPI.COMM_WORLD
        self.world = world
        self.group = world
        self.rank = world.Get_rank()
        self.failures: list[str] = []
        self.cases = 0
        self.raised: list[tuple[str, str, str, float, str]] = []

    def fail(self, what: str, why: str = "") -> None:
        """Record a failure of ``what`` on this rank (``why``: the details)."""
        self.failures.append(f"rank {self.rank}: {what}" + (f": {why}" if why else ""))

    def true(self, what: str, cond: bool, msg: str = "") -> None:
        self.cases += 1
        if not cond:
            self.fail(what, msg)

    def equal(self, what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        self.cases += 1
        if got.dtype != expected.dtype or got.shape != expected.shape or not torch.equal(got, expected):
            where = ("dtype" if got.dtype != expected.dtype else "shape" if got.shape != expected.shape
                     else (got != expected).nonzero()[:3].flatten().tolist())
            self.fail(what, f"wrong at {where}; got {got.flatten()[:8].tolist()} ({got.dtype}, {tuple(got.shape)}), "
                            f"expected {expected.flatten()[:8].tolist()} ({expected.dtype}, {tuple(expected.shape)})")

    def identical(self, what: str, t: torch.Tensor) -> None:
        """Every rank of ``self.group`` holds the same bits in ``t`` (gathered through MPI as raw bytes)."""
        from mpi4py import MPI
        raw = (t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)).numpy()
        every = torch.empty(self.group.Get_size() * raw.size, dtype=torch.uint8).numpy()
        self.group.Allgather([raw, MPI.BYTE], [every, MPI.BYTE])
        self.cases += 1
        for q in range(self.group.Get_size()):
            if not (every[q * raw.size:(q + 1) * raw.size] == raw).all():
                self.fail(what, f"result differs from rank {q}'s bits")
                return
        if not torch.equal(t, t):
            self.fail(what, "NaN in the result")

    def raises(self, what: str, exc: type | tuple[type, ...], fn, must_mention: str = "") -> None:
        """``fn()`` raises ``exc`` (a class or a tuple of them) with ``must_mention`` in its message."""
        self.cases += 1
        expected = " or ".join(e.__name__ for e in (exc if isinstance(exc, tuple) else (exc,)))
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the wrong exception is a failure too, not a crash
            self.raised.append((what, expected, type(e).__name__, time.monotonic() - t0, str(e).splitlines()[0]
                                if str(e) else ""))
            if not isinstance(e, exc):
                self.fail(what, f"raised {type(e).__name__} instead of {expected}: {e}")
            elif must_mention not in str(e):
                self.fail(what, f"error does not mention {must_mention!r}: {e}")
        else:
            self.raised.append((what, expected, "nothing", time.monotonic() - t0, ""))
            self.fail(what, f"did not raise {expected}")

    def run(self, body) -> None:
        """``body()``; an exception in it ends the whole job (the other ranks would wait for this
        one forever), after printing every failure so far and the traceback."""
        try:
            body()
        except Exception:  # noqa: BLE001
            self.failures.append(f"rank {self.rank}: exception\n{traceback.format_exc()}")
            print_line("\n".join(self.failures))
            self.world.Abort(1)

    def report(self, heading: str) -> int:
        """Rank 0 prints the failures, one line per rank and ``"<heading>, <cases> checks, <k> failures"``
        (support/report.py's ``gather_and_report``, which tests read with ``read_report``); the exit status."""
        return gather_and_report(heading, self.failures, self.cases, self.world)
