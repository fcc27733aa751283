"""mpi4jax's point-to-point on JAX arrays: ``send``, ``recv``, ``sendrecv``, eager and inside ``jax.jit``.

Semantics (mpi4jax >= 0.8, token-free: tokens are managed for the user, and ``token=`` is refused as
mpi4jax refuses it; its signatures and defaults):

    send(x, dest, *, tag=0, comm=None)                     ``x``'s values to rank ``dest``; returns None
    recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None)
                                                           a new array shaped and typed as ``x`` (``x``
                                                           is a template, never overwritten) holding
                                                           what ``source`` sent with ``tag``
    sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None, status=None)
                                                           a send to ``dest`` and a recv from ``source``
                                                           at once (no deadlock in a ring); returns
                                                           the received array

Messages between one pair of ranks with one tag arrive in the order sent (MPI's non-overtaking
rule). A jitted function runs its sends and receives as ordered ``io_callback``s (collectives.py
says why), so in program order, once per call; eagerly, a call runs at once, after the effects
already dispatched. ``status`` (an ``mpi4py.MPI.Status``) learns the sender's rank and tag.
``send`` returns once its message is on its way (MPI_Send's rule: possibly only when the receiver
takes it), so two ranks that both send first and receive second may wait on each other for a
large message, as with mpi4jax: use ``sendrecv``.

Each message carries a small header (the dtype's name and the shape) before the values, so a
receiver whose template differs from what was sent raises ValueError naming both ranks, the tag,
and both shapes and dtypes, instead of reading garbage. A peer out of range, a negative or too
large tag, or a ``source``/``tag`` wildcard given to ``send`` raise ValueError naming the rank
before anything is sent; so does a ``send`` to this rank itself, which MPI completes only once it
is received (a deadlock for one thread), naming ``sendrecv``, which does both at once. Every wait
is bounded by the communicator's deadline (``Options.timeout``): past it a CollectiveTimeout names
the peer.

Transport: a private duplicate of the communicator's MPI communicator (``Idup``: collective, made
by ``ddl_triton.jax.init()`` on every rank for the world, else by each rank's first point-to-point
call on that communicator, as mpi4jax clones COMM_WORLD at its first call). A world made without
MPI (env:// RANK/WORLD_SIZE/MASTER_ADDR) has none: point-to-point is refused there, naming the
collectives to use instead. Not differentiable (JAX refuses to differentiate an io_callback), and
not under ``jax.vmap``.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from . import world
from .collectives import concrete, ordered
from ..errors import peer_failed

__all__ = ["init", "recv", "send", "sendrecv"]

_NAME_BYTES = 16  # a dtype's name ("bfloat16", "complex128") in ASCII, zero-padded
_MAX_DIMS = 64
_CHANNELS: dict = {}  # id(communicator) -> (communicator, its private MPI duplicate)


def send(x, dest, *, tag=0, comm=None, token=world.NO_TOKEN):
    """Send ``x`` (a JAX or NumPy array, or a scalar) to rank ``dest`` with ``tag`` (module doc)."""
    world.no_token(token, "send")
    comm = world.resolve(comm)
    x = jnp.asarray(x)
    dest = _peer(comm, "send", "dest", dest, wildcard=False)
    tag = _tag(comm, "send", "tag", tag, wildcard=False)
    if dest == comm.rank:
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax.send: dest={dest} is this rank, whose send would wait "
                         "for its own recv (MPI completes a message to oneself only once it is received): use "
                         f"sendrecv(x, x, source={dest}, dest={dest}) for a copy to oneself")
    mpi = channel(comm)
    if concrete([x]):
        _send_now(comm, mpi, np.asarray(x), dest, tag)
        return None
    ordered(lambda v: (_send_now(comm, mpi, np.asarray(v), dest, tag), [])[1], (x,), [])
    return None


def recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None, token=world.NO_TOKEN):
    """A new array like ``x`` holding what ``source`` sent with ``tag`` (module doc)."""
    world.no_token(token, "recv")
    comm = world.resolve(comm)
    x = jnp.asarray(x)
    source = _peer(comm, "recv", "source", source, wildcard=True)
    tag = _tag(comm, "recv", "tag", tag, wildcard=True)
    _check_status(comm, "recv", status)
    mpi = channel(comm)
    like = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if concrete([x]):
        return jnp.asarray(_recv_now(comm, mpi, like, source, tag, status))
    return ordered(lambda _: _recv_now(comm, mpi, like, source, tag, status), (x,), [like])[0]


def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None, status=None,
             token=world.NO_TOKEN):
    """Send ``sendbuf`` to ``dest`` while receiving, from ``source``, a new array like ``recvbuf`` (module doc)."""
    world.no_token(token, "sendrecv")
    comm = world.resolve(comm)
    sendbuf, recvbuf = jnp.asarray(sendbuf), jnp.asarray(recvbuf)
    dest = _peer(comm, "sendrecv", "dest", dest, wildcard=False)
    source = _peer(comm, "sendrecv", "source", source, wildcard=True)
    sendtag = _tag(comm, "sendrecv", "sendtag", sendtag, wildcard=False)
    recvtag = _tag(comm, "sendrecv", "recvtag", recvtag, wildcard=True)
    _check_status(comm, "sendrecv", status)
    mpi = channel(comm)
    like = jax.ShapeDtypeStruct(recvbuf.shape, recvbuf.dtype)

    def exchange(value):
        pending = _post_send(mpi, np.asarray(value), dest, sendtag)
        got = _recv_now(comm, mpi, like, source, recvtag, status, also=pending, call="sendrecv: recv")
        _wait(comm, pending[0], f"sendrecv: send to rank {dest} (tag {sendtag})", dest)
        return got

    if concrete([sendbuf, recvbuf]):
        return jnp.asarray(exchange(sendbuf))
    return ordered(exchange, (sendbuf,), [like])[0]


def init(**kwargs):
    """``ddl_triton.jax.init``: the world communicator (world.py's ``init``: ``ddl_triton.init(**kwargs)``,
    created at the first call, the same object afterwards); under MPI it also sets up the world's
    point-to-point channel, collectively, on every rank (so that no rank's first send waits for it)."""
    comm = world.init(**kwargs)
    if getattr(comm.bootstrap, "kind", None) == "mpi":
        channel(comm)
    return comm


def channel(comm):
    """``comm``'s private MPI communicator for point-to-point, made (collectively: ``Idup``) at the
    first call; refused, naming the alternative, where ``comm`` was made without MPI."""
    held = _CHANNELS.get(id(comm))
    if held is not None and held[0] is comm:
        return held[1]
    base = getattr(comm.bootstrap, "comm", None)
    if not isinstance(base, MPI.Comm):
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax point-to-point (send, recv, sendrecv) needs an MPI "
                         "world (launch with ddlrun or mpiexec); this communicator was made without MPI (env://): "
                         "exchange data with the collectives instead (alltoall, allgather, bcast)")
    dup, request = base.Idup()
    _wait(comm, request, "setting up point-to-point (every rank of the communicator makes its first point-to-point "
                         "call, or calls ddl_triton.jax.init(), at the same point)", -1)
    _CHANNELS[id(comm)] = (comm, dup)
    return dup


