"""harmony, gpt-oss's chat format (OpenAI's `openai-harmony` renderer, o200k_harmony's special tokens).

A message is `<|start|>{role}<|channel|>{channel}<|message|>{text}<|end|>`. The conversation opens with
the system message, which this format writes from its variables (the model identity, the knowledge
cutoff, the current date when given, the reasoning effort, the valid channels: the fields of harmony's
SystemContent, with its defaults); a `system` message of the conversation is the developer message's
instructions (`# Instructions`, as gpt-oss's own template puts it). An assistant message is on the
`final` channel unless its `channel` says `analysis` or `commentary`; its `thinking`, when it has one, is
an `analysis` message before it. As harmony's renderer does (auto_drop_analysis), when the last assistant
message is on the final channel the analysis messages before the conversation's first final message are
left out. The last message, when it is the assistant's on the final channel, ends with `<|return|>` (what
render_conversation_for_training writes and the model stops at); the generation prompt is
`<|start|>assistant`. The assistant's tokens ({% generation %}) are each assistant message after the
`<|start|>assistant` that opens its turn (a second message of the same turn, the final answer after its
analysis, is the model's to write: its header too).

Not taken: tool calls and tool messages (`to=functions.x`, `<|call|>`, `<|constrain|>`): a conversation
with tools or tool_calls (gptkit.chat_formats.tools) is refused by ChatTemplate.render (this template never
reads them), and a `tool` message is an error here.

tests/data/test_harmony.py compares the token ids with openai-harmony's own renderer.
"""

from __future__ import annotations

# the special tokens the template writes (o200k_harmony: 200006, 200005, 200008, 200007, 200002)
SPECIAL_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]

# harmony's SystemContent defaults; current_date "" writes no date line (harmony's default, None)
VARIABLES = {
    "model_identity": "You are ChatGPT, a large language model trained by OpenAI.",
    "knowledge_cutoff": "2024-06",
    "current_date": "",
    "reasoning_effort": "medium",
}

CHANNELS = ("analysis", "commentary", "final")

# the variables' defaults, so that the template renders alone too (an exported chat_template.jinja)
_DEFAULTS = "".join(
    f"{{%- if {k} is not defined -%}}{{%- set {k} = {v!r} -%}}{{%- endif -%}}" for k, v in VARIABLES.items()
)

TEMPLATE = _DEFAULTS + (
    # where analysis is dropped: the last assistant message is final, and before the first final one
    "{%- set ns = namespace(first_final=-1, last_final=false, prev='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set ch = m.channel if m.channel is defined and m.channel is not none else 'final' -%}"
    "{%- if ch not in ['analysis', 'commentary', 'final'] -%}"
    "{{- raise_exception('the harmony format has the channels analysis, commentary and final, not ' + ch) -}}"
    "{%- endif -%}"
    "{%- if ch == 'final' and ns.first_final < 0 -%}{%- set ns.first_final = loop.index0 -%}{%- endif -%}"
    "{%- set ns.last_final = ch == 'final' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set drop = ns.last_final and ns.first_final >= 0 -%}"
    # the system message
    "<|start|>system<|message|>{{- model_identity -}}"
    "{%- if knowledge_cutoff -%}{{- '\\nKnowledge cutoff: ' + knowledge_cutoff -}}{%- endif -%}"
    "{%- if current_date -%}{{- '\\nCurrent date: ' + current_date -}}{%- endif -%}"
    "{%- if reasoning_effort -%}{{- '\\n\\nReasoning: ' + reasoning_effort | lower -}}{%- endif -%}"
    "{{- '\\n\\n# Valid channels: analysis, commentary, final. '"
    "'Channel must be included for every message.' -}}"
    "<|end|>"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "<|start|>developer<|message|>{{- '# Instructions\\n\\n' + m['content'] -}}<|end|>"
    "{%- elif m['role'] == 'user' -%}"
    "<|start|>user<|message|>{{- m['content'] -}}<|end|>"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- set ch = m.channel if m.channel is defined and m.channel is not none else 'final' -%}"
    "{%- set i, turn_last, messages_of_turn = loop.index0, loop.last, [] -%}"
    "{%- if m.thinking is defined and m.thinking is not none "
    "and not (drop and i <= ns.first_final) -%}"
    "{%- set messages_of_turn = messages_of_turn + [['analysis', m.thinking]] -%}"
    "{%- endif -%}"
    "{%- if not (drop and ch == 'analysis' and i < ns.first_final) -%}"
    "{%- set messages_of_turn = messages_of_turn + [[ch, m['content']]] -%}"
    "{%- endif -%}"
    "{%- for part in messages_of_turn -%}"
    "{%- set last = loop.last and turn_last -%}"
    "{%- if ns.prev != 'assistant' -%}<|start|>assistant{%- endif -%}"
    "{%- generation -%}"
    "{%- if ns.prev == 'assistant' -%}<|start|>assistant{%- endif -%}"
    "<|channel|>{{- part[0] -}}<|message|>{{- part[1] -}}"
    "{%- if last and part[0] == 'final' and not add_generation_prompt -%}<|return|>"
    "{%- else -%}<|end|>{%- endif -%}"
    "{%- endgeneration -%}"
    "{%- set ns.prev = 'assistant' -%}"
    "{%- endfor -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- raise_exception('the harmony format takes no tool messages '"
    "'(gptkit conversations carry no tool calls)') -}}"
    "{%- else -%}"
    "{{- raise_exception('the harmony format has no role ' + m['role']) -}}"
    "{%- endif -%}"
    "{%- if m['role'] != 'assistant' -%}{%- set ns.prev = m['role'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


class ReplyReader:
    """What a reply the model writes after `<|start|>assistant` says: the text of its final-channel message
    is shown (streamed) and is the message's content; its analysis messages are its `thinking` (which the
    template leaves out of later turns, as harmony does). A reply without a message header (a model that
    has not learned the format) is shown whole."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = {s: tokenizer.token_to_id(s) for s in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")}
        self.start_id, self.channel_id, self.message_id, self.end_id = ids.values()
        # where the reader is: "header" (role and channel name), "body" (a message's text), "after" (<|end|>)
        self.state, self.name, self.body = "header", [], []
        self.current = None
        # (channel, ids of its text), each message read so far
        self.parts: list[tuple[str, list[int]]] = []
        self.headers = 0

    def shows(self, tok: int) -> bool:
        """Read one more id of the reply; True when it is text to show (the final channel's)."""
        if tok == self.start_id:
            self.state, self.name = "header", []
        elif tok == self.channel_id:
            self.state, self.name = "channel", []
        elif tok == self.message_id:
            self.headers += 1
            self.current = self.tokenizer.decode(self.name).strip() or "final"
            self.state, self.body = "body", []
            self.parts.append((self.current, self.body))
        elif tok == self.end_id:
            self.state = "after"
        elif self.state == "channel":
            self.name.append(tok)
        elif self.state == "body":
            self.body.append(tok)
            return self.current == "final"
        return False

    def message(self, ids: list[int], shown: str) -> dict:
        """The assistant's message of a reply (`ids`, read through shows; `shown`: the text shown)."""
        if not self.headers:
            return {"role": "assistant", "content": self.tokenizer.decode(ids)}
        out: dict = {"role": "assistant", "content": shown}
        thinking = [self.tokenizer.decode(b) for ch, b in self.parts if ch == "analysis"]
        if thinking:
            out["thinking"] = "".join(thinking)
        return out
