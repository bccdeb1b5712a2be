"""DeepSeek-V3 and transformers (gptkit/hf/deepseek_v3.py, DeepseekV3ForCausalLM: DeepSeek-V3/V3.1,
Kimi K2, Moonlight): a tiny random model (every weight and the correction bias perturbed; a dense first
layer, 8 experts in 4 groups, shared experts; a low-rank query with DeepSeek's YaRN, or q_proj with plain
RoPE) imports with transformers' fp32 logits (<= 1e-5), greedy tokens equal `generate` for 64 tokens, and
exports back to the same files bit for bit; the MTP layers its checkpoints keep are kept or dropped with a
note; the presets count as transformers' own model on the meta device; what does not map is one line."""

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import hf_export_same_files, hf_import, one_line_error, run_cli, run_main
from safetensors.torch import load_file, save_file

from gptkit import accounting as acc
from gptkit import hf
from gptkit.conf_tree import conf_dir
from gptkit.errors import GptkitError
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig
from gptkit.model.mtp import mtp_targets

transformers = pytest.importorskip("transformers")

V, T = 64, 72
# DeepSeek-V3's YaRN (mscale = mscale_all_dim = 1, beta 32 / 1) over an original context of 18
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 18, "beta_fast": 32.0}
YARN |= {"beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# Moonlight's shape: q_proj, plain RoPE, rms_norm_eps 1e-5 (transformers' latent norms keep 1e-6)
KINDS = {"q_lora-yarn": (16, True, {}), "q_proj-rope-eps": (None, False, {"rms_norm_eps": 1e-5})}


def hf_model(q_lora_rank, yarn: bool, **change):
    """3 layers (layer 0 dense), d_model 32, 4 heads of nope 12 + rope 4 (interleaved), values 8, latent 12; 8
    experts of width 16 in 4 groups (2 kept), top-3, 2 shared, routed scale 2.5; every weight and each layer's
    e_score_correction_bias perturbed."""
    rope = {"rope_theta": 500.0, **YARN} if yarn else {"rope_theta": 500.0, "rope_type": "default"}
    cfg = transformers.DeepseekV3Config(
        **dict(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            q_lora_rank=q_lora_rank,
            kv_lora_rank=12,
            qk_nope_head_dim=12,
            qk_rope_head_dim=4,
            v_head_dim=8,
            max_position_embeddings=T,
            tie_word_embeddings=False,
            rope_parameters=rope,
            bos_token_id=None,
            eos_token_id=None,
        )
        | change
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("kind", KINDS)
def test_import_has_transformers_logits_and_tokens_and_export_gives_back_the_same_files(
    tmp_path, capsys, kind
):
    q_lora_rank, yarn, change = KINDS[kind]
    theirs = hf_model(q_lora_rank, yarn, **change)
    cfg, model = hf_import(tmp_path, theirs, dict(attention_kind="mla", n_layers=3, mtp=None))
    assert cfg.mla.q_lora_rank == q_lora_rank and cfg.mla.rope_interleave
    assert cfg.mla.latent_norm_eps == (1e-6 if change else None)
    assert (cfg.rope_scaling or {}).get("mscale_all_dim") == (1.0 if yarn else None)
    m = cfg.moe
    assert (m.n_experts, m.top_k, m.d_expert, m.n_shared, m.first_dense) == (8, 3, 16, 2, 1)
    assert (m.router, m.route_scale, m.n_group, m.topk_group, m.correction_bias) == (
        "sigmoid",
        2.5,
        4,
        2,
        True,
    )
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = theirs(idx).logits
        assert (model(idx).logits - ref).abs().max().item() <= 1e-5
        # the correction bias is read, not left at zero: without it the choice (and the logits) differ
        bias = model.blocks[1].mlp.expert_bias
        held = bias.clone()
        bias.zero_()
        assert (model(idx).logits - ref).abs().max().item() > 1e-3
        bias.copy_(held)
        theirs.generation_config.eos_token_id = None
        prompt = idx[:1, :8]
        want = theirs.generate(prompt, max_new_tokens=T - 8, do_sample=False)[0, 8:].tolist()
    # the latent cache's weight-absorbed decode against transformers' uncompressed one
    got = generate(model, prompt[0].tolist(), SampleOptions(max_new_tokens=T - 8, temperature=0)).tokens[0]
    assert len(want) == 64 and got == want
    hf_export_same_files(tmp_path, "DeepseekV3ForCausalLM", idx, ref)
    # bf16: the correction bias stays fp32, as in DeepSeek's files and transformers' memory
    assert (
        run_main(capsys, "export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'bf16'}", "dtype=bf16")[0]
        == 0
    )
    bf16 = load_file(tmp_path / "bf16" / "model.safetensors")
    assert bf16["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert bf16["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    # in memory (transformers 5 fuses each layer's experts) and back, exactly
    back = hf.from_transformers(hf.to_transformers(model))
    assert back.cfg == model.cfg
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_deepseek_yarn_equals_transformers_at_deepseek_v3s_numbers():
    """model.rope_scaling of DeepSeek-V3's config.json (factor 40 over 4096, mscale = mscale_all_dim = 1)
    gives transformers' DeepseekV3RotaryEmbedding's cos and sin, and the scores' mscale^2 its attention
    scaling."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from gptkit.model.layers import RotaryEmbedding
    from gptkit.model.mla import mla_scale

    rope = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32}
    rope |= {"beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    d = transformers.DeepseekV3Config(num_hidden_layers=1, max_position_embeddings=163840, rope_scaling=rope)
    cfg = hf.model_config_from_hf(d.to_dict())
    theirs = DeepseekV3RotaryEmbedding(d)
    positions = torch.tensor([[0, 1, 4095, 4096, 70000, 163839]])
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions)
    ours = RotaryEmbedding(64, cfg.max_seq_len, cfg.rope_theta, scaling=cfg.rope_scaling)
    assert torch.equal(ours.cos[positions[0]], cos[0]) and torch.equal(ours.sin[positions[0]], sin[0])
    want = transformers.models.deepseek_v3.modeling_deepseek_v3.yarn_apply_mscale(
        d.rope_parameters, 192**-0.5
    )
    assert mla_scale(cfg) == pytest.approx(want, rel=1e-12)


# ---- the multi-token prediction layers ---------------------------------------------------------------------
def with_mtp_layer(tmp_path, theirs, differ: str | None = None, break_shape: bool = False) -> dict:
    """theirs saved at tmp_path/hf, then made a DeepSeek checkpoint with one MTP layer
    (model.layers.3: random enorm, hnorm, eh_proj, a MoE block, shared_head.norm; copies of the embedding
    and the head), as DeepSeek-V3's files keep it; config.json's num_nextn_predict_layers 1. `differ`: that
    copy made unequal."""
    theirs.save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    files = load_file(f)
    cfg = hf.model_config_from_hf(theirs.config.to_dict())
    mtp_cfg = ModelConfig.from_dict(cfg.to_dict() | {"mtp": {"depth": 1}})
    torch.manual_seed(3)
    model = GPT(mtp_cfg)
    with torch.no_grad():
        for p in list(model.parameters()) + [b for n, b in model.named_buffers() if "expert_bias" in n]:
            p.normal_(0.0, 0.3)
    state = hf.to_hf_state_dict(model.state_dict(), mtp_cfg)
    layer = {k: v for k, v in state.items() if k.startswith("model.layers.3.")}
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in layer
    layer["model.layers.3.embed_tokens.weight"] = files["model.embed_tokens.weight"].clone()
    layer["model.layers.3.shared_head.head.weight"] = files["lm_head.weight"].clone()
    if differ is not None:
        layer[differ] = layer[differ] + 1.0
    if break_shape:
        layer["model.layers.3.eh_proj.weight"] = layer["model.layers.3.eh_proj.weight"][:, :40].contiguous()
    save_file(files | layer, f, metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    return layer


def reference_mtp_loss(theirs, layer: dict, idx) -> torch.Tensor:
    """DeepSeek-V3's MTP module (its reference / vLLM's DeepSeekMultiTokenPredictorLayer) written out on
    transformers' pieces: the main model's final-normed hidden state h, x = eh_proj([enorm(Emb(token i + 1));
    hnorm(h)]), transformers' own decoder layer (index 3: MoE), shared_head.norm, the head; the loss of
    predicting token i + 2."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    c = theirs.config
    p = "model.layers.3."
    norms = {n: DeepseekV3RMSNorm(32, eps=c.rms_norm_eps) for n in ("enorm", "hnorm", "shared_head.norm")}
    for n, m in norms.items():
        m.weight.data.copy_(layer[p + n + ".weight"])
    block = DeepseekV3DecoderLayer(c, 3).eval()
    own = {k[len(p) :]: v for k, v in layer.items() if k.startswith(p)}
    mem = {}
    for part in ("gate_proj", "up_proj", "down_proj"):
        mem[part] = torch.stack([own.pop(f"mlp.experts.{j}.{part}.weight") for j in range(8)])
    own["mlp.experts.gate_up_proj"] = torch.cat([mem["gate_proj"], mem["up_proj"]], dim=1)
    own["mlp.experts.down_proj"] = mem["down_proj"]
    keys = set(block.state_dict())
    block.load_state_dict({k: v for k, v in own.items() if k in keys}, strict=True)
    with torch.no_grad():
        h = theirs.model(idx).last_hidden_state  # [B, T, d]
        nxt = torch.cat([idx[:, 1:], idx[:, -1:]], dim=1)  # token i + 1 at position i
        e = theirs.model.embed_tokens(nxt)
        x = F.linear(torch.cat([norms["enorm"](e), norms["hnorm"](h)], -1), layer[p + "eh_proj.weight"])
        positions = torch.arange(idx.shape[1]).unsqueeze(0)
        pe = theirs.model.rotary_emb(x, positions)
        y = block(x, position_embeddings=pe, attention_mask=None, position_ids=positions)
        logits = theirs.lm_head(norms["shared_head.norm"](y))
    targets = mtp_targets(torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], 1), 1, None)
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)


