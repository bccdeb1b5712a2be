"""Loss (nats/token), perplexity, bits per byte and bits per character of a run on a corpus, over
every window of the split (not a sample). Every token after the first is scored exactly once: with
stride=seq_len (the default) the windows do not overlap; with a smaller stride each window scores
only its last `stride` targets, which then see at least seq_len - stride tokens of context.

Bits per byte = total NLL / ln 2 / UTF-8 bytes of the scored text (per character: / characters),
comparable across tokenizers.

Examples:
  gptkit eval run=runs/shakespeare                       (the run's own val split)
  gptkit eval run=runs/shakespeare data=files 'data.paths=[held_out.txt]'   (a whole held-out file)
  gptkit eval run=runs/shakespeare stride=64 format=json
A run trained with data.pack=documents is evaluated the same way (attention stays inside each document of a
window, positions restart with model.position_reset); pack=stream|documents chooses.
"""

from __future__ import annotations


def corpus_tokens(cfg, r):
    """(tokens [N] numpy, description, EOS id or None): the split of the held-out corpus or of the run's own
    data."""
    import numpy as np

    from gptkit.data import prepare
    from gptkit.errors import GptkitError
    from gptkit.runs import TOKENIZER_FILE

    run_tok = r.config.get("tokenizer") or {}
    data = cfg.get("data") if cfg.get("data") is not None else r.config.get("data") or {}
    if data.get("kind") == "chat":  # conversations, not a token stream: no windows to score
        raise GptkitError("eval scores windows of a text corpus; data=chat is conversations (a data=chat "
                          "run's val/loss, on the assistant's tokens, is in its metrics.csv); pass a text "
                          "corpus: data=files 'data.paths=[held_out.txt]'")
    if cfg.get("data") is None:
        if "data" not in r.config or "tokenizer" not in r.config:
            raise GptkitError(f"{r.dir}/config.yaml has no data/tokenizer sections to find its val split; "
                              f"pass a corpus: data=files 'data.paths=[held_out.txt]'")
        p = prepare(r.config["data"], run_tok, progress=False)
        if p.tokenizer().to_str() != r.tokenizer.to_str():
            raise GptkitError(f"the run's data ({p.dir}) was tokenized with another tokenizer than "
                              f"{r.dir / TOKENIZER_FILE}; evaluate on data=... instead")
        split = cfg.split or "val"
    else:  # a held-out corpus, tokenized with exactly the run's tokenizer.json
        tok_cfg = {"kind": "file", "path": str(r.dir / TOKENIZER_FILE), "eos_token": run_tok.get("eos_token")}
        p = prepare(cfg.data, tok_cfg, progress=False)
        split = cfg.split or "all"
    if split == "all":
        tokens = np.concatenate([p.train_tokens(), p.val_tokens()])  # the tail split: train then val
    elif split in ("train", "val"):
        tokens = p.train_tokens() if split == "train" else p.val_tokens()
    else:
        raise GptkitError(f"split={split!r} is not one of val, train, all")
    return tokens, f"{p.manifest['source']['description'] or p.dir.name} ({split})", p.eos_id


def pack_eos_id(cfg, r, eos_id: int | None, source: str) -> int | None:
    """The EOS id that separates documents when the windows are evaluated as packed documents (pack=, by
    default the run's own data.pack), else None."""
    from gptkit.errors import ConfigError

    if (cfg.pack or (r.config.get("data") or {}).get("pack") or "stream") == "stream":
        return None
    if eos_id is None:
        raise ConfigError(f"pack=documents needs an EOS token between documents and {source} has none; "
                          f"use pack=stream")
    return eos_id


def run(cfg) -> int:
    import json
    import math

    from gptkit.errors import ConfigError, GptkitError
    from gptkit.evaluation import evaluate, scored_text_size, window_starts
    from gptkit.runs import load_for_inference, resolve_device
    from gptkit.threads import set_threads

    if cfg.format not in ("table", "json"):
        raise ConfigError(f"format={cfg.format!r} must be table or json")
    set_threads(cfg.threads, "threads", warn=resolve_device(cfg.device) == "cpu")
    r = load_for_inference(cfg.run, cfg.device, cfg.dtype)
    max_len = r.model_cfg.max_seq_len
    trained = (r.config.get("trainer") or {}).get("seq_len")  # the windows the run trained and validated on
    seq_len = int(cfg.seq_len or trained or max_len)
    if not 1 <= seq_len <= max_len:
        raise ConfigError(f"seq_len={seq_len} must be in [1, model.max_seq_len={max_len}]")
    stride = int(cfg.stride or seq_len)
    if not 1 <= stride <= seq_len:
        raise ConfigError(f"stride={stride} must be in [1, seq_len={seq_len}]")
    if int(cfg.batch_size) < 1:
        raise ConfigError(f"batch_size={cfg.batch_size} must be >= 1")
    if cfg.pack not in (None, "stream", "documents"):
        raise ConfigError(f"pack={cfg.pack!r} must be stream or documents (or null: the run's data.pack)")
    tokens, source, eos_id = corpus_tokens(cfg, r)
    eos_id = pack_eos_id(cfg, r, eos_id, source)
    if len(tokens) < 2:
        raise GptkitError(f"{source} has {len(tokens)} token(s); evaluation needs at least 2")
    if int(tokens.max()) >= r.model_cfg.vocab_size:
        raise GptkitError(f"{source} holds token id {int(tokens.max())} but model.vocab_size="
                          f"{r.model_cfg.vocab_size}; evaluate with the run's own tokenizer")
    n_windows = len(window_starts(len(tokens), seq_len, stride, cfg.max_windows))
    bs = int(cfg.batch_size)
    if cfg.progress:
        from rich.console import Console
        from rich.progress import Progress

        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(f"eval {source}", total=n_windows)
            res = evaluate(r.model, tokens, seq_len, stride, bs, cfg.max_windows, lambda n: bar.advance(task, n),
                           eos_id=eos_id)
    else:
        res = evaluate(r.model, tokens, seq_len, stride, bs, cfg.max_windows, eos_id=eos_id)
    n_bytes, n_chars = scored_text_size(r.tokenizer, tokens, res.pop("last_target"))
    bits = res["nll_sum"] / math.log(2)
    res.update({"run": str(r.dir), "checkpoint": str(r.checkpoint), "data": source, "corpus_tokens": len(tokens),
                "bytes": n_bytes, "chars": n_chars, "bits_per_byte": bits / max(n_bytes, 1),
                "bits_per_char": bits / max(n_chars, 1), "dtype": str(cfg.dtype)})
    if cfg.format == "json":
        print(json.dumps(res, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{r.dir.name} on {source}")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("loss (nats/token)", f"{res['loss']:.4f}")
    t.add_row("perplexity", f"{res['perplexity']:.3f}")
    t.add_row("bits per token", f"{res['bits_per_token']:.4f}")
    t.add_row("bits per byte", f"{res['bits_per_byte']:.4f}")
    t.add_row("bits per character", f"{res['bits_per_char']:.4f}")
    t.add_section()
    t.add_row("tokens scored", f"{res['tokens_scored']:,} of {len(tokens):,}")
    t.add_row("bytes / characters scored", f"{n_bytes:,} / {n_chars:,}")
    t.add_row("windows (seq_len, stride)", f"{res['windows']:,} ({seq_len}, {stride})"
              + (", attention within documents" if res["documents"] else ""))
    t.add_row("time", f"{res['seconds']:.2f} s ({res['tokens_per_s']:,.0f} tokens/s)")
    Console().print(t)
    return 0
