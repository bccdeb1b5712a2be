"""Chat templates: how a conversation becomes text, and that text token ids.

A template is Jinja, rendered as transformers' apply_chat_template renders it (a sandboxed environment,
trim_blocks and lstrip_blocks, `{% generation %}` blocks, raise_exception, strftime_now, tojson). Built in:
`chatml`, `llama3` and `harmony` (gpt-oss's, gptkit/chat_formats/harmony.py; their special tokens are
added to a tokenizer that lacks them); any other template
comes from a file (.jinja, a transformers tokenizer_config.json, or a gptkit run's chat.json) or from the
folder a tokenizer lies in (`auto`).

The assistant's tokens are found as transformers finds them: from `{% generation %}` blocks when the
template has them; otherwise, for each assistant turn, as the text between the conversation rendered up to
that turn with the generation prompt and rendered with the turn (so the end-of-turn token, e.g. <|im_end|>,
is learned).

Text is data: what the messages say (their content, every string but the role) never becomes a control token,
even when it spells one (`<|im_end|>`, `<|eot_id|>`...): only the template's own markup yields the special
ids (encode_conversation, which every room that encodes a conversation calls). transformers'
apply_chat_template does not do this (it encodes the rendered text whole, matching special tokens anywhere);
for a conversation whose text spells no special token the ids are the same as its.

Tools: a conversation that carries tools (gptkit.chat_formats.tools.Conversation: the record's `tools`, the
assistant's `tool_calls`, `tool` messages) renders them with the template's own tool syntax (`tools=` as
transformers passes it); their strings are data as the messages' are; a template that never reads tools or
tool_calls refuses a conversation that has them (they would be dropped without a word).

Used by every room that talks in turns: data=chat and data=preference (gptkit.data), `gptkit chat`
(gptkit.inference.generate), export and import (gptkit.hf).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from gptkit.chat_formats import harmony, tool_syntax
from gptkit.chat_formats.tools import tools_of
from gptkit.errors import GptkitError

# jinja2 is imported where a template is compiled or rendered.

# in a run folder (and a prepared chat or preference folder): the template the run was trained with
CHAT_FILE = "chat.json"

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' "
    "}}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# name -> (template, its special tokens (added to a tokenizer that lacks them), the variables it reads)
BUILTIN = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], {}),
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>"},
    ),
    # gpt-oss's (gptkit/chat_formats/harmony.py)
    "harmony": (harmony.TEMPLATE, harmony.SPECIAL_TOKENS, harmony.VARIABLES),
}
TEMPLATE_VARIABLES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# private-use marks around {% generation %}
_GEN_START, _GEN_END = "\ue000gen\ue001", "\ue000/gen\ue001"
# private-use marks around each string of the messages in a second render (text_spans), and the one put
# inside each special token they spell (its fallback)
_OPEN, _CLOSE, _DEFUSE = "\U000f0000", "\U000f0001", "\U000f0002"
_MARKS = re.compile(f"[{_OPEN}{_CLOSE}]")


@dataclass
class ChatTemplate:
    """A chat template and what it renders with: the Jinja text, the variables (bos_token, ...) and the
    special tokens it needs as single tokens."""

    # chatml | llama3 | harmony | the file it came from
    name: str
    text: str
    # bos_token, eos_token, ...: the tokenizer's special tokens, as transformers
    variables: dict[str, str]
    # must each be one token of the tokenizer (built-ins: added when missing)
    special_tokens: list[str]

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "template": self.text,
                "variables": self.variables,
                "special_tokens": self.special_tokens,
            },
            indent=2,
            ensure_ascii=False,
        )

    @property
    def compiled(self):
        if getattr(self, "_compiled", None) is None:
            self._compiled = compile_template(self.text, self.name)
        return self._compiled

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[tuple[int, int]]]:
        """(the text, the character spans of its {% generation %} blocks) for `messages`, rendered exactly
        as transformers' apply_chat_template(tokenize=False, tools=tools) renders them. tools: None takes
        the tools the conversation carries (gptkit.chat_formats.tools.Conversation)."""
        import jinja2

        if tools is None:
            tools = tools_of(messages)
        # a template without tool syntax would drop the tools or the calls without a word
        if tools and "tools" not in self.text:
            raise TemplateRenderError(
                "it has no tool syntax (it never reads tools), and the conversation has tools"
            )
        if "tool_calls" not in self.text and any(m.get("tool_calls") for m in messages):
            raise TemplateRenderError(
                "it has no tool syntax (it never reads tool_calls), and an assistant calls a tool"
            )
        try:
            out = self.compiled.render(
                messages=list(messages),
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except jinja2.TemplateError as exc:
            raise TemplateRenderError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
        except Exception as exc:  # noqa: BLE001 - a template may fail in any way on odd input
            raise TemplateRenderError(f"{type(exc).__name__}: {str(exc)[:160]}") from None
        spans, text, pos = [], [], 0
        while True:
            i = out.find(_GEN_START, pos)
            if i < 0:
                text.append(out[pos:])
                break
            j = out.find(_GEN_END, i)
            text.append(out[pos:i])
            start = sum(map(len, text))
            body = out[i + len(_GEN_START) : j]
            text.append(body)
            spans.append((start, start + len(body)))
            pos = j + len(_GEN_END)
        return "".join(text), spans

    def reply_reader(self, tokenizer):
        """What reads a reply's ids as the model writes them: which are text to show, and the assistant's
        message they make (harmony's: the final channel shown, its analysis the message's thinking; any
        other template: every id is the reply's text)."""
        return harmony.ReplyReader(tokenizer) if self.text == harmony.TEMPLATE else PlainReply()

    def reply_text(self, tokenizer, ids: list[int]) -> str:
        """The text a reply's ids show (what the reply reader streams; serve's chat replies)."""
        reader = self.reply_reader(tokenizer)
        shown = [t for t in ids if reader.shows(t)]
        return reader.message(ids, tokenizer.decode(shown))["content"]

    def call_syntax(self) -> tool_syntax.CallSyntax | None:
        """How this template writes a tool call, learned by rendering one (gptkit/chat_formats/
        tool_syntax.py); None when it writes none that reads back (no tool syntax; harmony's channels)."""
        if "_call_syntax" not in self.__dict__:
            found = None
            if "tool_calls" in self.text and self.text != harmony.TEMPLATE:
                found = tool_syntax.learn(
                    lambda msgs, gen, tools: self.render(msgs, gen, tools)[0], self.end_of_turn()
                )
            self.__dict__["_call_syntax"] = found
        return self.__dict__["_call_syntax"]

    def end_of_turn(self) -> str:
        """What the template writes after an assistant's text (e.g. '<|im_end|>\\n'): where a reply ends."""
        probe = "\ue002"
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}]
        text, _ = self.render(msgs)
        return text[text.rindex(probe) + 1 :] if probe in text else ""


