"""Prompt and prefix building: the LM input of a question about a window of frames, pruned.

A window's prefix is [system prompt, the kept visual tokens]; each kept token sits at the M-RoPE
position the full (unpruned) sequence gives it (one get_rope_index per visual grid, kept as a
layout). A question's prefix adds only its own text after the window, at the consecutive
positions the full prompt gives it, so questions about one window share its part.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from arr_coc.lod import token_frames
from pipeline.runtime.cuda import device_of, to_device, upload
from pipeline.vlm import hf, qwen3_vl
from pipeline.vlm.frame_groups import VideoLayout, group_timestamps, kept_slots, stamp_ids, video_layout
from pipeline.vlm.geometry import VLMGeometry
from pipeline.vlm.selection import (allocation_keys, pair_lod, select_tokens, snap_to_windows, token_cells,
                                    token_relevance)
from pipeline.vlm_config import VLMConfig

SYSTEM_PROMPT = "You are a helpful assistant."
MAX_LAYOUTS = 16          # prompt layouts (per visual grid: embeddings, M-RoPE positions) kept per VLM


@dataclass
class Prefix:
    """LM input of one request, pruned: embeds (L, D), positions (3, L) of the full sequence at the
    kept tokens, and next_position, the first generated token's position (full max + 1)."""
    embeds: torch.Tensor
    positions: torch.Tensor
    next_position: int
    tokens_kept: int
    tokens_full: int
    window: WindowPrefix | None = None  # the window whose tokens lead embeds (question_prefix)
    deepstack: torch.Tensor | None = None  # (n, S, D) Qwen3-VL: DeepStack features of the first S slots


@dataclass
class WindowPrefix:
    """What every question about one window shares: the prompt up to the end of the video with only
    the kept visual tokens, embeds (S, D) and positions (3, S); text_start, the M-RoPE position of
    the first token after the video; max_position, the largest position of the full (unpruned)
    prompt up to there; scores (tokens_kept,) float32 pass 1's relevance of each kept visual token,
    in their order (None: none given): a frame pair's token the higher of its two cells, a pooled
    token its block's best.

    Qwen3-VL (None / defaults elsewhere): deepstack (n, S, D) the DeepStack features of each slot
    (zeros but at the kept visual slots); visual (K,) the slots of the kept visual tokens (None: the
    last K, Qwen2-VL's [system prompt, video]); groups (S,) each slot's frame group (-1: outside
    every group), with drop_empty a group left without visual tokens loses its slots
    (vlm.empty_frame_groups); text_skip, the slots of the text after the window that come before
    the question (Qwen2-VL: its <|vision_end|>)."""
    embeds: torch.Tensor
    positions: torch.Tensor
    text_start: int
    max_position: int
    tokens_kept: int
    tokens_full: int
    scores: torch.Tensor | None = None
    deepstack: torch.Tensor | None = None
    visual: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    drop_empty: bool = False
    text_skip: int = 1

    def visual_slots(self) -> torch.Tensor:
        """(K,) the slots of the kept visual tokens, ascending (their order)."""
        if self.visual is not None:
            return self.visual
        S = self.embeds.shape[0]
        return torch.arange(S - self.tokens_kept, S, device=self.embeds.device)


@dataclass(frozen=True)
class Layout:
    """The prompt up to the end of the video for one visual grid, whatever the keep map: embeddings
    of the ids before the video (v0, D), M-RoPE positions of those ids and of every video token
    (3, v0 + n_full), and where the text after the video starts (text_start; max_position as above).
    Qwen3-VL: before holds the embeddings of every slot of the unpruned video prompt (timestamps,
    markers, video pads) and video its layout (frame_groups.VideoLayout)."""
    before: torch.Tensor
    positions: torch.Tensor
    text_start: int
    max_position: int
    video: VideoLayout | None = None
    video_slots: torch.Tensor | None = None  # Qwen3-VL: video.video_slots and video.group on the device,
    group: torch.Tensor | None = None        # uploaded once per layout (a pageable upload waits for the GPU)


