"""Where outer sync starts to win: the link rate below which per-step allreduce can no longer keep
compute utilisation at the planner's target, so that ``plan_sync`` switches to outer sync (DiLoCo).
The same cost model as the planner's (ddl_triton/planning/outer_sync.py), solved for the rate:

    per-step with wire bits b reaches the target U  <=>  2(n-1)·a + 2(n-1)/n · B·b/32 / r  <=  step·(1/U - 1)
                                                   <=>  r  >=  2(n-1)/n · B·b/32 / (step·(1/U - 1) - 2(n-1)·a)

for ``n`` hosts, ``B`` model bytes (fp32), ``a`` the link's one-way latency and ``r`` its rate each
way. Each per-step method (fp32 and every registered compression method) has its own crossover;
the planner's is the lowest among its per-step candidates (fp32, the methods ``compression="auto"``
may choose, and a method named with ``compression``: ``per_step_methods``), or fp32's alone when
per-step compression is ruled out. None where no rate suffices (the latency alone exposes too much), 0 where
none is needed (one host, or a model of no bytes).

    python -m ddl_triton.simulate crossover --params 1.2M --step-ms 4 --hosts 2
    python -m ddl_triton.simulate outer-sync --params 1M --step-ms 4 --hosts 2 --rate 100mbit \\
        [--latency-us 50] [--max-sync-every 128] [--compression int8] [--fragments 4]

``outer-sync`` prints the plan for those numbers (what ``DiLoCo(sync_every="auto")`` would print) and
every candidate's exposed time; ``crossover`` prints each per-step candidate's crossover rate.
``--rate`` is the payload rate between hosts (a tc-style "100mbit", or bytes per second); a
shaped testbed link carries about 0.9-0.95 of its tbf rate as payload (bench/results/*.md).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from .. import compression_methods
from ..planning.outer_sync import TARGET_UTILISATION, format_rate, per_step_methods, plan_sync


@dataclass(frozen=True)
class Crossover:
    """``rates``: each per-step candidate's crossover (bytes per second, None where none suffices);
    ``planner``: the rate below which ``plan_sync`` chooses outer sync (the lowest of ``rates``)."""

    rates: tuple[tuple[str, float | None], ...]
    planner: float | None


def crossover(*, model_bytes: float, step_s: float, hosts: int, link_latency_s: float = 0.0,
              compression: str | None = None, per_step_compression: bool = True) -> Crossover:
    """The link rates where outer sync starts to win (module doc), per per-step method and the
    planner's (``compression`` as ``plan_sync`` takes it); ``per_step_compression=False`` leaves
    fp32 as the only per-step candidate."""
    if not (isinstance(step_s, (int, float)) and 0 < step_s < math.inf):
        raise ValueError(f"crossover: step_s must be a finite number of seconds > 0, got {step_s!r}")
    if not (isinstance(model_bytes, (int, float)) and 0 <= model_bytes < math.inf):
        raise ValueError(f"crossover: model_bytes must be a finite number >= 0, got {model_bytes!r}")
    if not (isinstance(hosts, int) and hosts >= 1):
        raise ValueError(f"crossover: hosts must be an integer >= 1, got {hosts!r}")
    methods = (compression_methods.NONE, *(compression_methods.names() if per_step_compression else ()))
    budget = step_s * (1 / TARGET_UTILISATION - 1) - 2 * (hosts - 1) * link_latency_s
    rates = []
    for method in methods:
        bits = 32.0 if method == compression_methods.NONE else compression_methods.get(method).bits(256)
        if hosts == 1 or model_bytes == 0:
            rate = 0.0
        elif budget <= 0:
            rate = None
        else:
            rate = 2 * (hosts - 1) / hosts * model_bytes * bits / 32 / budget
        rates.append(("fp32" if method == compression_methods.NONE else method, rate))
    candidates = {"fp32" if m == compression_methods.NONE else m for m in per_step_methods(compression)}
    known = [r for name, r in rates if r is not None and name in candidates]
    return Crossover(rates=tuple(rates), planner=min(known) if known else None)


def _rate(text: str) -> float:
    """Bytes per second from "100mbit" (tc's units) or a plain number of bytes per second."""
    try:
        return float(text)
    except ValueError:
        from ..testbed.hosts import parse_rate
        return parse_rate(text) / 8


def _params(text: str) -> float:
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(text[-1:].lower(), 1)
    return float(text[:-1] if scale != 1 else text) * scale


def _codec(text: str) -> tuple[str, float]:
    """("int8", 1e-9) from "int8=1": a method and its roundtrip in ns per fp32 byte."""
    method, sep, ns = text.partition("=")
    try:
        return method, float(ns) * 1e-9
    except ValueError:
        raise argparse.ArgumentTypeError(f"--codec wants METHOD=NS_PER_BYTE (e.g. int8=1.5), got {text!r}") from None


def add_parsers(sub) -> None:
    """The ``outer-sync`` and ``crossover`` sub-commands of ``python -m ddl_triton.simulate``."""
    for name, helptext in (("outer-sync", "the planner's choice of per-step allreduce or outer sync (DiLoCo)"),
                           ("crossover", "the link rate where outer sync starts to win")):
        p = sub.add_parser(name, help=helptext)
        size = p.add_mutually_exclusive_group(required=True)
        size.add_argument("--params", type=_params, help="parameters (fp32), e.g. 1.2M")
        size.add_argument("--model-bytes", type=float, help="fp32 bytes of the parameters")
        p.add_argument("--step-ms", type=float, required=True, help="one inner step's compute, ms")
        p.add_argument("--hosts", type=int, default=2)
        p.add_argument("--latency-us", type=float, default=0.0, help="the link's one-way latency")
        p.add_argument("--compression", default=None, help="the pseudo-gradients' method (none, a method, auto), "
                       "also a per-step candidate when named")
        if name == "outer-sync":
            p.add_argument("--rate", type=_rate, required=True, help="payload rate between hosts: 100mbit, or B/s")
            p.add_argument("--ranks-per-host", type=int, default=1)
            p.add_argument("--max-sync-every", type=int, default=128)
            p.add_argument("--fragments", type=int, default=1)
            p.add_argument("--codec", action="append", default=[], type=_codec, metavar="METHOD=NS_PER_BYTE",
                           help="a method's measured compress + decompress (its roundtrip), ns per fp32 byte; "
                           "repeatable (planning/outer_sync.py's codec_s_per_byte)")
            p.add_argument("--per-step-fp32-ms", type=float, default=None,
                           help="one per-step fp32 average's measured exposed time (its per_step_fp32_s)")
        else:
            p.add_argument("--no-per-step-compression", action="store_true", help="fp32 the only per-step candidate")


def run(args) -> int:
    model_bytes = args.model_bytes if args.model_bytes is not None else 4 * args.params
    step_s = args.step_ms / 1e3
    if args.command == "outer-sync":
        plan = plan_sync(model_bytes=model_bytes, step_s=step_s, hosts=args.hosts, ranks_per_host=args.ranks_per_host,
                         link_bytes_per_s=args.rate, link_latency_s=args.latency_us / 1e6,
                         max_sync_every=args.max_sync_every, compression=args.compression, fragments=args.fragments,
                         codec_s_per_byte=dict(args.codec) or None,
                         per_step_fp32_s=None if args.per_step_fp32_ms is None else args.per_step_fp32_ms / 1e3)
        print(plan.why)
        print(f"# plan: {plan.mode}, compression {plan.compression}, sync_every {plan.sync_every}, fragments "
              f"{plan.fragments}: {plan.exposed_s * 1e3:.3f} ms exposed per step, {plan.utilisation:.1%} utilisation")
        print(f"{'candidate':>24} {'exposed ms':>11} {'utilisation':>12}")
        for name, exposed in plan.candidates:
            print(f"{name:>24} {exposed * 1e3:>11.3f} {step_s / (step_s + exposed):>11.1%}")
        return 0
    result = crossover(model_bytes=model_bytes, step_s=step_s, hosts=args.hosts, link_latency_s=args.latency_us / 1e6,
                       compression=args.compression, per_step_compression=not args.no_per_step_compression)
    print(f"# {model_bytes / 1e6:.3g} MB fp32, {args.step_ms:g} ms per step, {args.hosts} hosts, "
          f"{args.latency_us:g} us: per-step allreduce reaches {TARGET_UTILISATION:.0%} utilisation at or above")
    for name, rate in result.rates:
        print(f"{'per-step ' + name:>20}  {_show(rate)}")
    print(f"# the planner (per-step candidates: {', '.join(per_step_methods(args.compression))}) switches to outer "
          f"sync below {_show(result.planner)}")
    return 0


def _show(rate: float | None) -> str:
    if rate is None:
        return "no rate (the latency alone exposes too much)"
    return "any rate" if rate == 0 else f"{format_rate(rate)} ({rate:.4g} B/s)"