class PlainReply:
    """A reply whose every id is its text (every template but harmony)."""

    def shows(self, tok: int) -> bool:
        return True

    def message(self, ids: list[int], shown: str) -> dict[str, Any]:
        return {"role": "assistant", "content": shown}


class TemplateRenderError(GptkitError):
    """A template that raised while rendering (the caller adds the file and row)."""


def compile_template(text: str, name: str):
    """The template compiled as transformers compiles chat templates: a sandboxed Jinja environment with
    trim_blocks and lstrip_blocks, loop controls, the {% generation %} tag, and raise_exception,
    strftime_now, a tojson that keeps non-ASCII characters, dict and namespace."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _GEN_START + caller() + _GEN_END

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda f: datetime.now().strftime(f),
        dict=dict,
        namespace=jinja2.utils.Namespace,
    )
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise GptkitError(
            f"the chat template {name} is not valid Jinja (line {exc.lineno}: {exc.message})"
        ) from None


def _template_from_hf_config(d: dict[str, Any], source: Path) -> str | None:
    t = d.get("chat_template")
    if isinstance(t, list):  # [{name, template}, ...]: the default one
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    if t is not None and not isinstance(t, str):
        raise GptkitError(f"{source}: chat_template is neither a string nor a list of named templates")
    return t


def _variables(d: dict[str, Any]) -> dict[str, str]:
    out = {}
    for k in TEMPLATE_VARIABLES:
        v = d.get(k)
        # an AddedToken written out: {"content": ..., ...}
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[k] = v
    return out


def template_in_folder(folder: Path) -> ChatTemplate | None:
    """The chat template saved in a folder: a gptkit run's chat.json, else a transformers folder's
    chat_template.jinja or tokenizer_config.json chat_template (with its special tokens as variables)."""
    if (folder / CHAT_FILE).is_file():
        return load_template_file(folder / CHAT_FILE)
    cfg_file = folder / "tokenizer_config.json"
    d: dict[str, Any] = {}
    if cfg_file.is_file():
        try:
            d = json.loads(cfg_file.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise GptkitError(f"{cfg_file} is not valid JSON ({exc})") from None
    if (folder / "chat_template.jinja").is_file():
        return ChatTemplate(
            str(folder / "chat_template.jinja"),
            (folder / "chat_template.jinja").read_text(),
            _variables(d),
            [],
        )
    text = _template_from_hf_config(d, cfg_file) if d else None
    return ChatTemplate(str(cfg_file), text, _variables(d), []) if text else None


def load_template_file(path: Path) -> ChatTemplate:
    """A template from a file: chat.json (gptkit), tokenizer_config.json (transformers) or a .jinja text."""
    if not path.is_file():
        raise GptkitError(
            f"data.template={path}: no such file; use auto, {', '.join(BUILTIN)} or a .jinja file"
        )
    if path.suffix == ".json":
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise GptkitError(f"{path} is not valid JSON ({exc})") from None
        if not isinstance(d, dict):
            raise GptkitError(f"{path} holds no chat template (not a JSON object)")
        if path.name == CHAT_FILE and isinstance(d.get("template"), str):
            return ChatTemplate(
                str(d.get("name") or path),
                d["template"],
                dict(d.get("variables") or {}),
                list(d.get("special_tokens") or []),
            )
        text = _template_from_hf_config(d, path)
        if not text:
            raise GptkitError(f"{path} has no chat_template")
        return ChatTemplate(str(path), text, _variables(d), [])
    return ChatTemplate(str(path), path.read_text(encoding="utf-8"), {}, [])


class NoChatTemplate(GptkitError):
    """data.template=auto found no template: `where` it looked (in words), `folder` the folder it read (None:
    a tokenizer built here), `what` it looked for. A caller that knows where the tokenizer came from
    (init_from=: copied from the source run) raises another naming that."""

    def __init__(self, where: str, folder: Path | None, what: str | None = None) -> None:
        what = what or f"a run's {CHAT_FILE}, or tokenizer_config.json's chat_template"
        super().__init__(
            f"data.template=auto found no chat template {where} ({what}); choose one: data.template=chatml, "
            "data.template=llama3 or data.template=<file.jinja>"
        )
        self.folder = folder


def resolve_template(spec: str, tokenizer_path: str | None) -> ChatTemplate:
    """data.template as a ChatTemplate: auto (the template saved next to the tokenizer), a built-in name, or
    a file."""
    spec = str(spec)
    if spec in BUILTIN:
        text, special, variables = BUILTIN[spec]
        return ChatTemplate(spec, text, dict(variables), list(special))
    if spec == "auto":
        folder = Path(tokenizer_path).parent if tokenizer_path else None
        found = template_in_folder(folder) if folder is not None else None
        if found is None:
            where = f"next to {tokenizer_path}" if tokenizer_path else "for a tokenizer built here"
            raise NoChatTemplate(where, folder)
        return found
    return load_template_file(Path(spec).expanduser())


def add_special_tokens(tokenizer, template: ChatTemplate) -> list[str]:
    """Add the template's special tokens the tokenizer lacks (as special tokens, after its vocabulary);
    returns those added."""
    missing = [t for t in template.special_tokens if tokenizer.token_to_id(t) is None]
    if missing:
        tokenizer.add_special_tokens(missing)
    return missing


def check_special_tokens(tokenizer, template: ChatTemplate, what: str) -> None:
    """Each of the template's special tokens must be one token of `tokenizer` (else GptkitError)."""
    lacking = [t for t in template.special_tokens if tokenizer.token_to_id(t) is None]
    if lacking:
        raise GptkitError(
            f"{what}'s tokenizer lacks the special tokens of the chat template "
            f"{template.name}: {', '.join(lacking)}; train with data=chat "
            f"data.template={template.name} (which adds them) or choose the template the run "
            "was trained with"
        )


