"""DPO (objective=dpo, data=preference): the loss is the paper's formula, the pairs are rendered with the chat
template and masked to their answers, bad input is one line, and a run trains against a frozen reference,
logs its rewards, resumes bit-exactly and follows the same trajectory on 2 processes (DDP, then FSDP2).
"""

import math
from pathlib import Path

import pytest
import torch
from conftest import (
    answer_rows,
    assert_same,
    estimate_plan,
    from_sft,
    loss_and_grads,
    policy_and_reference,
    run_group,
    run_main,
    sft_start,
    write_jsonl,
)
from conftest import rows_by_step as rows_of

import gptkit
from gptkit import chat_templates as templates
from gptkit.data import prepare
from gptkit.data.preference import make_pair_rows
from gptkit.errors import GptkitError
from gptkit.training.objectives.dpo import (
    RewardWindow,
    answer_logps,
    check_dpo_config,
    dpo_loss,
    orpo_loss,
    simpo_loss,
)

# known summed log-probs: policy chosen, policy rejected, reference chosen, reference rejected
LOGPS = [
    (-12.5, -14.0, -13.0, -13.5),
    (-3.25, -2.0, -3.0, -2.5),
    (-40.0, -41.5, -40.2, -40.9),
    (-7.0, -7.0, -7.0, -7.0),
    (-100.0, -60.0, -90.0, -75.0),
]


def paper_loss(pc, pr, rc, rr, beta, eps=0.0):
    """-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), eq. 7 of Rafailov et al. 2023, with cDPO's
    label smoothing eps, in float64 from math alone."""
    z = beta * ((pc - rc) - (pr - rr))
    return -(1 - eps) * math.log(1 / (1 + math.exp(-z))) - eps * math.log(1 / (1 + math.exp(z)))


@pytest.mark.parametrize("beta, eps", [(0.1, 0.0), (0.5, 0.0), (2.0, 0.0), (0.1, 0.2)])
def test_loss_is_the_papers_formula_on_known_log_probs(beta, eps):
    pc, pr, rc, rr = (torch.tensor(col, dtype=torch.float32) for col in zip(*LOGPS))
    losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta, eps)
    want = torch.tensor([paper_loss(*row, beta, eps) for row in LOGPS], dtype=torch.float64)
    assert torch.allclose(losses.double(), want, atol=1e-6, rtol=0), (losses, want)
    assert torch.allclose(chosen, beta * (pc - rc)) and torch.allclose(rejected, beta * (pr - rr))
    hinge, _, _ = dpo_loss(pc, pr, rc, rr, beta, loss="hinge")
    want = [max(0.0, 1 - beta * ((a - c) - (b - d))) for a, b, c, d in LOGPS]
    assert torch.allclose(hinge.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=0)


# each pair's answer lengths in loss tokens: chosen, rejected
LENGTHS = [(5, 7), (1, 2), (20, 19), (3, 3), (50, 40)]


def test_ipo_simpo_and_orpo_are_their_papers_formulas_on_known_log_probs():
    """IPO (Azar et al. eq. 17, the log-ratios per answer token as TRL and the authors have it), SimPO (Meng
    et al. eq. 6) and ORPO (Hong et al. eq. 6-7), each written out in float64 from math alone."""
    pc, pr, rc, rr = (torch.tensor(col, dtype=torch.float32) for col in zip(*LOGPS))
    nc, nr = (torch.tensor(col, dtype=torch.float32) for col in zip(*LENGTHS))
    for beta in (0.1, 0.5, 2.0):
        got, _, _ = dpo_loss(pc, pr, rc, rr, beta, loss="ipo", chosen_tokens=nc, rejected_tokens=nr)
        want = [
            ((a - c) / m - (b - d) / k - 1 / (2 * beta)) ** 2 for (a, b, c, d), (m, k) in zip(LOGPS, LENGTHS)
        ]
        assert got.double().tolist() == pytest.approx(want, abs=1e-5, rel=1e-6)
    for beta, gamma, eps in ((2.0, 0.5, 0.0), (2.5, 1.4, 0.0), (0.1, 0.0, 0.2)):
        got, chosen, rejected = simpo_loss(pc, pr, nc, nr, beta, gamma, eps)
        want = []
        for (a, b, _, _), (m, k) in zip(LOGPS, LENGTHS):
            z = beta / m * a - beta / k * b - gamma
            want.append(-(1 - eps) * math.log(1 / (1 + math.exp(-z))) - eps * math.log(1 / (1 + math.exp(z))))
        assert got.double().tolist() == pytest.approx(want, abs=1e-6)
        assert chosen.tolist() == pytest.approx([beta * a / m for (a, *_), (m, _) in zip(LOGPS, LENGTHS)])
    for lam in (0.1, 1.0):
        got, chosen, _ = orpo_loss(pc, pr, nc, nr, lam)
        want = []
        for (a, b, _, _), (m, k) in zip(LOGPS, LENGTHS):
            p_w, p_l = math.exp(a / m), math.exp(b / k)  # P(y|x) per token, the paper's eq. 2
            odds_ratio = (p_w / (1 - p_w)) / (p_l / (1 - p_l))
            want.append(-a / m - lam * math.log(1 / (1 + 1 / odds_ratio)))
        assert got.double().tolist() == pytest.approx(want, abs=1e-6, rel=1e-6)
        assert chosen.tolist() == pytest.approx([lam * a / m for (a, *_), (m, _) in zip(LOGPS, LENGTHS)])
    # the odds-ratio term without cancellation where a mean log-prob is near 0 (p near 1)
    near = orpo_loss(torch.tensor([-1e-8]), torch.tensor([-2e-8]), torch.ones(1), torch.ones(1), 1.0)[0]
    # log odds = a - log(1 - e^a) = a - log(-expm1(a)), in float64
    log_odds = (-1e-8 - math.log(-math.expm1(-1e-8))) - (-2e-8 - math.log(-math.expm1(-2e-8)))
    assert float(near) == pytest.approx(1e-8 - math.log(1 / (1 + math.exp(-log_odds))), abs=1e-5)


def test_answer_log_probs_sum_the_answer_tokens_only_and_rewards_average_over_pairs():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)  # [N, T, vocab_size]
    y = torch.tensor([[-100, -100, 3, 1, -100], [-100, 6, -100, -100, -100]])
    lp = torch.log_softmax(logits, -1)
    want = torch.stack([lp[0, 2, 3] + lp[0, 3, 1], lp[1, 1, 6]])
    assert torch.allclose(answer_logps(logits, y), want, atol=1e-6)
    window = RewardWindow()
    window.add(torch.tensor([1.0, -1.0]), torch.tensor([0.0, 0.5]))
    window.add(torch.tensor([2.0]), torch.tensor([3.0]))
    got = window.read(None, "train")
    want = {
        "train/rewards/chosen": 2 / 3,
        "train/rewards/rejected": 3.5 / 3,
        "train/rewards/margin": -1.5 / 3,
        "train/rewards/accuracy": 1 / 3,
    }
    assert got == pytest.approx(want)
    # read once: the next window starts afresh
    assert window.read(None, "train") == {}
    # validation adds the pairs' losses too: their mean over the pairs, not a mean of batch means
    window.add(torch.tensor([1.0, -1.0]), torch.tensor([0.0, 0.5]), torch.tensor([0.5, 1.0]))
    window.add(torch.tensor([2.0]), torch.tensor([3.0]), torch.tensor([3.0]))
    assert window.read(None, "train") == pytest.approx({"train/loss": 4.5 / 3, **want})


