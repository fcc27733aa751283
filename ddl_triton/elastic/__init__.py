"""The elastic floor: what every framework's elastic room shares (Horovod's ``hvd.elastic``
without a framework). The rooms over it: ``ddl_triton.torch.elastic`` (TorchState, DDP) and
``ddl_triton.jax.elastic`` (JaxState, pytrees), ``ddl_triton.tensorflow.elastic`` (Keras).

What lives here (one concept per file):

    state.py    ``State``: counters and commits, saved, restored, and synchronized to a new world
                as raw bytes and a JSON manifest (a room's state adds its arrays)
    world.py    ``ElasticWorld``: the store, the membership (ddl_triton/elastic/membership.py decides
                who is in each generation), the ddl communicator of the current generation, how a
                generation is re-formed, and its ``records`` (one per change); ``CURRENT``, the
                stand-in for the world communicator of the moment
    run.py      the retry loop behind ``@elastic.run`` (``make_run``: each room's own decorator)
    entry.py    each room's ``init`` body (``start``) and its questions (rank, size, generation, recoveries)
    membership.py  who is in each generation: the agreement through the job's store, joiners'
                admission, revocation (moved here from the runtime: only elastic jobs use it)
    store_calls.py the membership's bounded store calls and blocking waits, on connections of
                their own
    watcher.py  the thread that wakes on a revocation notice and makes this process's waits give up

This room may import the runtime, transports and the core modules; never a framework room
(``ddl_triton.torch``, ``ddl_triton.jax``, ``ddl_triton.tensorflow``), nor JAX or TensorFlow.
It uses torch only as the runtime does (tensors as byte buffers, torch's TCPStore client).
docs/elastic.md tells the whole story.
"""
from __future__ import annotations

from .run import make_run, run
from .state import State
from .world import CURRENT, ElasticWorld, HostsUpdated, current

__all__ = ["CURRENT", "ElasticWorld", "HostsUpdated", "State", "current", "make_run", "run"]
