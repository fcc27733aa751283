"""PyTorch users' launchers: torchrun, torch.multiprocessing.spawn and plain RANK/WORLD_SIZE/MASTER_*.

No MPI launcher here: MPI sees every rank as a singleton, and the ranks bootstrap from a
torch Store (ddl_triton/runtime/setup/bootstrap.py): shm within a host, gloo between (emulated) hosts.
"""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

from support import real_hosts
from support.launch import TESTS, TORCHRUN, ddl_segments, torch_launcher_env as _env
from support.report import read_report

ROOT = TESTS.parent


def _run(cmd: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          cwd=str(TESTS))


def _torchrun(n: int, *args: str, **env) -> subprocess.CompletedProcess:
    return _run([TORCHRUN, "--standalone", "--nproc-per-node", str(n), *args], _env(**env))


def _clean(proc: subprocess.CompletedProcess, before: set[str]) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    assert not ddl_segments() - before, f"shared memory left behind: {sorted(ddl_segments() - before)}"
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("n", [2])  # 4 ranks under torchrun: the emulated-hosts test below
def test_torchrun_ddp_replicas_bitwise_identical(n):
    before = ddl_segments()
    out = _clean(_torchrun(n, str(ROOT / "examples" / "ddp_anywhere.py")), before)
    assert f"ddp_anywhere: {n} ranks, 5 steps" in out and "replicas bitwise identical: True" in out, out[-3000:]


def test_mp_spawn_file_init_ddp_replicas_bitwise_identical():
    before = ddl_segments()
    proc = _run([sys.executable, str(ROOT / "examples" / "ddp_anywhere.py"), "--spawn", "2"], _env())
    out = _clean(proc, before)
    assert "ddp_anywhere: 2 ranks, 5 steps" in out and "replicas bitwise identical: True" in out, out[-3000:]


@pytest.mark.skipif(not real_hosts.UNAVAILABLE, reason="this machine builds real hosts: tests/multirank/test_testbed_torchrun.py "
                                          "runs the same checks across two of them")
def test_two_emulated_hosts_under_torchrun_every_collective_exact_bytes_through_gloo():
    # Every backend op, sub-groups, p2p, DDP/gloo/FSDP2 training, the communicator's own collectives
    # across several pipeline chunks (small chunks keep it quick), then the byte counters.
    before = ddl_segments()
    out = _clean(_torchrun(4, "multirank/torch_launchers_worker.py", "checks", DDL_TOPOLOGY="2x2", DDL_CHUNK_BYTES="65536"), before)
    # Every rank, each of world size 4 (a root checks more than the others).
    checks = read_report(out, "torch_launchers_worker: 4 ranks, topology 2x2, checks", 4, same_on_every_rank=False)
    assert sum(checks) >= 500, out[-4000:]
    for rank in range(4):
        moved = re.search(rf"rank {rank} transport bytes: (.*)", out).group(1)
        assert "'gloo': {'sent': " in moved and "'mpi'" not in moved, moved
        sent = int(re.search(r"'gloo': \{'sent': (\d+)", moved).group(1))
        assert sent > 1_000_000, moved  # MBs crossed between the emulated hosts, all through gloo


def _ranks(sizes: list[int], mode: str, timeout: float = 90, **env) -> tuple[list[str], list[int], float]:
    """Start one process per entry of ``sizes`` (its WORLD_SIZE), ranks 0, 1, ...; returns their
    outputs, exit codes and the wall time."""
    port = _free_port()
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "multirank/torch_launchers_worker.py", mode], cwd=str(TESTS), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(RANK=str(r), WORLD_SIZE=str(s), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), **env))
             for r, s in enumerate(sizes)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return outs, [p.returncode for p in procs], time.monotonic() - t0


def test_plain_env_variables_init():
    outs, codes, _ = _ranks([2, 2], "init")
    assert codes == [0, 0], outs
    assert all("allreduce gave [3, 3, 3]" in o for o in outs), outs


def test_world_size_disagreeing_fails_clearly_and_fast():
    outs, codes, elapsed = _ranks([2, 3], "init", DDL_TIMEOUT="60")
    assert codes == [3, 3], outs
    assert "rank 1 (pid" in outs[0] and "world size 3, this rank with 2" in outs[0], outs[0]
    assert "world size 2, this rank with 3" in outs[1], outs[1]
    assert elapsed < 45, f"took {elapsed:.0f} s: the mismatch must not wait for the deadline"


