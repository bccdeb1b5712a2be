"""`gptkit eval tasks=...`: lm-eval tasks through gptkit's LM adapter, offline on the tiny tasks of
tests/evals/, with the same per-request log-likelihoods, generations and metrics as lm-eval's own `hf`
backend on the exported model; and `scoring=lm-eval`, which equals lm-eval's bits_per_byte."""

import json
import math
import sys

import pytest
from conftest import REPO, make_run, run_cli, run_main, tiny_run, write_corpus

from gptkit.cli import main

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from gptkit.errors import GptkitError  # noqa: E402
from gptkit.evaluation import tasks as T  # noqa: E402
from gptkit.evaluation.lm_eval_adapter import GptkitLM  # noqa: E402

EVALS = REPO / "tests" / "evals"
# the end of the line that names the Python a task folder runs
TRUST = ": use only task folders you trust"


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory):
    """A tiny random Llama-style run (char tokenizer, context 64) and its `gptkit export` folder."""
    tmp = tmp_path_factory.mktemp("tasks")
    d, model, tok = make_run(tmp, max_seq_len=64)
    assert main(["export", f"run={d}", f"out={tmp / 'hf'}"]) == 0
    return d, tmp / "hf", model, tok


def evaluate_local(lm, **kw):
    """Every task of tests/evals on `lm`, with lm-eval's per-sample records."""
    T.quiet_lm_eval()
    specs = T.find_tasks([str(EVALS)])
    manager = T.task_manager(specs)
    return T.run_tasks(lm, specs, manager, bootstrap_iters=0, log_samples=True, **kw)


def test_same_numbers_as_lm_evals_hf_backend_on_the_exported_model(run_and_export):
    from lm_eval.models.huggingface import HFLM

    from gptkit.runs import load_run

    d, hf_dir, _, _ = run_and_export
    r = load_run(d)
    # batches split a question's choices
    ours_lm = GptkitLM(r.model, r.tokenizer, r.config, batch_size=5)
    ours = evaluate_local(ours_lm)
    theirs = evaluate_local(HFLM(pretrained=str(hf_dir), device="cpu", batch_size=4, dtype="float32"))
    assert set(ours["samples"]) == {"tiny_mc", "tiny_mc_2shot", "tiny_gen", "tiny_ppl"}
    n_ll = 0
    for task in ours["samples"]:
        a = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(theirs["samples"][task], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b] and a
        for sa, sb in zip(a, b):
            # the same prompts reached both
            assert sa["arguments"] == sb["arguments"]
            for ra, rb in zip(sa["resps"], sb["resps"]):
                ra, rb = ra[0], rb[0]
                # generate_until: the same greedy text up to the stop string
                if isinstance(ra, str):
                    assert ra == rb
                # loglikelihood_rolling
                elif isinstance(ra, float):
                    assert abs(ra - rb) <= 1e-5 * max(1.0, abs(rb)), (task, ra, rb)
                    n_ll += 1
                # loglikelihood: (log p, greedy)
                else:
                    assert abs(ra[0] - rb[0]) <= 1e-5 * max(1.0, abs(rb[0])), (task, ra, rb)
                    assert ra[1] == rb[1]
                    n_ll += 1
        # accuracies equal; exp(mean) metrics to 1e-5
        for key, value in ours["results"][task].items():
            if isinstance(value, float) and "stderr" not in key:
                exact = key.startswith(("acc", "exact_match"))
                want = theirs["results"][task][key]
                assert value == pytest.approx(want, rel=0 if exact else 1e-5), (task, key)
    assert n_ll == 8 * 4 * 2 + 4
    # the 2-shot contexts outgrow the context and are cut on the left
    assert ours_lm.stats.truncated > 0


