"""Live status of `python -m pipeline live`: per source fps in/out, dropped, reconnects, latency p50/p95.

On a terminal: one compact line, redrawn in place twice a second. Otherwise (piped, logged): one
JSON metrics object per `every_s` seconds. Both go to stderr; stdout carries only the answers.
"""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from typing import Any, TextIO

from sources.live import LiveSource, percentile, window_rate


def snapshot(sources: list[LiveSource], counters: dict[str, Any]) -> dict[str, Any]:
    """Metrics of every source now: the same numbers the status line and the JSON lines show."""
    now = time.time()
    streams = {}
    for source in sources:
        c = counters[source.stream_id]
        stats = source.stats()   # fps_in: over the same window as fps_out
        answer_lat, frame_lat = list(c.answer_latency), list(c.frame_latency)
        streams[source.stream_id] = {
            "fps_in": round(stats.fps_in, 2),
            "fps_out": round(window_rate(list(c.out_times), now, since=source.began_at), 2),
            "frames_in": stats.frames_in, "frames_out": c.frames_out, "dropped": stats.dropped,
            "reconnects": stats.reconnects, "gaps": c.gaps, "answers": c.answers,
            # the source's own count of outages (the current one included) and their seconds
            "outages": stats.gaps, "outage_s": round(stats.outage_s, 2), "connected": stats.connected,
            "answer_latency_p50_s": _round(percentile(answer_lat, 50)),
            "answer_latency_p95_s": _round(percentile(answer_lat, 95)),
            "frame_latency_p50_s": _round(percentile(frame_lat, 50)),
            "frame_latency_p95_s": _round(percentile(frame_lat, 95)),
        }
    return {"time": round(now, 3), "streams": streams}


def status_line(snap: dict[str, Any]) -> str:
    parts = []
    for sid, s in snap["streams"].items():
        # answer latency when there are answers, else arrival -> stored (no VLM)
        kind, p50, p95 = ("ans", s["answer_latency_p50_s"], s["answer_latency_p95_s"]) if s["answers"] else \
            ("frm", s["frame_latency_p50_s"], s["frame_latency_p95_s"])
        lat = "-" if p50 is None else f"{p50 * 1e3:.0f}/{p95 * 1e3:.0f}ms"
        down = "" if s["connected"] else " DOWN"
        parts.append(f"{sid}: {s['fps_in']:.1f}>{s['fps_out']:.1f}fps drop {s['dropped']} "
                     f"rc {s['reconnects']} out {s['outage_s']:.1f}s{down} {kind} {lat}")
    return " | ".join(parts)


class StatusReporter:
    """A daemon thread printing the status; `close()` ends the terminal line cleanly."""

    def __init__(self, sources: list[LiveSource], counters: dict[str, Any], *, every_s: float,
                 stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.sources, self.counters = sources, counters
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = 0.5 if self.tty else every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-status", daemon=True)
        self._width = 0

    def start(self) -> "StatusReporter":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._emit()
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._emit()

    def _emit(self) -> None:
        snap = snapshot(self.sources, self.counters)
        if self.tty:
            line = status_line(snap)
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(json.dumps({"metrics": snap}) + "\n")
        self.stream.flush()


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)
