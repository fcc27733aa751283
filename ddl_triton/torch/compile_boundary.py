"""Where torch.compile stops: the "ddl" backend's Python runs eagerly, as a C++ backend's code would.

``eager_methods(cls)`` marks every method defined on ``cls`` as never traced by Dynamo: a frame
of one, and everything it calls, runs as ordinary Python while a compiled function runs; and
where Dynamo would inline a call of one into a graph, it breaks the graph there and calls it
eagerly (as for a ``torch.compiler.disable``d function).

Why: gloo's and NCCL's ProcessGroups are C++, so nothing Dynamo could trace runs when DDP's
C++ reducer calls them. Ours is Python, reached from C++ through torch's ProcessGroup
trampoline, and Dynamo's frame hook sees those frames. During a compiled DDP forward, DDP's
``_pre_forward`` has the reducer rebuild its buckets, which broadcasts through the group; Dynamo
then tried to trace ``DdlProcessGroup.broadcast`` and stopped at its first attribute, because a
ProcessGroup is an opaque object to Dynamo (``UnsafeScriptObjectError: Attempted to access
unregistered member on an OpaqueObject``, member ``_comm``). A communication backend is not
model code: nothing in it belongs in a graph, and tracing it could only fail or add graph breaks.
The model's own code still compiles; DDP's comm hooks run where DDP runs them, in backward.

How: each method's code object gets Dynamo's "skip, and skip what it calls" frame strategy,
set through torch's C hook (``torch._C._dynamo.eval_frame.set_code_exec_strategy``, what
``torch._dynamo.skip`` uses), and the ``_torchdynamo_disable`` mark Dynamo checks before
inlining. It costs nothing per call and does not import ``torch._dynamo`` (about 2 s, which
every rank of a job would pay at ``import ddl_triton.torch``). A torch without that hook gets
``torch.compiler.disable(recursive=True)`` wrappers instead: the same behaviour, the import
paid, about 1 us per call.

Example:
    @eager_methods
    class DdlProcessGroup(dist.ProcessGroup): ...
    # torch.compile(DistributedDataParallel(model)) now runs the group's broadcast eagerly
"""
from __future__ import annotations

import inspect

import torch

__all__ = ["eager_methods"]


def eager_methods(cls: type) -> type:
    """Mark each function defined in ``cls``'s own body (not dunders, properties or inherited
    methods) as never traced by Dynamo, with what it calls (module doc); returns ``cls``."""
    for name, member in list(vars(cls).items()):
        if name.startswith("__") or not inspect.isfunction(member):
            continue
        setattr(cls, name, _never_traced(member))
    return cls


def _never_traced(fn):
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return torch.compiler.disable(fn, recursive=True)
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    fn._torchdynamo_disable = True  # inlining it into a graph: a graph break, then an eager call
    fn._torchdynamo_disable_msg = "ddl_triton: a communication backend runs eagerly (compile_boundary.py)"
    return fn
