"""The continuous-batching loop on a thread of its own, fed by a bounded queue: what a server (or any caller
with many concurrent requests) talks to.

    engine = Engine(model, max_batch=16, max_queue=64).start()
    handle = engine.submit(prompt_ids, SamplingParams(...), decode=tokenizer.decode)
    for event in handle: ...            # Events as the batcher delivers them (blocking)
    handle.result()                     # or all of it at once: a gptkit.inference.batcher.Completion
    handle.cancel()                     # frees its slots at the next step
    engine.stop()

submit() raises QueueFull when max_queue requests already wait for a slot (a server answers 429). A
custom `deliver` (called on the engine's thread once per step with that step's events) replaces the handle's
own queue: the server hands events to its event loop that way. A failure that belongs to one request (its
prefill, its sampler, its text) ends that request alone with an "error" event, the batch going on without
it (gptkit.inference.batcher); if the batch's decode pass itself fails (out of memory, a bug), every request
then in the batch ends with an "error" event and the loop goes on with the next ones.

The thread owns the model while it runs (in inference mode; on the CPU with the decoding layout of
decoding_layout.py for `layout_rows` rows, None: the model's own layers). The layout copies the weights
once, at start(): a caller that changes the weights (a training loop between rollouts) restarts the engine,
or uses batcher.generate_many, which lays them out anew at every call.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
from typing import Callable, Iterator, Optional

import torch

from gptkit.errors import GptkitError
from gptkit.inference.batcher import Batcher, Choice, Completion, Event, Job, SamplingParams
from gptkit.inference.block_pool import Paging
from gptkit.inference.decoding_layout import decoding_layout
from gptkit.inference.speculative import Speculator


class QueueFull(GptkitError):
    """Every slot is busy and max_queue requests already wait."""


class Handle:
    """A submitted request: iterate its Events, or wait for its Completion."""

    def __init__(self, job: Job, engine: "Engine", events: Optional[queue.SimpleQueue]) -> None:
        self.job, self.engine, self._events = job, engine, events

    def cancel(self) -> None:
        self.job.cancelled = True
        self.engine.wake()

    def __iter__(self) -> Iterator[Event]:
        if self._events is None:
            raise RuntimeError("this request delivers its events elsewhere (a deliver function was given)")
        ended = 0
        while ended < self.job.params.n:
            for e in self._events.get():
                if e.finish:
                    ended += 1
                yield e

    def result(self) -> Completion:
        """Wait for every choice; an error event raises a GptkitError."""
        decode = self.job.decode
        got = [Choice([], "" if decode is not None else None, "") for _ in range(self.job.params.n)]
        for e in self:
            ch = got[e.choice]
            ch.tokens += e.tokens
            if decode is not None:
                ch.text += e.text
            if e.finish == "error":
                raise GptkitError(f"generation failed: {e.error}")
            if e.finish:
                ch.finish_reason = e.finish
        return Completion(len(self.job.prompt), got, sum(self.job.sampled))


class Engine:
    def __init__(
        self,
        model,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        max_len: Optional[int] = None,
        layout_rows: Optional[int] = None,
        speculate: Optional[Speculator] = None,
        paging: Optional[Paging] = Paging(),
    ) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise GptkitError(f"max_queue={max_queue!r} must be an integer >= 0")
        self.batcher = Batcher(
            model, max_batch=max_batch, max_len=max_len, speculate=speculate, paging=paging
        )
        self.batcher.log = lambda line: print(f"error: {line}", file=sys.stderr, flush=True)
        self.model = model
        self.max_batch, self.max_queue = max_batch, max_queue
        self.layout_rows = layout_rows
        self._inbox: list[Job] = []
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        # what a failed step said last (None: none failed)
        self.last_error: Optional[str] = None

    # ---- life -----------------------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gptkit-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the loop: requests still running or waiting end as cancelled."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests ---------------------------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        decode: Optional[Callable[[list[int]], str]] = None,
        deliver: Optional[Callable[[list[Event]], None]] = None,
    ) -> Handle:
        """Queue a request (checked here: a bad one raises a one-line GptkitError); QueueFull when the queue
        is full."""
        self.batcher.check(prompt, params)
        if params.stop and decode is None:
            raise GptkitError("stop strings need a decode function")
        events = None
        if deliver is None:
            events = queue.SimpleQueue()
            deliver = events.put
        job = Job(prompt, params, deliver, decode)
        with self._cv:
            if self._stopping or not self.running:
                raise GptkitError("the engine is not running (Engine.start() it)")
            waiting = sum(j.params.n for j in self._inbox) + sum(
                j.params.n for j in list(self.batcher.waiting)
            )
            free = max(0, self.max_batch - self.batcher.active)
            if waiting + params.n > self.max_queue + free:
                raise QueueFull(
                    f"all {self.max_batch} slots are busy and {waiting} sequences wait (max_queue="
                    f"{self.max_queue}); try again shortly"
                )
            self._inbox.append(job)
            self._cv.notify()
        return Handle(job, self, events)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def load(self) -> dict:
        """What the engine holds now: active slots, waiting requests, steps run, the mean batch, the choices
        ended so far by reason."""
        b = self.batcher
        spec = b.speculate
        # draft=: the acceptance so far (speculative.SpecStats.as_dict)
        extra = {} if spec is None else {"speculative": spec.stats.as_dict(spec.drafter.name, spec.k)}
        # the paged KV memory: blocks, the prefix cache's hit rate, preemptions (or why one slot a sequence)
        extra["kv_cache"] = b.paged.stats() if b.paged is not None else {"paged": False, "why": b.paging_off}
        return {
            "active": b.active,
            "waiting": len(self._inbox) + len(b.waiting),
            "max_batch": self.max_batch,
            "max_queue": self.max_queue,
            "steps": b.steps,
            "mean_batch": b.rows / b.steps if b.steps else 0.0,
            "ended": dict(b.ended),
            **extra,
        }

    # ---- the loop ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        layout = (
            decoding_layout(self.model, self.layout_rows) if self.layout_rows else contextlib.nullcontext()
        )
        spec = self.batcher.speculate
        draft_layout = spec.drafter.layout(self.model) if spec is not None else contextlib.nullcontext()
        with torch.inference_mode(), layout, draft_layout:
            while True:
                with self._cv:
                    while not self._inbox and not self.batcher.busy and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        break
                    new, self._inbox = self._inbox, []
                for job in new:
                    self.batcher.waiting.append(job)
                try:
                    self.batcher.step()
                except Exception as exc:  # noqa: BLE001 - one failed step must not end the server
                    self.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    print(f"error: a decode step failed ({self.last_error[:300]})", file=sys.stderr)
                    self.batcher.fail_all(self.last_error[:300])
            # stopping: what is left ends as cancelled
            for job in self._inbox:
                job.cancelled = True
                self.batcher.waiting.append(job)
            self._inbox = []
            for s in self.batcher.seqs:
                s.job.cancelled = True
            for job in self.batcher.waiting:
                job.cancelled = True
            if self.batcher.busy:
                try:
                    self.batcher.step()
                except Exception:  # noqa: BLE001
                    self.batcher.fail_all("the engine stopped")
