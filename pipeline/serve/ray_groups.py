"""Live streams over several GPUs on Ray Serve (`serve --ray ... --stream-groups N`):

    HTTP ──▶ Ingress: POST /v1/streams checks the source and the limits, ──▶ StreamGroup 0 .. N-1
             places the stream (placement.py: the least-loaded group),       one deployment each, a GPU each:
             follows its events, lists and stops it                          capture, ARR-COC and its own
                                                                             VLM for the streams placed there

A group runs its streams exactly as the single-process server does (streams.LiveStreams over a
VLM of its own), so one group is what one GPU serves alone (bench_live), and N groups serve N
times that while the ingress keeps up. The ingress keeps what each group last reported (every
REPORT_S): listing a stream never waits on a group; a stream's status may lag by that much.
Sources are resolved and checked once, in the ingress (--allow-dir, uploads, the fetch policy);
a group opens what it is handed. Every group writes its streams into the one store. The chat
requests' answers go to the groups' VLMs as well (to the one with the fewest of this ingress's
requests waiting), so N GPUs serve everything with no VLM deployment beside them.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterator

from ray import serve

from ..config import PipelineConfig
from ..core.live_stages import LiveOptions
from ..core.setup import build_model, runtime_device
from .errors import ApiError
from .options import ServeOptions
from .placement import Placement
from .streams import Source, check_room, live_options, new_stream_id

log = logging.getLogger(__name__)

REPORT_S = 1.0        # how often the ingress asks every group for its streams and its VLM queue
CALL_S = 60.0         # a group that does not answer a call in this long: 503
ENDED = ("ended", "stopped", "failed")


@serve.deployment
class StreamGroup:
    """One GPU's live streams: a VLM (behind one batcher) and ARR-COC of its own."""

    def __init__(self, cfg: PipelineConfig, options: ServeOptions) -> None:
        from ..core.compose import frontend_graphs
        from ..core.frontend_graphs import FrontendGraphsPool
        from ..vlm.loading import load_answerer
        from .answering import LocalVLM
        from .metrics import Metrics
        from .streams import LiveStreams

        # what streams.LiveStreams reads of its engine
        self.cfg, self.options = cfg, options
        device = runtime_device(cfg)
        self.service = LocalVLM(load_answerer(cfg, device))
        self.model = build_model(cfg, device, answering=True)
        self.frontends = FrontendGraphsPool(options.max_frontend_graphs or options.max_streams, frontend_graphs)
        self.metrics = Metrics()
        self.streams = LiveStreams(self)

    # the VLM deployment's interface (ray_app.RemoteVLM): with stream groups, the chat requests'
    # answers go to the groups' VLMs too, batched with their live streams' answers
    def info(self) -> dict[str, Any]:
        from ..vlm.hf_forward import model_card
        from .answering import context_length

        v = self.service.vlm
        return {"name": v.name, "geometry": v.geometry, "config": v.config, "warning": v.warning,
                "context_length": context_length(v), "card": model_card(v)}

    def count_tokens(self, text: str) -> int:
        return self.service.count_tokens(text)

    def prefix_length(self, question: str, visual_tokens: int) -> int:
        return self.service.prefix_length(question, visual_tokens)

    async def answer(self, request: Any) -> Any:
        return await asyncio.wrap_future(self.service.submit(request))

    def start(self, source: Source, question: str, options: LiveOptions, owner: str, stream_id: str) -> dict:
        """The stream started (its to_dict), or {"refused": ...}: an ApiError's fields (a client's
        mistake is an answer here, not an error of the replica)."""
        try:
            return self.streams.launch(source, question, options, owner, stream_id).to_dict()
        except ApiError as e:
            return {"refused": {"status": e.status, "message": e.message, "param": e.param, "code": e.code}}

    def report(self) -> dict[str, Any]:
        """Every stream of this group (to_dict and owner) and the answer requests its VLM has waiting."""
        return {"streams": [(s.to_dict(), s.owner) for s in self.streams.list()], "pending": self.service.pending()}

    def delete(self, stream_id: str, owner: str) -> dict:
        return self.streams.delete(stream_id, owner).to_dict()

    async def events(self, stream_id: str, owner: str, after: int) -> AsyncIterator[tuple]:
        async for event in self.streams.get(stream_id, owner).events.follow(after):
            yield event

    def stop_all(self) -> None:
        self.streams.stop_all()

    def __del__(self) -> None:                       # Serve takes the replica down: end its streams cleanly
        streams = getattr(self, "streams", None)
        if streams is not None:
            streams.stop_all()
            self.service.close()


class RemoteEvents:
    """A group stream's events, followed through the group's handle (as streams.EventLog.follow)."""

    def __init__(self, handle: Any, stream_id: str, owner: str) -> None:
        self.handle, self.stream_id, self.owner = handle, stream_id, owner

    async def follow(self, after: int = 0) -> AsyncIterator[tuple]:
        async for event in self.handle.options(stream=True).events.remote(self.stream_id, self.owner, after):
            yield tuple(event)