# ---- the chunked log-probs (never [N, T, vocab] fp32) against the unchunked path ------------------------
@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo", "orpo"])
def test_dpo_losses_and_gradients_chunked_equal_the_unchunked_path(loss, monkeypatch):
    """objective=dpo reads per-token log-probs the model computes chunk by chunk (7 rows: chunks that divide
    neither T = 20 nor the answers); the loss and every parameter's gradient (the head's and, through the
    hidden states, the rest) equal those of whole logits + F.cross_entropy to 1e-6 in fp32."""
    from types import SimpleNamespace

    from gptkit.training.objectives.dpo import DPO

    policy, reference = policy_and_reference()
    settings = {"beta": 0.5, "loss": loss, **({"label_smoothing": 0.1} if loss == "sigmoid" else {})}
    dpo = DPO(SimpleNamespace(cfg={"dpo": settings}), {"reference": reference})
    batch = answer_rows(4)  # 2 pairs
    chunked = loss_and_grads(lambda m: dpo.loss(m, batch)[0], policy, monkeypatch, 7)
    whole = loss_and_grads(lambda m: dpo.loss(m, batch)[0], policy, monkeypatch, None)
    assert_same(chunked, whole)
    # and the unchunked path is the objective as it was: summed log-probs from the model's whole logits
    x, y = batch
    with torch.no_grad():
        pi = answer_logps(policy(x).logits, y).view(-1, 2)
        ref = answer_logps(reference.module(x).logits, y).view(-1, 2)
    n = (y != -100).sum(-1).float().view(-1, 2)
    if loss == "simpo":
        want = simpo_loss(pi[:, 0], pi[:, 1], n[:, 0], n[:, 1], 0.5, 0.5)[0]
    elif loss == "orpo":
        want = orpo_loss(pi[:, 0], pi[:, 1], n[:, 0], n[:, 1], 0.1)[0]
    else:
        want = dpo_loss(*pi.T, *ref.T, 0.5, settings.get("label_smoothing", 0.0), loss, *n.T)[0]
    torch.testing.assert_close(whole[0], want.mean(), rtol=1e-6, atol=1e-6)


def test_kto_loss_and_gradients_chunked_equal_the_unchunked_path(monkeypatch):
    """objective=kto: its rows, mismatched rows (no grad) and reference read chunked log-probs; loss and
    gradients equal the unchunked path's to 1e-6 in fp32."""
    from types import SimpleNamespace

    from gptkit.training.objectives.kto import KTO

    policy, reference = policy_and_reference(seed=2)
    kto = KTO(
        SimpleNamespace(cfg={"kto": {"beta": 0.5, "undesirable_weight": 1.5}}), {"reference": reference}
    )
    x, y = answer_rows(4, seed=3)
    kl_x, kl_y = answer_rows(4, seed=4)
    batch = (x, y, kl_x, kl_y, torch.tensor([1, 0, 1, 0]))
    chunked = loss_and_grads(lambda m: kto.loss(m, batch)[0], policy, monkeypatch, 7)
    whole = loss_and_grads(lambda m: kto.loss(m, batch)[0], policy, monkeypatch, None)
    assert_same(chunked, whole)


@pytest.mark.parametrize(
    "dpo, message",
    [
        ({"beta": 0}, "dpo.beta=0 must be > 0"),
        ({"beta": -1}, "dpo.beta=-1 must be > 0"),
        ({"label_smoothing": 0.5}, "label_smoothing=0.5 must be in"),
        ({"loss": "kto"}, "dpo.loss='kto' is not one of sigmoid, hinge, ipo, simpo, orpo"),
        (
            {"loss": "hinge", "label_smoothing": 0.1},
            "dpo.label_smoothing applies to dpo.loss=sigmoid or simpo",
        ),
        ({"loss": "simpo", "gamma": -1}, "dpo.gamma=-1 must be >= 0"),
        ({"loss": "orpo", "lambda": 0}, "dpo.lambda=0 must be > 0"),
        ({"reference": "cached"}, "dpo.reference='cached' is not one of live, precomputed"),
        ({"loss": "simpo", "reference": "precomputed"}, "dpo.reference=precomputed: dpo.loss=simpo reads no"),
    ],
)
def test_bad_dpo_settings_are_one_line(dpo, message):
    with pytest.raises(GptkitError, match=message):
        check_dpo_config(dpo)


# ---- data -----------------------------------------------------------------------------------
PAIR = {"prompt": "upper ab", "chosen": "AB", "rejected": "AC"}
CHAT = {
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "upper ab"},
    ],
    "chosen": "AB",
    "rejected": "A",
}


def test_pairs_render_with_the_chat_template_and_the_loss_reads_the_last_answer_only(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [PAIR, CHAT])
    data = prepare(
        {"kind": "preference", "paths": [str(f)], "val_paths": [str(f)], "template": "chatml"},
        {"kind": "byte"},
        cache_dir=tmp_path / "c",
    )
    tok, template = data.tokenizer(), templates.resolve_template("chatml", None)
    rows = make_pair_rows(data.train, 64, "error", data.pad_id)
    assert rows.x.shape == (2, 2, 64) and len(rows) == 2
    for i, rec in enumerate([PAIR, CHAT]):
        msgs = rec.get("messages") or [{"role": "user", "content": rec["prompt"]}]
        for side in (0, 1):
            answer = rec[("chosen", "rejected")[side]]
            text, _ = template.render([*msgs, {"role": "assistant", "content": answer}])
            ids = tok.encode(text, add_special_tokens=False).ids
            assert (
                rows.x[i, side, : len(ids) - 1].tolist() == ids[:-1]
                # the whole conversation, then padding
            )
            targets = rows.y[i, side][rows.y[i, side] != -100].tolist()
            # not "hello"
            assert tok.decode(targets, skip_special_tokens=False) == answer + "<|im_end|>\n"
    x, y = rows.batch(torch.tensor([1, 0]))  # [4, 64]: pair 1 chosen, rejected, pair 0 chosen, rejected
    assert (
        torch.equal(x[0], rows.x[1, 0])
        and torch.equal(x[1], rows.x[1, 1])
        and torch.equal(y[3], rows.y[0, 1])
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {"prompt": "p", "rejected": "b"},
            "line 2: a preference record needs chosen and rejected answers .* no chosen",
        ),
        ({"prompt": "p", "chosen": "a"}, "line 2: .* it has no rejected"),
        ({"prompt": "p", "chosen": "a", "rejected": "  "}, "line 2: rejected is empty"),
        ({"prompt": "p", "chosen": ["a"], "rejected": "b"}, "line 2: chosen must be text"),
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, "line 2: chosen and rejected are the same text"),
        ({"chosen": "a", "rejected": "b"}, "line 2: a preference record needs a messages list or a prompt"),
        (
            {
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
                "chosen": "a",
                "rejected": "b",
            },
            "line 2: messages ends with an assistant turn",
        ),
        (
            {"messages": [{"role": "robot", "content": "q"}], "chosen": "a", "rejected": "b"},
            "line 2: message 1 has the unknown role 'robot'",
        ),
        ({"messages": [], "chosen": "a", "rejected": "b"}, "line 2: the conversation is empty"),
    ],
)
def test_bad_pairs_are_named_by_file_and_line_before_anything_is_written(tmp_path, bad, message):
    f = write_jsonl(tmp_path / "d.jsonl", [PAIR, bad])
    with pytest.raises(GptkitError, match=message):
        prepare(
            {"kind": "preference", "paths": [str(f)], "template": "chatml"},
            {"kind": "byte"},
            cache_dir=tmp_path / "c",
        )
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_a_pair_longer_than_a_row_is_named_or_dropped_or_cut_and_counted(tmp_path):
    long = {"prompt": "upper " + "a" * 10, "chosen": "A" * 60, "rejected": "B"}
    f = write_jsonl(tmp_path / "d.jsonl", [PAIR, long, PAIR])
    data = prepare(
        {"kind": "preference", "paths": [str(f)], "val_paths": [str(f)], "template": "chatml"},
        {"kind": "byte"},
        cache_dir=tmp_path / "c",
    )
    with pytest.raises(
        GptkitError,
        match=r"d\.jsonl line 2: the prompt with the chosen answer makes \d+ "
        r"tokens, more than a row of 65 .* data\.truncate=drop",
    ):
        make_pair_rows(data.train, 64, "error", data.pad_id)
    dropped = make_pair_rows(data.train, 64, "drop", data.pad_id)
    assert (len(dropped), dropped.dropped, dropped.first_dropped) == (2, 1, f"{f} line 2")
    cut = make_pair_rows(data.train, 64, "cut", data.pad_id)
    # both answers keep tokens
    assert (len(cut), cut.cut) == (3, 1) and (cut.y[1] != -100).any(dim=-1).all()


