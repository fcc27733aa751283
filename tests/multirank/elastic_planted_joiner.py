"""examples/elastic_train.py, run as a joiner that plants a state of its own before it asks to join
(tests/multirank/test_elastic_joining.py): every parameter 7.0, the learning rate 1e9, saved with
``state.save()`` (the fewest commits of any rank), then ``elastic.run`` as the example calls it. A
joiner must never be the source of the job's state: after the join every rank must hold the
members' state, whatever this one saved."""
from __future__ import annotations

import functools
import os
import sys

import torch

from ddl_triton.torch import elastic

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
sys.path.insert(0, os.path.abspath(EXAMPLES))
import elastic_train  # noqa: E402 - the example itself, unchanged

_run = elastic.run


def _planting_run(func=None, *, min_size: int = 1):
    """``elastic.run`` that first plants this process's own state (see the module doc)."""
    def decorate(train):
        wrapped = _run(train, min_size=min_size)

        @functools.wraps(train)
        def planted(state, *args, **kwargs):
            with torch.no_grad():
                for p in state.model.parameters():
                    p.fill_(7.0)
            for group in state.optimizer.param_groups:
                group["lr"] = 1e9
            state.save()
            return wrapped(state, *args, **kwargs)
        return planted
    return decorate(func) if func is not None else decorate


if __name__ == "__main__":
    elastic.run = _planting_run
    sys.exit(elastic_train.main())
