"""`gptkit train` end to end, through the CLI as a user runs it (tiny model, small corpus)."""

import csv
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_S, TINY_LLAMA, module_corpus, run_cli, shakespeare, tiny_run, wait_for

corpus = module_corpus(60_000)


def tiny_args(corpus: Path, runs: Path, name: str, *extra: str) -> list[str]:
    return tiny_run(corpus, runs, name, *extra, layers=2, val_fraction=0.1, val_every=6, val_windows=8)


def train(corpus, runs, name, *extra, timeout=HANG_S):
    return run_cli("train", *tiny_args(corpus, runs, name, *extra), timeout=timeout)


def losses(run_dir: Path, key: str = "train/loss") -> dict[int, str]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): r[key] for r in csv.DictReader(f) if r.get(key)}


def test_run_folder_is_complete(corpus, tmp_path):
    r = train(corpus, tmp_path / "runs", "full")
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "runs" / "full"
    for f in (
        "config.yaml",
        "tokenizer.json",
        "manifest.json",
        "metrics.csv",
        "loss.png",
        "checkpoints/last.ckpt",
        "checkpoints/step-000006.ckpt",
        "checkpoints/step-000012.ckpt",
    ):
        assert (run / f).is_file(), f
    # loads safely
    ck = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    assert ck["global_step"] == 12
    # one writer: at a periodic step last.ckpt is that file (a hard link), not a second save
    assert (run / "checkpoints/last.ckpt").samefile(run / "checkpoints/step-000012.ckpt")
    train_loss = losses(run)
    assert len(train_loss) == 12
    val = losses(run, "val/loss")
    # it learned something
    assert sorted(val) and float(val[max(val)]) < float(train_loss[min(train_loss)])
    header = (run / "metrics.csv").read_text().splitlines()[0]
    for k in ("perf/tokens_per_s", "perf/flops_per_s", "perf/tokens", "perf/flops", "val/ppl", "train/lr"):
        assert k in header, k
    # one row per logged step: loss, lr and speed together
    with open(run / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["train/loss"]]
    assert len(rows) == 12 and all(r["train/lr"] and r["perf/tokens_per_s"] for r in rows)
    # CPU: no peak known, no MFU
    assert "perf/mfu" not in header
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    # vocab taken from the tokenizer
    assert cfg["model"]["vocab_size"] == len(set(corpus.read_text()))
    (run / "loss.png").unlink()
    # the plot on demand, of ./runs/full
    r = run_cli("plot", "run=latest", cwd=tmp_path)
    assert r.returncode == 0 and (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # ./runs/full
    r = run_cli("sample", "run=latest", "prompt=the", "max_new_tokens=5", "--json", cwd=tmp_path)
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
    # the same per-step losses, as text: bit-identical floats
    assert len(a) == 12 and a == b
    assert losses(tmp_path / "straight", "val/loss") == losses(tmp_path / "split", "val/loss")


def test_a_stop_at_step_validates_its_last_step_once_and_the_resume_too(corpus, tmp_path, capsys):
    """trainer.stop_at_step at a step that is no validation step: Lightning validates the step it stops at
    (should_stop), and the final validation must not run it again (its line was printed twice)."""
    from conftest import run_main

    def validated(err: str) -> list[str]:
        """The steps of the progress lines' validations ("step 4  val loss 3.9367")."""
        return [
            line.split()[1] for line in err.splitlines() if line.startswith("step ") and "  val loss " in line
        ]

    args = [a for a in tiny_args(corpus, tmp_path, "stops") if a != "trainer.progress=false"]
    code, _, err = run_main(capsys, "train", *args, "trainer.progress=lines", "trainer.stop_at_step=4")
    assert code == 0, err[-3000:]
    assert validated(err) == ["4"], err[-3000:]
    resume = ["train", f"resume={tmp_path / 'stops'}", "trainer.progress=lines"]
    code, _, err = run_main(capsys, *resume, "trainer.stop_at_step=8")
    assert code == 0, err[-3000:]
    assert validated(err) == ["6", "8"], err[-3000:]
    code, _, err = run_main(capsys, *resume)
    assert code == 0, err[-3000:]
    assert validated(err) == ["12"]
    assert sorted(losses(tmp_path / "stops", "val/loss")) == [4, 6, 8, 12]


def test_sigterm_saves_and_resumes(corpus, tmp_path):
    args = tiny_args(
        corpus,
        tmp_path,
        "term",
        "trainer.max_steps=100000",
        "trainer.checkpoint_every=100000",
        "trainer.val_every=100000",
    )
    env = dict(os.environ)
    env.pop("GPTKIT_VERB", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptkit", "train", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "term" / "metrics.csv"
    # a few steps logged, however long a loaded machine takes to get there
    wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) > 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 143, err[-3000:]
    assert "resume=" in err
    ck = torch.load(tmp_path / "term" / "checkpoints" / "last.ckpt", weights_only=True)
    step = ck["global_step"]
    assert step > 0
    r = run_cli("train", f"resume={tmp_path / 'term'}", f"trainer.max_steps={step + 2}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        torch.load(tmp_path / "term" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
        == step + 2
    )


def test_nan_loss_stops_and_keeps_last_good_checkpoint(corpus, tmp_path):
    r = train(
        corpus,
        tmp_path,
        "nan",
        "optim.lr=1e30",
        "optim.warmup_steps=0",
        "optim.min_lr=0",
        "trainer.checkpoint_every=1",
        "trainer.gradient_clip_val=null",
    )
    assert r.returncode == 2
    last_line = r.stderr.strip().splitlines()[-1]
    assert "loss became" in last_line and "at step" in last_line
    ckpts = sorted((tmp_path / "nan" / "checkpoints").glob("step-*.ckpt"))
    assert ckpts
    sd = torch.load(ckpts[-1], weights_only=True)["state_dict"]
    assert all(torch.isfinite(v).all() for v in sd.values())


def test_multirun_gives_one_folder_per_job(corpus, tmp_path):
    r = run_cli(
        "train", "-m", *tiny_args(corpus, tmp_path, "sweep", "trainer.max_steps=2", "optim.lr=1e-3,3e-3")
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for job in ("0", "1"):
        assert (tmp_path / "sweep" / job / "checkpoints" / "last.ckpt").is_file()
    import yaml

    lrs = {
        yaml.safe_load((tmp_path / "sweep" / j / "config.yaml").read_text())["optim"]["lr"]
        for j in ("0", "1")
    }
    assert lrs == {1e-3, 3e-3}
    # each job says what it runs
    assert "job 0: " in r.stderr and "optim.lr=0.003" in r.stderr
    # and the sweep ends with a table
    with open(tmp_path / "sweep" / "summary.csv", newline="") as f:
        summary = list(csv.DictReader(f))
    assert [row["job"] for row in summary] == ["0", "1"]
    # what the jobs differ in
    assert summary[0]["overrides"] == "optim.lr=0.001"
    assert float(summary[1]["final_val_loss"]) > 0
    assert float(summary[0]["tokens_per_s"]) > 0


def test_loggers_csv_tensorboard_wandb_offline(corpus, tmp_path):
    r = run_cli(
        "train",
        *tiny_args(corpus, tmp_path, "logs", "trainer.max_steps=3", "logger=[csv,tensorboard,wandb]"),
        env={"WANDB_MODE": "offline"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "logs"
    assert (run / "metrics.csv").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run / "wandb").glob("offline-run-*"))


def test_wandb_online_without_key_fails_before_training_or_wandb_starts(corpus, tmp_path):
    env = {"WANDB_MODE": "", "WANDB_API_KEY": "", "HOME": str(tmp_path)}
    r = run_cli(
        "train", *tiny_args(corpus, tmp_path, "online", "logger=[wandb]", "logger.wandb.mode=online"), env=env
    )
    assert r.returncode == 2 and "API key" in r.stderr
    # refused up front: no step trained, no wandb run started (which would wait on its login and retries)
    run = tmp_path / "online"
    assert not (run / "checkpoints").exists() and not (run / "wandb").exists()
    assert not (run / "metrics.csv").exists()


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["optim=sgd"], "optim=sgd is not a preset (optim presets: adamw"),
        (["trainer.precision=fp8"], "trainer.precision"),
        (["resume=/nonexistent/run"], "does not exist"),
    ],
)
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
    assert r.returncode == 2 and "fixes model.n_layers=2" in r.stderr
    # a truncated checkpoint: refused with one line
    bad = tmp_path / "truncated.ckpt"
    bad.write_bytes((ckdir / "last.ckpt").read_bytes()[:1000])
    r = run_cli("train", f"resume={bad}")
    assert r.returncode == 2 and "is not a torch checkpoint" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert _digest(ckdir) == before


