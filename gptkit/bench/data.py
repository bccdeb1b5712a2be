"""gptkit bench data: how fast text becomes tokens, what memory that takes, and what one training
batch costs next to a training step. Everything is measured in one run on one file (>= 200 MB: made
from the standard library's sources unless bench.file is given), and the machine's load is stated.

1. Each tokenizer of bench.tokenizers (byte, char, byte-level BPE 8k and 32k trained on a
   bench.train_chars sample): every encoder that gives its ids (HF `tokenizers`, tiktoken from the
   same merges, the UTF-8 bytes, a code point table) alone, one process and one thread, on the same
   bench.encode_mb of text (every k-th batch of the file): MB/s, and whether its ids equal HF's.
2. prepare() of the whole file with data.workers = each of bench.workers, for each of bench.formats (text:
   the file; jsonl: the same text as JSON-lines records, which the workers read in byte ranges themselves;
   its MB/s are of the .jsonl file, its ratios of the text): MB/s and tokens/s of its
   tokenization phase (reading, cutting, encoding, writing), peak RSS of the process and of all its
   workers, and the ratio to workers x the fastest single-process encoder (target >= 0.85), which is
   timed again after each prepare: the ratio is to the mean of its speeds just before and just after.
   Beside them: reading and decoding the file alone, and with cutting (what the main process does for
   any tokenizer; byte's and char's encoders are faster than that).
3. The projected time for 40 GB of text (and of JSON lines) on 16 cores: 16 workers at the measured
   2-worker efficiency, or what the one main process (text: reading, cutting, writing; JSON lines: finding
   the workers' ranges, writing) can feed at its measured CPU per MB, if less.
4. One training batch from the stateless sampler against one training step of `model`: target < 1%.
"""

from __future__ import annotations

import json
import os
import resource
import sysconfig
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from gptkit.conf_tree import conf_dir, model_config
from gptkit.data import TokenDataModule, prepare
from gptkit.data.console import human
from gptkit.data.sources import stdlib_files, text_parts
from gptkit.data.tokenize import Cutter, EncoderSpec, batches, tiktoken_tables
from gptkit.data.workers import Tokenizing
from gptkit.errors import GptkitError
from gptkit.model import GPT
from gptkit.tokenizer import build_tokenizer

# bench.formats -> the results' key per row
PREPARE_KEYS = {"text": "prepare", "jsonl": "prepare_jsonl"}


@contextmanager
def peak_rss(tree: bool = False):
    """Sample resident memory every 50 ms; yields a dict that gets `added_mb`, `peak_mb` (this process) and,
    with tree=True, `tree_peak_mb` (this process plus its children, e.g. tokenization workers), and `s`.
    The list of children is refreshed every 0.25 s (listing them scans /proc: at every sample of 10 ms it
    cost a sixth of a core, taken from what is measured; now well under 1%)."""
    proc = psutil.Process()
    base = proc.memory_info().rss
    out = {"peak": base, "tree": base}
    stop = threading.Event()

    def sample() -> None:
        kids: list = []
        listed = 0.0
        while not stop.is_set():
            rss = proc.memory_info().rss
            out["peak"] = max(out["peak"], rss)
            if tree:
                if time.perf_counter() - listed > 0.25:
                    kids, listed = proc.children(recursive=True), time.perf_counter()
                total = rss
                for c in kids:
                    try:
                        total += c.memory_info().rss
                    except psutil.Error:
                        pass
                out["tree"] = max(out["tree"], total)
            stop.wait(0.05)

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
        out["peak_mb"] = out["peak"] / 2**20
        out["tree_peak_mb"] = out["tree"] / 2**20
        out["tree_added_mb"] = (out["tree"] - base) / 2**20


def step_time(model_name: str, vocab_size: int, batch: tuple, steps: int) -> tuple[float, int]:
    """Mean seconds of one fp32 AdamW training step (forward, backward, update) of a conf/model preset."""
    mcfg = OmegaConf.load(conf_dir() / "model" / f"{model_name}.yaml")
    mcfg.vocab_size = vocab_size
    torch.manual_seed(0)
    model = GPT(model_config(mcfg))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    x, y = batch  # [batch_size, seq_len] each
    times = []
    # two warm-up steps
    for i in range(steps + 2):
        t0 = time.perf_counter()
        model(x, y).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sum(times) / len(times), sum(p.numel() for p in model.parameters())


