"""The models people fine-tune: Llama 3.1/3.2 (RoPE scaling llama3), Qwen2/2.5 (q/k/v biases), Qwen3 (QK-norm
per head), OLMo-2 (QK-norm over all heads, norms after each branch), SmolLM3 (NoPE layers) and Phi-3/Phi-4
(partial RoPE, fused qkv_proj and gate_up_proj) import and export with the logits of `transformers` (fp32,
<= 1e-5), on random-weight models built from their configs (no hub)."""

import json

import pytest
import torch
import yaml
from conftest import hf_common, hf_export_same_files, hf_import, hf_perturbed, run_main
from conftest import main_code as cli

from gptkit import accounting as acc
from gptkit import hf
from gptkit.conf_tree import conf_dir
from gptkit.errors import ConfigError, GptkitError
from gptkit.inference.batcher import SamplingParams, generate_many
from gptkit.inference.generate import generate
from gptkit.inference.rollouts import RolloutOptions, sample_groups
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig

transformers = pytest.importorskip("transformers")

V, T = 64, 48
# Phi-3's models have room to generate past T
PHI_POSITIONS = 96
# an "original" context of 16: positions up to 48 are scaled
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_type": "llama3",
}
# LongRoPE over an original context of 32 (Phi-4-mini's is 4096 of 131072): 64 greedy tokens after an
# 8-token prompt cross it; 4 factors each, one per pair of the 8 features turning in each 16-wide head
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.2, 1.5, 2.0],
    "long_factor": [1.0, 3.0, 7.0, 16.0],
}
LONGROPE_ORIGINAL = 32


def hf_model(kind: str):
    """A tiny transformers model of each family, every weight random (norms and biases included)."""
    common = hf_common(V, T)
    if kind == "llama3.2":
        cfg = transformers.LlamaConfig(
            **common, tie_word_embeddings=True, rope_parameters={"rope_theta": 500.0, **LLAMA3_SCALING}
        )
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=10000.0)
    elif kind == "smollm3":
        # four layers, every 2nd NoPE: transformers' no_rope_layers [1, 0, 1, 0] (1: RoPE), T + 64 positions
        # for the greedy decode
        cfg = transformers.SmolLM3Config(
            **hf_common(V, T + 80, num_hidden_layers=4), no_rope_layer_interval=2, rope_theta=500.0
        )
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False, attention_bias=False)
    elif kind.startswith("phi3"):
        # phi3: half of each 16-wide head turns (Phi-3.5/Phi-4-mini turn 3/4), a window of 16 in every layer;
        # phi3-full: RoPE over the whole head (Phi-4); phi3-longrope: half of each head, LongRoPE (Phi-4-mini)
        partial = {
            "phi3": {"partial_rotary_factor": 0.5, "sliding_window": 16},
            "phi3-full": {},
            "phi3-longrope": {
                "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": LONGROPE_ORIGINAL,
                # a copy: Phi3Config writes its partial_rotary_factor into the dict it is given
                "rope_scaling": dict(LONGROPE),
            },
            # Phi-3.5-mini: LongRoPE over the whole head (8 pairs)
            "phi3-longrope-full": {
                "original_max_position_embeddings": LONGROPE_ORIGINAL,
                "rope_scaling": {k: v * 2 if isinstance(v, list) else v for k, v in LONGROPE.items()}
                | {"partial_rotary_factor": 1.0},
            },
        }[kind]
        cfg = transformers.Phi3Config(
            **hf_common(V, PHI_POSITIONS), **partial, rope_theta=10000.0, tie_word_embeddings=False
        )
    else:
        cfg = transformers.Olmo2Config(**(common | {"num_key_value_heads": 4}), tie_word_embeddings=False)
    cls = {
        "llama3.2": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "olmo2": transformers.Olmo2ForCausalLM,
        "smollm3": transformers.SmolLM3ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
        "phi3-full": transformers.Phi3ForCausalLM,
        "phi3-longrope": transformers.Phi3ForCausalLM,
        "phi3-longrope-full": transformers.Phi3ForCausalLM,
    }[kind]
    return hf_perturbed(lambda: cls(cfg))


