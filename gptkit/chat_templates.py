"""Chat templates: how a conversation becomes text, and that text token ids.

A template is Jinja, rendered as transformers' apply_chat_template renders it (a sandboxed environment,
trim_blocks and lstrip_blocks, `{% generation %}` blocks, raise_exception, strftime_now, tojson). Built in:
`chatml` and `llama3` (their special tokens are added to a tokenizer that lacks them); any other template
comes from a file (.jinja, a transformers tokenizer_config.json, or a gptkit run's chat.json) or from the
folder a tokenizer lies in (`auto`).

The assistant's tokens are found as transformers finds them: from `{% generation %}` blocks when the
template has them; otherwise, for each assistant turn, as the text between the conversation rendered up to
that turn with the generation prompt and rendered with the turn (so the end-of-turn token, e.g. <|im_end|>,
is learned).

Used by every room that talks in turns: data=chat and data=preference (gptkit.data), `gptkit chat`
(gptkit.generate), export and import (gptkit.hf).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

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


@dataclass
class ChatTemplate:
    """A chat template and what it renders with: the Jinja text, the variables (bos_token, ...) and the
    special tokens it needs as single tokens."""

    # chatml | llama3 | the file it came from
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
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """(the text, the character spans of its {% generation %} blocks) for `messages`, rendered exactly
        as transformers' apply_chat_template(tokenize=False) renders them."""
        import jinja2

        try:
            out = self.compiled.render(
                messages=messages,
                tools=None,
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

    def end_of_turn(self) -> str:
        """What the template writes after an assistant's text (e.g. '<|im_end|>\\n'): where a reply ends."""
        probe = "\ue002"
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}]
        text, _ = self.render(msgs)
        return text[text.rindex(probe) + 1 :] if probe in text else ""


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


def assistant_spans(
    template: ChatTemplate, msgs: list[dict[str, Any]], where: str
) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans of the assistant's turns) of one conversation."""
    try:
        text, spans = template.render(msgs)
        # the template marks them itself ({% generation %})
        if spans:
            return text, spans
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before, _ = template.render(msgs[:i], add_generation_prompt=True)
            upto, _ = template.render(msgs[: i + 1])
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
    added around it) and 1 for every token overlapping an assistant span."""
    enc = tokenizer.encode(text, add_special_tokens=False)
    mask = [0] * len(enc.ids)
    k = 0
    for t, (a, b) in enumerate(enc.offsets):
        while k < len(spans) and a >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if b > spans[k][0]:
            mask[t] = 1
    return enc.ids, mask
