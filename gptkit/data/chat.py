"""Chat / instruction data (data=chat): conversations rendered with a chat template, loss on the assistant's
tokens.

    records (jsonl / json / parquet)  messages: [{role, content}, ...]   or   prompt + response (+ system)
      -> checked (roles, an assistant turn, file and row named in every error)
      -> rendered with a chat template (Jinja, as transformers' apply_chat_template renders it)
      -> token ids + an assistant mask per token, cached (ChatData)
      -> rows of seq_len + 1 tokens: packed (data.pack=documents, with doc_ids) or one per row (pad)
      -> batches (x, y[, doc_ids]) whose targets are -100 outside the assistant's turns
         (data.train_on=assistant)

Templates (data.template): `auto` takes the template saved with the tokenizer (a run's chat.json, or the
chat_template of a transformers folder's tokenizer_config.json / chat_template.jinja); `chatml` and `llama3`
are built in, and their special tokens are added to a tokenizer that lacks them; any other value is a file
(.jinja, or a tokenizer_config.json / chat.json holding one).

The assistant's tokens are found as transformers finds them: from `{% generation %}` blocks when the template
has them; otherwise, for each assistant turn, as the text between the conversation rendered up to that turn
with the generation prompt and rendered with the turn (so the end-of-turn token, e.g. <|im_end|>, is learned).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gptkit.data.build import cache_root, remove_stale_builds
from gptkit.data.sources import expand_paths
from gptkit.errors import GptkitError
from gptkit.fsio import DIR_MODE
from gptkit.tokenizer import build_tokenizer, load_tokenizer_file, tokenizer_settings, tokenizer_sha256

# jinja2, pyarrow and torch are imported where a template is rendered or a batch made.

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("assistant", "all")
PACKS = ("documents", "pad")
TRUNCATE = ("drop", "cut")
# in a run folder (and a prepared chat folder): the template the run was trained with
CHAT_FILE = "chat.json"
FORMAT = "gptkit-chat"
FORMAT_VERSION = 1

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

DEFAULTS: dict[str, Any] = {
    "paths": None,
    "val_paths": None,
    "val_fraction": 0.1,
    "format": "auto",
    "messages_field": "messages",
    "prompt_field": "prompt",
    "response_field": "response",
    "system_field": "system",
    "template": "auto",
    "train_on": "assistant",
    "pack": "documents",
    "truncate": "drop",
}
# how rows are made from the tokens: no part of the cache key
ROW_KEYS = ("train_on", "pack", "truncate")


# ---- templates ------------------------------------------------------------------------------------------
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


def resolve_template(spec: str, tokenizer_path: str | None) -> ChatTemplate:
    """data.template as a ChatTemplate: auto (the template saved next to the tokenizer), a built-in name, or
    a file."""
    spec = str(spec)
    if spec in BUILTIN:
        text, special, variables = BUILTIN[spec]
        return ChatTemplate(spec, text, dict(variables), list(special))
    if spec == "auto":
        found = template_in_folder(Path(tokenizer_path).parent) if tokenizer_path else None
        if found is None:
            where = f"next to {tokenizer_path}" if tokenizer_path else "for a tokenizer built here"
            raise GptkitError(
                f"data.template=auto found no chat template {where} (a run's {CHAT_FILE}, or "
                f"tokenizer_config.json's chat_template); choose one: data.template=chatml, "
                f"data.template=llama3 or data.template=<file.jinja>"
            )
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


# ---- conversations ---------------------------------------------------------------------------------------
def _records(f: Path, fmt: str) -> Iterator[tuple[str, Any]]:
    """(where, record) for every record of a jsonl / json / parquet file; where names the file and the line
    (jsonl), record (json) or row (parquet)."""
    if fmt == "auto":
        fmt = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}.get(f.suffix.lower(), "")
        if not fmt:
            raise GptkitError(f"{f}: data=chat reads .jsonl, .json and .parquet files (or set data.format)")
    if fmt == "jsonl":
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield f"{f} line {n}", json.loads(line)
                    except ValueError as exc:
                        raise GptkitError(f"{f} line {n} is not valid JSON ({exc})") from None
    elif fmt == "json":
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise GptkitError(f"{f} is not valid JSON ({exc})") from None
        if not isinstance(data, list):
            raise GptkitError(
                f"{f}: a .json file for data=chat holds a list of records (use .jsonl for one per line)"
            )
        for n, rec in enumerate(data, 1):
            yield f"{f} record {n}", rec
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        for n, rec in enumerate(pq.read_table(f).to_pylist(), 1):
            yield f"{f} row {n}", rec
    else:
        raise GptkitError(f"data.format={fmt!r} must be auto, jsonl, json or parquet")


def conversation(rec: Any, where: str, s: dict[str, Any]) -> list[dict[str, Any]]:
    """A record as a checked list of messages (role, content); GptkitError naming `where` otherwise."""
    if not isinstance(rec, dict):
        raise GptkitError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    mf, pf, rf, sf = s["messages_field"], s["prompt_field"], s["response_field"], s["system_field"]
    if mf in rec:
        msgs = rec[mf]
        if not isinstance(msgs, list):
            raise GptkitError(
                f"{where}: {mf} must be a list of {{role, content}} messages, got {type(msgs).__name__}"
            )
    elif pf in rec and rf in rec:
        msgs = ([{"role": "system", "content": rec[sf]}] if rec.get(sf) else []) + [
            {"role": "user", "content": rec[pf]},
            {"role": "assistant", "content": rec[rf]},
        ]
    else:
        raise GptkitError(
            f"{where}: a record needs a {mf} list or {pf} and {rf} fields "
            "(data.messages_field, data.prompt_field, data.response_field); it has "
            f"{', '.join(map(str, rec)) or 'none'}"
        )
    if not msgs:
        raise GptkitError(f"{where}: the conversation is empty")
    out = []
    for i, m in enumerate(msgs, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise GptkitError(f"{where}: message {i} must be an object with role and content")
        if m["role"] not in ROLES:
            raise GptkitError(
                f"{where}: message {i} has the unknown role {m['role']!r}; roles are {', '.join(ROLES)}"
            )
        if not isinstance(m["content"], str):
            raise GptkitError(
                f"{where}: message {i} ({m['role']}) has content of type "
                f"{type(m['content']).__name__}; content must be text"
            )
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        raise GptkitError(
            f"{where}: the conversation has no assistant turn, so nothing in it would be learned"
        )
    return out


def read_conversations(files: list[Path], s: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Every conversation of the files as (file:row, messages), checked; none at all is an error."""
    out = [(where, conversation(rec, where, s)) for f in files for where, rec in _records(f, s["format"])]
    if not out:
        raise GptkitError(f"{', '.join(map(str, files))}: no conversations")
    return out


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


