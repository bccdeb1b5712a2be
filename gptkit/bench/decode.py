"""`gptkit bench sample`: decode speed of gptkit's generation loop against transformers generate() on the
same weights (random init, loaded into LlamaForCausalLM / GPT2LMHeadModel through gptkit.hf.to_transformers).

Decode tokens/s = batch * (new_tokens - 1) / (time(new_tokens) - time(1 new token)): the prefill cancels
out, the same measure for every side. Each repeat times both runs, gptkit's and transformers' in turn (the
same load on both); tables show the median over the repeats and their min-max. First-token latency is
time(1 new token): the prompt's prefill and the first sample.
Greedy tokens are compared between the sides (same weights, same math: they should agree in fp32).

bench.device=cpu (the default): gptkit (decode=auto: the eager loop with the CPU decoding layout) vs
  transformers, for bench.models x bench.batch_sizes, and the read roofline (read_roofline: what reading a
  step's bytes once costs this process here); then ms per decode step against the context length, with the
  KV cache vs a no-cache loop that re-runs the whole prefix.
bench.parts=[latent]: multi-head latent attention's latent cache against its expanded cache and an MHA model
  of the same parameters, KV bytes and decode tokens/s at a 4k context (gptkit/bench/latent.py).
bench.parts=[quantize]: quantize=int8|nf4 (and int4 on CUDA) against the full model on a trained run: bytes,
  perplexity, greedy agreement, decode tokens/s (gptkit/bench/quantized.py).
bench.parts=[llamacpp]: one-row decode ms per token against llama.cpp (llama-cpp-python) on the same weights,
  gptkit fp32 vs llama.cpp f32 and gptkit quantize=int8 vs llama.cpp Q8_0, greedy agreement
  (gptkit/bench/llamacpp.py).
bench.parts=[speculative]: the plain greedy decode against speculative decoding (draft=self, the
  acceptance's upper bound, and draft=ngram on a repetitive prompt), wall seconds and their ratio
  (gptkit/bench/speculative.py).
bench.device=cuda: bench.cuda.models in bench.cuda.dtype x bench.cuda.batch_sizes, each side in
  bench.cuda.sides (SIDES below), rows printed as they finish; the HBM roofline is batch * bandwidth /
  gptkit.accounting.decode_bytes_per_step (the weights, and the K/V at the mean context of the timed steps).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import yaml
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from gptkit.accounting import decode_bytes_per_step, memory_bandwidth
from gptkit.bench import latent, llamacpp, quantized, speculative
from gptkit.conf_tree import conf_dir, presets
from gptkit.errors import ConfigError
from gptkit.extras import MissingExtra, require
from gptkit.hf import to_transformers
from gptkit.inference.decoding_layout import decoding_layout
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, KVCache, ModelConfig
from gptkit.threads import set_threads

# bench.parts: decode (the speed tables), quantize (quantized weights against the full model:
# bench/quantized.py), latent (multi-head latent attention's cache against the expanded one and MHA at a long
# context: bench/latent.py), speculative (plain vs speculative decoding: bench/speculative.py), llamacpp
# (decode per token against llama.cpp: bench/llamacpp.py)
PARTS = ("decode", "quantize", "latent", "speculative", "llamacpp")
# bench.cuda.sides: name -> what runs
SIDES = {
    "gptkit-eager": "gptkit, decode=eager (growing KV cache, one Python-launched step per token)",
    "gptkit-graph": "gptkit, decode=graph compile=false (static cache, the step captured as a CUDA graph)",
    "gptkit-compiled": "gptkit, decode=graph compile=true (the step compiled by torch.compile, then "
    "captured)",
    "transformers": "transformers generate(), its defaults (dynamic cache)",
    "transformers-static": 'transformers generate(cache_implementation="static"), which it compiles itself '
    "on CUDA",
}


def build_model(spec: dict):
    if not isinstance(spec, dict) or "preset" not in spec:
        raise ConfigError(
            f"a bench model must be a mapping with a preset (a conf/model name), got {spec!r}; "
            f"drop a model with ~bench.models.<name>"
        )
    spec = dict(spec)
    path = conf_dir() / "model" / f"{spec.pop('preset')}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown model preset {path.stem!r}; known: {', '.join(presets('model'))}")
    d = yaml.safe_load(path.read_text())
    d.update(spec)
    torch.manual_seed(0)
    return GPT(ModelConfig.from_dict(d)).eval()


# cpu: this process's CPU seconds
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass
class Rate:
    # decode tokens/s over the repeats
    median: float
    low: float
    high: float
    # median time(1 new token)
    first_token_s: float

    def text(self) -> str:
        return f"{self.median:,.0f} ({self.low:,.0f}-{self.high:,.0f})"


def measure(
    generate_n: Callable[[int], object],
    batch: int,
    new_tokens: int,
    repeats: int,
    clock=time.perf_counter,
    sync: Callable[[], None] = lambda: None,
) -> Rate:
    """Decode tokens/s of generate_n: one warm-up of each length, then `repeats` timed pairs."""
    return measure_interleaved([generate_n], batch, new_tokens, repeats, clock, sync)[0]


def measure_interleaved(
    fns: list[Callable[[int], object]],
    batch: int,
    new_tokens: int,
    repeats: int,
    clock=time.perf_counter,
    sync: Callable[[], None] = lambda: None,
) -> list[Rate]:
    """Decode tokens/s of each generate_n of `fns`: one warm-up of each length, then `repeats` rounds that
    time each in turn (A, B, A, B: the sides compared see the same load)."""

    def timed(generate_n, n: int) -> float:
        t0 = clock()
        generate_n(n)
        sync()
        return clock() - t0

    # warm-up: compiles, captures, fills caches
    for fn in fns:
        timed(fn, new_tokens), timed(fn, 1)
    rates: list[list[float]] = [[] for _ in fns]
    firsts: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            full, one = timed(fn, new_tokens), timed(fn, 1)
            # else the clock could not tell them apart (too few tokens for its resolution)
            if full > one:
                rates[i].append(batch * (new_tokens - 1) / (full - one))
            firsts[i].append(one)
    out = []
    for r, f in zip(rates, firsts):
        r = r or [float("nan")]
        out.append(Rate(statistics.median(r), min(r), max(r), statistics.median(f)))
    return out


def ours(model, prompt, batch: int, **options):
    """n -> the greedy new tokens per sample, from gptkit's generate()."""

    def run(n: int):
        g = generate(
            model, prompt, SampleOptions(max_new_tokens=n, temperature=0, num_samples=batch, **options)
        )
        # e.g. a fallback from decode=graph
        run.notes = g.notes
        return g.tokens

    run.notes = []
    return run


