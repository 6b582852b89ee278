"""The kept-cells vision tower (vlm.encode: kept) replayed as CUDA graphs at padded shapes.

Eager, the tower over a few hundred kept cells is bound by kernel launches, not by the GPU (figures:
docs/performance.md). The full-frame tower replays a
graph per grid (vision_graph); the kept set changes with every window, so its graphs are keyed by
padded sizes instead, and every window of about the same size replays the same one (past a few
shapes, a larger graph already captured, the smallest that fits: KeptGraphs._fitting):

- patches: the encoded cells rounded up to a bucket (CELL_BUCKETS: steps of about sqrt(2));
- attention: the blocks (frame pairs; Qwen2.5-VL: also its windows) as cumulative bounds into the
  packed patches, one varlen flash-attention call per layer (torch.nn.attention.varlen: no padding
  inside a block, no host read), their count rounded up to a power of two and the longest block's
  length bounded by a power of two; unused bounds repeat the last one (empty blocks).

The padding rows lie outside every block: no real patch attends to them, every other operation of
the tower is per row (norms, MLPs) or per merge block (the merger), and their tokens are dropped.
Qwen2.5-VL's window permutation maps them to themselves.

Built with capture=False (CPU, tests), the same padded forward runs eagerly each call; attention
then runs one SDPA per block (vision_attention.varlen_attention). Built with plan_only (off CUDA),
no graph is made: the keys a GPU would capture are kept (each new one goes to LEDGER) and the caller
runs the tower eagerly, so a CPU run tells which shapes warm-up must cover.

Warm-up (`prepare`) captures the shapes a run can ask for before it starts: every cell bucket up to
the largest call, each at the most blocks, the longest block and the most windows a call of that
many cells can have (`warm_keys`); `free_captures` 0 then makes every later call replay the smallest
of them that fits.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.runtime.cuda import LEDGER, capture
from pipeline.vlm import hf
from pipeline.vlm.vision_attention import batched_attention, varlen_available

MAX_GRAPHS = 24       # graphs kept per VLM (least recently used dropped first): live windows' kept
                      # counts move between a few buckets; warm-up captures one per bucket up to a full batch
MAX_PAD = 2           # a captured graph serves a call of up to this many times fewer cells ...
FREE_CAPTURES = 8     # ... once this many graphs exist (before, every new shape gets its own)


def _cell_buckets(limit: int = 1 << 20) -> list[int]:
    """64 * 2^(k/2) rounded up to a multiple of 32: 64, 96, 128, 192, 256, 384, 512, 736, ..."""
    out, k = [], 0
    while not out or out[-1] < limit:
        size = 64 * 2 ** (k / 2)
        out.append(int(-(-size // 32) * 32))
        k += 1
    return out


CELL_BUCKETS = _cell_buckets()


def cell_bucket(cells: int) -> int:
    """The padded cell count a tower call of `cells` cells runs at (at most ~41% extra)."""
    for size in CELL_BUCKETS:
        if size >= cells:
            return size
    raise ValueError(f"{cells} cells is more than a kept graph holds ({CELL_BUCKETS[-1]})")


def pow2_at_least(n: int, least: int) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def label(key: tuple[int, int, int, int]) -> str:
    return "kept cells={} blocks={} longest={} windows={}".format(*key)


def warm_keys(max_cells: int, max_blocks: int, frame_cells: int, units: int,
              frame_windows: int | None, limit: int = MAX_GRAPHS) -> list[tuple[int, int, int, int]]:
    """The padded shapes that serve every call of up to max_cells cells in at most max_blocks
    blocks (frame pairs) of at most frame_cells cells each (frame_windows: Qwen2.5-VL's windows per
    frame pair, None without windows): per cell bucket, its largest blocks, longest block and
    windows. More buckets than `limit`: every other one from the top (a call then pads up to 2x,
    which MAX_PAD allows)."""
    top = cell_bucket(max_cells)
    buckets = [c for c in CELL_BUCKETS if c <= top]
    if len(buckets) > limit:
        buckets = buckets[::-1][::2][::-1]
    keys = []
    for cells in buckets:
        blocks = pow2_at_least(min(cells, max_blocks), 2)
        longest = pow2_at_least(min(cells, frame_cells) * units, 64)
        windows = 0 if frame_windows is None else pow2_at_least(min(cells, max_blocks * frame_windows), 8)
        keys.append((cells, blocks, longest, windows))
    return keys


def blank_call(key: tuple[int, int, int, int], features: int, dtype: torch.dtype, device: torch.device,
               units: int, frame_grid: tuple[int, int], window_rows: int | None, sizes: bool) -> TowerCall:
    """A TowerCall of key's padded shape on blank pixels (a graph keeps no data): key's blocks (and
    windows, window_rows patches at most: Qwen2.5-VL) of equal length, never longer than the key's
    longest (rows past them lie in none, as padding does), every patch of a frame_grid (patches) frame."""
    cells, blocks, longest, windows = key
    n = cells * units

    def bounds(count: int, most: int) -> torch.Tensor:
        step = min(most, -(-n // count))
        return torch.arange(count + 1, device=device).mul(step).clamp(max=n).to(torch.int32)
    window_index = cu_window = None
    if window_rows is not None:
        window_index = torch.arange(cells, device=device)
        cu_window = bounds(windows, window_rows)
    grid = torch.tensor(frame_grid, device=device).expand(n, 2) if sizes else None
    return TowerCall(torch.zeros(n, features, dtype=dtype, device=device),
                     torch.zeros(n, 2, dtype=torch.long, device=device), bounds(blocks, longest), longest,
                     window_index, cu_window, grid)


@dataclass(frozen=True)
class TowerCall:
    """One kept tower call, packed (KeptEncoder._tower builds it): pixels (n, F) of whole merge
    blocks, positions (n, 2) their (row, column) in the patch grid, cu (S + 1,) int32 bounds of the
    full-attention blocks, longest the largest of those blocks; Qwen2.5-VL: window_index (n / m^2,),
    cu_window (W + 1,) int32 window bounds; Qwen3-VL: sizes (n, 2) each patch's frame grid (see
    hf.vision_forward_on)."""

    pixels: torch.Tensor
    positions: torch.Tensor
    cu: torch.Tensor
    longest: int
    window_index: torch.Tensor | None = None
    cu_window: torch.Tensor | None = None
    sizes: torch.Tensor | None = None

    def key(self, merge_units: int) -> tuple[int, int, int, int]:
        cells = cell_bucket(self.pixels.shape[0] // merge_units)
        windows = 0 if self.cu_window is None else pow2_at_least(self.cu_window.numel() - 1, 8)
        return (cells, pow2_at_least(self.cu.numel() - 1, 2), pow2_at_least(self.longest, 64), windows)


class KeptGraph:
    """The tower at one padded shape (cells, blocks, longest block, windows): static inputs, one
    captured forward (or, capture=False, the same forward run eagerly)."""

    def __init__(self, visual: nn.Module, key: tuple[int, int, int, int], dtype: torch.dtype, window_cells: int,
                 pool: Any, first: TowerCall, capture_graph: bool = True) -> None:
        cells, blocks, longest, windows = key
        device = next(visual.parameters()).device
        units = visual.spatial_merge_size ** 2
        n = cells * units
        features = visual.patch_embed.proj.weight[0].numel()             # C x temporal x patch x patch
        self.units = units
        self.pixels = torch.zeros(n, features, dtype=dtype, device=device)
        self.positions = torch.zeros(n, 2, dtype=first.positions.dtype, device=device)
        self.cu = torch.zeros(blocks + 1, dtype=torch.int32, device=device)
        self.grid = torch.tensor([[1, 1, n]], device=device)             # unused: every grid input is given
        self.sizes = None if first.sizes is None else torch.ones(n, 2, dtype=first.sizes.dtype, device=device)
        self.plans: dict = {(self.cu.data_ptr(), self.cu.numel(), n): ("varlen", longest)}
        self.window_index = self.cu_window = None
        if windows:
            self.window_index = torch.arange(cells, device=device)
            self.cu_window = torch.zeros(windows + 1, dtype=torch.int32, device=device)
            self.plans[(self.cu_window.data_ptr(), self.cu_window.numel(), n)] = (
                "varlen", window_cells * units)

        def forward() -> torch.Tensor:
            with batched_attention(None, self.plans):
                return hf.vision_forward_on(visual, self.pixels, self.grid, self.positions, self.cu,
                                            self.window_index, self.cu_window, self.sizes)
        self._forward = forward
        self._fill(first)
        self.graph = None
        if capture_graph:
            self.graph, self.merged = capture(forward, torch.cuda.Stream(device), pool, label=label(key))

    def _fill(self, call: TowerCall) -> None:
        n, S = call.pixels.shape[0], call.cu.numel()
        self.pixels[:n].copy_(call.pixels)
        self.positions[:n].copy_(call.positions)
        if self.sizes is not None:
            self.sizes[:n].copy_(call.sizes)
        self.cu[:S].copy_(call.cu)
        self.cu[S:].fill_(n)                                             # empty blocks; padding rows in none
        if self.window_index is not None:
            c, W = n // self.units, call.cu_window.numel()
            self.window_index[:c].copy_(call.window_index)
            self.window_index[c:].copy_(torch.arange(c, self.window_index.numel(), device=self.pixels.device))
            self.cu_window[:W].copy_(call.cu_window)
            self.cu_window[W:].fill_(n)

    def __call__(self, call: TowerCall, filled: bool = False) -> torch.Tensor:
        """-> the merged tokens (n / m^2, D) of call's patches, a copy."""
        if not filled:
            self._fill(call)
        cells = call.pixels.shape[0] // self.units
        if self.graph is None:
            return self._forward()[:cells]
        self.graph.replay()
        return self.merged[:cells].clone()


