"""A loopback relay between FFmpeg and an RTSP server at a checked address, so that the server's
redirects are checked too.

FFmpeg's RTSP client follows a 3xx reply (its Location) to any host, resolved by itself, and has no
option to turn that off. So FFmpeg opens rtsp://127.0.0.1:PORT/... instead: the relay connects to
the address the fetch policy checked and copies bytes both ways, reading the server's side as
FFmpeg does (rtsp.c: ff_rtsp_read_reply) at message boundaries only: a reply's header lines, its
Content-Length body, interleaved media frames ('$', channel, 16-bit length) passed through whole.
A 3xx reply never reaches FFmpeg as it came: its Location is checked with the same policy and
rewritten to a one-shot listener of this relay that connects to the checked address (at most
`max_redirects` deep), or the connection is cut and `refusal` says "redirect refused by policy".
What reads ambiguously (a media frame inside a reply's headers, a header line FFmpeg would cut, a
body too long) cuts the connection too: the relay never guesses what FFmpeg would make of it.

Media goes over the one connection (rtsp_transport=tcp, which the caller sets): UDP would make
FFmpeg send to the address the server names.
"""
from __future__ import annotations

import logging
import re
import socket
import threading
from typing import Callable
from urllib.parse import urlsplit, urlunsplit

from .errors import ApiError

MAX_LINE = 4000          # FFmpeg keeps 4095 bytes of a line: a longer one it would read differently
MAX_HEAD = 1 << 16       # header bytes of one reply
MAX_BODY = 1 << 20       # a reply's body (an SDP is a few hundred bytes)
_CHUNK = 1 << 16
_SPACE = b" \t"          # FFmpeg's get_word separators on a line (\r is gone, \n ends it)
_C_INT = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_CRS = re.compile(rb"\r*")
# get_word's separators (" \t"; \r and \n are gone), and the same with \v and \f too
_WORDS = (re.compile(rb"[ \t]*([^ \t\v\f]*)(.*)", re.S), re.compile(rb"[ \t]*([^ \t]*)(.*)", re.S))
log = logging.getLogger("pipeline.serve.fetch")

Check = Callable[[str], list[str]]    # an rtsp URL -> its checked addresses (ApiError when refused)


class Garbled(Exception):
    """The server's bytes read ambiguously: the connection is cut."""


class Refused(Exception):
    """A redirect the policy refuses (the log gets why)."""


def c_int(text: bytes) -> int:
    """What C's strtol-then-int gives for text (atoi, and FFmpeg's `int = strtol(...)`): leading
    space, a sign, digits; saturated to 64 bits, then its low 32 bits, two's complement."""
    m = _C_INT.match(text)
    if m is None:
        return 0
    value = max(-(1 << 63), min((1 << 63) - 1, int(m.group(1))))
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def statuses(line: bytes) -> set[int]:
    """Every status FFmpeg could read in a reply's first line (its second word, get_word, through
    atoi; its 1024-byte word buffer cuts a longer word): the reply is a redirect if any is 3xx.
    Reading more than FFmpeg does (a request's line too) only refuses more."""
    found = set()
    for word in _WORDS:
        second = word.match(word.match(line).group(2)).group(1)
        found |= {c_int(second), c_int(second[:1023])}
    return found


def _line(raw: bytes) -> bytes:
    """A line as FFmpeg's parser sees it: no \r anywhere, no \n, cut at a NUL (a C string)."""
    return raw.replace(b"\r", b"")[:-1].split(b"\0", 1)[0]


class ReplyReader:
    """The server-to-FFmpeg byte stream, read as FFmpeg reads it: feed(bytes) -> the bytes to pass
    on. `redirect(location)` gives a 3xx reply's new Location (or raises Refused)."""

    def __init__(self, redirect: Callable[[str], str]) -> None:
        self.redirect = redirect
        self.buf = b""
        self.skip = 0                  # bytes of a media frame or a body still to pass on as they are
        self.head: list[bytes] = []    # raw lines of the reply being read

    def feed(self, data: bytes) -> bytes:
        buf = self.buf + data if self.buf else data
        view, pos, out = memoryview(buf), 0, []
        while pos < len(buf):
            if self.skip:                      # media and bodies: sliced whole, never looked into
                n = min(self.skip, len(buf) - pos)
                out.append(view[pos:pos + n])
                pos, self.skip = pos + n, self.skip - n
                continue
            start = _CRS.match(buf, pos).end()                 # FFmpeg drops every \r
            if buf[start:start + 1] == b"$":                    # an interleaved media frame
                if self.head:
                    raise Garbled("a media frame inside a reply's headers")
                if len(buf) < start + 4:
                    break
                self.skip = start - pos + 4 + int.from_bytes(buf[start + 2:start + 4], "big")
                continue
            end = buf.find(b"\n", pos)
            if end < 0:
                if len(buf) - pos > MAX_LINE:
                    raise Garbled(f"a header line over {MAX_LINE} bytes")
                break
            raw, pos = buf[pos:end + 1], end + 1
            if len(raw) > MAX_LINE or sum(map(len, self.head)) > MAX_HEAD:
                raise Garbled("a reply's headers too long")
            self.head.append(raw)
            if not _line(raw):         # an empty line ends the reply ("\0..." is empty to FFmpeg)
                out.append(self._reply(self.head))
                self.head = []
        self.buf = buf[pos:]
        return b"".join(out)

    def _reply(self, raw: list[bytes]) -> bytes:
        lines = [_line(r) for r in raw]
        redirect = len(lines) > 1 and any(300 <= status < 400 for status in statuses(lines[0]))
        length, location = 0, None
        for line in lines[1:-1]:
            low = line.lower()
            if low.startswith(b"content-length:"):
                length = c_int(line[15:])
            elif low.startswith(b"location:"):
                location = line[9:].lstrip(_SPACE + b"\r\n")
        if length > MAX_BODY:
            raise Garbled(f"a body of {length} bytes")
        self.skip = max(length, 0)
        if not redirect:
            return b"".join(raw)
        if location is None:
            raise Refused("", "a 3xx reply without a Location")
        moved = self.redirect(location.decode("latin-1")).encode("latin-1")
        kept = [r for r, line in zip(raw[:-1], lines[:-1]) if not line.lower().startswith(b"location:")]
        return b"".join(kept) + b"Location: " + moved + b"\r\n" + raw[-1]


