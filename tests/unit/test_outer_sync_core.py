"""The outer-sync floor (ddl_triton/outer_sync/) in one process: the fragment split, torchft's staggered
schedule, the core's pseudo-gradient and state dict, torch's DiLoCo on a world of one, and the
contract's errors. The multi-rank behaviour (averages, identical replicas, compression, hosts) is
tests/multirank/test_outer_sync.py's."""
from __future__ import annotations

import pytest
import torch

from ddl_triton.outer_sync import OuterSync, Schedule, split


class _Work:
    def __init__(self, t):
        self.t = t

    def wait(self, timeout=None):
        return self.t


class OneRank:
    """A communicator of one rank: what the core asks of one (the average of one replica is itself).
    ``nodes`` and ``link`` stand for a placement and an init probe (sync_every="auto" reads them)."""
    rank, size = 0, 1

    def __init__(self, nodes=(0,), link=None):
        from types import SimpleNamespace
        self.placement = SimpleNamespace(node_of_rank=tuple(nodes))
        self.planner = SimpleNamespace(link=link)

    def allreduce(self, t, op="sum", async_op=False):
        return _Work(t) if async_op else t

    def broadcast(self, t, root=0, async_op=False):
        return t


# -- the split -----------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes, fragments, expected", [
    ([400, 100, 100, 400], 2, [[0, 1], [2, 3]]),
    ([10, 10, 10, 10], 4, [[0], [1], [2], [3]]),
    ([1000, 1, 1, 1], 2, [[0], [1, 2, 3]]),
    ([1, 1, 1, 1000], 2, [[0, 1, 2], [3]]),
    ([1, 1, 1000, 1, 1], 3, [[0, 1], [2], [3, 4]]),
    ([5], 1, [[0]]),
    ([0, 0, 0], 3, [[0], [1], [2]]),
])
def test_the_split_is_contiguous_non_empty_and_balanced(nbytes, fragments, expected):
    got = split(nbytes, fragments)
    assert got == expected
    assert [i for g in got for i in g] == list(range(len(nbytes)))


def test_the_split_balances_many_parameters_within_one_parameter():
    sizes = [4 * (1 + (i * 37) % 11) for i in range(100)]
    for f in (2, 3, 7):
        groups = split(sizes, f)
        loads = [sum(sizes[i] for i in g) for g in groups]
        assert max(loads) - min(loads) <= 2 * max(sizes), (f, loads)


@pytest.mark.parametrize("fragments, why", [(0, "fragments must be an int >= 1"), (4, "more than the 3 parameters"),
                                            (True, "fragments must be an int")])
def test_the_split_refuses_bad_fragment_counts(fragments, why):
    with pytest.raises(ValueError, match=why) as e:
        split([4, 4, 4], fragments, rank=2)
    assert "rank 2" in str(e.value)


# -- the schedule --------------------------------------------------------------------------------
def test_one_fragment_syncs_every_sync_every_steps():
    s = Schedule(4)
    assert [t for t in range(1, 13) if s.syncs_at(t) is not None] == [4, 8, 12]
    assert [s.starts_at(t) for t in range(1, 9)] == [None, None, None, 0, None, None, None, 0]


def test_fragments_are_staggered_as_torchft_staggers_them():
    s = Schedule(8, fragments=2, fragment_sync_delay=1)
    assert s.period == 4 and [s.offset(i) for i in range(2)] == [4, 8]
    applies = {t: s.syncs_at(t) for t in range(1, 25) if s.syncs_at(t) is not None}
    starts = {t: s.starts_at(t) for t in range(1, 25) if s.starts_at(t) is not None}
    assert applies == {4: 0, 8: 1, 12: 0, 16: 1, 20: 0, 24: 1}
    assert starts == {3: 0, 7: 1, 11: 0, 15: 1, 19: 0, 23: 1}
    for i in range(2):  # the brief's form: fragment i syncs where (step - offset_i) % sync_every == 0
        assert [t for t, f in applies.items() if f == i] == [t for t in range(s.offset(i), 25, 8)]