def test_mtp_layers_are_kept_as_model_mtp_and_written_back_bit_for_bit(tmp_path, capsys):
    theirs = hf_model(16, True)
    theirs.config._attn_implementation = "sdpa"
    layer = with_mtp_layer(tmp_path, theirs)
    code, _, err = run_main(capsys, "import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}")
    assert code == 0, err
    assert "note: kept the 1 multi-token prediction layer(s) model.layers.3.." in err
    from gptkit.runs import load_model

    model = load_model(tmp_path / "run")[-1]
    assert model.cfg.mtp.depth == 1
    idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = theirs(idx).logits
        assert (model(idx).logits - ref).abs().max().item() <= 1e-5
        targets = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], 1)
        ours = model(idx, targets, mtp=True).mtp_losses[0]
    # gptkit's MTP module is DeepSeek-V3's: the same depth-1 loss
    assert abs(ours.item() - reference_mtp_loss(theirs, layer, idx).item()) <= 1e-5
    hf_export_same_files(tmp_path, "DeepseekV3ForCausalLM", idx, ref)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize(
    "differ", ["model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight", None]
)
def test_mtp_layers_that_gptkit_cannot_share_or_that_the_files_lack_are_dropped_with_a_note(
    tmp_path, capsys, differ
):
    theirs = hf_model(None, False)
    if differ is None:
        # transformers writes num_nextn_predict_layers 1 and no MTP layer
        theirs.save_pretrained(tmp_path / "hf")
        said = "config.json has num_nextn_predict_layers=1 but the files hold no MTP layer"
    else:
        with_mtp_layer(tmp_path, theirs, differ=differ)
        said = f"dropped the 1 multi-token prediction layer(s) (num_nextn_predict_layers=1): {differ} differs"
    code, _, err = run_main(capsys, "import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}")
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and said in notes[0]
    from gptkit.runs import load_model

    assert load_model(tmp_path / "run")[-1].cfg.mtp is None


