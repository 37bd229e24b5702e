"""One HTTP request of the trainer's client to `leantune vllm-serve`, with a deadline over all of it and no proxy for
this machine.

`urllib`'s timeout bounds each socket operation, so a server that trickles its answer a byte at a time would hold
a request for ever. Here a timer shuts the request's socket at its deadline, whatever phase it is in (connect, send,
the answer's head or body), and the request fails with `DeadlinePassed`. Requests to a loopback host or to one on
`no_proxy` go direct: `http_proxy` set for the internet must not carry the bearer token of a local server to a
proxy (or to nothing, when the proxy is down).
"""

from __future__ import annotations

import functools
import http.client
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

from .server_access import is_loopback


class DeadlinePassed(TimeoutError):
    """The whole request took longer than its deadline."""


class ClosedWhileSending(ConnectionError):
    """The server closed the connection before it had the whole request: a full house answers 503 before reading a
    body and closes, so a client still sending a big one (an update's chunk) sees a reset instead of the 503. The
    server acts on a request only once its body is whole, so nothing of it was done: it may be sent again."""


def goes_direct(url: str) -> bool:
    """Whether a request to `url` skips proxies: a loopback host, or one that `no_proxy` names."""
    host = urlparse(url).hostname or ""
    return is_loopback(host) or bool(urllib.request.proxy_bypass_environment(host))


def request(method: str, url: str, data: bytes | None, headers: dict, seconds: float) -> tuple[int, bytes]:
    """(status, body) of the answer, any status; DeadlinePassed past `seconds`; OSError if none came."""
    deadline = _Deadline(seconds)
    handlers = [_DeadlineHTTPHandler(deadline), _DeadlineHTTPSHandler(deadline)]
    if goes_direct(url):
        handlers.append(urllib.request.ProxyHandler({}))
    opener = urllib.request.build_opener(*handlers)
    timer = threading.Timer(seconds, deadline.expire)
    timer.daemon = True
    timer.start()
    try:
        try:
            with opener.open(urllib.request.Request(url, data=data, method=method, headers=headers),
                             timeout=seconds) as response:
                status, body = response.status, response.read()
        except urllib.error.HTTPError as error:
            with error:
                status, body = error.code, error.read()
    except Exception as error:
        if deadline.passed or _is_timeout(error):
            raise DeadlinePassed(f"no whole answer within {seconds:g} s") from None
        if _lost_while_sending(error):
            raise ClosedWhileSending(str(error.reason)) from error
        raise
    finally:
        timer.cancel()
    if deadline.passed:  # an answer without a length may have been cut short
        raise DeadlinePassed(f"no whole answer within {seconds:g} s")
    return status, body


def _lost_while_sending(error: Exception) -> bool:
    """urllib wraps an error of the request's sending in URLError; one of reading the answer comes unwrapped."""
    return isinstance(error, urllib.error.URLError) and not isinstance(error, urllib.error.HTTPError) and isinstance(
        error.reason, (ConnectionResetError, BrokenPipeError))


def _is_timeout(error: Exception) -> bool:
    return isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError)


class _Deadline:
    """The request's end: its sockets are shut when it passes."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds
        self.passed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def remaining(self) -> float:
        return max(0.001, self.at - time.monotonic())

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            passed = self.passed
        if passed:
            _shut(sock)

    def expire(self) -> None:
        with self._lock:
            self.passed = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _DeadlineConnection:
    """Mixed into http.client's connections: connect within what is left, then let the deadline shut the socket."""

    def __init__(self, *args, deadline: _Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self):
        self.timeout = min(self.timeout, self.deadline.remaining()) if self.timeout else self.deadline.remaining()
        super().connect()
        self.deadline.watch(self.sock)


class _DeadlineHTTPConnection(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(functools.partial(_DeadlineHTTPConnection, deadline=self.deadline), req)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(functools.partial(_DeadlineHTTPSConnection, deadline=self.deadline), req,
                            context=self._context)
