"""Ctrl-C (SIGINT) and SIGTERM: a training run saves the step it is at, skips a validation that has not
started, prints its saved line last (no `done:`) and exits 130 / 143; its resume ends equal to an
uninterrupted run. A prepare says "interrupted" once, without a worker's traceback.

The signal is sent from inside the process (a patched hook), at a known point of the run: no sleeps.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_S, module_corpus, run_cli, tiny_run, trained
from conftest import timeless_rows as rows

STEPS = 6

# SIG and AT (the step during which the signal arrives) or IN_VAL (the step whose validation it
# interrupts) come from the environment; each validation batch of a step after the signal's adds a line
# to VAL_AFTER (the test asserts that none did)
SEND_SIGNAL = """import os, signal, sys
from gptkit.training.module import LitGPT
from gptkit.training.run_checkpoints import RunCheckpoints
sig = getattr(signal, os.environ["SIG"])
at, in_val, sent = int(os.environ.get("AT", 0)), int(os.environ.get("IN_VAL", 0)), []
start, step = RunCheckpoints.on_train_batch_start, LitGPT.validation_step
def during_step(self, trainer, *args):
    if trainer.global_step == at - 1 and not sent:
        sent.append(trainer.global_step)
        os.kill(os.getpid(), sig)
    return start(self, trainer, *args)
def validation_step(self, *args, **kw):
    if sent and self.trainer.global_step > sent[0]:
        with open(os.environ["VAL_AFTER"], "a") as f:
            f.write(f"{self.trainer.global_step}\\n")
    if self.trainer.global_step == in_val and not sent:
        sent.append(in_val)
        os.kill(os.getpid(), sig)
    return step(self, *args, **kw)
RunCheckpoints.on_train_batch_start = during_step
LitGPT.validation_step = validation_step
from gptkit.cli import main
sys.exit(main())
"""


corpus = module_corpus(20_000)


def tiny(corpus: Path, runs: Path, name: str, *extra: str) -> list[str]:
    return tiny_run(corpus, runs, name, *extra, steps=STEPS, val_every=2)


def weights(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("ref")
    return trained(tiny(corpus, runs, "ref"), runs / "ref")


def signalled(tmp_path: Path, argv: list[str], **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "send_signal.py"
    script.write_text(SEND_SIGNAL)
    e = dict(os.environ, VAL_AFTER=str(tmp_path / "val_after"), **env)
    e.pop("GPTKIT_VERB", None)
    return subprocess.run(
        [sys.executable, str(script), *argv], env=e, capture_output=True, text=True, timeout=HANG_S
    )


@pytest.mark.parametrize(
    "sig, code, when, saved",
    [
        # during step 4, whose validation (val_every=2) would follow: skipped
        pytest.param("SIGINT", 130, {"AT": "4"}, 4, marks=pytest.mark.long),
        # during step 3: no validation is due, and Lightning's own one at a stop is skipped too
        pytest.param("SIGTERM", 143, {"AT": "3"}, 3, marks=pytest.mark.long),
        # during the validation at step 2: it finishes, step 3 is trained and saved, no validation after it
        ("SIGINT", 130, {"IN_VAL": "2"}, 3),
        # during the last step (6, validated at the end)
        pytest.param("SIGTERM", 143, {"AT": "6"}, 6, marks=pytest.mark.long),
    ],
)
def test_a_signal_saves_the_step_skips_the_validation_and_the_resume_is_exact(
    corpus, reference, tmp_path, sig, code, when, saved
):
    r = signalled(tmp_path, ["train", *tiny(corpus, tmp_path, "s")], SIG=sig, **when)
    # no validation step ran after the signal
    assert not (tmp_path / "val_after").exists(), (tmp_path / "val_after").read_text()
    stopped_then_resumed_exactly(r, tmp_path / "s", reference, sig, code, saved)


@pytest.mark.parametrize(
    "fault, sig, code, saved",
    [
        # GPTKIT_FAULT's signal form: at the end of step 3, before its checkpoint
        pytest.param("step@3:SIGTERM", "SIGTERM", 143, 3, marks=pytest.mark.long),
        # during the validation at step 4: it finishes, step 5 is saved
        ("validation@2:SIGINT", "SIGINT", 130, 5),
    ],
)
def test_a_signal_from_gptkit_fault_stops_as_a_real_one(corpus, reference, tmp_path, fault, sig, code, saved):
    r = run_cli("train", *tiny(corpus, tmp_path, "s"), env={"GPTKIT_FAULT": fault})
    stopped_then_resumed_exactly(r, tmp_path / "s", reference, sig, code, saved)


def stopped_then_resumed_exactly(r, run: Path, reference: Path, sig: str, code: int, saved: int) -> None:
    """`r` stopped by `sig` with `code`, its last line the saved line of step `saved`; then resumed, it
    equals the uninterrupted `reference`."""
    assert r.returncode == code, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    # the saved line last, no summary of a finished run
    assert lines[-1] == (
        f"{sig}: saved {run / 'checkpoints' / 'last.ckpt'} at step {saved}; continue with: gptkit train "
        f"resume={run}"
    ), r.stderr[-3000:]
    assert not any(ln.startswith("done:") for ln in lines) and "Traceback" not in r.stderr
    assert weights(run)["global_step"] == saved
    # the resume runs the validation the signal skipped, then the rest: equal to an uninterrupted run
    r = run_cli("train", f"resume={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert rows(run) == rows(reference)
    got, want = weights(run)["state_dict"], weights(reference)["state_dict"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


# ---- Ctrl-C in prepare ------------------------------------------------------------------------------
# A terminal's Ctrl-C goes to the whole foreground process group: the prepare and its workers. AT says when:
# "start": as soon as both workers have their SIGINT disposition set (Python's handler installed, or ignored
# or blocked from the start), read from /proc, while they import; a number: at that complete shard.
CTRL_C_PREPARE = """import os, signal, sys, time
import gptkit.data.build as b, gptkit.data.shards as s, gptkit.data.tokenize as t
at = os.environ.get("AT", "")
def ctrl_c():
    os.killpg(os.getpgid(0), signal.SIGINT)
