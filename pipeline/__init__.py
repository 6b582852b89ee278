"""ARR-COC streaming video understanding: the pipeline around the relevance model (arr_coc).

    from pipeline import Pipeline as Pipeline
    Pipeline(vlm="tiny-random", device="cpu").answer("video.mp4", "What is moving?")

The names below are imported on first use (PEP 562): `import pipeline`, and the command line's
`--help`, stay light.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from arr_coc._lazy import lazy_exports

_HOMES = {
    "Pipeline": "api", "Answer": "api", "VideoAnswers": "api",
    "PipelineConfig": "config",
    "FrameAllocation": "core.items",
    "AllocationStream": "runners.run", "RunResult": "runners.run",
    "LiveResult": "runners.live", "BatchSummary": "runners.batch",
}
__all__ = list(_HOMES)

if TYPE_CHECKING:
    from .api import Answer as Answer, Pipeline as Pipeline, VideoAnswers as VideoAnswers
    from .config import PipelineConfig as PipelineConfig
    from .core.items import FrameAllocation as FrameAllocation
    from .runners.batch import BatchSummary as BatchSummary
    from .runners.live import LiveResult as LiveResult
    from .runners.run import AllocationStream as AllocationStream, RunResult as RunResult


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
