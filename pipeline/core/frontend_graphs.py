"""CUDA-graph replay for the front end's steady state.

Run eagerly, texture + realize launch about a thousand small kernels per batch and the host,
not the GPU, sets the pace at any batch size. A CUDA graph records those launches once and
replays them with one call, so a batch costs what the GPU needs (benchmarks/profile_frontend.py;
figures in docs/performance.md).

A graph replays fixed shapes on fixed memory: every input (frames, the stream's last frame and
state) is copied into the graph's buffers before each replay, and the outputs are the graph's
own buffers, valid until its next replay (callers copy them out first, in stream order). The
graphs hold no state of their own, so one graph per batch shape serves every stream, and eager
batches (a stream's first) and replays interleave freely.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import fields
from typing import Any, Callable, Iterable

import torch

from arr_coc.model import ARRCOC, Allocation
from arr_coc.realizing import STATE_TENSORS, StreamState
from arr_coc.texture import Texture

from ..runtime.cuda import LEDGER, capture

STATE_FIELDS = STATE_TENSORS
# A shape no prepare() covered (a file's short last batch) runs eagerly the first time it comes and
# is captured when it comes again: in batch mode the FrontendGraphs serve video after video, and
# short last batches recur (at 2 fps a 10 s clip is one batch of 16 frames and one of 4).
CAPTURE_ON_SIGHTING = 2
TEXTURE_FIELDS = tuple(f.name for f in fields(Texture))


class GraphedCall:
    """fn(buffers) captured once on `stream`; call(**inputs) copies inputs in and replays."""

    def __init__(self, fn: Callable[[dict[str, torch.Tensor]], Any], example: dict[str, torch.Tensor],
                 stream: torch.cuda.Stream, warmup: int = 2, label: str = "frontend") -> None:
        self.buffers = {k: v.clone() for k, v in example.items()}
        self.graph, self.outputs = capture(lambda: fn(self.buffers), stream, warmup=warmup, label=label)

    def __call__(self, **inputs: torch.Tensor) -> Any:
        """Replay on the current stream; the outputs are overwritten by the next call."""
        for name, value in inputs.items():
            self.buffers[name].copy_(value, non_blocking=True)
        self.graph.replay()
        return self.outputs


class FrontendGraphs:
    """Per batch shape: one graph for extract() and one for realize() (per query shape), shared by
    all streams; the query (and its mask) is an input of the realize graphs, so one FrontendGraphs
    serves run after run of another query of the same padded length (batch: video after video).

    Each stage replays its graphs on its own CUDA stream, so two replays of one graph never overlap.
    """

    def __init__(self, model: ARRCOC, grid: tuple[int, int], query: torch.Tensor,
                 query_mask: torch.Tensor | None = None) -> None:
        self.model, self.grid, self.query, self.query_mask = model, grid, query, query_mask
        self.texture_graphs: dict[tuple, GraphedCall] = {}
        self.realize_graphs: dict[tuple, GraphedCall] = {}
        self.capture_new = True  # capture a graph for each new shape; else see CAPTURE_ON_SIGHTING
        self._prepared: set[tuple] = set()
        self._sightings: Counter[tuple] = Counter()   # of shapes without a graph, while capture_new is off
        self._flags: dict[bool, torch.Tensor] = {}     # last_real inputs, on the device
        self._streams: dict[int, torch.cuda.Stream] = {}   # the streams replays ran on, since settle()

    @torch.inference_mode()
    def prepare(self, batch: int, height: int, width: int, query: torch.Tensor | None = None,
                query_mask: torch.Tensor | None = None) -> None:
        """Capture the graphs of full (batch, H, W) batches (and this query's shape) now, during a
        run's setup, on blank frames (graphs keep no data), rather than inside its first batches
        (~0.1-0.3 s); shapes prepared before are not captured again. Other shapes (a file's short
        last batch) then run eagerly, until they come CAPTURE_ON_SIGHTING times."""
        query, query_mask = self._query(query, query_mask)
        key = (batch, height, width, tuple(query.shape), query_mask is None)
        # these shapes, now (an earlier prepare() may have closed capturing)
        self.capture_new = key not in self._prepared
        if not self.capture_new:
            return
        device = query.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the query, made on the caller's stream
        with torch.cuda.stream(stream):
            # the layout the texture stage hands over: (T, H, W, 3) uint8 viewed as (T, 3, H, W)
            frames = torch.zeros(batch, height, width, 3, dtype=torch.uint8, device=device).permute(0, 3, 1, 2)
            texture = self.model.extract(frames, None, self.grid)          # a stream's first batch
            _, state, _ = self.model.realize(texture, query, None, query_mask=query_mask)
            texture = self.extract(frames, frames[-1].clone(), stream, last_real=True)
            self.realize(texture, state, torch.ones(batch, dtype=torch.bool, device=device), stream,
                         query, query_mask)
        stream.synchronize()
        self._prepared.add(key)
        self.capture_new = False

    def _query(self, query: torch.Tensor | None, query_mask: torch.Tensor | None):
        return (self.query, self.query_mask) if query is None else (query, query_mask)

    def _may_capture(self, key: tuple) -> bool:
        if self.capture_new:
            return True
        self._sightings[key] += 1
        return self._sightings[key] >= CAPTURE_ON_SIGHTING

    def _flag(self, value: bool, device: torch.device) -> torch.Tensor:
        if value not in self._flags:
            self._flags[value] = torch.tensor(value, device=device)
        return self._flags[value]

    def extract(self, frames: torch.Tensor, last: torch.Tensor, stream: torch.cuda.Stream,
                last_real: bool = True) -> Texture | None:
        """last_real False: a stream's first batch, with last = frames[0] (ARRCOC.extract)."""
        shape = tuple(frames.shape)
        graph = self.texture_graphs.get(shape)
        if graph is None:
            LEDGER.shape(f"texture frames={shape}")
            if not self._may_capture(("texture", shape)):
                return None
        flag = self._flag(last_real, frames.device)
        if graph is None:
            graph = self.texture_graphs[shape] = GraphedCall(
                lambda b: self.model.extract(b["frames"], b["last"], self.grid, b["last_real"]),
                {"frames": frames, "last": last, "last_real": flag}, stream, label=f"texture frames={shape}")
        self._streams[id(stream)] = stream
        out = graph(frames=frames, last=last, last_real=flag)
        # the realize stage reads this on its own stream while the next batch may replay here
        return Texture(**{n: getattr(out, n).clone() for n in TEXTURE_FIELDS})

    def realize(self, texture: Texture, state: StreamState, vlm_frames: torch.Tensor,
                stream: torch.cuda.Stream, query: torch.Tensor | None = None,
                query_mask: torch.Tensor | None = None) -> tuple[Allocation, StreamState] | None:
        """query (and query_mask): this run's (default: the constructor's)."""
        query, query_mask = self._query(query, query_mask)
        shape = (tuple(texture.data.shape), tuple(query.shape), query_mask is None)
        graph = self.realize_graphs.get(shape)
        if graph is None:
            LEDGER.shape(f"realize texture={shape[0]} query={shape[1]}")
            if not self._may_capture(("realize", shape)):
                return None
        inputs = {"tex_" + n: getattr(texture, n) for n in TEXTURE_FIELDS}
        inputs.update({n: getattr(state, n) for n in STATE_FIELDS})
        inputs["vlm_frames"] = vlm_frames
        inputs["query"] = query
        if query_mask is not None:
            inputs["query_mask"] = query_mask
        if graph is None:
            graph = self.realize_graphs[shape] = GraphedCall(self._realize_step, inputs, stream,
                                                             label=f"realize texture={shape[0]} query={shape[1]}")
        self._streams[id(stream)] = stream
        allocation, new_state = graph(**inputs)
        # the next replay overwrites the outputs; the state must survive until the next batch
        return allocation, StreamState(**{n: getattr(new_state, n).clone() for n in STATE_FIELDS})

    def settle(self) -> None:
        """Wait for the replays queued so far: a run that ends aborted may leave one in flight on its
        streams, and the next run to take this set (FrontendGraphsPool) replays on streams of its own,
        into the same buffers."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.synchronize()

    def _realize_step(self, b: dict[str, torch.Tensor]) -> tuple[Allocation, StreamState]:
        texture = Texture(**{n: b["tex_" + n] for n in TEXTURE_FIELDS})
        state = StreamState(**{n: b[n] for n in STATE_FIELDS})
        allocation, new_state, _ = self.model.realize(texture, b["query"], state, query_mask=b.get("query_mask"),
                                                      vlm_frames=b["vlm_frames"])
        return allocation, new_state


def graphable(state: StreamState | None) -> bool:
    """A graph needs every state tensor to exist: after a stream's first batch they do, and
    ARRCOC.realizer.initial_state gives them for the first."""
    return state is not None and all(getattr(state, n) is not None for n in STATE_FIELDS)



def frontend_key(grid: tuple[int, int], sizes: Iterable[tuple[int, int]]) -> tuple:
    """A run's key in a FrontendGraphsPool: its grid and its frames' sizes (H, W) -- (grid, H, W)
    for one size, whether the frames come from a file or a live source."""
    return (grid, *(d for size in sorted(set(sizes)) for d in size))


class FrontendGraphsPool:
    """Front-end graphs shared by the runs of a long-lived process (the server), bounded in number.

    A run (a file request, a live stream, a chat about a live source) takes a set for its key
    (frontend_key: grid, frame size) for itself and gives it back when it ends, so a set is never
    replayed by two runs at once (give_back first waits for its last replays: settle), and the
    next run of that shape, file or live, reuses its graphs instead of capturing its own. At most
    `capacity` sets exist: a new shape replaces the least recently used idle set; when every set
    is in use the run goes eager (None). A set in use is never replaced."""

    def __init__(self, capacity: int, make: Callable[..., "FrontendGraphs | None"]) -> None:
        self.capacity, self.make = capacity, make
        self._idle: list[tuple[tuple, FrontendGraphs]] = []     # least recently used first
        self._busy = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return self._busy + len(self._idle)

    def take(self, key: tuple, *args: Any) -> "FrontendGraphs | None":
        """An idle set for key, else a new one (make(*args)) where the cap allows, else None."""
        with self._lock:
            for k, (held, graphs) in enumerate(self._idle):
                if held == key:
                    del self._idle[k]
                    self._busy += 1
                    return graphs
            if self._busy + len(self._idle) >= self.capacity:
                if not self._idle:
                    return None
                del self._idle[0]            # its graphs go with their last reference
            self._busy += 1
        graphs = None
        try:
            graphs = self.make(*args)
        finally:
            if graphs is None:
                with self._lock:
                    self._busy -= 1
        return graphs

    def give_back(self, key: tuple, graphs: "FrontendGraphs | None") -> None:
        if graphs is not None:
            graphs.settle()
            with self._lock:
                self._busy -= 1
                self._idle.append((key, graphs))
