"""Who may drive `leantune vllm-serve`: whoever holds its token, from a page of no browser, by one of its names.

The server can overwrite the policy and stop itself, so every request must carry `Authorization: Bearer <token>`
(compared in constant time). The token is `LEANTUNE_VLLM_SERVER_TOKEN` when set (the trainer's client reads the same
variable); otherwise the server makes one at start (`secrets.token_urlsafe`) and writes it to a file only this user
can read, `token_path(port)` (`$XDG_CACHE_HOME/leantune` or `~/.cache/leantune`, `vllm-server-<port>.token`, mode
0600), where the client of a loopback URL finds it. A made token only serves a loopback address: any other host
needs the shared variable.

A browser page can send requests to 127.0.0.1 too (a page on this machine, or a name of the attacker's that
rebinds to 127.0.0.1), so the server also refuses a `Host` that is not one of its own names (DNS rebinding), any
`Origin` (the trainer's client sends none; a browser always does on a cross-origin POST), and a POST whose
`Content-Type` a plain HTML form could send (server_guard).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
from pathlib import Path
from urllib.parse import urlparse

TOKEN_ENV = "LEANTUNE_VLLM_SERVER_TOKEN"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def server_token() -> str | None:
    """The shared token from the environment (None when unset or empty)."""
    return os.environ.get(TOKEN_ENV) or None


def token_path(port: int) -> Path:
    """Where the server writes a token it made for `port`, and where a loopback client looks for it."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "leantune" / f"vllm-server-{port}.token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token_file(port: int, token: str) -> Path:
    """Write the token where only this user can read it (file 0600, a new folder 0700; never through a link)."""
    path = token_path(port)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)  # a file left by an older run may have had other bits
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return path


def remove_token_file(port: int, token: str) -> None:
    """Remove the file at stop, unless a newer server on the same port wrote its own token there."""
    path = token_path(port)
    try:
        if path.read_text() == token:
            path.unlink()
    except OSError:
        pass


def client_token(base_url: str) -> str | None:
    """The token a client sends: the shared variable, else (for a loopback URL only) the server's token file."""
    token = server_token()
    if token is not None:
        return token
    parts = urlparse(base_url)
    if not is_loopback(parts.hostname or ""):
        return None  # a remote server's token is never on this machine; a local file must not travel there
    try:
        return token_path(parts.port or 80).read_text().strip() or None
    except OSError:
        return None


def authorization_header(base_url: str) -> dict:
    """The client's header for the server's token (none when neither the variable nor a token file has one)."""
    token = client_token(base_url)
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def authorized(header: str | None, token: str) -> bool:
    """Whether a request's Authorization header carries the token."""
    scheme, _, sent = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), token.encode())


def own_host_names(bound_host: str, extra: tuple[str, ...] = ()) -> frozenset[str]:
    """The names a request's Host may use: the bound address, this machine's names, and `extra` (--allowed_hosts).
    Loopback binds answer to loopback names only; an IP literal is always checked as an address (host_allowed)."""
    names = {bound_host.lower(), *(name.lower() for name in extra)}
    if is_loopback(bound_host):
        names.add("localhost")
    else:
        names.update({socket.gethostname().lower(), socket.getfqdn().lower()})
    return frozenset(names)


def host_allowed(host_header: str | None, bound_host: str, names: frozenset[str]) -> bool:
    """Whether a request's Host names this server (its port is not checked: an SSH tunnel may change it).

    A name is allowed only if it is one of `names`; an IP literal if it is loopback (loopback bind), any address
    (wildcard bind: the client reached one of this machine's addresses) or the bound address. A page of another
    site can make the browser send only that site's name, never one of these."""
    if not host_header:
        return False
    host = _host_of(host_header.strip().lower())
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host in names
    if is_loopback(bound_host):
        return address.is_loopback
    if bound_host in WILDCARD_HOSTS:
        return True
    return host == bound_host.lower().strip("[]")


def _host_of(value: str) -> str:
    """The host part of a Host header: `name`, `name:port`, `[v6]` or `[v6]:port`."""
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def access_line(host: str, port: int, token_file: Path | None) -> str:
    """One line at start: who may connect, and where a made token is."""
    if token_file is not None:
        return (f"only this machine may connect ({host}:{port} is a loopback address), with the token written to "
                f"{token_file} (mode 0600: this user only; the trainer's client reads it); requests without it get "
                "HTTP 401.")
    where = "this machine" if is_loopback(host) else f"anyone who reaches {host}:{port}"
    return f"{where} may connect with the token in ${TOKEN_ENV}; requests without it get HTTP 401."