def hf_generate(hf_model, prompt, batch: int, static: bool = False):
    """n -> the greedy new tokens per sample, from transformers' generate()."""
    device = next(hf_model.parameters()).device
    ids = torch.tensor([prompt] * batch, device=device)  # [B, T0]
    mask = torch.ones_like(ids)
    extra = {"cache_implementation": "static"} if static else {}

    def run(n: int):
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                use_cache=True,
                **extra,
            )
        return out[:, len(prompt) :].tolist()

    return run


def same_tokens(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where two batches of token lists agree."""
    total = sum(len(x) for x in a)
    return sum(p == q for x, y in zip(a, b) for p, q in zip(x, y)) / max(total, 1)


def read_roofline(model, batch: int, context: int, repeats: int, clock=time.perf_counter) -> float:
    """Tokens/s if a decode step cost only reading its bytes (gptkit.accounting.decode_bytes_per_step: the
    weights once, the K/V at `context`) at the speed this process reads that many bytes here: a sum over a
    buffer of that size, timed like the steps (the median of `repeats` after one warm-up). On one CPU core a
    decode step of a small fp32 model is this read; no fp32 decoder gets past it."""
    n_bytes = decode_bytes_per_step(model.cfg, batch, context, "fp32")
    # touched: the pages exist before the timing
    buf = torch.ones(max(1, n_bytes // 4), dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeats):
        t0 = clock()
        buf.sum()
        times.append(clock() - t0)
    return batch / max(statistics.median(times), 1e-9)


def cached_steps(
    model, seq: torch.Tensor, context: int, steps: int, cache: KVCache
) -> Iterator[torch.Tensor]:
    """The decode steps of seq[:, context : context + steps] through `cache` (which holds seq[:, :context]),
    as generate() runs them: a step that takes the sequence past a longrope scaling's original context fills
    the cache again by one prefill over the whole sequence (GPT.rope_restart: the keys cached with the short
    factors are stale). Each step's logits [B, V] for the token after it."""
    for t in range(context, context + steps):
        if model.rope_restart(t, t + 1):
            cache.reset()
            yield model(seq[:, : t + 1], cache=cache, logits_to_keep=1).logits[:, -1]
        else:
            yield model(seq[:, t : t + 1], cache=cache, logits_to_keep=1).logits[:, -1]


def per_token_ms(model, context: int, steps: int, use_cache: bool, clock=time.perf_counter) -> float:
    """Mean ms of one decode step at `context` tokens of context (batch 1)."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, model.cfg.vocab_size, (1, context + steps), generator=g)  # [1, context + steps]
    # the weights as generate() lays them out
    with torch.inference_mode(), decoding_layout(model, 1):

        def run():
            if use_cache:
                cache = KVCache(model.cfg, 1, max_len=context + steps)
                model(seq[:, :context], cache=cache, logits_to_keep=1)
                t0 = clock()
                for _ in cached_steps(model, seq, context, steps, cache):
                    pass
            else:
                t0 = clock()
                for t in range(context, context + steps):
                    model(seq[:, : t + 1], logits_to_keep=1)
            return clock() - t0

        run()
        return min(run() for _ in range(2)) / steps * 1e3


def _console():
    # logs: whole rows, not wrapped cells
    return Console(width=None if sys.stdout.isatty() else 200)


def _need_transformers():
    require("transformers", "the transformers side (bench.hf=true; bench.hf=false measures without it) needs")
    return to_transformers


def _prompt(model, n: int) -> list[int]:
    return torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def run(cfg) -> int:
    if cfg.clock not in CLOCKS:
        raise ConfigError(f"bench.clock={cfg.clock!r} is not one of {', '.join(CLOCKS)}")
    parts = [str(p) for p in cfg.get("parts") or ("decode",)]
    wrong = [p for p in parts if p not in PARTS]
    if wrong:
        raise ConfigError(f"bench.parts: {', '.join(wrong)} is not one of {', '.join(PARTS)}")
    set_threads(cfg.threads, "bench.threads")
    device = str(cfg.device)
    if not (device == "cpu" or device.startswith("cuda")):
        raise ConfigError(f"bench.device={device!r} must be cpu or cuda (cuda:<n>)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("bench.device=cuda needs a CUDA GPU (torch sees none); use bench.device=cpu")
    results: dict = {}
    if "decode" in parts:
        results = run_cpu(cfg) if device == "cpu" else run_cuda(cfg, torch.device(device))
    if "quantize" in parts:
        dtype = "fp32" if device == "cpu" else str(cfg.cuda.dtype)
        results["quantize"] = quantized.run(cfg.quantize, device, dtype)
    if "latent" in parts:
        if device != "cpu":
            raise ConfigError("bench.parts=[latent] measures on the CPU: drop bench.device or set it to cpu")
        results["latent"] = latent.run(cfg.latent, CLOCKS[cfg.clock], _console(), build_model, per_token_ms)
    if "speculative" in parts:
        if device != "cpu":
            raise ConfigError(
                "bench.parts=[speculative] measures on the CPU: drop bench.device or set it to cpu"
            )
        results["speculative"] = speculative.run(cfg.speculative, CLOCKS[cfg.clock], _console(), build_model)
    if "llamacpp" in parts:
        if device != "cpu":
            raise ConfigError(
                "bench.parts=[llamacpp] measures on the CPU: drop bench.device or set it to cpu"
            )
        results["llamacpp"] = llamacpp.run(
            cfg.llamacpp, CLOCKS[cfg.clock], str(cfg.clock), _console(), build_model, measure_interleaved
        )
    if cfg.out:
        from gptkit.fsio import atomic_write_text

        atomic_write_text(Path(str(cfg.out)), json.dumps(results, indent=2))
        print(f"results: {cfg.out}")
    return 0


# ---- CPU -----------------------------------------------------------------------------------------
def run_cpu(cfg) -> dict:
    clock = CLOCKS[cfg.clock]
    specs = OmegaConf.to_container(cfg.models, resolve=True)
    con = _console()
    results: dict = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "clock": str(cfg.clock),
        "repeats": int(cfg.repeats),
        "decode": [],
        "context": [],
    }
    to_transformers = _need_transformers() if cfg.hf else None
    new_tokens, repeats = int(cfg.new_tokens), int(cfg.repeats)
    t = Table(
        title=f"decode tokens/s, greedy, prompt {cfg.prompt_tokens} + {new_tokens} new tokens, CPU, "
        f"{torch.get_num_threads()} threads, {cfg.clock} clock: median of {repeats} (min-max)"
    )
    for col in (
        "model",
        "params",
        "batch",
        "gptkit",
        "transformers",
        "speed-up",
        "same tokens",
        "read roofline",
    ):
        t.add_column(col, justify="left" if col == "model" else "right")
    models = {}
    for name, spec in specs.items():
        model = build_model(spec)
        models[name] = model
        hf_model = to_transformers(model) if to_transformers else None
        prompt = _prompt(model, int(cfg.prompt_tokens))
        for batch in cfg.batch_sizes:
            fn = ours(model, prompt, int(batch))
            hf_fn = hf_generate(hf_model, prompt, batch) if hf_model is not None else None
            # gptkit and transformers in turn, repeat by repeat
            mine, *theirs = measure_interleaved(
                [fn, *([hf_fn] if hf_fn else [])], batch, new_tokens, repeats, clock
            )
            row = {
                "model": name,
                "params": model.num_parameters(),
                "batch": batch,
                "gptkit_tokens_per_s": mine.median,
                "gptkit_min": mine.low,
                "gptkit_max": mine.high,
            }
            cells = ["-", "-", "-"]
            if hf_fn is not None:
                theirs = theirs[0]
                row.update(
                    transformers_tokens_per_s=theirs.median,
                    transformers_min=theirs.low,
                    transformers_max=theirs.high,
                    speed_up=mine.median / theirs.median,
                    same_tokens=same_tokens(fn(new_tokens), hf_fn(new_tokens)),
                )
                cells = [theirs.text(), f"{row['speed_up']:.2f}x", f"{row['same_tokens']:.0%}"]
            roof = read_roofline(
                model, int(batch), int(cfg.prompt_tokens) + new_tokens // 2, max(repeats, 3), clock
            )
            row.update(read_roofline_tokens_per_s=roof, gptkit_of_roofline=mine.median / roof)
            results["decode"].append(row)
            t.add_row(
                name,
                f"{row['params'] / 1e6:.1f}M",
                str(batch),
                mine.text(),
                *cells,
                f"{roof:,.0f} (gptkit {mine.median / roof:.0%})",
            )
    con.print(t)
    con.print(
        "read roofline: tokens/s if a step only read its weights and K/V once, at the speed this "
        "process reads that many bytes here (a sum over a buffer of that size)",
        style="dim",
    )

    model = (
        models[cfg.context_model] if cfg.context_model in models else build_model(specs[cfg.context_model])
    )
    ct = Table(title=f"{cfg.context_model}: ms per decode step (batch 1) against the context length")
    for col in ("context", "with KV cache", "no cache (whole prefix)", "ratio"):
        ct.add_column(col, justify="right")
    for ctx in cfg.context_lens:
        if ctx + int(cfg.context_steps) > model.cfg.max_seq_len:
            raise ConfigError(
                f"context {ctx} + {cfg.context_steps} steps exceeds max_seq_len={model.cfg.max_seq_len}"
            )
        cached = per_token_ms(model, int(ctx), int(cfg.context_steps), True, clock)
        full = per_token_ms(model, int(ctx), int(cfg.context_steps), False, clock)
        results["context"].append({"context": ctx, "cache_ms": cached, "no_cache_ms": full})
        ct.add_row(str(ctx), f"{cached:.2f}", f"{full:.2f}", f"{full / cached:.1f}x")
    con.print(ct)
    return results


# ---- CUDA ----------------------------------------------------------------------------------------
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _side(name: str, model, hf_model, prompt, batch: int):
    if name == "gptkit-eager":
        return ours(model, prompt, batch, decode="eager")
    if name == "gptkit-graph":
        return ours(model, prompt, batch, decode="graph", compile=False)
    if name == "gptkit-compiled":
        return ours(model, prompt, batch, decode="graph", compile=True)
    return hf_generate(hf_model, prompt, batch, static=name == "transformers-static")


def run_cuda(cfg, device) -> dict:
    """The GPU comparison (module docstring). `device` may be the CPU for a dry run of the pipeline."""
    c = cfg.cuda
    sides = list(c.sides)
    for s in sides:
        if s not in SIDES:
            raise ConfigError(f"bench.cuda.sides: {s!r} is not one of {', '.join(SIDES)}")
    if str(c.dtype) not in DTYPES:
        raise ConfigError(f"bench.cuda.dtype={c.dtype!r} is not one of {', '.join(DTYPES)}")
    dtype = getattr(torch, DTYPES[str(c.dtype)])
    con = _console()
    to_transformers = None
    if any(s.startswith("transformers") for s in sides):
        try:
            to_transformers = _need_transformers()
        # a GPU machine without transformers still measures gptkit's sides
        except MissingExtra:
            sides = [s for s in sides if not s.startswith("transformers")]
            con.print("note: transformers is not installed here: its sides are skipped")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    bandwidth = float(c.hbm_gbps) * 1e9 if c.hbm_gbps else memory_bandwidth(gpu)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    new_tokens, repeats, prompt_tokens = int(c.new_tokens), int(c.repeats), int(c.prompt_tokens)
    con.print(
        f"{gpu}: {c.dtype}, greedy, prompt {prompt_tokens} + {new_tokens} new tokens, median of "
        f"{repeats} (min-max); HBM "
        f"{'%.0f GB/s' % (bandwidth / 1e9) if bandwidth else 'unknown (set bench.cuda.hbm_gbps)'}"
    )
    for s in sides:
        con.print(f"  {s}: {SIDES[s]}")
    results: dict = {
        "device": gpu,
        "dtype": str(c.dtype),
        "new_tokens": new_tokens,
        "prompt_tokens": prompt_tokens,
        "repeats": repeats,
        "hbm_bytes_per_s": bandwidth,
        "decode": [],
    }
    for name, spec in OmegaConf.to_container(c.models, resolve=True).items():
        model = build_model(spec)
        hf_model = to_transformers(model).to(device=device, dtype=dtype) if to_transformers else None
        model.to(device=device, dtype=dtype)
        prompt = _prompt(model, prompt_tokens)
        for batch in c.batch_sizes:
            batch = int(batch)
            step_bytes = decode_bytes_per_step(
                model.cfg, batch, prompt_tokens + new_tokens // 2, str(c.dtype)
            )
            roofline = batch * bandwidth / step_bytes if bandwidth else None
            # the first side's tokens
            reference = None
            for side in sides:
                fn = _side(side, model, hf_model, prompt, batch)
                try:
                    rate = measure(fn, batch, new_tokens, repeats, sync=sync)
                except torch.cuda.OutOfMemoryError:
                    con.print(f"{name} batch {batch} {side}: out of memory")
                    torch.cuda.empty_cache()
                    continue
                tokens = fn(new_tokens)
                reference = reference or (side, tokens)
                row = {
                    "model": name,
                    "params": model.num_parameters(),
                    "batch": batch,
                    "side": side,
                    **{f"tokens_per_s_{k}": v for k, v in asdict(rate).items() if k != "first_token_s"},
                    "first_token_ms": rate.first_token_s * 1e3,
                    "roofline_tokens_per_s": roofline,
                    "roofline_fraction": rate.median / roofline if roofline else None,
                    "same_tokens_as": reference[0],
                    "same_tokens": same_tokens(reference[1], tokens),
                }
                results["decode"].append(row)
                con.print(
                    f"{name} batch {batch} {side}: {rate.text()} tokens/s, first token "
                    f"{row['first_token_ms']:.1f} ms"
                    + (
                        f", {row['roofline_fraction']:.1%} of the HBM roofline ({roofline:,.0f})"
                        if roofline
                        else ""
                    )
                    + f", {row['same_tokens']:.0%} same tokens as {reference[0]}"
                )
                for note in getattr(fn, "notes", []):
                    con.print(f"  note: {note}")
        del model, hf_model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    t = Table(
        title=f"{gpu}: decode tokens/s, {c.dtype}, greedy, prompt {prompt_tokens} + {new_tokens} new "
        f"tokens, median of {repeats} (min-max)"
    )
    for col in (
        "model",
        "batch",
        "side",
        "tokens/s",
        "first token ms",
        "HBM roofline",
        "vs transformers",
        "vs transformers-static",
        "same tokens",
    ):
        t.add_column(col, justify="left" if col in ("model", "side") else "right")
    rows = results["decode"]
    for row in rows:

        def vs(other: str) -> str:
            base = [
                r for r in rows if (r["model"], r["batch"], r["side"]) == (row["model"], row["batch"], other)
            ]
            return f"{row['tokens_per_s_median'] / base[0]['tokens_per_s_median']:.2f}x" if base else "-"

        t.add_row(
            row["model"],
            str(row["batch"]),
            row["side"],
            f"{row['tokens_per_s_median']:,.0f} "
            f"({row['tokens_per_s_low']:,.0f}-{row['tokens_per_s_high']:,.0f})",
            f"{row['first_token_ms']:.1f}",
            f"{row['roofline_fraction']:.1%}" if row["roofline_fraction"] is not None else "-",
            vs("transformers"),
            vs("transformers-static"),
            f"{row['same_tokens']:.0%}",
        )
    con.print(t)
    return results
