"""Who may drive `leantune vllm-serve`: this machine only, or whoever sends the shared token.

The server can overwrite the policy and stop itself, so it binds 127.0.0.1 unless told otherwise, and a
non-loopback address needs a token: a shared secret from the environment variable `LEANTUNE_VLLM_SERVER_TOKEN`,
which the trainer's client reads too and sends as `Authorization: Bearer <token>`. With a token set, every request
must carry it (also on 127.0.0.1); it is compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

TOKEN_ENV = "LEANTUNE_VLLM_SERVER_TOKEN"


def server_token() -> str | None:
    """The shared token from the environment (None when unset or empty)."""
    return os.environ.get(TOKEN_ENV) or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authorized(header: str | None, token: str | None) -> bool:
    """Whether a request's Authorization header carries the token (always true when the server has none)."""
    if token is None:
        return True
    scheme, _, sent = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), token.encode())


def authorization_header() -> dict:
    """The client's header for the server's token (none when the environment has no token)."""
    token = server_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def access_line(host: str, port: int, token: str | None) -> str:
    """One line at start: who may connect."""
    if token is None:
        return f"only this machine may connect ({host}:{port} is a loopback address; no token)."
    where = "this machine" if is_loopback(host) else f"anyone who reaches {host}:{port}"
    return f"{where} may connect with the token in ${TOKEN_ENV}; requests without it get HTTP 401."
