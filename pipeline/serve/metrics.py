"""The server's Prometheus metrics (text exposition format 0.0.4), kept in this process.

    arrcoc_requests_total{route,status}             requests answered, by route and HTTP status
    arrcoc_request_latency_seconds{route}           histogram: request received -> response complete
    arrcoc_tokens_kept_total / arrcoc_tokens_full_total   visual tokens sent to the VLM / a stock VLM's
    arrcoc_queue_depth{queue}                       gauge: "requests" waiting for a front end, "vlm"
                                                    answer requests waiting for the VLM
    arrcoc_requests_running                         gauge: front ends running now
    arrcoc_live_streams                             gauge: live streams running now
    arrcoc_vlm_batch_size                           summary of the VLM batches (how many requests
                                                    were decoded together)
"""
from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from typing import Callable

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)   # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(f'{name}_bucket{{{labels}{"," if labels else ""}le="{le}"}} {running}')
        brace = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{brace} {self.sum:.6f}", f"{name}_count{brace} {self.count}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.latency: dict[str, Histogram] = {}
        self.tokens_kept = 0
        self.tokens_full = 0
        self.waiting = 0
        self.running = 0
        # gauges read when scraped (set by the engine): VLM queue, live streams, batch sizes
        self.vlm_pending: Callable[[], int] = lambda: 0
        self.live_streams: Callable[[], int] = lambda: 0
        self.batch_sizes: Callable[[], list[int]] = lambda: []

    def request(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(route, status)] += 1
            self.latency.setdefault(route, Histogram()).observe(seconds)

    def tokens(self, kept: int, full: int) -> None:
        with self._lock:
            self.tokens_kept += kept
            self.tokens_full += full

    def queued(self, delta: int) -> None:
        with self._lock:
            self.waiting += delta

    def started(self, delta: int) -> None:
        with self._lock:
            self.running += delta

    def render(self) -> str:
        with self._lock:
            lines = ["# HELP arrcoc_requests_total Requests answered, by route and HTTP status.",
                     "# TYPE arrcoc_requests_total counter"]
            lines += [f'arrcoc_requests_total{{route="{r}",status="{s}"}} {n}'
                      for (r, s), n in sorted(self.requests.items())]
            lines += ["# HELP arrcoc_request_latency_seconds Request received to response complete.",
                      "# TYPE arrcoc_request_latency_seconds histogram"]
            for route, hist in sorted(self.latency.items()):
                lines += hist.lines("arrcoc_request_latency_seconds", f'route="{route}"')
            lines += ["# HELP arrcoc_tokens_kept_total Visual tokens sent to the VLM.",
                      "# TYPE arrcoc_tokens_kept_total counter", f"arrcoc_tokens_kept_total {self.tokens_kept}",
                      "# HELP arrcoc_tokens_full_total Visual tokens a stock VLM would have used.",
                      "# TYPE arrcoc_tokens_full_total counter", f"arrcoc_tokens_full_total {self.tokens_full}",
                      "# HELP arrcoc_queue_depth Work waiting: requests for a front end, answers for the VLM.",
                      "# TYPE arrcoc_queue_depth gauge", f'arrcoc_queue_depth{{queue="requests"}} {self.waiting}',
                      f'arrcoc_queue_depth{{queue="vlm"}} {self.vlm_pending()}',
                      "# HELP arrcoc_requests_running Front ends running now.",
                      "# TYPE arrcoc_requests_running gauge", f"arrcoc_requests_running {self.running}",
                      "# HELP arrcoc_live_streams Live streams running now.",
                      "# TYPE arrcoc_live_streams gauge", f"arrcoc_live_streams {self.live_streams()}"]
            sizes = list(self.batch_sizes())
            lines += ["# HELP arrcoc_vlm_batch_size Answer requests decoded together per VLM batch.",
                      "# TYPE arrcoc_vlm_batch_size summary", f"arrcoc_vlm_batch_size_sum {sum(sizes)}",
                      f"arrcoc_vlm_batch_size_count {len(sizes)}"]
        return "\n".join(lines) + "\n"
