"""The CLI takes only what it will use: an option no code reads, a value of the wrong type, a sweep
without -m or a required value left unset is one line on stderr with exit status 2, before anything is
written; every other user mistake on the bad-input list is one line too. Threads and start-up imports.

Most cases call gptkit.cli.main in process (the checks run before any verb code); the ones raised
inside `train` run it as a subprocess, as a user does.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_S, TINY_LLAMA, make_run, one_line_error, refused_before_torch, run_main

from gptkit.cli import VERBS


def one_line(capsys, *args) -> str:
    code, _, err = run_main(capsys, *args)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("strict"))[0]


# ---- issue 15, item 2: never train on something other than what was asked -------------------------
@pytest.mark.parametrize("plus", ["", "+"])
def test_a_key_of_another_preset_names_the_preset(capsys, tmp_path, plus):
    err = one_line(capsys, "train", f"{plus}data.paths={tmp_path / 's.txt'}", f"runs_dir={tmp_path / 'runs'}")
    assert (
        "data.paths needs data=files or data=chat or data=tokens or data=prompts or data=preference or "
        f"data=unpaired (data is pydoc now): data=files data.paths={tmp_path / 's.txt'}"
    ) in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("verb", list(VERBS))
def test_a_key_no_code_reads_is_refused_on_every_verb(capsys, verb):
    args = [verb] + (["data"] if verb == "bench" else []) + ["+trainer.max_step=3"]
    err = one_line(capsys, *args)
    assert "unknown option trainer.max_step" in err
    if verb in ("train", "preflight"):
        assert "did you mean trainer.max_steps?" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["count-params", "model.n_layer=2"], "unknown option model.n_layer: did you mean model.n_layers?"),
        (
            ["train", "logger.wandb.mode=online"],
            "logger.wandb.mode needs the wandb logger: logger=[csv,wandb]",
        ),
        (["train", "tokenizer=char", "tokenizer.vocab_size=100"], "tokenizer.vocab_size needs tokenizer=bpe"),
        (
            ["eval", "run=x", "data.paths=a.txt"],
            "data.paths needs data=files or data=chat or data=tokens or data=prompts or data=preference or "
            "data=unpaired "
            "(no data is chosen)",
        ),
        (["bench", "data", "seq_lens=[1]"], "bench.seq_lens needs bench=attention"),
        (["train", "data.path=x"], "did you mean data.paths (with data=files)?"),
        (
            ["train", "+trainer.max_steps=3"],
            "trainer.max_steps is an option already: write trainer.max_steps=3",
        ),
        (["train", "data=hub"], "data.name is required with data=hub"),
        (["sample"], "run is required"),
        (["train", "trainer.progress=maybe"], "trainer.progress='maybe' is not one of auto, bar, lines, off"),
        (
            ["train", "optim.betas=[0.9,0.95]", "trainer.max_steps=inf"],
            "trainer.max_steps=inf is not a number",
        ),
    ],
)
def test_options_are_checked_against_the_verbs_config(capsys, args, message):
    assert message in one_line(capsys, *args)


def test_free_form_maps_take_new_keys():
    from gptkit.options import check_options, parse_options

    args = [
        "bench=sample",
        "~bench.models",
        "+bench.models.x.preset=gpt2-tiny",
        "+bench.model_overrides.n_layers=1",
    ]
    cfg = check_options("bench", parse_options(args))
    assert list(cfg.bench.models) == ["x"] and cfg.bench.models.x.preset == "gpt2-tiny"


@pytest.mark.parametrize(
    "tokens, want",
    [("2T", 2e12), ("300B", 300e9), ("1.5e12", 1.5e12), ("20M", 20e6), ("4k", 4e3), ("1000", 1000.0)],
)
def test_count_params_reads_token_counts_as_it_prints_them(capsys, tokens, want):
    code, out, err = run_main(capsys, "count-params", f"tokens={tokens}", "--json")
    assert code == 0, err
    assert json.loads(out)["plan"]["tokens"] == want


# ---- issue 17, item 6: every user mistake is one line, exit 2 -----------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "optim.lr=abc"], "optim.lr=abc is not a number (the default is optim.lr=0.001)"),
        (["train", "seed=abc"], "seed=abc is not a number (the default is seed=1337)"),
        (
            ["count-params", "tokens=abc"],
            "tokens=abc is not a positive count; write e.g. tokens=300B, 2T or 1.5e12",
        ),
        (["count-params", "tokens=-1"], "tokens=-1 is not a positive count"),
        (
            ["train", "optim.lr=1,2"],
            "optim.lr=1,2: a comma separates the values of a sweep, which only `gptkit train -m`",
        ),
        (["count-params", "model.n_layers=1,2"], "write a list as model.n_layers=[1,2]"),
        (
            ["train", "name=caf\u00e9"],
            "name=caf\u00e9: Hydra reads only ASCII characters in an unquoted value; quote it",
        ),
        (["count-params", "model.n_layers"], "model.n_layers has no value"),
    ],
)
def test_bad_values_are_one_line_naming_the_option(capsys, args, message):
    assert message in one_line(capsys, *args)


def test_a_list_of_overrides_gets_a_suggestion_that_reads_as_that_list(capsys):
    from gptkit.options import parse_options

    err = one_line(capsys, "bench", "grpo", "overrides=[trainer.max_steps=10,trainer.val_every=5]")
    suggestion = err.split("characters: ")[1].strip().strip("'")
    assert suggestion == 'bench.overrides=["trainer.max_steps=10","trainer.val_every=5"]'
    assert parse_options([suggestion])[0].value == ["trainer.max_steps=10", "trainer.val_every=5"]


def test_a_quoted_non_ascii_value_is_read(capsys):
    from gptkit.options import parse_options

    assert parse_options(["name='caf\u00e9'"])[0].value == "caf\u00e9"


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc")
def test_a_runs_folder_that_cannot_be_made(capsys):
    assert "cannot write the runs folder /proc/x" in one_line(capsys, "train", "runs_dir=/proc/x")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["trainer.max_tokens=-1"], "trainer.max_tokens=-1 is not a positive count"),
        (["trainer.devices=-1"], "trainer.devices=-1: write trainer.devices=auto"),
        (["trainer.threads=0"], "trainer.threads=0 must be an integer >= 1"),
    ],
)
def test_train_values_are_one_line_naming_the_option(cli, tmp_path, extra, message):
    r = cli("train", f"runs_dir={tmp_path}", "name=x", *extra)
    line = one_line_error(r, message)
    assert "max_steps" not in line and "TypeError" not in line


def test_prompt_file_that_is_not_utf8_or_a_folder(capsys, run_dir, tmp_path):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    err = one_line(capsys, "sample", f"run={run_dir}", f"prompt_file={tmp_path / 'latin1.txt'}")
    assert "latin1.txt: byte 3 (b'\\xe9') is not valid UTF-8" in err
    err = one_line(capsys, "sample", f"run={run_dir}", f"prompt_file={tmp_path}")
    assert f"prompt_file={tmp_path} is a folder" in err


def test_tokenizer_path_that_is_a_folder(capsys, tmp_path):
    err = one_line(
        capsys, "prepare", "tokenizer=file", f"tokenizer.path={tmp_path}", f"cache_dir={tmp_path / 'c'}"
    )
    assert f"tokenizer file {tmp_path} is a folder" in err


def test_attention_needs_a_text(capsys, run_dir):
    err = one_line(capsys, "attention", f"run={run_dir}", "text=")
    assert 'attention needs a text to look at: text="..."' in err


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


@pytest.mark.parametrize(
    "content, message",
    [
        (
            "exploit",
            "would run code when loaded (posix.system), which weights_only=True refuses: a checkpoint "
            "holds only tensors and plain data; use a checkpoint you trust",
        ),
        (b"", "is empty (0 bytes), not a checkpoint"),
        (
            bytes(range(256)) * 4,
            "is not a torch checkpoint (not the zip archive torch.save writes: truncated, or another",
        ),
    ],
)
def test_bad_checkpoint_files_are_one_complete_line(capsys, tmp_path, content, message):
    d = make_run(tmp_path)[0]
    ckpt = d / "checkpoints" / "last.ckpt"
    if content == "exploit":
        torch.save({"state_dict": {}, "x": Exploit()}, ckpt)
    else:
        ckpt.write_bytes(content)
    code, out, err = run_main(capsys, "sample", f"run={d}")
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert "_use_new_zipfile_serialization" not in err and "this must never run" not in out


def test_llama_config_without_max_position_embeddings(capsys, tmp_path):
    from conftest import hf_llama

    hf_llama(tie=False, bias=False).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["max_position_embeddings"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    # transformers' progress bar
    capsys.readouterr()
    err = one_line(capsys, "import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}")
    assert "llama config.json has no max_position_embeddings" in err


def test_export_under_a_file(capsys, run_dir, tmp_path):
    (tmp_path / "f").write_text("x")
    err = one_line(capsys, "export", f"run={run_dir}", f"out={tmp_path / 'f' / 'sub'}")
    assert f"{tmp_path / 'f'} is a file, so no folder can be made in it" in err


def test_import_says_what_the_weights_confirm_about_the_heads(capsys, tmp_path):
    from conftest import hf_gpt2

    # 4 heads of 8
    hf_gpt2(tie=True).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    # the same tensor shapes: nothing in the weights contradicts it
    config["n_head"] = 2
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    code, out, err = run_main(capsys, "import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}")
    assert code == 0, err
    assert "attention heads: n_heads=2 from config.json; the weight shapes cannot confirm it" in out


# ---- issue 15, item 4: threads ----------------------------------------------------------------------
def test_oversubscription_warning_names_the_fix():
    from gptkit.threads import oversubscribed

    # one other job on two cores
    msg = oversubscribed(2, 1, "trainer.threads", load=1.0, n_cores=2)
    assert "2 torch threads on 2 cores" in msg and "set trainer.threads=1 (or OMP_NUM_THREADS=1)" in msg
    # nothing better to suggest
    assert oversubscribed(1, 1, "threads", load=1.0, n_cores=2) is None
    # a quiet machine
    assert oversubscribed(2, 1, "threads", load=0.2, n_cores=2) is None
    # DDP on CPU
    assert "x 4 processes" in oversubscribed(2, 4, "trainer.threads", load=0.0, n_cores=4)


def test_a_load_average_left_by_work_that_has_ended_gives_no_warning(monkeypatch):
    """The 1-minute average lags: right after a `gptkit train`, `gptkit sample` must not warn because of
    it."""
    import gptkit.threads
    from gptkit.threads import oversubscribed

    monkeypatch.setattr(gptkit.threads, "cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.3, 1.0, 1.0))
    # the machine is quiet now
    monkeypatch.setattr(gptkit.threads, "busy_now", lambda: 0.1)
    assert oversubscribed(2, 1, "threads") is None
    # still busy: the warning, with the load now
    monkeypatch.setattr(gptkit.threads, "busy_now", lambda: 1.2)
    assert "already loads (1.2)" in oversubscribed(2, 1, "threads")


def test_busy_now_is_the_machine_s_busy_cpu_time_less_this_process_s_per_second(monkeypatch):
    """busy_now's arithmetic on a controlled /proc/stat and clock (the live machine's load is no input to a
    test): busy ticks (all but idle and iowait) over the wait, less this process's CPU time, per wall
    second."""
    import io
    from types import SimpleNamespace

    import gptkit.threads
    from gptkit.threads import busy_now

    # user nice system idle iowait irq softirq steal, at the start and the end of the wait
    stats = iter(["cpu  100 5 50 9000 40 0 5 0\n", "cpu  250 5 90 9100 90 10 5 0\n"])
    waits = []
    # process_time, then perf_counter, at the start and at the end
    process_time = iter([10.0, 10.3])
    perf_counter = iter([50.0, 50.5])
    clock = SimpleNamespace(
        sleep=waits.append, process_time=lambda: next(process_time), perf_counter=lambda: next(perf_counter)
    )
    monkeypatch.setattr(gptkit.threads, "open", lambda path: io.StringIO(next(stats)), raising=False)
    monkeypatch.setattr(gptkit.threads, "time", clock)
    monkeypatch.setattr(os, "sysconf", lambda name: 100)
    # busy ticks 160 -> 360: 2.0 s of CPU in 0.5 s, 0.3 s of it this process's: (2.0 - 0.3) / 0.5
    assert busy_now(0.5) == pytest.approx(3.4) and waits == [0.5]

    # this process alone was busy: none other, never below zero
    stats = iter(["cpu  100 0 0 0 0 0 0 0\n", "cpu  110 0 0 0 0 0 0 0\n"])
    process_time, perf_counter = iter([0.0, 0.2]), iter([0.0, 0.2])
    assert busy_now(0.2) == 0.0

    # /proc/stat unreadable (not Linux, a sandbox): unknown, and no warning follows from it
    def unreadable(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(gptkit.threads, "open", unreadable, raising=False)
    assert busy_now() is None


@pytest.fixture
def busy_machine(monkeypatch):
    """Two cores, one of them busy with other work; torch's threads restored afterwards."""
    import gptkit.threads

    monkeypatch.setattr(gptkit.threads, "cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    monkeypatch.setattr(gptkit.threads, "busy_now", lambda: 1.0)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_sample_threads_warns_once_on_a_busy_machine(capsys, run_dir, busy_machine):
    args = ["sample", f"run={run_dir}", "prompt=ROMEO", "max_new_tokens=2", "device=cpu", "stream=false"]
    code, _, err = run_main(capsys, *args, "threads=2")
    assert code == 0 and torch.get_num_threads() == 2
    assert [line for line in err.splitlines() if line.startswith("warning:")] == [
        "warning: 2 torch threads on 2 cores that other work already loads (1.0): the threads will wait for "
        "each other and steps can be several times slower; set threads=1 (or OMP_NUM_THREADS=1)"
    ]
    code, _, err = run_main(capsys, *args, "threads=1")
    assert code == 0 and torch.get_num_threads() == 1 and "warning" not in err


@pytest.mark.long
def test_train_threads_warns_once_on_a_busy_machine(tmp_path):
    from conftest import shakespeare

    (tmp_path / "c.txt").write_text(shakespeare(5000))
    args = [
        "train",
        "data=files",
        f"data.paths={tmp_path / 'c.txt'}",
        "tokenizer=char",
        "model.n_layers=1",
        "model.d_model=16",
        "model.n_heads=2",
        "model.max_seq_len=16",
        "trainer.batch_size=2",
        "trainer.max_steps=1",
        "trainer.val_windows=2",
        "trainer.progress=false",
        "trainer.accelerator=cpu",
        f"runs_dir={tmp_path}",
        "name=t",
        "trainer.threads=2",
    ]
    code = (
        "import os, sys, torch\nimport gptkit.threads\nos.getloadavg = lambda: (1.0, 1.0, 1.0)\n"
        "gptkit.threads.cores = lambda: 2\ngptkit.threads.busy_now = lambda: 1.0\nfrom gptkit.cli import "
        f"main\nrc = main({args!r})\nprint('threads', torch.get_num_threads(), rc)"
    )
    env = {k: v for k, v in os.environ.items() if k != "GPTKIT_VERB"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "threads 2 0"
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "set trainer.threads=1 (or OMP_NUM_THREADS=1)" in warnings[0], r.stderr


# ---- issue 15, item 6: start-up --------------------------------------------------------------------
def _imported_after(code: str) -> set[str]:
    probe = (
        "import sys, io, contextlib\n" + code + "\nprint('imported:', *(m for m in ('torch', "
        "'lightning', "
        "'transformers', 'torchmetrics') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.strip().splitlines()[-1].split()[1:])


def test_verbs_that_need_no_lightning_do_not_import_it():
    for args in (["--help"], ["count-params", "model=llama2-7b", "--json"], ["train", "--help"]):
        code = f"from gptkit.cli import main\nwith contextlib.redirect_stdout(io.StringIO()): main({args!r})"
        assert _imported_after(code) == set(), args


def test_lightning_through_the_cli_does_not_import_transformers():
    code = (
        "from gptkit.cli import "
        "_skip_transformers_in_torchmetrics\n_skip_transformers_in_torchmetrics()\nimport lightning, "
        # still usable afterwards
        "torchmetrics\nassert 'transformers' not in sys.modules\nimport transformers\nassert "
        "transformers.GPT2Config().n_head == 12"
    )
    assert _imported_after(code) == {"torch", "lightning", "torchmetrics", "transformers"}


@pytest.mark.parametrize(
    "args",
    [
        ["train", "model=nope"],
        ["train", "no_such_key=1"],
        ["train", "model.n_layers=abc"],
        ["count-params", "model=nope"],
        ["sample", "no_such_key=1"],
        # refused by fit.check_config's values (gptkit/training/config_checks.py)
        ["train", "trainer.precision=fp9"],
        ["train", "trainer.batch_size=0"],
        ["train", "trainer.compile=always"],
        ["train", "optim.lr=-1"],
        ["train", "optim.schedule=nope"],
        ["train", "model.n_layers=0"],
        # trainer.tensor_parallel: a mesh larger than the world, heads that do not split (config_checks.py)
        ["train", "trainer=fsdp", "trainer.devices=2", "trainer.tensor_parallel=4"],
        ["train", "trainer=fsdp", "trainer.devices=3", "trainer.tensor_parallel=3", "model=gpt2-tiny"],
        # a run= that does not exist: found before torch is imported
        ["sample", "run=/nonexistent/gptkit-run"],
        ["chat", "run=/nonexistent/gptkit-run"],
        ["eval", "run=/nonexistent/gptkit-run"],
        ["serve", "run=/nonexistent/gptkit-run"],
        ["attention", "run=/nonexistent/gptkit-run", "text=a"],
        ["export", "run=/nonexistent/gptkit-run", "out=/nonexistent/gptkit-out"],
        ["verify", "trainer.precision=fp9"],
        ["preflight", "trainer.precision=fp9"],
        ["prepare", "data.kind=nope"],
    ],
)
def test_a_refused_config_imports_no_torch(args):
    """Issue 47 item 12: a config refused before the verb runs is one line without torch or Lightning (the
    one-line report looked for torch's out-of-memory error through gptkit.training.memory, importing both;
    check_config imported them before checking the values; sample, chat, eval, serve and attention before
    looking for their run)."""
    code = (
        "from gptkit.cli import main\n"
        "with contextlib.redirect_stderr(io.StringIO()) as err:\n"
        f"    try:\n        main({args!r})\n    except SystemExit as e:\n        assert e.code == 2, e\n"
        "assert err.getvalue().startswith('error: ') and err.getvalue().count(chr(10)) == 1, err.getvalue()"
    )
    assert _imported_after(code) == set(), args


def test_the_entry_point_ends_at_once_after_a_one_line_error_its_atexit_handlers_run():
    """Issue 47 item 12: after the line is printed the interpreter's teardown (1.2 s of CPU with torch and
    Lightning loaded) is skipped; the atexit handlers (a run folder's lock) still run."""
    code = (
        "import atexit, sys\n"
        "class Teardown:\n    def __del__(self):\n        print('teardown ran', flush=True)\n"
        "kept = Teardown()\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "from gptkit.cli import main\n"
        "sys.argv = ['gptkit', 'train', 'model=nope']\n"
        "sys.exit(main())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 2 and r.stderr.startswith("error: model=nope is not a preset"), r.stderr
    assert r.stdout.split() == ["atexit", "ran"], r.stdout


def test_a_chat_export_without_an_end_of_text_token_says_one_thing_of_where_generate_stops(tmp_path, capsys):
    """Issue 47 item 10: the export said "generate() stops at <|im_end|>", then "will stop only at
    max_new_tokens"; generation_config.json stops at the end of a turn."""
    import json

    from gptkit import chat_templates as templates
    from gptkit.model import GPT, ModelConfig
    from gptkit.runs import write_run_folder
    from gptkit.tokenizer import byte_tokenizer

    tok = byte_tokenizer([])
    t = templates.resolve_template("chatml", None)
    templates.add_special_tokens(tok, t)
    # 1 layer of 2 heads, width 16
    cfg = TINY_LLAMA | dict(n_layers=1, n_heads=2, n_kv_heads=None, d_model=16, max_seq_len=32)
    model = GPT(ModelConfig(vocab_size=tok.get_vocab_size(), **cfg))
    run = write_run_folder(tmp_path / "run", {"tokenizer": {}}, model, tok)
    (run / templates.CHAT_FILE).write_text(t.to_json())
    code, out, err = run_main(capsys, "export", f"run={run}", f"out={tmp_path / 'hf'}")
    end = tok.token_to_id("<|im_end|>")
    assert code == 0, err
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == end
    assert "generate() stops at <|im_end|>" in out
    assert "will stop only at the end of a turn or at max_new_tokens" in err


def test_trainer_launcher_ray_settings_are_refused_in_one_line_before_torch():
    """Issue 51 item 3: trainer.launcher=ray's settings are checked with the config's values (config_checks):
    each refusal is one line, exit 2, and none imports torch (one interpreter for all of them)."""
    refused = {
        ("trainer.launcher=rai",): "trainer.launcher='rai' is not one of null, ray",
        (
            "trainer=ddp",
            "trainer.launcher=ray",
            "trainer.ray.num_workers=0",
        ): "trainer.ray.num_workers=0 must be",
        ("trainer=ddp", "trainer.launcher=ray", "trainer.ray.num_workers=2", "trainer.devices=4"): (
            "trainer.launcher=ray starts trainer.ray.num_workers=2 process(es) of one device each, not "
            "trainer.devices=4; pass trainer.ray.num_workers=4"
        ),
        ("trainer=ddp", "trainer.launcher=ray", "trainer.num_nodes=2"): "pass trainer.num_nodes=1",
        ("trainer.launcher=ray", "trainer.ray.num_workers=2"): "add trainer=ddp or trainer=fsdp",
        ("trainer=ddp", "trainer.launcher=ray", "trainer.ray.max_failures=-2"): "trainer.ray.max_failures=-2",
    }
    refused_before_torch(refused)
