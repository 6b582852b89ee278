"""RTSP redirects through the server's relay (issue 40): FFmpeg follows an RTSP 3xx anywhere, so
a live rtsp:// source is opened through pipeline/serve/rtsp_relay.py, which checks every
redirect with the fetch policy, caps their number, and reads the server's bytes as FFmpeg does.
Fake RTSP servers on loopback (no GStreamer needed) and a recorder prove what was connected to;
the plays-through tests use GStreamer's server where the machine has it."""
from __future__ import annotations

import io
import socket
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve tests need the serve extra (fastapi)")

from pipeline.serve.fetch_policy import FetchPolicy, live_error, live_gap_reason
from pipeline.serve.rtsp_relay import Garbled, Refused, ReplyReader, c_int
from sources.errors import SourceError
from sources.live import open_live
from sources.live_connections import LiveConfig, RefusedByPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "live"))
from live_servers import rtsp_or_skip  # noqa: E402

QUICK = LiveConfig(open_timeout_s=3.0, read_timeout_s=2.0)


class Recorder:
    """A loopback listener that counts connections: a refused redirect must leave it at zero."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            self._handle(conn, self.connections)

    def _handle(self, conn: socket.socket, n: int) -> None:
        conn.close()

    def close(self) -> None:
        self.sock.close()


class Redirector(Recorder):
    """Answers every RTSP request with `status` and a Location (`location(n)` for its n-th
    connection), as a camera that moved, or an attacker's server, would."""

    def __init__(self, location, status: int = 302) -> None:
        self.location, self.status = location, status
        super().__init__()

    def _handle(self, conn: socket.socket, n: int) -> None:
        threading.Thread(target=self._answer, args=(conn, n), daemon=True).start()

    def _answer(self, conn: socket.socket, n: int) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                piece = conn.recv(4096)
                if not piece:
                    return
                data += piece
            cseq = next((line.split(b":", 1)[1].strip() for line in data.split(b"\r\n")
                         if line.lower().startswith(b"cseq:")), b"1")
            conn.sendall(b"RTSP/1.0 %d Moved\r\nCSeq: %s\r\nLocation: %s\r\n\r\n"
                         % (self.status, cseq, self.location(n).encode()))
            time.sleep(0.5)


@pytest.fixture
def recorder():
    r = Recorder()
    yield r
    r.close()


def policy(**kwargs) -> FetchPolicy:
    """Every host named here resolves to loopback; only the named ones may."""
    return FetchPolicy(allow_hosts=("cam.test",), pinned=(("cam.test", "127.0.0.1"), ("elsewhere.test", "127.0.0.1")),
                       **kwargs)