def test_three_fragments_each_sync_once_per_sync_every():
    s = Schedule(6, fragments=3, fragment_sync_delay=1)
    applied = [s.syncs_at(t) for t in range(1, 13)]
    assert applied == [None, 0, None, 1, None, 2, None, 0, None, 1, None, 2]
    assert [s.starts_at(t) for t in range(1, 13)] == [0, None, 1, None, 2, None, 0, None, 1, None, 2, None]


@pytest.mark.parametrize("kwargs, why", [
    (dict(sync_every=0), "sync_every must be an int >= 1"),
    (dict(sync_every=2.0), "sync_every must be an int >= 1"),
    (dict(sync_every=4, fragments=3), "must be a multiple of fragments"),
    (dict(sync_every=2, fragments=4), "must be a multiple of fragments"),
    (dict(sync_every=4, fragments=2, fragment_sync_delay=2), r"fragment_sync_delay must be an int in \[0, "),
    (dict(sync_every=4, fragment_sync_delay=-1), "fragment_sync_delay must be"),
])
def test_the_schedule_refuses_what_torchft_refuses(kwargs, why):
    with pytest.raises(ValueError, match=why) as e:
        Schedule(**kwargs, rank=1)
    assert "rank 1" in str(e.value)


# -- the core ------------------------------------------------------------------------------------
def test_the_core_takes_the_pseudo_gradient_and_round_trips_its_state():
    core = OuterSync(OneRank(), [12, 8], sync_every=4, fragments=2, fragment_sync_delay=1)
    core.set_backup(0, torch.tensor([1.0, 2.0, 3.0]))
    core.set_backup(1, torch.tensor([5.0, 6.0]))
    events = [core.advance() for _ in range(4)]
    assert events == [(0, None), (None, 0), (1, None), (None, 1)]  # (starting, applying) per inner step
    core.start(0, torch.tensor([0.0, 4.0, 3.0]))
    assert core.pending() == [0]
    state = core.state_dict()
    assert torch.equal(core.finish(0), torch.tensor([1.0, -2.0, 0.0]))  # backup - local
    assert state["step"] == 4 and state["fragments"] == [[0], [1]]
    other = OuterSync(OneRank(), [12, 8], sync_every=4, fragments=2, fragment_sync_delay=1)
    other.load_state_dict(state)
    assert other.step == 4 and torch.equal(other.backups[1], torch.tensor([5.0, 6.0]))
    # the start was in flight when the state was saved: finishing redoes it from the local params
    assert torch.equal(other.finish(0, torch.tensor([1.0, 1.0, 1.0])), torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="the state is of sync_every"):
        OuterSync(OneRank(), [12, 8], sync_every=8, fragments=2).load_state_dict(state)


def test_the_core_refuses_auto_compression_and_unknown_methods():
    with pytest.raises(ValueError, match="rank 0: outer sync: compression 'auto'"):
        OuterSync(OneRank(), [4], sync_every=1, compression="auto")
    with pytest.raises(ValueError, match="rank 0"):
        OuterSync(OneRank(), [4], sync_every=1, compression="no-such-method")


# -- torch's DiLoCo on one rank: the hook, the outer step, the contract's errors ------------------
def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p) + i)
    return m


def _train(model, inner, steps):
    for t in range(steps):
        inner.zero_grad()
        x = torch.full((4, 3), float(t % 3 - 1))
        model(x).sum().backward()
        inner.step()


