"""Quotas and retention (issue 40, issue 41 item 11's partial fetches): uploads beyond
--max-storage-gb evict the oldest and the disk stays under the cap; what is older than
--retention-s is gone; DELETE /v1/files/{id}; half-written fetches of a killed server are cleared at
start; one server per uploads directory; front-end graphs shared per shape and bounded."""
from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve tests need the serve extra (fastapi)")

from pipeline.core.frontend_graphs import FrontendGraphsPool
from pipeline.serve.admission import Deadline
from pipeline.serve.errors import ApiError
from pipeline.serve.media import Media
from pipeline.serve.options import ServeOptions
from pipeline.serve.retention import Retention
from serve_client import chat_body
from serve_process import ROOT, ServeProcess, request
from sources.synthetic import write_video

CAP_GB = 0.0005                       # 524 kB: a few of the ~70 kB uploads below
CAP = int(CAP_GB * (1 << 30))
RETENTION_S = 6.0


def _disk(*paths: Path) -> int:
    return sum(f.stat().st_size for p in paths for f in p.rglob("*") if f.is_file())


def _noise_video(path: Path, seed: int) -> Path:
    frames = np.random.default_rng(seed).integers(0, 255, (8, 96, 128, 3), dtype=np.uint8)   # (T, H, W, 3)
    return write_video(path, frames, fps=10)