def make_corpus(path: Path, size_mb: float) -> Path:
    """A text file of about size_mb MB: the standard library's .py sources, as often as needed."""
    want = int(size_mb * 1e6)
    files = stdlib_files(include_tests=True)
    with open(path, "wb") as out:
        while out.tell() < want:
            for f in files:
                data = f.read_bytes()
                try:
                    data.decode("utf-8")
                # a few test files are deliberately not UTF-8
                except UnicodeDecodeError:
                    continue
                out.write(data)
                if out.tell() >= want:
                    break
    return path


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _tok_cfg(name: str, train_chars: int) -> dict:
    if name.startswith("bpe-"):
        return {"kind": "bpe", "vocab_size": int(name[4:]), "train_chars": train_chars}
    if name in ("byte", "char"):
        return {"kind": name, **({"eos_token": "<|endoftext|>"} if name == "byte" else {})}
    raise ValueError(f"bench.tokenizers: {name!r} is not byte, char or bpe-<vocab_size>")


def encoder_sample(path: Path, mb: float) -> list[str]:
    """About `mb` MB of the file, cut as prepare cuts it: every k-th batch of it, so that the encoders are
    timed on text spread over the whole file like prepare's (its parts need not encode at the same speed)."""
    every = max(1, round(path.stat().st_size / (mb * 1e6)))
    pieces = Cutter("gpt2").pieces(text_parts(path, "strict", "error"), eos=0)
    return [t for i, b in enumerate(batches(pieces)) if i % every == 0 for t, _, _ in b]


def time_encoder(tok, engine: str, pieces: list[str], mb: float):
    """(MB/s, ids, CPU ms per MB) of one encoder alone on the pieces: one process, one thread, built before
    the clock."""
    work = list(batches(((p, False) for p in pieces)))
    spec = EncoderSpec(tok.to_str(), engine, (), None, "uint32")
    with Tokenizing(spec, 1) as t:
        t0, c0 = time.perf_counter(), time.process_time()
        ids = [a for a, *_ in t.map(iter(work))]
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return mb / dt, np.concatenate(ids), 1e3 * dc / mb


def encoder_speeds(tok, kind: str, pieces: list[str], mb: float) -> dict[str, dict]:
    """{engine: {"mb_per_s", "same_ids"}} for every encoder of this tokenizer, one process, one thread."""
    engines = {"byte": ["utf8", "hf"], "char": ["chars", "hf"]}.get(kind, ["hf"])
    if kind not in ("byte", "char") and tiktoken_tables(tok.to_str()) is not None:
        engines = ["tiktoken", "hf"]
    out = {}
    for engine in engines:
        speed, flat, cpu = time_encoder(tok, engine, pieces, mb)
        out[engine] = {
            "mb_per_s": round(speed, 2),
            "tokens": int(len(flat)),
            "_ids": flat,
            "cpu_ms_per_mb": round(cpu, 2),
        }
    hf = out["hf"]["_ids"]
    for e in out.values():
        e["same_ids"] = bool(np.array_equal(e.pop("_ids"), hf))
    return out


def make_jsonl(text_file: Path, path: Path, seed: int = 0) -> Path:
    """The text file as JSON lines: consecutive records of its text (about 200 to 200,000 characters each,
    log-normal, cut at line ends), so that the records hold exactly the file's text."""
    import random

    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as out:
        for part, _ in text_parts(text_file, "strict", "error"):
            at = 0
            while at < len(part):
                n = min(200_000, int(rng.lognormvariate(8.5, 1.5)) + 200)
                end = part.find("\n", at + n)
                end = len(part) if end == -1 else end + 1
                out.write(json.dumps({"text": part[at:end]}) + "\n")
                at = end
    return path