def test_cli_table_json_and_results_files(run_and_export, capsys, tmp_path):
    d, _, _, _ = run_and_export
    two = f"{EVALS / 'tiny_mc.yaml'},{EVALS / 'tiny_gen.yaml'}"
    code, out, err = run_main(
        capsys, "eval", f"run={d}", f"tasks={two}", "limit=3", "progress=false", "device=cpu"
    )
    assert code == 0, err
    assert "tiny_mc" in out and "acc_norm" in out and "exact_match" in out and "stderr" in out
    files = sorted((d / "evals").glob("*.json"))
    assert {f.name.split("-")[0] for f in files} == {"tiny_mc", "tiny_gen"}
    saved = json.loads(next(f for f in files if f.name.startswith("tiny_mc")).read_text())
    assert saved["task"] == "tiny_mc" and saved["limit"] == 3 and saved["n_samples"]["effective"] == 3
    acc = next(r for r in saved["rows"] if r["metric"] == "acc")
    assert 0 <= acc["value"] <= 1 and acc["n"] == 3

    # out= in a folder not made yet (issue 47 item 10): made
    out_file = tmp_path / "results" / "res.json"
    code, out, err = run_main(
        capsys,
        "eval",
        f"run={d}",
        f"tasks={EVALS}",
        "limit=2",
        "num_fewshot=1",
        f"out={out_file}",
        "progress=false",
        "--json",
    )
    assert code == 0, err
    res = json.loads(out)
    assert res["files"] == [str(out_file)] and {r["task"] for r in res["rows"]} >= {"tiny_mc", "tiny_ppl"}
    assert len(json.loads(out_file.read_text())["tasks"]) == 4


def test_scoring_lm_eval_equals_lm_evals_bits_per_byte(run_and_export, capsys):
    """scoring=lm-eval on the documents of tiny_ppl.jsonl: lm-eval's rolling-window formula (BOS first, every
    token, no EOS), and the bits_per_byte lm-eval reports for the tiny_ppl task, to 1e-6."""
    import torch

    d, _, model, tok = run_and_export
    docs = [json.loads(line)["text"] for line in (EVALS / "tiny_ppl.jsonl").read_text().splitlines()]
    corpus = (
        "data=files",
        f"data.paths=[{EVALS / 'tiny_ppl.jsonl'}]",
        "seq_len=64",
        "progress=false",
        "--json",
    )
    code, out, err = run_main(capsys, "eval", f"run={d}", "scoring=lm-eval", *corpus)
    assert code == 0, err
    res = json.loads(out)
    # no BOS: the EOS, as lm-eval does
    prefix = tok.token_to_id("<|endoftext|>")
    ll = 0.0
    with torch.no_grad():
        for doc in docs:
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(tok.encode(doc).ids, prefix, max_seq_len=64, context_len=1),
            ):
                x = torch.tensor([ctx + cont][0][:-1])[None]  # [1, T]
                logp = torch.log_softmax(model(x).logits[0].float(), -1)[-len(cont) :]  # [len(cont), V]
                ll += logp.gather(-1, torch.tensor(cont)[:, None]).sum().item()
    n_bytes = sum(len(doc.encode()) for doc in docs)
    assert res["bytes"] == n_bytes and res["documents_scored"] == len(docs)
    # every token, no EOS
    assert res["tokens_scored"] == sum(len(tok.encode(doc).ids) for doc in docs)
    assert abs(res["bits_per_byte"] - (-ll / n_bytes / math.log(2))) < 1e-6

    from gptkit.runs import load_run

    r = load_run(d)
    reported = evaluate_local(GptkitLM(r.model, r.tokenizer, r.config))["results"]["tiny_ppl"]
    assert abs(res["bits_per_byte"] - reported["bits_per_byte,none"]) < 1e-6

    # the default: gptkit's convention
    code, out, err = run_main(capsys, "eval", f"run={d}", *corpus)
    gptkit = json.loads(out)
    # the EOSes, not the first token
    assert gptkit["tokens_scored"] == res["tokens_scored"] + len(docs) - 1
    assert gptkit["bits_per_byte"] != res["bits_per_byte"]