def _upload(proc: ServeProcess, path: Path) -> tuple[int, dict]:
    boundary = "b0undary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{path.name}\"\r\n"
            f"Content-Type: video/mp4\r\n\r\n").encode() + path.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    code, reply, _ = request(proc, "POST", "/v1/files", raw=body,
                             headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    return code, reply


@pytest.fixture(scope="module")
def served(tmp_path_factory, videos):
    tmp = tmp_path_factory.mktemp("retention")
    left_behind = tmp / "serve.zarr.uploads" / "tmp" / "fetch-0123456789abcdef"   # a killed server's fetch
    left_behind.parent.mkdir(parents=True)
    left_behind.write_bytes(b"\0" * 1000)
    with ServeProcess(tmp, "--max-storage-gb", str(CAP_GB), "--retention-s", str(RETENTION_S), "--max-upload-mb",
                      "0.1", "--max-fetch-mb", "0.1", "--allow-dir", str(videos.allowed)) as proc:
        proc.left_behind = left_behind
        yield proc


def test_partial_fetches_are_cleared_at_start(served):
    assert not served.left_behind.exists()


def test_a_second_server_on_the_same_uploads_is_refused(served):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pipeline", "serve", "--vlm", "tiny-random", "--device", "cpu",
                          "--port", "0", "--out", str(served.store), "--set", "runtime.model_weights=none"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "is in use by another running server" in run.stderr, run.stderr


def test_uploads_beyond_the_cap_evict_the_oldest(served, tmp_path, videos):
    ids, uploaded = [], []
    for k in range(12):
        code, reply = _upload(served, _noise_video(tmp_path / f"noise{k}.mp4", k))
        assert code == 200, reply
        ids.append(reply["id"])
        uploaded.append(time.monotonic())
        assert _disk(served.uploads, served.store) <= CAP
        code, listing, _ = request(served, "GET", "/v1/files")
        kept = [f["id"] for f in listing["data"]]
        # the newest; at least 3 fit under the cap, of those younger than --retention-s (on a loaded
        # machine the oldest may have expired as well, with a second's slack for the clocks)
        young = sum(t > time.monotonic() - RETENTION_S + 1.0 for t in uploaded)
        assert kept == ids[len(ids) - len(kept):] and len(kept) >= min(3, young), (kept, ids)
    assert request(served, "GET", f"/v1/files/{ids[0]}")[0] == 404
    assert not (served.uploads / ids[0]).exists()
    # each request stores its homunculus: they count too, and the cap still holds
    for _ in range(6):
        code, reply, _ = request(served, "POST", "/v1/chat/completions", chat_body(videos.small.as_uri()))
        assert code == 200, reply
        assert _disk(served.uploads, served.store) <= CAP
    code, reply = _upload(served, _noise_video(tmp_path / "last.mp4", 12))
    assert code == 200, reply
    code, deleted, _ = request(served, "DELETE", f"/v1/files/{reply['id']}")
    assert code == 200 and deleted["deleted"] is True
    assert request(served, "GET", f"/v1/files/{reply['id']}")[0] == 404 and not (served.uploads / reply["id"]).exists()


def test_expired_files_and_homunculi_are_gone(served, videos):
    code, upload = _upload(served, videos.small)
    assert code == 200
    code, reply, _ = request(served, "POST", "/v1/chat/completions", chat_body(videos.small.as_uri()))
    assert code == 200
    assert request(served, "GET", f"/v1/homunculus/{reply['id']}")[0] == 200
    deadline = time.monotonic() + RETENTION_S + 20
    while time.monotonic() < deadline and (request(served, "GET", "/v1/files")[1]["data"] or
                                           request(served, "GET", f"/v1/homunculus/{reply['id']}")[0] != 404):
        time.sleep(0.5)
    assert request(served, "GET", "/v1/files")[1]["data"] == []
    assert not (served.uploads / upload["id"]).exists()
    assert request(served, "GET", f"/v1/homunculus/{reply['id']}")[0] == 404
    assert [p.name for p in (served.store / "streams").iterdir() if p.is_dir()] == []


class TestRetentionUnit:
    def test_room_refuses_when_only_busy_streams_are_left(self, tmp_path):
        uploads = tmp_path / "u"
        uploads.mkdir()
        (uploads / "file-000000000000000000000001").write_bytes(b"\0" * 800)
        (uploads / "file-000000000000000000000001.json").write_text("{}")
        busy = {"file-000000000000000000000001"}
        retention = Retention(uploads, str(tmp_path / "s.zarr"), retention_s=3600, max_bytes=1000,
                              busy=lambda: busy)
        retention.scan()
        assert [i.name for i in retention.items()] == ["file-000000000000000000000001"]
        with pytest.raises(ApiError) as e:
            retention.room(500)
        assert e.value.status == 507 and "--max-storage-gb" in e.value.message
        busy.clear()
        release = retention.room(500)                     # now the old one may go
        assert not (uploads / "file-000000000000000000000001").exists() and retention.reserved == 500
        release()
        release()
        assert retention.reserved == 0


def test_a_fetched_copy_goes_when_its_request_ends(tmp_path, videos):
    """A copy whose request ended before its answer ran (the client left while it was probed) is
    removed: retention counts the scratch directory but never prunes it."""
    media = Media(ServeOptions(store=str(tmp_path / "s.zarr"), max_upload_mb=1, max_fetch_mb=1, max_storage_gb=0.01))
    inline = "data:video/mp4;base64," + base64.b64encode(videos.small.read_bytes()).decode()
    deadline = Deadline()
    ref = media.resolve(inline, deadline=deadline)
    assert Path(ref.target).is_file() and ref.temporary
    deadline.cancel("client gone")
    assert list(media.scratch.iterdir()) == []
    ended = Deadline()
    ended.cancel("client gone")              # gone before the copy was probed: removed at once
    media.resolve(inline, deadline=ended)
    assert list(media.scratch.iterdir()) == []


def test_a_data_url_takes_room_under_the_cap(tmp_path):
    """A data: URL's video is written like a fetch: room is made first (the oldest upload goes),
    so the disk stays under --max-storage-gb."""
    options = ServeOptions(store=str(tmp_path / "s.zarr"), max_upload_mb=1, max_fetch_mb=1, max_storage_gb=0.002)
    media, cap = Media(options), options.max_storage_bytes
    retention = Retention(media.uploads, options.store, retention_s=3600, max_bytes=cap, busy=set)
    media.room = retention.room
    old = [f"file-{k:024d}" for k in range(2)]
    for k, name in enumerate(old):               # two uploads fill the cap, the first the older
        (media.uploads / name).write_bytes(b"\0" * (cap // 2 - 2000))
        (media.uploads / f"{name}.json").write_text("{}")
        os.utime(media.uploads / f"{name}.json", (time.time() - 100 + k,) * 2)
    retention.scan()
    video = _noise_video(tmp_path / "noise.mp4", 0).read_bytes()
    ref = media.resolve("data:video/mp4;base64," + base64.b64encode(video).decode())
    assert _disk(media.uploads) <= cap
    assert not (media.uploads / old[0]).exists() and (media.uploads / old[1]).exists()
    ref.discard()


class TestFrontendGraphsPool:
    def test_shared_per_shape_and_bounded(self):
        made = []

        class Graphs:
            settled = 0

            def settle(self):             # the run's last replays done before another run takes it
                self.settled += 1

        def make(*args):
            made.append(args)
            return Graphs()
        pool = FrontendGraphsPool(2, make)
        a = pool.take(("g", 96, 128), 1)
        pool.give_back(("g", 96, 128), a)
        assert pool.take(("g", 96, 128), 1) is a and len(made) == 1      # the next request reuses it
        b = pool.take(("g", 96, 128), 1)                                  # a concurrent one: its own
        assert b is not a and len(pool) == 2
        assert pool.take(("h", 48, 64), 1) is None                        # all in use: eager
        pool.give_back(("g", 96, 128), a)
        c = pool.take(("h", 48, 64), 1)                                   # replaces the idle one
        assert c is not None and c is not a and len(pool) == 2 and len(made) == 3
        pool.give_back(("g", 96, 128), b)
        pool.give_back(("h", 48, 64), c)
        assert len(pool) == 2 and (a.settled, b.settled, c.settled) == (2, 1, 1)

    def test_the_servers_requests_share_one_pool(self, server, videos, monkeypatch):
        """Every request of the server takes its front-end graphs from the engine's one pool, keyed by
        its shape, and gives them back (on CPU the pool makes none: the runs are eager)."""
        from serve_client import call

        taken, given = [], []

        class Recording(FrontendGraphsPool):
            def take(self, key, *args):
                taken.append(key)
                return super().take(key, *args)

            def give_back(self, key, graphs):
                given.append(key)
                super().give_back(key, graphs)
        monkeypatch.setattr(server.engine, "frontends", Recording(2, lambda *args: None))
        for url in (videos.small.as_uri(), videos.small.as_uri(), videos.demo.as_uri()):
            status, body = call(server, "POST", "/v1/chat/completions", chat_body(url))
            assert status == 200, body
        assert taken == given and len(taken) == 3
        assert taken[0] == taken[1] and taken[0][1:] == (96, 128) and taken[2][1:] == (120, 160)

    def test_no_graphs_on_cpu(self):
        pool = FrontendGraphsPool(1, lambda *args: None)
        assert pool.take(("g",)) is None and len(pool) == 0
        pool.give_back(("g",), None)
        assert len(pool) == 0
