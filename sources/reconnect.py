"""When a live source tries again after an outage, and when it gives up.

An outage starts when a connection ends or stalls and lasts until a frame arrives again. Every
attempt of the outage that brings no frame is a failure: a source that cannot be opened, and one
that opens and then ends or stalls before its first frame (an HTTP server that answers each GET
and then closes, a camera that opens and delivers nothing). The n-th attempt waits
`backoff_s(n failures so far)`: capped exponential, so a flapping source is asked ever more rarely
instead of at the first step's rate; and `max_reconnects` failures in a row end the source. Only a
frame ends an outage, so only a frame starts the count afresh.

Each delay is scaled by a random factor in [1 - jitter, 1 + jitter], below the nominal delay as
often as above it: many clients of one server, cut off together, spread out instead of coming
back in lockstep, and on average wait the nominal delay.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from sources.errors import SourceError

Connection = TypeVar("Connection")


def backoff_s(failures: int, initial_s: float, max_s: float, jitter: float, rng: random.Random) -> float:
    """Delay before the attempt that follows `failures` failed ones: initial_s doubled per failure,
    capped at max_s, times a factor drawn uniformly from [1 - jitter, 1 + jitter]."""
    base = min(max_s, initial_s * 2.0 ** min(failures, 30))
    return base * (1.0 + jitter * rng.uniform(-1.0, 1.0))


@dataclass
class Outage:
    """A live stream without frames since (start_pts, start_wall): its Gap once it ends."""

    cause: str                  # how it began; a stall's reason states the whole outage's length
    stalled: bool
    read_timeout_s: float
    start_pts: float
    start_wall: float
    failures: int = 0           # attempts of this outage that brought no frame
    last_failure: str = ""

    def fail(self, why: str) -> None:
        """One more attempt brought no frame; `why` (lower case, no source name) for the reason."""
        self.failures += 1
        self.last_failure = why

    def reason(self, end_wall: float, ending: str | None = None) -> str:
        parts = [f"no frames for {end_wall - self.start_wall:.1f} s (read timeout {self.read_timeout_s:g} s)"
                 if self.stalled else self.cause]
        if self.failures:
            attempts = f" ({self.failures} attempts)" if self.failures > 1 else ""
            parts.append(f"reconnect failed: {self.last_failure}{attempts}")
        if ending:
            parts.append(ending)
        return "; ".join(parts)


@dataclass(frozen=True)
class Reconnect:
    """The policy: delays from `delay(failures)`, give up after `max_reconnects` failures (None: never)."""

    delay: Callable[[int], float]
    max_reconnects: int | None

    def run(self, outage: Outage, connect: Callable[[], Connection], stop: threading.Event,
            name: str) -> tuple[Connection | None, SourceError | None]:
        """Open a connection for `outage` after the backoff its failures call for. Returns
        (connection, None) once one opens (whether it brings frames the caller's read tells:
        if it does not, the caller counts that with `outage.fail` and calls again), (None, None)
        when `stop` is set, or (None, error) once the failures reach max_reconnects. A failed
        open counts at once; `connect` raises SourceError with `.cause` for the reason."""
        while not stop.is_set():
            if self.max_reconnects is not None and outage.failures >= self.max_reconnects:
                return None, SourceError(
                    f"{name}: gave up after {outage.failures} failed reconnect attempts "
                    f"(--max-reconnects {self.max_reconnects}); last: {outage.reason(time.time())}")
            if stop.wait(self.delay(outage.failures)):
                return None, None
            try:
                return connect(), None
            except SourceError as e:
                outage.fail(getattr(e, "cause", None) or str(e))
        return None, None
