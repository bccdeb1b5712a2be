"""Does optim=muon pay for LoRA? AdamW and Muon fine-tune the same LoRA adapters from the same base, through
`gptkit bench optim` (one lr grid for both, the best of each on 3 seeds, side by side).

    python .ci/muon_lora.py

The base: llama-tiny trained with its defaults (600 steps, the default corpus: pydoc, byte tokenizer) in
runs/bench-lora-muon/base, made once. The fine-tune: shakespeare (a text the base has not seen), rank 8 on
all seven projections, 300 steps, validated every 25. Runs and results stay under runs/bench-lora-muon.
"""

import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from gptkit.bench.optim import run

RUNS = Path("runs/bench-lora-muon")
LRS = [1.0e-3, 3.0e-3, 6.0e-3, 1.0e-2, 1.6e-2, 3.0e-2]


def main() -> int:
    if not (RUNS / "base" / "checkpoints" / "last.ckpt").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gptkit",
                "train",
                "model=llama-tiny",
                "name=base",
                f"runs_dir={RUNS}",
                "trainer.progress=false",
            ],
            check=True,
        )
    recipe = [
        f"init_from={RUNS / 'base'}",
        "finetune=lora",
        "data=shakespeare",
        "lora.rank=8",
        "lora.alpha=16",
        "lora.targets=[q,k,v,o,gate,up,down]",
    ]
    cfg = OmegaConf.create(
        {
            "recipes": {"lora": recipe},
            "optimizers": {"adamw": ["optim=adamw"], "muon": ["optim=muon"]},
            "lrs": LRS,
            "seeds": [1, 2, 3],
            "baseline": "adamw",
            "parallel": 2,
            "common": ["trainer.max_steps=300", "trainer.val_every=25"],
            "runs_dir": str(RUNS),
            "out": str(RUNS / "results.json"),
        }
    )
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
