"""Frame producers: video files (PyAV / decord) and generated clips."""
from sources.errors import DecoderCrashed, SourceError, StreamInterruptedWarning, VideoTruncatedWarning
from sources.frame import Frame
from sources.video import DECODERS, VideoInfo, VideoSource, open_video, probe

__all__ = ["DECODERS", "DecoderCrashed", "Frame", "SourceError", "StreamInterruptedWarning", "VideoInfo", "VideoSource",
           "VideoTruncatedWarning", "open_video", "probe"]