class TestRedirects:
    @pytest.mark.parametrize("target", ["rtsp://127.0.0.1:{port}/x", "rtsp://elsewhere.test:{port}/x",
                                        "rtsps://cam.test:{port}/x", "http://cam.test:{port}/x"])
    def test_a_redirect_the_policy_refuses_is_never_followed(self, recorder, target):
        server = Redirector(lambda n: target.format(port=recorder.port))
        try:
            url = f"rtsp://cam.test:{server.port}/cam"
            with pytest.raises(RefusedByPolicy) as e:
                open_live(url, config=LiveConfig(connect=policy().route, open_timeout_s=3.0))
            assert str(e.value) == f"{url}: redirect refused by policy" and "\n" not in str(e.value)
            assert live_error(str(e.value), "unreachable") == "refused by policy"
            time.sleep(0.3)
            assert recorder.connections == 0 and server.connections == 1
        finally:
            server.close()

    def test_without_the_relay_ffmpeg_follows_it(self, recorder):
        """What the relay is for: FFmpeg alone goes wherever the 3xx says (so the test above can fail)."""
        server = Redirector(lambda n: f"rtsp://127.0.0.1:{recorder.port}/x")
        try:
            with pytest.raises(SourceError):
                open_live(f"rtsp://127.0.0.1:{server.port}/cam", config=QUICK)
            time.sleep(0.3)
            assert recorder.connections == 1
        finally:
            server.close()

    def test_redirects_are_capped(self):
        """An allowed host that redirects to itself forever: max_redirects hops, then refused."""
        server = Redirector(lambda n: f"rtsp://cam.test:{server.port}/again{n}")
        try:
            with pytest.raises(RefusedByPolicy, match="redirect refused by policy$"):
                open_live(f"rtsp://cam.test:{server.port}/cam", config=LiveConfig(connect=policy(max_redirects=2).route,
                                                                                  open_timeout_s=5.0))
            assert server.connections == 3        # the first request and two redirects followed
        finally:
            server.close()

    def test_an_allowed_redirect_plays(self):
        """A redirect to a host the policy allows is followed, to the address that passed the check."""
        rtsp = rtsp_or_skip(fps=20)
        server = Redirector(lambda n: f"rtsp://cam.test:{rtsp.port}/cam")
        try:
            with open_live(f"rtsp://cam.test:{server.port}/old", config=LiveConfig(connect=policy().route)) as src:
                assert (src.width, src.height) == (160, 120)
                frames, deadline = 0, time.monotonic() + 10
                while frames < 5 and time.monotonic() < deadline:
                    frames += len(src.take(8)[0])
            assert frames >= 5 and server.connections == 1
        finally:
            server.close()
            rtsp.stop()

    def test_a_stream_plays_through_the_relay(self):
        rtsp = rtsp_or_skip(fps=20)
        try:
            url = f"rtsp://user:secret@cam.test:{rtsp.port}/cam"
            with open_live(url, config=LiveConfig(connect=policy().route)) as src:
                # what the store records: the client's URL, not the address or the relay (no password)
                assert src.name == f"rtsp://user:***@cam.test:{rtsp.port}/cam"
                frames, deadline = 0, time.monotonic() + 10
                while frames < 20 and time.monotonic() < deadline:
                    frames += len(src.take(8)[0])
            assert frames >= 20
        finally:
            rtsp.stop()

    def test_rtsps_needs_a_named_host(self):
        with pytest.raises(RefusedByPolicy, match="refused by policy$"):
            FetchPolicy(resolver=lambda h, p: ["93.184.216.34"]).route("rtsps://cam.example/s")
        route = policy().route("rtsps://cam.test/s")     # named: the operator vouches for its redirects
        assert route.url == "rtsps://127.0.0.1/s"


def frame(channel: int, payload: bytes) -> bytes:
    return b"$" + bytes([channel]) + len(payload).to_bytes(2, "big") + payload