def test_bad_dpo_commands_exit_2_with_one_line_before_anything_is_written(tmp_path, capsys):
    f = write_jsonl(tmp_path / "d.jsonl", [PAIR] * 4)
    base = ["model=llama-tiny", "tokenizer=byte", f"runs_dir={tmp_path / 'runs'}", "name=bad"]
    pref = ["data=preference", f"data.paths=[{f}]", "data.template=chatml"]
    for args, message in [
        ([*pref, "objective=dpo"], "objective=dpo needs a starting checkpoint: init_from="),
        ([*pref, "objective=dpo", "init_from=nowhere", "dpo.beta=0"], "dpo.beta=0 must be > 0"),
        ([*pref], "data=preference holds preference pairs for DPO: add objective=dpo"),
        (
            ["data=chat", f"data.paths=[{f}]", "objective=dpo", "init_from=x"],
            "objective=dpo trains on preference",
        ),
        ([*pref, "objective=ppo"], "objective='ppo' is not one of lm, dpo"),
        # the recipe sets objective=dpo (experiment= composes after train.yaml's own keys)
        (["experiment=dpo-tiny", f"data.paths=[{f}]"], "objective=dpo needs a starting checkpoint"),
    ]:
        code, _, err = run_main(capsys, "train", *base, *args)
        assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: {message}"), (args, err)
        assert not (tmp_path / "runs" / "bad").exists()


# ---- training --------------------------------------------------------------------------------
def pairs(n):
    import random

    rng, out = random.Random(0), []
    for _ in range(n):
        w = "".join(rng.choice("abcdef") for _ in range(4))
        out.append({"prompt": f"upper {w}", "chosen": w.upper(), "rejected": w.upper()[:3] + w[3]})
    return out


@pytest.fixture(scope="module")
def dpo_data(tmp_path_factory):
    """An SFT start (2 steps of data=chat, chatml, byte) and 40 pairs."""
    root = tmp_path_factory.mktemp("dpo")
    rows = pairs(40)
    sft = write_jsonl(root / "sft.jsonl", [{"prompt": r["prompt"], "response": r["chosen"]} for r in rows])
    write_jsonl(root / "pairs.jsonl", rows)
    sft_start(root, sft, seq_len=48)
    return root


def dpo_args(root, name, world=1, *extra):
    """The same global batch (4 pairs) whatever the world size."""
    return [
        "objective=dpo",
        f"init_from={root / 'sft'}",
        "data=preference",
        f"data.paths=[{root / 'pairs.jsonl'}]",
        "dpo.beta=0.5",
        *from_sft(root, name, world, *extra),
    ]


@pytest.fixture(scope="module")
def straight(dpo_data):
    gptkit.train(dpo_args(dpo_data, "straight"))
    return dpo_data / "straight"


def test_dpo_trains_against_the_frozen_start_logs_rewards_and_resumes_bit_exactly(dpo_data, straight):
    rows = rows_of(straight)
    train = {s: r for s, r in rows.items() if r.get("train/loss")}
    # the row of step N: after N optimizer steps
    assert sorted(train) == list(range(1, 7))
    # step 0: the policy is the reference, every reward 0 and the loss log 2
    assert float(train[1]["train/loss"]) == pytest.approx(math.log(2), abs=1e-6)
    assert float(train[1]["train/rewards/margin"]) == 0.0
    assert float(train[6]["train/loss"]) < float(train[1]["train/loss"])
    # the policy moved towards the chosen answers
    assert float(train[6]["train/rewards/margin"]) > 0
    val = {s: r for s, r in rows.items() if r.get("val/rewards/accuracy")}
    assert sorted(val) == [3, 6] and all(r["val/loss"] and r["val/rewards/margin"] for r in val.values())
    # the reference stayed the start: the val margin of step 6, recomputed from the start's and the end's
    # weights on the same 3 val pairs, is the one logged
    from gptkit.runs import load_model

    *_, start = load_model(dpo_data / "sft")
    *_, end = load_model(straight)
    data = prepare(
        {"kind": "preference", "paths": [str(dpo_data / "pairs.jsonl")]},
        {"kind": "file", "path": str(straight / "tokenizer.json")},
    )
    val_rows = make_pair_rows(data.val, 48, "error", data.pad_id)
    x, y = val_rows.batch(torch.arange(3))
    with torch.no_grad():
        ratio = (answer_logps(end(x).logits, y) - answer_logps(start(x).logits, y)).view(3, 2)  # [pairs, 2]
    margin = float(0.5 * (ratio[:, 0] - ratio[:, 1]).mean())
    assert margin == pytest.approx(float(val[6]["val/rewards/margin"]), abs=1e-5) and margin > 0
    # resume: stopped at step 3 (a validation step), continued in a new invocation: the same floats
    gptkit.train(dpo_args(dpo_data, "split", 1, "trainer.stop_at_step=3"))
    gptkit.train([f"resume={dpo_data / 'split'}", f"runs_dir={dpo_data}", "name=split"])
    keys = ("train/loss", "train/rewards/chosen", "train/rewards/accuracy", "val/loss", "val/rewards/margin")
    again = rows_of(dpo_data / "split")
    assert [[r.get(k) for k in keys] for r in again.values()] == [
        [r.get(k) for k in keys] for r in rows.values()
    ]


def test_precomputed_outputs_of_another_model_tokenizer_rows_or_damaged_are_one_line_and_kept(tmp_path):
    """gptkit/data/frozen_outputs.py: outputs are read back only for the model, tokenizer and rows they were
    computed for, and whole; every refusal is one ConfigError naming the prepare to run, the files kept."""
    import numpy as np

    from gptkit.data import frozen_outputs as fo
    from gptkit.errors import ConfigError

    (tmp_path / "tokenizer.json").write_text("{}")
    x, y = np.arange(12).reshape(3, 4), np.arange(12).reshape(3, 4) + 1
    model = {"path": "/runs/sft/last.ckpt", "step": 2, "crc32": "0000abcd"}
    record = {
        "what": "answer_logps",
        "model": model,
        "tokenizer_sha256": fo.tokenizer_sha256(tmp_path),
        "seq_len": 4,
        "row_keys": {"truncate": "error"},
        "rows_crc32": {"train": fo.rows_crc32(x, y)},
    }
    logps = np.array([-1.5, -2.5, -3.5], dtype=np.float32)

    def check(model=model, seq_len=4, rows=(x, y), what="answer_logps"):
        return fo.check_outputs(
            tmp_path, "reference", what, model, seq_len, {"train": rows}, {"truncate": "error"}, "REDO"
        )

    with pytest.raises(ConfigError, match="holds no precomputed reference outputs; REDO"):
        check()
    npz = fo.write_outputs(tmp_path, "reference", record, {"train_logps": logps}).with_suffix(".npz")
    assert np.array_equal(check()["train_logps"], logps)
    for kwargs, message in [
        (
            dict(model={**model, "crc32": "ffff0000"}),
            r"was computed by /runs/sft/last.ckpt \(step 2, crc32 0000abcd\)",
        ),
        (dict(model={**model, "step": 3}), "not by this run's reference"),
        (dict(seq_len=8), "holds rows of seq_len 4"),
        (dict(rows=(x, y + 1)), "was computed over other rows than this run's"),
        (dict(what="topk"), "holds 'answer_logps', not 'topk'"),
    ]:
        with pytest.raises(ConfigError, match=message + ".*REDO"):
            check(**kwargs)
    (tmp_path / "tokenizer.json").write_text('{"other": 1}')
    with pytest.raises(ConfigError, match="computed with another tokenizer.json; REDO"):
        check()
    (tmp_path / "tokenizer.json").write_text("{}")
    npz.write_bytes(npz.read_bytes()[:-3] + b"xyz")
    with pytest.raises(ConfigError, match="does not match its record .CRC-32.: it is damaged; REDO"):
        check()
    assert npz.is_file() and npz.with_suffix(".json").is_file()


