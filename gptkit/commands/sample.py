"""Generate text from a trained run: one prefill pass over the prompt, then one token per step
through a KV cache. Beyond model.max_seq_len the window slides (overflow=slide, the default: the
cache is rebuilt from the last slide_keep tokens at positions 0..slide_keep-1) or generation stops
(overflow=stop). Statistics go to stderr, the text to stdout. On CUDA the one-token step runs with a
static cache, compiled and captured as a CUDA graph (decode=auto; decode=eager: the plain loop).

Examples:
  gptkit sample run=runs/shakespeare prompt="ROMEO:" max_new_tokens=300
  gptkit sample run=runs/shakespeare prompt_file=prompt.txt greedy=true
  gptkit sample run=runs/shakespeare prompt="To be" num_samples=4 top_k=50 top_p=0.9 seed=1
  gptkit sample run=runs/shakespeare prompt="KING" 'stop=["\\n\\n"]' --json   (one JSON line per sample)
  gptkit sample run=runs/llama/checkpoints/step-001000.ckpt device=cuda dtype=bf16 prompt="Once"
  gptkit sample run=runs/big prompt="ROMEO:" draft=runs/small draft_k=4   (speculative: docs/speculative.md)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).

STOP_REASONS = {
    "eos": "the end-of-text token",
    "stop": "a stop string",
    "length": "max_new_tokens",
    "context": "the full context (overflow=stop)",
}


def plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def options(cfg, max_seq_len: int, eos_id):
    from gptkit.errors import ConfigError
    from gptkit.inference.sampling import SampleOptions

    if cfg.compile not in (None, "auto", True, False):
        raise ConfigError(f"compile={cfg.compile!r} must be auto, true or false")
    stop = cfg.stop
    stop = [stop] if isinstance(stop, str) else [str(s) for s in (stop or ())]
    # the escapes \n and \t
    stop = tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in stop)

    def number(key: str, kind=int, none=(None,)):
        value = cfg[key]
        if value in none:
            return None
        try:
            if isinstance(value, bool) or (
                kind is int and isinstance(value, float) and not value.is_integer()
            ):
                raise ValueError
            return kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value} is not {'an integer' if kind is int else 'a number'}") from None

    opts = SampleOptions(
        max_new_tokens=number("max_new_tokens"),
        temperature=0.0 if cfg.greedy else number("temperature", float),
        top_k=number("top_k", none=(None, 0)),
        top_p=number("top_p", float),
        seed=number("seed"),
        num_samples=number("num_samples"),
        eos_id=eos_id if cfg.eos else None,
        stop=stop,
        overflow=str(cfg.overflow),
        slide_keep=number("slide_keep"),
        decode=str(cfg.decode),
        compile=None if cfg.compile in (None, "auto") else cfg.compile,
        check_every=number("check_every"),
    )
    opts.validate(max_seq_len)
    return opts


def read_prompt(cfg) -> str:
    from gptkit.errors import ConfigError, GptkitError

    if cfg.prompt_file is None:
        return str(cfg.prompt)
    # both given: which one was meant cannot be known
    if str(cfg.prompt) != "":
        raise ConfigError(
            f"prompt= and prompt_file={cfg.prompt_file} both give the prompt; give one of them "
            "(prompt_file= for text that is awkward to quote)"
        )
    p = Path(str(cfg.prompt_file)).expanduser()
    if p.is_dir():
        raise GptkitError(f"prompt_file={p} is a folder; give a text file")
    if not p.is_file():
        raise GptkitError(f"prompt_file={p} does not exist")
    data = p.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GptkitError(
            f"prompt_file={p}: byte {exc.start} ({data[exc.start : exc.start + 1]!r}) is not "
            f"valid UTF-8; save the prompt as UTF-8 text"
        ) from None


def prepare_args(args: list[str]) -> list[str]:
    """run=s3://bucket/prefix/<run>: its newest complete checkpoint, downloaded (gptkit/remote.py)."""
    from gptkit.remote import localize_args

    return localize_args(args, {"run": "run"})


