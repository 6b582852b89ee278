"""Admission control: how many requests do work at once, and for how long.

A request that does work (a chat completion, an upload, opening a live stream) takes a slot of
the server's `--max-concurrent` and of its API key's `--max-concurrent-per-key` before its body
is read; with none free it is answered 429 at once, with `Retry-After`, instead of waiting in a
queue that grows until everything times out. Each admitted request gets a `Deadline`
(`--request-timeout-s`) that every thread working for it consults: when it fires, or when the
client goes away, the request's fetch is cut, its graph aborted, and its slot freed.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any, Callable

from starlette.responses import JSONResponse

from .errors import ApiError, error_body
from .owners import OWNER

# the routes whose requests do work; everything else (lists, reads, /health) is answered at once
ADMITTED = {("POST", "/v1/chat/completions"), ("POST", "/v1/files"), ("POST", "/v1/streams")}
GRACE_S = 2.0      # past its deadline, a request's aborted work has this long to answer 504 itself


class Deadline:
    """One request's time limit and cancellation, shared by every thread that works for it.
    seconds None: no time limit (cancel() still ends the work)."""

    def __init__(self, seconds: float | None = None) -> None:
        self.expires = None if seconds is None else time.monotonic() + seconds
        self.reason: str | None = None
        self._cancelled = threading.Event()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next = 0
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self) -> bool:
        return self.expires is not None and time.monotonic() >= self.expires

    def remaining(self) -> float | None:
        return None if self.expires is None else self.expires - time.monotonic()

    def bound(self, seconds: float) -> float:
        """seconds, or less where the deadline comes sooner (a socket's timeout)."""
        left = self.remaining()
        return seconds if left is None else max(0.001, min(seconds, left))

    def check(self, error: Callable[[], BaseException]) -> None:
        """Raise error() when the request is over (its deadline passed, or it was cancelled)."""
        if self.cancelled or self.expired():
            raise error()

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when the request is cancelled (now, if it already is) -> an undo."""
        with self._lock:
            if not self.cancelled:
                key, self._next = self._next, self._next + 1
                self._callbacks[key] = callback
                return lambda: self._callbacks.pop(key, None)
        callback()
        return lambda: None

    def cancel(self, reason: str) -> None:
        """End the request's work: every registered callback runs once (from this thread)."""
        with self._lock:
            if self.cancelled:
                return
            self.reason = reason
            self._cancelled.set()
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        for callback in callbacks:
            callback()


class Admission:
    """Counts of running requests, per server and per client; admit() or 429."""

    def __init__(self, max_requests: int, max_per_client: int) -> None:
        self.max_requests, self.max_per_client = max_requests, max_per_client
        self.running = 0
        self.by_client: dict[str, int] = {}
        self.refused = 0
        self._seconds = 1.0        # a running mean of how long a slot is held: the Retry-After
        self._lock = threading.Lock()

    def admit(self, client: str) -> Callable[[], None]:
        """Take a slot for client -> its release (call once). 429 when the server or the client
        has none free."""
        with self._lock:
            mine = self.by_client.get(client, 0)
            if self.running >= self.max_requests or mine >= self.max_per_client:
                self.refused += 1
                whose = (f"{self.max_requests} requests are running (--max-concurrent)"
                         if self.running >= self.max_requests else
                         f"this API key has {mine} requests running (--max-concurrent-per-key)")
                raise ApiError(429, f"busy: {whose}; retry after {self.retry_after()} s", code="rate_limited",
                               headers={"Retry-After": str(self.retry_after())})
            self.running += 1
            self.by_client[client] = mine + 1
        start, released = time.monotonic(), [False]

        def release() -> None:
            with self._lock:
                if released[0]:
                    return
                released[0] = True
                self.running -= 1
                self.by_client[client] -= 1
                if not self.by_client[client]:
                    del self.by_client[client]
                self._seconds = 0.8 * self._seconds + 0.2 * (time.monotonic() - start)
        return release

    def retry_after(self) -> int:
        return max(1, min(60, math.ceil(self._seconds)))


class Admit:
    """ASGI middleware: the ADMITTED routes take a slot (or get 429) before their body is read and
    run under a Deadline (scope["state"]["deadline"]). When it fires the deadline is cancelled,
    which aborts the work, and the request has GRACE_S to answer (its own 504, or an error event
    in a stream) before it is cut; a client that disconnects cancels it and cuts it at once."""

    def __init__(self, app: Any, admission: Admission, timeout_s: float | None) -> None:
        self.app, self.admission, self.timeout_s = app, admission, timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"].rstrip("/")) not in ADMITTED:
            return await self.app(scope, receive, send)
        client = scope.get("state", {}).get(OWNER, "")     # the key's owner (app.Guard runs first)
        try:
            release = self.admission.admit(client)
        except ApiError as e:
            return await JSONResponse(e.body(), status_code=e.status, headers=e.headers)(scope, receive, send)
        deadline = Deadline(self.timeout_s)
        scope.setdefault("state", {})["deadline"] = deadline
        started, gone = [False], asyncio.Event()

        async def sending(message: dict) -> None:
            started[0] = started[0] or message["type"] == "http.response.start"
            await send(message)
        watcher: list[asyncio.Task] = []

        async def receiving() -> dict:
            if watcher:                     # the body is in: only a disconnect can come
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                watcher.append(asyncio.ensure_future(self._watch(receive, gone)))
            return message
        work = asyncio.ensure_future(self.app(scope, receiving, sending))
        ended = asyncio.ensure_future(gone.wait())
        try:
            done, _ = await asyncio.wait({work, ended}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            deadline.cancel("client gone" if gone.is_set() else "deadline")
            if not gone.is_set():     # the aborted work answers 504 itself (a stream: an error event)
                await asyncio.wait({work}, timeout=GRACE_S)
            if not work.done():
                work.cancel()
            try:
                await work
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the request is over either way
                pass
            if not started[0] and not gone.is_set():        # it did not answer in its grace period
                body = error_body(504, f"the request took longer than its deadline of {self.timeout_s:g} s "
                                       f"(--request-timeout-s) and was stopped", code="request_timeout")
                await JSONResponse(body, status_code=504)(scope, receive, send)
        finally:
            ended.cancel()
            for task in watcher:
                task.cancel()
            deadline.cancel("done")
            release()

    @staticmethod
    async def _watch(receive: Callable, gone: asyncio.Event) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()
