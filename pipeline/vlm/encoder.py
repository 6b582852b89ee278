"""The vision side of the engine: frames -> merged visual tokens, on every patch (vlm.encode: all,
a replayed graph where one runs them) or on the kept cells' patches only (kept: KeptEncoder)."""
from __future__ import annotations

import numpy as np
import torch

from arr_coc.lod import token_frames
from pipeline.runtime.requests import AnswerRequest
from pipeline.vlm import hf
from pipeline.vlm.kept_graph import blank_call, warm_keys
from pipeline.vlm.kept_vision import KeptEncoder, KeptFeatures
from pipeline.vlm.preprocess import VideoPreprocessor
from pipeline.vlm.vision_attention import batched_attention
from pipeline.vlm.vision_graph import T_BUCKET, VisionGraphs
from pipeline.vlm_config import VLMConfig


class VisionEncoder:
    """The vision tower of one model with its preprocessing, graphs and kept-cell encoder."""

    def __init__(self, visual, preprocessor: VideoPreprocessor, kept_encoder: KeptEncoder, *, config: VLMConfig,
                 dtype: torch.dtype, device: torch.device, vision_graphs: VisionGraphs | None) -> None:
        self._visual, self.preprocessor, self.kept_encoder = visual, preprocessor, kept_encoder
        self.config, self.dtype, self.device = config, dtype, device
        self._vision_graphs = vision_graphs

    @property
    def geometry(self):
        return self.preprocessor.geometry

    @torch.no_grad()
    def warm_up(self, frame_sizes, window_frames: int, max_batch: int) -> None:
        """Capture now the tower graphs that batches of up to max_batch windows of up to
        window_frames frames of these (height, width) sizes will replay: encode kept, every
        padded shape (kept_graph.warm_keys) up to all their cells, after which every call replays
        the smallest captured graph that fits; encode all, each temporal bucket of the full-frame
        tower. Graph caches that only plan (off CUDA) record the same shapes."""
        g = self.geometry
        pairs = max_batch * token_frames(window_frames, g.temporal_patch_size)  # frame pairs in a batch, at most
        kept = self.kept_encoder.graphs
        for height, width in frame_sizes:
            gh, gw = g.grid(height, width)
            if self.config.encode == "kept" and kept is not None and kept.enabled:
                side = kept.window
                windows = None if side is None else -(-gh // side) * -(-gw // side)
                units = g.merge_size ** 2
                features = self._visual.patch_embed.proj.weight[0].numel()
                for key in warm_keys(pairs * gh * gw, pairs, gh * gw, units, windows):
                    kept.prepare(key, blank_call(key, features, self.dtype, self.device, units,
                                                 (gh * g.merge_size, gw * g.merge_size),
                                                 None if side is None else side * side * units,
                                                 self.kept_encoder.per_patch_sizes))
                kept.free_captures = 0       # from now on a call replays the smallest captured graph that fits
            elif self.config.encode == "all" and self._vision_graphs is not None:
                frames_per_pair = g.temporal_patch_size
                for t in range(T_BUCKET, pairs + T_BUCKET, T_BUCKET):
                    self.merged_tokens([np.zeros((min(t, pairs) * frames_per_pair, height, width, 3), np.uint8)])

    @torch.no_grad()
    def visual_tokens(self, frames: np.ndarray | torch.Tensor) -> torch.Tensor:
        merged = self.merged_tokens([frames])[0]                            # (T', gh, gw, D)
        return merged.flatten(1, 2)                                          # (T', gh*gw, D)

    def merged_tokens(self, videos: list) -> list[torch.Tensor]:
        return self.vision(*self.preprocess(videos))

    def preprocess(self, videos: list) -> tuple[torch.Tensor, torch.Tensor]:
        """-> pixels (N_patches, F) on the device, grid_thw (N, 3) on the host."""
        pixels, grids = zip(*(self.preprocessor(v, self.device) for v in videos))
        return torch.cat(pixels).to(self.dtype), torch.stack(grids)

    def vision(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """All patches through the vision tower (a replayed graph where one runs them) -> per video
        merged tokens (T', gh, gw, D)."""
        grids = grid_thw.tolist()
        merged = self._vision_graphs(pixels, grids) if self._vision_graphs is not None else None
        if merged is None:
            same_size = len({(h, w) for _, h, w in grids}) == 1
            with batched_attention(grids[0][1] * grids[0][2] if same_size else None):  # one attention call per layer
                out = self._visual(pixels, grid_thw=grid_thw.to(self.device))
            merged = hf.tower_tokens(out)                                   # (sum T'gh gw, D)
        m = self.geometry.merge_size
        sizes = [t * h * w // m**2 for t, h, w in grids]
        return [x.view(t, h // m, w // m, -1) for x, (t, h, w) in zip(merged.split(sizes), grids)]

    def encode_cells(self, frames: np.ndarray | torch.Tensor, cells: np.ndarray | torch.Tensor | None) -> KeptFeatures:
        """The vision tower on the given cells only: frames (T, H, W, 3), cells (T, gh, gw) nonzero
        where wanted (e.g. a pass's candidates) -> their merged tokens (pipeline.vlm.kept_vision)."""
        return self.kept_encoder.encode(frames, cells)

    def window_tokens(self, requests: list[AnswerRequest], keeps: list | None = None) -> list[torch.Tensor]:
        """Per request merged tokens (T', gh, gw, D) to select from: every cell's (encode: all), or
        the kept cells' only, zeros elsewhere (encode: kept); keeps: the requests' keep maps, where
        their masks are to be worked out (VLM._window_prefixes: on the host for a map that came
        from there; default: theirs)."""
        if self.config.encode == "all":
            return self.merged_tokens([r.frames for r in requests])
        reuse = [(r.reuse_key, r.scene_change) if r.reuse_key is not None else None for r in requests]
        keeps = [r.keep for r in requests] if keeps is None else keeps
        return self.kept_encoder.merged([r.frames for r in requests], keeps, reuse)
