"""`gptkit bench sample bench.parts=[speculative]`: the plain greedy decode against speculative decoding
(gptkit/inference/speculative.py) on the same model, side by side, CPU, batch 1.

Each draft in bench.speculative.drafts runs against the plain eager loop on the same prompt (a pattern of
`pattern` random tokens repeated up to prompt_tokens: prompt lookup finds its n-grams), each repeat timing
both in turn (the same load on both); the table shows the median wall seconds of each, the ratio plain /
speculative (> 1: speculative is faster), the acceptance, the tokens per target forward, and whether the
tokens are the same (greedy: they must be).
  self    the model drafts for itself: every proposal accepted (the acceptance's upper bound), at the cost of
          k draft forwards per k + 1 tokens
  ngram   prompt lookup: no draft model, the context's own n-grams
"""

from __future__ import annotations

import statistics

import torch
from rich.table import Table

from gptkit.errors import ConfigError
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.inference.speculative import ModelDrafter, NgramDrafter, Speculator

DRAFTS = ("self", "ngram")


def _drafter(name: str, model):
    if name == "self":
        return ModelDrafter(model, "self")
    if name == "ngram":
        return NgramDrafter()
    raise ConfigError(f"bench.speculative.drafts: {name!r} is not one of {', '.join(DRAFTS)}")


def run(cfg, clock, con, build_model) -> dict:
    from omegaconf import OmegaConf

    specs = OmegaConf.to_container(cfg.models, resolve=True)
    return {name: _one(name, spec, cfg, clock, con, build_model) for name, spec in specs.items()}


def _one(name: str, spec: dict, cfg, clock, con, build_model) -> dict:
    model = build_model(spec)
    n_new, k, repeats = int(cfg.new_tokens), int(cfg.k), int(cfg.repeats)
    gen = torch.Generator().manual_seed(1)
    pattern = torch.randint(0, model.cfg.vocab_size, (int(cfg.pattern),), generator=gen).tolist()
    prompt = (pattern * (int(cfg.prompt_tokens) // len(pattern) + 1))[: int(cfg.prompt_tokens)]
    if len(prompt) + n_new > model.cfg.max_seq_len:
        raise ConfigError(
            f"bench.speculative: prompt_tokens + new_tokens = {len(prompt) + n_new} > the model's "
            f"max_seq_len {model.cfg.max_seq_len} (the window would slide); lower them or raise the model's"
        )
    opts = SampleOptions(max_new_tokens=n_new, temperature=0, decode="eager")
    drafters = {str(d): _drafter(str(d), model) for d in cfg.drafts}
    # warm-up: the first forward of each shape pays for allocations
    generate(model, prompt, SampleOptions(max_new_tokens=4, temperature=0, decode="eager"))
    times: dict[str, list[float]] = {"plain": [], **{d: [] for d in drafters}}
    figures: dict[str, dict] = {}
    for _ in range(repeats):
        t = clock()
        plain = generate(model, prompt, opts)
        times["plain"].append(clock() - t)
        for d, drafter in drafters.items():
            t = clock()
            g = generate(model, prompt, opts, speculate=Speculator(drafter, k))
            times[d].append(clock() - t)
            figures[d] = {**g.speculative, "same_tokens": g.tokens == plain.tokens}
    plain_s = statistics.median(times["plain"])
    params = sum(p.numel() for p in model.parameters())
    table = Table(
        title=f"{name} ({params / 1e6:.1f}M parameters): plain vs speculative greedy decode, {len(prompt)} "
        f"prompt tokens, {n_new} new, draft_k={k}, batch 1, CPU"
    )
    for col in ("draft", "plain s", "speculative s", "ratio", "acceptance", "tokens/forward", "same tokens"):
        table.add_column(col)
    rows = {}
    for d in drafters:
        s = statistics.median(times[d])
        f = figures[d]
        rows[d] = {"plain_s": plain_s, "speculative_s": s, "ratio": plain_s / s, **f}
        table.add_row(
            d,
            f"{plain_s:.3f}",
            f"{s:.3f}",
            f"{plain_s / s:.2f}x",
            f"{f['acceptance']:.2f}",
            f"{f['tokens_per_forward']:.2f}",
            str(f["same_tokens"]),
        )
    con.print(table)
    return {"model": spec, "prompt_tokens": len(prompt), "new_tokens": n_new, "k": k, "drafts": rows}
