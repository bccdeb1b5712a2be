"""Mixtures of experts and transformers (gptkit/hf/): Mixtral, Qwen3-MoE and OLMoE import
with transformers' fp32 logits (<= 1e-5, every weight perturbed), export back to the same files bit for bit,
export from gptkit with the same greedy tokens, and an expert layout or a config that does not fit is one
line, exit 2. Tiny random models built from their configs (no hub)."""

import json

import pytest
import torch
from conftest import HF_EOS as EOS
from conftest import HF_TEXT as TEXT
from conftest import (
    TINY_LLAMA,
    char_tokenizer,
    gptkit_greedy,
    hf_common,
    hf_export_same_files,
    hf_import,
    hf_perturbed,
    one_line_error,
    run_cli,
)
from conftest import main_code as cli
from safetensors.torch import load_file, save_file

from gptkit import hf
from gptkit.errors import GptkitError
from gptkit.model import GPT, ModelConfig
from gptkit.runs import write_run_folder

transformers = pytest.importorskip("transformers")

V, T = 64, 48
KINDS = ["mixtral", "qwen3_moe", "olmoe"]


def hf_model(kind: str, **change):
    """A tiny transformers mixture of each family, d_model 32, 4 experts top-2, every weight random."""
    common = hf_common(V, T, hidden_size=32, num_experts_per_tok=2)
    # each family its own width
    del common["intermediate_size"]
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=40, num_local_experts=4, **change)
    elif kind == "qwen3_moe":
        # layer 0 dense (mlp_only_layers), head_dim wider than d_model / n_heads, top-k renormalized
        cfg = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=56,
            moe_intermediate_size=24,
            num_experts=4,
            head_dim=16,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            **change,
        )
    else:
        cfg = transformers.OlmoeConfig(
            **(common | {"num_key_value_heads": 4}), intermediate_size=24, num_experts=4, **change
        )
    cls = {
        "mixtral": transformers.MixtralForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "olmoe": transformers.OlmoeForCausalLM,
    }[kind]
    return hf_perturbed(lambda: cls(cfg))


# what each family is in gptkit's fields
WANT = {
    "mixtral": dict(qk_norm=None, d_ff=40, moe_layers=[0, 1]),
    "qwen3_moe": dict(qk_norm="head", head_dim=16, d_ff=56, moe_layers=[1]),
    "olmoe": dict(qk_norm="full", norm_placement="pre", n_kv_heads=4, moe_layers=[0, 1]),
}
MOE = {
    "mixtral": dict(n_experts=4, top_k=2, d_expert=40, norm_topk_prob=True),
    "qwen3_moe": dict(n_experts=4, top_k=2, d_expert=24, norm_topk_prob=True, first_dense=1),
    "olmoe": dict(n_experts=4, top_k=2, d_expert=24, norm_topk_prob=False),
}


@pytest.mark.parametrize("kind", KINDS)
def test_import_has_the_logits_of_transformers_and_export_gives_back_the_same_files(tmp_path, kind):
    theirs = hf_model(kind)
    model_cfg, model = hf_import(tmp_path, theirs, WANT[kind])
    for k, v in MOE[kind].items():
        assert getattr(model_cfg.moe, k) == v, k
    # [B, T]: the whole context
    idx = torch.randint(0, V, (2, T))
    with torch.no_grad():
        ref = theirs(idx).logits
        for attention in ("sdpa", "eager"):
            for impl in ("grouped_mm", "loop"):
                d = model_cfg.to_dict()
                d |= {"attention": attention, "moe": d["moe"] | {"impl": impl}}
                ours = GPT.from_state(ModelConfig.from_dict(d), model.state_dict())
                assert (ours(idx).logits - ref).abs().max().item() <= 1e-5, (attention, impl)
    hf_export_same_files(tmp_path, type(theirs).__name__, idx, ref)


