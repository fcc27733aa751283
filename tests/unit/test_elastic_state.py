"""TorchState (ddl_triton/torch/elastic/state.py) and the elastic API's refusals, in one process.

commit / restore must bring back the model, the optimizer's state and the counters bit for bit (a
restore after a failed step is what keeps replicas identical); what sync sends is raw bytes and a
JSON manifest; bad input is refused with a message that says what to do."""
from __future__ import annotations

import pytest
import torch

from ddl_triton.errors import DDLError
from ddl_triton.torch import elastic
from ddl_triton.torch.elastic import state as state_module


def _net_and_opt(kind: str = "sgd"):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    net.register_buffer("seen", torch.zeros(3, dtype=torch.int64))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) if kind == "sgd" else \
        torch.optim.Adam(net.parameters(), lr=1e-2, betas=(0.8, 0.95))
    return net, opt


def _step(net, opt, seed: int) -> None:
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    net(x).square().sum().backward()
    opt.step()
    net.seen += 1


def _bits(net, opt) -> list[bytes]:
    out = [t.detach().reshape(-1).view(torch.uint8).numpy().tobytes() for t in net.state_dict().values()]
    for slots in opt.state_dict()["state"].values():
        out += [v.detach().reshape(-1).view(torch.uint8).numpy().tobytes() for v in slots.values()
                if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_restore_brings_back_the_last_commit_bit_for_bit(kind):
    net, opt = _net_and_opt(kind)
    st = elastic.TorchState(net, opt, step=0, epoch=0)
    for i in range(3):
        _step(net, opt, i)
        st.step += 1
        st.commit()
    committed = _bits(net, opt)
    _step(net, opt, 99)  # a step whose collective "failed" on another rank, applied here
    st.step += 1
    st.epoch = 5
    assert _bits(net, opt) != committed
    st.restore()
    assert _bits(net, opt) == committed and st.step == 3 and st.epoch == 0 and st.commits == 3
    assert all(p.grad is None for p in net.parameters())  # the failed step's gradients are gone
    _step(net, opt, 3)   # training goes on from the restored state: the optimizer's state is its own
    st.restore()         # (not the snapshot's tensors: a second restore still finds the commit)
    assert _bits(net, opt) == committed


def test_the_state_crosses_as_bytes_and_a_json_manifest():
    net, opt = _net_and_opt("adam")
    st = elastic.TorchState(net, opt, step=7)
    _step(net, opt, 0)
    st.save()
    tensors, manifest = st._packed()
    import json
    json.dumps(manifest)  # JSON only: nothing that would need pickle
    assert manifest["counters"] == {"step": 7}
    assert manifest["optimizer"]["param_groups"][0]["betas"] == [0.8, 0.95]
    flat = torch.empty(manifest["nbytes"], dtype=torch.uint8)
    state_module._pack(tensors, flat)
    # A joiner: the same code, a fresh model and an optimizer that has not stepped (no Adam state yet).
    net2, opt2 = _net_and_opt("adam")
    with torch.no_grad():
        for p in net2.parameters():
            p.add_(1)
    st2 = elastic.TorchState(net2, opt2, step=0)
    received = st2._receiving(manifest, rank=1, source=0)
    state_module._unpack(flat, received)
    st2._load(manifest, received)
    assert _bits(net2, opt2) == _bits(net, opt) and st2.step == 7
    _step(net, opt, 1)
    _step(net2, opt2, 1)
    assert _bits(net2, opt2) == _bits(net, opt)  # and they go on in step


def test_a_joiner_with_another_model_is_refused():
    net, opt = _net_and_opt()
    st = elastic.TorchState(net, opt)
    st.save()
    _, manifest = st._packed()
    other = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    other.register_buffer("seen", torch.zeros(3, dtype=torch.int64))
    st2 = elastic.TorchState(other, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(DDLError, match=r"rank 2: elastic: 0.weight is .*\[8, 5\] here, .*\[7, 5\] on rank 0"):
        st2._receiving(manifest, rank=2, source=0)


def test_bad_states_are_refused():
    net, opt = _net_and_opt()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        elastic.TorchState("net", opt)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        elastic.TorchState(net, "adam")
    with pytest.raises(ValueError, match="nothing to keep"):
        elastic.TorchState()
    with pytest.raises(TypeError, match="counter epoch='1' must be an int or a float"):
        elastic.TorchState(net, opt, epoch="1")
    with pytest.raises(ValueError, match="reserved"):
        elastic.TorchState(net, opt, commits=0)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="updates none of the model's parameters"):
        elastic.TorchState(other, opt)
    with pytest.raises(DDLError, match="nothing was saved"):
        elastic.TorchState(net, opt).restore()
    with pytest.raises(TypeError, match="not callable"):
        elastic.TorchState(net, opt).register_reset_callbacks([1])


def test_run_and_init_refuse_bad_use(monkeypatch):
    net, opt = _net_and_opt()
    with pytest.raises(ValueError, match="min_size must be an int >= 1"):
        elastic.run(min_size=0)
    train = elastic.run(lambda state: None)
    with pytest.raises(ValueError, match="call ddl_triton.torch.elastic.init_process_group"):
        train(elastic.TorchState(net, opt))
    monkeypatch.setenv("PMI_RANK", "0")  # as mpiexec/ddlrun launch a process
    with pytest.raises(ValueError, match="launched by MPI .*cannot lose a rank.*torchrun"):
        elastic.init_process_group("ddl")
    monkeypatch.delenv("PMI_RANK")
    with pytest.raises(ValueError, match="backend 'gloo'"):
        elastic.init_process_group("gloo")
    monkeypatch.setenv("DDL_TOPOLOGY", "2x2")
    with pytest.raises(ValueError, match="DDL_TOPOLOGY='2x2' emulates a grid of a fixed size"):
        elastic.init_process_group("ddl")


def test_run_refuses_a_model_without_its_optimizer(monkeypatch):
    """In a world of one (a store in memory): a state with a trainable model and no optimizer is
    refused before training, and min_size larger than the world too."""
    import torch.distributed as dist

    from ddl_triton.elastic import world as floor_world
    from ddl_triton.elastic.membership import Membership
    from ddl_triton.torch.elastic import world as world_module

    store = dist.HashStore()
    membership = Membership(store, 0, "h0", 5.0)
    membership.start(0, 1)
    fake = world_module.ElasticWorld(store, membership, None, "ddl", joiner=False)
    monkeypatch.setattr(floor_world, "_WORLD", fake)  # the elastic floor keeps the process's world
    net, opt = _net_and_opt()
    with pytest.raises(ValueError, match="a model but no optimizer"):
        elastic.run(lambda state: None)(elastic.TorchState(net))
    with pytest.raises(ValueError, match="min_size=2 is larger than the world \\(1 ranks\\)"):
        elastic.run(min_size=2)(lambda state: None)(elastic.TorchState(net, opt))
    with pytest.raises(TypeError, match="must be an elastic.TorchState"):
        elastic.run(lambda state: None)({"model": net})


class _ThreadComm:
    """Just what ``TorchState.sync`` calls of a communicator, for ranks that are threads of this
    process: all_gather and broadcast through shared slots and a barrier."""

    class _Options:
        timeout = 10.0

    def __init__(self, rank: int, shared: dict):
        self.rank, self.size, self.options, self._shared = rank, shared["size"], self._Options(), shared

    def _meet(self, put) -> None:
        self._shared["slots"][self.rank] = put
        self._shared["barrier"].wait(10)
        got = list(self._shared["slots"])
        self._shared["barrier"].wait(10)
        return got

    def all_gather(self, out, inp):
        out.copy_(torch.cat([t.reshape(-1) for t in self._meet(inp.clone())]))

    def broadcast(self, t, root):
        t.copy_(self._meet(t.clone())[root])


def test_a_joiner_that_saved_a_state_of_its_own_is_never_the_source():
    """Two members at commit 5 and a joiner that planted its own weights and lr=1e9, saved with 0
    commits (the fewest): every rank ends with the members' state. The joiner is named by the
    decision (``joined``), not by what it sends."""
    import threading

    import torch.distributed as dist

    store, size = dist.HashStore(), 3
    shared = {"size": size, "slots": [None] * size, "barrier": threading.Barrier(size)}
    states, results = [], [None] * size
    for rank in range(size):
        net, opt = _net_and_opt()
        st = elastic.TorchState(net, opt, step=0)
        if rank < 2:  # members: five steps and five commits, the same on both
            for s in range(5):
                _step(net, opt, s)
                st.step += 1
                st.commits += 1
                st.save()
        else:  # the joiner: weights and a learning rate of its own, saved before asking to join
            with torch.no_grad():
                for p in net.parameters():
                    p.fill_(7.0)
            opt.param_groups[0]["lr"] = 1e9
            st.save()
        states.append(st)

    def run(rank: int) -> None:
        results[rank] = states[rank].sync(_ThreadComm(rank, shared), "manifest", store, joined=frozenset({2}))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == [0, 0, 0]
    member = _bits(states[0].model, states[0].optimizer)
    assert _bits(states[1].model, states[1].optimizer) == member
    assert _bits(states[2].model, states[2].optimizer) == member
    assert states[2].optimizer.param_groups[0]["lr"] == 0.1 and states[2].step == 5 and states[2].commits == 5
