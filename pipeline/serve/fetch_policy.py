"""Where the server may connect on a client's behalf, and the one way it fetches a URL.

A client names a video by URL; fetching it is the server opening a connection of the client's
choosing. Unchecked, that reaches whatever the server can reach: its own loopback services, the
cloud's metadata service (169.254.169.254), hosts on its private network. So every http(s)://
and rtsp(s):// host is resolved once, every address it resolves to is checked, and the
connection goes to an address that was checked (a name that resolves to a public address for the
check and to 127.0.0.1 for the connection cannot slip through). Each redirect is a new URL and
is checked again; their number is capped. A live stream is checked at each (re)connection
(`route`); FFmpeg's RTSP redirects, which it cannot be told not to follow, go through a relay
that checks them (rtsp_relay.py).

Refused by default: loopback, link-local, private (RFC 1918, unique-local), shared (CGNAT),
multicast, reserved and unspecified addresses, IPv4 and IPv6, including IPv4 inside IPv6
(::ffff:a.b.c.d, NAT64 64:ff9b::/96, 6to4 2002::/16). `allow_hosts` (wildcards, `*.cdn.example`)
names hosts that may resolve anywhere; `allow_private` lifts the address check for every host;
`hosts_only` refuses every host `allow_hosts` does not name.

What a client learns is "refused by policy" or "unreachable" and nothing in between: whether an
internal host answered, and what, is not the client's business (the server's log has the detail).
"""
from __future__ import annotations

import base64
import contextlib
import fnmatch
import http.client
import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Iterator
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

from sources.live import redact
from sources.live_connections import OpenError, RefusedByPolicy, Route

from .admission import Deadline
from .errors import ApiError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]

FETCH_SCHEMES = ("http", "https")
LIVE_SCHEMES = ("rtsp", "rtsps")
DEFAULT_PORTS = {"http": 80, "https": 443, "rtsp": 554, "rtsps": 322}
REDIRECTS = (301, 302, 303, 307, 308)
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_CHUNK = 1 << 16
log = logging.getLogger("pipeline.serve.fetch")


REFUSED = "refused by policy"


def live_error(reason: str, otherwise: str) -> str:
    """What a client learns of why a network stream failed: "refused by policy" or `otherwise`
    ("unreachable", "the stream ended"). FFmpeg's reason can name internal hosts and addresses and
    what answered there: it stays in the server's log."""
    return REFUSED if REFUSED in reason else otherwise


def live_open_failed(shown: str, reason: str, *, param: str, code: str) -> ApiError:
    """A live source that did not open, as its client learns it: 403 `url_refused` when the policy
    refused it, else 400 `code`; reason is already in the policy's words (live_error)."""
    if reason == REFUSED:
        return ApiError(403, f"cannot open live source {shown!r}: {REFUSED}", param=param, code="url_refused")
    return ApiError(400, f"cannot open live source {shown!r}: {reason}", param=param, code=code)


def live_gap_reason(reason: str) -> str:
    """A network stream's outage as its client learns it (sources/reconnect.py: Outage.reason,
    less FFmpeg's words): a stall's length, or that the stream ended; why reconnecting failed."""
    first, *rest = reason.split("; ")
    parts = [first if first.startswith("no frames for ") else "the stream ended"]
    if any(p.startswith("reconnect failed: ") for p in rest):
        parts.append(f"reconnect failed: {live_error(reason, 'unreachable')}")
    parts += [p for p in rest if p in ("gave up", "still down when the source closed",
                                       "still down when the capture ended")]
    return "; ".join(parts)


def refused(shown: str) -> ApiError:
    return ApiError(403, f"cannot fetch {shown!r}: refused by policy", code="url_refused", param="messages")


def unreachable(shown: str) -> ApiError:
    return ApiError(400, f"cannot fetch {shown!r}: unreachable", code="url_unreachable", param="messages")