def test_bad_input_is_one_line(run_and_export, capsys, tmp_path, monkeypatch):
    d, _, _, _ = run_and_export

    def fails(*args):
        code, out, err = run_main(capsys, "eval", f"run={d}", "progress=false", *args)
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), (code, err)
        return err

    err = fails(f"tasks={EVALS / 'tiny_mc.yaml'}", "num_fewshot=4")
    assert "num_fewshot=4 but task tiny_mc has 3 few-shot example(s)" in err and "num_fewshot<=3" in err
    assert "unknown task 'tiny_mcc'" in (msg := _unknown(T, "tiny_mcc")) and "did you mean tiny_mc or" in msg
    assert "limit=-1" in fails(f"tasks={EVALS}", "limit=-1")
    assert "no such folder or task YAML" in fails("tasks=./nowhere")
    assert "belongs to tasks=" in fails("num_fewshot=2")
    assert "belongs to the corpus evaluation" in fails(f"tasks={EVALS}", "stride=8")
    assert "scoring='lm_eval' must be one of gptkit, lm-eval" in fails("scoring=lm_eval")

    # 'Q' is not in the char tokenizer's corpus
    unknown = tmp_path / "q_task.yaml"
    unknown.write_text(
        (EVALS / "tiny_mc.yaml")
        .read_text()
        .replace("Ask:", "Q:")
        .replace("task: tiny_mc", "task: q_mc")
        .replace("tiny_mc", str(EVALS / "tiny_mc"))
    )
    assert "1 character(s) the run's tokenizer cannot encode: 'Q'" in fails(f"tasks={unknown}")

    # a task whose data set lives on the Hub, with the Hub unreachable
    hub = tmp_path / "hub_task.yaml"
    text = (EVALS / "tiny_mc.yaml").read_text()
    hub.write_text(text.replace("dataset_path: json", "dataset_path: nobody/none").replace("tiny_mc", "hub"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    err = fails(f"tasks={hub}")
    assert "HF_DATASETS_OFFLINE" in err and "dataset_kwargs.data_files" in err

    # lm-eval not installed
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert fails(f"tasks={EVALS}").rstrip().endswith(": pip install 'gptkit[eval]'")
    code, out, err = run_main(capsys, "eval", f"run={d}", "progress=false", "max_windows=2", "--json")
    # everything else works without it
    assert code == 0 and json.loads(out)["windows"] == 2


def test_a_task_folders_missing_data_file_is_one_line_not_a_file_of_the_current_folder(
    run_and_export, capsys, tmp_path, monkeypatch
):
    """Relative data files are read from the YAML's folder only: when the file is not there, a file of the
    same name in the current folder is not read instead, and the line names the path looked at."""
    d, _, _, _ = run_and_export
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "t.yaml").write_text((EVALS / "tiny_mc.yaml").read_text())
    (folder / "tiny_mc_train.jsonl").write_text((EVALS / "tiny_mc_train.jsonl").read_text())
    here = tmp_path / "here"
    here.mkdir()
    (here / "tiny_mc.jsonl").write_text((EVALS / "tiny_mc.jsonl").read_text())
    monkeypatch.chdir(here)
    code, _, err = run_main(capsys, "eval", f"run={d}", "progress=false", f"tasks={folder}")
    assert code == 2 and err.count("\n") == 1, (code, err)
    assert err == (
        f"error: {folder / 't.yaml'}: dataset_kwargs.data_files names tiny_mc.jsonl, and "
        f"{folder / 'tiny_mc.jsonl'} does not exist (relative data files are read from the YAML's folder)\n"
    )


def test_a_task_folders_data_that_is_not_json_is_one_line_naming_the_file(run_and_export, tmp_path):
    """datasets logs the file and the fault on a line of its own and raises only "An error occurred while
    generating the dataset": the one line says both (a new process: datasets' handler writes to the real
    stderr)."""
    d, _, _, _ = run_and_export
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "t.yaml").write_text((EVALS / "tiny_mc.yaml").read_text())
    (folder / "tiny_mc_train.jsonl").write_text((EVALS / "tiny_mc_train.jsonl").read_text())
    (folder / "tiny_mc.jsonl").write_text("not json\n")
    r = run_cli("eval", f"run={d}", "progress=false", f"tasks={folder}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: task tiny_mc could not be loaded: DatasetGenerationError: ")
    assert f"{folder / 'tiny_mc.jsonl'}' with error " in r.stderr and "JSON parse error" in r.stderr