def shared_windows(prefixes: list[Prefix]) -> tuple[list[WindowPrefix], list[int]] | None:
    """(windows, window of each prefix) where every prefix starts with a window (question_prefix)
    and some window leads several: questions about one window then share its prefill. None: no
    sharing (a prefix without a window, or one prefix per window)."""
    windows: list[WindowPrefix] = []
    index: dict[int, int] = {}
    window_of = []
    for p in prefixes:
        if p.window is None:
            return None
        if id(p.window) not in index:
            index[id(p.window)] = len(windows)
            windows.append(p.window)
        window_of.append(index[id(p.window)])
    return (windows, window_of) if len(windows) < len(prefixes) else None


class PrefixBuilder:
    """Builds the pruned LM prefixes of one model: its tokenizer and chat format, its M-RoPE (the
    model's own get_rope_index, once per visual grid) and the selection of the kept tokens."""

    def __init__(self, model, lm, tokenizer, *, family: str, config: VLMConfig, geometry: VLMGeometry,
                 device: torch.device) -> None:
        self.model, self.lm, self.tokenizer = model, lm, tokenizer
        self.family, self.config, self.geometry, self.device = family, config, geometry, device
        self.video_token_id = model.config.video_token_id
        self._layouts: OrderedDict[tuple, Layout] = OrderedDict()
        self._before_ids: list[int] | None = None
        # Qwen3-VL: a timestamp per frame group, no system turn, DeepStack features per visual token
        self.timestamps = family in qwen3_vl.FAMILIES
        self.deepstack = qwen3_vl.deepstack_count(model)

    @torch.no_grad()
    def text_embeddings(self, question: str) -> torch.Tensor:
        ids = to_device(self.tokenizer(question).input_ids, self.device, torch.long)
        return self.lm.embed_tokens(ids)                                   # (L, D)

    def prompt_ids(self, question: str, n_video_tokens: int) -> tuple[list[int], list[int]]:
        """Qwen chat format around one video: ids before and after the video pad tokens (Qwen3-VL:
        before its frame groups, and after the template's closing <|vision_end|>)."""
        if self._before_ids is None:
            system = "" if self.timestamps else f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
            self._before_ids = self.tokenizer(f"{system}<|im_start|>user\n<|vision_start|>").input_ids
        after = f"{'' if self.timestamps else '<|vision_end|>'}{question}<|im_end|>\n<|im_start|>assistant\n"
        return list(self._before_ids), self.tokenizer(after).input_ids

    def full_input_ids(self, question: str, n_video_tokens: int) -> torch.Tensor:
        before, after = self.prompt_ids(question, n_video_tokens)
        return torch.tensor(before + [self.video_token_id] * n_video_tokens + after, device=self.device)

    def prefix_length(self, question: str, visual_tokens: int) -> int:
        """LM prefix length of `question` about a window of which `visual_tokens` tokens are kept
        (what warm_up needs to know ahead of time; Qwen3-VL: not counting the frame groups'
        timestamps and markers, whose number is the window's)."""
        before, after = self.prompt_ids(question, visual_tokens)
        return len(before) + visual_tokens + len(after) + int(self.timestamps)

    def rope_positions(self, input_ids: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """(L,) unpruned ids, grid (3,) -> (3, L) M-RoPE positions from the model's own get_rope_index."""
        seconds = (torch.tensor([self.geometry.temporal_patch_size / self.config.fps])
                   if self.family == "qwen2_5_vl" else None)
        positions = hf.rope_index(self.model, input_ids[None], grid_thw[None].to(self.device), self.video_token_id,
                                  seconds)                                   # (3, 1, L)
        return positions[:, 0]                                               # (3, L)

    def snapped(self, keep: np.ndarray | torch.Tensor | None,
                 scores: np.ndarray | torch.Tensor | None) -> torch.Tensor | None:
        """A request's keep map on the device, its tokens moved into whole windows when
        vlm.snap_windows asks for it and pass 1's relevance is there (selection.snap_to_windows)."""
        if keep is None:
            return None
        keep = to_device(keep, self.device)
        side = self.config.snap_windows
        if not side or scores is None:
            return keep
        return snap_to_windows(keep, to_device(scores, self.device), side, self.geometry.temporal_patch_size)

    def mask_source(self, keep: np.ndarray | torch.Tensor | None, scores: np.ndarray | torch.Tensor | None,
                    snapped: torch.Tensor | None) -> torch.Tensor | None:
        """Where a request's masks are worked out: its keep map on the host (a CPU tensor) when it
        came from the host and snapping leaves it as it is (the pipeline's stages hand over numpy
        maps: no device round trip and no host read then), else `snapped`, its map on the device."""
        if keep is None or device_of(keep).type != "cpu":
            return snapped
        if self.config.snap_windows and scores is not None:
            return snapped
        return torch.as_tensor(keep)

    def token_mask(self, frames: np.ndarray | torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """(T' gh gw,) bool: the cells of frames (T, H, W, 3) that carry a token under keep (None:
        all), worked out from the grid alone, before any encoding (selection.token_cells), on the
        device keep is on (None: the host)."""
        T, H, W = frames.shape[:3]
        grid = (token_frames(T, self.geometry.temporal_patch_size), *self.geometry.grid(H, W))
        return token_cells(self.window_lod(frames, keep, grid, device_of(keep))).flatten()

    def window_lod(self, frames: np.ndarray | torch.Tensor, keep: np.ndarray | torch.Tensor | None,
                   grid: tuple[int, int, int], device: torch.device | None = None) -> torch.Tensor:
        """keep (T, gh, gw) LOD or None (all), checked against the frames' grid -> (T', gh, gw) LOD
        per video token (the pairing rule), on `device` (default: the model's)."""
        Tp, gh, gw = grid
        device = self.device if device is None else device
        if keep is None:
            return torch.ones(Tp, gh, gw, dtype=torch.int8, device=device)
        keep = to_device(keep, device)                                       # a no-op where it is already
        expected = (frames.shape[0], gh, gw)
        if tuple(keep.shape) != expected:
            raise ValueError(f"keep map shape {tuple(keep.shape)} does not match the VLM grid {expected} "
                             f"for {frames.shape[2]}x{frames.shape[1]} frames")
        return pair_lod(keep, self.geometry.temporal_patch_size)

    @torch.no_grad()
    def window_prefix(self, frames: np.ndarray | torch.Tensor, keep: np.ndarray | torch.Tensor | None,
                      merged: torch.Tensor, scores: np.ndarray | torch.Tensor | None = None, *,
                      index: torch.Tensor | None = None, host_index: np.ndarray | None = None) -> WindowPrefix:
        """The question-independent part of the prefix: frames (T, H, W, 3) (only their shape is
        used), keep (T, gh, gw) LOD or None (all tokens), merged tokens (T', gh, gw, D) of them,
        scores (T, gh, gw) pass 1's relevance or None (WindowPrefix.scores); index: the kept tokens'
        cells when the caller read them already (selection.token_cells' nonzero), host_index the
        same on the host (Qwen3-VL then lays out the window without a host read: queued behind
        the vision tower, not waiting for it)."""
        Tp, gh, gw, _ = merged.shape
        keep = None if keep is None else to_device(keep, self.device)       # (already there from prepare)
        lod = self.window_lod(frames, keep, (Tp, gh, gw))
        tokens, index = select_tokens(merged, lod, index)                    # (K, D), (K,)
        if self.timestamps:
            window = self._qwen3_window(frames.shape[0], (Tp, gh, gw), tokens, index, host_index)
        else:
            layout = self._layout(Tp, gh, gw)
            v0 = layout.before.shape[0]
            embeds = torch.cat([layout.before, tokens.to(layout.before.dtype)])  # (v0 + K, D)
            positions = torch.cat([layout.positions[:, :v0], layout.positions[:, v0 + index]], 1)  # (3, v0 + K)
            window = WindowPrefix(embeds, positions, layout.text_start, layout.max_position, int(index.numel()),
                                  Tp * gh * gw)
        token_scores = None
        if scores is not None:
            expected = (frames.shape[0], gh, gw)
            if tuple(scores.shape) != expected:
                raise ValueError(f"scores shape {tuple(scores.shape)} does not match the VLM grid {expected} "
                                 f"for {frames.shape[2]}x{frames.shape[1]} frames")
            scores = to_device(scores, self.device).float()
            tempering = self.config.tempering
            allocation = tempering.ladder and tempering.rank == "allocation" and self.config.pass2 == "off"
            if allocation and keep is not None:
                scores = allocation_keys(keep, scores, tempering.rungs)      # each rung's own allocation
            if not (allocation and keep is None):                            # every token, no allocation: one pass
                token_scores = token_relevance(scores, lod, index, self.geometry.temporal_patch_size)  # (K,)
        window.scores = token_scores
        return window

    def _qwen3_window(self, T: int, grid: tuple[int, int, int], tokens: torch.Tensor,
                      index: torch.Tensor, host_index: np.ndarray | None = None) -> WindowPrefix:
        """Qwen3-VL's window: the unpruned video prompt (timestamps, markers, every video token) with
        the slots of dropped tokens taken out (and, vlm.empty_frame_groups=drop, those of groups left
        empty), tokens (K, D x (1 + n)) the kept ones with their n DeepStack features appended, at
        raster cells index (K,). With host_index (index on the host) the kept slots are worked out
        on the host and uploaded in one queued copy: no host read, so the window is built while the
        GPU still runs the tower that makes `tokens` (without it, one nonzero reads the slots back)."""
        Tp, gh, gw = grid
        layout = self._layout(Tp, gh, gw, T)
        video = layout.video
        D, n = layout.before.shape[1], self.deepstack
        at = layout.video_slots[index]                                       # (K,) slots of the kept tokens
        embeds = layout.before.clone()                                       # (L, D)
        embeds[at] = tokens[:, :D].to(embeds.dtype)
        deepstack = embeds.new_zeros(n, *embeds.shape)                       # (n, L, D)
        deepstack[:, at] = tokens[:, D:].view(-1, n, D).transpose(0, 1).to(embeds.dtype)
        mode = self.config.empty_frame_groups
        if host_index is not None:
            slots = kept_slots(video, torch.from_numpy(np.asarray(host_index, np.int64)), gh * gw, mode).numpy()
            rank = np.cumsum(slots) - 1
            rows, visual = upload([np.flatnonzero(slots), rank[video.video_slots.numpy()[host_index]]], self.device)
        else:
            slots = kept_slots(video, index, gh * gw, mode)                  # (L,) bool
            visual = (slots.cumsum(0) - 1)[at]                               # (K,) among the kept slots
            rows = slots.nonzero().squeeze(1)                                # (S,)
        return WindowPrefix(embeds[rows], layout.positions[:, rows], layout.text_start, layout.max_position,
                            int(index.numel()), Tp * gh * gw, deepstack=deepstack[:, rows], visual=visual,
                            groups=layout.group[rows], drop_empty=mode == "drop", text_skip=0)

    @torch.no_grad()
    def question_prefix(self, window: WindowPrefix, question: str) -> Prefix:
        """One question's prefix over a window's shared part: only the text after the video is new,
        at consecutive M-RoPE positions (t = h = w) from window.text_start on."""
        return self.question_prefixes(window, [question])[0]

    @torch.no_grad()
    def question_prefixes(self, window: WindowPrefix, questions: list[str]) -> list[Prefix]:
        """question_prefix of each question, their text embedded in one lookup (one host copy)."""
        afters = [self.prompt_ids(q, 0)[1] for q in questions]
        texts = self.lm.embed_tokens(to_device([i for a in afters for i in a], self.device, torch.long))
        prefixes = []
        for after, text in zip(afters, texts.split([len(a) for a in afters])):  # (n, D) each
            n = len(after)
            positions = (window.text_start + torch.arange(n, device=self.device)).expand(3, n)
            next_position = max(window.max_position, window.text_start + n - 1) + 1  # the full prompt's max + 1
            prefixes.append(Prefix(torch.cat([window.embeds, text]), torch.cat([window.positions, positions], 1),
                                   next_position, window.tokens_kept, window.tokens_full, window,
                                   window.deepstack))
        return prefixes

    @torch.no_grad()
    def video_prompt(self, T: int, gh: int, gw: int) -> Layout:
        """Qwen3-VL's unpruned video prompt of T frames on a (gh, gw) grid (ids, positions, frame
        groups: Layout.video), the one every window is cut from; the QA trainer builds its inputs
        from it (pipeline/training/qa_forward.py)."""
        if not self.timestamps:
            raise ValueError(f"video_prompt is Qwen3-VL's; this model is {self.family}")
        return self._layout(token_frames(T, self.geometry.temporal_patch_size), gh, gw, T)

    def _layout(self, Tp: int, gh: int, gw: int, T: int | None = None) -> Layout:
        """The layout of a visual grid (Qwen3-VL: of T frames, whose count sets the timestamps)."""
        key = (Tp, gh, gw) if T is None else (Tp, gh, gw, T, self.config.fps)   # Qwen3: fps sets the stamps
        layout = self._layouts.pop(key, None)
        if layout is None:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.popitem(last=False)
            layout = self._make_layout(Tp, gh, gw) if T is None else self._qwen3_layout(T, gh, gw)
        self._layouts[key] = layout                                          # most recently used last
        return layout

    def _make_layout(self, Tp: int, gh: int, gw: int) -> Layout:
        """get_rope_index (python-heavy) once per visual grid, on the full prompt of a probe question:
        M-RoPE puts the text after the video on one run of consecutive positions whatever its ids,
        so the probe tells where any question's text starts (checked here, not assumed)."""
        n_full = Tp * gh * gw
        before, probe = self.prompt_ids("?", n_full)
        ids = torch.tensor(before + [self.video_token_id] * n_full + probe, device=self.device)
        m = self.geometry.merge_size
        full_pos = self.rope_positions(ids, torch.tensor([Tp, gh * m, gw * m]))  # (3, L_full)
        end = len(before) + n_full
        text_pos = full_pos[:, end:]                                         # (3, len(probe))
        text_start = int(text_pos[0, 0])
        if not torch.equal(text_pos, text_start + torch.arange(len(probe), device=self.device).expand(3, -1)):
            raise RuntimeError(f"get_rope_index of this transformers version does not place the text after "
                               f"the video at consecutive positions ({text_pos.tolist()}): questions cannot "
                               f"share a window's positions")
        return Layout(self.lm.embed_tokens(torch.tensor(before, device=self.device)), full_pos[:, :end],
                       text_start, int(full_pos[:, :end].max()))

    def _qwen3_layout(self, T: int, gh: int, gw: int) -> Layout:
        """Qwen3-VL's unpruned video prompt for T frames on a (gh, gw) grid: a timestamp per frame
        group as transformers' processor writes it (pipeline/vlm/frame_groups.py; the times of the T
        frames, the last index repeated to fill the last group), positions from the model's own
        get_rope_index; the question follows the template's closing <|vision_end|> on one axis."""
        tp, m = self.geometry.temporal_patch_size, self.geometry.merge_size
        Tp = token_frames(T, tp)
        stamps = stamp_ids(group_timestamps(range(T), self.config.fps, tp), lambda t: self.tokenizer(t).input_ids)
        cfg = self.model.config
        video = video_layout(self.prompt_ids("?", 0)[0], stamps, gh * gw, vision_start=cfg.vision_start_token_id,
                             vision_end=cfg.vision_end_token_id, video_token=self.video_token_id)
        ids = video.ids.to(self.device)
        grid = torch.tensor([[Tp, gh * m, gw * m]], device=self.device)
        positions = qwen3_vl.rope_index(self.model, ids[None], grid, self.video_token_id)[:, 0]  # (3, L)
        return Layout(self.lm.embed_tokens(ids), positions, int(positions[0, -1]) + 1, int(positions.max()), video,
                      video.video_slots.to(self.device), video.group.to(self.device))
