"""JSON over HTTP from servers minispec did not write, bounded in time, size and shape.

An engine under test is a server that may be stuck, broken or hostile, so one request here can neither hang
nor exhaust memory nor raise anything but a one-line `ServerError` naming the server and the limit it hit:

    answer = get_json("http://127.0.0.1:8080/completion", {"prompt": [1, 2]}, deadline=60.0,
                      max_bytes=MAX_BYTES, server_name="llama-server at http://127.0.0.1:8080")

- **A deadline for the whole answer**, not for each read: a timer shuts the connection down when it passes, so
  a server that trickles a byte every few seconds (in its headers or its body) ends there too.
- **A cap on the answer's size**: a declared length over `max_bytes` is refused before reading, and a body read
  past it (an endless one) is cut there.
- **JSON that Python can hold**: an answer nested too deeply to parse, or holding NaN, an infinity (a literal or a
  number like 1e999) or an integer too long to read, is refused. What the numbers mean (a count must not be
  negative) is the caller's to check.
- **Interruptible and stoppable**: `Cancel` ends every request it was given at once from another thread (a run
  that failed, or Ctrl-C), and the waits are socket reads that Ctrl-C interrupts in the main thread.

`get_text` reads a text endpoint (Prometheus' /metrics) within the same bounds, None where the server has none.
Standard library only; `https` is served as `http` is.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import urllib.parse

from ..errors import InputError, one_line, show

MAX_BYTES = 16 << 20  # an answer's size cap: far above any answer the harness asks for, far below memory
SMALL_REQUEST_S = 30.0  # the deadline of an answer that needs no sampling (/props, /v1/models, /detokenize, /metrics)
REQUEST_S = 300.0  # the default deadline of a whole answer (--request-timeout): a sampled answer on a slow server
CHUNK = 1 << 16


class ServerError(InputError):
    """A server could not be reached or used, or answered something the harness cannot test; one line that names
    the server."""


class ServerUnreachable(ServerError):
    """The connection failed or broke (refused, reset, closed early): the server may have exited."""


def base_url(url: str, what: str = "--url") -> str:
    """`scheme://host:port` of an http(s) address (a bare host:port is taken as http), checked: a port in
    1..65535 and a well-formed host (an IPv6 address in brackets). ServerError saying what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ServerError(f"{what} {show(url)} is not an http(s) address such as http://127.0.0.1:8080")
    text = url.strip()
    try:
        parts = urllib.parse.urlsplit(text if "//" in text else f"http://{text}")
        port = parts.port
    except ValueError as e:  # urllib's own words for a bad port or IPv6 literal
        raise ServerError(f"{what} {show(url)} is not a usable address ({e}); e.g. http://127.0.0.1:8080 or "
                          "http://[::1]:8080") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(f"{what} {show(url)} is not an http(s) address such as http://127.0.0.1:8080")
    if port == 0:
        raise ServerError(f"{what} {show(url)} has port 0; a server listens on a port in 1..65535")
    if parts.query or parts.fragment:  # the paths of the requests are appended to the address, so no ?... or #...
        raise ServerError(f"{what} {show(url)} has a {'query (?...)' if parts.query else 'fragment (#...)'}; give "
                          "the server's address alone, e.g. http://127.0.0.1:8080/v1")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + ("" if port is None else f":{port}")


def ascii_digits(text: str) -> bool:
    """Whether `text` is a non-negative integer in ASCII digits: str.isdigit() and int() also take other scripts'
    digits ("٣", "²"), which no server writes for a number."""
    return text.isascii() and text.isdigit()


def check_seconds(seconds, what: str) -> float:
    """A positive, finite number of seconds, or ServerError."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ServerError(f"{what} must be a positive, finite number of seconds, got {show(seconds)}")
    return float(seconds)


def _shut(sock) -> None:
    """End a connection now: any read blocked on it returns at once, in whatever thread it waits."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed or never connected
        pass


class Cancel:
    """Requests that another thread can end at once: a run stopping on an error or on Ctrl-C calls it, and
    every request given this token, in flight or still to come, fails without waiting for its server."""

    def __init__(self):
        self._lock = threading.Lock()
        self._socks: set = set()
        self.cancelled = False

    def __call__(self) -> None:
        with self._lock:
            self.cancelled = True
            socks, self._socks = list(self._socks), set()
        for s in socks:
            _shut(s)

    def _add(self, sock) -> bool:
        with self._lock:
            if not self.cancelled:
                self._socks.add(sock)
        return not self.cancelled

    def _remove(self, sock) -> None:
        with self._lock:
            self._socks.discard(sock)


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {show(text)} is not finite")
    return v


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes):
    """The JSON value of `raw`, every number finite; ValueError (RecursionError for deep nesting) otherwise."""
    return json.loads(raw, parse_float=_finite, parse_constant=_no_constant)


def _error_message(out) -> str:
    """The message of an error answer: OpenAI's and llama.cpp's {"error": {"message": ...}}, else the answer."""
    msg = out.get("error", out) if isinstance(out, dict) else out
    msg = msg.get("message", msg) if isinstance(msg, dict) else msg
    return " ".join(str(msg).split())[:200]


