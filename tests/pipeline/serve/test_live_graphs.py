"""Live streams and chats about live sources take their front-end graphs from the server's one pool,
like requests about files (issue 40): a set per shape, shared in turn by every run of that shape,
never by two at once, at most the pool's bound of sets; beyond it a run goes eager rather than
capturing a set of its own. On a CPU no graphs exist, so the pool here holds stand-ins the stages
ask and that answer "no graph" (the stages run eagerly); the tests read the pool's accounting."""
from __future__ import annotations

import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve tests need the serve extra (fastapi)")

import pipeline.core.compose as compose_mod
import pipeline.runners.live as live_mod
import pipeline.runners.run as run_mod
from pipeline.core.frontend_graphs import FrontendGraphsPool, frontend_key
from pipeline.serve.media import VideoRef
from serve_client import call, chat_body, sse
from sources.synthetic import Shot, render_clip, write_video

sys.path.insert(0, str(Path(__file__).parents[2] / "live"))
from live_servers import http_ts_server  # noqa: E402

SMALL = (96, 128)       # videos.small
DEMO = (120, 160)       # videos.demo, the TS server's clip, long_video below


class StandIn:
    """A pooled set on a CPU: no graph for any shape (extract / realize None: the stages run
    eagerly); counts what the pool and the runs ask of it."""

    def __init__(self) -> None:
        self.prepared: list[tuple[int, int, int]] = []
        self.settled = 0

    def prepare(self, batch: int, height: int, width: int, *args: Any) -> None:
        self.prepared.append((batch, height, width))

    def extract(self, *args: Any, **kwargs: Any) -> None:
        return None

    def realize(self, *args: Any, **kwargs: Any) -> None:
        return None

    def settle(self) -> None:
        self.settled += 1


