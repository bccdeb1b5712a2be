"""Run the app under uvicorn: bind, print where it listens (and a curl line to try), serve until Ctrl-C or
SIGTERM, then stop the engine.
"""

from __future__ import annotations

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
) -> int:
    """Serve until Ctrl-C or SIGTERM. sock: a socket bind() already opened on host (before the model loaded,
    so that a port in use fails at once); None: bind host:port now."""
    import uvicorn

    if sock is None:
        sock = bind(host, port)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound}"
    app = build_app(served, api_key=api_key, max_request_bytes=max_request_bytes)
    config = uvicorn.Config(
        app,
        log_level="info" if access_log else "warning",
        access_log=access_log,
        lifespan="off",
        timeout_graceful_shutdown=3,
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
