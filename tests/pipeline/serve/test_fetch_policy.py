"""Outbound fetches (issue 40): a client's URL never makes the server connect to loopback, private,
link-local or other internal addresses, by any spelling, by a name that resolves there, or by a
redirect; `--allow-media-host` lets exactly the named hosts through. Against a real server process;
a loopback listener that records connections proves that no connection was made."""
from __future__ import annotations

import ipaddress
import socket
import time

import pytest

pytest.importorskip("fastapi", reason="the serve tests need the serve extra (fastapi)")

from pipeline.serve.fetch_policy import FetchPolicy, blocked_address
from pipeline.serve.errors import ApiError
from serve_client import chat_body
from serve_process import Recorder, ServeProcess, media_fixture, request  # noqa: F401 - media_fixture: the `media` fixture

FLAGS = ("--allow-media-host", "media.allowed", "--allow-media-host", "*.cdn.test",
         "--media-resolve", "media.allowed=127.0.0.1", "--media-resolve", "other.allowed=127.0.0.1",
         "--media-resolve", "looks-public.example=127.0.0.1", "--media-resolve", "a.cdn.test=127.0.0.1",
         "--media-resolve", "cdn.test.evil=127.0.0.1", "--media-resolve", "v6.example=::1",
         "--max-fetch-mb", "2", "--max-upload-mb", "2")


class TestAddresses:
    @pytest.mark.parametrize("address", [
        "127.0.0.1", "127.255.0.9", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
        "0.0.0.0", "224.0.0.1", "239.255.255.250", "240.0.0.1", "255.255.255.255", "192.0.2.1",
        "::1", "::", "fe80::1", "fc00::1", "fd12:3456::1", "ff02::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
        "::ffff:169.254.169.254", "64:ff9b::7f00:1", "64:ff9b::a00:1", "2002:7f00:1::1", "2001:db8::1", "::127.0.0.1"])
    def test_internal_addresses_are_blocked(self, address):
        assert blocked_address(ipaddress.ip_address(address))

    @pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8",
                                         "64:ff9b::808:808", "2002:808:808::1"])
    def test_public_addresses_pass(self, address):
        assert not blocked_address(ipaddress.ip_address(address))

    def test_one_internal_answer_refuses_the_name(self):
        policy = FetchPolicy(resolver=lambda host, port: ["93.184.216.34", "127.0.0.1"])
        with pytest.raises(ApiError) as e:
            policy.addresses("http://mixed.example/a.mp4", "x")
        assert e.value.status == 403 and e.value.message.endswith("refused by policy")
        assert FetchPolicy(resolver=lambda h, p: ["93.184.216.34"]).addresses("http://a.example/", "x") == \
            ["93.184.216.34"]

    def test_wildcards_and_hosts_only(self):
        policy = FetchPolicy(allow_hosts=("*.cdn.test", "Media.Allowed"), hosts_only=True,
                             resolver=lambda h, p: ["10.0.0.5"])
        assert policy.addresses("http://a.b.cdn.test/x", "x") == ["10.0.0.5"]
        assert policy.addresses("http://MEDIA.allowed./x", "x") == ["10.0.0.5"]
        for url in ("http://cdn.test.evil/x", "http://cdn.test/x", "http://public.example/x"):
            with pytest.raises(ApiError, match="refused by policy"):
                policy.addresses(url, "x")

    def test_live_streams_go_to_the_checked_address(self):
        """Per connection: http(s) pinned with its Host header and FFmpeg's redirects off; rtsp
        through the relay (test_rtsp_relay.py), over TCP, credentials kept for FFmpeg to send."""
        policy = FetchPolicy(allow_hosts=("cam.local",), pinned=(("cam.local", "10.0.0.7"),))
        route = policy.route("http://cam.local/live.ts")
        assert route.url == "http://10.0.0.7/live.ts" and route.options == {"headers": "Host: cam.local\r\n",
                                                                             "max_redirects": "0"}
        route = policy.route("rtsp://u:p@cam.local:8554/s?x=1")
        try:
            assert route.url.startswith("rtsp://u:p@127.0.0.1:") and route.url.endswith("/s?x=1")
            assert route.options == {"rtsp_transport": "tcp"} and route.refusal() is None
        finally:
            route.close()


@pytest.fixture(scope="module")
def recorder():
    r = Recorder()
    yield r
    r.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, videos):
    with ServeProcess(tmp_path_factory.mktemp("policy"), *FLAGS, "--allow-dir", str(videos.allowed)) as proc:
        yield proc


def _refused(served, url: str, status: int = 403) -> dict:
    start = time.monotonic()
    code, body, _ = request(served, "POST", "/v1/chat/completions", chat_body(url))
    assert code == status, body
    assert time.monotonic() - start < 10
    return body


