"""One VLM for several processes: a spawned process loads it and answers every client's videos,
batched together (`batch --processes N --shared-vlm`, bench_batch --shared-vlm).

Why: on one GPU, `batch --processes N` runs N shard processes so that their host sides together keep
the GPU busy (one process's front end tops out first). With a VLM in each, every process decodes its
own answers: the decode steps of a 2B LM cost about the same for 16 rows as for 128 (a step reads
every weight once), so N processes pay N steps where one VLM answering all of their videos together
pays one. N VLMs also cost N times the weights and KV caches in GPU memory.

`VLMServer` (in the parent) starts the process, which builds its VLM with `factory` (picklable, as
for RemoteVLM) and listens on a Unix socket; `SharedVLM` (in each client) connects to it and offers
what the batch runner uses of a VLM: `answer_windows`, `geometry`, `config`, `name`, `warning`,
`counters`. A client sends each video's WindowQuestions (frames, keep map, questions) as its own
request, from any of its threads; the server hands them to one VLMBatcher, which answers whatever
is waiting, from every client, in one `VLM.answer_windows` call of up to `max_batch` videos. Errors
come back as in RemoteVLM: an answer's own error where it pickles, else VLMProcessError; a server
that dies fails every pending and later call with VLMProcessError. The server ignores Ctrl-C (the
parent stops the clients first, then closes it) and exits when its parent closes it or exits.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import shutil
import signal
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any, Callable

from pipeline.runtime.sockets import short_tempdir
from pipeline.vlm.remote import VLMProcessError, _send_error

AUTHKEY_ENV = "ARRCOC_VLM_AUTHKEY"       # a client process's key to the server (hex), not on its command line
MAX_SOCKET_DIR = 90                      # longer socket directories move to /tmp (sun_path is 108 bytes)


@dataclass(frozen=True)
class ServerAddress:
    """Where a VLMServer listens (a Unix socket path) and the key its clients present."""
    path: str
    authkey: bytes

    def to_env(self) -> dict[str, str]:
        return {AUTHKEY_ENV: self.authkey.hex()}

    @classmethod
    def from_env(cls, path: str) -> ServerAddress:
        key = os.environ.get(AUTHKEY_ENV)
        if not key:
            raise VLMProcessError(f"--vlm-server {path}: the shared VLM's key is not in the environment "
                                  f"({AUTHKEY_ENV}); this option is set by `batch --processes`")
        return cls(path, bytes.fromhex(key))


def _describe(vlm: Any) -> dict[str, Any]:
    return {"geometry": vlm.geometry, "config": vlm.config, "name": vlm.name, "warning": vlm.warning}


def _serve(factory: Callable[[], Any], address: ServerAddress, max_batch: int, control: Any) -> None:
    """The server process: load, listen, say ready, answer until the parent says stop (or is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C reaches the whole process group: the parent decides
    try:
        vlm = factory()
        listener = Listener(address.path, "AF_UNIX", authkey=address.authkey)
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        _send_error(control, e)
        return
    from pipeline.vlm.batcher import VLMBatcher

    batcher = VLMBatcher(vlm, max_batch=max_batch, max_wait_s=0.0, answer=vlm.answer_windows)
    info = _describe(vlm)
    threading.Thread(target=_accept, args=(listener, batcher, vlm, info), name="vlm-server-accept",
                     daemon=True).start()
    control.send(("ready", info))
    try:
        control.recv()                                  # None: stop; EOFError: the parent is gone
    except (EOFError, OSError):
        pass
    listener.close()
    batcher.close()


def _accept(listener: Listener, batcher: Any, vlm: Any, info: dict) -> None:
    while True:
        try:
            conn = listener.accept()
        except OSError:                                 # closed: the server is stopping
            return
        except Exception:  # noqa: BLE001 - a client with the wrong key, or one that hung up at once
            continue
        threading.Thread(target=_client, args=(conn, batcher, vlm, info), name="vlm-server-client",
                         daemon=True).start()


def _client(conn: Any, batcher: Any, vlm: Any, info: dict) -> None:
    """One client's requests: each (id, "answer", WindowQuestions) goes to the batcher, its answers
    go back as (id, "ok", [AnswerResult]) when ready, whichever order they finish in."""
    lock = threading.Lock()

    def reply(rid: int, status: str, payload: Any) -> None:
        with lock:
            try:
                conn.send((rid, status, payload))
            except (OSError, ValueError):               # the client is gone: nobody waits for it
                pass

    def answered(rid: int, future: Future) -> None:
        error = future.exception()
        if error is None:
            reply(rid, "ok", future.result())
            return
        with lock:
            try:
                _send_error(conn, error, rid)
            except (OSError, ValueError):
                pass

    reply(-1, "ok", info)
    while True:
        try:
            rid, method, payload = conn.recv()
        except (EOFError, OSError):
            conn.close()
            return
        if method == "answer":
            batcher.submit(payload).add_done_callback(lambda f, rid=rid: answered(rid, f))
        elif method == "counters":
            timings = list(batcher.timings)
            reply(rid, "ok", {"vlm": dict(getattr(vlm, "counters", {})),
                              "batch_sizes": list(batcher.batch_sizes),
                              # seconds: each batch's VLM call, and each video's wait for its batch
                              "answer_s": [t.answer_s for t in timings],
                              "queued_s": [q for t in timings for q in t.queued_s]})
        else:
            reply(rid, "error", (None, f"unknown request {method!r}"))


class VLMServer:
    """Start `factory()`'s VLM in a spawned process that serves SharedVLM clients at `address`."""

    def __init__(self, factory: Callable[[], Any], *, max_batch: int, start_timeout_s: float = 900.0) -> None:
        self._dir = str(short_tempdir("arrcoc-vlm-", MAX_SOCKET_DIR))
        self.address = ServerAddress(str(Path(self._dir) / "vlm.sock"), os.urandom(16))
        ctx = mp.get_context("spawn")
        self._control, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(factory, self.address, max_batch, child),
                                    name="vlm-server", daemon=True)
        self._process.start()
        child.close()
        try:
            if not self._control.poll(start_timeout_s):
                raise VLMProcessError(f"the shared VLM process did not start within {start_timeout_s:g} s")
            try:
                status, info = self._control.recv()
            except (EOFError, OSError):
                raise VLMProcessError(f"the shared VLM process exited while loading "
                                      f"(code {self._process.exitcode})") from None
            if status != "ready":
                error, text = info
                if error is not None:
                    raise error                         # e.g. VLMLoadError: as in-process
                raise VLMProcessError(f"the shared VLM process could not load its model: {text}")
        except BaseException:
            self.close()
            raise
        self.name = info["name"]

    def counters(self) -> dict:
        """SharedVLM.counters, read through a client of this parent's own (VLMProcessError when the
        server cannot be reached)."""
        client = SharedVLM(self.address)
        try:
            return client.counters
        finally:
            client.close()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the server (after the batch it is answering) and remove its socket."""
        try:
            self._control.send(None)
        except (OSError, ValueError):
            pass
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)
        self._control.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> VLMServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SharedVLM:
    """A client of a VLMServer: what the batch runner uses of a VLM, answered by the shared one.
    Thread-safe: each video in flight sends its request and waits for its own answers."""

    def __init__(self, address: ServerAddress) -> None:
        try:
            self._conn = Client(address.path, "AF_UNIX", authkey=address.authkey)
        except (OSError, EOFError) as e:
            raise VLMProcessError(f"cannot reach the shared VLM process at {address.path}: {e}") from None
        except mp.AuthenticationError:
            raise VLMProcessError(f"the shared VLM process at {address.path} refused this process's key") from None
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._failed: str | None = None
        _, status, info = self._conn.recv()
        self.geometry, self.config = info["geometry"], info["config"]
        self.name, self.warning = info["name"], info["warning"]
        self._reader = threading.Thread(target=self._read, name="shared-vlm-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                rid, status, payload = self._conn.recv()
            except (EOFError, OSError):
                self._fail("the shared VLM process exited")
                return
            with self._lock:
                future = self._pending.pop(rid, None)
            if future is None:
                continue
            if status == "ok":
                future.set_result(payload)
            else:
                error, text = payload
                future.set_exception(error if error is not None else VLMProcessError(f"in the shared VLM: {text}"))

    def _fail(self, reason: str) -> None:
        with self._lock:
            self._failed = self._failed or reason
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(VLMProcessError(self._failed))

    def _request(self, method: str, payload: Any = None) -> Future:
        future: Future = Future()
        with self._lock:
            if self._failed is not None:
                raise VLMProcessError(self._failed)
            rid = next(self._ids)
            self._pending[rid] = future
        try:
            with self._send_lock:
                self._conn.send((rid, method, payload))
        except (OSError, ValueError) as e:
            self._fail(f"the shared VLM process is gone: {e}")
        return future

    def answer_windows(self, windows: list) -> list[list]:
        """Each video's answers (VLM.answer_windows), its request batched with other clients' videos."""
        futures = [self._request("answer", window) for window in windows]
        return [f.result() for f in futures]

    @property
    def counters(self) -> dict:
        """The shared VLM's counters and the sizes of the batches it answered ({} once it is gone)."""
        try:
            return self._request("counters").result()
        except VLMProcessError:
            return {}

    def close(self) -> None:
        self._fail("the shared VLM client was closed")
        # wake the reader first (its read returns end-of-file) and let it end: closing the
        # descriptor under it let a later connection that got the same number lose bytes to it
        # (its handshake then read "bad message length")
        try:
            with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:                                 # closed already
            pass
        self._reader.join(5.0)
        self._conn.close()