def _unknown(T, name: str) -> str:
    """The message for an unknown task name, over a registry of the tiny tasks (lm-eval's own takes ~20 s to
    index; the same code path)."""
    from lm_eval.tasks import TaskManager

    from gptkit.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        T.check_names([name], TaskManager(include_defaults=False, include_path=str(EVALS)))
    return str(exc.value)


@pytest.mark.long
def test_task_evals_during_training_log_what_gptkit_eval_gives(tmp_path, capsys):
    """trainer.eval_tasks: the fixed subset is scored at every eval_every step and after the last; the metric
    logged for the final weights is what `gptkit eval tasks=... limit=` reports on the final checkpoint."""
    import csv

    task = EVALS / "tiny_mc.yaml"
    evals = [f"trainer.eval_tasks=[{task}]", "trainer.eval_every=6", "trainer.eval_limit=4"]
    keys = dict(layers=2, seq_len=64, val_every=6, val_windows=8, checkpoint_every=12, log_every=None)
    corpus = write_corpus(tmp_path, 30_000)
    r = run_cli("train", *tiny_run(corpus, tmp_path / "runs", "tasks", *evals, **keys, warmup=None))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "task evals: 2 x 1 task(s)" in r.stderr and "% of" in r.stderr
    with open(tmp_path / "runs" / "tasks" / "metrics.csv", newline="") as f:
        rows = {int(row["step"]): row for row in csv.DictReader(f)}
    logged = {s: float(row["eval/tiny_mc/acc"]) for s, row in rows.items() if row.get("eval/tiny_mc/acc")}
    assert sorted(logged) == [6, 12] and all(v in (0, 0.25, 0.5, 0.75, 1) for v in logged.values())
    code, out, err = run_main(
        capsys,
        "eval",
        f"run={tmp_path / 'runs' / 'tasks'}",
        f"tasks={task}",
        "limit=4",
        "progress=false",
        "--json",
    )
    assert code == 0, err
    acc = next(row for row in json.loads(out)["rows"] if row["metric"] == "acc")
    assert acc["value"] == logged[12]


def test_ranks_score_their_shares_and_the_total_is_the_whole(run_and_export):
    """Under DDP each rank scores examples rank, rank + world, ...; merged, their values give the metrics of
    one process scoring all of them."""
    from gptkit.runs import load_run

    d, _, _, _ = run_and_export
    r = load_run(d)
    lm = GptkitLM(r.model, r.tokenizer, r.config)
    specs = T.find_tasks([str(EVALS / "tiny_mc.yaml"), str(EVALS / "tiny_gen.yaml")])
    manager = T.task_manager(specs)
    for name, task in T.leaf_tasks(T.load_tasks(specs, manager)).items():
        whole = T.TaskSubset(name, task, limit=5).score(lm)
        shares = [T.TaskSubset(name, task, limit=5, rank=k, world_size=2) for k in range(2)]
        assert [len(s.docs) for s in shares] == [3, 2]
        merged = T.merge_shares([s.score(lm) for s in shares])
        sub = shares[0]
        assert sub.aggregate(merged) == pytest.approx(sub.aggregate(whole)) and sub.aggregate(whole)


def byte_run(tmp_path):
    """A run as `gptkit train` makes by default: the byte tokenizer, no end-of-text token (a tiny random
    model)."""
    import torch

    from gptkit.model import GPT, ModelConfig
    from gptkit.runs import write_run_folder
    from gptkit.tokenizer import build_tokenizer

    tok_cfg = {"kind": "byte", "special_tokens": [], "eos_token": None}
    tok = build_tokenizer(tok_cfg)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, max_seq_len=64, n_layers=1, n_heads=2, d_model=16)
    return write_run_folder(tmp_path / "byte-run", {"tokenizer": tok_cfg}, GPT(cfg).eval(), tok)


