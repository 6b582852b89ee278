"""Frame producers: video files (PyAV / decord / NVDEC) and generated clips.

The names below are imported on first use (PEP 562): generated clips (sources.synthetic, which
evaluation's scenes and QA clips draw with) need neither PyAV nor decord until they write a video,
so training the QA model runs where only numpy and OpenCV are installed.
"""
from __future__ import annotations

from arr_coc._lazy import lazy_exports

_HOMES = {"DecoderCrashed": "errors", "NvdecFallbackWarning": "errors", "SourceError": "errors",
          "StreamInterruptedWarning": "errors", "VideoTruncatedWarning": "errors", "Frame": "frame",
          "NvdecUnavailable": "nvdec", "DECODERS": "video", "VideoInfo": "video", "VideoSource": "video",
          "open_video": "video", "probe": "video"}
__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