class TestReplyReader:
    """The server's side read as FFmpeg's ff_rtsp_read_reply reads it."""

    def moved_to(self, location: str) -> str:
        return "rtsp://127.0.0.1:9/new"

    def test_media_and_bodies_pass_as_they_are_in_any_pieces(self):
        sdp = b"v=0\r\nm=video 0 RTP/AVP 96\r\n\r\n$not a frame\r\n"
        stream = (b"RTSP/1.0 200 OK\r\nCSeq: 2\r\nContent-Length: %d\r\n\r\n" % len(sdp) + sdp
                  + frame(0, b"\x80" * 1500) + frame(1, b"") + b"RTSP/1.0 200 OK\r\nCSeq: 3\r\n\r\n"
                  + frame(0, bytes(range(256)) * 200))
        for step in (1, 7, 4096, len(stream)):
            reader = ReplyReader(self.moved_to)
            out = b"".join(reader.feed(stream[i:i + step]) for i in range(0, len(stream), step))
            assert out == stream

    @pytest.mark.parametrize("status_line", [b"RTSP/1.0 302 Found", b"RTSP/1.0 301", b"anything 399 x",
                                             b"\tRTSP/1.0\t  307 x", b"RTSP/1.0 4294967598 x", b"RTSP/1.0 +302x",
                                             b"RTSP/1.0 " + b"0" * 1020 + b"302999", b"A\vB 302"])
    def test_every_reply_ffmpeg_reads_as_3xx_is_rewritten(self, status_line):
        reply = status_line + b"\r\nCSeq: 1\r\nLOCATION: rtsp://evil/a\r\nlocation:rtsp://evil/b\r\n\r\n"
        out = ReplyReader(self.moved_to).feed(reply)
        assert b"evil" not in out and out.endswith(b"Location: rtsp://127.0.0.1:9/new\r\n\r\n")

    def test_a_nul_line_ends_the_headers_as_for_ffmpeg(self):
        """FFmpeg reads lines as C strings: "\\0..." is the empty line that ends a reply, and a 302
        after it is the next reply, which must not pass as a header of the first."""
        reply = b"RTSP/1.0 200 OK\r\nCSeq: 1\r\n\0x\r\nRTSP/1.0 302 Moved\r\nLocation: rtsp://evil/\r\n\r\n"
        out = ReplyReader(self.moved_to).feed(reply)
        assert b"evil" not in out and out.endswith(b"Location: rtsp://127.0.0.1:9/new\r\n\r\n")

    def test_a_refused_redirect_passes_nothing(self):
        def refuse(location: str) -> str:
            raise Refused(location, "no")
        reader = ReplyReader(refuse)
        assert reader.feed(b"RTSP/1.0 200 OK\r\nCSeq: 1\r\n\r\n") == b"RTSP/1.0 200 OK\r\nCSeq: 1\r\n\r\n"
        assert reader.feed(b"RTSP/1.0 302 Moved\r\nCSeq: 2\r") == b""
        with pytest.raises(Refused):
            reader.feed(b"\nLocation: rtsp://10.0.0.1/\r\n\r\n")

    @pytest.mark.parametrize("data", [b"RTSP/1.0 200 OK\r\n" + frame(0, b"xx"), b"RTSP/1.0 200 OK\r\nX: " + b"a" * 5000,
                                      b"RTSP/1.0 200 OK\r\nContent-Length: 99999999\r\n\r\n"])
    def test_what_reads_ambiguously_cuts_the_connection(self, data):
        with pytest.raises(Garbled):
            ReplyReader(self.moved_to).feed(data)

    def test_c_integers(self):
        assert [c_int(t) for t in (b"302", b" \v302x", b"-1", b"x", b"4294967598", b"99999999999999999999999")] == \
            [302, 302, -1, 0, 302, -1]


class TestWhatAClientLearns:
    """Issue 40: after a stream opened, its failures read as before it opened; FFmpeg's words
    (which can name internal hosts) stay in the server's log."""

    def test_errors(self):
        gave_up = ("rtsp://cam.test/s: gave up after 3 failed reconnect attempts (--max-reconnects 3); last: stream "
                   "error: connection to 10.1.2.3 port 554 refused; reconnect failed: cannot open the stream (x)")
        assert live_error(gave_up, "unreachable") == "unreachable"
        assert live_error("rtsp://cam.test/s: redirect refused by policy", "unreachable") == "refused by policy"
        assert live_error("rtsp://cam.test/s: stream error: no route to 10.0.0.9", "the stream ended") == \
            "the stream ended"

    def test_gap_reasons(self):
        assert live_gap_reason("stream error: invalid data from 10.0.0.9") == "the stream ended"
        assert live_gap_reason("no frames for 3.0 s (read timeout 2 s); reconnect failed: cannot open the stream "
                               "(Server returned 404 Not Found: 10.0.0.9) (2 attempts)") == \
            "no frames for 3.0 s (read timeout 2 s); reconnect failed: unreachable"
        assert live_gap_reason("server closed the connection; reconnect failed: redirect refused by policy; gave up") \
            == "the stream ended; reconnect failed: refused by policy; gave up"


