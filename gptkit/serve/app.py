"""The HTTP app (Starlette): the route table and the guards every request passes.

    the endpoints of gptkit/serve/endpoints/   the OpenAI API (chat completions, completions, models): a row
                                               each, answered by one runner (_Api.answer) that asks the
                                               endpoint and runs the Generation it may ask for (jobs.py)
    GET  /health                 {"status": "ok", ...the engine's load}
    GET  /                       the chat page (gptkit/serve/page.html), which streams from the same API

Errors are ApiError bodies in OpenAI's shape; anything unexpected is a 500 in that shape with one line on
stderr, never a traceback to the client.

What a web page in a visitor's browser could make of a server on their machine is closed off: every request
must name this server in its Host header (HostGuard: a DNS-rebinding page names its own domain), and a body
must be declared application/json (check_content_type: the one kind a page elsewhere cannot send without
the browser first asking this server, which answers no CORS headers).
"""

from __future__ import annotations

import asyncio
import hmac
import sys
from functools import partial
from importlib import resources
from typing import Awaitable, Callable, Optional, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from gptkit.serve import jobs, protocol
from gptkit.serve.endpoints import ENDPOINTS, Endpoint, Generation
from gptkit.serve.http import LOOPBACK_NAMES, HostGuard, host_name  # noqa: F401 - their home was here
from gptkit.serve.jobs import one_line
from gptkit.serve.protocol import ApiError
from gptkit.serve.served import Served
from gptkit.version import __version__

# the page's Content-Security-Policy: its own inline script and style, requests to this server only
PAGE_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status == 429 else None
    if err.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def check_content_type(value: Optional[str]) -> None:
    """A body must be declared application/json (a charset, if any, utf-8): 415 otherwise. A web page can
    send text/plain or a form to any address without asking, but not application/json."""
    media, _, params = (value or "").partition(";")
    charset = next(
        (
            v.strip().strip('"').lower()
            for k, _, v in (p.partition("=") for p in params.split(";"))
            if k.strip().lower() == "charset"
        ),
        "utf-8",
    )
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        shown = f"Content-Type {value[:80]!r}" if value else "no Content-Type"
        raise ApiError(
            415,
            f"this server reads JSON bodies only: send them with 'Content-Type: application/json' "
            f"(got {shown})",
            None,
            "unsupported_media_type",
        )


class _Api:
    """The handlers of one app: the guards every request passes (the API key; a body's type, size and time to
    arrive; errors in OpenAI's shape) and the one runner of every endpoint."""

    def __init__(
        self,
        served: Served,
        api_key: Optional[str],
        max_request_bytes: int,
        request_timeout: Optional[float],
        log: Callable[[str], None],
    ) -> None:
        self.served = served
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.request_timeout = request_timeout
        self.log = log
        self.fingerprint = f"gptkit-{__version__}"
        self.dispatcher = jobs.Dispatcher()
        self.page = resources.files("gptkit.serve").joinpath("page.html").read_text(encoding="utf-8")

    # ---- the guards ------------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if not self.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise ApiError(
                401,
                "You didn't provide an API key: send it as 'Authorization: Bearer <key>' (this server was "
                "started with api_key)",
                None,
                "missing_api_key",
            )
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise ApiError(401, "Incorrect API key provided", None, "invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        """The body: JSON (Content-Type application/json: a page elsewhere cannot send that without the
        browser asking this server first, which it never allows), within max_request_bytes, arrived within
        request_timeout seconds; checked whole (protocol.parse_body)."""
        check_content_type(request.headers.get("content-type"))
        if self.request_timeout is None:
            return await self._read_body(request)
        try:
            return await asyncio.wait_for(self._read_body(request), self.request_timeout)
        except asyncio.TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {self.request_timeout:g} s (request_timeout)",
                None,
                "request_timeout",
            ) from None

    async def _read_body(self, request: Request) -> dict:
        limit = self.max_request_bytes
        too_big = ApiError(
            413,
            f"the request body is larger than this server's limit of {limit:,} bytes (max_request_bytes)",
            None,
            "request_too_large",
        )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return protocol.parse_body(b"".join(chunks))

    def guarded(
        self, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """An ApiError becomes its response; anything else a 500 in the same shape and one line on stderr."""

        async def run_guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as exc:
                return error_response(exc)
            except Exception as exc:  # noqa: BLE001 - the server answers and stays up
                line = one_line(exc)
                self.log(f"error: {request.method} {request.url.path} failed ({line})")
                return error_response(
                    ApiError(500, f"internal error ({line})", None, "internal_error", "server_error")
                )

        return run_guarded

    # ---- the handlers ----------------------------------------------------------------------------------
    async def answer(self, endpoint: Endpoint, request: Request) -> Response:
        """Any endpoint: the key checked, the body read (POST), the endpoint's answer sent, or the Generation
        it asks for run on the engine (gptkit/serve/jobs.py)."""
        self.authorize(request)
        body = await self.read_json(request) if endpoint.method == "POST" else None
        out = endpoint.answer(body, dict(request.path_params))
        if isinstance(out, Generation):
            return await jobs.run(request, self.served, self.dispatcher, out, self.fingerprint)
        return JSONResponse(out)

    async def health(self, request: Request) -> Response:
        served = self.served
        ok = served.engine.running
        body = {
            "status": "ok" if ok else "stopped",
            "model": served.name,
            "chat": served.has_chat,
            "context": served.context,
            **served.engine.load(),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def index(self, request: Request) -> Response:
        return HTMLResponse(
            self.page, headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-cache"}
        )

    # ---- the route table -------------------------------------------------------------------------------
    def routes(self, endpoints: Sequence[type[Endpoint]]) -> list[Route]:
        """The page, the health check, and a route per endpoint (gptkit/serve/endpoints/'s table)."""
        own = [
            Route("/", self.guarded(self.index), methods=["GET"]),
            Route("/health", self.guarded(self.health), methods=["GET"]),
        ]
        return own + [
            Route(e.path, self.guarded(partial(self.answer, e(self.served))), methods=[e.method])
            for e in endpoints
        ]


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 and 405 (no route, or a route's other method) in OpenAI's shape."""
    if exc.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(ApiError(exc.status_code, message, None, None))


def build_app(
    served: Served,
    *,
    api_key: Optional[str] = None,
    max_request_bytes: int = 1 << 20,
    allowed_hosts: tuple[str, ...] = (),
    any_ip_host: bool = False,
    request_timeout: Optional[float] = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    endpoints: Sequence[type[Endpoint]] = ENDPOINTS,
) -> Starlette:
    """The Starlette app serving `served` (its engine must be started). allowed_hosts, any_ip_host: the Host
    names it answers besides the loopback ones (HostGuard); request_timeout: seconds a request body may take
    to arrive (None: no limit; the server's own timeout covers the request head); endpoints: the OpenAI
    endpoints it answers (gptkit.serve.endpoints.ENDPOINTS)."""
    api = _Api(served, api_key, max_request_bytes, request_timeout, log)
    return Starlette(
        routes=api.routes(endpoints),
        exception_handlers={HTTPException: http_error},
        middleware=[Middleware(HostGuard, allowed=tuple(allowed_hosts), any_ip=any_ip_host)],
    )
