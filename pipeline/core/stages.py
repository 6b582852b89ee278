"""The stages of the streaming graph: decode -> texture -> realize -> [vlm] -> sink.

The items flowing between them are in pipeline/core/items.py.

GPU stages each own a CUDA stream; hand-offs carry CUDA events (`wait_event` on the consumer's
stream, `event.synchronize()` only where the host must read the data), never a device-wide sync.
"""
from __future__ import annotations

import json
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Iterator, TextIO

import numpy as np
import torch

from arr_coc.model import ARRCOC
from arr_coc.realizing import StreamState
from arr_coc.texture import Texture
from sources.frame import Frame
from sources.process import ProcessSource
from sources.yuv import yuv_to_rgb

from ..runtime.cuda import CAPTURE_LOCK, host_uint8, pins_frames, stack_device, stack_host, to_device, window_frames
from ..runtime.requests import AnswerRequest
from .frontend_graphs import FrontendGraphs, graphable
from .graph import Stage
from .items import (AllocationBatch, AnswerItem, AnswerItems, FrameAllocation, FrameBatch, FrameRef, Outcome,
                    RunStatus, TextureBatch)


def frontend_stream(device: torch.device) -> torch.cuda.Stream:
    """A CUDA stream for the per-frame stages (decode copies, texture, realize), at the highest
    priority: where the VLM shares the GPU (live mode), the GPU's scheduler runs the front end's
    kernels first, so frames keep their rate and answers absorb the wait. With the default stream
    (priority 0) for the VLM, it is a no-op when nothing else runs."""
    return torch.cuda.Stream(device, priority=-1)  # lower is higher; torch maps it into CUDA's range


def stack_frames(frames: list[Frame], pin: bool) -> torch.Tensor:
    """(T, H, W, 3) uint8 host tensor; written straight into pinned memory when `pin`. Frames the
    GPU decoded (Frame.on_device) stay there: stacked on the device's default stream, which a
    consumer without the batch's ready event waits for (TextureStage)."""
    if frames[0].on_device:
        rgb = [f.rgb for f in frames]
        return stack_device(rgb, torch.cuda.default_stream(rgb[0].device) if rgb[0].is_cuda else None)
    return stack_host([f.rgb for f in frames], pin)


