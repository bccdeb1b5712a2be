"""Does optim=muon pay for LoRA? AdamW and Muon fine-tune the same LoRA adapters from the same base, through
`gptkit bench optim` (its steps-to-target, time ratio and equal-time loss, medians over seeds).

    python .ci/muon_lora.py sweep                 seed 1, both optimizers at each lr of LRS
    python .ci/muon_lora.py seeds ADAMW_LR MUON_LR   seeds 1-3 at the chosen lrs

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
LRS = ["1.0e-3", "3.0e-3", "6.0e-3", "1.0e-2", "1.6e-2", "3.0e-2"]


def recipe(lr: str) -> list[str]:
    return [
        f"init_from={RUNS / 'base'}",
        "finetune=lora",
        "data=shakespeare",
        "lora.rank=8",
        "lora.alpha=16",
        "lora.targets=[q,k,v,o,gate,up,down]",
        f"optim.lr={lr}",
    ]


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
    if sys.argv[1] == "sweep":
        recipes = {f"lr{lr}": recipe(lr) for lr in LRS}
        muon = {f"lr{lr}": ["optim=muon", f"optim.lr={lr}"] for lr in LRS}
        seeds, out = [1], RUNS / "sweep.json"
    else:
        adamw_lr, muon_lr = sys.argv[2], sys.argv[3]
        recipes = {"lora": recipe(adamw_lr)}
        muon = {"lora": ["optim=muon", f"optim.lr={muon_lr}"]}
        seeds, out = [1, 2, 3], RUNS / f"seeds-{adamw_lr}-{muon_lr}.json"
    cfg = OmegaConf.create(
        {
            "recipes": recipes,
            "muon": muon,
            "seeds": seeds,
            "parallel": 2,
            "common": ["trainer.max_steps=300", "trainer.val_every=25"],
            "runs_dir": str(RUNS),
            "out": str(out),
        }
    )
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
