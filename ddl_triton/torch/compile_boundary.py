"""Where torch.compile stops: the "ddl" backend's Python runs eagerly, as a C++ backend's code would.

``eager_methods(cls)`` wraps every method defined on ``cls`` in ``torch.compiler.disable``:
when Dynamo meets a call of one, it runs it as ordinary Python instead of tracing it, and
everything the method calls too.

Why: gloo's and NCCL's ProcessGroups are C++, so nothing Dynamo could trace runs when DDP's
C++ reducer calls them. Ours is Python, reached from C++ through torch's ProcessGroup
trampoline, and Dynamo's frame hook sees those frames. During a compiled DDP forward, DDP's
``_pre_forward`` has the reducer rebuild its buckets, which broadcasts through the group; Dynamo
then tried to trace ``DdlProcessGroup.broadcast`` and stopped at its first attribute, because a
ProcessGroup is an opaque object to Dynamo (``UnsafeScriptObjectError: Attempted to access
unregistered member on an OpaqueObject``, member ``_comm``). A communication backend is not
model code: nothing in it belongs in a graph, and tracing it could only fail or add graph breaks.
The model's own code still compiles; DDP's comm hooks run where DDP runs them, in backward.
The wrapper costs about 1 us per call, against tens of microseconds for the smallest collective.

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
    """Wrap each function defined in ``cls``'s own body (not dunders, properties or inherited
    methods) in ``torch.compiler.disable``; returns ``cls``."""
    for name, member in list(vars(cls).items()):
        if name.startswith("__") or not inspect.isfunction(member):
            continue
        setattr(cls, name, torch.compiler.disable(member, recursive=True))
    return cls
