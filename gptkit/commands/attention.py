"""Draw the attention probabilities of every layer and head for a text, as one PNG grid
(rows: layers, columns: heads; each cell query (y) vs key (x), token labels where they fit),
written into the run folder. Uses the eager backend's fp32 softmax.

Examples:
  gptkit attention run=runs/shakespeare text="ROMEO: But soft, what light"
  gptkit attention run=runs/shakespeare text="To be, or not to be" out=tobe.png
"""

from __future__ import annotations

import json

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def run(cfg) -> int:
    from gptkit.errors import ConfigError
    from gptkit.runs import find_run_checkpoint, load_for_inference

    if cfg.format not in ("text", "json"):
        raise ConfigError(f"format={cfg.format!r} must be text or json")
    if str(cfg.text) == "":
        raise ConfigError('attention needs a text to look at: text="..." (at least one character)')
    # the run first, torch after (gptkit.inference.generate, the device, the model): a run= that is not one is
    # one line in 0.24 s of CPU, not 3.3 s (issue 47 item 12, docs/benchmarks.md)
    ckpt = find_run_checkpoint(cfg.run)
    from gptkit.evaluation.attention_maps import mean_entropy_bits, write_for_run
    from gptkit.inference.generate import encode_prompt, special_token_ids

    r = load_for_inference(ckpt, cfg.device, "fp32", "eager")
    bos_id, _ = special_token_ids(r.tokenizer, r.config)
    ids = encode_prompt(r.tokenizer, str(cfg.text), bos_id)
    path, probs = write_for_run(r, ids, cfg.out)
    if cfg.format == "json":
        print(
            json.dumps(
                {
                    "path": str(path),
                    "tokens": len(ids),
                    "layers": len(probs),
                    "heads": int(next(p for p in probs if p is not None).shape[0]),
                    "mean_entropy_bits": mean_entropy_bits(probs),
                },
                indent=2,
            )
        )
    else:
        print(path)
    return 0
