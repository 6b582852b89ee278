"""The items flowing between the graph's stages, and the facts a run shares with its sink.

  FrameBatch       decoded frames of one stream, stacked in (pinned) host memory
  TextureBatch     + the texture array on the device and the CUDA event that makes it ready
  AllocationBatch  + the allocation copied to (pinned) host memory and its ready event
  AnswerItem       one VLM answer for one window (AnswerItems: several, committed together)
  FrameAllocation  one frame's row of the store's frame arrays
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from arr_coc.model import Allocation
from arr_coc.texture import Texture
from sources.frame import Frame

from ..runtime.answer_words import no_answer

Outcome = Literal["complete", "damaged", "incomplete"]   # how a stream of a finished graph ends


@dataclass
class RunStatus:
    """Shared facts about a run that the sink needs when it closes the store."""

    truncated: bool = False
    stopped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@dataclass(frozen=True)
class FrameRef:
    """A frame's place in its stream, for batches whose pixels live only on the device."""

    stream_id: str
    index: int
    pts_s: float
    arrival_s: float | None = None


@dataclass
class FrameBatch:
    stream_id: str
    frames: list[Frame] | list[FrameRef]  # FrameRef when the pixels went straight to the device
    pixels: torch.Tensor            # (T, H, W, 3) uint8: on the host (pinned on CUDA), or on the device
    ready: torch.cuda.Event | None = None  # device pixels: ready once this fires

    @property
    def frames_count(self) -> int:
        return len(self.frames)

    @property
    def description(self) -> str:
        return f"stream '{self.stream_id}' frames {self.frames[0].index}-{self.frames[-1].index}"


@dataclass
class TextureBatch:
    batch: FrameBatch
    texture: Texture
    ready: torch.cuda.Event | None

    frames_count = property(lambda self: self.batch.frames_count)
    description = property(lambda self: self.batch.description)


@dataclass
class AllocationBatch:
    batch: FrameBatch
    allocation: Allocation          # on the host (pinned when on CUDA); valid once `ready` fired
    ready: torch.cuda.Event | None
    vlm_frames: list[bool] | None = None  # frames sampled for the VLM (None: no VLM in the graph)

    frames_count = property(lambda self: self.batch.frames_count)
    description = property(lambda self: self.batch.description)

    def wait(self) -> Allocation:
        if self.ready is not None:
            self.ready.synchronize()
        return self.allocation


@dataclass
class AnswerItem:
    stream_id: str
    t_start: float
    t_end: float
    question: str
    text: str
    tokens_kept: int                  # visual tokens of the final pass
    tokens_full: int
    latency_s: float
    passes: int = 1                   # answering passes (vlm.tempering)
    tokens_spent: int | None = None   # visual tokens over all passes (None: tokens_kept)
    confidence: float = float("nan")  # of the answer's first token (pipeline/vlm/tempering.py)
    no_answer: str = ""               # why `text` is no answer ("": an answer; pipeline/runtime/answer_words.py)

    frames_count = 0
    description = property(lambda self: f"answer for '{self.stream_id}' {self.t_start:.2f}-{self.t_end:.2f}s")

    def __post_init__(self) -> None:
        if self.tokens_spent is None:
            self.tokens_spent = self.tokens_kept

    @classmethod
    def of(cls, stream_id: str, t_start: float, t_end: float, question: str, result: Any,
           model: str | None = None) -> AnswerItem:
        """The item of a VLM's AnswerResult (pipeline/runtime/requests.py) for one window; `model`:
        the VLM's name, whose snapshot may list the answers it gives (pipeline/runtime/answer_words.py)."""
        return cls(stream_id=stream_id, t_start=float(t_start), t_end=float(t_end), question=question,
                   text=result.text, tokens_kept=result.tokens_kept, tokens_full=result.tokens_full,
                   latency_s=float(result.latency_s), passes=result.passes, tokens_spent=result.tokens_spent,
                   confidence=float(result.confidence), no_answer=no_answer(result.text, model))

    def row(self) -> dict[str, Any]:
        """The store's answer columns (StreamWriter.add_answers)."""
        return dict(t_start=self.t_start, t_end=self.t_end, question=self.question, text=self.text,
                    tokens_kept=self.tokens_kept, tokens_full=self.tokens_full, latency_s=self.latency_s,
                    passes=self.passes, tokens_spent=self.tokens_spent,
                    confidence=self.confidence if math.isfinite(self.confidence) else None, no_answer=self.no_answer)


@dataclass(frozen=True)
class FrameAllocation:
    """One frame's allocation: a row of the store's frame arrays (streams/<stream_id>/), as the
    sink writes it (the store holds relevance as float16 and tokens as uint16)."""

    stream_id: str
    pts: float                # presentation time (s)
    frame_index: int          # index in the decoded stream
    relevance: np.ndarray     # (gh, gw) float32, realized relevance in [0, 1]
    tokens: np.ndarray        # (gh, gw) int32, the homunculus: VLM tokens spent on each cell
    scene_change: bool        # the first frame of a new shot / fixation
    motion: float             # mean motion magnitude of the frame

    @property
    def tokens_kept(self) -> int:
        """Visual tokens spent on this frame."""
        return int(self.tokens.sum())

    @property
    def tokens_full(self) -> int:
        """Visual tokens a stock VLM spends on it: one per cell."""
        return int(self.tokens.size)


@dataclass
class AnswerItems:
    """Several answers of one stream (a batch video's questions), committed to the store at once."""
    items: list[AnswerItem]

    frames_count = 0
    description = property(lambda self: f"{len(self.items)} answers for '{self.items[0].stream_id}'")
