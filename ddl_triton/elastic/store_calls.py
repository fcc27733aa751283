"""The elastic membership's store calls (ddl_triton/elastic/membership.py): each bounded by the
job's deadline, a store that cannot be reached raised as ``CoordinatorLost``, and blocking waits on
a connection of their own.

Semantics. ``_call`` runs one store call, bounded (``bound``, else the deadline); ``_wait`` blocks
until a key exists or a given time, on a client of its own made once (``clone()``), so that the
watcher and the grace's timer can use the store meanwhile.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

from ..errors import CoordinatorLost

# After one, torch's TCPStore client fails every call (it never reconnects), each printing ~15 lines of
# C++ frames: no store call is tried again (``_call``, ``_watch``).
_BREAKS_CLIENT = "DistNetworkError"
_PREFIX = "ddl_triton/elastic"  # the job's keys in its store


class StoreCalls:
    """The store part of ``Membership`` (a mixin: it uses its ``store``, ``member``, ``host``,
    ``timeout``, ``_broken`` and ``_blocking``)."""

    def _blocking_client(self):
        if self._blocking is None:
            self._blocking = self._call(lambda: self.store.clone() if hasattr(self.store, "clone") else self.store,
                                        "connecting to the store")
        return self._blocking

    def _wait(self, key: str, until: float) -> bool:
        """Block until ``key`` exists (True) or the monotonic time ``until`` (False), on a store
        connection of its own: torch's TCPStore client serves one call at a time, and the watcher and
        the grace's timer still call the store meanwhile."""
        client = self._blocking_client()

        def attempt(seconds: float) -> bool:
            try:
                client.wait([key], timedelta(seconds=seconds))
                return True
            except RuntimeError as e:
                if str(e).lower().startswith("wait timeout"):
                    return False
                raise
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return bool(self._call(lambda: client.check([key]), f"waiting for {key}"))
            # Bounded below the deadline that bounds the call itself; the loop waits the rest. At least
            # a millisecond: torch's stores count the wait in whole milliseconds, and 0 ms means "no
            # limit" to them (a wait begun 0.4 ms before ``until`` blocked until the deadline).
            seconds = max(min(left, self.timeout / 2), 0.001)
            if self._call(lambda: attempt(seconds), f"waiting for {key}"):
                return True

    def _set(self, key: str, value: str) -> None:
        self._call(lambda: self.store.set(key, value), f"writing {key}")

    def _call(self, call, what: str, bound: float | None = None):
        """A store call, bounded by the deadline; a store that went away or cannot be reached is the
        coordinator lost (once the client broke, _BREAKS_CLIENT, no call is tried again). Bounded on a
        thread of its own because torch's TCPStore client does not bound every call by its timeout: on
        a link cut both ways, ``check``, ``get`` and ``compare_set`` were seen still blocked 15 s past
        a 2 s timeout (only ``set`` returned). A call left behind stays blocked on its daemon thread;
        this process ends with the error."""
        if self._broken:
            raise self._lost(what, self._broken)
        box, done = {}, threading.Event()

        def run() -> None:
            try:
                box["value"] = call()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            done.set()

        threading.Thread(target=run, name="ddl_triton-elastic-store", daemon=True).start()
        if not done.wait(self.timeout if bound is None else bound):
            raise CoordinatorLost(
                f"member {self.member} on {self.host}: elastic job: the store did not answer within "
                f"{self.timeout if bound is None else bound:g} s ({what}): this host is cut off from the job's coordinator (the store's "
                "host: rank 0's process under env://, torchrun's agent on the first host), or it is gone; "
                "either way this rank cannot take part in the job any more, and ends")
        error = box.get("error")
        if isinstance(error, RuntimeError) and not isinstance(error, CoordinatorLost):
            reason = str(error).splitlines()[0][:200]  # the first line: torch's C++ frames stay out of it
            self._broken = self._broken or (reason if type(error).__name__ == _BREAKS_CLIENT else "")
            raise self._lost(what, reason) from None
        if error is not None:
            raise error
        return box.get("value")

    def _lost(self, what: str, reason: str) -> CoordinatorLost:
        return CoordinatorLost(f"member {self.member} on {self.host}: elastic job: lost the store ({what}: {reason}); "
                               "the store's host is the job's coordinator (rank 0's process under env://, torchrun's "
                               "agent on the first host): without it the world cannot be re-formed, so the job ends")
