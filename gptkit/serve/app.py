"""The HTTP routes (Starlette): the OpenAI API over a Served model, the health check and the chat page.

    POST /v1/chat/completions    messages -> the chat template -> the engine; JSON, or SSE with stream=true
    POST /v1/completions         prompt (text or token ids, one or several) -> the engine
    GET  /v1/models[/<id>]       the one model served
    GET  /health                 {"status": "ok", ...the engine's load}
    GET  /                       the chat page (gptkit/serve/page.html), which streams from the same API

Each request's choices run as jobs of the engine (gptkit.inference.engine), whose thread hands each step's
events to this event loop (one call_soon_threadsafe per step, _Dispatcher). A client that disconnects
cancels its jobs, freeing their slots at the next step. Errors are ApiError bodies in OpenAI's shape; anything
unexpected is a 500 in that shape with one line on stderr, never a traceback to the client.

What a web page in a visitor's browser could make of a server on their machine is closed off: every request
must name this server in its Host header (HostGuard: a DNS-rebinding page names its own domain), and a body
must be declared application/json (check_content_type: the one kind a page elsewhere cannot send without
the browser first asking this server, which answers no CORS headers).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import sys
import threading
from functools import partial
from importlib import resources
from typing import Callable, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gptkit.errors import GptkitError
from gptkit.inference.batcher import Event, SamplingParams
from gptkit.inference.engine import QueueFull
from gptkit.serve import protocol
from gptkit.serve.protocol import DONE, ApiError, Reply, sse, usage
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


class _Dispatcher:
    """Events from the engine's thread to the event loop: what one step delivers to all its requests crosses
    in one wake-up of the loop (one call_soon_threadsafe, one write to its self-pipe), not one per request."""

    def __init__(self) -> None:
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.lock = threading.Lock()
        self.pending: list = []
        self.scheduled = False

    def put(self, queue: asyncio.Queue, item) -> None:
        """On the engine's thread."""
        with self.lock:
            self.pending.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        # the event loop is gone (shutdown): nobody waits for these events
        except RuntimeError:
            pass

    def _drain(self) -> None:
        with self.lock:
            items, self.pending, self.scheduled = self.pending, [], False
        for queue, item in items:
            queue.put_nowait(item)