# ---- the prepared (cached) form --------------------------------------------------------------------------
@dataclass
class ChatSplit:
    """One split of prepared chat data: the tokens of every conversation, the loss mask, and the offsets."""

    ids: np.ndarray  # [n_tokens] every conversation's tokens, one after another
    mask: np.ndarray  # [n_tokens] uint8: 1 on the assistant's tokens
    offsets: np.ndarray  # [n_conversations + 1] where each conversation starts in ids

    @property
    def n(self) -> int:
        return len(self.offsets) - 1


@dataclass
class TemplatedData:
    """What train reads of a prepared data=chat or data=preference folder, as of a PreparedData: dir,
    manifest, vocab_size, eos_id, pad_id, tokenizer_path and the chat template's template_path."""

    dir: Path
    manifest: dict[str, Any]
    # the data config (train_on, pack, truncate, ...)
    settings: dict[str, Any]

    @property
    def tokenizer_path(self) -> Path:
        return self.dir / "tokenizer.json"

    @property
    def template_path(self) -> Path:
        return self.dir / CHAT_FILE

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int | None:
        return self.manifest["tokenizer"].get("eos_id")

    @property
    def pad_id(self) -> int:
        return int(self.manifest["tokenizer"]["pad_id"])

    def wait_checked(self) -> None:
        """Nothing runs in the background here (the shards are read whole when loaded)."""

    def tokenizer(self):
        return load_tokenizer_file(self.tokenizer_path)


@dataclass
class ChatData(TemplatedData):
    """Tokenized conversations (train and val), their tokenizer and template: what data=chat prepares."""

    train: ChatSplit
    val: ChatSplit


def chat_settings(cfg: Any) -> dict[str, Any]:
    """data=chat's settings as a complete plain dict, checked."""
    from omegaconf import DictConfig, OmegaConf

    d = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    s = {**DEFAULTS, **d, "kind": "chat"}
    for key, allowed in (("train_on", TRAIN_ON), ("pack", PACKS), ("truncate", TRUNCATE)):
        if s[key] not in allowed:
            raise GptkitError(f"data.{key}={s[key]!r} is not one of {', '.join(allowed)}")
    if not s["paths"]:
        raise GptkitError(
            "data=chat needs data.paths=[conversations.jsonl,...] (jsonl, json or parquet files)"
        )
    if s["val_paths"] is None and not 0.0 < float(s["val_fraction"]) < 1.0:
        raise GptkitError(f"data.val_fraction={s['val_fraction']} must be between 0 and 1 (exclusive)")
    return s


