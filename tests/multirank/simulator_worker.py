"""Link emulation on real ranks (tests/multirank/test_simulator.py): exact results, and the emulated wire time.

Run under mpiexec with DDL_TOPOLOGY=1x2 and DDL_LINK_EMULATION=mpi:bw=10MB/s,lat=20ms.
"""
import sys
import time

import torch

import ddl_triton as ddl
from support.report import print_line

comm = ddl.init()
x = torch.arange(250_000, dtype=torch.int64) * (comm.rank + 1)   # 2 MB
t0 = time.monotonic()
comm.allreduce(x)
took = time.monotonic() - t0
exact = torch.equal(x, torch.arange(250_000, dtype=torch.int64) * sum(range(1, comm.size + 1)))
# Whatever the schedule, at least one message of this rank's share crosses the 10 MB/s link after 20 ms.
print_line(f"EMULATED rank={comm.rank} exact={exact} seconds={took:.3f}")
ddl.finalize()
sys.exit(0 if exact else 1)