# end-of-text spellings a reply also stops at (besides the run's own eos_token)
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>")


def reply_stop_ids(tokenizer, template: ChatTemplate, eos_token: str | None = None) -> list[int]:
    """The ids that end an assistant's reply, the template's end-of-turn token first (e.g. <|im_end|>), then
    the end-of-text tokens the tokenizer has (the run's eos_token, then the usual spellings): what `gptkit
    chat` and `gptkit serve` stop at, and what export writes as generation_config.json's eos_token_id."""
    end = template.end_of_turn().strip()
    names = ([end] if end else []) + ([eos_token] if eos_token else []) + list(END_OF_TEXT)
    ids = [tokenizer.token_to_id(t) for t in names]
    return list(dict.fromkeys(i for i in ids if i is not None))


def assistant_spans(
    template: ChatTemplate, msgs: list[dict[str, Any]], where: str
) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans of the assistant's turns) of one conversation."""
    # the conversation's tools, in every render of a part of it
    tools = tools_of(msgs)
    try:
        text, spans = template.render(msgs, tools=tools)
        # the template marks them itself ({% generation %})
        if spans:
            return text, spans
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before, _ = template.render(msgs[:i], add_generation_prompt=True, tools=tools)
            upto, _ = template.render(msgs[: i + 1], tools=tools)
            if not (text.startswith(before) and text.startswith(upto) and len(upto) >= len(before)):
                raise GptkitError(
                    f"{where}: the chat template {template.name} renders the turns before "
                    f"assistant message {i + 1} differently in the whole conversation, so its "
                    "tokens cannot be told apart; use data.train_on=all or a template with "
                    f"{{% generation %}} blocks"
                )
            spans.append((len(before), len(upto)))
    except TemplateRenderError as exc:
        raise GptkitError(f"{where}: the chat template {template.name} failed to render: {exc}") from None
    return text, spans