def _file_hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.resolve()).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)


def prepare_chat(
    data_cfg: Any, tokenizer_cfg: Any, cache_dir: str | Path | None = None, force: bool = False
) -> ChatData:
    """Conversations -> token ids + assistant masks (train and val), the tokenizer (with the template's
    special tokens) and the template, cached by (files, settings, tokenizer, template). Every bad record is
    a one-line GptkitError naming its file and row, raised before anything is written."""
    s = chat_settings(data_cfg)
    tok_s = tokenizer_settings(tokenizer_cfg)
    train_files = expand_paths(s["paths"], "data.paths")
    val_files = expand_paths(s["val_paths"], "data.val_paths") if s["val_paths"] else []
    template = resolve_template(s["template"], tok_s.get("path") if tok_s["kind"] == "file" else None)
    template.compiled  # noqa: B018 - a template that is not Jinja fails before the files are read
    root, final, key, content = cache_folder(
        "chat", s, ROW_KEYS, FORMAT_VERSION, tok_s, template, train_files + val_files, cache_dir, force
    )
    if (final / "manifest.json").is_file():
        data = load_chat(final, s)
        _say(f"cache hit: {final} ({_counts(data.manifest)})")
        return data

    convs = read_conversations(train_files, s)
    val_convs = read_conversations(val_files, s) if val_files else []
    rendered = [(where, *assistant_spans(template, m, where)) for where, m in convs + val_convs]
    if tok_s["kind"] in ("char", "bpe"):
        tokenizer = build_tokenizer(tok_s, lambda: (text for _, text, _ in rendered), progress=False)
    else:
        tokenizer = build_tokenizer(tok_s)
    added = add_special_tokens(tokenizer, template)
    encoded = [encode(tokenizer, text, spans) for _, text, spans in rendered]
    for (where, _, spans), (_, mask) in zip(rendered, encoded):
        if spans and not any(mask):
            raise GptkitError(f"{where}: the assistant's text renders to no tokens")
    n_train = len(convs)
    # the last val_fraction of the conversations (at least one each)
    if not val_files:
        n_train = min(n_train - 1, max(1, round(n_train * (1 - float(s["val_fraction"])))))
        if n_train < 1:
            raise GptkitError(
                f"data.paths hold {len(convs)} conversation(s); data=chat needs at least 2 "
                "(one for validation) or data.val_paths"
            )
    splits = {"train": encoded[:n_train], "val": encoded[n_train:]}
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "cache_key": key,
        "source": {
            "kind": "chat",
            "description": "chat conversations from "
            f"{', '.join(map(str, train_files))}"
            + (f" (val: {', '.join(map(str, val_files))})" if val_files else ""),
            "sha256": content,
        },
        "template": template.name,
        "added_tokens": added,
        "tokenizer": tokenizer_record(tokenizer, tok_s, template),
        "splits": {
            k: {
                "conversations": len(v),
                "tokens": sum(len(ids) for ids, _ in v),
                "loss_tokens": sum(sum(m) for _, m in v),
            }
            for k, v in splits.items()
        },
    }
    arrays = {}
    for k, v in splits.items():
        arrays[f"{k}_ids"] = np.array([t for ids, _ in v for t in ids], dtype=np.uint32)
        arrays[f"{k}_mask"] = np.array([t for _, m in v for t in m], dtype=np.uint8)
        arrays[f"{k}_offsets"] = np.cumsum([0] + [len(ids) for ids, _ in v], dtype=np.int64)
    publish_folder(root, final, {"conversations.npz": arrays}, tokenizer, template, manifest)
    data = load_chat(final, s)
    note = f"; added {', '.join(added)} to the tokenizer" if added else ""
    _say(f"prepared {final} ({_counts(manifest)}{note})")
    return data


def cache_folder(
    prefix: str,
    s: dict[str, Any],
    row_keys,
    format_version: int,
    tok_s: dict[str, Any],
    template,
    files: list[Path],
    cache_dir,
    force: bool,
) -> tuple[Path, Path, str, str]:
    """(cache root, folder, cache key, content hash) of a chat or preference build, keyed by the files'
    content, the settings but those that only choose rows (row_keys), the tokenizer (a tokenizer.json's
    content too), the template and the format; force=true removes a cached folder first."""
    from gptkit.tokenizer import file_sha256

    content = _file_hash(files)
    cache_s = {k: v for k, v in s.items() if k not in row_keys}
    key_src = json.dumps(
        [cache_s, content, tok_s, template.text, template.variables, format_version],
        sort_keys=True,
        default=str,
    )
    if tok_s["kind"] == "file":
        key_src += file_sha256(tok_s["path"])
    key = hashlib.sha256(key_src.encode()).hexdigest()
    root = cache_root(cache_dir)
    final = root / f"{prefix}-{tok_s['kind']}-{key[:16]}"
    if final.exists() and force:
        shutil.rmtree(final)
    return root, final, key, content