class TestRefusedThroughARealServer:
    @pytest.mark.parametrize("template", [
        "http://127.0.0.1:{p4}/a.mp4", "http://127.9.9.9:{p4}/a.mp4", "http://[::1]:{p6}/a.mp4",
        "http://[::ffff:127.0.0.1]:{p4}/a.mp4", "http://[::ffff:7f00:1]:{p4}/a.mp4",
        "http://2130706433:{p4}/a.mp4", "http://0x7f.1:{p4}/a.mp4", "http://localhost:{p4}/a.mp4",
        "http://looks-public.example:{p4}/a.mp4", "http://other.allowed:{p4}/a.mp4",
        "http://cdn.test.evil:{p4}/a.mp4", "http://user:pw@127.0.0.1:{p4}/a.mp4", "https://127.0.0.1:{p4}/a.mp4",
        "http://10.1.2.3:{p4}/a.mp4", "http://169.254.169.254/latest/meta-data/", "http://[fd00::1]/a.mp4",
        "http://0.0.0.0:{p4}/a.mp4", "rtsp://127.0.0.1:{p4}/cam", "rtsp://looks-public.example:{p4}/cam"])
    def test_internal_urls_are_refused_before_any_connection(self, served, recorder, template):
        url = template.format(p4=recorder.port4, p6=recorder.port6)
        body = _refused(served, url)
        assert body["error"]["message"].endswith("refused by policy") and body["error"]["code"] == "url_refused"
        time.sleep(0.1)
        assert recorder.connections == []

    def test_live_streams_are_refused_too(self, served, recorder):
        for url in (f"rtsp://127.0.0.1:{recorder.port4}/cam", f"http://[::1]:{recorder.port6}/live.ts",
                    f"http://looks-public.example:{recorder.port4}/live.ts"):
            code, body, _ = request(served, "POST", "/v1/streams", {"source": url, "question": "what moves?"})
            assert code == 403 and body["error"]["message"].endswith("refused by policy"), body
        assert recorder.connections == []

    @pytest.mark.parametrize("target", ["http://127.0.0.1:{p4}/x.mp4", "http://[::1]:{p6}/x.mp4",
                                        "http://other.allowed:{p4}/x.mp4", "file:///etc/passwd",
                                        "http://169.254.169.254/latest/"])
    def test_a_redirect_from_an_allowed_host_to_an_internal_one(self, served, recorder, media, target):
        to = target.format(p4=recorder.port4, p6=recorder.port6)
        body = _refused(served, f"http://media.allowed:{media.server_address[1]}/redirect?to={to}")
        assert body["error"]["message"].endswith("refused by policy")
        assert recorder.connections == []

    def test_redirects_are_capped(self, served, media):
        body = _refused(served, f"http://media.allowed:{media.server_address[1]}/loop")
        assert body["error"]["message"].endswith("refused by policy")

    def test_errors_say_unreachable_and_nothing_more(self, served, media):
        port = media.server_address[1]
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
        closed.close()
        for url in (f"http://media.allowed:{port}/missing.mp4", f"http://media.allowed:{dead_port}/a.mp4",
                    f"http://media.allowed:{port}/auth/small.mp4", "http://no-such-host.invalid/a.mp4"):
            body = _refused(served, url, 400)
            assert body["error"]["message"] == f"cannot fetch {url!r}: unreachable", body


    def test_a_live_source_that_redirects_inside_is_not_followed(self, served, recorder, media):
        """A live http(s) source is opened by FFmpeg at the checked address with its redirects off:
        a redirect to loopback fails the start (4xx) and nothing connects there."""
        to = f"http://127.0.0.1:{recorder.port4}/live.ts"
        source = f"http://media.allowed:{media.server_address[1]}/redirect?to={to}"
        code, body, _ = request(served, "POST", "/v1/streams", {"source": source, "question": "what moves?"})
        assert 400 <= code < 500, body
        time.sleep(0.5)
        assert recorder.connections == []

    def test_an_rtsp_redirect_inside_is_refused(self, served, recorder):
        """FFmpeg would follow an RTSP 3xx anywhere: the relay checks it, nothing connects to the
        internal address, and the client reads one line (test_rtsp_relay.py has the details)."""
        from test_rtsp_relay import Redirector

        camera = Redirector(lambda n: f"rtsp://127.0.0.1:{recorder.port4}/cam")
        try:
            url = f"rtsp://media.allowed:{camera.port}/cam"
            code, body, _ = request(served, "POST", "/v1/streams", {"source": url, "question": "q"})
            assert code == 403 and body["error"]["message"] == f"cannot open live source {url!r}: refused by policy"
            code, body, _ = request(served, "POST", "/v1/chat/completions", chat_body(url))
            assert code == 403 and body["error"]["message"] == f"cannot open live source {url!r}: refused by policy"
            time.sleep(0.3)
            assert recorder.connections == [] and camera.connections >= 2
        finally:
            camera.close()

    def test_live_sources_say_unreachable_and_nothing_more(self, served, media):
        """An allowed host's live source that cannot be opened reads the same whether nothing
        listens there or something that is no stream answers: no port scan through the server."""
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
        closed.close()
        for port in (dead_port, media.server_address[1]):
            url = f"rtsp://media.allowed:{port}/cam"
            code, body, _ = request(served, "POST", "/v1/streams", {"source": url, "question": "q"})
            assert code == 400 and body["error"]["message"] == f"cannot open live source {url!r}: unreachable", body
            code, body, _ = request(served, "POST", "/v1/chat/completions", chat_body(url))
            assert code == 400 and body["error"]["message"] == f"cannot open live source {url!r}: unreachable", body


