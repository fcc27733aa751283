"""ddl_triton.jax.elastic in one process: JaxState's commit, restore and byte transfer (raw bytes and
a JSON manifest, checked against the receiver's own pytrees), its refusals, and how a jitted step
traced once reaches the world of the moment (jax/elastic/world.py: ``CURRENT``). The multi-rank
drill is tests/multirank/test_elastic_jax_one_host.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import ddl_triton.jax as ddj  # noqa: E402
from ddl_triton.elastic import state as floor_state  # noqa: E402
from ddl_triton.errors import DDLError  # noqa: E402
from ddl_triton.jax import elastic  # noqa: E402
from ddl_triton.jax import world as jax_world  # noqa: E402
from ddl_triton.options import Options  # noqa: E402
from ddl_triton.runtime import world as ddl_world  # noqa: E402


def _tree(seed: int):
    k = jax.random.PRNGKey(seed)
    return {"w": jax.random.normal(k, (3, 4)), "b": jnp.arange(4, dtype=jnp.int32) + seed,
            "h": [jnp.full((2,), seed, dtype=jnp.bfloat16), np.arange(3, dtype=np.float64) * seed]}


def _bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def test_restore_brings_back_the_last_commit_bit_for_bit():
    st = elastic.JaxState(params=_tree(1), step=3)
    st.save()
    committed = _bits(st.params)
    st.params = _tree(2)
    st.step = 4
    st.restore()
    assert _bits(st.params) == committed and st.step == 3 and st.commits == 0


def test_the_state_crosses_as_bytes_and_a_json_manifest():
    source = elastic.JaxState(params=_tree(5), opt=[_tree(6)], step=7, lr=0.5)
    tensors, manifest = source._packed()
    assert json.loads(json.dumps(manifest)) == manifest  # JSON only: nothing that would need pickle
    assert manifest["counters"] == {"step": 7, "lr": 0.5}
    flat = torch.empty(manifest["nbytes"], dtype=torch.uint8)
    floor_state._pack(tensors, flat)
    joiner = elastic.JaxState(params=_tree(0), opt=[_tree(0)], step=0, lr=0.1)  # same structure, other values
    received = joiner._receiving(manifest, rank=1, source=0)
    floor_state._unpack(flat, received)
    joiner._load(manifest, received)
    assert _bits(joiner.params) == _bits(source.params) and _bits(joiner.opt) == _bits(source.opt)
    assert (joiner.step, joiner.lr) == (7, 0.5)
    assert isinstance(joiner.params["w"], jax.Array) and isinstance(joiner.params["h"][1], np.ndarray)


def test_a_joiner_with_other_pytrees_is_refused():
    _, manifest = elastic.JaxState(params=_tree(1))._packed()
    other = _tree(1)
    other["w"] = jnp.zeros((4, 4))
    with pytest.raises(DDLError, match=r"rank 2: elastic: pytree 'params' differs from rank 0's: leaf \['w'\] "
                                       r"float32\[4, 4\] here, \['w'\] float32\[3, 4\] there"):
        elastic.JaxState(params=other)._receiving(manifest, rank=2, source=0)
    with pytest.raises(DDLError, match=r"rank 2: elastic: this rank's JaxState holds pytrees \['weights'\]"):
        elastic.JaxState(weights=_tree(1))._receiving(manifest, rank=2, source=0)


def test_bad_states_are_refused():
    with pytest.raises(ValueError, match="nothing to keep"):
        elastic.JaxState()
    with pytest.raises(TypeError, match=r"params\['x'\] is a str: a pytree's leaves must be arrays"):
        elastic.JaxState(params={"x": "1"})
    for name in ("commit", "commits", "_x"):
        with pytest.raises(ValueError, match="reserved"):
            elastic.JaxState(**{name: 0})
    with pytest.raises(DDLError, match="nothing was saved"):
        elastic.JaxState(step=0).restore()
    with pytest.raises(TypeError, match="not callable"):
        elastic.JaxState(step=0).register_reset_callbacks([1])


class _Mirror:
    """A world of ``size`` ranks whose every peer passes what this rank passes (tests/unit/test_jax.py's)."""

    requested_options = Options()

    def __init__(self, size):
        self.rank, self.size, self.calls = 0, size, 0

    def allreduce(self, buf, op="sum"):
        self.calls += 1
        buf *= self.size
        return buf

    def broadcast(self, buf, root=0):
        return buf

    def all_gather(self, out, inp):
        out[:] = np.tile(inp, self.size)
        return out


def test_a_jitted_step_traced_once_reaches_the_world_of_the_moment(monkeypatch):
    """What elastic.init() sets up: after a re-form the same jitted step, not traced again, reduces
    over the new world (its size too). Before the stand-in, it kept the world it was traced with."""
    two, three = _Mirror(2), _Mirror(3)
    monkeypatch.setattr(ddl_world, "_world", two)
    monkeypatch.setattr(jax_world, "_elastic_world", None)
    jax_world.use_elastic_world(elastic.CURRENT)
    traced = []

    @jax.jit
    def step(x):
        traced.append(1)
        return ddj.allreduce(x, "sum") + ddj.allreduce_gradients({"g": x}, op="sum")["g"]

    x = jnp.arange(4, dtype=jnp.int32)
    assert (np.asarray(step(x)) == 4 * np.arange(4)).all() and two.calls == 2
    monkeypatch.setattr(ddl_world, "_world", three)  # the world re-formed: another communicator, another size
    assert (np.asarray(step(x)) == 6 * np.arange(4)).all() and three.calls == 2 and two.calls == 2
    assert len(traced) == 1
