"""Ranks given different options learn it at init, on every rank, by name
(ddl_triton/runtime/setup/option_agreement.py)."""
from __future__ import annotations

import threading

import pytest

from ddl_triton.options import Options
from ddl_triton.runtime.setup.option_agreement import (MUST_AGREE, SET_OR_NOT, OptionsDiffer, agree_on_options,
                                                 differences)


def _values(**changes) -> dict:
    """What a rank with these options sends (agree_on_options)."""
    opts = Options().replace(**changes)
    return {name: getattr(opts, name) for name in MUST_AGREE} | {name: getattr(opts, name) != "" for name in SET_OR_NOT}


def test_the_wording_names_the_option_the_values_the_ranks_and_the_variable():
    every = [_values(chunk_bytes=1048576), _values(chunk_bytes=4194304)]
    assert differences(1, every) == ("rank 1: options differ across ranks: chunk_bytes is 1048576 on rank 0, "
                                     "4194304 on rank 1 (DDL_CHUNK_BYTES)")
    every = [_values(schedule="ring", pipeline_depth=2), _values(), _values(schedule="ring"), _values()]
    assert differences(0, every) == (
        "rank 0: options differ across ranks: pipeline_depth is 2 on rank 0, 4 on ranks 1, 2, 3 (DDL_PIPELINE_DEPTH); "
        "schedule is 'ring' on ranks 0, 2, '' on ranks 1, 3 (DDL_SCHEDULE)")
    assert differences(0, [_values(check_calls=False), _values()]) == (
        "rank 0: options differ across ranks: check_calls is 0 on rank 0, 1 on rank 1 (DDL_CHECK_CALLS)")
    assert differences(2, [_values(), _values(), _values()]) == ""
    # Tracing on some ranks only: the tracer's clock alignment is collective. Its folder may differ.
    assert differences(0, [_values(), _values(trace="/t1")]) == (
        "rank 0: options differ across ranks: trace is '' on rank 0, set on rank 1 (DDL_TRACE)")
    assert differences(0, [_values(trace="/t0"), _values(trace="/t1")]) == ""
    # The job's secret: set on every rank or on none; its value is never exchanged, nor named in errors.
    assert differences(1, [_values(job_secret="s" * 16), _values()]) == (
        "rank 1: options differ across ranks: job_secret is set on rank 0, '' on rank 1 (DDL_JOB_SECRET)")
    assert differences(0, [_values(job_secret="s" * 16), _values(job_secret="t" * 16)]) == ""


def test_per_rank_fields_may_differ_and_every_shared_field_is_compared():
    per_rank = {f for f in Options.__dataclass_fields__} - set(MUST_AGREE)
    assert per_rank == {"timeout", "status_dir", "tuning_file", "tuning_dir", "trace", "flight_entries", "dump_dir",
                        "debug", "mpi_cuda_aware", "job_secret", "launcher"}
    samples = {"chunk_bytes": 4096, "pipeline_depth": 3, "wire_chunk_bytes": 8192, "schedule": "ring",
               "topology": "1x2", "transport": "mpi", "check_calls": False, "kernels": "torch",
               "compression": "int8", "link_emulation": "mpi:bw=1GB/s", "link_probe": False}
    for name in MUST_AGREE:
        text = differences(0, [_values(), _values(**{name: samples[name]})])
        assert text.startswith(f"rank 0: options differ across ranks: {name} is ") and \
            text.endswith(f"on rank 1 (DDL_{name.upper()})"), text


def _agree_in_threads(options: list[Options]) -> list:
    """Run agree_on_options for each rank's options over one in-process store; each rank's outcome."""
    import torch.distributed as dist

    from ddl_triton.runtime.setup.bootstrap import StoreBootstrap

    store, outcome = dist.HashStore(), [None] * len(options)

    def rank(r: int) -> None:
        try:
            agree_on_options(StoreBootstrap(store, r, len(options), timeout=10, prefix="o"), options[r])
            outcome[r] = "agreed"
        except Exception as e:  # noqa: BLE001
            outcome[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(options))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcome


def test_every_rank_raises_over_a_real_bootstrap_and_agreeing_ranks_pass():
    pytest.importorskip("torch.distributed")
    outcome = _agree_in_threads([Options(chunk_bytes=1048576, trace="/a"), Options(chunk_bytes=4194304, trace="/b")])
    for r, e in enumerate(outcome):
        assert isinstance(e, OptionsDiffer) and isinstance(e, ValueError), e
        assert str(e) == (f"rank {r}: options differ across ranks: chunk_bytes is 1048576 on rank 0, 4194304 on "
                          "rank 1 (DDL_CHUNK_BYTES)")
    assert _agree_in_threads([Options(timeout=5, debug=True), Options(timeout=9)]) == ["agreed", "agreed"]


def test_a_peer_that_sends_something_else_is_refused_by_name():
    from ddl_triton.runtime.setup.bootstrap import BootstrapError

    class _Peer:
        rank, size = 0, 2

        def __init__(self, theirs):
            self.theirs = theirs

        def allgather(self, mine):
            return [mine, self.theirs]

    for theirs, why in (([1, 2], "name the fields list"), ({"chunk_bytes": 1}, "name the fields"),
                        ({**_values(), "chunk_bytes": "big"}, r"rank 1's options \(chunk_bytes\) holds 'big'"),
                        ({**_values(), "check_calls": 1}, r"rank 1's options \(check_calls\) holds 1")):
        with pytest.raises(BootstrapError, match=r"^rank 0: ddl_triton.* " + why):
            agree_on_options(_Peer(theirs), Options())


@pytest.mark.parametrize("name", MUST_AGREE + SET_OR_NOT)
def test_every_field_that_must_agree_is_sent_as_the_rank_holds_it(name):
    """End to end over a real bootstrap, one field at a time: rank 1 holds another value, and every
    rank names that field. A rank that sent one field as anything but its own value (a constant, the
    default) would pass the others' checks here and fail later, as something else."""
    pytest.importorskip("torch.distributed")
    other = {"chunk_bytes": 4096, "pipeline_depth": 3, "wire_chunk_bytes": 8192, "schedule": "ring",
             "topology": "1x2", "transport": "mpi", "check_calls": False, "kernels": "torch", "compression": "int8",
             "link_emulation": "mpi:bw=1GB/s", "link_probe": False, "trace": "/t", "job_secret": "s" * 16}[name]
    outcome = _agree_in_threads([Options(), Options(**{name: other})])
    for r, e in enumerate(outcome):
        assert isinstance(e, OptionsDiffer), (name, e)
        assert f"options differ across ranks: {name} is " in str(e) and f"(DDL_{name.upper()})" in str(e), e
    # And the other way round: the default on rank 1 (a rank sending the default would agree with it).
    outcome = _agree_in_threads([Options(**{name: other}), Options()])
    assert all(isinstance(e, OptionsDiffer) for e in outcome), (name, outcome)
