"""Errors and warnings every frame source raises, so the CLI can print one line instead of a traceback."""
from __future__ import annotations


class SourceError(Exception):
    """A video input cannot be read: missing, not a video, no video stream, bad arguments.

    The message is one line that names the input and the problem, ready to show to a user.
    """


class DecoderCrashed(SourceError):
    """The decoder process died (killed: out of memory, a signal) while reading an input that opened
    fine. Not the input's fault as far as anyone can tell: the CLI reports a failed stage (exit 1),
    not bad input; batch skips the video like an unreadable one and carries on."""


class VideoTruncatedWarning(UserWarning):
    """Decoding hit damage (a truncated or corrupt file) and stopped early; earlier frames are valid."""


class StreamInterruptedWarning(UserWarning):
    """A live stream stopped delivering frames (stalled, dropped) or came back; the outage is a Gap."""


class NvdecFallbackWarning(UserWarning):
    """decoder=nvdec was asked for where possible (decode.fallback), and this input decodes with PyAV:
    the message names why NVDEC cannot be used."""
