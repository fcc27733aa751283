"""Why is the job stuck or failing? A diagnosis from the ranks' flight-recorder dumps.

Input: the ``flight-rank<R>.json`` files ddl_triton/observability/flight.py writes (one per rank that
dumped), of one job: ``load_job`` takes a job's folder, or a folder of job folders (the default
``$TMPDIR/ddl_triton-flight-<uid>``: the newest job), and never mixes jobs (a dump of another job
in the same folder, an older run's, is set aside and named). Output: lines of plain text, the most
likely cause first. Per communicator (its id in the dumps) the diagnosis looks for, in order:

1. **disagreement**: the first sequence number where the ranks' calls differ
   ("ranks disagree at #12: rank 0 allreduce(sum, 1000 x float32), rank 1 broadcast(...)");
2. **a rank behind**: ranks whose last issued call is older than the others', including a rank
   that left no dump but left the communicator (finalize, close, a destroyed group, exit) while
   the others waited, as the waiting ranks recorded it ("rank 1 never issued allreduce #57
   (ranks 0, 2 issued it from train.py:88): it called finalize after 56 collectives on this
   communicator, as ranks 0, 2 saw (it left no dump)");
3. **stuck together**: the ranks inside the same call: which step each reached and what each
   was waiting for ("all ranks reached step 'ag[1] chunk 3' of allreduce #40; rank 2 was waiting
   for rank 3 (shm message 7)"); "all" only when every rank dumped;
4. ranks that left no dump (killed, or never reached a dump point).
"""
from __future__ import annotations

import glob
import json
import os

_DUMPS = "flight-rank*.json"


def load_job(folder: str) -> tuple[dict[int, dict], list[str]]:
    """({rank: dump} of one job, notes on what was set aside). ``folder`` holds dumps (a job's
    folder, or one named by DDL_DUMP_DIR), or job folders that do (the default folder per user):
    the job dumped last is taken; dumps and folders of other jobs are named in the notes."""
    notes: list[str] = []
    dumps = _read(folder)
    if not dumps:
        jobs = {}
        for sub in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            found = _read(os.path.join(folder, sub))
            if found:
                jobs[sub] = found
        if not jobs:
            return {}, notes
        newest = max(jobs, key=lambda j: _last_time(jobs[j]))
        if len(jobs) > 1:
            others = ", ".join(j for j in jobs if j != newest)
            notes.append(f"{folder} holds the dumps of {len(jobs)} jobs; this is the newest, {newest} (the others: "
                         f"{others}; name a job's folder to read it)")
        dumps = jobs[newest]
    by_job: dict[str, list[tuple[str, dict]]] = {}
    for path, data in dumps:
        by_job.setdefault(str(data.get("job", "")), []).append((path, data))
    newest = max(by_job, key=lambda j: _last_time(by_job[j]))
    for job, rows in sorted(by_job.items()):
        if job != newest:
            names = ", ".join(os.path.basename(path) for path, _ in rows)
            notes.append(f"set aside {len(rows)} dump{'s' if len(rows) > 1 else ''} of another job "
                         f"({job or 'no job id'}) than the newest here ({newest or 'no job id'}): {names}")
    return {int(data["rank"]): data for _, data in by_job[newest]}, notes


def load_dumps(folder: str) -> dict[int, dict]:
    """{rank: dump} of the newest job in ``folder`` (``load_job`` without its notes)."""
    return load_job(folder)[0]


