"""POST /v1/chat/completions: messages -> the run's chat template -> the engine; a chat.completion, or its
chunks with stream=true.

The conversation is rendered with the run's chat template and the generation prompt, then encoded as
`gptkit chat` encodes it (Served.chat_ids: message text is data, only the template's markup yields control
tokens); a reply ends at the template's end-of-turn token and the end-of-text tokens (Served.chat_stop).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from gptkit.serve.endpoints.base import Endpoint, Generation, Logprob, Reply, finite
from gptkit.serve.grammar import response_format
from gptkit.serve.protocol import (
    COMMON,
    MAX_LOGPROBS,
    bad,
    boolean,
    check_unknown,
    integer,
    sampling,
    type_name,
    unsupported,
)

# the fields this endpoint knows; anything else is an unknown argument
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "modalities",
    "reasoning_effort",
    "prediction",
}

ROLES = ("system", "developer", "user", "assistant")


def messages(body: dict) -> list[dict[str, str]]:
    """The conversation as the template renders it: role and content (text), `developer` read as `system`."""
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise bad(f"messages must be an array, not {type_name(msgs)}", "messages", "invalid_type")
    if not msgs:
        raise bad("messages must not be empty", "messages", "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(
                f"{where}.role={json.dumps(role)[:40]} is not one of {', '.join(ROLES)} (tool messages are "
                "not supported)",
                f"{where}.role",
                "invalid_value",
            )
        for key in m:
            if key not in ("role", "content", "name"):
                raise bad(f"{where}.{key} is not supported by gptkit serve", f"{where}.{key}", "unsupported")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise bad(
                        f'{where}.content[{j}] is not a text part ({{"type": "text", "text": ...}}); '
                        "this model reads text only",
                        f"{where}.content",
                        "invalid_value",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string or an array of text parts", f"{where}.content")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise bad(f"{where}.name must be a string", f"{where}.name", "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


class ChatReply(Reply):
    prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def logprobs(self, entries: list[Logprob]) -> Optional[dict]:
        """OpenAI's {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
        if self.tokens is None:
            return None
        t = self.tokens

        def one(i: int, lp: float) -> dict:
            return {"token": t.text(i), "logprob": finite(lp), "bytes": list(t.bytes(i))}

        content = [{**one(i, lp), "top_logprobs": [one(j, v) for j, v in top]} for i, lp, top in entries]
        return {"content": content, "refusal": None}

    def choice(self, index: int, text: str, reason: str, logprobs: list[Logprob]) -> dict:
        message = {"role": "assistant", "content": text, "refusal": None}
        return {
            "index": index,
            "message": message,
            "logprobs": self.logprobs(logprobs),
            "finish_reason": reason,
        }

    def delta(self, index: int, text: Optional[str], reason: Optional[str], logprobs: list[Logprob]) -> dict:
        delta: dict[str, Any] = {"content": text} if text else {}
        lps = self.logprobs(logprobs) if logprobs else None
        return {"index": index, "delta": delta, "logprobs": lps, "finish_reason": reason}

    def opening(self, n_choices: int) -> list[dict]:
        """Each choice's first chunk: the role, with empty content."""
        return [
            {
                **self.head(self.chunk_object),
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for i in range(n_choices)
        ]


class ChatCompletions(Endpoint):
    path = "/v1/chat/completions"

    def answer(self, body: Optional[dict], path_params: dict[str, Any]) -> Generation:
        check_unknown(body, CHAT_FIELDS)
        s = sampling(body, self.served.engine.max_batch, "max_completion_tokens")
        logprobs = boolean(body, "logprobs")
        top = integer(body, "top_logprobs", low=0, high=MAX_LOGPROBS)
        if top and not logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        unsupported(body, "tools", ([],), "tool calling")
        unsupported(body, "functions", ([],), "function calling")
        unsupported(body, "tool_choice", ("none", "auto"), "tool calling")
        unsupported(body, "function_call", ("none", "auto"), "function calling")
        constraint = response_format(self.served, body.get("response_format"))
        unsupported(body, "modalities", (["text"],), "output other than text")
        unsupported(body, "prediction", (), "predicted outputs")
        boolean(body, "parallel_tool_calls")
        msgs = messages(body)
        self.check_model(s.model)
        ids = self.served.chat_ids(msgs)
        max_tokens = self.served.check_length(len(ids), s.max_tokens, "messages")
        return self.generation(
            [ids],
            s,
            max_tokens,
            self.served.chat_stop,
            ChatReply,
            decode=self.served.chat_text,
            logprobs=(top or 0) if logprobs else None,
            constraint=constraint,
        )
