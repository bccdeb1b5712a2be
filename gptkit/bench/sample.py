"""gptkit bench sample: decode speed of our KV-cache loop against transformers generate().

1. For each model (random init, the same weights loaded into LlamaForCausalLM / GPT2LMHeadModel
   through gptkit.hf.to_transformers) and batch size: greedy generation of new_tokens after a
   prompt_tokens prompt, on both sides. Decode tokens/s = batch * (new_tokens - 1) /
   (time(new_tokens) - time(1 new token)): the prefill cancels out, the same measure for both.
   The greedy tokens of both sides are compared (they should agree: same weights, same math).
2. Per-token decode time against the context length: one step through the cache (attention over
   the cached keys) vs a no-cache loop that re-runs the whole prefix every step (both with the
   weight layout generate() decodes with).
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def build_model(spec: dict):
    import torch
    import yaml

    from gptkit.config import conf_dir, presets
    from gptkit.errors import ConfigError
    from gptkit.model import GPT, ModelConfig

    if not isinstance(spec, dict) or "preset" not in spec:
        raise ConfigError(f"a bench model must be a mapping with a preset (a conf/model name), got {spec!r}; "
                          f"drop a model with ~bench.models.<name>")
    spec = dict(spec)
    path = conf_dir() / "model" / f"{spec.pop('preset')}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown model preset {path.stem!r}; known: {', '.join(presets('model'))}")
    d = yaml.safe_load(path.read_text())
    d.update(spec)
    torch.manual_seed(0)
    return GPT(ModelConfig.from_dict(d)).eval()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU seconds


def _best(fn, repeats: int, clock) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def decode_rate(generate_n, batch: int, new_tokens: int, repeats: int, clock=time.perf_counter) -> float:
    """tokens/s of the decode phase: batch * (n - 1) tokens in time(n) - time(1)."""
    full = _best(lambda: generate_n(new_tokens), repeats, clock)
    one = _best(lambda: generate_n(1), repeats, clock)
    return batch * (new_tokens - 1) / max(full - one, 1e-9)


def ours(model, prompt, batch: int):
    from gptkit.generate import SampleOptions, generate

    def run(n: int):
        return generate(model, prompt, SampleOptions(max_new_tokens=n, temperature=0, num_samples=batch))

    return run


def hf_generate(hf_model, prompt, batch: int):
    import torch

    ids = torch.tensor([prompt] * batch)  # [B, T0]
    mask = torch.ones_like(ids)

    def run(n: int):
        with torch.inference_mode():
            return hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)

    return run


def per_token_ms(model, context: int, steps: int, use_cache: bool, clock=time.perf_counter) -> float:
    """Mean ms of one decode step at `context` tokens of context (batch 1)."""
    import torch

    from gptkit.generate import decoding_layout
    from gptkit.model import KVCache

    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, model.cfg.vocab_size, (1, context + steps), generator=g)  # [1, context + steps]
    with torch.inference_mode(), decoding_layout(model, 1):  # the weights as generate() lays them out
        def run():
            if use_cache:
                cache = KVCache(model.cfg, 1, max_len=context + steps)
                model(seq[:, :context], cache=cache, logits_to_keep=1)
                t0 = clock()
                for t in range(context, context + steps):
                    model(seq[:, t : t + 1], cache=cache, logits_to_keep=1)
            else:
                t0 = clock()
                for t in range(context, context + steps):
                    model(seq[:, : t + 1], logits_to_keep=1)
            return clock() - t0

        run()
        return min(run() for _ in range(2)) / steps * 1e3


def run(cfg) -> int:
    import torch
    from omegaconf import OmegaConf
    from rich.console import Console
    from rich.table import Table

    from gptkit.errors import ConfigError
    from gptkit.threads import set_threads

    if str(cfg.device) != "cpu":
        raise ConfigError("bench sample measures CPU decoding; set bench.device=cpu")
    set_threads(cfg.threads, "bench.threads")
    if cfg.clock not in CLOCKS:
        raise ConfigError(f"bench.clock={cfg.clock!r} is not one of {', '.join(CLOCKS)}")
    clock = CLOCKS[cfg.clock]
    specs = OmegaConf.to_container(cfg.models, resolve=True)
    con = Console()
    results: dict = {"threads": torch.get_num_threads(), "clock": str(cfg.clock), "decode": [], "context": []}
    if cfg.hf:
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            raise ConfigError("bench.hf=true needs transformers (pip install gptkit[test]); "
                              "or set bench.hf=false") from exc
        from gptkit.hf import to_transformers

    t = Table(title=f"decode tokens/s, greedy, prompt {cfg.prompt_tokens} + {cfg.new_tokens} new tokens, "
                    f"CPU, {torch.get_num_threads()} threads, {cfg.clock} clock (best of {cfg.repeats})")
    for col in ("model", "params", "batch", "gptkit", "transformers", "speed-up", "same tokens"):
        t.add_column(col, justify="right" if col not in ("model",) else "left")
    models = {}
    for name, spec in specs.items():
        model = build_model(spec)
        models[name] = model
        hf_model = to_transformers(model) if cfg.hf else None
        prompt = torch.randint(0, model.cfg.vocab_size, (int(cfg.prompt_tokens),),
                               generator=torch.Generator().manual_seed(1)).tolist()
        for batch in cfg.batch_sizes:
            fn = ours(model, prompt, int(batch))
            ours_rate = decode_rate(fn, batch, int(cfg.new_tokens), int(cfg.repeats), clock)
            row = {"model": name, "params": model.num_parameters(), "batch": batch, "gptkit_tokens_per_s": ours_rate}
            if hf_model is not None:
                hf_fn = hf_generate(hf_model, prompt, batch)
                row["transformers_tokens_per_s"] = decode_rate(hf_fn, batch, int(cfg.new_tokens), int(cfg.repeats),
                                                               clock)
                mine = fn(int(cfg.new_tokens)).tokens
                theirs = hf_fn(int(cfg.new_tokens))[:, len(prompt):].tolist()
                row["same_tokens"] = sum(a == b for x, y in zip(mine, theirs) for a, b in zip(x, y)) / (
                    batch * int(cfg.new_tokens))
            results["decode"].append(row)
            hf_rate = row.get("transformers_tokens_per_s")
            t.add_row(name, f"{row['params'] / 1e6:.1f}M", str(batch), f"{ours_rate:,.0f}",
                      f"{hf_rate:,.0f}" if hf_rate else "-", f"{ours_rate / hf_rate:.2f}x" if hf_rate else "-",
                      f"{row['same_tokens']:.0%}" if hf_rate else "-")
    con.print(t)

    model = models[cfg.context_model] if cfg.context_model in models else build_model(specs[cfg.context_model])
    ct = Table(title=f"{cfg.context_model}: ms per decode step (batch 1) against the context length")
    for col in ("context", "with KV cache", "no cache (whole prefix)", "ratio"):
        ct.add_column(col, justify="right")
    for ctx in cfg.context_lens:
        if ctx + int(cfg.context_steps) > model.cfg.max_seq_len:
            raise ConfigError(f"context {ctx} + {cfg.context_steps} steps exceeds max_seq_len={model.cfg.max_seq_len}")
        cached = per_token_ms(model, int(ctx), int(cfg.context_steps), True, clock)
        full = per_token_ms(model, int(ctx), int(cfg.context_steps), False, clock)
        results["context"].append({"context": ctx, "cache_ms": cached, "no_cache_ms": full})
        ct.add_row(str(ctx), f"{cached:.2f}", f"{full:.2f}", f"{full / cached:.1f}x")
    con.print(ct)
    if cfg.out:
        from gptkit.fsio import atomic_write_text

        atomic_write_text(Path(str(cfg.out)), json.dumps(results, indent=2))
        con.print(f"results: {cfg.out}")
    return 0
