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

import json
import socket
import sys
from typing import Optional

from gptkit.errors import GptkitError
from gptkit.serve.app import build_app
from gptkit.serve.http import (  # noqa: F401 - their home was here
    MAX_HEAD_BYTES,
    bind,
    head_timeout_protocol,
    is_loopback,
    is_wildcard,
    log_config,
)
from gptkit.serve.served import Served


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
            f"  KV cache: {kv_line(e)}",
            f"  decode matmuls: {served.matmuls}",
            f"  try: curl {url}/v1/{endpoint} -H 'Content-Type: application/json'{key} "
            f"-d '{json.dumps(example)}'",
        ]
    )


def kv_line(engine) -> str:
    """The engine's KV memory in words: paged (blocks, the step's token budget, the prefix cache), or one slot
    a sequence and why."""
    b = engine.batcher
    if b.paged is None:
        return f"one slot per sequence ({b.paging_off})"
    pool = b.paged.pool
    return (
        f"paged, {pool.blocks} blocks of {pool.block_size} tokens, max_step_tokens={b.paged.budget}, prefix "
        f"cache {'on' if pool.prefix_cache else 'off'}"
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