# -- the host side ---------------------------------------------------------------------------------
def _header(dtype, shape) -> np.ndarray:
    name = np.dtype(dtype).name.encode("ascii")[:_NAME_BYTES]
    head = np.zeros(_NAME_BYTES + 8 * (1 + len(shape)), dtype=np.uint8)
    head[: len(name)] = np.frombuffer(name, dtype=np.uint8)
    head[_NAME_BYTES:] = np.array([len(shape), *shape], dtype=np.int64).view(np.uint8)
    return head


def _described(raw: np.ndarray) -> str:
    """What a message's header says it holds ("float32[5]"), or that it is not one of ours."""
    if raw.size < _NAME_BYTES + 8:
        return f"a message of {raw.size} bytes without a header"
    name = bytes(raw[:_NAME_BYTES]).rstrip(b"\0").decode("ascii", "replace")
    ndim = int(raw[_NAME_BYTES: _NAME_BYTES + 8].view(np.int64)[0])
    if not 0 <= ndim <= _MAX_DIMS or raw.size < _NAME_BYTES + 8 * (1 + ndim):
        return f"a message of {raw.size} bytes with an unreadable header"
    shape = raw[_NAME_BYTES + 8: _NAME_BYTES + 8 * (1 + ndim)].view(np.int64).tolist()
    return f"{name}{shape}"


