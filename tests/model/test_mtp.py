"""Multi-token prediction (model.mtp, gptkit/model/mtp.py; its objective gptkit/training/objectives/mtp.py):
off is bit-identical, each depth predicts the right token from the right inputs (a reference that truncates
instead of rolling), packed documents mask the targets that cross a boundary, sampling ignores the modules,
the counts and FLOPs hold them, and a model=mtp-tiny run trains and logs each depth's loss."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_LLAMA, one_line_error, run_cli
from torch.utils.flop_counter import FlopCounterMode

from gptkit import accounting as acc
from gptkit.errors import ConfigError
from gptkit.model import GPT, ModelConfig
from gptkit.model.mtp import mtp_targets

V = 48


def tiny(depth: int | None = 1, moe: dict | None = None, **fields) -> ModelConfig:
    mtp = None if depth is None else {"depth": depth, "loss_scale": 0.3}
    return ModelConfig(
        **TINY_LLAMA, vocab_size=V, max_seq_len=32, tie_embeddings=False, mtp=mtp, moe=moe, **fields
    )


def test_depth_zero_is_no_module_and_bit_identical():
    torch.manual_seed(0)
    a = GPT(tiny(None))
    torch.manual_seed(0)
    b = GPT(tiny(0))
    assert b.cfg.mtp is None and b.mtp is None
    assert a.state_dict().keys() == b.state_dict().keys()
    x = torch.randint(0, V, (2, 9))
    out_a, out_b = a(x, x), b(x, x, mtp=True)
    assert torch.equal(out_a.logits, out_b.logits) and torch.equal(out_a.loss, out_b.loss)
    assert out_b.mtp_losses is None


def reference(model: GPT, s: torch.Tensor) -> list[torch.Tensor]:
    """Each depth's loss written out from the token stream s [B, T + 1], truncating where the module rolls:
    depth k at position i reads h_{k-1}[i] and Emb(s[i + k]) and predicts s[i + k + 1]."""
    T = s.shape[1] - 1
    with torch.no_grad():
        x = model.tok_emb(s[:, :T])
        for block in model.blocks:
            x = block(x, rope=model.rope)[0]
        h = model.final_norm(x)  # [B, T, d]
        losses = []
        for k, layer in enumerate(model.mtp.layers, start=1):
            n = T - k
            e = model.tok_emb(s[:, k : k + n])
            z = layer.proj(torch.cat([layer.e_norm(e), layer.h_norm(h[:, :n])], -1))
            h = layer.out_norm(layer.block(z, rope=model.rope)[0])
            logits = model.lm_head(h)
            losses.append(F.cross_entropy(logits.reshape(-1, V), s[:, k + 1 : k + 1 + n].reshape(-1)))
    return losses


@pytest.mark.parametrize("moe", [None, {"n_experts": 4, "top_k": 2, "d_expert": 24}], ids=["dense", "moe"])
def test_each_depth_predicts_the_token_after_its_input(moe):
    torch.manual_seed(0)
    model = GPT(tiny(2, moe)).eval()
    s = torch.randint(0, V, (2, 13))
    with torch.no_grad():
        out = model(s[:, :-1], s[:, 1:], mtp=True)
    assert len(out.mtp_losses) == 2
    for got, want in zip(out.mtp_losses, reference(model, s)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the main loss is the plain next-token loss
    assert torch.equal(out.loss, model(s[:, :-1], s[:, 1:]).loss)


def test_mtp_targets_cross_no_document_boundary():
    y = torch.arange(10, 16).view(1, 6)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    # depth 1: position i's target is y[i + 1]; token i + 1 of another document (i = 2) or none (i = 5): -100
    assert mtp_targets(y, 1, None).tolist() == [[11, 12, 13, 14, 15, -100]]
    assert mtp_targets(y, 1, docs).tolist() == [[11, 12, -100, 14, 15, -100]]
    assert mtp_targets(y, 2, docs).tolist() == [[12, -100, -100, 15, -100, -100]]
    assert mtp_targets(y, 6, docs).tolist() == [[-100] * 6]


def test_packed_documents_keep_the_mtp_loss_inside_each_document():
    """With doc_ids, a depth's loss of a window of two documents is the token mean of each document's own
    loss: changing the second document leaves the first's positions alone, and no target crosses."""
    torch.manual_seed(0)
    model = GPT(tiny(1)).eval()
    s = torch.randint(0, V, (1, 13))
    docs = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        whole = model(s[:, :-1], s[:, 1:], doc_ids=docs, mtp=True).mtp_losses[0]
        # document 0 alone (5 tokens: 4 depth-1 targets, its last token's next one counted as the main
        # loss counts it), document 1 alone (7 tokens: 6 targets)
        first = model(s[:, :5], s[:, 1:6], mtp=True).mtp_losses[0]
        second = model(s[:, 5:12], s[:, 6:13], mtp=True).mtp_losses[0]
    torch.testing.assert_close(whole, (4 * first + 6 * second) / 10, atol=1e-5, rtol=1e-5)