def python_task_folder(tmp_path):
    """tiny_mc (its test split) as a folder whose YAML runs utils.py (`process_docs: !function utils.docs`);
    utils.py says on stderr when it is imported."""
    folder = tmp_path / "py_tasks"
    folder.mkdir()
    yaml_text = (EVALS / "tiny_mc.yaml").read_text()
    yaml_text = yaml_text.replace("task: tiny_mc", "task: py_mc").replace("tiny_mc", str(EVALS / "tiny_mc"))
    (folder / "py_mc.yaml").write_text(yaml_text + "process_docs: !function utils.docs\n")
    (folder / "utils.py").write_text(
        "import sys\n\nprint('utils.py is running', file=sys.stderr)\n\n\n"
        "def docs(dataset):\n    return dataset\n"
    )
    return folder


def test_a_task_folder_that_runs_python_says_so_first(tmp_path, capsys):
    """`!function` in a task YAML imports a Python file of the folder: one line names it before it runs (read
    from the YAML text); a folder without Python prints no such line."""
    d = byte_run(tmp_path)
    folder = python_task_folder(tmp_path)
    assert T.code_notices([str(folder)]) == [f"tasks={folder} runs utils.py from {folder}{TRUST}"]
    # nothing was imported to find it
    assert "utils.py is running" not in capsys.readouterr().err

    code, out, err = run_main(
        capsys, "eval", f"run={d}", f"tasks={folder}", "limit=2", "progress=false", "--json"
    )
    assert code == 0, err
    lines = err.splitlines()
    # said first, before utils.py runs and before any result
    assert lines[0] == f"tasks={folder} runs utils.py from {folder}{TRUST}"
    assert lines.index("utils.py is running") > 0
    assert {r["task"] for r in json.loads(out)["rows"]} == {"py_mc"}

    # a single YAML of it, and an include of it from elsewhere, name the same file
    assert T.code_notices([str(folder / "py_mc.yaml")], "trainer.eval_tasks") == [
        f"trainer.eval_tasks={folder / 'py_mc.yaml'} runs utils.py from {folder}{TRUST}"
    ]
    other = tmp_path / "other"
    other.mkdir()
    (other / "again.yaml").write_text(f"include: {folder / 'py_mc.yaml'}\ntask: again\n")
    assert T.code_notices([str(other)]) == [f"tasks={other} runs {folder / 'utils.py'} from {other}{TRUST}"]

    # no Python in tests/evals: no such line
    code, out, err = run_main(
        capsys, "eval", f"run={d}", f"tasks={EVALS / 'tiny_mc.yaml'}", "limit=2", "progress=false"
    )
    assert code == 0, err
    assert "trust" not in err and not T.code_notices([str(EVALS)])


def test_trainer_eval_tasks_say_the_python_of_a_task_folder(tmp_path, capsys):
    from gptkit.training.task_evals import check_task_evals

    folder = python_task_folder(tmp_path)
    capsys.readouterr()
    check_task_evals({"eval_tasks": [str(folder)]})
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"trainer.eval_tasks={folder} runs utils.py from {folder}{TRUST}"
    assert lines[1:] == ["utils.py is running"]
    check_task_evals({"eval_tasks": [str(EVALS)]})
    assert "trust" not in capsys.readouterr().err
    # a bad entry is named by the option it came from
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        GptkitError, match=f"^trainer.eval_tasks={tmp_path / 'empty'}: the folder holds no task"
    ):
        check_task_evals({"eval_tasks": [str(tmp_path / "empty")]})


