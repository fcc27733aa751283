"""Triton kernels of ddl_triton: reduction (reduce.py), compression (int8.py, int4.py, onebit.py; the 16-bit
casts in sixteen_bit.py; which method uses which: ddl_triton/compression_methods.py) and bucket
packing (pack.py).

Each launcher takes keyword-only options, validates its tensors, and runs the
private ``@triton.jit`` kernel on CUDA tensors (or on CPU tensors when
``DDL_KERNELS=triton`` under ``TRITON_INTERPRET=1``); CPU tensors otherwise run
the torch reference that sits beside each kernel.

Launch configurations (block sizes, warps, stages) are plain data in :mod:`.launch_configs`
(read, edit, extend, pin a tuned winner); :mod:`.config_sweep` times them on a GPU; :mod:`.bandwidth` is
the one GB/s measurement the benchmarks share. Kernels know nothing of ranks or transports: the
package imports torch, and of ddl_triton only the options (the default backend). Triton is
imported when a Triton kernel is first needed (a CUDA tensor, ``DDL_KERNELS=triton``, the sweep),
not with the package, which every rank imports: see _lazy_kernels.py (``load_triton``: why Triton
must load before TensorFlow).
"""
from . import launch_configs
from ._dispatch import get_backend, set_backend
from ._lazy_kernels import load_triton
from .int8 import (dequantize_int8, dequantize_int8_reference, quantize_int8, quantize_int8_keep_error,
                   quantize_int8_reference, reduce_int8, reduce_int8_reference)
from .onebit import sign_compress, sign_compress_reference, sign_decompress, sign_decompress_reference
from .pack import pack, pack_reference, unpack, unpack_reference
from .reduce import REDUCE_OPS, reduce, reduce_reference

__all__ = [
    "REDUCE_OPS", "config_sweep", "dequantize_int8", "dequantize_int8_reference", "get_backend", "launch_configs",
    "load_triton", "pack", "pack_reference", "quantize_int8", "quantize_int8_keep_error", "quantize_int8_reference", "reduce",
    "reduce_int8", "reduce_int8_reference", "reduce_reference", "set_backend", "sign_compress",
    "sign_compress_reference", "sign_decompress", "sign_decompress_reference", "unpack", "unpack_reference",
]


def __getattr__(name: str):
    # PEP 562. config_sweep.py times the compiled kernels and imports triton at module level, so it is
    # imported on first access (ddl_triton.kernels.config_sweep), not with the package: see _lazy_kernels.py.
    if name == "config_sweep":
        import importlib

        return importlib.import_module(".config_sweep", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
