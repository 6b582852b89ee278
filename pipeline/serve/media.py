"""Where a request's video comes from, and what the server refuses.

    file:///abs/path.mp4   only inside an --allow-dir directory, compared after os.path.realpath
                           (so `..` and symlinks that lead out are refused whatever the file is)
    file-<24 hex>          a video uploaded with POST /v1/files (multipart field `file`)
    http(s)://...          fetched to a temporary file (at most max_fetch_mb), deleted after the request
    data:video/...;base64  inline, at most max_upload_mb
    rtsp(s)://...          a live stream: answered over a short live window (chat) or followed (streams)

Every refusal is an ApiError naming the input and why; a file that is not a readable video is
refused before any model runs.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Literal
from urllib.parse import unquote, urlsplit

from sources import SourceError, open_video
from sources.live import redact

from .admission import Deadline
from .errors import ApiError
from .fetch_policy import LIVE_SCHEMES, fetch
from .options import MB, ServeOptions
from .retention import claim_uploads

UPLOAD_ID = re.compile(r"file-[0-9a-f]{24}")
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mkv", ".mov", ".avi", ".webm", ".ts", ".mpg", ".mpeg")
_COPY_CHUNK = 1 << 20


@dataclass(frozen=True)
class VideoRef:
    """A request's video, resolved: a local file to process, or a live URL to watch."""

    kind: Literal["file", "live"]
    target: str                 # a local path (file) or the URL (live)
    source: str                 # what the store records: the reference, any password removed
    temporary: bool = False     # a fetched copy, deleted once the request is done

    def discard(self) -> None:
        if self.temporary:
            Path(self.target).unlink(missing_ok=True)


@dataclass(frozen=True)
class Upload:
    id: str
    filename: str
    bytes: int
    created_at: int
    purpose: str
    owner: str = ""             # owners.py: the API key that uploaded it (never shown)

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed"}