def test_a_task_the_tokenizer_cannot_serve_is_skipped_and_said(tmp_path, capsys):
    """tests/evals on a default run (byte tokenizer, no end-of-text token): tiny_ppl (rolling log-likelihood,
    which starts each text with a BOS or EOS) is skipped, on one line, and the other tasks are scored."""
    d = byte_run(tmp_path)
    out_file = tmp_path / "all.json"
    code, out, err = run_main(
        capsys, "eval", f"run={d}", f"tasks={EVALS}", "limit=2", "progress=false", f"out={out_file}", "--json"
    )
    assert code == 0, err
    said = [line for line in err.splitlines() if line.startswith("skipped")]
    assert said == [
        "skipped task tiny_ppl: it scores whole texts (loglikelihood_rolling), which start with a BOS or "
        "end-of-text token, and the run's tokenizer has neither; train with tokenizer.eos_token set to "
        "score it"
    ]
    res = json.loads(out)
    assert {r["task"] for r in res["rows"]} == {"tiny_mc", "tiny_mc_2shot", "tiny_gen"}
    assert list(res["skipped"]) == ["tiny_ppl"] and "loglikelihood_rolling" in res["skipped"]["tiny_ppl"]
    saved = json.loads(out_file.read_text())
    assert [t["task"] for t in saved["tasks"]] == ["tiny_gen", "tiny_mc", "tiny_mc_2shot"]
    assert list(saved["skipped"]) == ["tiny_ppl"]

    # the table: no row of it
    code, out, err = run_main(capsys, "eval", f"run={d}", f"tasks={EVALS}", "limit=1", "progress=false")
    assert code == 0 and "tiny_mc" in out and "tiny_ppl" not in out and "skipped task tiny_ppl" in err

    # nothing left to score: one line, exit 2
    code, out, err = run_main(
        capsys, "eval", f"run={d}", f"tasks={EVALS / 'tiny_ppl.yaml'}", "progress=false"
    )
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: task tiny_ppl scores whole texts"), (
        err
    )


def test_trainer_eval_tasks_skip_what_the_tokenizer_cannot_serve(tmp_path, capsys):
    from types import SimpleNamespace

    from gptkit.runs import load_run
    from gptkit.training.task_evals import TaskEvals

    r = load_run(byte_run(tmp_path))
    trainer = SimpleNamespace(
        global_rank=0,
        world_size=1,
        is_global_zero=True,
        datamodule=SimpleNamespace(prepared=SimpleNamespace(tokenizer=lambda: r.tokenizer)),
    )
    evals = TaskEvals([str(EVALS)], every=1, limit=2, batch_size=4)
    capsys.readouterr()
    evals.setup(trainer, SimpleNamespace(model=r.model), "fit")
    assert [s.name for s in evals.subsets] == ["tiny_gen", "tiny_mc", "tiny_mc_2shot"]
    assert capsys.readouterr().err.startswith("skipped task tiny_ppl: it scores whole texts")
    with pytest.raises(GptkitError, match="task tiny_ppl scores whole texts"):
        TaskEvals([str(EVALS / "tiny_ppl.yaml")], every=1, limit=2, batch_size=4).setup(
            trainer, SimpleNamespace(model=r.model), "fit"
        )


def _hub_unreachable(monkeypatch):
    """No network: the reachability check's connect is refused (and counted); any other socket connect is
    counted too."""
    import socket

    calls = []

    def refused(address, *args, **kwargs):
        calls.append(address)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: calls.append(address))
    monkeypatch.setattr(socket.socket, "connect_ex", lambda self, address: calls.append(address) or 111)
    return calls


