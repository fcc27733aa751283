"""Lightning's ways to train on "ddl" in one torchrun job: ``torchrun ... multirank/frameworks_worker.py``.

Five ``Trainer.fit`` calls on the same default "ddl" group (examples/lightning_train.py's fit()):

plain               Lightning's DDPStrategy(process_group_backend="ddl"), which initialises the group;
hook-allreduce      DDLStrategy with ddl_triton's allreduce_hook (lossless: the same losses as plain);
hook-int8           DDLStrategy with int8_compress_hook (lossy: other losses, replicas still identical);
hook-skipped        Lightning's own DDPStrategy given int8_compress_hook, which Lightning skips on
                    the CPU (lightning/pytorch/strategies/ddp.py:224): rank 0 prints 0 hook calls;
gloo                DDPStrategy(process_group=<a gloo group of every rank>): DDP's gradients over
                    torch's gloo, the rest as before (same losses as plain, bit for bit).

One job runs all three because Lightning's import dominates a job (5-9 s per rank on 2 cores),
and because a second init_process_group in one torchrun process fails on any backend (the
agent's store keeps the first group's keys: gloo's connectFullMesh then dials a closed port),
the later fits reuse the group, as Lightning does whenever one exists. Rank 0 prints
"frameworks_worker: case NAME identical B" after each fit's own lines; exit 1 unless all are.
"""
from __future__ import annotations

import sys
import warnings

import torch.distributed as dist

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

CASES = (("plain", None, "lightning"), ("hook-allreduce", "allreduce", "ddl"), ("hook-int8", "int8", "ddl"),
         ("hook-skipped", "int8", "lightning"), ("gloo", None, "lightning"))


def main() -> int:
    from ddl_triton.examples import lightning_train

    results = []
    for name, hook, strategy in CASES:
        # a gloo group for DDP's gradients, made once the default group exists (after the first fit)
        group = dist.new_group(backend="gloo") if name == "gloo" else None
        identical = lightning_train.fit("ddl", hook, strategy, steps=4, ddp_group=group)
        if dist.get_rank() == 0:
            print(f"frameworks_worker: case {name} identical {identical}", flush=True)
        results.append(identical)
    dist.destroy_process_group()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
