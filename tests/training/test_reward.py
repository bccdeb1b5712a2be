"""Reward models (objective=reward, data=preference): the Bradley-Terry loss is its formula, a run trained
here scores held-out pairs above chance, exports as transformers' *ForSequenceClassification with the same
logits, serves objective=grpo as a batched reward ({kind: model}), and is refused as a policy in one line.
"""

import math
import random

import pytest
import torch
from conftest import make_run, rows_by_step, run_cli, run_main, tiny_run, write_jsonl

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
