"""Issue 25 item 21 (what a user watching a run expects) and item 20's small ones: the gradient norm with
the loss, loss.png at every validation, a greedy sample at validations, best.ckpt; resume past the end."""

import csv
from pathlib import Path

from conftest import run_main, shakespeare


def tiny(tmp_path: Path, name: str, *extra: str) -> list[str]:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(shakespeare(20_000))
    return ["model=gpt2-tiny", "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.max_seq_len=32",
            "tokenizer=char", "data=files", f"data.paths=[{corpus}]", "data.val_fraction=0.1",
            "trainer.batch_size=4", "trainer.max_steps=6", "trainer.val_every=3", "trainer.val_windows=4",
            "trainer.checkpoint_every=3", "trainer.log_every=1", "trainer.progress=lines",
            "optim.warmup_steps=1", f"runs_dir={tmp_path / 'runs'}", f"name={name}", *extra]


def rows(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_gradient_norm_before_clipping_is_logged_with_the_loss(tmp_path, capsys):
    code, _, err = run_main(capsys, "train", *tiny(tmp_path, "g", "trainer.gradient_clip_val=1e-3"))
    assert code == 0, err
    norms = [float(r["train/grad_norm"]) for r in rows(tmp_path / "runs" / "g") if r.get("train/grad_norm")]
    assert len(norms) == 6
    assert min(norms) > 1e-3  # the norm the clipping computed, not the clipped one
    assert "grad norm " in err