class DecodeStage(Stage):
    """Source stage: batches of consecutive frames from a video source.

    device: with a ProcessSource and a CUDA device, batches go from the worker's shared slots
    straight to the device (the slots are page-locked in place, so no host copy is made; YUV
    planes are converted to RGB there) and carry FrameRefs instead of host frames. For runs that
    never read pixels on the host (no VLM, no overlay).

    Frames the GPU decoded (decoder nvdec: Frame.rgb a CUDA tensor) are stacked on the device, on
    this stage's stream, and never pass through host memory; the batch's frames are views of it.
    """

    name = "decode"

    def __init__(self, source: Any, batch_size: int, pin: bool, status: RunStatus,
                 stop: threading.Event | None = None, device: torch.device | None = None) -> None:
        self.source, self.batch_size, self.pin, self.status = source, batch_size, pin, status
        self._stop = stop
        self.device = device if isinstance(source,
                                           ProcessSource) and device is not None and device.type == "cuda" else None
        if self.device is None and getattr(source, "yuv", None) is not None:
            raise ValueError("a ProcessSource handing over YUV planes needs a CUDA device to convert them")
        self.stream = frontend_stream(self.device) if self.device is not None else None
        self._registered: int | None = None  # address of the page-locked slots
        if self.device is not None:
            self._page_lock(source.buffer)

    def produce(self) -> Iterator[FrameBatch]:
        if self.device is not None:
            batches = self._to_device()
        elif isinstance(self.source, ProcessSource):
            batches = self._from_process()
        else:
            batches = self._from_thread()
        yield from batches
        if getattr(self.source, "truncated", False):
            with self.status.lock:
                self.status.truncated = True

    def _from_process(self) -> Iterator[FrameBatch]:
        """Batches decoded by the worker process: one copy from its shared slot into (pinned) memory."""
        sid = self.source.stream_id
        for decoded in self.source.batches():
            pixels = host_uint8(decoded.rgb.shape, self.pin)
            rgb = pixels.numpy()
            np.copyto(rgb, decoded.rgb)
            self.source.release(decoded)
            frames = [Frame(sid, index, pts, rgb[k]) for k, (index, pts) in enumerate(zip(decoded.indices,
                                                                                          decoded.pts))]
            yield FrameBatch(sid, frames, pixels)

    def _to_device(self) -> Iterator[FrameBatch]:
        """Shared slot -> device (DMA from the page-locked slot), YUV -> RGB on the device. The slot
        goes back to the worker as soon as its copy is done; conversion and the next stages run on."""
        sid, source = self.source.stream_id, self.source
        for decoded in source.batches():
            with torch.cuda.stream(self.stream):
                data = torch.from_numpy(decoded.pixels).to(self.device, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.stream)
                pixels = yuv_to_rgb(data, decoded.yuv) if decoded.yuv is not None else data  # (T, H, W, 3)
                ready = torch.cuda.Event()
                ready.record(self.stream)
            copied.synchronize()
            source.release(decoded)
            frames = [FrameRef(sid, index, pts) for index, pts in zip(decoded.indices, decoded.pts)]
            yield FrameBatch(sid, frames, pixels, ready)

    def _page_lock(self, buffer: np.ndarray) -> None:
        """cudaHostRegister the slots so copies from them are asynchronous DMA. Where the driver
        refuses (some containers limit locked memory), copies still work, synchronously."""
        cudart = torch.cuda.cudart()
        with CAPTURE_LOCK.shared():  # (un)registering page-locked memory: not while another thread captures
            err = cudart.cudaHostRegister(buffer.ctypes.data, buffer.nbytes, 0)
        if int(getattr(err, "value", err)) == 0:
            self._registered = buffer.ctypes.data

    def _from_thread(self) -> Iterator[FrameBatch]:
        pending: list[Frame] = []
        for frame in self.source:
            if pending and frame.rgb.shape != pending[0].rgb.shape:
                raise ValueError(f"frame size changed mid-stream at frame {frame.index}: "
                                 f"{tuple(pending[0].rgb.shape[:2])} -> {tuple(frame.rgb.shape[:2])}")
            pending.append(frame)
            if len(pending) == self.batch_size:
                yield self._batch(pending)
                pending = []
        if pending:
            yield self._batch(pending)

    def _batch(self, frames: list[Frame]) -> FrameBatch:
        sid = self.source.stream_id
        if not (frames[0].on_device and frames[0].rgb.is_cuda):
            return FrameBatch(sid, frames, stack_frames(frames, self.pin))
        device = frames[0].rgb.device
        if self.stream is None:
            self.stream = frontend_stream(device)
        pixels = stack_device([f.rgb for f in frames], self.stream)            # (T, H, W, 3) on the GPU
        ready = torch.cuda.Event()
        ready.record(self.stream)
        # the frames become views of the batch: the per-frame tensors go back to the allocator now
        views = [Frame(sid, f.index, f.pts_s, pixels[k], f.arrival_s) for k, f in enumerate(frames)]
        return FrameBatch(sid, views, pixels, ready)

    def close(self) -> None:
        if self._registered is not None:  # before the slots are unmapped
            with CAPTURE_LOCK.shared():  # a device-wide sync would invalidate another thread's capture
                torch.cuda.synchronize(self.device)
                torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        close = getattr(self.source, "close", None)
        if close is not None:
            close()


