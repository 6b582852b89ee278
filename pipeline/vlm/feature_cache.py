"""Per-stream vision features reused across live answer windows (VLMConfig.reuse_cells).

A live stream asks about its latest few seconds every `--every` seconds, and most of a steady view
does not change between two windows. With `vlm.encode: kept` the vision tower runs on the cells a
window keeps; a cell whose pixels (both frames of its pair) are unchanged since the stream last
encoded it is not encoded again: its merged token comes from here.

Unchanged: the mean absolute colour change per pixel of the cell (0..1 units, each frame of the
pair apart) stays under `threshold`. That bounds the change of the cell's mean colour, so at the
same threshold (both default to 0.04) a cell reused here is one the temporal realizer's redundancy
test (arr_coc/realizing.py: |change of the cell's mean colour|) also calls unchanged; it is
stricter where a texture moves inside a cell whose mean colour stays. Vision features do not depend on the
frame's time (the tower's rotary is 2-D), so a cell's entry serves any later pair.

What is reused is the token as it was encoded: the vision tower's attention mixes the patches
encoded together (a frame pair's kept cells; Qwen2.5-VL: its windows), so a reused token equals a
fresh encode exactly when the rest of what was encoded with it is unchanged too, and differs by
that context otherwise. Cells encoded afresh next to reused ones attend only among the fresh ones.

Bounded: one entry per spatial cell at most, `cells` entries per stream (least recently used
dropped first), MAX_STREAMS streams (least recently asked dropped first). `drop(key)` empties a
stream: the caller does it on a scene change (a cut, a reconnect), so nothing from another shot
is reused; a new grid (frame size) starts the stream over too.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

MAX_STREAMS = 64      # streams whose features are kept, least recently asked dropped first


@dataclass
class _Stream:
    grid: tuple[int, int]          # (gh, gw) the entries belong to
    slot_of: torch.Tensor          # (gh*gw,) long: the slot holding each spatial cell, -1 none
    cell_of: torch.Tensor          # (S,) long: the spatial cell in each slot, -1 free
    stamp: torch.Tensor            # (S,) long: request count when the slot was last used, -1 free
    clock: int = 0                 # requests of this stream so far
    features: torch.Tensor | None = None   # (S, D) merged tokens
    pixels: torch.Tensor | None = None     # (S, m^2, F) the patches they were encoded from


class FeatureCache:
    """Vision features of cells, per stream key (thread-safe). `std`: the preprocessor's per-channel
    normalization (pixels are (x * rescale - mean) / std, so a change times std is in 0..1 units);
    `temporal`: frames per patch row (its features are laid out (C, temporal, p, p))."""

    def __init__(self, cells: int, threshold: float, std: tuple[float, ...], temporal: int,
                 max_streams: int = MAX_STREAMS) -> None:
        if cells < 1 or max_streams < 1:
            raise ValueError(f"FeatureCache needs cells >= 1 and max_streams >= 1, got {cells}, {max_streams}")
        self.cells, self.threshold, self.temporal, self.max_streams = cells, threshold, temporal, max_streams
        self.std = torch.tensor(std, dtype=torch.float32)
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._lock = threading.Lock()

    def drop(self, key: str) -> None:
        with self._lock:
            self._streams.pop(key, None)

    def __len__(self) -> int:
        """Cells cached over all streams."""
        with self._lock:
            return sum(int((s.cell_of >= 0).sum()) for s in self._streams.values())

    def cached(self, key: str) -> int:
        with self._lock:
            s = self._streams.get(key)
            return 0 if s is None else int((s.cell_of >= 0).sum())

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for s in self._streams.values()
                       for t in (s.features, s.pixels) if t is not None)

    def lookup(self, key: str, grid: tuple[int, int], cells: torch.Tensor,
               pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A new request of stream `key` on a (gh, gw) grid: cells (n,) flat indices into its
        (T', gh, gw) raster, pixels (n, m^2, F) their patches -> hit (n,) bool, the cells whose
        cached entry is unchanged, and features (n, D) (valid where hit; None: nothing cached)."""
        with self._lock:
            stream = self._stream(key, grid, pixels.device)
            stream.clock += 1
            if stream.features is None or cells.numel() == 0:
                return torch.zeros(cells.shape, dtype=torch.bool, device=cells.device), None
            slot = stream.slot_of[cells % stream.slot_of.numel()]             # (n,)
            held = slot.clamp(min=0)
            hit = (slot >= 0) & self._unchanged(pixels, stream.pixels[held])  # (n,)
            stream.stamp[slot[hit]] = stream.clock
            return hit, stream.features[held]

    def store(self, key: str, grid: tuple[int, int], cells: torch.Tensor, pixels: torch.Tensor,
              features: torch.Tensor) -> None:
        """Cells (n,) of the request lookup() began, freshly encoded from pixels (n, m^2, F) into
        features (n, D): the latest pair's of each spatial cell replace what the stream held."""
        with self._lock:
            stream = self._stream(key, grid, pixels.device)
            G = stream.slot_of.numel()
            if cells.numel() == 0:
                return
            spatial, t = cells % G, cells // G
            latest = torch.full((G,), -1, dtype=t.dtype, device=t.device).scatter_reduce(0, spatial, t, "amax")
            pick = t == latest[spatial]                                      # one entry per spatial cell
            spatial, pixels, features = spatial[pick], pixels[pick], features[pick]
            if stream.features is None:
                S = stream.cell_of.numel()
                stream.features = features.new_zeros(S, features.shape[1])
                stream.pixels = pixels.new_zeros(S, *pixels.shape[1:])
            slot = self._slots(stream, spatial)                             # (n,) -1: no room
            placed = slot >= 0
            slot = slot[placed]
            stream.features[slot] = features[placed]
            stream.pixels[slot] = pixels[placed]
            stream.stamp[slot] = stream.clock

    def _stream(self, key: str, grid: tuple[int, int], device: torch.device) -> _Stream:
        stream = self._streams.pop(key, None)
        if stream is None or stream.grid != tuple(grid):
            G = grid[0] * grid[1]
            S = min(self.cells, G)
            stream = _Stream(tuple(grid), torch.full((G,), -1, dtype=torch.long, device=device),
                             torch.full((S,), -1, dtype=torch.long, device=device),
                             torch.full((S,), -1, dtype=torch.long, device=device))
        self._streams[key] = stream                                          # most recently asked last
        while len(self._streams) > self.max_streams:
            self._streams.popitem(last=False)
        return stream

    def _slots(self, stream: _Stream, spatial: torch.Tensor) -> torch.Tensor:
        """Slots for spatial cells (n,): their own where held, else free or least recently used
        ones not used by this request (-1 where none is left)."""
        slot = stream.slot_of[spatial]
        stream.stamp[slot[slot >= 0]] = stream.clock                         # refreshed: not evicted below
        new = (slot < 0).nonzero().squeeze(1)                                # (k,)
        if new.numel():
            order = stream.stamp.argsort(stable=True)                        # free slots (-1) first
            order = order[stream.stamp[order] < stream.clock][:new.numel()]  # never this request's
            new = new[:order.numel()]
            evicted = stream.cell_of[order]
            stream.slot_of[evicted[evicted >= 0]] = -1
            stream.cell_of[order] = spatial[new]
            stream.slot_of[spatial[new]] = order
            slot[new] = order
        return slot

    def _unchanged(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """(n, m^2, F) patches now and when cached -> (n,) bool: every frame's mean |change| per
        pixel, in 0..1 colour units, under the threshold."""
        n, blocks, features = new.shape
        channels = self.std.numel()
        diff = (new - old).abs().view(n, blocks, channels, self.temporal, -1)  # (n, m^2, C, tp, p*p)
        per_channel = diff.mean(dim=(1, 4), dtype=torch.float32)             # (n, C, tp)
        change = (per_channel * self.std.to(new.device)[:, None]).mean(1)    # (n, tp) 0..1 units
        return (change < self.threshold).all(1)
