"""The vision tower replayed as a CUDA graph, one per (temporal patches, patch grid).

Run eagerly, Qwen2-VL-2B's 32 vision blocks launch about 600 kernels for a window, and with the
batch path's other threads competing for the GIL the host, not the GPU, sets the pace (in
`pipeline batch` the eager tower took several times its GPU time: docs/performance.md). A graph
replays those launches in one call.

What a graph needs, and how it gets it:
- No host reads while capturing. HF computes the tower's grid-derived inputs (rotary position ids,
  the frame blocks' `cu_seqlens`, Qwen2.5-VL's window order and window blocks) from `grid_thw` with
  `.tolist()` and `repeat_interleave`; its forward takes them precomputed as keyword arguments
  (`transformers.vision_utils`), so `grid_inputs` makes them once per graph. The batched attention's
  plans (vision_attention) are kept with the graph: its warm-up reads the window lengths once.
- Fixed shapes. Frames go through the tower independently (attention within a frame pair, or within
  windows of it; position ids, norms, MLPs and the 2x2 merge per patch), so a window of T temporal
  patches runs in the graph of ceil(T / T_BUCKET) * T_BUCKET patches: the extra frame pairs compute
  on whatever the buffer holds and their tokens are dropped. Same-size videos are one longer video
  to the tower, so a batch of them replays one graph too.

Without `transformers.vision_utils` (transformers older than the precomputed inputs), or where a
capture fails, the tower runs eagerly as before (`VisionGraphs.enabled` says which). Built with
capture_graphs=False (off CUDA), it only keeps the keys a GPU would capture graphs for (each new one
goes to LEDGER) and the tower runs eagerly: a CPU run tells which shapes warm-up must cover.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from pipeline.runtime.cuda import LEDGER, capture
from pipeline.vlm import hf, qwen3_vl
from pipeline.vlm.vision_attention import batched_attention

T_BUCKET = 2          # temporal patches (frame pairs) a graph's length is a multiple of
MAX_GRAPHS = 8        # graphs kept per VLM, least recently used dropped first


def grid_inputs(visual: nn.Module, grid_thw: torch.Tensor) -> dict[str, Any] | None:
    """The keyword arguments that let HF's Qwen2-VL / Qwen2.5-VL vision forward skip computing its
    grid-derived inputs (and the host reads that takes); None where this transformers lacks them."""
    vu = hf.vision_utils()
    if vu is None:
        return None
    merge = visual.spatial_merge_size
    inputs: dict[str, Any] = {"position_ids": vu.get_vision_position_ids(grid_thw, merge)}
    inputs["cu_seqlens"], max_seqlen = vu.get_vision_attention_seqlens(grid_thw, visual.config)
    if max_seqlen is not None:                                       # flash attention only
        inputs["max_seqlen"] = max_seqlen
    if hasattr(visual, "fullatt_block_indexes"):                     # Qwen2.5-VL: windowed layers
        inputs["window_index"], inputs["cu_window_seqlens"] = vu.get_vision_window_index(
            grid_thw, spatial_merge_size=merge, window_size=visual.window_size, patch_size=visual.patch_size)
        cu = inputs["cu_window_seqlens"]
        if max_seqlen is not None:
            inputs["max_window_seqlen"] = int((cu[1:] - cu[:-1]).max())
    if qwen3_vl.has_deepstack(visual):                               # Qwen3-VL: learned positions resampled
        inputs.update(qwen3_vl.grid_interpolation(visual, grid_thw))
    # on the tower's device (HF makes the window order on the host): a graph cannot copy them in
    device = next(visual.parameters()).device
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


class VisionGraph:
    """The tower over (T, gh, gw) patches (one video's frames, merged tokens out), captured once."""

    def __init__(self, visual: nn.Module, grid: tuple[int, int, int], dtype: torch.dtype, pool: Any) -> None:
        T, gh, gw = grid
        device = next(visual.parameters()).device
        grid_thw = torch.tensor([grid], device=device)
        self.inputs = grid_inputs(visual, grid_thw)
        if self.inputs is None:
            raise RuntimeError("this transformers cannot take the vision tower's grid inputs precomputed")
        features = visual.patch_embed.proj.weight[0].numel()             # C x temporal x patch x patch
        self.pixels = torch.zeros(T * gh * gw, features, dtype=dtype, device=device)
        self.plans: dict = {}
        self.block = gh * gw                                             # patches per frame pair

        def forward() -> torch.Tensor:
            with batched_attention(self.block, self.plans):
                out = visual(self.pixels, grid_thw=grid_thw, **self.inputs)
            return hf.tower_tokens(out)
        self.graph, self.merged = capture(forward, torch.cuda.Stream(device), pool, label=label(grid))

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (n, F) of the first n rows -> their merged tokens (n / merge^2, D), a copy."""
        n = pixels.shape[0]
        self.pixels[:n].copy_(pixels)
        self.graph.replay()
        return self.merged[:n * self.merged.shape[0] // self.pixels.shape[0]].clone()


class VisionGraphs:
    """A VLM's vision graphs, keyed by (T bucket, gh, gw); `enabled` turns off for good at the first
    capture that fails (the tower then runs eagerly)."""

    def __init__(self, visual: nn.Module, dtype: torch.dtype, pool_fn, capture_graphs: bool = True) -> None:
        self.visual, self.dtype, self.pool_fn, self.capture_graphs = visual, dtype, pool_fn, capture_graphs
        self.graphs: OrderedDict[tuple[int, int, int], VisionGraph | None] = OrderedDict()  # None: planned only
        self.enabled = _has_vision_utils()
        self.captured = 0

    def __call__(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor | None:
        """All videos' patches (same gh, gw; grids [[t, gh, gw], ...]) -> their merged tokens
        (sum t gh gw / merge^2, D), or None where no graph runs them (the caller runs the tower)."""
        if not self.enabled or len({(h, w) for _, h, w in grids}) != 1:
            return None
        T = sum(t for t, _, _ in grids)
        _, gh, gw = grids[0]
        key = (-(-T // T_BUCKET) * T_BUCKET, gh, gw)
        known = key in self.graphs
        graph = self.graphs.pop(key, None)
        if not known:
            LEDGER.shape(label(key))
        if not self.capture_graphs:
            self._keep(key, None)
            return None
        if graph is None:
            try:
                graph = VisionGraph(self.visual, key, self.dtype, self.pool_fn())
            except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly from now on
                self.enabled = False
                warnings.warn(f"vision tower CUDA graph capture failed, it runs eagerly: {e}", RuntimeWarning,
                              stacklevel=2)
                return None
            self.captured += 1
        self._keep(key, graph)
        return graph(pixels)

    def _keep(self, key: tuple[int, int, int], graph: VisionGraph | None) -> None:
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        self.graphs[key] = graph                                          # most recently used last


def label(key: tuple[int, int, int]) -> str:
    return f"vision T={key[0]} grid={key[1]}x{key[2]}"


def _has_vision_utils() -> bool:
    return hf.vision_utils() is not None
