"""POST /v1/chat/completions: messages -> the run's chat template -> the engine; a chat.completion, or its
chunks with stream=true.

The conversation is rendered with the run's chat template and the generation prompt, then encoded as
`gptkit chat` encodes it (Served.chat_ids: message text is data, only the template's markup yields control
tokens); a reply ends at the template's end-of-turn token and the end-of-text tokens (Served.chat_stop).

Tools (gptkit/serve/tool_calls.py): the request's tools are rendered by the template with the messages (an
assistant's tool_calls and tool messages too); a reply that is calls in the template's syntax is answered
as OpenAI's tool_calls with finish_reason "tool_calls" (streamed: its text held from where a call may
start, then each call's id and name, then its arguments); a botched call is the reply's text.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Optional

from gptkit.chat_formats.tool_syntax import openai_calls
from gptkit.chat_formats.tools import Conversation, check_calls
from gptkit.errors import GptkitError
from gptkit.serve.endpoints.base import FINISH, Endpoint, Generation, Logprob, Reply, finite
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
from gptkit.serve.tool_calls import ToolCalls, tool_request

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

ROLES = ("system", "developer", "user", "assistant", "tool")
# the fields a message may have (besides role and content), by role
MESSAGE_FIELDS = {"assistant": ("name", "tool_calls"), "tool": ("tool_call_id", "name")}


def messages(body: dict) -> list[dict[str, Any]]:
    """The conversation as the template renders it: role and content (text), `developer` read as `system`;
    an assistant's tool_calls and a tool message's tool_call_id and name checked by the one tool contract
    (gptkit.chat_formats.tools: arguments as objects, as the templates write them)."""
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
                f"{where}.role={json.dumps(role)[:40]} is not one of {', '.join(ROLES)}",
                f"{where}.role",
                "invalid_value",
            )
        for key in m:
            # null fields, and a reply's own metadata that a client sends back with it (the openai
            # client's message object: refusal, annotations), say nothing
            if m[key] is None or (role == "assistant" and key in ("refusal", "annotations")):
                continue
            if key not in ("role", "content", "name", *MESSAGE_FIELDS.get(role, ())):
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
        msg = {"role": "system" if role == "developer" else role, "content": content}
        for key in MESSAGE_FIELDS.get(role, ()):
            if key != "name" and m.get(key) is not None:
                msg[key] = m[key]
        if role == "tool" and m.get("name") is not None:
            msg["name"] = m["name"]
        out.append(msg)
    try:
        return check_calls(out, "messages")
    except GptkitError as exc:
        raise bad(str(exc), "messages", "invalid_value") from None


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

    def __init__(self, *args, calls: Optional[ToolCalls] = None, **kw) -> None:
        super().__init__(*args, **kw)
        # tools the reply may call (None: its text is its content)
        self.calls = calls
        # each streamed choice's text held from where a call may start (CallStream)
        self.streams: dict[int, Any] = {}

    def choice(self, index: int, text: str, reason: str, logprobs: list[Logprob]) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        parsed = self.calls.parse(text) if self.calls is not None and reason == "stop" else None
        if parsed is not None:
            content, calls = parsed
            message = {**message, "content": content, "tool_calls": openai_calls(calls)}
            reason = "tool_calls"
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

    def stream(self, index: int, text: Optional[str], logprobs: list[Logprob]) -> list[dict]:
        """With tools: the text shown as it comes up to where a call may start (CallStream)."""
        if self.calls is not None and text:
            if index not in self.streams:
                self.streams[index] = self.calls.stream()
            text = self.streams[index].feed(text)
            if not text and not logprobs:
                return []
        return super().stream(index, text, logprobs)

    def ending(self, index: int, finish: str) -> list[dict]:
        """With tools: the held text read whole: calls (each an id and name, then its arguments), then
        finish_reason tool_calls; or the rest of the text."""
        state = self.streams.pop(index, None)
        if state is None:
            return super().ending(index, finish)
        rest, calls = state.end(cut=FINISH.get(finish, finish) != "stop")
        out = [self.chunk(index, rest)] if rest else []
        for k, c in enumerate(calls or []):
            head = {
                "index": k,
                "id": c["id"],
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": ""},
            }
            out.append(self._tool_delta(index, head))
            out.append(
                self._tool_delta(index, {"index": k, "function": {"arguments": c["function"]["arguments"]}})
            )
        return out + [self.chunk(index, None, finish="tool_calls" if calls else finish)]

    def _tool_delta(self, index: int, call: dict) -> dict:
        choice = {"index": index, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}
        return {**self.head(self.chunk_object), "choices": [choice]}

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
        unsupported(body, "functions", ([],), "function calling (the legacy field; send tools)")
        unsupported(
            body, "function_call", ("none", "auto"), "function calling (the legacy field; send tool_choice)"
        )
        boolean(body, "parallel_tool_calls")
        constraint = response_format(self.served, body.get("response_format"))
        unsupported(body, "modalities", (["text"],), "output other than text")
        unsupported(body, "prediction", (), "predicted outputs")
        msgs = messages(body)
        self.check_model(s.model)
        tools = tool_request(self.served, body)
        if tools.constraint is not None:
            if constraint is not None:
                raise bad(
                    "response_format and a forced tool call (tool_choice required or a function) cannot "
                    "both constrain the reply; send one",
                    "tool_choice",
                    "invalid_value",
                )
            constraint = tools.constraint
        ids = self.served.chat_ids(Conversation(msgs, tools.tools))
        max_tokens = self.served.check_length(len(ids), s.max_tokens, "messages")
        return self.generation(
            [ids],
            s,
            max_tokens,
            self.served.chat_stop,
            partial(ChatReply, calls=tools.calls) if tools.calls is not None else ChatReply,
            decode=self.served.call_text(tools.calls.syntax)
            if tools.calls is not None
            else self.served.chat_text,
            logprobs=(top or 0) if logprobs else None,
            constraint=constraint,
        )