class RemoteStream:
    """The ingress's view of a stream in group `group`: what the group last reported of it."""

    def __init__(self, info: dict, owner: str, group: int, handle: Any) -> None:
        self.id, self.owner, self.group, self.info = info["id"], owner, group, info
        self.events = RemoteEvents(handle, self.id, owner)

    @property
    def status(self) -> str:
        return self.info["status"]

    def to_dict(self) -> dict[str, Any]:
        return {**self.info, "group": self.group}


class GroupedStreams:
    """streams.LiveStreams' interface (start, get, list, delete, running, stop_all) over stream
    groups: the ingress's engine.streams."""

    def __init__(self, groups: list[Any], media: Any, options: ServeOptions) -> None:
        self.groups, self.media, self.options = groups, media, options
        self.placement = Placement(len(groups))
        self.pending = [0] * len(groups)
        self._streams: dict[str, RemoteStream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="stream-groups", daemon=True)
        self._reporter.start()

    def running(self) -> int:
        return sum(s.status in ("starting", "running") for s in self.list())

    def get(self, stream_id: str, owner: str = "") -> RemoteStream:
        with self._lock:
            stream = self._streams.get(stream_id)
        if stream is None or stream.owner != owner:
            raise ApiError(404, f"no live stream {stream_id!r}", code="not_found")
        return stream

    def list(self, owner: str | None = None) -> list[RemoteStream]:
        with self._lock:
            return [s for s in self._streams.values() if owner is None or s.owner == owner]

    def start(self, source: str, question: str, *, every_s: float, on_scene_change: bool,
              duration_s: float | None, owner: str = "") -> RemoteStream:
        """Check the source and the limits here, place the stream on the least-loaded group and
        start it there (blocking: call it off the event loop)."""
        resolved = Source(*self.media.live_source(source, owner))
        options = live_options(every_s, on_scene_change, duration_s)
        stream_id = new_stream_id()
        with self._lock:                     # the check and the placement together: a burst cannot overshoot
            check_room(self.options, list(self._streams.values()), owner)
            group = self.placement.place(stream_id, self.pending)
            placeholder = RemoteStream({"id": stream_id, "status": "starting"}, owner, group, self.groups[group])
            self._streams[stream_id] = placeholder
        try:
            info = self._call(self.groups[group].start, resolved, question, options, owner, stream_id)
        except BaseException:
            self._forget(stream_id)
            raise
        if "refused" in info:
            self._forget(stream_id)
            e = info["refused"]
            raise ApiError(e["status"], e["message"], param=e["param"], code=e["code"])
        stream = RemoteStream(info, owner, group, self.groups[group])
        with self._lock:
            self._streams[stream_id] = stream
        return stream

    def delete(self, stream_id: str, owner: str = "") -> RemoteStream:
        stream = self.get(stream_id, owner)
        stream.info = self._call(self.groups[stream.group].delete, stream_id, owner)
        self.placement.release(stream_id)
        return stream

    def stop_all(self) -> None:
        self._stop.set()
        for group in self.groups:
            try:
                group.stop_all.remote().result(timeout_s=CALL_S)
            except Exception as e:  # noqa: BLE001 - a group already gone has no streams left to stop
                log.warning("stream group did not stop its streams: %s", e)

    def _forget(self, stream_id: str) -> None:
        with self._lock:
            self._streams.pop(stream_id, None)
        self.placement.release(stream_id)

    def _call(self, method: Any, *args: Any) -> Any:
        try:
            return method.remote(*args).result(timeout_s=CALL_S)
        except TimeoutError:
            raise ApiError(503, f"a stream group did not answer within {CALL_S:g} s", code="group_timeout") from None

    def _report_loop(self) -> None:
        while not self._stop.wait(REPORT_S):
            for g, group in enumerate(self.groups):
                try:
                    report = group.report.remote().result(timeout_s=CALL_S)
                except Exception as e:  # noqa: BLE001 - the next round asks again
                    log.warning("stream group %d did not report: %s", g, e)
                    continue
                self._update(g, report)

    def _update(self, group: int, report: dict[str, Any]) -> None:
        """Take group `group`'s report: statuses, its VLM queue; streams that ended stop counting
        for placement, and those the group itself no longer keeps are forgotten here too."""
        self.pending[group] = int(report["pending"])
        reported = {info["id"]: (info, owner) for info, owner in report["streams"]}
        with self._lock:
            for sid, stream in list(self._streams.items()):
                if stream.group != group:
                    continue
                if sid in reported:
                    stream.info = reported[sid][0]
                elif stream.status in ENDED:
                    del self._streams[sid]
        for sid, (info, _) in reported.items():
            if info["status"] in ENDED:
                self.placement.release(sid)
