"""The interface every endpoint of the OpenAI API implements, and what a completion endpoint hands the app.

gptkit/serve/app.py answers every endpoint the same way and never asks which one it has:

    path, method       where it answers (GET: no body; POST: a JSON body, read and checked whole by the app)
    Endpoint(served)   one instance per app, over the model served
    answer(body, path_params) -> dict | Generation
                       the request checked field by field (an ApiError, OpenAI's 4xx shape, names the field),
                       then either the JSON reply itself (models) or a Generation: the prompts' ids, how to
                       sample them, and the Reply class that shapes what the engine makes of them
    Reply              the shape of one response: its id prefix and object names, and a choice whole
                       (choice) or as a stream chunk's part (delta), each with its tokens' log-probs when
                       asked (logprobs); opening() gives the chunks a stream starts with before any text
                       (chat: each choice's role); stream() and ending() give a choice's chunks for new
                       text and for its end (chat with tools holds text where a call may start, and ends
                       with the calls)

A new endpoint is one file here with its Endpoint subclass, and one row of gptkit/serve/endpoints/__init__.py.
vLLM's entrypoints/openai/ (one folder per endpoint: its protocol and its serving class) is the model.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

from gptkit.inference.batcher import SamplingParams
from gptkit.serve.protocol import ApiError, Sampling
from gptkit.serve.served import Served
from gptkit.serve.tokens import TokenTexts

# the engine's reasons a choice ended, as OpenAI names them
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}

# one sampled token's log-probs: its id, its log-prob, and the k most likely (id, log-prob)
Logprob = tuple[int, float, list[tuple[int, float]]]

# what a log-prob of -inf is sent as (JSON has no infinity; vLLM's value)
LOGPROB_FLOOR = -9999.0


def finite(lp: float) -> float:
    return max(lp, LOGPROB_FLOOR)


class Reply:
    """Ids and time of one response; a subclass gives the shape of its choices."""

    # the response id's prefix, the object of a whole response and of a stream chunk
    prefix: ClassVar[str]
    object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(
        self, model: str, fingerprint: Optional[str] = None, tokens: Optional[TokenTexts] = None
    ) -> None:
        self.model = model
        self.fingerprint = fingerprint
        # the request asked for log-probs: how ids are named; None: every choice's logprobs is null
        self.tokens = tokens
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def choice(self, index: int, text: str, reason: str, logprobs: list[Logprob]) -> dict:
        """One choice of a whole response."""
        raise NotImplementedError

    def delta(self, index: int, text: Optional[str], reason: Optional[str], logprobs: list[Logprob]) -> dict:
        """One choice's part of a stream chunk: new text (and its tokens' log-probs), or its ending."""
        raise NotImplementedError

    def opening(self, n_choices: int) -> list[dict]:
        """The chunks a stream starts with, before any text."""
        return []

    def stream(self, index: int, text: Optional[str], logprobs: list[Logprob]) -> list[dict]:
        """The chunks for new text of choice `index` (chat with tools: held where a call may start)."""
        return [self.chunk(index, text, logprobs=logprobs)]

    def ending(self, index: int, finish: str) -> list[dict]:
        """The chunks that end choice `index` (chat with tools: its calls, then finish_reason)."""
        return [self.chunk(index, None, finish=finish)]

    def head(self, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def final(self, texts: list[str], reasons: list[str], usage: dict, logprobs: list[list[Logprob]]) -> dict:
        choices = [
            self.choice(i, text, FINISH.get(r, r), lps)
            for i, (text, r, lps) in enumerate(zip(texts, reasons, logprobs))
        ]
        return {**self.head(self.object), "choices": choices, "usage": usage}

    def chunk(
        self, index: int, text: Optional[str], finish: Optional[str] = None, logprobs: Optional[list] = None
    ) -> dict:
        """One stream chunk for choice `index`: new text (and its tokens' log-probs), or the ending."""
        reason = FINISH.get(finish, finish) if finish else None
        return {**self.head(self.chunk_object), "choices": [self.delta(index, text, reason, logprobs or [])]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.head(self.chunk_object), "choices": [], "usage": usage}


@dataclass
class Generation:
    """What a completion endpoint asks of the engine: each prompt's ids sampled params.n times, answered in
    the shape of `reply`, whole or streamed."""

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    # the Reply class (or a partial of one: chat's with the request's tools)
    reply: Callable[..., Reply]
    # ids -> the text a reply shows (chat: the template's, e.g. harmony's final channel); None: all of it
    decode: Optional[Callable[[list[int]], str]] = None


class Endpoint:
    """One route of the OpenAI API over the model served."""

    path: ClassVar[str]
    method: ClassVar[str] = "POST"

    def __init__(self, served: Served) -> None:
        self.served = served

    def answer(self, body: Optional[dict], path_params: dict[str, Any]) -> dict | Generation:
        raise NotImplementedError

    def check_model(self, name: Optional[str]) -> None:
        """A request naming a model names the one served (404 otherwise)."""
        if name is not None and name != self.served.name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.served.name}` "
                "(GET /v1/models)",
                "model",
                "model_not_found",
            )

    def generation(
        self,
        prompts: list[list[int]],
        s: Sampling,
        max_tokens: int,
        stop_ids: tuple[int, ...],
        reply: Callable[..., Reply],
        decode: Optional[Callable[[list[int]], str]] = None,
        logprobs: Optional[int] = None,
        constraint: Optional[Callable] = None,
    ) -> Generation:
        """The prompts sampled as the request's checked fields say, ending at stop_ids unless ignore_eos;
        logprobs: None, or each token's log-prob and the k most likely; constraint: one per choice
        (response_format's grammar, gptkit/serve/grammar.py)."""
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=s.seed,
            n=s.n,
            stop_ids=() if s.ignore_eos else stop_ids,
            stop=s.stop,
            logprobs=logprobs,
            constraint=constraint,
        )
        return Generation(prompts, params, s.stream, s.include_usage, reply, decode)
