"""The CLI as a user meets it: verbs, help, count-params, one-line errors."""

import json
import sys

import pytest


def test_help_lists_verbs(cli):
    r = cli("--help")
    assert r.returncode == 0
    assert "count-params" in r.stdout and "usage: gptkit <verb>" in r.stdout


def test_verb_help_shows_config_and_presets(cli):
    r = cli("count-params", "--help")
    assert r.returncode == 0
    assert "llama2-7b" in r.stdout and "n_layers:" in r.stdout


def test_count_params_llama2_7b_is_exact_and_builds_no_model(capsys, monkeypatch):
    """Analytic: no 7B model (nor any module or weight) is built, which is what keeps it instant."""
    import torch
    from conftest import run_main

    def built(*args, **kwargs):
        raise AssertionError("count-params built a torch module")

    monkeypatch.setattr(torch.nn.Module, "__init__", built)
    code, out, err = run_main(capsys, "count-params", "model=llama2-7b")
    assert code == 0, err
    assert "6,738,415,616" in out


def test_count_params_json(cli):
    r = cli("count-params", "model=gpt2", "format=json", "tokens=1e9", "gpu=h100")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["params"]["total"] == 124_439_808
    assert d["plan"]["tokens"] == 1e9
    assert d["plan"]["peak_flops_per_gpu"] == 989e12


def test_count_params_rows_of_a_hybrid_and_of_a_mixture_with_sinks(capsys):
    """gdn-tiny: a row for the linear layers' own parameters (the shares sum to the total) and their states
    beside the KV cache; gpt-oss-tiny (sinks before the mlp row): the mixture's rows after the mlp row."""
    from conftest import run_main

    code, out, err = run_main(capsys, "count-params", "model=gdn-tiny", "format=json")
    d = json.loads(out)
    p, plan = d["params"], d["plan"]
    parts = ("tok_emb", "pos_emb", "attn_q", "attn_k", "attn_v", "attn_o", "attn_sinks", "attn_gate")
    rest = ("attn_linear", "mlp", "norms", "final_norm", "lm_head", "mtp")
    assert code == 0 and p["attn_linear"] > 0 and sum(p[k] for k in parts + rest) == p["total"]
    # three linear layers: the delta rule's 4 x 32 x 32 and the conv's 3 last inputs of 256 channels, in fp32
    # (the KV cache's dtype is bf16)
    assert plan["state_bytes"] == 3 * 4 * (4 * 32 * 32 + 256 * 3)
    code, out, err = run_main(capsys, "count-params", "model=gdn-tiny")
    assert "linear attention: beta and decay projections" in out and "linear layers' states" in out
    code, out, err = run_main(capsys, "count-params", "model=gpt-oss-tiny")
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.count("│") >= 3]
    at = next(i for i, r in enumerate(rows) if r.startswith("mlp"))
    assert rows[at + 1].startswith("routers") and rows[at - 1].startswith("attention sinks")


def test_count_params_knows_muon_lora_and_the_dpo_reference(capsys):
    """optim's state, the trainable adapters and a reference of its own, as `train`'s estimate counts them."""
    from conftest import run_main

    code, out, err = run_main(capsys, "count-params", "model=llama-tiny", "precision=32-true", "format=json")
    base = json.loads(out)["plan"]["memory_per_gpu"]
    code, out, err = run_main(
        capsys,
        "count-params",
        "model=llama-tiny",
        "precision=32-true",
        "optimizer=muon",
        "objective=dpo",
        "format=json",
    )
    plan = json.loads(out)["plan"]
    mem = plan["memory_per_gpu"]
    assert code == 0 and mem["optimizer"] == base["optimizer"] - 4 * plan["muon_params"]
    assert mem["reference"] == mem["weights"]
    # both answers of the micro-batch's pair (micro_batch 1), their log-probs chunked (train's estimate)
    from gptkit.model import ModelConfig
    from gptkit.training.memory import chunked_logits_bytes

    m = ModelConfig.from_dict(json.loads(out)["model"])
    assert mem["logits"] == chunked_logits_bytes(2 * m.max_seq_len, m)
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    code, out, err = run_main(
        capsys, "count-params", "model=llama-tiny", "finetune=lora", "lora.rank=2", "format=json"
    )
    plan = json.loads(out)["plan"]
    assert plan["memory_per_gpu"]["gradients"] == 4 * plan["trainable_params"] < base["gradients"] / 50
    code, _, err = run_main(capsys, "count-params", "model=gpt2-tiny", "optimizer=sgd")
    assert code == 2 and err.strip() == "error: optimizer='sgd' is not one of adamw, muon"


