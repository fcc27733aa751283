"""16-bit compression (the fp16 and bf16 rows of ddl_triton/compression_methods.py): round to the wire
dtype, and back.

    compress:    w = wire_dtype(x)          round to nearest even, once (torch's cast; inf beyond
                                            fp16's 65504, bf16 keeps fp32's range)
    decompress:  out = out.dtype(w)         exact when out is fp32 (every 16-bit value is one)

No Triton kernel: a cast is one pass at memory speed in torch already, on the CPU and on a GPU,
and is bitwise the same there. The collective that sends these values (``allreduce_16bit``, its
server summing in fp32 and rounding once) is ddl_triton/runtime/compression/compressed.py's.
Payload per n elements: 2n bytes (2x smaller than fp32).

Example: compress_16bit(tensor([1.0, 0.1]), "bfloat16") -> tensor([1.0, 0.10009765625], bfloat16)
"""
from __future__ import annotations

import torch

WIRE_DTYPES = ("float16", "bfloat16")


def wire_dtype(name) -> torch.dtype:
    """The torch dtype of a wire dtype given by name ("float16", "bfloat16") or as a torch dtype."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name in WIRE_DTYPES else name
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"a 16-bit wire dtype must be float16 or bfloat16, got {name}")
    return dtype


def compress_16bit(x: torch.Tensor, dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` rounded once to ``dtype`` (written into ``out`` when given: a message buffer)."""
    dtype = wire_dtype(dtype)
    if out is None:
        return x.to(dtype)
    return out.copy_(x)


def decompress_16bit(w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``w`` stored into ``out`` (exact for an fp32 ``out``)."""
    return out.copy_(w)


def roundtrip_float16(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One compress + decompress through fp16, the cost the tuner's probe times (the fp16 row)."""
    return decompress_16bit(compress_16bit(x, torch.float16), out)


def roundtrip_bfloat16(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One compress + decompress through bf16, the cost the tuner's probe times (the bf16 row)."""
    return decompress_16bit(compress_16bit(x, torch.bfloat16), out)
