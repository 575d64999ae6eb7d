"""A tmpfs mounted for a test: a small, full or read-only filesystem (mounting needs the right to;
without it the test is skipped)."""
from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(mount: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at `mount` (created) with `options` (`size=64k`, `ro`), unmounted afterwards."""
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def fill(folder: Path) -> None:
    """Take every free byte of `folder`'s filesystem (a file that grows until the disk is full)."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC, error
