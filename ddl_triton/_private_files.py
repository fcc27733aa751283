"""Files and folders that other local users cannot read, replace or redirect.

Semantics: every file the project writes where another user of the host could interfere (under
``/tmp``, a shared cache folder, a folder named by a variable) goes through here.

``private_folder(path, what=...)`` returns a folder that is a real directory (not a symbolic
link), owned by this user and writable by nobody else, with mode 0700:

- missing: it is created (parents 0700 too, when missing) and set to 0700 whatever the umask;
- present, owned by this user, not a link, not group- or other-writable: it is used, and set
  to 0700 (a folder an earlier version made 0755 was never writable by anyone else, so nothing
  in it was planted; narrowing it keeps what is written from now on unreadable to others);
- anything else (a symbolic link, not a directory, another user's, group- or other-writable):
  it is refused, never followed or changed, and a fresh ``tempfile.mkdtemp`` folder is used
  instead. One line on stderr names ``what``, the refused path, why, and the folder used; the
  same fallback is returned for that path for the rest of the process, while it stays private.

``chosen_folder(path)`` is for a folder the user named (``DDL_DUMP_DIR``, ``DDL_TRACE``, ``ddl-tune
--out``): created like a private folder when missing, else used as it is, a link the user made
included; the files in it are still created as below, so no link planted at a file's path is
followed.

``create_private_file(path)`` creates a new file with mode 0600 (whatever the umask) and opens it
for writing: ``O_CREAT | O_EXCL | O_NOFOLLOW``, so an existing file, or a link planted at the path,
is never opened (``FileExistsError``, or ``OSError(ELOOP)`` for a link on some systems).

``write_private_file(path, data)`` replaces the file at ``path`` with ``data``, atomically: the data
goes to a new 0600 file of a fresh name beside it (``create_private_file``) that is then renamed
onto ``path``. A rename replaces the directory entry, a link planted there included, and never
writes through it. Used for every file the project writes: dumps that are rewritten (the flight
recorder's, the tracer's), tuning tables, merged timelines; ``save_figure`` for plots.

Standard library only: launch, observability and the testbed use it without torch or MPI.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import tempfile
import threading

_FOLDER_MODE = 0o700
_FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)

_fallbacks: dict[str, str] = {}  # refused path -> the mkdtemp folder used instead (see private_folder)
_lock = threading.RLock()  # a signal handler's dump may interrupt one on the same thread


def private_folder(path: str, *, what: str) -> str:
    """``path`` if it is (or could be made) a private folder, else a fresh private folder in its
    place, named on stderr (see the module doc). ``what`` says what the folder is for, in that
    message ("flight-recorder dumps")."""
    path = os.path.abspath(path)
    with _lock:
        why = _make_private(path)
        if why is None:
            return path
        fallback = _fallbacks.get(path)
        if fallback is not None and _refusal(fallback) is None:
            return fallback
        fallback = tempfile.mkdtemp(prefix=f"ddl_triton-{_slug(what)}-")  # 0700, ours, a new name
        _fallbacks[path] = fallback
    print(f"ddl_triton: {what}: not using {path}: {why}; using {fallback} instead", file=sys.stderr, flush=True)
    return fallback


def chosen_folder(path: str) -> str:
    """``path``, created with mode 0700 (and missing parents likewise) if missing, else as it is:
    the user named it (see the module doc). Raises ``OSError`` if it cannot be created."""
    try:
        _mkdir_private(os.path.abspath(path))
    except FileExistsError:
        pass
    return path


def create_private_file(path: str, mode: str = "w"):
    """A new file at ``path``, mode 0600, opened for writing with ``mode`` ("w" or "wb"); raises
    ``FileExistsError`` if anything (a file, a link) is already there. See the module doc."""
    if mode not in ("w", "wb"):
        raise ValueError(f"create_private_file: mode must be 'w' or 'wb', not {mode!r}")
    fd = os.open(path, _FILE_FLAGS, _FILE_MODE)
    try:
        os.fchmod(fd, _FILE_MODE)  # the umask may have narrowed it; never wider than 0600
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def write_private_file(path: str, data: str | bytes) -> None:
    """Replace the file at ``path`` with ``data`` atomically, through a new 0600 file beside it
    (see the module doc). Raises ``OSError`` if it cannot; leaves no temporary file behind."""
    folder, name = os.path.split(os.path.abspath(path))
    for _ in range(100):  # a name taken (a leftover, or planted) is skipped, not opened
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
        try:
            f = create_private_file(tmp, "wb" if isinstance(data, bytes) else "w")
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name", os.path.join(folder, f".{name}.*.tmp"))
    try:
        with f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_figure(fig, path: str, *, dpi: int) -> None:
    """A matplotlib figure saved to ``path`` (format from its suffix, else PNG) as
    ``write_private_file`` writes: matplotlib's own ``savefig(path)`` opens the path following links."""
    import io
    buffer = io.BytesIO()
    fig.savefig(buffer, format=os.path.splitext(path)[1][1:].lower() or "png", dpi=dpi)
    write_private_file(path, buffer.getvalue())


def _make_private(path: str) -> str | None:
    """Create ``path`` as a private folder, or check and narrow the folder there; ``None`` when it
    is usable, else why not."""
    try:
        _mkdir_private(path)
    except FileExistsError:
        pass
    except OSError as e:
        return f"cannot be created ({e.strerror})"
    # Checked and narrowed through a descriptor opened without following a link: what is checked
    # is what gets the chmod, even if the entry is replaced meanwhile.
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        return _refusal(path) or f"cannot be opened ({e.strerror})"
    try:
        why = _unsafe(os.fstat(fd))
        if why is None:
            os.fchmod(fd, _FOLDER_MODE)
        return why
    except OSError as e:
        return f"cannot be checked ({e.strerror})"
    finally:
        os.close(fd)


def _mkdir_private(path: str) -> None:
    """``mkdir`` with mode 0700 whatever the umask, and missing parents likewise (an existing
    parent is left as it is); ``FileExistsError`` if ``path`` exists."""
    try:
        os.mkdir(path, _FOLDER_MODE)
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if parent == path:
            raise
        try:
            _mkdir_private(parent)
        except FileExistsError:
            pass
        os.mkdir(path, _FOLDER_MODE)
    # The umask may have narrowed 0700 (never widened it); the leaf is set again, after its check,
    # in _make_private. Through a descriptor that does not follow a link, as there.
    fd = os.open(path, _DIR_FLAGS)
    try:
        os.fchmod(fd, _FOLDER_MODE)
    finally:
        os.close(fd)


def _refusal(path: str) -> str | None:
    """Why the entry at ``path`` (not followed) is not a private folder; ``None`` if it is one."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    return _unsafe(st) or (None if stat.S_IMODE(st.st_mode) & 0o077 == 0 else "it is readable by others")


def _unsafe(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _slug(what: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in what.lower()).split())[:40] or "files"