def test_count_params_holds_no_reference_for_simpo_and_orpo(capsys):
    """dpo.loss=simpo and orpo are reference-free, and dpo.reference=precomputed holds none: the estimate asks
    the objective which frozen models it holds, as `train`'s does, and is lower than sigmoid's by exactly the
    reference's bytes."""
    from conftest import run_main

    def memory(*extra):
        code, out, err = run_main(
            capsys, "count-params", "model=llama-tiny", "objective=dpo", "format=json", *extra
        )
        assert code == 0, err
        return json.loads(out)["plan"]["memory_per_gpu"]

    dpo = memory()
    assert dpo == memory("dpo.loss=sigmoid") and dpo["reference"] == dpo["weights"] > 0
    # and so is dpo.reference=precomputed: its log-probs come from the data
    for free_args in ("dpo.loss=simpo", "dpo.loss=orpo", "dpo.reference=precomputed"):
        free = memory(free_args)
        assert "reference" not in free and free["total"] == dpo["total"] - dpo["reference"], free_args
        assert free == {k: v for k, v in dpo.items() if k not in ("reference", "total")} | {
            "total": free["total"]
        }
    code, _, err = run_main(capsys, "count-params", "objective=dpo", "dpo.loss=nope")
    assert (
        code == 2 and err.strip() == "error: dpo.loss='nope' is not one of sigmoid, hinge, ipo, simpo, orpo"
    )


def test_count_params_holds_grpos_reference_and_distills_teacher(capsys):
    """objective=grpo: micro_batch counts prompts of grpo.group_size completions, and grpo.beta > 0 keeps a
    frozen reference; objective=distill keeps its teacher (counted at the model's size): as `train`'s
    estimate asks the objective's frozen models, each a copy of the weights (none with LoRA)."""
    from conftest import run_main

    def memory(*extra):
        code, out, err = run_main(capsys, "count-params", "model=llama-tiny", "format=json", *extra)
        assert code == 0, err
        return json.loads(out)["plan"]["memory_per_gpu"]

    lm = memory()
    grpo = memory("objective=grpo")
    assert "reference" not in grpo and grpo["activations"] == 8 * lm["activations"]
    assert memory("objective=grpo", "grpo.group_size=2")["activations"] == 2 * lm["activations"]
    kl = memory("objective=grpo", "grpo.beta=0.04")
    assert kl["reference"] == kl["weights"] > 0 and kl["total"] == grpo["total"] + kl["reference"]
    distill = memory("objective=distill")
    assert (
        distill["teacher"] == distill["weights"] and distill["logits"] < lm["logits"]
    )  # chunked, both heads
    assert distill["total"] == lm["total"] - lm["logits"] + distill["logits"] + distill["teacher"]
    assert "teacher" not in memory("objective=distill", "finetune=lora")
    code, _, err = run_main(capsys, "count-params", "objective=grpo", "grpo.group_size=1")
    assert code == 2 and err.strip().startswith("error: grpo.group_size=1 must be an integer >= 2"), err


def test_override_a_field(cli):
    r = cli("count-params", "model=gpt2", "model.n_layers=2", "format=json")
    d = json.loads(r.stdout)
    assert d["model"]["n_layers"] == 2 and d["params"]["total"] < 124_439_808