KINDS = ["llama3.2", "qwen2", "qwen3", "olmo2", "smollm3", "phi3"]
# what each family is in gptkit's fields
WANT = {
    "llama3.2": dict(qkv_bias=False, qk_norm=None, norm_placement="pre", tie_embeddings=True),
    "qwen2": dict(bias=False, qkv_bias=True, qk_norm=None, norm_placement="pre", rope_scaling=None),
    "qwen3": dict(qk_norm="head", head_dim=32, norm_placement="pre"),
    "olmo2": dict(qk_norm="full", norm_placement="post", n_kv_heads=4),
    "smollm3": dict(nope_layers=[1, 3], n_layers=4, tie_embeddings=True, rope_theta=500.0, qk_norm=None),
    "phi3": dict(rotary_dim=8, head_dim=16, sliding_window=16, bias=False, tie_embeddings=False),
}


@pytest.mark.parametrize("kind", KINDS)
def test_import_has_the_logits_of_transformers_and_export_gives_back_the_same_files(tmp_path, kind):
    theirs = hf_model(kind)
    model_cfg, model = hf_import(tmp_path, theirs, WANT[kind])
    idx = torch.randint(0, V, (2, T))  # [B, T]: the whole context, so every (scaled) position is checked
    with torch.no_grad():
        # each backend against transformers' own (eager and sdpa differ by ~2e-5 in SmolLM3's four layers)
        for attention in ("eager", "sdpa"):
            theirs.set_attn_implementation(attention)
            ref = theirs(idx).logits
            ours = GPT.from_state(
                ModelConfig.from_dict({**model_cfg.to_dict(), "attention": attention}), model.state_dict()
            )
            assert (ours(idx).logits - ref).abs().max().item() <= 1e-5, attention
    hf_export_same_files(tmp_path, type(theirs).__name__, idx, ref)


def test_phi3_with_rope_over_the_whole_head_is_the_llama_layout_in_phi3_files(tmp_path):
    """Phi-4 turns the whole head: it imports (its fused files read) with transformers' logits, and exports
    as LlamaForCausalLM, the same model under Llama's names."""
    theirs = hf_model("phi3-full")
    model_cfg, model = hf_import(tmp_path, theirs, dict(rotary_dim=None, head_dim=16, bias=False))
    idx = torch.randint(0, V, (2, T))
    with torch.no_grad():
        ref = theirs(idx).logits
        assert (model(idx).logits - ref).abs().max().item() <= 1e-5
        assert hf.architecture(model_cfg) == "llama"
        assert (hf.to_transformers(model)(idx).logits - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", ["phi3", "phi3-full"])
def test_phi3_greedy_generation_equals_transformers(kind):
    """64 greedy tokens past an 8-token prompt (through the window of 16 for phi3): the tokens of
    transformers' own generate with its cache."""
    theirs = hf_model(kind)
    ours = hf.from_transformers(theirs)
    prompt = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])  # [1, 8]
        want = theirs.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            pad_token_id=0,
        )[0, 8:].tolist()
    got = generate(ours, prompt, SampleOptions(max_new_tokens=64, temperature=0.0, decode="eager")).tokens[0]
    assert len(want) == 64 and len(set(want)) > 3 and got == want


def test_partial_rope_is_applied_not_ignored():
    """The same Phi-3 weights with RoPE over the whole head give other logits: the parity tests the split."""
    theirs = hf_model("phi3")
    ours = hf.from_transformers(theirs)
    whole = GPT.from_state(
        ModelConfig.from_dict({**ours.cfg.to_dict(), "rotary_dim": None}), ours.state_dict()
    )
    idx = torch.randint(0, V, (1, T))
    with torch.no_grad():
        assert (whole(idx).logits - theirs(idx).logits).abs().max().item() > 1e-2


