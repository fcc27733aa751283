"""The wire layout of the compressed allreduces (compressed.py's two-shot, gathered.py's
two-rank form, per_level.py's inter-host phase): how a tensor is cut into chunks, and how one
chunk, compressed, fills one message slot.

- A tensor of N elements on n ranks is cut into n chunks of C elements (``chunk_elems``): N/n
  rounded up to the compressor's alignment (``align``: the int8 block, the int4 block but at
  least 8, 32 sign bits for 1-bit, 1 for 16-bit), so no quantization block or bit word spans
  two chunks; the trailing chunks may be short or empty (``chunk_bounds``). The two-rank form
  sends the whole tensor as one chunk (n = 1 here: ``whole_slot_words``).
- One chunk's slot (``slot_words``), in wire elements of the method's ``word_bytes``: the
  method's row in ddl_triton/compression_methods.py says (no method is spelled out here):
      int8         C int8 values (C/4 int32 words), then C/block fp32 scales
      int4         C 4-bit values (C/8 int32 words, two a byte), then C/block fp32 scales
      onebit       C sign bits (C/32 words), then one fp32 scale per scale group (at least 1)
      fp16, bf16   C values of the wire dtype ("16bit": their shared layout's older name)
- 1-bit's scale groups (``segments``): a chunk split at the ``groups`` offsets, each rounded
  down to a multiple of 8 so that every group starts on a whole byte of bits (``nbytes``).

Example: int8, N = 10, n = 3, block 4: C = 4, chunks [(0, 4), (4, 8), (8, 10)], each slot
4/4 + 4/4 = 2 words (the last chunk's 2 elements padded to the block).
"""
from __future__ import annotations

from ... import compression_methods

ONEBIT_ALIGN = 32  # 32 sign bits = one int32 word: a chunk's bits fill whole words


def align(kind: str, block: int) -> int:
    """The multiple every chunk (but the trailing ones) holds for method ``kind`` (its row's ``align``)."""
    return compression_methods.layout(kind).align(block)


def chunk_elems(numel: int, size: int, alignment: int) -> int:
    """C: ceil(ceil(numel / alignment) / size) * alignment, at least one ``alignment``."""
    units = -(-numel // alignment)
    return max(1, -(-units // size)) * alignment


def chunk_bounds(numel: int, size: int, alignment: int = 1) -> list[tuple[int, int]]:
    """The ``size`` chunks ``[start, stop)`` of ``numel`` elements: rank q reduces chunk q.

    Every chunk but the trailing ones holds C = ``chunk_elems(numel, size, alignment)``
    elements; the last non-empty one may be shorter, and chunks past the end are empty.
    Example: chunk_bounds(10, 3, alignment=4) -> [(0, 4), (4, 8), (8, 10)];
             chunk_bounds(5, 3, alignment=4)  -> [(0, 4), (4, 5), (5, 5)].
    """
    c = chunk_elems(numel, size, alignment)
    return [(min(q * c, numel), min((q + 1) * c, numel)) for q in range(size)]


def slot_words(kind: str, c: int, block: int, scales: int = 1) -> int:
    """Wire elements of one chunk's slot of C = ``c`` elements (its row's ``slot_words``): int32
    words (int8, onebit) or 16-bit values, as the row's ``word_bytes`` says."""
    return compression_methods.layout(kind).slot_words(c, block, scales)


def whole_slot_words(kind: str, numel: int, block: int, groups) -> int:
    """Elements of the two-rank form's one slot: the whole tensor as one chunk."""
    row = compression_methods.layout(kind)
    c = chunk_elems(numel, 1, row.align(block))
    scales = len(segments([(0, numel)], groups)[0]) if row.scale_groups else 1
    return row.slot_words(c, block, scales)


def segments(bounds: list[tuple[int, int]], groups) -> list[list[tuple[int, int]]]:
    """Per chunk, its scale groups [s, e): the chunk split at ``groups`` offsets rounded down to 8."""
    starts = sorted({g - g % 8 for g in (groups or ())})
    out = []
    for a, b in bounds:
        cuts = [a] + [g for g in starts if a < g < b] + [b]
        out.append([(s, e) for s, e in zip(cuts, cuts[1:]) if e > s])
    return out


def nbytes(bits: int) -> int:
    """Whole bytes that hold ``bits`` sign bits."""
    return (bits + 7) // 8