@pytest.mark.parametrize(
    "args, needle",
    [
        (["model=nope"], "model=nope is not a preset"),
        (["model.n_heads=5"], "not divisible by model.n_heads=5"),
        (["model=llama-tiny", "model.n_kv_heads=3"], "n_kv_heads"),
        (["model.n_layers=0"], "positive integer"),
        (["model.position=alibi"], "model.position"),
        (["model=llama-tiny", "model.d_model=120", "model.n_heads=8"], "even head_dim"),
        (["no_such_key=1"], "no_such_key"),
        (["model.n_layers"], "n_layers"),
        (["gpu=tpu9"], "unknown gpu"),
    ],
)
def test_bad_input_is_one_line(cli, args, needle):
    r = cli("count-params", *args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_verb(cli):
    r = cli("frobnicate")
    assert r.returncode == 2 and "unknown verb" in r.stderr


def test_debug_shows_traceback(cli):
    r = cli("count-params", "model.n_heads=5", env={"GPTKIT_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_verb_help_lists_groups_that_are_unchosen_by_default(cli):
    groups = [line.strip() for line in cli("train", "--help").stdout.splitlines()]
    assert any(line.startswith("experiment: ") and "shakespeare-char" in line for line in groups)
    assert "data: chat, files, hub" in cli("eval", "--help").stdout
    # verify's config is train's (`- train` in its defaults list): train's unchosen groups too
    verify = [line.strip() for line in cli("verify", "--help").stdout.splitlines()]
    assert any(line.startswith("experiment: ") and "sft-tiny" in line for line in verify)


def test_the_verb_table_is_the_commands_folder():
    """cli.VERBS is the whole wiring: every command module has a verb, every verb a module with run()
    and a config in conf/."""
    import pkgutil

    import gptkit.commands
    from gptkit.cli import VERBS, command
    from gptkit.conf_tree import conf_dir

    modules = {m.name for m in pkgutil.iter_modules(gptkit.commands.__path__) if not m.name.startswith("_")}
    assert modules == {v.module for v in VERBS.values()}
    for verb, v in VERBS.items():
        assert callable(command(verb).run), verb
        assert (conf_dir() / f"{v.config}.yaml").is_file(), verb


@pytest.mark.parametrize(
    "args, message",
    [
        (["sample", "--run", "runs/x"], "options are key=value, not --run: did you mean run=runs/x?"),
        (["train", "--max_steps", "10"], "did you mean trainer.max_steps=10?"),
        (["eval", "--stride=8"], "did you mean stride=8?"),
    ],
)
def test_flags_are_one_line_naming_the_key_value_spelling(capsys, args, message):
    from gptkit.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


# ---- issue 47 item 9: a missing optional package is one line naming its pip install ----------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from conftest import make_run

    d, _, _ = make_run(tmp_path_factory.mktemp("extras"), max_seq_len=64)
    return d


@pytest.mark.parametrize(
    "blocked, args, line",
    [
        (["starlette"], ["serve", "run=runs/none"], "gptkit serve needs starlette, which"),
        (["uvicorn"], ["serve", "run=runs/none"], "gptkit serve needs uvicorn, which"),
        (["lm_eval"], ["eval", "run={run}", "tasks=tests/evals", "progress=false"], "needs lm_eval, which"),
        (["torchao"], ["sample", "run={run}", "quantize=nf4", "prompt=a"], "need torchao, which"),
        (
            ["tensorboard"],
            ["train", "logger=[csv,tensorboard]", "runs_dir={tmp}"],
            "logger=tensorboard needs",
        ),
        (["wandb"], ["train", "logger=[wandb]", "runs_dir={tmp}"], "logger=wandb needs wandb, which"),
        (
            ["ray"],
            ["train", "trainer=ddp", "trainer.launcher=ray", "trainer.ray.num_workers=2", "runs_dir={tmp}"],
            "trainer.launcher=ray needs ray, which",
        ),
        (
            ["triton"],
            ["bench", "attention", "bench.device=cpu", "bench.backends=[sdpa,triton]"],
            "the triton row needs Triton, and triton is not installed",
        ),
        (["transformers"], ["bench", "sample", "bench.hf=true"], "the transformers side"),
        (
            ["gguf"],
            ["export", "run={run}", "out={tmp}/g", "format=gguf"],
            "export format=gguf needs gguf, which",
        ),
        # imported at the top of a module (no require before it): the CLI's report names the extra too
        (
            ["lm_eval", "gptkit.bench.evals", "gptkit.evaluation.lm_eval_adapter"],
            ["bench", "evals"],
            # bench's own line, or evaluation.tasks' where an earlier test of this worker imported it
            "needs lm_eval, which",
        ),
    ],
)
def test_a_missing_optional_package_is_one_line_naming_its_pip_install(
    capsys, monkeypatch, tmp_path, tiny_run, blocked, args, line
):
    from conftest import run_main

    from gptkit.extras import EXTRAS

    for name in blocked:
        # gptkit's own modules are imported again, the optional package is unimportable
        if name.startswith("gptkit."):
            monkeypatch.delitem(sys.modules, name, raising=False)
        else:
            monkeypatch.setitem(sys.modules, name, None)
    args = [a.format(run=tiny_run, tmp=tmp_path) for a in args]
    code, out, err = run_main(capsys, *args)
    pip = next(row.pip for row in EXTRAS.values() if blocked[0] in row.modules)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    assert line in err and err.rstrip().endswith(f": {pip}"), err


def test_the_extras_table_is_pyprojects():
    """Every extra of pyproject.toml but the test one is a row of gptkit.extras.EXTRAS whose pip command
    installs it, and its pinned versions are the ones the table names."""
    import tomllib

    from conftest import REPO

    from gptkit.extras import EXTRAS, TORCHAO_PIN

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in set(extras) - {"test"}:
        assert EXTRAS[name].pip.startswith(f"pip install 'gptkit[{name}]'"), name
    assert f"torchao=={TORCHAO_PIN}" in extras["quant"]
    assert {m for row in EXTRAS.values() for m in row.modules} >= {
        "starlette",
        "uvicorn",
        "lm_eval",
        "torchao",
    }


def test_serve_help_names_its_extra(cli):
    for args in (["serve", "--help"], ["--help"]):
        assert "pip install 'gptkit[serve]'" in " ".join(cli(*args).stdout.split()), args


# ---- issue 47 item 10: the helps say what the code does -----------------------------------------------
def verb_helps() -> dict[str, str]:
    """`gptkit <verb> --help` of every verb (the bench ones: bench's own line), and `gptkit --help`."""
    import contextlib
    import io

    from gptkit.cli import VERBS, _show_help, _usage

    helps = {"": _usage()}
    for verb, v in VERBS.items():
        if v.positional == v.config:
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            _show_help(verb, [])
        helps[verb] = out.getvalue()
    return helps


def test_no_help_comment_stops_mid_sentence():
    """A conf/ comment continued on lines under the key (not in its column) is read whole: the
    special_tokens_in_content comments of train, chat and serve ended at "is its text," before."""
    import re

    cut = []
    for verb, text in verb_helps().items():
        for line in text.splitlines():
            comment = line.split("  # ", 1)[1].rstrip() if "  # " in line else ""
            if re.search(r"[,|(:;]$|\b(or|and|the|a|of|to|is)$", comment):
                cut.append(f"{verb}: {line.strip()}")
    assert cut == []
    for verb in ("train", "chat", "serve", "sample"):
        said = [ln for ln in verb_helps()[verb].splitlines() if ln.strip().startswith("special_tokens_in")]
        assert said and all("allow: it becomes" in ln for ln in said), (verb, said)


def listed(comment: str) -> list[str]:
    """The choices a comment lists as `a | b | c` (a word each, the first after a colon or `type:`)."""
    import re

    m = re.search(r"([\w.-]+(?: \| [\w.-]+)+)", comment)
    return m.group(1).split(" | ") if m else []


def test_each_help_lists_the_codes_families_precisions_and_rope_scalings():
    """The lists the helps show are the code's tables: export's and import's transformers families
    (gptkit.hf.ARCHITECTURES), every precision comment of conf/ (gptkit.precision.PRECISIONS; FSDP's preset:
    the ones FSDP trains) and every rope_scaling comment (gptkit.model.config.ROPE_SCALINGS)."""
    import re

    from conftest import REPO

    from gptkit.cli import HF_FAMILIES
    from gptkit.hf import ARCHITECTURES
    from gptkit.model.config import ROPE_SCALINGS
    from gptkit.options import yaml_comments
    from gptkit.precision import PRECISIONS

    def family(name: str) -> str:
        return re.sub(r"[-_. ]|_text$", "", name.removesuffix("_text").lower())

    assert sorted(family(f) for f in re.split(r", | or ", HF_FAMILIES)) == sorted(map(family, ARCHITECTURES))
    helps = {verb: " ".join(text.split()) for verb, text in verb_helps().items()}
    for verb in ("", "export", "import"):
        assert HF_FAMILIES in helps[verb], verb
    assert "Qwen2/3" not in " ".join(helps.values())
    # conf/'s comments, which the helps print
    precisions, scalings = [], []
    for path in sorted((REPO / "conf").rglob("*.yaml")):
        for key, comment in yaml_comments(path.read_text()).items():
            if key.split(".")[-1] == "precision" and listed(comment):
                fsdp = path.name == "fsdp.yaml"
                want = [p.name for p in PRECISIONS.values() if p.fsdp or not fsdp]
                precisions.append((path.name, listed(comment), want))
            if key.split(".")[-1] == "rope_scaling" and listed(comment):
                scalings.append((path.name, listed(comment), list(ROPE_SCALINGS)))
    assert len(precisions) >= 3 and len(scalings) >= 2
    assert [p for p in precisions + scalings if p[1] != p[2]] == []
    train = helps["train"]
    assert " | ".join(PRECISIONS) in train and " | ".join(ROPE_SCALINGS) in train


def test_count_params_plans_per_mesh_and_refuses_a_mesh_that_does_not_divide(capsys):
    """n_gpus = dp x cp x tp: tp and cp divide the activations and logits, the matrices go over all n_gpus
    (the norms over dp x cp only), the bytes sent per micro-step follow the formulas of docs/parallelism.md;
    a mesh that does not divide the world or the model is one line naming the dimension, exit 2."""
    from conftest import run_main

    def plan(*args):
        code, out, err = run_main(capsys, "count-params", "model=llama-tiny", "format=json", *args)
        assert code == 0, err
        return json.loads(out)["plan"]

    flat = plan("n_gpus=8", "checkpointing=selective")
    mesh = plan("n_gpus=8", "tensor_parallel=2", "context_parallel=2", "checkpointing=selective")
    assert mesh["mesh"] == {"n_gpus": 8, "dp": 2, "tp": 2, "cp": 2, "ep": 1}
    a, b = flat["memory_per_gpu"], mesh["memory_per_gpu"]
    assert b["activations"] * 4 == pytest.approx(a["activations"])
    assert b["logits"] * 4 == pytest.approx(a["logits"])
    # llama-tiny: 4 layers of width 128, 128 tokens, 4 heads of which 2 kv (32 wide: d_kv 64), fp32 weights
    # and bf16 compute under bf16-mixed
    L, d, T, d_kv = 4, 128, 128, 64
    comm = mesh["communication_per_step"]
    # selective (ops) recomputes every block: per block 8 all-gathers/reduce-scatters of [b, T/cp, d] and 3
    # more recomputed, 4 for the embedding and head; loss_parallel's 3 all-reduces of [b, T/cp] fp32; the
    # norms' gradients all-reduced (tests/training/test_comm_count.py counts them on gloo)
    norms = (4 * 2 + 1) * d
    seq = (8 * L + 4 + 3 * L) * (1 / 2) * (T / 2) * d * 2
    assert comm["tp"] == seq + 3 * 2 * (1 / 2) * (T / 2) * 4 + 2 * (1 / 2) * norms * 2
    # the ring: K, V forward (and recomputed) cp-1 times, backward K, V cp-1 times and dK, dV (fp32) cp times
    kv = 2 * (T / 2) * (d_kv / 2)
    assert comm["cp"] == L * (2 * 1 * kv * 2 + 2 * kv * 4) + L * 1 * kv * 2
    assert b["weights"] > a["weights"] and b["weights"] < 1.01 * a["weights"]
    assert "tp" not in flat["communication_per_step"]
    for args, says in (
        (["n_gpus=4", "tensor_parallel=4", "context_parallel=2"], "= 8 GPUs is a mesh larger than the world"),
        (["n_gpus=6", "tensor_parallel=4"], "tensor_parallel=4 x context_parallel=1 = 4 does not divide"),
        (["n_gpus=8", "tensor_parallel=8"], "model.n_heads=4 is not divisible by tensor_parallel=8"),
        (["n_gpus=8", "context_parallel=2", "seq_len=126"], "seq_len=126 is not divisible by 2 x "),
    ):
        code, out, err = run_main(capsys, "count-params", "model=llama-tiny", *args)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, (args, err)
