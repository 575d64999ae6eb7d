"""One writer per key across hosts: a lease object instead of a kernel lock.

The lease object (JSON: owner, host, pid, its duration, a renewal count) is taken with a
conditional write: If-None-Match when there is none, If-Match on the ETag read when its holder
released it or it expired. Its holder renews it (If-Match on its own last ETag) from a thread every
third of its duration, and releases it by writing it as released (If-Match again): a lease is never
deleted, so no holder can undo another's write.

Expiry needs no agreement between clocks: a waiter times the lease with its own monotonic clock
from the moment it first sees a version (an ETag) of it; a version unchanged for its duration plus
a margin belongs to a holder that stopped renewing (killed, or its host gone), and is taken over.
A holder whose renewal finds the lease changed has lost it (it stalled past its duration and was
taken over), as has one that could not reach the store to renew it for a whole duration (a waiter
may have taken it over meanwhile): `lost` tells the work it guards to stop writing shared state,
and `lost_because` says which of the two happened. A renewal thread may notice that late (a
stalled process resumes its work before the thread runs), so a step only the holder may take
(pushing its work directory, publishing) first calls `confirm`, which renews at once: after a
confirmed renewal nobody can take the lease over for 1.25 durations.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator

from .errors import one_line
from .objects import ObjectRoot, json_object

MARGIN = 1.25  # a version must stay unchanged this many durations before it is taken over


class Lease:
    def __init__(self, root: ObjectRoot, rel: str, seconds: float):
        self.root, self.rel, self.seconds = root, rel, seconds
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.etag: str | None = None
        self.renewals = 0
        self.taken_over: dict | None = None  # the expired holder's lease, when this one was taken over
        self.lost = threading.Event()
        self.lost_because = ""  # set with `lost`: what happened, for the run's log
        self._stop = threading.Event()
        self._renewing = threading.Lock()  # one renewal at a time: the thread's or `confirm`'s
        self._thread: threading.Thread | None = None

    def _body(self, released: bool = False) -> bytes:
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "seconds": self.seconds, "renewals": self.renewals, "time": time.time(),
                           "released": released}, sort_keys=True).encode()

    def acquire(self, wait: bool = True, on_wait: Callable[[], None] | None = None) -> bool:
        """Take the lease, waiting for its holder to release it or to stop renewing it; with
        wait=False give up at once (False) when someone holds it."""
        seen: tuple[str, float] | None = None  # (ETag, when this waiter first saw it)
        waited = False
        while True:
            found = self.root.get_tagged(self.rel)
            if found is None:
                if self.root.put_new(self.rel, self._body()):
                    return self._held(self.root.get_tagged(self.rel))
                continue
            data, etag = found
            state = json_object(data)
            now = time.monotonic()
            if seen is None or seen[0] != etag:
                seen = (etag, now)
            expired = now - seen[1] >= MARGIN * float(state.get("seconds", self.seconds))
            if state.get("released") or expired:
                if self.root.replace(self.rel, self._body(), etag):
                    self.taken_over = None if state.get("released") else state
                    return self._held(self.root.get_tagged(self.rel))
                continue
            if not wait:
                return False
            if on_wait and not waited:
                on_wait()
            waited = True
            time.sleep(min(2.0, max(0.1, float(state.get("seconds", self.seconds)) / 10)))

    def _held(self, found: tuple[bytes, str] | None) -> bool:
        if found is None or json_object(found[0]).get("owner") != self.owner:
            self.etag = None
            return self.acquire()  # someone released and retook it between the two requests
        self.etag = found[1]
        self._thread = threading.Thread(target=self._renew_until_stopped, daemon=True, name=f"lease {self.rel}")
        self._thread.start()
        return True

    def _renew_until_stopped(self) -> None:
        last_success = time.monotonic()
        while not self._stop.wait(self.seconds / 3):
            try:
                if not self.confirm():
                    return
                last_success = time.monotonic()
            except Exception as error:  # an unreachable store: keep trying until the lease would have expired
                if time.monotonic() - last_success > self.seconds:
                    reason = getattr(error, "reason", "") or one_line(str(error)) or type(error).__name__
                    self._lose(f"the object store could not be reached for {self.seconds:g} s while renewing this"
                               f" run's lease ({reason}), so another run may have taken it over (if the store stays"
                               " unreachable, this run ends and a rerun resumes from its work directory)")
                    return

    def _lose(self, because: str) -> None:
        self.lost_because = because
        self.lost.set()

    def confirm(self) -> bool:
        """Renew the lease now; whether this run still holds it (False once another run took it over)."""
        with self._renewing:
            if self.lost.is_set():
                return False
            self.renewals += 1
            etag = self.root.replace(self.rel, self._body(), self.etag)
            if etag is None:
                etag = self._own_etag()  # our renewal may have landed without its answer reaching us
            if etag is None:
                self._lose("another run took over this run's lease (this one stalled)")
                return False
            self.etag = etag
            return True

    def _own_etag(self) -> str | None:
        found = self.root.get_tagged(self.rel)
        state = json_object(found[0]) if found else {}
        return found[1] if state.get("owner") == self.owner and not state.get("released") else None

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        if self.etag and not self.lost.is_set():
            self.root.replace(self.rel, self._body(released=True), self.etag)
        self.etag = None


@contextmanager
def lease_lock(root: ObjectRoot, rel: str, seconds: float, on_wait: Callable[[], None] | None = None,
               wait: bool = True) -> Iterator[Lease | None]:
    """Hold the lease at `rel` for the block (yields the Lease), or yield None at once when
    wait=False and another holder has it."""
    lease = Lease(root, rel, seconds)
    if not lease.acquire(wait, on_wait):
        yield None
        return
    try:
        yield lease
    finally:
        lease.release()
