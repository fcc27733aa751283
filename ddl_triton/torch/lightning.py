"""PyTorch Lightning on the "ddl" backend: Lightning's own DDPStrategy, plus its comm hook on the CPU.

``Trainer(strategy=DDPStrategy(process_group_backend="ddl"))`` runs as is: Lightning passes the
name to ``torch.distributed.init_process_group`` and keeps no list of backends. One argument
does not: DDPStrategy's ``ddp_comm_hook`` (and ``ddp_comm_state``, ``ddp_comm_wrapper``) is
registered only on CUDA. Lightning 2.6's ``DDPStrategy._register_ddp_hooks``
(``lightning/pytorch/strategies/ddp.py:224``, ``if self.root_device.type == "cuda":``) skips it
on any other device without a word, after a comment that hooks "only work with NCCL"; with
torch 2.13, DDP on gloo or "ddl" runs hooks on CPU tensors (tests/multirank/test_frameworks.py).

``DDLStrategy`` is DDPStrategy with ``process_group_backend="ddl"`` by default and the hook
registered on every device. It overrides only the public ``configure_ddp`` and calls torch's
public ``DistributedDataParallel.register_comm_hook``; on CUDA, where Lightning registers the
hook itself, it does not register it twice::

    from ddl_triton.torch import hooks
    from ddl_triton.torch.lightning import DDLStrategy

    trainer = Trainer(accelerator="cpu", devices=2,
                      strategy=DDLStrategy(ddp_comm_state=hooks.HookState(), ddp_comm_hook=hooks.int8_compress_hook))
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch.strategies import DDPStrategy

import ddl_triton.torch  # noqa: F401  (registers the backend "ddl")

__all__ = ["DDLStrategy"]


class DDLStrategy(DDPStrategy):
    """Lightning's DDPStrategy on "ddl" (by default), whose ``ddp_comm_hook`` applies on CPU too.

    Every argument is DDPStrategy's. ``ddp_comm_wrapper``, if given, wraps the hook as Lightning
    does (``hook = ddp_comm_wrapper(ddp_comm_hook)``). A wrapper or state without a hook is
    an error, as it would silently do nothing.
    """

    def __init__(self, *args: Any, process_group_backend: Optional[str] = "ddl", ddp_comm_state: Optional[object] = None,
                 ddp_comm_hook: Optional[Callable] = None, ddp_comm_wrapper: Optional[Callable] = None,
                 **kwargs: Any) -> None:
        if ddp_comm_hook is None and (ddp_comm_wrapper is not None or ddp_comm_state is not None):
            raise ValueError("DDLStrategy: ddp_comm_state or ddp_comm_wrapper given without ddp_comm_hook")
        super().__init__(*args, process_group_backend=process_group_backend, ddp_comm_state=ddp_comm_state,
                         ddp_comm_hook=ddp_comm_hook, ddp_comm_wrapper=ddp_comm_wrapper, **kwargs)
        self._ddl_hook = (ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper)

    def configure_ddp(self) -> None:
        super().configure_ddp()
        state, hook, wrapper = self._ddl_hook
        # DDP keeps the hooks it was given in _comm_hooks; a second register_comm_hook raises.
        # Lightning registers on CUDA itself (ddp.py:224), so only what it skipped is added here.
        if hook is None or getattr(self.model, "_comm_hooks", None):
            return
        self.model.register_comm_hook(state, wrapper(hook) if wrapper is not None else hook)