def random_moe(kind: str, vocab_size: int) -> GPT:
    """A tiny gptkit mixture that maps to `kind`, every weight random."""
    attention = {
        "mixtral": dict(qk_norm=None),
        "qwen3_moe": dict(qk_norm="head", qkv_bias=False),
        "olmoe": dict(qk_norm="full", qkv_bias=False),
    }[kind]
    moe = dict(n_experts=3, top_k=2, d_expert=24, aux_loss_coef=0.02)
    if kind == "qwen3_moe":
        moe |= dict(every=2, norm_topk_prob=False)
    torch.manual_seed(1)
    # Mixtral and OLMoE have no dense layer and no width of their own for one: import sets d_ff = d_expert
    d_ff = 40 if kind == "qwen3_moe" else 24
    cfg = ModelConfig(
        **TINY_LLAMA,
        vocab_size=vocab_size,
        max_seq_len=48,
        d_ff=d_ff,
        tie_embeddings=False,
        moe=moe,
        **attention,
    )
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_with_auto_classes_same_logits_and_greedy_tokens(tmp_path, kind):
    tok = char_tokenizer()
    model = random_moe(kind, tok.get_vocab_size())
    write_run_folder(tmp_path / "run", {"tokenizer": {"eos_token": EOS}}, model, tok)
    assert cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'hf'}") == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf_model).__name__ == hf.ARCHITECTURES[kind]
    ids = torch.tensor([tok.encode(TEXT).ids])  # [1, T]
    with torch.no_grad():
        assert (model(ids).logits - hf_model(ids).logits).abs().max().item() <= 1e-5
        generated = hf_model.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist()
    assert generated == gptkit_greedy(model, ids, 8, tok.token_to_id(EOS))
    # in memory (transformers 5 fuses each layer's experts) and back, exactly
    back = hf.from_transformers(hf.to_transformers(model))
    assert back.cfg == model.cfg
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def without_expert(folder, layer: int, expert: int) -> None:
    """Remove one expert's three tensors from a saved transformers folder."""
    f = folder / "model.safetensors"
    state = load_file(f)
    gone = [k for k in state if f"layers.{layer}." in k and f".experts.{expert}." in k]
    assert len(gone) == 3
    save_file({k: v for k, v in state.items() if k not in gone}, f, metadata={"format": "pt"})


def test_an_import_whose_experts_do_not_match_its_config_is_one_line(tmp_path):
    hf_model("mixtral").save_pretrained(tmp_path / "hf")
    without_expert(tmp_path / "hf", layer=1, expert=3)
    r = run_cli("import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}")
    one_line_error(r, "layer 1 holds experts 0..2 (3)", "the config needs 4")
    assert not (tmp_path / "run").exists()


def test_an_expert_layer_where_the_config_says_dense_is_refused(tmp_path):
    theirs = hf_model("qwen3_moe")
    theirs.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"mlp_only_layers": [0, 1]}))
    with pytest.raises(GptkitError, match="no layer of the 2 is MoE"):
        from gptkit.hf.folders import Source, import_folder

        import_folder(Source(tmp_path / "hf", "x", "x"), tmp_path / "run")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"mlp_only_layers": []}))
    with pytest.raises(GptkitError, match="layer 0 holds no experts, the config needs 4"):
        import_folder(Source(tmp_path / "hf", "x", "x"), tmp_path / "run")


