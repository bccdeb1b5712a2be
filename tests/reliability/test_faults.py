"""Fault injection: kill -9 at each write point, concurrent writers, corrupted files, a full disk, bad
run folders, start-up failures. The fast deterministic cases; `.ci/fault-loop` runs the longer random loop.

A kill is injected with GPTKIT_FAULT=<point>@<n> (gptkit/faults.py): the process SIGKILLs itself the
n-th time it passes that write point, exactly as `kill -9` at that moment would.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    HANG_S,
    make_run,
    module_corpus,
    run_cli,
    run_main,
    shakespeare,
    tiny_run,
    trained,
    wait_for,
)
from conftest import timeless_rows as rows

from gptkit.errors import GptkitError

STEPS = 12


corpus = module_corpus(30_000)


def tiny(corpus: Path, runs: Path, name: str, *extra: str) -> list[str]:
    return tiny_run(corpus, runs, name, *extra, steps=STEPS, keep=2)


def leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in [*run.glob(".*.tmp"), *(run / "checkpoints").glob(".*")])


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("ref")
    return trained(tiny(corpus, runs, "ref"), runs / "ref")


def test_reference_run_has_one_row_per_step_and_keeps_two_checkpoints(reference):
    got = rows(reference)
    # one row per step, named as it ends
    assert [int(r["step"]) for r in got] == list(range(1, STEPS + 1))
    lr = next(k for k in got[0] if "lr" in k)
    # loss and learning rate on the same row
    assert all(r["train/loss"] and r[lr] for r in got)
    # validation on the row of its step
    assert [int(r["step"]) for r in got if r["val/loss"]] == [3, 6, 9, 12]
    ckdir = reference / "checkpoints"
    assert sorted(p.name for p in ckdir.iterdir()) == ["last.ckpt", "step-000009.ckpt", "step-000012.ckpt"]


@pytest.mark.parametrize(
    "point",
    [
        # during the write of step 6's checkpoint
        "ckpt-tmp@2",
        # step 6's checkpoint complete, not yet published (its rows not yet synced)
        pytest.param("ckpt-pending@2", marks=pytest.mark.long),
        # step-000006.ckpt in place, last.ckpt still step 3
        pytest.param("ckpt-published@2", marks=pytest.mark.long),
        # right after last.ckpt was replaced by step 6
        pytest.param("last-replaced@2", marks=pytest.mark.long),
        # rows appended after step 3's checkpoint was published (row 5, during step 6)
        "metrics-append@3",
    ],
)
def test_kill_at_a_write_point_then_resume_loses_and_repeats_nothing(corpus, reference, tmp_path, point):
    r = run_cli("train", *tiny(corpus, tmp_path, "k"), env={"GPTKIT_FAULT": point})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    # step 3's
    assert (tmp_path / "k/checkpoints/last.ckpt").is_file()
    other = tmp_path / "elsewhere"
    # continues in its own folder
    r = run_cli("train", f"resume={tmp_path / 'k'}", f"runs_dir={other}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "continues" in r.stderr and not other.exists()
    # every step exactly once, the same values
    assert rows(tmp_path / "k") == rows(reference)
    last = torch.load(tmp_path / "k/checkpoints/last.ckpt", weights_only=True)
    want = torch.load(reference / "checkpoints/last.ckpt", weights_only=True)
    assert last["global_step"] == STEPS
    assert all(torch.equal(v, want["state_dict"][k]) for k, v in last["state_dict"].items())
    # the killed write's temporary files were removed
    assert leftovers(tmp_path / "k") == []


def test_a_run_killed_before_its_first_checkpoint_starts_clean_when_run_again(corpus, reference, tmp_path):
    r = run_cli("train", *tiny(corpus, tmp_path, "again"), env={"GPTKIT_FAULT": "metrics-rewrite@2"})
    # while the first validation's columns were added, before step 3's
    assert r.returncode == -signal.SIGKILL
    # checkpoint
    assert rows(tmp_path / "again") and not (tmp_path / "again/checkpoints/last.ckpt").exists()
    # the same command again: no checkpoint to resume
    r = run_cli("train", *tiny(corpus, tmp_path, "again"))
    assert r.returncode == 0, r.stderr[-3000:]
    # no duplicated rows
    assert rows(tmp_path / "again") == rows(reference)


@pytest.mark.long
def test_one_writer_per_run_folder_and_kill_9_leaves_no_stale_lock(corpus, tmp_path):
    args = tiny(corpus, tmp_path, "same", "trainer.max_steps=100000", "trainer.val_every=100000")
    env = dict(os.environ)
    env.pop("GPTKIT_VERB", None)
    first = subprocess.Popen(
        [sys.executable, "-m", "gptkit", "train", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = tmp_path / "same" / "metrics.csv"
        # the first writer holds the folder and has logged steps, however long a loaded machine takes
        wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) > 2, first)
        second = run_cli("train", *tiny(corpus, tmp_path, "same", "seed=7"))
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [second.stderr.strip()]
        assert f"PID {first.pid}" in second.stderr
        # kill -9: the OS releases the lock
        first.kill()
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    from gptkit.checkpoints import checkpoint_step

    step = checkpoint_step(tmp_path / "same/checkpoints/last.ckpt")
    r = run_cli("train", f"resume={tmp_path / 'same'}", f"trainer.max_steps={step + 2}")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [int(r["step"]) for r in rows(tmp_path / "same")]
    # one writer's rows, each step once
    assert steps == list(range(1, step + 3))


def test_a_second_ctrl_c_stops_at_once_with_one_line_and_130(corpus, tmp_path):
    """Two Ctrl-C's during step 3, the second after the first was handled (a real terminal's two presses
    can coalesce into one when they arrive within one long torch op, so the test sends them from inside)."""
    script = tmp_path / "ctrl_c_twice.py"
    script.write_text(
        "import os, signal, sys\n"
        "from gptkit.training.run_checkpoints import RunCheckpoints\n"
        "end = RunCheckpoints.on_train_batch_end\n"
        "def twice(self, trainer, *args):\n"
        "    if trainer.global_step == 3:\n"
        "        os.kill(os.getpid(), signal.SIGINT)  # finish the step, save, stop ...\n"
        "        os.kill(os.getpid(), signal.SIGINT)  # ... no: stop now\n"
        "    return end(self, trainer, *args)\n"
        "RunCheckpoints.on_train_batch_end = twice\n"
        "from gptkit.cli import main\n"
        "sys.exit(main())\n"
    )
    env = dict(os.environ)
    env.pop("GPTKIT_VERB", None)
    r = subprocess.run(
        [sys.executable, str(script), "train", *tiny(corpus, tmp_path, "int")],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert r.returncode == 130, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted by a second Ctrl-C") and "holds step" not in last, r.stderr[-2000:]
    # before step 3 was saved
    assert "no checkpoint was saved yet" in last and "Traceback" not in r.stderr


# ---- corruption is detected, not used -------------------------------------------------------------
def test_every_flipped_byte_of_a_checkpoint_is_refused_or_harmless(tmp_path):
    from gptkit.checkpoints import atomic_torch_save, load_checkpoint

    good = tmp_path / "good.ckpt"
    state = {"state_dict": {"model.w": torch.randn(64, 32), "model.b": torch.randn(32)}, "global_step": 7}
    atomic_torch_save(state, good)
    data = good.read_bytes()
    rng = np.random.default_rng(0)
    refused = 0
    for i, pos in enumerate(sorted(rng.choice(len(data), size=300, replace=False))):
        bad = tmp_path / f"flip{i}.ckpt"
        flipped = bytearray(data)
        flipped[pos] ^= 1 << int(rng.integers(8))
        bad.write_bytes(bytes(flipped))
        try:
            got = load_checkpoint(bad)
        except GptkitError:
            refused += 1
            continue
        # accepted: then the flip was in bytes nothing reads (zip padding), and the content is intact
        assert got["global_step"] == 7 and all(
            torch.equal(got["state_dict"][k], v) for k, v in state["state_dict"].items()
        ), pos
    # the tensors and the pickle are most of the file
    assert refused > 250


def test_a_bit_flipped_last_ckpt_is_refused_by_sample_with_one_line(tmp_path, capsys):
    d, _, _ = make_run(tmp_path)
    last = d / "checkpoints" / "last.ckpt"
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0x04
    last.write_bytes(bytes(data))
    code, _, err = run_main(capsys, "sample", f"run={d}", "prompt=the", "max_new_tokens=2")
    assert code == 2 and "is corrupted" in err and str(last) in err
    assert len(err.strip().splitlines()) == 1


def test_a_zeroed_shard_and_out_of_range_ids_are_refused(tmp_path):
    from gptkit.data import load_prepared, prepare
    from gptkit.data.windows import windows

    text = tmp_path / "t.txt"
    text.write_text(shakespeare(5_000))
    p = prepare(
        {"kind": "files", "paths": [str(text)]}, {"kind": "char"}, cache_dir=tmp_path / "c", progress=False
    )
    shard = p.dir / "train.bin"
    # zeroed at the same size
    shard.write_bytes(bytes(shard.stat().st_size))
    again = load_prepared(p.dir)
    with pytest.raises(GptkitError, match=f"{shard} is corrupted"):
        again.train_tokens()
    ids = np.memmap(tmp_path / "ids.bin", dtype=np.uint16, mode="w+", shape=(100,))
    ids[50] = 999
    with pytest.raises(GptkitError, match="ids.bin holds token id 999, outside the tokenizer's 60 ids"):
        windows(ids, np.array([40]), 16, vocab_size=60)


def test_a_sharded_folder_is_checked_against_its_checksums(tmp_path):
    from gptkit.checkpoints import verify_checkpoint, write_checksums

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    for name, data in ((".metadata", b"index"), ("__0_0.distcp", b"a" * 100), ("__1_0.distcp", b"b" * 100)):
        (folder / name).write_bytes(data)
    write_checksums(folder)
    verify_checkpoint(folder)
    (folder / "__1_0.distcp").write_bytes(b"b" * 99 + b"c")
    with pytest.raises(GptkitError, match="__1_0.distcp does not match"):
        verify_checkpoint(folder)


# ---- a full disk ----------------------------------------------------------------------------------
def test_a_full_disk_during_a_checkpoint_save_is_one_line_and_keeps_the_previous_one(tmp_path, monkeypatch):
    from gptkit.checkpoints import atomic_torch_save

    path = tmp_path / "last.ckpt"
    atomic_torch_save({"state_dict": {"model.w": torch.zeros(4)}}, path)
    before = path.read_bytes()

    def full(obj, f, *a, **k):
        Path(f).write_bytes(b"PK partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(GptkitError) as err:
        atomic_torch_save({"state_dict": {"model.w": torch.zeros(1024, 1024)}}, path)
    msg = str(err.value)
    assert "no space left" in msg and str(path) in msg and "4.00 MiB" in msg and "\n" not in msg
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_full_disk_during_prepare_is_one_line_and_leaves_the_cache_as_it_was(tmp_path, monkeypatch):
    from gptkit.data import prepare

    text = tmp_path / "t.txt"
    text.write_text(shakespeare(5_000))
    cache = tmp_path / "cache"
    prepare({"kind": "files", "paths": [str(text)]}, {"kind": "char"}, cache_dir=cache, progress=False)
    before = sorted(p.name for p in cache.iterdir())

    # numpy's ndarray.tofile on a full disk
    def full(encode, docs, out, *a, **k):
        out.write_bytes(b"\0" * 63124)
        raise OSError("65574 requested and 63124 written")

    monkeypatch.setattr("gptkit.data.build.write_tokens", full)
    with pytest.raises(GptkitError) as err:
        prepare({"kind": "files", "paths": [str(text)]}, {"kind": "byte"}, cache_dir=cache, progress=False)
    msg = str(err.value)
    assert "no space left" in msg and str(cache) in msg and "needs about" in msg
    # no .tmp build folder left, the old one intact
    assert sorted(p.name for p in cache.iterdir()) == before


def test_a_dead_builds_folder_is_removed_a_live_ones_is_not(tmp_path):
    from gptkit.data.cache import BUILD_LOCK, remove_stale_builds
    from gptkit.fsio import lock_file

    dead, live = tmp_path / ".files-x.abc.tmp", tmp_path / ".files-y.def.tmp"
    for d in (dead, live):
        d.mkdir()
        (d / BUILD_LOCK).touch()
    # a builder that is still running
    fd = lock_file(live / BUILD_LOCK)
    try:
        assert remove_stale_builds(tmp_path) == [dead]
        assert live.is_dir() and not dead.exists()
    finally:
        os.close(fd)


# ---- run folders stay inside runs_dir; failed starts leave nothing --------------------------------
@pytest.mark.parametrize(
    "args, needle",
    [
        (["name=../victim"], "not a run name"),
        (["name=../../tmp/evil"], "not a run name"),
        (["name=.."], "not a run name"),
        (["name="], "not a run name"),
        (["name=/abs"], "not a run name"),
        (["runs_dir="], "runs_dir= is empty"),
        (["name=ok", "optim.lr=-1"], "optim.lr=-1"),
        (["name=ok", "optim.schedule=nope"], "optim.schedule"),
        (["name=ok", "init_from=/nonexistent"], "does not exist"),
    ],
)
def test_bad_run_folder_and_settings_are_refused_before_anything_is_written(
    tmp_path, capsys, monkeypatch, args, needle
):
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    (tmp_path / "victim").mkdir()
    given = {a.split("=")[0] for a in args}
    code, _, err = run_main(capsys, "train", *args, *([] if "runs_dir" in given else [f"runs_dir={runs}"]))
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert list(runs.iterdir()) == [] and list((tmp_path / "victim").iterdir()) == []


def test_a_start_up_failure_leaves_no_run_folder(corpus, tmp_path):
    from gptkit.model import GPT, ModelConfig
    from gptkit.runs import write_run_folder
    from gptkit.tokenizer import build_tokenizer

    tok_cfg = {"kind": "char", "special_tokens": [], "eos_token": None, "unk_token": None}
    # a tokenizer that cannot encode Shakespeare
    tok = build_tokenizer(tok_cfg, texts=lambda: ["abc\n"])
    model = GPT(
        ModelConfig(vocab_size=tok.get_vocab_size(), max_seq_len=32, n_layers=1, n_heads=2, d_model=32)
    )
    write_run_folder(tmp_path / "runs" / "abc", {"tokenizer": tok_cfg}, model, tok)
    r = run_cli(
        "train",
        f"init_from={tmp_path / 'runs' / 'abc'}",
        "data=files",
        f"data.paths=[{corpus}]",
        f"runs_dir={tmp_path / 'runs'}",
        "name=ft",
    )
    assert r.returncode == 2 and "cannot encode" in r.stderr, r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["abc"]
    r = run_cli(
        "train",
        *tiny(corpus, tmp_path / "runs", "nolog", "logger=[wandb]"),
        env={"PYTHONPATH": str(_no_package(tmp_path, "wandb"))},
    )
    assert r.returncode == 2 and "pip install wandb" in r.stderr, r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["abc"]


def _no_package(tmp_path: Path, name: str) -> Path:
    """A folder for PYTHONPATH in which importing `name` fails as if it were not installed."""
    stub = tmp_path / "stub"
    (stub / name).mkdir(parents=True)
    (stub / name / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n"
    )
    return stub


# ---- export never destroys its source -------------------------------------------------------------
def test_export_refuses_an_out_that_is_contains_or_lies_inside_the_run(tmp_path, capsys):
    d, _, _ = make_run(tmp_path)
    (tmp_path / "other").mkdir()
    other, _, _ = make_run(tmp_path / "other")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out in (d, d.parent, d / "hf", other):
        code, _, err = run_main(capsys, "export", f"run={d}", f"out={out}", "force=true")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


# ---- metrics.csv and the disk estimate, in process -------------------------------------------------
def test_metrics_csv_keeps_exactly_the_rows_a_checkpoint_covers(tmp_path):
    from gptkit.training.metrics_csv import MetricsCSV, read_rows

    m = MetricsCSV(tmp_path)
    for step in range(1, 6):
        m.log_metrics({"train/loss": float(step), "lr-AdamW": 0.1}, step)
        if step == 4:
            # the validation after 4 steps ...
            m.log_metrics({"val/loss": 9.0}, step)
            # ... is on disk before the checkpoint of step 4 is published
            m.sync()
        m.save()
    with open(tmp_path / "metrics.csv", "a") as f:
        # a row cut short by a kill
        f.write("6,6.0,0.1")
    resumed = MetricsCSV(tmp_path, resume_step=4)
    resumed.log_metrics({"train/loss": 5.5, "lr-AdamW": 0.1}, 5)
    resumed.finalize("success")
    columns, rows = read_rows(tmp_path / "metrics.csv")
    # one row per step: the checkpoint's four, then step 5 redone
    assert list(rows) == [1, 2, 3, 4, 5]
    assert rows[4] == {"val/loss": "9.0", "train/loss": "4.0", "lr-AdamW": "0.1"}
    assert rows[5] == {"train/loss": "5.5", "lr-AdamW": "0.1"}
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0] == "step,train/loss,lr-AdamW,val/loss"


def test_an_older_metrics_csv_with_the_learning_rate_on_its_own_rows_is_merged_on_resume(tmp_path):
    from gptkit.training.metrics_csv import MetricsCSV, read_rows

    (tmp_path / "metrics.csv").write_text(
        "lr-AdamW,step,train/loss\n0.1,0,\n,0,4.0\n0.2,1,\n,1,3.9\n0.3,2,\n"
    )
    MetricsCSV(tmp_path, resume_step=2).finalize("success")
    assert read_rows(tmp_path / "metrics.csv")[1] == {
        0: {"lr-AdamW": "0.1", "train/loss": "4.0"},
        1: {"lr-AdamW": "0.2", "train/loss": "3.9"},
        2: {"lr-AdamW": "0.3"},
    }


def test_start_up_says_what_the_checkpoints_need_and_warns_when_the_disk_lacks_it(
    tmp_path, monkeypatch, capsys
):
    from omegaconf import OmegaConf

    from gptkit.model import ModelConfig
    from gptkit.training import report

    t = OmegaConf.create({"precision": "32-true", "checkpoint_every": 100, "keep_checkpoints": 3})
    # gpt2: 124M
    cfg = ModelConfig(vocab_size=50304, max_seq_len=1024, n_layers=12, n_heads=12, d_model=768)
    monkeypatch.setattr("gptkit.fsio.free_bytes", lambda path: 2 << 30)
    report.check_disk(tmp_path, cfg, t, max_steps=1000, start_step=0)
    err = capsys.readouterr().err
    # 3 kept + the one being written + last.ckpt
    assert "checkpoints: ~1.39 GiB each, up to 5 at once" in err
    assert "warning" in err and "lacks the space" in err


# ---- import never destroys its source or a run -----------------------------------------------------
def test_import_force_never_replaces_its_source_a_trained_run_or_a_locked_one(tmp_path, capsys):
    from conftest import hf_llama

    from gptkit.runs import LOCK_FILE

    src = tmp_path / "parent" / "hf"
    hf_llama(tie=False, bias=False).save_pretrained(src)
    (tmp_path / "runs").mkdir()
    trained, _, _ = make_run(tmp_path / "runs")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    # the source, around it, in it, a trained run
    for out in (src, src.parent, src / "inside", trained):
        code, _, err = run_main(capsys, "import", f"hf={src}", f"out={out}", "force=true")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before

    # an earlier import is replaced with force=true, unless a live process holds its lock
    imported = tmp_path / "runs" / "imported"
    assert run_main(capsys, "import", f"hf={src}", f"out={imported}")[0] == 0
    held = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom gptkit.runs import claim_run_dir\n"
            f"claim_run_dir({str(imported)!r}, False); print('held', flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert held.stdout.readline().strip() == "held"
        code, _, err = run_main(capsys, "import", f"hf={src}", f"out={imported}", "force=true")
        assert code == 2 and f"PID {held.pid}" in err and "out=" in err, err
        assert len(err.strip().splitlines()) == 1, err
    finally:
        held.kill()
        held.wait()
    assert run_main(capsys, "import", f"hf={src}", f"out={imported}", "force=true")[0] == 0
    assert (imported / "imported_from.json").is_file() and not (imported / LOCK_FILE).exists()


def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path):
    from gptkit.fsio import lock_file

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / ".lock").symlink_to(victim)
    with pytest.raises(GptkitError, match="symbolic link"):
        lock_file(tmp_path / ".lock")
    assert victim.read_text() == "keep me"


def test_a_ray_worker_writes_the_run_folder_its_driver_holds_and_a_fault_picks_its_rank(
    tmp_path, monkeypatch
):
    """Issue 51 item 3 (trainer.launcher=ray, .ci/ray runs the whole job): the driver holds the run folder's
    lock for the job; a worker told its PID (GPTKIT_RUN_LOCK_HOLDER) writes the folder, any other process is
    refused in one line. GPTKIT_FAULT_RANK faults one rank only, and a worker Ray restarted
    (GPTKIT_RESTART_COUNT > 0) runs clean."""
    from gptkit.fsio import lock_file
    from gptkit.runs import LOCK_HOLDER_ENV, claim_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = lock_file(run_dir / ".lock")
    os.pwrite(held, b"424242\n", 0)
    try:
        with pytest.raises(GptkitError, match="PID 424242"):
            claim_run_dir(run_dir, remove_if_unused=False)
        monkeypatch.setenv(LOCK_HOLDER_ENV, "424242")
        claim_run_dir(run_dir, remove_if_unused=False)
    finally:
        os.close(held)

    def fault(env: dict) -> int:
        code = "from gptkit.faults import fault_point\nfault_point('step')\nprint('passed')"
        env = {**os.environ, "GPTKIT_FAULT": "step", **env}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=HANG_S)
        return r.returncode

    assert fault({"RANK": "1", "GPTKIT_FAULT_RANK": "1"}) == -signal.SIGKILL
    assert fault({"RANK": "0", "GPTKIT_FAULT_RANK": "1"}) == 0
    assert fault({"RANK": "1", "GPTKIT_FAULT_RANK": "1", "GPTKIT_RESTART_COUNT": "1"}) == 0
