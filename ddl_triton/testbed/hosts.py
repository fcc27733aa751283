"""Hosts built from Linux namespaces on one machine: real sockets between them, nothing else shared.

A :class:`Testbed` of N hosts is, for each host ``h<i>``:

- a network namespace with one interface, ``eth0``, at ``10.77.0.<i>/24``, joined to the other hosts
  through a bridge that lives in a switch namespace of its own (the root namespace is left alone);
- a holder process (holder.py) in new UTS, IPC, mount and PID namespaces: its own hostname
  (``h<i>``), its own PID space and ``/proc`` (the holder is the host's init, pid 1), its own
  ``/dev/shm`` and ``/tmp`` (private tmpfs), its own boot id and an ``/etc/hosts`` naming every host.
  A pid means nothing outside its host, as on real hosts: ``process`` turns a host's pid into the
  machine's. Every process of the host is in its network namespace, which is how ``kill`` finds
  them all; SIGKILL to the holder alone would end them too (the end of a PID namespace's init).
  The folders under /tmp that hold this process's interpreter, package and working directory (a
  clone in /tmp, say) stay visible on every host, as a cluster's shared file system would be;
- ``tbf`` shaping both directions of its link to ``rate`` (the host's egress and the switch port
  toward it, so two senders into one host are limited too).

Commands enter a host with ``nsenter`` into the holder's namespaces, given as its namespace files
(``run``, ``popen``; a signal sent to the process ``popen`` returns reaches the command inside).
The kernel lets no process enter a sibling PID namespace, so from inside a host the ssh stand-in
(ssh.py) asks the testbed's relay (relay.py, in the machine's namespaces, one per testbed, started
by ``up``) to run a command in another host, as ssh asks a remote sshd. ``cut``
takes a host's link down, both ways or one way, and ``mend`` brings it back; ``shape`` changes its
rate mid-run; ``kill`` ends the host (its link goes silent, then SIGKILL to every process in it, as
a power cut would). ``down`` removes what this testbed made, and nothing else: each namespace is
recorded in the state file (state.py) as it is made, so a failed ``up`` removes exactly what it
had made, and a namespace of the same name that existed before is left alone. The context manager
calls ``down`` on any exit, Ctrl-C included. Every name carries a per-run prefix checked by one
pattern (state.check_name), and every command is an argument list, never a shell string;
``reap`` removes testbeds whose owning process died without taking them down.

Example::

    with Testbed(hosts=2, rate="1gbit") as bed:
        bed.run("h1", ["hostname"]).stdout   # "h1\\n"
        bed.run("h2", ["ping", "-c1", "h1"])

Traffic stays inside the namespaces a testbed made, on the addresses it assigned on its own bridge.
Needs root, ``ip``, ``tc``, ``unshare`` and ``nsenter``; :func:`check_available` says what is missing.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from . import processes as _processes, state as _state
from .processes import HostProcess, kill_netns, nsenter_argv, start_time
from .state import STATE_DIR, check_name, live_names

HOLDER = str(Path(__file__).with_name("holder.py"))  # run as a file: the holder imports no package
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
        if not 1 <= hosts <= _state.MAX_HOSTS:
            raise ValueError(f"ddl-testbed: hosts must be 1..{_state.MAX_HOSTS}, got {hosts}")
        if rate:
            parse_rate(rate)
        self.name = check_name(name or f"dt{secrets.token_hex(2)}", "testbed")
        self.hosts = [f"h{i}" for i in range(1, hosts + 1)]
        self.rate = rate
        self.address = {h: f"{SUBNET}.{i}" for i, h in enumerate(self.hosts, 1)}
        self.holders: dict[str, int] = {}   # host -> pid (the machine's) of the process holding its namespaces
        self._started: dict[str, int] = {}  # host -> the holder's start time (/proc/<pid>/stat field 22)
        self._made: list[str] = []          # the namespaces this testbed made, in order: all down() removes
        self._made_run_dir = False
        self._relay: list[int] | None = None  # [pid, start time] of the testbed's ssh daemon (relay.py)
        self._run_dir = STATE_DIR / self.name
        # persistent: made by `ddl-testbed up`, which exits at once; else owned by this process,
        # and `reap` may remove it once this process is gone.
        self._owner = None if persistent else os.getpid()
        self.shared = _shared_under_tmp(shared)
        self._up = False

    # -- life cycle -------------------------------------------------------------------------
    def up(self) -> "Testbed":
        """Build the switch, the hosts and their links; on any failure, remove what was built
        (only that: see ``down``)."""
        check_available()
        _state.state_folder()
        if _state.read_state(self.name) is not None or self._run_dir.exists():
            raise RuntimeError(f"ddl-testbed: a testbed named {self.name!r} is already up")
        try:
            self._run_dir.mkdir(mode=0o700)
        except FileExistsError:
            raise RuntimeError(f"ddl-testbed: a testbed named {self.name!r} is already up") from None
        self._made_run_dir = self._up = True
        try:
            self._save()  # first, so that `down`/`reap` find even a half-built testbed
            switch = self._ns("sw")
            self._add_netns(switch)
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
            self._start_relay()
        except BaseException:
            self.down()
            raise
        return self

    def _add_netns(self, ns: str) -> None:
        """``ip netns add``, recorded (and saved) the moment it exists: ``down`` removes only these."""
        _ip("netns", "add", ns)
        self._made.append(ns)
        self._save()

    def _add_host(self, host: str) -> None:
        ns, switch = self._ns(host), self._ns("sw")
        inner, port = f"{self.name}{host}i", f"{self.name}{host}p"
        self._add_netns(ns)
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
        (self._run_dir / f"{host}.boot_id").write_text(str(uuid.uuid4()) + "\n")
        (self._run_dir / f"{host}.outer_tmp").mkdir()
        ready, log = self._run_dir / f"{host}.ready", self._run_dir / f"{host}.log"
        argv = ["ip", "netns", "exec", ns, "unshare", "--uts", "--ipc", "--mount", "--pid", "--fork",
                "--propagation", "private", "--kill-child", sys.executable, "-I", HOLDER, "--testbed", self.name,
                "--host", host, "--run-dir", str(self._run_dir), "--inside-state", INSIDE_STATE]
        argv += [word for folder in self.shared for word in ("--shared", folder)]
        with open(log, "w") as err:
            holder = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                      start_new_session=True)  # outlives `ddl-testbed up`; not in the caller's Ctrl-C group
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not ready.exists():
            if holder.poll() is not None or time.monotonic() > deadline:
                why = log.read_text().strip() or f"it did not start within {_READY_TIMEOUT_S:g} s"
                raise RuntimeError(f"ddl-testbed: host {host}: {why}")
            time.sleep(0.02)
        # The holder as the machine numbers it: the init of a PID namespace in this host's network
        # namespace (just made: there is no other), pinned by its start time from now on.
        pid = _processes.init_in_netns(f"/run/netns/{ns}")
        if pid is None:
            raise RuntimeError(f"ddl-testbed: host {host}: its holder is not in namespace {ns}")
        self.holders[host], self._started[host] = pid, int(start_time("/proc", pid))
        self._save()

    def _start_relay(self) -> None:
        """Start the testbed's ssh daemon (relay.py) in the machine's namespaces, and record it."""
        argv = [sys.executable, "-m", "ddl_triton.testbed.relay", "--testbed", self.name, "--run-dir",
                str(self._run_dir)]
        argv += [w for h in self.hosts for w in ("--holder", f"{h}:{self.holders[h]}:{self._started[h]}")]
        log = self._run_dir / "relay.log"
        with open(log, "w") as err:
            relay = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                     cwd="/", start_new_session=True)
        self._relay = [relay.pid, int(start_time("/proc", relay.pid) or 0)]
        self._save()  # before it is ready, so that `down` ends it whatever happens next
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not (self._run_dir / "ssh.sock").exists():
            if relay.poll() is not None or time.monotonic() > deadline:
                why = log.read_text().strip()[-2000:] or f"it did not start within {_READY_TIMEOUT_S:g} s"
                raise RuntimeError(f"ddl-testbed: the ssh relay: {why}")
            time.sleep(0.02)

    def down(self) -> None:
        """Kill every process of the hosts this testbed made, remove the namespaces it made (their
        veths go with them) and its state; nothing else (a namespace of the same name that it did
        not make stays). Safe to call twice, and on a half-built testbed."""
        if self._relay and start_time("/proc", self._relay[0]) == str(self._relay[1]):
            _processes.kill_pinned(self._relay[0])
        self._relay = None
        for ns in self._made:
            kill_netns(ns)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self._made_run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            _state.state_path(self.name).unlink(missing_ok=True)
        self._made.clear()
        self._made_run_dir = False
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
        """``argv`` as a command line that runs inside ``host`` (in ``cwd``, default the caller's):
        ``nsenter`` into the holder's namespaces, PID namespace included (nsenter then forks: the
        command is the child of the ``nsenter`` process, which exits with its status). Only from
        the machine's PID namespace: the kernel lets no host enter another's (ssh.py, relay.py)."""
        return nsenter_argv("/proc", self._holder(host), cwd or os.getcwd(), argv)

    def run(self, host: str, argv: list[str], *, cwd: str | None = None, timeout: float | None = 120,
            **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion (text output captured unless told otherwise);
        past ``timeout`` the command is killed (inside the host) and TimeoutExpired raised."""
        if kwargs.pop("capture_output", True):
            kwargs.setdefault("stdout", subprocess.PIPE)
            kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        with self.popen(host, argv, cwd=cwd, **kwargs) as process:
            try:
                out, err = process.communicate(timeout=timeout)
            except BaseException:
                process.kill()
                process.wait()
                raise
            return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def popen(self, host: str, argv: list[str], *, cwd: str | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``host``; the caller waits for it. ``send_signal`` (``terminate``,
        ``kill``) on the result reaches the command itself, not only the nsenter above it."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return HostProcess(self.command(host, argv, cwd), **kwargs)

    def process(self, host: str, pid: int) -> int | None:
        """The machine's pid of the process that ``host`` numbers ``pid`` (what ``os.getpid()``
        says inside the host), or None when the host has no such process."""
        return _processes.in_pid_namespace(self._holder(host), pid)

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
        kill_netns(self._ns(host))
        del self.holders[host], self._started[host]
        self._save()

    def _egress(self, host: str, direction: str) -> tuple[str, str]:
        """(namespace, device) whose egress carries ``direction`` of ``host``'s link."""
        return (self._ns(host), "eth0") if direction == "up" else (self._ns("sw"), f"{self.name}{host}p")

    # -- state ---------------------------------------------------------------------------------
    def _ns(self, host: str) -> str:
        return f"{self.name}-{host}"

    def _holder(self, host: str) -> int:
        """The holder's pid, once it is checked to still be that holder (its start time)."""
        if host not in self.holders:
            raise ValueError(f"ddl-testbed {self.name}: no running host {host!r}; hosts: {', '.join(self.holders)}")
        pid = self.holders[host]
        if start_time("/proc", pid) != str(self._started.get(host)):
            raise RuntimeError(f"ddl-testbed {self.name}: host {host}'s holder (pid {pid}) is gone")
        return pid

    def _save(self) -> None:
        _state.write_state({"name": self.name, "hosts": self.hosts, "rate": self.rate, "address": self.address,
                            "holders": self.holders, "started": self._started, "made": self._made,
                            "run_dir": self._made_run_dir, "owner": self._owner, "relay": self._relay})

    @classmethod
    def attach(cls, name: str) -> "Testbed":
        """The live testbed ``name`` (made by ``up`` in another process, e.g. the CLI)."""
        state = _state.read_state(check_name(name, "testbed"))
        if state is None:
            raise ValueError(f"ddl-testbed: no testbed named {name!r} is up" + _listing())
        bed = cls(len(state["hosts"]), state["rate"], name=state["name"])
        bed.holders, bed._started, bed._made = dict(state["holders"]), dict(state["started"]), list(state["made"])
        bed._made_run_dir, bed._owner, bed._relay, bed._up = state["run_dir"], state["owner"], state["relay"], True
        return bed


def _shared_under_tmp(extra: tuple[str, ...]) -> tuple[str, ...]:
    """The top folders under /tmp of this process's interpreter, ddl_triton's source, the working
    directory and ``extra``: what a host must still see through its private /tmp. They reach the
    holder as arguments, never through a shell, so any character in them is only a character."""
    package_root = Path(__file__).resolve().parents[2]
    tops = set()
    for path in (sys.prefix, str(package_root), os.getcwd(), *extra):
        parts = Path(os.path.realpath(path)).parts
        if len(parts) >= 3 and parts[1] == "tmp":
            tops.add(os.path.join("/tmp", parts[2]))
    return tuple(sorted(tops))


def reap() -> list[str]:
    """Take down every testbed whose owning process is gone (a test run killed before its
    clean-up); returns their names. Persistent ones (``ddl-testbed up``) stay, and so does one
    whose state file does not pass state.read_state's checks."""
    reaped = []
    for name in live_names():
        try:
            bed = Testbed.attach(name)
        except ValueError:
            continue  # a state this testbed cannot vouch for (another version's): nothing of it is removed
        if bed._owner is not None and not Path(f"/proc/{bed._owner}").exists():
            bed.down()
            reaped.append(name)
    return reaped


def _listing() -> str:
    names = live_names()
    return f"; up: {', '.join(names)}" if names else "; none is up"


def _exit_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)