class KeptGraphs:
    """A VLM's kept-tower graphs by padded shape; `enabled` turns off for good where varlen
    attention is missing or a capture fails (the tower then runs eagerly, as before)."""

    def __init__(self, visual: nn.Module, dtype: torch.dtype, pool_fn, capture_graphs: bool = True,
                 plan_only: bool = False) -> None:
        self.visual, self.dtype, self.pool_fn, self.capture_graphs = visual, dtype, pool_fn, capture_graphs
        self.plan_only = plan_only
        self.window = hf.vision_window_cells(visual)
        # None: a key planned only (plan_only)
        self.graphs: OrderedDict[tuple[int, int, int, int], KeptGraph | None] = OrderedDict()
        device = next(visual.parameters()).device
        # flash attention: half precision on CUDA (the eager reference serves any dtype, on the CPU)
        self.enabled = (hf.vision_utils() is not None and
                        (plan_only or not capture_graphs or (varlen_available() and device.type == "cuda"
                                                             and dtype in (torch.float16, torch.bfloat16))))
        self.captured = 0
        self.free_captures = FREE_CAPTURES

    def _fitting(self, key: tuple[int, int, int, int]) -> tuple[tuple[int, int, int, int], bool, KeptGraph | None]:
        """The captured graph that runs a call of padded shape `key` (taken out of the LRU order): its
        own; else none while fewer than `free_captures` graphs exist (a shape that recurs gets its
        own, unpadded); else the smallest one at least as large in every dimension and of at most
        MAX_PAD times its cells; else none. Live windows' kept counts move with what changed in each
        stream, and a capture costs a few forward passes: past a few shapes, a larger graph serving
        a smaller call bounds how many get captured. -> (key, found, graph)."""
        if key in self.graphs:
            return key, True, self.graphs.pop(key)
        if len(self.graphs) < self.free_captures:
            return key, False, None
        fits = [k for k in self.graphs if all(a >= b for a, b in zip(k, key)) and k[0] <= MAX_PAD * key[0]]
        if not fits:
            return key, False, None
        best = min(fits)                                                 # fewest cells first
        return best, True, self.graphs.pop(best)

    def __call__(self, call: TowerCall) -> torch.Tensor | None:
        """call's merged tokens (n / m^2, D), or None where no graph runs it (the caller runs the tower)."""
        if not self.enabled:
            return None
        units = self.visual.spatial_merge_size ** 2
        try:
            key = call.key(units)
        except ValueError:
            return None
        key, found, graph = self._fitting(key)
        if self.plan_only:
            if not found:
                LEDGER.shape(label(key))
            self._keep(key, None)
            return None
        filled = False
        if graph is None:
            LEDGER.shape(label(key))
            graph = self._make(key, call)
            if graph is None:
                return None
            filled = True
        self._keep(key, graph)
        return graph(call, filled)

    def prepare(self, key: tuple[int, int, int, int], call: TowerCall) -> None:
        """Capture the graph of `key` now (warm-up; call: blank_call's), unless it exists."""
        if not self.enabled or key in self.graphs:
            return
        LEDGER.shape(label(key))
        graph = None if self.plan_only else self._make(key, call)
        if graph is not None or self.plan_only:
            self._keep(key, graph)

    def _make(self, key: tuple[int, int, int, int], call: TowerCall) -> KeptGraph | None:
        try:
            pool = self.pool_fn() if self.capture_graphs else None
            graph = KeptGraph(self.visual, key, self.dtype, (self.window or 1) ** 2, pool, call, self.capture_graphs)
        except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly from now on
            self.enabled = False
            warnings.warn(f"kept vision tower CUDA graph capture failed, it runs eagerly: {e}", RuntimeWarning,
                          stacklevel=2)
            return None
        self.captured += 1
        return graph

    def _keep(self, key: tuple[int, int, int, int], graph: KeptGraph | None) -> None:
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        self.graphs[key] = graph                                         # most recently used last