def test_a_hub_task_offline_or_unreachable_fails_at_once(tmp_path, capsys, monkeypatch):
    """tasks=arc_easy with the Hub offline or unreachable: one line and exit 2 before lm-eval indexes its
    registry or asks for a data set (so none of its retries); offline, no connect is attempted at all."""
    import datasets.config
    from huggingface_hub import constants

    def not_reached(*args, **kwargs):
        raise AssertionError("lm-eval was asked")

    # what lm-eval would do next: index its registry, then load the data sets
    monkeypatch.setattr(T, "task_manager", not_reached)
    monkeypatch.setattr(T, "load_tasks", not_reached)
    calls = _hub_unreachable(monkeypatch)
    # caches that hold no Hub data set
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    # a run folder (eval finds its run before anything else: a missing one is its own line, without torch)
    from conftest import make_run

    d, _, _ = make_run(tmp_path)

    def fails(*args):
        code, out, err = run_main(capsys, "eval", f"run={d}", "progress=false", *args)
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), (code, err)
        assert "Retrying" not in err and "thrown while requesting" not in err
        return err

    # offline (tests set HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1)
    err = fails("tasks=arc_easy")
    assert "task arc_easy (lm-eval's registry) needs data from the Hugging Face Hub" in err
    assert (
        "HF_HUB_OFFLINE='1'" in err and "hold no Hub data set" in err and "dataset_kwargs.data_files" in err
    )
    assert calls == []
    # trainer.eval_tasks: the same line, before any data is prepared
    from gptkit.training.task_evals import check_task_evals

    with pytest.raises(GptkitError, match="task arc_easy .* hold no Hub data set"):
        check_task_evals({"eval_tasks": ["arc_easy"]})
    assert calls == []

    # unreachable: one connect, refused
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    err = fails("tasks=arc_easy")
    assert "the Hugging Face Hub (" in err and "is unreachable (ConnectionRefusedError" in err
    assert "task arc_easy (lm-eval's registry) reads data from it: set HF_HUB_OFFLINE=1" in err
    assert len(calls) == 1
    # a local YAML whose data set is on the Hub: the same
    hub_yaml = tmp_path / "hub_task.yaml"
    text = (EVALS / "tiny_mc.yaml").read_text()
    hub_yaml.write_text(
        text.replace("dataset_path: json", "dataset_path: nobody/none").replace("tiny_mc", "hub")
    )
    assert f"task hub ({hub_yaml}) reads data from it" in fails(f"tasks={hub_yaml}")
    # local data needs no Hub: no check
    calls.clear()
    assert T.check_hub(T.find_tasks([str(EVALS)])) is None and calls == []


