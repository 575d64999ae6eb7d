"""A work directory on local disk, mirrored to object storage so that another host can resume it.

Stages write their resumable state (training checkpoints, logs) with plain file I/O into a local
work directory. While the build holds the key's lease, a thread pushes what changed to
`<root>/work/<stage>/<work key>/` every few seconds, and once more when the build ends; removed
files are removed there too. Hidden entries (`.staging-*`, this module's state file) are not pushed:
a checkpoint appears there only once committed locally. A checkpoint cut short by a host dying
mid-push is caught by its seal (every file's digest), so a resumer falls back to the one before.

When a build takes the lease, `pull` makes the local directory agree with the root, which is the
truth: files the root has (and this host does not, or has in another version) are downloaded;
files this host pushed before but the root no longer has (another host rotated them away) are
removed; files only this host has and never pushed (its own run died before pushing them) are
kept and pushed with the rest.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

from .objects import ObjectRoot

STATE = ".pushed.json"  # rel -> [size, mtime_ns, etag] of what this host last pushed or pulled


class WorkSync:
    def __init__(self, root: ObjectRoot, prefix: str, local: Path, held: Callable[[], bool] = lambda: True):
        """`held` says whether this run still holds the key's lease (Lease.confirm): only then it pushes."""
        self.root, self.prefix, self.local, self.held = root, prefix.rstrip("/") + "/", Path(local), held
        self.local.mkdir(parents=True, exist_ok=True)
        self.state: dict[str, list] = self._load_state()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stopped = False

    def pull(self) -> int:
        """Bring the local directory in line with the root; returns how many files were downloaded."""
        remote = self.root.list(self.prefix)
        local = _files(self.local)
        fetch = [rel for rel, entry in remote.items()
                 if rel not in local or self.state.get(rel) != [*local[rel], entry.etag]]
        for rel in fetch:
            (self.local / rel).parent.mkdir(parents=True, exist_ok=True)
        self.root.download_many([(self.prefix + rel, self.local / rel) for rel in fetch])
        for rel in set(self.state) - set(remote):
            self._remove_local(rel)
        local = _files(self.local)
        self.state = {rel: [*local[rel], entry.etag] for rel, entry in remote.items() if rel in local}
        self._save_state()
        return len(fetch)

    def push(self) -> None:
        """Upload what changed here since the last push or pull; delete what was removed here."""
        with self._lock:
            if self.stopped or not self.held():
                return
            local = _files(self.local)
            changed = [rel for rel, stat in local.items() if self.state.get(rel, [None, None])[:2] != list(stat)]
            for rel in changed:
                try:
                    self.root.upload(self.local / rel, self.prefix + rel)
                except FileNotFoundError:  # removed while pushing (a rotated checkpoint)
                    continue
                self.state[rel] = [*local[rel], ""]
            gone = [rel for rel in self.state if rel not in local]
            self.root.delete(self.prefix + rel for rel in gone)
            for rel in gone:
                del self.state[rel]
            if changed or gone:
                self._refresh_etags(changed)
                self._save_state()

    def start(self, every: float) -> None:
        """Push from a thread every `every` seconds until `finish`."""
        self._thread = threading.Thread(target=self._push_until_stopped, args=(every,), daemon=True,
                                        name=f"push {self.prefix}")
        self._thread.start()

    def finish(self, push: bool = True) -> None:
        """Stop the thread; push a last time (unless the lease was lost: another host owns it now)."""
        self._stop.set()
        if self._thread:
            self._thread.join()
        if push:
            self.push()
        with self._lock:
            self.stopped = True

    def remove(self) -> None:
        """Delete the work directory here and on the root."""
        self.finish(push=False)
        self.root.delete_prefix(self.prefix)
        shutil.rmtree(self.local, ignore_errors=True)

    def _remove_local(self, rel: str) -> None:
        """Remove a file the root no longer has, and the folders it leaves empty: a rotated
        checkpoint's empty folder would read as a damaged checkpoint."""
        (self.local / rel).unlink(missing_ok=True)
        folder = (self.local / rel).parent
        while folder != self.local and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent

    def _push_until_stopped(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.push()
            except Exception:  # noqa: BLE001 (a failed push is retried by the next one, and by `finish`)
                continue

    def _refresh_etags(self, rels: list[str]) -> None:
        listed = self.root.list(self.prefix)
        for rel in rels:
            if rel in listed and rel in self.state:
                self.state[rel][2] = listed[rel].etag

    def _load_state(self) -> dict[str, list]:
        try:
            return json.loads((self.local / STATE).read_text())
        except (OSError, ValueError):
            return {}

    def _save_state(self) -> None:
        tmp = self.local / f"{STATE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.local / STATE)


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """rel -> (size, mtime_ns) of every file under `folder`, hidden files and folders left out."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            found[os.path.relpath(path, folder).replace(os.sep, "/")] = (st.st_size, st.st_mtime_ns)
    return found
