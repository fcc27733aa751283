"""``@elastic.run`` for torch: the elastic floor's retry loop (ddl_triton/elastic/run.py, Horovod's
``hvd.elastic.run``; its doc has the semantics) over a ``TorchState``, which it refuses when the
state has a trained model but no optimizer (a rolled-back step would leave the optimizer ahead)."""
from __future__ import annotations

from ...elastic.run import make_run
from .state import TorchState

run = make_run(TorchState, "ddl_triton.torch.elastic.init_process_group()")
