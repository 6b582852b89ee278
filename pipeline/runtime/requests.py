"""What the streaming graph hands the VLM and gets back: the request and answer types both sides
import (the graph builds requests, the engine answers them), so neither imports the other."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AnswerRequest:
    stream_id: str
    frames: np.ndarray | torch.Tensor   # (T, H, W, 3) uint8 RGB, already sampled at VLMConfig.fps
    keep: np.ndarray | torch.Tensor | None  # (T, gh, gw) int LOD (0 drop, 1 full, 2 pooled); None = stock
    question: str
    t_start: float
    t_end: float
    arrival_s: float | None = None      # time.monotonic() when the window was complete; latency starts here
    reuse_key: str | None = None        # live stream whose cached vision features may serve (encode: kept)
    scene_change: bool = False          # a cut since reuse_key's previous request: its cache is dropped first
    # (T, gh, gw) float pass 1's realized relevance of each cell (ARR-COC's, as the keep map's): the
    # tempering ladder's passes keep the best-scored tokens (vlm.tempering.rank: relevance); None: none
    scores: np.ndarray | torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.frames.shape)
        if len(shape) != 4 or shape[-1] != 3 or shape[0] < 1:
            raise ValueError(f"AnswerRequest.frames must be (T, H, W, 3) with T >= 1, got {shape}")
        if self.frames.dtype not in (np.uint8, torch.uint8):
            raise ValueError(f"AnswerRequest.frames must be uint8, got {self.frames.dtype}")
        if self.keep is not None and (len(self.keep.shape) != 3 or self.keep.shape[0] != shape[0]):
            raise ValueError(f"AnswerRequest.keep must be (T={shape[0]}, gh, gw), got {tuple(self.keep.shape)}")
        if not self.question.strip():
            raise ValueError("AnswerRequest.question is empty")
        if self.reuse_key is not None and not isinstance(self.reuse_key, str):
            raise ValueError(f"AnswerRequest.reuse_key must be a string or None, got {self.reuse_key!r}")
        if self.scores is not None:
            check_scores(self.scores, shape[0] if self.keep is None else tuple(self.keep.shape))


def check_scores(scores: np.ndarray | torch.Tensor, expected: int | tuple[int, ...]) -> None:
    """Pass 1's relevance map: (T, gh, gw) finite floats, T frames (an int) or the keep map's shape."""
    if not isinstance(scores, (np.ndarray, torch.Tensor)):
        raise ValueError(f"AnswerRequest.scores must be a (T, gh, gw) float array, got {type(scores).__name__}")
    shape = tuple(scores.shape)
    fits = len(shape) == 3 and (shape[0] == expected if isinstance(expected, int) else shape == expected)
    if not fits:
        want = f"(T={expected}, gh, gw)" if isinstance(expected, int) else f"the keep map's shape {expected}"
        raise ValueError(f"AnswerRequest.scores must be {want}, got {shape}")
    if isinstance(scores, torch.Tensor):
        floating = scores.is_floating_point()
    else:
        floating = np.issubdtype(scores.dtype, np.floating)
    if not floating:
        raise ValueError(f"AnswerRequest.scores must be floats, got {scores.dtype}")
    finite = bool(torch.isfinite(scores).all()) if isinstance(scores, torch.Tensor) else bool(np.isfinite(scores).all())
    if not finite:
        raise ValueError("AnswerRequest.scores must be finite (pass 1's relevance), got NaN or inf")


@dataclass(frozen=True)
class WindowQuestions:
    """Questions about one window of frames (VLM.answer_windows): frames (T, H, W, 3), keep
    (T, gh, gw) LOD or None (every token), scores pass 1's relevance or None, as AnswerRequest's."""
    frames: np.ndarray | torch.Tensor
    keep: np.ndarray | torch.Tensor | None
    questions: list[str]
    scores: np.ndarray | torch.Tensor | None = None


@dataclass(frozen=True)
class AnswerResult:
    text: str
    tokens_kept: int     # visual tokens actually sent to the LM (in the final pass)
    tokens_full: int     # visual tokens the stock model would use for the same frames
    latency_s: float
    passes: int = 1      # answering passes (tempering: one per rung of the budget ladder tried)
    tokens_spent: int | None = None   # visual tokens over all passes (None: tokens_kept, one pass)
    confidence: float = float("nan")  # of the first answer token (vlm.tempering.confidence; NaN: unknown)

    def __post_init__(self) -> None:
        if self.tokens_spent is None:
            object.__setattr__(self, "tokens_spent", self.tokens_kept)
        if self.passes < 1 or self.tokens_spent < self.tokens_kept:
            raise ValueError(f"AnswerResult: passes ({self.passes}) must be >= 1 and tokens_spent "
                             f"({self.tokens_spent}) >= tokens_kept ({self.tokens_kept})")