def _post_send(mpi, value: np.ndarray, dest: int, tag: int):
    value = np.ascontiguousarray(value)
    message = np.concatenate([_header(value.dtype, value.shape), value.reshape(-1).view(np.uint8)])
    return mpi.Isend([message, message.size, MPI.BYTE], dest=dest, tag=tag), message


def _send_now(comm, mpi, value: np.ndarray, dest: int, tag: int) -> None:
    request, message = _post_send(mpi, value, dest, tag)
    _wait(comm, request, f"send to rank {dest} (tag {tag})", dest)
    del message  # kept alive until MPI is done with it


def _recv_now(comm, mpi, like, source: int, tag: int, status, also=None, call: str = "recv") -> np.ndarray:
    """Receive the next message matching (source, tag), check its header against ``like``, return
    its values. ``also``: a send of sendrecv's, polled meanwhile so a ring cannot wait on itself."""
    seen = status if status is not None else MPI.Status()
    peer = "any rank" if source == MPI.ANY_SOURCE else f"rank {source}"
    what = f"{call} from {peer} (tag {'any' if tag == MPI.ANY_TAG else tag})"
    deadline = time.monotonic() + comm.options.timeout
    pause = 0.0
    message = None
    while message is None:
        message = mpi.Improbe(source=source, tag=tag, status=seen)
        if message is None:
            if also is not None:
                also[0].Test()
            if time.monotonic() > deadline:
                raise peer_failed(comm.rank, f"ddl_triton.jax.{what}", source if source >= 0 else -1,
                                  "a message", comm.options.timeout, comm.placement.describe)
            time.sleep(pause)  # releases the GIL for JAX's threads
            pause = min(1e-3, pause * 2 or 1e-6)
    raw = np.empty(seen.Get_count(MPI.BYTE), dtype=np.uint8)
    _wait(comm, message.Irecv([raw, raw.size, MPI.BYTE]), what, seen.Get_source())
    dtype, shape = np.dtype(like.dtype), tuple(like.shape)
    head = _header(dtype, shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if raw.size != head.size + nbytes or not np.array_equal(raw[: head.size], head):
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax.{what}: rank {seen.Get_source()} sent "
                         f"{_described(raw)} with tag {seen.Get_tag()}, but this rank's template is "
                         f"{dtype.name}{list(shape)}: give recv an array of the sent shape and dtype")
    return raw[head.size:].view(dtype).reshape(shape).copy()


def _wait(comm, request, what: str, peer: int) -> None:
    deadline = time.monotonic() + comm.options.timeout
    pause = 0.0
    while not request.Test():
        if time.monotonic() > deadline:
            raise peer_failed(comm.rank, f"ddl_triton.jax.{what}", peer, "its MPI request", comm.options.timeout,
                              comm.placement.describe)
        time.sleep(pause)
        pause = min(1e-3, pause * 2 or 1e-6)


# -- argument checks (before anything is sent, naming the rank) ------------------------------------
def _peer(comm, what: str, name: str, peer, wildcard: bool) -> int:
    if wildcard and isinstance(peer, (int, np.integer)) and peer == MPI.ANY_SOURCE:
        return int(peer)
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or not 0 <= peer < comm.size:
        allowed = " or MPI.ANY_SOURCE" if wildcard else ""
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax.{what}: {name} must be a rank in [0, {comm.size})"
                         f"{allowed}, got {peer!r}")
    return int(peer)


def _tag(comm, what: str, name: str, tag, wildcard: bool) -> int:
    if wildcard and isinstance(tag, (int, np.integer)) and tag == MPI.ANY_TAG:
        return int(tag)
    bound = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag <= bound:
        allowed = " or MPI.ANY_TAG" if wildcard else ""
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax.{what}: {name} must be in [0, {bound}]{allowed}, "
                         f"got {tag!r}")
    return int(tag)


def _check_status(comm, what: str, status) -> None:
    if status is not None and not isinstance(status, MPI.Status):
        raise TypeError(f"rank {comm.rank}: ddl_triton.jax.{what}: status must be an mpi4py.MPI.Status or None, "
                        f"got {type(status).__name__}")
