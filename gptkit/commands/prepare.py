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

A killed prepare (kill -9 included) is continued by running the same command again. See docs/data-pipeline.md.
"""

from __future__ import annotations

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def run(cfg) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from gptkit.data.settings import settings

    # an unknown data kind before the builders import torch (0.3 s of CPU, not 1.7 s)
    settings(cfg.data)
    from gptkit.data import prepare
    from gptkit.data.windows import check_window

    # seq_len= also bounds data=chat / data=preference rows: a longer conversation is not encoded whole
    p = prepare(
        cfg.data,
        cfg.tokenizer,
        cache_dir=cfg.cache_dir,
        progress=bool(cfg.progress),
        force=bool(cfg.force),
        max_seq_len=cfg.seq_len,
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
    return 0