def test_offline_with_a_cache_lm_eval_reads_it(tmp_path, monkeypatch):
    """Offline with a Hub data set in the cache, check_hub lets lm-eval read the cache (a data set missing
    from it is then lm-eval's one line)."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    calls = _hub_unreachable(monkeypatch)
    specs = T.TaskSpecs(names=["arc_easy"])
    # local json files, cached by datasets, are no Hub data set
    (tmp_path / "datasets" / "json" / "default-0").mkdir(parents=True)
    with pytest.raises(GptkitError, match="hold no Hub data set"):
        T.check_hub(specs)
    # datasets' cache of a Hub data set, or huggingface_hub's download of one
    for cached in (
        tmp_path / "datasets" / "someone___cached",
        tmp_path / "hub" / "datasets--someone--cached",
    ):
        cached.mkdir(parents=True)
        assert T.check_hub(specs) is None and calls == []
        cached.rmdir()


def test_a_longrope_model_scores_each_request_as_alone_either_side_of_its_original_context():
    """LongRoPE (Phi-4-mini's) turns a sequence past its original context (16 here) with other frequencies:
    shared prefixes, batches and padding do not move a request across it. Each (log p, greedy) equals the
    request's own forward pass."""
    import torch

    from gptkit.model import GPT, ModelConfig
    from gptkit.tokenizer import byte_tokenizer

    tok = byte_tokenizer([])
    scaling = {"type": "longrope", "factor": 4.0, "original_max_seq_len": 16}
    scaling |= {"short_factor": [1.0] * 4, "long_factor": [3.0] * 4}
    torch.manual_seed(0)
    cfg = dict(n_layers=2, n_heads=4, d_model=32, position="rope", mlp="swiglu", norm="rmsnorm")
    model = GPT(
        ModelConfig(vocab_size=tok.get_vocab_size(), max_seq_len=64, rope_scaling=scaling, **cfg)
    ).eval()
    ids = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    # a prefix of 12 with tails ending before 16 and past it; whole inputs short and long in one batch
    requests = [(None, ids[:12], ids[12:14]), (None, ids[:12], ids[12:30]), (None, ids[:12], ids[12:15])]
    requests += [(None, ids[20:26], ids[26:30]), (None, ids[:20], ids[20:36])]
    got = GptkitLM(model, tok, batch_size=4)._loglikelihood_tokens(requests)
    for (_, ctx, cont), (lp, greedy) in zip(requests, got):
        x = torch.tensor([ctx + cont[:-1]])
        with torch.no_grad():
            logp = torch.log_softmax(model(x).logits[0, len(ctx) - 1 :].float(), dim=-1)  # [c, V]
        target = torch.tensor(cont)
        assert lp == pytest.approx(logp.gather(-1, target[:, None]).sum().item(), abs=1e-5)
        assert greedy == bool((logp.argmax(-1) == target).all())


def _lockstep_rank(rank: int, run_dir: str, port: int, out: str) -> None:
    """One rank of test_task_evals_under_fsdp_run_in_lockstep: its share scored over FSDP2 shards."""
    import os
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank left waiting (forwards out of step) fails in a minute instead of hanging
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        _lockstep_score(rank, run_dir, out)
        dist.barrier()  # both ranks done with every collective before either tears gloo down
    finally:
        dist.destroy_process_group()
    # The group outlives destroy_process_group (DTensor's sharding caches keep the mesh and so the group, its
    # gloo threads still running): left to the interpreter's teardown, 1 rank end in ~10 was "terminate called
    # without an active exception", SIGABRT, after the metrics were written (CI, 2026-12-06; 1 of 9, 1 of 11
    # here). A rank that got this far has nothing left to do: it ends without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _lockstep_score(rank: int, run_dir: str, out: str) -> None:
    """The rank's share over FSDP2 shards, gathered; rank 0 writes the merged metrics to `out`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gptkit.runs import load_run
    from gptkit.training.task_evals import score_in_lockstep

    r = load_run(run_dir)
    mesh = init_device_mesh("cpu", (2,))
    for block in r.model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(r.model, mesh=mesh)
    r.model._gptkit_sharded = True
    lm = GptkitLM(r.model, r.tokenizer, r.config)
    specs = T.find_tasks([str(EVALS / "tiny_mc.yaml"), str(EVALS / "tiny_gen.yaml")])
    loaded = T.leaf_tasks(T.load_tasks(specs, T.task_manager(specs)))
    subsets = [T.TaskSubset(name, task, 5, rank, 2) for name, task in loaded.items()]
    shares = score_in_lockstep(subsets, lm)
    gathered: list = [None] * 2
    dist.all_gather_object(gathered, shares)
    if rank == 0:
        merged = {s.name: s.aggregate(T.merge_shares([g[s.name] for g in gathered])) for s in subsets}
        with open(out, "w") as f:
            json.dump(merged, f)


@pytest.mark.long
def test_task_evals_under_fsdp_run_in_lockstep(run_and_export, tmp_path):
    """trainer=fsdp with trainer.eval_tasks: two gloo ranks, each with its share (3 and 2 examples: not the
    same forwards), score over FSDP2's sharded weights in lockstep and give the metrics of one process
    scoring every example with the whole model."""
    import socket

    import torch.multiprocessing as mp

    from gptkit.runs import load_run

    d, _, _, _ = run_and_export
    r = load_run(d)
    lm = GptkitLM(r.model, r.tokenizer, r.config)
    specs = T.find_tasks([str(EVALS / "tiny_mc.yaml"), str(EVALS / "tiny_gen.yaml")])
    want = {
        name: (s := T.TaskSubset(name, task, limit=5)).aggregate(s.score(lm))
        for name, task in T.leaf_tasks(T.load_tasks(specs, T.task_manager(specs))).items()
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "merged.json"
    mp.spawn(_lockstep_rank, args=(str(d), port, str(out)), nprocs=2)
    got = json.loads(out.read_text())
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == pytest.approx(want[name], abs=1e-6), name