def test_rank_that_never_arrives_is_named_at_the_deadline():
    outs, codes, elapsed = _ranks([3, 3], "init", DDL_TIMEOUT="4")
    assert codes == [3, 3], outs
    assert "BootstrapTimeout" in outs[0] and "rank(s) 2 of 3 never arrived" in outs[0], outs[0]
    # Its own timeout, or the store gone with rank 0 (which timed out first): either way named as rank 1's.
    assert re.search(r"Bootstrap(Timeout|Error): rank 1: ddl_triton bootstrap", outs[1]), outs[1]
    assert elapsed < 60, f"took {elapsed:.0f} s"


def test_lost_peer_across_emulated_hosts_is_noticed_at_once():
    # The last rank SIGKILLs itself mid-loop: shm waits see its pid gone, gloo reports the closed socket.
    outs, codes, _ = _ranks([4, 4, 4, 4], "die", DDL_TOPOLOGY="2x2")
    assert codes[3] == -9, outs[3]
    for r in range(3):
        assert codes[r] == 1, outs[r]
        # "rank 3 on <host> died", from the call check or a step (the small path's, say): one wording (errors.py)
        m = re.search(r"noticed after ([0-9.]+) s: CollectiveTimeout: .*rank 3 on \S+ died", outs[r])
        assert m and float(m.group(1)) < 5.0, outs[r]


def test_lost_peer_inside_gloos_own_allreduce_is_noticed_at_once():
    # One rank per emulated host and 4 MB: the group step of hierarchical_native, gloo's allreduce;
    # with the call check off, the survivor is inside it when its peer dies.
    outs, codes, _ = _ranks([2, 2], "die", DDL_TOPOLOGY="1x2", DDL_CHECK_CALLS="0", DIE_NUMEL=str(1 << 20))
    assert codes == [1, -9], outs
    m = re.search(r"noticed after ([0-9.]+) s: CollectiveTimeout: .*schedule hierarchical_native, step "
                  r"'native allreduce'\) failed: rank 1 on \S+ died \(gloo allreduce among ranks 0, 1", outs[0])
    assert m and float(m.group(1)) < 5.0, outs[0]


def test_a_mismatch_before_gloos_own_allreduce_raises_at_once_and_exits_0():
    # One rank per emulated host and 1 MiB: hierarchical_native's one group step, gloo's allreduce.
    # The call check must answer before it starts: gloo aborts the process (SIGABRT, "Received data
    # size doesn't match expected size") when the peer's allreduce has another size.
    outs, codes, _ = _ranks([2, 2], "mismatch", DDL_TOPOLOGY="1x2", MISMATCH_NUMEL=str(1 << 18))
    assert codes == [0, 0], outs
    for r in range(2):
        m = re.search(r"rank %d after ([0-9.]+) s: CollectiveMismatch: .*rank 1: allreduce\(sum, 262145 x float32\)"
                      % r, outs[r])
        assert m and float(m.group(1)) < 5.0, outs[r]


def test_call_check_flight_recorder_and_trace_across_gloo(tmp_path):
    outs, codes, _ = _ranks([4, 4, 4, 4], "mismatch", DDL_TOPOLOGY="2x2", DDL_TRACE=str(tmp_path / "trace"),
                            DDL_DUMP_DIR=str(tmp_path / "dump"))
    assert codes == [0, 0, 0, 0], outs
    for r in range(4):
        assert "CollectiveMismatch" in outs[r] and "rank 3: allreduce(sum, 11 x float32)" in outs[r], outs[r]
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == [f"flight-rank{r}.json" for r in range(4)]
    import json
    for r in range(1, 4):  # clocks aligned to rank 0's by a ping-pong over gloo
        meta = json.loads((tmp_path / "trace" / f"trace-rank{r}.json").read_text())["metadata"]
        assert meta["size"] == 4 and meta["offset_bound_us"] > 0, meta