def run(cfg) -> int:
    from gptkit.data.settings import SPECIAL_TEXT
    from gptkit.errors import ConfigError
    from gptkit.runs import find_run_checkpoint, load_for_inference, resolve_device
    from gptkit.threads import set_threads

    if cfg.format not in ("text", "json"):
        raise ConfigError(f"format={cfg.format!r} must be text or json")
    if cfg.special_tokens_in_content not in SPECIAL_TEXT:
        raise ConfigError(
            f"special_tokens_in_content={cfg.special_tokens_in_content!r} must be text (a special token the "
            "prompt spells is its text) or allow (it becomes the control token)"
        )
    allow = cfg.special_tokens_in_content == "allow"
    prompt = read_prompt(cfg)
    # the run first, torch after (gptkit.inference.generate, the device, the model): a run= that is not one is
    # one line in 0.24 s of CPU, not 3.3 s (issue 47 item 12, docs/benchmarks.md)
    ckpt = find_run_checkpoint(cfg.run)
    from gptkit.inference.generate import empty_prompt_start, encode_prompt, generate, special_token_ids

    r = load_for_inference(ckpt, cfg.device, cfg.dtype, cfg.attention, cfg.quantize)
    bos_id, eos_id = special_token_ids(r.tokenizer, r.config)
    opts = options(cfg, r.model_cfg.max_seq_len, eos_id)
    from gptkit.inference.speculative import load_speculator

    speculate = load_speculator(cfg.draft, cfg.draft_k, r, cfg.device, cfg.dtype)
    ids = encode_prompt(r.tokenizer, prompt, bos_id, eos_id, allow_special_text=allow)
    # once the work will start
    set_threads(cfg.threads, "threads", warn=resolve_device(cfg.device) == "cpu")
    if prompt == "" and bos_id is None:
        print(
            f"note: the prompt is empty and the tokenizer has no BOS token: the sample starts after "
            f'{empty_prompt_start(bos_id, eos_id)} (not printed); give prompt="..." to choose its start',
            file=sys.stderr,
        )
    decode = r.tokenizer.decode
    streaming = cfg.format == "text" and cfg.stream and opts.num_samples == 1

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if streaming:
        write(prompt)
    g = generate(r.model, ids, opts, decode=decode, on_text=write if streaming else None, speculate=speculate)
    # speculative: a step emits 1..draft_k + 1 tokens
    steps_tokens = g.speculative["decode_tokens"] if g.speculative else g.decode_steps * opts.num_samples
    tok_s = steps_tokens / g.decode_s if g.decode_s > 0 else 0.0
    # JSON Lines: one object per sample, each line complete on its own
    if cfg.format == "json":
        shared = {
            "run": str(r.dir),
            "checkpoint": str(r.checkpoint),
            "prompt": prompt,
            "prompt_tokens": g.prompt_tokens,
            "settings": {
                **opts.__dict__,
                "stop": list(opts.stop),
                "device": str(r.model.tok_emb.weight.device),
                "dtype": str(cfg.dtype),
            },
            "timing": {
                "prefill_s": g.prefill_s,
                "decode_s": g.decode_s,
                "decode_steps": g.decode_steps,
                "decode_tokens_per_s": tok_s,
                "slides": g.slides,
                "decode": g.decode,
                "setup_s": g.setup_s,
            },
            "notes": g.notes,
            "speculative": g.speculative,
        }
        for i, (text, tokens, why) in enumerate(zip(g.texts, g.tokens, g.stop_reasons)):
            sample = {"sample": i + 1, "text": text, "tokens": tokens, "stop_reason": why}
            print(json.dumps({**sample, **shared}, ensure_ascii=False))
    else:
        if streaming:
            write("\n")
        else:
            for i, text in enumerate(g.texts):
                print(f"--- sample {i + 1}/{len(g.texts)} ({g.stop_reasons[i]}) ---")
                print(prompt + text)
        for note in g.notes:
            print(f"note: {note}", file=sys.stderr)
        # compile and CUDA graph capture
        setup = f"setup {g.setup_s:.1f} s, " if g.setup_s >= 0.05 else ""
        ended = ", ".join(STOP_REASONS.get(r, r) for r in sorted(set(g.stop_reasons)))
        print(
            f"[{plural(g.prompt_tokens, 'prompt token')}, {sum(map(len, g.tokens))} new, {setup}prefill "
            f"{g.prefill_s * 1e3:.1f} ms, decode {tok_s:,.0f} tokens/s ({g.decode}), ended by {ended}]",
            file=sys.stderr,
        )
        if speculate is not None:
            print(f"[{speculate.describe()}]", file=sys.stderr)
    if cfg.attention_map:
        from gptkit.evaluation.attention_maps import write_for_run

        path, _ = write_for_run(r, ids, out=None)
        print(f"attention map: {path}", file=sys.stderr)
    return 0
