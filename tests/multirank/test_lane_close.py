"""A call lane closed while a peer still pulls its last message (tests/multirank/lane_close_worker.py).

Under load, the 4-rank 2x2 matrix's last 64 KiB small broadcast failed about one run in two: rank 0
closed its communicator, its lane freed the send buffer MPI was still reading, and a slower rank
received heap bytes where rank 0's header should be. The worker makes that order certain; the lane
now retires its active requests with their buffers (transports/mpi_retired.py).
"""
from __future__ import annotations

from support.launch import assert_clean_run, ddl_segments, run_ranks


def test_a_closed_lane_still_delivers_its_last_message(tmp_path):
    before = ddl_segments()
    proc = run_ranks(2, "multirank/lane_close_worker.py", str(tmp_path), timeout=120, own_launch=True)
    assert_clean_run(proc, before)
    out = proc.stdout
    assert "rank 0: lane close ok" in out and "rank 1: lane close ok" in out, out[-3000:]
    # The send was still active when the lane closed, so the check above could have failed.
    assert "rank 0: 1 retired requests active at close" in out, out[-3000:]
    assert "rank 0: 0 retired requests active after rank 1's receive" in out, out[-3000:]
