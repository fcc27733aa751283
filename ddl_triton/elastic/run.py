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

Each room makes its own ``run`` with ``make_run`` (the state type it takes, the init to call first).
"""
from __future__ import annotations

import functools

from ..errors import DDLError, say_first
from .state import State
from .world import HostsUpdated, current


def make_run(state_type: type = State, init_call: str = "an elastic room's init()"):
    """The ``run`` decorator of a room whose states are ``state_type`` and whose world ``init_call`` makes."""

    def run(func=None, *, min_size: int = 1):
        """Decorator (bare, or ``run(min_size=2)``): see ddl_triton/elastic/run.py."""
        if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 1:
            raise ValueError(f"elastic.run: min_size must be an int >= 1, got {min_size!r}")

        def decorate(train):
            if not callable(train):
                raise TypeError(f"elastic.run: {train!r} is not callable")

            @functools.wraps(train)
            def wrapper(state, *args, **kwargs):
                world = current()
                if world is None:
                    raise ValueError(f"elastic.run: call {init_call} first")
                if not isinstance(state, state_type):
                    raise TypeError(f"elastic.run: the function's first argument must be an elastic."
                                    f"{state_type.__name__}, got {type(state).__name__}")
                _check_runnable(state)
                return _retry(world, state, train, args, kwargs, min_size)
            return wrapper

        return decorate(func) if func is not None else decorate

    return run


def _check_runnable(state) -> None:
    check = getattr(state, "_check_runnable", None)  # a room's own refusal (TorchState: no optimizer)
    if check is not None:
        check()


def _retry(world, state, train, args, kwargs, min_size: int):
    """The loop of the module doc."""
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
                if isinstance(e, DDLError):  # the job's end: its cause first, after the store's warnings
                    say_first(e, "the elastic job ends here: the traceback follows")
                raise
            change = ("lost", e)


run = make_run()
