"""A headless Chromium driven over the DevTools protocol with the standard library only.

`--remote-debugging-pipe` makes Chromium read protocol commands from its file descriptor
3 and write replies and events to descriptor 4, each message one JSON text ended by a NUL
byte. `Browser` starts it with two pipes on those descriptors, attaches to a page target
(flattened sessions) and sends commands synchronously; events that arrive meanwhile are
kept in `events`.

    with Browser() as b:
        b.open("file:///tmp/explore.html")
        b.eval("window.explorer.nodeCount()")
        b.screenshot("shot.png", width=1400, height=900)

As a script, it takes screenshots of a page (used for docs/img/explore_*.png):

    python tests/_browser.py page.html shot.png [--js "explorer.select('op3')"] [--size 1400x900]
"""
import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium():
    """The path of a Chromium (or Chrome) binary, or None."""
    env = os.environ.get("MICROTENSOR_CHROMIUM")
    if env:
        return env if os.path.exists(env) else shutil.which(env)
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page; a context manager that ends the process."""

    def __init__(self, binary=None, timeout=30.0):
        self.binary = binary or find_chromium()
        if self.binary is None:
            raise BrowserError("no chromium binary on PATH (apt-get install chromium)")
        self.timeout = timeout
        self.events = []
        self._id = 0
        self._buffer = b""
        self.profile = tempfile.mkdtemp(prefix="mt-chromium-")
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        args = [self.binary, "--headless=new", "--no-sandbox", "--disable-gpu",
                "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage", "--mute-audio",
                "--hide-scrollbars", "about:blank"]

        # the child's ends, first moved above 9 so that neither is 3 or 4 itself
        child_in = fcntl.fcntl(to_child_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_out = fcntl.fcntl(from_child_w, fcntl.F_DUPFD_CLOEXEC, 10)
        for fd in (to_child_r, from_child_w):
            os.close(fd)

        def onto_3_and_4():
            # in the child, before exec: its ends become descriptors 3 and 4 (dup2 clears
            # close-on-exec; every other descriptor of ours is close-on-exec)
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)
        self.proc = subprocess.Popen(args, preexec_fn=onto_3_and_4, close_fds=False,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(child_in)
        os.close(child_out)
        self._write, self._read = to_child_w, from_child_r
        try:
            target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.call("Target.attachToTarget",
                                     {"targetId": target, "flatten": True})["sessionId"]
            self.send("Page.enable")
            self.send("Runtime.enable")
            self.send("Network.enable")
        except BaseException:
            self.close()
            raise

    # -- the protocol -----------------------------------------------------------------
    def call(self, method, params=None, session=None):
        """Send one command, wait for its reply; returns its result (raises on error)."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._next(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def send(self, method, params=None):
        """A command to the page's session."""
        return self.call(method, params, self.session)

    def _next(self, deadline):
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("chromium did not answer in time")
            ready, _, _ = select.select([self._read], [], [], left)
            if ready:
                chunk = os.read(self._read, 1 << 20)
                if not chunk:
                    raise BrowserError("chromium closed the pipe (it exited)")
                self._buffer += chunk
        text, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(text)

    def wait_event(self, method, timeout=None):
        """Wait for an event (already received or coming) of this method."""
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            e = self._next(deadline)
            if e.get("method") == method:
                return e
            self.events.append(e)

    # -- conveniences -----------------------------------------------------------------
    def open(self, url, wait_for="document.body && document.body.dataset.ready === '1'"):
        """Navigate and wait for the load event and for `wait_for` to be true; returns
        the seconds from the navigation to that moment."""
        # NOTE: from page#a to page#b is a navigation within the document, which fires
        # no load event and runs no script again: leave the page first
        self.send("Page.navigate", {"url": "about:blank"})
        self.wait_event("Page.loadEventFired")
        self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        start = time.monotonic()
        self.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired")
        deadline = time.monotonic() + self.timeout
        while wait_for and not self.eval(wait_for):
            if time.monotonic() > deadline:
                raise BrowserError(f"the page never got to {wait_for!r}")
            time.sleep(0.02)
        return time.monotonic() - start

    def eval(self, expression):
        """The value of a JavaScript expression in the page (by value; raises on an
        exception in the page)."""
        result = self.send("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def click(self, x, y):
        """A real mouse click (press and release) at page coordinates."""
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y,
                                                   "button": "left", "clickCount": 1})

    def requests(self):
        """The URLs of every request the page started (Network.requestWillBeSent), about:
        blank (which `open` passes through) left out."""
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"
                and e["params"]["request"]["url"] != "about:blank"]

    def resize(self, width, height):
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                         "deviceScaleFactor": 1,
                                                         "mobile": False})

    def screenshot(self, path):
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path

    def close(self):
        if self.proc.poll() is None:
            try:
                os.write(self._write, json.dumps({"id": 0, "method": "Browser.close"})
                         .encode() + b"\0")
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for fd in (self._write, self._read):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="Screenshot a local HTML page in headless "
                                            "Chromium (after running some JavaScript).")
    p.add_argument("page")
    p.add_argument("png")
    p.add_argument("--js", action="append", default=[],
                   help="JavaScript to run before the screenshot (repeatable)")
    p.add_argument("--size", default="1400x900", help="window WIDTHxHEIGHT")
    args = p.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    with Browser() as b:
        b.resize(width, height)
        b.open("file://" + os.path.abspath(args.page))
        for js in args.js:
            b.eval(js)
        time.sleep(0.2)
        b.screenshot(args.png)
    print(args.png)


if __name__ == "__main__":
    sys.exit(main())