class Watched(FrontendGraphsPool):
    """The engine's pool with stand-ins, recording each take (key, set) and any set handed to a run
    while another holds it (a test cannot assert inside the server's threads)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, self._make)
        self.made: list[StandIn] = []
        self.taken: list[tuple[tuple, StandIn | None]] = []
        self.held: set[int] = set()
        self.overlaps = self.peak = 0
        self.guard = threading.Lock()

    def _make(self, *args: Any) -> StandIn:
        self.made.append(StandIn())
        return self.made[-1]

    def take(self, key: tuple, *args: Any) -> StandIn | None:
        graphs = super().take(key, *args)
        with self.guard:
            self.taken.append((key, graphs))
            self.peak = max(self.peak, len(self))
            if graphs is not None:
                self.overlaps += id(graphs) in self.held
                self.held.add(id(graphs))
        return graphs

    def give_back(self, key: tuple, graphs: Any) -> None:
        with self.guard:
            self.held.discard(id(graphs))
        super().give_back(key, graphs)

    def sets(self, key_size: tuple[int, int]) -> list[StandIn | None]:
        return [g for k, g in self.taken if k[1:] == key_size]


@pytest.fixture
def pool(server, monkeypatch):
    """Install a Watched pool (capacity set by the test) in the server; no run may capture a set of
    its own beside it (frontend_graphs is never called)."""
    own: list[Any] = []
    for mod in (compose_mod, live_mod, run_mod):
        if hasattr(mod, "frontend_graphs"):
            monkeypatch.setattr(mod, "frontend_graphs", lambda *args: own.append(args))

    def install(capacity: int) -> Watched:
        watched = Watched(capacity)
        monkeypatch.setattr(server.engine, "frontends", watched)
        return watched
    yield install
    assert own == [], "a run captured front-end graphs of its own beside the pool"


@pytest.fixture(scope="module")
def long_video(videos) -> Path:
    """30 s at 10 fps, 120x160 (DEMO's size): a live stream that runs until it is deleted."""
    clip = render_clip([Shot("static", 300)], height=DEMO[0], width=DEMO[1], seed=3)
    return write_video(videos.allowed / "long_120x160.mp4", clip.frames, fps=10)


def start_stream(server, url: str, **extra: Any) -> str:
    status, stream = call(server, "POST", "/v1/streams", {"source": url, "question": "what moves?", "every": 1.0,
                                                          **extra})
    assert status == 201, stream
    return stream["id"]


def wait_end(server, stream_id: str) -> dict[str, Any]:
    events = list(sse(server, f"/v1/streams/{stream_id}/events"))
    assert events[-1][0] == "end", events
    return events[-1][1]


def delete(server, stream_id: str) -> None:
    assert call(server, "DELETE", f"/v1/streams/{stream_id}")[0] == 200


def chat(server, url: str) -> None:
    status, reply = call(server, "POST", "/v1/chat/completions", chat_body(url))
    assert status == 200, reply


def test_live_streams_and_file_requests_of_one_shape_share_one_set(server, videos, pool):
    """Two live streams about a 96x128 video, one after the other, then a chat about it: one set,
    made once, taken by all three in turn and settled at each give-back."""
    watched = pool(4)
    for _ in range(2):
        end = wait_end(server, start_stream(server, videos.small.as_uri()))
        assert end["reason"] == "source_ended", end
    chat(server, videos.small.as_uri())
    assert len(watched.taken) == 3 and len({k for k, _ in watched.taken}) == 1, watched.taken
    assert watched.taken[0][0][1:] == SMALL
    assert len(watched.made) == 1 and len(watched) == 1 and watched.overlaps == 0
    assert all(g is watched.made[0] for _, g in watched.taken)
    assert watched.made[0].settled == 3
    live_batches = {b for b, h, w in watched.made[0].prepared}
    assert 1 in live_batches and (1, *SMALL) in watched.made[0].prepared   # the live run's shapes, on the shared set


def test_a_set_in_use_is_never_handed_to_another_run(server, videos, long_video, pool):
    """Two live streams of one shape at once hold two sets; when one is deleted, a chat of that shape
    takes the idle set, not the one the other stream replays; a new shape, the pool full, replaces
    the idle set, never the one in use; the surviving stream's set serves the next run after it."""
    watched = pool(2)
    first, second = start_stream(server, long_video.as_uri()), start_stream(server, long_video.as_uri())
    try:
        a, b = watched.sets(DEMO)
        assert a is not None and b is not None and a is not b and watched.overlaps == 0
        delete(server, first)
        chat(server, videos.demo.as_uri())                     # 120x160: the deleted stream's set
        assert watched.taken[-1] == (watched.taken[0][0], a)
        chat(server, videos.small.as_uri())                    # a new shape, the pool full: a's set goes
        small = watched.sets(SMALL)
        assert len(small) == 1 and small[0] not in (None, a, b) and len(watched) == 2
    finally:
        delete(server, second)
    chat(server, videos.demo.as_uri())                         # b, given back, serves the next one
    assert watched.taken[-1][1] is b and len(watched.made) == 3
    assert watched.overlaps == 0 and watched.peak <= 2 and len(watched) == 2


def test_beyond_the_bound_live_runs_go_eager(server, videos, long_video, pool):
    """One set allowed and a live stream holding it: a live stream and a chat of another shape run
    eagerly (no set, none of their own), and the running stream's set stays; many shapes in turn
    never hold more than the bound."""
    watched = pool(1)
    held = start_stream(server, long_video.as_uri())
    try:
        end = wait_end(server, start_stream(server, videos.small.as_uri()))
        assert end["reason"] == "source_ended", end
        chat(server, videos.small.as_uri())
        assert [g for _, g in watched.taken[1:]] == [None, None] and len(watched.made) == 1
    finally:
        delete(server, held)
    for url in (videos.small.as_uri(), long_video.as_uri(), videos.small.as_uri()):
        wait_end(server, start_stream(server, url, duration=1.0))
    assert len(watched.made) == 4 and watched.peak == 1 and len(watched) == 1 and watched.overlaps == 0


def test_a_chat_about_a_live_source_shares_the_set_of_file_requests(server, videos, pool, tmp_path):
    """A chat about a live HTTP stream (120x160) takes the set a chat about a file of that size gave
    back (the live source resolved as media.py resolves an rtsp:// one)."""
    watched = pool(2)
    chat(server, videos.demo.as_uri())
    with http_ts_server(tmp_path, size=(DEMO[1], DEMO[0]), seconds=3.0) as ts:
        ref = VideoRef("live", ts.url(), "a camera")
        completion = server.engine.answer(ref, "what moves?", f"chatcmpl-{uuid.uuid4().hex[:24]}")
    assert completion.answers, completion
    assert [k[1:] for k, _ in watched.taken] == [DEMO, DEMO], watched.taken
    assert watched.taken[1][1] is watched.taken[0][1] is watched.made[0] and len(watched) == 1


def test_frontend_key_is_one_for_files_and_live_sources():
    assert frontend_key((6, 8), [(96, 128)]) == ((6, 8), 96, 128)
    assert frontend_key((6, 8), [(96, 128), (96, 128)]) == ((6, 8), 96, 128)       # two cameras, one size
    assert frontend_key((6, 8), [(120, 160), (96, 128)]) == ((6, 8), 96, 128, 120, 160)


def test_the_bound_holds_a_set_for_every_run_that_can_be_at_work(server):
    """By default one set per request slot and per live stream: every run at work can hold one."""
    from pipeline.serve.options import ServeOptions

    assert ServeOptions(max_concurrent=3, max_streams=2).frontend_graph_sets == 5
    assert ServeOptions(max_concurrent=3, max_streams=2, max_frontend_graphs=1).frontend_graph_sets == 1
    options = server.engine.options
    assert server.engine.frontends.capacity == options.max_concurrent + options.max_streams
