"""The flight recorder, its diagnosis, the timeline and its tools, on real jobs (tests/multirank/observability_worker.py)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from ddl_triton.observability import trace_command as trace_cli
from ddl_triton.observability.diagnose import diagnose, load_dumps

HERE = Path(__file__).resolve().parent
DDLRUN = Path(sys.executable).parent / "ddlrun"
WORKER = HERE / "observability_worker.py"


def _line_of(marker: str) -> int:
    return next(i for i, line in enumerate(WORKER.read_text().splitlines(), 1) if marker in line)


def _ddlrun(ranks: int, mode: str, env: dict, timeout_s: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(DDLRUN), "-n", str(ranks), "--timeout", "3", "--", sys.executable, str(WORKER), mode],
                          env=dict(os.environ, OMP_NUM_THREADS="1", **env), capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def test_a_rank_that_skips_a_collective_is_named_with_the_sequence_number_and_call_site(tmp_path):
    """Rank 1 calls finalize after 5 allreduces; ranks 0 and 2 wait in #6. They raise at once (rank 1
    is at exit, not slow), and dump to the default folder: one folder per job, named by the job's id,
    the same on every rank. Run twice, the two jobs' dumps stay apart, and `why` on the user's folder
    reads the newest job's."""
    user_folder = tmp_path / f"ddl_triton-flight-{os.getuid()}"
    site = f"observability_worker.py:{_line_of('ALLREDUCE-LINE')}"
    jobs = []
    for run in (1, 2):
        proc = _ddlrun(3, "hang", {"TMPDIR": str(tmp_path)})
        assert proc.returncode == 1, proc.stderr           # no hang: every rank ends by itself
        assert "ddlrun: exit status per rank: 0: 1, 1: 0, 2: 1" in proc.stderr, proc.stderr
        new = sorted(set(os.listdir(user_folder)) - set(jobs))
        assert len(new) == 1, (run, new)                   # one folder for the job's ranks
        jobs += new
        folder = user_folder / new[0]
        assert sorted(p.name for p in folder.iterdir()) == ["flight-rank0.json", "flight-rank2.json"]
        assert {json.loads((folder / f"flight-rank{r}.json").read_text())["job"] for r in (0, 2)} == {new[0]}
        lines = diagnose(load_dumps(str(folder)))
        assert lines[0] == (f"rank 1 never issued allreduce #6 (ranks 0, 2 issued it from {site}): it called "
                            "finalize after 5 collectives on this communicator, as ranks 0, 2 saw (it left no dump)"), lines
        for rank in (0, 2):
            assert f"rank {rank} was waiting in allreduce #6 when rank 1 called finalize" in lines, lines
    why = subprocess.run([sys.executable, "-m", "ddl_triton.trace", "why", str(user_folder)], capture_output=True,
                         text=True, timeout=60)
    assert why.returncode == 0 and why.stdout.splitlines()[0] == lines[0], why.stdout + why.stderr
    assert f"this is the newest, {jobs[1]}" in why.stdout, why.stdout


