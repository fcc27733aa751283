"""Nothing a bootstrap reads is executed: values cross as JSON, checked on arrival
(ddl_triton/runtime/setup/bootstrap_values.py). The store is unauthenticated, so these tests plant
what a stranger on its port could write, where the ranks read it."""
from __future__ import annotations

import os
import pickle
import threading

import pytest

torch_dist = pytest.importorskip("torch.distributed")

from ddl_triton.runtime.setup.bootstrap import BootstrapError, MpiBootstrap, StoreBootstrap  # noqa: E402


class _Planted:
    """A pickle payload whose unpickling creates ``path``: the visible side effect of running
    a stranger's code (``__reduce__`` names any callable; ``open`` is the harmless one)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _payload(tmp_path) -> tuple[bytes, str]:
    path = str(tmp_path / "ran")
    return pickle.dumps(_Planted(path)), path


def test_a_pickle_planted_at_the_larger_world_hello_key_never_runs(tmp_path):
    # The key a rank of a larger world would write, which no rank of this world writes and every
    # rank reads: world of 1, prefix "p", step 1 -> "p/1-hello/1".
    store = torch_dist.HashStore()
    payload, ran = _payload(tmp_path)
    store.set("p/1-hello/1", payload)
    with pytest.raises(BootstrapError, match=r"^rank 0: ddl_triton bootstrap: store key 'p/1-hello/1' does not "
                                             r"hold a JSON value"):
        StoreBootstrap(store, 0, 1, timeout=5, prefix="p")
    assert not os.path.exists(ran), "the planted pickle was unpickled: a stranger's code ran"


def test_a_pickle_planted_at_a_peers_hello_allgather_and_bcast_keys_never_runs(tmp_path):
    payload, ran = _payload(tmp_path)
    # A peer's hello key, planted before that peer (rank 1) posts it: rank 0 reads it first.
    store = torch_dist.HashStore()
    store.set("h/1-hello/1", payload)
    with pytest.raises(BootstrapError, match=r"^rank 0: .*store key 'h/1-hello/1' does not hold a JSON value"):
        StoreBootstrap(store, 0, 2, timeout=5, prefix="h")
    # Rank 1 is real (a thread) and says hello; its allgather and bcast values are planted.
    store = torch_dist.HashStore()
    peer = threading.Thread(target=StoreBootstrap, args=(store, 1, 2), kwargs={"timeout": 5, "prefix": "t"})
    peer.start()
    boot = StoreBootstrap(store, 0, 2, timeout=5, prefix="t")
    peer.join(10)
    store.set("t/2-allgather/1", payload)
    with pytest.raises(BootstrapError, match=r"^rank 0: .*store key 't/2-allgather/1' does not hold a JSON value"):
        boot.allgather([1, 2])
    store.set("t/3-bcast", payload)
    with pytest.raises(BootstrapError, match=r"^rank 0: .*store key 't/3-bcast' does not hold a JSON value"):
        boot.bcast(None, root=1)
    assert not os.path.exists(ran), "the planted pickle was unpickled: a stranger's code ran"


def test_json_that_is_not_a_hello_is_refused_by_name():
    store = torch_dist.HashStore()
    for value in (b'"hello"', b"[2, 3, 4]", b'[0, "h|b", 1]', b'[2, "h|b", -1]', b'[true, "h|b", 1]'):
        store.set("q/1-hello/1", value)
        with pytest.raises(BootstrapError, match=r"^rank 0: ddl_triton bootstrap: store key 'q/1-hello/1' holds"):
            StoreBootstrap(store, 0, 1, timeout=5, prefix="q")
        store.delete_key("q/1-hello/claims/0")  # the next try may claim rank 0 again


def test_values_round_trip_as_json_and_anything_else_is_refused():
    from ddl_triton.runtime.setup.bootstrap_values import decode, encode, shaped

    assert decode(encode((1, "a", [2.5, None], {"k": True})), "k", 0) == [1, "a", [2.5, None], {"k": True}]
    with pytest.raises(TypeError, match="only JSON-able values"):
        encode({1, 2})
    with pytest.raises(TypeError, match="only JSON-able values"):
        encode(float("nan"))
    for raw, why in ((b"\xff\xfe", "not UTF-8"), (b"[" * 100000, "too deep"), (b"NaN", "not JSON"),
                     (b"[1,", "truncated")):
        with pytest.raises(BootstrapError, match=r"^rank 3: ddl_triton bootstrap: where does not hold a JSON value"):
            decode(raw, "where", 3)
    with pytest.raises(BootstrapError, match="holds a str, not bytes"):
        decode("text", "where", 3)
    assert shaped(["h", 1], (str, int), "w", 0) == ["h", 1]
    for bad in (["h", True], ["h"], ("h", 1), [1, "h"], None):
        with pytest.raises(BootstrapError, match=r"^rank 0: ddl_triton bootstrap: w holds .*not the \[str, int\]"):
            shaped(bad, (str, int), "w", 0)


def test_the_mpi_bootstrap_carries_the_same_json_values():
    from mpi4py import MPI

    boot = MpiBootstrap(MPI.COMM_SELF, timeout=5)
    try:
        assert boot.allgather(("x", 1)) == [["x", 1]]
        assert boot.bcast({"a": (1, 2)}) == {"a": [1, 2]}
        boot.barrier()
        assert boot.host_of_rank() == [0]
        with pytest.raises(TypeError, match="only JSON-able values"):
            boot.allgather(object())
    finally:
        boot.close()
