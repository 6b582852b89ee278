"""A VLM in a process of its own, answering over a pipe (live: LiveOptions.vlm_process).

Why: under many live streams a VLM call takes several times as long as the same call alone
(docs/performance.md): the capture, front-end and sink threads share the interpreter lock with the
VLM thread, which launches thousands of small kernels per call and waits for the lock again after
every host sync. In its own process the VLM has
an interpreter to itself; the requests (frames, keep maps, relevance) travel pickled over a pipe,
the answers come back the same way.

RemoteVLM has the parts of VLM that VLMBatcher and the live runner use (answer, warm_up,
prefix_length, geometry, config, name, warning, counters and kept_encoder.counters), so either
runs it unchanged, and whoever reads counters finds them where a VLM has them. The child
is started with the "spawn" method (CUDA cannot be forked) and builds its VLM with `factory`, a
picklable callable (a module-level function, or functools.partial of one). An error inside the
child (loading the model, or an answer) reaches the caller as itself where it pickles (a bad model
path is the same VLMLoadError as in-process), else as VLMProcessError with its type and message; a
child that dies fails every later call with VLMProcessError, and close() stops it.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any, Callable

_METHODS = ("answer", "warm_up", "prefix_length", "counters", "kept_counters")


class VLMProcessError(RuntimeError):
    """The VLM process failed: an answer's error (its type and message), or the process itself."""


def _send_error(conn: Any, error: BaseException, *tag: Any) -> None:
    """(*tag, "error", info): the error itself where it pickles (the parent raises the same type: a
    bad model path stays a VLMLoadError), else its type and message. tag: what comes first in every
    message on conn (vlm/server.py: the request id)."""
    text = f"{type(error).__name__}: {error}"
    try:
        conn.send((*tag, "error", (error if isinstance(error, Exception) else None, text)))
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
        conn.send((*tag, "error", (None, text)))


def _serve(factory: Callable[[], Any], conn: Any) -> None:
    """The child: build the VLM, say what it is, then answer calls until told to stop."""
    try:
        vlm = factory()
        conn.send(("ready", {"geometry": vlm.geometry, "config": vlm.config, "name": vlm.name,
                             "warning": vlm.warning}))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        _send_error(conn, e)
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):                                      # the parent is gone
            return
        if message is None:
            return
        method, args, kwargs = message
        try:
            if method == "counters":
                result = dict(getattr(vlm, "counters", {}))
            elif method == "kept_counters":
                result = dict(getattr(getattr(vlm, "kept_encoder", None), "counters", {}))
            else:
                result = getattr(vlm, method)(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001 - the caller's future gets it
            _send_error(conn, e)


class RemoteVLM:
    """`factory()`'s VLM in a spawned process; calls are serialized (one at a time)."""

    def __init__(self, factory: Callable[[], Any], *, start_timeout_s: float = 900.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(factory, child), name="vlm-process", daemon=True)
        self._process.start()
        child.close()
        self._lock = threading.Lock()
        self._failed: str | None = None
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise VLMProcessError(f"the VLM process did not start within {start_timeout_s:g} s")
        status, info = self._receive()
        if status != "ready":
            self.close()
            error, text = info
            if error is not None:
                raise error                                              # e.g. VLMLoadError: as in-process
            raise VLMProcessError(f"the VLM process could not load its model: {text}")
        self.geometry, self.config = info["geometry"], info["config"]
        self.name, self.warning = info["name"], info["warning"]
        self.kept_encoder = _KeptCounters(self)

    def _receive(self) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            code = self._process.exitcode
            self._failed = f"the VLM process exited (code {code})" if code is not None else f"the VLM pipe broke: {e}"
            raise VLMProcessError(self._failed) from None

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method not in _METHODS:
            raise AttributeError(method)
        with self._lock:
            if self._failed is not None:
                raise VLMProcessError(self._failed)
            try:
                self._conn.send((method, args, kwargs))
            except (OSError, ValueError) as e:
                self._failed = f"the VLM process is gone: {e}"
                raise VLMProcessError(self._failed) from None
            status, result = self._receive()
        if status == "error":
            error, text = result
            if error is not None:
                raise error                                              # the answer's own error, as in-process
            raise VLMProcessError(f"in the VLM process: {text}")
        return result

    def answer(self, requests: list) -> list:
        return self._call("answer", requests)

    def warm_up(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("warm_up", *args, **kwargs)

    def prefix_length(self, question: str, visual_tokens: int) -> int:
        return self._call("prefix_length", question, visual_tokens)

    @property
    def counters(self) -> dict:
        """The VLM's counters (decoders, graphs), read from the child ({} once it is gone)."""
        return self._read("counters")

    def _read(self, method: str) -> dict:
        try:
            return self._call(method)
        except VLMProcessError:
            return {}

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the child (after the call in flight, if any); kill it if it does not stop."""
        with self._lock:
            try:
                self._conn.send(None)
            except (OSError, ValueError):
                pass
            self._failed = self._failed or "the VLM process was closed"
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)
        self._conn.close()

    def __enter__(self) -> "RemoteVLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _KeptCounters:
    """RemoteVLM.kept_encoder: the child's kept encoder's counters (cells encoded and reused, tower
    graphs captured), where VLM.kept_encoder has them."""

    def __init__(self, remote: RemoteVLM) -> None:
        self._remote = remote

    @property
    def counters(self) -> dict:
        return self._remote._read("kept_counters")
