"""Benchmarks print a table (and write JSON with out=...); numbers in the README come from these.

Examples:
  gptkit bench attention            (GPU: Triton vs SDPA flash vs eager, TFLOP/s)
  gptkit bench data                 (tokenizer MB/s, batch cost vs a training step)
  gptkit bench train                (Lightning loop vs a bare PyTorch loop)
  gptkit bench sample               (decode tokens/s vs transformers generate(); bench.device=cuda on a GPU;
                                     quantize=int8|nf4|int4 against the full model: perplexity, agreement;
                                     parts=[llamacpp]: ms per token vs llama.cpp f32 and Q8_0)
  gptkit bench serve                (gptkit serve: 1/4/16 clients vs one at a time vs transformers' batching)
  gptkit bench sft                  (experiment=sft-tiny end to end: held-out exact match before and after)
  gptkit bench dpo                  (experiment=dpo-tiny, full and LoRA: held-out preference before and after)
  gptkit bench grpo                 (experiment=grpo-tiny: held-out exact match before and after)
  gptkit bench lora                 (finetune=lora vs full: trainable parameters, checkpoint, memory, speed)
  gptkit bench qlora                (finetune=qlora: base memory vs bf16, loss and speed vs lora, NF4's error)
  gptkit bench optim                (AdamW vs Muon: one lr grid swept for each, the best of each on 3 seeds)
  gptkit bench compare              (variants of one model side by side at equal steps: val loss, step time)
  gptkit bench memory               (activation checkpointing none/full/selective and offload: kept and peak
                                     bytes at one shape, loss and gradients against the plain step)
  gptkit bench long-context         (gdn-tiny vs every layer softmax at 4k-16k: train, memory, decode, cache)
Every benchmark ends with a line of its wall and CPU seconds and the machine's load before and after it.
"""

from __future__ import annotations

import importlib
import sys

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def prepare_args(args: list[str]) -> list[str]:
    """Options belong to the chosen benchmark: `out=x.json` means `bench.out=x.json`."""
    out = []
    for a in args:
        key = a.split("=", 1)[0]
        if (
            "=" in a
            and not a.startswith(("-", "+", "~", "hydra"))
            and key != "bench"
            and not key.startswith("bench.")
        ):
            a = f"bench.{a}"
        out.append(a)
    return out


def run(cfg) -> int:
    """The benchmark's own run(), then one line on stderr: its wall and CPU seconds, and the machine's load
    before and after it (gptkit/bench/measure.py)."""
    from gptkit.errors import ConfigError
    from gptkit.extras import missing_extra

    what = cfg.bench.name
    try:
        mod = importlib.import_module(f"gptkit.bench.{what}")
    except ModuleNotFoundError as exc:
        # a benchmark that is there, missing a package it imports: that package's line (gptkit.extras)
        if exc.name != f"gptkit.bench.{what}":
            extra = missing_extra(exc, f"gptkit bench {what} needs")
            if extra is None:
                raise
            raise extra from None
        raise ConfigError(f"no benchmark named {what!r}") from exc
    from gptkit.bench.measure import Usage

    usage = Usage().start()
    code = int(mod.run(cfg.bench) or 0)
    # one line at the end (a benchmark refused for bad input prints only its error)
    print(usage.stop().line(f"gptkit bench {what}"), file=sys.stderr, flush=True)
    return code