def reading_floor(path: Path) -> dict[str, float]:
    """MB/s of what the one main process of a prepare does to the text whatever the tokenizer, alone, one
    process: reading and decoding the file, and that plus cutting it into pieces (as for a byte-level BPE).
    An encoder faster than these (byte, char) cannot set prepare's pace."""
    mb = path.stat().st_size / 1e6
    t0 = time.perf_counter()
    for _ in text_parts(path, "strict", "error"):
        pass
    read = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in batches(Cutter("gpt2").pieces(text_parts(path, "strict", "error"), eos=0)):
        pass
    cut = time.perf_counter() - t0
    return {"read_decode_mb_per_s": round(mb / read, 1), "read_decode_cut_mb_per_s": round(mb / cut, 1)}


def run(cfg) -> int:
    from gptkit.threads import cores, set_threads

    set_threads(cfg.threads, "bench.threads")
    con = Console(stderr=True)
    r: dict = {
        "load_avg_start": loadavg(),
        "cpus": os.cpu_count(),
        "usable_cores": cores(),
        "python_stdlib": sysconfig.get_paths()["stdlib"],
        "tokenizers": {},
    }
    with tempfile.TemporaryDirectory(prefix="gptkit-bench-data-") as tmp:
        tmp = Path(tmp)
        path = (
            Path(cfg.file).expanduser() if cfg.file else make_corpus(tmp / "corpus.txt", float(cfg.size_mb))
        )
        size = path.stat().st_size
        mb = size / 1e6
        r["file"], r["file_mb"] = str(path), round(mb, 1)
        con.print(f"corpus: {path} ({human(size)}); load average {loadavg()}")
        data = {"kind": "files", "paths": [str(path)], "val_fraction": 0.01}
        formats = [str(f) for f in cfg.formats]
        if set(formats) - set(PREPARE_KEYS) or not formats:
            raise GptkitError(f"bench.formats={formats} must be a non-empty list of text and jsonl")
        files = {"text": path}
        if "jsonl" in formats:
            files["jsonl"] = make_jsonl(path, tmp / "corpus.jsonl")
            con.print(
                f"the same text as JSON lines: {files['jsonl']} ({human(files['jsonl'].stat().st_size)})"
            )
        r["reading"] = reading_floor(path)
        sample = encoder_sample(path, float(cfg.encode_mb))
        sample_mb = sum(len(p.encode()) for p in sample) / 1e6
        byte_prepared = None
        for name in cfg.tokenizers:
            tok_cfg = _tok_cfg(str(name), int(cfg.train_chars))
            kind = tok_cfg["kind"]
            row: dict = {}
            if kind in ("bpe", "char"):
                con.print(f"{name}: building the tokenizer ...")
                from gptkit.data.build import training_sample
                from gptkit.data.kinds import open_corpus

                corpus = open_corpus(
                    {
                        "kind": "files",
                        "paths": [str(path)],
                        "val_paths": None,
                        "format": "auto",
                        "text_field": "text",
                        "encoding_errors": "strict",
                    }
                )
                with peak_rss() as train:
                    if kind == "bpe":
                        texts, _ = training_sample(corpus, int(cfg.train_chars))
                        tok = build_tokenizer(tok_cfg, texts=texts, progress=False)
                    else:
                        tok = build_tokenizer(
                            tok_cfg, texts=lambda: (t for t, _ in corpus.all_parts()), progress=False
                        )
                row["build_tokenizer_s"] = round(train["s"], 2)
                row["build_tokenizer_peak_rss_added_mb"] = round(train["added_mb"], 1)
                tok_file = tmp / f"{name}.json"
                tok.save(str(tok_file))
            else:
                tok = build_tokenizer(tok_cfg)
            con.print(f"{name}: encoders alone on {sample_mb:.1f} MB ...")
            row["encoders"] = encoder_speeds(tok, kind, sample, sample_mb)
            best = max((v["mb_per_s"], e) for e, v in row["encoders"].items() if v["same_ids"])
            fastest, best_engine = best
            cpu_before = row["encoders"][best_engine]["cpu_ms_per_mb"]
            row["fastest_encoder_mb_per_s"] = fastest
            # the fastest encoder is timed again after each prepare: the ratio is to the
            before = fastest
            # mean of its speeds just before and just after (the load drifts)
            for fmt in formats:
                row[PREPARE_KEYS[fmt]] = {}
                for w in cfg.workers:
                    con.print(
                        f"{name}: prepare of the {fmt} file with data.workers={w} ... "
                        f"(load average {loadavg()})"
                    )
                    load0 = loadavg()
                    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    file = files[fmt]
                    with peak_rss(tree=True) as prep:
                        p = prepare(
                            {**data, "paths": [str(file)], "workers": int(w)},
                            tok_cfg,
                            cache_dir=tmp / f"cache-{name}-{fmt}-{w}",
                            progress=False,
                        )
                    m = p.manifest
                    tokens = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
                    ts = m["tokenize_seconds"]
                    # the workers, joined by now
                    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    kids = kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime
                    after, _, cpu_after = time_encoder(tok, best_engine, sample, sample_mb)
                    after = round(after, 2)
                    around = (before + after) / 2
                    enc_cpu = (cpu_before + cpu_after) / 2
                    # per MB of text
                    prep_cpu = 1e3 * (m["tokenize_main_cpu_seconds"] + kids) / mb
                    file_mb = file.stat().st_size / 1e6
                    row[PREPARE_KEYS[fmt]][str(w)] = {
                        "workers": m["workers"],
                        "encoder": m["encoder"],
                        "tasks": m["tasks"],
                        "tokenize_s": ts,
                        "file_mb": round(file_mb, 1),
                        "mb_per_s": round(file_mb / ts, 2),
                        "text_mb_per_s": round(mb / ts, 2),
                        "tokens_per_s": round(tokens / ts),
                        "main_cpu_ms_per_mb": round(1e3 * m["tokenize_main_cpu_seconds"] / file_mb, 2),
                        "whole_prepare_s": round(prep["s"], 1),
                        "peak_rss_added_mb": round(prep["added_mb"], 1),
                        "peak_rss_added_with_workers_mb": round(prep["tree_added_mb"], 1),
                        "fastest_encoder_before_after_mb_per_s": [before, after],
                        "ratio_to_workers_x_fastest": round(mb / ts / (int(w) * around), 3),
                        # CPU time, which the other processes on the machine disturb less than wall time: the
                        # encoder's per MB of text over prepare's (its tokenization phase and all its workers'
                        # CPU, their start-up included); 1.0: no overhead
                        "encoder_cpu_ms_per_mb": round(enc_cpu, 2),
                        "prepare_cpu_ms_per_mb": round(prep_cpu, 2),
                        "cpu_ratio": round(enc_cpu / prep_cpu, 3),
                        "load_avg_before": load0,
                        "load_avg_after": loadavg(),
                        "tokens": tokens,
                    }
                    before, cpu_before = after, cpu_after
                    if kind == "byte" and byte_prepared is None:
                        byte_prepared = p
            r["tokenizers"][str(name)] = row
        last = list(r["tokenizers"])[-1]
        for fmt in formats:
            row = r["tokenizers"][last][PREPARE_KEYS[fmt]]
            if "2" not in row:
                continue
            eff = row["2"]["ratio_to_workers_x_fastest"]
            workers_rate = 16 * r["tokenizers"][last]["fastest_encoder_mb_per_s"] * eff
            # one main process feeds every worker (text: it reads, cuts and writes; JSON lines: it finds the
            # workers' byte ranges and writes): at its CPU per MB it feeds at most
            main_rate = 1e3 / max(row["2"]["main_cpu_ms_per_mb"], 1e-9)
            rate = min(workers_rate, main_rate)
            r["projection_40gb_16_cores" + ("" if fmt == "text" else f"_{fmt}")] = {
                "tokenizer": last,
                "format": fmt,
                "efficiency": eff,
                "mb_per_s": round(rate, 1),
                "workers_mb_per_s": round(workers_rate, 1),
                "main_process_mb_per_s": round(main_rate, 1),
                "bound": "the main process" if main_rate < workers_rate else "the workers",
                "minutes": round(40e3 / rate / 60, 1),
            }

        if byte_prepared is not None:
            dm = TokenDataModule(
                byte_prepared, batch_size=int(cfg.batch_size), seq_len=int(cfg.seq_len), seed=0
            )
            dm.sampler.batch(0)
            t0 = time.perf_counter()
            for s in range(int(cfg.batches)):
                batch = dm.sampler.batch(s)
            batch_s = (time.perf_counter() - t0) / int(cfg.batches)
            con.print(f"{cfg.model} training steps ...")
            step_s, n_params = step_time(str(cfg.model), byte_prepared.vocab_size, batch, int(cfg.steps))
            r.update(
                {
                    "batch_ms": round(batch_s * 1e3, 4),
                    "step_ms": round(step_s * 1e3, 2),
                    "batch_share_of_step": batch_s / step_s,
                    "model": str(cfg.model),
                    "model_params": n_params,
                    "torch_threads": torch.get_num_threads(),
                    "batch": f"{cfg.batch_size} x {cfg.seq_len}",
                }
            )
    r["load_avg_end"] = loadavg()

    t = Table(title=f"gptkit bench data: {r['file_mb']} MB of text")
    for c in ("tokenizer", "measure", "value"):
        t.add_column(c, justify="right" if c == "value" else "left")
    for name, row in r["tokenizers"].items():
        if "build_tokenizer_s" in row:
            t.add_row(
                name,
                "build the tokenizer",
                f"{row['build_tokenizer_s']} s, peak +{row['build_tokenizer_peak_rss_added_mb']:.0f} MB",
            )
        for e, v in row["encoders"].items():
            t.add_row(
                name,
                f"encoder {e} alone (1 process, 1 thread)",
                f"{v['mb_per_s']} MB/s" + ("" if v["same_ids"] else " (ids differ from HF: not used)"),
            )
        for fmt, key in PREPARE_KEYS.items():
            for w, v in row.get(key, {}).items():
                t.add_row(
                    name,
                    f"prepare {fmt}, {v['workers']} worker(s), {v['encoder']}",
                    f"{v['mb_per_s']} MB/s, {v['tokens_per_s'] / 1e6:.2f} M tokens/s, "
                    f"{v['ratio_to_workers_x_fastest']:.2f} x ({w} x fastest: "
                    f"{' / '.join(map(str, v['fastest_encoder_before_after_mb_per_s']))} MB/s "
                    f"before / after), "
                    f"peak +{v['peak_rss_added_mb']:.0f} MB "
                    f"(with workers +{v['peak_rss_added_with_workers_mb']:.0f} MB), "
                    f"main process {v['main_cpu_ms_per_mb']} ms CPU per MB of the file, CPU ratio "
                    f"{v['cpu_ratio']:.2f} ({v['encoder_cpu_ms_per_mb']} / "
                    f"{v['prepare_cpu_ms_per_mb']} ms per MB of text), load {v['load_avg_before']}",
                )
    if "reading" in r:
        t.add_row(
            "",
            "reading and decoding the file alone (1 process)",
            f"{r['reading']['read_decode_mb_per_s']} MB/s",
        )
        t.add_row(
            "",
            "... and cutting it into pieces (1 process)",
            f"{r['reading']['read_decode_cut_mb_per_s']} MB/s",
        )
    for key in ("projection_40gb_16_cores", "projection_40gb_16_cores_jsonl"):
        if key in r:
            pr = r[key]
            t.add_row(
                pr["tokenizer"],
                f"[bold]projected: 40 GB of {pr['format']} on 16 cores",
                f"[bold]{pr['minutes']} min ({pr['mb_per_s']} MB/s, bound by {pr['bound']}: 16 workers "
                f"at {pr['efficiency']:.2f} efficiency {pr['workers_mb_per_s']} MB/s, one main process "
                f"{pr['main_process_mb_per_s']} MB/s)",
            )
    if "batch_ms" in r:
        t.add_row("byte", f"one training batch ({r['batch']}, memory-mapped)", f"{r['batch_ms']:.3f} ms")
        t.add_row(
            "", f"one {r['model']} step (fp32, AdamW, {r['torch_threads']} threads)", f"{r['step_ms']:.1f} ms"
        )
        t.add_row("", "[bold]batch cost / step (target < 1%)", f"[bold]{100 * r['batch_share_of_step']:.3f}%")
    t.caption = (
        f"{r['cpus']} CPUs ({r['usable_cores']} usable); load average (1, 5, 15 min) at the start "
        f"{r['load_avg_start']}, at the end {r['load_avg_end']}"
    )
    Console().print(t)
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(r, indent=2))
    return 0
