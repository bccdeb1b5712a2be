"""Multi-turn episodes of GRPO with an environment (grpo.environment=): the model's turns alternate with the
tools' results, up to max_turns model turns.

    run_episodes(model, ctx, records, keys, max_turns, opts, seq_len)   -> per prompt, its Episodes

One turn of an episode:

  1. context   the conversation so far, with the environment's tools, rendered with the chat template up to
               the assistant's turn (the generation prompt) and encoded as every room encodes a conversation
               (gptkit.chat_templates.encode_conversation: text is data, a tool's result included)
  2. sample    the reply drawn with the key sample_key(episode key, turn) (gptkit.inference.rollouts: a pure
               function of its key, whatever else is sampled beside it), at most opts.max_new_tokens and the
               room seq_len leaves; episodes whose contexts have one length are one batch
  3. parse     the reply read back with the template's own call syntax (gptkit/chat_formats/tool_syntax.py,
               the one contract of data=chat, serve and `gptkit chat tools=`): calls of the environment's
               tools, or text (the final answer: the episode ends)
  4. tools     each call run on the episode's environment instance; its result a `tool` message. A tool that
               raises ends the episode with its error recorded (the error as the tool's message)
  5. reward    the environment's turn_reward (optional), then at the end its score of the whole conversation

What trains is the finished conversation as an SFT record ({"messages", "tools"}: `Episode.record()`) encoded
as data=chat encodes it: its ids, and a loss mask of the assistant's turns (the tools' results, the prompt and
the template's markup between turns masked). Those are the ids sampled: each turn's context is the render of
the conversation before it, and its reply's ids are the render's ids there, except where the reply's text
encodes to other ids than the ones drawn (a non-canonical split of the same text); such a turn is counted
(`Turn.retokenized`), and what trains is the rendered record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gptkit.chat_formats.tools import Conversation
from gptkit.chat_templates import encode_conversation
from gptkit.inference.environment import Environment
from gptkit.inference.rollouts import RolloutOptions, sample_key, sample_rows

# why an episode ended
ANSWER, MAX_TURNS, TOOL_ERROR, LENGTH, CONTEXT = "answer", "max_turns", "tool_error", "length", "context"


@dataclass
class EpisodeContext:
    """What every episode of a run shares: the tokenizer, the chat template and its call syntax, the
    environment."""

    tokenizer: Any
    template: Any
    syntax: Any
    env: Environment


@dataclass
class Turn:
    """One model turn: its context's length (tokens), the ids drawn, its text, its calls and their results,
    its reward, and whether its text encodes to other ids than the ones drawn."""

    context: int
    tokens: list[int]
    text: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    reward: float = 0.0
    retokenized: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "tokens": len(self.tokens),
            "text": self.text,
            "calls": self.calls,
            "results": self.results,
            "reward": self.reward,
            "retokenized": self.retokenized,
        }


@dataclass
class Episode:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    turns: list[Turn] = field(default_factory=list)
    stop: str = ""
    error: Optional[str] = None
    score: float = 0.0
    # what trains: the record's ids and its assistant mask (encode_conversation)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)

    @property
    def reward(self) -> float:
        """The episode's total: its turns' rewards and the environment's score."""
        return self.score + sum(t.reward for t in self.turns)

    def conversation(self) -> Conversation:
        return Conversation(self.messages, self.tools)

    def record(self) -> dict[str, Any]:
        """The finished episode as a data=chat record."""
        return {"messages": list(self.messages), "tools": list(self.tools)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "stop": self.stop,
            "error": self.error,
            "score": self.score,
            "reward": self.reward,
            "tokens": len(self.ids),
            "turns": [t.to_dict() for t in self.turns],
        }


def render(ctx: EpisodeContext, messages: list[dict], tools, prompt: bool) -> tuple[list[int], list[int]]:
    """(ids, assistant mask) of a conversation with the tools (prompt: up to the assistant's turn)."""
    return encode_conversation(
        ctx.tokenizer, ctx.template, Conversation(messages, tools), "an episode", add_generation_prompt=prompt
    )