def test_a_precomputed_reference_gives_the_live_runs_losses_holds_no_reference_and_resumes(
    dpo_data, straight, capsys
):
    """dpo.reference=precomputed: refused in one line before `gptkit prepare ... reference=` wrote the
    log-probs; then the same losses and rewards as the live reference (straight) to 1e-6, no reference model
    built, a bit-exact resume; outputs of another model or row layout refused in one line, nothing lost."""
    sft, tok = dpo_data / "sft", dpo_data / "sft" / "tokenizer.json"
    # the tokenizer named (not init_from='s per-run copy), so that prepare and train find the same folder
    data = [f"data.paths=[{dpo_data / 'pairs.jsonl'}]", "tokenizer=file", f"tokenizer.path={tok}"]
    args = [*dpo_args(dpo_data, "pre", 1, "dpo.reference=precomputed"), *data[1:]]
    code, _, err = run_main(capsys, "train", *args)
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err and last.startswith("error: ")
    assert "holds no precomputed reference outputs; compute them with `gptkit prepare" in last
    assert not (dpo_data / "pre" / "config.yaml").exists()
    for bad, message in [
        (["rows=48"], "rows= is the row length of precomputed outputs; give reference=<run> or teacher="),
        (["rows=0", f"reference={sft}"], "reference= needs rows=<the training run's trainer.seq_len>"),
        (["rows=48", f"reference={sft}", f"teacher={sft}"], "give reference= or teacher=, not both"),
    ]:
        code, _, err = run_main(capsys, "prepare", "data=preference", *data, *bad)
        assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: {message}"), err
    code, out, err = run_main(
        capsys, "prepare", "data=preference", *data, "data.template=auto", "rows=48", f"reference={sft}"
    )
    assert code == 0, err
    record = out.split("precomputed reference log-probs of every row of 48: ")[1].split()[0]
    assert record.endswith("frozen/reference.json")
    code, _, err = run_main(capsys, "train", *args, "trainer.stop_at_step=3")
    assert code == 0, err
    assert "reference: precomputed log-probs in the data (no reference model held)" in err
    code, _, err = run_main(capsys, "train", f"resume={dpo_data / 'pre'}", f"runs_dir={dpo_data}", "name=pre")
    assert code == 0, err
    keys = ("train/loss", "train/rewards/chosen", "train/rewards/margin", "val/loss", "val/rewards/margin")
    want, got = rows_of(straight), rows_of(dpo_data / "pre")
    assert sorted(got) == sorted(want)
    for step in want:
        for key in keys:
            if want[step].get(key):
                assert abs(float(got[step][key]) - float(want[step][key])) < 1e-6, (step, key)
    # no reference was built: nothing of it in the checkpoint
    assert "gptkit_dpo_reference" not in torch.load(dpo_data / "pre" / "checkpoints" / "last.ckpt")
    # another model (frozen.reference= the end of a DPO run), another row layout: one line, nothing lost
    other = straight / "checkpoints" / "last.ckpt"
    for extra, message in [
        ([f"frozen.reference={straight}"], f"was computed by {sft / 'checkpoints' / 'last.ckpt'} (step "),
        (
            ["trainer.seq_len=40"],
            "holds rows of seq_len 48 ({'truncate': 'error'}), this run's are seq_len 40",
        ),
    ]:
        code, _, err = run_main(
            capsys, "train", *dpo_args(dpo_data, "pre-bad", 1, "dpo.reference=precomputed"), *data[1:], *extra
        )
        last = err.strip().splitlines()[-1]
        assert code == 2 and "Traceback" not in err and last.startswith("error: ") and message in last, err
        assert not (dpo_data / "pre-bad" / "config.yaml").exists()
    assert other.is_file() and Path(record).is_file()