def test_ranks_that_disagree_are_named_with_both_calls(tmp_path):
    proc = _ddlrun(2, "mismatch", {"DDL_DUMP_DIR": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr
    lines = diagnose(load_dumps(str(tmp_path)))
    assert lines[0] == (f"ranks disagree at #4: rank 0 allreduce(sum, 100 x float32) (from observability_worker.py:"
                        f"{_line_of('MISMATCH-ALLREDUCE-LINE')}), rank 1 broadcast(root 0, 100 x float32) (from observability_worker.py:"
                        f"{_line_of('BROADCAST-LINE')})"), lines


def test_the_timeline_nests_steps_in_collectives_links_async_issues_and_merges(tmp_path):
    proc = _ddlrun(2, "traced", {"DDL_TRACE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert sorted(re.findall(r"PROFILER rank=(\d) saw=(\w+)", proc.stdout)) == [("0", "True"), ("1", "True")]
    for rank in (0, 1):
        data = json.loads((tmp_path / f"trace-rank{rank}.json").read_text())
        events = data["traceEvents"]
        assert data["metadata"]["rank"] == rank and data["metadata"]["offset_bound_us"] >= 0
        threads = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        calls = [e for e in events if e.get("cat") == "ddl.collective"]
        assert [e["name"] for e in calls][:4] == ["allreduce #1", "allreduce #2", "allreduce #3", "allreduce #4"]
        first = calls[0]
        assert first["args"]["bytes"] == 1_200_000 and first["args"]["schedule"] and first["args"]["dtype"] == "float32"
        steps = [e for e in events if e.get("cat") == "ddl.step" and e["tid"] == first["tid"]
                 and first["ts"] <= e["ts"] <= first["ts"] + first["dur"]]
        assert steps and all(e["ts"] + e["dur"] <= first["ts"] + first["dur"] + 1 for e in steps)
        phases = {e["name"] for e in events if e.get("cat") == "ddl.phase"}
        assert {"wait", "send"} <= phases and phases & {"reduce", "copy"}
        asyncs = [e for e in events if e.get("cat") == "ddl.async"]
        assert sorted(e["ph"] for e in asyncs) == ["b"] * 3 + ["e"] * 3
        flows = [e for e in events if e.get("cat") == "ddl.flow"]
        assert {e["ph"] for e in flows} == {"s", "f"}
        runner = [e for e in calls if e["name"] in ("allreduce #4", "allreduce #5", "allreduce #6")]
        # async: the runner thread, or the thread that waited for a call the runner had not started
        assert len(runner) == 3 and {threads[e["tid"]] for e in runner} <= {f"ddl_triton-rank{rank}", "MainThread"}
    out = tmp_path / "job.json"
    assert trace_cli.main(["merge", str(tmp_path), "-o", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert {e["pid"] for e in merged["traceEvents"] if "pid" in e} == {0, 1}
    assert merged["metadata"]["clock_alignment_bound_us"] >= 0
    rows = {r["collective"]: r for r in trace_cli.summary(str(tmp_path))}
    assert rows["allreduce"]["calls"] == 2 * 7 and rows["broadcast"]["calls"] == 2
    assert trace_cli.overlap(str(tmp_path))["bursts"] == 2  # one burst of three async calls per rank
    trace_cli.plot(str(tmp_path), str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 5000


def test_the_recorder_is_bounded_and_sigusr2_dumps_it(tmp_path):
    env = {"DDL_DUMP_DIR": str(tmp_path), "DDL_FLIGHT_ENTRIES": "10", "DDL_DEBUG": "1"}
    proc = _ddlrun(2, "bounded", env)
    assert proc.returncode == 0, proc.stderr
    got = sorted(re.findall(r"BOUNDED rank=(\d) reason=(\S+) records=(\d+) first=(\d+) last=(\d+)", proc.stdout))
    assert got == [("0", "SIGUSR2", "10", "41", "50"), ("1", "SIGUSR2", "10", "41", "50")], proc.stdout
    # DDL_DEBUG: the transports per peer on every rank, the plan once per call shape on rank 0.
    assert "ddl_triton[rank 0]: communicator #1 of 2 ranks, topology 2; transport per peer: 0: self, 1: shm" in proc.stderr
    assert "ddl_triton[rank 1]: communicator #1 of 2 ranks, topology 2; transport per peer: 0: shm, 1: self" in proc.stderr
    assert proc.stderr.count("ddl_triton[rank 0]: allreduce of 8 x float32:") == 1, proc.stderr


def test_every_entry_records_its_callers_line_on_shm_and_over_mpi():
    """The recorder jumps straight to the public entry's caller (flight._ENTRY_CALLER_DEPTH), then
    walks up past ddl_triton's and torch's frames: a depth one too deep, or an entry that reaches
    the recorder through one more frame than the constant says, names the worker's caller instead."""
    proc = _ddlrun(2, "sites", {})
    assert proc.returncode == 0, proc.stderr
    got = sorted(re.findall(r"SITES rank=(\d) checked=(\d+) wrong=(.*)", proc.stdout))
    assert got == [("0", "16", "[]"), ("1", "16", "[]")], proc.stdout + proc.stderr


def test_the_call_site_is_the_first_frame_outside_ddl_triton_and_torch_even_for_equal_code():
    """Code objects compiled from the same text compare (and hash) equal whatever their file; the
    recorder must still tell a ddl_triton frame from the user's by the frame's own file."""
    import ddl_triton
    from ddl_triton.observability.flight import FlightRecorder, site_of

    recorder = FlightRecorder()
    source = "def relay(fn):\n    return fn()\n"
    inside, outside = {}, {}
    ours = os.path.join(os.path.dirname(ddl_triton.__file__), "_relay_for_test.py")
    exec(compile(source, ours, "exec"), inside)
    exec(compile(source, "/elsewhere/user_script.py", "exec"), outside)
    assert inside["relay"].__code__ == outside["relay"].__code__  # equal, though not the same file

    def site():
        return site_of(recorder._call_site(2))  # from site's caller (relay) upwards

    def through(relay):
        return relay(site)

    # The user's relay is the call site; a ddl_triton relay is skipped, so this test's frame is.
    assert through(outside["relay"]) == ("/elsewhere/user_script.py", 2)
    here = through(inside["relay"])
    assert here[0] == __file__, here
    assert through(outside["relay"]) == ("/elsewhere/user_script.py", 2)  # cached decisions stay per file