def tokenizer_record(tokenizer, tok_s: dict[str, Any], template) -> dict[str, Any]:
    """The manifest's tokenizer entry of a chat or preference folder: its settings, size, hash, and the ids
    of EOS, padding (EOS, else 0) and the template's end of turn."""
    eos = tok_s.get("eos_token")
    eos_id = tokenizer.token_to_id(eos) if eos else None
    end = template.end_of_turn().strip()
    return {
        **tok_s,
        "vocab_size": tokenizer.get_vocab_size(),
        "sha256": tokenizer_sha256(tokenizer),
        "eos_id": eos_id,
        "pad_id": eos_id if eos_id is not None else 0,
        "end_of_turn": end,
        "end_of_turn_id": tokenizer.token_to_id(end) if end else None,
    }


def publish_folder(
    root: Path,
    final: Path,
    arrays: dict[str, dict[str, Any]],
    tokenizer,
    template,
    manifest: dict[str, Any],
    extra: dict[str, str] | None = None,
) -> None:
    """Write a chat or preference folder atomically: its .npz files ({file name: arrays}), `extra` text files,
    tokenizer.json, the template and manifest.json (last) into a temporary folder beside `final`, then renamed
    into place. A folder another process finished first is kept; any failure removes the temporary folder."""
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        for name, content in arrays.items():
            np.savez(tmp / name, **content)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        (tmp / "tokenizer.json").write_text(tokenizer.to_str())
        (tmp / CHAT_FILE).write_text(template.to_json())
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False))
        os.chmod(tmp, DIR_MODE)
        try:
            os.rename(tmp, final)
        # another process finished the same folder first: keep theirs
        except OSError:
            if not (final / "manifest.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _counts(m: dict[str, Any]) -> str:
    tr, va = m["splits"]["train"], m["splits"]["val"]
    return (
        f"template {m['template']}: {tr['conversations']:,} train / {va['conversations']:,} val "
        f"conversations, {tr['tokens']:,} train tokens"
    )


def load_chat(folder: Path, settings: dict[str, Any]) -> ChatData:
    """A prepared chat folder (manifest.json + conversations.npz), checked against these settings."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        z = np.load(folder / "conversations.npz")
        splits = {k: ChatSplit(z[f"{k}_ids"], z[f"{k}_mask"], z[f"{k}_offsets"]) for k in ("train", "val")}
    except (OSError, ValueError, KeyError) as exc:
        raise GptkitError(
            f"{folder} is not a complete prepared chat folder ({exc}); delete it and train again"
        ) from None
    if manifest.get("format") != FORMAT:
        raise GptkitError(f"{folder / 'manifest.json'} is not a gptkit chat manifest; delete {folder}")
    return ChatData(folder, manifest, settings, splits["train"], splits["val"])


# ---- rows and batches ------------------------------------------------------------------------------------
@dataclass
class ChatRows:
    """Training rows: x, y [N, seq_len] int64 (y = -100 where no loss), doc_ids [N, seq_len] int32
    (data.pack=documents)."""

    x: Any
    y: Any
    # None with data.pack=pad
    doc_ids: Any | None
    # conversations longer than a row, cut (data.truncate=cut)
    cut: int
    # conversations longer than a row, left out (drop; or cut before any assistant token)
    dropped: int
    conversations: int

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def loss_share(self) -> float:
        return float((self.y != -100).float().mean()) if len(self) else 0.0

    def batch(self, rows):
        out = (self.x[rows], self.y[rows])
        return out if self.doc_ids is None else (*out, self.doc_ids[rows])


def make_rows(
    split: ChatSplit, seq_len: int, pack: str, train_on: str, truncate: str, pad_id: int
) -> ChatRows:
    """Conversations as rows of seq_len + 1 tokens (inputs: the first seq_len, targets: the last seq_len).
    pack=documents fills each row with whole conversations in order (a conversation that does not fit starts
    the next row); pad puts one conversation in each row. The rest of a row is padding (pad_id, no loss, its
    own document). A conversation longer than a row is cut to it or dropped (truncate); one cut before any
    assistant token is dropped. A target carries loss when its token is the assistant's (train_on=assistant)
    or any token of the same conversation (all)."""
    import torch

    width = seq_len + 1
    rows_ids: list[np.ndarray] = []
    rows_mask: list[np.ndarray] = []
    rows_doc: list[np.ndarray] = []
    cur_ids: list[np.ndarray] = []
    cur_mask: list[np.ndarray] = []
    cur_doc: list[np.ndarray] = []
    used = cut = dropped = 0

    def close_row() -> None:
        nonlocal used
        if not cur_ids:
            return
        fill = width - used
        ids = np.concatenate(cur_ids + [np.full(fill, pad_id, dtype=np.int64)])
        mask = np.concatenate(cur_mask + [np.zeros(fill, dtype=np.uint8)])
        doc = np.concatenate(cur_doc + [np.full(fill, len(cur_doc), dtype=np.int32)])
        rows_ids.append(ids)
        rows_mask.append(mask)
        rows_doc.append(doc)
        cur_ids.clear()
        cur_mask.clear()
        cur_doc.clear()
        used = 0

    for i in range(split.n):
        a, b = int(split.offsets[i]), int(split.offsets[i + 1])
        ids, mask = split.ids[a:b].astype(np.int64), split.mask[a:b].copy()
        if train_on == "all":
            mask[:] = 1
        if len(ids) > width:
            if truncate == "drop":
                dropped += 1
                continue
            ids, mask = ids[:width], mask[:width]
            if not mask[1:].any():
                dropped += 1
                continue
            cut += 1
        if pack == "pad" or used + len(ids) > width:
            close_row()
        cur_ids.append(ids)
        cur_mask.append(mask)
        cur_doc.append(np.full(len(ids), len(cur_doc), dtype=np.int32))
        used += len(ids)
    close_row()
    if not rows_ids:
        raise GptkitError(
            f"every conversation is longer than a row of {width} tokens and data.truncate=drop "
            "left them all out; use data.truncate=cut or a longer trainer.seq_len / "
            "model.max_seq_len"
        )
    ids = torch.from_numpy(np.stack(rows_ids))  # [N, seq_len + 1]
    mask = torch.from_numpy(np.stack(rows_mask)).bool()  # [N, seq_len + 1]
    doc = torch.from_numpy(np.stack(rows_doc))  # [N, seq_len + 1]
    # a target in the same conversation as its input
    same_doc = doc[:, 1:] == doc[:, :-1]
    y = torch.where(mask[:, 1:] & same_doc, ids[:, 1:], torch.full_like(ids[:, 1:], -100))  # [N, seq_len]
    x = ids[:, :-1].contiguous()  # [N, seq_len]
    docs = doc[:, :-1].contiguous() if pack == "documents" else None
    return ChatRows(x, y.contiguous(), docs, cut, dropped, split.n)


class ChatSampler:
    """The rows of micro-step `step` are a pure function of (seed, step, rank, world_size), as WindowSampler's
    windows: a resumed run sees exactly the batches an uninterrupted one would."""

    def __init__(self, rows: ChatRows, batch_size: int, seed: int) -> None:
        self.rows, self.batch_size, self.seed = rows, int(batch_size), int(seed)

    def batch(self, step: int, rank: int = 0, world_size: int = 1):
        n = self.batch_size * world_size
        if n > len(self.rows):
            raise GptkitError(
                f"the chat data makes {len(self.rows)} training rows, fewer than a global "
                f"batch of {n}; give more conversations or a smaller trainer.batch_size"
            )
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, int(step)])))
        picked = rng.choice(len(self.rows), size=n, replace=False)  # [batch_size * world_size], distinct
        picked = picked[rank * self.batch_size : (rank + 1) * self.batch_size]
        return self.rows.batch(picked)


def describe_rows(train: ChatRows, val: ChatRows, seq_len: int, s: dict[str, Any]) -> str:
    """The start-up line: rows, the share of target positions that carry loss, conversations cut or
    dropped."""
    # train and val together
    cut, dropped = train.cut + val.cut, train.dropped + val.dropped
    lost = ([f"{cut} cut"] if cut else []) + ([f"{dropped} dropped"] if dropped else [])
    over = (
        f"; conversations longer than {seq_len + 1} tokens: {', '.join(lost)} (data.truncate={s['truncate']})"
        if lost
        else f"; no conversation is longer than {seq_len + 1} tokens"
    )
    return (
        f"chat data: {train.conversations:,} train conversations in {len(train):,} rows of {seq_len} "
        f"(data.pack={s['pack']}), {val.conversations:,} val in {len(val):,}; {train.loss_share():.1%} "
        f"of the train targets carry loss (data.train_on={s['train_on']}){over}"
    )