def run_episodes(
    model,
    ctx: EpisodeContext,
    prompts: list[tuple[list[dict], dict]],
    keys: list[list[int]],
    max_turns: int,
    opts: RolloutOptions,
    seq_len: int,
    lockstep: Optional[Callable[[bool], bool]] = None,
) -> list[list[Episode]]:
    """For each (messages, record) of `prompts`, len(keys[p]) episodes, episode r drawn with keys[p][r]
    (module docstring)."""
    tools = ctx.env.specs
    groups = [[Episode([dict(m) for m in msgs], tools) for _ in ks] for (msgs, _), ks in zip(prompts, keys)]
    flat = [(p, r, e) for p, g in enumerate(groups) for r, e in enumerate(g)]
    instances = {(p, r): ctx.env.new(dict(prompts[p][1])) for p, r, _ in flat}
    active = [(p, r, e) for p, r, e in flat]
    for turn in range(max_turns):
        if not active:
            break
        contexts = {}
        for p, r, e in active:
            ids, _ = render(ctx, e.messages, tools, prompt=True)
            contexts[(p, r)] = ids
        # episodes whose contexts have one length: one batch
        by_len: dict[tuple[int, int], list] = {}
        for p, r, e in active:
            n = len(contexts[(p, r)])
            by_len.setdefault((n, min(opts.max_new_tokens, seq_len - n)), []).append((p, r, e))
        replies = {}
        for (_, budget), items in sorted(by_len.items(), key=lambda kv: kv[0]):
            if budget < 1:
                for item in items:
                    item[2].stop = CONTEXT
                continue
            done = sample_rows(
                model,
                [contexts[(p, r)] for p, r, _ in items],
                [sample_key(keys[p][r], turn) for p, r, _ in items],
                opts,
                budget,
                lockstep,
            )
            replies.update({(p, r): c for (p, r, _), c in zip(items, done)})
        still = []
        for p, r, e in active:
            if e.stop:
                continue
            c = replies[(p, r)]
            tokens = c.tokens
            body = tokens[:-1] if tokens and tokens[-1] in opts.stop_ids else tokens
            text = ctx.template.reply_text(ctx.tokenizer, body)
            t = Turn(len(contexts[(p, r)]), list(tokens), text)
            e.turns.append(t)
            parsed = ctx.syntax.parse(text, tools) if c.stop_reason == "stop" else None
            if parsed is None:
                e.messages.append({"role": "assistant", "content": text})
                e.stop = ANSWER if c.stop_reason == "stop" else LENGTH
                t.reward = ctx.env.turn_reward(instances[(p, r)], turn, e.messages[-1], [])
                continue
            content, calls = parsed
            ids = [f"call_{turn}_{k}" for k in range(len(calls))]
            message = {
                "role": "assistant",
                "content": content or "",
                "tool_calls": [
                    {
                        "id": i,
                        "type": "function",
                        "function": {"name": x["name"], "arguments": x["arguments"]},
                    }
                    for i, x in zip(ids, calls)
                ],
            }
            e.messages.append(message)
            t.calls = [{"name": x["name"], "arguments": x["arguments"]} for x in calls]
            if turn + 1 == max_turns:
                # the last turn's calls are not run: the episode is over
                e.stop = MAX_TURNS
                t.reward = ctx.env.turn_reward(instances[(p, r)], turn, message, [])
                continue
            for i, x in zip(ids, calls):
                result, error = ctx.env.call(instances[(p, r)], x["name"], x["arguments"])
                t.results.append(result)
                e.messages.append({"role": "tool", "tool_call_id": i, "name": x["name"], "content": result})
                if error is not None:
                    e.stop, e.error = TOOL_ERROR, error
                    break
            t.reward = ctx.env.turn_reward(instances[(p, r)], turn, message, t.results)
            if not e.stop:
                still.append((p, r, e))
        active = still
    for p, r, e in flat:
        e.stop = e.stop or MAX_TURNS
        e.score = ctx.env.score(instances[(p, r)], list(e.messages))
        e.ids, e.mask = render(ctx, e.messages, tools, prompt=False)
        for t in e.turns:
            t.retokenized = e.ids[t.context : t.context + len(t.tokens)] != t.tokens
    return groups
