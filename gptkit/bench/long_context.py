"""`gptkit bench long-context`: a hybrid of linear-attention and softmax layers (gdn-tiny: three Gated
DeltaNet layers, one softmax layer) against the same model with every layer softmax, at long contexts on the
CPU (conf/bench/long-context.yaml; docs/linear-attention.md#long-context). At each context T of
bench.contexts:

    training   `gptkit bench compare` (gptkit/bench/compare.py) of bench.variants on every seed, the variants
               of a seed side by side, one thread each; a row is one window of T tokens (model.max_seq_len=T,
               trainer.batch_size=1), every run the context's steps, in <runs_dir>/ctx<T>: the final val loss
               at equal steps, the training seconds and their ratio to the baseline's run beside it, the peak
               memory each run measured (perf/memory_peak: its peak RSS above its RSS before the model was
               built, training/peak_memory.py), the load before and after each run
    decoding   in this process, one thread: each variant's run of the first seed, its ms per decode step at
               positions T - decode_steps .. T - 1 after a prefill of the positions before (batch 1, the CPU
               decoding layout: gptkit/bench/decode.py per_token_ms, the best of two after a warm-up), the
               variants in turn for decode_repeats rounds (tokens/s: median, min-max); and the bytes one
               sequence's cache keeps at T tokens, fp32, computed from the model's cache layout
               (accounting.kv_cache_bytes: a softmax layer's K and V of T positions, a linear layer's state)
               and read from the tensors a KVCache of T positions allocates (K, V, states), which must agree.

Losses do not depend on the machine's load; seconds do (the ratios of runs side by side much less).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gptkit import accounting
from gptkit.bench import compare
from gptkit.bench.decode import CLOCKS, per_token_ms
from gptkit.bench.measure import loadavg
from gptkit.errors import ConfigError, GptkitError
from gptkit.model import KVCache
from gptkit.runs import load_model
from gptkit.threads import set_threads

KEYS = ("context", "steps", "warmup_steps", "val_windows")


def check(cfg) -> list[dict]:
    """bench.contexts as dicts of KEYS, each a positive integer (decode_steps fewer than the context)."""
    if cfg.clock not in CLOCKS:
        raise ConfigError(f"bench.clock={cfg.clock!r} is not one of {', '.join(CLOCKS)}")
    contexts = OmegaConf.to_container(cfg.contexts, resolve=True) if cfg.contexts else None
    if not contexts:
        raise ConfigError("bench.contexts must not be empty")
    for c in contexts:
        if not isinstance(c, dict) or set(c) != set(KEYS):
            raise ConfigError(f"bench.contexts holds {c!r}; give each as {{{', '.join(KEYS)}}}")
        bad = [k for k in KEYS if isinstance(c[k], bool) or not isinstance(c[k], int) or c[k] < 1]
        if bad:
            raise ConfigError(f"bench.contexts: {c!r} has {', '.join(bad)} not an integer >= 1")
        if c["warmup_steps"] >= c["steps"]:
            raise ConfigError(f"bench.contexts: {c!r} has warmup_steps >= steps")
        if c["context"] <= int(cfg.decode_steps):
            raise ConfigError(
                f"bench.contexts: context {c['context']} <= bench.decode_steps={cfg.decode_steps}"
            )
    return contexts


def compare_cfg(cfg, c: dict):
    """The `gptkit bench compare` of one context."""
    T = c["context"]
    return OmegaConf.create(
        {
            "model": [*cfg.model, f"model.max_seq_len={T}"],
            "variants": OmegaConf.to_container(cfg.variants, resolve=True),
            "baseline": cfg.baseline,
            "seeds": list(cfg.seeds),
            "common": [
                *cfg.common,
                f"trainer.max_steps={c['steps']}",
                f"trainer.val_every={c['steps']}",
                f"trainer.val_windows={c['val_windows']}",
                f"optim.warmup_steps={c['warmup_steps']}",
            ],
            "parallel": cfg.parallel,
            "runs_dir": str(Path(cfg.runs_dir) / f"ctx{T}"),
        }
    )


def cache_bytes(model, context: int) -> tuple[int, int]:
    """(by the cache layout, allocated): the bytes one sequence's fp32 cache keeps at `context` tokens."""
    cache = KVCache(model.cfg, 1, max_len=context)
    allocated = sum(
        t.numel() * t.element_size() for t in (*cache.k, *cache.v, *cache.states) if t is not None
    )
    return accounting.kv_cache_bytes(model.cfg, context, "fp32"), allocated


