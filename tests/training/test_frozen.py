"""An objective's frozen models (gptkit/training/objectives/base.py FrozenModel, frozen.<name> resolved by
gptkit/training/start.py): a teacher of another size from a run, a checkpoint file, a transformers folder
(hf:<folder>) or a Hub id (hf:<owner/name>, served by a fake hub: nothing is downloaded) gives the logits of
the same weights loaded directly; it is frozen, on the policy's device and dtype, in no optimizer and no
checkpoint; one of another vocabulary is one line naming both sources before anything trains.

The objective here is a test's own (`teach`: the KL to frozen.teacher), added to OBJECTIVES for the test, so
the seam is tested apart from objective=distill (tests/training/test_distill.py), which reads its teacher
through it. DPO's own
frozen.reference (the default, and a reference of another size) is in tests/training/test_dpo.py.
"""

import shutil

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import HF_EOS, HF_TEXT, char_tokenizer, random_gpt
from omegaconf import open_dict

import gptkit
from gptkit.conf_tree import compose
from gptkit.errors import ConfigError
from gptkit.training.objectives import OBJECTIVES
from gptkit.training.objectives.lm import LM

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


class Teach(LM):
    """A test objective: the forward KL from frozen.teacher's next-token distribution to the policy's.
    `seen` keeps each step's inputs and the teacher's logits of them."""

    name = "teach"
    seen: list = []

    @classmethod
    def frozen_models(cls, group):
        return ("teacher",)

    def loss(self, model, batch):
        x, y, *_ = batch
        teacher = self.frozen["teacher"].logits(model, x)
        Teach.seen.append((x.detach().clone(), teacher.detach().clone()))
        student = model(x).logits.float().log_softmax(-1)
        target = teacher.float().log_softmax(-1).flatten(0, 1)
        kl = F.kl_div(student.flatten(0, 1), target, log_target=True, reduction="batchmean")
        return kl, None


@pytest.fixture(autouse=True)
def teach(monkeypatch):
    monkeypatch.setitem(OBJECTIVES, "teach", Teach)
    Teach.seen.clear()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A small policy run (2 layers, d_model 32), a teacher of another size (3 layers, d_model 48) with the
    same tokenizer, the teacher exported as a transformers folder, a run of another vocabulary, some text."""
    from gptkit.cli import main as gptkit_main
    from gptkit.model import GPT, ModelConfig
    from gptkit.runs import write_run_folder

    root = tmp_path_factory.mktemp("frozen")
    tok = char_tokenizer()
    n = tok.get_vocab_size()
    config = {"tokenizer": {"kind": "file", "eos_token": HF_EOS}}
    write_run_folder(root / "small", config, random_gpt("llama-gqa-untied", n), tok)
    torch.manual_seed(1)
    big = ModelConfig(
        vocab_size=n,
        max_seq_len=48,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        d_model=48,
        d_ff=96,
        position="rope",
        mlp="swiglu",
        norm="rmsnorm",
        bias=False,
        tie_embeddings=False,
        init_std=0.3,
    )
    write_run_folder(root / "big", config, GPT(big).eval(), tok)
    assert gptkit_main(["export", f"run={root / 'big'}", f"out={root / 'big-hf'}"]) == 0
    other = char_tokenizer()
    other.add_tokens(["qq"])
    write_run_folder(root / "other", config, random_gpt("llama-gqa-untied", other.get_vocab_size()), other)
    (root / "text.txt").write_text((HF_TEXT.lower() + ". ") * 200)
    return root


def teach_cfg(root, runs_dir, teacher, *extra):
    """objective=teach from the small run, frozen.teacher=`teacher`."""
    cfg = compose(
        "train",
        [
            f"init_from={root / 'small'}",
            "data=files",
            f"data.paths=[{root / 'text.txt'}]",
            "trainer.batch_size=2",
            "trainer.max_steps=2",
            "trainer.val_every=2",
            "trainer.val_windows=2",
            "trainer.progress=false",
            "trainer.accelerator=cpu",
            f"runs_dir={runs_dir}",
            "name=student",
            *extra,
        ],
    )
    with open_dict(cfg):
        cfg.objective = "teach"
        cfg.frozen.teacher = teacher
    return cfg


def built(cfg):
    """The plan of cfg, its LitGPT with the frozen models' weights loaded (as fit loads them)."""
    from gptkit.training.module import LitGPT
    from gptkit.training.start import load_frozen

    plan = gptkit.plan(cfg)
    module = LitGPT(plan)
    load_frozen(module, plan.cfg, plan.init_from, plan.frozen)
    return plan, module


def fake_hub(monkeypatch, files, cache):
    """huggingface_hub.snapshot_download serving `files` as one commit of any repository, online."""

    def snapshot_download(repo_id, *, revision=None, allow_patterns=(), local_files_only=False, **kw):
        from fnmatch import fnmatch

        snapshot = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in files.iterdir():
            if any(fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, snapshot / f.name)
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("gptkit.hub.check_hub_reachable", lambda timeout, instead="": None)