def test_llama3_scaling_is_applied_not_ignored():
    """Without its rope_scaling the same weights give other logits: the parity above tests the scaling."""
    theirs = hf_model("llama3.2")
    ours = hf.from_transformers(theirs)
    plain = GPT.from_state(
        ModelConfig.from_dict({**ours.cfg.to_dict(), "rope_scaling": None}), ours.state_dict()
    )
    idx = torch.randint(0, V, (1, T))
    with torch.no_grad():
        assert (plain(idx).logits - theirs(idx).logits).abs().max().item() > 1e-2
    assert ours.cfg.rope_scaling == {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_seq_len": 16,
    }


@pytest.mark.parametrize("kind", KINDS)
def test_kv_cache_and_triton_attention_match_the_plain_forward(kind):
    model = hf.from_transformers(hf_model(kind))
    prompt = torch.randint(0, V, (12,)).tolist()
    opts = SampleOptions(max_new_tokens=20, temperature=0.0, decode="eager")
    cached = generate(model, prompt, opts).tokens[0]
    recomputed = generate(model, prompt, opts, use_cache=False).tokens[0]
    assert cached == recomputed
    triton = GPT.from_state(
        ModelConfig.from_dict({**model.cfg.to_dict(), "attention": "triton"}), model.state_dict()
    )
    idx = torch.randint(0, V, (1, 32))
    with torch.no_grad():
        assert (triton(idx).logits - model(idx).logits).abs().max().item() <= 1e-4


def test_smollm3_greedy_decode_is_transformers_generate_and_its_nope_layers_are_read_not_inverted():
    """64 greedy tokens (our KV cache, NoPE layers unrotated in it) = transformers' generate; the NoPE layers
    read the right way round (no_rope_layers 1 = RoPE) and not ignored: either mistake moves the logits."""
    theirs = hf_model("smollm3")
    model = hf.from_transformers(theirs)
    assert model.cfg.nope_layers == [1, 3]
    prompt = torch.randint(0, V, (12,))
    with torch.no_grad():
        want = theirs.generate(prompt[None], max_new_tokens=64, do_sample=False)[0, 12:].tolist()
    opts = SampleOptions(max_new_tokens=64, temperature=0.0, decode="eager")
    assert generate(model, prompt.tolist(), opts).tokens[0] == want
    idx = torch.randint(0, V, (1, T))
    with torch.no_grad():
        ref = theirs(idx).logits
        for wrong in ([0, 2], None):
            other = GPT.from_state(
                ModelConfig.from_dict({**model.cfg.to_dict(), "nope_layers": wrong}), model.state_dict()
            )
            assert (other(idx).logits - ref).abs().max().item() > 1e-2, wrong


def test_smollm3_nope_layers_from_the_interval_and_refusals():
    d = hf_model("smollm3").config.to_dict()
    del d["no_rope_layers"]
    # without the list: every no_rope_layer_interval-th layer (transformers' SmolLM3Config)
    assert hf.model_config_from_hf(d | {"no_rope_layer_interval": 3}).nope_layers == [2]
    assert hf.model_config_from_hf(d | {"no_rope_layer_interval": 5}).nope_layers is None
    for change, named in (
        (dict(no_rope_layers=[1, 2, 1, 1]), "no_rope_layers"),
        (dict(no_rope_layers=[1, 0]), "no_rope_layers"),
        (dict(no_rope_layer_interval=0), "no_rope_layer_interval"),
        (dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 4), "sliding"),
        (dict(attention_bias=True), "attention_bias"),
    ):
        with pytest.raises(GptkitError, match=named) as e:
            hf.model_config_from_hf(d | change)
        assert "\n" not in str(e.value)