class RtspRelay:
    """One FFmpeg connection's relay (see the module doc): `url(client_url)` is what FFmpeg opens;
    `close()` ends every listener and connection; `refusal` is set once a redirect was refused."""

    def __init__(self, addresses: list[str], port: int, check: Check, shown: str, max_redirects: int,
                 connect_timeout_s: float = 10.0) -> None:
        self.check, self.shown, self.max_redirects = check, shown, max_redirects
        self.connect_timeout_s = connect_timeout_s
        self.refusal: str | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self.port = self._listen(addresses, port, depth=0, once=False)

    def url(self, url: str) -> str:
        """url (rtsp://[user:pass@]host[:port]/path) with its host and port this relay's."""
        return _local(urlsplit(url), self.port)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            _shut(s)

    def __enter__(self) -> "RtspRelay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keep(self, s: socket.socket) -> bool:
        with self._lock:
            if not self._closed:
                self._sockets.append(s)
                return True
        _shut(s)
        return False

    def _listen(self, addresses: list[str], port: int, depth: int, once: bool) -> int:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        if self._keep(listener):
            threading.Thread(target=self._accept, args=(listener, addresses, port, depth, once),
                             name="rtsp-relay", daemon=True).start()
        return listener.getsockname()[1]

    def _accept(self, listener: socket.socket, addresses: list[str], port: int, depth: int, once: bool) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if once:
                _shut(listener)
            if self._keep(client):
                threading.Thread(target=self._serve, args=(client, addresses, port, depth),
                                 name="rtsp-relay", daemon=True).start()
            if once:
                return

    def _serve(self, client: socket.socket, addresses: list[str], port: int, depth: int) -> None:
        upstream = None
        for address in addresses:            # every one of them was checked
            try:
                upstream = socket.create_connection((address, port), self.connect_timeout_s)
                break
            except OSError as e:
                log.info("live source %s: %s port %d: %s", self.shown, address, port, e)
        if upstream is None or not self._keep(upstream):
            _shut(client)
            return
        upstream.settimeout(None)
        threading.Thread(target=_copy, args=(client, upstream), name="rtsp-relay", daemon=True).start()
        reader = ReplyReader(lambda location: self._redirect(location, depth))
        try:
            while data := upstream.recv(_CHUNK):
                client.sendall(reader.feed(data))
        except Refused as e:
            log.info("live source %s: redirect to %r refused by policy (%s)", self.shown, *e.args)
            self.refusal = "redirect refused by policy"
        except Garbled as e:
            log.info("live source %s: cut: %s", self.shown, e)
        except OSError:
            pass
        _shut(upstream)
        _shut(client)

    def _redirect(self, location: str, depth: int) -> str:
        """A 3xx reply's Location -> the one-shot listener's URL FFmpeg goes to instead."""
        if depth + 1 > self.max_redirects:
            raise Refused(location, f"more than {self.max_redirects} redirects")
        try:
            parts = urlsplit(location.strip())
            port = parts.port or 554
        except ValueError:
            raise Refused(location, "not a URL") from None
        if parts.scheme.lower() != "rtsp":
            raise Refused(location, "only rtsp:// redirects can be checked")
        try:
            addresses = self.check(location.strip())
        except ApiError as e:
            raise Refused(location, e.message) from None
        return _local(parts, self._listen(addresses, port, depth + 1, once=True))


def _local(parts, port: int) -> str:
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (f"{userinfo}@" if userinfo else "") + f"127.0.0.1:{port}"
    return urlunsplit(("rtsp", netloc, parts.path, parts.query, ""))


def _copy(src: socket.socket, dst: socket.socket) -> None:
    """FFmpeg's requests, as they are, until either side closes."""
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    _shut(dst)
    _shut(src)


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)     # wakes a recv or accept blocked in another thread
    except OSError:
        pass
    s.close()
