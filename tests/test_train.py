"""`gptkit train` end to end, through the CLI as a user runs it (tiny model, small corpus)."""

import csv
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SHAKESPEARE, run_cli


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("corpus") / "shakespeare-60k.txt"
    p.write_text(SHAKESPEARE.read_text()[:60_000])
    return p


def tiny_args(corpus: Path, runs: Path, name: str, *extra: str) -> list[str]:
    return [
        "model=gpt2-tiny", "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.max_seq_len=32",
        "tokenizer=char", "data=files", f"data.paths=[{corpus}]", "data.val_fraction=0.1",
        "trainer.batch_size=4", "trainer.max_steps=12", "trainer.val_every=6", "trainer.val_windows=8",
        "trainer.checkpoint_every=6", "trainer.log_every=1", "trainer.progress=false",
        "optim.warmup_steps=2", f"runs_dir={runs}", f"name={name}", *extra,
    ]


def train(corpus, runs, name, *extra, timeout=300):
    return run_cli("train", *tiny_args(corpus, runs, name, *extra), timeout=timeout)


def losses(run_dir: Path, key: str = "train/loss") -> dict[int, str]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): r[key] for r in csv.DictReader(f) if r.get(key)}


def test_run_folder_is_complete(corpus, tmp_path):
    r = train(corpus, tmp_path / "runs", "full")
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "runs" / "full"
    for f in ("config.yaml", "tokenizer.json", "manifest.json", "metrics.csv", "loss.png",
              "checkpoints/last.ckpt", "checkpoints/step-000006.ckpt", "checkpoints/step-000012.ckpt"):
        assert (run / f).is_file(), f
    ck = torch.load(run / "checkpoints/last.ckpt", weights_only=True)  # loads safely
    assert ck["global_step"] == 12
    train_loss = losses(run)
    assert len(train_loss) == 12
    val = losses(run, "val/loss")
    assert sorted(val) and float(val[max(val)]) < float(train_loss[min(train_loss)])  # it learned something
    header = (run / "metrics.csv").read_text().splitlines()[0]
    for k in ("perf/tokens_per_s", "perf/flops_per_s", "perf/tokens", "perf/flops", "val/ppl", "lr-AdamW"):
        assert k in header, k
    assert "perf/mfu" not in header  # CPU: no peak known, no MFU
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["vocab_size"] == len(set(corpus.read_text()))  # vocab taken from the tokenizer
    (run / "loss.png").unlink()
    r = run_cli("plot", f"run={run}")  # the plot on demand
    assert r.returncode == 0 and (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    r = run_cli("sample", "run=latest", "prompt=the", "max_new_tokens=5", "--json", cwd=tmp_path)  # ./runs/full
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    assert json.loads(r.stdout)["run"] == "runs/full"


def test_resume_is_bit_identical(corpus, tmp_path):
    full = train(corpus, tmp_path, "straight")
    assert full.returncode == 0, full.stderr[-3000:]
    # stop at step 6 - a step that also validates - then continue with the same plan of 12 steps
    first = train(corpus, tmp_path, "split", "trainer.stop_at_step=6")
    assert first.returncode == 0, first.stderr[-3000:]
    assert torch.load(tmp_path / "split/checkpoints/last.ckpt", weights_only=True)["global_step"] == 6
    resumed = run_cli("train", f"resume={tmp_path / 'split'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert len(a) == 12 and a == b  # the same per-step losses, as text: bit-identical floats
    assert losses(tmp_path / "straight", "val/loss") == losses(tmp_path / "split", "val/loss")


def test_sigterm_saves_and_resumes(corpus, tmp_path):
    args = tiny_args(corpus, tmp_path, "term", "trainer.max_steps=100000", "trainer.checkpoint_every=100000",
                     "trainer.val_every=100000")
    env = dict(os.environ)
    env.pop("GPTKIT_VERB", None)
    proc = subprocess.Popen([sys.executable, "-m", "gptkit", "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "term" / "metrics.csv"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) > 3):
        time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "resume=" in err
    ck = torch.load(tmp_path / "term" / "checkpoints" / "last.ckpt", weights_only=True)
    step = ck["global_step"]
    assert step > 0
    r = run_cli("train", f"resume={tmp_path / 'term'}", f"trainer.max_steps={step + 2}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert torch.load(tmp_path / "term" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == step + 2


def test_nan_loss_stops_and_keeps_last_good_checkpoint(corpus, tmp_path):
    r = train(corpus, tmp_path, "nan", "optim.lr=1e30", "optim.warmup_steps=0", "optim.min_lr=0",
              "trainer.checkpoint_every=1", "trainer.gradient_clip_val=null")
    assert r.returncode == 2
    last_line = r.stderr.strip().splitlines()[-1]
    assert "loss became" in last_line and "at step" in last_line
    ckpts = sorted((tmp_path / "nan" / "checkpoints").glob("step-*.ckpt"))
    assert ckpts
    sd = torch.load(ckpts[-1], weights_only=True)["state_dict"]
    assert all(torch.isfinite(v).all() for v in sd.values())


def test_multirun_gives_one_folder_per_job(corpus, tmp_path):
    r = run_cli("train", "-m", *tiny_args(corpus, tmp_path, "sweep", "trainer.max_steps=2", "optim.lr=1e-3,3e-3"))
    assert r.returncode == 0, r.stderr[-3000:]
    for job in ("0", "1"):
        assert (tmp_path / "sweep" / job / "checkpoints" / "last.ckpt").is_file()
    import yaml

    lrs = {yaml.safe_load((tmp_path / "sweep" / j / "config.yaml").read_text())["optim"]["lr"] for j in ("0", "1")}
    assert lrs == {1e-3, 3e-3}


def test_loggers_csv_tensorboard_wandb_offline(corpus, tmp_path):
    r = run_cli(
        "train", *tiny_args(corpus, tmp_path, "logs", "trainer.max_steps=3", "logger=[csv,tensorboard,wandb]"),
        env={"WANDB_MODE": "offline"})
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "logs"
    assert (run / "metrics.csv").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run / "wandb").glob("offline-run-*"))


def test_wandb_online_without_key_fails_fast(corpus, tmp_path):
    t0 = time.time()
    env = {"WANDB_MODE": "", "WANDB_API_KEY": "", "HOME": str(tmp_path)}
    r = run_cli("train", *tiny_args(corpus, tmp_path, "online", "logger=[wandb]", "logger.wandb.mode=online"), env=env)
    assert r.returncode == 2 and "API key" in r.stderr
    assert time.time() - t0 < 60


@pytest.mark.parametrize("extra, needle", [
    (["optim=sgd"], "optim/sgd"),
    (["trainer.precision=fp8"], "trainer.precision"),
    (["resume=/nonexistent/run"], "does not exist"),
])
def test_bad_input_one_line(corpus, tmp_path, extra, needle):
    r = train(corpus, tmp_path, "bad", *extra)
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]


def test_unwritable_runs_folder(corpus, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    r = run_cli("train", *tiny_args(corpus, blocker / "runs", "x"))
    assert r.returncode == 2 and "runs folder" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.ckpt"))}


def test_failed_runs_never_touch_existing_checkpoints(corpus, tmp_path):
    assert train(corpus, tmp_path, "keep", "trainer.max_steps=6").returncode == 0
    ckdir = tmp_path / "keep" / "checkpoints"
    before = _digest(ckdir)
    # the same name again without resume: refused
    r = train(corpus, tmp_path, "keep")
    assert r.returncode == 2 and "already holds checkpoints" in r.stderr
    # resume with a different model: refused
    r = run_cli("train", f"resume={tmp_path / 'keep'}", "model.n_layers=3")
    assert r.returncode == 2 and "different model" in r.stderr
    # a truncated checkpoint: refused with one line
    bad = tmp_path / "truncated.ckpt"
    bad.write_bytes((ckdir / "last.ckpt").read_bytes()[:1000])
    r = run_cli("train", f"resume={bad}")
    assert r.returncode == 2 and "not a readable gptkit checkpoint" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert _digest(ckdir) == before