def test_nope_layers_outside_smollm3_are_refused_on_export():
    """Every other family rotates every layer: a NoPE config with Qwen3's QK-norm, or with experts, has no
    architecture."""
    cfg = ModelConfig(**(ONE_ROPE_LAYER | {"n_layers": 2}), bias=False, qk_norm="head", nope_layers=[1])
    with pytest.raises(GptkitError, match=r"SmolLM3ForCausalLM \(.*\) needs qk_norm=None"):
        hf.hf_config(cfg)
    # a mixture (Mixtral's layout) with a NoPE layer
    moe = ModelConfig(**(ONE_ROPE_LAYER | {"n_layers": 2}), bias=False, moe={"n_experts": 2}, nope_layers=[1])
    with pytest.raises(GptkitError, match=r"model.nope_layers=\[1\] .* needs nope_layers=None"):
        hf.hf_config(moe)


@pytest.mark.parametrize("moe", [None, {"n_experts": 2}], ids=["dense", "moe"])
def test_multi_token_prediction_is_refused_on_export_by_the_families_without_it(moe):
    """A family without MTP modules would drop them silently: refused, naming model.mtp."""
    cfg = ModelConfig(**(ONE_ROPE_LAYER | {"n_layers": 2}), bias=False, moe=moe, mtp={"depth": 1})
    with pytest.raises(GptkitError, match=r"model.mtp=.* needs mtp=None"):
        hf.hf_config(cfg)


def test_a_linear_attention_hybrid_is_claimed_by_qwen3_next_alone_and_refused_by_the_field_it_lacks():
    """Llama's layout claimed a hybrid of Gated DeltaNet and softmax layers, then failed on a KeyError; the
    Qwen3-Next family claims it and names what it does not have (its norms are (1 + w): rmsnorm refused)."""
    gdn = {"n_key_heads": 2, "n_value_heads": 2, "key_head_dim": 8, "value_head_dim": 8}
    cfg = ModelConfig(
        **(ONE_ROPE_LAYER | {"n_layers": 2}), bias=False, layer_types=["linear", "global"], gdn=gdn
    )
    with pytest.raises(
        GptkitError, match=r"model.norm=rmsnorm .*Qwen3NextForCausalLM.* needs norm=rmsnorm_unit"
    ):
        hf.hf_config(cfg)
    # every other family refuses model.gdn by name
    from gptkit.hf.families import FAMILIES

    for family in FAMILIES:
        if family.model_type != "qwen3_next" and family.claims(cfg):
            with pytest.raises(GptkitError, match=r"model.gdn=.* needs gdn=None"):
                family.check(cfg)


def test_fused_norm_kernel_on_qk_norm_matches_eager():
    model = hf.from_transformers(hf_model("qwen3"))
    fused = GPT.from_state(
        ModelConfig.from_dict({**model.cfg.to_dict(), "kernels": ["norm", "rope"]}), model.state_dict()
    )
    idx = torch.randint(0, V, (1, 16))
    with torch.no_grad():
        assert (fused(idx).logits - model(idx).logits).abs().max().item() <= 1e-4


def test_post_norm_and_qk_norm_train_a_step():
    """Gradients reach every new weight (q_norm, k_norm, the post-branch norms)."""
    model = hf.from_transformers(hf_model("olmo2")).train()
    idx = torch.randint(0, V, (2, 16))
    model(idx, idx).loss.backward()
    for name in ("blocks.0.attn.q_norm.weight", "blocks.0.attn.k_norm.weight", "blocks.1.mlp_norm.weight"):
        g = dict(model.named_parameters())[name].grad
        assert g is not None and g.abs().sum() > 0, name