def timed_out(shown: str) -> ApiError:
    return ApiError(504, f"cannot fetch {shown!r}: the request's deadline passed (--request-timeout-s)",
                    code="request_timeout", param="messages")


def blocked_address(address: Address) -> bool:
    """True for every address a server must not reach for a client: anything but a global unicast
    address, judged on the IPv4 address inside an IPv6 one where there is one."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and any(address in net for net in _NAT64):
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return blocked_address(embedded)
    if isinstance(address, ipaddress.IPv4Address) and address in _SHARED:
        return True
    # is_global alone is not enough: 224.0.0.0/4 counts as global in Python's tables
    return (not address.is_global or address.is_private or address.is_loopback or address.is_link_local
            or address.is_multicast or address.is_reserved or address.is_unspecified
            or getattr(address, "is_site_local", False))


def system_resolver(host: str, port: int) -> list[str]:
    """The addresses the system's resolver gives for host (every one, in its order)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


@dataclass(frozen=True)
class FetchPolicy:
    """Which hosts and addresses outbound media connections may reach (see the module doc).

    pinned: HOST -> ADDRESS used instead of DNS (`--media-resolve`, as curl's --resolve); the
    address is still checked."""

    allow_hosts: tuple[str, ...] = ()
    allow_private: bool = False
    hosts_only: bool = False
    max_redirects: int = 5
    pinned: tuple[tuple[str, str], ...] = ()
    resolver: Resolver = field(default=system_resolver, compare=False, repr=False)

    def __post_init__(self) -> None:
        from arr_coc._validate import ConfigError

        for host, address in self.pinned:
            try:
                ipaddress.ip_address(address.strip("[]"))
            except ValueError:
                raise ConfigError(f"--media-resolve {host}={address}: {address!r} is not an IP address") from None
        if self.hosts_only and not self.allow_hosts:
            raise ConfigError("--media-hosts-only needs at least one --allow-media-host")
        if not 0 <= self.max_redirects <= 20:
            raise ConfigError(f"--max-redirects={self.max_redirects} is out of range [0, 20]")

    def named(self, host: str) -> bool:
        host = host.lower().strip("[]").rstrip(".")
        return any(fnmatch.fnmatchcase(host, pattern.lower().strip("[]").rstrip(".")) for pattern in self.allow_hosts)

    def addresses(self, url: str, shown: str) -> list[str]:
        """The checked addresses to connect to for url's host (resolved once); 403 when the host or
        any address it resolves to is refused, 400 (unreachable) when it does not resolve."""
        parts = urlsplit(url)
        host = parts.hostname
        try:
            port = parts.port or DEFAULT_PORTS.get(parts.scheme.lower(), 80)
        except ValueError:
            raise ApiError(400, f"{shown!r}: the port is not a number in 0-65535", param="messages") from None
        if not host:
            raise ApiError(400, f"{shown!r}: the URL names no host", param="messages")
        named = self.named(host)
        if self.hosts_only and not named:
            log.info("refused %s: host not in --allow-media-host", shown)
            raise refused(shown)
        pinned = dict((h.lower(), a.strip("[]")) for h, a in self.pinned)
        try:
            found = [pinned[host.lower()]] if host.lower() in pinned else self.resolver(host, port)
            addresses = [ipaddress.ip_address(a.split("%")[0]) for a in found]
        except (OSError, UnicodeError, ValueError) as e:
            log.info("cannot resolve %s: %s", shown, e)
            raise unreachable(shown) from None
        if not addresses:
            raise unreachable(shown)
        if not (named or self.allow_private) and any(blocked_address(a) for a in addresses):
            # one refused address refuses the host: a name that resolves both ways is not trusted
            log.info("refused %s: it resolves to %s", shown, ", ".join(map(str, addresses)))
            raise refused(shown)
        return [str(a) for a in addresses]

    def check_live(self, url: str, shown: str) -> list[str]:
        """A live URL's checked addresses (as `addresses`). rtsps:// only for a host that
        --allow-media-host names, or while --allow-private-media lifts every address check: its
        redirects are inside TLS, where the relay cannot read them (rtsp_relay.py)."""
        addresses = self.addresses(url, shown)
        host = urlsplit(url).hostname or ""
        if urlsplit(url).scheme.lower() == "rtsps" and not (self.named(host) or
                                                          (self.allow_private and not self.hosts_only)):
            log.info("refused %s: rtsps:// redirects cannot be checked; --allow-media-host %s lets it through",
                     shown, host)
            raise refused(shown)
        return addresses

    def route(self, url: str) -> Route:
        """How one connection reaches a live (rtsp/http) URL: sources/live_connections.py's
        LiveConfig.connect, called per (re)connection, so each one is checked. rtsp goes through a
        relay that checks the server's redirects (rtsp_relay.py; TCP interleaved media); http(s)
        to the checked address with the Host header and FFmpeg's redirects off; rtsps (see
        check_live) to the checked address. RefusedByPolicy / OpenError when the host is refused
        or does not resolve."""
        shown = redact(url)
        try:
            addresses = self.check_live(url, shown)
        except ApiError as e:
            if e.code == "url_refused":
                raise RefusedByPolicy(shown, "refused by policy", "refused by policy") from None
            raise OpenError(shown, "unreachable", "unreachable") from None
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme == "rtsp":
            from .rtsp_relay import RtspRelay

            relay = RtspRelay(addresses, parts.port or DEFAULT_PORTS["rtsp"], lambda u: self.check_live(u, redact(u)),
                              shown, self.max_redirects)
            return Route(relay.url(url), {"rtsp_transport": "tcp"}, lambda: relay.refusal, relay.close)
        literal = f"[{addresses[0]}]" if ":" in addresses[0] else addresses[0]
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = (f"{userinfo}@" if userinfo else "") + literal + (f":{parts.port}" if parts.port else "")
        options: dict[str, str] = {}
        if scheme in FETCH_SCHEMES:
            options = {"headers": f"Host: {parts.netloc.rpartition('@')[2]}\r\n", "max_redirects": "0"}
        return Route(urlunsplit(parts._replace(netloc=netloc)), options)


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to `address`, speaking to it as `host` (Host header)."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """An HTTPS connection to `address`; the certificate is checked against `host` (SNI too)."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def fetch(url: str, dst: Path, policy: FetchPolicy, *, limit: int, read_timeout_s: float, deadline: Deadline,
          shown: str, too_large: Callable[[int | None], ApiError],
          room: Callable[[int], ContextManager[None]] = lambda n: contextlib.nullcontext()) -> int:
    """Download url (http/https) into dst through the policy: each hop checked, redirects capped,
    user:password@ sent as Basic auth to the URL's own host only, at most `limit` bytes, every
    socket wait bounded by read_timeout_s and by the deadline, which also ends the download when
    it is cancelled (the client left). room(n): disk space for the body while it is written (its
    Content-Length, else `limit`). -> bytes written; dst is removed on any failure."""
    try:
        with _Exchange(url, policy, read_timeout_s, deadline, shown) as (response, conn):
            declared = response.getheader("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise too_large(int(declared))
            with room(int(declared) if declared is not None and declared.isdigit() else limit):
                return _copy(response, conn, dst, limit, read_timeout_s, deadline, shown, too_large)
    except BaseException:
        dst.unlink(missing_ok=True)
        raise


class _Exchange:
    """Context manager: (response, connection) of the first answer that is not a redirect."""

    def __init__(self, url: str, policy: FetchPolicy, read_timeout_s: float, deadline: Deadline, shown: str) -> None:
        self.args = url, policy, read_timeout_s, deadline, shown
        self.conn: http.client.HTTPConnection | None = None
        self.undo: Callable[[], None] = lambda: None

    def __enter__(self):
        url, policy, read_timeout_s, deadline, shown = self.args
        origin = urlsplit(url)
        for _ in range(policy.max_redirects + 1):
            parts = urlsplit(url)
            if parts.scheme.lower() not in FETCH_SCHEMES:
                log.info("refused %s: a redirect to %s", shown, parts.scheme)
                raise refused(shown)
            addresses = policy.addresses(url, shown)
            response = self._request(parts, addresses, origin, read_timeout_s, deadline, shown)
            location = response.getheader("Location")
            if response.status in REDIRECTS and location:
                response.close()
                self._close()
                url = urljoin(url, location.strip())
                continue
            if not 200 <= response.status < 300:
                log.info("fetch %s: HTTP %s %s", shown, response.status, response.reason)
                raise unreachable(shown)
            return response, self.conn
        log.info("fetch %s: more than %d redirects", shown, policy.max_redirects)
        raise refused(shown)

    def _request(self, parts, addresses: list[str], origin, read_timeout_s: float, deadline: Deadline, shown: str):
        host, port = parts.hostname, parts.port or DEFAULT_PORTS[parts.scheme.lower()]
        kind = _PinnedHTTPS if parts.scheme.lower() == "https" else _PinnedHTTP
        headers = {"User-Agent": "arr-coc-serve", "Accept-Encoding": "identity"}
        # user:password@ of this hop's URL, else of the client's URL while on its host (a redirect
        # within the host keeps them; one to another host does not carry them there)
        creds = parts if parts.username is not None else origin
        if creds.username is not None and (parts.hostname, parts.port) == (creds.hostname, creds.port):
            token = f"{unquote(creds.username)}:{unquote(creds.password or '')}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(token).decode()
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        failure: BaseException | None = None
        for address in addresses:                # every one of them was checked
            deadline.check(lambda: timed_out(shown))
            self.conn = kind(host, port, address, deadline.bound(read_timeout_s))
            self.undo = deadline.on_cancel(self._abort)
            try:
                self.conn.request("GET", target, headers=headers)
                return self.conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                failure = e
                self._close()
        deadline.check(lambda: timed_out(shown))
        log.info("fetch %s: %s", shown, failure)
        raise unreachable(shown)

    def _abort(self) -> None:
        sock = self.conn.sock if self.conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)     # wakes a read blocked in another thread
            except OSError:
                pass

    def _close(self) -> None:
        self.undo()
        self.undo = lambda: None
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def __exit__(self, *exc: object) -> None:
        self._close()


