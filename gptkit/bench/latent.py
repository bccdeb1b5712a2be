"""`gptkit bench sample bench.parts=[latent]`: multi-head latent attention's decode at a long context on the
CPU, three sides of equal parameters (bench.latent.models):

    mla            model.attention_kind=mla, decoding through the latent cache (the absorbed path: the cache
                   keeps kv_lora_rank + qk_rope_head_dim numbers per token per layer)
    mla-expanded   the same weights, model.mla.absorb=false: each head's expanded key and value cached
                   (transformers' DeepseekV3 layout: n_heads * (qk_nope + qk_rope + v_head_dim) per token
                   per layer)
    mha            multi-head attention of (about) the same parameter count (its own random weights)

For each: the bytes its KVCache allocates for bench.latent.context positions (batch 1, fp32, read from the
cache's tensors) and count-params' KV figure for them, and the decode tokens/s of a step at that context
(batch 1, the CPU decoding layout, gptkit/bench/decode.py per_token_ms: the mean of bench.latent.steps steps
after the prefill, the best of two runs), the sides in turn for bench.latent.repeats rounds (median, min-max).
The mla sides' greedy tokens from a short prompt must agree (the same math in another order).
"""

from __future__ import annotations

import statistics

import torch
from omegaconf import OmegaConf
from rich.table import Table

from gptkit import accounting
from gptkit.errors import ConfigError
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import KVCache
from gptkit.model.attention_kinds import cache_layout


def cache_bytes(model, context: int) -> int:
    """Bytes of the K/V tensors a batch-1 KVCache of `context` positions allocates for `model`."""
    cache = KVCache(model.cfg, 1, max_len=context)
    return sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v) if t is not None)


def run(cfg, clock, console, build_model, per_token_ms) -> dict:
    """The table and the results' `latent` entry (see the module docstring); build_model and per_token_ms
    are gptkit/bench/decode.py's (which calls this)."""
    specs = OmegaConf.to_container(cfg.models, resolve=True)
    context, steps, repeats = int(cfg.context), int(cfg.steps), int(cfg.repeats)
    models = {name: build_model(spec) for name, spec in specs.items()}
    for name, model in models.items():
        if context + steps > model.cfg.max_seq_len:
            raise ConfigError(
                f"bench.latent: context {context} + {steps} steps exceeds {name}'s max_seq_len="
                f"{model.cfg.max_seq_len}; raise bench.latent.models.{name}.max_seq_len"
            )
    # the expanded side decodes the latent side's weights
    if "mla" in models and "mla-expanded" in models:
        models["mla-expanded"].load_state_dict(models["mla"].state_dict())
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            times[name].append(per_token_ms(model, context, steps, True, clock))
    rows = []
    for name, model in models.items():
        tps = sorted(1e3 / ms for ms in times[name])
        rows.append(
            {
                "model": name,
                "params": model.num_parameters(),
                "cached_per_token_per_layer": cache_layout(model.cfg, 0).per_position,
                "kv_cache_bytes": cache_bytes(model, context),
                "kv_cache_bytes_count_params": accounting.kv_cache_bytes(model.cfg, context, "fp32"),
                "tokens_per_s": statistics.median(tps),
                "tokens_per_s_min": tps[0],
                "tokens_per_s_max": tps[-1],
            }
        )
    same = None
    if "mla" in models and "mla-expanded" in models:
        prompt = torch.randint(
            0, models["mla"].cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(1)
        )
        opts = SampleOptions(max_new_tokens=32, temperature=0.0)
        a, b = (generate(models[n], prompt.tolist(), opts).tokens for n in ("mla", "mla-expanded"))
        same = a == b
    t = Table(
        title=f"decode at context {context}, batch 1, fp32, CPU, {torch.get_num_threads()} threads: tokens/s "
        f"median of {repeats} (min-max), each the mean of {steps} steps"
    )
    for col in ("model", "params", "cached / token / layer", "KV cache", "tokens/s"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        t.add_row(
            r["model"],
            f"{r['params']:,}",
            str(r["cached_per_token_per_layer"]),
            f"{r['kv_cache_bytes'] / 2**20:.2f} MiB",
            f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f})",
        )
    console.print(t)
    if same is not None:
        console.print(f"mla and mla-expanded greedy tokens (32 from a 16-token prompt) the same: {same}")
    return {"context": context, "steps": steps, "repeats": repeats, "rows": rows, "same_tokens": same}
