"""The HTTP app (FastAPI): OpenAI's chat completions with video, uploads, the homunculus of every
request, live streams as server-sent events, health, Prometheus metrics and the viewer page at `/`.

Every error is one line in OpenAI's error shape with a 4xx status for the client's mistakes (the
server keeps serving); with an API key set, every /v1 route needs `Authorization: Bearer <key>`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import mimetypes
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException, MultiPartParser

from sources import SourceError

from ..core.graph import StageError
from .engine import Engine
from .errors import ApiError, error_body
from .limits import answer_period, duration_s, parse_json
from .media import too_large
from .openai_api import DONE, answer_text, chunk, completion_body, extension, parse_chat, sse, window_line
from .owners import OWNER, owner_of, request_owner

STATIC = Path(__file__).with_name("static")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
log = logging.getLogger("pipeline.serve")


def create_app(engine: Engine) -> FastAPI:
    """The app over a built engine; the engine (live streams, the VLM batcher) closes when the app shuts down."""
    pool = ThreadPoolExecutor(max_workers=max(64, 4 * engine.options.max_concurrent), thread_name_prefix="serve")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.close)
        pool.shutdown(wait=False)

    app = FastAPI(title="ARR-COC video QA", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine = engine

    async def blocking(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, partial(fn, *args, **kwargs))

    _error_handlers(app)
    app.add_middleware(Guard, engine=engine)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text())

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.model_id, "device": str(engine.device),
                "live_streams": engine.streams.running(), "auth": engine.options.api_key is not None}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.model_id, "object": "model", "created": 0,
                                            "owned_by": "arr-coc", **engine.service.card}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await json_body(request)
        chat = await blocking(parse_chat, body, engine.model_id, engine.cfg)      # off the loop: linear, not free
        await blocking(engine.check_question, chat.question, "messages")
        ref = await blocking(engine.media.resolve, chat.video, request_owner(request))   # 4xx before anything runs
        request_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        windowed = ref.kind == "file" and (chat.every_s or engine.cfg.runtime.every_s) is not None
        if not chat.stream:
            completion = await blocking(engine.answer, ref, chat.question, request_id, every_s=chat.every_s)
            return completion_body(completion, engine.model_id, windowed)
        return StreamingResponse(_stream_answer(engine, blocking, ref, chat, request_id, windowed),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/files")
    async def upload(request: Request) -> dict[str, Any]:
        limit = engine.options.max_upload_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit + 64 * 1024:
            await _drain(request.stream(), limit)
            raise too_large("the upload", int(declared), limit, "--max-upload-mb")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "upload with multipart/form-data: a `file` field (and optionally `purpose`)",
                           param="file")
        parser = MultiPartParser(request.headers, _limited(request.stream(), limit + 64 * 1024),
                                 max_files=1, max_fields=4)
        try:
            form = await parser.parse()
        except MultiPartException as e:
            raise ApiError(400, f"malformed multipart upload: {e.message}", param="file") from None
        try:
            file = form.get("file")
            if file is None or isinstance(file, str):
                raise ApiError(400, "no file: send multipart/form-data with a `file` field", param="file")
            purpose = form.get("purpose") if isinstance(form.get("purpose"), str) else "user_data"
            saved = await blocking(engine.media.save_upload, file.filename or "video", file.file, purpose,
                                   request_owner(request))
        finally:
            await form.close()
        return saved.to_dict()

    @app.get("/v1/files")
    async def files(request: Request) -> dict[str, Any]:
        uploads = await blocking(engine.media.uploads_list, request_owner(request))
        return {"object": "list", "data": [u.to_dict() for u in uploads]}

    @app.get("/v1/files/{file_id}")
    async def file_info(file_id: str, request: Request) -> dict[str, Any]:
        return engine.media.upload(file_id, request_owner(request)).to_dict()

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> FileResponse:
        upload = engine.media.upload(file_id, request_owner(request))
        return FileResponse(engine.media.uploads / upload.id, media_type=_video_type(upload.filename),
                            filename=upload.filename)

    @app.delete("/v1/files/{file_id}")
    async def file_delete(file_id: str, request: Request) -> dict[str, Any]:
        engine.media.delete_upload(file_id, request_owner(request))
        return {"id": file_id, "object": "file", "deleted": True}

    @app.get("/v1/videos")
    async def videos() -> dict[str, Any]:
        return {"object": "list", "data": await blocking(engine.media.videos)}

    @app.get("/v1/videos/content")
    async def video_content(url: str) -> FileResponse:
        path = await blocking(engine.media.allowed_video, url)
        return FileResponse(path, media_type=_video_type(path.name))

    @app.get("/v1/homunculus/{stream_id}")
    async def homunculus(stream_id: str) -> dict[str, Any]:
        return await blocking(engine.homunculus, stream_id)

    @app.post("/v1/streams")
    async def stream_start(request: Request) -> JSONResponse:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        question = body.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ApiError(400, "no question: give the stream a non-empty \"question\"", param="question",
                           code="missing_question")
        if not isinstance(body.get("source"), str):
            raise ApiError(400, "no source: give the stream a \"source\" (rtsp://, http(s)://, file:// or file-<id>)",
                           param="source")
        every = answer_period(engine.cfg, body.get("every", 2.0))
        duration = None if body.get("duration") is None else duration_s(body["duration"])
        scene = body.get("on_scene_change", False)
        if not isinstance(scene, bool):
            raise ApiError(400, f"on_scene_change must be true or false, got {scene!r}", param="on_scene_change")
        await blocking(engine.check_question, question.strip(), "question")
        stream = await blocking(engine.streams.start, body["source"], question.strip(), every_s=every,
                                on_scene_change=scene, duration_s=duration, owner=request_owner(request))
        return JSONResponse(stream.to_dict(), status_code=201)

    @app.get("/v1/streams")
    async def streams(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [s.to_dict() for s in engine.streams.list(request_owner(request))]}

    @app.get("/v1/streams/{stream_id}")
    async def stream_info(stream_id: str, request: Request) -> dict[str, Any]:
        return engine.streams.get(stream_id, request_owner(request)).to_dict()

    @app.get("/v1/streams/{stream_id}/events")
    async def stream_events(stream_id: str, request: Request) -> StreamingResponse:
        stream = engine.streams.get(stream_id, request_owner(request))
        after = request.headers.get("last-event-id", "0")
        after = int(after) if after.isdigit() else 0

        async def events():
            async for number, kind, data in stream.events.follow(after):
                yield sse(data, event=kind, event_id=number)
        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    @app.delete("/v1/streams/{stream_id}")
    async def stream_stop(stream_id: str, request: Request) -> dict[str, Any]:
        stream = await blocking(engine.streams.delete, stream_id, request_owner(request))
        return {**stream.to_dict(), "deleted": True}

    return app


async def _stream_answer(engine: Engine, blocking: Callable[..., Any], ref: Any, chat: Any, request_id: str,
                         windowed: bool):
    """chat.completion.chunk events: the role, each window's answer as it is ready, the finish (with
    ARR-COC's extension), usage if asked for, then [DONE]. An error after the first event is sent
    as an error event (the status line has gone out already)."""
    model, created = engine.model_id, int(time.time())
    loop = asyncio.get_running_loop()
    answers: asyncio.Queue = asyncio.Queue()
    work = asyncio.ensure_future(blocking(engine.answer, ref, chat.question, request_id, every_s=chat.every_s,
                                          on_answer=lambda row: loop.call_soon_threadsafe(answers.put_nowait, row)))
    yield chunk(request_id, model, created, {"role": "assistant", "content": ""})
    sent = 0

    def piece(row: dict[str, Any]) -> str:
        text = window_line(row) if windowed else answer_text(row)
        return chunk(request_id, model, created, {"content": ("\n" if sent else "") + text})
    try:
        while not work.done() or not answers.empty():
            if answers.empty():
                waiter = asyncio.ensure_future(answers.get())
                await asyncio.wait({waiter, work}, return_when=asyncio.FIRST_COMPLETED)
                if not waiter.done():
                    waiter.cancel()
                    continue
                row = waiter.result()
            else:
                row = answers.get_nowait()
            yield piece(row)
            sent += 1
        completion = work.result()
    except Exception as e:  # noqa: BLE001 - the client learns why in the stream; the server keeps serving
        status, message = _classify(e)
        yield sse(error_body(status, message))
        yield DONE
        return
    yield chunk(request_id, model, created, {}, "stop", arrcoc=extension(completion))
    if chat.include_usage:
        yield chunk(request_id, model, created, None, usage=completion.usage())
    yield DONE


def _video_type(name: str) -> str:
    return mimetypes.guess_type(name)[0] or "application/octet-stream"


async def json_body(request: Request) -> Any:
    """The body as JSON; 413 past the upload limit (a data: URL is the largest thing a body carries)."""
    limit = request.app.state.engine.options.max_upload_bytes * 4 // 3 + (1 << 20)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _drain(request.stream(), limit)
        raise too_large("the request body", int(declared), limit, "--max-upload-mb")
    raw = b"".join([piece async for piece in _limited(request.stream(), limit, "the request body")])
    return await asyncio.get_running_loop().run_in_executor(None, parse_json, raw)


async def _limited(stream, limit: int, what: str = "the upload"):
    """The request body, refused (413) past `limit` bytes: an upload is never spooled beyond it."""
    size = 0
    async for piece in stream:
        size += len(piece)
        if size > limit:
            await _drain(stream, limit)
            raise too_large(what, None, limit, "--max-upload-mb")
        yield piece


async def _drain(stream, limit: int) -> None:
    """Read and drop the rest of a refused body (up to a few times the limit), so that a client still
    sending it reads the 413 instead of a broken pipe; beyond that the connection is just closed."""
    dropped = 0
    async for piece in stream:
        dropped += len(piece)
        if dropped > max(4 * limit, 16 << 20):
            break


def _classify(e: BaseException) -> tuple[int, str]:
    """(status, one line) for an exception raised while answering."""
    if isinstance(e, ApiError):
        return e.status, e.message
    inner = e.error if isinstance(e, StageError) else e
    line = (str(inner).strip().splitlines() or [type(inner).__name__])[0]
    if isinstance(inner, SourceError):
        return 400, line
    if isinstance(inner, ApiError):
        return inner.status, inner.message
    log.error("request failed", exc_info=e)
    return 500, f"{type(inner).__name__}: {line}"


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        return JSONResponse(error_body(400, f"{where}: {first.get('msg', 'invalid request')}", param=where),
                            status_code=400)

    @app.exception_handler(Exception)
    async def other_error(request: Request, e: Exception) -> JSONResponse:
        status, message = _classify(e)
        return JSONResponse(error_body(status, message), status_code=status)


class Guard:
    """ASGI middleware: the API key on /v1 routes, and every response counted in the metrics (route
    template, status, time until its last byte)."""

    def __init__(self, app: Any, engine: Engine) -> None:
        self.app, self.engine = app, engine
        self.expected = {f"Bearer {key}".encode(): owner_of(key) for key in engine.options.keys}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def observed(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                route = scope.get("route")
                self.engine.metrics.request(getattr(route, "path", "unmatched"), status[0], time.perf_counter() - start)

        if self.expected and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            owner = None
            for expected, key_owner in self.expected.items():     # every key compared: no timing tells which
                if hmac.compare_digest(given, expected):
                    owner = key_owner
            if owner is None:
                why = "missing" if not given else "wrong"
                body = error_body(401, f"{why} API key: send `Authorization: Bearer <key>` (the server's --api-key)",
                                  code="invalid_api_key")
                return await JSONResponse(body, status_code=401)(scope, receive, observed)
            scope.setdefault("state", {})[OWNER] = owner
        await self.app(scope, receive, observed)