def _read(folder: str) -> list[tuple[str, dict]]:
    """(path, dump) for every flight-recorder dump in ``folder``."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, _DUMPS))):
        with open(path) as f:
            data = json.load(f)
        if data.get("format") == "ddl_triton-flight":
            out.append((path, data))
    return out


def _last_time(rows: list[tuple[str, dict]]) -> float:
    return max(float(data.get("time", 0.0)) for _, data in rows)


def diagnose(dumps: dict[int, dict]) -> list[str]:
    """The diagnosis (see the module doc) as lines of text."""
    if not dumps:
        return ["no flight-recorder dumps found (flight-rank<R>.json)"]
    size = max(d.get("size", 0) for d in dumps.values()) or (max(dumps) + 1)
    missing = [r for r in range(size) if r not in dumps]
    lines: list[str] = []
    comms = sorted({r["comm"] for d in dumps.values() for r in d["records"]})
    for comm in comms:
        per_rank = {rank: sorted((r for r in d["records"] if r["comm"] == comm), key=lambda r: r["seq"])
                    for rank, d in dumps.items()}
        per_rank = {rank: rs for rank, rs in per_rank.items() if rs}
        left = _left(per_rank)
        found = _disagreement(per_rank) or _behind(per_rank, left) or _stuck_together(per_rank, missing)
        if found:
            prefix = f"communicator {comm}: " if len(comms) > 1 else ""
            lines.extend(prefix + line for line in found)
    if missing:
        lines.append(f"no dump from rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} (killed, or it never "
                     "timed out, mismatched, or received SIGUSR2)")
    reasons = {rank: d.get("reason", "") for rank, d in dumps.items()}
    for rank in sorted(reasons):
        lines.append(f"rank {rank} dumped because: {reasons[rank]}")
    return lines or ["every rank completed every recorded collective: nothing looks wrong"]


def _left(per_rank: dict[int, list[dict]]) -> dict[int, tuple[dict, list[int]]]:
    """{rank that left: (what the others recorded of it, the ranks that saw it)}, from the records
    of calls that failed because a peer left without issuing them (flight.Record.left)."""
    out: dict[int, tuple[dict, list[int]]] = {}
    for rank, rs in sorted(per_rank.items()):
        for r in rs:
            left = r.get("left")
            if left:
                out.setdefault(int(left["rank"]), (left, []))[1].append(rank)
    return out


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


def _behind(per_rank: dict[int, list[dict]], left: dict[int, tuple[dict, list[int]]]) -> list[str]:
    last = {rank: rs[-1] for rank, rs in per_rank.items()}
    # A rank that left while others waited, and dumped nothing: its last call is what they recorded.
    gone = {rank: info for rank, (info, _) in left.items() if rank not in last}
    newest = max(r["seq"] for r in last.values())
    laggards = sorted([rank for rank, r in last.items() if r["seq"] < newest]
                      + [rank for rank, info in gone.items() if int(info["calls"]) < newest])
    if not laggards:
        return []
    ahead = sorted(rank for rank in last if rank not in laggards)
    lines = []
    for rank in laggards:
        mine = last.get(rank)
        missed = (mine["seq"] if mine else int(gone[rank]["calls"])) + 1
        theirs = [_by_seq(per_rank[a]).get(missed) for a in ahead]
        theirs = [t for t in theirs if t]
        what = f"{theirs[0]['collective']} #{missed}" if theirs else f"#{missed}"
        where = f" (rank{'s' if len(ahead) > 1 else ''} {_ranks(ahead)} issued it from {theirs[0]['site']})" \
            if theirs else ""
        if mine is None:
            info, saw = left[rank]
            lines.append(f"rank {rank} never issued {what}{where}: it {info['did']} after {info['calls']} "
                         f"collectives on this communicator, as rank{'s' if len(saw) > 1 else ''} {_ranks(saw)} "
                         "saw (it left no dump)")
            continue
        then = f"; then it {left[rank][0]['did']}" if rank in left else ""
        lines.append(f"rank {rank} never issued {what}{where}; its last was {mine['collective']} #{mine['seq']}, "
                     f"issued from {mine['site']}, {mine['state']}{then}")
    for rank in ahead:
        stuck = last[rank]
        if stuck.get("left"):
            lines.append(f"rank {rank} was waiting in {stuck['collective']} #{stuck['seq']} when rank "
                         f"{stuck['left']['rank']} {stuck['left']['did']}")
        elif stuck["state"] in ("started", "failed") and stuck.get("waiting"):
            lines.append(f"rank {rank} {'is' if stuck['state'] == 'started' else 'was'} waiting in "
                         f"{stuck['collective']} #{stuck['seq']} for {_waited(stuck['waiting'])}")
    return lines


def _stuck_together(per_rank: dict[int, list[dict]], missing: list[int]) -> list[str]:
    last = {rank: rs[-1] for rank, rs in per_rank.items()}
    if any(r["state"] == "done" for r in last.values()):
        return []
    seq = next(iter(last.values()))["seq"]
    name = next(iter(last.values()))["collective"]
    steps: dict[str, list[int]] = {}
    for rank, r in last.items():
        steps.setdefault(r["step"] or "(before its first step)", []).append(rank)
    if len(steps) == 1 and missing:  # the ranks that left no dump may never have issued it
        lines = [f"rank{'s' if len(last) > 1 else ''} {_ranks(sorted(last))} reached step '{next(iter(steps))}' of "
                 f"{name} #{seq}; whether rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} (no dump) "
                 "issued it is unknown"]
    elif len(steps) == 1:
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
