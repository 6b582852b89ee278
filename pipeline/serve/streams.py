"""Live streams over HTTP: each one is `runners.live.run_live` in its own thread (its answers through
the server's shared VLM batcher), its answers, reconnect gaps and end as numbered events that any
number of followers read as server-sent events, from the start or from where they left off.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from sources import SourceError
from sources.live import Gap, LiveConfig

from ..core.graph import StageError
from ..core.live_stages import LiveOptions
from ..core.items import AnswerItem
from ..runners.live import run_live
from .answering import RequestVLM, item_row
from .errors import ApiError
from .fetch_policy import live_error, live_gap_reason, live_open_failed

FINISHED_KEPT = 64          # ended streams whose events stay readable
START_WAIT_S = 30.0         # POST /v1/streams waits this long for the source to open
log = logging.getLogger("pipeline.serve.streams")


class EventLog:
    """Numbered events, appended from any thread, followed from event loops. Keeps the newest
    `capacity`; the `end` event is always the last one."""

    def __init__(self, capacity: int) -> None:
        self._events: collections.deque = collections.deque(maxlen=capacity)
        self._next = 1
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.ended = False

    def append(self, kind: str, data: dict[str, Any]) -> None:
        with self._lock:
            if self.ended:
                return
            self._events.append((self._next, kind, data))
            self._next += 1
            self.ended = kind == "end"
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def since(self, after: int) -> list[tuple[int, str, dict[str, Any]]]:
        with self._lock:
            return [e for e in self._events if e[0] > after]

    async def follow(self, after: int = 0) -> AsyncIterator[tuple[int, str, dict[str, Any]]]:
        """Every event numbered above `after`, as they come, up to and including `end`."""
        while True:
            wake = asyncio.Event()
            with self._lock:
                pending = [e for e in self._events if e[0] > after]
                if not pending and not self.ended:
                    self._waiters.append((asyncio.get_running_loop(), wake))
            for event in pending:
                yield event
                after = event[0]
                if event[1] == "end":
                    return
            if not pending:
                if self.ended:
                    return
                await wake.wait()


class StatusKeeper:
    """run_live's status stream: keeps the newest JSON metrics line (frames, drops, latency)."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] = {}

    def write(self, text: str) -> int:
        for line in text.splitlines():
            try:
                self.latest = json.loads(line).get("metrics", self.latest)
            except (ValueError, AttributeError):
                pass
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@dataclass
class LiveStream:
    id: str
    source: str                 # as shown (no password)
    question: str
    every_s: float
    on_scene_change: bool
    created: int
    events: EventLog
    stop: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)
    status: str = "starting"    # starting, running, ended, stopped, failed
    error: str | None = None
    deleted: bool = False       # stopped by DELETE /v1/streams/{id} (not by its duration)
    status_lines: StatusKeeper = field(default_factory=StatusKeeper)
    thread: threading.Thread | None = None
    owner: str = ""             # owners.py: the API key that started it (never shown)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "object": "live.stream", "created": self.created, "source": self.source,
                "question": self.question, "every": self.every_s, "on_scene_change": self.on_scene_change,
                "status": self.status, "error": self.error, "events": f"/v1/streams/{self.id}/events",
                "homunculus": f"/v1/homunculus/{self.id}", "metrics": self.status_lines.latest}


@dataclass(frozen=True)
class Source:
    """A live source as media.live_source resolved it: what run_live opens (a network stream
    through the fetch policy: FetchPolicy.route), whether it is a file played in real time, what
    is shown (no password)."""
    spec: str
    realtime: bool
    shown: str


def new_stream_id() -> str:
    return f"live-{uuid.uuid4().hex[:24]}"


def live_options(every_s: float, on_scene_change: bool, duration_s: float | None) -> LiveOptions:
    """A stream's answer settings, or 400 naming the bad one."""
    try:
        return LiveOptions(every_s=every_s, on_scene_change=on_scene_change, duration_s=duration_s)
    except ValueError as e:
        raise ApiError(400, str(e).replace("--", ""), param="every") from None


def check_room(options: Any, streams: list[Any], owner: str) -> None:
    """429 when --max-streams of `streams` are running, or --max-streams-per-key of `owner`'s."""
    per_key = options.per_key[1]
    running = [s for s in streams if s.status in ("starting", "running")]
    mine = sum(s.owner == owner for s in running)
    if len(running) >= options.max_streams or mine >= per_key:
        which = (f"{options.max_streams} live streams are running (--max-streams)"
                 if mine < per_key else f"this API key runs {mine} live streams (--max-streams-per-key)")
        raise ApiError(429, f"{which}; stop one with DELETE /v1/streams/{{id}}", code="too_many_streams",
                       headers={"Retry-After": "10"})


