"""Slurm's host lists, read here without ``scontrol``: ``node[01-04,07]`` is node01 ... node04, node07.

Semantics (Slurm's hostlist syntax, as ``scontrol show hostnames`` expands it):

- Items are separated by commas outside brackets: ``a[1-2],b3`` is a1, a2, b3.
- A bracket holds comma-separated numbers and ``low-high`` ranges; each range keeps the zero
  padding of its lower bound: ``node[009-011]`` is node009, node010, node011, and ``n[8-10]`` is
  n8, n9, n10.
- An item may hold several brackets, expanded as a cartesian product, the first bracket
  slowest: ``r[1-2]n[1-2]`` is r1n1, r1n2, r2n1, r2n2. Text may follow a bracket (``gpu[1-2]-ib``).
- Hosts keep the list's order; a host listed twice is kept once, where it first appears.

A list that is not in this syntax (an unclosed or nested bracket, an empty item, a range whose
bounds are not numbers or run backwards) raises ``ValueError`` naming the list and the fault:
nothing is guessed. ``expand`` refuses lists of more than ``MAX_HOSTS`` hosts (a typo such as
``n[1-999999999]`` must not take the machine's memory).
"""
from __future__ import annotations

MAX_HOSTS = 1 << 20


def expand(nodelist: str) -> list[str]:
    """Every host of ``nodelist``, in order (see the module doc)."""
    if not nodelist or not nodelist.strip():
        raise ValueError(f"Slurm node list {nodelist!r} is empty")
    hosts: list[str] = []
    seen: set[str] = set()
    for item in _items(nodelist):
        for host in _expand_item(item, nodelist):
            if host not in seen:
                seen.add(host)
                hosts.append(host)
            if len(hosts) > MAX_HOSTS:
                raise ValueError(f"Slurm node list {nodelist!r} names more than {MAX_HOSTS} hosts")
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of ``nodelist`` (where Slurm's block distribution puts task 0); the whole
    list is checked, as ``expand`` checks it."""
    return expand(nodelist)[0]


def _items(nodelist: str) -> list[str]:
    """The comma-separated items of ``nodelist``, commas inside brackets kept."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"Slurm node list {nodelist!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"Slurm node list {nodelist!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"Slurm node list {nodelist!r}: a '[' is never closed")
    items.append(nodelist[start:])
    for item in items:
        if not item.strip():
            raise ValueError(f"Slurm node list {nodelist!r} has an empty item")
    return [item.strip() for item in items]


def _expand_item(item: str, nodelist: str) -> list[str]:
    """The hosts of one item (text and brackets)."""
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, inside, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    numbers = _numbers(inside, nodelist)
    tails = _expand_item(rest, nodelist) if rest else [""]
    return [prefix + n + t for n in numbers for t in tails]


def _numbers(inside: str, nodelist: str) -> list[str]:
    """The numbers of one bracket's body (``01-04,07``), each with its range's padding."""
    out: list[str] = []
    for part in inside.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"Slurm node list {nodelist!r}: {part!r} in [{inside}] is not a number or a "
                             "range low-high of numbers")
        if not dash:
            out.append(low)
            continue
        a, b = int(low), int(high)
        if b < a:
            raise ValueError(f"Slurm node list {nodelist!r}: the range {part!r} runs backwards")
        if len(out) + b - a + 1 > MAX_HOSTS:
            raise ValueError(f"Slurm node list {nodelist!r} names more than {MAX_HOSTS} hosts")
        width = len(low)  # Slurm pads to the lower bound's width: 009-011, 8-10
        out.extend(str(n).zfill(width) for n in range(a, b + 1))
    return out