def _source_run(corpus: Path, folder: Path) -> Path:
    """A run folder as `gptkit import` writes it (config, tokenizer.json, checkpoints/last.ckpt): a random
    Llama-style model (RoPE, GQA, SwiGLU, RMSNorm) over a char tokenizer of the corpus."""
    from gptkit.model import GPT, ModelConfig
    from gptkit.runs import write_run_folder
    from gptkit.tokenizer import build_tokenizer

    tok_cfg = {"kind": "char", "special_tokens": [], "eos_token": None, "unk_token": None}
    tok = build_tokenizer(tok_cfg, texts=lambda: [corpus.read_text()])
    torch.manual_seed(3)
    # 2 heads (1 of keys and values)
    cfg = TINY_LLAMA | dict(
        n_heads=2, n_kv_heads=1, vocab_size=tok.get_vocab_size(), max_seq_len=32, name="src"
    )
    model = GPT(ModelConfig(**cfg))
    return write_run_folder(folder, {"tokenizer": tok_cfg}, model, tok)


def test_init_from_starts_a_new_run_from_the_source_weights(corpus, tmp_path):
    import yaml

    src = _source_run(corpus, tmp_path / "src")
    r = run_cli(
        "train",
        f"init_from={src}",
        "data=files",
        f"data.paths=[{corpus}]",
        "trainer.batch_size=4",
        "trainer.max_steps=1",
        "trainer.val_windows=4",
        "trainer.progress=false",
        "optim.lr=1e-12",
        "optim.min_lr=0",
        "optim.warmup_steps=0",
        "model.dropout=0.1",
        f"runs_dir={tmp_path}",
        "name=ft",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "weights from" in r.stderr
    ft = tmp_path / "ft"
    before = torch.load(src / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    after = torch.load(ft / "checkpoints/last.ckpt", weights_only=True)
    # a new run: its own step count
    assert after["global_step"] == 1
    # one step at lr 1e-12 away from the source, not a fresh init (~0.02 apart)
    for k, v in before.items():
        torch.testing.assert_close(after["state_dict"][k], v, rtol=0, atol=1e-9)
    src_cfg, ft_cfg = (yaml.safe_load((d / "config.yaml").read_text()) for d in (src, ft))
    assert ft_cfg["model"] == {**src_cfg["model"], "dropout": 0.1}
    assert ft_cfg["init_from"] == str(src / "checkpoints" / "last.ckpt")
    assert ft_cfg["tokenizer"]["kind"] == "file"
    assert ft_cfg["tokenizer"]["path"] == str((ft / "tokenizer.json").resolve())
    assert (ft / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["model.n_layers=3"], "fixes model.n_layers=2"),
        (["model=llama-tiny"], "brings its own model"),
        (["resume=SRC"], "not both"),
    ],
)
def test_init_from_bad_input_one_line(corpus, tmp_path, extra, needle):
    src = _source_run(corpus, tmp_path / "src")
    extra = [e.replace("SRC", str(src)) for e in extra]
    r = run_cli(
        "train",
        f"init_from={src}",
        "data=files",
        f"data.paths=[{corpus}]",
        f"runs_dir={tmp_path}",
        "name=ft",
        *extra,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert not (tmp_path / "ft" / "checkpoints").exists()


def test_latest_is_the_newest_run_folder_never_hydras(tmp_path):
    """run=latest / init_from=latest: the newest config.yaml of a run (or multirun job) folder; Hydra's own
    .hydra/config.yaml, written when a new run starts, is not a run."""
    from gptkit.errors import GptkitError
    from gptkit.runs import resolve_latest

    with pytest.raises(GptkitError, match="found no run folder"):
        resolve_latest("latest", tmp_path)
    for i, rel in enumerate(["old", "sweep/0", "new", "starting/.hydra", "failed"]):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "config.yaml").write_text("model: {}\n")
        os.utime(tmp_path / rel / "config.yaml", (1000 + i, 1000 + i))
        # a start that failed has no checkpoint: not usable, skipped (issue 25 item 16)
        if rel != "failed":
            (tmp_path / rel / "checkpoints").mkdir()
            (tmp_path / rel / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert resolve_latest("latest", tmp_path) == tmp_path / "new"
    assert resolve_latest("runs/x", tmp_path) == Path("runs/x")


def test_a_transformers_folder_is_pointed_to_import(tmp_path):
    """run=/init_from= given a transformers folder (config.json, model.safetensors): say to import it."""
    from gptkit.checkpoints import find_checkpoint, run_dir_of
    from gptkit.errors import GptkitError
    from gptkit.runs import read_config

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(GptkitError, match=f"gptkit import hf={tmp_path} out=runs/<name>"):
        read_config(run_dir_of(find_checkpoint(tmp_path)))


def test_a_logger_can_be_switched_off(tmp_path):
    from gptkit.training.trainer import build_loggers

    assert build_loggers({"csv": {"enabled": False}}, tmp_path, "x") == []
    assert len(build_loggers({"csv": {"enabled": True}}, tmp_path, "x")) == 1


def test_a_missing_logger_package_is_one_line_before_any_work(tmp_path, monkeypatch):
    import sys

    from gptkit.extras import MissingExtra
    from gptkit.training.config_checks import check_loggers

    # `import tensorboard` raises ImportError
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(
        MissingExtra,
        match=r"^logger=tensorboard needs tensorboard, which cannot be imported \(.*\): "
        r"pip install 'gptkit\[tensorboard\]'$",
    ):
        check_loggers({"csv": {}, "tensorboard": {"enabled": True}})
    # switched off: not needed
    check_loggers({"csv": {}, "tensorboard": {"enabled": False}})


def test_trainer_seq_len_trains_and_fine_tunes_on_windows_shorter_than_the_context(corpus, tmp_path):
    """trainer.seq_len: windows of 8 tokens for a model whose context is 32 (start-up says so; FLOPs and the
    token count follow), which lets init_from fine-tune on a text shorter than the model's context."""
    # model.max_seq_len=32
    src = _source_run(corpus, tmp_path / "src")
    short = tmp_path / "short.txt"
    # 30 characters: not one window of 33
    short.write_text(shakespeare(30, start=100_000))
    base = [
        "train",
        f"init_from={src}",
        "data=files",
        f"data.paths=[{short}]",
        "data.val_fraction=0.3",
        "trainer.batch_size=2",
        "trainer.max_steps=2",
        "trainer.val_windows=2",
        "trainer.progress=false",
        f"runs_dir={tmp_path}",
    ]
    r = run_cli(*base, "name=ft-ctx")
    assert r.returncode == 2 and "shorter than one window" in r.stderr, r.stderr[-2000:]
    r = run_cli(*base, "trainer.seq_len=8", "name=ft")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "16 tokens/step = 2 sequences x 8 tokens" in r.stderr, r.stderr[-2000:]
    # eval's windows follow
    e = run_cli("eval", f"run={tmp_path / 'ft'}", "progress=false", "format=json")
    assert e.returncode == 0 and '"seq_len": 8' in e.stdout, e.stderr[-2000:]
    r = run_cli(*base, "trainer.seq_len=33", "name=ft-long")
    assert r.returncode == 2 and "trainer.seq_len=33 must be in [1, model.max_seq_len=32]" in r.stderr
    # a new model: before any work
    r = run_cli("train", *tiny_args(corpus, tmp_path, "new", "trainer.seq_len=64"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert not (tmp_path / "new").exists()