def test_init_arguments_are_checked_before_anything_starts():
    import torch.distributed as dist

    import ddl_triton
    from ddl_triton.runtime.setup.bootstrap import StoreBootstrap

    with pytest.raises(ValueError, match="go together"):
        ddl_triton.init(store=dist.HashStore())
    with pytest.raises(ValueError, match="not both"):
        ddl_triton.init(object(), store=dist.HashStore(), rank=0, size=1)
    with pytest.raises(ValueError, match="rank 2 is not a rank of a world of size 2"):
        StoreBootstrap(dist.HashStore(), 2, 2, timeout=1)
    with pytest.raises(TypeError, match="rank must be an int"):
        StoreBootstrap(dist.HashStore(), "0", 2, timeout=1)
    store = dist.HashStore()
    StoreBootstrap(store, 0, 1, timeout=1, prefix="p")
    with pytest.raises(ValueError, match="another process already started as rank 0"):
        StoreBootstrap(store, 0, 1, timeout=1, prefix="p")


class _StoreThatDies:
    """A HashStore whose calls raise torch's DistNetworkError once ``calls_left`` are spent, as
    the calls of a rank whose store server (rank 0) has exited do."""

    def __init__(self, calls_left: int):
        import torch.distributed as dist

        self._store, self.calls_left = dist.HashStore(), calls_left

    def __getattr__(self, name: str):
        import torch.distributed as dist

        method = getattr(self._store, name)

        def call(*args):
            if self.calls_left == 0:
                raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
            self.calls_left -= 1
            return method(*args)
        return call


def test_a_store_lost_at_any_call_of_a_bootstrap_step_is_a_bootstrap_error_naming_the_rank():
    from ddl_triton.runtime.setup.bootstrap import BootstrapError, BootstrapTimeout, StoreBootstrap

    # hello in a world of 2 whose rank 1 never comes: the store dies at its 1st, 2nd, ... call,
    # until it outlives the 0.2 s deadline.
    calls = 0
    while True:
        try:
            StoreBootstrap(_StoreThatDies(calls), 0, 2, timeout=0.2)
        except BootstrapTimeout:
            break
        except BootstrapError as e:
            assert str(e).startswith("rank 0: ddl_triton bootstrap (hello") and "lost the store (Failed to recv" \
                in str(e), (calls, e)
        else:
            pytest.fail("a world of 2 finished its hello with one rank")
        calls += 1
    assert calls >= 5, calls  # add, set, check, and the arrival check's get and check of a larger world's key
    # allgather, bcast and barrier in a world of 1, each with 3 calls: set, check, get.
    for step, run in (("allgather", lambda b: b.allgather(7)), ("bcast", lambda b: b.bcast(7)),
                      ("barrier", lambda b: b.barrier())):
        for left in range(4):
            store = _StoreThatDies(10**6)
            boot = StoreBootstrap(store, 0, 1, timeout=5)
            store.calls_left = left
            if left < 3:
                with pytest.raises(BootstrapError, match=rf"^rank 0: ddl_triton bootstrap \({step}\): lost the store"):
                    run(boot)
            else:
                run(boot)  # 3 calls are all a step of a world of 1 makes


def test_a_store_that_cannot_be_served_or_reached_is_named_with_the_rank_and_address():
    from ddl_triton.runtime.setup.bootstrap import BootstrapError, store_from_env

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        with pytest.raises(BootstrapError, match=rf"^rank 0: ddl_triton.init: cannot serve the store on "
                                                 rf"127.0.0.1:{port} \(.*\); choose a free MASTER_PORT"):
            store_from_env(1.0, env)
    # The port is free now, and nobody serves it.
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with pytest.raises(BootstrapError, match=rf"^rank 1: ddl_triton.init: could not reach the store at "
                                             rf"127.0.0.1:{port} \(.*\); is rank 0 running"):
        store_from_env(1.0, env)


def test_store_bootstrap_steps_on_one_store():
    # Two ranks in threads of this process over one HashStore: allgather, bcast, barrier, split, hosts.
    import threading

    import torch.distributed as dist

    from ddl_triton.runtime.setup.bootstrap import StoreBootstrap

    store, results, errors = dist.HashStore(), {}, []

    def rank(r: int) -> None:
        try:
            b = StoreBootstrap(store, r, 2, timeout=10, prefix="t")
            results[r] = (b.allgather(("x", r)), b.bcast(r * 10, root=1), b.barrier(), b.host_of_rank(),
                          b.split(0).size, b.split(r).size)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for r in range(2):
        assert results[r] == ([["x", 0], ["x", 1]], 10, None, [0, 0], 2, 1), results[r]  # JSON: tuples come back as lists
