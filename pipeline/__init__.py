"""ARR-COC streaming video understanding: the pipeline around the relevance model (arr_coc).

    from pipeline import Pipeline
    Pipeline(vlm="tiny-random", device="cpu").answer("video.mp4", "What is moving?")

The names below are imported on first use (PEP 562): `import pipeline`, and the command line's
`--help`, stay light.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "Pipeline": "api", "Answer": "api", "VideoAnswers": "api",
    "PipelineConfig": "config",
    "FrameAllocation": "core.stages",
    "AllocationStream": "runners.run", "RunResult": "runners.run",
    "LiveResult": "runners.live", "BatchSummary": "runners.batch",
}
__all__ = list(_HOMES)

if TYPE_CHECKING:
    from .api import Answer, Pipeline, VideoAnswers
    from .config import PipelineConfig
    from .core.stages import FrameAllocation
    from .runners.batch import BatchSummary
    from .runners.live import LiveResult
    from .runners.run import AllocationStream, RunResult


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
