"""Issue 25 item 21 (what a user watching a run expects) and item 20's small ones: the gradient norm with
the loss, loss.png at every validation, a greedy sample at validations, best.ckpt; resume past the end."""

import csv
import json
from pathlib import Path

from conftest import make_run, run_main, tiny_run, write_corpus


def tiny(tmp_path: Path, name: str, *extra: str) -> list[str]:
    keys = dict(val_fraction=0.1, steps=6, progress="lines", warmup=1)
    return tiny_run(write_corpus(tmp_path), tmp_path / "runs", name, *extra, **keys)


def rows(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_gradient_norm_before_clipping_is_logged_with_the_loss(tmp_path, capsys):
    code, _, err = run_main(capsys, "train", *tiny(tmp_path, "g", "trainer.gradient_clip_val=1e-3"))
    assert code == 0, err
    norms = [float(r["train/grad_norm"]) for r in rows(tmp_path / "runs" / "g") if r.get("train/grad_norm")]
    assert len(norms) == 6
    # the norm the clipping computed, not the clipped one
    assert min(norms) > 1e-3
    assert "grad norm " in err


def test_validations_redraw_the_plot_sample_greedily_and_keep_the_best_checkpoint(
    tmp_path, capsys, monkeypatch
):
    from gptkit.training import plots, run_checkpoints

    drawn, best_saves = [], []
    real_plot, real_replace = plots.plot_loss, run_checkpoints.replace_checkpoint
    monkeypatch.setattr("gptkit.training.watch.plot_loss", lambda d: drawn.append(1) or real_plot(d))

    def replace(src, dst):
        if dst.name == "best.ckpt":
            best_saves.append(1)
        return real_replace(src, dst)

    monkeypatch.setattr(run_checkpoints, "replace_checkpoint", replace)
    args = tiny(
        tmp_path,
        "w",
        "trainer.sample_every=3",
        "trainer.keep_best=true",
        "trainer.keep_checkpoints=0",
        "optim.lr=3e-3",
    )
    code, _, err = run_main(capsys, "train", *args)
    assert code == 0, err
    run = tmp_path / "runs" / "w"
    # at the validations of steps 3 and 6 (fit draws it once more at the end)
    assert len(drawn) == 2
    samples = (run / "samples.jsonl").read_text().splitlines()
    assert [json.loads(s)["step"] for s in samples] == [3, 6]
    assert err.count(" sample: ") == 2 and "step 3  sample: " in err
    vals = [float(r["val/loss"]) for r in rows(run) if r.get("val/loss")]
    assert len(best_saves) == 1 + (vals[1] < vals[0])
    # retention (keep 0) never removes it
    assert (run / "checkpoints" / "best.ckpt").is_file()
    assert not list((run / "checkpoints").glob("step-*.ckpt"))


def test_a_broken_plot_is_one_note_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    def broken(_):
        raise RuntimeError("no display")

    monkeypatch.setattr("gptkit.training.watch.plot_loss", broken)
    args = tiny(tmp_path, "p", "trainer.max_steps=3", "trainer.val_every=1")
    code, _, err = run_main(capsys, "train", *args)
    assert code == 0, err
    assert err.count("note: redrawing loss.png failed (RuntimeError: no display)") == 1


def snapshot(run: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(run.rglob("*"))
        if p.is_file() and not p.name.endswith(".lock")
    }


def test_resume_with_max_steps_at_or_below_the_checkpoint_says_nothing_to_do_and_touches_nothing(
    tmp_path, capsys
):
    args = tiny(tmp_path, "r", "trainer.max_steps=3", "trainer.val_every=3", "trainer.log_every=3")
    assert run_main(capsys, "train", *args)[0] == 0
    run = tmp_path / "runs" / "r"
    before = snapshot(run)
    for steps in (2, 3):
        code, _, err = run_main(capsys, "train", f"resume={run}", f"trainer.max_steps={steps}")
        assert code == 0, err
        assert f"nothing to do: {run} is at step 3 and trainer.max_steps={steps}" in err
        assert snapshot(run) == before


def test_eval_stride_0_or_seq_len_0_is_one_line(tmp_path, capsys):
    from conftest import one_line

    run, _, _ = make_run(tmp_path)
    cases = (("stride=0", "stride=0 must be in [1, seq_len=64]"), ("seq_len=0", "seq_len=0 must be"))
    for arg, needle in cases:
        code, _, err = run_main(capsys, "eval", f"run={run}", arg, "progress=false")
        assert code == 2 and one_line(err) and needle in err, err


def test_a_bpe_that_trains_far_fewer_entries_than_asked_says_so_once(capsys):
    from gptkit.tokenizer import train_bpe

    tok = train_bpe(lambda: ["to be or not to be"] * 3, 5000, ["<|endoftext|>"], progress=False)
    err = capsys.readouterr().err
    assert err.count("note: tokenizer.vocab_size=5000 asked, the corpus gave a BPE of ") == 1, err
    assert f"of {tok.get_vocab_size():,} entries" in err
    train_bpe(lambda: ["to be or not to be"] * 3, 270, ["<|endoftext|>"], progress=False)
    assert "note:" not in capsys.readouterr().err


def test_16_true_on_the_cpu_gets_one_note(tmp_path, capsys):
    args = tiny(tmp_path, "h", "trainer.precision=16-true", "trainer.max_steps=1", "trainer.val_every=1")
    code, _, err = run_main(capsys, "train", *args)
    assert code == 0, err
    assert err.count("note: trainer.precision=16-true on the CPU: fp16 has no fast CPU kernels") == 1


def test_preflight_does_not_suggest_what_the_run_already_does():
    from omegaconf import OmegaConf

    from gptkit.commands.preflight import memory_advice

    t = OmegaConf.create(
        {"strategy": "auto", "batch_size": 4, "activation_checkpointing": False, "precision": "bf16-mixed"}
    )
    assert memory_advice(t).startswith("trainer=fsdp, more devices, a smaller trainer.batch_size")
    t.update(
        {"strategy": "fsdp", "batch_size": 1, "activation_checkpointing": True, "precision": "bf16-true"}
    )
    assert memory_advice(t) == "more devices"
