"""Ranged HTTP reads from a server we do not trust (the Hub, or whatever $HF_ENDPOINT points at): one reader.

Each read asks for exactly the bytes it needs and takes only an answer that is them: a ranged read wants 206 with a
Content-Range whose start, end and total are the ones asked for (ASCII digits) and a body of exactly that length; a
whole-file read wants 200 and a body no longer than its cap (checked against Content-Length before reading, and
while reading). A server that ignores ranges (200 to a ranged request) is refused at its status line, so it costs a
socket buffer, never the shard. The token (Authorization) goes only to the endpoint's own scheme, host and port:
a redirect elsewhere (the Hub's CDN) is followed without it. Every exchange, connect to last body byte, has one
deadline (CLOVER_GGUF_HUB_TIMEOUT seconds, 60 by default) that a watchdog enforces by shutting the socket, so a
server trickling a byte every second cannot hold a read open for longer; all exchanges of one reader together have
ten times that. Every failure, malformed answers included, is one UserError line.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
import threading
import time
import urllib.parse

from clover_gguf.errors import UserError

TIMEOUT_ENV = "CLOVER_GGUF_HUB_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
TOTAL_FACTOR = 10  # all reads of one reader together: this many times the per-exchange deadline
MAX_REDIRECTS = 5
CHUNK = 1 << 16
CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+)", re.ASCII)
UNSATISFIED_RANGE = re.compile(r"bytes \*/([0-9]+)", re.ASCII)
REDIRECTS = (301, 302, 303, 307, 308)


def timeout_from_env() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not 0.0 < v <= 86400.0:
        raise UserError(f"${TIMEOUT_ENV} must be a number of seconds in (0, 86400], not {raw!r}")
    return v


def check_url(url: str, what: str) -> urllib.parse.SplitResult:
    """An http(s) URL with a host and a port in range, and no whitespace or control characters (a CR/LF would
    end the request line early)."""
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise UserError(f"{what} {url!r} contains whitespace or control characters")
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise UserError(f"{what} {url!r} has a port outside 0-65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise UserError(f"{what} {url!r} is not an http(s) URL with a host")
    return parts


def _origin(parts: urllib.parse.SplitResult) -> tuple[str, str, int]:
    return parts.scheme, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


class RangeReader:
    """GETs of whole files or byte ranges under one deadline policy; `endpoint`: the URL whose origin may see the
    token; `label`: how messages name the source; `bytes_read`: body bytes received."""

    def __init__(self, endpoint: str, headers: dict[str, str], label: str, timeout_s: float | None = None):
        self.origin = _origin(check_url(endpoint, "the Hub endpoint ($HF_ENDPOINT)"))
        self.headers, self.label = dict(headers), label
        self.timeout_s = timeout_from_env() if timeout_s is None else timeout_s
        self.total_deadline = time.monotonic() + TOTAL_FACTOR * self.timeout_s
        self.bytes_read = 0

    # ---- the two kinds of read --------------------------------------------------------------------------------
    def whole(self, url: str, name: str, cap: int) -> bytes | None:
        """The file at url (None: 404), at most `cap` bytes."""
        got = self._get(url, name, None, cap)
        return None if got is None else got[0]

    def range(self, url: str, name: str, start: int, n: int, total: int | None = None) -> tuple[bytes, int] | None:
        """Bytes start..start+n-1 and the file's size (None: 404; (b"", 0) for an empty file). `total`: the size
        an earlier read reported, which this answer must repeat."""
        return self._get(url, name, (start, n, total), n)

    # ---- one exchange, redirects followed -----------------------------------------------------------------------
    def _get(self, url: str, name: str, rng: tuple[int, int, int | None] | None, cap: int):
        where = f"{self.label}/{name}"
        headers = dict(self.headers)
        if rng is not None:
            headers["Range"] = f"bytes={rng[0]}-{rng[0] + rng[1] - 1}"
        for _ in range(MAX_REDIRECTS + 1):
            parts = check_url(url, f"{where}: the URL")
            if _origin(parts) != self.origin:  # the token stays on the endpoint's scheme, host and port
                headers = {k: v for k, v in headers.items() if k.lower() not in ("authorization", "cookie")}
            status, hdrs, body, location = self._exchange(parts, headers, where, cap, rng is not None)
            if status in REDIRECTS:
                if not location:
                    raise UserError(f"{where}: the server answered {status} without a Location")
                url = urllib.parse.urljoin(url, location)
                continue
            return self._check(status, hdrs, body, where, rng, cap)
        raise UserError(f"{where}: more than {MAX_REDIRECTS} redirects")

    def _check(self, status: int, hdrs: http.client.HTTPMessage, body: bytes, where: str,
               rng: tuple[int, int, int | None] | None, cap: int):
        if status == 404:
            return None
        if status in (401, 403):
            raise UserError(f"{where}: the server answered {status} (a gated or private repo needs a token: "
                            "`huggingface-cli login` or $HF_TOKEN)")
        if rng is None:
            if status != 200:
                raise UserError(f"{where}: the server answered {status}, not 200 with the file")
            return body, len(body)
        start, n, known = rng
        if status == 416:  # a range past the end: only an empty file is asked for byte 0
            m = UNSATISFIED_RANGE.fullmatch(hdrs.get("Content-Range", "").strip())
            if start == 0 and m and int(m[1]) == 0 and known in (None, 0):
                return b"", 0
            raise UserError(f"{where}: the server cannot give bytes {start}-{start + n - 1} (416): the file is "
                            "shorter than its header says")
        if status == 200:
            raise UserError(f"{where}: the server ignores byte ranges (it answered 200 with the whole file to a "
                            "ranged request); graft reads only a few MB of a checkpoint by ranges: use a server "
                            "that supports them, or download the checkpoint and graft from its folder")
        if status != 206:
            raise UserError(f"{where}: the server answered {status} to a ranged request, not 206")
        m = CONTENT_RANGE.fullmatch(hdrs.get("Content-Range", "").strip())
        if m is None:
            raise UserError(f"{where}: the server's 206 has no valid Content-Range "
                            f"({hdrs.get('Content-Range', '')[:60]!r})")
        b, e, total = int(m[1]), int(m[2]), int(m[3])
        if b != start or e != start + n - 1 or e >= total or (known is not None and total != known):
            raise UserError(f"{where}: the server sent bytes {b}-{e}/{total} for a request of bytes "
                            f"{start}-{start + n - 1}" + (f" of {known}" if known is not None else ""))
        if len(body) != e - b + 1:
            raise UserError(f"{where}: the server sent {len(body)} bytes where its Content-Range says {e - b + 1}")
        return body, total

    def _exchange(self, parts: urllib.parse.SplitResult, headers: dict[str, str], where: str, cap: int,
                  ranged: bool) -> tuple[int, http.client.HTTPMessage, bytes, str | None]:
        now = time.monotonic()
        deadline = min(now + self.timeout_s, self.total_deadline)
        if deadline <= now:
            raise self._late(where)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname, parts.port, timeout=deadline - now)
        expired = threading.Event()

        def expire() -> None:  # a blocked read cannot see a deadline: shutting the socket ends it
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(deadline - now, expire)
        watchdog.daemon = True
        watchdog.start()
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        try:
            conn.request("GET", path, headers=headers)
            r = conn.getresponse()
            if expired.is_set():  # the headers ended because the watchdog shut the socket
                raise self._late(where)
            if r.status in REDIRECTS or r.status == 404 or (ranged and r.status != 206) or \
                    (not ranged and r.status != 200):
                return r.status, r.headers, b"", r.headers.get("Location")
            length = r.headers.get("Content-Length")
            if length is not None and (not re.fullmatch(r"[0-9]+", length.strip(), re.ASCII) or int(length) > cap):
                raise UserError(f"{where}: the server announces {length.strip()[:30]} bytes, more than the "
                                f"{cap} this read takes")
            body = bytearray()
            while True:
                chunk = r.read1(CHUNK)
                if expired.is_set():
                    raise self._late(where)
                if not chunk:
                    break
                body += chunk
                self.bytes_read += len(chunk)
                if len(body) > cap:
                    raise UserError(f"{where}: the server sends more than the {cap} bytes this read takes")
            if length is not None and len(body) != int(length):
                raise UserError(f"{where}: the server's answer was cut short ({len(body)} of the {int(length)} "
                                "bytes it announced)")
            return r.status, r.headers, bytes(body), None
        except UserError:
            raise
        except (http.client.HTTPException, OSError, ValueError) as e:
            if expired.is_set() or time.monotonic() >= deadline:
                raise self._late(where) from None
            what = type(e).__name__
            detail = str(e).splitlines()[0][:80] if str(e) else ""
            if isinstance(e, OSError) and not isinstance(e, http.client.HTTPException):
                raise UserError(f"cannot reach the Hub for {where}: {getattr(e, 'strerror', None) or detail or what}"
                                ) from None
            raise UserError(f"{where}: the server's answer is malformed ({what}{': ' + detail if detail else ''})"
                            ) from None
        finally:
            watchdog.cancel()
            conn.close()

    def _late(self, where: str) -> UserError:
        return UserError(f"{where}: the server did not finish answering within {self.timeout_s:g} s (a stalled or "
                         f"trickling server; ${TIMEOUT_ENV} sets the limit, all reads together get "
                         f"{TOTAL_FACTOR} times it)")

