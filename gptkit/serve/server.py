"""Run the app under uvicorn: bind, print where it listens (and a curl line to try), serve until Ctrl-C or
SIGTERM, then stop the engine.

Limits on connections (docs/serve.md): a request's line and headers must arrive within request_timeout
seconds of the connection opening (or of its previous response; uvicorn itself has no such deadline, so a
client sending headers slowly held its connection forever); a head still incomplete at 16 KiB is a 400;
the body must arrive within request_timeout too (408); an idle keep-alive connection closes after
timeout_keep_alive seconds; beyond limit_concurrency open connections a request gets 503. Logs (uvicorn's
and its access log) go to stderr; stdout has the banner only.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import socket
import sys
from typing import Optional

from gptkit.errors import GptkitError
from gptkit.serve.app import build_app
from gptkit.serve.served import Served


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


def banner(served: Served, url: str, api_key: Optional[str]) -> str:
    e = served.engine
    chat = (
        f"chat template {served.template.name}"
        if served.template is not None
        else "no chat template: /v1/completions only (chat completions answer 400)"
    )
    example = (
        {"model": served.name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
        if served.has_chat
        else {"model": served.name, "prompt": "Once upon a time", "max_tokens": 32}
    )
    endpoint = "chat/completions" if served.has_chat else "completions"
    key = " -H 'Authorization: Bearer $GPTKIT_API_KEY'" if api_key else ""
    return "\n".join(
        [
            f"serving {served.run_dir} as model {served.name!r} ({served.n_params:,} parameters, "
            f"{served.device}, {served.dtype}, context {served.context}; {chat})",
            f"  listening on {url}  (chat page: {url}/)",
            "  endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health",
            f"  batching: max_batch={e.max_batch} sequences at once, max_queue={e.max_queue} waiting "
            "(then 429)" + ("; API key required" if api_key else ""),
            f"  try: curl {url}/v1/{endpoint} -H 'Content-Type: application/json'{key} "
            f"-d '{json.dumps(example)}'",
        ]
    )


def serve(
    served: Served,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: Optional[socket.socket] = None,
    api_key: Optional[str] = None,
    max_request_bytes: int = 1 << 20,
    access_log: bool = True,
    allowed_hosts: tuple[str, ...] = (),
    request_timeout: float = 30.0,
    timeout_keep_alive: int = 5,
    limit_concurrency: int = 512,
) -> int:
    """Serve until Ctrl-C or SIGTERM. sock: a socket bind() already opened on host (before the model loaded,
    so that a port in use fails at once); None: bind host:port now. allowed_hosts: Host names (or addresses)
    answered besides localhost, 127.0.0.1, [::1] and `host` ("*": any); a wildcard host (0.0.0.0, ::) answers
    every IP address too. The limits: the module docstring."""
    import uvicorn

    if sock is None:
        sock = bind(host, port)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound}"
    if not (isinstance(request_timeout, (int, float)) and request_timeout > 0):
        raise GptkitError(f"request_timeout={request_timeout!r} must be a number of seconds > 0")
    wildcard = is_wildcard(host)
    app = build_app(
        served,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        allowed_hosts=tuple(allowed_hosts) + (() if wildcard else (host,)),
        any_ip_host=wildcard,
        request_timeout=float(request_timeout),
    )
    config = uvicorn.Config(
        app,
        http=head_timeout_protocol(float(request_timeout)),
        log_config=log_config(),
        log_level="info" if access_log else "warning",
        access_log=access_log,
        lifespan="off",
        timeout_graceful_shutdown=3,
        timeout_keep_alive=timeout_keep_alive,
        limit_concurrency=limit_concurrency,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        server_header=False,
    )
    server = uvicorn.Server(config)
    served.engine.start()
    print(banner(served, url, api_key), flush=True)
    if not is_loopback(host) and not api_key:
        print(
            f"warning: host={host} accepts connections from other machines and no api_key is set: anyone who "
            "reaches this port can use the model (set api_key= or GPTKIT_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    try:
        server.run(sockets=[sock])
    finally:
        served.engine.stop()
        sock.close()
    return 0