def encode(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(ids, mask): the text's token ids as transformers' apply_chat_template makes them (no special tokens
    added around it; special tokens matched anywhere, also in what the messages say: encode_conversation
    keeps those text) and 1 for every token overlapping an assistant span."""
    enc = tokenizer.encode(text, add_special_tokens=False)
    return enc.ids, _mask(enc.offsets, spans)


def _mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token (its character offsets, in order) that overlaps one of the spans, else 0."""
    mask = [0] * len(offsets)
    k = 0
    for t, (a, b) in enumerate(offsets):
        while k < len(spans) and a >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if b > spans[k][0]:
            mask[t] = 1
    return mask


def encode_conversation(
    tokenizer,
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    where: str = "the conversation",
    *,
    add_generation_prompt: bool = False,
    rendered: tuple[str, list[tuple[int, int]]] | None = None,
    last_turn_only: bool = False,
    allow_special_text: bool = False,
    prefix: bool = False,
) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation: rendered with the template (assistant_spans; with
    add_generation_prompt, render's text and its {% generation %} spans; `rendered`: that render, when the
    caller has it), tokenized without special tokens added around it, 1 in the mask for every token
    overlapping an assistant span (last_turn_only: the last one).

    Text is data: a special token that the messages' own text spells (content, or any other string in a
    message but its role) is encoded as text, as HF's split_special_tokens encodes it; only the template's
    markup yields special ids. The ids are those of encoding the whole text (`encode`, transformers' ids)
    unless a special token found there overlaps the messages' text; then the text is encoded again in
    stretches between the markup's special tokens, each with special tokens split (each stretch on its own,
    as HF encodes the text between added tokens; a pre-tokenizer that treats only a text's start apart, e.g.
    Metaspace's prepend_scheme=first, treats each stretch's start so). Where the messages' text lies comes
    from text_spans (exact; its fallback and its one error are described there). Added tokens that are not
    special (vocabulary words) are matched as always. allow_special_text=True: the whole text encoded as
    before (spelled special tokens become control tokens: data.special_tokens_in_content=allow). prefix:
    `rendered`'s text is only the start of the conversation's render (a row longer than any training row,
    cut before it is encoded: gptkit.data.chat.RowLimit), and where the messages' text lies is found in that
    start."""
    if rendered is None:
        if add_generation_prompt:
            try:
                rendered = template.render(messages, add_generation_prompt=True)
            except TemplateRenderError as exc:
                raise GptkitError(
                    f"{where}: the chat template {template.name} failed to render: {exc}"
                ) from None
        else:
            rendered = assistant_spans(template, messages, where)
    text, spans = rendered
    if last_turn_only:
        spans = spans[-1:]
    enc = tokenizer.encode(text, add_special_tokens=False)
    ids, offsets = enc.ids, enc.offsets
    specials = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    if allow_special_text or not any(i in specials for i in ids):
        return ids, _mask(offsets, spans)
    data = text_spans(
        template, messages, text, add_generation_prompt, list(specials.values()), where, prefix=prefix
    )
    if any(i in specials and _overlaps(offsets[t], data) for t, i in enumerate(ids)):
        ids, offsets = _encode_markup_apart(tokenizer, text, data, set(specials))
    return ids, _mask(offsets, spans)


def _overlaps(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    a, b = span
    return any(a < d and c < b for c, d in spans)


def text_spans(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    text: str,
    add_generation_prompt: bool,
    specials: list[str],
    where: str,
    prefix: bool = False,
) -> list[tuple[int, int]]:
    """The character spans of `text` (the messages rendered) that the messages' own strings (all but the
    role, nested ones too) make, so that special tokens there are told from the template's markup.

    Exact: the messages rendered again with private-use marks around each string (or, for a template that
    trims them, e.g. llama3's `| trim`, around each without its outer whitespace) give `text` once the marks
    are taken out; the marks are where each string lies, as the template placed it (copied, escaped by
    tojson, ...). A template that changes the strings otherwise (cuts, splits, compares them: Qwen3's
    `content.split('</think>')`) fails that check; the fallback then renders once more with a mark inside
    each special token that the strings spell, and protects those where the marks land (exact for the
    spelled tokens; a template that makes a special token out of other text, e.g. by changing its case,
    is not caught there). Strings that spell no special token need neither (no span). A template that
    changes even the spelled tokens (the text differs without the marks), or strings that hold the marks
    themselves: a GptkitError naming `where` (nothing is encoded). prefix: `text` is only the start of the
    render; the spans are those within it."""

    def same(out: str) -> bool:
        return out.startswith(text) if prefix else out == text

    def within(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(a, min(b, len(text))) for a, b in spans if a < len(text)] if prefix else spans

    tools = tools_of(messages)

    def with_strings(f) -> list[dict[str, Any]]:
        return [{k: v if k == "role" else _map_strings(v, f) for k, v in m.items()} for m in messages]

    def again(msgs, f) -> str | None:
        # the tools' strings (names, descriptions, the schemas' texts) are marked too: data as the messages'
        marked = [{**t, "function": _map_strings(t["function"], f)} for t in tools] if tools else None
        try:
            return template.render(msgs, add_generation_prompt, tools=marked)[0]
        # the template refuses the marked strings: the next way
        except TemplateRenderError:
            return None

    if _OPEN not in text and _CLOSE not in text:
        for strip in (False, True):
            wrap = lambda v, strip=strip: _wrap(v, strip)  # noqa: E731
            out = again(with_strings(wrap), wrap)
            found = _unmark(out) if out is not None else None
            if found is not None and same(found[0]):
                return within(found[1])
    spelled = []
    with_strings(lambda v: spelled.append(v) or v)
    _map_strings(tools or [], lambda v: spelled.append(v) or v)
    if not any(t in v for v in spelled for t in specials if t):
        # no string spells a special token: nothing to protect
        return []
    if _DEFUSE not in text:
        defuse = lambda v: _defuse(v, specials)  # noqa: E731
        out = again(with_strings(defuse), defuse)
        if out is not None and same(out.replace(_DEFUSE, "")):
            spans = []
            for k, j in enumerate(m.start() for m in re.finditer(_DEFUSE, out)):
                # the mark follows the first character of a spelled token
                at = j - k - 1
                longest = max((len(t) for t in specials if text.startswith(t, at)), default=1)
                spans.append((at, at + longest))
            return within(spans)
    raise GptkitError(
        f"{where}: the chat template {template.name} changes what the messages say in a way that hides "
        "where their text lies, so the special tokens it spells cannot be kept text; remove them from "
        "the messages, or let them be control tokens with special_tokens_in_content=allow"
    )


def _map_strings(v: Any, f, all_keys: bool = False, these_keys: bool = False) -> Any:
    """v with f applied to every string in it (in lists and dicts too). Keys are the template's to read,
    except what a user wrote as keys: a tool call's `arguments` (every key in it) and a schema's
    `properties` (the property names) are data too."""
    if isinstance(v, str):
        return f(v)
    if isinstance(v, list):
        return [_map_strings(x, f, all_keys) for x in v]
    if isinstance(v, dict):
        return {
            f(k) if (all_keys or these_keys) and isinstance(k, str) else k: _map_strings(
                x, f, all_keys or k == "arguments", not all_keys and k == "properties"
            )
            for k, x in v.items()
        }
    return v


def _wrap(v: str, strip: bool) -> str:
    """v between the marks (strip: the marks inside its outer whitespace, which a trim removes)."""
    if not strip:
        return _OPEN + v + _CLOSE
    core = v.strip()
    lead = v[: len(v) - len(v.lstrip())] if core else v
    return lead + _OPEN + core + _CLOSE + v[len(lead) + len(core) :]


def _unmark(out: str) -> tuple[str, list[tuple[int, int]]] | None:
    """(out without the marks, the spans they enclosed), or None when they do not pair up."""
    spans: list[tuple[int, int]] = []
    # marks seen so far, where the open span starts (in the text without them)
    n, start = 0, None
    for m in _MARKS.finditer(out):
        i, c = m.start(), m.group()
        if (c == _OPEN) != (start is None):
            return None
        if c == _OPEN:
            start = i - n
        else:
            spans.append((start, i - n))
            start = None
        n += 1
    if start is not None:
        return None
    return out.replace(_OPEN, "").replace(_CLOSE, ""), spans


def _defuse(v: str, specials: list[str]) -> str:
    """v with a mark after the first character of every special token it spells."""
    starts = {i for s in specials if s for i in _find_all(v, s)}
    return "".join(c + _DEFUSE if i in starts else c for i, c in enumerate(v)) if starts else v


def _find_all(v: str, s: str):
    i = v.find(s)
    while i != -1:
        yield i
        i = v.find(s, i + 1)


def _encode_markup_apart(
    tokenizer, text: str, data: list[tuple[int, int]], special_ids: set[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, offsets) of `text` with special tokens matched only in the template's markup (outside the
    `data` spans: each stretch of markup encoded on its own, its special tokens kept), the text between
    those encoded with special tokens split."""
    marks: list[tuple[int, int, int]] = []
    pos = 0
    for a, b in [*sorted(data), (len(text), len(text))]:
        if a > pos:
            enc = tokenizer.encode(text[pos:a], add_special_tokens=False)
            marks += [(pos + x, pos + y, i) for i, (x, y) in zip(enc.ids, enc.offsets) if i in special_ids]
        pos = max(pos, b)
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    before = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        pos = 0
        for a, b, i in [*marks, (len(text), len(text), None)]:
            if a > pos:
                enc = tokenizer.encode(text[pos:a], add_special_tokens=False)
                ids += enc.ids
                offsets += [(pos + x, pos + y) for x, y in enc.offsets]
            if i is not None:
                ids.append(i)
                offsets.append((a, b))
            pos = b
    finally:
        tokenizer.encode_special_tokens = before
    return ids, offsets


def encode_text(tokenizer, text: str) -> list[int]:
    """The ids of plain text: a special token it spells is encoded as its characters (HF's
    split_special_tokens), never as the control id (a prompt, a line of a corpus: text is data)."""
    before = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        return tokenizer.encode(text, add_special_tokens=False).ids
    finally:
        tokenizer.encode_special_tokens = before
