"""Where the testbed keeps what it knows about the testbeds that are up, and the one rule for names.

Semantics:
- ``check_name(name, what)``: the one pattern every name the testbed puts into a command must match
  (a testbed's name, which prefixes its namespaces and interfaces, and a host's): 1-6 lowercase
  letters and digits, starting with a letter. Anything else raises ValueError naming it, before
  anything runs. Commands are argument lists, never shell strings; the pattern is a second line.
- ``state_folder()``: ``STATE_DIR``, the testbed's own folder: created 0700 when missing; used only
  when it is a real directory (not a symbolic link), owned by root and writable by nobody else,
  and then set to 0700. Anything else is refused with an error naming why (no fallback folder, as
  ``ddl_triton._private_files.private_folder`` would give: other processes, the CLI and the ssh
  stand-in, find this one by its fixed name).
- ``state_path(name)``: the state file of testbed ``name``, always directly inside ``STATE_DIR``.
- ``write_state`` / ``read_state``: the state as JSON (never anything executable), written through
  ``_private_files.write_private_file`` (0600, atomic, never through a link), read without
  following a link, and checked field by field (``_checked``) so that a state file can only name
  this testbed's own hosts, namespaces and processes.
"""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from .._private_files import write_private_file

STATE_DIR = Path("/run/ddl_triton-testbed")  # one JSON file and one folder per live testbed
_NAME = re.compile(r"[a-z][a-z0-9]{0,5}")    # short: Linux interface names hold 15 characters
MAX_HOSTS = 16


def check_name(name: object, what: str) -> str:
    """``name`` if it matches the testbed's one name pattern, else ValueError naming it."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"ddl-testbed: {what} {name!r} is not a testbed name: 1-6 lowercase letters and digits, "
                         "starting with a letter")
    return name


def state_folder() -> Path:
    """``STATE_DIR``, created 0700 if missing, checked otherwise (see the module doc)."""
    try:
        os.mkdir(STATE_DIR, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(STATE_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise RuntimeError(f"ddl-testbed: refusing {STATE_DIR}: {e.strerror} (a symbolic link, or not a folder?)") \
            from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise RuntimeError(f"ddl-testbed: refusing {STATE_DIR}: not a folder")
        if st.st_uid != os.geteuid():
            raise RuntimeError(f"ddl-testbed: refusing {STATE_DIR}: owned by uid {st.st_uid}, not {os.geteuid()}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise RuntimeError(f"ddl-testbed: refusing {STATE_DIR}: writable by others "
                               f"(mode {stat.S_IMODE(st.st_mode):o})")
        os.fchmod(fd, 0o700)  # an earlier version made it 0755; nobody else could write into it
    finally:
        os.close(fd)
    return STATE_DIR


def state_path(name: str) -> Path:
    return STATE_DIR / f"{check_name(name, 'testbed')}.json"


def write_state(state: dict) -> None:
    write_private_file(str(state_path(state["name"])), json.dumps(state))


def read_state(name: str) -> dict | None:
    """The checked state of testbed ``name``; None when it is not up. ValueError if the file is not
    a state this testbed could have written."""
    path = state_path(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"ddl-testbed: cannot read {path}: {e.strerror}") from None
    with os.fdopen(fd) as f:
        text = f.read(1 << 20)
    try:
        return _checked(name, json.loads(text))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"ddl-testbed: {path} is not a testbed's state: {e}") from None


def live_names() -> list[str]:
    if not STATE_DIR.is_dir():
        return []
    return sorted(p.stem for p in STATE_DIR.glob("*.json") if _NAME.fullmatch(p.stem))


def _checked(name: str, state: dict) -> dict:
    """``state`` if every field is what ``Testbed._save`` writes for testbed ``name``; else raises."""
    if state["name"] != name:
        raise ValueError(f"it names testbed {state['name']!r}")
    hosts = state["hosts"]
    if not 1 <= len(hosts) <= MAX_HOSTS or hosts != [f"h{i}" for i in range(1, len(hosts) + 1)]:
        raise ValueError(f"hosts {hosts!r}")
    if not isinstance(state["rate"], str):
        raise ValueError(f"rate {state['rate']!r}")
    for field in ("holders", "started"):
        table = state[field]
        if not isinstance(table, dict) or not set(table) <= set(hosts) or \
                not all(isinstance(v, int) and v > 0 for v in table.values()):
            raise ValueError(f"{field} {table!r}")
    ours = {f"{name}-{h}" for h in [*hosts, "sw"]}
    if not isinstance(state["made"], list) or not set(state["made"]) <= ours:
        raise ValueError(f"namespaces {state['made']!r} (this testbed's are {sorted(ours)})")
    relay = state["relay"]
    if relay is not None and not (isinstance(relay, list) and len(relay) == 2
                                  and all(isinstance(v, int) and v >= 0 for v in relay)):
        raise ValueError(f"relay {relay!r}")
    if not isinstance(state["run_dir"], bool) or not (state["owner"] is None or isinstance(state["owner"], int)):
        raise ValueError("run_dir or owner")
    return state
