"""gptkit bench data: how fast text becomes tokens, what memory that takes, and what one training
batch costs next to a training step.

1. Train the byte-level BPE (vocab_size) on the corpus: time and peak resident memory added.
2. prepare() the corpus with that tokenizer (tokenizer=file) into a temporary cache: hashing,
   tokenizing and writing the shards, in MB/s of UTF-8 text, and the peak memory it added (the
   corpus must not be held more than a few times over).
3. prepare() with the byte tokenizer (its ids are the UTF-8 bytes: no tokenizer call needed).
4. The BPE tokenizer alone: its parallel batch encoder over the corpus, in MB/s.
5. One training batch from the stateless sampler (memory-mapped shards) against one training step
   of `model` (fp32, AdamW, batch_size x seq_len, built with gptkit.model.GPT): target under 1%.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def peak_rss():
    """Sample this process's resident memory every 10 ms; yields a dict that gets `added_mb` and `s`."""
    import psutil

    proc = psutil.Process()
    base = proc.memory_info().rss
    out = {"peak": base}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            out["peak"] = max(out["peak"], proc.memory_info().rss)
            stop.wait(0.01)

    t = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join()
        out["s"] = time.perf_counter() - t0
        out["added_mb"] = (out["peak"] - base) / 2**20


def step_time(model_name: str, vocab_size: int, batch: tuple, steps: int) -> tuple[float, int]:
    """Mean seconds of one fp32 AdamW training step (forward, backward, update) of a conf/model preset."""
    import torch
    from omegaconf import OmegaConf

    from gptkit.config import conf_dir, model_config
    from gptkit.model import GPT

    mcfg = OmegaConf.load(conf_dir() / "model" / f"{model_name}.yaml")
    mcfg.vocab_size = vocab_size
    torch.manual_seed(0)
    model = GPT(model_config(mcfg))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    x, y = batch  # [batch_size, seq_len] each
    times = []
    for i in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        model(x, y).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sum(times) / len(times), sum(p.numel() for p in model.parameters())


def run(cfg) -> int:
    import torch
    from hydra import compose, initialize_config_dir
    from rich.console import Console
    from rich.table import Table

    from gptkit.config import conf_dir
    from gptkit.data import TokenDataModule, prepare
    from gptkit.data.build import data_settings, split_long
    from gptkit.data.sources import open_corpus
    from gptkit.threads import set_threads
    from gptkit.tokenizer import build_tokenizer

    set_threads(cfg.threads, "bench.threads")
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        data_cfg = compose(config_name=f"data/{cfg.corpus}").data
    corpus = open_corpus(data_settings(data_cfg))
    mb = sum(len(d.encode("utf-8")) for d in corpus.all_docs()) / 1e6
    con = Console(stderr=True)

    with tempfile.TemporaryDirectory(prefix="gptkit-bench-data-") as tmp:
        con.print(f"training BPE {cfg.vocab_size} on {mb:.1f} MB ...")
        with peak_rss() as train:
            tok = build_tokenizer({"kind": "bpe", "vocab_size": int(cfg.vocab_size)}, texts=corpus.all_docs,
                                  progress=False)
        tok_file = Path(tmp) / "bpe.json"
        tok.save(str(tok_file))

        con.print("prepare() with it ...")
        with peak_rss() as prep:
            prepared = prepare(data_cfg, {"kind": "file", "path": str(tok_file), "eos_token": "<|endoftext|>"},
                               cache_dir=Path(tmp) / "cache", progress=False)
        tokens = sum(prepared.manifest["splits"][s]["tokens"] for s in ("train", "val"))

        con.print("prepare() with the byte tokenizer ...")
        with peak_rss() as prep_byte:
            prepare(data_cfg, {"kind": "byte"}, cache_dir=Path(tmp) / "cache", progress=False)

        con.print("encode_batch alone ...")
        pieces = [p for d in corpus.all_docs() for p in split_long(d)]
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        t0 = time.perf_counter()
        for i in range(0, len(pieces), 16):
            encode(pieces[i:i + 16], add_special_tokens=False)
        encode_s = time.perf_counter() - t0
        del pieces

        dm = TokenDataModule(prepared, batch_size=int(cfg.batch_size), seq_len=int(cfg.seq_len), seed=0)
        dm.sampler.batch(0)
        t0 = time.perf_counter()
        for s in range(int(cfg.batches)):
            batch = dm.sampler.batch(s)
        batch_s = (time.perf_counter() - t0) / int(cfg.batches)
        con.print(f"{cfg.model} training steps ...")
        step_s, n_params = step_time(str(cfg.model), prepared.vocab_size, batch, int(cfg.steps))

    r = {
        "corpus": corpus.description, "corpus_mb": round(mb, 2), "tokens": tokens,
        "bytes_per_token": round(mb * 1e6 / tokens, 3), "vocab_size": prepared.vocab_size,
        "bpe_train_s": round(train["s"], 2), "bpe_train_peak_rss_added_mb": round(train["added_mb"], 1),
        "prepare_s": round(prep["s"], 2), "prepare_mb_per_s": round(mb / prep["s"], 3),
        "prepare_peak_rss_added_mb": round(prep["added_mb"], 1),
        "prepare_byte_s": round(prep_byte["s"], 2), "prepare_byte_peak_rss_added_mb": round(prep_byte["added_mb"], 1),
        "encode_s": round(encode_s, 2), "encode_mb_per_s": round(mb / encode_s, 3),
        "batch_ms": round(batch_s * 1e3, 4), "step_ms": round(step_s * 1e3, 2),
        "batch_share_of_step": batch_s / step_s, "model": str(cfg.model), "model_params": n_params,
        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
        "batch": f"{cfg.batch_size} x {cfg.seq_len}",
    }
    t = Table(title=f"gptkit bench data: {r['corpus']}")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row("corpus", f"{mb:.1f} MB, {tokens:,} tokens ({r['bytes_per_token']} bytes/token)")
    t.add_row(f"train byte-level BPE {prepared.vocab_size}",
              f"{train['s']:.1f} s, +{train['added_mb']:.0f} MB peak ({train['added_mb'] / mb:.1f}x corpus)")
    t.add_row("prepare(): hash + tokenize + write shards",
              f"{prep['s']:.1f} s = {r['prepare_mb_per_s']:.2f} MB/s, +{prep['added_mb']:.0f} MB peak "
              f"({prep['added_mb'] / mb:.1f}x corpus)")
    t.add_row("prepare() with tokenizer=byte (ids = UTF-8 bytes)",
              f"{prep_byte['s']:.1f} s = {mb / prep_byte['s']:.1f} MB/s, +{prep_byte['added_mb']:.0f} MB peak")
    t.add_row(f"tokenizer throughput (BPE {prepared.vocab_size}, encode_batch)", f"{r['encode_mb_per_s']:.2f} MB/s")
    t.add_row(f"one training batch ({r['batch']}, memory-mapped)", f"{batch_s * 1e3:.3f} ms")
    t.add_row(f"one {cfg.model} training step (fp32, AdamW, {n_params / 1e6:.2f} M params, "
              f"{r['torch_threads']} threads)", f"{step_s * 1e3:.1f} ms")
    t.add_row("[bold]batch cost / step (target < 1%)", f"[bold]{100 * r['batch_share_of_step']:.3f}%")
    t.caption = f"{r['cpus']} CPUs, 1-minute load average {r['load_avg_1m']:.1f} at the end"
    Console().print(t)
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(r, indent=2))
    return 0
