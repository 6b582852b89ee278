"""Video preprocessing on the model's device, numerically equal to HF's Qwen2-VL video processor.

Same steps as ``Qwen2VLVideoProcessor`` (transformers 5.x): smart_resize, antialiased resize with the
processor's interpolation (torchvision's rule: uint8 kernel on CPU, float kernel + clamp + round
elsewhere), fused rescale/normalize in float32, repeat the last frame to an even count, patchify into
rows ordered (t, h/merge, w/merge, merge, merge) with features (C, temporal, patch, patch).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.runtime.cuda import to_device
from pipeline.vlm.geometry import VLMGeometry

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESAMPLE_MODES = {2: "bilinear", 3: "bicubic"}  # PIL resample codes used in HF processor configs


@dataclass(frozen=True)
class VideoPreprocessor:
    geometry: VLMGeometry
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3

    def __post_init__(self) -> None:
        if self.resample not in RESAMPLE_MODES:
            raise ValueError(f"Invalid resample ({self.resample}). Supported values are "
                             f"{', '.join(f'{k} ({v})' for k, v in RESAMPLE_MODES.items())}.")

    def __call__(self, frames: np.ndarray | torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
        """frames (T, H, W, 3) uint8 RGB -> pixel_values (T'*gh_p*gw_p, 3*tp*p*p) float32, grid_thw (3,) int64
        where T' = ceil(T / tp) and (gh_p, gw_p) is the patch grid (twice the merged-token grid)."""
        video = to_device(frames, torch.device(device))
        if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != torch.uint8:
            raise ValueError(f"frames must be (T, H, W, 3) uint8, got {tuple(video.shape)} {video.dtype}")
        video = video.permute(0, 3, 1, 2)                               # (T, 3, H, W)
        video = self.resize(video)                                      # (T, 3, rh, rw) uint8
        video = self.normalize(video)                                   # (T, 3, rh, rw) float32
        return self.patchify(video)

    def resize(self, video: torch.Tensor) -> torch.Tensor:
        rh, rw = self.geometry.resized_size(*video.shape[-2:])
        if (rh, rw) == tuple(video.shape[-2:]):
            return video
        mode = RESAMPLE_MODES[self.resample]
        if video.device.type == "cpu":
            # torchvision resizes uint8 natively on CPU (fixed-point kernel); HF's processor gets that.
            return F.interpolate(video.contiguous(), size=(rh, rw), mode=mode, align_corners=False, antialias=True)
        out = F.interpolate(video.float(), size=(rh, rw), mode=mode, align_corners=False, antialias=True)
        return out.clamp_(0, 255).round_().to(torch.uint8)

    def normalize(self, video: torch.Tensor) -> torch.Tensor:
        # HF fuses rescale into normalize: (x - mean/scale) / (std/scale), computed in float32
        mean = to_device(self.image_mean, video.device, torch.float32) * (1.0 / self.rescale_factor)
        std = to_device(self.image_std, video.device, torch.float32) * (1.0 / self.rescale_factor)
        return video.to(torch.float32).sub_(mean[:, None, None]).div_(std[:, None, None])

    def patchify(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.geometry
        p, m, tp = g.patch_size, g.merge_size, g.temporal_patch_size
        if pad := -video.shape[0] % tp:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])  # HF repeats the last frame
        T, C, H, W = video.shape
        gt, gh, gw = T // tp, H // p, W // p
        x = video.view(gt, tp, C, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)                       # (gt, gh/m, gw/m, m, m, C, tp, p, p)
        pixel_values = x.reshape(gt * gh * gw, C * tp * p * p)
        return pixel_values, torch.tensor([gt, gh, gw], dtype=torch.long)
