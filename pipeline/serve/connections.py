"""Connections before authentication (slowloris): uvicorn's HTTP/1.1 protocol (h11) with two limits
it lacks. A request head must arrive within `header_timeout_s` of the connection (or of the previous
response on a kept-alive one), else the connection is closed; and at most `max_connections` are open:
at the cap, the oldest connection still sending its head is closed to make room for the new one
(a slowloris client keeps heads open for minutes, a legitimate one sends its head at once), and
when every open connection is inside a request the new one is answered 503.

uvicorn's own limits do the rest: h11 refuses a head over `h11_max_incomplete_event_size`, and
`timeout_keep_alive` closes idle kept-alive connections. Its `limit_concurrency` does not serve here:
it counts the slow connections too, so at its cap it turns away the legitimate request, not them.
"""
from __future__ import annotations

import asyncio
import resource
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nretry-after: 1\r\n"
        b"connection: close\r\ncontent-length: 34\r\n\r\nevery connection is in a request\r\n")
MAX_HEAD_BYTES = 16 * 1024      # h11's limit on an incomplete request head (bytes)


def connection_cap(max_connections: int) -> int:
    """max_connections, within half the process' open-file limit (the rest: the store, the models'
    files, the decoders): past that limit accept() fails and every client waits."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max_connections if soft == resource.RLIM_INFINITY else max(8, min(max_connections, soft // 2))


def guarded_h11(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config(http=...)) enforcing the head timeout and the cap; one
    class per server (its connections waiting for a head are shared by its instances)."""
    waiting: dict[GuardedH11, asyncio.TimerHandle] = {}     # oldest first

    class GuardedH11(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:   # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                oldest = next(iter(waiting), None)
                if oldest is None:
                    transport.write(BUSY)
                    transport.close()
                    return
                oldest.transport.close()
                _stop_waiting(oldest)
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            _stop_waiting(self)
            super().connection_lost(exc)

        def _watch(self) -> None:
            """Waiting for a request head: no request yet, or the last one answered and no next one."""
            if self.transport.is_closing():
                _stop_waiting(self)
            elif self.cycle is None or self.cycle.response_complete:
                if self not in waiting:
                    waiting[self] = self.loop.call_later(header_timeout_s, self._head_timed_out)
            else:
                _stop_waiting(self)

        def _head_timed_out(self) -> None:
            waiting.pop(self, None)
            self.transport.close()

    def _stop_waiting(protocol: GuardedH11) -> None:
        timer = waiting.pop(protocol, None)
        if timer is not None:
            timer.cancel()

    return GuardedH11


def uvicorn_limits(header_timeout_s: float, max_connections: int) -> dict[str, Any]:
    """The uvicorn.Config keywords of a server guarded so."""
    return {"http": guarded_h11(header_timeout_s, connection_cap(max_connections)),
            "h11_max_incomplete_event_size": MAX_HEAD_BYTES, "timeout_keep_alive": 5}
