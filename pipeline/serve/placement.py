"""Which GPU group a new live stream runs on (`serve --ray ... --stream-groups N`: ray_app.py).

A group is one GPU's worth of live streams: capture, ARR-COC and a VLM on that GPU. A new stream
goes to the group with the fewest live streams; among equals, to the one whose VLM has the fewest
answer requests waiting (measured, as the groups last reported it), then to the lowest index. A
stream counts against its group from the moment it is placed (before its source has opened, so a
burst of starts spreads out) until it is released: when it ends, is stopped, or fails to start.
Streams are the unit because a live stream's load is steady (its frame rate and answer period);
the measured queue only breaks ties, where stream counts say nothing.
"""
from __future__ import annotations

import threading
from typing import Sequence


class Placement:
    """Streams placed on `groups` groups; thread-safe."""

    def __init__(self, groups: int) -> None:
        if groups < 1:
            raise ValueError(f"a placement needs at least one group, got {groups}")
        self.groups = groups
        self._group_of: dict[str, int] = {}
        self._lock = threading.Lock()

    def place(self, stream_id: str, pending: Sequence[int] | None = None) -> int:
        """The group `stream_id` runs on, now counted there: the least loaded (fewest streams, then
        fewest waiting answer requests `pending[g]`, then the lowest g). A stream already placed
        keeps its group."""
        if pending is not None and len(pending) != self.groups:
            raise ValueError(f"pending has {len(pending)} entries for {self.groups} groups")
        with self._lock:
            if stream_id in self._group_of:
                return self._group_of[stream_id]
            counts = self._counts()
            group = min(range(self.groups), key=lambda g: (counts[g], pending[g] if pending else 0, g))
            self._group_of[stream_id] = group
            return group

    def release(self, stream_id: str) -> None:
        """The stream no longer counts (it ended, was stopped, or never started); unknown ids are ignored."""
        with self._lock:
            self._group_of.pop(stream_id, None)

    def group_of(self, stream_id: str) -> int | None:
        with self._lock:
            return self._group_of.get(stream_id)

    def counts(self) -> list[int]:
        """Live streams placed on each group."""
        with self._lock:
            return self._counts()

    def _counts(self) -> list[int]:
        counts = [0] * self.groups
        for group in self._group_of.values():
            counts[group] += 1
        return counts
