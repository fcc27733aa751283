"""The ``@triton.jit`` kernel of pack.py (its docstring has the semantics and the tables' layout),
imported on first use through _lazy_kernels.py so that importing the launcher does not import triton."""
import triton
import triton.language as tl


@triton.jit
def _pack_kernel(flat_ptr, meta_ptr, num_tensors, num_programs, UNPACK: tl.constexpr, BLOCK: tl.constexpr):
    # meta (int64) = [ptrs(T) | starts(T) | sizes(T) | program's tensor(P) | program's block(P)].
    pid = tl.program_id(0)
    t = tl.load(meta_ptr + 3 * num_tensors + pid)
    b = tl.load(meta_ptr + 3 * num_tensors + num_programs + pid)
    base = tl.load(meta_ptr + t).to(tl.pointer_type(flat_ptr.dtype.element_ty))
    start = tl.load(meta_ptr + num_tensors + t)
    size = tl.load(meta_ptr + 2 * num_tensors + t)
    # int64 offsets (b and start are int64): a > 2**31-element bucket must not wrap.
    offsets = b * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < size
    if UNPACK:
        tl.store(base + offsets, tl.load(flat_ptr + start + offsets, mask=mask), mask=mask)
    else:
        tl.store(flat_ptr + start + offsets, tl.load(base + offsets, mask=mask), mask=mask)
