"""Talk with a trained (or imported) run, turn by turn, in its chat template.

Each answer is streamed as it is generated; the KV cache is kept across turns, so a turn runs only its own
new tokens through the model (reuse_cache=false: the whole conversation again, every turn). Commands:
/reset forgets the conversation (the system prompt stays), /exit (or Ctrl-D) ends. Without a terminal,
every line of stdin is one user message and every answer is printed (format=json: one JSON object a line,
with its timings), so a chat can be scripted; a message the context cannot hold is an `error:` line and
exit 2 there (at a terminal the line only: type a shorter one).

Examples:
  gptkit chat run=runs/sft
  gptkit chat run=runs/qwen system="You are terse." temperature=0 max_new_tokens=128
  printf 'What is 2+3?\\nAnd times 4?\\n' | gptkit chat run=runs/sft greedy=true --json
  gptkit chat run=runs/qwen tools=my_tools.py       # the model may call my_tools.py's functions
  gptkit chat run=runs/sft draft=ngram draft_k=4     (speculative decoding: docs/speculative.md)

Tools (tools=, a template with tool syntax): the tools are rendered into every prompt; a reply that is
calls is shown as `tool call:` lines, each call answered by its function (tools=file.py or a module: the
user's code, announced on stderr before it runs; an error it raises is its result) or by the user (tools=
file.json: the next line typed, or read from stdin, is the result), and the model answers again, up to
MAX_TOOL_ROUNDS rounds a message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).

COMMANDS = ("/reset", "/exit")
# tool-call rounds one user message may start (each: the calls, their results, the model's next reply)
MAX_TOOL_ROUNDS = 8
# max_new_tokens=null (conf/chat.yaml): up to this many, capped at what the run's context leaves
DEFAULT_NEW_TOKENS = 256


def run(cfg) -> int:
    from gptkit.chat_templates import (
        check_special_tokens,
        reply_stop_ids,
        resolve_template,
        template_in_folder,
    )
    from gptkit.data.settings import SPECIAL_TEXT
    from gptkit.errors import ConfigError, GptkitError
    from gptkit.runs import find_run_checkpoint, load_for_inference, resolve_device
    from gptkit.threads import set_threads

    if cfg.format not in ("text", "json"):
        raise ConfigError(f"format={cfg.format!r} must be text or json")
    if cfg.special_tokens_in_content not in SPECIAL_TEXT:
        raise ConfigError(
            f"special_tokens_in_content={cfg.special_tokens_in_content!r} must be text (a special token "
            "typed in a message stays text) or allow (it becomes the control token)"
        )
    # the run first, torch after (gptkit.inference.generate, the device, the model): a run= that is not one is
    # one line in 0.24 s of CPU, not 3.3 s (issue 47 item 12, docs/benchmarks.md)
    ckpt = find_run_checkpoint(cfg.run)
    tools = None
    if cfg.tools:
        from gptkit.extras import require
        from gptkit.inference.chat_tools import load_tools

        require("tools", "chat tools=")
        tools = load_tools(str(cfg.tools))
    from gptkit.inference.generate import ChatSession
    from gptkit.inference.sampling import SampleOptions

    set_threads(cfg.threads, "threads", warn=resolve_device(cfg.device) == "cpu")
    r = load_for_inference(ckpt, cfg.device, cfg.dtype, cfg.attention, cfg.quantize)
    if cfg.template == "auto":
        template = template_in_folder(Path(r.dir))
        if template is None:
            raise GptkitError(
                f"{r.dir} has no chat template (chat.json: train with data=chat, or import a "
                "model whose tokenizer_config.json has one); choose one with "
                "template=chatml|llama3|<file>"
            )
    else:
        template = resolve_template(str(cfg.template), None)
    check_special_tokens(r.tokenizer, template, f"the run {r.dir}")
    template.compiled  # noqa: B018 - a template that is not Jinja fails now
    stop = reply_stop_ids(r.tokenizer, template, (r.config.get("tokenizer") or {}).get("eos_token"))
    if not stop:
        print(
            "note: the template has no end-of-turn token and the tokenizer no end-of-text token: every "
            "answer runs to max_new_tokens",
            file=sys.stderr,
        )
    try:
        # not given: the default, which must fit the run (a small model's context is shorter than it)
        fit_answer = cfg.max_new_tokens is None
        opts = SampleOptions(
            max_new_tokens=DEFAULT_NEW_TOKENS if fit_answer else int(cfg.max_new_tokens),
            temperature=0.0 if cfg.greedy else float(cfg.temperature),
            top_k=None if cfg.top_k in (None, 0) else int(cfg.top_k),
            top_p=float(cfg.top_p),
            seed=None if cfg.seed is None else int(cfg.seed),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"a sampling value is not a number ({exc})") from exc
    opts.validate(r.model_cfg.max_seq_len)
    from gptkit.inference.speculative import load_speculator

    speculate = load_speculator(cfg.draft, cfg.draft_k, r, cfg.device, cfg.dtype)
    session = ChatSession(
        r.model,
        r.tokenizer,
        template,
        opts,
        system=cfg.system or None,
        stop_ids=tuple(stop),
        max_context=cfg.max_context,
        reuse_cache=bool(cfg.reuse_cache),
        fit_answer=fit_answer,
        allow_special_text=cfg.special_tokens_in_content == "allow",
        tools=tools.specs if tools is not None else None,
        speculate=speculate,
    )
    if session.fit_note():
        print(f"note: {session.fit_note()}", file=sys.stderr)
    tty = sys.stdin.isatty()
    streaming = cfg.format == "text" and bool(cfg.stream)

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if tty:
        print(
            f"chatting with {r.dir} (template {template.name}); /reset forgets, /exit ends", file=sys.stderr
        )

    def ask(prompt: str):
        """The next line the user types (a prompt at a terminal), or of stdin; None at its end."""
        if tty:
            try:
                return input(prompt)
            except EOFError:
                return None
        got = sys.stdin.readline()
        return got.rstrip("\n") if got else None

    if tools is not None:
        from gptkit.inference.chat_tools import run_call

        answers = "you type each result" if tools.functions is None else "their functions answer"
        names = ", ".join(t["function"]["name"] for t in tools.specs)
        print(f"tools: {names} (from {tools.source}; {answers})", file=sys.stderr)
    turn_no = 0
    while True:
        if tty:
            try:
                line = input("you> ")
            except EOFError:
                print(file=sys.stderr)
                break
        else:
            line = sys.stdin.readline()
            if not line:
                break
            line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            session.reset()
            turn_no = 0
            print("(conversation reset)", file=sys.stderr)
            continue
        turn_no += 1
        if tty and streaming:
            write("assistant> ")
        answered: list[dict] = []
        try:
            t = session.reply(line, on_text=write if streaming else None)
            rounds = 0
            while t.calls and rounds < MAX_TOOL_ROUNDS:
                rounds += 1
                if streaming:
                    write("\n")
                results = []
                for c in t.calls:
                    args = json.dumps(c["arguments"], ensure_ascii=False)
                    print(f"tool call: {c['name']}({args})", file=sys.stderr, flush=True)
                    if tools.functions is not None:
                        result = run_call(tools.functions[c["name"]], c["arguments"])
                        print(f"tool result: {result}", file=sys.stderr, flush=True)
                    else:
                        result = ask(f"result of {c['name']}> ")
                        if result is None:
                            print("error: the input ended before the tool's result", file=sys.stderr)
                            return 2
                    results.append(result)
                    answered.append({"name": c["name"], "arguments": c["arguments"], "result": result})
                if tty and streaming:
                    write("assistant> ")
                t = session.answer_calls(results, on_text=write if streaming else None)
            if t.calls:
                print(
                    f"note: the model called tools {MAX_TOOL_ROUNDS} rounds running; its last calls are "
                    "left unanswered",
                    file=sys.stderr,
                )
        # a message too long for the context: said in one line; at a terminal the conversation goes on (type a
        # shorter one), from a script it ends there with exit 2 (the answers already printed stay)
        except GptkitError as exc:
            print(f"error: {exc}", file=sys.stderr)
            if tty:
                continue
            return 2
        if cfg.format == "json":
            print(
                json.dumps(
                    {
                        "turn": turn_no,
                        "user": line,
                        "assistant": t.text,
                        "tokens": len(t.tokens),
                        "stop_reason": t.stop_reason,
                        "prompt_tokens": t.prompt_tokens,
                        "fed_tokens": t.fed_tokens,
                        "prefill_s": t.prefill_s,
                        "decode_s": t.decode_s,
                        "notes": t.notes,
                        **({"tool_calls": answered} if answered else {}),
                        "speculative": t.speculative,
                    },
                    ensure_ascii=False,
                ),
                flush=True,
            )
        else:
            write("\n" if streaming else t.text + "\n")
        for note in t.notes:
            print(f"note: {note}", file=sys.stderr)
        if cfg.format == "text" and cfg.stats:
            tok_s = len(t.tokens) / t.decode_s if t.decode_s > 0 else 0.0
            print(
                f"[turn {turn_no}: {t.fed_tokens:,} of {t.prompt_tokens:,} prompt tokens run (the rest "
                f"from the cache), prefill {t.prefill_s * 1e3:.1f} ms, {len(t.tokens)} new at {tok_s:,.0f} "
                f"tokens/s, ended by {t.stop_reason}]",
                file=sys.stderr,
            )
            if speculate is not None:
                print(f"[turn {turn_no}: {speculate.describe()}]", file=sys.stderr)
    return 0
