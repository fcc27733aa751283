"""One module words every failure (ddl_triton/errors.py, issue 42 item 3): each builder's text names
this rank, the peer and the peer's host, the call and the deadline; the five places that used to word
a CollectiveTimeout each in their own way are provoked here in-process and read alike; nothing else
in the package constructs a CollectiveTimeout or CollectiveMismatch, and one liveness check serves
shm's waits and the placement's naming of a wait on every rank."""
from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddl_triton import errors
from ddl_triton.errors import CollectiveMismatch, CollectiveTimeout, DDLError
from ddl_triton.planning.topology import Topology
from ddl_triton.runtime.setup.placement import Placement
from ddl_triton.transports import PeerTimeout

ROOT = Path(__file__).resolve().parents[2]
T = 0.2  # every deadline here: short, so a provoked timeout costs a fifth of a second


def _two_hosts() -> Placement:
    """Rank 0 on h1 (this process), rank 1 on h2."""
    return Placement(0, 2, Topology((1, 2), "1x2"), (0, 1), (0, 1), (0,), ("self", "gloo"), "auto",
                     ("h1", "h2"), (os.getpid(), 1))


def _four_on_two_hosts(pids) -> Placement:
    names = ("h1", "h1", "h2", "h2")
    hosts = (0, 0, 2, 2)
    return Placement(0, 4, Topology((2, 2), "2x2"), hosts, hosts, (0, 1), ("self", "shm", "mpi", "mpi"), "auto",
                     names, pids)


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid  # reaped: no process has it now (pids are not reused this soon)


# -- the builders -------------------------------------------------------------------------------

def test_every_builder_names_the_rank_the_peer_its_host_the_call_and_the_deadline():
    name = _two_hosts().describe
    call = errors.call_name("allreduce", 4, "ring", "r1")
    texts = {
        "silent": str(errors.wait_failed(0, call, PeerTimeout(1, "message 7"), 2.5, name)),
        "dead": str(errors.wait_failed(0, call, PeerTimeout(1, "message 7", dead=True), 2.5, name)),
        "p2p": str(errors.peer_failed(0, "recv from 1 (tag 3)", 1, "its MPI request", 2.5, name)),
        "engine": str(errors.engine_failed(0, "send to 1 (tag 3)", 1, "gloo", "Connection closed by peer", 2.5,
                                           name)),
        "arrive": str(errors.did_not_arrive(0, 1, "connect to the call lane", 2.5, name)),
    }
    for kind, text in texts.items():
        assert text.startswith("rank 0: "), (kind, text)
        assert "rank 1 on h2" in text and "2.5 s" in text, (kind, text)
    assert texts["silent"] == ("rank 0: allreduce #4 (schedule ring, step 'r1') timed out after 2.5 s; "
                               "not heard from rank 1 on h2 (message 7)")
    assert texts["dead"] == ("rank 0: allreduce #4 (schedule ring, step 'r1') failed: rank 1 on h2 died "
                             "(message 7) before the 2.5 s deadline")
    assert "recv from 1 (tag 3)" in texts["p2p"] and "send to 1 (tag 3)" in texts["engine"]
    assert texts["arrive"] == "rank 0: rank 1 on h2 did not connect to the call lane within 2.5 s"
    assert isinstance(errors.engine_failed(0, "x", 1, "gloo", "y", 1, name), DDLError)


def test_a_peer_is_named_with_its_host_on_one_host_too_and_without_a_placement_says_so():
    one_host = Placement(0, 2, Topology((1, 2), "1x2"), (0, 0), (0, 0), (0, 1), ("self", "shm"), "auto")
    assert one_host.describe(1) == f"rank 1 on {socket.gethostname()}"
    assert f"a rank on {socket.gethostname()} " in one_host.describe(-1)
    text = str(errors.wait_failed(0, "allreduce #1", PeerTimeout(1, "message 0"), 1.0))
    assert "not heard from rank 1 (host unknown)" in text