def _exchange(url: str, data: bytes | None, *, deadline: float, max_bytes: int, server_name: str, method: str,
              accept: str, cancel: Cancel | None) -> tuple[int, bytes, str]:
    """(HTTP status, body, "SERVER: METHOD PATH") of one bounded request; ServerError or ServerUnreachable."""
    deadline = check_seconds(deadline, "the request deadline")
    parts = urllib.parse.urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += f"?{parts.query}"
    where = f"{server_name}: {method} {path}"
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=deadline)
    expired = threading.Event()
    sock = None

    def expire() -> None:
        expired.set()
        if sock is not None:
            _shut(sock)

    timer = threading.Timer(deadline, expire)
    timer.daemon = True
    timer.start()
    try:
        if cancel is not None and cancel.cancelled:
            raise ServerError(f"{where} was stopped")
        conn.connect()
        sock = conn.sock  # kept: the answer is read through it even after http.client drops its own reference
        if expired.is_set():
            _shut(sock)
        if cancel is not None and not cancel._add(sock):
            raise ServerError(f"{where} was stopped")
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", "Accept": accept})
        resp = conn.getresponse()
        raw, declared = _read(resp, where, max_bytes)
        if expired.is_set() or (cancel is not None and cancel.cancelled):  # a shut connection reads as an early end
            raise ConnectionAbortedError("the connection was shut")
        if declared is not None and len(raw) < declared:
            raise http.client.IncompleteRead(b"", declared - len(raw))
    except (OSError, http.client.HTTPException, ValueError) as e:
        if expired.is_set() or isinstance(e, TimeoutError):
            raise ServerError(f"{where} timed out: no complete answer within {deadline:g} s (the deadline for a "
                              "whole answer)") from None
        if cancel is not None and cancel.cancelled:
            raise ServerError(f"{where} was stopped") from None
        raise ServerUnreachable(f"{where} failed: {e.__class__.__name__}: {' '.join(str(e).split())[:200]}") from None
    finally:
        timer.cancel()
        if cancel is not None and sock is not None:
            cancel._remove(sock)
        conn.close()
        if sock is not None:
            sock.close()
    _not_redirected(resp, where)
    return resp.status, raw, where


def _read(resp, where: str, max_bytes: int) -> tuple[bytes, int | None]:
    """The answer's body, read up to max_bytes (a declared length over it refused before reading, an endless body
    cut there), and its declared length (None: not declared)."""
    declared = resp.getheader("Content-Length", "").strip()
    declared = int(declared) if ascii_digits(declared) else None
    if declared is not None and declared > max_bytes:
        raise ServerError(f"{where} answered {declared} bytes, over the {max_bytes}-byte limit on an answer's size")
    raw, n = [], 0
    while n <= max_bytes:
        chunk = resp.read(min(CHUNK, max_bytes + 1 - n))
        if not chunk:
            break
        raw.append(chunk)
        n += len(chunk)
    if n > max_bytes:
        raise ServerError(f"{where} answered more than {max_bytes} bytes, the limit on an answer's size")
    return b"".join(raw), declared


def _not_redirected(resp, where: str) -> None:
    """ServerError for a redirect: not followed, since the audit asks the server it was given, so it names the new
    address."""
    if 300 <= resp.status < 400:
        location = resp.getheader("Location")
        raise ServerError(f"{where} answered HTTP {resp.status}, a redirect to "
                          f"{'nowhere (no Location header)' if location is None else show(location, 200)}; "
                          "redirects are not followed: give that address instead")


def get_json(url: str, payload=None, *, deadline: float, max_bytes: int = MAX_BYTES, server_name: str,
             method: str | None = None, cancel: Cancel | None = None):
    """The JSON answer of a server at `url` (POST `payload` as JSON, or GET when it is None), or ServerError.

    deadline: seconds for the whole exchange (connecting, sending, every byte of the answer); max_bytes: the
    largest answer body taken; server_name: how messages name the server (e.g. "llama-server at URL"); cancel:
    a Cancel that may end the request early. An answer other than HTTP 200 raises ServerError with its message;
    a failed or broken connection raises ServerUnreachable."""
    data = None if payload is None else json.dumps(payload, allow_nan=False).encode()
    status, raw, where = _exchange(url, data, deadline=deadline, max_bytes=max_bytes, server_name=server_name,
                                   method=method or ("GET" if payload is None else "POST"),
                                   accept="application/json", cancel=cancel)
    try:
        out = parse_json(raw)
    except RecursionError:
        raise ServerError(f"{where} answered HTTP {status} with JSON nested too deeply to read") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ServerError(f"{where} answered HTTP {status} with no JSON: {show(raw[:80])}") from None
    except ValueError as e:  # NaN, an infinity, or an integer too long to read
        raise ServerError(f"{where} answered HTTP {status} with a number it cannot take: {one_line(e)[:120]}") from None
    if status != 200:
        raise ServerError(f"{where} answered HTTP {status}: {_error_message(out)}")
    return out


ABSENT = (404, 405, 501)  # the answers of a server without the endpoint asked for (llama-server's /metrics: 501)


def get_text(url: str, *, deadline: float, max_bytes: int = MAX_BYTES, server_name: str,
             cancel: Cancel | None = None) -> str | None:
    """The UTF-8 text a server answers to GET `url` (e.g. Prometheus' /metrics), within the same bounds as
    get_json; None when the server has no such endpoint (HTTP 404, 405 or 501); ServerError otherwise."""
    status, raw, where = _exchange(url, None, deadline=deadline, max_bytes=max_bytes, server_name=server_name,
                                   method="GET", accept="text/plain", cancel=cancel)
    if status in ABSENT:
        return None
    if status != 200:
        raise ServerError(f"{where} answered HTTP {status}: {show(raw[:80])}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ServerError(f"{where} answered bytes that are not UTF-8 text: {show(raw[:80])}") from None
