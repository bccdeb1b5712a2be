"""Tokenizing in worker processes (gptkit.data.tokenize says how text is cut and encoded).

`Tokenizing(spec, workers)` encodes batches of pieces in `workers` processes (spawned, one thread each), at
most 2 x workers batches in flight, results in input order: the ids do not depend on the worker count. The
processes can be started early (`start_workers`), so that their start-up (spawning and imports: seconds)
overlaps the work before tokenizing; a task carries only its text and a small spec (the tokenizer is read
from its file once per process), a result only its ids. A task can also be a byte range of a JSON-lines file
that the worker reads, parses and cuts itself, or of a text file, ending at safe cuts, that it reads, decodes
and cuts (gptkit.data.ranges): the main process then does almost nothing per byte of text.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import resource_tracker
from typing import Any, Callable, Iterator

from gptkit.data.tokenize import EncoderSpec, build_encoder, encode_batch
from gptkit.errors import GptkitError

# in a worker: its encoder(s)
_worker: dict[EncoderSpec, Callable[[list[str]], list[Any]]] = {}


def _init_worker(parent: int) -> None:
    """A worker's start: SIGINT ignored, the watch on `parent` (the pid of the prepare that started it,
    given by that process: a parent killed while this worker was starting is already gone here, and
    os.getppid() would name the process that adopted the worker), then the encoders' imports."""
    # a terminal's Ctrl-C reaches the whole process group: the prepare decides (it shuts the pool down)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        # blocked by start_workers since this process was spawned (a pending one is discarded: ignored)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    # one thread per worker process
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    import tokenizers  # noqa: F401

    try:
        import tiktoken  # noqa: F401
    except ImportError:
        pass


def _ready() -> None:
    """A no-op task: submitting one per worker makes the pool start all its processes now."""


def _exit_with_parent(parent: int) -> None:
    """A worker whose prepare was killed (kill -9 included) exits within a second: it would otherwise wait
    for work forever, holding the killed command's output pipes open."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def encode_task(
    encode: Callable[[list[str]], list[Any]], spec: EncoderSpec, batch: list[tuple[str, bool, bool]]
) -> tuple[Any, Any, int]:
    """One task of pieces cut by the main process: (ids, the ends of the documents it ends (encode_batch),
    UTF-8 bytes of the text)."""
    return (*encode_batch(encode, batch, spec.eos, spec.dtype, spec.bos), text_bytes(batch))


# (encode, spec, task) -> result
Task = Callable[[Callable[[list[str]], list[Any]], EncoderSpec, Any], tuple]


def _work(spec: EncoderSpec, task: Any, run: Task = encode_task):
    """In a worker: run(its encoder, spec, task), e.g. encode_task: (ids, documents' ends, UTF-8 bytes)."""
    encode = _worker.get(spec)
    if encode is None:
        _worker.clear()
        encode = _worker[spec] = build_encoder(spec)
    return run(encode, spec, task)


def text_bytes(batch: list[tuple[str, bool, bool]]) -> int:
    """The UTF-8 size of a batch's text (what progress counts)."""
    return sum(len(t[0].encode()) for t in batch)


def start_workers(workers: int) -> ProcessPoolExecutor:
    """`workers` spawned processes (one thread each), started now: their imports overlap what the caller
    does before it gives them work (`Tokenizing(spec, workers, pool=...)`). They never see a Ctrl-C: SIGINT
    is blocked from their first instruction (a blocked signal stays blocked across exec) and ignored from
    their initializer on, so that a Ctrl-C while they import prints no traceback of theirs; the prepare
    stops them (Tokenizing shuts the pool down)."""
    block = hasattr(signal, "pthread_sigmask")
    if block:
        # started first: starting it unblocks SIGINT in this thread (multiprocessing's own guard, bpo-33613)
        resource_tracker.ensure_running()
    # this thread's mask is what the spawned processes start with; a Ctrl-C meanwhile reaches this process
    # at the restore below (or at once through another of its threads)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if block else None
    try:
        pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(os.getpid(),),
        )
        # each submit to a pool without an idle process starts one
        for _ in range(workers):
            pool.submit(_ready)
    finally:
        if before is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
    return pool


class Tokenizing:
    """Encodes batches in `workers` processes (1: in this process, one thread), in input order. `pool`:
    the processes, already started by start_workers(workers) (shut down with this object)."""

    def __init__(self, spec: EncoderSpec, workers: int, pool: ProcessPoolExecutor | None = None) -> None:
        self.spec, self.workers = spec, int(workers)
        self.pool = pool if self.workers > 1 else None
        if pool is not None and self.pool is None:
            pool.shutdown(wait=False, cancel_futures=True)
        self.encode: Callable[[list[str]], list[Any]] | None = None
        self._env: str | None = None

    def __enter__(self) -> Tokenizing:
        if self.workers > 1:
            if self.pool is None:
                self.pool = start_workers(self.workers)
        else:
            self._env = os.environ.get("TOKENIZERS_PARALLELISM")
            # one process, one thread: what workers=1 means
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            self.encode = build_encoder(self.spec)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        elif self._env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self._env

    def map(self, work: Iterator[Any], run: Task = encode_task) -> Iterator[tuple]:
        """run(encoder, spec, task) per task, in order, here or in the workers (a module-level function):
        by default a task is a batch of pieces and its result (ids array, the ends of the documents it ends,
        UTF-8 bytes of text). At most 2 x workers tasks in flight."""
        if self.pool is None:
            assert self.encode is not None
            for b in work:
                yield run(self.encode, self.spec, b)
            return
        flight: deque[Future] = deque()
        light = self.spec.light()
        try:
            for b in work:
                flight.append(self.pool.submit(_work, light, b, run))
                if len(flight) >= 2 * self.workers:
                    yield flight.popleft().result()
            while flight:
                yield flight.popleft().result()
        except BrokenProcessPool as exc:
            raise GptkitError(
                "a tokenization worker process ended abruptly (killed, out of memory, or, from Python, a "
                'script that calls prepare() without `if __name__ == "__main__":`: each spawned worker '
                "imports it again); set data.workers=1 to tokenize in this process"
            ) from exc