class TextureStage(Stage):
    """GPU stream A: host->device copy from pinned memory, then the texture array."""

    name = "texture"

    def __init__(self, model: ARRCOC, device: torch.device, grid: tuple[int, int],
                 graphs: FrontendGraphs | None = None) -> None:
        self.model, self.device, self.grid = model, device, grid
        self.cuda = device.type == "cuda"
        self.stream = frontend_stream(device) if self.cuda else None
        self.last: dict[str, torch.Tensor] = {}  # last frame of each stream, on the device
        # batches of a stream with history replay a CUDA graph (one per batch shape); a stream's
        # first batch runs eagerly
        self.graphs = graphs

    def reset(self, stream_id: str) -> None:
        """Forget the stream's last frame: the next one has no predecessor (a live reconnect)."""
        self.last.pop(stream_id, None)

    @torch.inference_mode()
    def process(self, item: FrameBatch) -> Iterable[TextureBatch]:
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            if item.ready is not None:  # decoded straight to the device on the decode stage's stream
                self.stream.wait_event(item.ready)
                item.pixels.record_stream(self.stream)
            elif self.cuda and item.pixels.is_cuda:  # GPU frames stacked on the default stream (stack_frames)
                self.stream.wait_stream(torch.cuda.default_stream(self.device))
                item.pixels.record_stream(self.stream)
            pixels = item.pixels.to(self.device, non_blocking=True)       # (T, H, W, 3) uint8
            frames = pixels.permute(0, 3, 1, 2)                           # (T, 3, H, W)
            last = self.last.get(item.stream_id)
            texture = None
            if self.graphs is not None:  # a stream's first batch too: frames[0] stands in for its last frame
                texture = self.graphs.extract(frames, frames[0] if last is None else last, self.stream,
                                              last_real=last is not None)     # None: no graph for this shape
            if texture is None:
                texture = self.model.extract(frames, last, self.grid)
            self.last[item.stream_id] = frames[-1].clone()  # not a view that pins the whole batch
            ready = None
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        return (TextureBatch(item, texture, ready),)


class RealizeStage(Stage):
    """GPU stream B: knowing -> balancing -> temporal realizing -> attending, then device->host."""

    name = "realize"

    def __init__(self, model: ARRCOC, device: torch.device, query: torch.Tensor,
                 query_mask: torch.Tensor | None = None, vlm_fps: float | None = None,
                 graphs: FrontendGraphs | None = None) -> None:
        self.model, self.device = model, device
        self.query, self.query_mask = query.to(device), None if query_mask is None else query_mask.to(device)
        self.vlm_fps = vlm_fps
        self.cuda = device.type == "cuda"
        self.stream = frontend_stream(device) if self.cuda else None
        if self.cuda:
            # The query was made on the caller's stream, and PyTorch's pool streams do not wait for
            # the default stream by themselves: without this a first batch could read a query (and
            # mask) still being written.
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.states: dict[str, StreamState] = {}
        self.next_vlm_pts: dict[str, float] = {}
        self.graphs = graphs

    def reset(self, stream_id: str) -> None:
        """Drop the stream's temporal state: its next frame is a new fixation (scene_change True)."""
        self.states.pop(stream_id, None)
        self.next_vlm_pts.pop(stream_id, None)

    def vlm_frames(self, item: FrameBatch) -> torch.Tensor | None:
        """Which frames the VLM will see (sampled at vlm_fps on pts); None when every frame counts."""
        if self.vlm_fps is None:
            return None
        nxt = self.next_vlm_pts.get(item.stream_id)
        marks = []
        for f in item.frames:
            take = nxt is None or f.pts_s >= nxt - 1e-6
            if take:
                nxt = (f.pts_s if nxt is None else nxt) + 1.0 / self.vlm_fps
                while nxt <= f.pts_s:
                    nxt += 1.0 / self.vlm_fps
            marks.append(take)
        self.next_vlm_pts[item.stream_id] = nxt
        return torch.tensor(marks, dtype=torch.bool)

    @torch.inference_mode()
    def process(self, item: TextureBatch) -> Iterable[AllocationBatch]:
        vlm_frames = self.vlm_frames(item.batch)
        marks = None if vlm_frames is None else vlm_frames.tolist()
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            if item.ready is not None:
                self.stream.wait_event(item.ready)
                _record_stream(item.texture, self.stream)
            if vlm_frames is not None and self.cuda:  # pinned, so the copy does not wait for the GPU
                vlm_frames = to_device(vlm_frames, self.device)
            state = self.states.get(item.batch.stream_id)
            replayed = None
            if self.graphs is not None and state is None:  # a stream's first batch, as tensors a graph takes
                state = self.model.realizer.initial_state(item.texture)
            if self.graphs is not None and graphable(state):
                marks_dev = vlm_frames
                if marks_dev is None:
                    marks_dev = torch.ones(item.batch.frames_count, dtype=torch.bool, device=self.device)
                replayed = self.graphs.realize(item.texture, state, marks_dev, self.stream,  # None: no graph
                                               self.query, self.query_mask)
            if replayed is not None:
                allocation, state = replayed
            else:
                allocation, state, _ = self.model.realize(item.texture, self.query, state,
                                                          query_mask=self.query_mask, vlm_frames=vlm_frames)
            self.states[item.batch.stream_id] = state
            with CAPTURE_LOCK.shared() if self.cuda else nullcontext():
                host = allocation.to("cpu", non_blocking=self.cuda)
            ready = None
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        return (AllocationBatch(item.batch, host, ready, marks),)


