"""What a web page in the user's own browser can do to a server on their machine: nothing it was
not let do. Two attacks matter for a loopback server without a key (the default most people run):

- **DNS rebinding**: a page on ``evil.example`` points its name at 127.0.0.1, after which the browser
  treats the server as same-origin and reads every reply. The browser still sends ``Host:
  evil.example``, so a server that answers only the names it is known by is safe. :class:`AllowedHosts`
  holds those names.
- **Cross-site writes without a preflight**: a form or a ``fetch`` with a ``text/plain`` (or no) body
  is sent without asking the server first. Only ``application/json`` bodies are read here, and a
  browser must ask (a CORS preflight, refused unless ``--cors-origin`` names the page) before it
  sends one cross-site.

Both checks run in :class:`BrowserGuard`, an ASGI middleware outside the API-key check."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from hearth.serving.errors import APIError

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_OPEN_ENDPOINTS = frozenset({"/health"})  # probes (load balancers, kubelets) send any Host


@dataclass(frozen=True)
class AllowedHosts:
    """The ``Host`` names a server answers: IP literals (a rebinding page cannot send one: its
    ``Host`` is its own name), loopback names, ``names``, and where ``anywhere`` (the server listens
    beyond loopback) this machine's own names. ``"*"`` among the names turns the check off."""

    names: frozenset[str] = frozenset()
    anywhere: bool = False

    @classmethod
    def for_server(cls, bind_host: str, extra: tuple[str, ...] = ()) -> AllowedHosts:
        """The names for a server bound to ``bind_host`` with ``--allowed-hosts`` ``extra``."""
        names = {n.strip().lower().rstrip(".") for n in extra if n.strip()}
        bound = bind_host.strip("[]").lower()
        if bound and not _is_ip(bound) and bound not in ("0.0.0.0", "::"):
            names.add(bound)  # a server bound to a name answers that name
        anywhere = not _is_loopback_bind(bound)
        if anywhere:
            names |= _machine_names()
        return cls(frozenset(names), anywhere)

    def permits(self, host_header: str | None) -> bool:
        """Whether a request with this ``Host`` header (``name[:port]``; None: none sent) is served."""
        if host_header is None or "*" in self.names:
            return True  # no Host: not a browser (HTTP/1.0 tools)
        name = _host_name(host_header)
        if name is None:
            return False
        if _is_ip(name) or name in _LOOPBACK_NAMES or name.endswith(".localhost"):
            return True
        return name in self.names or any(n.startswith(".") and name.endswith(n) for n in self.names)


def _host_name(header: str) -> str | None:
    """The name of a ``Host`` header, lower-case, without its port or a trailing dot; None if malformed."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8000
        end = header.find("]")
        return header[1:end] if end > 0 else None
    name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return name.rstrip(".") or None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_loopback_bind(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _machine_names() -> set[str]:
    """This machine's names as LAN clients write them: its host name, the fully qualified one, and
    the mDNS ``.local`` one."""
    short = socket.gethostname().lower()
    names = {short, f"{short.split('.')[0]}.local"}
    with contextlib.suppress(OSError):
        names.add(socket.getfqdn().lower())
    return {n for n in names if n}


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json`` or ``application/<something>+json`` (parameters such as charset allowed)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BrowserGuard:
    """Pure ASGI middleware: a request naming a host this server is not known by gets 403, and a
    request body that is not JSON gets 415, both in the API's error format and before the API key
    is checked or a byte of the body is read."""

    def __init__(self, app: Any, hosts: AllowedHosts, error_response: Any) -> None:
        self.app, self.hosts, self.error_response = app, hosts, error_response

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        error = self.check(scope) if scope["type"] == "http" else None
        if error is None:
            await self.app(scope, receive, send)
        else:
            await self.error_response(scope["path"], error)(scope, receive, send)

    def check(self, scope: dict) -> APIError | None:
        """The error a request gets here, or None to pass it on."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host")
        if scope["path"] not in _OPEN_ENDPOINTS and not self.hosts.permits(host):
            return APIError(403, f"Host '{host[:100]}' is not one this server answers to (a guard against DNS "
                                 "rebinding); start it with --allowed-hosts NAME to add the name", "host")
        if scope["method"] in _BODY_METHODS and not is_json_media_type(headers.get("content-type")):
            given = headers.get("content-type")
            return APIError(415, f"Content-Type {given[:100]!r} is not JSON: send the body with 'Content-Type: "
                                 "application/json'" if given else "the request has no Content-Type: send the "
                                 "body with 'Content-Type: application/json'", "content-type")
        return None


def guarded_h11_protocol(read_timeout: float) -> type:
    """uvicorn's h11 protocol with a deadline for each request to arrive whole: ``read_timeout``
    seconds from its first byte (or from the connection opening) to the end of its body. uvicorn
    has none: a client sending a byte every few seconds would hold a connection (a file descriptor,
    a parser) for ever. A connection that misses the deadline is closed; one whose request has
    arrived is never cut here (generation takes as long as it takes)."""
    waiting = (h11.IDLE, h11.SEND_BODY)  # the client's states while its request is still arriving

    class GuardedH11Protocol(H11Protocol):
        _deadline: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state in waiting:
                self._arm()  # (armed once per request: more bytes do not move the deadline)
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # the keep-alive timer now watches the idle connection
            self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(read_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.conn.their_state in waiting and not self.transport.is_closing():
                self.logger.info("closed a connection whose request took longer than %g s to arrive", read_timeout)
                self.transport.close()

    return GuardedH11Protocol