def set_up(pid):
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    return any(int(fields[k], 16) >> (signal.SIGINT - 1) & 1 for k in ("SigCgt", "SigIgn", "SigBlk"))
start = b.start_workers
def start_workers(n):
    pool = start(n)
    if at == "start":
        while not all(set_up(pid) for pid in list(pool._processes)):
            time.sleep(0.01)
        ctrl_c()
    return pool
point, shards = s.fault_point, []
def fault_point(name):
    if name == "prepare-shard" and at.isdigit():
        shards.append(name)
        if len(shards) == int(at):
            ctrl_c()
    point(name)
# (each spawned worker imports this file again: only the prepare runs it)
if __name__ == "__main__":
    t.PIECE_CHARS, t.HARD_CHARS, t.BATCH_CHARS, s.SHARD_TOKENS = 600, 1200, 2000, 1500
    b.start_workers, s.fault_point = start_workers, fault_point
    from gptkit.cli import main
    sys.exit(main())
"""


def ctrl_c_prepare(tmp_path: Path, corpus: Path, at: str, cache: Path) -> subprocess.CompletedProcess:
    """The prepare of `corpus` into `cache` with 2 BPE workers and small shards, Ctrl-C at `at` (AT above;
    "": none)."""
    script = tmp_path / "ctrl_c_prepare.py"
    script.write_text(CTRL_C_PREPARE)
    e = dict(os.environ, AT=at)
    e.pop("GPTKIT_VERB", None)
    argv = [
        "prepare",
        "data=files",
        f"data.paths=[{corpus}]",
        "data.workers=2",
        "tokenizer=bpe",
        "tokenizer.vocab_size=300",
        f"cache_dir={cache}",
        "progress=false",
    ]
    # its own process group: the Ctrl-C reaches the prepare and its workers, not pytest
    return subprocess.run(
        [sys.executable, str(script), *argv],
        env=e,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        start_new_session=True,
    )


@pytest.mark.parametrize("at", ["start", "3"])
def test_ctrl_c_in_a_prepare_with_two_workers_is_one_line_and_keeps_the_complete_shards(corpus, tmp_path, at):
    cache = tmp_path / "cache"
    r = ctrl_c_prepare(tmp_path, corpus, at, cache)
    assert r.returncode == 130, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if "interrupted" in ln]
    # once, last, and no worker's traceback
    assert len(said) == 1 and r.stderr.strip().splitlines()[-1] == said[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr[-3000:]
    (partial,) = cache.glob(".*.partial")
    assert said[0].startswith(f"interrupted: the complete shards are kept in {partial}")
    if at == "3":
        # the 3 complete shards are kept, and the same command continues from them
        state = json.loads((partial / "progress.json").read_text())
        assert sum(sp["tokens"] for sp in state["splits"].values()) >= 3 * 1500
        again = ctrl_c_prepare(tmp_path, corpus, "", cache)
        assert again.returncode == 0 and "continuing the interrupted build" in again.stderr, again.stderr
