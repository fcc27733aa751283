"""Per-step allreduce or outer sync (DiLoCo), chosen from numbers: the link between hosts, the step
time and the model's size. Takes numbers only (it never measures, imports no runtime and talks to
no rank); ``ddl_triton.torch.DiLoCo(sync_every="auto")`` calls it with the link the init probe
measured (planning/measured_link.py's ``MeasuredLink.bytes_per_s`` and ``.alpha``), its own timed
inner steps and the model's parameter bytes, and prints the plan; ``python -m ddl_triton.simulate
outer-sync`` prints it for numbers given by hand.

The cost model (every figure per host; ``n`` hosts, ``B`` bytes to average, ``r`` the link's rate
each way with both ways busy, ``a`` its one-way latency):

    allreduce(B) = 2(n-1)·a + 2(n-1)/n · B / r

the ring allreduce across the hosts: each host's link carries 2(n-1)/n of the tensor each way in
2(n-1) steps, each paying the latency once. The ranks of a host reduce among themselves first
(shared memory, counted free: the slow link is the cost), so ``ranks_per_host`` changes no byte on
the host link; it is kept in the plan's text. One host: nothing crosses a slow link, every exposure
is 0. A compressed tensor puts ``B · bits / 32`` on the wire (``compression_methods``' ``bits``
at its default block of 256: int8 8.125 bits, 16-bit methods 16, onebit 1).

Candidates, each with its exposed communication per inner step:

- **per-step fp32** and **per-step <method>** for each method usable per step unasked: those
  ``compression="auto"`` may choose (``compression_methods.auto_names()``: int8), and the method
  ``compression`` names (every method under "auto"). A method that must be named (onebit, int4, the
  16-bit ones) is not proposed per step unless named: on the testbed, per-step onebit took the byte-LM's
  eval loss 18% above fp32's at equal tokens (bench/results/outer_sync.md). ``allreduce(B_wire)``
  every step, all of it exposed (DDP's overlap with backward is not credited: across a slow link
  the transfer dwarfs backward).
- **outer H=<h> <method>**: DiLoCo's sync of the pseudo-gradient (``model_bytes``, compressed with
  ``compression``: None or "none" for fp32, a method's name, or "auto" for every method and fp32)
  every ``h`` inner steps, ``h`` the powers of two up to ``max_sync_every`` and the bound itself.
  With ``fragments`` = 1 the sync blocks: ``T/h`` exposed per inner step, ``T = allreduce(B_wire)``.
  With ``fragments`` = F > 1 (Streaming DiLoCo) the F fragments sync at staggered steps, one every
  h/F inner steps, each overlapped with the ``fragment_sync_delay`` = h/F - 1 inner steps that follow
  it (the longest delay DiLoCo takes: a fragment is applied before its next sync starts): per inner
  step ``max(0, T_F - (h - F)·step_s) / h`` exposed, ``T_F = F·2(n-1)·a + 2(n-1)/n·B_wire/r`` (each
  fragment pays the latency). Candidates with h < F are left out (a fragment per step at most).
  The outer optimizer's step and the pseudo-gradient's arithmetic are not counted; neither is the
  CPU a background transfer takes from the inner steps where ranks share cores.

Two measured terms, each optional (absent: 0, and the plan is the link-only model's above). On CPU
ranks they are on the critical path; bench/results/outer_sync.md measured the link-only model
predicting 93-96% for per-step int8/int4 at 1 Gbit/s where 54-71% was measured, because it left
them out:

- ``codec_s_per_byte``, {method: seconds per fp32 byte}: one compress + decompress (the registry
  row's ``roundtrip``, ddl_triton/compression_methods.py) of ``method`` on this machine, timed at the
  model's size (``DiLoCo(sync_every="auto")`` times it on each rank during its warm-up, with
  ``roundtrip`` as tuning/auto_compression.py's probe times it, and takes the slowest rank's). A
  compressed allreduce of B fp32 bytes costs ``CODEC_ROUNDTRIPS`` (2, the tuner's count: the
  worker's quantise, the server's dequantise + reduce + requantise, the final dequantise) ×
  ``codec_s_per_byte[m]`` × B of CPU, added whole to the exposed time (no transfer hides it: it
  takes the core the step needs): every step for per-step m, once every h steps for outer H=h m,
  fragments or not (the fragments' codecs sum to the whole model's). A method absent from the
  mapping is priced 0 there; fp32 has no codec.
- ``per_step_fp32_s``: the measured exposed time of one per-step fp32 gradient average (the
  warm-up's: ``DiLoCo(sync_every="auto")`` averages in fp32 before each of its first inner steps,
  and times each call whole, flattening and copy-back included; the median, slowest rank). What
  it exceeds the link model's ``allreduce(model_bytes)`` by is the per-call overhead (the call, the
  flattening, what the link model misses), ``max(0, per_step_fp32_s - allreduce(model_bytes))``,
  which every per-step candidate pays each step (per-step fp32 then exposes
  ``max(per_step_fp32_s, allreduce(model_bytes))``) and an outer candidate once per fragment sync
  (``fragments`` per h steps). A measurement below the link model's prediction lowers nothing: four
  warm-up calls can ride a shaper's burst allowance, or (a stand-in communicator) not cross the link.

So per-step m exposes ``allreduce(B_wire) + 2·c_m·B + overhead`` and outer H=h m (blocking) exposes
``(allreduce(B_wire) + 2·c_m·B + overhead) / h``; streaming, ``(2·c_m·B + F·overhead +
max(0, T_F - (h - F)·step_s)) / h``.

Utilisation is ``step_s / (step_s + exposed_s)``. The rule, with ``TARGET_UTILISATION`` = 0.9:
per-step (the training math unchanged) when a per-step candidate reaches the target, fp32 first,
else the compressed one of the most wire bits that does (the least change to the gradients);
else outer sync with the smallest h that reaches it (ties: more wire bits); else the candidate that
exposes the least (the bound, normally: outer sync at h = ``max_sync_every``), saying what stays
exposed. Choosing outer sync changes the training math: the caller opts in (``sync_every="auto"``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import compression_methods

__all__ = ["CODEC_ROUNDTRIPS", "SyncPlan", "TARGET_UTILISATION", "allreduce_seconds", "format_rate", "per_step_methods", "plan_sync"]

TARGET_UTILISATION = 0.9
CODEC_ROUNDTRIPS = 2  # compress + decompress round trips on a compressed allreduce's critical path (module doc)
_BLOCK = 256  # the compressed allreduce's default block (compression_methods' ``bits(block)``)


@dataclass(frozen=True)
class SyncPlan:
    """What ``plan_sync`` chose (module doc): ``mode`` "per-step" or "outer"; ``compression`` "none"
    or a registry method's name; ``sync_every`` (1 when per-step); ``fragments``; ``exposed_s`` the
    predicted exposed communication per inner step; ``utilisation`` step_s / (step_s + exposed_s);
    ``why`` one line that says so; ``candidates`` every candidate's (name, exposed_s)."""

    mode: str
    compression: str
    sync_every: int
    fragments: int
    exposed_s: float
    utilisation: float
    why: str
    candidates: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class _Candidate:
    name: str
    mode: str
    compression: str
    sync_every: int
    exposed_s: float
    bits: float
    codec_s: float = 0.0  # of exposed_s per inner step: the codec's CPU
    overhead_s: float = 0.0  # of exposed_s per inner step: the measured per-call overhead