# ---- presets and count-params ------------------------------------------------------------------------
def test_phi3_longrope_has_the_logits_of_transformers_under_and_over_its_original_context(tmp_path):
    """Phi-4-mini's LongRoPE imports as model.rope_scaling longrope (its original context config.json's
    top-level key, its factor max_position_embeddings / original): fp32 logits equal transformers' within the
    original context (short factors) and past it (long factors), and the export gives back the same files,
    which transformers reads back to the same logits."""
    theirs = hf_model("phi3-longrope")
    want = {"type": "longrope", "factor": PHI_POSITIONS / LONGROPE_ORIGINAL}
    want |= {"original_max_seq_len": LONGROPE_ORIGINAL, "attention_factor": None}
    want |= {k: LONGROPE[k] for k in ("short_factor", "long_factor")}
    model_cfg, model = hf_import(tmp_path, theirs, dict(rotary_dim=8, rope_scaling=want))
    # the same weights with the long factors left out: equal within the original context, not past it
    short = dict(model_cfg.rope_scaling, long_factor=LONGROPE["short_factor"])
    only_short = GPT.from_state(
        ModelConfig.from_dict({**model_cfg.to_dict(), "rope_scaling": short}), model.state_dict()
    )
    with torch.no_grad():
        for T in (LONGROPE_ORIGINAL, PHI_POSITIONS):
            idx = torch.randint(0, V, (2, T))  # [B, T]
            ref = theirs(idx).logits
            assert (model(idx).logits - ref).abs().max().item() <= 1e-5, T
            differ = (only_short(idx).logits - ref).abs().max().item()
            assert (differ > 1e-2) == (T > LONGROPE_ORIGINAL), T
    hf_export_same_files(tmp_path, "Phi3ForCausalLM", idx, ref)
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["original_max_position_embeddings"] == LONGROPE_ORIGINAL
    for rope in (config["rope_parameters"], config["rope_scaling"]):
        assert rope["rope_type"] == "longrope" and rope["long_factor"] == LONGROPE["long_factor"]


def test_phi3_longrope_over_the_whole_head_exports_as_phi3_not_llama(tmp_path):
    """Phi-3.5-mini turns the whole head with LongRoPE: Llama's generate would keep the keys cached before
    the switch, so it exports as Phi3ForCausalLM, the same files and logits past the original context."""
    theirs = hf_model("phi3-longrope-full")
    model_cfg, model = hf_import(tmp_path, theirs, dict(rotary_dim=None, head_dim=16))
    assert hf.architecture(model_cfg) == "phi3"
    idx = torch.randint(0, V, (2, PHI_POSITIONS))
    with torch.no_grad():
        ref = theirs(idx).logits
        assert (model(idx).logits - ref).abs().max().item() <= 1e-5
    hf_export_same_files(tmp_path, "Phi3ForCausalLM", idx, ref)


def test_longrope_outside_phi3_is_refused_on_import_and_export():
    d = hf_model("qwen3").config.to_dict()
    d["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 16}
    d["rope_parameters"] |= {"long_factor": [2.0] * 16, "original_max_position_embeddings": 16}
    with pytest.raises(GptkitError, match="rope_type='longrope'.*Phi-3's") as e:
        hf.model_config_from_hf(d)
    assert "\n" not in str(e.value)
    moe = ModelConfig(**ONE_ROPE_LAYER, bias=False, moe={"n_experts": 2}, rope_scaling=LONGROPE_CFG)
    with pytest.raises(GptkitError, match="longrope has no faithful transformers architecture"):
        hf.hf_config(moe)


def test_phi3_longrope_greedy_decode_past_the_original_context_is_transformers_generate_on_every_path():
    """64 greedy tokens after 8 cross the original context of 32: transformers' Phi-3 generate then computes
    every key again with the long factors. gptkit's KV-cache generate, the static decode, serve's slot cache
    (beside a shorter prompt that crosses later) and the rollouts give its tokens."""
    theirs = hf_model("phi3-longrope")
    ours = hf.from_transformers(theirs)
    prompt = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])  # [1, 8]
        want = theirs.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            pad_token_id=0,
        )[0, 8:].tolist()
    assert len(want) == 64 and len(set(want)) > 3
    for decode in ("eager", "static"):
        opts = SampleOptions(max_new_tokens=64, temperature=0.0, decode=decode)
        assert generate(ours, prompt, opts).tokens[0] == want, decode
    greedy = SampleOptions(max_new_tokens=64, temperature=0.0)
    assert generate(ours, prompt, greedy, use_cache=False).tokens[0] == want
    served = generate_many(
        ours, [prompt, prompt[:3]], SamplingParams(max_new_tokens=64, temperature=0), max_batch=2
    )
    assert served[0].choices[0].tokens == want
    assert served[1].choices[0].tokens == generate(ours, prompt[:3], greedy, use_cache=False).tokens[0]
    rolled = sample_groups(ours, [prompt], [[1, 2]], RolloutOptions(64, temperature=0), [64])
    assert [c.tokens for c in rolled[0]] == [want, want]