def test_mtp_weights_of_the_wrong_shape_are_one_line(tmp_path):
    with_mtp_layer(tmp_path, hf_model(None, False), break_shape=True)
    r = run_cli("import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}")
    one_line_error(r, "the MTP tensor model.layers.3.eh_proj.weight has shape (32, 40)", "needs (32, 64)")
    assert not (tmp_path / "run").exists()


# ---- presets and counts ------------------------------------------------------------------------------------
def preset(name: str) -> ModelConfig:
    return ModelConfig.from_dict(yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text()))


# total and active (count-params), from the released configs
COUNTS = {
    "deepseek-v3": (682_636_472_320, 37_552_282_624),
    "kimi-k2": (1_026_408_209_408, 32_861_477_888),
    "moonlight-16b-a3b": (15_960_108_544, 2_914_774_528),
    "deepseek-tiny": (10_504_736, 9_069_312),
}


@pytest.mark.parametrize("name", list(COUNTS))
def test_presets_count_as_transformers_deepseek_v3_on_the_meta_device(name):
    """count-params' total less its mtp row is transformers' parameter count (its class builds no MTP layer),
    active its count less the experts a token skips; the mtp row is DeepSeek's MTP layer less its copies of
    the embedding and the head (gptkit's modules share them)."""
    cfg = preset(name)
    counts = acc.count_params(cfg)
    d = hf.hf_config(cfg)
    config = transformers.DeepseekV3Config(
        **{k: v for k, v in d.items() if k not in ("architectures", "dtype")}
    )
    # config.json alone: MTP is the files' word (with_files); the bias's training rate is not config.json's
    want = cfg.to_dict() | {"mtp": None}
    want["moe"] = dict(want["moe"], bias_update_rate=0.0)
    assert hf.model_config_from_hf(config.to_dict(), name=cfg.name) == ModelConfig.from_dict(want)
    with torch.device("meta"):
        theirs = transformers.DeepseekV3ForCausalLM(config)
        assert GPT(cfg).num_parameters() == counts.total
        mtp_layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(config, 99)
    total = sum(p.numel() for p in theirs.parameters())
    m = cfg.moe
    skipped = sum(
        p.numel() * (m.n_experts - m.top_k) // m.n_experts
        for n, p in theirs.named_parameters()
        if ".experts." in n
    )
    assert (counts.total - counts.mtp, counts.active) == (total, total - skipped)
    d_model = cfg.d_model
    assert counts.mtp == cfg.mtp_depth * (
        sum(p.numel() for p in mtp_layer.parameters()) + 3 * d_model + 2 * d_model**2
    )
    assert (counts.total, counts.active) == COUNTS[name]


