"""Headless Chromium for the tests that look at a page as a user does (the Prefect UI, the dataset
review): Debian's chromium, installed with apt-get when missing, driven over the DevTools protocol."""
from __future__ import annotations

import base64
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def stop(process: subprocess.Popen, sig: int, grace: float = 20) -> None:
    """Send `sig` to the process, then kill whatever of it and its descendants is left."""
    if process.poll() is not None:
        return
    family = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(sig)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for child in family:
        if child.is_running():
            child.kill()


def installed_chromium() -> Path:
    """Debian's chromium, installed here (apt-get, as root) when missing: the UI checks never skip.
    One install at a time (pytest-xdist's workers ask at once; apt holds dpkg's lock)."""
    with open(Path(tempfile.gettempdir()) / "lorapipe-tests-chromium.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _install_chromium()


def _install_chromium() -> Path:
    if not CHROMIUM.exists():
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            pytest.fail(f"{CHROMIUM} is missing and this is not root with apt-get: `apt-get install -y chromium`")
        apt = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for step in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            done = subprocess.run(step, env=apt, capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, f"`{shlex.join(step)}` failed:\n{done.stdout[-1000:]}{done.stderr[-2000:]}"
    return CHROMIUM


class Chromium:
    """Headless Chromium driven over the DevTools protocol (no browser download, no extra package)."""

    def __init__(self, executable: Path, profile: Path):
        self.profile = profile
        self.process = subprocess.Popen([str(executable), *CHROMIUM_FLAGS, "--window-size=1400,2400",
                                         f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file, deadline = profile / "DevToolsActivePort", time.time() + 120
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.time() < deadline and self.process.poll() is None, "chromium did not start"
            time.sleep(0.2)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json") as answer:
            page = next(t for t in json.load(answer) if t["type"] == "page")
        from websockets.sync.client import connect

        self.socket, self.calls = connect(page["webSocketDebuggerUrl"], max_size=None), 0

    def call(self, method: str, **params: Any) -> dict:
        self.calls += 1
        self.socket.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:  # events arrive in between; the answer carries our id
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == self.calls:
                assert "error" not in message, message
                return message["result"]

    def wait_for(self, expression: str, timeout: float = 120) -> Any:
        """The expression's first truthy value, evaluated every half second."""
        deadline = time.time() + timeout
        while not (value := self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")):
            if time.time() > deadline:
                page = self.call("Runtime.evaluate", returnByValue=True,
                                 expression="location.href + '\\n' + document.body.innerText.slice(0, 1500)")
                shot = self.screenshot(self.profile.parent / f"{self.profile.name}-failed.png")
                raise AssertionError(f"the page never satisfied {expression}; see {shot}; it shows "
                                     f"{page['result'].get('value')}")
            time.sleep(0.5)
        return value

    def click(self, selector: str, text: str = "") -> None:
        """Click, as a mouse does, the first element matching `selector` (and containing `text`)
        once it exists and has stopped moving: content loading above it shifts it, and a click at its
        old place misses (some UI widgets answer mouse events only, not element.click())."""
        x, y = self.wait_for(f"""(() => {{
            const e = [...document.querySelectorAll({json.dumps(selector)})].find(e => e.innerText.includes({json.dumps(text)}));
            if (!e) return null;
            e.scrollIntoView({{block: "center"}});
            const box = e.getBoundingClientRect(), at = [box.x + box.width / 2, box.y + box.height / 2];
            const settled = JSON.stringify(at) === window.__lastClickTarget;
            window.__lastClickTarget = JSON.stringify(at);
            return settled ? at : null; }})()""")
        for event in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=event, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        self.socket.close()
        stop(self.process, signal.SIGTERM, grace=10)