def test_diloco_counts_inner_steps_by_the_hook_and_removes_it_on_exit():
    from ddl_triton.torch.diloco import DiLoCo

    ref = _model()
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.125), 6)
    m = _model()
    inner = torch.optim.SGD(m.parameters(), lr=0.125)
    outer = torch.optim.SGD(m.parameters(), lr=1.0)
    d = DiLoCo(m, inner, outer, sync_every=2, fragments=2, comm=OneRank())
    with d:
        _train(m, inner, 6)
        assert d.step == 6
    _train(m, inner, 1)  # outside the context: not counted
    assert d.step == 6 and not inner._optimizer_step_post_hooks
    # one replica, outer SGD lr 1: the outer step puts back the local parameters (exact here)
    m2 = _model()
    _train(m2, torch.optim.SGD(m2.parameters(), lr=0.125), 7)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert d.state_dict()["outer_sync"]["step"] == 6
    d.close()
    with pytest.raises(RuntimeError, match="rank 0: DiLoCo: entered after close"):
        d.__enter__()


def _bad(kind):
    from ddl_triton.torch.diloco import DiLoCo

    m = _model()
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    outer = torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    kw = dict(comm=OneRank())
    if kind == "sync_every 0":
        return DiLoCo(m, inner, outer, 0, **kw)
    if kind == "fragments > params":
        return DiLoCo(m, inner, outer, 5, fragments=5, **kw)
    if kind == "outer not the model's":
        return DiLoCo(m, inner, torch.optim.SGD(_model().parameters(), lr=1.0), 2, **kw)
    if kind == "outer over part":
        return DiLoCo(m, inner, torch.optim.SGD(list(m.parameters())[:1], lr=1.0), 2, **kw)
    if kind == "same optimizer":
        return DiLoCo(m, inner, inner, 2, **kw)
    if kind == "auto":
        return DiLoCo(m, inner, outer, "auto", **kw)
    if kind == "manager":
        return DiLoCo(m, inner, outer, 2, manager=object(), **kw)
    if kind == "should_quantize":
        return DiLoCo(m, inner, outer, 2, should_quantize=True, **kw)
    if kind == "alpha":
        return DiLoCo(m, inner, outer, 2, fragment_update_alpha=1.5, **kw)
    if kind == "delay":
        return DiLoCo(m, inner, outer, 2, fragment_sync_delay=2, **kw)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, exc, why", [
    ("sync_every 0", ValueError, "sync_every must be an int >= 1"),
    ("fragments > params", ValueError, "more than the 4 parameters"),
    ("outer not the model's", ValueError, "not the model's parameters"),
    ("outer over part", ValueError, "every one of the model's parameters"),
    ("same optimizer", ValueError, "must be two optimizers"),
    ("auto", ValueError, "sync_every='auto' needs a bound, max_sync_every"),
    ("manager", TypeError, "torchft's manager= is not taken here"),
    ("should_quantize", TypeError, "compression= names a method"),
    ("alpha", ValueError, "fragment_update_alpha must be in [0, 1]"),
    ("delay", ValueError, "fragment_sync_delay must be"),
])
def test_diloco_refuses_bad_input_naming_the_rank(kind, exc, why):
    with pytest.raises(exc) as e:
        _bad(kind)
    assert why in str(e.value) and "rank 0" in str(e.value), str(e.value)


def test_an_elastic_state_keeps_and_sends_diloco_backups_step_and_outer_optimizer():
    # ddl_triton.torch.elastic.TorchState(diloco=...): an outer step undone by restore(), and the
    # state's bytes and manifest (what a new world's ranks receive) carry the backups, the step and
    # the outer optimizer's momentum.
    from ddl_triton.torch.diloco import DiLoCo
    from ddl_triton.torch.elastic import TorchState

    def made():
        m = _model()
        inner = torch.optim.SGD(m.parameters(), lr=0.125)
        outer = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5)
        return m, inner, DiLoCo(m, inner, outer, sync_every=2, comm=OneRank())

    m, inner, d = made()
    state = TorchState(m, inner, diloco=d, batch=0)
    with d:
        _train(m, inner, 2)  # one outer step: momentum now held
        state.commit()
        kept = [b.clone() for b in d.core.backups], [p.detach().clone() for p in m.parameters()]
        _train(m, inner, 2)  # another outer step, undone below
        assert d.step == 4
        state.restore()
    assert d.step == 2
    assert all(torch.equal(a, b) for a, b in zip(kept[0], d.core.backups))
    assert all(torch.equal(a, b.detach()) for a, b in zip(kept[1], m.parameters()))
    momentum = [d.outer_optimizer.state[p]["momentum_buffer"].clone() for p in m.parameters()]

    tensors, manifest = state._packed()
    m2, inner2, d2 = made()
    other = TorchState(m2, inner2, diloco=d2, batch=0)
    got = other._receiving(manifest, 0, 0)
    for a, b in zip(got, tensors):
        a.copy_(b)
    other._load(manifest, got)
    assert d2.step == 2 and all(torch.equal(a, b) for a, b in zip(d.core.backups, d2.core.backups))
    assert all(torch.equal(a, d2.outer_optimizer.state[p]["momentum_buffer"]) for a, p in
               zip(momentum, m2.parameters()))
    d.close()
    d2.close()


