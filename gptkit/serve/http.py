"""The HTTP stack gptkit's servers share, without torch: the listening socket, uvicorn's protocol with a
deadline on each request head, its logging, and the Host guard. `gptkit serve` (app.py, server.py) and
`gptkit runs serve` (gptkit/runs_page/) build on it; importing it loads Starlette, not the model's rooms."""

from __future__ import annotations

import copy
import ipaddress
import socket
from typing import Optional

from starlette.responses import JSONResponse

from gptkit.errors import GptkitError


def error_body(message: str, code: Optional[str], type: str = "invalid_request_error") -> dict:
    """An error in OpenAI's shape (what protocol.ApiError.body writes)."""
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(value: str) -> str:
    """The name of a Host header's value, without its port or an IPv6 literal's brackets, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    name, colon, port = value.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        value = name
    return value.removesuffix(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostGuard:
    """ASGI middleware: a request whose Host header names another server gets 421 (a DNS-rebinding page: the
    browser believes it talks to attacker.example, which resolves to this machine). Accepted: the loopback
    names, `allowed` (names or addresses; "*": any), and with any_ip every IP address (a server bound to
    0.0.0.0 is reached by the addresses of its interfaces; a page is never same-origin with a bare address
    it was not served from). A request without a Host header (HTTP/1.0) passes: no browser sends one."""

    def __init__(self, app, allowed: tuple[str, ...] = (), any_ip: bool = False) -> None:
        self.app = app
        self.any = "*" in allowed
        self.names = frozenset(LOOPBACK_NAMES) | {host_name(a) for a in allowed if a != "*"}
        self.any_ip = any_ip

    def accepts(self, value: str) -> bool:
        name = host_name(value)
        return self.any or name in self.names or (self.any_ip and _is_ip(name))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            value = next((v for k, v in scope["headers"] if k == b"host"), None)
            if value is not None and not self.accepts(value.decode("latin-1")):
                shown = value.decode("latin-1")[:100]
                message = (
                    f"this server does not answer to the host {shown!r} (it answers to "
                    f"{', '.join(sorted(self.names))}); give the name in serve's allowed_hosts"
                )
                await JSONResponse(error_body(message, "invalid_host"), status_code=421)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one), or a one-line GptkitError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise GptkitError(
            f"host={host} is not an address this machine can listen on ({exc.strerror})"
        ) from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise GptkitError(
            f"cannot listen on {host}:{port} ({exc.strerror}); give another port= (port=0: any free one)"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# the h11 protocol's bound on a request's line and headers (h11's own default)
MAX_HEAD_BYTES = 16 * 1024


def head_timeout_protocol(timeout: float):
    """uvicorn's h11 protocol with a deadline for each request head: a connection that has not sent a whole
    request line and headers `timeout` seconds after it opened, or after its previous response, is closed."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutH11(H11Protocol):
        _head_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(timeout, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # a whole request head has arrived
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeadTimeoutH11


def log_config() -> dict:
    """uvicorn's logging, its access log on stderr too (uvicorn's default writes it to stdout)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == ""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
