"""Issue 47, fourth pass (inputs): a path option that is a URL is refused in one line, never made a folder
named `s3:`; a hand-edited plan.json is checked by trace."""

import os

import pytest
from conftest import run_main

from gptkit.errors import ConfigError
from gptkit.options import PATH_KEYS, check_paths, is_path_key

URL = "s3://bucket/x"
# every path option of every verb: (verb and its other args, the path option); the s3:// locations gptkit
# reads and writes (runs_dir=, resume=, run=, data.dir=, cache_dir=, out=, hf= of the verbs in
# test_object_storage.S3_OPTIONS) are checked there
PATH_OPTIONS = [
    ("train", f"init_from={URL}"),
    ("train data=files", f"data.paths=[corpus.txt,{URL}]"),
    ("train data=files data.paths=[corpus.txt]", f"data.val_paths=[{URL}]"),
    ("train tokenizer=file", f"tokenizer.path={URL}"),
    ("prepare data=files", f"data.paths=[{URL}]"),
    ("sample run=runs/x", f"prompt_file={URL}"),
    ("chat", f"run={URL}"),
    ("chat run=runs/x", f"template={URL}"),
    ("serve", f"run={URL}"),
    ("serve run=runs/x", f"template={URL}"),
    ("eval run=runs/x", f"out={URL}"),
    ("eval run=runs/x", f"tasks={URL}"),
    ("import hf=folder", f"out={URL}"),
    ("consolidate", f"run={URL}"),
    ("consolidate run=runs/x", f"out={URL}"),
    ("attention", f"run={URL}"),
    ("attention run=runs/x", f"out={URL}"),
    ("plot", f"run={URL}"),
    ("trace", f"run={URL}"),
    ("trace run=latest", f"runs_dir={URL}"),
    ("verify", f"dir={URL}"),
    ("bench data", f"bench.file={URL}"),
    ("bench data", f"bench.out={URL}"),
    ("bench optim", f"bench.runs_dir={URL}"),
]


@pytest.mark.parametrize(
    "verb_args, option", PATH_OPTIONS, ids=[f"{v.split()[0]}-{o}" for v, o in PATH_OPTIONS]
)
def test_a_url_in_any_path_option_is_one_line_and_makes_no_folder(
    tmp_path, monkeypatch, capsys, verb_args, option
):
    monkeypatch.chdir(tmp_path)
    key = option.split("=")[0]
    code, out, err = run_main(capsys, *verb_args.split(), option)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines == [
        f"error: {key}={URL}: URLs (s3://) are not supported yet; give a local "
        + ("folder" if key.endswith("dir") else "path")
    ], err
    # nothing made here, least of all a folder named after the scheme
    assert not any(p.name.startswith("s3:") for p in tmp_path.rglob("*"))
    assert list(tmp_path.iterdir()) == []


def test_hf_prefix_of_init_from_still_works_and_hf_url_gets_the_spelling(tmp_path, monkeypatch, capsys):
    from gptkit.fsio import check_local_path

    # hf:<owner/name | folder> is init_from's own scheme-like prefix: not a URL
    for ok in ("hf:owner/name", "hf:/models/llama", "runs/x", "relative/s3:/x", "C:/x", None, 3):
        check_local_path("init_from", ok)
    with pytest.raises(ConfigError, match=r"^init_from=hf://owner/name: write init_from=hf:<owner/name"):
        check_local_path("init_from", "hf://owner/name")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "train", "init_from=hf://owner/name")
    assert code == 2 and err.count("\n") == 1 and "init_from=hf:<owner/name" in err, err


def test_a_url_set_by_a_preset_is_refused_as_the_command_line_is():
    # what an experiment preset composes: checked after composition
    with pytest.raises(ConfigError, match=r"^runs_dir=gs://b/runs: URLs \(gs://\)"):
        check_paths({"runs_dir": "gs://b/runs", "model": {"name": "x"}})
    with pytest.raises(ConfigError, match=r"^data\.val_paths=file:///x: URLs \(file://\)"):
        check_paths({"data": {"kind": "files", "paths": ["a.txt"], "val_paths": ["file:///x"]}})
    # text is not a path: a prompt may quote a URL
    check_paths({"prompt": "see https://example.com", "system": "s3://x is a bucket", "run": "runs/x"})
    assert is_path_key("data.sources.web.paths") and not is_path_key("prompt")
    assert {"run", "out", "runs_dir", "init_from", "resume", "cache_dir", "paths"} <= set(PATH_KEYS)


def test_gptkit_cache_as_a_url_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "corpus.txt").write_text("hello world\n" * 50)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPTKIT_CACHE", URL)
    code, _, err = run_main(capsys, "prepare", "data=files", "data.paths=[corpus.txt]", "tokenizer=byte")
    assert code == 2, err
    assert err.strip().splitlines() == [
        f"error: GPTKIT_CACHE={URL}: URLs (s3://) are not supported yet; give a local path"
    ], err
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]


