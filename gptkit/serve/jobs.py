"""A completion endpoint's Generation run on the engine and answered: whole (one JSON reply once every choice
has finished) or streamed (server-sent events as the engine's steps release text). It never asks which
endpoint it runs: the Generation's Reply class gives the shape.

Each request's choices run as jobs of the engine (gptkit.inference.engine), whose thread hands each step's
events to this event loop (one call_soon_threadsafe per step, Dispatcher). A client that disconnects
cancels its jobs, freeing their slots at the next step; a choice that fails ends its request alone (a 500,
or an error event in the stream), never the server.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from functools import partial
from typing import Callable, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gptkit.errors import GptkitError
from gptkit.inference.batcher import Event, SamplingParams
from gptkit.inference.engine import QueueFull
from gptkit.serve import protocol
from gptkit.serve.endpoints.base import Generation, Logprob, Reply
from gptkit.serve.protocol import DONE, ApiError, sse, usage
from gptkit.serve.served import Served


class Dispatcher:
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

    def __init__(self, served: Served, dispatcher: Dispatcher) -> None:
        self.served = served
        if dispatcher.loop is None:
            dispatcher.loop = asyncio.get_running_loop()
        self.dispatcher = dispatcher
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles: list = []

    def _deliver(self, k: int, events: list[Event]) -> None:
        """On the engine's thread."""
        self.dispatcher.put(self.queue, (k, events))

    def submit(self, prompts: list[list[int]], params: SamplingParams, decode=None) -> None:
        decode = decode or self.served.decode
        try:
            for k, ids in enumerate(prompts):
                self.handles.append(
                    self.served.engine.submit(ids, params, decode=decode, deliver=partial(self._deliver, k))
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


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


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


async def run(
    request: Request, served: Served, dispatcher: Dispatcher, gen: Generation, fingerprint: str
) -> Response:
    """The Generation's jobs submitted (a 429 when the engine's queue is full), then answered."""
    reply = gen.reply(served.name, fingerprint, served.tokens if gen.params.logprobs is not None else None)
    jobs = _Jobs(served, dispatcher)
    jobs.submit(gen.prompts, gen.params, gen.decode)
    n_prompt = sum(len(p) for p in gen.prompts)
    if gen.stream:
        return _Stream(
            _events(jobs, reply, gen.params.n, len(gen.prompts), n_prompt, gen.include_usage), jobs.cancel
        )
    return await _whole(request, jobs, reply, gen.params.n, len(gen.prompts), n_prompt)


async def _whole(
    request: Request, jobs: _Jobs, reply: Reply, n: int, n_prompts: int, n_prompt: int
) -> Response:
    """One JSON reply once every choice has finished; a 500 when one fails (the others are cancelled), a 499
    nobody reads when the client leaves first."""
    total = n_prompts * n
    texts, reasons = [""] * total, [""] * total
    logprobs: list[list[Logprob]] = [[] for _ in range(total)]
    error: list[str] = []

    async def collect() -> None:
        left = total
        while left:
            k, events = await jobs.queue.get()
            for e in events:
                i = k * n + e.choice
                texts[i] += e.text
                logprobs[i] += _logprobs(e)
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
    return JSONResponse(reply.final(texts, reasons, usage(n_prompt, jobs.sampled()), logprobs))


def _logprobs(e: Event) -> list[Logprob]:
    """An event's tokens with their log-probs (none when the request asked for none)."""
    return [(tok, lp, top) for tok, (lp, top) in zip(e.tokens, e.logprobs)]


async def _events(jobs: _Jobs, reply: Reply, n: int, n_prompts: int, n_prompt: int, include_usage: bool):
    """The stream of one request: the reply's opening chunks (chat: each choice's role), text chunks as the
    engine's steps release text (what queued up between two sends goes in one write, each choice's text
    merged; with log-probs, a chunk for each choice that sampled tokens, its text empty while a stop string
    may still claim it), each choice's finish_reason, the usage chunk when asked
    (stream_options.include_usage), then [DONE]."""
    total = n_prompts * n
    opening = reply.opening(total)
    if opening:
        yield b"".join(sse(chunk) for chunk in opening)
    left = total
    while left:
        batch = [await jobs.queue.get()]
        while not jobs.queue.empty():
            batch.append(jobs.queue.get_nowait())
        texts: dict[int, str] = {}
        logprobs: dict[int, list[Logprob]] = {}
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
                if e.logprobs:
                    logprobs.setdefault(i, []).extend(_logprobs(e))
                if e.finish:
                    ends.append((i, e.finish))
        out = [
            sse(chunk)
            for i in sorted(texts.keys() | logprobs.keys())
            for chunk in reply.stream(i, texts.get(i), logprobs.get(i) or [])
        ]
        out += [sse(chunk) for i, reason in ends for chunk in reply.ending(i, reason)]
        left -= len(ends)
        if out:
            yield b"".join(out)
    tail = sse(reply.usage_chunk(usage(n_prompt, jobs.sampled()))) if include_usage else b""
    yield tail + DONE
