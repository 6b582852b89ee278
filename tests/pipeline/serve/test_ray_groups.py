"""The ingress's view of the stream groups (ray_groups.GroupedStreams) over fake group handles:
streams go to the least-loaded group, limits hold over all groups, ended streams free their group,
a group's refusal reaches the client. (The groups on a real Ray Serve: test_ray_serve.py.)"""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="needs ray[serve]")

from pipeline.serve import ray_groups  # noqa: E402
from pipeline.serve.errors import ApiError  # noqa: E402
from pipeline.serve.options import ServeOptions  # noqa: E402


class Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        fn = self.fn

        class Response:
            def result(self, timeout_s: float | None = None) -> Any:
                return fn(*args)
        return Response()


class FakeGroup:
    """A StreamGroup's methods as handle calls; `refuse` makes start answer as a source that fails."""

    def __init__(self) -> None:
        self.streams: dict[str, dict] = {}
        self.owners: dict[str, str] = {}
        self.refuse = False
        self.start, self.report, self.delete, self.stop_all = (Call(self._start), Call(self._report),
                                                               Call(self._delete), Call(lambda: None))

    def _start(self, source, question, options, owner, stream_id):
        if self.refuse:
            return {"refused": {"status": 400, "message": "cannot open live source 'x': gone", "param": "source",
                              "code": "source_failed"}}
        self.streams[stream_id] = {"id": stream_id, "status": "running", "question": question, "error": None}
        self.owners[stream_id] = owner
        return dict(self.streams[stream_id])

    def _report(self):
        return {"streams": [(dict(s), self.owners[sid]) for sid, s in self.streams.items()], "pending": 0}

    def _delete(self, stream_id, owner):
        self.streams[stream_id]["status"] = "stopped"
        return dict(self.streams[stream_id])


class FakeMedia:
    def live_source(self, ref: str, owner: str = ""):
        return f"/videos/{ref}", True, ref


@pytest.fixture
def grouped(monkeypatch):
    monkeypatch.setattr(ray_groups, "REPORT_S", 3600.0)      # reports taken by hand: no timing
    groups = [FakeGroup(), FakeGroup()]
    streams = ray_groups.GroupedStreams(groups, FakeMedia(), ServeOptions(max_streams=4, max_streams_per_key=3))
    yield streams, groups
    streams.stop_all()


def start(streams, owner: str = "a"):
    return streams.start("clip.mp4", "what moves?", every_s=1.0, on_scene_change=False, duration_s=None, owner=owner)


def test_streams_fill_the_groups_evenly_and_are_listed_by_owner(grouped):
    streams, groups = grouped
    started = [start(streams, owner) for owner in ("a", "b", "a")]
    assert [s.group for s in started] == [0, 1, 0]
    assert [len(g.streams) for g in groups] == [2, 1]
    assert streams.running() == 3 and [s.id for s in streams.list("a")] == [started[0].id, started[2].id]
    assert streams.get(started[1].id, "b").to_dict()["group"] == 1
    with pytest.raises(ApiError, match="no live stream"):
        streams.get(started[1].id, "a")                          # another key's stream does not exist


def test_an_ended_stream_frees_its_group(grouped):
    streams, groups = grouped
    first, second, third = start(streams), start(streams, "b"), start(streams, "b")
    assert (first.group, second.group, third.group) == (0, 1, 0)
    groups[0].streams[first.id]["status"] = "ended"               # its source ended
    streams._update(0, groups[0]._report())
    assert streams.get(first.id, "a").status == "ended" and streams.running() == 2
    assert streams.placement.counts() == [1, 1]
    assert start(streams).group == 0 and start(streams, "c").group == 1      # [2, 2]
    streams.delete(second.id, "b")                                # stopped: one place free in group 1
    assert streams.placement.counts() == [2, 1]
    assert start(streams, "c").group == 1


def test_the_limits_count_every_group(grouped):
    streams, _ = grouped
    for owner in ("a", "a", "a"):
        start(streams, owner)
    with pytest.raises(ApiError, match=r"this API key runs 3 live streams \(--max-streams-per-key\)") as e:
        start(streams, "a")
    assert e.value.status == 429
    start(streams, "b")
    with pytest.raises(ApiError, match=r"4 live streams are running \(--max-streams\)"):
        start(streams, "c")


def test_a_source_the_group_cannot_open_is_a_400_and_takes_no_place(grouped):
    streams, groups = grouped
    groups[0].refuse = True
    with pytest.raises(ApiError, match="cannot open live source 'x': gone") as e:
        start(streams)
    assert (e.value.status, e.value.code) == (400, "source_failed")
    assert streams.list() == [] and streams.placement.counts() == [0, 0]
    groups[0].refuse = False
    assert start(streams).group == 0