# ---- item 8: resume= checks the run's own trainer; trace checks plan.json -------------------------------
@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A 2-step moe-tiny run (one process), with plan.json."""
    from conftest import shakespeare

    from gptkit.cli import main

    d = tmp_path_factory.mktemp("moe")
    (d / "corpus.txt").write_text(shakespeare(8_000))
    args = [
        "train",
        "model=moe-tiny",
        "model.n_layers=1",
        "model.d_model=32",
        "model.n_heads=2",
        "model.max_seq_len=32",
        "model.moe.n_experts=4",
        "model.moe.d_expert=16",
        "tokenizer=char",
        "data=files",
        f"data.paths=[{d / 'corpus.txt'}]",
        "trainer.batch_size=2",
        "trainer.max_steps=2",
        "trainer.val_every=2",
        "trainer.val_windows=1",
        "trainer.progress=false",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        f"runs_dir={d / 'runs'}",
        "name=moe",
    ]
    assert main(args) == 0
    return d / "runs" / "moe"


def test_resume_checks_the_saved_trainer_not_the_command_line_default(moe_run, tmp_path, capsys):
    """trainer.expert_parallel=2 on resume= of an FSDP run: the check sees the run's trainer=fsdp (its saved
    config, the command line merged in), so its refusal here is the world of 1 process, not 'needs
    trainer=fsdp' (what the command line's default trainer said)."""
    import shutil

    from omegaconf import OmegaConf

    run = tmp_path / "runs" / "moe"
    shutil.copytree(moe_run, run)
    saved = OmegaConf.load(run / "config.yaml")
    assert saved.trainer.strategy != "fsdp"
    # the run's config is FSDP's (trained as trainer=fsdp: the check stops before any weight is read)
    saved.trainer.strategy = "fsdp"
    OmegaConf.save(saved, run / "config.yaml")
    code, _, err = run_main(capsys, "train", f"resume={run}", "trainer.expert_parallel=2")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "trainer.expert_parallel=2 must divide the job's 1 process(es)" in lines[0], (
        err
    )
    assert "needs trainer=fsdp" not in err


PLAN_EDITS = {
    "max_steps -5": (lambda inv: inv[0].update(max_steps=-5), "invocations[0].max_steps is -5"),
    "a string": (lambda inv: inv[0].update(accumulation="2"), "invocations[0].accumulation is '2'"),
    "zero world": (lambda inv: inv[0].update(world_size=0), "invocations[0].world_size is 0"),
    "missing": (lambda inv: inv[0].pop("seq_len"), "invocations[0].seq_len is missing"),
    "a bool": (lambda inv: inv[0].update(seed=True), "invocations[0].seed is True"),
    "not rising": (lambda inv: inv.append(dict(inv[0])), "invocations[1].from_step=1 does not follow"),
    "not objects": (lambda inv: inv.__setitem__(0, 7), "invocations[0] is 7, not an object"),
}


@pytest.mark.parametrize("edit", PLAN_EDITS)
def test_trace_checks_a_hand_edited_plan_json(moe_run, tmp_path, capsys, edit):
    import json
    import shutil

    run = tmp_path / "moe"
    shutil.copytree(moe_run, run)
    plan = json.loads((run / "plan.json").read_text())
    change, needle = PLAN_EDITS[edit]
    change(plan["invocations"])
    (run / "plan.json").write_text(json.dumps(plan))
    code, out, err = run_main(capsys, "trace", f"run={run}", "step=1")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {run / 'plan.json'}: {needle}"), err
    assert "fix it, or remove the file" in err and out == ""


def test_trace_of_a_cut_plan_json_and_of_a_step_before_it_was_written(moe_run, tmp_path, capsys):
    import json
    import shutil

    run = tmp_path / "moe"
    shutil.copytree(moe_run, run)
    good = json.loads((run / "plan.json").read_text())
    want = run_main(capsys, "trace", f"run={run}", "step=1", "--json")
    assert want[0] == 0, want[2]
    (run / "plan.json").write_text('{"invocations": [{"from_')
    code, _, err = run_main(capsys, "trace", f"run={run}", "step=1")
    assert code == 2 and err.count("\n") == 1 and "plan.json: not readable JSON" in err, err
    # a plan.json that starts at step 2 (a run resumed by a gptkit that writes it): step 1 planned from config
    good["invocations"][0]["from_step"] = 2
    (run / "plan.json").write_text(json.dumps(good))
    code, out, err = run_main(capsys, "trace", f"run={run}", "step=1", "--json")
    assert code == 0, err
    assert json.loads(out)["micro_batches"] == json.loads(want[1])["micro_batches"]
