"""Reward models (objective=reward, data=preference): the Bradley-Terry loss is its formula, a run trained
here scores held-out pairs above chance, exports as transformers' *ForSequenceClassification with the same
logits, serves objective=grpo as a batched reward ({kind: model}), and is refused as a policy in one line.
"""

import math
import random

import pytest
import torch
from conftest import (
    char_tokenizer,
    hf_common,
    hf_perturbed,
    make_run,
    rows_by_step,
    run_cli,
    run_main,
    tiny_run,
    write_jsonl,
)

import gptkit
from gptkit.training.objectives.reward import bradley_terry_loss, check_reward_config, last_positions

# known rewards: chosen, rejected
REWARDS = [(1.5, -0.5), (-2.0, 0.25), (0.0, 0.0), (7.0, 6.5), (-30.0, 10.0)]


def test_the_loss_is_bradley_terrys_formula_with_trls_centring_term():
    c, r = (torch.tensor(col) for col in zip(*REWARDS))
    for center in (0.0, 0.01, 0.5):
        losses, chosen, rejected = bradley_terry_loss(c, r, center)
        want = [-math.log(1 / (1 + math.exp(-(a - b)))) + center * (a + b) ** 2 for a, b in REWARDS]
        assert losses.double().tolist() == pytest.approx(want, abs=1e-5, rel=1e-6)
        assert chosen.tolist() == c.tolist() and rejected.tolist() == r.tolist()
    # the head reads the answer's last token: one place after its last target, or the row's last input
    y = torch.tensor([[-100, 3, 4, -100, -100], [-100, -100, -100, 5, 6]])
    assert last_positions(y).tolist() == [3, 4]
    with pytest.raises(Exception, match="center_rewards_coefficient=-1 must be null or >= 0"):
        check_reward_config({"center_rewards_coefficient": -1})