def decode(cfg, ccfg, T: int) -> dict:
    """Each variant's decode tokens/s at T and its cache bytes (module docstring)."""
    steps, clock = int(cfg.decode_steps), CLOCKS[cfg.clock]
    seed = int(cfg.seeds[0])
    models = {}
    for v in cfg.variants:
        run_dir = Path(ccfg.runs_dir) / compare.run_name(v, seed)
        models[v] = load_model(run_dir, "cpu")[4]
    times: dict[str, list[float]] = {v: [] for v in models}
    for _ in range(int(cfg.decode_repeats)):
        for v, model in models.items():
            times[v].append(per_token_ms(model, T - steps, steps, True, clock))
    out = {}
    for v, model in models.items():
        tps = sorted(1e3 / ms for ms in times[v])
        layout, allocated = cache_bytes(model, T)
        if layout != allocated:
            raise GptkitError(
                f"{v} at {T}: the cache layout counts {layout:,} bytes, a KVCache allocates {allocated:,}"
            )
        out[v] = {
            "params": model.num_parameters(),
            "layer_types": [model.cfg.attention_kind_of(i) for i in range(model.cfg.n_layers)],
            "tokens_per_s": {"median": statistics.median(tps), "min": tps[0], "max": tps[-1]},
            "cache_bytes_layout": layout,
            "cache_bytes_allocated": allocated,
        }
    return out


def run(cfg) -> int:
    contexts = check(cfg)
    set_threads(1, "bench.threads")
    con = Console(width=None if sys.stdout.isatty() else 200, highlight=False)
    results = []
    for c in contexts:
        T, ccfg = c["context"], compare_cfg(cfg, c)
        load_before = loadavg()
        con.print(f"context {T}: {c['steps']} steps of 1 x {T} tokens, seeds {list(cfg.seeds)}")
        train = compare.measure(ccfg, con)
        load_trained = loadavg()
        dec = decode(cfg, ccfg, T)
        results.append(
            {
                **c,
                "load_before": load_before,
                "load_trained": load_trained,
                "load_after": loadavg(),
                "train": train,
                "decode": dec,
            }
        )
    report(con, cfg, results)
    if cfg.out:
        from gptkit.fsio import atomic_write_text

        atomic_write_text(cfg.out, json.dumps({"seeds": list(cfg.seeds), "contexts": results}, indent=2))
    return 0


def report(con: Console, cfg, results: list[dict]) -> None:
    def fmt(s, f="{:.4f}", scale=1.0):
        if s is None:
            return "-"
        lo, med, hi = (f.format(s[k] * scale) for k in ("min", "median", "max"))
        return f"{med} ({lo}-{hi})"

    t = Table(
        title=f"{escape(' '.join(cfg.model))} against every layer softmax, CPU, 1 thread per run, median "
        f"(min-max) over seeds {list(cfg.seeds)}; decode: the first seed's run, batch 1, {cfg.decode_steps} "
        f"steps before T, {cfg.clock} clock, median of {cfg.decode_repeats}"
    )
    for col in (
        "T",
        "variant",
        "params",
        "val loss",
        "by seed",
        "train s / step",
        f"wall / {cfg.baseline}",
        f"CPU / {cfg.baseline}",
        "peak MiB",
        "decode tok/s",
        "cache + state / seq",
        "load",
    ):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for r in results:
        for v, x in r["train"].items():
            d = r["decode"][v]
            t.add_row(
                f"{r['context']:,}",
                v,
                f"{d['params']:,}",
                fmt(x["final_val_loss"]),
                " ".join(f"{loss:.4f}" for loss in x["final_val_loss_by_seed"].values()),
                fmt(x["train_seconds"], "{:.2f}", 1 / r["steps"]),
                fmt(x["wall_ratio"], "{:.2f}"),
                fmt(x["cpu_ratio"], "{:.2f}"),
                fmt(x["memory_peak"], "{:.0f}", 2**-20),
                fmt(d["tokens_per_s"], "{:.1f}"),
                f"{d['cache_bytes_allocated'] / 2**20:.2f} MiB",
                f"{r['load_before']} -> {r['load_after']}",
            )
    con.print(t)
    con.print(
        "cache + state: one sequence's fp32 cache at T tokens, by the cache layout = the tensors a KVCache "
        "allocates (checked); peak MiB: each run's peak RSS above its RSS before the model was built",
        style="dim",
    )