def test_a_wait_on_every_rank_names_the_suspects_with_their_hosts():
    me = os.getpid()
    everyone_here_alive = _four_on_two_hosts((me, me, 1, 1)).describe(-1)
    assert everyone_here_alive.startswith("a rank on another host, one of rank(s) 2, 3 on h2")
    assert _four_on_two_hosts((me, _exited_pid(), 1, 1)).describe(-1).startswith(
        "rank(s) 1 on h1 (this host), whose process has exited")


def test_a_mismatch_lists_every_rank_s_call_and_says_who_has_not_arrived():
    e = errors.calls_disagree(1, 9, {0: "allreduce(sum, 4 x float32)", 1: "broadcast(root 0)"}, 3)
    assert isinstance(e, CollectiveMismatch)
    assert str(e) == ("rank 1: ranks disagree on collective #9: rank 0: allreduce(sum, 4 x float32); "
                      "rank 1: broadcast(root 0); rank 2: (has not reached this call yet)")


def test_a_peer_that_left_is_named_with_its_host_what_it_did_and_the_call_waited_in():
    e = errors.peer_left(0, "allreduce #6", 1, "reached exit", 5, name=_two_hosts().describe)
    assert isinstance(e, errors.CollectiveSkipped) and isinstance(e, CollectiveMismatch)
    assert str(e) == ("rank 0: rank 1 on h2 reached exit while rank 0 waits in allreduce #6 (rank 1 had issued 5 "
                      "collectives on this communicator)")
    assert (e.peer, e.did, e.calls, e.failed) == (1, "reached exit", 5, False)
    failed = errors.peer_left(2, "barrier #1", 0, "called finalize", 1, failed=True)
    assert str(failed).endswith("(rank 0 had issued 1 collective on this communicator, the last of which failed)")


def test_one_liveness_check():
    from ddl_triton.transports import shm

    assert shm.process_alive is errors.process_alive  # shm's waits use the one check
    assert errors.process_alive(os.getpid()) and not errors.process_alive(_exited_pid())
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        for _ in range(200):  # until it has exited, unreaped (a zombie): bounded, 10 s
            if not errors.process_alive(zombie.pid):
                break
            import time
            time.sleep(0.05)
        assert not errors.process_alive(zombie.pid), "a zombie (killed, not yet reaped) counts as ended"
    finally:
        zombie.wait()


# -- the five former sites, provoked in-process -------------------------------------------------

class _SilentTransport:
    """A transport to rank 1 that never delivers: its receive fails as a transport's does."""
    completes_sends = posts_receives_early = has_group_allreduce = False

    def acquire(self, msg_id, peers, count, dtype, timeout):
        return torch.empty(count, dtype=dtype)

    def publish(self, msg_id):
        pass

    def prefetch(self, peer, msg_id, size, dtype):
        pass

    def recv(self, peer, msg_id, count, dtype, timeout, *args, **kwargs):
        raise PeerTimeout(peer, f"message {msg_id}")

    def release(self, peer, msg_id):
        pass

    def flush(self, timeout):
        pass


def _executor():
    from ddl_triton import schedules
    from ddl_triton.runtime.calls.executor import CallContext, Executor

    ex = Executor(0, 2, [None, _SilentTransport()], timeout=T, depth=2)
    ex.describe = _two_hosts().describe
    buf = torch.ones(5, dtype=torch.int32)
    ex.run(schedules.build("one_shot", "allreduce", 2, 5, chunk_elems=8), buf, buf, CallContext("allreduce"), 1)


def _call_check():
    from ddl_triton.runtime.lanes.call_check import CallChecker

    class _SilentLane:
        def exchange(self, seq, head, nbytes):
            raise PeerTimeout(1, f"the call lane message of call #{seq}")

    checker = CallChecker(_SilentLane(), 0, 2, None, T, describe=_two_hosts().describe)
    if hasattr(checker, "begin_call"):  # the call path one way down (issue 42 item 4): the runner brackets calls
        checker.begin_call(1, "allreduce", "sum", torch.float32, 4, 0)
    else:
        checker.checked(1, "allreduce", "sum", torch.float32, 4, 0, lambda: None)