# ---- what does not map -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, named",
    [
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
        (dict(topk_method="group_limited_greedy"), "topk_method"),
        (dict(n_shared_experts=0), "n_shared_experts=0"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(num_key_value_heads=2), "num_key_value_heads=2 but num_attention_heads=4"),
        (dict(kv_lora_rank=None), "no kv_lora_rank"),
        (dict(topk_group=5), "topk_group=5 exceeds model.moe.n_group=4"),
        (dict(qk_rope_head_dim=3), "qk_rope_head_dim=3 must be even"),
    ],
)
def test_deepseek_configs_gptkit_cannot_represent_are_refused_by_name(change, named):
    d = hf_model(None, False).config.to_dict() | change
    with pytest.raises(GptkitError, match=named.replace(".", r"\.").replace("(", r"\(")):
        hf.model_config_from_hf(d)


@pytest.mark.parametrize(
    "moe, named",
    [
        # a softmax router is DeepSeek-V2's, whose top-k weights are never renormalized
        (dict(router="softmax"), "DeepseekV2ForCausalLM .* needs moe.norm_topk_prob=False"),
        (
            dict(router="softmax", norm_topk_prob=False),
            "DeepseekV2ForCausalLM .* needs moe.correction_bias=False",
        ),
        (dict(n_shared=0), "moe.n_shared=0"),
        (dict(correction_bias=False), "model.moe has no expert bias"),
        (dict(every=2, first_dense=0), "moe.every=2"),
    ],
)
def test_mla_models_deepseek_v3_cannot_hold_are_refused_on_export(moe, named):
    cfg = hf.model_config_from_hf(hf_model(None, False).config.to_dict()).to_dict()
    cfg = ModelConfig.from_dict(cfg | {"moe": cfg["moe"] | moe})
    with pytest.raises(GptkitError, match=named):
        hf.hf_config(cfg)


def test_a_dense_mla_model_exports_as_deepseek_v3_with_every_layer_dense(tmp_path):
    """mla-tiny (no mixture): first_k_dense_replace = its layers, the same logits in transformers (its latent
    norms' eps set to transformers' 1e-6, refused before)."""
    cfg = preset("mla-tiny").to_dict() | {"vocab_size": V, "n_layers": 2}
    with pytest.raises(GptkitError, match="latent_norm_eps=1e-05 .* fixes 1e-06"):
        hf.hf_config(ModelConfig.from_dict(cfg))
    # its norm_eps 1e-5; transformers' latent norms keep 1e-6
    cfg["mla"] |= {"latent_norm_eps": 1e-6}
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_dict(cfg)).eval()
    theirs = hf.to_transformers(model)
    assert theirs.config.first_k_dense_replace == 2
    idx = torch.randint(0, V, (1, 16))
    with torch.no_grad():
        assert (model(idx).logits - theirs(idx).logits).abs().max().item() <= 1e-5
    assert hf.from_transformers(theirs).cfg == model.cfg


