"""How a buffer is cut into per-rank blocks and pipelined chunks."""
from __future__ import annotations


def blocks(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous (start, size) blocks whose sizes
    differ by at most one, larger ones first: blocks(10, 4) -> [(0,3),(3,3),(6,2),(8,2)]."""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, size))
        start += size
    return out


def chunk_of(block: tuple[int, int], k: int, chunk_elems: int) -> tuple[int, int]:
    """The k-th chunk (start, size) of a block; size 0 once the block is used up."""
    start, size = block
    lo = min(size, k * chunk_elems)
    hi = min(size, lo + chunk_elems)
    return start + lo, hi - lo


def rounds(largest_block: int, chunk_elems: int) -> int:
    """Pipeline rounds needed to cover a block of ``largest_block`` elements."""
    return -(-largest_block // chunk_elems) if largest_block > 0 else 0
