"""The fragment split: a model's parameters, in order, cut into ``fragments`` contiguous groups of
balanced bytes (Streaming DiLoCo's fragments; torchft takes them from the user as ``model_fragments``).

Every rank splits alike: the split is a pure function of the parameters' byte sizes, which are the
same on every rank of a data-parallel job. Contiguous groups in parameter order keep each fragment
a run of layers (what Streaming DiLoCo syncs), and the greedy cut below puts the boundary of group
``g`` where the running byte total first reaches ``g/fragments`` of the whole, never leaving a
group empty.

Example: byte sizes [400, 100, 100, 400] into 2 -> [[0, 1], [2, 3]] (500 B each).
"""
from __future__ import annotations

__all__ = ["split"]


def split(nbytes: list[int], fragments: int, rank: int | None = None) -> list[list[int]]:
    """The parameter indices of each fragment (module doc): ``fragments`` non-empty lists that
    together hold 0..len(nbytes)-1 in order. ValueError (naming ``rank`` when given) unless
    1 <= fragments <= len(nbytes)."""
    where = f"rank {rank}: " if rank is not None else ""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"{where}outer sync: fragments must be an int >= 1, got {fragments!r}")
    if fragments > len(nbytes):
        raise ValueError(f"{where}outer sync: fragments={fragments} is more than the {len(nbytes)} parameters "
                         "to split (each fragment holds at least one)")
    total = sum(nbytes)
    groups: list[list[int]] = [[] for _ in range(fragments)]
    running, g = 0, 0
    for i, size in enumerate(nbytes):
        if groups[g] and g + 1 < fragments:
            target = total * (g + 1)  # in units of 1/fragments bytes: integers, the same on every rank
            overshoots = abs((running + size) * fragments - target) > abs(running * fragments - target)
            needed = len(nbytes) - i <= fragments - g - 1  # every item left is needed by a later group
            if overshoots or needed:
                g += 1
        groups[g].append(i)
        running += size
    return groups