@pytest.mark.parametrize(
    "kind, change, named",
    [
        ("mixtral", dict(sliding_window=16), "sliding_window=16"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
        ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
        ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
        ("qwen3_moe", dict(num_experts_per_tok=5), "model.moe.top_k=5 exceeds model.moe.n_experts=4"),
    ],
)
def test_unsupported_moe_configs_are_refused_by_name(kind, change, named):
    d = hf_model(kind).config.to_dict() | change
    with pytest.raises(GptkitError, match=named.replace(".", r"\.")):
        hf.model_config_from_hf(d)


@pytest.mark.parametrize(
    "moe, named",
    [
        (dict(router="sigmoid"), "moe.router=sigmoid"),
        (dict(n_shared=1), "moe.n_shared=1"),
        (dict(bias_update_rate=0.001), "the expert bias moves the top-k choice"),
        (dict(correction_bias=True), "moe.correction_bias=True has no faithful"),
        (dict(every=2), "moe.every=2"),
        (dict(norm_topk_prob=False), "moe.norm_topk_prob=False"),
    ],
)
def test_mixtures_without_a_transformers_architecture_are_refused_on_export(moe, named):
    cfg = random_moe("mixtral", V).cfg.to_dict()
    cfg = ModelConfig.from_dict(cfg | {"n_layers": 2, "moe": cfg["moe"] | moe})
    with pytest.raises(GptkitError, match=named):
        hf.hf_config(cfg)


def parity_table() -> list[str]:
    """The measured differences behind the bounds above, one Markdown row per family (docs/moe.md):
    `python tests/hf/test_hf_moe.py`."""
    head = ("family (transformers class)", "sdpa, grouped_mm", "eager, grouped_mm", "sdpa, loop", "export")
    rows = ["| " + " | ".join(head) + " | max abs logit |", "|---|---|---|---|---|---|"]
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    for kind in KINDS:
        theirs = hf_model(kind)
        model = hf.from_transformers(theirs)
        diffs = []
        with torch.no_grad():
            ref = theirs(idx).logits
            for attention, impl in (("sdpa", "grouped_mm"), ("eager", "grouped_mm"), ("sdpa", "loop")):
                d = model.cfg.to_dict()
                d |= {"attention": attention, "moe": d["moe"] | {"impl": impl}}
                ours = GPT.from_state(ModelConfig.from_dict(d), model.state_dict())
                diffs.append((ours(idx).logits - ref).abs().max().item())
            mine = random_moe(kind, V)
            diffs.append((mine(idx).logits - hf.to_transformers(mine)(idx).logits).abs().max().item())
        cells = " | ".join(f"{x:.1e}" if x else "0.0" for x in diffs)
        rows.append(f"| {kind} (`{hf.ARCHITECTURES[kind]}`) | {cells} | {ref.abs().max().item():.1f} |")
    return rows


if __name__ == "__main__":
    print("\n".join(parity_table()))


def test_train_init_from_hf_fine_tunes_a_mixture_with_its_router_figures(tmp_path, monkeypatch):
    import csv
    import sys

    from conftest import shakespeare

    # the Hydra app sets sys.argv
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])
    hf_model("olmoe").save_pretrained(tmp_path / "hf")
    (tmp_path / "c.txt").write_text(shakespeare(20_000).lower())
    args = ["train", f"init_from=hf:{tmp_path / 'hf'}", "tokenizer=char", "data=files"]
    args += [f"data.paths=[{tmp_path / 'c.txt'}]", "trainer.batch_size=2", "trainer.max_steps=2"]
    args += ["trainer.val_windows=2", "trainer.log_every=1", "trainer.progress=false"]
    assert cli(*args, f"runs_dir={tmp_path / 'runs'}", "name=ft") == 0
    with open(tmp_path / "runs/ft/metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["train/loss"]]
    assert len(rows) == 2 and all(r["train/aux_loss"] and r["moe/entropy/1"] for r in rows)


def test_mxfp4_reads_back_the_values_the_format_defines():
    """OCP MX: E2M1 nibbles (low nibble first) times 2^(E8M0 scale - 127), in blocks of 32."""
    from gptkit.hf.mxfp4 import dequantize_mxfp4

    blocks = torch.zeros(1, 2, 16, dtype=torch.uint8)  # [rows, G, 16]
    blocks[0, 0, 0] = 0x21  # 0.5 then 1.0
    blocks[0, 0, 1] = 0x8F  # -6.0 then -0.0
    blocks[0, 1, 15] = 0x7B  # -1.5 then 6.0 (the block's last two values)
    scales = torch.tensor([[128, 125]], dtype=torch.uint8)  # x 2, x 1/4
    out = dequantize_mxfp4(blocks, scales)  # [1, 64]
    assert out.shape == (1, 64)
    assert out[0, :4].tolist() == [1.0, 2.0, -12.0, -0.0] and torch.signbit(out[0, 3])
    assert out[0, 62:].tolist() == [-0.375, 1.5] and out[0, 4:62].abs().sum() == 0


def test_mxfp4_equals_transformers_reader_and_refuses_what_is_not_mxfp4():
    from gptkit.hf.mxfp4 import dequantize_mxfp4

    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), generator=g, dtype=torch.uint8)  # [E, rows, G, 16]
    scales = torch.randint(100, 140, (2, 6, 3), generator=g, dtype=torch.uint8)  # [E, rows, G]
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, G * 32, rows]
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2))
    for b, s, named in (
        (blocks[..., :8], scales, r"blocks \(2, 6, 3, 8\) and scales \(2, 6, 3\) do not fit"),
        (blocks, scales[..., :2], "do not fit"),
        (blocks.to(torch.int32), scales, "must be uint8"),
        (blocks, torch.full_like(scales, 0xFF), "0xFF, which E8M0 defines as NaN"),
    ):
        with pytest.raises(GptkitError, match=named):
            dequantize_mxfp4(b, s, name="model.layers.0.mlp.experts.gate_up_proj")
