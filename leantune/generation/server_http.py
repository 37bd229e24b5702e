"""`leantune vllm-serve`'s HTTP stack: uvicorn (h11) on an asyncio loop of its own thread, around an ASGI app.

What uvicorn and h11 bring: a request line and headers of at most `HEAD_BYTES` (h11's `max_incomplete_event_size`),
strict framing (a Content-Length that is not digits, longer than 20 digits, or given twice with two values; a
Transfer-Encoding other than chunked; no Host on HTTP/1.1: each a 400 and a closed connection, logged as one
warning line, no traceback), at most `max_open_connections` connections open at once (503 beyond), an idle
keep-alive connection closed after `head_seconds`, and no thread per connection (one event loop holds them all).

What uvicorn lacks, and `_HeadDeadlineProtocol` adds: a deadline on a request's head. uvicorn closes a keep-alive
connection only while it sends nothing, and never one that trickles its headers a byte at a time, so a few such
connections would stay open for ever. Here a connection must send a whole request head within `head_seconds` of
connecting (or of its last answer), however it trickles, or it is closed.
"""

from __future__ import annotations

import socket
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_BYTES = 16 * 1024
SHUTDOWN_SECONDS = 5


class _HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head (`head_seconds`, set by `protocol_class`)."""

    head_seconds = 10.0

    def connection_made(self, transport) -> None:
        self._head_timer = None
        super().connection_made(transport)
        self._arm_head_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a whole head arrived: the request is under way
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        self._arm_head_timer()  # for the next request's head (cancelled at once if one is pipelined already)
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_seconds, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug("vllm-serve: closed a connection that sent no whole request head in %g s",
                              self.head_seconds)
            self.transport.close()


def protocol_class(head_seconds: float) -> type:
    return type("HeadDeadlineProtocol", (_HeadDeadlineProtocol,), {"head_seconds": head_seconds})


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening socket (bound now, so port 0 has its real port before anything is printed)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    return sock


class HTTPServer:
    """uvicorn serving `app` on `sock`, on a thread of its own (`start`, `stop`)."""

    def __init__(self, app, sock: socket.socket, head_seconds: float, max_open_connections: int):
        self.socket = sock
        self.server_address = sock.getsockname()[:2]
        config = uvicorn.Config(
            app, http=protocol_class(head_seconds), ws="none", lifespan="off", interface="asgi3", loop="asyncio",
            log_config=None, access_log=False, proxy_headers=False, server_header=False,
            h11_max_incomplete_event_size=HEAD_BYTES, limit_concurrency=max_open_connections,
            timeout_keep_alive=max(1, round(head_seconds)), timeout_graceful_shutdown=SHUTDOWN_SECONDS)
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, name="vllm-serve-http",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=SHUTDOWN_SECONDS + 5)
        self.socket.close()