PUBLISHED = {
    "llama3.2-1b": 1_235_814_400,
    "qwen2.5-0.5b": 494_032_768,
    "llama3.1-8b": 8_030_261_248,
    # transformers' own MistralForCausalLM and Gemma3ForCausalLM of the Hub configs
    "mistral-7b": 7_248_023_552,
    "gemma3-1b": 999_885_952,
    # transformers' SmolLM3ForCausalLM of SmolLM3Config's defaults (its docstring's SmolLM3-3B)
    "smollm3-3b": 3_075_098_624,
    # transformers' Phi3ForCausalLM of microsoft/phi-4's config.json, on the meta device
    "phi-4": 14_659_507_200,
    # and of microsoft/Phi-4-mini-instruct's
    "phi-4-mini": 3_836_021_760,
}


def preset(name: str) -> ModelConfig:
    return ModelConfig.from_dict(yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text()))


@pytest.mark.parametrize(
    "name",
    [
        "llama3.2-1b",
        "llama3.1-8b",
        "qwen2.5-0.5b",
        "qwen3-0.6b",
        "olmo2-1b",
        "olmo3-7b",
        "olmo3-tiny",
        "mistral-7b",
        "mistral-7b-v0.1",
        "gemma3-1b",
        "gemma3-tiny",
        "smollm3-3b",
        "smollm3-tiny",
        "phi-4",
        "phi-4-mini",
        "phi-tiny",
    ],
)
def test_presets_count_exactly_and_equal_their_transformers_architecture(name):
    cfg = preset(name)
    n = acc.count_params(cfg).total
    if name in PUBLISHED:
        assert n == PUBLISHED[name]
    with torch.device("meta"):
        assert GPT(cfg).num_parameters() == n
        d = hf.hf_config(cfg)
        config = getattr(transformers, hf.CONFIG_CLASSES[d.pop("model_type")])(
            **{k: v for k, v in d.items() if k not in ("architectures", "dtype")}
        )
        theirs = getattr(transformers, hf.ARCHITECTURES[hf.architecture(cfg)])(config)
    assert sum(p.numel() for p in theirs.parameters()) == n
    assert hf.model_config_from_hf(config.to_dict(), name=cfg.name) == cfg


@pytest.mark.parametrize("name, total", [("qwen2.5-0.5b", "494,032,768"), ("mistral-7b", "7,248,023,552")])
def test_count_params_cli_prints_the_exact_total(capsys, name, total):
    assert cli("count-params", f"model={name}") == 0
    assert total in capsys.readouterr().out


