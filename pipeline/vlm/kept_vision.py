"""Encode only what is kept (VLMConfig.encode = "kept"): the vision tower over the patches of the
cells an allocation keeps, instead of over every patch with the tokens picked afterwards.

- The frames are preprocessed whole (resize, normalize, patchify: cheap next to the tower), then
  only the rows of the encoded cells are gathered. A cell is one merge block of m x m patches (m^2
  consecutive rows), so the merger turns each encoded cell into exactly its one token.
- Every patch keeps its true position: the tower's 2-D rotary gets the (row, column) the patch has
  in the full patch grid, as the stock forward gives it, and the LM gets each token's M-RoPE
  position from the full (unpruned) sequence (VLM.window_prefix, as for `encode: all`).
- Qwen2-VL's blocks attend within a frame pair. Here they attend among the encoded patches of each
  frame pair: cells that are not encoded are not context, which is where a kept token differs from
  the stock one. With every cell encoded the tokens are the stock encoder's.
- Qwen2.5-VL attends within windows of 112x112 px (4x4 cells) in most blocks and over the whole
  frame pair in `fullatt_block_indexes` (4 of the 7B's 32). Here the unit is the window: every cell
  of a window that holds a kept cell is encoded, so the windowed blocks compute what they compute in
  the stock forward (given the same input). The full-attention blocks see the encoded windows of the
  pair, not the others: the deviation from the stock tokens enters there (and, through them, the
  windowed blocks after the first of them). Tokens of cells encoded only to complete a window are
  dropped after the merger. With `vlm.kept_windows: cells` only the kept cells are encoded (about
  2.4x fewer for the 7B at 10%: 416 against 1008 cells of 32 frames at 448x448); each windowed
  block then attends among the kept cells of each window, so the deviation starts at the first block.
- Qwen3-VL attends within a frame group like Qwen2-VL; its tower adds learned position embeddings
  resampled to each frame's grid, so each encoded patch gets its own frame's grid size too, and its
  tokens come with the DeepStack features of the encoded patches' own hidden states
  (qwen3_vl.tower_on): a kept token's features never mix in a cell that was not encoded.
- LOD-2 cells (pooled 2x2 blocks) are encoded like full ones; the pooled token is the mean of their
  merged tokens (selection.select_tokens).
- Live reuse: with a stream key, cells unchanged since that stream last encoded them are not encoded
  again; their tokens come from pipeline.vlm.feature_cache (see there for what "unchanged" is).

Speed: on CUDA with vlm.cuda_graphs the tower replays a graph captured at a padded shape (kept_graph:
cells, blocks and windows rounded up to buckets, varlen flash attention within the blocks), since the
kept set changes with every window and the full-frame graphs (vision_graph) are fixed per grid.
Otherwise the batched attention (vision_attention) runs with ragged blocks (one host read of the
block lengths per boundary tensor) and the fast blocks (vision_blocks) as for every patch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from arr_coc.lod import pad_to_pairs, token_frames
from pipeline.runtime.cuda import device_of, read_back, to_device, upload
from pipeline.vlm import hf, qwen3_vl
from pipeline.vlm.feature_cache import FeatureCache
from pipeline.vlm.kept_graph import KeptGraphs, TowerCall
from pipeline.vlm.preprocess import VideoPreprocessor
from pipeline.vlm.vision_attention import batched_attention


@dataclass(frozen=True)
class KeptFeatures:
    """Merged tokens of the cells of one video that were asked for: tokens (K, D), their flat index
    (K,) in the (T', gh, gw) raster (ascending, the model's token order), and that grid."""

    tokens: torch.Tensor
    index: torch.Tensor
    grid: tuple[int, int, int]

    def dense(self) -> torch.Tensor:
        """(T', gh, gw, D): the tokens at their cells, zeros elsewhere (VLM.window_prefix's input)."""
        Tp, gh, gw = self.grid
        out = self.tokens.new_zeros(Tp * gh * gw, self.tokens.shape[-1])     # (T' gh gw, D)
        out[self.index] = self.tokens
        return out.view(Tp, gh, gw, -1)


def nonzero_each(masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """[mask.nonzero().squeeze(1) for mask in masks] (1-D bool masks) with two host reads in all,
    not one per mask."""
    if len(masks) <= 1:
        return [mask.nonzero().squeeze(1) for mask in masks]
    starts = [0, *itertools.accumulate(mask.numel() for mask in masks)]
    index = torch.cat(masks).nonzero().squeeze(1)                            # (sum n,) ascending
    cuts = torch.searchsorted(index, torch.tensor(starts, device=index.device)).tolist()
    return [index[a:b] - start for a, b, start in zip(cuts, cuts[1:], starts)]


def any_on_device(maps: list) -> bool:
    """Whether any of these maps (None, numpy or tensors) is on a device: working out its masks
    then reads it back (a host sync); maps on the host read nothing."""
    return any(m is not None and device_of(m).type != "cpu" for m in maps)


def pair_cells(cells: torch.Tensor, temporal_patch: int) -> torch.Tensor:
    """(T, gh, gw) per-frame map, nonzero = wanted -> (T', gh, gw) bool per video token: wanted when
    either frame of its pair wants it (the LOD pairing rule, arr_coc/lod.py)."""
    return pad_to_pairs(cells != 0, temporal_patch).any(1)                  # (T', gh, gw)


def window_cells(wanted: torch.Tensor, side: int) -> torch.Tensor:
    """(T', gh, gw) bool -> every cell of each side x side window (Qwen2.5-VL's, anchored at the top
    left, edge windows cut by the grid) that holds a wanted cell."""
    Tp, gh, gw = wanted.shape
    x = F.pad(wanted, (0, -gw % side, 0, -gh % side))                       # (T', gh2, gw2)
    hit = x.view(Tp, x.shape[1] // side, side, x.shape[2] // side, side).any(4).any(2)  # (T', wh, ww)
    return hit.repeat_interleave(side, 1).repeat_interleave(side, 2)[:, :gh, :gw]


def context_cells(wanted: torch.Tensor, radius: int) -> torch.Tensor:
    """(T', gh, gw) bool -> wanted, and every cell within `radius` cells of a wanted one (a square
    neighbourhood in the same frame pair, cut by the grid): vlm.kept_context."""
    if radius <= 0:
        return wanted
    size = 2 * radius + 1
    return F.max_pool2d(wanted[:, None].float(), size, stride=1, padding=radius)[:, 0] > 0


def patch_positions(cells: np.ndarray, gh: int, gw: int, merge: int) -> np.ndarray:
    """cells (n,) flat in (T', gh, gw) (host) -> (n * merge^2, 2) int64 (row, column) of their
    patches in the patch grid, in the tower's row order (cell by cell, each merge block row-major)."""
    h, w = np.divmod(np.asarray(cells, dtype=np.int64) % (gh * gw), gw)     # (n,)
    sub = np.arange(merge)
    shape = (h.size, merge, merge)
    rows = np.broadcast_to(h[:, None, None] * merge + sub[None, :, None], shape)
    cols = np.broadcast_to(w[:, None, None] * merge + sub[None, None, :], shape)
    return np.stack([rows.ravel(), cols.ravel()], -1)                       # (n m m, 2)


def window_order(cells: np.ndarray, gh: int, gw: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """cells (n,) flat in (T', gh, gw), ascending (host) -> (order (n,), lengths (W,)): the cells in
    Qwen2.5-VL's window order (pair, window row, window column, then row-major inside the window)
    and how many cells each non-empty window holds, in that order."""
    t, spatial = np.divmod(np.asarray(cells, dtype=np.int64), gh * gw)
    h, w = np.divmod(spatial, gw)
    windows_w = -(-gw // side)
    window = (t * -(-gh // side) + h // side) * windows_w + w // side          # (n,)
    order = np.argsort(window * side * side + (h % side) * side + w % side, kind="stable")
    _, lengths = np.unique(window[order], return_counts=True)              # ascending: the windows in order
    return order, lengths


@dataclass
class _Job:
    """One video's part of a tower call."""
    blocks: torch.Tensor | None        # (T' gh gw, m^2, F) its patches, merge block by merge block
    grid: tuple[int, int, int]         # (T', gh, gw) merged grid
    wanted: torch.Tensor | None = None  # (K,) cells asked for, ascending
    encoded: torch.Tensor | None = None  # (n,) cells through the tower, ascending: wanted less reused,
                                       # Qwen2.5-VL: completed to whole windows
    cells: np.ndarray | None = None    # encoded, on the host
    reused: int = 0                    # wanted cells taken from the cache
    key: str | None = None             # feature-cache stream
    cached: torch.Tensor | None = None  # (K, D) cached tokens of the wanted cells (valid where reused)


@dataclass
class _Plan:
    """What a tower call needs besides the pixels (see TowerCall): the bounds of its full-attention
    blocks, the longest, the patches' positions (and Qwen3-VL: frame grids), and for Qwen2.5-VL
    its window permutation and window bounds; all worked out on the host, uploaded in one copy."""
    cu: torch.Tensor
    longest: int
    positions: torch.Tensor                  # (n m^2, 2) each encoded patch's (row, column)
    sizes: torch.Tensor | None = None        # Qwen3-VL: (n m^2, 2) each patch's frame grid (in patches)
    window_index: torch.Tensor | None = None
    cu_window: torch.Tensor | None = None


class KeptEncoder:
    """The vision tower over chosen cells of videos (see the module doc): `dim`, its tokens' width
    (the LM's); `cache`: live reuse; `graphs`: the tower replayed at padded shapes (kept_graph);
    `whole_windows` (Qwen2.5-VL, vlm.kept_windows): every cell of a window holding a kept cell is
    encoded (false: the kept cells only, which then see each other only in the windowed layers);
    `context` (vlm.kept_context): cells within this many cells of a kept one are encoded too, as
    context, and not returned."""

    def __init__(self, visual: nn.Module, preprocessor: VideoPreprocessor, dtype: torch.dtype, dim: int,
                 cache: FeatureCache | None = None, graphs: KeptGraphs | None = None,
                 whole_windows: bool = True, context: int = 0) -> None:
        self.visual, self.preprocessor, self.dtype, self.dim, self.cache = visual, preprocessor, dtype, dim, cache
        self.graphs, self.whole_windows, self.context = graphs, whole_windows, context
        self.geometry = preprocessor.geometry
        self.window = hf.vision_window_cells(visual)
        self.per_patch_sizes = qwen3_vl.has_deepstack(visual)
        self.device = next(visual.parameters()).device
        self.counters = {"cells_encoded": 0, "cells_reused": 0}
        if graphs is not None:                     # captures so far (a live run should stop adding them)
            self.counters["graphs_captured"] = 0

    @torch.no_grad()
    def encode(self, frames: np.ndarray | torch.Tensor, cells: np.ndarray | torch.Tensor | None) -> KeptFeatures:
        """frames (T, H, W, 3) uint8, cells (T, gh, gw) per frame, nonzero = encode (an LOD map,
        pass 1's candidates; None: all) -> the merged tokens of exactly those cells (a video token
        when either frame of its pair asks for it), encoded together."""
        return self.encode_many([frames], [cells])[0]

    @torch.no_grad()
    def encode_many(self, videos: list, cell_maps: list, reuse: list | None = None) -> list[KeptFeatures]:
        """encode() of several videos in one tower call. reuse: per video None or (stream key,
        scene_change): its unchanged cells come from the feature cache (emptied first on a scene
        change), and what it encodes goes there."""
        for frames, cells in zip(videos, cell_maps):
            expected = (frames.shape[0], *self.geometry.grid(*frames.shape[1:3]))
            if cells is not None and tuple(cells.shape) != expected:
                raise ValueError(f"keep map shape {tuple(cells.shape)} does not match the VLM grid {expected} "
                                 f"for {frames.shape[2]}x{frames.shape[1]} frames")
        reuse = reuse or [None] * len(videos)
        if self.cache is not None and any(use is not None for use in reuse):
            # live reuse compares the wanted cells' pixels with the cache's: preprocess first
            pixels, grids = zip(*(self.preprocessor(frames, self.device) for frames in videos))
            return self.encode_pixels(list(pixels), list(grids), cell_maps, reuse)
        # the plan needs the cell maps only. Maps on the device are read back for it: it is worked
        # out before the frames are uploaded and preprocessed, so that the read does not wait for
        # that work (on an H200 profile of the Qwen3-VL 2B, ~1 ms of upload and kernels). Maps
        # on the host are read from nothing: the frames go first and the GPU works on them while
        # the host plans. Either way the tower is queued right after the plan.
        tp = self.geometry.temporal_patch_size
        shapes = [(token_frames(frames.shape[0], tp), *self.geometry.grid(*frames.shape[1:3])) for frames in videos]
        def preprocess() -> list[torch.Tensor]:
            return [self.preprocessor(frames, self.device)[0] for frames in videos]
        pixels = None if any_on_device(cell_maps) else preprocess()
        jobs, plan = self._jobs(shapes, None, cell_maps, reuse)
        for job, px in zip(jobs, preprocess() if pixels is None else pixels):
            job.blocks = self._blocks(px, job.grid)
        fresh = self._tower(jobs, plan)
        return [self._finish(job, tokens) for job, tokens in zip(jobs, fresh)]

    @torch.no_grad()
    def encode_pixels(self, pixels: list[torch.Tensor], grids: list[torch.Tensor], cell_maps: list,
                      reuse: list | None = None) -> list[KeptFeatures]:
        """encode_many() of preprocessed videos: pixels (N, F) and patch grid (3,) each (as
        VideoPreprocessor returns them), cell maps checked against the frames already."""
        reuse = reuse or [None] * len(pixels)
        m = self.geometry.merge_size
        shapes = []
        for grid_thw in grids:
            Tp, gh, gw = (int(v) for v in grid_thw.tolist())
            shapes.append((Tp, gh // m, gw // m))
        blocks = [self._blocks(px, shape) for px, shape in zip(pixels, shapes)]
        jobs, plan = self._jobs(shapes, blocks, cell_maps, reuse)
        fresh = self._tower(jobs, plan)
        return [self._finish(job, tokens) for job, tokens in zip(jobs, fresh)]

    def merged(self, videos: list, keeps: list, reuse: list | None = None) -> list[torch.Tensor]:
        """Per video (T', gh, gw, D) merged tokens of its kept cells (keep: (T, gh, gw) LOD, None:
        all), zeros elsewhere: what VLM.window_prefix selects from."""
        return [f.dense() for f in self.encode_many(videos, keeps, reuse)]

    def _indices(self, masks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each 1-D bool mask's nonzero index (ascending) on the device: those of host masks from
        numpy, uploaded in one copy; those of device masks in one read (nonzero_each)."""
        on_host = [i for i, m in enumerate(masks) if m.device.type == "cpu"]
        on_device = [i for i, m in enumerate(masks) if m.device.type != "cpu"]
        out: list = [None] * len(masks)
        for i, index in zip(on_device, nonzero_each([masks[i] for i in on_device])):
            out[i] = index
        for i, index in zip(on_host, upload([np.flatnonzero(masks[i].numpy()) for i in on_host], self.device)):
            out[i] = index
        return out

    def _blocks(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """A video's preprocessed pixels (N, F) -> (T' gh gw, m^2, F) in the tower's dtype."""
        m = self.geometry.merge_size
        return pixels.to(self.dtype).view(grid[0] * grid[1] * grid[2], m * m, -1)

    def _jobs(self, shapes: list, blocks: list | None, cell_maps: list,
              reuse: list) -> tuple[list[_Job], _Plan | None]:
        """Each video's part of the tower call (its cells wanted and to encode) and the call's plan,
        from the merged grids (T', gh, gw) and cell maps; blocks: the videos' patches (_blocks),
        needed here by live reuse only (None: the caller sets each job's later).
        The masks are worked out where each cell map is: a map from the host (the pipeline's
        stages hand over numpy) on the host, so reading them back reads nothing from the device;
        those on the device come back in one read (a host sync, which under live load also waits
        for the interpreter lock: one per batch, not several per video). The plan is worked out
        on the host and every index goes back in one copy. Live reuse compares the wanted cells'
        patches with the cache's on the device: the cells it then still has to encode are read
        back (one read), and maps on the device need their index read first (one more)."""
        blocks = blocks or [None] * len(shapes)
        caching = self.cache is not None and any(use is not None for use in reuse)
        wanted = []
        for (Tp, gh, gw), cells in zip(shapes, cell_maps):
            if cells is None:
                wanted.append(torch.ones(Tp * gh * gw, dtype=torch.bool))
            else:
                paired = pair_cells(to_device(cells, device_of(cells)), self.geometry.temporal_patch_size)
                wanted.append(paired.flatten())                              # (T' gh gw,)
        indices = self._indices(wanted) if caching else [None] * len(wanted)
        jobs, todo = [], []
        for b, grid, mask, index, use in zip(blocks, shapes, wanted, indices, reuse):
            job = _Job(b, grid, index)
            if use is not None and self.cache is not None:
                job.key, scene_change = use
                if scene_change:
                    self.cache.drop(job.key)
                hit, job.cached = self.cache.lookup(job.key, grid[1:], index, b[index])
                # a copy on the device (the wanted mask is read back below as it is)
                mask = mask.clone() if mask.device == self.device else to_device(mask, self.device)
                mask[index[hit]] = False
            if self.context:
                mask = context_cells(mask.view(grid), self.context).flatten()
            if self.window is not None and self.whole_windows:
                mask = window_cells(mask.view(grid), self.window).flatten()
            jobs.append(job)
            todo.append(mask)
        host = read_back(todo + wanted)                                      # the one read of the batch
        for job, encode, want in zip(jobs, host, host[len(jobs):]):
            job.cells = np.flatnonzero(encode)
            job.reused = int(np.count_nonzero(want & ~encode)) if job.cached is not None else 0
        arrays = [job.cells for job in jobs] + [np.flatnonzero(w) for w in host[len(jobs):] if not caching]
        plan = self._plan(jobs)
        if plan is not None:
            arrays += plan.values()
        device = upload(arrays, self.device)
        for i, job in enumerate(jobs):
            job.encoded = device[i]
            if not caching:
                job.wanted = device[len(jobs) + i]
        if plan is None:
            return jobs, None
        tail = dict(zip(plan, device[len(device) - len(plan):]))
        return jobs, _Plan(tail["cu"].int(), int(np.diff(plan["cu"]).max()), tail["positions"].view(-1, 2),
                           tail["sizes"].view(-1, 2) if "sizes" in tail else None,
                           tail.get("window_index"), tail["cu_window"].int() if "cu_window" in tail else None)

    def _plan(self, jobs: list[_Job]) -> dict[str, np.ndarray] | None:
        """On the host, from the jobs' cells: the bounds of the tower's full-attention blocks (the
        encoded patches of each frame pair, video after video), each encoded patch's position (and
        Qwen3-VL: its frame's patch grid), and for Qwen2.5-VL its window permutation of the packed
        cells and the window bounds. None: nothing to encode."""
        m = self.geometry.merge_size
        per_pair, positions, sizes, order, window_lengths, offset = [], [], [], [], [], 0
        for job in jobs:
            if not job.cells.size:
                continue
            Tp, gh, gw = job.grid
            counts = np.bincount(job.cells // (gh * gw), minlength=Tp)
            per_pair.append(counts[counts > 0] * m * m)
            positions.append(patch_positions(job.cells, gh, gw, m))
            if self.per_patch_sizes:
                sizes.append(np.broadcast_to(np.array([gh * m, gw * m]), (job.cells.size * m * m, 2)))
            if self.window is not None:
                o, lengths = window_order(job.cells, gh, gw, self.window)
                order.append(o + offset)
                window_lengths.append(lengths * m * m)
            offset += job.cells.size
        if not per_pair:
            return None
        plan = {"cu": np.concatenate([[0], np.cumsum(np.concatenate(per_pair))]),
                "positions": np.concatenate(positions)}
        if sizes:
            plan["sizes"] = np.concatenate(sizes)
        if self.window is not None:
            plan["window_index"] = np.concatenate(order)
            plan["cu_window"] = np.concatenate([[0], np.cumsum(np.concatenate(window_lengths))])
        return plan

    def _finish(self, job: _Job, fresh: torch.Tensor) -> KeptFeatures:
        """The wanted cells' tokens: fresh where encoded, else cached; the fresh ones are cached."""
        at = torch.full((job.blocks.shape[0],), -1, dtype=torch.long, device=self.device)
        at[job.encoded] = torch.arange(job.encoded.numel(), device=self.device)
        at = at[job.wanted]                                                  # (K,) row in fresh, -1: reused
        if job.cached is None:
            tokens = fresh[at]
        else:
            tokens = job.cached
            new = at >= 0
            tokens[new] = fresh[at[new]]
        if job.key is not None and self.cache is not None:
            self.cache.store(job.key, job.grid[1:], job.encoded, job.blocks[job.encoded], fresh)
        self.counters["cells_encoded"] += job.encoded.numel()
        if job.cached is not None:                                           # without the cache all are encoded
            self.counters["cells_reused"] += job.reused
        return KeptFeatures(tokens, job.wanted, job.grid)

    def _tower(self, jobs: list[_Job], plan: _Plan | None) -> list[torch.Tensor]:
        """The encoded cells of every job through the tower in one call -> per job (n, D)."""
        m = self.geometry.merge_size
        sizes = [job.encoded.numel() for job in jobs]
        if plan is None:
            return [torch.empty(0, self.dim, dtype=self.dtype, device=self.device) for _ in jobs]
        rows, grids = [], []
        for job in jobs:
            if job.encoded.numel() == 0:
                continue
            Tp, gh, gw = job.grid
            rows.append(job.blocks[job.encoded].flatten(0, 1))               # (n m^2, F)
            grids.append([Tp, gh * m, gw * m])
        pixels = torch.cat(rows)
        merged = None
        if self.graphs is not None and self.graphs.enabled:                  # replayed at a padded shape
            merged = self.graphs(TowerCall(pixels, plan.positions, plan.cu, plan.longest, plan.window_index,
                                           plan.cu_window, plan.sizes))
            self.counters["graphs_captured"] = self.graphs.captured
        if merged is None:
            with batched_attention(None):         # blocks of unequal length: one host read per boundary tensor
                merged = hf.vision_forward_on(self.visual, pixels, torch.tensor(grids, device=self.device),
                                              plan.positions, plan.cu, plan.window_index, plan.cu_window,
                                              plan.sizes)
        return list(merged.split(sizes))                                     # (n, D) each
