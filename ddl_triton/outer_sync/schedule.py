"""When each fragment syncs: torchft's staggered schedule of ``DiLoCo`` (torchft/local_sgd.py).

With ``sync_every`` = H inner steps and F fragments, the period is p = H // F (torchft requires
F <= H and F dividing H): every p inner steps one fragment syncs, the fragments in turn, so each
fragment syncs once every H steps. Fragment i's sync steps are (i + 1) * p + k * H (k >= 0; torchft's
``fragment_sync_offset`` of fragment i is floor(H / F * (i + 1)) = (i + 1) * p), i.e. the steps
where (step - offset_i) % H == 0.

With ``fragment_sync_delay`` = d (torchft's, the tau of the Streaming DiLoCo paper; 0 <= d < p),
the fragment's pseudo-gradient is taken and its allreduce started after inner step sync - d, and
the result is applied (the outer optimizer steps) after inner step sync: the allreduce overlaps
d inner steps. ``step`` counts inner steps from 1 (the first ``inner_optimizer.step()`` is step 1).

Example: H = 8, F = 2, d = 1: p = 4; fragment 0 starts at steps 3, 11, 19, ... and applies at 4,
12, 20, ...; fragment 1 starts at 7, 15, ... and applies at 8, 16, ...
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Schedule"]


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Schedule:
    """The staggered sync schedule (module doc); the constructor checks torchft's constraints."""

    sync_every: int
    fragments: int = 1
    fragment_sync_delay: int = 0
    rank: int | None = None

    def __post_init__(self):
        where = f"rank {self.rank}: " if self.rank is not None else ""
        if not _int(self.sync_every) or self.sync_every < 1:
            raise ValueError(f"{where}outer sync: sync_every must be an int >= 1, got {self.sync_every!r}")
        if not _int(self.fragments) or self.fragments < 1:
            raise ValueError(f"{where}outer sync: fragments must be an int >= 1, got {self.fragments!r}")
        if self.sync_every < self.fragments or self.sync_every % self.fragments:
            raise ValueError(f"{where}outer sync: sync_every ({self.sync_every}) must be a multiple of fragments "
                             f"({self.fragments}): one fragment syncs every sync_every // fragments steps "
                             "(torchft's rule)")
        if not _int(self.fragment_sync_delay) or not 0 <= self.fragment_sync_delay < self.period:
            raise ValueError(f"{where}outer sync: fragment_sync_delay must be an int in [0, sync_every // fragments "
                             f"= {self.period}), got {self.fragment_sync_delay!r} (a fragment must be applied "
                             "before the next one starts)")

    @property
    def period(self) -> int:
        """Inner steps between two fragments' syncs: sync_every // fragments."""
        return self.sync_every // self.fragments

    def offset(self, fragment: int) -> int:
        """Fragment ``fragment``'s first sync step, (fragment + 1) * period (torchft's offset)."""
        return (fragment + 1) * self.period

    def syncs_at(self, step: int) -> int | None:
        """The fragment applied after inner step ``step``, or None."""
        if step < 1 or step % self.period:
            return None
        return (step // self.period - 1) % self.fragments

    def starts_at(self, step: int) -> int | None:
        """The fragment whose allreduce starts after inner step ``step``, or None."""
        return self.syncs_at(step + self.fragment_sync_delay)