class LiveStreams:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._streams: dict[str, LiveStream] = {}
        self._lock = threading.Lock()

    def running(self) -> int:
        with self._lock:
            return sum(s.status in ("starting", "running") for s in self._streams.values())

    def get(self, stream_id: str, owner: str = "") -> LiveStream:
        """The stream `stream_id` of `owner`; 404 if there is none (another key's streams included)."""
        with self._lock:
            stream = self._streams.get(stream_id)
        if stream is None or stream.owner != owner:
            raise ApiError(404, f"no live stream {stream_id!r}", code="not_found")
        return stream

    def list(self, owner: str | None = None) -> list[LiveStream]:
        """The streams of `owner` (None: every stream)."""
        with self._lock:
            return [s for s in self._streams.values() if owner is None or s.owner == owner]

    def start(self, source: str, question: str, *, every_s: float, on_scene_change: bool,
              duration_s: float | None, owner: str = "") -> LiveStream:
        """Open the source and start answering (blocks until it is open or has failed: call it off the
        event loop). 400 for a bad source, 429 when --max-streams are running (in all, or for this
        owner: --max-streams-per-key)."""
        source = Source(*self.engine.media.live_source(source, owner))
        options = live_options(every_s, on_scene_change, duration_s)
        return self.launch(source, question, options, owner, check=True)

    def launch(self, source: Source, question: str, options: LiveOptions, owner: str = "",
               stream_id: str | None = None, *, check: bool = False) -> LiveStream:
        """Start answering a source already checked (start, or the ingress of a stream group:
        ray_app.py, which names the stream and checks the limits itself); blocks until it is open
        or has failed (400). check: the --max-streams limits, with the registration (429)."""
        stream = LiveStream(stream_id or new_stream_id(), source.shown, question, options.every_s,
                            options.on_scene_change, int(time.time()), EventLog(self.engine.options.stream_events),
                            owner=owner)
        live = LiveConfig(realtime=source.realtime, connect=self.engine.options.fetch_policy.route)
        stream.thread = threading.Thread(target=self._run, args=(stream, source.spec, live, options),
                                         name=f"serve-{stream.id}", daemon=True)
        with self._lock:         # the check and the registration together: a burst cannot overshoot
            if check:
                check_room(self.engine.options, list(self._streams.values()), owner)
            self._streams[stream.id] = stream
            self._forget_finished()
        stream.thread.start()
        stream.started.wait(START_WAIT_S)
        if stream.status == "failed":
            raise live_open_failed(source.shown, stream.error, param="source", code="source_failed")
        return stream

    def delete(self, stream_id: str, owner: str = "") -> LiveStream:
        stream = self.get(stream_id, owner)
        stream.deleted = True
        stream.stop.set()
        if stream.thread is not None:
            stream.thread.join(30.0)
        return stream

    def stop_all(self) -> None:
        for stream in self.list():
            stream.stop.set()
        for stream in self.list():
            if stream.thread is not None:
                stream.thread.join(30.0)

    def _run(self, stream: LiveStream, spec: str, live: LiveConfig, options: LiveOptions) -> None:
        engine = self.engine

        def on_graph(graph: Any) -> None:
            stream.status = "running"
            stream.started.set()

        def on_answer(item: AnswerItem) -> None:
            stream.events.append("answer", {"stream": stream.id, "question": item.question, **item_row(item)})
            engine.metrics.tokens(item.tokens_kept, item.tokens_full)

        def on_gap(_sid: str, gap: Gap) -> None:
            stream.events.append("gap", {"stream": stream.id, "start_pts": round(gap.start_pts, 3),
                                         "end_pts": round(gap.end_pts, 3),
                                         "seconds": round(gap.end_wall - gap.start_wall, 3),
                                         "reason": gap.reason if live.realtime else live_gap_reason(gap.reason)})
        try:
            result = run_live([spec], stream.question, engine.options.store, engine.cfg, live=live, options=options,
                              status_out=stream.status_lines, stop=stream.stop, on_graph=on_graph,
                              vlm=RequestVLM(engine.service), model=engine.model, stream_ids=[stream.id],
                              on_answer=on_answer, on_gap=on_gap, frontends=engine.frontends)
        except BaseException as e:  # the stream's follower learns why; the server keeps serving
            error = e.error if isinstance(e, StageError) else e
            stream.status, stream.error = "failed", str(error).splitlines()[0] if str(error) else type(error).__name__
            if not isinstance(error, (SourceError, ApiError)):
                stream.error = f"{type(error).__name__}: {stream.error}"
            elif isinstance(error, SourceError) and not live.realtime:
                # a network source that failed: why (refused, timed out, not a stream) and at which
                # address is the server's log's business, not the client's (fetch_policy.py)
                log.info("live source %s: %s", stream.source, stream.error)
                stream.error = live_error(stream.error, "unreachable" if not stream.started.is_set()
                                          else "the stream ended")
            stream.started.set()
            stream.events.append("end", {"stream": stream.id, "reason": "failed", "error": stream.error})
            return
        if result.errors:
            stream.status, stream.error, reason = "failed", result.errors[0], "source_failed"
            if not live.realtime:      # it gave up reconnecting
                log.info("live source %s: %s", stream.source, stream.error)
                stream.error = live_error(stream.error, "unreachable")
        elif stream.deleted:
            stream.status = reason = "stopped"
        else:   # the source ended (a realtime file) or the stream's duration did
            stream.status, reason = "ended", "duration" if stream.stop.is_set() else "source_ended"
        stream.started.set()
        stream.events.append("end", {"stream": stream.id, "reason": reason, "error": stream.error,
                                     "answers": len(result.answers), "wall_s": round(result.wall_s, 2)})

    def _forget_finished(self) -> None:
        finished = [k for k, s in self._streams.items() if s.status in ("ended", "stopped", "failed")]
        for key in finished[:max(0, len(finished) - FINISHED_KEPT)]:
            del self._streams[key]
