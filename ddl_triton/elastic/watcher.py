"""The elastic watcher thread (ddl_triton/elastic/membership.py): it blocks on this process's own
notice of the current generation, ``g<G>/tell/<id>``, and revokes the process's waits
(transports/failure_notice.py) and says the process is here for the next generation as soon as a
revoker writes it.

Semantics. The wait is on a store connection of the watcher's own (torch's TCPStore client serves
one call at a time). It is re-armed once an hour (or per deadline, if longer): while nothing fails a
process sends the store two messages (the wait and its cancel) that often, whatever the world's
size. Nothing needs the wait to end sooner: when ``current`` changes, or at ``close``, the process
writes its own notice itself (``compare_set``, so a revocation written there first stays) to wake
the watcher, and a store that goes away breaks the wait's connection at once. One notice is acted
on once.
"""
from __future__ import annotations

import atexit
import json
import threading
from datetime import timedelta

from ..errors import CoordinatorLost
from ..transports import failure_notice
from .store_calls import _BREAKS_CLIENT, _PREFIX

_POLL_S = 0.05            # how often the watcher looks at this process's own revocation, while it waits for it to clear
_WATCH_FLOOR_S = 3600.0   # the watcher re-arms its wait at least this long: a wait that times out
                          # costs two messages and prints two lines of torch's warnings on stderr
                          # (every 60 s, as first written, that was 120 lines an hour in every job)
_MOVED, _CLOSING = "moved", "closing"  # what a process writes on its own notice to wake its watcher


class RevocationWatch:
    """The watcher part of ``Membership`` (a mixin: it uses its ``store``, ``current``, ``_call``,
    ``say_here`` and the state ``Membership.__init__`` makes)."""

    def watch(self) -> None:
        """Start the watcher thread: it revokes this process's waits as soon as the store says the
        current generation failed, and says this process is here for the next one."""
        if self._watcher is not None:
            return
        # The agreement's own connection (``_wait``), made now: made at a failure, every survivor's at
        # once, they overflowed the store's listen queue (32 processes: 5 s of SYN retries).
        try:
            self._blocking_client()
        except CoordinatorLost:
            pass  # said by the next store call of the rank's own (the client broke: ``_broken``)
        self._watcher = threading.Thread(target=self._watch, name="ddl_triton-elastic-watch", daemon=True)
        self._watcher.start()
        # Stopped before the interpreter finalizes: a daemon thread that comes back from a store call
        # (C++, the GIL released) while the interpreter is finalizing is unwound by the runtime, and
        # the unwinding through the store's C++ frames aborts the process ("terminate called without
        # an active exception"): seen once in three runs, as a job that did nothing wrong exited.
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the watcher thread: it is woken from its wait (this process writes its own notice)."""
        self._stop.set()
        self._wake_watcher(_CLOSING, bound=1.0)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=1.0)

    def _wake_watcher(self, why: str, bound: float | None = None) -> None:
        """Wake the watcher from its wait on this process's notice (``current`` changed, or closing):
        ``compare_set``, so a revocation written there first is never overwritten."""
        self._moved.set()
        with self._lock:
            key = self._watching
        if not key or self._broken:
            return
        try:
            self._call(lambda: self.store.compare_set(key, "", why), "waking the watcher", bound)
        except CoordinatorLost:
            pass  # the store is gone: the watcher's wait fails too, and the next call here says so

    def _watch(self) -> None:
        """Block on this process's notice for the current generation; act once per generation."""
        if self._broken:
            return
        try:
            client = self.store.clone() if hasattr(self.store, "clone") else self.store
        except RuntimeError as e:  # a store that cannot be reached: the main thread's next store call says so
            self._broken = self._broken or str(e).splitlines()[0][:200]
            return
        rearm = timedelta(seconds=max(self.timeout, _WATCH_FLOOR_S))
        handled = None  # the generation whose end this watcher has seen
        while not self._stop.is_set():
            self._moved.clear()
            current = self.current
            if current is None or current is handled:
                self._moved.wait(rearm.total_seconds())
                continue
            key = notice_key(current.generation, self.member)
            with self._lock:  # published before ``current`` is read again: a change is never missed
                if self._stop.is_set():
                    return
                self._watching = key
            try:
                if self.current is not current:
                    continue
                client.wait([key], rearm)
                raw = client.get(key)
            except RuntimeError as e:
                if type(e).__name__ == _BREAKS_CLIENT:  # for good: each call would print torch's C++ frames
                    self._broken = self._broken or str(e).splitlines()[0][:200]
                    return
                if not str(e).startswith("wait timeout"):
                    self._stop.wait(_POLL_S)  # the store is gone: the main thread's next store call says so
                continue
            finally:
                with self._lock:
                    self._watching = ""
            handled = current
            if raw in (_MOVED.encode(), _CLOSING.encode()):
                continue
            if self.current is not current:
                continue
            why = f"generation {current.generation} revoked: {_reason(raw)}"
            if failure_notice.revoked() is None:
                failure_notice.revoke(why)  # first: the waits give up at once
                self.say_here()
                continue
            self.say_here()  # alive, whatever revoked this process's waits already
            # This process's revocation of the generation before is cleared as this one is built (world.py):
            # wait for that (locally), so that this revocation is not cleared with it.
            while self.current is current and failure_notice.revoked() is not None and not self._stop.is_set():
                self._stop.wait(_POLL_S)
            if self.current is current and not self._stop.is_set():
                failure_notice.revoke(why)


def notice_key(generation: int, member: int) -> str:
    """The key that tells ``member`` that ``generation`` ended: its watcher blocks on it."""
    return f"{_PREFIX}/g{generation}/tell/{member}"


def _reason(raw: bytes) -> str:
    try:
        member, reason = json.loads(raw.decode())
        return f"member {int(member)}: {str(reason)[:300]}"
    except (UnicodeDecodeError, ValueError, TypeError):
        return "(unreadable reason)"