def _barrier():
    """The barrier without call checks: MPI's (or gloo's) Ibarrier, which never completes here."""
    never = SimpleNamespace(Test=lambda: False)
    control = SimpleNamespace(Ibarrier=lambda: never)
    try:
        from ddl_triton.runtime.calls.running import CallRunner  # the call path's runner (issue 42 item 4)
    except ImportError:  # before the call path moved out of the communicator
        from ddl_triton.runtime.communicator import Communicator

        Communicator._mpi_barrier(SimpleNamespace(_comm=control, options=SimpleNamespace(timeout=T), rank=0,
                                                  _seq=1, placement=_two_hosts()))
        return
    CallRunner(0, 2, executor=None, plans=None, small=None, checker=None, gpu=None, control=control,
               timeout=T, describe=_two_hosts().describe)._barrier()


def _point_to_point():
    from ddl_triton.torch.point_to_point import MpiPointToPoint

    p2p = MpiPointToPoint(None, T, 0, _two_hosts().describe)
    try:
        p2p._wait(SimpleNamespace(Test=lambda *status: False), "recv from 1 (tag 3)", None, 1)
    finally:
        p2p._runner.close()


def _lane_sockets():
    import torch.distributed as dist

    from ddl_triton.runtime.lanes.lane_sockets import LaneSockets

    LaneSockets(dist.HashStore(), 0, 2, T, _two_hosts().describe)  # rank 1 never connects


SITES = {  # each former site -> what its text must hold besides "rank 0: ", the peer with its host and the deadline
    "calls/executor.py": (_executor, "allreduce #1 (schedule one_shot, step "),
    "lanes/call_check.py": (_call_check, "allreduce #1 timed out after"),
    "communicator.py (the barrier)": (_barrier, "barrier #1 "),
    "torch/point_to_point.py": (_point_to_point, "recv from 1 (tag 3) timed out after"),
    "lanes/lane_sockets.py": (_lane_sockets, "did not connect to the call lane within"),
}


@pytest.mark.parametrize("site", SITES)
def test_each_former_site_words_its_failure_the_one_way(site):
    provoke, call = SITES[site]
    with pytest.raises(CollectiveTimeout) as e:
        provoke()
    text = str(e.value)
    assert text.startswith("rank 0: ") and call in text, text
    assert f"{T:g} s" in text, text
    assert re.search(r"rank(?:\(s\))? 1 on h2", text), text  # the peer, with its host (the barrier's too)


# -- the rule ------------------------------------------------------------------------------------

def test_only_errors_py_constructs_a_collective_timeout_or_mismatch_or_reads_a_pid_s_liveness():
    """Wording lives in one module: a new failure site calls a builder there. Outside the launcher and
    the testbed (which watch processes of their own), nothing asks whether a pid still runs but
    errors.process_alive."""
    constructs, liveness = [], []
    for d in ("ddl_triton", "transports", "schedules"):
        for path in sorted((ROOT / d).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel == "ddl_triton/errors.py":
                continue
            text = path.read_text()
            for node in ast.walk(ast.parse(text, rel)):
                if isinstance(node, ast.Call):
                    f = node.func
                    called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                    if called in ("CollectiveTimeout", "CollectiveMismatch", "CollectiveSkipped"):
                        constructs.append(f"{rel}:{node.lineno}")
            # A liveness check: signal 0 to a pid, or a pid's /proc state read for a zombie ("Z").
            signals_zero = re.search(r"os\.kill\([^)]*,\s*0\)", text)
            reads_zombie = "/proc/{" in text and re.search(r"[\"']Z[\"']", text)
            if not rel.startswith(("ddl_triton/launch/", "ddl_triton/testbed/")) and (signals_zero or reads_zombie):
                liveness.append(rel)
    assert not constructs, f"worded outside ddl_triton/errors.py: {constructs}"
    assert not liveness, f"a liveness check of their own: {liveness}"


def test_a_garbled_lane_header_is_named_not_an_index_error():
    """Bytes off the wire that are no header of ours (seen once as freed-heap pointers) are worded as
    such, with the bytes, instead of raising IndexError while the mismatch is being described."""
    from ddl_triton.runtime.lanes import call_lane
    raw = bytes.fromhex("a0d9cef6c3550000700ccbf6c3550000")
    text = call_lane._describe(raw)
    assert "dtype#" in text and "op#" in text and raw.hex() in text, text