@pytest.mark.parametrize("source", ["run", "checkpoint", "hf-folder", "hf-hub"])
def test_a_teacher_of_another_size_loads_from_each_source_and_gives_the_logits_of_its_weights(
    runs, tmp_path, monkeypatch, source
):
    from gptkit.runs import load_model

    given = {
        "run": str(runs / "big"),
        "checkpoint": str(runs / "big" / "checkpoints" / "last.ckpt"),
        "hf-folder": f"hf:{runs / 'big-hf'}",
        "hf-hub": "hf:tiny-org/big-teacher",
    }[source]
    if source == "hf-hub":
        fake_hub(monkeypatch, runs / "big-hf", tmp_path / "hf-cache")
    plan, module = built(teach_cfg(runs, tmp_path, given))
    teacher = module.frozen["teacher"]
    # its own config: another size than the policy's
    assert (teacher.module.cfg.n_layers, teacher.module.cfg.d_model) == (3, 48)
    assert (module.model.cfg.n_layers, module.model.cfg.d_model) == (2, 32)
    # frozen: no gradient, eval mode, not a submodule (no checkpoint, no optimizer)
    assert not any(p.requires_grad for p in teacher.module.parameters()) and not teacher.module.training
    assert all(k.startswith("model.") for k in module.state_dict())
    assert len(module.state_dict()) == len(module.model.state_dict())
    optimizer = module.configure_optimizers()["optimizer"]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} <= {
        id(p) for p in module.model.parameters()
    }
    # the logits of the same weights loaded directly
    *_, direct = load_model(runs / "big")
    x = torch.randint(0, module.model.cfg.vocab_size, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(teacher.logits(module.model, x), direct(x).logits, atol=1e-5, rtol=1e-5)
    # the run's config records the exact source (an import: the pinned one), which a resume reads again
    recorded = str(plan.cfg.frozen.teacher)
    if source == "hf-hub":
        assert recorded == f"hf:tiny-org/big-teacher@{COMMIT}"
    elif source == "hf-folder":
        assert recorded == f"hf:{(runs / 'big-hf').resolve()}"
    else:
        assert recorded == str(runs / "big" / "checkpoints" / "last.ckpt")


def test_an_objective_trains_against_its_teacher_which_stays_out_of_the_checkpoint(runs, tmp_path, capfd):
    from gptkit.runs import load_model

    result = gptkit.train(teach_cfg(runs, tmp_path, str(runs / "big"), "trainer.precision=bf16-true"))
    # each step read the teacher's logits, on the policy's dtype (bf16-true: the teacher converted too)
    assert len(Teach.seen) == 2 and all(t.dtype == torch.bfloat16 for _, t in Teach.seen)
    *_, direct = load_model(runs / "big", dtype="bf16")
    x, logits = Teach.seen[0]
    with torch.no_grad():
        torch.testing.assert_close(logits, direct(x).logits, atol=2e-2, rtol=2e-2)
    ckpt = torch.load(result.run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    # the policy's weights only; the teacher's source, not its weights
    *_, student = load_model(result.run_dir)
    assert set(ckpt["state_dict"]) == {f"model.{k}" for k in student.state_dict()}
    assert ckpt["gptkit_frozen_teacher"] == {
        "path": str(runs / "big" / "checkpoints" / "last.ckpt"),
        "step": 0,
    }
    n_opt = sum(len(g["params"]) for g in ckpt["optimizer_states"][0]["param_groups"])
    assert n_opt == len(list(student.parameters()))
    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert saved["frozen"]["teacher"] == str(runs / "big" / "checkpoints" / "last.ckpt")


def test_a_teacher_of_another_vocabulary_is_one_line_naming_both_sources(runs, tmp_path):
    with pytest.raises(ConfigError) as e:
        gptkit.plan(teach_cfg(runs, tmp_path, str(runs / "other")))
    message = str(e.value)
    assert "\n" not in message
    assert f"frozen.teacher={runs / 'other'} has another vocabulary than the policy (init_from=" in message
    assert str(runs / "small") in message and str(runs / "other" / "tokenizer.json") in message


@pytest.mark.parametrize(
    "bad, needle",
    [
        ("missing", "frozen.teacher={p}: {p} does not exist; pass a run folder"),
        ("empty", "frozen.teacher={p}: no checkpoint in {p}"),
        ("linked", "frozen.teacher={p}: {p}/checkpoints/last.ckpt is a symbolic link to"),
        (None, "objective=teach needs frozen.teacher=<start, a run folder or checkpoint"),
    ],
)
def test_a_bad_teacher_source_is_one_line_before_any_data(runs, tmp_path, bad, needle):
    p = tmp_path / str(bad)
    if bad == "empty":
        p.mkdir()
    elif bad == "linked":
        (p / "checkpoints").mkdir(parents=True)
        shutil.copy(runs / "big" / "config.yaml", p / "config.yaml")
        (p / "checkpoints" / "last.ckpt").symlink_to(runs / "big" / "checkpoints" / "last.ckpt")
    with pytest.raises(ConfigError) as e:
        gptkit.plan(teach_cfg(runs, tmp_path / "runs", None if bad is None else str(p)))
    assert "\n" not in str(e.value) and needle.format(p=p) in str(e.value)
    # refused before the data or the run folder
    assert not (tmp_path / "runs" / "student" / "config.yaml").exists()