@pytest.mark.parametrize("link_bytes_per_s, mode", [(None, "per-step"), (1e5, "outer")])
def test_auto_measures_plans_once_and_runs_the_plan(link_bytes_per_s, mode, capsys):
    # sync_every="auto": 5 inner steps averaged per step (the first not timed), then plan_sync's choice:
    # one host -> per-step fp32; 2 hosts over a 100 kB/s link -> outer sync, H within the bound.
    from types import SimpleNamespace

    from ddl_triton.torch.diloco import DiLoCo
    from ddl_triton.torch.diloco_auto import MEASURED_STEPS

    comm = OneRank() if link_bytes_per_s is None else \
        OneRank(nodes=(0, 1), link=SimpleNamespace(bytes_per_s=link_bytes_per_s, alpha=1e-3))
    m = _model()
    inner = torch.optim.SGD(m.parameters(), lr=0.125)
    d = DiLoCo(m, inner, torch.optim.SGD(m.parameters(), lr=1.0), "auto", max_sync_every=16, comm=comm)
    with d:
        _train(m, inner, MEASURED_STEPS)
        assert d.plan is None and d.sync_every is None
        _train(m, inner, 1)
        assert d.plan is not None and d.plan.mode == mode, d.plan
        _train(m, inner, 20)
    assert d.step == MEASURED_STEPS + 21
    printed = capsys.readouterr().out
    assert printed.count("DiLoCo(sync_every='auto')") == 1 and d.plan.why in printed
    if mode == "outer":
        assert 1 <= d.sync_every <= 16 and d.core.step == 20
    else:
        assert d.core is None and d.sync_every is None
    d.close()


def test_fragment_update_alpha_mixes_the_local_steps_taken_during_the_delay():
    # torchft's merge: after the outer step, params = lerp(global, local, alpha). One replica, outer SGD
    # lr 1, H=2, delay 1: the average (started after step 1) puts back step 1's params as the global
    # ones, and alpha mixes in step 2's local params.
    from ddl_triton.torch.diloco import DiLoCo

    for alpha in (0.0, 0.5):
        m = _model()
        inner = torch.optim.SGD(m.parameters(), lr=0.125)
        d = DiLoCo(m, inner, torch.optim.SGD(m.parameters(), lr=1.0), 2, fragment_sync_delay=1,
                   fragment_update_alpha=alpha, comm=OneRank())
        ref = _model()
        ref_inner = torch.optim.SGD(ref.parameters(), lr=0.125)
        with d:
            _train(m, inner, 2)
        _train(ref, ref_inner, 1)
        after_one = [p.detach().clone() for p in ref.parameters()]
        ref_inner.zero_grad()
        ref(torch.full((4, 3), 0.0)).sum().backward()  # step 2's batch (t = 1: 1 % 3 - 1 = 0)
        ref_inner.step()
        for p, g, local in zip(m.parameters(), after_one, ref.parameters()):
            assert torch.equal(p.detach(), torch.lerp(g, local.detach(), alpha))
        assert all(torch.equal(b, torch.cat([g.reshape(-1) for g in after_one])) for b in d.core.backups)
        d.close()