def test_train_init_from_hf_fine_tunes_deepseek_v3_with_its_mtp_layer_and_fixed_correction_bias(
    tmp_path, monkeypatch, capsys
):
    """init_from=hf: of a checkpoint holding its MTP layer: the run trains the kept depth (train/mtp_loss_1)
    and its correction bias stays as imported (bias_update_rate 0)."""
    import csv
    import sys

    from conftest import main_code, shakespeare

    from gptkit.runs import load_model

    # the Hydra app sets sys.argv
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])
    with_mtp_layer(tmp_path, hf_model(16, True))
    (tmp_path / "c.txt").write_text(shakespeare(20_000).lower())
    args = ["train", f"init_from=hf:{tmp_path / 'hf'}", "tokenizer=char", "data=files"]
    args += [f"data.paths=[{tmp_path / 'c.txt'}]", "trainer.batch_size=2", "trainer.max_steps=2"]
    args += ["trainer.val_windows=2", "trainer.log_every=1", "trainer.progress=false"]
    assert main_code(*args, f"runs_dir={tmp_path / 'runs'}", "name=ft") == 0
    assert "note: kept the 1 multi-token prediction layer(s)" in capsys.readouterr().err
    with open(tmp_path / "runs/ft/metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["train/loss"]]
    assert len(rows) == 2 and all(r["train/mtp_loss_1"] and r["moe/entropy/mtp1"] for r in rows)
    before = load_model(tmp_path / "runs" / "hf-imported")[-1].state_dict()
    after = load_model(tmp_path / "runs" / "ft")[-1].state_dict()
    assert torch.equal(before["blocks.1.mlp.expert_bias"], after["blocks.1.mlp.expert_bias"])
    assert not torch.equal(before["mtp.layers.0.proj.weight"], after["mtp.layers.0.proj.weight"])


# ---- DeepSeek-V2 (softmax routing, no correction bias, no groups) ---------------------------------------
def hf_v2(**change):
    """DeepSeek-V2-Lite's shape in small: q_proj, 3 layers (layer 0 dense), 8 experts top-3 (softmax, not
    renormalized, scaled 1.5), 2 shared; every weight perturbed."""
    cfg = transformers.DeepseekV2Config(
        **dict(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=2,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=12,
            qk_nope_head_dim=12,
            qk_rope_head_dim=4,
            v_head_dim=8,
            max_position_embeddings=T,
            rope_parameters={"rope_theta": 500.0, "rope_type": "default"},
            bos_token_id=None,
            eos_token_id=None,
        )
        | change
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def test_deepseek_v2_imports_with_transformers_logits_and_tokens_and_exports_the_same_files(tmp_path):
    theirs = hf_v2()
    cfg, model = hf_import(tmp_path, theirs, dict(attention_kind="mla", mtp=None))
    m = cfg.moe
    assert (m.router, m.norm_topk_prob, m.route_scale, m.correction_bias, m.n_shared) == (
        "softmax",
        False,
        1.5,
        False,
        2,
    )
    assert cfg.mla.rope_interleave and hf.architecture(cfg) == "deepseek_v2"
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = theirs(idx).logits
        assert (model(idx).logits - ref).abs().max().item() <= 1e-5
        theirs.generation_config.eos_token_id = None
        prompt = idx[:1, :8]
        want = theirs.generate(prompt, max_new_tokens=T - 8, do_sample=False)[0, 8:].tolist()
    got = generate(model, prompt[0].tolist(), SampleOptions(max_new_tokens=T - 8, temperature=0)).tokens[0]
    assert got == want
    hf_export_same_files(tmp_path, "DeepseekV2ForCausalLM", idx, ref)


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(topk_method="group_limited_greedy", n_group=4, topk_group=2), "topk_method"),
        (dict(mlp_bias=True), "mlp_bias"),
    ],
)
def test_deepseek_v2_routing_gptkit_cannot_represent_is_refused_by_name(change, named):
    with pytest.raises(GptkitError, match=named):
        hf.model_config_from_hf(hf_v2().config.to_dict() | change)


def parity_rows() -> list[str]:
    """The measured max |logit difference| behind the bounds above (docs/families.md):
    `PYTHONPATH=tests python tests/hf/test_hf_deepseek.py`."""
    rows = []
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    models = {kind: (lambda q=q, y=y, c=c: hf_model(q, y, **c)) for kind, (q, y, c) in KINDS.items()}
    for kind, build in (models | {"deepseek_v2": hf_v2}).items():
        theirs = build()
        ours = hf.from_transformers(theirs)
        with torch.no_grad():
            ref = theirs(idx).logits
            diffs = [(m(idx).logits - ref).abs().max().item() for m in (ours, hf.to_transformers(ours))]
        top = ref.abs().max().item()
        rows.append(
            f"{kind}: import {diffs[0]:.1e}, back in transformers {diffs[1]:.1e} (max |logit| {top:.1f})"
        )
    return rows


if __name__ == "__main__":
    print("\n".join(parity_rows()))
