"""One writer per key: an OS lock the kernel releases when its holder dies."""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


@contextmanager
def key_lock(path: Path, on_wait: Callable[[], None] | None = None, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive flock on `path`; call `on_wait` once if another process holds it.
    With wait=False, yield False at once instead of waiting (nothing is held then); else True.
    The descriptor is not inherited, so a child process never keeps the lock alive."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            if on_wait:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock
