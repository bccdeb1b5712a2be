"""Tokenize a corpus into token shards (train.bin, val.bin), manifest.json and tokenizer.json.

The result is cached by (corpus content, tokenizer): running it again is a no-op that says so.
`gptkit train` does this itself when the shards are missing.

Examples:
  gptkit prepare                                   (pydoc docs, byte tokenizer: offline)
  gptkit prepare data=stdlib tokenizer=bpe tokenizer.vocab_size=4096
  gptkit prepare data=shakespeare tokenizer=char     (tiny Shakespeare, built in)
  gptkit prepare data=files data.paths=[input.txt] tokenizer=char
  gptkit prepare data=files data.paths=input.txt           (one path may be a plain string)
  gptkit prepare data=files "data.paths=['data/*.jsonl']" data.val_paths=[val.jsonl] data.text_field=content
                                                   (globs inside a list need quotes: Hydra's grammar)
  gptkit prepare data=hub data.name=Salesforce/wikitext data.config=wikitext-2-raw-v1 \\
      data.val_split=validation
                                                   (streamed: nothing is downloaded first)
  gptkit prepare data=files 'data.paths=[big/*.txt]' tokenizer=bpe data.workers=16   (16 tokenizing processes)
  gptkit prepare data=mix 'data.sources={web: {kind: files, paths: [web.jsonl], weight: 0.7},
                                         code: {kind: stdlib, weight: 0.3}}'   (each source cached on its own)
  gptkit prepare data=tokens 'data.paths=[train.bin]' 'data.val_paths=[val.bin]' data.vocab_size=50304 \\
                 tokenizer=file tokenizer.path=gpt2/tokenizer.json      (nanoGPT .bin or llm.c shards)

  gptkit prepare data=preference data.paths=[pairs.jsonl] data.template=auto \\
      tokenizer=file tokenizer.path=runs/sft/tokenizer.json rows=512 reference=runs/sft
                                                   (the reference's log-probs of every pair, precomputed for
                                                    objective=dpo dpo.reference=precomputed: docs/dpo.md)

A killed prepare (kill -9 included) is continued by running the same command again. See docs/data-pipeline.md.
"""

from __future__ import annotations

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def prepare_args(args: list[str]) -> list[str]:
    """cache_dir=s3://bucket/prefix: the data is prepared in its local staging folder, then published there
    once (gptkit/remote.py); training reads it with data=prepared data.dir=s3://bucket/prefix/<folder>."""
    from gptkit.remote import localize_args

    return localize_args(args, {"cache_dir": "staging"})


def run(cfg) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from gptkit.data.settings import settings

    # an unknown data kind before the builders import torch (0.3 s of CPU, not 1.7 s)
    settings(cfg.data)
    from gptkit.data import prepare
    from gptkit.data.windows import check_window

    frozen = _frozen_model(cfg)
    data, max_seq_len = cfg.data, cfg.seq_len
    if frozen is not None:
        from gptkit.data import for_model

        # the folder the training run reads: data.bos resolved for the model, rows bounded by its context
        data = for_model(cfg.data, str(frozen.position or "learned"))
        max_seq_len = frozen.max_seq_len if max_seq_len is None else max_seq_len
    # seq_len= also bounds data=chat / data=preference rows: a longer conversation is not encoded whole
    p = prepare(
        data,
        cfg.tokenizer,
        cache_dir=cfg.cache_dir,
        progress=bool(cfg.progress),
        force=bool(cfg.force),
        max_seq_len=max_seq_len,
    )
    m = p.manifest
    if cfg.seq_len is not None:
        for split in ("train", "val"):
            check_window(m["splits"][split]["tokens"], int(cfg.seq_len), split)
    t = Table(title=f"prepared data: {escape(str(p.dir))}")
    t.add_column("")
    t.add_column("value")
    for name, value in p.table():
        t.add_row(escape(name), escape(value))
    Console().print(t)
    from gptkit.errors import ConfigError

    if frozen is not None:
        from gptkit.training.precompute import score

        name = _frozen_name(cfg)
        top_k = cfg.get("top_k")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ConfigError(f"top_k={top_k!r} must be a whole number >= 1 (tokens kept per position)")
        rec = score(
            p,
            name,
            str(cfg[name]),
            int(cfg.rows),
            top_k,
            int(cfg.frozen_batch_size),
            _device(str(cfg.device)),
        )
        what = "reference log-probs of every row" if name == "reference" else "teacher top-k of every row"
        print(f"precomputed {what} of {int(cfg.rows)}: {rec}")
    _publish(p.dir)
    return 0


def _publish(folder) -> None:
    """A folder prepared in an s3:// cache_dir's staging folder: uploaded once (its files, the manifest of
    their SHA-256, COMPLETE last); a complete copy with the same files there is left alone."""
    from gptkit.remote import publish_folder, remote_of

    url = remote_of(folder)
    if url is None:
        return
    sent = publish_folder(folder, url, "cache_dir")
    print(f"{'published' if sent else 'already published'}: data=prepared data.dir={url}")


def _frozen_name(cfg) -> str | None:
    """reference or teacher, whichever is given (one at most), else None."""
    from gptkit.errors import ConfigError

    given = [n for n in ("reference", "teacher") if cfg.get(n) not in (None, "")]
    if len(given) > 1:
        raise ConfigError("give reference= or teacher=, not both (one frozen model's outputs per prepare)")
    return given[0] if given else None


def _frozen_model(cfg):
    """reference= or teacher=: the frozen model's ModelConfig (checked: rows= given, a checkpoint found),
    else None."""
    from gptkit.errors import ConfigError

    name = _frozen_name(cfg)
    if name is None:
        if cfg.get("rows") is not None:
            raise ConfigError(
                "rows= is the row length of precomputed outputs; give reference=<run> or teacher=<run> too"
            )
        return None
    rows = cfg.get("rows")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ConfigError(
            f"{name}= needs rows=<the training run's trainer.seq_len> (the rows its outputs are computed "
            f"on), got rows={rows!r}"
        )
    from gptkit.checkpoints import run_dir_of
    from gptkit.fsio import check_local_path
    from gptkit.model.config import ModelConfig
    from gptkit.runs import find_run_checkpoint, read_config

    check_local_path(name, cfg[name])
    try:
        ckpt = find_run_checkpoint(str(cfg[name]), "runs")
        return ModelConfig.from_dict(read_config(run_dir_of(ckpt))["model"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{name}={cfg[name]}: {exc}") from None


def _device(device: str) -> str:
    from gptkit.runs import resolve_device

    return resolve_device(device)