def test_sampling_ignores_the_mtp_modules():
    torch.manual_seed(0)
    with_mtp = GPT(tiny(2)).eval()
    plain = GPT(tiny(None)).eval()
    plain.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    x = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        assert torch.equal(with_mtp(x).logits, plain(x).logits)
        # targets without mtp=True: the main loss alone, no MTP work
        assert with_mtp(x, x).mtp_losses is None


@pytest.mark.parametrize("moe", [None, {"n_experts": 4, "top_k": 2, "d_expert": 24, "impl": "loop"}])
def test_counts_and_training_flops_hold_the_mtp_modules(moe):
    cfg = ModelConfig.from_dict({**tiny(2, moe).to_dict(), "attention": "eager"})
    model = GPT(cfg)
    pc = acc.count_params(cfg)
    assert pc.total == model.num_parameters()
    assert pc.mtp == sum(p.numel() for p in model.mtp.parameters())
    base = acc.count_params(ModelConfig.from_dict({**cfg.to_dict(), "mtp": None}))
    assert pc.active == base.active and pc.total == base.total + pc.mtp
    B, T = 2, cfg.max_seq_len
    x = torch.randint(0, V, (B, T))
    counted = []
    for mtp in (False, True):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(x, x, mtp=mtp)
        counted.append(counter.get_total_flops())
    fl = acc.flops_per_token(cfg, T)
    # the forward figures are inference's; training adds 3x the modules' forward (the lm_head's included)
    assert counted[0] == fl.forward_dense * B * T
    assert counted[1] - counted[0] == (fl.train_dense - 3 * fl.forward_dense) / 3 * B * T


@pytest.mark.parametrize(
    "mtp, named",
    [
        ({"depth": -1}, "model.mtp.depth=-1 must be an integer >= 0"),
        ({"depth": 1, "loss_scale": -0.1}, "model.mtp.loss_scale=-0.1 must be a number >= 0"),
        ({"depth": 1, "heads": 2}, "unknown model.mtp field(s) heads"),
        (3, "model.mtp=3 must be null (no MTP) or a mapping"),
    ],
)
def test_bad_mtp_settings_are_one_line_config_errors(mtp, named):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**TINY_LLAMA, mtp=mtp)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_an_objective_without_mtp_refuses_the_model_in_one_line(tmp_path):
    pairs = Path(__file__).parents[2] / "gptkit" / "data" / "examples" / "pairs.jsonl"
    pref = ["data=preference", f"data.paths=[{pairs}]", "data.template=chatml"]
    r = run_cli("train", "model=mtp-tiny", "objective=dpo", *pref, f"runs_dir={tmp_path}")
    one_line_error(r, "model.mtp.depth=1: objective=dpo cannot train multi-token prediction modules")
    assert not any(tmp_path.iterdir())


def test_mtp_tiny_trains_and_logs_each_depth(tmp_path):
    """model=mtp-tiny (grouped routing, the expert bias, one MTP depth; shrunk) trains on the built-in corpus:
    train/mtp_loss_1 and the MTP block's router figures in metrics.csv; val/loss is the next-token head's."""
    r = run_cli(
        "train",
        "model=mtp-tiny",
        "model.n_layers=2",
        "model.d_model=32",
        "model.moe.d_expert=24",
        "model.mtp.depth=2",
        "trainer.max_steps=4",
        "trainer.log_every=2",
        "trainer.val_every=4",
        "trainer.accelerator=cpu",
        f"runs_dir={tmp_path}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(open(next(tmp_path.glob("*/metrics.csv")))))
    logged = [row for row in rows if row.get("train/mtp_loss_1")]
    assert logged and all(float(row["train/mtp_loss_2"]) > 0 for row in logged)
    assert any(row.get("moe/max_load/mtp1") for row in rows) and any(row.get("val/loss") for row in rows)