def allreduce_seconds(nbytes: float, *, hosts: int, link_bytes_per_s: float, link_latency_s: float,
                      latency_terms: int = 1) -> float:
    """Seconds of one ring allreduce of ``nbytes`` per host across ``hosts`` hosts (module doc):
    ``latency_terms`` allreduces' latency (fragments), one transfer of the bytes. 0 for one host
    or no bytes (nothing to send: no call)."""
    if hosts <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (hosts - 1)
    wire = steps / hosts * nbytes / link_bytes_per_s
    return latency_terms * steps * link_latency_s + wire


def format_rate(bytes_per_s: float) -> str:
    """A link rate as people say it: 12.5e6 -> "100 Mbit/s", 1.25e8 -> "1 Gbit/s"."""
    bits = bytes_per_s * 8
    if math.isinf(bits):
        return "an unlimited link"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def _check(model_bytes, step_s, hosts, ranks_per_host, link_bytes_per_s, link_latency_s, max_sync_every,
           fragments, codec_s_per_byte=None, per_step_fp32_s=None) -> None:
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)

    def integer(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    problems = []
    if not (number(model_bytes) and 0 <= model_bytes < math.inf):
        problems.append(f"model_bytes must be a finite number >= 0, got {model_bytes!r}")
    if not (number(step_s) and 0 < step_s < math.inf):
        problems.append(f"step_s must be a finite number of seconds > 0, got {step_s!r}")
    for name, value in (("hosts", hosts), ("ranks_per_host", ranks_per_host), ("max_sync_every", max_sync_every),
                        ("fragments", fragments)):
        if not (integer(value) and value >= 1):
            problems.append(f"{name} must be an integer >= 1, got {value!r}")
    if not (number(link_bytes_per_s) and link_bytes_per_s > 0):
        problems.append(f"link_bytes_per_s must be a number > 0 (inf for no limit), got {link_bytes_per_s!r}")
    if not (number(link_latency_s) and 0 <= link_latency_s < math.inf):
        problems.append(f"link_latency_s must be a finite number of seconds >= 0, got {link_latency_s!r}")
    if codec_s_per_byte is not None:
        if not hasattr(codec_s_per_byte, "items"):
            problems.append(f"codec_s_per_byte must be a mapping of method to seconds per byte, got "
                            f"{codec_s_per_byte!r}")
        else:
            known = set(compression_methods.names())
            for method, value in codec_s_per_byte.items():
                if method not in known:
                    problems.append(f"codec_s_per_byte names {method!r}, no compression method (known: "
                                    f"{', '.join(sorted(known))})")
                elif not (number(value) and 0 <= value < math.inf):
                    problems.append(f"codec_s_per_byte[{method!r}] must be a finite number of seconds >= 0, "
                                    f"got {value!r}")
    if per_step_fp32_s is not None and not (number(per_step_fp32_s) and 0 <= per_step_fp32_s < math.inf):
        problems.append(f"per_step_fp32_s must be a finite number of seconds >= 0 or None, got {per_step_fp32_s!r}")
    if problems:
        raise ValueError("plan_sync: " + "; ".join(problems))


def _outer_methods(compression) -> list[str]:
    if compression is None or compression == compression_methods.NONE:
        return [compression_methods.NONE]
    if compression == compression_methods.AUTO:
        return [compression_methods.NONE, *compression_methods.names()]
    compression_methods.get(compression)  # an unknown name: ValueError listing the valid ones
    return [compression]


def per_step_methods(compression: str | None = None) -> tuple[str, ...]:
    """The per-step candidates' methods ("none" for fp32): fp32, those ``compression="auto"`` may
    choose, and the method ``compression`` names (every method for "auto"); module doc."""
    named = [] if compression is None or compression == compression_methods.NONE else _outer_methods(compression)
    return tuple(dict.fromkeys([compression_methods.NONE, *compression_methods.auto_names(), *named]))


def _bits(method: str) -> float:
    return 32.0 if method == compression_methods.NONE else compression_methods.get(method).bits(_BLOCK)


def _label(method: str) -> str:
    return "fp32" if method == compression_methods.NONE else method


def _sync_everys(max_sync_every: int) -> list[int]:
    out, h = [], 2
    while h <= max_sync_every:
        out.append(h)
        h *= 2
    if max_sync_every > 1 and max_sync_every not in out:
        out.append(max_sync_every)
    return out


def plan_sync(*, model_bytes: float, step_s: float, hosts: int, ranks_per_host: int, link_bytes_per_s: float,
              link_latency_s: float, max_sync_every: int, compression: str | None = None,
              fragments: int = 1, codec_s_per_byte: dict[str, float] | None = None,
              per_step_fp32_s: float | None = None) -> SyncPlan:
    """Per-step allreduce (fp32 or compressed) or outer sync every H inner steps, by the cost model
    and rule of the module doc. ``model_bytes``: fp32 bytes of the parameters to average;
    ``step_s``: one inner step's compute; ``link_bytes_per_s``/``link_latency_s``: the link between
    hosts each way (``MeasuredLink.bytes_per_s``/``.alpha``); ``max_sync_every``: the largest H the
    user allows (1: per-step only); ``compression``: the pseudo-gradients' method (None/"none",
    a method, "auto"), also a per-step candidate when named; ``fragments``: Streaming DiLoCo's fragments (> 1 overlaps the sync);
    ``codec_s_per_byte`` ({method: measured seconds per fp32 byte of one ``roundtrip``}) and
    ``per_step_fp32_s`` (one per-step fp32 average's measured exposed seconds): the module doc's
    measured terms, 0 where absent. Bad numbers raise ValueError naming each."""
    _check(model_bytes, step_s, hosts, ranks_per_host, link_bytes_per_s, link_latency_s, max_sync_every, fragments,
           codec_s_per_byte, per_step_fp32_s)
    outer_methods = _outer_methods(compression)
    link = dict(hosts=hosts, link_bytes_per_s=link_bytes_per_s, link_latency_s=link_latency_s)
    one_host = hosts <= 1 or model_bytes <= 0  # nothing crosses a slow link: no call, no codec, no overhead
    codec = {} if one_host else dict(codec_s_per_byte or {})
    overhead = 0.0
    if per_step_fp32_s is not None and not one_host:
        overhead = max(0.0, per_step_fp32_s - allreduce_seconds(model_bytes, **link))

    def codec_s(method: str) -> float:
        return CODEC_ROUNDTRIPS * codec.get(method, 0.0) * model_bytes

    candidates: list[_Candidate] = []
    for method in per_step_methods(compression):
        bits = _bits(method)
        wire = allreduce_seconds(model_bytes * bits / 32, **link)
        candidates.append(_Candidate(f"per-step {_label(method)}", "per-step", method, 1,
                                     wire + codec_s(method) + overhead, bits, codec_s(method), overhead))
    for h in _sync_everys(max_sync_every):
        if h < fragments:
            continue
        for method in outer_methods:
            bits = _bits(method)
            cpu, calls = codec_s(method) / h, overhead * fragments / h
            if fragments == 1:
                exposed = allreduce_seconds(model_bytes * bits / 32, **link) / h
            else:
                total = allreduce_seconds(model_bytes * bits / 32, latency_terms=fragments, **link)
                exposed = max(0.0, total - (h - fragments) * step_s) / h
            candidates.append(_Candidate(f"outer H={h} {_label(method)}", "outer", method, h, exposed + cpu + calls,
                                         bits, cpu, calls))

    def reaches(c: _Candidate) -> bool:
        return step_s / (step_s + c.exposed_s) >= TARGET_UTILISATION

    per_step = [c for c in candidates if c.mode == "per-step" and reaches(c)]
    outer = [c for c in candidates if c.mode == "outer" and reaches(c)]
    if per_step:
        chosen = min(per_step, key=lambda c: (-c.bits, c.exposed_s))
    elif outer:
        chosen = min(outer, key=lambda c: (c.sync_every, -c.bits, c.exposed_s))
    else:
        # the bound: the least exposed; per-step first on a tie (it leaves the training math alone)
        chosen = min(candidates, key=lambda c: (c.exposed_s, c.mode != "per-step", -c.bits))
    utilisation = step_s / (step_s + chosen.exposed_s)
    why = _why(chosen, candidates, step_s, hosts, ranks_per_host, link_bytes_per_s, fragments, reached=reaches(chosen),
               measured_fp32=per_step_fp32_s is not None)
    return SyncPlan(mode=chosen.mode, compression=chosen.compression, sync_every=chosen.sync_every,
                    fragments=fragments, exposed_s=chosen.exposed_s, utilisation=utilisation, why=why,
                    candidates=tuple((c.name, c.exposed_s) for c in candidates))


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def _parts(c: _Candidate) -> str:
    """The measured terms of ``c``'s exposed time, where there are any: "(codec 2.1 ms, per call 3 ms)"."""
    parts = ([f"codec {_ms(c.codec_s)}"] if c.codec_s > 0 else []) + \
            ([f"per call {_ms(c.overhead_s)}"] if c.overhead_s > 0 else [])
    return f" ({', '.join(parts)})" if parts else ""


def _why(chosen: _Candidate, candidates: list[_Candidate], step_s: float, hosts: int, ranks_per_host: int,
         link_bytes_per_s: float, fragments: int, *, reached: bool, measured_fp32: bool = False) -> str:
    if hosts == 1:
        return (f"one host ({ranks_per_host} rank{'s' if ranks_per_host > 1 else ''}): no link between hosts to "
                f"hide, per-step fp32")
    by_name = {c.name: c for c in candidates}
    fp32 = by_name["per-step fp32"]
    measured = " (measured)" if measured_fp32 and fp32.overhead_s > 0 else ""  # else the prediction, higher
    head = f"{format_rate(link_bytes_per_s)} between hosts: per-step fp32 exposes {_ms(fp32.exposed_s)}{measured} " \
           f"of a {_ms(step_s)} step"
    if chosen is fp32:
        return head + f" ({step_s / (step_s + fp32.exposed_s):.0%} utilisation): per-step fp32"
    # the default compressed method (what "auto" runs across hosts) and, where cheaper, the cheapest
    compressed = [c for c in candidates if c.mode == "per-step" and c.compression != compression_methods.NONE]
    named = [c for c in compressed if c.compression == compression_methods.DEFAULT]
    cheapest = min(compressed, key=lambda c: c.exposed_s, default=None)
    if cheapest is not None and (not named or cheapest.exposed_s < named[0].exposed_s):
        named.append(cheapest)
    for c in named:
        head += f"; {_label(c.compression)} {_ms(c.exposed_s)}" + _parts(c)
    streaming = f", {fragments} fragments overlapped" if fragments > 1 else ""
    if not reached:
        verdict = (f"nothing reaches {TARGET_UTILISATION:.0%}: {chosen.name}{streaming if chosen.mode == 'outer' else ''}"
                   f" still exposes {_ms(chosen.exposed_s)} per step")
    elif chosen.mode == "per-step":
        verdict = f"per-step {_label(chosen.compression)} reaches {TARGET_UTILISATION:.0%}"
    else:
        verdict = (f"DiLoCo H={chosen.sync_every} ({_label(chosen.compression)} pseudo-gradients{streaming}) "
                   f"hides it: {_ms(chosen.exposed_s)} per step exposed{_parts(chosen)}")
    return f"{head}; {verdict} ({step_s / (step_s + chosen.exposed_s):.0%} utilisation)"
