"""Browser sessions: whose uploads and analyses a request may see.

One server is shared by whoever can reach it, so an upload belongs to the browser session that
made it. A session is an unguessable random token (``secrets.token_urlsafe``) that the server
issues on the first request without one, in an HttpOnly, SameSite=Strict cookie, and signs with
a per-server secret: a cookie the server did not issue (a guessed, forged or stale one from a
previous server) is replaced by a fresh session, so nobody can pick the space they land in.
Every lookup of an upload or an analysis by id is scoped by ``current_session()``; files named on
``memlens serve``'s command line and the bundled samples are public.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import select
import socket
from collections.abc import Callable

from flask import Flask, Response, g, has_request_context, request

COOKIE = "memlens_session"
# 32 random bytes: as hard to guess as the signing key itself.
_TOKEN_BYTES = 32
# The space of work done by the server itself (checking the files given on the command line).
SERVER_SESSION = "server"
# The prefix an IPv6 host is given (RFC 6177: a /64 per subnet, every address in it the host's).
IPV6_HOST_PREFIX = 64


class Sessions:
    """Issues and checks the session cookie of one server (its key lives only in this process)."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def _signature(self, token: str) -> str:
        return hmac.new(self._key, token.encode(), hashlib.sha256).hexdigest()[:32]

    def new_cookie(self) -> tuple[str, str]:
        """A fresh (session id, cookie value)."""
        token = secrets.token_urlsafe(_TOKEN_BYTES)
        return token, f"{token}.{self._signature(token)}"

    def session_of(self, cookie: str | None) -> str | None:
        """The session a cookie value names, or None for one this server did not issue."""
        if not cookie or len(cookie) > 200 or "." not in cookie:
            return None
        token, _, signature = cookie.rpartition(".")
        if not token or not hmac.compare_digest(signature, self._signature(token)):
            return None
        return token


def register_sessions(server: Flask, sessions: Sessions | None = None) -> Sessions:
    """Give every request a session (``g.memlens_session``), issuing the cookie when it lacks one."""
    sessions = sessions or Sessions()

    @server.before_request
    def _find_session() -> None:
        session = sessions.session_of(request.cookies.get(COOKIE))
        if session is None:
            session, g.memlens_new_cookie = sessions.new_cookie()
        g.memlens_session = session

    @server.after_request
    def _set_cookie(response: Response) -> Response:
        cookie = g.get("memlens_new_cookie")
        if cookie:
            # No max-age: a browser session's cookie, gone when the browser closes (and the
            # uploads are gone when the server stops anyway).
            response.set_cookie(COOKIE, cookie, httponly=True, samesite="Strict", path="/",
                                secure=request.is_secure)
        return response

    return sessions


def current_session() -> str:
    """The session of the request being answered (the server's own outside a request)."""
    if not has_request_context():
        return SERVER_SESSION
    session = g.get("memlens_session")
    return session if isinstance(session, str) else SERVER_SESSION


def current_address() -> str:
    """The network address of the request being answered ("" outside a request): a client that
    drops its cookie is a new session with every request, but not a new address."""
    if not has_request_context():
        return ""
    return client_network(request.remote_addr or "")


def client_network(address: str) -> str:
    """Who ``address`` is, for a share of the server: an IPv4 address itself, an IPv6 address's
    /64 (one host is given a whole /64 and may send from any address in it)."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address  # not an IP (a Unix socket, a test client): as it is
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/{IPV6_HOST_PREFIX}", strict=False))
    return str(parsed)


def client_gone_check() -> Callable[[], bool] | None:
    """A check that the client of the request being answered has closed its connection (None when
    that cannot be seen, outside werkzeug's server): a job it asked for can then be stopped.

    While a request is being answered the browser sends nothing more on its connection, so the
    socket turning readable with nothing to read (end of stream) means the client has gone.
    """
    if not has_request_context():
        return None
    connection = request.environ.get("werkzeug.socket")
    if not isinstance(connection, socket.socket):
        return None

    def gone() -> bool:
        try:
            readable, _, _ = select.select([connection], [], [], 0)
            if not readable:
                return False
            return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            return True  # reset, or closed under us

    return gone
