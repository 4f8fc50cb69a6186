"""Headless Chromium over the DevTools protocol on a pipe: open a report, read its probe, screenshot it.

No extra packages and no network: Chromium is started with ``--remote-debugging-pipe`` and
talks JSON messages ending in NUL over file descriptors 3 (commands in) and 4 (events out),
the same transport kaleido's choreographer uses. Every wait has a deadline; a browser that
does not answer is killed, never waited for forever.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--no-default-browser-check", "--disable-extensions", "--mute-audio",
         # WebGL (scattergl) on the software rasterizer: this page is our own, trusted content
         "--enable-unsafe-swiftshader", "--use-angle=swiftshader")
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


class BrowserError(RuntimeError):
    """Chromium could not be started, did not answer in time, or the page failed."""


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome executable: $PARATWIN_CHROMIUM, $BROWSER_PATH, then PATH."""
    for var in ("PARATWIN_CHROMIUM", "BROWSER_PATH"):
        if os.environ.get(var) and Path(os.environ[var]).is_file():
            return os.environ[var]
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class PageResult:
    """What a page did while it loaded: its probe, its errors, and how long it took."""

    probe: dict
    errors: list[str] = field(default_factory=list)
    load_ms: float = 0.0
    """Navigation start to the probe's 'ready' (every figure drawn), as the page measured it."""
    wall_s: float = 0.0
    screenshot: Path | None = None
    values: dict = field(default_factory=dict)
    """Results of the ``evaluate`` expressions, by name."""


