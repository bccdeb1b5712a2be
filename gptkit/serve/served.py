"""What a server serves: one run's model behind an Engine, its tokenizer and chat template, and how a
request's text becomes ids.

    completion prompt   text -> ids as `gptkit sample` encodes it (gptkit.inference.generate.encode_prompt: a
                        special token the text spells stays text); or token ids as given
    chat messages       rendered with the run's chat template and the generation prompt, then encoded as
                        `gptkit chat` encodes them (gptkit.chat_templates.encode_conversation: message text
                        is data, only the template's markup yields control tokens)
    ends                completions: the end-of-text token (as `gptkit sample` eos=true); chat: the template's
                        end-of-turn token and the end-of-text tokens (chat_templates.reply_stop_ids)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from gptkit.chat_templates import (
    BUILTIN,
    ChatTemplate,
    check_special_tokens,
    encode_conversation,
    reply_stop_ids,
    resolve_template,
    template_in_folder,
)
from gptkit.errors import GptkitError
from gptkit.inference.decoding_layout import describe
from gptkit.inference.engine import Engine
from gptkit.inference.generate import encode_prompt, special_token_ids
from gptkit.inference.speculative import load_speculator
from gptkit.runs import load_for_inference
from gptkit.serve.protocol import ApiError, bad
from gptkit.serve.tokens import TokenTexts


@dataclass
class Served:
    # the id clients send as "model"
    name: str
    run_dir: Path
    checkpoint: Path
    tokenizer: object
    # None: completions only
    template: Optional[ChatTemplate]
    engine: Engine
    # model.max_seq_len
    context: int
    bos_id: Optional[int]
    eos_id: Optional[int]
    chat_stop: tuple[int, ...]
    allow_special_text: bool
    # unix time of the checkpoint (the model's "created")
    created: int
    n_params: int
    device: str
    dtype: str
    # each id's text and bytes (log-probs, a grammar's vocabulary)
    tokens: TokenTexts
    # the decode's matmuls in words (decoding_layout.describe, before the engine lays the weights out)
    matmuls: str = ""
    # response_format's grammar compiler, made at its first use (gptkit/serve/grammar.py)
    grammar: Optional[object] = None

    @property
    def has_chat(self) -> bool:
        return self.template is not None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def chat_text(self, ids: list[int]) -> str:
        """What a chat reply's ids show (the template's reply reader: harmony's final channel)."""
        return self.template.reply_text(self.tokenizer, ids)

    def call_text(self, syntax) -> Callable[[list[int]], str]:
        """chat_text that keeps the special tokens a tool call's markers spell (a tokenizer may have
        `<tool_call>` as a special token, which decoding drops): what a reply with tools is read from."""
        keep = {m for m in (syntax.prefix.strip(), syntax.suffix.strip()) if m}
        keep_ids = {i for i in self.tokens.special if self.tokenizer.id_to_token(i) in keep}
        if not keep_ids:
            return self.chat_text

        def decode(ids: list[int]) -> str:
            out, run = [], []
            for t in ids:
                if t in keep_ids:
                    out += [self.chat_text(run), self.tokenizer.id_to_token(t)]
                    run = []
                else:
                    run.append(t)
            return "".join(out) + self.chat_text(run)

        return decode

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            vocab = self.engine.model.cfg.vocab_size
            bad_id = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad_id is not None:
                raise bad(f"the prompt holds the token id {bad_id}, not one of 0..{vocab - 1}", "prompt")
            return list(prompt)
        try:
            return encode_prompt(
                self.tokenizer, prompt, self.bos_id, self.eos_id, allow_special_text=self.allow_special_text
            )
        except GptkitError as exc:
            raise bad(str(exc), "prompt", "invalid_value") from None

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The messages (a Conversation carries its tools) rendered with the generation prompt, as ids."""
        if self.template is None:
            raise ApiError(
                400,
                f"the model {self.name} has no chat template, so this server answers /v1/completions only "
                "(serve a run trained with data=chat, or give template=chatml|llama3|<file>)",
                "messages",
                "no_chat_template",
            )
        try:
            ids, _ = encode_conversation(
                self.tokenizer,
                self.template,
                messages,
                "the messages",
                add_generation_prompt=True,
                allow_special_text=self.allow_special_text,
            )
        except GptkitError as exc:
            raise bad(str(exc), "messages", "invalid_value") from None
        return ids

    def check_length(self, n_prompt: int, max_tokens: Optional[int], what: str) -> int:
        """The max_tokens to run: as asked, or what the context leaves; a 400 naming the context length when
        the prompt (and max_tokens) do not fit."""
        if n_prompt >= self.context:
            raise bad(
                f"This model's maximum context length is {self.context} tokens. However, your {what} "
                f"resulted in {n_prompt} tokens, which leaves no room for a completion; shorten it",
                what,
                "context_length_exceeded",
            )
        room = self.context - n_prompt
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise bad(
                f"This model's maximum context length is {self.context} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in the "
                f"completion). Please reduce the length of the {what} or the completion",
                "max_tokens",
                "context_length_exceeded",
            )
        return max_tokens


def load_served(
    run: str,
    *,
    name: Optional[str] = None,
    template: str = "auto",
    device: str = "auto",
    dtype: str = "fp32",
    attention: Optional[str] = None,
    max_batch: int = 16,
    max_queue: int = 64,
    allow_special_text: bool = False,
    quantize: Optional[str] = None,
    transform: Optional[Callable] = None,
    draft: Optional[str] = None,
    draft_k: Optional[int] = None,
    paging=None,
) -> Served:
    """Load a run and start its Engine. quantize: None or int8 | w8a8 | int4 | nf4, the block projections
    quantized as `sample quantize=` does (gptkit.quant). paging: the engine's
    gptkit.inference.block_pool.Paging (None: its defaults). transform(model) -> model runs once at load
    time, before the engine sees the model (any other load-time change)."""
    r = load_for_inference(run, device, dtype, attention, quantize)
    model = transform(r.model) if transform is not None else r.model
    tpl = None
    if template == "auto":
        tpl = template_in_folder(Path(r.dir))
    elif template not in (None, "none"):
        if template not in BUILTIN and not Path(str(template)).expanduser().is_file():
            raise GptkitError(
                f"template={template}: no such file; use auto, none, {', '.join(BUILTIN)} or a .jinja file"
            )
        tpl = resolve_template(str(template), None)
    if tpl is not None:
        check_special_tokens(r.tokenizer, tpl, f"the run {r.dir}")
        # a template that is not Jinja fails now, not at the first request
        tpl.compiled  # noqa: B018
    bos_id, eos_id = special_token_ids(r.tokenizer, r.config)
    eos_name = (r.config.get("tokenizer") or {}).get("eos_token")
    chat_stop = tuple(reply_stop_ids(r.tokenizer, tpl, eos_name)) if tpl is not None else ()
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise GptkitError(f"max_batch={max_batch!r} must be an integer >= 1")
    layout_rows = max_batch if model.lm_head.weight.device.type == "cpu" else None
    matmuls = describe(model)
    # draft=: speculative decoding, each sequence alone in a forward (gptkit/inference/speculative.py)
    speculate = load_speculator(draft, draft_k, r, device, dtype)
    engine = Engine(
        model,
        max_batch=max_batch,
        max_queue=max_queue,
        layout_rows=layout_rows,
        speculate=speculate,
        **({} if paging is None else {"paging": paging}),
    )
    ckpt = Path(r.checkpoint)
    return Served(
        name=name or Path(r.dir).resolve().name,
        run_dir=Path(r.dir),
        checkpoint=ckpt,
        tokenizer=r.tokenizer,
        template=tpl,
        engine=engine,
        context=model.cfg.max_seq_len,
        bos_id=bos_id,
        eos_id=eos_id,
        chat_stop=chat_stop,
        allow_special_text=allow_special_text,
        created=int(ckpt.stat().st_mtime) if ckpt.exists() else 0,
        n_params=model.num_parameters(),
        device=str(model.tok_emb.weight.device),
        dtype=str(model.tok_emb.weight.dtype).removeprefix("torch."),
        tokens=TokenTexts(r.tokenizer, model.cfg.vocab_size),
        matmuls=matmuls,
    )
