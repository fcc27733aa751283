"""``@elastic.run``: call the training function until it returns, re-forming the world whenever it
fails because of a lost rank or grows because a host joined (Horovod's ``hvd.elastic.run``).

Semantics: ``run(train)(state, *args)`` calls ``train(state, *args)``. The first call makes every
rank take rank 0's state (a joiner first waits to be admitted, then takes the members' state).
When the call raises because the world failed (a collective timed out, a peer died, another rank
said so through the store), the state is rolled back to its last commit, the survivors agree on a
new world, every rank takes the same state, the reset callbacks run, and ``train`` is called
again: it resumes from the state's counters. When ``state.commit()`` found joiners, the world grows
the same way, without a rollback. The function returns once it has returned on every rank of one
world (a rank that finished while another failed re-forms with it and calls ``train`` again, which
finds its counters at the end). Any other exception is the application's and goes on up (the
process then exits; the others see a lost rank). ``min_size``: a world smaller than this ends the
job with ``PeersLost``; it may not be larger than the world at the first call.
"""
from __future__ import annotations

import functools

from ...errors import DDLError, say_first
from .state import TorchState
from .world import HostsUpdated, current


def run(func=None, *, min_size: int = 1):
    """Decorator (bare, or ``run(min_size=2)``): see the module doc."""
    if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 1:
        raise ValueError(f"elastic.run: min_size must be an int >= 1, got {min_size!r}")

    def decorate(train):
        if not callable(train):
            raise TypeError(f"elastic.run: {train!r} is not callable")

        @functools.wraps(train)
        def wrapper(state, *args, **kwargs):
            world = current()
            if world is None:
                raise ValueError("elastic.run: call ddl_triton.torch.elastic.init_process_group() first")
            if not isinstance(state, TorchState):
                raise TypeError(f"elastic.run: the function's first argument must be an elastic.TorchState, got "
                                f"{type(state).__name__}")
            if state.optimizer is None and _has_optimizer(state.model):
                raise ValueError("elastic.run: the state has a model but no optimizer: pass TorchState(model, "
                                 "optimizer), or a rolled-back step would leave the optimizer's state ahead")
            if world.joiner_waiting:
                world.admit(state)
            else:
                if min_size > world.decision.size:
                    raise ValueError(f"rank {world.decision.rank}: elastic.run: min_size={min_size} is larger than "
                                     f"the world ({world.decision.size} ranks)")
                world.start(state)
            change = None  # (reason, error) of a world change to make before training again
            while True:
                try:
                    if change is not None:
                        world.reform(state, *change, min_size)  # may fail too (a second loss): then again
                        change = None
                    result = train(state, *args, **kwargs)
                    world.finish()  # every rank got here: none leaves while another still needs it
                    return result
                except HostsUpdated:
                    change = ("grow", None)
                except Exception as e:  # noqa: BLE001 - the world's failures are recovered, others re-raised
                    if not world.failed(e):
                        if isinstance(e, DDLError):  # the job's end: its cause first, after torch's store warnings
                            say_first(e, "the elastic job ends here: the traceback follows")
                        raise
                    change = ("lost", e)
        return wrapper

    return decorate(func) if func is not None else decorate


def _has_optimizer(model) -> bool:
    """Whether the application evidently trains ``model`` (any parameter that requires a gradient)."""
    return model is not None and any(p.requires_grad for p in model.parameters())
