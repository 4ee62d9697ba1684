"""A headless Chromium driven over the DevTools protocol on a pipe (standard library only).

``Browser`` starts ``chromium --headless --remote-debugging-pipe``: commands go to the browser on
file descriptor 3, answers and events come back on 4, as NUL-terminated JSON. ``open(url)``
attaches to a fresh page; ``Page.evaluate`` runs JavaScript and returns its value, ``screenshot``
returns PNG bytes, and ``errors`` lists what the page reported: console errors and warnings,
uncaught exceptions, and browser log errors (blocked fetches, Content-Security-Policy refusals).

``find_chromium`` looks for the binary; ``ensure_chromium`` installs it from the system packages
(``apt-get install -y chromium``) when it is missing and says so, since the browser test is part
of the default suite.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["Browser", "ensure_chromium", "find_chromium"]

INSTALL = "apt-get install -y chromium"
_CANDIDATES = ("/usr/lib/chromium/chromium", "chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """Path of a Chromium binary ($DETFP_CHROMIUM first), or None."""
    env = os.environ.get("DETFP_CHROMIUM")
    if env:
        return env
    for c in _CANDIDATES:
        path = c if os.path.isabs(c) and os.access(c, os.X_OK) else shutil.which(c)
        if path:
            return path
    return None


def ensure_chromium() -> str:
    """A Chromium binary, installed with apt-get when missing; RuntimeError naming the command when
    that is impossible (no apt-get, not root)."""
    found = find_chromium()
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        raise RuntimeError(f"Chromium is needed for the HTML report test and is not installed; run: {INSTALL}")
    print(f"\ntests: Chromium is missing; installing it for the browser test: {INSTALL}", file=sys.stderr)
    res = subprocess.run([apt, "install", "-y", "chromium"], capture_output=True, text=True)
    found = find_chromium()
    if res.returncode != 0 or not found:
        tail = " ".join(res.stderr.split()[-40:])
        raise RuntimeError(f"could not install Chromium with `{INSTALL}` (exit {res.returncode}): {tail}")
    return found


class Browser:
    """One headless Chromium process; use as a context manager."""

    def __init__(self, binary: str, profile: Path, timeout: float = 30.0):
        self.timeout = timeout
        self._id = 0
        self._buf = b""
        self.events: list[dict[str, Any]] = []
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def child() -> None:  # put the pipe ends on the fds the protocol expects: 3 (in) and 4 (out)
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [
            binary,
            "--headless=new",
            "--remote-debugging-pipe",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--hide-scrollbars",
            "--force-color-profile=srgb",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args,
            pass_fds=(3, 4),
            preexec_fn=child,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.send("Browser.close")
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for fd in (self._to_chrome, self._from_chrome):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- protocol
    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError(f"Chromium closed the protocol pipe (exit {self.proc.poll()})")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        """Send a command and return its result (events that arrive meanwhile go to ``events``)."""
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            m = self._read_message(deadline)
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_event(self, method: str, session: str, deadline: float) -> dict[str, Any]:
        for i, m in enumerate(self.events):
            if m.get("method") == method and m.get("sessionId") == session:
                return self.events.pop(i)
        while True:
            m = self._read_message(deadline)
            if m.get("method") == method and m.get("sessionId") == session:
                return m
            self.events.append(m)

    def open(self, url: str, width: int = 1280, height: int = 900) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session=session)
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        self.send("Page.navigate", {"url": url}, session=session)
        self.wait_event("Page.loadEventFired", session, time.monotonic() + self.timeout)
        return Page(self, session)


class Page:
    """An attached page."""

    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def evaluate(self, expression: str) -> Any:
        res = self.browser.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}, self.session
        )
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression[:80]}: {res['exceptionDetails'].get('text')}")
        return res["result"].get("value")

    def screenshot(self, full_page: bool = False) -> bytes:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.browser.send("Page.getLayoutMetrics", session=self.session)["cssContentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
            params["captureBeyondViewport"] = True
        return base64.b64decode(self.browser.send("Page.captureScreenshot", params, self.session)["data"])

    def errors(self) -> list[str]:
        """Console errors/warnings, uncaught exceptions and browser log errors seen on this page."""
        self.evaluate("0")  # drain events sent before now
        out = []
        for m in self.browser.events:
            if m.get("sessionId") != self.session:
                continue
            p = m.get("params", {})
            if m.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(
                    f"console.{p['type']}: "
                    + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", []))
                )
            elif m.get("method") == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append(f"exception: {d.get('text')} {d.get('exception', {}).get('description', '')}".strip())
            elif m.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
                e = p["entry"]
                out.append(f"log.{e['level']}: {e.get('source')}: {e.get('text')}")
        return out
