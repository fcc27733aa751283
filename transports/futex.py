"""Sleep until a shared-memory word changes: Linux futexes through ctypes.

Semantics: ``wait(address, expected, timeout)`` returns when the 32-bit word at ``address``
(in memory mapped by several processes) no longer holds ``expected``, when another process
calls ``wake(address)``, after ``timeout`` seconds, or spuriously; the caller re-checks its
condition in every case. ``wake(address)`` wakes every process sleeping on the word.

Why: a communicator thread waiting for a peer that is still computing should neither burn the
core (spinning, yielding) nor wake up late (napping on a timer). A futex sleeps in the kernel
and is woken by the peer's ``publish``, at the cost of one system call on each side and only
when someone sleeps. Where futexes are unavailable (not Linux, or no libc), ``AVAILABLE`` is
False and callers nap on a timer instead.
"""
from __future__ import annotations

import ctypes
import platform
import sys

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221}.get(platform.machine())
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc():
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
AVAILABLE = _LIBC is not None


def wait(address: int, expected: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``address`` holds ``expected`` (at most ``timeout`` s).
    ctypes releases the GIL for the call, so other threads run meanwhile."""
    ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected & 0xFFFFFFFF),
                  ctypes.byref(ts), None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address``."""
    _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