@pytest.mark.parametrize(
    "override, named",
    [
        ("model.rope_scaling.short_factor=[1.0,2.0]", "short_factor has 2 numbers; it needs 48"),
        ("model.rope_scaling.long_factor=[1.0,-2.0]", "long_factor must be a list of positive numbers"),
    ],
)
def test_phi_4_mini_factor_lists_of_the_wrong_shape_are_one_line_exit_2(capsys, override, named):
    code, _, err = run_main(capsys, "count-params", "model=phi-4-mini", override)
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, named",
    [
        (dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}), "rope_type"),
        (dict(use_sliding_window=True, sliding_window=8, layer_types=["chunked_attention"] * 2), "layer_"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_unsupported_hf_configs_are_refused_by_name(change, named):
    d = hf_model("qwen3").config.to_dict() | change
    with pytest.raises(GptkitError, match=named):
        hf.model_config_from_hf(d)


@pytest.mark.parametrize(
    "rope, named",
    [
        # LongRoPE's factor lists: one positive number per pair of the 4 pairs turning
        ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 4}, "has 3 numbers"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0, 0.0, 1, 1]}, "positive"),
        ({"type": "su", "short_factor": [1.0] * 4}, "needs long_factor"),
        # Phi3Config takes plain RoPE or LongRoPE only
        ({"rope_type": "linear", "factor": 2.0}, "rope_type='linear'"),
        # 0.3125 x 16 = 5 features: RoPE turns pairs
        ({"rope_type": "default", "partial_rotary_factor": 0.3125}, "partial_rotary_factor=0.3125"),
        ({"rope_type": "default", "partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5"),
    ],
)
def test_phi3_configs_gptkit_cannot_represent_are_refused_in_one_line(rope, named):
    d = hf_model("phi3").config.to_dict()
    rope = {"rope_theta": 10000.0, "original_max_position_embeddings": 48} | rope
    # an older config.json: its rope_scaling first, as Phi3Config reads it
    d["rope_parameters" if "rope_type" in rope else "rope_scaling"] = rope
    d.pop("partial_rotary_factor", None)
    with pytest.raises(GptkitError, match=named) as e:
        hf.model_config_from_hf(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("old", ["su", "yarn"])
def test_phi3_reads_older_su_and_yarn_as_longrope_with_its_top_level_original_context(old):
    d = hf_model("phi3").config.to_dict() | {"original_max_position_embeddings": 24}
    d["rope_scaling"] = {"type": old, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    d.pop("rope_parameters", None)
    s = hf.model_config_from_hf(d).rope_scaling
    assert s["type"] == "longrope" and s["original_max_seq_len"] == 24 and s["factor"] == PHI_POSITIONS / 24


@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
        (dict(qkv_bias=True), "qkv_bias"),
        (dict(sliding_window=8, layer_types=["local", "global"]), "every layer"),
        # 30 / 44 is no float transformers turns back into 30 features
        (dict(head_dim=44, rotary_dim=30), "rotary_dim=30 of head_dim=44"),
    ],
)
def test_partial_rope_models_phi3_cannot_hold_are_refused_on_export(kw, named):
    cfg = ModelConfig(**(ONE_ROPE_LAYER | dict(n_layers=2, bias=False, rotary_dim=4) | kw))
    with pytest.raises(GptkitError, match=named) as e:
        hf.hf_config(cfg)
    assert "\n" not in str(e.value)


def test_phi3_lora_adapters_export_merged_only():
    from gptkit.hf.peft import peft_adapters

    cfg = ModelConfig(**(ONE_ROPE_LAYER | dict(bias=False, rotary_dim=4)))
    with pytest.raises(GptkitError, match="adapters=false"):
        peft_adapters({}, cfg, {"rank": 2, "alpha": 4, "dropout": 0.0, "targets": ["q"]})


# a one-layer model with RoPE, SwiGLU and RMSNorm
ONE_ROPE_LAYER = dict(
    vocab_size=V, n_layers=1, n_heads=4, d_model=32, position="rope", mlp="swiglu", norm="rmsnorm"
)
LONGROPE_CFG = {
    "type": "longrope",
    "factor": 4.0,
    "original_max_seq_len": 16,
    "short_factor": [1.0] * 4,
    "long_factor": [2.0] * 4,
}


