"""The ASGI middleware in front of `leantune vllm-serve`'s routes: everything a request's head can be refused for,
refused before its body is read or a request slot is taken.

In this order, each answered with one JSON line and `Connection: close`: a `Host` that is not one of the server's
names (403: DNS rebinding), any `Origin` (403: a browser page), a missing or wrong token (401), an unknown route
(404) or method (405), `Transfer-Encoding` (400: a body needs a Content-Length), a missing `Content-Length` (411) or
one over `max_request_bytes` (413), a `Content-Type` other than the route's (415: an HTML form can send only
text/plain and form types, so it never reaches a route). Then a slot (at most `max_connections` requests at once,
503 beyond), and the body, which must arrive whole: each read waits at most `stall_seconds`, the whole body at most
`stall_seconds` plus its length at `MIN_BODY_BYTES_PER_SECOND` (408 past either; a client that hangs up mid-body:
400). A refusal after the token was checked calls `on_refused(scope)`, which ends a weight update the request
belonged to. Framing errors (a bad, huge or conflicting Content-Length, a bad request line) never reach this: h11
refuses them in uvicorn with 400 (server_http).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from .server_access import authorized, host_allowed

JSON = "application/json"
SAFETENSORS = "application/octet-stream"  # a weight chunk; not a type an HTML form can send
MIN_BODY_BYTES_PER_SECOND = 2**20


@dataclass(frozen=True)
class GuardSettings:
    token: str
    bound_host: str
    host_names: frozenset[str]
    routes: dict  # path -> (method, content type of its body, or None for no body)
    max_request_bytes: int
    max_connections: int
    stall_seconds: float


class Refusal(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ServerGuard:
    """Wraps the routes' ASGI app; `active` counts the requests holding a slot (one event loop: no lock)."""

    def __init__(self, app, settings: GuardSettings, on_refused: Callable[[dict], None]):
        self.app = app
        self.settings = settings
        self.on_refused = on_refused
        self.active = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        scope["path"] = scope["path"].rstrip("/") or "/"
        headers = _headers(scope)
        try:
            self._check_access(headers)
        except Refusal as refusal:
            return await refuse(send, refusal)
        try:
            length = self._checked_length(scope, headers)
        except Refusal as refusal:
            self.on_refused(scope)
            return await refuse(send, refusal)
        if self.active >= self.settings.max_connections:
            return await refuse(send, Refusal(503, "the server is busy (all request slots in use, "
                                                   "--max_connections); retry"))
        self.active += 1
        try:
            try:
                body = await self._body(receive, length)
            except Refusal as refusal:
                self.on_refused(scope)
                return await refuse(send, refusal)
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.active -= 1

    def _check_access(self, headers: dict) -> None:
        """Refusal unless the request names this server, comes from no browser page and carries the token."""
        settings = self.settings
        hosts = headers.get("host", [])
        if len(hosts) != 1 or not host_allowed(hosts[0], settings.bound_host, settings.host_names):
            raise Refusal(403, f"Host {', '.join(hosts) or '(none)'} is not a name of this server (start it with "
                               "--allowed_hosts NAME to reach it by another name)")
        if "origin" in headers:
            raise Refusal(403, "requests from browser pages (with an Origin) are refused")
        tokens = headers.get("authorization", [])
        if len(tokens) != 1 or not authorized(tokens[0], settings.token):
            raise Refusal(401, "missing or wrong token: send the server's token as 'Authorization: Bearer <token>' "
                               "(LEANTUNE_VLLM_SERVER_TOKEN, or the token file the server named at start)")

    def _checked_length(self, scope, headers: dict) -> int:
        """The body's length, or Refusal: the route, its method, and how its body is framed and typed."""
        settings = self.settings
        route = settings.routes.get(scope["path"])
        if route is None:
            raise Refusal(404, f"no such endpoint: {scope['method']} {scope['path']}")
        method, content_type = route
        if scope["method"] != method:
            raise Refusal(405, f"{scope['path']} takes {method} only")
        if "transfer-encoding" in headers:
            raise Refusal(400, "send the body with a Content-Length (no Transfer-Encoding)")
        lengths = headers.get("content-length", [])
        length = int(lengths[0]) if lengths else None  # h11 has checked it: digits, one value
        if content_type is None:
            if length:
                raise Refusal(400, f"{method} {scope['path']} takes no body")
            return 0
        if length is None:
            raise Refusal(411, f"a {method} needs a Content-Length header")
        if length > settings.max_request_bytes:
            raise Refusal(413, f"request of {length} bytes is over the server's limit of "
                               f"{settings.max_request_bytes} bytes (send smaller weight chunks)")
        sent_type = (headers.get("content-type") or [""])[0].partition(";")[0].strip().lower()
        if sent_type != content_type:
            raise Refusal(415, f"{scope['path']} takes Content-Type {content_type}, got {sent_type or 'none'}")
        return length

    async def _body(self, receive, length: int) -> bytes:
        stall = self.settings.stall_seconds
        loop = asyncio.get_running_loop()
        deadline = loop.time() + stall + length / MIN_BODY_BYTES_PER_SECOND
        body = bytearray()
        more = length > 0
        while more:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, min(stall, deadline - loop.time())))
            except TimeoutError:
                raise Refusal(408, f"the body stalled or came too slowly ({len(body)} of {length} bytes)") from None
            if message["type"] == "http.disconnect":
                raise Refusal(400, f"the client hung up after {len(body)} of {length} bytes")
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if len(body) != length:
            raise Refusal(400, f"the body has {len(body)} bytes, its Content-Length says {length}")
        return bytes(body)


async def refuse(send, refusal: Refusal) -> None:
    """Answer and close: the unread body is never waited for."""
    data = json.dumps({"error": str(refusal)}).encode()
    headers = [(b"content-type", JSON.encode()), (b"content-length", str(len(data)).encode()),
               (b"connection", b"close")]
    if refusal.status == 503:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _headers(scope) -> dict[str, list[str]]:
    headers: dict[str, list[str]] = {}
    for name, value in scope["headers"]:
        headers.setdefault(name.decode("latin-1"), []).append(value.decode("latin-1"))
    return headers


def _replay(body: bytes, receive):
    """The ASGI `receive` of a request whose body was read already."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
