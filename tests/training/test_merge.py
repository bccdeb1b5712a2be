"""`gptkit merge`: step checkpoints (single-file and sharded) averaged into a new run folder, bitwise equal to
the average computed by hand in fp32; merge.json; the merged folder loads like any run and does not resume;
bad input is one line, exit 2, nothing written. trainer.ema: resumed bitwise, val/loss_ema, merge ema=true."""

import json

import pytest
import torch
from conftest import make_run, rows_by_step, run_main, tiny_run

from gptkit.checkpoints import EXTRA_STATE, STATE_PREFIX, atomic_torch_save, write_checksums


def _save_sharded(folder, state, step):
    """A sharded checkpoint folder as trainer=fsdp writes it (an index, the shard, meta.pt, checksums.json),
    written in this process."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": state}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"global_step": step}, folder / EXTRA_STATE)
    write_checksums(folder)


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """A run folder with step checkpoints 2, 4, 6 (files), 8 (a sharded folder) and 10 (another shape):
    (run folder, {step: state dict with the model. prefix})."""
    run, model, _ = make_run(tmp_path_factory.mktemp("merge"))
    ckdir = run / "checkpoints"
    g = torch.Generator().manual_seed(1)
    states = {}
    for step in (2, 4, 6, 8):
        # tied tensors (the embedding and the head) stay tied
        noise = {}
        states[step] = {
            STATE_PREFIX + k: v + noise.setdefault(v.data_ptr(), torch.randn(v.shape, generator=g) * 0.1)
            for k, v in model.state_dict().items()
        }
        if step == 8:
            _save_sharded(ckdir / "step-000008.ckpt", states[step], step)
        else:
            atomic_torch_save(
                {"state_dict": states[step], "global_step": step}, ckdir / f"step-{step:06d}.ckpt"
            )
    other = dict(states[6])
    name = next(iter(other))
    other[name] = torch.zeros(3, 3)
    atomic_torch_save({"state_dict": other, "global_step": 10}, ckdir / "step-000010.ckpt")
    return run, states


def _by_hand(states, weights):
    w = [x / sum(weights) for x in weights]
    out = {}
    for k in states[0]:
        acc = states[0][k].to(torch.float32) * w[0]
        for wi, s in zip(w[1:], states[1:]):
            acc += s[k].to(torch.float32) * wi
        out[k] = acc
    return out


def test_merge_equals_the_average_by_hand(steps, capsys, tmp_path):
    """Weighted files, and a file with a sharded folder: bitwise the fp32 average; merge.json names the
    sources; the folder loads as a run (config, tokenizer, checkpoint)."""
    from gptkit.runs import load_run

    run, states = steps
    out = tmp_path / "merged"
    code, printed, err = run_main(capsys, "merge", str(run), "steps=[2,4,6]", "weights=[1,2,3]", f"out={out}")
    assert code == 0, err
    assert printed.strip() == str(out)
    merged = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert merged["global_step"] == 6 and merged["merged_from"] == [2, 4, 6]
    expected = _by_hand([states[2], states[4], states[6]], [1, 2, 3])
    assert merged["state_dict"].keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(merged["state_dict"][k], v), k
    record = json.loads((out / "merge.json").read_text())
    assert [s["step"] for s in record["sources"]] == [2, 4, 6]
    assert [s["given_weight"] for s in record["sources"]] == [1, 2, 3]
    assert all(len(s["crc32"]) == 8 and s["bytes"] > 0 for s in record["sources"])
    assert "not carried" in record["optimizer_state"]
    loaded = load_run(out)
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(v, expected[STATE_PREFIX + k]), k
    # no optimizer state: resume= is one line (init_from= starts from it), and the folder is left as it was
    files = sorted(p.name for p in out.iterdir())
    code, _, err = run_main(capsys, "train", f"resume={out}", "trainer.max_steps=20")
    assert code == 2 and "is a merge of step checkpoints" in err and f"init_from={out}" in err, err
    assert sorted(p.name for p in out.iterdir()) == files

    # the newest two (8 is a sharded folder, read tensor by tensor), the default folder beside the run
    code, printed, err = run_main(capsys, "merge", str(run), "steps=[6,8]")
    assert code == 0, err
    default = run.parent / "run-merge-6-8-k2"
    assert printed.strip() == str(default)
    merged = torch.load(default / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    for k, v in _by_hand([states[6], states[8]], [1, 1]).items():
        assert torch.equal(merged[k], v), k
    # force=true replaces an earlier merge
    code, _, err = run_main(capsys, "merge", str(run), "steps=[6,8]", "weights=[0,1]", "force=true")
    assert code == 0, err
    merged = torch.load(default / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(merged[k], v) for k, v in states[8].items())


@pytest.mark.parametrize(
    "args, needle",
    [
        (("steps=[2,6,10]",), "checkpoints of different shapes in a merge"),
        (("steps=[2,5]",), "no checkpoint of step(s) [5]"),
        (("last=9",), "last=9 but"),
        (("steps=[2,4]", "weights=[1]"), "weights= has 1 numbers for 2 checkpoints"),
        (("steps=[2,4]", "weights=[1,-1]"), "whose sum is positive"),
        (("steps=[2,4]", "weights=[1,nan]"), "whose sum is positive"),
        (("steps=[2,4]", "last=2"), "exactly one of steps="),
        ((), "exactly one of steps="),
        (("steps=[2,2]",), "names a step twice"),
        (("last=0",), "last=0 must be at least 1"),
        (("steps=[2,x]",), "is not an integer"),
    ],
)
def test_bad_merges_are_one_line(steps, capsys, tmp_path, args, needle):
    run, _ = steps
    out = tmp_path / "out"
    code, printed, err = run_main(capsys, "merge", str(run), *args, f"out={out}")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0], lines[0]
    # nothing written, no temporary left beside it
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_merge_never_replaces_a_run(steps, capsys):
    run, _ = steps
    code, _, err = run_main(capsys, "merge", str(run), "last=2", f"out={run}", "force=true")
    assert code == 2 and "run folder" in err, err


@pytest.mark.long
def test_ema_resumes_bitwise_and_merges(corpus, tmp_path, capsys):
    """trainer.ema: a run stopped at step 3 and resumed ends with the same weights as one without EMA (the
    swap for val/loss_ema leaves training alone), its EMA at step 6 is bitwise the EMA of step 3 moved by the
    weights of steps 4, 5, 6, and bitwise an uninterrupted run's; both validations log val/loss and
    val/loss_ema; `merge ema=true` writes the EMA as a run that loads (a run without an EMA is one line)."""
    from gptkit.runs import load_run

    runs = tmp_path / "runs"
    args = tiny_run(
        corpus, runs, None, "trainer.keep_checkpoints=null", steps=6, checkpoint_every=1, threads=1
    )
    code, _, err = run_main(capsys, "train", *args, "name=plain")
    assert code == 0, err
    ema = (*args, "name=ema", "trainer.ema=0.75")
    code, _, err = run_main(capsys, "train", *ema, "trainer.stop_at_step=3")
    assert code == 0, err
    code, _, err = run_main(capsys, "train", f"resume={runs / 'ema'}", "trainer.progress=false")
    assert code == 0, err
    code, _, err = run_main(capsys, "train", *args, "name=straight", "trainer.ema=0.75")
    assert code == 0, err

    def ckpt(run, step):
        return torch.load(runs / run / "checkpoints" / f"step-{step:06d}.ckpt", weights_only=True)

    last = ckpt("ema", 6)
    assert all(torch.equal(v, ckpt("plain", 6)["state_dict"][k]) for k, v in last["state_dict"].items())
    average = ckpt("ema", 3)["callbacks"]["EMA"]["ema"]
    for step in (4, 5, 6):
        weights = ckpt("ema", step)["state_dict"]
        average = {k: v.lerp(weights[STATE_PREFIX + k].float(), 0.25) for k, v in average.items()}
    saved = last["callbacks"]["EMA"]
    assert saved["updates"] == 6 and saved["ema"].keys() == average.keys()
    assert all(torch.equal(saved["ema"][k], v) for k, v in average.items())
    straight = ckpt("straight", 6)["callbacks"]["EMA"]
    assert all(torch.equal(straight["ema"][k], v) for k, v in saved["ema"].items())
    rows = rows_by_step(runs / "ema")
    plain = rows_by_step(runs / "plain")
    for step in (3, 6):
        assert rows[step]["val/loss"] == plain[step]["val/loss"]
        assert float(rows[step]["val/loss_ema"]) > 0

    code, printed, err = run_main(capsys, "merge", str(runs / "ema"), "ema=true")
    assert code == 0, err
    model = load_run(printed.strip()).model.state_dict()
    assert all(torch.equal(model[k], v) for k, v in average.items())

    code, _, err = run_main(capsys, "merge", str(runs / "plain"), "ema=true")
    assert code == 2 and "holds no EMA" in err, err


@pytest.mark.parametrize("bad", ["trainer.ema=1", "trainer.ema=0", "trainer.ema=-0.5", "trainer.ema=true"])
def test_bad_decays_are_one_line(corpus, tmp_path, capsys, bad):
    code, _, err = run_main(capsys, "train", *tiny_run(corpus, tmp_path / "runs", "bad"), bad)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "strictly between 0 and 1" in lines[0], err
    assert not (tmp_path / "runs" / "bad").exists()