class _Jobs:
    """The engine jobs of one request, their events arriving on this event loop."""

    def __init__(self, served: Served, dispatcher: _Dispatcher) -> None:
        self.served = served
        if dispatcher.loop is None:
            dispatcher.loop = asyncio.get_running_loop()
        self.dispatcher = dispatcher
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles: list = []

    def _deliver(self, k: int, events: list[Event]) -> None:
        """On the engine's thread."""
        self.dispatcher.put(self.queue, (k, events))

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> None:
        try:
            for k, ids in enumerate(prompts):
                self.handles.append(
                    self.served.engine.submit(
                        ids, params, decode=self.served.decode, deliver=partial(self._deliver, k)
                    )
                )
        except QueueFull as exc:
            self.cancel()
            raise ApiError(429, str(exc), None, "queue_full", "rate_limit_error") from None
        except GptkitError as exc:
            self.cancel()
            raise protocol.bad(str(exc)) from None

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    def sampled(self) -> int:
        return sum(sum(h.job.sampled) for h in self.handles)


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Stream(StreamingResponse):
    """Server-sent events that stop when the client leaves, whatever ASGI version the server speaks, and then
    run on_close (which cancels the request's jobs)."""

    def __init__(self, content, on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, gone):
                task.cancel()
            results = await asyncio.gather(stream, gone, return_exceptions=True)
            self.on_close()
        failed = results[0]
        if isinstance(failed, Exception) and not isinstance(failed, OSError):
            print(f"error: a stream failed ({one_line(failed)})", file=sys.stderr, flush=True)


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
                err = ApiError(
                    421,
                    f"this server does not answer to the host {shown!r} (it answers to "
                    f"{', '.join(sorted(self.names))}); give the name in serve's allowed_hosts",
                    None,
                    "invalid_host",
                )
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    served: Served,
    *,
    api_key: Optional[str] = None,
    max_request_bytes: int = 1 << 20,
    allowed_hosts: tuple[str, ...] = (),
    any_ip_host: bool = False,
    request_timeout: Optional[float] = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> Starlette:
    """The Starlette app serving `served` (its engine must be started). allowed_hosts, any_ip_host: the Host
    names it answers besides the loopback ones (HostGuard); request_timeout: seconds a request body may take
    to arrive (None: no limit; the server's own timeout covers the request head)."""
    fingerprint = f"gptkit-{__version__}"
    dispatcher = _Dispatcher()
    page = resources.files("gptkit.serve").joinpath("page.html").read_text(encoding="utf-8")

    def authorize(request: Request) -> None:
        if not api_key:
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
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "Incorrect API key provided", None, "invalid_api_key")

    async def read_json(request: Request) -> dict:
        """The body: JSON (Content-Type application/json: a page elsewhere cannot send that without the
        browser asking this server first, which it never allows), within max_request_bytes, arrived within
        request_timeout seconds; checked whole (protocol.parse_body)."""
        check_content_type(request.headers.get("content-type"))
        if request_timeout is None:
            return await read_body(request)
        try:
            return await asyncio.wait_for(read_body(request), request_timeout)
        except asyncio.TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {request_timeout:g} s (request_timeout)",
                None,
                "request_timeout",
            ) from None

    async def read_body(request: Request) -> dict:
        declared = request.headers.get("content-length")
        too_big = ApiError(
            413,
            f"the request body is larger than this server's limit of {max_request_bytes:,} bytes "
            "(max_request_bytes)",
            None,
            "request_too_large",
        )
        if declared is not None and declared.isdigit() and int(declared) > max_request_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                raise too_big
            chunks.append(chunk)
        return protocol.parse_body(b"".join(chunks))

    def check_model(name: Optional[str]) -> None:
        if name is not None and name != served.name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this server serves `{served.name}` (GET /v1/models)",
                "model",
                "model_not_found",
            )

    def params(s: protocol.Sampling, max_tokens: int, stop_ids: tuple[int, ...]) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=s.seed,
            n=s.n,
            stop_ids=() if s.ignore_eos else stop_ids,
            stop=s.stop,
        )

    async def run(
        request: Request, kind: str, prompts: list[list[int]], sp: SamplingParams, s: protocol.Sampling
    ) -> Response:
        reply = Reply(kind, served.name, fingerprint=fingerprint)
        jobs = _Jobs(served, dispatcher)
        jobs.submit(prompts, sp)
        n_prompt = sum(len(p) for p in prompts)
        total = len(prompts) * sp.n
        if s.stream:
            return _Stream(_events(jobs, reply, sp.n, total, n_prompt, s.include_usage), jobs.cancel)
        texts, reasons = [""] * total, [""] * total
        error: list[str] = []

        async def collect() -> None:
            left = total
            while left:
                k, events = await jobs.queue.get()
                for e in events:
                    i = k * sp.n + e.choice
                    texts[i] += e.text
                    if e.finish:
                        left -= 1
                        reasons[i] = e.finish
                        if e.finish == "error":
                            # the request fails now: its other choices are cancelled (finally, below)
                            error.append(e.error or "generation failed")
                            return

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                task.cancel()
            await asyncio.gather(work, gone, return_exceptions=True)
            jobs.cancel()
        if error:
            raise ApiError(500, f"generation failed: {error[0]}", None, "generation_failed", "server_error")
        if not all(reasons):
            # the client left: nobody reads this
            return Response(status_code=499)
        return JSONResponse(reply.final(texts, reasons, usage(n_prompt, jobs.sampled())))

    async def chat(request: Request) -> Response:
        authorize(request)
        body = await read_json(request)
        msgs, s = protocol.chat_request(body, served.engine.max_batch)
        check_model(s.model)
        ids = served.chat_ids(msgs)
        max_tokens = served.check_length(len(ids), s.max_tokens, "messages")
        return await run(request, "chat", [ids], params(s, max_tokens, served.chat_stop), s)

    async def completions(request: Request) -> Response:
        authorize(request)
        body = await read_json(request)
        prompts, s = protocol.completion_request(body, served.engine.max_batch)
        check_model(s.model)
        if len(prompts) * s.n > served.engine.max_batch + served.engine.max_queue:
            raise protocol.bad(
                f"{len(prompts)} prompts x n={s.n} is more than this server queues at once "
                f"(max_batch + max_queue = {served.engine.max_batch + served.engine.max_queue})",
                "prompt",
            )
        ids = [served.completion_ids(p) for p in prompts]
        max_tokens = min(served.check_length(len(i), s.max_tokens, "prompt") for i in ids)
        stop_ids = (served.eos_id,) if served.eos_id is not None else ()
        return await run(request, "completion", ids, params(s, max_tokens, stop_ids), s)

    def model_card() -> dict:
        return {"id": served.name, "object": "model", "created": served.created, "owned_by": "gptkit"}

    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        authorize(request)
        check_model(request.path_params["model"])
        return JSONResponse(model_card())

    async def health(request: Request) -> Response:
        ok = served.engine.running
        body = {
            "status": "ok" if ok else "stopped",
            "model": served.name,
            "chat": served.has_chat,
            "context": served.context,
            **served.engine.load(),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def index(request: Request) -> Response:
        return HTMLResponse(page, headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-cache"})

    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(ApiError(exc.status_code, message, None, None))

    def guarded(endpoint):
        """An ApiError becomes its response; anything else a 500 in the same shape and one line on stderr."""

        async def run_endpoint(request: Request) -> Response:
            try:
                return await endpoint(request)
            except ApiError as exc:
                return error_response(exc)
            except Exception as exc:  # noqa: BLE001 - the server answers and stays up
                line = one_line(exc)
                log(f"error: {request.method} {request.url.path} failed ({line})")
                return error_response(
                    ApiError(500, f"internal error ({line})", None, "internal_error", "server_error")
                )

        return run_endpoint

    routes = [
        Route("/", guarded(index), methods=["GET"]),
        Route("/health", guarded(health), methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(model), methods=["GET"]),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error},
        middleware=[Middleware(HostGuard, allowed=tuple(allowed_hosts), any_ip=any_ip_host)],
    )


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


async def _events(jobs: _Jobs, reply: Reply, n: int, total: int, n_prompt: int, include_usage: bool):
    """The stream of one request: the role chunk (chat), text chunks as the engine's steps release text
    (what queued up between two sends goes in one write, each choice's text merged), each choice's
    finish_reason, the usage chunk when asked (stream_options.include_usage), then [DONE]."""
    if reply.kind == "chat":
        yield b"".join(sse(reply.chunk(i, None, role=True)) for i in range(total))
    left = total
    while left:
        batch = [await jobs.queue.get()]
        while not jobs.queue.empty():
            batch.append(jobs.queue.get_nowait())
        texts: dict[int, str] = {}
        ends: list[tuple[int, str]] = []
        for k, events in batch:
            for e in events:
                i = k * n + e.choice
                if e.finish == "error":
                    err = ApiError(
                        500, f"generation failed: {e.error}", None, "generation_failed", "server_error"
                    )
                    yield sse(err.body()) + DONE
                    return
                if e.text:
                    texts[i] = texts.get(i, "") + e.text
                if e.finish:
                    ends.append((i, e.finish))
        out = [sse(reply.chunk(i, text)) for i, text in texts.items()]
        out += [sse(reply.chunk(i, None, finish=reason)) for i, reason in ends]
        left -= len(ends)
        if out:
            yield b"".join(out)
    tail = sse(reply.usage_chunk(usage(n_prompt, jobs.sampled()))) if include_usage else b""
    yield tail + DONE