def _copy(response: http.client.HTTPResponse, conn: http.client.HTTPConnection, dst: Path, limit: int,
          read_timeout_s: float, deadline: Deadline, shown: str, too_large: Callable[[int | None], ApiError]) -> int:
    size = 0
    with open(dst, "wb") as out:
        for piece in _pieces(response, conn, read_timeout_s, deadline, shown):
            size += len(piece)
            if size > limit:
                raise too_large(None)
            out.write(piece)
    return size


def _pieces(response: http.client.HTTPResponse, conn: http.client.HTTPConnection, read_timeout_s: float,
            deadline: Deadline, shown: str) -> Iterator[bytes]:
    """The body as it arrives (read1: whatever one receive gives, so that an upstream dripping a
    byte at a time meets the deadline, not a full buffer), each wait bounded by the deadline."""
    while True:
        deadline.check(lambda: timed_out(shown))
        if conn.sock is not None:
            conn.sock.settimeout(deadline.bound(read_timeout_s))
        try:
            piece = response.read1(_CHUNK)
        except (OSError, http.client.HTTPException, ValueError) as e:
            deadline.check(lambda: timed_out(shown))
            log.info("fetch %s: %s", shown, e)
            raise unreachable(shown) from None
        if not piece:
            deadline.check(lambda: timed_out(shown))   # an abort ends the body too: that is no whole video
            return
        yield piece