def test_the_connection_goes_to_the_address_that_was_checked(monkeypatch, recorder, tmp_path):
    """No DNS rebinding: the host is resolved once, and the connection goes to the address that
    passed the check, not to whatever a second lookup would answer (here: loopback)."""
    from pipeline.serve.admission import Deadline
    from pipeline.serve.fetch_policy import fetch

    real, looked_up = socket.getaddrinfo, []

    def rebinding(host, port, *args, **kwargs):
        if host != "rebind.example":
            return real(host, port, *args, **kwargs)
        looked_up.append(host)
        address = "93.184.216.34" if len(looked_up) == 1 else "127.0.0.1"    # public for the check, then not
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]
    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    with pytest.raises(ApiError) as e:       # no network here: the checked public address is unreachable
        fetch(f"http://rebind.example:{recorder.port4}/a.mp4", tmp_path / "a.mp4", FetchPolicy(), limit=1 << 20,
              read_timeout_s=1.0, deadline=Deadline(5.0), shown="x", too_large=lambda n: ApiError(413, "large"))
    assert e.value.status == 400 and e.value.message.endswith("unreachable")
    time.sleep(0.1)
    assert looked_up == ["rebind.example"] and recorder.connections == []


class TestAllowedHosts:
    def test_the_named_host_is_fetched(self, served, media):
        port = media.server_address[1]
        for url in (f"http://media.allowed:{port}/small.mp4", f"http://a.cdn.test:{port}/small.mp4",
                    f"http://media.allowed:{port}/redirect?to=/small.mp4"):
            code, body, _ = request(served, "POST", "/v1/chat/completions", chat_body(url))
            assert code == 200 and body["arrcoc"]["frames"] == 24, body

    def test_credentials_in_the_url_are_sent(self, served, media):
        url = f"http://user:pw@media.allowed:{media.server_address[1]}/auth/small.mp4"
        code, body, _ = request(served, "POST", "/v1/chat/completions", chat_body(url))
        assert code == 200 and body["arrcoc"]["frames"] == 24, body
        port = media.server_address[1]
        within = f"http://user:pw@media.allowed:{port}/redirect?to=/auth/small.mp4"      # the same host: kept
        assert request(served, "POST", "/v1/chat/completions", chat_body(within))[0] == 200
        away = f"http://user:pw@media.allowed:{port}/redirect?to=http://a.cdn.test:{port}/auth/small.mp4"
        assert _refused(served, away, 400)["error"]["message"].endswith("unreachable")   # not carried away
        wrong = url.replace("user:pw", "user:nope")
        shown = wrong.replace(":nope", ":***")
        assert _refused(served, wrong, 400)["error"]["message"] == f"cannot fetch {shown!r}: unreachable"


def test_allow_private_media_lifts_the_check(tmp_path, media):
    url = f"http://127.0.0.1:{media.server_address[1]}/small.mp4"
    with ServeProcess(tmp_path, "--allow-private-media") as proc:
        code, body, _ = request(proc, "POST", "/v1/chat/completions", chat_body(url))
        assert code == 200 and body["arrcoc"]["frames"] == 24, body


def test_a_live_http_stream_of_a_named_host_is_followed(served, tmp_path):
    """The live source is pinned to the checked address (FFmpeg given the Host header, no redirects)."""
    from live_servers import http_ts_server
    from serve_client import sse

    with http_ts_server(tmp_path, seconds=3.0) as ts:
        url = ts.url().replace("127.0.0.1", "media.allowed")
        code, stream, _ = request(served, "POST", "/v1/streams", {"source": url, "question": "q", "every": 0.5,
                                                                  "duration": 3})
        assert code == 201, stream
        events = [e for e, _, _ in sse(served, f"/v1/streams/{stream['id']}/events", key=served.api_key)]
    assert "answer" in events and events[-1] == "end", events
