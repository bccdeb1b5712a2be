"""POST /v1/completions: a prompt (text or token ids, one or several) -> the engine; a text_completion, or its
chunks with stream=true.

Text is encoded as `gptkit sample` encodes it (Served.completion_ids: a special token the text spells stays
text), token ids are taken as given (each within the vocabulary); a completion ends at the end-of-text token
(as `gptkit sample` eos=true). Each prompt is sampled n times: choice k * n + i is prompt k's i-th.
"""

from __future__ import annotations

from typing import Any, Optional

from gptkit.serve.endpoints.base import Endpoint, Generation, Logprob, Reply, finite
from gptkit.serve.protocol import COMMON, MAX_LOGPROBS, bad, check_unknown, integer, sampling, unsupported

# the fields this endpoint knows; anything else is an unknown argument
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}


def _token_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def prompts(body: dict) -> list[str | list[int]]:
    """The prompts: a string, an array of strings, an array of token ids, or an array of those."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt is required", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, str):
        out: list = [p]
    elif _token_ids(p):
        out = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        out = list(p)
    elif isinstance(p, list) and p and all(_token_ids(x) for x in p):
        out = list(p)
    else:
        raise bad(
            "prompt must be a non-empty string, an array of strings, an array of token ids, or an array of "
            "arrays of token ids",
            "prompt",
            "invalid_type",
        )
    if any(x == "" for x in out):
        raise bad("the prompt is empty; give at least one character", "prompt", "invalid_value")
    return out


class CompletionReply(Reply):
    prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        # each choice's text so far, in tokens decoded alone (text_offset)
        self.offsets: dict[int, int] = {}

    def logprobs(self, index: int, entries: list[Logprob]) -> Optional[dict]:
        """OpenAI's legacy {tokens, token_logprobs, top_logprobs: [{token: logprob}] (the k most likely and
        the sampled one), text_offset (each token's start in the choice's text, tokens decoded alone)}."""
        if self.tokens is None:
            return None
        t = self.tokens
        offsets = []
        for i, _, _ in entries:
            offsets.append(self.offsets.get(index, 0))
            self.offsets[index] = offsets[-1] + len(t.text(i))
        return {
            "tokens": [t.text(i) for i, _, _ in entries],
            "token_logprobs": [finite(lp) for _, lp, _ in entries],
            "top_logprobs": [
                {**{t.text(j): finite(v) for j, v in top}, t.text(i): finite(lp)} for i, lp, top in entries
            ],
            "text_offset": offsets,
        }

    def choice(self, index: int, text: str, reason: str, logprobs: list[Logprob]) -> dict:
        return {
            "index": index,
            "text": text,
            "logprobs": self.logprobs(index, logprobs),
            "finish_reason": reason,
        }

    def delta(self, index: int, text: Optional[str], reason: Optional[str], logprobs: list[Logprob]) -> dict:
        lps = self.logprobs(index, logprobs) if logprobs else None
        return {"index": index, "text": text or "", "logprobs": lps, "finish_reason": reason}


class Completions(Endpoint):
    path = "/v1/completions"

    def answer(self, body: Optional[dict], path_params: dict[str, Any]) -> Generation:
        engine = self.served.engine
        check_unknown(body, COMPLETION_FIELDS)
        s = sampling(body, engine.max_batch)
        texts = prompts(body)
        logprobs = integer(body, "logprobs", low=0, high=MAX_LOGPROBS)
        unsupported(
            body, "top_logprobs", (0,), "top_logprobs (on /v1/completions logprobs=<k> asks for them)"
        )
        unsupported(body, "echo", (False,), "echo")
        unsupported(body, "suffix", ("",), "suffix")
        best_of = integer(body, "best_of", low=1)
        if best_of is not None and best_of != s.n:
            raise bad(
                f"best_of={best_of} (other than n) is not supported by gptkit serve", "best_of", "unsupported"
            )
        self.check_model(s.model)
        if len(texts) * s.n > engine.max_batch + engine.max_queue:
            raise bad(
                f"{len(texts)} prompts x n={s.n} is more than this server queues at once "
                f"(max_batch + max_queue = {engine.max_batch + engine.max_queue})",
                "prompt",
            )
        ids = [self.served.completion_ids(p) for p in texts]
        max_tokens = min(self.served.check_length(len(i), s.max_tokens, "prompt") for i in ids)
        stop_ids = (self.served.eos_id,) if self.served.eos_id is not None else ()
        return self.generation(ids, s, max_tokens, stop_ids, CompletionReply, logprobs=logprobs)
