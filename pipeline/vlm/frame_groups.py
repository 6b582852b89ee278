"""Qwen3-VL's video prompt: a textual timestamp before each frame group, and which of its slots a
pruned window keeps. Pure (token ids and torch index arithmetic, no model).

transformers' Qwen3VLProcessor writes a video of T' frame groups (temporal patches of
`temporal_patch` frames) inside the chat template's own <|vision_start|> ... <|vision_end|> as

    <|vision_start|> <t_0 seconds><|vision_start|> pad x n <|vision_end|> ... <t_T'-1 seconds>... <|vision_end|>

with n = gh x gw merged tokens a group and t_g the mean time of the group's first and last frame
(frame i at indices[i] / fps; the last index repeated to fill the last group), written "%.1f". The
answer windows here hold frames sampled at vlm.fps, so indices are 0..T-1 at that rate: the times
are seconds since the window's first frame, as the processor gives them for that clip.

Empty frame groups (vlm.empty_frame_groups): a group none of whose tokens is kept either keeps
its timestamp and markers with no visual token ("keep", the default: the prompt reads as the full
one with tokens taken out, every kept token still after the timestamp of the group it was seen
in, and the time between kept groups still stated) or loses them too ("drop": a few text tokens
fewer per empty group). Every slot kept either way sits at the position the full prompt gives it.
Keep answered better on a small Qwen3-VL trained for it (docs/models.md, docs/performance.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

EmptyGroups = Literal["keep", "drop"]
EMPTY_GROUPS = ("keep", "drop")


def group_timestamps(indices: Sequence[int], fps: float, temporal_patch: int) -> list[float]:
    """Seconds of each frame group: frame indices (in the video sampled at `fps`) -> one time per
    group of `temporal_patch` frames, the mean of its first and last frame's time."""
    if fps <= 0 or temporal_patch < 1 or not len(indices):
        raise ValueError(f"group_timestamps needs frames, fps > 0 and temporal_patch >= 1, got {len(indices)} "
                         f"frames, fps {fps}, temporal_patch {temporal_patch}")
    idx = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch)
    times = [i / fps for i in idx]
    return [(times[g] + times[g + temporal_patch - 1]) / 2 for g in range(0, len(times), temporal_patch)]


def timestamp_text(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"


@dataclass(frozen=True)
class VideoLayout:
    """The prompt up to the end of the video for one grid: ids (L,) from the first prompt token to
    the template's closing <|vision_end|>, group (L,) the frame group of each slot (-1 outside every
    group: the chat header and the template's own markers), video_slots (T' n,) the slot of each
    video token, in the merged-token raster order (t, h, w)."""
    ids: torch.Tensor
    group: torch.Tensor
    video_slots: torch.Tensor


def video_layout(before: list[int], stamps: list[list[int]], tokens_per_group: int, *,
                 vision_start: int, vision_end: int, video_token: int) -> VideoLayout:
    """before: the ids up to and including the template's <|vision_start|>; stamps: each group's
    timestamp ids -> the layout of the unpruned video prompt."""
    ids, group = list(before), [-1] * len(before)
    for g, stamp in enumerate(stamps):
        part = stamp + [vision_start] + [video_token] * tokens_per_group + [vision_end]
        ids += part
        group += [g] * len(part)
    ids.append(vision_end)
    group.append(-1)
    ids_t = torch.tensor(ids, dtype=torch.long)
    return VideoLayout(ids_t, torch.tensor(group, dtype=torch.long), (ids_t == video_token).nonzero().squeeze(1))


def kept_slots(layout: VideoLayout, kept: torch.Tensor, tokens_per_group: int,
               empty_groups: EmptyGroups = "keep") -> torch.Tensor:
    """kept (K,) raster indices of the kept video tokens -> (L,) bool, the slots of the layout the
    pruned prompt keeps: every text slot, the kept video tokens, and under "drop" no slot of a
    group without a kept token."""
    if empty_groups not in EMPTY_GROUPS:
        raise ValueError(f"Invalid empty_groups ({empty_groups!r}). Supported values are {', '.join(EMPTY_GROUPS)}.")
    slots = layout.video_slots.to(kept.device)
    keep = torch.ones(layout.ids.shape[0], dtype=torch.bool, device=kept.device)
    keep[slots] = False
    keep[slots[kept]] = True
    if empty_groups == "drop":
        n_groups = layout.video_slots.numel() // tokens_per_group
        per_group = torch.bincount(kept // tokens_per_group, minlength=n_groups)          # (T',)
        group = layout.group.to(kept.device)
        empty = (group >= 0) & (per_group[group.clamp(min=0)] == 0)
        keep &= ~empty
    return keep


def stamp_ids(times: list[float], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each group's timestamp text as token ids (one encode per distinct text)."""
    cache: dict[str, list[int]] = {}
    for text in map(timestamp_text, times):
        if text not in cache:
            cache[text] = encode(text)
    return [cache[timestamp_text(t)] for t in times]
