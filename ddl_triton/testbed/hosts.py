"""Hosts built from Linux namespaces on one machine: real sockets between them, nothing else shared.

A :class:`Testbed` of N hosts is, for each host ``h<i>``:

- a network namespace with one interface, ``eth0``, at ``10.77.0.<i>/24``, joined to the other hosts
  through a bridge that lives in a switch namespace of its own (the root namespace is left alone);
- a holder process in new UTS, IPC and mount namespaces: its own hostname (``h<i>``), its own
  ``/dev/shm`` and ``/tmp`` (private tmpfs), its own boot id and an ``/etc/hosts`` naming every host.
  Every process of the host shares its network namespace, which is how ``kill`` finds them all
  (no PID namespace: a process inside one host must be able to enter another, as ssh would).
  The folders under /tmp that hold this process's interpreter, package and working directory (a
  clone in /tmp, say) stay visible on every host, as a cluster's shared file system would be;
- ``tbf`` shaping both directions of its link to ``rate`` (the host's egress and the switch port
  toward it, so two senders into one host are limited too).

Commands enter a host with ``nsenter`` into the holder's namespaces (``run``, ``popen``). ``cut``
takes a host's link down, both ways or one way, and ``mend`` brings it back; ``shape`` changes its
rate mid-run; ``kill`` ends the host (its link goes silent, then SIGKILL to every process in it, as
a power cut would). ``down`` removes everything; the context manager calls it on
any exit, Ctrl-C included. Every name carries a per-run prefix, so two testbeds never collide;
``reap`` removes testbeds whose owning process died without taking them down.

Example::

    with Testbed(hosts=2, rate="1gbit") as bed:
        bed.run("h1", ["hostname"]).stdout   # "h1\\n"
        bed.run("h2", ["ping", "-c1", "h1"])

Traffic stays inside the namespaces a testbed made, on the addresses it assigned on its own bridge.
Needs root, ``ip``, ``tc``, ``unshare`` and ``nsenter``; :func:`check_available` says what is missing.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

STATE_DIR = Path("/run/ddl_triton-testbed")  # one JSON file per live testbed (the CLI finds them there)
SUBNET = "10.77.0"                           # inside each testbed's own switch namespace only
INSIDE_STATE = "/tmp/.ddl_triton-testbed.json"  # where a host finds its testbed (its /tmp is private)
_READY_TIMEOUT_S = 10.0


class TestbedUnavailable(RuntimeError):
    """This machine cannot build hosts (no root, or no namespaces): the message says which."""


def check_available() -> None:
    """Raise TestbedUnavailable naming the first missing capability."""
    if os.geteuid() != 0:
        raise TestbedUnavailable("ddl-testbed: needs root (network, UTS, mount and PID namespaces)")
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            raise TestbedUnavailable(f"ddl-testbed: needs the '{tool}' command (iproute2 / util-linux)")
    probe = f"ddlprobe{os.getpid()}-{secrets.token_hex(3)}"  # unique: testbeds may start in several threads at once
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        raise TestbedUnavailable(f"ddl-testbed: cannot create a network namespace: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def burst_bytes(rate: str) -> int:
    """The tbf burst for ``rate``: about 2 ms of traffic, at least 64 KiB (tbf drops any packet
    larger than its burst, and offloaded TCP hands it 64 KiB segments)."""
    bits = parse_rate(rate)
    return max(64 << 10, bits // 8 // 500)


def parse_rate(rate: str) -> int:
    """Bits per second of a tc-style rate: "1gbit", "100mbit", "10kbit", "5000bit"."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"ddl-testbed: rate {rate!r} is not like '1gbit', '100mbit' or '10kbit'")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip"] + (["-n", netns] if netns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ddl-testbed: {' '.join(cmd)}: {done.stderr.strip()}")


class Testbed:
    """N hosts on one machine (see the module doc). ``rate`` shapes every link ("" for none)."""

    def __init__(self, hosts: int = 2, rate: str = "1gbit", *, name: str | None = None, persistent: bool = False,
                 shared: tuple[str, ...] = ()):
        if not 1 <= hosts <= 16:
            raise ValueError(f"ddl-testbed: hosts must be 1..16, got {hosts}")
        if rate:
            parse_rate(rate)
        self.name = name or f"dt{secrets.token_hex(2)}"  # short: Linux interface names hold 15 characters
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", self.name):
            raise ValueError(f"ddl-testbed: name {self.name!r} must be 1-6 lowercase letters and digits")
        self.hosts = [f"h{i}" for i in range(1, hosts + 1)]
        self.rate = rate
        self.address = {h: f"{SUBNET}.{i}" for i, h in enumerate(self.hosts, 1)}
        self.holders: dict[str, int] = {}   # host -> pid of the process holding its namespaces
        self._run_dir = STATE_DIR / self.name
        # persistent: made by `ddl-testbed up`, which exits at once; else owned by this process,
        # and `reap` may remove it once this process is gone.
        self._owner = None if persistent else os.getpid()
        self.shared = _shared_under_tmp(shared)
        self._up = False

    # -- life cycle -------------------------------------------------------------------------
    def up(self) -> "Testbed":
        """Build the switch, the hosts and their links; on any failure, remove what was built."""
        check_available()
        if (STATE_DIR / f"{self.name}.json").exists():
            raise RuntimeError(f"ddl-testbed: a testbed named {self.name!r} is already up")
        self._up = True
        try:
            self._run_dir.mkdir(parents=True, exist_ok=False)
            self._save()  # first, so that `down`/`reap` find even a half-built testbed
            switch = self._ns("sw")
            _ip("netns", "add", switch)
            _ip("link", "set", "lo", "up", netns=switch)
            _ip("link", "add", "br0", "type", "bridge", netns=switch)
            _ip("link", "set", "br0", "up", netns=switch)
            # Bridged frames must not go through the root namespace's iptables (it defaults to on).
            subprocess.run(["ip", "netns", "exec", switch, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"],
                           capture_output=True)
            (self._run_dir / "hosts").write_text(
                "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in self.address.items()))
            for h in self.hosts:
                self._add_host(h)
            self._save()
        except BaseException:
            self.down()
            raise
        return self

    def _add_host(self, host: str) -> None:
        ns, switch = self._ns(host), self._ns("sw")
        inner, port = f"{self.name}{host}i", f"{self.name}{host}p"
        _ip("netns", "add", ns)
        _ip("link", "set", "lo", "up", netns=ns)
        _ip("link", "add", inner, "type", "veth", "peer", "name", port)
        _ip("link", "set", inner, "netns", ns, "name", "eth0")
        _ip("link", "set", port, "netns", switch)
        _ip("link", "set", port, "master", "br0", netns=switch)
        _ip("link", "set", port, "up", netns=switch)
        _ip("addr", "add", f"{self.address[host]}/24", "dev", "eth0", netns=ns)
        _ip("link", "set", "eth0", "up", netns=ns)
        if self.rate:
            self.shape(host, self.rate)
        boot_id = self._run_dir / f"{host}.boot_id"
        boot_id.write_text(str(uuid.uuid4()) + "\n")
        state = self._run_dir / f"{host}.state"
        state.write_text(json.dumps({"testbed": self.name, "host": host}))
        ready = self._run_dir / f"{host}.ready"
        outer_tmp = self._run_dir / f"{host}.outer_tmp"  # the machine's /tmp, seen from inside the host
        outer_tmp.mkdir()
        keep = "".join(f" && mkdir -p {d} && mount --bind {outer_tmp}{d[len('/tmp'):]} {d}" for d in self.shared)
        # The holder keeps the host's namespaces alive. Bind mounts first (their sources live outside
        # /tmp), then the private tmpfs; it then waits forever (SIGKILL from down/kill ends it).
        script = (f"hostname {host} && mount --bind {boot_id} /proc/sys/kernel/random/boot_id && "
                  f"mount --bind {self._run_dir / 'hosts'} /etc/hosts && mount -t tmpfs tmpfs /dev/shm && "
                  f"mount --bind /tmp {outer_tmp} && mount -t tmpfs tmpfs /tmp{keep} && "
                  f"cp {state} {INSIDE_STATE} && echo $$ > {ready}.tmp && "
                  f"mv {ready}.tmp {ready} && exec sleep infinity")
        subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "--ipc", "--mount", "--propagation",
                          "private", "--fork", "--kill-child", "sh", "-c", script],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)  # outlives `ddl-testbed up`; not in the caller's Ctrl-C group
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not ready.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"ddl-testbed: host {host} did not start within {_READY_TIMEOUT_S:g} s")
            time.sleep(0.02)
        # The pid the holder wrote before it exec'd sleep: the same process, whatever it is running
        # by now (looking for a "sleep" in the namespace raced with that exec on a busy machine).
        self.holders[host] = int(ready.read_text())
        self._save()

    def down(self) -> None:
        """Kill every host's processes, remove the namespaces (their veths go with them) and the
        state. Safe to call twice, and on a half-built testbed."""
        for ns in self._namespaces():
            _kill_netns(ns)
        for ns in self._namespaces():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self._run_dir, ignore_errors=True)
        (STATE_DIR / f"{self.name}.json").unlink(missing_ok=True)
        self.holders.clear()
        self._up = False

    def __enter__(self) -> "Testbed":
        # SIGTERM (a timeout, a job scheduler) must tear down too: turn it into SystemExit, which
        # unwinds through __exit__, when this thread may and nobody else handles it.
        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self.up()

    def __exit__(self, *exc) -> None:
        try:
            self.down()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)

    # -- using the hosts ----------------------------------------------------------------------
    def command(self, host: str, argv: list[str], cwd: str | None = None) -> list[str]:
        """``argv`` as a command line that runs inside ``host`` (in ``cwd``, default the caller's)."""
        pid = self._holder(host)
        return ["nsenter", "-t", str(pid), "-n", "-u", "-i", "-m", f"--wd={cwd or os.getcwd()}", "--", *argv]

    def run(self, host: str, argv: list[str], *, cwd: str | None = None, timeout: float = 120,
            **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion (text output captured unless told otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.command(host, argv, cwd), timeout=timeout, **kwargs)

    def popen(self, host: str, argv: list[str], *, cwd: str | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``host``; the caller waits for it."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self.command(host, argv, cwd), **kwargs)

    def cut(self, host: str, direction: str = "both") -> None:
        """Stop ``host``'s link from carrying anything: ``both`` ways (the switch port goes down, as a
        cut cable; the host's own eth0 stays up and configured), or one way only: ``up`` drops what
        the host sends, ``down`` what is sent to it (a queue that holds nothing, pfifo limit 0, on
        that direction's egress). ``mend`` undoes any of them."""
        if direction == "both":
            _ip("link", "set", f"{self.name}{host}p", "down", netns=self._ns("sw"))
        elif direction in ("up", "down"):
            where, dev = self._egress(host, direction)
            subprocess.run(["tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "0"],
                           check=True, capture_output=True)
        else:
            raise ValueError(f"ddl-testbed: direction must be both, up or down, got {direction!r}")

    def mend(self, host: str) -> None:
        """Bring ``host``'s link back after any ``cut``, shaped as it was."""
        self._holder(host)
        _ip("link", "set", f"{self.name}{host}p", "up", netns=self._ns("sw"))
        self.shape(host, self.rate)

    def shape(self, host: str, rate: str) -> None:
        """Shape both directions of ``host``'s link to ``rate`` ("" for none) from now on (a link that
        turns slow mid-run); ``mend`` returns it to the testbed's rate."""
        if rate:
            parse_rate(rate)
        for direction in ("up", "down"):
            where, dev = self._egress(host, direction)
            if rate:
                subprocess.run(["tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                                "burst", str(burst_bytes(rate)), "latency", "50ms"], check=True, capture_output=True)
            else:
                subprocess.run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"], capture_output=True)

    def kill(self, host: str) -> None:
        """End ``host`` as a power cut would: its link goes silent first (so its peers get no FIN or
        RST from the sockets of the processes dying), then SIGKILL to every process on it. The
        network namespace stays, cut, as a dead host's cable does."""
        self._holder(host)
        self.cut(host)
        _kill_netns(self._ns(host))
        del self.holders[host]
        self._save()

    def _egress(self, host: str, direction: str) -> tuple[str, str]:
        """(namespace, device) whose egress carries ``direction`` of ``host``'s link."""
        return (self._ns(host), "eth0") if direction == "up" else (self._ns("sw"), f"{self.name}{host}p")

    # -- state ---------------------------------------------------------------------------------
    def _ns(self, host: str) -> str:
        return f"{self.name}-{host}"

    def _namespaces(self) -> list[str]:
        return [self._ns(h) for h in self.hosts] + [self._ns("sw")]

    def _holder(self, host: str) -> int:
        if host not in self.holders:
            raise ValueError(f"ddl-testbed {self.name}: no running host {host!r}; hosts: {', '.join(self.holders)}")
        return self.holders[host]

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"name": self.name, "hosts": self.hosts, "rate": self.rate, "address": self.address,
                 "holders": self.holders, "owner": self._owner}
        tmp = STATE_DIR / f"{self.name}.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(STATE_DIR / f"{self.name}.json")

    @classmethod
    def attach(cls, name: str) -> "Testbed":
        """The live testbed ``name`` (made by ``up`` in another process, e.g. the CLI)."""
        path = STATE_DIR / f"{name}.json"
        if not path.exists():
            raise ValueError(f"ddl-testbed: no testbed named {name!r} is up" + _listing())
        state = json.loads(path.read_text())
        bed = cls(len(state["hosts"]), state["rate"], name=state["name"])
        bed.holders = {h: int(p) for h, p in state["holders"].items()}
        bed._owner = state["owner"]
        bed._up = True
        return bed


def _shared_under_tmp(extra: tuple[str, ...]) -> tuple[str, ...]:
    """The top folders under /tmp of this process's interpreter, ddl_triton's source, the working
    directory and ``extra``: what a host must still see through its private /tmp."""
    import sys
    package_root = Path(__file__).resolve().parents[2]
    tops = set()
    for path in (sys.prefix, str(package_root), os.getcwd(), *extra):
        parts = Path(os.path.realpath(path)).parts
        if len(parts) >= 3 and parts[1] == "tmp":
            tops.add(os.path.join("/tmp", parts[2]))
    return tuple(sorted(tops))


def reap() -> list[str]:
    """Take down every testbed whose owning process is gone (a test run killed before its
    clean-up); returns their names. Persistent ones (``ddl-testbed up``) stay."""
    reaped = []
    for name in live_names():
        bed = Testbed.attach(name)
        if bed._owner is not None and not Path(f"/proc/{bed._owner}").exists():
            bed.down()
            reaped.append(name)
    return reaped


def live_names() -> list[str]:
    return sorted(p.stem for p in STATE_DIR.glob("*.json")) if STATE_DIR.exists() else []


def _listing() -> str:
    names = live_names()
    return f"; up: {', '.join(names)}" if names else "; none is up"


def _pids_in_netns(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _exit_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def _kill_netns(netns: str) -> None:
    """SIGKILL every process in ``netns``, again while any remain (one may fork as it dies); bounded."""
    for _ in range(50):
        pids = _pids_in_netns(netns)
        if not pids:
            return
        for pid in pids:
            _kill(pid)
        time.sleep(0.02)
    raise RuntimeError(f"ddl-testbed: processes in {netns} survive SIGKILL: {_pids_in_netns(netns)}")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
