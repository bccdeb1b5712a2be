"""optim=muon through the CLI, 2 gloo CPU processes (DDP, FSDP2) against one, for both optim.muon.ns_dtype:
the largest difference of the logged train loss over the steps.

    python .ci/muon_world_sizes.py [STEPS]          (default 30; a tiny GPT-2, global batch 4, lr 1e-2)

Each run is a `gptkit train` in a temporary folder; one thread per process.
"""

import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import shakespeare  # noqa: E402


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GPTKIT_VERB", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        corpus = out / "shakespeare.txt"
        corpus.write_text(shakespeare(40_000))

        def train(name: str, world: int, *extra: str) -> dict[int, float]:
            args = [
                "model=gpt2-tiny",
                "model.n_layers=2",
                "model.d_model=32",
                "model.n_heads=2",
                "model.max_seq_len=32",
                "model.dropout=0.0",
                "tokenizer=char",
                "data=files",
                f"data.paths=[{corpus}]",
                "data.val_fraction=0.1",
                f"trainer.batch_size={4 // world}",
                f"trainer.max_steps={steps}",
                f"trainer.val_every={steps}",
                "trainer.val_windows=4",
                f"trainer.checkpoint_every={steps}",
                "trainer.log_every=1",
                "trainer.progress=false",
                "trainer.accelerator=cpu",
                "trainer.precision=32-true",
                "optim.warmup_steps=2",
                f"runs_dir={out}",
                f"name={name}",
                "optim=muon",
                "optim.lr=1e-2",
                *extra,
            ]
            r = subprocess.run(
                [sys.executable, "-m", "gptkit", "train", *args],
                capture_output=True,
                text=True,
                env=env,
                cwd=REPO,
            )
            if r.returncode != 0:
                sys.exit(f"gptkit train {' '.join(args)} failed:\n{r.stderr[-3000:]}")
            with open(out / name / "metrics.csv", newline="") as f:
                return {
                    int(row["step"]): float(row["train/loss"])
                    for row in csv.DictReader(f)
                    if row.get("train/loss")
                }

        for ns in ("bfloat16", "float32"):
            one = train(f"one-{ns}", 1, f"optim.muon.ns_dtype={ns}")
            for strategy in ("ddp", "fsdp"):
                two = train(
                    f"{strategy}-{ns}",
                    2,
                    f"optim.muon.ns_dtype={ns}",
                    f"trainer={strategy}",
                    "trainer.devices=2",
                )
                diff = [abs(two[s] - one[s]) for s in sorted(one)]
                worst = max(diff)
                print(
                    f"ns_dtype={ns:8s} {strategy:4s} 2 processes vs 1, {len(diff)} steps: max |train "
                    f"loss diff| {worst:.2e} (step {diff.index(worst)}), at the last step {diff[-1]:.2e}; "
                    f"the loss goes {one[0]:.4f} -> {one[max(one)]:.4f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
