"""Why is the job stuck or failing? A diagnosis from the ranks' flight-recorder dumps.

Input: the ``flight-rank<R>.json`` files ddl_triton/observability/flight.py writes (one per rank that
dumped). Output: lines of plain text, the most likely cause first. Per communicator (its
id in the dumps) the diagnosis looks for, in order:

1. **disagreement**: the first sequence number where the ranks' calls differ
   ("ranks disagree at #12: rank 0 allreduce(sum, 1000 x float32), rank 1 broadcast(...)");
2. **a rank behind**: ranks whose last issued call is older than the others'
   ("rank 1 never entered allreduce #57 (ranks 0, 2 issued it from train.py:88); its last
   was allreduce #56, issued from train.py:88, done");
3. **stuck together**: every rank inside the same call: which step each reached and
   what each was waiting for ("all ranks reached step 'ag[1] chunk 3' of allreduce #40;
   rank 2 was waiting for rank 3 (shm message 7)");
4. ranks that left no dump (killed, or never reached a dump point).
"""
from __future__ import annotations

import glob
import json
import os


def load_dumps(folder: str) -> dict[int, dict]:
    """{rank: dump} for every flight-rank*.json in ``folder``."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "flight-rank*.json"))):
        with open(path) as f:
            data = json.load(f)
        if data.get("format") == "ddl_triton-flight":
            out[int(data["rank"])] = data
    return out


def diagnose(dumps: dict[int, dict]) -> list[str]:
    """The diagnosis (see the module doc) as lines of text."""
    if not dumps:
        return ["no flight-recorder dumps found (flight-rank<R>.json)"]
    size = max(d.get("size", 0) for d in dumps.values()) or (max(dumps) + 1)
    lines: list[str] = []
    comms = sorted({r["comm"] for d in dumps.values() for r in d["records"]})
    for comm in comms:
        per_rank = {rank: sorted((r for r in d["records"] if r["comm"] == comm), key=lambda r: r["seq"])
                    for rank, d in dumps.items()}
        per_rank = {rank: rs for rank, rs in per_rank.items() if rs}
        found = _disagreement(per_rank) or _behind(per_rank) or _stuck_together(per_rank)
        if found:
            prefix = f"communicator {comm}: " if len(comms) > 1 else ""
            lines.extend(prefix + line for line in found)
    missing = [r for r in range(size) if r not in dumps]
    if missing:
        lines.append(f"no dump from rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} (killed, or it never "
                     "timed out, mismatched, or received SIGUSR2)")
    reasons = {rank: d.get("reason", "") for rank, d in dumps.items()}
    for rank in sorted(reasons):
        lines.append(f"rank {rank} dumped because: {reasons[rank]}")
    return lines or ["every rank completed every recorded collective: nothing looks wrong"]


def _by_seq(records: list[dict]) -> dict[int, dict]:
    return {r["seq"]: r for r in records}


def _disagreement(per_rank: dict[int, list[dict]]) -> list[str]:
    tables = {rank: _by_seq(rs) for rank, rs in per_rank.items()}
    seqs = sorted(set.intersection(*(set(t) for t in tables.values()))) if len(tables) > 1 else []
    for seq in seqs:
        calls = {rank: t[seq]["call"] for rank, t in tables.items()}
        if len(set(calls.values())) > 1:
            parts = ", ".join(f"rank {rank} {call} (from {tables[rank][seq]['site']})" for rank, call in sorted(calls.items()))
            return [f"ranks disagree at #{seq}: {parts}"]
    return []


def _behind(per_rank: dict[int, list[dict]]) -> list[str]:
    last = {rank: rs[-1] for rank, rs in per_rank.items()}
    newest = max(r["seq"] for r in last.values())
    laggards = sorted(rank for rank, r in last.items() if r["seq"] < newest)
    if not laggards:
        return []
    ahead = sorted(rank for rank in last if rank not in laggards)
    lines = []
    for rank in laggards:
        mine = last[rank]
        missed = mine["seq"] + 1
        theirs = [_by_seq(per_rank[a]).get(missed) for a in ahead]
        theirs = [t for t in theirs if t]
        what = f"{theirs[0]['collective']} #{missed}" if theirs else f"#{missed}"
        where = f" (rank{'s' if len(ahead) > 1 else ''} {_ranks(ahead)} issued it from {theirs[0]['site']})" \
            if theirs else ""
        lines.append(f"rank {rank} never entered {what}{where}; its last was {mine['collective']} #{mine['seq']}, "
                     f"issued from {mine['site']}, {mine['state']}")
    for rank in ahead:
        stuck = last[rank]
        if stuck["state"] in ("started", "failed") and stuck.get("waiting"):
            lines.append(f"rank {rank} {'is' if stuck['state'] == 'started' else 'was'} waiting in "
                         f"{stuck['collective']} #{stuck['seq']} for {_waited(stuck['waiting'])}")
    return lines


def _stuck_together(per_rank: dict[int, list[dict]]) -> list[str]:
    last = {rank: rs[-1] for rank, rs in per_rank.items()}
    if any(r["state"] == "done" for r in last.values()):
        return []
    seq = next(iter(last.values()))["seq"]
    name = next(iter(last.values()))["collective"]
    steps: dict[str, list[int]] = {}
    for rank, r in last.items():
        steps.setdefault(r["step"] or "(before its first step)", []).append(rank)
    if len(steps) == 1:
        lines = [f"all ranks reached step '{next(iter(steps))}' of {name} #{seq}"]
    else:
        lines = [f"ranks stopped at different steps of {name} #{seq}: "
                 + "; ".join(f"{_ranks(ranks)} at '{step}'" for step, ranks in steps.items())]
    for rank, r in sorted(last.items()):
        if r.get("waiting"):
            lines.append(f"rank {rank} {'is' if r['state'] == 'started' else 'was'} waiting for {_waited(r['waiting'])}"
                         + (f": {r['error']}" if r.get("error") else ""))
    return lines


def _waited(waiting: dict) -> str:
    peer = waiting.get("peer", -1)
    who = f"rank {peer}" if peer is not None and peer >= 0 else "every rank at once (an MPI-wide wait)"
    return f"{who} ({waiting.get('what', '')})"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