def pairs(n, seed=0):
    """Pairs whose chosen answer is the prompt's word in capitals, the rejected one the same but its last
    letter (DPO's off-by-one answers of tests/training/test_dpo.py, by case)."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        w = "".join(rng.choice("abcdef") for _ in range(4))
        out.append({"prompt": f"upper {w}", "chosen": w.upper(), "rejected": w.upper()[:3] + w[3]})
    return out


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory):
    """An SFT start (a plain tiny Llama: 2 steps of data=chat, chatml, byte) and a reward run from it on 80
    pairs (20 held out), 24 steps of 8 pairs."""
    root = tmp_path_factory.mktemp("reward")
    rows = pairs(80)
    sft = write_jsonl(root / "sft.jsonl", [{"prompt": r["prompt"], "response": r["chosen"]} for r in rows])
    write_jsonl(root / "pairs.jsonl", rows)
    keys = dict(tokenizer="byte", data="chat", steps=2, val_every=2, val_windows=2, checkpoint_every=None)
    model = dict(model="llama-tiny", kv_heads=1, d_ff=64, seq_len=48, dropout=0.0)
    gptkit.train(
        tiny_run(sft, root, "sft", "data.template=chatml", **model, **keys, log_every=None, accelerator="cpu")
    )
    from gptkit.cli import main

    # through the CLI's main, as `gptkit train ...` runs it
    assert main(["train", *reward_args(root, "rm")]) in (0, None)
    return root


def reward_args(root, name, *extra):
    keys = dict(model=None, tokenizer=None, data=None, batch_size=8, steps=12, val_every=4, val_windows=20)
    return [
        "objective=reward",
        f"init_from={root / 'sft'}",
        "data=preference",
        f"data.paths=[{root / 'pairs.jsonl'}]",
        "data.val_fraction=0.25",
        *tiny_run(None, root, name, *extra, **keys, accelerator="cpu", lr="3e-3", warmup=1),
    ]


def test_a_reward_model_learns_to_score_held_out_pairs_above_chance(reward_run):
    rows = rows_by_step(reward_run / "rm")
    val = {s: r for s, r in rows.items() if r.get("val/rewards/accuracy")}
    assert sorted(val) == [4, 8, 12]
    train = [float(r["train/loss"]) for r in rows.values() if r.get("train/loss")]
    # the start scores at chance: its head gives rewards near 0, the first loss is log 2, accuracy 50%
    assert train[0] == pytest.approx(math.log(2), abs=1e-3) and train[-1] < train[0]
    end = val[12]
    # 20 held-out pairs (the start scores them at chance: 35%, 60%, 0% over 3 seeds, docs/reward-models.md):
    # well above chance (this seed: 100%, margin 1.27), by a clear margin
    assert float(end["val/rewards/accuracy"]) >= 0.75, end
    assert float(end["val/rewards/margin"]) > 0.5, end
    assert float(end["val/loss"]) < math.log(2)


def test_the_lm_head_a_reward_model_never_reads_is_frozen_so_ddp_trains_it():
    """An untied LM head gets no gradient from the scores: frozen (DDP refuses a trained weight without a
    gradient); a tied one is the embedding, which trains."""
    from gptkit.model import GPT, ModelConfig

    small = dict(vocab_size=16, max_seq_len=8, n_layers=1, n_heads=2, d_model=8, score_head=True)
    untied = GPT(ModelConfig(**small, tie_embeddings=False))
    assert not untied.lm_head.weight.requires_grad and untied.score.weight.requires_grad
    assert GPT(ModelConfig(**small)).lm_head.weight.requires_grad


@pytest.mark.long
def test_a_reward_run_resumes_bit_exactly_and_on_2_processes_equals_one_process(reward_run):
    """4 steps of 8 pairs: stopped at step 2 and resumed, the same floats; DDP and FSDP2 (fp32) on 2 CPU ranks
    of 4 pairs each log what one process logs."""

    def rows(name, *extra):
        args = reward_args(reward_run, name, "trainer.max_steps=4", *extra)
        r = run_cli("train", *args)
        assert r.returncode == 0, r.stderr[-3000:]
        return rows_by_step(reward_run / name)

    one = rows("one")
    keys = ("train/loss", "train/rewards/margin", "val/loss", "val/rewards/accuracy", "val/rewards/margin")
    rows("split", "trainer.stop_at_step=2")
    r = run_cli("train", f"resume={reward_run / 'split'}", f"runs_dir={reward_run}", "name=split")
    assert r.returncode == 0, r.stderr[-3000:]
    again = rows_by_step(reward_run / "split")
    # (the stop at step 2 validates there too)
    assert [[r[k] for k in keys[:2]] for r in again.values()] == [
        [r[k] for k in keys[:2]] for r in one.values()
    ]
    assert [again[4][k] for k in keys] == [one[4][k] for k in keys]
    for extra in (["trainer=ddp"], ["trainer=fsdp", "trainer.precision=32-true"]):
        two = rows(extra[0].split("=")[1], *extra, "trainer.devices=2", "trainer.batch_size=4")
        for step, row in one.items():
            for k in keys:
                if row.get(k):
                    assert float(two[step][k]) == pytest.approx(float(row[k]), abs=1e-5), (extra, step, k)


def test_a_reward_model_exports_as_llama_for_sequence_classification_with_equal_logits(reward_run, capsys):
    transformers = pytest.importorskip("transformers")
    from gptkit.runs import load_model

    out = reward_run / "hf"
    code, stdout, err = run_main(capsys, "export", f"run={reward_run / 'rm'}", f"out={out}")
    assert code == 0, err
    assert "LlamaForSequenceClassification" in stdout
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out).float().eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    *_, ours = load_model(reward_run / "rm")
    assert_same_scores(ours, hf)


def assert_same_scores(ours, hf):
    """Rows of 3 lengths, padded on the right with pad_token_id: transformers' logits [N, 1] (the head at the
    last token that is not pad) equal our scores at each row's last token, fp32, to 1e-5."""
    pad, vocab = hf.config.pad_token_id, ours.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    lengths = [12, 7, 3]
    ids = torch.full((3, 12), pad, dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(0, vocab, (n,), generator=g)
        ids[i, :n] = torch.where(row == pad, (row + 1) % vocab, row)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits[:, 0]
        mine = ours(ids, score_at=torch.tensor(lengths) - 1).scores
    assert torch.allclose(mine, theirs, atol=1e-5, rtol=0), (mine, theirs)
    assert mine.std() > 0


def test_lora_on_a_reward_model_trains_its_head_in_full_and_checkpoints_and_exports_it_with_the_adapters():
    """apply_lora leaves the new score head trainable (PEFT's modules_to_save), the checkpoint keeps it with
    the adapters, and the PEFT export is SEQ_CLS with modules_to_save=["score"] holding it."""
    from gptkit.adapters import check_adapters
    from gptkit.hf import peft_adapters
    from gptkit.model import GPT, ModelConfig
    from gptkit.training.finetune.lora import adapter_state_dict, apply_lora

    small = dict(vocab_size=16, max_seq_len=8, n_layers=1, n_heads=2, d_model=8, tie_embeddings=False)
    lora = {"rank": 2, "alpha": 4, "dropout": 0.0, "targets": ["q", "v"]}
    model = GPT(ModelConfig(**small, score_head=True, mlp="swiglu", norm="rmsnorm", position="rope"))
    trainable = apply_lora(model, lora)
    named = {k for k, p in model.named_parameters() if p.requires_grad}
    assert named == {"score.weight", *(k for k in named if "lora_" in k)} and len(named) == 5
    assert trainable == 8 + 2 * (2 * 8 + 8 * 2)
    state = adapter_state_dict({f"model.{k}": v for k, v in model.state_dict().items()}, "model.")
    assert set(state) == {f"model.{k}" for k in named}
    plain = {k.removeprefix("model."): v for k, v in state.items()}
    check_adapters(plain, model.cfg, lora, "ckpt")
    with pytest.raises(Exception, match="ckpt does not hold score.weight, which train in full"):
        check_adapters({k: v for k, v in plain.items() if k != "score.weight"}, model.cfg, lora, "ckpt")
    config, tensors = peft_adapters(plain, model.cfg, lora)
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    assert torch.equal(tensors["base_model.model.score.weight"], model.score.weight)


@pytest.mark.long
def test_a_reward_model_trains_lora_adapters_with_its_head_in_full_and_exports_merged_and_for_peft(
    reward_run, capsys
):
    """finetune=lora: the adapters and the new score head train (PEFT's modules_to_save) and the checkpoint
    holds both; the merged export's logits and PEFT's (SEQ_CLS adapters on the exported base) equal gptkit's
    scores."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from gptkit.runs import load_model

    code, _, err = run_main(
        capsys, "train", *reward_args(reward_run, "rm-lora", *LORA, "trainer.max_steps=2")
    )
    assert code == 0, err
    saved = torch.load(reward_run / "rm-lora" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert "model.score.weight" in saved and all("lora_" in k for k in saved if k != "model.score.weight")
    # the adapters' B (zeros at the start) moved: the head's gradient reaches them
    assert all(v.abs().max() > 0 for k, v in saved.items() if k.endswith("_B"))
    *_, ours = load_model(reward_run / "rm-lora")
    code, stdout, err = run_main(
        capsys, "export", f"run={reward_run / 'rm-lora'}", f"out={reward_run / 'hf-l'}"
    )
    assert code == 0 and "LlamaForSequenceClassification" in stdout, err
    merged = (
        transformers.AutoModelForSequenceClassification.from_pretrained(reward_run / "hf-l").float().eval()
    )
    assert_same_scores(ours, merged)
    # PEFT: the adapters and the head on the base the run started from, exported as transformers'
    code, _, err = run_main(capsys, "export", f"run={reward_run / 'sft'}", f"out={reward_run / 'hf-sft'}")
    assert code == 0, err
    out = reward_run / "peft-l"
    code, stdout, err = run_main(
        capsys, "export", f"run={reward_run / 'rm-lora'}", f"out={out}", "adapters=true"
    )
    assert code == 0 and "and the score head, modules_to_save" in stdout, err
    base = transformers.AutoModelForSequenceClassification.from_pretrained(
        reward_run / "hf-sft", num_labels=1, pad_token_id=merged.config.pad_token_id
    )
    assert_same_scores(ours, peft.PeftModel.from_pretrained(base, out).float().eval())


LORA = ("finetune=lora", "lora.rank=4", "lora.alpha=8", "lora.targets=[q,v,down]")
QLORA = ("finetune=qlora", "qlora.block_size=32", "qlora.scaler_block_size=8", *LORA[1:])


@pytest.mark.long
@pytest.mark.parametrize("adapters", [LORA, QLORA], ids=["lora", "qlora"])
def test_a_reward_models_adapters_and_head_resume_bit_exactly(reward_run, capsys, adapters):
    """finetune=lora and qlora (whose NF4 base lacks the head: it starts from the run's seed): 4 steps
    straight, and stopped at step 2 then resumed, log the same floats and save the same head; lora on 2 DDP
    ranks logs one process's."""
    from gptkit.runs import load_model

    name = adapters[0].split("=")[1]
    for run, extra in ((f"{name}-4", ()), (f"{name}-2", ("trainer.stop_at_step=2",))):
        code, _, err = run_main(
            capsys, "train", *reward_args(reward_run, run, *adapters, "trainer.max_steps=4", *extra)
        )
        assert code == 0, err
    code, _, err = run_main(capsys, "train", f"resume={reward_run / f'{name}-2'}", "trainer.progress=false")
    assert code == 0, err
    one, two = rows_by_step(reward_run / f"{name}-4"), rows_by_step(reward_run / f"{name}-2")
    keys = ("train/loss", "train/rewards/margin")
    assert [[two[s][k] for k in keys] for s in (1, 2, 3, 4)] == [
        [one[s][k] for k in keys] for s in (1, 2, 3, 4)
    ]
    assert two[4]["val/loss"] == one[4]["val/loss"] and float(one[4]["train/loss"]) < float(
        one[1]["train/loss"]
    )
    heads = [load_model(reward_run / r)[-1].score.weight for r in (f"{name}-4", f"{name}-2")]
    assert torch.equal(*heads) and heads[0].abs().max() > 0
    if name == "lora":
        # DDP: 2 ranks of 4 pairs, the adapters and the head reduced, one process's floats
        args = reward_args(reward_run, "lora-ddp", *adapters, "trainer.max_steps=4", "trainer=ddp")
        r = run_cli("train", *args, "trainer.devices=2", "trainer.batch_size=4")
        assert r.returncode == 0, r.stderr[-3000:]
        ddp = rows_by_step(reward_run / "lora-ddp")
        for s in (1, 2, 3, 4):
            for k in (*keys, *(("val/loss", "val/rewards/accuracy") if s == 4 else ())):
                assert float(ddp[s][k]) == pytest.approx(float(one[s][k]), abs=1e-5), (s, k)


def test_gpt2_exports_its_score_head_and_a_family_without_one_is_refused_in_one_line(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from gptkit.runs import load_model

    (tmp_path / "gpt2").mkdir()
    run, _, _ = make_run(tmp_path / "gpt2", position="learned", score_head=True)
    code, stdout, err = run_main(capsys, "export", f"run={run}", f"out={tmp_path / 'hf2'}")
    assert code == 0 and "GPT2ForSequenceClassification" in stdout, err
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf2").float().eval()
    *_, ours = load_model(run)
    assert_same_scores(ours, hf)
    (tmp_path / "qwen3").mkdir()
    run, _, _ = make_run(tmp_path / "qwen3", score_head=True, qk_norm="head")
    code, _, err = run_main(capsys, "export", f"run={run}", f"out={tmp_path / 'hf3'}")
    assert code == 2 and err.strip().startswith("error: a reward model (model.score_head) of the Qwen3")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "hf3").exists()


@pytest.mark.parametrize("kind", ["Llama", "Qwen2", "GPT2"])
def test_a_transformers_reward_model_imports_with_its_score_head_and_the_same_logits(tmp_path, capsys, kind):
    """`gptkit import` of a tiny *ForSequenceClassification (num_labels 1, every weight perturbed): a reward
    model (model.score_head) whose scores are transformers' logits on right-padded rows, exported back to
    the same tensors; more labels is one line, exit 2."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from gptkit.hf.families import family_of
    from gptkit.model import GPT
    from gptkit.runs import load_model
    from gptkit.training.objectives.reward import Reward
    from gptkit.training.rewards import RewardModel
    from gptkit.training.start import load_init_weights

    def config(labels, **pad):
        if kind == "GPT2":
            shape = dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
            return transformers.GPT2Config(**shape, num_labels=labels, **pad)
        return getattr(transformers, f"{kind}Config")(
            **hf_common(96, 32, **pad), num_labels=labels, tie_word_embeddings=False
        )

    cls = getattr(transformers, f"{kind}ForSequenceClassification")
    theirs = hf_perturbed(lambda: cls(config(1, pad_token_id=0)))
    theirs.save_pretrained(tmp_path / "hf")
    # (a reward model's folder has its tokenizer: the GRPO reward reads it)
    char_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    code, _, err = run_main(capsys, "import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'rm'}")
    assert code == 0, err
    *_, ours = load_model(tmp_path / "rm")
    assert (
        ours.cfg.score_head and family_of(ours.cfg).score_architecture == f"{kind}ForSequenceClassification"
    )
    assert_same_scores(ours, theirs)
    # as a GRPO reward ({kind: model}): one batched forward, transformers' logits
    model = RewardModel(str(tmp_path / "rm"), "rm")
    model.check()
    seqs = [[5, 9, 17, 3], [7, 1], [60, 61, 62, 63, 64, 95]]
    ids = torch.tensor([q + [0] * (6 - len(q)) for q in seqs])
    with torch.no_grad():
        want = theirs(input_ids=ids).logits[:, 0].tolist()
    assert model.scores(seqs, "cpu") == pytest.approx(want, abs=1e-5)
    # and not a policy: one line, exit 2
    code, _, err = run_main(capsys, "sample", f"run={tmp_path / 'rm'}", "prompt=hi", "max_new_tokens=2")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "is a reward model" in err, err
    # as the start of objective=reward: its head kept (Reward.model_config), its weights loaded as init_from=
    start = GPT(Reward.model_config(ours.cfg, "init_from")).eval()
    load_init_weights(start, tmp_path / "rm" / "checkpoints" / "last.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(start.state_dict().values(), ours.state_dict().values()))
    code, stdout, err = run_main(capsys, "export", f"run={tmp_path / 'rm'}", f"out={tmp_path / 'again'}")
    assert code == 0 and f"{kind}ForSequenceClassification" in stdout, err
    original, again = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "again"))
    assert sorted(again) == sorted(original) and all(torch.equal(again[k], v) for k, v in original.items())
    # a classifier of 3 labels is not a reward model
    cls(config(3)).save_pretrained(tmp_path / "c3")
    code, _, err = run_main(capsys, "import", f"hf={tmp_path / 'c3'}", f"out={tmp_path / 'c3-run'}")
    assert code == 2 and err.strip() == (
        f"error: config.json: {kind}ForSequenceClassification with 3 labels; gptkit reads a reward model, "
        "one score (num_labels 1)"
    )


def test_a_reward_model_is_refused_as_a_policy_in_one_line(reward_run, capsys):
    rm = reward_run / "rm"
    code, _, err = run_main(capsys, "sample", f"run={rm}", "prompt=hi", "max_new_tokens=2", "device=cpu")
    assert code == 2 and err.strip().startswith(f"error: {rm} is a reward model"), err
    assert len(err.strip().splitlines()) == 1
    dpo = [
        "objective=dpo",
        f"init_from={rm}",
        "data=preference",
        f"data.paths=[{reward_run / 'pairs.jsonl'}]",
        f"runs_dir={reward_run}",
        "name=policy",
        "trainer.accelerator=cpu",
    ]
    code, _, err = run_main(capsys, "train", *dpo)
    assert code == 2 and f"init_from={rm}" in err and "is a reward model" in err, err
    assert not (reward_run / "policy").exists()
    # nor is it a frozen reference, and a GRPO reward must name a reward run
    dpo[1] = f"init_from={reward_run / 'sft'}"
    code, _, err = run_main(capsys, "train", *dpo, f"frozen.reference={rm}")
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        f"error: frozen.reference={rm} is a reward"
    ), err
    grpo = [
        "objective=grpo",
        "data=prompts",
        f"data.paths=[{reward_run / 'pairs.jsonl'}]",
        *dpo[1:2],
        *dpo[4:],
    ]
    for rewards, message in (
        ("[{kind: model}]", "grpo.rewards[0]: kind: model needs path: <a reward run>"),
        (f"[{{kind: model, path: '{reward_run / 'sft'}'}}]", f"{reward_run / 'sft'} is not a reward model"),
    ):
        code, _, err = run_main(capsys, "train", *grpo, f"grpo.rewards={rewards}")
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_grpo_reads_a_reward_model_batched_and_trains(reward_run, monkeypatch):
    from gptkit.training import rewards

    write_jsonl(reward_run / "prompts.jsonl", [{"prompt": r["prompt"]} for r in pairs(12, seed=1)])
    calls = []
    scores = rewards.RewardModel.scores

    def counted(self, seqs, device, tokenizer=None):
        out = scores(self, seqs, device, tokenizer)
        calls.append(out)
        return out

    monkeypatch.setattr(rewards.RewardModel, "scores", counted)
    keys = dict(model=None, tokenizer=None, data=None, batch_size=2, steps=3, val_every=3, val_windows=2)
    gptkit.train(
        [
            "objective=grpo",
            f"init_from={reward_run / 'sft'}",
            "data=prompts",
            f"data.paths=[{reward_run / 'prompts.jsonl'}]",
            f"grpo.rewards=[{{kind: model, path: '{reward_run / 'rm'}', name: rm}}]",
            "grpo.group_size=4",
            "grpo.max_new_tokens=6",
            *tiny_run(None, reward_run, "grpo", **keys, accelerator="cpu", lr="1e-3", warmup=1),
        ]
    )
    # one forward per micro-batch: its 2 prompts x 4 completions at once (train), then the val prompt's one
    assert [len(c) for c in calls] == [8, 8, 8, 1], [len(c) for c in calls]
    rows = rows_by_step(reward_run / "grpo")
    logged = [float(r["train/rewards/rm"]) for r in rows.values() if r.get("train/rewards/rm")]
    assert len(logged) == 3 and all(math.isfinite(v) for v in logged)
    assert logged[0] == pytest.approx(sum(calls[0]) / 8, abs=1e-5)
    assert float(rows[3]["train/loss"]) == float(rows[3]["train/loss"])
