"""Issue 25's second reliability pass: what a checkpoint, index or run folder names stays inside it, a broken
sharded checkpoint is one line, a run's saved config is validated data, and the CLI's refusals are one line.
(The cases that need a kill or a full training run are in tests/reliability/test_faults.py and
.ci/fault-loop.)"""

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from conftest import HANG_S, make_run, one_line, run_main, tiny_model, tiny_run

from gptkit.errors import GptkitError


def sharded_run(tmp_path: Path) -> Path:
    """A run folder whose last.ckpt is a sharded (torch.distributed.checkpoint) folder without checksums.json,
    as an older gptkit wrote it: a .metadata index, one shard, meta.pt."""
    import torch.distributed.checkpoint as dcp

    d, _, _ = make_run(tmp_path)
    last = d / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True)
    last.unlink()
    with warnings.catch_warnings():
        # "torch.distributed is disabled ...: save in a single process"
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": state["state_dict"]}, checkpoint_id=str(last))
    torch.save({"global_step": 3}, last / "meta.pt")
    return d


# ---- item 3: a sharded index or an HF index never names a file outside its folder ----
def test_a_sharded_index_naming_a_file_outside_its_folder_is_refused_by_every_reader(tmp_path, capsys):
    from gptkit.checkpoints import safe_reader

    d = sharded_run(tmp_path)
    last = d / "checkpoints" / "last.ckpt"
    metadata = safe_reader(last).read_metadata()
    shard = next(last.glob("*.distcp"))
    outside = tmp_path / "outside" / "secret.bin"
    outside.parent.mkdir()
    # a readable shard: only the confinement refuses it
    outside.write_bytes(shard.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = os.path.relpath(outside, last)
    (last / ".metadata").write_bytes(pickle.dumps(metadata))
    for verb, *args in (
        ("consolidate", f"run={last}"),
        ("sample", f"run={d}", "max_new_tokens=2"),
        ("eval", f"run={d}"),
    ):
        code, _, err = run_main(capsys, verb, *args)
        assert code == 2 and "lies outside" in err and "secret.bin" in err and one_line(err), (verb, err)
    # a name inside the folder that is a link leaving it
    link = last / "linked.distcp"
    link.symlink_to(outside)
    for info in metadata.storage_data.values():
        info.relative_path = link.name
    (last / ".metadata").write_bytes(pickle.dumps(metadata))
    code, _, err = run_main(capsys, "consolidate", f"run={last}")
    assert code == 2 and "lies outside" in err and one_line(err), err
    assert not list(last.parent.glob("*consolidated*"))


def test_an_hf_index_naming_a_file_outside_its_folder_is_not_imported(tmp_path, capsys):
    from conftest import hf_llama

    src, other = tmp_path / "src", tmp_path / "other"
    hf_llama(tie=False, bias=False).save_pretrained(other)
    src.mkdir()
    (src / "config.json").write_text((other / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(other / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    index = {"metadata": {}, "weight_map": {k: "../other/model.safetensors" for k in keys}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_main(capsys, "import", f"hf={src}", f"out={tmp_path / 'runs' / 'x'}")
    assert code == 2 and "lies outside" in err and "../other/model.safetensors" in err and one_line(err), err
    assert not (tmp_path / "runs").exists()


# ---- item 4: a broken sharded checkpoint is one line ----
def test_a_pickled_payload_in_the_index_or_a_truncated_shard_is_one_line(tmp_path, capsys):
    d = sharded_run(tmp_path)
    last = d / "checkpoints" / "last.ckpt"
    index = (last / ".metadata").read_bytes()
    # would call os.system if unpickled freely
    (last / ".metadata").write_bytes(pickle.dumps(os.system))
    code, _, err = run_main(capsys, "consolidate", f"run={last}")
    assert code == 2 and "not a readable checkpoint index" in err and one_line(err), err
    (last / ".metadata").write_bytes(index)
    shard = next(last.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, _, err = run_main(capsys, "consolidate", f"run={last}")
    assert code == 2 and "truncated" in err and one_line(err), err
    with pytest.raises(GptkitError, match="not a readable sharded checkpoint"):
        from gptkit.checkpoints import read_sharded_checkpoint

        read_sharded_checkpoint(last)


# ---- item 2: a run folder's files are never links that leave it ----
def test_a_run_folder_with_a_link_leaving_it_is_refused_and_the_target_untouched(tmp_path, capsys):
    d, _, _ = make_run(tmp_path)
    victim = tmp_path / "victim.json"
    victim.write_text("keep me")
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(victim)
    code, _, err = run_main(capsys, "sample", f"run={d}", "max_new_tokens=2")
    assert code == 2 and "symbolic link" in err and str(victim) in err and one_line(err), err
    code, _, err = run_main(capsys, "train", f"resume={d}")
    assert code == 2 and "symbolic link" in err and one_line(err), err
    assert victim.read_text() == "keep me"


# ---- items 10, 11, 16: a run's saved config.yaml is validated data ----
def trained_looking_run(tmp_path: Path) -> Path:
    """make_run's folder with the trainer/optim/... sections a `train` run's config.yaml has."""
    import yaml
    from omegaconf import OmegaConf

    from gptkit.conf_tree import compose

    d, _, _ = make_run(tmp_path)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    full = OmegaConf.to_container(compose("train", []), resolve=False)
    full.update(
        model=cfg["model"], tokenizer=cfg["tokenizer"], data=cfg["data"], name="run", runs_dir=str(tmp_path)
    )
    (d / "config.yaml").write_text(yaml.safe_dump(full, sort_keys=False))
    return d


@pytest.mark.parametrize(
    "edit, needle",
    [
        (("optim", "lr", "abc"), "optim.lr=abc is not a number"),
        (("seed", None, "hello"), "seed=hello is not a number"),
        (
            ("trainer", "max_tokenz", None),
            "unknown key trainer.max_tokenz (did you mean trainer.max_tokens?)",
        ),
        (("model", "n_heads", 8), "does not match its config"),
        (("model", "name", "${oc.env:SECRET_TOKEN}"), "is an interpolation"),
    ],
)
def test_a_hand_edited_config_yaml_is_refused_on_resume_naming_the_file(
    tmp_path, capsys, monkeypatch, edit, needle
):
    import yaml

    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    d = trained_looking_run(tmp_path)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    section, key, value = edit
    if key is None:
        cfg[section] = value
    else:
        cfg[section][key] = value
    if key == "max_tokenz":
        del cfg["trainer"]["max_tokens"]
    (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    before = (d / "config.yaml").read_text()
    code, _, err = run_main(capsys, "train", f"resume={d}")
    assert code == 2 and needle in err and one_line(err), err
    assert f"{d / 'config.yaml'}" in err or "config.yaml)" in err, err
    assert (
        "hunter2" not in err and (d / "config.yaml").read_text() == before
        # nothing resolved, nothing written
    )
    assert not (d / "metrics.csv").exists()


def test_sample_names_the_config_yaml_of_a_broken_model_section(tmp_path, capsys):
    import yaml

    d, _, _ = make_run(tmp_path)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cfg["model"]["n_layerz"] = 2
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    code, _, err = run_main(capsys, "sample", f"run={d}", "max_new_tokens=2")
    assert code == 2 and f"{d / 'config.yaml'}: unknown model field(s) n_layerz" in err and one_line(err), err


def test_resume_of_an_imported_run_says_to_use_init_from(tmp_path, capsys):
    from conftest import hf_llama

    src = tmp_path / "hf"
    hf_llama(tie=False, bias=False).save_pretrained(src)
    out = tmp_path / "runs" / "imported"
    assert run_main(capsys, "import", f"hf={src}", f"out={out}")[0] == 0
    code, _, err = run_main(capsys, "train", f"resume={out}")
    assert code == 2 and "no training state" in err and f"init_from={out}" in err and one_line(err), err


# ---- items 14, 17: a preset that does not exist, in any group, is one line before anything is written ----
@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["experiment=shakespeare"],
            "experiment=shakespeare is not a preset: did you mean experiment=shakespeare-char?",
        ),
        (["logger=[csv,tensorbord]"], "logger=tensorbord is not a preset: did you mean logger=tensorboard?"),
        (
            ["-m", "model=gpt2-tiny,llama_tiny"],
            "model=llama_tiny is not a preset: did you mean model=llama-tiny?",
        ),
        (["tokenizer=chars"], "(tokenizer presets: bpe, byte, char, file)"),
    ],
)
def test_a_missing_preset_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "train", *args, f"runs_dir={tmp_path / 'runs'}")
    assert code == 2 and needle in err and one_line(err), err
    # no run folder, no multirun.yaml
    assert list(tmp_path.iterdir()) == []


# ---- item 5: Ctrl-C during the final validation saves, stops, exits 130; resume finishes the validation ----
def test_ctrl_c_during_the_final_validation_keeps_the_last_step_and_exits_130(corpus, tmp_path):
    import subprocess
    import sys

    from conftest import run_cli

    from gptkit.checkpoints import checkpoint_step

    script = tmp_path / "ctrl_c_in_final_validation.py"
    script.write_text(
        "import os, signal, sys\n"
        "from gptkit.training.module import LitGPT\n"
        "step = LitGPT.validation_step\n"
        "def send(self, *args, **kw):\n"
        "    if self.trainer.global_step == 5:  # only the final validation (max_steps=5, val_every=2)\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return step(self, *args, **kw)\n"
        "LitGPT.validation_step = send\n"
        "from gptkit.cli import main\n"
        "sys.exit(main())\n"
    )
    args = tiny_run(corpus, tmp_path, "r", steps=5, val_every=2, warmup=None)
    env = dict(os.environ)
    env.pop("GPTKIT_VERB", None)
    r = subprocess.run(
        [sys.executable, str(script), "train", *args], env=env, capture_output=True, text=True, timeout=HANG_S
    )
    run = tmp_path / "r"
    assert r.returncode == 130, r.stderr[-2000:]
    assert (
        f"SIGINT: saved {run / 'checkpoints' / 'last.ckpt'} at step 5" in r.stderr
        and "Traceback" not in r.stderr
    )
    # the finished last step is kept
    assert checkpoint_step(run / "checkpoints" / "last.ckpt") == 5
    r = run_cli("train", f"resume={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = (run / "metrics.csv").read_text().splitlines()
    assert rows[-1].startswith("5,") and [row.split(",")[0] for row in rows[1:]] == [
        "1",
        "2",
        "3",
        "4",
        "5",
    ]


# ---- item 8: the run's tokenizer must fit the model ----
def test_a_tokenizer_larger_than_the_model_vocabulary_is_one_line(tmp_path, capsys):
    from gptkit.tokenizer import build_tokenizer

    d, model, _ = make_run(tmp_path)
    # 256+ ids against make_run's ~65
    big = build_tokenizer({"kind": "byte"}, texts=lambda: ["x"])
    (d / "tokenizer.json").write_text(big.to_str())
    for verb, *args in (("sample", "max_new_tokens=2"), ("eval",), ("export", f"out={tmp_path / 'hf'}")):
        code, _, err = run_main(capsys, verb, f"run={d}", *args)
        assert code == 2 and f"but the model has {model.cfg.vocab_size}" in err and one_line(err), (verb, err)
    assert not (tmp_path / "hf").exists()


# ---- item 16: run=latest is the newest run usable for the verb ----
def test_latest_skips_folders_the_verb_cannot_use(tmp_path, capsys, monkeypatch):
    import time

    from gptkit.runs import resolve_latest

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    good, _, _ = make_run(tmp_path / "runs")
    time.sleep(0.02)
    failed = tmp_path / "runs" / "failed"
    failed.mkdir()
    (failed / "config.yaml").write_text(
        (good / "config.yaml").read_text()
        # a start that failed: no checkpoint
    )
    assert resolve_latest("latest").resolve() == good.resolve()
    assert "newer folders without a checkpoint skipped" in capsys.readouterr().err
    # an import: nothing to resume
    (good / "imported_from.json").write_text("{}")
    with pytest.raises(GptkitError, match="with training to resume"):
        resolve_latest("latest", need="training")


# ---- items 19, 12: the host's memory, before the model is built; an allocation failure is one line ----
def test_a_run_too_large_for_the_host_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("gptkit.training.memory.available_memory", lambda: 1 << 30)
    runs = tmp_path / "runs"
    code, _, err = run_main(
        capsys,
        "train",
        *tiny_model(),
        "tokenizer=char",
        "trainer.batch_size=100000",
        "trainer.accelerator=cpu",
        f"runs_dir={runs}",
        "name=big",
    )
    assert (
        code == 2 and "not enough memory for this run on the CPU" in err and "1.00 GiB is available" in err
    ), err
    assert "activations" in err and "trainer.batch_size=100000" in err and one_line(err), err
    from gptkit.runs import unused

    # nothing written but the lock (the folder goes when the process exits)
    assert unused(runs / "big")


def test_the_cpu_allocators_failure_is_one_line(capsys, monkeypatch):
    from gptkit import cli

    try:
        # 100 TB: refused by the allocator at once
        torch.empty(10**14, dtype=torch.uint8)
    except RuntimeError as exc:
        error = exc
    else:
        pytest.skip("this machine allocated 100 TB")
    assert cli._report(error) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory on the CPU allocating 90.95 TiB") and one_line(err), err


# ---- item 6: a full disk names the file that failed ----
def test_a_full_disk_names_metrics_csv_the_exported_file_or_says_no_file_is_named(
    tmp_path, monkeypatch, capsys
):
    import errno

    from gptkit import cli
    from gptkit.fsio import staged_dir
    from gptkit.training.metrics_csv import MetricsCSV

    full = OSError(errno.ENOSPC, "No space left on device")

    def no_space(*args, **kwargs):
        raise full

    m = MetricsCSV(tmp_path)
    m.log_metrics({"train/loss": 1.0}, 0)
    monkeypatch.setattr(MetricsCSV, "_append", no_space)
    monkeypatch.setattr(MetricsCSV, "_rewrite", no_space)
    with pytest.raises(
        GptkitError, match=f"no space left on the disk writing {tmp_path / 'metrics.csv'}: .* is free"
    ):
        m.finalize("success")
    out = tmp_path / "hf"
    with pytest.raises(GptkitError, match=f"writing {out / 'model.safetensors'}: "):
        with staged_dir(out) as tmp:
            (tmp / "config.json").write_text("{}")
            (tmp / "model.safetensors").write_bytes(b"half")
            raise full
    # nothing half-made
    assert list(tmp_path.iterdir()) == []
    assert cli._report(OSError(errno.ENOSPC, "No space left on device")) == 2
    err = capsys.readouterr().err
    assert "the failed write names no file" in err and one_line(err), err


# ---- item 7: the next export/import/consolidate removes a killed one's leftovers, never a live one's ----
def test_leftover_temporaries_of_a_killed_export_are_removed_by_the_next_export_and_a_live_ones_kept(
    tmp_path, capsys
):
    from gptkit.fsio import locked_temp

    d, _, _ = make_run(tmp_path)
    out = tmp_path / "hf"
    fd, dead = locked_temp(out, folder=True)
    (dead / "model.safetensors").write_bytes(b"\0" * 100_000)
    # its writer is gone (kill -9 drops the lock the same way)
    os.close(fd)
    # another export of the same out, still writing
    live_fd, live = locked_temp(out, folder=True)
    other_fd, other = locked_temp(tmp_path / "hf2", folder=True)
    # a dead temporary of another out: not this export's to remove
    os.close(other_fd)
    try:
        code, _, err = run_main(capsys, "export", f"run={d}", f"out={out}")
        assert code == 0, err
        assert not dead.exists() and live.is_dir() and other.is_dir() and (out / "config.json").is_file()
        assert "removed 1 temporary copy" in err and "97.66 KiB" in err, err
    finally:
        os.close(live_fd)
    ckpt = tmp_path / "single.ckpt"
    fd, dead = locked_temp(ckpt)
    os.close(fd)
    from gptkit.fsio import remove_dead_temps

    assert remove_dead_temps(ckpt) == [dead] and not dead.exists()


# ---- item 15: threads not set on a loaded machine: the count that fits, said once ----
def test_unset_threads_on_a_loaded_machine_use_the_count_that_fits_and_an_explicit_count_is_kept(
    monkeypatch, capsys
):
    import gptkit.threads
    from gptkit.threads import set_threads

    monkeypatch.setattr(gptkit.threads, "cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    # one of the two cores busy with other work
    monkeypatch.setattr(gptkit.threads, "busy_now", lambda: 1.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        # torch's default on two cores
        torch.set_num_threads(2)
        assert set_threads(None, "trainer.threads") == 1 and torch.get_num_threads() == 1
        err = capsys.readouterr().err
        assert err == (
            "note: 1 torch thread instead of 2: other work loads 1.0 of the 2 cores "
            "(set trainer.threads=2 to use 2 anyway)\n"
        ), err
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert (
            set_threads(2, "trainer.threads") == 2 and torch.get_num_threads() == 2
            # the user's count: kept
        )
        assert capsys.readouterr().err.startswith("warning: 2 torch threads on 2 cores")
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        # not on the CPU: untouched
        assert set_threads(None, "threads", warn=False) == 2
    finally:
        torch.set_num_threads(before)


# ---- item 9: a metrics.csv cut short before a resume is said, once ----
def test_a_truncated_metrics_csv_names_the_missing_steps_on_resume(tmp_path, capsys):
    from gptkit.training.metrics_csv import MetricsCSV, missing_tail

    # rows 1-5 left of 1-12
    lines = ["step,train/loss"] + [f"{s},{4 - s / 10}" for s in range(1, 6)]
    (tmp_path / "metrics.csv").write_text("\n".join(lines) + "\n")
    MetricsCSV(tmp_path, resume_step=12).finalize("success")
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "has no rows for steps 6-12" in err, err
    # log_every=10
    assert missing_tail([10, 20, 30, 40], 40) is None
    assert missing_tail([10, 20, 30], 39) is None
    assert missing_tail([10, 20], 40) == (21, 40)
    assert missing_tail(list(range(1, 13)), 12) is None and missing_tail(list(range(1, 12)), 12) == (12, 12)


# ---- item 13: bit rot in last.ckpt names only the checkpoints that are not the same file ----
def test_a_corrupted_last_ckpt_advises_only_checkpoints_that_are_other_files(tmp_path, capsys):
    from gptkit.checkpoints import atomic_torch_save, link_checkpoint

    ckdir = tmp_path / "run" / "checkpoints"
    for step in (3, 6):
        atomic_torch_save(
            {"state_dict": {"model.w": torch.full((64,), float(step))}, "global_step": step},
            ckdir / f"step-{step:06d}.ckpt",
        )
    # as training publishes it
    link_checkpoint(ckdir / "step-000006.ckpt", ckdir / "last.ckpt")
    data = bytearray((ckdir / "last.ckpt").read_bytes())
    data[len(data) // 2] ^= 0x04
    # in place: the hard-linked step-000006.ckpt rots with it
    (ckdir / "last.ckpt").write_bytes(bytes(data))
    from gptkit.checkpoints import load_checkpoint

    with pytest.raises(GptkitError) as err:
        load_checkpoint(ckdir / "last.ckpt")
    msg = str(err.value)
    assert "(step-000006.ckpt: the same file, corrupted too)" in msg, msg
    assert msg.endswith(f"take an earlier checkpoint of the run ({ckdir / 'step-000003.ckpt'})"), msg


# ---- item 18: the kernel benchmarks without Triton run what can run ----
def test_bench_kernels_without_triton_runs_the_pure_torch_rows_and_names_the_install(monkeypatch, capsys):
    from omegaconf import OmegaConf

    from gptkit.bench import kernels

    monkeypatch.setattr("gptkit.bench.attention.triton_version", lambda: None)
    assert kernels.run(OmegaConf.create({"out": None, "loss_shapes": []})) == 0
    out = capsys.readouterr().out
    assert "triton not installed" in out.splitlines()[0]
    assert (
        "what=doc-tiles, kernel, model  note=not measured: triton is not installed: "
        "pip install 'gptkit[triton]'"
    ) in out


# ---- item 20: small ones ----
def test_version_verb_did_you_mean_and_a_bare_run_path(tmp_path, capsys, monkeypatch):
    from gptkit import __version__

    assert run_main(capsys, "--version")[:2] == (0, f"gptkit {__version__}\n")
    # set by earlier in-process calls, as in a DDP child
    monkeypatch.delenv("GPTKIT_VERB", raising=False)
    code, _, err = run_main(capsys, "smaple")
    assert code == 2 and "did you mean sample?" in err and one_line(err), err
    code, _, err = run_main(capsys, "sample", "runs/x")
    assert code == 2 and "did you mean run=runs/x?" in err and one_line(err), err