class Browser:
    """One headless Chromium; open pages one after another with ``open``. Use as a context."""

    def __init__(self, executable: str | None = None, timeout_s: float = 60.0):
        exe = executable or find_chromium()
        if exe is None:
            raise BrowserError("chromium was not found; install it (`apt-get install -y chromium`) "
                               "or set PARATWIN_CHROMIUM to a Chrome/Chromium executable")
        self.timeout_s = timeout_s
        self._profile = tempfile.TemporaryDirectory(prefix="paratwin-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._evt_r, evt_w = os.pipe()

        def wire_fds() -> None:  # in the child: commands on fd 3, events on fd 4
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (cmd_r, evt_w)]
            for want, fd in zip((3, 4), high):
                os.dup2(fd, want)
                os.set_inheritable(want, True)

        try:
            self._proc = subprocess.Popen(
                [exe, *FLAGS, f"--user-data-dir={self._profile.name}", "--remote-debugging-pipe",
                 "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, preexec_fn=wire_fds, close_fds=False)
        except OSError as err:
            self._profile.cleanup()
            raise BrowserError(f"could not start {exe}: {err}") from None
        finally:
            os.close(cmd_r)
            os.close(evt_w)
        self._buf = b""
        self._next_id = 0
        self._events: list[dict] = []
        try:
            self.version = self.call("Browser.getVersion").get("product", "")
        except (BrowserError, OSError) as err:
            self.close()
            raise BrowserError(f"{exe} did not start as a headless browser: {err}") from None

    # -- protocol ---------------------------------------------------------------------------
    def _send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        try:
            os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError:
            raise BrowserError(f"chromium exited (code {self._proc.poll()})") from None
        return self._next_id

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"chromium did not answer within {self.timeout_s:.0f} s")
            ready, _, _ = select.select([self._evt_r], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._evt_r, 1 << 20)
                if not chunk:
                    raise BrowserError(f"chromium exited (code {self._proc.poll()})")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout_s: float | None = None) -> dict:
        """Send one command and wait for its answer (events meanwhile are kept)."""
        want = self._send(method, params, session)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            msg = self._read(deadline)
            if msg.get("id") == want:
                if "error" in msg:
                    raise BrowserError(f"{method}: {msg['error'].get('message')}")
                return msg.get("result", {})
            if "method" in msg:
                self._events.append(msg)

    def _drain_errors(self, session: str) -> list[str]:
        out = []
        for ev in self._events:
            if ev.get("sessionId") != session:
                continue
            m, p = ev["method"], ev.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description", "")))
                                    for a in p.get("args", [])))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(p["entry"].get("text", ""))
        self._events = [e for e in self._events if e.get("sessionId") != session]
        return out

    # -- pages ------------------------------------------------------------------------------
    def open(self, html: Path, screenshot: Path | None = None, width: int = 1400,
             max_height: int = 9000, timeout_s: float | None = None,
             elements: dict[str, Path] | None = None,
             evaluate: dict[str, str] | None = None) -> PageResult:
        """Load ``html``, wait until its probe says every figure is drawn, read the probe and
        the page's errors, and optionally save a full-page PNG and PNGs of single elements
        (``elements``: CSS selector -> file). ``evaluate``: name -> JavaScript expression
        (a promise is awaited) run once the page is ready."""
        t0 = time.monotonic()
        limit = timeout_s or self.timeout_s
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        try:
            for domain in ("Runtime", "Log", "Page"):
                self.call(f"{domain}.enable", session=sid)
            self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900,
                      "deviceScaleFactor": 1, "mobile": False}, session=sid)
            self.call("Page.navigate", {"url": Path(html).resolve().as_uri()}, session=sid)
            probe = self._wait_probe(sid, t0 + limit)
            values = {}
            for name, expr in (evaluate or {}).items():
                res = self.call("Runtime.evaluate", {"expression": expr, "awaitPromise": True,
                                "returnByValue": True}, session=sid, timeout_s=limit)
                if "exceptionDetails" in res:
                    raise BrowserError(f"evaluating {name!r} failed: "
                                       f"{res['exceptionDetails'].get('text', '')}")
                values[name] = res.get("result", {}).get("value")
            errors = self._drain_errors(sid) + [e for e in probe.get("errors", [])]
            shot = None
            if screenshot is not None:
                shot = self._screenshot(sid, Path(screenshot), width, max_height)
            for selector, path in (elements or {}).items():
                self._element_shot(sid, selector, Path(path))
            return PageResult(probe=probe, errors=errors, load_ms=float(probe.get("ready_ms", 0)),
                              wall_s=time.monotonic() - t0, screenshot=shot, values=values)
        finally:
            self.call("Target.closeTarget", {"targetId": target})

    def _wait_probe(self, sid: str, deadline: float) -> dict:
        expr = ("(() => { const e = document.getElementById('paratwin-probe');"
                " return e && e.dataset.ready === '1' ? e.textContent : null; })()")
        while time.monotonic() < deadline:
            res = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True},
                            session=sid, timeout_s=max(1.0, deadline - time.monotonic()))
            value = res.get("result", {}).get("value")
            if value:
                return json.loads(value)
            time.sleep(0.1)
        errors = self._drain_errors(sid)
        raise BrowserError("the report's probe never became ready (no element #paratwin-probe "
                           f"with data-ready=1) within {self.timeout_s:.0f} s; page errors: "
                           f"{errors or 'none'}")

    def _screenshot(self, sid: str, path: Path, width: int, max_height: int) -> Path:
        size = self.call("Page.getLayoutMetrics", session=sid).get("cssContentSize", {})
        height = int(min(max(size.get("height", 900), 400), max_height))
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                  "deviceScaleFactor": 1, "mobile": False}, session=sid)
        self.call("Runtime.evaluate", {"expression": "new Promise(r => requestAnimationFrame("
                  "() => requestAnimationFrame(r)))", "awaitPromise": True}, session=sid)
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                         session=sid)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def _element_shot(self, sid: str, selector: str, path: Path) -> Path:
        expr = (f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) "
                "return null; const r = e.getBoundingClientRect(); return [r.left + scrollX, "
                "r.top + scrollY, r.width, r.height]; })()")
        box = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True},
                        session=sid).get("result", {}).get("value")
        if not box:
            raise BrowserError(f"no element matches {selector!r} on the page")
        clip = {"x": box[0], "y": box[1], "width": box[2], "height": box[3], "scale": 1}
        data = self.call("Page.captureScreenshot", {"format": "png", "clip": clip,
                         "captureBeyondViewport": True}, session=sid)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if self._proc.poll() is None:
                try:
                    self.call("Browser.close", timeout_s=5)
                except (BrowserError, OSError):
                    pass
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=10)
        finally:
            for fd in (self._cmd_w, self._evt_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._profile.cleanup()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_page(html: Path, screenshot: Path | None = None, timeout_s: float = 60.0) -> PageResult:
    """Open one report in a fresh headless Chromium (see ``Browser.open``)."""
    with Browser(timeout_s=timeout_s) as b:
        return b.open(html, screenshot=screenshot)