class VLMStage(Stage):
    """Collects the VLM-sampled frames and their token maps into answer windows and asks the VLM.

    Allocation batches pass straight through to the sink; an AnswerItem follows each window.
    Windows are `every_s` seconds of video on a fixed grid from the first frame's pts (None: the
    whole video, answered at the end). A window longer than `max_frames` VLM frames keeps an even
    spread over all of it: every `stride`-th frame, the stride doubling each time the window fills.
    """

    name = "vlm"

    def __init__(self, vlm: Any, question: str, every_s: float | None, max_frames: int = 256) -> None:
        if max_frames < 2:
            raise ValueError(f"max_frames must be >= 2 (a full window keeps every other frame), got {max_frames}")
        self.vlm, self.question, self.every_s, self.max_frames = vlm, question, every_s, max_frames
        self.pin = pins_frames(vlm)
        self.rgb: list[np.ndarray] = []
        self.lod: list[np.ndarray] = []
        self.relevance: list[np.ndarray] = []   # pass 1's realized relevance of each kept frame (gh, gw)
        self.stride = 1                       # the window keeps every stride-th of its VLM frames
        self.offered = 0                      # VLM frames of this window so far, kept or not
        self.last_pts: float | None = None    # the newest of them
        self.stream_id = ""
        self.window_start: float | None = None
        self.answered = 0

    def process(self, item: AllocationBatch) -> Iterable[Any]:
        out: list[Any] = [item]
        allocation = item.wait()
        self.stream_id = item.batch.stream_id
        for frame, lod, relevance, take in zip(item.batch.frames, allocation.lod.numpy(),
                                               allocation.relevance.float().numpy(), item.vlm_frames or []):
            if self.window_start is None:
                self.window_start = frame.pts_s
            if self.every_s is not None and frame.pts_s >= self.window_start + self.every_s and self.rgb:
                out.append(self._answer(end=self.window_start + self.every_s))
                # the window this frame falls in (after a jump in pts, the windows between are empty)
                self.window_start += self.every_s * ((frame.pts_s - self.window_start) // self.every_s)
            if take:
                self._take(frame, lod, relevance)
        return out

    def _take(self, frame: Frame, lod: np.ndarray, relevance: np.ndarray) -> None:
        if self.offered % self.stride == 0:
            if len(self.rgb) == self.max_frames:  # keep frames 0, 2, 4 ... of those kept: the stride doubles
                del self.rgb[1::2], self.lod[1::2], self.relevance[1::2]
                self.stride *= 2
            if self.offered % self.stride == 0:
                self.rgb.append(frame.rgb)
                self.lod.append(lod)
                self.relevance.append(relevance)
        self.offered += 1
        self.last_pts = frame.pts_s

    def finish(self) -> Iterable[Any]:
        if self.rgb:
            return (self._answer(end=self.last_pts),)
        return ()

    def _answer(self, end: float) -> AnswerItem:
        request = AnswerRequest(stream_id=self.stream_id, frames=window_frames(self.rgb, self.pin),
                                keep=np.stack(self.lod),
                                question=self.question, t_start=float(self.window_start), t_end=float(end),
                                arrival_s=time.monotonic(), scores=np.stack(self.relevance))
        result = self.vlm.answer([request])[0]
        self.rgb, self.lod, self.relevance, self.stride, self.offered = [], [], [], 1, 0
        self.answered += 1
        return AnswerItem.of(self.stream_id, request.t_start, request.t_end, self.question, result,
                             getattr(self.vlm, "name", None))


def frame_rows(frames: list[Frame], allocation: Any) -> dict[str, np.ndarray]:
    """One batch's rows of the store's per-frame arrays (sinks.schema.FRAMES)."""
    return dict(pts=np.array([f.pts_s for f in frames], dtype=np.float64),
                frame_index=np.array([f.index for f in frames], dtype=np.int64),
                relevance=allocation.relevance.float().numpy(), tokens=allocation.tokens.numpy(),
                scene_change=allocation.scene_change.numpy(), motion=allocation.motion.float().numpy())


class SinkStage(Stage):
    """Writes every stream's homunculus sequence, gaps and answers to the store (one StreamWriter per
    stream), the overlay video of a single-stream run, and answers as JSON lines when asked.

    How each stream ends is `outcome(stream_id)` once the graph finished: "complete" (processed to its
    end), "damaged" (processed to where damage stopped decoding: done, not complete; core/damage.py)
    or "incomplete" (run: stopped; live: the source gave up). After a failure, an abort or an
    interrupt every stream is incomplete. Counters (live) are updated per stream when given.

    A stream whose writer is None is not stored (the Python API's answers and allocations unless
    asked for a store). on_frames: called with each batch's FrameAllocations, in order, after they
    were written.
    """

    name = "sink"

    def __init__(self, writers: dict[str, Any], *, outcome: Callable[[str], Outcome] = lambda stream_id: "complete",
                 overlay: Any = None, counters: dict[str, Any] | None = None, answers_out: TextIO | None = None,
                 on_frames: Callable[[list[FrameAllocation]], None] | None = None) -> None:
        self.writers, self.outcome, self.overlay, self.on_frames = writers, outcome, overlay, on_frames
        self.counters, self.answers_out = counters, answers_out
        self.interrupted = False                   # Ctrl-C / SIGTERM: no stream is complete
        # told of each answer / gap once the store has it (the server's events; set by run_live)
        self.on_answer: Callable[[AnswerItem], None] | None = None
        self.on_gap: Callable[[str, Any], None] | None = None
        self.late_gaps: Callable[[], list[tuple[str, Any]]] = lambda: []   # live: outages no frame ended
        self.ending_attrs: Callable[[str], dict[str, Any]] = lambda stream_id: {}   # live: how each one ended
        self.frames_written = 0
        self.last_pts: dict[str, float] = {}      # per stream: its last stored frame's pts
        self.answers: list[AnswerItem] = []
        self._closed = False

    def process(self, item: Any) -> Iterable[Any]:
        if isinstance(item, (AnswerItem, AnswerItems)):
            for answers in _by_stream(item.items if isinstance(item, AnswerItems) else [item]):
                self._answers(answers)
            return ()
        sid = item.batch.stream_id
        writer = self.writers[sid]
        gap = getattr(item.batch, "gap", None)
        if gap is not None:
            self._gap(sid, gap)
        allocation = item.wait()
        frames = item.batch.frames
        rows = frame_rows(frames, allocation)
        if writer is not None:
            writer.append(**rows)
        if self.overlay is not None:
            for f, tok, rel in zip(frames, rows["tokens"], rows["relevance"]):
                self.overlay.write(f.host_rgb(), tok, rel)
        if self.on_frames is not None:
            self.on_frames([FrameAllocation(sid, float(rows["pts"][k]), int(rows["frame_index"][k]),
                                            rows["relevance"][k].copy(), rows["tokens"][k].copy(),
                                            bool(rows["scene_change"][k]), float(rows["motion"][k]))
                            for k in range(len(frames))])
        self.frames_written += len(frames)
        self.last_pts[sid] = frames[-1].pts_s
        if self.counters is not None:
            counters, now = self.counters[sid], time.time()
            counters.frames_out += len(frames)
            counters.out_times.extend([now] * len(frames))
            counters.frame_latency.extend(now - f.arrival_s for f in frames if f.arrival_s is not None)
        return ()

    def _gap(self, sid: str, gap: Any) -> None:
        writer = self.writers.get(sid)
        if writer is not None:
            writer.add_gap(start_pts=gap.start_pts, end_pts=gap.end_pts, start_wall=gap.start_wall,
                           end_wall=gap.end_wall, reason=gap.reason)
        if self.counters is not None:
            self.counters[sid].gaps += 1
        if self.on_gap is not None:
            self.on_gap(sid, gap)

    def _answers(self, answers: list[AnswerItem]) -> None:
        sid = answers[0].stream_id
        if self.writers.get(sid) is not None:
            self.writers[sid].add_answers([a.row() for a in answers])   # one commit: all or none
        self.answers += answers
        if self.on_answer is not None:
            for a in answers:
                self.on_answer(a)
        if self.counters is not None:
            self.counters[sid].answers += len(answers)
            self.counters[sid].answer_latency.extend(a.latency_s for a in answers)
        if self.answers_out is not None:
            for a in answers:
                self.answers_out.write(json.dumps({
                    "stream": a.stream_id, "t_start": round(a.t_start, 3), "t_end": round(a.t_end, 3),
                    "question": a.question, "text": a.text, "no_answer": a.no_answer, "tokens_kept": a.tokens_kept,
                    "tokens_full": a.tokens_full, "latency_s": round(a.latency_s, 4), "passes": a.passes,
                    "tokens_spent": a.tokens_spent}) + "\n")
            self.answers_out.flush()

    def finish(self) -> Iterable[Any]:
        try:
            for sid, gap in self.late_gaps():
                self._gap(sid, gap)
        finally:
            self._close(failed=False)
        return ()

    def close(self) -> None:
        self._close(failed=True)   # only reached without finish() after a failure or an abort

    def _close(self, failed: bool) -> None:
        if self._closed:
            return
        self._closed = True
        errors = []
        try:
            if self.overlay is not None:
                self.overlay.close()
        except Exception as e:
            errors.append(e)
        for sid, writer in self.writers.items():
            if writer is None:
                continue
            outcome = "incomplete" if failed or self.interrupted else self.outcome(sid)
            try:
                damaged = outcome == "damaged"        # core/damage.py: done up to the damage, not complete
                writer.close(complete=outcome == "complete", damaged=damaged,
                             truncated_at_s=self.last_pts.get(sid) if damaged else None, attrs=self.ending_attrs(sid))
            except Exception as e:  # close every writer; report the first failure
                errors.append(e)
        if errors:
            raise errors[0]


def _by_stream(answers: list[AnswerItem]) -> list[list[AnswerItem]]:
    groups: dict[str, list[AnswerItem]] = {}
    for a in answers:
        groups.setdefault(a.stream_id, []).append(a)
    return list(groups.values())


def _record_stream(texture: Texture, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator that stream B uses tensors made on stream A."""
    for value in vars(texture).values():
        if isinstance(value, torch.Tensor) and value.is_cuda:
            value.record_stream(stream)
