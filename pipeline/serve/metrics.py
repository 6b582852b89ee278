"""The server's Prometheus metrics, kept in this process and written by prometheus_client.

    arrcoc_requests_total{route,status}             requests answered, by route and HTTP status
    arrcoc_request_latency_seconds{route}           histogram: request received -> response complete
    arrcoc_tokens_kept_total / arrcoc_tokens_full_total   visual tokens sent to the VLM / a stock VLM's
    arrcoc_queue_depth{queue}                       gauge: "requests" waiting for a front end, "vlm"
                                                    answer requests waiting for the VLM
    arrcoc_requests_running                         gauge: front ends running now
    arrcoc_live_streams                             gauge: live streams running now
    arrcoc_vlm_batch_size                           summary of the VLM batches (how many requests
                                                    were decoded together)

Each server owns its own registry (not prometheus_client's global one), so several engines in one
process (tests, Ray Serve replicas) count apart.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric, SummaryMetricFamily

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """What /metrics shows. The engine calls request / tokens / queued / started as work happens and
    sets vlm_pending, live_streams and batch_sizes to callables read at each scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter("arrcoc_requests", "Requests answered, by route and HTTP status.",
                                 ["route", "status"], registry=self.registry)
        self._latency = Histogram("arrcoc_request_latency_seconds", "Request received to response complete.",
                                  ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self._tokens_kept = Counter("arrcoc_tokens_kept", "Visual tokens sent to the VLM.", registry=self.registry)
        self._tokens_full = Counter("arrcoc_tokens_full", "Visual tokens a stock VLM would have used.",
                                    registry=self.registry)
        self._running = Gauge("arrcoc_requests_running", "Front ends running now.", registry=self.registry)
        self._lock = threading.Lock()
        self._waiting = 0   # one family with the VLM's queue, which is read at scrape time (_ScrapeTime)
        # read when scraped (set by the engine): VLM queue, live streams, batch sizes
        self.vlm_pending: Callable[[], int] = lambda: 0
        self.live_streams: Callable[[], int] = lambda: 0
        self.batch_sizes: Callable[[], list[int]] = lambda: []
        self.registry.register(_ScrapeTime(self))

    def request(self, route: str, status: int, seconds: float) -> None:
        self._requests.labels(route=route, status=str(status)).inc()
        self._latency.labels(route=route).observe(seconds)

    def tokens(self, kept: int, full: int) -> None:
        self._tokens_kept.inc(kept)
        self._tokens_full.inc(full)

    def queued(self, delta: int) -> None:
        with self._lock:
            self._waiting += delta

    def started(self, delta: int) -> None:
        self._running.inc(delta)

    def render(self) -> str:
        """Every metric in Prometheus' text exposition format 0.0.4, for GET /metrics."""
        return generate_latest(self.registry).decode()


class _ScrapeTime:
    """The metrics whose values are read at scrape time: the queues, the live streams, VLM batches."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []   # values come from callables that may not be set yet: nothing to check at register time

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        depth = GaugeMetricFamily("arrcoc_queue_depth", "Work waiting: requests for a front end, answers for the VLM.",
                                  labels=["queue"])
        depth.add_metric(["requests"], m._waiting)
        depth.add_metric(["vlm"], m.vlm_pending())
        yield depth
        yield GaugeMetricFamily("arrcoc_live_streams", "Live streams running now.", value=m.live_streams())
        sizes = list(m.batch_sizes())
        yield SummaryMetricFamily("arrcoc_vlm_batch_size", "Answer requests decoded together per VLM batch.",
                                  count_value=len(sizes), sum_value=sum(sizes))