class TestAStreamThatOpened:
    """A network stream that opened and then fails: its events and status carry the policy's words."""

    RAW = "rtsp://cam.test/s: stream error: connection to 10.1.2.3 port 554 reset by peer"

    def run_stream(self, monkeypatch, run_live):
        pytest.importorskip("fastapi", reason="the serve tests need the serve extra (fastapi)")
        from types import SimpleNamespace

        from pipeline.serve import streams as streams_mod
        from pipeline.serve.options import ServeOptions

        opened = threading.Event()       # the stream fails once its start has answered

        def run_after_start(*args, on_graph, **kwargs):
            return run_live(*args, on_graph=lambda graph: (on_graph(graph), opened.wait(10)), **kwargs)
        monkeypatch.setattr(streams_mod, "run_live", run_after_start)
        service = SimpleNamespace(name="v", geometry=None, config=None, warning=None)
        engine = SimpleNamespace(options=ServeOptions(stream_events=16), cfg=None, service=service, model=None,
                                 frontends=None, metrics=None,
                                 media=SimpleNamespace(live_source=lambda ref, owner: (ref, False, ref)))
        live = streams_mod.LiveStreams(engine)
        stream = live.start("rtsp://cam.test/s", "q", every_s=1.0, on_scene_change=False, duration_s=None)
        opened.set()
        stream.thread.join(10)
        return stream, stream.events.since(0)

    def test_a_stream_that_gives_up(self, monkeypatch):
        from types import SimpleNamespace

        from sources.live import Gap

        def run_live(specs, question, out, cfg, *, on_graph, on_gap, **kwargs):
            on_graph(None)
            on_gap("s", Gap("s", 1.0, 2.0, 1.0, 2.0, "stream error: reset by 10.1.2.3; reconnect failed: "
                                                      "cannot open the stream (Connection refused by 10.1.2.3)"))
            return SimpleNamespace(errors=[f"{self.RAW}; gave up after 3 failed reconnect attempts"], answers=[],
                                   wall_s=1.0)
        stream, events = self.run_stream(monkeypatch, run_live)
        assert stream.error == "unreachable" and "10.1.2.3" not in str(events)
        assert [e[1] for e in events] == ["gap", "end"] and events[-1][2]["error"] == "unreachable"
        assert events[0][2]["reason"] == "the stream ended; reconnect failed: unreachable"

    def test_a_stream_that_fails_after_it_opened(self, monkeypatch):
        from pipeline.core.graph import StageError
        from sources.errors import SourceError

        def run_live(specs, question, out, cfg, *, on_graph, **kwargs):
            on_graph(None)
            raise StageError("capture", "frame 9", SourceError(self.RAW))
        stream, events = self.run_stream(monkeypatch, run_live)
        assert stream.error == "the stream ended" and events[-1][2]["error"] == "the stream ended"


class TestWhatTheStoreRecords:
    """The live URL as the client gave it (no password), never the address it resolved to."""

    def test_the_server_opens_the_clients_url(self, tmp_path):
        pytest.importorskip("fastapi", reason="the serve tests need the serve extra (fastapi)")
        from pipeline.serve.media import Media
        from pipeline.serve.options import ServeOptions
        from sources.live import parse_source

        media = Media(ServeOptions(store=str(tmp_path / "s.zarr"), allow_media_hosts=("cam.test",),
                                   media_resolve=(("cam.test", "10.0.0.7"),)))
        for url in ("rtsp://u:pw@cam.test:8554/s", "http://u:pw@cam.test/live.ts"):
            spec, realtime, shown = media.live_source(url)
            assert parse_source(spec).name == shown == url.replace(":pw@", ":***@") and not realtime
        assert parse_source(media.resolve("rtsp://u:pw@cam.test:8554/s").target).name == "rtsp://u:***@cam.test:8554/s"

    def test_a_run_through_the_relay_stores_the_clients_url(self, tmp_path):
        from pipeline.config import PipelineConfig, RuntimeConfig
        from pipeline.core.live_stages import LiveOptions
        from pipeline.runners.live import run_live
        from sinks import read_stream

        rtsp = rtsp_or_skip(fps=20)
        try:
            url = f"rtsp://u:pw@cam.test:{rtsp.port}/cam"
            untrained = {"model_weights": "none"} if "model_weights" in {f.name for f in fields(RuntimeConfig)} else {}
            cfg = PipelineConfig(runtime=RuntimeConfig(device="cpu", batch_size=4, **untrained))
            with pytest.warns(UserWarning, match="no VLM is loaded"):
                result = run_live([url], "q", tmp_path / "o.zarr", cfg, live=LiveConfig(connect=policy().route),
                                  options=LiveOptions(duration_s=1.5), stream_ids=["s"], status_out=io.StringIO())
        finally:
            rtsp.stop()
        data = read_stream(tmp_path / "o.zarr", "s")
        assert data["attrs"]["source"] == f"rtsp://u:***@cam.test:{rtsp.port}/cam" and len(data["pts"]) > 0
        assert result.errors == []
