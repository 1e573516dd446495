"""Debian's headless `chromium`, driven over the DevTools protocol: one page, navigated, read and photographed.

Nothing here waits without a deadline: starting, every protocol call and every poll of the page have their own,
all shorter than pytest's 120 s, so a browser that hangs is named, not waited on.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-dev-shm-usage",  # containers give /dev/shm 64 MB
    "--hide-scrollbars",
    "--window-size=1280,1000",
    "--remote-debugging-port=0",
)
START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 15.0


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One tab of the browser: DevTools calls, page events, and what the page threw or logged as an error."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._loads = 0
        self.problems: list[str] = []
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for message in self._ws:
            if message.type is not aiohttp.WSMsgType.TEXT:
                break
            payload = json.loads(message.data)
            if "id" in payload:
                future = self._pending.pop(payload["id"], None)
                if future is not None and not future.done():
                    future.set_result(payload)
                continue
            method, params = payload.get("method"), payload.get("params", {})
            if method == "Page.loadEventFired":
                self._loads += 1
            elif method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                thrown = details.get("exception", {}).get("description", "")
                self.problems.append(f"exception: {details.get('text')} {thrown}")
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                self.problems.append(f"log: {params['entry'].get('text')} ({params['entry'].get('url', '')})")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the DevTools connection closed"))

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        await self._ws.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        try:
            answer = await asyncio.wait_for(future, CALL_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError(f"chromium did not answer {method} within {CALL_TIMEOUT_S} s") from None
        if "error" in answer:
            raise AssertionError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def navigate(self, url: str, timeout: float = 15.0) -> None:
        """Open `url` and wait for its load event."""
        await self.load(lambda: self.call("Page.navigate", url=url), timeout)

    async def load(self, action: Callable[[], Any], timeout: float = 15.0) -> None:
        """Run `action` (a navigation, a form submitted) and wait for the page it leads to."""
        before = self._loads
        await action()
        deadline = time.monotonic() + timeout
        while self._loads == before:
            if time.monotonic() > deadline:
                raise AssertionError(f"no page load within {timeout} s")
            await asyncio.sleep(0.02)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, what: str, timeout: float = 15.0) -> Any:
        """Poll `expression` in the page until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"the page never showed {what} within {timeout} s (last: {value!r})")
            await asyncio.sleep(0.05)

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    async def close(self) -> None:
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def chromium(profile: Path, log: Path) -> AsyncIterator[Page]:
    """A fresh headless chromium on `profile` (a new --user-data-dir), its output in `log`, and its one page."""
    binary = chromium_binary()
    assert binary is not None, "chromium is not installed (make test-ui installs it)"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            binary, *FLAGS, f"--user-data-dir={profile}", "about:blank", stdout=out, stderr=out
        )
    try:
        port = await _devtools_port(profile, proc, log)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)) as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json()
            page_target = next(t for t in targets if t["type"] == "page")
            ws = await session.ws_connect(page_target["webSocketDebuggerUrl"], max_msg_size=64 << 20)
            page = Page(ws)
            try:
                for domain in ("Page.enable", "Runtime.enable", "Log.enable"):
                    await page.call(domain)
                yield page
            finally:
                await page.close()
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _devtools_port(profile: Path, proc: asyncio.subprocess.Process, log: Path) -> int:
    """Chromium writes the port it chose into the profile once it listens."""
    deadline = time.monotonic() + START_TIMEOUT_S
    marker = profile / "DevToolsActivePort"
    while True:
        if marker.exists():
            first = marker.read_text().split("\n", 1)[0].strip()
            if first.isdigit():
                return int(first)
        if proc.returncode is not None:
            raise AssertionError(f"chromium exited {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"chromium did not listen within {START_TIMEOUT_S} s: {log.read_text()[-2000:]}")
        await asyncio.sleep(0.05)
