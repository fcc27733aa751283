"""Reduction ops and dtypes the collectives accept, and their normalisation."""
from __future__ import annotations

import torch

OPS = ("sum", "avg", "min", "max")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64)
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def normalize_op(op, rank: int) -> str:
    """Accept "sum"/"avg"/"min"/"max" (any case) or a torch.distributed.ReduceOp."""
    if isinstance(op, str):
        name = op.lower()
    else:
        name = _reduce_op_name(op)
    if name not in OPS:
        raise ValueError(f"rank {rank}: unsupported reduction op {op!r}; valid: {', '.join(OPS)} "
                         "(or torch.distributed.ReduceOp.SUM/AVG/MIN/MAX)")
    return name


def _reduce_op_name(op) -> str:
    try:
        from torch.distributed import ReduceOp
    except ImportError:  # a torch built without distributed support
        return repr(op)
    table = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}
    for key, name in table.items():
        try:
            if op == key:
                return name
        except TypeError:
            continue
    return repr(op)


def check_op_dtype(op: str, dtype: torch.dtype, rank: int) -> None:
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"rank {rank}: op 'avg' is not defined for integer dtype {dtype} "
                         "(an integer mean would truncate); use 'sum' and divide")
