"""Headless Chromium driven over its DevTools protocol, with the standard library only.

Chromium is started with ``--remote-debugging-pipe``: it reads commands on
fd 3 and writes answers on fd 4, each a JSON message ended by a NUL byte
(no websocket, no second browser download). ``Browser.page(url)`` opens a
tab; a ``Page`` evaluates JavaScript, waits for a condition and takes
screenshots.

    with Browser() as b:
        page = b.page("http://127.0.0.1:8000/")
        page.wait_for("document.title == 'probing'")
        page.screenshot("out.png")
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(Exception):
    pass


class Browser:
    def __init__(self, width: int = 1400, height: int = 900, timeout: float = 60.0) -> None:
        exe = find_chromium()
        if exe is None:
            raise BrowserError("no chromium on PATH (.ci/setup.sh installs Debian's chromium)")
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="probing-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def fds() -> None:  # in the child: the pipe ends as fd 3 (commands) and 4 (answers)
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chrome_r, from_chrome_w)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        args = [
            exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-dev-shm-usage", "--disable-extensions", "--mute-audio",
            "--no-default-browser-check", "--remote-debugging-pipe",
            f"--user-data-dir={self._profile}", f"--window-size={width},{height}",
            "about:blank",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args,
            preexec_fn=fds,
            pass_fds=(3, 4),  # kept open in the child after fds() made them
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._lock = threading.Lock()
        self._answers: dict[int, dict[str, Any]] = {}
        self._events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.width, self.height = width, height

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_chrome, 1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    self._answers[-1] = {"closed": True}
                    self._cond.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                with self._cond:
                    if "id" in msg:
                        self._answers[msg["id"]] = msg
                    else:
                        self._events.append(msg)
                        del self._events[:-1000]
                    self._cond.notify_all()

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        with self._lock:
            self._next_id += 1
            mid = self._next_id
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        with self._cond:
            while mid not in self._answers:
                if -1 in self._answers:
                    raise BrowserError(f"chromium exited: {self._stderr()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrowserError(f"{method}: no answer in {timeout or self.timeout:g} s")
                self._cond.wait(left)
            answer = self._answers.pop(mid)
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def _stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return ""
        return self.proc.stderr.read().decode(errors="replace")[-2000:]

    def page(self, url: str) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        page = Page(self, session, target)
        page.send("Page.enable")
        page.send("Runtime.enable")
        page.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False},
        )
        page.goto(url)
        return page

    def console(self, session: str) -> list[str]:
        """What the page printed (console API calls and exceptions), oldest first."""
        out = []
        with self._cond:
            events = list(self._events)
        for e in events:
            if e.get("sessionId") != session:
                continue
            p = e.get("params", {})
            if e["method"] == "Runtime.consoleAPICalled":
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif e["method"] == "Runtime.exceptionThrown":
                out.append(str(p["exceptionDetails"].get("exception", {}).get("description")))
        return out

    def close(self) -> None:
        try:
            os.close(self._to_chrome)
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        try:
            os.close(self._from_chrome)
        except OSError:
            pass
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str, target: str) -> None:
        self.browser = browser
        self.session = session
        self.target = target

    def send(self, method: str, params: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        return self.browser.send(method, params, session=self.session, **kw)

    def goto(self, url: str) -> None:
        res = self.send("Page.navigate", {"url": url})
        if res.get("errorText"):
            raise BrowserError(f"{url}: {res['errorText']}")

    def evaluate(self, expr: str, timeout: float | None = None) -> Any:
        """The value of JavaScript ``expr`` (promises awaited), as JSON."""
        res = self.send(
            "Runtime.evaluate",
            {"expression": expr, "awaitPromise": True, "returnByValue": True},
            timeout=timeout,
        )
        if "exceptionDetails" in res:
            d = res["exceptionDetails"]
            raise BrowserError(d.get("exception", {}).get("description") or d.get("text"))
        return res["result"].get("value")

    def wait_for(self, expr: str, timeout: float = 60.0, interval: float = 0.2) -> Any:
        """Poll ``expr`` until it is truthy; its value. BrowserError on timeout."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.evaluate(expr, timeout=max(1.0, deadline - time.monotonic()))
            except BrowserError as err:
                last = err
            else:
                if last:
                    return last
            time.sleep(interval)
        raise BrowserError(
            f"waited {timeout:g} s for {expr!r}; last: {last!r}; console: "
            f"{self.browser.console(self.session)[-5:]}"
        )

    def screenshot(self, path: str | Path, settle: float = 30.0) -> Path:
        """A PNG of the page once it stops changing (two captures 0.5 s apart
        alike, or ``settle`` seconds passed): canvases draw after the DOM."""
        data, deadline = None, time.monotonic() + settle
        while True:
            shot = self.send("Page.captureScreenshot", {"format": "png"})["data"]
            if shot == data or time.monotonic() > deadline:
                break
            data = shot
            time.sleep(0.5)
        data = shot
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def console(self) -> list[str]:
        return self.browser.console(self.session)