class Media:
    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.allow_dirs = tuple(Path(os.path.realpath(d)) for d in options.allow_dirs)
        self.uploads = options.upload_dir
        self.uploads.mkdir(parents=True, exist_ok=True)
        self.scratch = self.uploads / "tmp"      # fetched videos while a request uses them
        self.owner = claim_uploads(self.uploads)   # one server per uploads directory
        shutil.rmtree(self.scratch, ignore_errors=True)   # what a killed server was fetching
        self.scratch.mkdir(exist_ok=True)
        self.policy = options.fetch_policy
        self.room: Callable[..., Callable[[], None]] | None = None    # retention: room for this many bytes

    # ---- chat requests ----
    def resolve(self, ref: str, owner: str = "", deadline: Deadline | None = None) -> VideoRef:
        """The video a content part names (may download: call it off the event loop)."""
        if not isinstance(ref, str) or not ref.strip():
            raise ApiError(400, "video_url.url must be a non-empty string", param="messages")
        if UPLOAD_ID.fullmatch(ref):
            return VideoRef("file", str(self.upload_path(ref, owner)), ref)
        scheme = urlsplit(ref).scheme.lower()
        if scheme == "file":
            path = self.allowed_path(ref)
            return VideoRef("file", str(self.probe(path, ref)), ref)
        if scheme in ("http", "https"):
            return self._scratch_ref(self.fetch(ref, deadline), redact(ref), redact(ref), deadline)
        if scheme == "data":
            return self._scratch_ref(self.inline(ref), "the data: URL", "data:", deadline)
        if scheme in LIVE_SCHEMES:
            self.policy.check_live(ref, redact(ref))    # refused now; each connection is checked again
            return VideoRef("live", ref, redact(ref))
        raise unsupported(ref)

    @staticmethod
    def _scratch_ref(path: Path, shown: str, source: str, deadline: Deadline | None) -> VideoRef:
        """A fetched or inline copy as the request's video, once it probes as one. It is removed when
        the request ends however it ends: a client that leaves while the copy is probed gets its
        request cancelled before any answer runs, and the answer is what discards it otherwise."""
        try:
            Media.probe(path, shown)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        ref = VideoRef("file", str(path), source, temporary=True)
        if deadline is not None:
            deadline.on_cancel(ref.discard)
        return ref

    def live_source(self, ref: str, owner: str = "") -> tuple[str, bool, str]:
        """A live stream's source -> (spec for run_live, realtime file?, what is shown). Network
        streams are checked by the fetch policy now and at each connection (LiveConfig.connect:
        FetchPolicy.route); files (allowed or uploaded) are played at their frame rate."""
        if not isinstance(ref, str) or not ref.strip():
            raise ApiError(400, "source must be a non-empty string", param="source")
        if UPLOAD_ID.fullmatch(ref):
            return str(self.upload_path(ref, owner)), True, ref
        scheme = urlsplit(ref).scheme.lower()
        if scheme in LIVE_SCHEMES or scheme in ("http", "https"):
            self.policy.check_live(ref, redact(ref))
            return ref, False, redact(ref)
        if scheme == "file":
            return str(self.probe(self.allowed_path(ref), ref)), True, ref
        if scheme == "" and (ref.isdigit() or ref.startswith("/dev/")):
            raise ApiError(400, f"source {ref!r}: the server's cameras are not served over HTTP; "
                                f"stream them as rtsp:// or use `python -m pipeline live`", param="source")
        raise ApiError(400, f"unsupported source {redact(ref)!r}; supported: rtsp(s)://, http(s):// streams, "
                            f"file:// (inside --allow-dir, played in real time) or file-<id> uploads",
                       param="source")

    def allowed_path(self, url: str) -> Path:
        """file:// URL -> its real path, only if that lies inside an --allow-dir directory."""
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ApiError(400, f"{url!r}: file:// URLs must name a local path (file:///abs/path)", param="messages")
        if not self.allow_dirs:
            raise ApiError(403, f"{url!r}: file:// inputs are off; the server was started without --allow-dir",
                           code="path_not_allowed", param="messages")
        raw = unquote(parts.path)
        if not os.path.isabs(raw) or "\0" in raw:
            raise ApiError(400, f"{url!r}: file:// URLs need an absolute path (and no NUL byte)", param="messages")
        real = Path(os.path.realpath(raw))
        if not self.inside(real):
            raise ApiError(403, f"{url!r} is outside the allowed directories (--allow-dir); "
                                f"`..` and symlinks are resolved first", code="path_not_allowed", param="messages")
        if not real.is_file():
            raise ApiError(404, f"{url!r}: no such file", code="file_not_found", param="messages")
        return real

    def inside(self, real: Path) -> bool:
        """A real path (symlinks resolved) lies inside an --allow-dir directory."""
        return any(real == d or d in real.parents for d in self.allow_dirs)

    def allowed_video(self, url: str) -> Path:
        """file:// URL -> its real path, only if it is inside --allow-dir and a video (by its name and
        its content): GET /v1/videos/content serves videos, not the other files of those
        directories (probes the file: call it off the event loop)."""
        path = self.allowed_path(url)
        if path.suffix.lower() not in VIDEO_SUFFIXES:
            raise ApiError(403, f"{url!r} is not a video file ({', '.join(VIDEO_SUFFIXES)}): only videos are served",
                           code="not_a_video", param="url")
        return self.probe(path, url)

    def fetch(self, url: str, deadline: Deadline | None = None) -> Path:
        """Download an http(s) video to a scratch file through the fetch policy (fetch_policy.py),
        refusing more than max_fetch_mb; the deadline cuts it (and the client leaving does)."""
        limit, shown = self.options.max_fetch_bytes, redact(url)
        path = self.scratch / f"fetch-{uuid.uuid4().hex}"
        fetch(url, path, self.policy, limit=limit, read_timeout_s=self.options.fetch_timeout_s,
              deadline=deadline or Deadline(), shown=shown, room=self._room,
              too_large=lambda size: too_large(f"the video at {shown!r}", size, limit, "--max-fetch-mb"))
        return path

    @contextlib.contextmanager
    def _room(self, nbytes: int, upload: str | None = None) -> Iterator[None]:
        """Room for nbytes under --max-storage-gb while they are written (retention.Retention.room);
        an upload is counted as it is once written."""
        release = self.room(nbytes, upload) if self.room is not None else (lambda: None)
        try:
            yield
        finally:
            release()

    def inline(self, url: str) -> Path:
        """data:video/<type>;base64,<data> -> a scratch file, written into room made for it under
        --max-storage-gb as a fetch is."""
        head, sep, data = url.partition(",")
        if not sep or not head.lower().startswith("data:video/") or not head.lower().endswith(";base64"):
            raise ApiError(400, "data: URLs must be data:video/<type>;base64,<data>", param="messages")
        limit = self.options.max_upload_bytes
        if len(data) * 3 // 4 > limit:
            raise too_large("the data: URL's video", len(data) * 3 // 4, limit, "--max-upload-mb")
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError:
            raise ApiError(400, "the data: URL is not valid base64", param="messages") from None
        path = self.scratch / f"inline-{uuid.uuid4().hex}"
        with self._room(len(raw)):
            path.write_bytes(raw)
        return path

    @staticmethod
    def probe(path: Path, shown: str) -> Path:
        """The path, if it opens as a video with at least one frame; else a 400 naming it."""
        try:
            with open_video(path, threads=1) as video:
                next(iter(video))
        except (SourceError, StopIteration) as e:
            why = str(e).splitlines()[0] if str(e) else "not a readable video (no frames)"
            why = why.removeprefix(f"{path}: ").replace(str(path), shown)   # the server's paths stay private
            raise ApiError(400, f"{shown}: {why}", code="invalid_video", param="file") from None
        return path

    # ---- uploads (POST /v1/files) ----
    def save_upload(self, filename: str, data: BinaryIO, purpose: str, owner: str = "") -> Upload:
        """Copy an uploaded file in, refusing more than max_upload_mb and anything that is not a video."""
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        path = self.uploads / file_id
        data.seek(0, os.SEEK_END)       # the parser spooled it whole: its size is known
        expected = min(data.tell(), self.options.max_upload_bytes + 1)
        data.seek(0)
        with self._room(expected, file_id):   # until the file is listed (and counted)
            size = copy_limited(data, path, self.options.max_upload_bytes, f"upload {filename!r}", "--max-upload-mb")
            try:
                self.probe(path, f"upload {filename!r}")
            except ApiError:
                path.unlink(missing_ok=True)
                raise
            upload = Upload(file_id, Path(filename).name or "video", size, int(time.time()), purpose, owner)
            (self.uploads / f"{file_id}.json").write_text(json.dumps({**upload.to_dict(), "owner": owner}))
        return upload

    def upload(self, file_id: str, owner: str = "") -> Upload:
        """The upload `file_id` of `owner`; 404 if there is none (another key's uploads included)."""
        try:
            d = json.loads((self.uploads / f"{file_id}.json").read_text()) if UPLOAD_ID.fullmatch(file_id) else {}
        except (FileNotFoundError, ValueError):       # none, or removed meanwhile
            d = {}
        if not d or d.get("owner", "") != owner:
            raise ApiError(404, f"no uploaded file {file_id!r}; upload one with POST /v1/files",
                           code="file_not_found", param="file_id")
        return Upload(d["id"], d["filename"], d["bytes"], d["created_at"], d["purpose"], owner)

    def upload_path(self, file_id: str, owner: str = "") -> Path:
        self.upload(file_id, owner)
        return self.uploads / file_id

    def uploads_list(self, owner: str = "") -> list[Upload]:
        metas = sorted(self.uploads.glob("file-*.json"), key=lambda p: p.stat().st_mtime)
        found = []
        for meta in metas:
            with contextlib.suppress(ApiError):      # another owner's (or one deleted meanwhile)
                found.append(self.upload(meta.stem, owner))
        return found

    def delete_upload(self, file_id: str, owner: str = "") -> None:
        self.upload(file_id, owner)
        (self.uploads / file_id).unlink(missing_ok=True)
        (self.uploads / f"{file_id}.json").unlink(missing_ok=True)

    def videos(self, limit: int = 200) -> list[dict[str, Any]]:
        """Video files under the allowed directories (the page's chooser), as file:// URLs."""
        found: list[dict[str, Any]] = []
        for root in self.allow_dirs:
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    path = Path(dirpath) / name
                    if (path.suffix.lower() in VIDEO_SUFFIXES and path.is_file()
                            and self.inside(Path(os.path.realpath(path)))):     # no symlink that leads out
                        found.append({"url": path.as_uri(), "name": str(path.relative_to(root)),
                                      "bytes": path.stat().st_size})
                        if len(found) >= limit:
                            return found
        return found


def copy_limited(src: BinaryIO, dst: Path, limit: int, what: str, flag: str) -> int:
    """Copy src into dst; past `limit` bytes dst is removed and a 413 raised. -> bytes copied."""
    size = 0
    try:
        with open(dst, "wb") as out:
            while chunk := src.read(_COPY_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise too_large(what, None, limit, flag)
                out.write(chunk)
    except BaseException:
        dst.unlink(missing_ok=True)
        raise
    return size


def too_large(what: str, size: int | None, limit: int, flag: str) -> ApiError:
    have = f" ({size / MB:.1f} MB)" if size is not None else ""
    return ApiError(413, f"{what}{have} is over the server's limit of {limit / MB:g} MB ({flag})",
                    code="file_too_large")


def unsupported(ref: str) -> ApiError:
    scheme = urlsplit(ref).scheme.lower()
    shown = f"scheme {scheme + '://'!r}" if scheme else f"reference {redact(ref)[:80]!r}"
    return ApiError(400, f"unsupported video {shown}; supported: file:// (inside --allow-dir), http(s)://, "
                         f"rtsp(s)://, data:video/...;base64, or file-<id> from POST /v1/files",
                    code="unsupported_url", param="messages")

