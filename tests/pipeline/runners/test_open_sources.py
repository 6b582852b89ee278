"""open_sources (sources.live.open_many): the sources open side by side, in the order given, and a
failure closes the rest."""
from __future__ import annotations

import threading

import pytest

import sources.live
from pipeline.runners import live as live_runner
from sources import SourceError
from sources.live import LiveConfig


class FakeSource:
    def __init__(self, spec: str, stream_id: str) -> None:
        self.spec, self.stream_id, self.closed = spec, stream_id, False

    def close(self) -> None:
        self.closed = True


def urls(n: int) -> list[str]:
    return [f"rtsp://cam{k}.example/live" for k in range(n)]


def test_sources_open_side_by_side_in_order(monkeypatch):
    # every open waits for three others: opened one by one, the barrier breaks after its timeout
    barrier = threading.Barrier(4, timeout=20)

    def fake_open(spec, *, config, stream_id):
        barrier.wait()
        return FakeSource(spec, stream_id)

    monkeypatch.setattr(sources.live, "open_live", fake_open)
    specs = urls(8)
    opened = live_runner.open_sources(specs, LiveConfig())
    assert [s.spec for s in opened] == specs
    assert [s.stream_id for s in opened] == [f"cam{k}.example_live" for k in range(8)]


def test_same_name_gets_distinct_ids_and_stream_ids_name_each(monkeypatch):
    monkeypatch.setattr(sources.live, "open_live", lambda spec, *, config, stream_id: FakeSource(spec, stream_id))
    spec = "rtsp://cam.example/live"
    assert [s.stream_id for s in live_runner.open_sources([spec] * 3, LiveConfig())] == \
        ["cam.example_live", "cam.example_live_2", "cam.example_live_3"]
    assert [s.stream_id for s in live_runner.open_sources([spec] * 2, LiveConfig(), ["a", "b"])] == ["a", "b"]


def test_a_failure_raises_the_first_in_order_and_closes_the_opened(monkeypatch):
    made: list[FakeSource] = []
    lock = threading.Lock()

    def fake_open(spec, *, config, stream_id):
        if spec.startswith(("rtsp://cam3.", "rtsp://cam5.")):
            raise SourceError(f"cannot open {spec}")
        source = FakeSource(spec, stream_id)
        with lock:
            made.append(source)
        return source

    monkeypatch.setattr(sources.live, "open_live", fake_open)
    with pytest.raises(SourceError, match="cam3"):
        live_runner.open_sources(urls(24), LiveConfig(capture_processes=0))   # threads: fake_open runs here
    assert made and all(s.closed for s in made)


def test_a_bad_spec_fails_before_anything_opens(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(sources.live, "open_live", lambda spec, **_: calls.append(spec))
    with pytest.raises(SourceError, match="invalid live source"):
        live_runner.open_sources(["rtsp://cam.example/live", ""], LiveConfig())
    assert calls == []