@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(rope_scaling={"type": "llama3", "factor": 8.0}), "missing: high_freq_factor"),
        (dict(rope_scaling={"type": "yarn"}), "rope_scaling"),
        # LongRoPE: one positive factor per pair of features turning (head_dim 8: 4 pairs)
        (
            dict(rope_scaling=LONGROPE_CFG | {"short_factor": [1.0] * 3}),
            "short_factor has 3 numbers; it needs 4",
        ),
        (
            dict(rope_scaling=LONGROPE_CFG | {"long_factor": [1.0, -2.0, 1.0, 1.0]}),
            "long_factor must be a list",
        ),
        (dict(rope_scaling=LONGROPE_CFG | {"long_factor": 2.0}), "long_factor must be a list of positive"),
        (dict(rope_scaling=LONGROPE_CFG | {"long_factor": []}), "long_factor must be a list of positive"),
        (
            dict(rope_scaling={k: v for k, v in LONGROPE_CFG.items() if k != "short_factor"}),
            "missing: short_f",
        ),
        (dict(qk_norm="layer"), "qk_norm"),
        (dict(norm_placement="middle"), "norm_placement"),
        (dict(qkv_bias="yes"), "qkv_bias"),
        (dict(nope_layers=[1]), "nope_layers holds 1: each must be a layer index from 0 to 0"),
        (dict(nope_layers=[0, 0]), "names a layer twice"),
        (dict(nope_layers="0"), "nope_layers"),
        # partial RoPE: an even width within the head (8), with RoPE, not with the whole-head fused kernel
        (dict(rotary_dim=3), "rotary_dim=3 must be a positive even"),
        (dict(rotary_dim=0), "rotary_dim=0 must be a positive even"),
        (dict(rotary_dim=10), "rotary_dim=10 exceeds head_dim=8"),
        (dict(rotary_dim=4, position="learned"), "rotary_dim=4 needs model.position=rope"),
        (dict(rotary_dim=4, kernels=["rope"]), r"kernels=\[rope\] turns whole heads"),
    ],
)
def test_bad_variant_fields_are_one_line_config_errors(kw, named):
    with pytest.raises(ConfigError, match=named) as e:
        ModelConfig(**(ONE_ROPE_LAYER | kw))
    assert "\n" not in str(e.value)


def test_nope_layers_need_rope():
    with pytest.raises(ConfigError, match="nope_layers needs model.position=rope"):
        ModelConfig(**(ONE_ROPE_LAYER | {"position": "learned"}), nope_layers=[0])
    assert ModelConfig(**ONE_ROPE_LAYER, nope_layers=[]).nope_layers is None


def test_variants_without_a_transformers_architecture_are_refused_on_export():
    cfg = ModelConfig(**ONE_ROPE_LAYER, bias=False, qk_norm="head", norm_placement="post")
    with pytest.raises(GptkitError, match="norm_placement"):
        hf.hf_config(cfg)


def test_train_init_from_hf_fine_tunes_phi3_and_exports_it_as_phi3(tmp_path, monkeypatch):
    """init_from=hf:<a Phi-3 folder> trains two steps with partial RoPE; the run exports as Phi3ForCausalLM
    (fused qkv_proj, gate_up_proj) with the logits of the trained run."""
    import json
    import sys

    from conftest import shakespeare

    from gptkit.runs import load_model

    # the Hydra app sets sys.argv
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])
    hf_model("phi3").save_pretrained(tmp_path / "hf")
    (tmp_path / "c.txt").write_text(shakespeare(20_000).lower())
    args = ["train", f"init_from=hf:{tmp_path / 'hf'}", "tokenizer=char", "data=files"]
    args += [f"data.paths=[{tmp_path / 'c.txt'}]", "trainer.batch_size=2", "trainer.max_steps=2"]
    args += ["trainer.val_windows=2", "trainer.progress=false", f"runs_dir={tmp_path / 'runs'}", "name=ft"]
    assert cli(*args) == 0
    assert cli("export", f"run={tmp_path / 'runs/ft'}", f"out={tmp_path / 'out'}") == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["partial_rotary_factor"] == 0.5
    *_, model = load_model(tmp_path / "runs/ft")
    assert model.cfg.rotary_dim == 8
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    idx = torch.randint(0, V, (1, 32))
    with torch.no_grad():
        assert (theirs(idx).logits - model(idx).logits).abs().max().item() <= 1e-5
