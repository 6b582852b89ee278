"""GET /metrics' text: every metric the server documents, with the values it was given, in a form
Prometheus' own parser reads (prometheus_client writes it)."""
from __future__ import annotations

import threading

from prometheus_client.parser import text_string_to_metric_families

from pipeline.serve.metrics import LATENCY_BUCKETS, Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render()) for s in family.samples}


def test_every_metric_and_its_values():
    m = Metrics()
    m.request("/v1/chat/completions", 200, 0.3)
    m.request("/v1/chat/completions", 200, 7.0)
    m.request("/v1/files", 413, 0.01)
    m.tokens(5, 50)
    m.tokens(7, 50)
    m.queued(1)
    m.started(2)
    m.started(-1)
    m.vlm_pending, m.live_streams, m.batch_sizes = (lambda: 3), (lambda: 2), (lambda: [2, 3, 1])
    got = samples(m)
    chat = ("route", "/v1/chat/completions")
    assert got[("arrcoc_requests_total", (chat, ("status", "200")))] == 2
    assert got[("arrcoc_requests_total", (("route", "/v1/files"), ("status", "413")))] == 1
    assert got[("arrcoc_request_latency_seconds_count", (chat,))] == 2
    assert abs(got[("arrcoc_request_latency_seconds_sum", (chat,))] - 7.3) < 1e-9
    assert got[("arrcoc_request_latency_seconds_bucket", (("le", "0.5"), chat))] == 1     # cumulative buckets
    assert got[("arrcoc_request_latency_seconds_bucket", (("le", "10.0"), chat))] == 2
    assert got[("arrcoc_request_latency_seconds_bucket", (("le", "+Inf"), chat))] == 2
    assert sum(1 for name, labels in got if name == "arrcoc_request_latency_seconds_bucket"
               and chat in labels) == len(LATENCY_BUCKETS) + 1
    assert got[("arrcoc_tokens_kept_total", ())] == 12 and got[("arrcoc_tokens_full_total", ())] == 100
    assert got[("arrcoc_queue_depth", (("queue", "requests"),))] == 1
    assert got[("arrcoc_queue_depth", (("queue", "vlm"),))] == 3                         # read at scrape time
    assert got[("arrcoc_requests_running", ())] == 1
    assert got[("arrcoc_live_streams", ())] == 2
    assert got[("arrcoc_vlm_batch_size_count", ())] == 3 and got[("arrcoc_vlm_batch_size_sum", ())] == 6


def test_two_servers_count_apart_and_concurrent_updates_add_up():
    a, b = Metrics(), Metrics()
    threads = [threading.Thread(target=lambda: [a.queued(1) or a.tokens(1, 2) for _ in range(500)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert samples(a)[("arrcoc_queue_depth", (("queue", "requests"),))] == 2000
    assert samples(a)[("arrcoc_tokens_full_total", ())] == 4000
    assert samples(b)[("arrcoc_tokens_kept_total", ())] == 0