def test_a_precomputed_teacher_of_the_whole_vocabulary_gives_the_live_teachers_losses(dpo_data, capsys):
    """distill.teacher=precomputed (the machinery of the precomputed reference above, on data=chat rows):
    with top_k = the vocabulary, D_k is the full forward KL, so 3 steps give the live teacher's losses
    to 1e-5 with no teacher built (the loss with k < the vocabulary: test_distill.py); a text corpus (windows
    that start anywhere) is refused in one line."""
    from gptkit.runs import read_config

    sft, tok = dpo_data / "sft", dpo_data / "sft" / "tokenizer.json"
    data = ["data=chat", f"data.paths=[{dpo_data / 'sft.jsonl'}]", "tokenizer=file", f"tokenizer.path={tok}"]
    run = [
        "objective=distill",
        f"init_from={sft}",
        f"frozen.teacher={sft}",
        "distill.alpha=0.5",
        *from_sft(dpo_data, "live-teacher", 1, "trainer.max_steps=3", "trainer.log_every=1"),
        *data,
    ]
    code, _, err = run_main(capsys, "train", *run)
    assert code == 0, err
    vocab = int(read_config(sft)["model"]["vocab_size"])
    code, out, err = run_main(
        capsys, "prepare", *data, "data.template=auto", "rows=48", f"teacher={sft}", f"top_k={vocab}"
    )
    assert code == 0, err
    pre = [a.replace("name=live-teacher", "name=top-k") for a in run]
    code, _, err = run_main(capsys, "train", *pre, "distill.teacher=precomputed")
    assert code == 0, err
    assert "its top-k precomputed in the data, renormalized (no teacher held" in err
    want, got = rows_of(dpo_data / "live-teacher"), rows_of(dpo_data / "top-k")
    for step in (1, 2, 3):
        for key in ("train/loss", "train/distill/divergence", "train/distill/ce"):
            assert abs(float(got[step][key]) - float(want[step][key])) < 1e-5, (step, key)
    assert "gptkit_frozen_teacher" not in torch.load(dpo_data / "top-k" / "checkpoints" / "last.ckpt")
    # stopped at step 2 and resumed (the top-k read again from the data): the straight figures and weights
    split = [a.replace("name=live-teacher", "name=top-k-split") for a in run]
    code, _, err = run_main(capsys, "train", *split, "distill.teacher=precomputed", "trainer.stop_at_step=2")
    assert code == 0, err
    code, _, err = run_main(capsys, "train", f"resume={dpo_data / 'top-k-split'}", "trainer.threads=1")
    assert code == 0, err
    again = rows_of(dpo_data / "top-k-split")
    for step in (1, 2, 3):
        for key in ("train/loss", "train/distill/divergence", "train/distill/ce"):
            assert again[step][key] == got[step][key], (step, key)
    weights = [
        torch.load(dpo_data / name / "checkpoints" / "last.ckpt")["state_dict"]
        for name in ("top-k", "top-k-split")
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    code, _, err = run_main(
        capsys,
        "train",
        *run[:-4],
        "data=files",
        f"data.paths=[{dpo_data / 'sft.jsonl'}]",
        "data.text_field=prompt",
        "distill.teacher=precomputed",
        "name=text-teacher",
    )
    assert code == 2 and "a precomputed teacher is kept for data=chat rows" in err, err


@pytest.mark.long
def test_a_precomputed_top_k_teacher_on_2_processes_equals_one_process(dpo_data, capsys):
    """distill.teacher=precomputed with k = 8 (below the vocabulary: D_k is not the full forward KL) on 2 CPU
    ranks of 2 rows, DDP and FSDP2 (fp32): each rank reads its own rows' top-k from the data, and the 3 steps
    log what one process of 4 rows logs, to 1e-5."""
    sft, tok = dpo_data / "sft", dpo_data / "sft" / "tokenizer.json"
    data = ["data=chat", f"data.paths=[{dpo_data / 'sft.jsonl'}]", "tokenizer=file", f"tokenizer.path={tok}"]
    code, _, err = run_main(
        capsys, "prepare", *data, "data.template=auto", "rows=48", f"teacher={sft}", "top_k=8"
    )
    assert code == 0, err

    def run(name, world, *extra):
        return [
            "-m",
            "gptkit",
            "train",
            "objective=distill",
            f"init_from={sft}",
            f"frozen.teacher={sft}",
            "distill.teacher=precomputed",
            "distill.alpha=0.5",
            *from_sft(dpo_data, name, world, "trainer.max_steps=3", "trainer.log_every=1", *extra),
            *data,
        ]

    r = run_group(*run("top8-one", 1))
    assert r.returncode == 0, r.stderr[-3000:]
    want = rows_of(dpo_data / "top8-one")
    keys = ("train/loss", "train/distill/divergence", "train/distill/ce")
    assert all(float(want[s]["train/distill/divergence"]) > 0 for s in (1, 2, 3))
    for name, extra in (
        ("top8-ddp", ["trainer=ddp"]),
        ("top8-fsdp", ["trainer=fsdp", "trainer.precision=32-true"]),
    ):
        r = run_group(*run(name, 2, *extra, "trainer.devices=2"))
        assert r.returncode == 0, r.stderr[-3000:]
        got = rows_of(dpo_data / name)
        for step in (1, 2, 3):
            for key in keys:
                assert abs(float(got[step][key]) - float(want[step][key])) < 1e-5, (name, step, key)


def test_dpo_on_a_hybrid_starts_at_log_2_and_logs_the_margin_its_weights_give(dpo_data):
    """DPO from a Gated DeltaNet + softmax hybrid: the loss of step 1 is log 2 (the policy is the frozen
    start), it falls, and the val margin logged at step 3 is the one recomputed from the start's and the end's
    weights (the paper's formula on the answers' summed log-probs, as for the other models)."""
    from gptkit.runs import load_model

    sft = sft_start(dpo_data, dpo_data / "sft.jsonl", seq_len=48, hybrid=True, name="sft-hybrid")
    args = dpo_args(dpo_data, "hybrid", 1, "trainer.max_steps=3", "trainer.val_every=3")
    gptkit.train([f"init_from={sft}" if a.startswith("init_from=") else a for a in args])
    rows = rows_of(dpo_data / "hybrid")
    assert float(rows[1]["train/loss"]) == pytest.approx(math.log(2), abs=1e-6)
    assert float(rows[3]["train/loss"]) < float(rows[1]["train/loss"])
    *_, start = load_model(sft)
    *_, end = load_model(dpo_data / "hybrid")
    assert start.cfg.linear_layers == [0]
    data = prepare(
        {"kind": "preference", "paths": [str(dpo_data / "pairs.jsonl")]},
        {"kind": "file", "path": str(sft / "tokenizer.json")},
    )
    x, y = make_pair_rows(data.val, 48, "error", data.pad_id).batch(torch.arange(3))
    with torch.no_grad():
        ratio = (answer_logps(end(x).logits, y) - answer_logps(start(x).logits, y)).view(3, 2)  # [pairs, 2]
    margin = float(0.5 * (ratio[:, 0] - ratio[:, 1]).mean())
    assert margin == pytest.approx(float(rows[3]["val/rewards/margin"]), abs=1e-5) and margin != 0


@pytest.mark.long
def test_dpo_on_2_processes_follows_one_process_fsdp_then_ddp(dpo_data, straight):
    def run(*args):
        r = run_group("-m", "gptkit", "train", *args)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    # FSDP2: rank 1 builds policy and reference on the meta device; both get rank 0's weights
    r = run(
        *dpo_args(
            dpo_data,
            "two",
            2,
            "trainer=fsdp",
            "trainer.devices=2",
            "trainer.precision=32-true",
            "trainer.stop_at_step=3",
        )
    )
    assert "the other 1 rank(s) start on the meta device" in r.stderr, r.stderr[-2000:]
    # DDP continues it: each rank reads the reference again from init_from=
    run(
        f"resume={dpo_data / 'two'}",
        f"runs_dir={dpo_data}",
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.batch_size=2",
    )
    want, got = rows_of(straight), rows_of(dpo_data / "two")
    for step in range(1, 7):
        for key in ("train/loss", "train/rewards/margin", "train/rewards/accuracy"):
            assert abs(float(got[step][key]) - float(want[step][key])) < 1e-5, (step, key)
    # validation over 3 pairs: 2 ranks of 2 with one repeat, each pair counted once, as one process
    # step 3 validated by FSDP2, step 6 by DDP; to 1e-5 relative (fp32 rounding: a reward of 1.82 came 1.1e-5
    # apart once the log-probs moved to fused.linear_log_probs)
    for step in (3, 6):
        for key in ("val/loss", "val/rewards/margin", "val/rewards/accuracy", "val/rewards/chosen"):
            w = float(want[step][key])
            assert abs(float(got[step][key]) - w) < 1e-5 * max(1.0, abs(w)), (step, key, got[step][key], w)


def test_dpo_with_lora_and_accumulation_measures_against_the_base_with_its_adapters_off(dpo_data, capfd):
    # 2 pairs per micro-batch, 2 micro-batches per step: the rewards add up over both
    gptkit.train(
        dpo_args(
            dpo_data,
            "lora",
            2,
            "trainer.accumulate_grad_batches=2",
            "finetune=lora",
            "lora.rank=4",
            "lora.targets=[q,k,v,o]",
        )
    )
    assert "reference: the base with the adapters off (no second copy)" in capfd.readouterr().err
    rows = rows_of(dpo_data / "lora")
    # B = 0: policy = base
    assert float(rows[1]["train/loss"]) == pytest.approx(math.log(2), abs=1e-6)
    assert float(rows[6]["train/rewards/margin"]) > 0
    from gptkit.runs import load_model

    *_, start = load_model(dpo_data / "sft")
    # the adapters merged into the base
    *_, end = load_model(dpo_data / "lora")
    data = prepare(
        {"kind": "preference", "paths": [str(dpo_data / "pairs.jsonl")]},
        {"kind": "file", "path": str(dpo_data / "lora" / "tokenizer.json")},
    )
    x, y = make_pair_rows(data.val, 48, "error", data.pad_id).batch(torch.arange(3))
    with torch.no_grad():
        ratio = (answer_logps(end(x).logits, y) - answer_logps(start(x).logits, y)).view(3, 2)
    margin = float(0.5 * (ratio[:, 0] - ratio[:, 1]).mean())
    assert margin == pytest.approx(float(rows[6]["val/rewards/margin"]), abs=1e-5) and margin > 0


@pytest.mark.long
def test_orpo_without_a_reference_on_2_processes_follows_one_process_fsdp_then_ddp(dpo_data):
    """A reference-free loss builds no frozen model (FSDP2's meta ranks have none to receive): one process
    stopped at step 2 and resumed logs the straight run's floats, and 2 steps under FSDP2, resumed under
    DDP, log one process's floats. ipo and hinge share sigmoid's data flow (a reference,
    a per-pair loss: test_dpo_on_2_processes_follows_one_process_fsdp_then_ddp); simpo's is orpo's."""
    loss = ("dpo.loss=orpo", "dpo.lambda=0.5", "trainer.max_steps=3", "trainer.val_every=3")
    gptkit.train(dpo_args(dpo_data, "orpo-one", 1, *loss))
    # one process stopped at step 2 and resumed (no reference to read again): the same floats
    gptkit.train(dpo_args(dpo_data, "orpo-split", 1, *loss, "trainer.stop_at_step=2"))
    gptkit.train([f"resume={dpo_data / 'orpo-split'}", f"runs_dir={dpo_data}", "name=orpo-split"])
    split, one = rows_of(dpo_data / "orpo-split"), rows_of(dpo_data / "orpo-one")
    keys = ("train/loss", "train/rewards/margin", "train/rewards/accuracy")
    assert [[split[s][k] for k in keys] for s in (1, 2, 3)] == [[one[s][k] for k in keys] for s in (1, 2, 3)]
    assert split[3]["val/loss"] == one[3]["val/loss"]
    r = run_group(
        "-m",
        "gptkit",
        "train",
        *dpo_args(dpo_data, "orpo-two", 2, *loss, "trainer=fsdp", "trainer.devices=2")
        + ["trainer.precision=32-true", "trainer.stop_at_step=2"],
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_group(
        "-m",
        "gptkit",
        "train",
        f"resume={dpo_data / 'orpo-two'}",
        f"runs_dir={dpo_data}",
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.batch_size=2",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = rows_of(dpo_data / "orpo-one"), rows_of(dpo_data / "orpo-two")
    for step in (1, 2, 3):
        for key in ("train/loss", "train/rewards/margin", "train/rewards/accuracy"):
            assert abs(float(got[step][key]) - float(want[step][key])) < 1e-5, (step, key)
    for key in ("val/loss", "val/rewards/margin"):
        w = float(want[3][key])
        assert abs(float(got[3][key]) - w) < 1e-5 * max(1.0, abs(w)), key


@pytest.mark.parametrize("objective, finetune", [("dpo", "qlora"), ("kto", "qlora"), ("kto", "lora")])
def test_qlora_measures_against_its_nf4_base_with_the_adapters_off(dpo_data, objective, finetune):
    """finetune=qlora (and lora for KTO; DPO's: test_dpo_with_lora_...): the reference is the base (NF4 for
    qlora) with the adapters off, which the policy equals at step 1: DPO's first loss is log 2 and KTO's
    1 - sigmoid(0), every reward 0; then the loss moves."""
    nf4 = ("qlora.block_size=32", "qlora.scaler_block_size=8") if finetune == "qlora" else ()
    q = (f"finetune={finetune}", *nf4, "lora.rank=4")
    args, name = dpo_args if objective == "dpo" else kto_args, f"{finetune}-{objective}"
    gptkit.train(args(dpo_data, name, 1, *q, "trainer.max_steps=2", "trainer.val_every=2"))
    rows = rows_of(dpo_data / name)
    assert float(rows[1]["train/loss"]) == pytest.approx(math.log(2) if objective == "dpo" else 0.5, abs=1e-6)
    reward = "train/rewards/chosen" if objective == "dpo" else "train/rewards/desirable"
    assert float(rows[1][reward]) == 0.0 and float(rows[2]["train/loss"]) != float(rows[1]["train/loss"])
    ckpt = torch.load(dpo_data / name / "checkpoints" / "last.ckpt", weights_only=True)
    assert ("quantized" in ckpt["gptkit_lora"]) == (finetune == "qlora")
    assert all("lora_" in k for k in ckpt["state_dict"])


def test_the_reference_takes_the_policys_dtype_so_rewards_start_at_0_in_bf16(dpo_data):
    gptkit.train(
        dpo_args(
            dpo_data, "bf16", 1, "trainer.precision=bf16-true", "trainer.max_steps=1", "trainer.val_every=1"
        )
    )
    # the first step's row
    step0 = rows_of(dpo_data / "bf16")[1]
    assert float(step0["train/rewards/chosen"]) == 0.0 == float(step0["train/rewards/rejected"])


@pytest.mark.parametrize("loss", ["ipo", "simpo", "orpo"])
def test_ipo_simpo_and_orpo_train_end_to_end_and_simpo_and_orpo_hold_no_reference(dpo_data, loss, capfd):
    extra = {"ipo": [], "simpo": ["dpo.beta=2.0", "dpo.gamma=0.5"], "orpo": ["dpo.lambda=0.5"]}[loss]
    gptkit.train(dpo_args(dpo_data, f"loss-{loss}", 1, f"dpo.loss={loss}", *extra, "trainer.max_steps=3"))
    err = capfd.readouterr().err
    rows = rows_of(dpo_data / f"loss-{loss}")
    train = [float(rows[s]["train/loss"]) for s in (1, 2, 3)]
    assert train[2] < train[0] and float(rows[3]["val/loss"]) > 0, train
    assert float(rows[3]["train/rewards/margin"]) > float(rows[1]["train/rewards/margin"])
    if loss == "ipo":
        # step 0: the policy is the reference, every log-ratio 0: the loss (1 / (2 beta))^2 = 1 at beta 0.5
        assert train[0] == pytest.approx(1.0, abs=1e-6) and "reference: a frozen copy" in err
    else:
        assert "; no reference" in err and "reference:" not in err, err


def test_a_bad_pair_stops_train_in_one_line_naming_file_and_line_and_leaves_no_run(dpo_data, capsys):
    f = write_jsonl(dpo_data / "bad.jsonl", [PAIR, PAIR, {"prompt": "upper ab", "chosen": "AB"}])
    code, _, err = run_main(capsys, "train", *dpo_args(dpo_data, "bad-pairs", 1, f"data.paths=[{f}]"))
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"error: {f} line 3: a preference record needs chosen and rejected answers (data.chosen_field, "
        "data.rejected_field); it has no rejected (fields: prompt, chosen)"
    )
    # removed when the process exits (runs.claim_run_dir); empty of results now
    run = dpo_data / "bad-pairs"
    assert not (run / "config.yaml").exists() and not (run / "checkpoints").exists()


def write_reference(dpo_data, name, tokenizer=None, **shape):
    """A run folder of a random llama-like model of `shape` with the SFT run's vocabulary (and its tokenizer,
    or `tokenizer`)."""
    from tokenizers import Tokenizer

    from gptkit.model import GPT, ModelConfig
    from gptkit.runs import read_config, write_run_folder

    tok = tokenizer or Tokenizer.from_file(str(dpo_data / "sft" / "tokenizer.json"))
    sft = read_config(dpo_data / "sft")["model"]
    vocab = sft["vocab_size"] if tokenizer is None else tok.get_vocab_size()
    torch.manual_seed(3)
    cfg = ModelConfig.from_dict({**sft, "vocab_size": vocab, "init_std": 0.1, **shape})
    return write_run_folder(dpo_data / name, {}, GPT(cfg).eval(), tok)


def test_dpo_measures_against_a_reference_of_another_size_from_frozen_reference(dpo_data, capfd):
    big = write_reference(dpo_data, "big-reference", n_layers=2, d_model=48, n_heads=4, n_kv_heads=2, d_ff=96)
    args = dpo_args(dpo_data, "big-ref", 1, f"frozen.reference={big}", "trainer.max_steps=2")
    gptkit.train([*args, "trainer.val_every=1", "trainer.stop_at_step=1"])
    ckpt = big / "checkpoints" / "last.ckpt"
    assert f"reference: frozen {ckpt} (2 layers, d_model 48)" in capfd.readouterr().err
    # the policy is the SFT start, the reference another model: the first rewards are not 0 (they are with
    # the default reference, test_dpo_trains_against_the_frozen_start_logs_rewards_and_resumes_bit_exactly)
    step1 = rows_of(dpo_data / "big-ref")[1]
    assert float(step1["train/rewards/chosen"]) != 0.0 and float(step1["train/rewards/rejected"]) != 0.0
    last = dpo_data / "big-ref" / "checkpoints" / "last.ckpt"
    assert torch.load(last)["gptkit_dpo_reference"] == {"path": str(ckpt), "step": 0}
    # a resume reads the reference again from the source config.yaml records; one that trained on since is
    # refused in one line
    saved = torch.load(ckpt)
    torch.save({**saved, "global_step": 5}, ckpt)
    resume = [f"resume={dpo_data / 'big-ref'}", f"runs_dir={dpo_data}", "name=big-ref"]
    with pytest.raises(
        GptkitError, match=f"the reference {ckpt} holds step 5, but this run started from step 0"
    ):
        gptkit.train(resume)
    torch.save(saved, ckpt)
    gptkit.train(resume)
    assert sorted(s for s, r in rows_of(dpo_data / "big-ref").items() if r.get("train/loss")) == [1, 2]


def test_a_bad_frozen_reference_exits_2_with_one_line_before_anything_is_written(dpo_data, capsys):
    from conftest import char_tokenizer

    other = write_reference(dpo_data, "other-vocab", tokenizer=char_tokenizer())
    gone = dpo_data / "gone"
    (dpo_data / "no-ckpt").mkdir(exist_ok=True)
    for extra, message in [
        ([f"frozen.reference={gone}"], f"frozen.reference={gone}: {gone} does not exist; pass a run folder"),
        (
            [f"frozen.reference={dpo_data / 'no-ckpt'}"],
            f"frozen.reference={dpo_data / 'no-ckpt'}: no checkpoint in {dpo_data / 'no-ckpt'}",
        ),
        (
            ["frozen.reference=s3://bucket/ref"],
            "frozen.reference=s3://bucket/ref: URLs (s3://) are not supported yet; give a local path",
        ),
        (
            ["frozen.reference=hf://org/ref"],
            "frozen.reference=hf://org/ref: write frozen.reference=hf:<owner/name or a transformers folder>",
        ),
        (
            [
                "objective=lm",
                "data=files",
                f"data.paths=[{dpo_data / 'pairs.jsonl'}]",
                f"frozen.reference={other}",
            ],
            f"frozen.reference={other}: objective=lm does not read it with these settings (it reads no "
            "frozen model); drop it",
        ),
        (
            ["dpo.loss=simpo", f"frozen.reference={other}"],
            f"frozen.reference={other}: objective=dpo does not read it with these settings (it reads no "
            "frozen model); drop it",
        ),
        (
            [f"frozen.reference={other}"],
            f"frozen.reference={other} has another vocabulary than the policy (init_from="
            f"{dpo_data / 'sft' / 'checkpoints' / 'last.ckpt'}): ",
        ),
    ]:
        code, _, err = run_main(capsys, "train", *dpo_args(dpo_data, "bad-ref", 1, *extra))
        assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: {message}"), (extra, err)
        assert len(err.strip().splitlines()) <= 3, err
        assert not (dpo_data / "bad-ref" / "config.yaml").exists()


def test_the_plan_counts_both_answers_and_the_reference_forward():
    from omegaconf import OmegaConf

    from gptkit import accounting as acc
    from gptkit.conf_tree import compose
    from gptkit.model import ModelConfig
    from gptkit.training.plan import make_plan

    cfg = compose("train", ["model=llama-tiny", "trainer.batch_size=3", "trainer.accelerator=cpu"])
    model = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    lm = make_plan(cfg, None, model)
    cfg.objective = "dpo"
    dpo = make_plan(cfg, None, model)
    # 3 pairs: 6 sequences
    assert dpo.tokens_per_step == 2 * lm.tokens_per_step
    forward = acc.flops_per_token(model, lm.seq_len)
    assert dpo.flops_per_token == pytest.approx(lm.flops_per_token + forward.forward_dense)
    assert dpo.causal_flops_per_token == pytest.approx(lm.causal_flops_per_token + forward.forward_causal)


def test_the_memory_estimate_counts_both_sequences_of_a_pair_and_the_reference():
    """objective=dpo: a batch of pairs is twice the sequences, their log-probs chunked; with finetune=full the
    frozen reference is a second copy of the weights, with lora it is the policy with its adapters off (no
    copy)."""
    import dataclasses
    from types import SimpleNamespace

    from gptkit.model import ModelConfig
    from gptkit.training.memory import chunked_logits_bytes, cpu_out_of_memory, estimate

    cfg = ModelConfig(vocab_size=64, max_seq_len=16, n_layers=2, n_heads=4, d_model=32)
    plan = estimate_plan(cfg, objective="lm")
    lm = estimate(plan)
    dpo = estimate(SimpleNamespace(**{**vars(plan), "objective": "dpo"}))
    assert dpo["reference"] == lm["weights"] and dpo["activations"] > lm["activations"]
    # 2 pairs = 4 sequences; their log-probs chunked (one chunk here), never 3 whole fp32 logits tensors
    assert dpo["logits"] == chunked_logits_bytes(4 * 16, cfg) == 2 * (4 * 16) * 64 * 4 + 4 * (4 * 16) * 4
    # at 2 pairs x 4,096 tokens and a 150k vocabulary: two chunks of ~2^26 logits, not 3 x 9.8 GB
    big = dataclasses.replace(cfg, vocab_size=150_000, max_seq_len=4096)
    plan_big = SimpleNamespace(**{**vars(estimate_plan(big, objective="dpo")), "seq_len": 4096})
    assert 500e6 < estimate(plan_big)["logits"] < 2 * (1 << 28) + 2**20
    assert (
        estimate(SimpleNamespace(**{**vars(plan_big), "objective": "lm"}))["logits"]
        == 3 * 2 * 4096 * 150_000 * 4
    )
    assert dpo["total"] == pytest.approx(sum(v for k, v in dpo.items() if k != "total"))
    lora = {"rank": 2, "alpha": 4, "dropout": 0.0, "targets": ["q", "v"]}
    dpo_lora = estimate(SimpleNamespace(**{**vars(plan), "objective": "dpo", "lora": lora}))
    assert "reference" not in dpo_lora and dpo_lora["logits"] == dpo["logits"]
    full = SimpleNamespace(**{**vars(plan), "objective": "dpo"})
    assert "the DPO reference" in str(cpu_out_of_memory(full))


# ---- KTO (objective=kto, data=unpaired) -------------------------------------------------------------------
def test_kto_loss_is_the_papers_formula_with_the_mismatched_rows_reference_point():
    """Ethayarajh et al. eq. 7-8 (TRL's loss_type="kto"), in float64 from math alone: z0 = max(0, mean of the
    mismatched rows' log-ratios), desirable w_d (1 - sigmoid(beta (r - z0))), undesirable w_u (1 -
    sigmoid(beta (z0 - r)))."""
    from gptkit.training.objectives.kto import kto_loss, reference_point

    pi, ref = [-12.5, -3.25, -40.0, -7.0], [-13.0, -3.0, -40.2, -7.0]
    good = [True, False, True, False]
    kl_pi, kl_ref = [-20.0, -9.0, -33.0, -14.0], [-20.5, -8.0, -34.0, -13.9]
    z = max(0.0, sum(a - b for a, b in zip(kl_pi, kl_ref)) / 4)
    z0 = reference_point(torch.tensor(kl_pi), torch.tensor(kl_ref))
    assert float(z0) == pytest.approx(z, abs=1e-6) and z > 0
    # a negative mean is clamped to 0
    assert float(reference_point(torch.tensor(kl_ref), torch.tensor(kl_pi))) == 0.0
    for beta, wd, wu in ((0.1, 1.0, 1.0), (0.5, 1.0, 1.33)):
        losses, rewards = kto_loss(torch.tensor(pi), torch.tensor(ref), torch.tensor(good), z0, beta, wd, wu)
        want = []
        for a, b, g in zip(pi, ref, good):
            r = a - b
            want.append(
                wd * (1 - 1 / (1 + math.exp(-beta * (r - z))))
                if g
                else wu * (1 - 1 / (1 + math.exp(-beta * (z - r))))
            )
        assert losses.double().tolist() == pytest.approx(want, abs=1e-6)
        assert rewards.tolist() == pytest.approx([beta * (a - b) for a, b in zip(pi, ref)], abs=1e-5)


def kto_rows(n):
    """Each of n pairs as two labelled completions: chosen desirable, rejected undesirable."""
    return [
        {"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
        for p in pairs(n)
        for side in ("chosen", "rejected")
    ]


def test_kto_trains_against_the_frozen_start_from_unpaired_rows(dpo_data, capfd):
    f = write_jsonl(dpo_data / "kto.jsonl", kto_rows(20))
    args = [
        "objective=kto",
        f"init_from={dpo_data / 'sft'}",
        "data=unpaired",
        f"data.paths=[{f}]",
        "kto.beta=0.5",
        *from_sft(dpo_data, "kto", 1, "trainer.max_steps=3"),
    ]
    gptkit.train(args)
    err = capfd.readouterr().err
    assert "KTO: beta 0.5" in err and "reference: a frozen copy of the starting weights" in err, err
    assert "unpaired data: 36 train completions (18 desirable, 18 undesirable" in err, err
    rows = rows_of(dpo_data / "kto")
    # step 0: the policy is the reference: every log-ratio and z0 0, each loss 1 - sigmoid(0)
    assert float(rows[1]["train/loss"]) == pytest.approx(0.5, abs=1e-6)
    assert float(rows[1]["train/kl"]) == 0.0 and float(rows[1]["train/rewards/desirable"]) == 0.0
    # after 3 steps the held-out desirable completions gained on the undesirable ones, the loss below 0.5
    val = rows[3]
    assert float(val["val/rewards/desirable"]) > float(val["val/rewards/undesirable"]), val
    assert 0 < float(val["val/loss"]) < 0.5 and val["val/kl"] != "" and float(rows[2]["train/kl"]) > 0


def kto_args(root, name, world=1, *extra):
    """KTO from root/sft on 20 pairs' 40 labelled completions: the same global batch (4) on any world."""
    f = root / "kto.jsonl"
    if not f.exists():
        write_jsonl(f, kto_rows(20))
    return [
        "objective=kto",
        f"init_from={root / 'sft'}",
        "data=unpaired",
        f"data.paths=[{f}]",
        "kto.beta=0.5",
        *from_sft(root, name, world, "trainer.max_steps=3", *extra),
    ]


def test_kto_mismatched_rows_are_the_same_whatever_the_world_size():
    """Row k's mismatched completion is the previous row's of the micro-step's rows over all the ranks (the
    last one's for the first), so 2 ranks' batches joined are one process's batch of the same rows."""
    import numpy as np

    from gptkit.data.unpaired import TOO_FEW, UnpairedRows, UnpairedSampler

    n = 10
    prompts = [np.array([1, 2 + i]) for i in range(n)]
    answers = [np.array([50 + i, 60 + i]) for i in range(n)]
    rows = UnpairedRows(prompts, answers, [np.ones(2, bool)] * n, [i % 2 == 0 for i in range(n)], 5, 0)
    one = UnpairedSampler(rows, 4, 0, TOO_FEW)
    two = UnpairedSampler(rows, 2, 0, TOO_FEW)
    for step in range(3):
        want = one.batch(step)
        joined = [torch.cat(t) for t in zip(*(two.batch(step, rank, 2) for rank in range(2)))]
        assert all(torch.equal(a, b) for a, b in zip(want, joined)), step
        # kl row k: row k's prompt, row k-1's completion (cyclic)
        picked = one.picked(step)
        for k in range(4):
            mate = int(picked[k - 1])
            assert want[2][k, 2:4].tolist() == [50 + mate, 60 + mate]
            assert want[2][k, :2].tolist() == [1, 2 + int(picked[k])]


@pytest.mark.long
def test_kto_on_2_processes_follows_one_process_fsdp_then_ddp(dpo_data):
    """Each row's mismatched completion is the previous row's over the global micro-batch, so the KL
    reference point, and the losses, do not depend on how the rows are split over the ranks."""
    gptkit.train(kto_args(dpo_data, "kto-one"))
    # one process stopped at step 2 and resumed: the same floats (the stop validates at step 2 too)
    gptkit.train(kto_args(dpo_data, "kto-split", 1, "trainer.stop_at_step=2"))
    gptkit.train([f"resume={dpo_data / 'kto-split'}", f"runs_dir={dpo_data}", "name=kto-split"])
    keys = ("train/loss", "train/kl", "train/rewards/desirable", "train/rewards/undesirable")
    split, one = rows_of(dpo_data / "kto-split"), rows_of(dpo_data / "kto-one")
    assert [[split[s][k] for k in keys] for s in (1, 2, 3)] == [[one[s][k] for k in keys] for s in (1, 2, 3)]
    assert split[3]["val/loss"] == one[3]["val/loss"]
    # 2 steps under FSDP2 (fp32), stopped, resumed under DDP: resume, FSDP2 and DDP at once
    two = ("trainer=fsdp", "trainer.precision=32-true", "trainer.devices=2", "trainer.stop_at_step=2")
    r = run_group("-m", "gptkit", "train", *kto_args(dpo_data, "kto-two", 2, *two))
    assert r.returncode == 0, r.stderr[-3000:]
    resume = (f"resume={dpo_data / 'kto-two'}", f"runs_dir={dpo_data}", "trainer=ddp", "trainer.batch_size=2")
    r = run_group("-m", "gptkit", "train", *resume, "trainer.devices=2")
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = rows_of(dpo_data / "kto-one"), rows_of(dpo_data / "kto-two")
    assert float(want[2]["train/kl"]) > 0
    for step in range(1, 4):
        for key in ("train/loss", "train/kl", "train/rewards/desirable", "train/rewards/undesirable"):
            assert abs(float(got[step][key]) - float(want[step][key])) < 1e-5, (step, key)


def test_kto_rows_without_a_label_are_one_line_naming_file_and_line(dpo_data, capsys):
    good = {"prompt": "upper ab", "completion": "AB", "label": True}
    for bad, message in [
        (
            {"prompt": "upper ab", "completion": "AB"},
            "a KTO record needs a label (data.label_field): true for a",
        ),
        (
            {"prompt": "upper ab", "completion": "AB", "label": "yes"},
            "label must be true or false, got 'yes'",
        ),
        ({"prompt": "upper ab", "label": False}, "a KTO record needs a completion (data.completion_field)"),
    ]:
        f = write_jsonl(dpo_data / "kto-bad.jsonl", [good, good, bad])
        args = [
            "objective=kto",
            f"init_from={dpo_data / 'sft'}",
            "data=unpaired",
            f"data.paths=[{f}]",
            *from_sft(dpo_data, "kto-bad", 1),
        ]
        code, _, err = run_main(capsys, "train", *args)
        assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: {f} line 3: {message}"), err
        assert not (dpo_data / "kto-bad" / "config.yaml").exists()
    # the kind belongs to KTO, and KTO to the kind
    f = write_jsonl(dpo_data / "kto-ok.jsonl", [good] * 4)
    base = ["model=llama-tiny", "tokenizer=byte", f"runs_dir={dpo_data}", "name=kto-bad"]
    for extra, message in [
        (["data=unpaired", f"data.paths=[{f}]"], "data=unpaired holds labelled completions for KTO"),
        (["objective=kto", "init_from=x", "data=preference", f"data.paths=[{f}]"], "objective=kto trains on"),
        (["objective=kto", "data=unpaired", f"data.paths=[{f}]", "init_from=x", "kto.beta=0"], "kto.beta=0"),
    ]:
        code, _, err = run_main(capsys, "train", *base, *extra)
        assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: {message}"), (extra, err)
